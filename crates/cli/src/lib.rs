//! The pieces behind the `tandem` binary: model pull, model resolution, single-model generation and
//! the engine benchmark. `main.rs` only parses flags and prints.

pub mod bench;
pub mod cloudproc;
pub mod generate;
pub mod latency;
pub mod live;
pub mod load;
pub mod models;
pub mod paper;
pub mod plan;
pub mod plots;
pub mod pull;
pub mod quant_study;
pub mod speculate;

/// The small tokio runtime every network piece of the CLI runs on (gRPC clients and servers, the
/// emulated link): one worker, so it never competes with an engine for a core.
pub fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
}
