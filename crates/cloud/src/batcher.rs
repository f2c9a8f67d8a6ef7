//! The batcher: an actor that owns the [`Verifier`] and runs the iteration loop. Each turn it takes
//! every message that has arrived (opens, drafts, closes, queries), runs one iteration of the
//! scheduler's plan, and answers each session through its [`Reply`]. It sleeps only when no
//! session has work.

use std::collections::HashMap;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_sched::pace::prefer_cloud;
use tandem_sched::{GrantPolicy, Pace, SchedError, SessionId, TenantId};

use crate::verifier::Event;
use crate::{CloudError, Gauges, Reply, ToCloud, ToEdge, Verifier};

/// How long an iteration whose plan was empty (every tenant with work is over its rate quota)
/// waits before planning again.
const THROTTLED_WAIT: Duration = Duration::from_millis(2);

/// Forwards between two looks at the load by the grant policy (each moves one level at most).
const GRANT_EVERY: u64 = 2;

/// Idle this long, the verifier counts as unloaded and the grant relaxes a level (per turn of the
/// loop). Shorter gaps are normal between rounds of speculation (edges drafting, blocks on the
/// wire) and do not count.
const IDLE_RELAX: Duration = Duration::from_millis(250);

/// Decay per verdict of the accepted and judged counts behind the grant's α.
const ALPHA_DECAY: f64 = 0.99;

/// Messages taken per turn at most, so that a flood of them cannot keep the forward from running.
const MESSAGES_PER_TURN: usize = 4096;

struct Live {
    reply: Reply,
    tenant: TenantId,
    /// What a speculation session asked for, and what it was last told it may use.
    want: Option<(u32, u32)>,
    granted: (u32, u32),
    /// The verifier decodes this session itself (its grant is γ 0).
    cloud: bool,
    /// Its speculative pace (ms per committed token), for a takeover of its own.
    pace: Pace,
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
    mut grants: GrantPolicy,
) -> Verifier {
    let started = Instant::now();
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
    let mut graded_at = 0u64;
    let mut last_forward = Instant::now();
    // Accepted and judged draft tokens over recent verdicts (decaying): the α the grant plans with.
    let (mut accepted_recent, mut judged_recent) = (0.0f64, 0.0f64);
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
                    admitted(
                        session,
                        tenant,
                        Some(want),
                        r,
                        reply,
                        &mut live,
                        mx,
                        iteration_ms,
                    );
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
                    admitted(session, tenant, None, r, reply, &mut live, mx, iteration_ms);
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
                }
                ToCloud::Query { session, reply } => reply(v.session(session)),
            }
        }
        // The load, looked at once the turn's messages are in: no forward for IDLE_RELAX means
        // the verifier sat idle (it relaxes a level), else every GRANT_EVERY forwards.
        if last_forward.elapsed() >= IDLE_RELAX {
            last_forward = Instant::now();
            v.stats.tokens_per_forward = 0.0;
            grants.grant(0.0);
        } else if v.stats.target_forwards >= graded_at + GRANT_EVERY {
            graded_at = v.stats.target_forwards;
            // Before any verdict, plan with α 0.8 (about the W4A16 draft's).
            let alpha = if judged_recent > 0.0 {
                accepted_recent / judged_recent
            } else {
                0.8
            };
            grants.grant_by_model(live.len(), alpha, v.stats.tokens_per_forward);
        }
        let (grant_g, grant_d) = grants.current();
        // γ 0: the verifier decodes the session itself.
        let grant_for = |want: (u32, u32)| {
            if grant_g == 0 {
                (0, 1)
            } else {
                (want.0.min(grant_g).max(1), want.1.min(grant_d).max(1))
            }
        };
        // Past the ridge every session is taken over (γ 0); below it, each one whose speculation
        // commits slower than cloud decoding would at this load.
        let cloud_itl = grants.cloud_itl_ms(live.len());
        for (id, l) in live.iter_mut() {
            if l.want.is_none() {
                continue;
            }
            let cloud = grant_g == 0
                || cloud_itl.is_some_and(|c| prefer_cloud(l.pace.ms_per_token(), c, l.cloud));
            if l.cloud != cloud {
                l.cloud = cloud;
                l.pace.restart();
                if cloud {
                    mx.takeovers.inc();
                }
                events.extend(v.set_cloud_decode(*id, cloud));
            }
        }
        throttled = false;
        if v.has_work() {
            let forwards = v.stats.target_forwards;
            let t0 = Instant::now();
            let e = v.step(started.elapsed().as_millis() as u64);
            if v.stats.target_forwards > forwards {
                last_forward = Instant::now();
                let ms = t0.elapsed().as_secs_f64() * 1e3;
                iteration_ms += 0.1 * (ms - iteration_ms);
                grants.observe_forward(v.stats.last_batch.1, ms);
                mx.forwards.inc();
                mx.batch_size.observe(v.stats.last_batch.0 as f64);
                mx.tokens_per_forward.observe(v.stats.last_batch.1 as f64);
            } else {
                throttled = e.is_empty();
            }
            events.extend(e);
        }
        let mut gone = Vec::new();
        for e in events {
            let (session, msg, fatal) = match e {
                Event::Opened { session, first } => {
                    let mut grant = (1, 1);
                    if let Some(l) = live.get_mut(&session) {
                        mx.ttft.observe(l.opened_at.elapsed().as_secs_f64());
                        l.last_commit = Some(Instant::now());
                        grant = grant_for(l.want.unwrap_or((1, 1)));
                        l.granted = grant;
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
                    if let Some(l) = live.get_mut(&session) {
                        if let Some(want) = l.want {
                            let now = grant_for(want);
                            if now != l.granted {
                                verdict.grant = Some(now);
                                l.granted = now;
                            }
                        }
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
                            let judged = accepted + usize::from(accepted < drafted);
                            accepted_recent = ALPHA_DECAY * accepted_recent + accepted as f64;
                            judged_recent = ALPHA_DECAY * judged_recent + judged as f64;
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
                        if !l.cloud {
                            l.pace
                                .on_commit(started.elapsed().as_millis() as u64, accepted + 1);
                        }
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
                    if let Some(l) = live.get_mut(&session) {
                        inter_token(mx, &mut l.last_commit, 1);
                        if handback {
                            let (g, d) = grant_for(l.want.unwrap_or((1, 1)));
                            decoded.resume = Some((g.max(1), d.max(1)));
                            l.granted = (g.max(1), d.max(1));
                        }
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
            }
        }
        // An edge that hung up (a dropped stream, a client that went away mid-generation) frees
        // its KV cache and stops costing forward passes.
        for id in gone {
            v.close(id);
            live.remove(&id);
        }
    }
}

/// Register an admitted session, or answer the refusal (with a retry hint when it is for load).
#[allow(clippy::too_many_arguments)]
fn admitted(
    session: SessionId,
    tenant: TenantId,
    want: Option<(u32, u32)>,
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
                    want,
                    granted: (0, 0),
                    cloud: false,
                    pace: Pace::default(),
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
