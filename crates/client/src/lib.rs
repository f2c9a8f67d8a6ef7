//! Tandem's client: one generation of one prompt in every mode, with its timings — on this
//! machine alone ([`generate`]: the draft or the target), streamed from a verifier (cloud-only
//! over gRPC), or speculated against one ([`speculate`]: sync and async over a real `tandem.v1`
//! session, to a running verifier or one started in this process) — and the demo's view of
//! tentative, accepted and corrected tokens ([`live`]). [`netem`] emulates a network link in
//! front of a verifier (`tandem netem`, the benchmarks, the tests). `tandem generate` and `tandem
//! demo` are this crate; the benchmarks run it many times.

pub mod commands;
pub mod generate;
pub mod live;
pub mod netem;
pub mod speculate;

pub use tandem_proto::runtime;

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
