//! Tandem's benchmarks and measured runs. Each benchmark prints tables, writes JSON (and plots),
//! and compares variants side by side in one run; none is a timed test.
//!
//! - Runs of one prompt in every mode, with their timings: [`generate`] (edge-only on the draft or
//!   the target, cloud-only over gRPC), [`speculate`] (sync and async over a real `tandem.v1`
//!   session, to a running verifier or one started in this process), [`live`] (the demo's view
//!   of tentative, accepted and corrected tokens).
//! - [`engine_bench`] (`bench engine`: decode, chunks, ragged batches, beside llama.cpp),
//!   [`latency`] (`bench latency`: every mode over an emulated link), [`load`] (`bench load`:
//!   the verifier under many synthetic edges, beside cloud-only), [`paper`] (`bench paper`: the
//!   paper's evaluation with the simulator and the model beside every row), [`quant_study`]
//!   (`bench quant`: the drafts one could make from the target), [`model_report`] (`tandem plan`:
//!   the analytic model's report).
//! - What they stand on: [`netem`] (a TCP proxy that emulates a link), [`synthetic`] (edges
//!   that draft at a set α and speed), [`cloudproc`] (a `tandem cloud serve` process), [`plots`].

pub mod cloudproc;
pub mod engine_bench;
pub mod generate;
pub mod latency;
pub mod live;
pub mod load;
pub mod model_report;
pub mod netem;
pub mod paper;
pub mod plots;
pub mod quant_study;
pub mod speculate;
pub mod synthetic;

/// The small tokio runtime every network piece runs on (gRPC clients and servers, the emulated
/// link): one worker, so it never competes with an engine for a core.
pub fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
}
