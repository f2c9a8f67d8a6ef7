//! The batcher: the thread that owns the [`VerifierCore`] and drives it with the wall clock. Each
//! turn it hands the core every message that has arrived, runs the core's turn, sends each
//! outgoing message through its session's [`Reply`] and records the turn in the metrics. It
//! sleeps only when no session has work. Every decision is the core's.

use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_engine::Engine;
use tandem_verifier::{Inbound, VerifierCore};

use crate::{Gauges, Reply, ToCloud};

/// How long a turn whose plan was empty (every tenant with work is over its rate quota) waits
/// before planning again.
const THROTTLED_WAIT: Duration = Duration::from_millis(2);

/// Messages taken per turn at most, so that a flood of them cannot keep the forward from running.
const MESSAGES_PER_TURN: usize = 4096;

type Answer = Box<dyn FnOnce(&VerifierCore<Engine, Reply>)>;

/// Drive `core` until every sender of `rx` is gone; returns the core. `tenant_names[t]` labels
/// tenant `t` in the metrics and the ledger; each ended session goes to `ledger` (flushed when
/// the batcher returns).
pub fn run_batcher(
    mut core: VerifierCore<Engine, Reply>,
    rx: Receiver<ToCloud>,
    gauges: Arc<Gauges>,
    tenant_names: Vec<String>,
    mut ledger: Option<crate::ledger::Ledger>,
) -> VerifierCore<Engine, Reply> {
    let started = Instant::now();
    // The core's clock (µs since `started`) in Unix ms, for the ledger's times.
    let epoch_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64);
    let now_us = || started.elapsed().as_micros() as u64;
    let mut throttled = false;
    loop {
        gauges.update(&core);
        let first = if !core.has_work() {
            // Idle but for sessions waiting for their edges' blocks: wake when a wait runs out.
            match core.wake_at_us() {
                None => match rx.recv() {
                    Ok(m) => Some(m),
                    Err(_) => break,
                },
                Some(at) => {
                    match rx.recv_timeout(Duration::from_micros(at.saturating_sub(now_us()))) {
                        Ok(m) => Some(m),
                        Err(RecvTimeoutError::Timeout) => None,
                        Err(RecvTimeoutError::Disconnected) => break,
                    }
                }
            }
        } else if throttled {
            match rx.recv_timeout(THROTTLED_WAIT) {
                Ok(m) => Some(m),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => break,
            }
        } else {
            None
        };
        // Answers to requests, given once this turn's messages are out.
        let mut answers: Vec<Answer> = Vec::new();
        for m in first
            .into_iter()
            .chain(rx.try_iter().take(MESSAGES_PER_TURN))
        {
            match m {
                ToCloud::Core(m) => core.receive(now_us(), m),
                ToCloud::Query {
                    session,
                    tenant,
                    reply,
                } => answers.push(Box::new(move |c| {
                    reply(c.session(session).filter(|s| s.tenant == tenant))
                })),
                ToCloud::Cancel {
                    session,
                    tenant,
                    reply,
                } => {
                    let r = core.cancel(session, tenant);
                    answers.push(Box::new(move |_| reply(r)));
                }
                ToCloud::Drain { reply } => {
                    core.drain();
                    answers.push(Box::new(move |c| reply(c.open_sessions())));
                }
                ToCloud::ShutDown { reply } => {
                    core.shut_down();
                    answers.push(Box::new(move |_| reply()));
                }
            }
        }
        // The sessions admitted hear so before the forward (which may be a long prompt's).
        for o in core.admissions() {
            if !(o.to)(o.msg) {
                core.receive(now_us(), Inbound::Close { session: o.session });
            }
        }
        let t0 = Instant::now();
        let turn = core.turn(now_us());
        let step_s = t0.elapsed().as_secs_f64();
        gauges.metrics.record(&turn, step_s, &tenant_names);
        record(&mut ledger, &turn.finished, &tenant_names, epoch_ms);
        throttled = turn.throttled;
        // An edge that hung up (a dropped stream, a client that went away mid-generation) frees
        // its KV cache and stops costing forward passes.
        for o in turn.out {
            let ends = o.msg.ends();
            if !(o.to)(o.msg) && !ends {
                core.receive(now_us(), Inbound::Close { session: o.session });
            }
        }
        for a in answers {
            a(&core);
        }
    }
    // Sessions closed since the last turn (the end of a drain) are in the ledger too.
    let last = core.take_finished();
    record(&mut ledger, &last, &tenant_names, epoch_ms);
    core
}

/// Each ended session's row to the ledger, if there is one.
fn record(
    ledger: &mut Option<crate::ledger::Ledger>,
    finished: &[tandem_verifier::Usage],
    tenant_names: &[String],
    epoch_ms: i64,
) {
    let Some(l) = ledger.as_mut() else {
        return;
    };
    for u in finished {
        let name = tenant_names
            .get(u.tenant.0 as usize)
            .map_or_else(|| u.tenant.to_string(), |n| n.clone());
        l.record(crate::ledger::Row::of(u, &name, epoch_ms));
    }
}
