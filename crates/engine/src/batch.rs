//! The ragged batch: several sequences, each with its own start position and new tokens, and the
//! logits that come back only where they were asked for.

use crate::kv::SeqId;
use crate::tree::Parent;

/// Which of a chunk's tokens need logits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Wanted {
    None,
    /// The last token only (prefill, plain decoding).
    Last,
    /// Every token (verification of a draft block).
    All,
    /// These indices into the chunk's tokens, ascending.
    At(Vec<usize>),
}

impl Wanted {
    pub fn indices(&self, n: usize) -> Vec<usize> {
        match self {
            Wanted::None => Vec::new(),
            Wanted::Last => n.checked_sub(1).into_iter().collect(),
            Wanted::All => (0..n).collect(),
            Wanted::At(v) => v.clone(),
        }
    }
}

/// New tokens of one sequence: `tokens[i]` goes to KV slot `start_pos + i`. In a linear chunk
/// (`parents` empty) that is also its position. In a tree chunk, `parents[i]` says where token
/// `i` hangs (see [`crate::tree`]): after the slot before it, or as the child of an earlier slot,
/// one position after it.
#[derive(Debug, Clone)]
pub struct SeqChunk {
    pub seq: SeqId,
    pub start_pos: usize,
    pub tokens: Vec<u32>,
    pub logits: Wanted,
    pub parents: Vec<Parent>,
}

impl SeqChunk {
    pub fn new(seq: SeqId, start_pos: usize, tokens: Vec<u32>, logits: Wanted) -> Self {
        Self {
            seq,
            start_pos,
            tokens,
            logits,
            parents: Vec::new(),
        }
    }

    /// A tree chunk: `parents[i]` is where `tokens[i]` hangs.
    pub fn tree(
        seq: SeqId,
        start_pos: usize,
        tokens: Vec<u32>,
        parents: Vec<Parent>,
        logits: Wanted,
    ) -> Self {
        Self {
            seq,
            start_pos,
            tokens,
            logits,
            parents,
        }
    }

    /// Each token's position, for a chunk whose parents are in the chunk or linear slots before
    /// it (what a verifier sends: its sequences are linear between forwards).
    pub fn positions(&self) -> Vec<usize> {
        let mut pos: Vec<usize> = Vec::with_capacity(self.tokens.len());
        for i in 0..self.tokens.len() {
            let slot = self.start_pos + i;
            pos.push(match self.parents.get(i) {
                None | Some(Parent::Previous) => slot,
                Some(&Parent::Slot(q)) if q >= self.start_pos && q < slot => {
                    pos[q - self.start_pos] + 1
                }
                // Not a parent the engine accepts; counted as the slot before.
                Some(&Parent::Slot(q)) if q >= slot => slot,
                Some(&Parent::Slot(q)) => q + 1,
            });
        }
        pos
    }
}

/// Where one row of logits came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogitsRow {
    pub seq: SeqId,
    /// Index into the chunk's tokens.
    pub index: usize,
    /// Position of that token (its KV slot, unless it is a tree node).
    pub pos: usize,
    /// Index of that token in the whole batch.
    pub token: usize,
}

/// `[num_wanted, vocab]` logits with their provenance, in batch order.
#[derive(Debug, Clone)]
pub struct Logits {
    pub vocab: usize,
    pub data: Vec<f32>,
    pub rows: Vec<LogitsRow>,
}

impl Logits {
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.vocab..(i + 1) * self.vocab]
    }

    /// The rows of `seq`, in position order.
    pub fn for_seq(&self, seq: SeqId) -> impl Iterator<Item = (LogitsRow, &[f32])> {
        self.rows
            .iter()
            .enumerate()
            .filter(move |(_, r)| r.seq == seq)
            .map(|(i, r)| (*r, self.row(i)))
    }

    /// The last row of `seq`, if it asked for any.
    pub fn last_for(&self, seq: SeqId) -> Option<&[f32]> {
        self.for_seq(seq).last().map(|(_, l)| l)
    }

    /// Logits for the positions `batch` asks for, one-hot at `next(seq, pos, token)`: the greedy
    /// choice of a model that follows `token` at position `pos` (simulated targets).
    pub fn one_hot(
        batch: &[SeqChunk],
        vocab: usize,
        next: impl Fn(SeqId, usize, u32) -> u32,
    ) -> Self {
        Self::one_hot_at(batch, vocab, |k, i, pos| {
            next(batch[k].seq, pos, batch[k].tokens[i])
        })
    }

    /// Logits for the positions `batch` asks for, one-hot at `next(k, i, pos)` for token `i` (at
    /// position `pos`) of chunk `k`: a simulated target whose choice depends on more than the
    /// token (a token tree's branch, the KV it reads).
    pub fn one_hot_at(
        batch: &[SeqChunk],
        vocab: usize,
        next: impl Fn(usize, usize, usize) -> u32,
    ) -> Self {
        let (mut rows, mut data, mut t0) = (Vec::new(), Vec::new(), 0);
        for (k, c) in batch.iter().enumerate() {
            let positions = c.positions();
            for i in c.logits.indices(c.tokens.len()) {
                let pos = positions[i];
                let mut row = vec![0f32; vocab];
                row[next(k, i, pos) as usize] = 1.0;
                data.extend_from_slice(&row);
                rows.push(LogitsRow {
                    seq: c.seq,
                    index: i,
                    pos,
                    token: t0 + i,
                });
            }
            t0 += c.tokens.len();
        }
        Self { vocab, data, rows }
    }
}
