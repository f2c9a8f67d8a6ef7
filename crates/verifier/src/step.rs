//! One iteration of the verifier: the scheduler's plan, one ragged forward of the target over it,
//! and the verdicts and tokens folded from its logits.

use tandem_engine::{EngineError, Logits, Parent, SeqChunk, SeqId, Wanted};
use tandem_sched::{Batch, SessionId, WorkKind};
use tandem_spec::sampling::token_logprob;
use tandem_spec::verify::judge_run;
use tandem_spec::{CloudSession, Decoded, Verdict, VerifyRule};

use crate::session::{Event, Scheduled, Work};
use crate::verifier_core::VerifierCore;
use crate::{Target, VerifierError};

/// What one iteration did: its events, and the forward it ran (None: nothing to run, or the
/// forward failed).
pub(crate) struct Iteration {
    pub events: Vec<Event>,
    pub forward: Option<Forward>,
}

/// A forward that ran: sessions and tokens in it, its time (µs, as the target timed it), and
/// whether it was planned while tenants shared the verifier.
pub(crate) struct Forward {
    pub sessions: usize,
    pub tokens: usize,
    pub us: u32,
    pub contended: bool,
}

impl<T: Target, H> VerifierCore<T, H> {
    /// Close the sessions that ended in the last iteration.
    pub(crate) fn close_ended(&mut self) {
        for id in std::mem::take(&mut self.ended) {
            self.close(id);
        }
    }

    /// One iteration, leaving the sessions that ended open until
    /// [`VerifierCore::close_ended`] (their last messages still go out through their records).
    pub(crate) fn iterate(&mut self, now_us: u64) -> Iteration {
        let mut plan = self.sched.schedule(now_us);
        self.widen_self_drafts(&mut plan);
        tracing::trace!(
            chunks = ?plan.chunks.iter().map(|c| (c.session.0, c.kind, c.start, c.len)).collect::<Vec<_>>(),
            "plan"
        );
        let mut events: Vec<Event> = plan
            .preempted
            .iter()
            .map(|&session| Event::Preempted { session })
            .collect();
        if plan.chunks.is_empty() {
            return Iteration {
                events,
                forward: None,
            };
        }
        let mut chunks = Vec::with_capacity(plan.chunks.len());
        let mut tables = Vec::with_capacity(plan.chunks.len());
        for c in &plan.chunks {
            let s = &self.sessions[&c.session];
            let seq = SeqId(c.session.0);
            let chunk = match (c.kind, &s.work) {
                (WorkKind::Prefill, work) => {
                    let end = c.start + c.len;
                    let prefilled = match work {
                        Work::Spec { vs, .. } => vs.is_some(),
                        Work::Generation { next, .. } => next.is_some(),
                    };
                    if prefilled {
                        self.stats.recomputed_tokens += c.len as u64;
                    }
                    let wants_first = !prefilled && end == s.history.len();
                    let wanted = if wants_first {
                        Wanted::Last
                    } else {
                        Wanted::None
                    };
                    SeqChunk::new(seq, c.start, s.history[c.start..end].to_vec(), wanted)
                }
                (WorkKind::Decode, Work::Spec { planned, .. }) => {
                    let p = planned
                        .as_ref()
                        .expect("invariant: a planned session has its plan")
                        .feed();
                    assert_eq!(
                        (p.start_pos, p.tokens.len()),
                        (c.start, c.len),
                        "invariant: the scheduler's step matches the session's plan"
                    );
                    let wanted = Wanted::At(p.logits_at.clone());
                    if p.is_tree() {
                        // Token 0 continues the sequence; the others hang in the tree.
                        let parents = p
                            .parents
                            .iter()
                            .enumerate()
                            .map(|(i, &q)| match i {
                                0 => Parent::Previous,
                                _ => Parent::Slot(c.start + q),
                            })
                            .collect();
                        SeqChunk::tree(seq, c.start, p.tokens.clone(), parents, wanted)
                    } else {
                        SeqChunk::new(seq, c.start, p.tokens.clone(), wanted)
                    }
                }
                (WorkKind::Decode, Work::Generation { next, guesses, .. }) => {
                    let t = next.expect("invariant: a decode step follows the prefill");
                    let mut tokens = vec![t];
                    tokens.extend_from_slice(guesses);
                    assert_eq!(
                        tokens.len(),
                        c.len,
                        "invariant: the scheduler's step matches the generation's guesses"
                    );
                    let wanted = Wanted::At((0..tokens.len()).collect());
                    SeqChunk::new(seq, c.start, tokens, wanted)
                }
            };
            chunks.push(chunk);
            tables.push(c.pages.clone());
        }
        // A session's first prefill chunk ends its wait in the queue.
        for c in plan
            .chunks
            .iter()
            .filter(|c| c.kind == WorkKind::Prefill && c.start == 0)
        {
            if let Some(s) = self.sessions.get_mut(&c.session) {
                s.counts.scheduled_us.get_or_insert(self.now_us);
            }
        }
        let n: usize = plan.tokens();
        let avg = &mut self.stats.tokens_per_forward;
        *avg += 0.2 * (n as f64 - *avg);
        let (forward, verify_us) = self.engine.forward_timed(&chunks, &tables);
        let ran = match forward {
            Ok(logits) => {
                self.stats.target_forwards += 1;
                self.fold(&plan, &logits, verify_us, &mut events);
                Some(Forward {
                    sessions: chunks.len(),
                    tokens: n,
                    us: verify_us,
                    contended: plan.contended,
                })
            }
            Err(e) => {
                self.failed(&plan, e, &mut events);
                None
            }
        };
        Iteration {
            events,
            forward: ran,
        }
    }

    /// Verdicts and tokens from a forward's logits, then the scheduler's update.
    fn fold(&mut self, plan: &Batch, logits: &Logits, verify_us: u32, events: &mut Vec<Event>) {
        let mut kv_len = Vec::new();
        let mut follow = Vec::new();
        let mut enqueue = Vec::new();
        for c in &plan.chunks {
            let id = c.session;
            let seq = SeqId(id.0);
            let s = self
                .sessions
                .get_mut(&id)
                .expect("invariant: planned sessions are open");
            match (c.kind, &mut s.work) {
                (WorkKind::Prefill, work) => {
                    let Some(row) = logits.last_for(seq) else {
                        continue; // a chunk of a longer prompt, or a recompute
                    };
                    // A constrained session draws its first token from the masked row.
                    let first = match constrained_sample(
                        &mut s.grammar,
                        row,
                        &s.params,
                        s.prompt_len as u64,
                    ) {
                        Ok(t) => t,
                        Err(e) => {
                            end_with(events, &mut self.ended, id, e);
                            continue;
                        }
                    };
                    match work {
                        Work::Spec {
                            rule,
                            vs,
                            queue,
                            self_draft,
                            ..
                        } => {
                            // Positions end at the context, or where the KV pool ends.
                            let pool = self.sched.pool();
                            let max_len = self
                                .engine
                                .context_len()
                                .min(pool.num_pages() * pool.page_size());
                            let mut cs = CloudSession::new(
                                *rule,
                                s.params,
                                &s.history[..s.prompt_len],
                                first,
                                max_len,
                            );
                            if let Some(g) = s.grammar.take() {
                                // Its state is already past `first`.
                                cs = cs.constrain(*g);
                            }
                            if let (true, Some(policy)) = (*self_draft, self.self_draft) {
                                cs = cs.with_self_draft(policy, &self.guess_record);
                            }

                            let mut first_logprob = None;
                            if let Some(top) = s.logprobs {
                                cs = cs.with_logprobs(top);
                                first_logprob = Some(token_logprob(row, first, s.prompt_len, top));
                            }
                            events.push(Event::Opened {
                                session: id,
                                first,
                                first_logprob,
                            });
                            // Blocks that came while the prompt was prefilled: checked now, in
                            // the order they came, each refused by name as on arrival.
                            queue.retain(|b| match cs.check(b).and_then(|()| cs.accept_index(b)) {
                                Ok(()) => true,
                                Err(e) => {
                                    events.push(Event::Error {
                                        session: id,
                                        error: e.into(),
                                        fatal: false,
                                    });
                                    false
                                }
                            });
                            *vs = Some(cs);
                            follow.push(id);
                        }
                        Work::Generation {
                            next,
                            produced,
                            max_tokens,
                            eog,
                            suffix,
                            ..
                        } => {
                            if let Some(d) = suffix {
                                d.push(first);
                            }
                            *produced = 1;
                            let done = *max_tokens <= 1 || eog.contains(&first);
                            *next = Some(first);
                            events.push(Event::Token {
                                session: id,
                                token: first,
                                done,
                            });
                            if done {
                                self.ended.push(id);
                            } else {
                                enqueue.push(id);
                            }
                        }
                    }
                }
                (
                    WorkKind::Decode,
                    Work::Spec {
                        vs,
                        planned,
                        draft,
                        queue,
                        ..
                    },
                ) => {
                    let vs = vs.as_mut().expect("invariant: prefilled");
                    match planned.take().expect("invariant: planned") {
                        Scheduled::Decode { feed } => {
                            let rows: Vec<&[f32]> = logits.for_seq(seq).map(|(_, r)| r).collect();
                            let run = match vs.finish_decode_run(&feed, &rows) {
                                Ok(run) => {
                                    logprobs_of(vs, id, events);
                                    run
                                }
                                Err(e) => {
                                    // Only a grammar that cannot go on fails a decode.
                                    end_with(events, &mut self.ended, id, e.into());
                                    continue;
                                }
                            };
                            // The KV keeps the accepted guesses, not the rejected ones.
                            s.history.truncate(feed.start_pos);
                            s.history.extend_from_slice(&feed.tokens);
                            s.history.truncate(vs.kv_len());
                            kv_len.push((id, vs.kv_len()));
                            self.stats.spec_decoded += 1;
                            self.stats.self_draft_guesses += run.guessed as u64;
                            self.stats.self_drafted += run.accepted as u64;
                            if let Some(j) = &run.judged {
                                self.guess_record.judge(j);
                            }
                            for decoded in run.decoded {
                                events.push(Event::Decoded {
                                    session: id,
                                    decoded,
                                    drafted: false,
                                });
                            }
                        }
                        Scheduled::Verify { block: b, feed: p } => {
                            let rows: Vec<&[f32]> = logits.for_seq(seq).map(|(_, r)| r).collect();
                            self.stats.blocks_verified += 1;
                            match vs.finish(&b, &p, &rows) {
                                Ok(f) => {
                                    logprobs_of(vs, id, events);
                                    s.history.truncate(p.start_pos);
                                    s.history.push(p.tokens[0]);
                                    if p.is_tree() {
                                        s.history.extend(f.keep.iter().map(|&j| p.tokens[j]));
                                        let slots: Vec<usize> =
                                            f.keep.iter().map(|&j| p.start_pos + j).collect();
                                        // A failed move is a broken invariant of the table, not
                                        // of the session: the verdict stands on the logits.
                                        self.engine
                                            .keep_path(&c.pages, p.start_pos + 1, &slots)
                                            .expect(
                                                "invariant: the path lies in the session's table",
                                            );
                                    } else {
                                        s.history.extend_from_slice(&p.tokens[1..]);
                                    }
                                    s.history.truncate(f.kv_len);
                                    kv_len.push((id, f.kv_len));
                                    draft.record(f.accepted, f.judged.min(f.accepted + 1));
                                    if f.partial {
                                        // A block trimmed to the grant, right so far: its
                                        // tokens go out as decoded ones, the rest of it waits.
                                        self.stats.partial_verifies += 1;
                                        let from = p.start_pos + 1;
                                        let told = &vs.committed()[from..=from + f.accepted];
                                        for (i, &token) in told.iter().enumerate() {
                                            events.push(Event::Decoded {
                                                session: id,
                                                decoded: Decoded {
                                                    epoch: f.verdict.epoch,
                                                    pos: from + i,
                                                    token,
                                                    grant: None,
                                                    guessed: false,
                                                },
                                                drafted: true,
                                            });
                                        }
                                        queue.push_front(b);
                                        follow.push(id);
                                        continue;
                                    }
                                    events.push(Event::Verdict {
                                        session: id,
                                        verdict: Verdict {
                                            verify_us,
                                            ..f.verdict
                                        },
                                        drafted: f.judged,
                                        accepted: f.accepted,
                                        positions: p.tokens.len(),
                                    });
                                }
                                // Refused before it changed anything, or a grammar that cannot
                                // go on (the session ends).
                                Err(e) => {
                                    kv_len.push((id, c.start));
                                    let fatal = matches!(e, tandem_spec::SpecError::Grammar(_));
                                    if fatal {
                                        self.ended.push(id);
                                    }
                                    events.push(Event::Error {
                                        session: id,
                                        error: e.into(),
                                        fatal,
                                    });
                                }
                            }
                        }
                    }
                    follow.push(id);
                }
                (
                    WorkKind::Decode,
                    Work::Generation {
                        next,
                        produced,
                        max_tokens,
                        eog,
                        suffix,
                        guesses,
                    },
                ) => {
                    let fed = next.expect("invariant: planned after the prefill");
                    s.history.push(fed);
                    // The new token's position is the history's length: the fed token's plus one.
                    let rows: Vec<&[f32]> = logits.for_seq(seq).map(|(_, r)| r).collect();
                    let g = std::mem::take(guesses);
                    let tokens = match judge_run(
                        VerifyRule::SampleMatch,
                        &s.params,
                        s.history.len(),
                        &g,
                        &rows,
                        s.grammar.as_deref_mut(),
                    ) {
                        Ok(t) => t,
                        Err(e) => {
                            end_with(events, &mut self.ended, id, grammar_error(e));
                            continue;
                        }
                    };
                    // The accepted guesses are in the KV; the rejected ones are cut.
                    let accepted = &tokens[..tokens.len() - 1];
                    s.history.extend_from_slice(accepted);
                    kv_len.push((id, s.history.len()));
                    self.stats.self_draft_guesses += g.len() as u64;
                    self.stats.self_drafted += accepted.len() as u64;
                    if let Some(d) = suffix {
                        if let Some(j) = d.judged(g.len(), accepted.len()) {
                            self.guess_record.judge(&j);
                        }
                        d.extend(&tokens);
                    }
                    let mut done = false;
                    for &token in &tokens {
                        *produced += 1;
                        *next = Some(token);
                        done = *produced >= *max_tokens || eog.contains(&token);
                        events.push(Event::Token {
                            session: id,
                            token,
                            done,
                        });
                        if done {
                            break;
                        }
                    }
                    if done {
                        self.ended.push(id);
                    } else {
                        enqueue.push(id);
                    }
                }
            }
        }
        self.sched.update(plan, &kv_len);
        for c in &plan.chunks {
            if let Some(s) = self.sessions.get(&c.session) {
                self.sched.publish(c.session, &s.history);
            }
        }
        for id in follow {
            self.proceed(id, events);
        }
        for id in enqueue {
            // A generation that outgrew the KV cache ends with the reason.
            if let Err(e) = self.sched.enqueue_verify(id, 1) {
                events.push(Event::Error {
                    session: id,
                    error: e.into(),
                    fatal: true,
                });
                self.ended.push(id);
            }
        }
    }

    /// The engine refused the batch: nothing was computed. A speculation session is put back as
    /// it was (its block queued again, first) and planned again; cloud-only generations end with
    /// the error.
    fn failed(&mut self, plan: &Batch, e: EngineError, events: &mut Vec<Event>) {
        let msg = e.to_string();
        let kv_len: Vec<(SessionId, usize)> =
            plan.chunks.iter().map(|c| (c.session, c.start)).collect();
        self.sched.update(plan, &kv_len);
        let mut follow = Vec::new();
        for c in &plan.chunks {
            let Some(s) = self.sessions.get_mut(&c.session) else {
                continue;
            };
            let error = VerifierError::Engine(msg.clone());
            match &mut s.work {
                Work::Spec {
                    vs, planned, queue, ..
                } if c.kind == WorkKind::Decode => {
                    // The block goes back to the front of the queue, planned again (rebased) with
                    // the session's next forward; a decode step is planned again.
                    if let Some(Scheduled::Verify { block, .. }) = planned.take() {
                        queue.push_front(block);
                    }
                    follow.push(c.session);
                }
                Work::Generation { .. } => {
                    events.push(Event::Error {
                        session: c.session,
                        error,
                        fatal: true,
                    });
                    self.ended.push(c.session);
                }
                Work::Spec { .. } => {} // its prefill chunk is planned again
            }
        }
        for id in follow {
            self.proceed(id, events);
        }
    }
}

/// The target's token at `pos` from `row`, masked by `grammar` when the session is constrained
/// (which then follows the token).
fn constrained_sample(
    grammar: &mut Option<Box<tandem_spec::Grammar>>,
    row: &[f32],
    params: &tandem_spec::sampling::SamplingParams,
    pos: u64,
) -> Result<u32, VerifierError> {
    let rule = VerifyRule::SampleMatch;
    judge_run(
        rule,
        params,
        pos as usize,
        &[],
        &[row],
        grammar.as_deref_mut(),
    )
    .map(|t| t[0])
    .map_err(grammar_error)
}

fn grammar_error(e: tandem_spec::GrammarError) -> VerifierError {
    VerifierError::Grammar(e.to_string())
}

impl<T: Target, H> VerifierCore<T, H> {
    /// Give the sessions in `plan` that the verifier decodes alone and drafts for (a
    /// speculation session with no usable block, a cloud-only generation that asked) their own
    /// guesses to verify in the same forward, within the room the forward has below the ridge
    /// ([`VerifierCore::self_draft_room`]), shared evenly, and the KV pages free now
    /// ([`tandem_sched::Scheduler::widen`]): never at another session's expense.
    fn widen_self_drafts(&mut self, plan: &mut Batch) {
        if self.self_draft.is_none() {
            return;
        }
        let mut room = self.self_draft_room(plan);
        // A guessed position delays every session in the forward.
        let cost = self.position_cost() * plan.chunks.len() as f64;
        let alone: Vec<usize> = (0..plan.chunks.len())
            .filter(|&i| {
                let c = &plan.chunks[i];
                c.kind == WorkKind::Decode
                    && match &self.sessions[&c.session].work {
                        Work::Spec {
                            planned: Some(Scheduled::Decode { .. }),
                            vs: Some(vs),
                            ..
                        } => vs.self_drafts(),
                        Work::Generation {
                            suffix: Some(_), ..
                        } => true,
                        _ => false,
                    }
            })
            .collect();
        for (k, &i) in alone.iter().enumerate() {
            if room == 0 {
                break;
            }
            let share = room.div_ceil(alone.len() - k);
            let id = plan.chunks[i].session;
            let s = self
                .sessions
                .get_mut(&id)
                .expect("invariant: planned sessions are open");
            let mut guesses = match &mut s.work {
                Work::Spec {
                    vs: Some(vs),
                    limit,
                    eog,
                    ..
                } => vs.self_guesses(share, *limit, eog, cost),
                Work::Generation {
                    suffix: Some(d),
                    produced,
                    max_tokens,
                    eog,
                    ..
                } => {
                    // The token after the guesses is produced too.
                    let most = share.min(max_tokens.saturating_sub(*produced + 1));
                    d.guesses(most, eog, cost)
                }
                _ => Vec::new(),
            };
            if guesses.is_empty() {
                continue;
            }
            let got = self.sched.widen(plan, i, guesses.len());
            guesses.truncate(got);
            room -= got;
            if got == 0 {
                continue;
            }
            match &mut s.work {
                Work::Spec {
                    vs: Some(vs),
                    planned,
                    ..
                } => {
                    let feed = vs
                        .decode_feed_with(&guesses)
                        .expect("invariant: the guesses stop before the context limit");
                    *planned = Some(Scheduled::Decode { feed });
                }
                Work::Generation { guesses: g, .. } => *g = guesses,
                _ => {}
            }
        }
    }
}

/// The target's log-probabilities `vs` noted in this forward, as an event before the one that
/// commits their tokens.
fn logprobs_of(vs: &mut CloudSession, session: SessionId, events: &mut Vec<Event>) {
    let entries = vs.take_logprobs();
    if !entries.is_empty() {
        events.push(Event::Logprobs { session, entries });
    }
}

/// The session ends with `error` (its edge is told; it is closed after the iteration).
fn end_with(
    events: &mut Vec<Event>,
    ended: &mut Vec<SessionId>,
    session: SessionId,
    error: VerifierError,
) {
    events.push(Event::Error {
        session,
        error,
        fatal: true,
    });
    ended.push(session);
}
