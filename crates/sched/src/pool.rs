//! Fixed-size KV blocks: allocate, free, truncate. Every block is either free or owned by exactly one
//! session; the scheduler decides which, the engine stores K and V in them.

use std::collections::HashMap;

use crate::{SchedError, SessionId};

#[derive(Debug, Clone)]
pub struct BlockPool {
    block_size: usize,
    num_blocks: usize,
    free: Vec<u32>,
    owned: HashMap<SessionId, Vec<u32>>,
}

impl BlockPool {
    pub fn new(num_blocks: usize, block_size: usize) -> Result<Self, SchedError> {
        if num_blocks == 0 || block_size == 0 {
            return Err(SchedError::InvalidConfig(
                "the block pool needs at least one block of at least one token".into(),
            ));
        }
        Ok(Self {
            block_size,
            num_blocks,
            // Popped from the end: low ids first.
            free: (0..num_blocks as u32).rev().collect(),
            owned: HashMap::new(),
        })
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }
    pub fn num_free(&self) -> usize {
        self.free.len()
    }
    /// Blocks needed to hold `tokens` token slots.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }
    pub fn table(&self, s: SessionId) -> &[u32] {
        self.owned.get(&s).map_or(&[], |v| v)
    }
    pub fn held(&self, s: SessionId) -> usize {
        self.table(s).len()
    }

    /// Extra blocks `s` needs to hold `tokens` slots.
    pub fn shortfall(&self, s: SessionId, tokens: usize) -> usize {
        self.blocks_for(tokens).saturating_sub(self.held(s))
    }

    /// Grow `s` to hold `tokens` slots; all or nothing.
    pub fn grow(&mut self, s: SessionId, tokens: usize) -> Result<(), SchedError> {
        let need = self.shortfall(s, tokens);
        if need > self.free.len() {
            return Err(SchedError::OutOfBlocks {
                needed: need,
                free: self.free.len(),
            });
        }
        let new: Vec<u32> = (0..need).filter_map(|_| self.free.pop()).collect();
        self.owned.entry(s).or_default().extend(new);
        Ok(())
    }

    /// Keep only the blocks `s` needs for `tokens` slots.
    pub fn truncate(&mut self, s: SessionId, tokens: usize) {
        let keep = self.blocks_for(tokens);
        if let Some(t) = self.owned.get_mut(&s) {
            while t.len() > keep {
                let b = t.pop().expect("len > keep ≥ 0");
                self.free.push(b);
            }
            if t.is_empty() {
                self.owned.remove(&s);
            }
        }
    }

    pub fn free_all(&mut self, s: SessionId) {
        self.truncate(s, 0);
    }

    /// Every block is free or owned once (for tests).
    pub fn conserved(&self) -> bool {
        let mut seen = vec![false; self.num_blocks];
        for b in self.free.iter().chain(self.owned.values().flatten()) {
            let i = *b as usize;
            if i >= self.num_blocks || seen[i] {
                return false;
            }
            seen[i] = true;
        }
        seen.iter().all(|&x| x)
    }
}
