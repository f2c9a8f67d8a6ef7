//! Tandem's edge runtime: the draft model drives the edge's session ([`EdgeSession`], the IO-free
//! core in `tandem-spec`), blocks go to the verifier over a [`Link`] (gRPC: [`grpc`]), verdicts
//! come back, and only verified tokens reach the user.
//!
//! The runtime never waits for the network while it may draft: verdicts are applied as soon as they
//! have arrived, and the edge blocks on the link only when the pipeline is full (`depth` blocks in
//! flight). `depth = 1` is synchronous speculation.

pub mod commands;
pub mod drafter;
pub mod driver;
pub mod grpc;
pub mod serve;
pub mod synthetic;

use std::time::Instant;

use serde::Serialize;
use tandem_engine::{Engine, EngineError};
use tandem_spec::sampling::SamplingParams;
use tandem_spec::verify::VerifyRule;
use tandem_spec::{Block, Incoming, Measured, PipelineStats, SessionConfig, SpecError};

pub use drafter::{Drafter, EngineDrafter, Proposal};
pub use driver::{Driver, Want};

#[derive(Debug, thiserror::Error)]
pub enum EdgeError {
    #[error("the verifier link is closed")]
    LinkClosed,
    #[error("the verifier refused: {0}")]
    Refused(String),
    /// No verifier answered: nothing accepts connections at the address, the connection
    /// failed, or the verifier is restarting or draining (`UNAVAILABLE`). Worth trying again.
    #[error("no verifier is reachable: {0}")]
    Unreachable(String),
    /// The session's `Open` was refused or never answered (a link that drafts before `Opened`:
    /// [`grpc::GrpcLink::start`]): nothing to reopen.
    #[error("opening the session: {0}")]
    NotOpened(String),
    /// A refusal with the verifier's hint when to try again (`retry-after-ms`).
    #[error("the verifier refused: {message} (retry after {retry_after_ms} ms)")]
    Busy {
        message: String,
        retry_after_ms: u64,
    },
    #[error(transparent)]
    Spec(#[from] SpecError),
    #[error(transparent)]
    Engine(#[from] EngineError),
}

/// The edge's side of a connection to a verifier session.
pub trait Link {
    fn send(&mut self, block: Block) -> Result<(), EdgeError>;
    /// Tell the verifier that the first `committed` tokens have arrived (flow control: it
    /// commits at most [`tandem_spec::FLOW_WINDOW`] past the last ack).
    fn ack(&mut self, committed: usize) -> Result<(), EdgeError>;
    /// The next message: waits for one when `wait`, else returns `None` if none has arrived.
    fn recv(&mut self, wait: bool) -> Result<Option<Incoming>, EdgeError>;
    /// After [`EdgeError::LinkClosed`]: open a new session whose prompt is the committed `history`
    /// (for at most `max_tokens` more), returning the target's token after it. A link that cannot
    /// reconnect says `LinkClosed`.
    fn reopen(&mut self, _history: &[u32], _max_tokens: usize) -> Result<u32, EdgeError> {
        Err(EdgeError::LinkClosed)
    }
}

impl<T: Link + ?Sized> Link for &mut T {
    fn send(&mut self, block: Block) -> Result<(), EdgeError> {
        (**self).send(block)
    }
    fn ack(&mut self, committed: usize) -> Result<(), EdgeError> {
        (**self).ack(committed)
    }
    fn recv(&mut self, wait: bool) -> Result<Option<Incoming>, EdgeError> {
        (**self).recv(wait)
    }
    fn reopen(&mut self, history: &[u32], max_tokens: usize) -> Result<u32, EdgeError> {
        (**self).reopen(history, max_tokens)
    }
}

/// What one speculation session of the edge runs: the shape it wants and may use (the edge core's
/// [`SessionConfig`]) and how drafts are judged.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct SpecConfig {
    pub session: SessionConfig,
    pub rule: VerifyRule,
    pub params: SamplingParams,
    /// Size of the sparse draft distribution sent for rejection sampling.
    pub q_top_k: usize,
    /// Ask the verifier to draft for itself while it decodes the session alone (protocol 7).
    pub self_draft: bool,
    /// Copy from the session's text where it matches, without the draft model
    /// ([`drafter::Copier`]).
    pub suffix: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct SpecReport {
    pub output_ids: Vec<u32>,
    /// Milliseconds from `start` (the request) to the commit of each output token.
    pub commit_ms: Vec<f64>,
    pub stats: PipelineStats,
    pub draft_forwards: usize,
    pub measured: Measured,
}

/// What the user can be shown after each step of the edge.
#[derive(Debug, Clone, Copy)]
pub struct Update<'a> {
    /// Tokens verified by this step (final: show them as the answer).
    pub committed: &'a [u32],
    /// The whole speculative tail after this step: drafted, not yet verified (tentative).
    pub tentative: &'a [u32],
    /// The target rejected the draft's token here: `(draft's token, target's token)`.
    pub correction: Option<(u32, u32)>,
    /// The session's counts so far (α live).
    pub stats: &'a tandem_spec::PipelineStats,
}

pub use drafter::prefill_draft;

/// Generate with speculation, drafting with the model in `draft`: `prompt` is already open on the
/// verifier behind `link`, which answered with the target's `first` token. The draft's sequence
/// holds nothing or exactly `prompt` (see [`prefill_draft`]).
#[allow(clippy::too_many_arguments)]
pub fn run(
    draft: &mut Engine,
    eog: Vec<u32>,
    prompt: &[u32],
    opened: Option<tandem_spec::Opened>,
    cfg: &SpecConfig,
    link: &mut dyn Link,
    start: Instant,
    on_update: impl FnMut(Update<'_>),
) -> Result<SpecReport, EdgeError> {
    let mut d = EngineDrafter::new(draft, prompt, cfg);
    run_with(&mut d, eog, prompt, opened, cfg, link, start, on_update)
}

/// [`run`] with any [`Drafter`] (a model, or the load generator's synthetic edge): one
/// [`Driver`] on the wall clock (`start` is the request's time), its draft steps run one by one.
#[allow(clippy::too_many_arguments)]
pub fn run_with(
    draft: &mut dyn Drafter,
    eog: Vec<u32>,
    prompt: &[u32],
    opened: Option<tandem_spec::Opened>,
    cfg: &SpecConfig,
    link: &mut dyn Link,
    start: Instant,
    mut on_update: impl FnMut(Update<'_>),
) -> Result<SpecReport, EdgeError> {
    let mut d = Driver::new(
        prompt,
        opened,
        cfg.session,
        eog,
        link,
        start,
        &mut on_update,
    )?;
    loop {
        // One step; a lost connection anywhere in it is recovered below. The edge's own work
        // per verdict is a step's time less its waits and its forwards.
        let step_start = Instant::now();
        let (mut idle_ms, mut forward_ms) = (0.0, 0.0);
        let step = (|| -> Result<bool, EdgeError> {
            let (want, idle) = d.poll(true, &mut on_update)?;
            idle_ms = idle;
            match want {
                Want::Done => return Ok(true),
                Want::Wait => {}
                Want::Draft(f) => {
                    // One forward grows every leaf of the draft tree (one leaf when linear).
                    let t0 = Instant::now();
                    draft.committed(d.session().committed());
                    let props =
                        draft.grow(&d.session().pipeline().tokens()[..f.base], &f.leaves)?;
                    let ms = t0.elapsed().as_secs_f64() * 1e3;
                    forward_ms = ms;
                    d.grown(props, ms, &mut on_update)?;
                }
            }
            Ok(false)
        })();
        d.on_edge_work(step_start.elapsed().as_secs_f64() * 1e3 - idle_ms - forward_ms);
        match step {
            Ok(true) => break,
            Ok(false) => {}
            Err(EdgeError::LinkClosed) => {
                if d.recover(&mut on_update)? {
                    break;
                }
            }
            Err(e) => return Err(e),
        }
    }
    draft.rollback(0)?;
    Ok(d.report())
}
