//! Paged KV cache: fixed-size blocks of `block_size` token slots from one pool sized by a memory
//! budget, and a block table per sequence. The blocks come from Tandem's one allocator,
//! [`tandem_sched::PagePool`]: the verifier's scheduler hands the engine its tables
//! ([`crate::Engine::forward_paged`]); an engine that runs its own sequences keeps them in
//! [`Sequences`] (lengths over a pool keyed by sequence). [`PagedKvCache`] adds the f32 storage
//! the attention reads.
//!
//! An engine's own sequences share the pool's prefix cache ([`Sequences::publish`],
//! [`Sequences::attach_prefix`]): the edge keeps the draft's KV of a conversation's earlier turns,
//! so the next turn computes only its new tokens. One engine is one owner (one user's device):
//! every sequence uses the same salt.
//!
//! Storage layout, per layer: `[num_blocks, block_size, n_kv_heads, head_dim]`.

use std::collections::HashMap;
use std::fmt;

use tandem_sched::{CacheCounts, PageHash, PagePool, SchedError};

use crate::error::{EngineError, Result};

/// A sequence in the KV cache (one user session, one draft stream...).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u64);

impl fmt::Display for SeqId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// The sequences an engine runs on its own: their lengths, and their KV blocks from the one
/// allocator ([`tandem_sched::PagePool`], keyed by sequence). No tensors.
#[derive(Debug, Clone)]
pub struct Sequences {
    pool: PagePool<SeqId>,
    lens: HashMap<SeqId, usize>,
    /// The content addresses of each sequence's first whole pages, as far as it published them
    /// (or attached them).
    chains: HashMap<SeqId, Vec<PageHash>>,
}

/// The salt of an engine's own pages: its sequences are one owner's.
const SALT: u64 = 0;

impl Sequences {
    /// `num_blocks` blocks of `block_size` slots; both at least 1 ([`PagedKvCache::new`] checks).
    pub fn new(num_blocks: usize, block_size: usize) -> Result<Self> {
        Ok(Self {
            pool: PagePool::new(num_blocks, block_size).map_err(|e| {
                EngineError::InvalidSetting {
                    field: "kv_blocks",
                    message: e.to_string(),
                }
            })?,
            lens: HashMap::new(),
            chains: HashMap::new(),
        })
    }

    pub fn page_size(&self) -> usize {
        self.pool.page_size()
    }
    pub fn num_pages(&self) -> usize {
        self.pool.num_pages()
    }
    pub fn num_free_blocks(&self) -> usize {
        self.pool.num_free()
    }
    /// Tokens held for `seq`; 0 for a sequence the cache has never seen.
    pub fn seq_len(&self, seq: SeqId) -> usize {
        self.lens.get(&seq).copied().unwrap_or(0)
    }
    pub fn contains(&self, seq: SeqId) -> bool {
        self.lens.contains_key(&seq)
    }
    pub fn num_seqs(&self) -> usize {
        self.lens.len()
    }
    pub fn blocks(&self, seq: SeqId) -> &[u32] {
        self.pool.table(seq)
    }
    /// What the prefix cache did, in pages.
    pub fn cache_counts(&self) -> CacheCounts {
        self.pool.counts()
    }
    /// Cached pages no sequence holds (counted in [`Sequences::num_free_blocks`]: a grow takes
    /// them back when no empty block is left).
    pub fn num_cached_blocks(&self) -> usize {
        self.pool.num_cached_unheld()
    }

    /// Whether `seq` may write slots `start..end`: no page they fall in is shared or published.
    pub fn writable(&self, seq: SeqId, start: usize, end: usize) -> bool {
        self.pool.writable(seq, start, end)
    }

    /// Start `seq`, which holds nothing, with the cached pages that hold the longest run of
    /// `tokens`' whole pages, short of the page holding its last token (that token is always
    /// computed: its logits are what the caller wants). Answers the tokens attached.
    pub fn attach_prefix(&mut self, seq: SeqId, tokens: &[u32]) -> Result<usize> {
        if self.seq_len(seq) > 0 {
            return Err(EngineError::InvalidBatch(format!(
                "sequence {seq} holds {} tokens: cached pages can only start a sequence",
                self.seq_len(seq)
            )));
        }
        let ps = self.pool.page_size();
        let mut chain = Vec::new();
        PageHash::extend_chain(
            &mut chain,
            SALT,
            ps,
            &tokens[..tokens.len().saturating_sub(1)],
        );
        let pages = self.pool.lookup(&chain);
        if pages.is_empty() {
            return Ok(0);
        }
        self.pool
            .attach(seq, &pages)
            .map_err(|e| EngineError::InvalidBatch(e.to_string()))?;
        chain.truncate(pages.len());
        self.chains.insert(seq, chain);
        self.lens.insert(seq, pages.len() * ps);
        Ok(pages.len() * ps)
    }

    /// Publish the whole pages of `seq` that hold `tokens`: its first slots, whose K and V are
    /// those tokens' (a slot's K and V depend only on the tokens up to it, so any linear run
    /// the engine computed is final content, drafted or not). Pages published before are
    /// skipped; tokens past the sequence's length are ignored.
    pub fn publish(&mut self, seq: SeqId, tokens: &[u32]) {
        let tokens = &tokens[..tokens.len().min(self.seq_len(seq))];
        let ps = self.pool.page_size();
        let chain = self.chains.entry(seq).or_default();
        let from = chain.len();
        PageHash::extend_chain(chain, SALT, ps, tokens);
        for (i, &h) in chain.iter().enumerate().skip(from) {
            self.pool.publish(seq, i, h);
        }
    }

    /// Grow every `(seq, new_len)` to `new_len` tokens, all or nothing: when the pool cannot hold
    /// them all, nothing changes and `OutOfBlocks` says how many blocks were missing.
    pub fn grow(&mut self, plan: &[(SeqId, usize)]) -> Result<()> {
        self.pool.grow_all(plan).map_err(|e| match e {
            SchedError::OutOfBlocks { needed, free } => EngineError::OutOfBlocks {
                needed,
                free,
                total: self.pool.num_pages(),
                block_size: self.pool.page_size(),
            },
            e => EngineError::InvalidBatch(e.to_string()),
        })?;
        for &(seq, len) in plan {
            let l = self.lens.entry(seq).or_default();
            *l = (*l).max(len);
        }
        Ok(())
    }

    /// Keep the first `len` tokens of `seq`, returning whole blocks past them to the pool, and
    /// answer how many it keeps: fewer than `len` when the block holding token `len` is shared
    /// with another sequence (that block is let go too, and the caller computes its kept part
    /// again: see [`PagePool::truncate`]).
    pub fn truncate(&mut self, seq: SeqId, len: usize) -> Result<usize> {
        let have = *self
            .lens
            .get(&seq)
            .ok_or(EngineError::UnknownSequence(seq))?;
        if len > have {
            return Err(EngineError::InvalidBatch(format!(
                "cannot truncate sequence {seq} to {len} tokens: it holds {have}"
            )));
        }
        let kept = self.pool.truncate(seq, len);
        self.lens.insert(seq, kept);
        if let Some(c) = self.chains.get_mut(&seq) {
            c.truncate(kept / self.pool.page_size());
        }
        Ok(kept)
    }

    /// Drop `seq` and return all its blocks. Freeing an unknown sequence is a no-op.
    pub fn free(&mut self, seq: SeqId) {
        self.pool.free_all(seq);
        self.lens.remove(&seq);
        self.chains.remove(&seq);
    }

    /// Every block is free, cached or held, exactly as the pool's records say.
    pub fn conserved(&self) -> bool {
        self.pool.conserved()
    }
}

/// Settings of the KV cache.
#[derive(Debug, Clone, Copy)]
pub struct KvConfig {
    /// Token slots per block.
    pub block_size: usize,
    /// Bytes of K and V storage over all layers.
    pub budget_bytes: usize,
}

impl Default for KvConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            budget_bytes: 256 << 20,
        }
    }
}

/// The block tables plus the K and V storage of every layer.
pub struct PagedKvCache {
    pub tables: Sequences,
    pub(crate) kv_dim: usize,
    pub(crate) k: Vec<Vec<f32>>,
    pub(crate) v: Vec<Vec<f32>>,
}

impl PagedKvCache {
    pub fn new(n_layers: usize, kv_dim: usize, cfg: KvConfig) -> Result<Self> {
        if cfg.block_size == 0 {
            return Err(EngineError::InvalidSetting {
                field: "kv_block_size",
                message: "must be at least 1".into(),
            });
        }
        let bytes_per_block = 2 * n_layers * cfg.block_size * kv_dim * 4;
        let num_blocks = cfg.budget_bytes / bytes_per_block;
        if num_blocks == 0 {
            return Err(EngineError::InvalidSetting {
                field: "kv_budget_bytes",
                message: format!(
                    "{} bytes cannot hold one block of {} tokens ({bytes_per_block} bytes)",
                    cfg.budget_bytes, cfg.block_size
                ),
            });
        }
        let floats = num_blocks * cfg.block_size * kv_dim;
        Ok(Self {
            tables: Sequences::new(num_blocks, cfg.block_size)?,
            kv_dim,
            k: (0..n_layers).map(|_| vec![0f32; floats]).collect(),
            v: (0..n_layers).map(|_| vec![0f32; floats]).collect(),
        })
    }

    /// Bytes of K and V one token occupies over all layers.
    pub fn bytes_per_token(&self) -> usize {
        2 * self.k.len() * self.kv_dim * 4
    }

    /// Capacity in tokens.
    pub fn capacity_tokens(&self) -> usize {
        self.tables.num_pages() * self.tables.page_size()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn out_of_blocks_is_typed_and_changes_nothing() {
        let mut t = Sequences::new(4, 16).unwrap();
        t.grow(&[(SeqId(1), 40)]).unwrap(); // 3 blocks
        let err = t.grow(&[(SeqId(2), 10), (SeqId(3), 20)]).unwrap_err();
        assert!(matches!(
            err,
            EngineError::OutOfBlocks {
                needed: 3,
                free: 1,
                ..
            }
        ));
        assert_eq!(t.num_free_blocks(), 1);
        assert!(!t.contains(SeqId(2)) && !t.contains(SeqId(3)));
        assert_eq!(t.seq_len(SeqId(1)), 40);
    }

    #[test]
    fn truncate_returns_whole_blocks_only() {
        let mut t = Sequences::new(8, 4).unwrap();
        t.grow(&[(SeqId(7), 10)]).unwrap();
        assert_eq!(t.blocks(SeqId(7)).len(), 3);
        t.truncate(SeqId(7), 5).unwrap();
        assert_eq!(t.blocks(SeqId(7)).len(), 2);
        assert_eq!(t.seq_len(SeqId(7)), 5);
        assert!(t.truncate(SeqId(7), 6).is_err());
        assert!(matches!(
            t.truncate(SeqId(9), 0),
            Err(EngineError::UnknownSequence(SeqId(9)))
        ));
    }

    #[derive(Debug, Clone)]
    enum Op {
        Grow(u64, usize),
        Truncate(u64, usize),
        Free(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u64..5, 1usize..60).prop_map(|(s, n)| Op::Grow(s, n)),
            (0u64..5, 0usize..60).prop_map(|(s, n)| Op::Truncate(s, n)),
            (0u64..5).prop_map(Op::Free),
        ]
    }

    proptest! {
        #[test]
        fn blocks_are_conserved(ops in proptest::collection::vec(op(), 1..80)) {
            let mut t = Sequences::new(12, 8).unwrap();
            for o in ops {
                match o {
                    Op::Grow(s, n) => {
                        let before = t.seq_len(SeqId(s));
                        let _ = t.grow(&[(SeqId(s), before + n)]);
                    }
                    Op::Truncate(s, n) => {
                        let len = t.seq_len(SeqId(s));
                        let _ = t.truncate(SeqId(s), n.min(len));
                    }
                    Op::Free(s) => t.free(SeqId(s)),
                }
                prop_assert!(t.conserved());
                for s in 0..5 {
                    let seq = SeqId(s);
                    prop_assert_eq!(t.blocks(seq).len(), t.seq_len(seq).div_ceil(8));
                }
                let mut all: Vec<u32> = (0..5).flat_map(|s| t.blocks(SeqId(s)).to_vec()).collect();
                all.sort_unstable();
                all.dedup();
                prop_assert_eq!(all.len() + t.num_free_blocks(), 12);
            }
        }
    }
}
