//! [`Engine`]: one model, one paged KV cache and one thread pool. Validates a ragged batch, grows the
//! sequences' block tables (all or nothing) and runs the forward pass.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::affinity::{self, CpuSet};
use crate::batch::{Logits, SeqChunk, Wanted};
use crate::error::{EngineError, Result};
use crate::kv::{KvConfig, PagedKvCache, SeqId};
use crate::models::llama::{LlamaModel, Observer};
use crate::tree::{NodeCtx, Parent};

/// Engine settings, checked once by [`Engine::new`].
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct EngineConfig {
    /// Worker threads for the matmuls and attention.
    pub threads: usize,
    /// Bytes of KV cache (K and V, all layers).
    pub kv_budget_bytes: usize,
    /// Token slots per KV block.
    pub kv_block_size: usize,
    /// Cores the worker threads are pinned to (empty: not pinned).
    #[serde(skip)]
    pub cpus: CpuSet,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            kv_budget_bytes: KvConfig::default().budget_bytes,
            kv_block_size: KvConfig::default().block_size,
            cpus: CpuSet::default(),
        }
    }
}

pub struct Engine {
    model: Arc<LlamaModel>,
    kv: PagedKvCache,
    pool: rayon::ThreadPool,
    /// The tree nodes that end a sequence the engine runs itself (its last `len` slots); a
    /// sequence without an entry is linear.
    tails: HashMap<SeqId, Vec<NodeCtx>>,
}

impl Engine {
    pub fn new(model: Arc<LlamaModel>, cfg: EngineConfig) -> Result<Self> {
        if cfg.threads == 0 {
            return Err(EngineError::InvalidSetting {
                field: "threads",
                message: "must be at least 1".into(),
            });
        }
        let kv = PagedKvCache::new(
            model.cfg.n_layer,
            model.cfg.kv_dim(),
            KvConfig {
                block_size: cfg.kv_block_size,
                budget_bytes: cfg.kv_budget_bytes,
            },
        )?;
        affinity::check(&cfg.cpus).map_err(|message| EngineError::InvalidSetting {
            field: "cpus",
            message,
        })?;
        let cpus = cfg.cpus;
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(cfg.threads)
            .thread_name(|i| format!("tandem-engine-{i}"))
            .start_handler(move |_| {
                // Checked above; a failure here can only mean the process lost the core since.
                if let Err(e) = affinity::pin_current_thread(&cpus) {
                    tracing::warn!("engine worker not pinned: {e}");
                }
            })
            .build()
            .map_err(|e| EngineError::InvalidSetting {
                field: "threads",
                message: e.to_string(),
            })?;
        Ok(Self {
            model,
            kv,
            pool,
            tails: HashMap::new(),
        })
    }

    pub fn model(&self) -> &Arc<LlamaModel> {
        &self.model
    }

    pub fn kv(&self) -> &PagedKvCache {
        &self.kv
    }

    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    /// Tokens `seq` holds in the KV cache (0 if unknown).
    pub fn seq_len(&self, seq: SeqId) -> usize {
        self.kv.tables.seq_len(seq)
    }

    /// Keep the first `len` tokens of `seq` (rejecting a draft rolls back this way), and answer
    /// how many it keeps: fewer when token `len` falls in a block `seq` shares with another
    /// sequence through the prefix cache (the caller computes the slots from there again).
    pub fn truncate(&mut self, seq: SeqId, len: usize) -> Result<usize> {
        let have = self.kv.tables.seq_len(seq);
        let kept = self.kv.tables.truncate(seq, len)?;
        if let Some(tail) = self.tails.get_mut(&seq) {
            let base = have - tail.len();
            if kept <= base {
                self.tails.remove(&seq);
            } else {
                tail.truncate(kept - base);
            }
        }
        Ok(kept)
    }

    /// Start `seq`, which holds nothing, with the prefix cache's pages for the longest run of
    /// `tokens`' whole pages short of its last token, published before by any of this engine's
    /// sequences ([`Engine::publish`]); answers the tokens attached. The logits that follow are
    /// bitwise those of computing the tokens (a slot's K and V depend only on the tokens up to
    /// it, whatever the batch).
    pub fn attach_cached(&mut self, seq: SeqId, tokens: &[u32]) -> Result<usize> {
        if self.tails.contains_key(&seq) {
            return Err(EngineError::InvalidBatch(format!(
                "sequence {seq} holds tree nodes: cached pages can only start a sequence"
            )));
        }
        self.kv.tables.attach_prefix(seq, tokens)
    }

    /// Offer to the prefix cache the whole blocks of `seq` that hold `tokens`, its first slots
    /// (as far as they are linear: tree nodes are never published). A block once published is
    /// never written again: a truncation into it takes it back or lets it go.
    pub fn publish(&mut self, seq: SeqId, tokens: &[u32]) {
        let linear = self.kv.tables.seq_len(seq) - self.tails.get(&seq).map_or(0, |t| t.len());
        self.kv
            .tables
            .publish(seq, &tokens[..tokens.len().min(linear)]);
    }

    /// Drop `seq` and return its KV blocks to the pool.
    pub fn free(&mut self, seq: SeqId) {
        self.kv.tables.free(seq);
        self.tails.remove(&seq);
    }

    /// Whether `seq` ends in tree nodes.
    pub fn has_tree(&self, seq: SeqId) -> bool {
        self.tails.contains_key(&seq)
    }

    /// Keep, of `seq`'s slots, the first `len` and then the tree path `path` (ascending slots,
    /// each the child of the one before, the first a child of slot `len - 1`): their K and V
    /// move down to slots `len..`, the rest is dropped, and the sequence is linear again.
    pub fn keep_path(&mut self, seq: SeqId, len: usize, path: &[usize]) -> Result<()> {
        let bad = |m: String| EngineError::InvalidBatch(format!("sequence {seq}: {m}"));
        let ctx = self.slot_contexts(seq)?;
        let mut want = len.checked_sub(1).map(NodeCtx::linear);
        for &s in path {
            let expect = match &want {
                Some(w) => w.child(s),
                None => NodeCtx::first(s),
            };
            if ctx.get(s) != Some(&expect) {
                return Err(bad(format!(
                    "slot {s} is not the child of the path before it"
                )));
            }
            want = Some(expect);
        }
        self.keep_tree(seq, len, path)
    }

    /// Keep, of `seq`'s slots, the first `len` and then the tree nodes `slots` (ascending, each
    /// attending only to the first `len` slots and to kept nodes): their K and V move down to
    /// slots `len..`, keeping each node's position and ancestors; the rest is dropped. Nodes that
    /// now continue the linear run become linear slots.
    pub fn keep_tree(&mut self, seq: SeqId, len: usize, slots: &[usize]) -> Result<()> {
        let bad = |m: String| EngineError::InvalidBatch(format!("sequence {seq}: {m}"));
        let ctx = self.slot_contexts(seq)?;
        let have = ctx.len();
        if len > have {
            return Err(bad(format!("cannot keep {len} of its {have} tokens")));
        }
        let mut moved = HashMap::new();
        let mut tail = Vec::with_capacity(slots.len());
        for (i, &s) in slots.iter().enumerate() {
            if s < len || s >= have || (i > 0 && s <= slots[i - 1]) {
                return Err(bad(format!(
                    "slot {s} is not an ascending slot in {len}..{have}"
                )));
            }
            // Its context, slot by slot, with kept nodes at their new slots.
            let c = &ctx[s];
            let mut slots_in = Vec::with_capacity(c.len());
            for j in 0..c.len() {
                let a = c.slot(j);
                slots_in.push(match moved.get(&a) {
                    _ if a < len => a,
                    Some(&to) => to,
                    None if a == s => len + i,
                    None => {
                        return Err(bad(format!(
                            "slot {s} attends to slot {a}, which is not kept"
                        )))
                    }
                });
            }
            let linear = slots_in
                .iter()
                .enumerate()
                .take_while(|&(j, &a)| a == j)
                .count();
            moved.insert(s, len + i);
            tail.push(NodeCtx::from_parts(
                c.pos,
                linear,
                slots_in.split_off(linear),
            ));
        }
        if !self.kv.tables.writable(seq, len, len + slots.len()) {
            return Err(bad(format!(
                "slots {len}..{} fall in a block the prefix cache shares",
                len + slots.len()
            )));
        }
        let table = self.kv.tables.blocks(seq).to_vec();
        copy_slots(&mut self.kv, &table, len, slots);
        self.kv.tables.truncate(seq, len + slots.len())?;
        // Kept nodes that continue the linear run are linear slots now.
        let linear = tail
            .iter()
            .enumerate()
            .take_while(|(i, c)| **c == NodeCtx::linear(len + i))
            .count();
        tail.drain(..linear);
        if tail.is_empty() {
            self.tails.remove(&seq);
        } else {
            self.tails.insert(seq, tail);
        }
        Ok(())
    }

    /// The context of each of `seq`'s slots.
    fn slot_contexts(&self, seq: SeqId) -> Result<Vec<NodeCtx>> {
        if !self.kv.tables.contains(seq) {
            return Err(EngineError::UnknownSequence(seq));
        }
        let have = self.kv.tables.seq_len(seq);
        let tail = self.tails.get(&seq).map_or(&[][..], |t| t.as_slice());
        let base = have - tail.len();
        Ok((0..base)
            .map(NodeCtx::linear)
            .chain(tail.iter().cloned())
            .collect())
    }

    /// [`keep_path`](Engine::keep_path) for a sequence whose blocks a scheduler allocated: K and
    /// V of slots `path` move to slots `len..` of `table`. The caller owns the length (now
    /// `len + path.len()`) and the tree's shape (a verifier's tree is the chunk it just ran).
    pub fn keep_path_paged(&mut self, table: &[u32], len: usize, path: &[usize]) -> Result<()> {
        let bs = self.kv.tables.page_size();
        let cap = table.len() * bs;
        if path.iter().any(|&s| s >= cap) || path.windows(2).any(|w| w[0] >= w[1]) {
            return Err(EngineError::InvalidBatch(format!(
                "path {path:?} is not ascending within the table's {cap} slots"
            )));
        }
        if path.first().is_some_and(|&s| s < len) {
            return Err(EngineError::InvalidBatch(format!(
                "path {path:?} starts below the kept length {len}"
            )));
        }
        copy_slots(&mut self.kv, table, len, path);
        Ok(())
    }

    /// Run one ragged batch. Each chunk must continue its sequence exactly where its KV ends
    /// (`start_pos == seq_len`); a sequence the cache has not seen starts at 0. Nothing changes
    /// when the batch is refused (bad token, position, duplicate sequence, or no KV blocks left).
    pub fn forward(&mut self, batch: &[SeqChunk]) -> Result<Logits> {
        self.forward_inner(batch, None)
    }

    /// [`forward`](Engine::forward), showing `observe` every layer's input rows at each
    /// [`Site`](crate::Site) (calibration: the activations a quantizer minimizes its error on).
    pub fn forward_observed(
        &mut self,
        batch: &[SeqChunk],
        observe: Observer<'_>,
    ) -> Result<Logits> {
        self.forward_inner(batch, Some(observe))
    }

    fn forward_inner(
        &mut self,
        batch: &[SeqChunk],
        observe: Option<Observer<'_>>,
    ) -> Result<Logits> {
        self.check(batch)?;
        for s in batch {
            let expected = self.kv.tables.seq_len(s.seq);
            if s.start_pos != expected {
                return Err(EngineError::PositionMismatch {
                    seq: s.seq,
                    expected,
                    got: s.start_pos,
                });
            }
            if !self
                .kv
                .tables
                .writable(s.seq, s.start_pos, s.start_pos + s.tokens.len())
            {
                return Err(EngineError::InvalidBatch(format!(
                    "sequence {}: slots from {} fall in a block the prefix cache shares",
                    s.seq, s.start_pos
                )));
            }
        }
        let plan: Vec<(SeqId, usize)> = batch
            .iter()
            .map(|s| (s.seq, s.start_pos + s.tokens.len()))
            .collect();
        let mut ctx = Vec::with_capacity(plan.iter().map(|p| p.1).sum());
        for s in batch {
            let tail = self.tails.get(&s.seq).map_or(&[][..], |t| t.as_slice());
            contexts(s, tail, &mut ctx)?;
        }
        self.kv.tables.grow(&plan)?;
        let tables: Vec<Vec<u32>> = batch
            .iter()
            .map(|s| self.kv.tables.blocks(s.seq).to_vec())
            .collect();
        let out = self.run(batch, &tables, &ctx, observe);
        if out.is_err() {
            for s in batch {
                let _ = self.kv.tables.truncate(s.seq, s.start_pos);
            }
            return out;
        }
        // Tree nodes join their sequence's tail.
        let mut t0 = 0;
        for s in batch {
            let n = s.tokens.len();
            for (i, c) in ctx[t0..t0 + n].iter().enumerate() {
                if self.tails.contains_key(&s.seq) || *c != NodeCtx::linear(s.start_pos + i) {
                    self.tails.entry(s.seq).or_default().push(c.clone());
                }
            }
            t0 += n;
        }
        out
    }

    /// Run one ragged batch over block tables that a scheduler allocated (`tables[i]` holds chunk
    /// `i`'s KV blocks, ids below [`num_blocks`](crate::kv::Sequences::num_blocks) of this
    /// engine's cache). The caller owns the allocation and the sequences' lengths: the engine only
    /// checks that the tables are in range, disjoint and long enough. An engine driven this way
    /// must not also allocate through [`forward`](Engine::forward).
    pub fn forward_paged(&mut self, batch: &[SeqChunk], tables: &[Vec<u32>]) -> Result<Logits> {
        self.check(batch)?;
        if self.kv.tables.num_seqs() > 0 {
            return Err(EngineError::InvalidBatch(
                "this engine allocates its own KV blocks; it cannot also take a scheduler's".into(),
            ));
        }
        if tables.len() != batch.len() {
            return Err(EngineError::InvalidBatch(format!(
                "{} block tables for {} sequences",
                tables.len(),
                batch.len()
            )));
        }
        let (bs, nb) = (self.kv.tables.page_size(), self.kv.tables.num_pages());
        // Tables may share the pages of a cached prefix, which the forward only reads; a page it
        // writes belongs to one table, once.
        let mut holders: HashMap<u32, usize> = HashMap::new();
        for t in tables {
            for &b in t {
                *holders.entry(b).or_default() += 1;
            }
        }
        for (s, t) in batch.iter().zip(tables) {
            let need = (s.start_pos + s.tokens.len()).div_ceil(bs);
            if t.len() < need {
                return Err(EngineError::InvalidBatch(format!(
                    "sequence {}: {} KV blocks cannot hold {} positions",
                    s.seq,
                    t.len(),
                    s.start_pos + s.tokens.len()
                )));
            }
            if let Some(b) = t.iter().find(|&&b| b as usize >= nb) {
                return Err(EngineError::InvalidBatch(format!(
                    "sequence {}: KV block {b} is out of range ({nb})",
                    s.seq
                )));
            }
            let written = &t[s.start_pos / bs..need];
            if let Some(b) = written.iter().find(|&b| holders[b] > 1) {
                return Err(EngineError::InvalidBatch(format!(
                    "sequence {}: KV block {b}, which it writes, is shared",
                    s.seq
                )));
            }
        }
        // A scheduler's sequences are linear between forwards: a tree lives in one chunk.
        let mut ctx = Vec::with_capacity(batch.iter().map(|s| s.tokens.len()).sum());
        for s in batch {
            contexts(s, &[], &mut ctx)?;
        }
        self.run(batch, tables, &ctx, None)
    }

    /// Checks that do not depend on who allocates the KV blocks.
    fn check(&self, batch: &[SeqChunk]) -> Result<()> {
        let cfg = &self.model.cfg;
        let mut seen = HashSet::new();
        for s in batch {
            if !seen.insert(s.seq) {
                return Err(EngineError::InvalidBatch(format!(
                    "sequence {} appears twice in one batch",
                    s.seq
                )));
            }
            if s.tokens.is_empty() {
                return Err(EngineError::InvalidBatch(format!(
                    "sequence {} has no tokens",
                    s.seq
                )));
            }
            if let Some(&token) = s.tokens.iter().find(|&&t| t as usize >= cfg.vocab) {
                return Err(EngineError::InvalidToken {
                    seq: s.seq,
                    token,
                    vocab: cfg.vocab,
                });
            }
            let end = s.start_pos + s.tokens.len();
            if end > cfg.context_len {
                return Err(EngineError::ContextOverflow {
                    seq: s.seq,
                    end,
                    max: cfg.context_len,
                });
            }
            if !s.parents.is_empty() && s.parents.len() != s.tokens.len() {
                return Err(EngineError::InvalidBatch(format!(
                    "sequence {}: {} parents for {} tokens",
                    s.seq,
                    s.parents.len(),
                    s.tokens.len()
                )));
            }
            if let Wanted::At(ix) = &s.logits {
                if ix.windows(2).any(|w| w[0] >= w[1]) || ix.iter().any(|&i| i >= s.tokens.len()) {
                    return Err(EngineError::InvalidBatch(format!(
                        "sequence {}: logits indices {ix:?} must be ascending and below {}",
                        s.seq,
                        s.tokens.len()
                    )));
                }
            }
        }
        Ok(())
    }

    fn run(
        &mut self,
        batch: &[SeqChunk],
        tables: &[Vec<u32>],
        ctx: &[NodeCtx],
        observe: Option<Observer<'_>>,
    ) -> Result<Logits> {
        let bs = self.kv.tables.page_size();
        let slots: Vec<usize> = batch
            .iter()
            .zip(tables)
            .flat_map(|(s, t)| {
                (s.start_pos..s.start_pos + s.tokens.len())
                    .map(move |p| t[p / bs] as usize * bs + p % bs)
            })
            .collect();
        let tables: Vec<&[u32]> = tables.iter().map(|t| t.as_slice()).collect();
        let model = Arc::clone(&self.model);
        let kv = &mut self.kv;
        self.pool
            .install(|| model.forward(batch, kv, &tables, &slots, ctx, observe))
    }
}

/// Each token's position and context in `chunk`, whose sequence ends in `tail` (tree nodes in
/// its last `tail.len()` slots before the chunk), appended to `all` (the batch's so far).
fn contexts(chunk: &SeqChunk, tail: &[NodeCtx], all: &mut Vec<NodeCtx>) -> Result<()> {
    let start = chunk.start_pos;
    let base = start - tail.len();
    let first = all.len();
    let mut tree = !tail.is_empty();
    for i in 0..chunk.tokens.len() {
        let slot = start + i;
        let c = match chunk.parents.get(i).copied().unwrap_or(Parent::Previous) {
            Parent::Previous if tree => {
                return Err(EngineError::InvalidBatch(format!(
                "sequence {}: token {i} continues linearly after tree nodes (keep a path first)",
                chunk.seq
            )))
            }
            Parent::Previous => NodeCtx::linear(slot),
            Parent::Slot(q) if q >= slot => {
                return Err(EngineError::InvalidBatch(format!(
                    "sequence {}: token {i}'s parent slot {q} is not before its slot {slot}",
                    chunk.seq
                )))
            }
            Parent::Slot(q) => {
                let parent = if q >= start {
                    all[first + q - start].clone()
                } else if q >= base {
                    tail[q - base].clone()
                } else {
                    NodeCtx::linear(q)
                };
                parent.child(slot)
            }
        };
        tree |= c != NodeCtx::linear(slot);
        all.push(c);
    }
    Ok(())
}

/// Move the K and V of `table`'s slots `path[i]` to slot `len + i`, every layer (ascending slots
/// at or above `len`: each copy goes down, onto a slot already read).
fn copy_slots(kv: &mut PagedKvCache, table: &[u32], len: usize, path: &[usize]) {
    let bs = kv.tables.page_size();
    let d = kv.kv_dim;
    let phys = |s: usize| table[s / bs] as usize * bs + s % bs;
    for (i, &from) in path.iter().enumerate() {
        let to = len + i;
        if to == from {
            continue;
        }
        let (f, t) = (phys(from) * d, phys(to) * d);
        for layer in kv.k.iter_mut().chain(kv.v.iter_mut()) {
            layer.copy_within(f..f + d, t);
        }
    }
}
