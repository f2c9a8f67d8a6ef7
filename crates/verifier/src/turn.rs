//! The driver's interface: messages in ([`VerifierCore::receive`]), one turn at a time
//! ([`VerifierCore::turn`]), messages out ([`Outgoing`]) and what was observed ([`Turn`]), all
//! on the driver's clock (µs) and in plain data.

use tandem_sched::{SchedError, SessionId, TenantId};
use tandem_spec::sampling::SamplingParams;
use tandem_spec::{Block, Decoded, Grammar, Shape, Verdict, VerifyRule};

use crate::control::Load;
use crate::session::{Event, Meter, Work};
use crate::verifier_core::VerifierCore;
use crate::{Target, VerifierError};

/// What a new session asks for.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Mode {
    /// Speculation judged by `rule`, within the γ and depth `want` (its grants never exceed
    /// them).
    Speculate { rule: VerifyRule, want: Shape },
    /// Cloud-only generation: the verifier produces every token.
    Generate,
}

/// A session to open.
#[derive(Debug, Clone, PartialEq)]
pub struct NewSession {
    pub tenant: TenantId,
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    /// New tokens at most, and the end-of-generation ids (for when the verifier decodes it).
    pub max_tokens: usize,
    pub eog: Vec<u32>,
    pub mode: Mode,
    /// Structured output: the grammar the output follows (compiled by the caller, at its start).
    pub grammar: Option<Box<Grammar>>,
    /// Send the target's log-probability of each committed token (a speculation session), with
    /// this many alternatives.
    pub logprobs: Option<usize>,
    /// Let the verifier draft for the session from its own text when it decodes it alone
    /// ([`VerifierConfig::self_draft_max`](crate::VerifierConfig::self_draft_max)).
    pub self_draft: bool,
}

/// A message from an edge (or its transport).
#[derive(Debug)]
pub enum Inbound<H> {
    /// Open a session; `handle` reaches its edge.
    Open {
        session: SessionId,
        new: NewSession,
        handle: H,
    },
    Draft {
        session: SessionId,
        block: Block,
    },
    /// The edge has received the session's first `committed` tokens (flow control).
    Ack {
        session: SessionId,
        committed: usize,
    },
    /// The edge closed the session, or its transport is gone.
    Close {
        session: SessionId,
    },
}

/// A message to an edge.
#[derive(Debug, Clone, PartialEq)]
pub enum ToEdge {
    /// A session is admitted: its prompt is to be prefilled, `cached` of its tokens from the
    /// prefix cache. `Opened` (a speculation session) or its first token (a generation) follows
    /// once the prefill is done.
    Admitted {
        cached: usize,
    },
    /// The prompt is prefilled: the target's first token, the γ and depth granted now, and how
    /// many prompt tokens the prefix cache served.
    Opened {
        first: u32,
        grant: Shape,
        cached: usize,
        /// The first token's log-probability, when the session asked for them.
        first_logprob: Option<tandem_spec::sampling::TokenLogprob>,
    },
    Verdict(Verdict),
    /// A token the verifier decoded itself for a speculation session it took over (`resume`: the
    /// last one, with the grant to draft again with).
    Decoded(Decoded),
    /// A token of a cloud-only generation.
    Token {
        token: u32,
        done: bool,
    },
    /// The target's log-probabilities of committed tokens, sent before the message that commits
    /// them.
    Logprobs(Vec<tandem_spec::sampling::TokenLogprob>),
    Error {
        error: VerifierError,
        /// When refused for load: try again after about this long.
        retry_after_ms: Option<u64>,
        /// The session is over (refused at admission, or it failed); the verifier has closed it.
        fatal: bool,
    },
}

impl ToEdge {
    /// Whether the session is over with this message.
    pub fn ends(&self) -> bool {
        matches!(
            self,
            ToEdge::Token { done: true, .. } | ToEdge::Error { fatal: true, .. }
        )
    }
}

/// A message for session `session`'s edge, with the driver's handle to it.
#[derive(Debug, Clone)]
pub struct Outgoing<H> {
    pub session: SessionId,
    pub to: H,
    pub msg: ToEdge,
}

/// A forward that ran in a turn.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ForwardDone {
    /// Sessions and tokens in it.
    pub sessions: usize,
    pub tokens: usize,
    /// How long it took (µs): the turn ends this much later than it began.
    pub us: u64,
}

/// What a driver may record of a turn (its metrics), on its clock.
#[derive(Debug, Clone, PartialEq)]
pub enum Observation {
    /// A session's first token reached its edge this long after it was admitted.
    FirstToken { seconds: f64 },
    /// `tokens` tokens were committed together, each `seconds` after the one before.
    InterToken { seconds: f64, tokens: usize },
    /// A block waited this long between its arrival and its verdict.
    QueueTime { seconds: f64 },
    /// A verdict in a forward: `drafted` tokens judged, `accepted` of them right, over
    /// `positions` positions.
    Verified {
        tenant: TenantId,
        drafted: usize,
        accepted: usize,
        positions: usize,
    },
    /// The forward verified `guessed` guesses the verifier copied from sessions' own text while
    /// it decoded them alone, and the target accepted `accepted` of them.
    SelfDrafted { guessed: u64, accepted: u64 },
}

/// One turn: the messages for the edges, in order, and what happened.
#[derive(Debug)]
pub struct Turn<H> {
    pub out: Vec<Outgoing<H>>,
    /// The forward that ran (None: nothing was planned).
    pub forward: Option<ForwardDone>,
    /// When the turn ended (µs): when it began plus the forward.
    pub ends_us: u64,
    /// There was work, but none could be planned (every tenant with work is over its rate
    /// quota): the driver looks again shortly.
    pub throttled: bool,
    pub takeovers: usize,
    pub preemptions: usize,
    /// Sessions refused for load or quota.
    pub refused: usize,
    pub observations: Vec<Observation>,
    /// What the sessions that ended since the last turn used (closed, finished, failed,
    /// cancelled, shut down), once each.
    pub finished: Vec<crate::Usage>,
}

impl<T: Target, H: Clone> VerifierCore<T, H> {
    /// A message from an edge at `now_us`. Whatever it is answered with goes out with the next
    /// [`VerifierCore::turn`], as every other answer does.
    pub fn receive(&mut self, now_us: u64, msg: Inbound<H>) {
        self.now_us = self.now_us.max(now_us);
        match msg {
            Inbound::Open {
                session,
                new,
                handle,
            } => {
                let (work, want) = match new.mode {
                    Mode::Speculate { rule, want } => (
                        Self::spec_work(
                            rule,
                            new.prompt.len(),
                            new.max_tokens,
                            new.eog,
                            new.self_draft && self.self_draft.is_some(),
                        ),
                        Some(self.load.clamp(want, 0).0),
                    ),
                    Mode::Generate => {
                        let suffix = match (new.self_draft, self.self_draft) {
                            (true, Some(policy)) => Some(tandem_spec::SelfDrafter::new(
                                &new.prompt,
                                policy,
                                &self.guess_record,
                            )),
                            _ => None,
                        };
                        (Self::generation_work(new.max_tokens, new.eog, suffix), None)
                    }
                };
                let r = self.admit(
                    session,
                    new.tenant,
                    &new.prompt,
                    new.params,
                    new.grammar,
                    new.logprobs,
                    work,
                    want,
                    now_us,
                    handle.clone(),
                );
                match r {
                    Err(e) => self.dismissed.push((session, handle, e)),
                    Ok(()) => self.held.push(Event::Admitted { session }),
                }
            }
            Inbound::Draft { session, block } => {
                if let Some(s) = self.sessions.get_mut(&session) {
                    s.meter.heard_us = s.meter.heard_us.max(now_us);
                    s.meter.spoke_us = s.meter.spoke_us.max(now_us);
                    s.meter.spoke = true;
                    let a = &mut s.meter.arrivals;
                    if a.len() >= 2 * crate::MAX_QUEUED_BLOCKS {
                        a.pop_front();
                    }
                    a.push_back((block.index, now_us));
                }
                let e = self.draft(session, block);
                self.held.extend(e);
            }
            Inbound::Ack { session, committed } => {
                if let Some(s) = self.sessions.get_mut(&session) {
                    s.meter.heard_us = s.meter.heard_us.max(now_us);
                    s.meter.spoke_us = s.meter.spoke_us.max(now_us);
                    s.meter.spoke = true;
                }
                let e = self.ack(session, committed);
                self.held.extend(e);
            }
            Inbound::Close { session } => self.close(session),
        }
    }

    /// One turn at `now_us`: close the sessions gone idle, look at the load (grants, takeovers,
    /// handbacks), run one iteration if any session has work, and return every message for the
    /// edges since the last turn — answers to the messages received, the load's, then the
    /// forward's — stamped as of the turn's end. Sessions that end with their messages (finished, failed) are closed.
    pub fn turn(&mut self, now_us: u64) -> Turn<H> {
        self.now_us = self.now_us.max(now_us);
        let mut turn = Turn {
            out: Vec::new(),
            forward: None,
            ends_us: now_us,
            throttled: false,
            takeovers: 0,
            preemptions: 0,
            refused: 0,
            observations: Vec::new(),
            finished: Vec::new(),
        };
        self.expire_idle(now_us);
        // Refusals at admission (the session never opened), cancellations, the shut-down, idle
        // sessions.
        for (session, to, error) in std::mem::take(&mut self.dismissed) {
            let retry_after_ms = match &error {
                VerifierError::Sched(SchedError::Saturated {
                    retry_iterations, ..
                }) => Some(
                    (*retry_iterations as f64 * self.iteration_ms)
                        .ceil()
                        .max(1.0) as u64,
                ),
                VerifierError::Sched(SchedError::QuotaExceeded { .. }) => {
                    Some(self.iteration_ms.ceil() as u64)
                }
                _ => None,
            };
            turn.refused += usize::from(retry_after_ms.is_some());
            turn.out.push(Outgoing {
                session,
                to,
                msg: ToEdge::Error {
                    error,
                    retry_after_ms,
                    fatal: true,
                },
            });
        }
        let mut events = std::mem::take(&mut self.held);
        // The load, looked at once the turn's messages are in.
        let load = Load {
            forwards: self.stats.target_forwards,
            tokens_per_forward: self.stats.tokens_per_forward,
            sessions: self.sessions.len(),
            position_cost: self.position_cost(),
        };
        let decisions = self.control.turn(
            now_us,
            load,
            self.sessions.iter_mut().map(|(&id, s)| (id, &mut s.ctl)),
        );
        if decisions.idle {
            self.stats.tokens_per_forward = 0.0;
        }
        for (id, on) in decisions.takeovers {
            turn.takeovers += usize::from(on);
            events.extend(self.set_takeover(id, on));
        }
        // Sessions whose wait for their edge's block ran out: a token decoded alone (no scan of
        // the sessions when the verifier never waits, the default).
        let waited: Vec<SessionId> = self
            .sessions
            .iter()
            .filter(|_| self.await_drafts_us > 0)
            .filter(|(_, s)| {
                matches!(s.work, Work::Spec { waiting_since: Some(t), planned: None, .. }
                    if t + self.await_drafts_us <= now_us)
            })
            .map(|(&id, _)| id)
            .collect();
        for id in waited {
            self.proceed(id, &mut events);
        }
        self.mark_quiet(now_us);
        if self.has_work() {
            let before = (self.stats.self_draft_guesses, self.stats.self_drafted);
            let it = self.iterate(now_us);
            let (guessed, accepted) = (
                self.stats.self_draft_guesses - before.0,
                self.stats.self_drafted - before.1,
            );
            if guessed > 0 {
                turn.observations
                    .push(Observation::SelfDrafted { guessed, accepted });
            }
            let e = it.events;
            if let Some(f) = it.forward {
                let (sessions, tokens) = (f.sessions, f.tokens);
                let us = u64::from(f.us);
                let ms = us as f64 / 1e3;
                self.iteration_ms += 0.1 * (ms - self.iteration_ms);
                self.position_fit.observe(tokens, ms);
                turn.ends_us = now_us + us;
                self.control.on_forward(turn.ends_us, tokens, ms);
                tracing::trace!(tokens, sessions, ms, contended = f.contended, "forward");
                self.adapt_contended(tokens, ms, f.contended);
                turn.forward = Some(ForwardDone {
                    sessions,
                    tokens,
                    us,
                });
            } else {
                turn.throttled = e.is_empty();
            }
            events.extend(e);
        }
        for e in events {
            self.stamp(e, &mut turn);
        }
        // Sessions over with this turn's messages: a finished or failed generation, a session
        // that failed for good.
        self.now_us = self.now_us.max(turn.ends_us);
        self.close_ended();
        turn.finished = self.take_finished();
        turn
    }

    /// Put the speculation sessions whose edge has said nothing for
    /// [`crate::LoadConfig::quiet_ms`] in
    /// the scheduler's background, and those whose edge spoke since back in the foreground.
    fn mark_quiet(&mut self, now_us: u64) {
        let Some(quiet_us) = self.load.quiet_ms.map(|ms| ms.saturating_mul(1000)) else {
            return;
        };
        let mut quiet = 0;
        for (&id, s) in &self.sessions {
            let q = match &s.work {
                Work::Spec { vs, .. } => {
                    // Silent for the quiet time, and either silent since its Open or owing
                    // acks: an edge that is there acks every ACK_EVERY tokens it receives, so
                    // one that spoke is quiet only once twice that many wait unacknowledged
                    // (a verifier slow under load, with an edge that only acks, is not).
                    let owes = vs
                        .as_ref()
                        .is_none_or(|vs| vs.unacked() >= 2 * tandem_spec::ACK_EVERY);
                    now_us.saturating_sub(s.meter.spoke_us) >= quiet_us && (!s.meter.spoke || owes)
                }
                _ => false,
            };
            quiet += usize::from(q);
            self.sched.set_background(id, q);
        }
        self.stats.quiet_sessions = quiet;
    }

    /// The admissions of the sessions opened since the last turn (`Admitted`), to
    /// send now: a driver calls this before a turn whose forward (the first chunk of their
    /// prefill, other sessions' work) would hold them back, so that an edge's connect timeout
    /// never counts a forward. A turn sends those left, first.
    pub fn admissions(&mut self) -> Vec<Outgoing<H>> {
        let mut out = Vec::new();
        let sessions = &self.sessions;
        self.held.retain(|e| match e {
            Event::Admitted { session } => {
                if let Some(s) = sessions.get(session) {
                    out.push(Outgoing {
                        session: *session,
                        to: s.handle.clone(),
                        msg: ToEdge::Admitted {
                            cached: s.counts.cached,
                        },
                    });
                }
                false
            }
            _ => true,
        });
        out
    }

    /// Turn an event into its edge's message as of the turn's end: grants, the session's pace
    /// and the α the grant plans with, and the observations of its timing.
    fn stamp(&mut self, e: Event, turn: &mut Turn<H>) {
        let at = turn.ends_us;
        let id = e.session();
        let Some(s) = self.sessions.get_mut(&id) else {
            return; // closed since (its edge hung up)
        };
        let obs = &mut turn.observations;
        let msg = match e {
            Event::Admitted { .. } => ToEdge::Admitted {
                cached: s.counts.cached,
            },
            Event::Opened {
                first,
                first_logprob,
                ..
            } => {
                let grant = self.control.on_opened(&mut s.ctl);
                s.counts.first_token_us = Some(at);
                // Its edge may have waited for this answer: its idle time starts now.
                s.meter.heard_us = s.meter.heard_us.max(at);
                if let Some(idle) = self.load.idle_timeout_ms {
                    let due = at.saturating_add(idle.saturating_mul(1000));
                    self.idle_check_us = self.idle_check_us.min(due);
                }
                obs.push(first_token(&mut s.meter, at));
                ToEdge::Opened {
                    first,
                    grant,
                    cached: s.counts.cached,
                    first_logprob,
                }
            }
            Event::Verdict {
                mut verdict,
                drafted,
                accepted,
                positions,
                ..
            } => {
                self.control
                    .on_verdict(&mut s.ctl, &mut verdict, drafted, accepted, positions, at);
                // Blocks before this one were answered or went stale.
                while let Some(&(b, t)) = s.meter.arrivals.front() {
                    if b > verdict.block {
                        break;
                    }
                    s.meter.arrivals.pop_front();
                    if b == verdict.block && drafted > 0 {
                        obs.push(Observation::QueueTime {
                            seconds: at.saturating_sub(t) as f64 / 1e6,
                        });
                    }
                }
                s.counts.drafted += drafted;
                s.counts.accepted += accepted;
                if drafted > 0 {
                    obs.push(Observation::Verified {
                        tenant: s.tenant,
                        drafted,
                        accepted,
                        positions,
                    });
                }
                obs.extend(inter_token(&mut s.meter, at, accepted + 1));
                ToEdge::Verdict(verdict)
            }
            Event::Token { token, done, .. } => {
                if s.meter.last_commit_us.is_none() {
                    s.counts.first_token_us = Some(at);
                    obs.push(first_token(&mut s.meter, at));
                } else {
                    obs.extend(inter_token(&mut s.meter, at, 1));
                }
                ToEdge::Token { token, done }
            }
            Event::Decoded {
                mut decoded,
                drafted,
                ..
            } => {
                if drafted {
                    s.counts.drafted += 1;
                    s.counts.accepted += 1;
                } else {
                    s.counts.decoded += 1;
                }
                self.control.on_decoded(&mut s.ctl, &mut decoded, at);
                obs.extend(inter_token(&mut s.meter, at, 1));
                ToEdge::Decoded(decoded)
            }
            Event::Error { error, fatal, .. } => {
                s.counts.failed |= fatal;
                ToEdge::Error {
                    error,
                    retry_after_ms: None,
                    fatal,
                }
            }
            Event::Preempted { .. } => {
                turn.preemptions += 1;
                return;
            }
            Event::Logprobs { entries, .. } => ToEdge::Logprobs(entries),
        };
        turn.out.push(Outgoing {
            session: id,
            to: s.handle.clone(),
            msg,
        });
    }
}

/// The session's first token reached its edge at `at`.
fn first_token(m: &mut Meter, at: u64) -> Observation {
    m.last_commit_us = Some(at);
    Observation::FirstToken {
        seconds: at.saturating_sub(m.opened_us) as f64 / 1e6,
    }
}

/// `tokens` tokens committed at `at` share the time since the last commit.
fn inter_token(m: &mut Meter, at: u64, tokens: usize) -> Option<Observation> {
    let last = m.last_commit_us.replace(at)?;
    let tokens = tokens.max(1);
    Some(Observation::InterToken {
        seconds: at.saturating_sub(last) as f64 / 1e6 / tokens as f64,
        tokens,
    })
}

#[cfg(test)]
mod tests;
