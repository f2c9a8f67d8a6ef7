//! The simulated target: a cost model for time, and a fixed pseudo-random function for its
//! greedy output.

use tandem_engine::{EngineError, Logits, SeqChunk};
use tandem_spec::capacity::ForwardCost;
use tandem_spec::sampling::uniform;
use tandem_verifier::Target;

/// Vocabulary of the simulated target (token 0 is never produced).
pub const VOCAB: usize = 256;
/// KV token slots per block.
const BLOCK_SIZE: usize = 16;

/// The target's greedy token at `pos` of session `seq`, after `prev` at `pos − 1`: a function of
/// what it was fed, so a verifier that fed a wrong token would get (and commit) a wrong one.
pub fn target_token(seed: u64, seq: u64, pos: usize, prev: u32) -> u32 {
    let key = (pos as u64) << 16 | prev as u64;
    1 + (uniform(seed ^ 0x7a6d, seq, key) * (VOCAB - 1) as f64) as u32 % (VOCAB as u32 - 1)
}

/// The target as a cost model: a forward of n tokens takes `cost.ms(n)`; its logits rows are
/// one-hot at the target's token for the next position.
pub struct SimTarget {
    pub cost: ForwardCost,
    pub num_blocks: usize,
    pub seed: u64,
}

impl Target for SimTarget {
    fn vocab(&self) -> usize {
        VOCAB
    }

    fn context_len(&self) -> usize {
        1 << 20
    }

    fn kv_geometry(&self) -> (usize, usize) {
        (BLOCK_SIZE, self.num_blocks)
    }

    fn forward_timed(
        &mut self,
        batch: &[SeqChunk],
        _tables: &[Vec<u32>],
    ) -> (Result<Logits, EngineError>, u32) {
        let seed = self.seed;
        let logits = Logits::one_hot(batch, VOCAB, |seq, pos, t| {
            target_token(seed, seq.0, pos + 1, t)
        });
        let t0: usize = batch.iter().map(|c| c.tokens.len()).sum();
        let us = (self.cost.ms(t0 as f64) * 1e3).round() as u32;
        (Ok(logits), us)
    }
    fn keep_path(&mut self, _: &[u32], _: usize, _: &[usize]) -> Result<(), EngineError> {
        Ok(()) // one-hot logits: no KV to move
    }
}
