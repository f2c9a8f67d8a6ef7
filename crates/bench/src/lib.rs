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
pub mod hostile;
pub mod latency;
pub mod live;
pub mod load;
pub mod model_report;
pub mod netem;
pub mod netns;
pub mod paper;
pub mod plots;
pub mod quant_study;
pub mod serve_bench;
pub mod soak;
pub mod speculate;
pub mod synthetic;

/// The small tokio runtime every network piece runs on (gRPC clients and servers, the emulated
/// link): one worker, so it never competes with an engine for a core.
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

/// How a run's tokens are produced: one name per mode, in every row, table, legend and flag.
/// JSON and tables write `local`, `edge-only`, `cloud-only`, `sync`, `async`; `tandem generate
/// --mode` takes `local`, `edge`, `cloud`, `sync`, `async`.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, clap::ValueEnum,
)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// One model alone on this machine.
    Local,
    /// The draft alone, on the edge.
    #[value(name = "edge", alias = "edge-only")]
    EdgeOnly,
    /// The target streams every token (no draft).
    #[value(name = "cloud", alias = "cloud-only")]
    CloudOnly,
    /// Speculation with one block in flight.
    Sync,
    /// Pipelined speculation: the edge drafts while blocks are on the wire.
    Async,
    /// Pipelined speculation whose γ and depth the edge's policy re-plans as it measures
    /// (`tandem generate --mode async --auto`).
    #[value(skip)]
    AsyncAuto,
    /// Pipelined speculation sending token trees (the draft's second choices where unsure).
    #[value(skip)]
    AsyncTree,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Local => "local",
            Mode::EdgeOnly => "edge-only",
            Mode::CloudOnly => "cloud-only",
            Mode::Sync => "sync",
            Mode::Async => "async",
            Mode::AsyncAuto => "async-auto",
            Mode::AsyncTree => "async-tree",
        }
    }

    /// Speculation with `depth` blocks in flight: `sync` at 1, `async` past it.
    pub fn of_depth(depth: usize) -> Self {
        if depth <= 1 {
            Mode::Sync
        } else {
            Mode::Async
        }
    }
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

pub fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
}
