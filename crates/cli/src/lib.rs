//! The pieces behind the `tandem` binary: model pull, model resolution, single-model generation and
//! the engine benchmark. `main.rs` only parses flags and prints.

pub mod bench;
pub mod generate;
pub mod latency;
pub mod live;
pub mod models;
pub mod pull;
pub mod speculate;
pub mod stats;
