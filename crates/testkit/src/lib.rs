//! Test-only support for Tandem's integration tests (`publish = false`; no product crate depends
//! on it). It holds what the tests of several crates share and what needs no server of Tandem's:
//!
//! - [`model`]: SmolLM2-135M-Instruct, pulled and its draft made on first use (through
//!   `tandem_models`, into the model store `tandem pull` uses), loaded once per test binary, and
//!   a reference greedy decoder on the engine;
//! - [`loopback`]: a server run on a fresh loopback port in a thread of its own, and the
//!   one-worker runtime the tests' clients run on;
//! - [`session`]: a verifier session driven by hand over the raw gRPC stream, message by message;
//! - [`cut`]: a relay that drops the network after the server's k-th gRPC message (an event, not
//!   a time);
//! - [`slow_head`]: a client that never finishes its request head, beside a whole request.
//!
//! It links only crates below the ones whose tests use it (`engine`, `models`, `spec`, `proto`):
//! the verifier server's tests (`crates/cloud/tests`) and the edge's depend on it, and a
//! dev-dependency that linked `tandem-cloud` or `tandem-edge` would close a cycle
//! (`crates/cli/tests/architecture.rs` refuses one). Starting a verifier in-process needs
//! `tandem-cloud`, so that helper lives in `crates/cloud/tests/common`, which the edge's and the
//! binary's tests include by path.

pub mod cut;
pub mod loopback;
pub mod model;
pub mod session;
pub mod slow_head;

pub use cut::*;
pub use loopback::*;
pub use model::*;
pub use session::*;
pub use slow_head::*;
