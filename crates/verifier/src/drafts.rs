//! Blocks arriving from an edge, and the plan of a speculation session's next forward: the
//! oldest usable block verified, or else the session's next token decoded by the verifier
//! itself. The verifier never idles a speculation session (unless told to wait a while for its
//! edge's blocks: [`crate::VerifierConfig::await_drafts_ms`]).

use tandem_sched::SessionId;
use tandem_spec::{Block, BlockAction};

use crate::session::{Event, Scheduled, Work};
use crate::verifier_core::{VerifierCore, MAX_QUEUED_BLOCKS};
use crate::{Target, VerifierError};

impl<T: Target, H> VerifierCore<T, H> {
    /// A draft block for `id`: checked and queued. It is planned with the session's next
    /// forward (rebased onto what is committed by then). Returns what can be answered now (a
    /// refusal).
    pub(crate) fn draft(&mut self, id: SessionId, block: Block) -> Vec<Event> {
        let refuse = |error: VerifierError| {
            vec![Event::Error {
                session: id,
                error,
                fatal: false,
            }]
        };
        let Some(s) = self.sessions.get_mut(&id) else {
            return refuse(VerifierError::UnknownSession(id));
        };
        let Work::Spec {
            queue, vs, limit, ..
        } = &mut s.work
        else {
            return refuse(VerifierError::Invalid(format!(
                "session {id} is a cloud-only generation: it takes no drafts"
            )));
        };
        // The edge keeps at most MAX_QUEUED_BLOCKS blocks in flight, and stops counting a block
        // when a correction makes it stale or a decoded token covers it; here such a block
        // waits until the next plan drops it unanswered. So the bound counts the blocks still
        // ahead of what is committed, and the queue as a whole is held to twice it.
        let ahead = match vs.as_ref() {
            Some(vs) => queue
                .iter()
                .filter(|b| {
                    b.epoch >= vs.epoch() && b.start_pos + b.tokens.len() > vs.committed_len()
                })
                .count(),
            None => queue.len(),
        };
        if ahead >= MAX_QUEUED_BLOCKS || queue.len() >= 2 * MAX_QUEUED_BLOCKS {
            return refuse(VerifierError::Invalid(format!(
                "draft.block: {ahead} blocks already wait for verification (at most {MAX_QUEUED_BLOCKS})",
            )));
        }
        match vs.as_mut() {
            Some(vs) => {
                if let Err(e) = vs.check(&block).and_then(|()| vs.accept_index(&block)) {
                    return refuse(e.into());
                }
            }
            // Its prompt is being prefilled: an edge that drafts from its Open on sent it. It
            // waits in the queue and is checked when the session opens (`check_early`); only
            // its size now, so that what waits stays within the session's own reach.
            None => {
                let nodes = block.tokens.len() + block.side.len();
                if block.start_pos.saturating_add(nodes) > *limit {
                    return refuse(VerifierError::Invalid(format!(
                        "draft: block {} reaches position {}, past the session's limit {}",
                        block.index,
                        block.start_pos.saturating_add(nodes),
                        limit
                    )));
                }
                queue.push_back(block);
                return Vec::new();
            }
        }
        queue.push_back(block);
        let mut events = Vec::new();
        self.proceed(id, &mut events);
        events
    }

    /// Plan `id`'s next forward: blocks that need no forward are dropped on the way (stale,
    /// covered, contradicted — none is answered), the oldest that needs one is verified, and with
    /// none (or when the session is taken over) its next token is decoded. A decode step already
    /// planned (not yet run) becomes the verify when a usable block has come; a planned verify
    /// stands. A session that reached its limit or end-of-generation token plans nothing more.
    pub(crate) fn proceed(&mut self, id: SessionId, events: &mut Vec<Event>) {
        let budget = self.sched.config().token_budget;
        let Some(s) = self.sessions.get_mut(&id) else {
            return;
        };
        let taken_over = s.ctl.is_cloud();
        // Waiting for the edge's blocks (protocol 1's rule, for a while): every block is
        // verified, and a token decoded alone only once the wait ran out; no wait where the
        // verifier decodes the session anyway (taken over, or granted γ 0).
        let patience = match taken_over || !self.control.drafts_granted(&s.ctl) {
            true => 0,
            false => self.await_drafts_us,
        };
        let now_us = self.now_us;
        // The current grant is enforced: a block drafted under a larger one (in flight when the
        // grant shrank, or from an edge that ignores it) is trimmed to it, not refused.
        let most = match s.ctl.granted().draft_len {
            0 => usize::MAX,
            g => g as usize,
        };
        let Work::Spec {
            vs: Some(vs),
            queue,
            planned,
            draft,
            waiting_since,
            limit,
            eog,
            ..
        } = &mut s.work
        else {
            return;
        };
        // A decode step not yet run becomes a block's verify when a usable block is queued.
        let upgrade = match planned {
            None => false,
            Some(Scheduled::Decode { .. }) => true,
            Some(Scheduled::Verify { .. }) => return,
        };
        if vs.committed_len() >= *limit || vs.committed().last().is_some_and(|t| eog.contains(t)) {
            return; // the edge has every token it asked for and closes
        }
        if !vs.window_open() {
            return; // its edge is not reading: nothing more until it acks (see Self::ack)
        }
        let refuse = |e: VerifierError| Event::Error {
            session: id,
            error: e,
            fatal: false,
        };
        // Planning a block changes the session only when it drops the block (a contradiction, or a
        // token tree diverted, moves the epoch):
        // a plan to verify, or a refusal, leaves it as it was, so nothing needs putting back.
        while let Some(b) = queue.front() {
            let action = vs.block_action_within(b, most);
            tracing::debug!(
                session = id.0,
                committed = vs.committed_len(),
                start = b.start_pos,
                len = b.tokens.len(),
                epoch = b.epoch,
                action = ?action.as_ref().map(|a| match a {
                    BlockAction::Forward(f) => format!("forward {}", f.tokens.len()),
                    other => format!("{other:?}"),
                }),
                "verifier plans a block"
            );
            match action {
                Ok(BlockAction::Stale) => {}
                Ok(BlockAction::Covered) => {
                    self.stats.blocks_covered += 1;
                    draft.record(b.tokens.len(), b.tokens.len());
                }
                Ok(BlockAction::Contradicted { pos }) => {
                    self.stats.blocks_contradicted += 1;
                    draft.record(pos - b.start_pos, pos - b.start_pos + 1);
                }
                Ok(BlockAction::Forward(feed))
                    if !taken_over && (patience > 0 || draft.verify(b.index)) =>
                {
                    // A block too large for one forward could never be verified, nor could one
                    // of a session that outgrew the KV cache: the session ends with the reason
                    // (dropping the block would leave the two sides' epochs apart).
                    let refused = if feed.tokens.len() > budget {
                        Err(VerifierError::Invalid(format!(
                            "draft.tokens: a block of {} tokens to feed exceeds the verifier's token budget {budget}",
                            feed.tokens.len()
                        )))
                    } else if upgrade {
                        self.sched
                            .replace_verify(id, feed.tokens.len())
                            .map_err(VerifierError::from)
                    } else {
                        self.sched
                            .enqueue_verify(id, feed.tokens.len())
                            .map_err(VerifierError::from)
                    };
                    if let Err(e) = refused {
                        events.push(Event::Error {
                            session: id,
                            error: e,
                            fatal: true,
                        });
                        self.ended.push(id);
                        return;
                    }
                    let block = queue.pop_front().expect("invariant: front");
                    *planned = Some(Scheduled::Verify { block, feed });
                    *waiting_since = None;
                    return;
                }
                // Taken over, or a draft not worth verifying: the block waits until the decoded
                // tokens cover it.
                Ok(BlockAction::Forward(_)) => break,
                Err(e) => events.push(refuse(e.into())),
            }
            queue.pop_front();
        }
        if upgrade {
            return; // the decode step stands
        }
        if patience > 0 {
            let since = *waiting_since.get_or_insert(now_us);
            if now_us < since + patience {
                return; // it waits for its edge's next block (see VerifierCore::wake_at_us)
            }
        }
        *waiting_since = None;
        let fatal = |e: VerifierError| Event::Error {
            session: id,
            error: e,
            fatal: true,
        };
        match vs.decode_feed() {
            Ok(feed) => match self.sched.enqueue_verify(id, feed.tokens.len()) {
                Ok(()) => *planned = Some(Scheduled::Decode { feed }),
                Err(e) => {
                    events.push(fatal(e.into()));
                    self.ended.push(id);
                }
            },
            Err(e) => {
                events.push(fatal(e.into()));
                self.ended.push(id);
            }
        }
    }

    /// The edge of `id` has received its first `committed` tokens: a session held back by flow
    /// control goes on. An ack beyond the committed tokens is refused (the session goes on).
    pub(crate) fn ack(&mut self, id: SessionId, committed: usize) -> Vec<Event> {
        let mut events = Vec::new();
        let Some(Work::Spec { vs: Some(vs), .. }) = self.sessions.get_mut(&id).map(|s| &mut s.work)
        else {
            return events;
        };
        if let Err(e) = vs.ack(committed) {
            events.push(Event::Error {
                session: id,
                error: e.into(),
                fatal: false,
            });
        }
        self.proceed(id, &mut events);
        events
    }

    /// Take a speculation session over (`on`): the verifier verifies none of its blocks and
    /// decodes every token, as for a cloud-only generation — what a saturated verifier does,
    /// since a verified position costs it as much as a decoded one. Its edge is told to draft
    /// nothing (a grant of γ 0) with the next token, and is told its grant again when the session
    /// is handed back (`!on`). The load control has already marked the session.
    pub(crate) fn set_takeover(&mut self, id: SessionId, on: bool) -> Vec<Event> {
        let mut events = Vec::new();
        if let Some(s) = self.sessions.get_mut(&id) {
            s.ctl.set_cloud(on);
        }
        self.proceed(id, &mut events);
        events
    }
}
