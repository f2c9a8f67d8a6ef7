//! [`Driver`]: one speculation session on the wall clock — its IO-free core ([`EdgeSession`]), its
//! link to the verifier, what it committed and when. [`crate::run_with`] drives one with its own
//! drafter; `tandem serve` drives many, their draft steps batched into one forward. Either way
//! the driver asks what to do ([`Driver::poll`]), hands over a draft step's tokens
//! ([`Driver::grown`]) and recovers a lost connection ([`Driver::recover`]).

use std::time::Instant;

use tandem_spec::edge::{Reconnecting, RECONNECT_WINDOW_MS};
use tandem_spec::{EdgeSession, Frontier, Grown, Incoming, Next, Opened, Output, SessionConfig};

use crate::{EdgeError, Link, Proposal, SpecReport, Update};

/// What a session needs next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Want {
    /// A draft step: grow each leaf of this frontier by one token (`tokens()[..base]` first).
    Draft(Frontier),
    /// Nothing until a message arrives.
    Wait,
    /// It is over: every token it asked for is committed.
    Done,
}

/// One speculation session being driven. See the module docs.
pub struct Driver<L> {
    es: EdgeSession,
    pub link: L,
    start: Instant,
    /// Milliseconds from `start` to the commit of each output token.
    commit_ms: Vec<f64>,
    /// Tokens committed since the user was last shown them.
    fresh: Vec<u32>,
    draft_forwards: usize,
    /// How long a lost connection may take to reopen.
    reconnect_window_ms: u64,
}

impl<L: Link> Driver<L> {
    /// A session over `prompt`, open on the verifier behind `link`, which answered with the
    /// target's first token and the session's grant; `start` is the request's time.
    /// (`opened` None: the `Open` is still on its way, and the link delivers the first token as
    /// the commit of its position: see [`EdgeSession::opening`].)
    pub fn new(
        prompt: &[u32],
        opened: Option<Opened>,
        cfg: SessionConfig,
        eog: Vec<u32>,
        link: L,
        start: Instant,
        on_update: &mut impl FnMut(Update<'_>),
    ) -> Result<Self, EdgeError> {
        let now = start.elapsed().as_micros() as u64;
        let (es, out) = match opened {
            Some(o) => EdgeSession::new(now, prompt.to_vec(), o, cfg, eog)?,
            None => EdgeSession::opening(now, prompt.to_vec(), cfg, eog)?,
        };
        let mut d = Self {
            es,
            link,
            start,
            commit_ms: Vec::new(),
            fresh: Vec::new(),
            draft_forwards: 0,
            reconnect_window_ms: RECONNECT_WINDOW_MS,
        };
        d.apply(out)?;
        d.show(on_update, None);
        Ok(d)
    }

    /// Since the start, ms (the user's timings and the logs).
    fn now(&self) -> f64 {
        self.start.elapsed().as_secs_f64() * 1e3
    }

    /// Since the start, µs: the session's clock.
    fn now_us(&self) -> u64 {
        self.start.elapsed().as_micros() as u64
    }

    pub fn session(&self) -> &EdgeSession {
        &self.es
    }

    /// Carry out the core's outputs: blocks and acks go to the verifier, commits are recorded.
    /// (Rolling the draft back is the drafter's own business: it reconciles its KV with each
    /// step's leaves.)
    fn apply(&mut self, outs: Vec<Output>) -> Result<(), EdgeError> {
        for o in outs {
            match o {
                Output::Send(b) => {
                    tracing::debug!(
                        t = self.now(),
                        epoch = b.epoch,
                        start = b.start_pos,
                        len = b.tokens.len(),
                        "edge sends a block"
                    );
                    self.link.send(b)?
                }
                Output::Rollback { .. } => {}
                Output::Ack { committed } => self.link.ack(committed)?,
                Output::Commit { tokens, .. } => {
                    let t = self.now();
                    self.commit_ms.extend(std::iter::repeat_n(t, tokens.len()));
                    self.fresh.extend(tokens);
                }
            }
        }
        Ok(())
    }

    /// Show the user what was committed since the last time, and the tail as it stands.
    fn show(&mut self, on_update: &mut impl FnMut(Update<'_>), correction: Option<(u32, u32)>) {
        let p = self.es.pipeline();
        on_update(Update {
            committed: &self.fresh,
            tentative: &p.tokens()[p.committed_len()..],
            correction,
            stats: p.stats(),
        });
        self.fresh.clear();
    }

    /// Take every message that has arrived — waiting for one when `wait` and the session has
    /// nothing to draft — and say what it needs next. Returns the milliseconds spent waiting.
    pub fn poll(
        &mut self,
        wait: bool,
        on_update: &mut impl FnMut(Update<'_>),
    ) -> Result<(Want, f64), EdgeError> {
        let mut arrived = Vec::new();
        while let Some(v) = self.recv(false)? {
            arrived.push(v);
        }
        let mut idle_ms = 0.0;
        if wait && arrived.is_empty() && self.es.next() == Next::Wait {
            let w = Instant::now();
            let v = self.recv(true);
            // A wait that ends in a lost connection is a wait too.
            idle_ms = w.elapsed().as_secs_f64() * 1e3;
            tracing::debug!(t = self.now(), waited = idle_ms, "edge waited");
            arrived.push(v?.ok_or(EdgeError::LinkClosed)?);
        }
        for m in arrived {
            tracing::debug!(
                t = self.now(),
                msg = ?m,
                committed = self.es.pipeline().committed_len(),
                drafted = self.es.pipeline().tokens().len(),
                "edge receives"
            );
            let r = self.es.on_message(self.now_us(), m)?;
            self.apply(r.outputs)?;
            self.show(on_update, r.correction);
        }
        Ok((self.want(), idle_ms))
    }

    /// The link's next message. The verifier's refusal of one message (a block it found
    /// wrong) is not the end of the answer: the session is taken for lost and reopened over what
    /// is committed, which drops the refused block with the rest of the unverified tail.
    fn recv(&mut self, wait: bool) -> Result<Option<Incoming>, EdgeError> {
        match self.link.recv(wait) {
            Err(EdgeError::Refused(m)) => {
                tracing::warn!("the verifier refused a message ({m}): reopening the session");
                Err(EdgeError::LinkClosed)
            }
            r => r,
        }
    }

    /// How long [`Driver::recover`] keeps trying (default [`RECONNECT_WINDOW_MS`]).
    pub fn set_reconnect_window(&mut self, ms: u64) {
        self.reconnect_window_ms = ms;
    }

    /// What the session needs next, as things stand.
    pub fn want(&self) -> Want {
        match self.es.next() {
            Next::Done => Want::Done,
            Next::Wait => Want::Wait,
            Next::Draft => Want::Draft(self.es.frontier()),
        }
    }

    /// A draft forward's proposals as the session takes them, and whether that forward also
    /// fed the prompt; the forward counted.
    fn growth(&mut self, props: Vec<Proposal>) -> (Vec<Grown>, bool) {
        self.draft_forwards += 1;
        let prefill = props.first().is_some_and(|p| p.prefill);
        let grown = props
            .into_iter()
            .map(|p| Grown {
                token: p.token,
                q: p.q,
                hedge: p.hedge,
            })
            .collect();
        (grown, prefill)
    }

    /// The tokens the session's [`Want::Draft`] asked for, from a draft forward of `ms`.
    pub fn grown(
        &mut self,
        props: Vec<Proposal>,
        ms: f64,
        on_update: &mut impl FnMut(Update<'_>),
    ) -> Result<(), EdgeError> {
        let (grown, prefill) = self.growth(props);
        let outs = self.es.on_grown(self.now_us(), grown, ms, prefill)?;
        self.apply(outs)?;
        self.show(on_update, None);
        Ok(())
    }

    /// The tokens the session's [`Want::Draft`] `asked` for, from a draft forward of `ms`
    /// during which [`Driver::poll`] went on taking messages: they count when `asked` is still
    /// what the session would grow (else they are dropped, and the session asks again).
    pub fn grown_at(
        &mut self,
        asked: &tandem_spec::Frontier,
        props: Vec<Proposal>,
        ms: f64,
        on_update: &mut impl FnMut(Update<'_>),
    ) -> Result<(), EdgeError> {
        let (grown, prefill) = self.growth(props);
        let Some(outs) = self
            .es
            .on_grown_at(self.now_us(), asked, grown, ms, prefill)?
        else {
            return Ok(());
        };
        self.apply(outs)?;
        self.show(on_update, None);
        Ok(())
    }

    /// The edge's own time per step (outside draft forwards and waits), for its policy.
    pub fn on_edge_work(&mut self, ms: f64) {
        self.es.on_edge_work(ms);
    }

    /// The connection was lost: keep what is verified, drop the rest, and reopen over the
    /// committed history, trying within the reconnect window (waits doubling to 2 s, jittered,
    /// never shorter than a verifier's `retry-after-ms`). Returns whether the session is over; an
    /// error (the last refusal) when it could not be reopened in the window.
    pub fn recover(&mut self, on_update: &mut impl FnMut(Update<'_>)) -> Result<bool, EdgeError> {
        let outs = self.es.on_connection_lost();
        self.apply(outs)?;
        let lost = Instant::now();
        let (mut attempt, mut retry_after_ms, mut last) = (0, None, EdgeError::LinkClosed);
        let first = loop {
            let at = Reconnecting {
                attempt,
                elapsed_ms: lost.elapsed().as_millis() as u64,
                window_ms: self.reconnect_window_ms,
                retry_after_ms,
                jitter: jitter(),
            };
            let Some(r) = self.es.reopen(at) else {
                tracing::warn!(
                    "the verifier could not be reached again within {} ms ({attempt} tries): {last}",
                    self.reconnect_window_ms
                );
                return Err(last);
            };
            std::thread::sleep(std::time::Duration::from_millis(r.after_ms));
            match self.link.reopen(self.es.committed(), r.max_tokens) {
                Ok(t) => break t,
                Err(
                    e @ (EdgeError::LinkClosed | EdgeError::Refused(_) | EdgeError::Unreachable(_)),
                ) => {
                    retry_after_ms = None;
                    last = e;
                }
                Err(
                    e @ EdgeError::Busy {
                        retry_after_ms: ms, ..
                    },
                ) => {
                    retry_after_ms = Some(ms);
                    last = e;
                }
                Err(e) => return Err(e),
            }
            attempt += 1;
        };
        let outs = self.es.on_reopened(first);
        self.apply(outs)?;
        self.show(on_update, None);
        Ok(self.es.next() == Next::Done)
    }

    /// What the session did.
    pub fn report(&self) -> SpecReport {
        let p = self.es.pipeline();
        SpecReport {
            output_ids: p.output().to_vec(),
            commit_ms: self.commit_ms.clone(),
            stats: *p.stats(),
            draft_forwards: self.draft_forwards,
            measured: self.es.measured(),
        }
    }
}

/// A uniform draw in [0, 1) for the reconnect jitter (std's per-process random hasher keys).
pub(crate) fn jitter() -> f64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(Instant::now().elapsed().as_nanos());
    (h.finish() >> 11) as f64 / (1u64 << 53) as f64
}
