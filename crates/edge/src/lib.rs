//! Tandem's edge runtime: the draft engine drives the speculation [`Pipeline`], blocks go to the
//! verifier over a [`Link`], verdicts come back, and only verified tokens reach the user.
//!
//! The runtime never waits for the network while it may draft: verdicts are applied as soon as they
//! have arrived, and the edge blocks on the link only when the pipeline is full (`depth` blocks in
//! flight). `depth = 1` is synchronous speculation.

pub mod drafter;
pub mod grpc;
pub mod netem;

use std::collections::HashMap;
use std::time::Instant;

use serde::Serialize;
use tandem_engine::{Engine, EngineError, SamplingParams};
use tandem_spec::policy::{recommend, Costs, Estimator};
use tandem_spec::verify::VerifyRule;
use tandem_spec::{
    Block, Decoded, Next, Output, Pipeline, PipelineConfig, PipelineStats, SpecError, Verdict,
};

pub use drafter::{Drafter, EngineDrafter, Proposal, SyntheticDrafter};

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

/// What the verifier sends a session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Incoming {
    Verdict(Verdict),
    /// A token it decoded itself, having taken the session over.
    Decoded(Decoded),
}

/// The edge's side of a connection to a verifier session.
pub trait Link {
    fn send(&mut self, block: Block) -> Result<(), EdgeError>;
    /// The next message: waits for one when `wait`, else returns `None` if none has arrived.
    fn recv(&mut self, wait: bool) -> Result<Option<Incoming>, EdgeError>;
    /// After [`EdgeError::LinkClosed`]: open a new session whose prompt is the committed `history`
    /// (for at most `max_tokens` more), returning the target's token after it. A link that cannot
    /// reconnect says `LinkClosed`.
    fn reopen(&mut self, _history: &[u32], _max_tokens: usize) -> Result<u32, EdgeError> {
        Err(EdgeError::LinkClosed)
    }
}

/// Attempts to reopen a session after the connection is lost, 100 ms apart, doubling.
const REOPEN_ATTEMPTS: u32 = 4;

#[derive(Debug, Clone, Copy, Serialize)]
pub struct SpecConfig {
    pub draft_len: usize,
    pub depth: usize,
    pub max_new_tokens: usize,
    pub rule: VerifyRule,
    pub params: SamplingParams,
    /// Size of the sparse draft distribution sent for rejection sampling.
    pub q_top_k: usize,
    /// Let the policy re-plan γ and depth as it measures (`draft_len` / `depth` are the start).
    pub auto: Option<AutoShape>,
    /// The verifier's grant at Open (γ, depth): the shape stays within it, and within each later
    /// grant that verdicts bring as the verifier's load changes. `draft_len`, `depth` and the
    /// auto bounds are what the edge wants; None: no limit.
    pub granted: Option<(usize, usize)>,
}

/// Bounds and starting guesses of the adaptive policy.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct AutoShape {
    /// The cloud's grant: γ and depth never exceed these.
    pub max_draft_len: usize,
    pub max_depth: usize,
    /// What the policy assumes before it has measured anything.
    pub prior: Costs,
}

/// The policy's assumptions before it has measured anything: a draft about as good as a 4-bit
/// copy of the target (α 0.7), a draft forward half as long as a verify.
pub fn default_prior(rtt_ms: f64) -> Costs {
    Costs {
        alpha: 0.7,
        draft_ms: 30.0,
        verify_ms: 60.0,
        verify_ms_per_token: 0.0,
        rtt_ms,
        verdict_ms: 1.0,
    }
}

/// What the edge measured during a run (milliseconds).
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Measured {
    /// Mean time of one draft forward.
    pub draft_ms: f64,
    /// Mean verifier forward time per verdict that needed one.
    pub verify_ms: f64,
    /// Mean time from sending a block to its verdict's arrival.
    pub block_round_trip_ms: f64,
    /// The round trip as the policy sees it (smallest recent arrival − send − verify).
    pub net_ms: f64,
    /// The edge's own time per verdict outside draft forwards and waits: handling verdicts,
    /// rolling the draft back, sending blocks, the caller's display.
    pub verdict_ms: f64,
    /// γ and depth at the end, and how often the policy changed them.
    pub final_draft_len: usize,
    pub final_depth: usize,
    pub reshapes: usize,
    /// Sessions reopened after a lost connection.
    pub reconnects: usize,
    /// Tokens the verifier decoded itself, having taken the session over under load.
    pub cloud_decoded: usize,
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
    let mut d = EngineDrafter::new(draft, prompt.len(), cfg);
    run_with(&mut d, eog, prompt, first, cfg, link, start, on_update)
}

/// Keep the pipeline's shape within the grant `cap`, aiming at `want`: the outputs of the reshape
/// (none when the shape already fits).
fn fit_shape(
    p: &mut Pipeline,
    want: (usize, usize),
    cap: (usize, usize),
    m: &mut Measured,
) -> Result<Vec<Output>, EdgeError> {
    let shape = (want.0.min(cap.0).max(1), want.1.min(cap.1).max(1));
    if shape == (p.config().draft_len, p.config().depth) {
        return Ok(Vec::new());
    }
    m.reshapes += 1;
    Ok(p.set_shape(shape.0, shape.1)?)
}
/// [`run`] with any [`Drafter`] (a model, or the load generator's synthetic edge).
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
    let mut cap = cfg.granted.unwrap_or((usize::MAX, usize::MAX));
    let pcfg = PipelineConfig {
        draft_len: cfg.draft_len.min(cap.0).max(1),
        depth: cfg.depth.min(cap.1).max(1),
        max_new_tokens: cfg.max_new_tokens,
    };
    let (mut p, first_out) = Pipeline::with_first(prompt.to_vec(), first, pcfg, eog)?;
    let mut commit_ms = Vec::new();
    let mut draft_forwards = 0;
    let mut sent_at: HashMap<u64, Instant> = HashMap::new();
    let mut est = Estimator::new(cfg.auto.map_or(
        Costs {
            alpha: 0.0,
            draft_ms: 0.0,
            verify_ms: 0.0,
            verify_ms_per_token: 0.0,
            rtt_ms: 0.0,
            verdict_ms: 0.0,
        },
        |a| a.prior,
    ));
    let mut m = Measured::default();
    let (mut draft_total, mut draft_steps, mut verify_total, mut verified) = (0.0, 0usize, 0.0, 0);
    let (mut rt_total, mut arrivals) = (0.0, 0usize);
    // Prompt prefills are timed apart from draft forwards: the edge's work per verdict (kept by
    // the estimator) is a step's time less its wait for a verdict and its forwards.
    let mut prefill_total = 0.0;
    let apply = |outs: Vec<Output>,
                 draft: &mut dyn Drafter,
                 link: &mut dyn Link,
                 commit_ms: &mut Vec<f64>,
                 sent_at: &mut HashMap<u64, Instant>,
                 fresh: &mut Vec<u32>|
     -> Result<(), EdgeError> {
        for o in outs {
            match o {
                Output::Send(b) => {
                    sent_at.insert(b.index, Instant::now());
                    link.send(b)?
                }
                Output::Rollback { to } => draft.rollback(to)?,
                Output::Commit { tokens, .. } => {
                    let t = start.elapsed().as_secs_f64() * 1e3;
                    commit_ms.extend(std::iter::repeat_n(t, tokens.len()));
                    fresh.extend(tokens);
                }
            }
        }
        Ok(())
    };
    let mut fresh = Vec::new();
    apply(
        first_out,
        draft,
        link,
        &mut commit_ms,
        &mut sent_at,
        &mut fresh,
    )?;
    show(&mut on_update, &mut fresh, &[], None);
    loop {
        // One step; a lost connection anywhere in it is recovered below.
        let step_start = Instant::now();
        let mut idle_ms = 0.0;
        let (arrivals_before, draft_before) = (arrivals, draft_total + prefill_total);
        let step = (|| -> Result<bool, EdgeError> {
            let mut arrived = Vec::new();
            while let Some(v) = link.recv(false)? {
                arrived.push(v);
            }
            if arrived.is_empty() && p.next() == Next::Wait {
                let w = Instant::now();
                let v = link.recv(true);
                // A wait that ends in a lost connection is a wait too.
                idle_ms += w.elapsed().as_secs_f64() * 1e3;
                arrived.push(v?.ok_or(EdgeError::LinkClosed)?);
            }
            for v in arrived {
                let v = match v {
                    Incoming::Verdict(v) => v,
                    Incoming::Decoded(d) => {
                        let outs = p.on_decoded(d)?;
                        apply(outs, draft, link, &mut commit_ms, &mut sent_at, &mut fresh)?;
                        m.cloud_decoded += 1;
                        if let Some((g, dp)) = d.resume {
                            // Handed back: draft again within the grant.
                            cap = (g.max(1) as usize, dp.max(1) as usize);
                            let outs = fit_shape(&mut p, (cfg.draft_len, cfg.depth), cap, &mut m)?;
                            apply(outs, draft, link, &mut commit_ms, &mut sent_at, &mut fresh)?;
                        }
                        show(
                            &mut on_update,
                            &mut fresh,
                            &p.tokens()[p.committed_len()..],
                            None,
                        );
                        continue;
                    }
                };
                let now = Instant::now();
                if let Some(t) = sent_at.remove(&v.block) {
                    let rt = (now - t).as_secs_f64() * 1e3;
                    let vms = v.verify_us as f64 / 1e3;
                    est.on_verdict(rt, vms);
                    rt_total += rt;
                    arrivals += 1;
                    if v.verify_us > 0 {
                        verify_total += vms;
                        verified += 1;
                    }
                }
                let (from, rejections) = (p.committed_len(), p.stats().rejections);
                let before = p.tokens()[from..].to_vec();
                let outs = p.on_verdict(v)?;
                apply(outs, draft, link, &mut commit_ms, &mut sent_at, &mut fresh)?;
                // The verifier's load changed its grant: keep within it (and grow back into it).
                if let Some((g, d)) = v.grant {
                    cap = (g.max(1) as usize, d.max(1) as usize);
                    let want = match cfg.auto {
                        // The policy re-plans within the new bounds below.
                        Some(_) => (p.config().draft_len, p.config().depth),
                        None => (cfg.draft_len, cfg.depth),
                    };
                    let outs = fit_shape(&mut p, want, cap, &mut m)?;
                    apply(outs, draft, link, &mut commit_ms, &mut sent_at, &mut fresh)?;
                }
                let correction = (p.stats().rejections > rejections)
                    .then(|| {
                        let now = &p.tokens()[from..];
                        before
                            .iter()
                            .zip(now)
                            .find(|(b, n)| b != n)
                            .map(|(&b, &n)| (b, n))
                    })
                    .flatten();
                show(
                    &mut on_update,
                    &mut fresh,
                    &p.tokens()[p.committed_len()..],
                    correction,
                );
                if let Some(a) = cfg.auto {
                    let s = *p.stats();
                    let costs = est.costs(s.accepted, s.accepted + s.rejections);
                    let (max_g, max_d) = (a.max_draft_len.min(cap.0), a.max_depth.min(cap.1));
                    let plan = recommend(&costs, max_g.max(1), max_d.max(1));
                    let (g, d) = (p.config().draft_len, p.config().depth);
                    // Synchronous speculation (depth 1) only chooses γ, by its own model.
                    let (want, best_ms, now_ms) = if max_d <= 1 {
                        let sync = |g| tandem_spec::policy::sync_itl_ms(&costs, g);
                        ((plan.sync_gamma, 1), plan.predicted_sync_itl_ms, sync(g))
                    } else {
                        let now = tandem_spec::policy::async_itl_ms(&costs, g, d);
                        ((plan.gamma, plan.depth), plan.predicted_async_itl_ms, now)
                    };
                    // Re-plan only for a clear gain, so that noise does not make the shape flap.
                    if want != (g, d) && best_ms < 0.95 * now_ms {
                        let outs = p.set_shape(want.0, want.1)?;
                        m.reshapes += 1;
                        apply(outs, draft, link, &mut commit_ms, &mut sent_at, &mut fresh)?;
                    }
                }
            }
            match p.next() {
                Next::Done => return Ok(true),
                Next::Wait => {}
                Next::Draft => {
                    let t0 = Instant::now();
                    let Proposal {
                        token: t,
                        q,
                        prefill,
                    } = draft.propose(p.tokens())?;
                    draft_forwards += 1;
                    let ms = t0.elapsed().as_secs_f64() * 1e3;
                    if prefill {
                        prefill_total += ms;
                    } else {
                        est.on_draft(ms);
                        draft_total += ms;
                        draft_steps += 1;
                    }
                    let outs = p.on_drafted(t, q);
                    apply(outs, draft, link, &mut commit_ms, &mut sent_at, &mut fresh)?;
                    show(
                        &mut on_update,
                        &mut fresh,
                        &p.tokens()[p.committed_len()..],
                        None,
                    );
                }
            }
            Ok(false)
        })();
        let work = step_start.elapsed().as_secs_f64() * 1e3
            - idle_ms
            - (draft_total + prefill_total - draft_before);
        est.on_edge_work(work, arrivals - arrivals_before);
        match step {
            Ok(true) => break,
            Ok(false) => {}
            Err(EdgeError::LinkClosed) => {
                // Keep what is verified, drop the rest, and reopen over the committed history.
                let outs = p.on_connection_lost();
                apply(outs, draft, link, &mut commit_ms, &mut sent_at, &mut fresh)?;
                sent_at.clear();
                let mut first = None;
                for attempt in 0..REOPEN_ATTEMPTS {
                    std::thread::sleep(std::time::Duration::from_millis(100 << attempt));
                    let left = cfg.max_new_tokens - p.output().len();
                    match link.reopen(&p.tokens()[..p.committed_len()], left) {
                        Ok(t) => {
                            first = Some(t);
                            break;
                        }
                        Err(EdgeError::LinkClosed | EdgeError::Refused(_)) => {}
                        Err(e) => return Err(e),
                    }
                }
                let first = first.ok_or(EdgeError::LinkClosed)?;
                m.reconnects += 1;
                let outs = p.on_reopened(first);
                apply(outs, draft, link, &mut commit_ms, &mut sent_at, &mut fresh)?;
                show(&mut on_update, &mut fresh, &[], None);
                if p.next() == Next::Done {
                    break;
                }
            }
            Err(e) => return Err(e),
        }
    }
    let mean = |t: f64, n: usize| if n == 0 { 0.0 } else { t / n as f64 };
    m.draft_ms = mean(draft_total, draft_steps);
    m.verify_ms = mean(verify_total, verified);
    m.block_round_trip_ms = mean(rt_total, arrivals);
    m.verdict_ms = est.edge_ms_per_verdict().unwrap_or(0.0);
    m.net_ms = est.costs(0, 0).rtt_ms;
    m.final_draft_len = p.config().draft_len;
    m.final_depth = p.config().depth;
    draft.rollback(0)?;
    Ok(SpecReport {
        output_ids: p.output().to_vec(),
        commit_ms,
        stats: *p.stats(),
        draft_forwards,
        measured: m,
    })
}
