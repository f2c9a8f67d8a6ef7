//! The batcher: an actor that owns the [`Verifier`] and runs the iteration loop. Each turn it takes
//! every message that has arrived (opens, drafts, closes, queries), runs one iteration of the
//! scheduler's plan, and answers each session through its [`Reply`]. It sleeps only when no
//! session has work.

use std::collections::HashMap;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_sched::{GrantPolicy, SchedError, SessionId, TenantId};

use crate::control::LoadControl;
use crate::verifier::Event;
use crate::{CloudError, Gauges, Reply, ToCloud, ToEdge, Verifier};

/// How long an iteration whose plan was empty (every tenant with work is over its rate quota)
/// waits before planning again.
const THROTTLED_WAIT: Duration = Duration::from_millis(2);

/// Messages taken per turn at most, so that a flood of them cannot keep the forward from running.
const MESSAGES_PER_TURN: usize = 4096;

struct Live {
    reply: Reply,
    tenant: TenantId,
    /// When the session was admitted (for the time to first token), and when it last got tokens.
    opened_at: Instant,
    last_commit: Option<Instant>,
    /// Arrival times of blocks not yet answered, by block index, oldest first (queue time).
    arrivals: std::collections::VecDeque<(u64, Instant)>,
}

/// Serve until every sender of `rx` is gone; returns the verifier. `tenant_names[t]` labels tenant
/// `t` in the metrics. `grants` follows the load (tokens per forward): a session learns of a new
/// grant with its next verdict.
pub fn serve(
    mut v: Verifier,
    rx: Receiver<ToCloud>,
    gauges: Arc<Gauges>,
    tenant_names: Vec<String>,
    grants: GrantPolicy,
) -> Verifier {
    let started = Instant::now();
    let now_ms = || started.elapsed().as_millis() as u64;
    let mut control = LoadControl::new(grants, 0);
    let mut live: HashMap<SessionId, Live> = HashMap::new();
    let mx = &gauges.metrics;
    let name = |t: TenantId| {
        tenant_names
            .get(t as usize)
            .cloned()
            .unwrap_or_else(|| t.to_string())
    };
    // Mean wall time of an iteration (for the retry hint of a refused session).
    let mut iteration_ms = 50.0f64;
    let mut throttled = false;
    loop {
        let mut events = Vec::new();
        gauges.update(&v);
        let first = if !v.has_work() {
            match rx.recv() {
                Ok(m) => Some(m),
                Err(_) => return v,
            }
        } else if throttled {
            match rx.recv_timeout(THROTTLED_WAIT) {
                Ok(m) => Some(m),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => return v,
            }
        } else {
            None
        };
        for m in first
            .into_iter()
            .chain(rx.try_iter().take(MESSAGES_PER_TURN))
        {
            match m {
                ToCloud::Open {
                    session,
                    tenant,
                    prompt,
                    params,
                    rule,
                    want,
                    max_tokens,
                    eog,
                    reply,
                } => {
                    let r = v.open(session, tenant, &prompt, params, rule, max_tokens, eog);
                    if r.is_ok() {
                        control.open(session, Some(want));
                    }
                    admitted(session, tenant, r, reply, &mut live, mx, iteration_ms);
                }
                ToCloud::Generate {
                    session,
                    tenant,
                    prompt,
                    params,
                    max_tokens,
                    eog,
                    reply,
                } => {
                    let r = v.open_generate(session, tenant, &prompt, params, max_tokens, eog);
                    if r.is_ok() {
                        control.open(session, None);
                    }
                    admitted(session, tenant, r, reply, &mut live, mx, iteration_ms);
                }
                ToCloud::Draft { session, block } => {
                    if let Some(l) = live.get_mut(&session) {
                        if l.arrivals.len() >= 2 * crate::verifier::MAX_QUEUED_BLOCKS {
                            l.arrivals.pop_front();
                        }
                        l.arrivals.push_back((block.index, Instant::now()));
                    }
                    events.extend(v.draft(session, block));
                }
                ToCloud::Close { session } => {
                    v.close(session);
                    live.remove(&session);
                    control.close(session);
                }
                ToCloud::Query { session, reply } => reply(v.session(session)),
            }
        }
        // The load, looked at once the turn's messages are in: the grant, and takeovers.
        let (e, takeovers) = control.turn(now_ms(), &mut v);
        mx.takeovers.inc_by(takeovers as u64);
        events.extend(e);
        throttled = false;
        if v.has_work() {
            let forwards = v.stats.target_forwards;
            let t0 = Instant::now();
            let e = v.step(started.elapsed().as_millis() as u64);
            if v.stats.target_forwards > forwards {
                let ms = t0.elapsed().as_secs_f64() * 1e3;
                iteration_ms += 0.1 * (ms - iteration_ms);
                control.on_forward(now_ms(), v.stats.last_batch.1, ms);
                mx.forwards.inc();
                mx.batch_size.observe(v.stats.last_batch.0 as f64);
                mx.tokens_per_forward.observe(v.stats.last_batch.1 as f64);
                mx.forward_time.observe(ms / 1e3);
            } else {
                throttled = e.is_empty();
            }
            events.extend(e);
        }
        let mut gone = Vec::new();
        for e in events {
            let (session, msg, fatal) = match e {
                Event::Opened { session, first } => {
                    let grant = control.on_opened(session);
                    if let Some(l) = live.get_mut(&session) {
                        mx.ttft.observe(l.opened_at.elapsed().as_secs_f64());
                        l.last_commit = Some(Instant::now());
                    }
                    (
                        session,
                        ToEdge::Opened {
                            session,
                            first,
                            grant,
                        },
                        false,
                    )
                }
                Event::Verdict {
                    session,
                    mut verdict,
                    drafted,
                    positions,
                } => {
                    control.on_verdict(session, &mut verdict, drafted, now_ms());
                    if let Some(l) = live.get_mut(&session) {
                        // Blocks before this one were answered or went stale.
                        while let Some(&(b, at)) = l.arrivals.front() {
                            if b > verdict.block {
                                break;
                            }
                            l.arrivals.pop_front();
                            if b == verdict.block && drafted > 0 {
                                mx.queue_time.observe(at.elapsed().as_secs_f64());
                            }
                        }
                        let accepted = verdict.accepted.min(drafted);
                        if drafted > 0 {
                            let t = name(l.tenant);
                            mx.drafts.inc();
                            mx.draft_tokens.inc_by(drafted as u64);
                            mx.accepted_tokens.inc_by(accepted as u64);
                            for pos in 0..accepted {
                                mx.accepted_per_pos
                                    .with_label_values(&[&pos.to_string()])
                                    .inc();
                            }
                            mx.tenant_verified
                                .with_label_values(&[&t])
                                .inc_by(positions as u64);
                            mx.tenant_drafted
                                .with_label_values(&[&t])
                                .inc_by(drafted as u64);
                            mx.tenant_accepted
                                .with_label_values(&[&t])
                                .inc_by(accepted as u64);
                        }
                        inter_token(mx, &mut l.last_commit, accepted + 1);
                    }
                    (session, ToEdge::Verdict(verdict), false)
                }
                Event::Token {
                    session,
                    token,
                    done,
                } => {
                    if let Some(l) = live.get_mut(&session) {
                        if l.last_commit.is_none() {
                            mx.ttft.observe(l.opened_at.elapsed().as_secs_f64());
                            l.last_commit = Some(Instant::now());
                        } else {
                            inter_token(mx, &mut l.last_commit, 1);
                        }
                    }
                    (session, ToEdge::Token { token, done }, done)
                }
                Event::Error {
                    session,
                    error,
                    fatal,
                } => (session, ToEdge::error(&error, fatal), fatal),
                Event::Preempted { .. } => {
                    mx.preemptions.inc();
                    continue;
                }
                Event::Decoded {
                    session,
                    mut decoded,
                    handback,
                } => {
                    control.on_decoded(session, handback, &mut decoded);
                    if let Some(l) = live.get_mut(&session) {
                        inter_token(mx, &mut l.last_commit, 1);
                    }
                    (session, ToEdge::Decoded(decoded), false)
                }
            };
            let Some(l) = live.get(&session) else {
                continue;
            };
            if !(l.reply)(msg) && !fatal {
                gone.push(session);
            }
            if fatal {
                live.remove(&session);
                control.close(session);
            }
        }
        // An edge that hung up (a dropped stream, a client that went away mid-generation) frees
        // its KV cache and stops costing forward passes.
        for id in gone {
            v.close(id);
            live.remove(&id);
            control.close(id);
        }
    }
}

/// Register an admitted session, or answer the refusal (with a retry hint when it is for load).
#[allow(clippy::too_many_arguments)]
fn admitted(
    session: SessionId,
    tenant: TenantId,
    r: Result<(), CloudError>,
    reply: Reply,
    live: &mut HashMap<SessionId, Live>,
    mx: &crate::metrics::Metrics,
    iteration_ms: f64,
) {
    match r {
        Ok(()) => {
            live.insert(
                session,
                Live {
                    reply,
                    tenant,
                    opened_at: Instant::now(),
                    last_commit: None,
                    arrivals: Default::default(),
                },
            );
        }
        Err(e) => {
            let retry_after_ms = match &e {
                CloudError::Sched(SchedError::Saturated {
                    retry_iterations, ..
                }) => Some((*retry_iterations as f64 * iteration_ms).ceil().max(1.0) as u64),
                CloudError::Sched(SchedError::QuotaExceeded { .. }) => {
                    Some(iteration_ms.ceil() as u64)
                }
                _ => None,
            };
            if retry_after_ms.is_some() {
                mx.refused.inc();
            }
            let message = match retry_after_ms {
                Some(ms) => format!("{e}; retry after about {ms} ms"),
                None => e.to_string(),
            };
            reply(ToEdge::Error {
                code: e.code(),
                message,
                retry_after_ms,
                fatal: true,
            });
        }
    }
}

/// Observe `tokens` inter-token gaps that together took the time since the last commit.
fn inter_token(mx: &crate::metrics::Metrics, last: &mut Option<Instant>, tokens: usize) {
    let now = Instant::now();
    if let Some(t) = last.replace(now) {
        let gap = (now - t).as_secs_f64() / tokens.max(1) as f64;
        for _ in 0..tokens.max(1) {
            mx.itl.observe(gap);
        }
    }
}
