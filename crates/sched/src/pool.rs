//! Fixed-size KV pages: allocate, free, truncate. Every page is either free or owned by exactly one
//! owner. This is Tandem's one KV allocator: the scheduler owns one for the verifier's sessions
//! (the engine stores K and V in the pages it hands out), and an engine that runs its own
//! sequences (the edge's draft, tests, calibration) keeps one keyed by its sequence ids. (The
//! flags, metrics and wire fields keep their older name, KV *blocks*: `--max-kv-blocks`,
//! `kv_blocks_used`; in the code a *block* is a draft block.)

use std::collections::HashMap;
use std::hash::Hash;

use crate::{SchedError, SessionId};

/// Pages of `page_size` token slots, each free or owned by one `K`.
#[derive(Debug, Clone)]
pub struct PagePool<K = SessionId> {
    page_size: usize,
    num_pages: usize,
    free: Vec<u32>,
    owned: HashMap<K, Vec<u32>>,
}

impl<K: Copy + Eq + Hash> PagePool<K> {
    pub fn new(num_pages: usize, page_size: usize) -> Result<Self, SchedError> {
        if num_pages == 0 || page_size == 0 {
            return Err(SchedError::InvalidConfig(
                "the KV page pool needs at least one page of at least one token".into(),
            ));
        }
        Ok(Self {
            page_size,
            num_pages,
            // Popped from the end: low ids first.
            free: (0..num_pages as u32).rev().collect(),
            owned: HashMap::new(),
        })
    }

    pub fn page_size(&self) -> usize {
        self.page_size
    }
    pub fn num_pages(&self) -> usize {
        self.num_pages
    }
    pub fn num_free(&self) -> usize {
        self.free.len()
    }
    /// Pages needed to hold `tokens` token slots.
    pub fn pages_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.page_size)
    }
    pub fn table(&self, s: K) -> &[u32] {
        self.owned.get(&s).map_or(&[], |v| v)
    }
    pub fn held(&self, s: K) -> usize {
        self.table(s).len()
    }

    /// Extra pages `s` needs to hold `tokens` slots.
    pub fn shortfall(&self, s: K, tokens: usize) -> usize {
        self.pages_for(tokens).saturating_sub(self.held(s))
    }

    /// Grow `s` to hold `tokens` slots; all or nothing.
    pub fn grow(&mut self, s: K, tokens: usize) -> Result<(), SchedError> {
        self.grow_all(&[(s, tokens)])
    }

    /// Grow every `(owner, tokens)` to hold `tokens` slots, all or nothing: when the pool cannot
    /// hold them all, nothing changes and `OutOfBlocks` says how many pages were missing. An
    /// owner named twice is grown to the larger size.
    pub fn grow_all(&mut self, plan: &[(K, usize)]) -> Result<(), SchedError> {
        // In the batch's order, so that page ids are handed out deterministically.
        let mut at: HashMap<K, usize> = HashMap::new();
        let mut want: Vec<(K, usize)> = Vec::with_capacity(plan.len());
        for &(s, tokens) in plan {
            match at.get(&s) {
                Some(&i) => want[i].1 = want[i].1.max(tokens),
                None => {
                    at.insert(s, want.len());
                    want.push((s, tokens));
                }
            }
        }
        let needed: usize = want.iter().map(|&(s, t)| self.shortfall(s, t)).sum();
        if needed > self.free.len() {
            return Err(SchedError::OutOfBlocks {
                needed,
                free: self.free.len(),
            });
        }
        for (s, tokens) in want {
            let need = self.shortfall(s, tokens);
            let new: Vec<u32> = (0..need).filter_map(|_| self.free.pop()).collect();
            if !new.is_empty() {
                self.owned.entry(s).or_default().extend(new);
            }
        }
        Ok(())
    }

    /// Keep only the pages `s` needs for `tokens` slots.
    pub fn truncate(&mut self, s: K, tokens: usize) {
        let keep = self.pages_for(tokens);
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

    pub fn free_all(&mut self, s: K) {
        self.truncate(s, 0);
    }

    /// Every page is free or owned once (for tests).
    pub fn conserved(&self) -> bool {
        let mut seen = vec![false; self.num_pages];
        for b in self.free.iter().chain(self.owned.values().flatten()) {
            let i = *b as usize;
            if i >= self.num_pages || seen[i] {
                return false;
            }
            seen[i] = true;
        }
        seen.iter().all(|&x| x)
    }
}
