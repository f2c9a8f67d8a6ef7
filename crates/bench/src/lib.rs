//! Tandem's benchmarks and measured runs. Each benchmark prints tables, writes JSON (and plots),
//! and compares variants side by side in one run; none is a timed test.
//!
//! One run of one prompt in every mode, with its timings, is the client's
//! (`tandem_client::generate`, `tandem_client::speculate`): the benchmarks run it many times.
//!
//! - [`engine_bench`] (`bench engine`: decode, chunks, ragged batches, beside llama.cpp),
//!   [`latency`] (`bench latency`: every mode over an emulated link), [`load`] (`bench load`:
//!   the verifier under many synthetic edges, beside cloud-only), [`paper`] (`bench paper`: the
//!   paper's evaluation with the simulator and the model beside every row), [`quant_study`]
//!   (`bench quant`: the drafts one could make from the target), [`rules_study`] (`bench rules`:
//!   how often each verify rule commits a sampled draft), [`model_report`] (`tandem plan`:
//!   the analytic model's report).
//! - What they stand on: [`cloudproc`] (a `tandem cloud serve` process), [`netns`] (a kernel
//!   link between network namespaces), [`plots`]; the client's emulated link
//!   (`tandem_client::netem`) and the edge's synthetic drafts (`tandem_edge::synthetic`).

pub mod chat_bench;
pub mod cloudproc;
pub mod commands;
pub mod engine_bench;
pub mod hostile;
pub mod latency;
pub mod load;
pub mod model_report;
pub mod netns;
pub mod paper;
pub mod plots;
pub mod quant_study;
pub mod rules_study;
pub mod serve_bench;
pub mod soak;

/// A `--…-pct` flag read as a fraction (10 → 0.1), refused unless within 0..100.
pub fn percent(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a percentage"))?;
    if !(0.0..100.0).contains(&v) {
        return Err(format!("{v} is not a percentage within 0..100"));
    }
    Ok(v / 100.0)
}
