//! Blocks arriving from an edge, and the takeover of a speculation session: what the core decides
//! without a forward, and the work it hands the scheduler.

use tandem_sched::SessionId;
use tandem_spec::{Block, BlockAction, DecodeAction};

use crate::session::{Event, Takeover, Work};
use crate::verifier_core::{VerifierCore, MAX_QUEUED_BLOCKS};
use crate::{Target, VerifierError};

impl<T: Target, H> VerifierCore<T, H> {
    /// A draft block for `id`: queued behind the block in verification, or judged at once (a
    /// stale block is dropped, a first token that contradicts the pending prediction is answered
    /// without a forward). Returns what can be answered now.
    pub fn draft(&mut self, id: SessionId, block: Block) -> Vec<Event> {
        let Some(s) = self.sessions.get_mut(&id) else {
            return vec![Event::Error {
                session: id,
                error: VerifierError::UnknownSession(id),
                fatal: false,
            }];
        };
        let Work::Spec { queue, .. } = &mut s.work else {
            return vec![Event::Error {
                session: id,
                error: VerifierError::Invalid(format!(
                    "session {id} is a cloud-only generation: it takes no drafts"
                )),
                fatal: false,
            }];
        };
        if queue.len() >= MAX_QUEUED_BLOCKS {
            return vec![Event::Error {
                session: id,
                error: VerifierError::Invalid(format!(
                    "draft.block: {} blocks already wait for verification (at most {MAX_QUEUED_BLOCKS})",
                    queue.len()
                )),
                fatal: false,
            }];
        }
        queue.push_back(block);
        let mut events = Vec::new();
        self.advance(id, &mut events);
        events
    }

    /// Move `id`'s queued blocks on while nothing of it is planned: stale blocks are dropped,
    /// early verdicts answered, the first block that needs the target is enqueued.
    pub(crate) fn advance(&mut self, id: SessionId, events: &mut Vec<Event>) {
        let budget = self.sched.config().token_budget;
        let Some(s) = self.sessions.get_mut(&id) else {
            return;
        };
        let Work::Spec {
            vs: Some(vs),
            queue,
            inflight,
            takeover: None,
            ..
        } = &mut s.work
        else {
            return;
        };
        while inflight.is_none() {
            let Some(b) = queue.pop_front() else { break };
            let before = vs.clone();
            let refuse = |e: VerifierError| Event::Error {
                session: id,
                error: e,
                fatal: false,
            };
            match vs.on_block(&b) {
                Ok(BlockAction::Stale) => self.stats.blocks_stale += 1,
                Ok(BlockAction::Verdict(v)) => {
                    self.stats.blocks_early += 1;
                    events.push(Event::Verdict {
                        session: id,
                        verdict: v,
                        drafted: 0,
                        positions: 0,
                    });
                }
                Ok(BlockAction::Forward(plan)) => {
                    if plan.tokens.len() > budget {
                        *vs = before;
                        events.push(refuse(VerifierError::Invalid(format!(
                            "draft.tokens: a block of {} tokens exceeds the verifier's token budget {budget}",
                            b.tokens.len()
                        ))));
                        continue;
                    }
                    if let Err(e) = self.sched.enqueue_verify(id, plan.tokens.len()) {
                        // It could never be computed (the session outgrew the KV cache).
                        *vs = before;
                        events.push(refuse(e.into()));
                        continue;
                    }
                    *inflight = Some((b, plan, before));
                }
                Err(e) => {
                    *vs = before;
                    events.push(refuse(e.into()));
                }
            }
        }
    }

    /// Move a speculation session on: its next block, or its next decoded token when the verifier
    /// has taken it over.
    pub(crate) fn proceed(&mut self, id: SessionId, events: &mut Vec<Event>) {
        let taken_over = matches!(
            self.sessions.get(&id).map(|s| &s.work),
            Some(Work::Spec {
                takeover: Some(_),
                ..
            })
        );
        if taken_over {
            self.takeover_next(id, events);
        } else {
            self.advance(id, events);
        }
    }

    /// Take a speculation session over (`on`) and decode it like a cloud-only generation, each
    /// token an [`Event::Decoded`] — what a saturated verifier does, since a verified position
    /// costs it as much as a decoded one and rejected ones are waste — or hand it back after the
    /// next token (`!on`). A session not yet prefilled is taken over once it is.
    pub fn set_takeover(&mut self, id: SessionId, on: bool) -> Vec<Event> {
        let mut events = Vec::new();
        let Some(s) = self.sessions.get_mut(&id) else {
            return events;
        };
        let Work::Spec {
            takeover, inflight, ..
        } = &mut s.work
        else {
            return events;
        };
        match (on, takeover.as_mut()) {
            (true, Some(c)) => c.stop = false,
            (true, None) => {
                *takeover = Some(Takeover {
                    stop: false,
                    step: None,
                });
                // A block already planned is verified first; the takeover follows its verdict.
                if inflight.is_none() {
                    self.takeover_next(id, &mut events);
                }
            }
            (false, Some(c)) => c.stop = true,
            (false, None) => {}
        }
        events
    }

    /// The next step of a session the verifier decodes: tokens known at once are sent at once,
    /// then one forward is enqueued. Hands the session back when asked to, and ends it at its
    /// limit or end-of-generation token.
    pub(crate) fn takeover_next(&mut self, id: SessionId, events: &mut Vec<Event>) {
        let Some(s) = self.sessions.get_mut(&id) else {
            return;
        };
        let Work::Spec {
            vs: Some(vs),
            inflight: None,
            takeover: Some(c),
            limit,
            eog,
            ..
        } = &mut s.work
        else {
            return;
        };
        if c.step.is_some() {
            return;
        }
        let handed_back = loop {
            if vs.committed_len() >= *limit {
                return; // the edge has every token it asked for and closes
            }
            let before = vs.clone();
            match vs.decode() {
                Ok(DecodeAction::Ready(d)) => {
                    let end = eog.contains(&d.token) || vs.committed_len() >= *limit;
                    let handback = c.stop && !end;
                    events.push(Event::Decoded {
                        session: id,
                        decoded: d,
                        handback,
                    });
                    if end {
                        return;
                    }
                    if handback {
                        break true;
                    }
                }
                Ok(DecodeAction::Forward(plan)) => {
                    if let Err(e) = self.sched.enqueue_verify(id, plan.tokens.len()) {
                        *vs = before;
                        events.push(Event::Error {
                            session: id,
                            error: e.into(),
                            fatal: true,
                        });
                        self.ended.push(id);
                        return;
                    }
                    c.step = Some((plan, before));
                    return;
                }
                Err(e) => {
                    *vs = before;
                    events.push(Event::Error {
                        session: id,
                        error: e.into(),
                        fatal: true,
                    });
                    self.ended.push(id);
                    return;
                }
            }
        };
        if handed_back {
            if let Work::Spec { takeover, .. } = &mut s.work {
                *takeover = None;
            }
            self.advance(id, events);
        }
    }
}
