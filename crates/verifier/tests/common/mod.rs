//! A one-hot target for the verifier core's tests: its greedy token after `token` at `pos` is
//! [`next`], every forward takes 10 µs, and forwards fail while its `fail` flag is set.
#![allow(dead_code)]

use std::cell::Cell;
use std::rc::Rc;

use tandem_engine::{EngineError, Logits, SeqChunk};
use tandem_verifier::{Target, VerifierConfig, VerifierCore};

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

/// A verifier core on a [`OneHot`] target, and the switch that makes its forwards fail.
pub fn core() -> (VerifierCore<OneHot>, Rc<Cell<bool>>) {
    let fail = Rc::new(Cell::new(false));
    let target = OneHot { fail: fail.clone() };
    (
        VerifierCore::new(target, VerifierConfig::default()).unwrap(),
        fail,
    )
}
