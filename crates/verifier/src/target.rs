//! What the verifier needs from the target model.

use tandem_engine::{Engine, EngineError, Logits, SeqChunk};

/// The target model as the verifier sees it: its vocabulary, the KV geometry its scheduler plans
/// for, and one ragged forward over the chunks the scheduler chose. [`Engine`] is the real one;
/// `tandem-sim` runs the same verifier over a cost model.
pub trait Target {
    fn vocab(&self) -> usize;
    /// Positions a sequence may reach.
    fn context_len(&self) -> usize;
    /// Token slots per KV page, and pages.
    fn kv_geometry(&self) -> (usize, usize);
    /// One forward over `batch` (with the scheduler's page `tables`), and how long it took (µs):
    /// the verifier's clock advances by it.
    fn forward_timed(
        &mut self,
        batch: &[SeqChunk],
        tables: &[Vec<u32>],
    ) -> (Result<Logits, EngineError>, u32);
    /// Keep a token tree's accepted path: the K and V of `table`'s slots `path` move to the
    /// slots from `len` on (see [`Engine::keep_path_paged`]).
    fn keep_path(&mut self, table: &[u32], len: usize, path: &[usize]) -> Result<(), EngineError>;
}

impl Target for Engine {
    fn vocab(&self) -> usize {
        self.model().cfg.vocab
    }

    fn context_len(&self) -> usize {
        self.model().cfg.context_len
    }

    fn kv_geometry(&self) -> (usize, usize) {
        let t = &self.kv().tables;
        (t.page_size(), t.num_pages())
    }

    fn forward_timed(
        &mut self,
        batch: &[SeqChunk],
        tables: &[Vec<u32>],
    ) -> (Result<Logits, EngineError>, u32) {
        let t0 = std::time::Instant::now();
        let r = self.forward_paged(batch, tables);
        (r, t0.elapsed().as_micros().min(u32::MAX as u128) as u32)
    }

    fn keep_path(&mut self, table: &[u32], len: usize, path: &[usize]) -> Result<(), EngineError> {
        self.keep_path_paged(table, len, path)
    }
}
