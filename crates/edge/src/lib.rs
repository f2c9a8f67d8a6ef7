//! Tandem's edge runtime: the draft model drives the edge's session ([`EdgeSession`], the IO-free
//! core in `tandem-spec`), blocks go to the verifier over a [`Link`] (gRPC: [`grpc`]), verdicts
//! come back, and only verified tokens reach the user.
//!
//! The runtime never waits for the network while it may draft: verdicts are applied as soon as they
//! have arrived, and the edge blocks on the link only when the pipeline is full (`depth` blocks in
//! flight). `depth = 1` is synchronous speculation.

pub mod drafter;
pub mod grpc;

use std::time::Instant;

use serde::Serialize;
use tandem_engine::{Engine, EngineError};
use tandem_spec::sampling::SamplingParams;
use tandem_spec::verify::VerifyRule;
use tandem_spec::{
    Block, EdgeSession, Grown, Incoming, Measured, Next, Output, PipelineStats, SessionConfig,
    SpecError,
};

pub use drafter::{Drafter, EngineDrafter, Proposal};

#[derive(Debug, thiserror::Error)]
pub enum EdgeError {
    #[error("the verifier link is closed")]
    LinkClosed,
    #[error("the verifier refused: {0}")]
    Refused(String),
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

/// What one speculation session of the edge runs: the shape it wants and may use (the edge core's
/// [`SessionConfig`]) and how drafts are judged.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct SpecConfig {
    pub session: SessionConfig,
    pub rule: VerifyRule,
    pub params: SamplingParams,
    /// Size of the sparse draft distribution sent for rejection sampling.
    pub q_top_k: usize,
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
}

pub use drafter::prefill_draft;

/// Show the user the tokens `fresh` committed (then forget them) and the tail as it stands.
fn show(
    on_update: &mut impl FnMut(Update<'_>),
    fresh: &mut Vec<u32>,
    tentative: &[u32],
    correction: Option<(u32, u32)>,
) {
    on_update(Update {
        committed: fresh,
        tentative,
        correction,
    });
    fresh.clear();
}

/// Generate with speculation, drafting with the model in `draft`: `prompt` is already open on the
/// verifier behind `link`, which answered with the target's `first` token. The draft's sequence
/// holds nothing or exactly `prompt` (see [`prefill_draft`]).
#[allow(clippy::too_many_arguments)]
pub fn run(
    draft: &mut Engine,
    eog: Vec<u32>,
    prompt: &[u32],
    first: u32,
    cfg: &SpecConfig,
    link: &mut dyn Link,
    start: Instant,
    on_update: impl FnMut(Update<'_>),
) -> Result<SpecReport, EdgeError> {
    let mut d = EngineDrafter::new(draft, prompt, cfg);
    run_with(&mut d, eog, prompt, first, cfg, link, start, on_update)
}

/// [`run`] with any [`Drafter`] (a model, or the load generator's synthetic edge): the driver of
/// the session's [`EdgeSession`] on the wall clock (`start` is the request's time).
#[allow(clippy::too_many_arguments)]
pub fn run_with(
    draft: &mut dyn Drafter,
    eog: Vec<u32>,
    prompt: &[u32],
    first: u32,
    cfg: &SpecConfig,
    link: &mut dyn Link,
    start: Instant,
    mut on_update: impl FnMut(Update<'_>),
) -> Result<SpecReport, EdgeError> {
    let now = || start.elapsed().as_secs_f64() * 1e3;
    let (mut es, first_out) = EdgeSession::new(now(), prompt.to_vec(), first, cfg.session, eog)?;
    let mut commit_ms = Vec::new();
    let mut draft_forwards = 0;
    let apply = |outs: Vec<Output>,
                 draft: &mut dyn Drafter,
                 link: &mut dyn Link,
                 commit_ms: &mut Vec<f64>,
                 fresh: &mut Vec<u32>|
     -> Result<(), EdgeError> {
        for o in outs {
            match o {
                Output::Send(b) => {
                    tracing::debug!(
                        t = start.elapsed().as_secs_f64() * 1e3,
                        epoch = b.epoch,
                        start = b.start_pos,
                        len = b.tokens.len(),
                        "edge sends a block"
                    );
                    link.send(b)?
                }
                Output::Rollback { to } => draft.rollback(to)?,
                Output::Ack { committed } => link.ack(committed)?,
                Output::Commit { tokens, .. } => {
                    let t = start.elapsed().as_secs_f64() * 1e3;
                    commit_ms.extend(std::iter::repeat_n(t, tokens.len()));
                    fresh.extend(tokens);
                }
            }
        }
        Ok(())
    };
    // The speculative tail as it stands: drafted, not yet verified.
    fn tail(es: &EdgeSession) -> &[u32] {
        let p = es.pipeline();
        &p.tokens()[p.committed_len()..]
    }
    let mut fresh = Vec::new();
    apply(first_out, draft, link, &mut commit_ms, &mut fresh)?;
    show(&mut on_update, &mut fresh, &[], None);
    loop {
        // One step; a lost connection anywhere in it is recovered below. The edge's own work
        // per verdict is a step's time less its waits and its forwards.
        let step_start = Instant::now();
        let (mut idle_ms, mut forward_ms) = (0.0, 0.0);
        let step = (|| -> Result<bool, EdgeError> {
            let mut arrived = Vec::new();
            while let Some(v) = link.recv(false)? {
                arrived.push(v);
            }
            if arrived.is_empty() && es.next() == Next::Wait {
                let w = Instant::now();
                let v = link.recv(true);
                // A wait that ends in a lost connection is a wait too.
                idle_ms += w.elapsed().as_secs_f64() * 1e3;
                tracing::debug!(
                    t = now(),
                    waited = w.elapsed().as_secs_f64() * 1e3,
                    "edge waited"
                );
                arrived.push(v?.ok_or(EdgeError::LinkClosed)?);
            }
            for m in arrived {
                tracing::debug!(
                    t = now(),
                    msg = ?m,
                    committed = es.pipeline().committed_len(),
                    drafted = es.pipeline().tokens().len(),
                    "edge receives"
                );
                let r = es.on_message(now(), m)?;
                apply(r.outputs, draft, link, &mut commit_ms, &mut fresh)?;
                show(&mut on_update, &mut fresh, tail(&es), r.correction);
            }
            match es.next() {
                Next::Done => return Ok(true),
                Next::Wait => {}
                Next::Draft => {
                    // One forward grows every leaf of the draft tree (one leaf when linear).
                    let t0 = Instant::now();
                    let f = es.frontier();
                    let props = draft.grow(&es.pipeline().tokens()[..f.base], &f.leaves)?;
                    draft_forwards += 1;
                    let ms = t0.elapsed().as_secs_f64() * 1e3;
                    forward_ms += ms;
                    let prefill = props.first().is_some_and(|p| p.prefill);
                    let grown = props
                        .into_iter()
                        .map(|p| Grown {
                            token: p.token,
                            q: p.q,
                            hedge: p.hedge,
                        })
                        .collect();
                    let outs = es.on_grown(now(), grown, ms, prefill)?;
                    apply(outs, draft, link, &mut commit_ms, &mut fresh)?;
                    show(&mut on_update, &mut fresh, tail(&es), None);
                }
            }
            Ok(false)
        })();
        es.on_edge_work(step_start.elapsed().as_secs_f64() * 1e3 - idle_ms - forward_ms);
        match step {
            Ok(true) => break,
            Ok(false) => {}
            Err(EdgeError::LinkClosed) => {
                // Keep what is verified, drop the rest, and reopen over the committed history.
                let outs = es.on_connection_lost();
                apply(outs, draft, link, &mut commit_ms, &mut fresh)?;
                let mut attempt = 0;
                let first = loop {
                    let Some(r) = es.reopen(attempt) else {
                        return Err(EdgeError::LinkClosed);
                    };
                    std::thread::sleep(std::time::Duration::from_millis(r.after_ms));
                    match link.reopen(es.committed(), r.max_tokens) {
                        Ok(t) => break t,
                        Err(EdgeError::LinkClosed | EdgeError::Refused(_)) => attempt += 1,
                        Err(e) => return Err(e),
                    }
                };
                let outs = es.on_reopened(first);
                apply(outs, draft, link, &mut commit_ms, &mut fresh)?;
                show(&mut on_update, &mut fresh, &[], None);
                if es.next() == Next::Done {
                    break;
                }
            }
            Err(e) => return Err(e),
        }
    }
    draft.rollback(0)?;
    let p = es.pipeline();
    Ok(SpecReport {
        output_ids: p.output().to_vec(),
        commit_ms,
        stats: *p.stats(),
        draft_forwards,
        measured: es.measured(),
    })
}
