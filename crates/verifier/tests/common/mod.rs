//! What the verifier core's tests share: a one-hot target (its greedy token after `token` at
//! `pos` is [`next`], every forward takes 10 µs, and forwards fail while its `fail` flag is set),
//! and a [`Driver`] that drives a core through its one API, as the batcher and the simulator do.
#![allow(dead_code)]

use std::cell::Cell;
use std::rc::Rc;

use tandem_engine::{EngineError, Logits, SeqChunk};
use tandem_sched::{SessionId, TenantId};
use tandem_spec::sampling::SamplingParams;
use tandem_spec::{Block, Shape, VerifyRule};
use tandem_verifier::{Inbound, Mode, NewSession, Target, ToEdge, VerifierConfig, VerifierCore};

pub const VOCAB: usize = 16;

/// The target's greedy token after `token` at `pos`.
pub fn next(pos: usize, token: u32) -> u32 {
    ((pos as u32 * 7 + token) % 15) + 1
}

/// The target's greedy continuation of `prompt`, `n` tokens.
pub fn oracle(prompt: &[u32], n: usize) -> Vec<u32> {
    let mut seq = prompt.to_vec();
    for _ in 0..n {
        let p = seq.len() - 1;
        seq.push(next(p, seq[p]));
    }
    seq[prompt.len()..].to_vec()
}

pub struct OneHot {
    pub fail: Rc<Cell<bool>>,
}

impl Target for OneHot {
    fn vocab(&self) -> usize {
        VOCAB
    }
    fn context_len(&self) -> usize {
        1024
    }
    fn kv_geometry(&self) -> (usize, usize) {
        (4, 256)
    }
    fn forward_timed(
        &mut self,
        batch: &[SeqChunk],
        _tables: &[Vec<u32>],
    ) -> (Result<Logits, EngineError>, u32) {
        if self.fail.get() {
            return (
                Err(EngineError::InvalidBatch("the device fell over".into())),
                10,
            );
        }
        (
            Ok(Logits::one_hot(batch, VOCAB, |_, pos, t| next(pos, t))),
            10,
        )
    }
    fn keep_path(&mut self, _: &[u32], _: usize, _: &[usize]) -> Result<(), EngineError> {
        Ok(()) // one-hot logits: no KV to move
    }
}

/// A target whose choice depends on the whole sequence, read through its KV pages as a real
/// model's does: each slot holds the state after its token ([`recurrent_step`] of the state at
/// its parent slot), and the greedy token after a slot is [`recurrent_next`] of its state. A
/// page that held another sequence's state (a prefix cache that shared the wrong page, a write
/// into a shared page) changes every token after it.
pub struct Recurrent {
    pub kv: Vec<u64>,
    pub page_size: usize,
}

/// The state before the first token.
pub const RECURRENT_SEED: u64 = 0x2545_F491_4F6C_DD1D;

pub fn recurrent_step(state: u64, pos: usize, token: u32) -> u64 {
    let mut x = state ^ (u64::from(token) << 32) ^ pos as u64;
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

pub fn recurrent_next(state: u64) -> u32 {
    (state % (VOCAB as u64 - 1)) as u32 + 1
}

/// [`Recurrent`]'s greedy token after `seq`.
pub fn recurrent_after(seq: &[u32]) -> u32 {
    let s = seq
        .iter()
        .enumerate()
        .fold(RECURRENT_SEED, |s, (p, &t)| recurrent_step(s, p, t));
    recurrent_next(s)
}

impl Recurrent {
    pub fn new() -> Self {
        let (page_size, pages) = Self::GEOMETRY;
        Self {
            kv: vec![0; page_size * pages],
            page_size,
        }
    }
    /// Pages of 4 slots, 24 of them: sessions of a test share pages, and cached ones are taken
    /// back.
    pub const GEOMETRY: (usize, usize) = (4, 24);

    fn slot(&self, table: &[u32], pos: usize) -> usize {
        table[pos / self.page_size] as usize * self.page_size + pos % self.page_size
    }
}

impl Default for Recurrent {
    fn default() -> Self {
        Self::new()
    }
}

impl Target for Recurrent {
    fn vocab(&self) -> usize {
        VOCAB
    }
    fn context_len(&self) -> usize {
        1024
    }
    fn kv_geometry(&self) -> (usize, usize) {
        Self::GEOMETRY
    }
    fn forward_timed(
        &mut self,
        batch: &[SeqChunk],
        tables: &[Vec<u32>],
    ) -> (Result<Logits, EngineError>, u32) {
        let mut next: Vec<Vec<u32>> = Vec::with_capacity(batch.len());
        for (c, table) in batch.iter().zip(tables) {
            let positions = c.positions();
            let mut out = Vec::with_capacity(c.tokens.len());
            for (i, &t) in c.tokens.iter().enumerate() {
                let slot = c.start_pos + i;
                let parent = match c.parents.get(i) {
                    Some(tandem_engine::Parent::Slot(p)) => Some(*p),
                    _ => slot.checked_sub(1),
                };
                let before = parent.map_or(RECURRENT_SEED, |p| self.kv[self.slot(table, p)]);
                let state = recurrent_step(before, positions[i], t);
                let at = self.slot(table, slot);
                self.kv[at] = state;
                out.push(recurrent_next(state));
            }
            next.push(out);
        }
        (
            Ok(Logits::one_hot_at(batch, VOCAB, |k, i, _| next[k][i])),
            10,
        )
    }
    fn keep_path(&mut self, table: &[u32], len: usize, path: &[usize]) -> Result<(), EngineError> {
        for (j, &from) in path.iter().enumerate() {
            let (src, dst) = (self.slot(table, from), self.slot(table, len + j));
            self.kv[dst] = self.kv[src];
        }
        Ok(())
    }
}

/// A verifier core on a [`OneHot`] target, and the switch that makes its forwards fail.
pub fn core() -> (VerifierCore<OneHot>, Rc<Cell<bool>>) {
    core_with(VerifierConfig::default())
}

/// A [`Driver`] of [`core`], and the switch that makes its forwards fail.
pub fn driver() -> (Driver<OneHot>, Rc<Cell<bool>>) {
    let (core, fail) = core();
    (Driver::new(core), fail)
}

/// [`core`] with `cfg`.
pub fn core_with(cfg: VerifierConfig) -> (VerifierCore<OneHot>, Rc<Cell<bool>>) {
    let fail = Rc::new(Cell::new(false));
    let target = OneHot { fail: fail.clone() };
    (VerifierCore::new(target, cfg, 0).unwrap(), fail)
}

/// A message a turn sent to a session's edge.
pub type Sent = (SessionId, ToEdge);

/// Drives a verifier core through [`VerifierCore::receive`] and [`VerifierCore::turn`] alone,
/// on a clock the test sets: messages arrive and turns run at `now_us`, which a turn does not
/// move. What the core answers to a message (a refused block or ack, a refused Open) goes out
/// with the next turn, as to every driver.
pub struct Driver<T: Target> {
    pub core: VerifierCore<T>,
    /// The driver's clock (µs).
    pub now_us: u64,
}

impl<T: Target> Driver<T> {
    /// A driver of `core` at time 0.
    pub fn new(core: VerifierCore<T>) -> Self {
        Self { core, now_us: 0 }
    }

    /// Open speculation session `id` of tenant 0, judged by `rule`, that asks for any shape
    /// (the default load config grants it) and ends after `max_tokens` new tokens.
    pub fn open(
        &mut self,
        id: SessionId,
        prompt: &[u32],
        params: SamplingParams,
        rule: VerifyRule,
        max_tokens: usize,
    ) {
        let want = Shape::UNLIMITED;
        self.open_as(
            id,
            prompt,
            params,
            max_tokens,
            Mode::Speculate { rule, want },
        );
    }

    /// Open cloud-only generation `id` of tenant 0, of `max_tokens` tokens.
    pub fn open_generation(
        &mut self,
        id: SessionId,
        prompt: &[u32],
        params: SamplingParams,
        max_tokens: usize,
    ) {
        self.open_as(id, prompt, params, max_tokens, Mode::Generate);
    }

    fn open_as(
        &mut self,
        session: SessionId,
        prompt: &[u32],
        params: SamplingParams,
        max_tokens: usize,
        mode: Mode,
    ) {
        let new = NewSession {
            tenant: TenantId(0),
            prompt: prompt.to_vec(),
            params,
            max_tokens,
            eog: vec![],
            mode,
            grammar: None,
            logprobs: None,
            self_draft: false,
        };
        self.receive(Inbound::Open {
            session,
            new,
            handle: (),
        });
    }

    /// Session `session`'s edge sends `block`.
    pub fn draft(&mut self, session: SessionId, block: Block) {
        self.receive(Inbound::Draft { session, block });
    }

    /// Session `session`'s edge has received its first `committed` tokens.
    pub fn ack(&mut self, session: SessionId, committed: usize) {
        self.receive(Inbound::Ack { session, committed });
    }

    /// Session `session`'s edge closes it.
    pub fn close(&mut self, session: SessionId) {
        self.receive(Inbound::Close { session });
    }

    fn receive(&mut self, msg: Inbound<()>) {
        self.core.receive(self.now_us, msg);
    }

    /// One turn: the messages it sent, in order.
    pub fn turn(&mut self) -> Vec<Sent> {
        let t = self.core.turn(self.now_us);
        t.out.into_iter().map(|o| (o.session, o.msg)).collect()
    }

    /// Turn until no session has work left, or a turn runs no forward and sends nothing (only
    /// rate-limited work is left); at least once, so that the answers to the messages received
    /// go out. Returns every message sent.
    pub fn run_until_idle(&mut self) -> Vec<Sent> {
        let mut sent = Vec::new();
        loop {
            let t = self.core.turn(self.now_us);
            let stuck = t.forward.is_none() && t.out.is_empty();
            sent.extend(t.out.into_iter().map(|o| (o.session, o.msg)));
            if stuck || !self.core.has_work() {
                return sent;
            }
        }
    }
}
