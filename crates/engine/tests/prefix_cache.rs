//! The prefix cache is exact: a sequence that starts from KV pages another sequence computed (a
//! cached prefix, shared through the one allocator, [`tandem_sched::PagePool`]) gets the same
//! next-token logits, bit for bit, as a fresh run that computes its whole prompt in one chunk.
//! Batch invariance makes it so: a position's K and V do not depend on how its sequence was cut
//! into chunks, nor on what else was in the forward.

use std::sync::Arc;

use candle_core::quantized::GgmlDType;
use tandem_engine::testing::{tiny_file, TinySpec};
use tandem_engine::{Engine, EngineConfig, LlamaModel, SeqChunk, SeqId, Wanted, WeightMode};
use tandem_sched::{PageHash, PagePool};

const PAGE: usize = 4;

fn model(dtype: GgmlDType, mode: WeightMode) -> Arc<LlamaModel> {
    let spec = TinySpec {
        dtype,
        ..TinySpec::default()
    };
    Arc::new(LlamaModel::load(&mut tiny_file(&spec).unwrap(), mode).unwrap())
}

fn engine(m: &Arc<LlamaModel>) -> Engine {
    let cfg = EngineConfig {
        threads: 2,
        kv_budget_bytes: 4 << 20,
        kv_block_size: PAGE,
        ..EngineConfig::default()
    };
    Engine::new(m.clone(), cfg).unwrap()
}

fn text(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 7 + seed * 13 + 3) % 90)
        .collect()
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn a_cached_prefix_gives_the_next_logits_of_a_fresh_run_bit_for_bit() {
    for (dtype, mode) in [
        (GgmlDType::F32, WeightMode::F32),
        (GgmlDType::Q4_0, WeightMode::Native),
    ] {
        let m = model(dtype, mode);
        let mut e = engine(&m);
        let (page_size, pages) = (e.kv().tables.page_size(), e.kv().tables.num_pages());
        assert_eq!(page_size, PAGE);
        // The scheduler's pool over the engine's pages, as in the verifier.
        let mut pool: PagePool<u64> = PagePool::new(pages, PAGE).unwrap();
        // A conversation's second turn: the first turn's 22 tokens, then 9 new ones.
        let first = text(1, 22);
        let mut second = first.clone();
        second.extend(text(2, 9));

        // Fresh: the whole second prompt in one chunk.
        pool.grow(1, second.len()).unwrap();
        let fresh = e
            .forward_paged(
                &[SeqChunk::new(SeqId(1), 0, second.clone(), Wanted::Last)],
                &[pool.table(1).to_vec()],
            )
            .unwrap();
        let fresh = bits(fresh.last_for(SeqId(1)).unwrap());

        // The first turn, in chunks of 5 beside another sequence in the same forwards, publishes
        // its full pages.
        let other = text(3, 22);
        let mut chain = Vec::new();
        PageHash::extend_chain(&mut chain, 7, PAGE, &first);
        for start in (0..first.len()).step_by(5) {
            let end = (start + 5).min(first.len());
            pool.grow(2, end).unwrap();
            pool.grow(3, end).unwrap();
            e.forward_paged(
                &[
                    SeqChunk::new(SeqId(3), start, other[start..end].to_vec(), Wanted::None),
                    SeqChunk::new(SeqId(2), start, first[start..end].to_vec(), Wanted::None),
                ],
                &[pool.table(3).to_vec(), pool.table(2).to_vec()],
            )
            .unwrap();
        }
        for (i, &h) in chain.iter().enumerate() {
            assert!(pool.publish(2, i, h));
        }
        pool.free_all(2);

        // The second turn starts from the 5 cached pages (20 tokens) and computes the other 11.
        let mut want = Vec::new();
        PageHash::extend_chain(&mut want, 7, PAGE, &second);
        let cached = pool.lookup(&want);
        assert_eq!(cached.len(), 5);
        pool.attach(4, &cached).unwrap();
        pool.grow(4, second.len()).unwrap();
        assert!(pool.writable(4, 20, second.len()));
        let got = e
            .forward_paged(
                &[SeqChunk::new(
                    SeqId(4),
                    20,
                    second[20..].to_vec(),
                    Wanted::Last,
                )],
                &[pool.table(4).to_vec()],
            )
            .unwrap();
        assert_eq!(
            bits(got.last_for(SeqId(4)).unwrap()),
            fresh,
            "{dtype:?}: the logits after a cached prefix differ from a fresh run's"
        );
        // A wrong page (another text's) changes them: the test can see a bad cache.
        pool.free_all(4);
        let mut wrong = cached.clone();
        wrong[2] = pool.table(3)[2];
        let mut t = wrong.clone();
        t.extend(pool.table(1)[5..8].iter());
        let bad = e
            .forward_paged(
                &[SeqChunk::new(
                    SeqId(5),
                    20,
                    second[20..].to_vec(),
                    Wanted::Last,
                )],
                &[t],
            )
            .unwrap();
        assert_ne!(bits(bad.last_for(SeqId(5)).unwrap()), fresh);
        assert!(pool.conserved());
    }
}

/// The next logits of `tokens`, computed in one chunk by a fresh engine.
fn fresh_last(m: &Arc<LlamaModel>, tokens: &[u32]) -> Vec<u32> {
    feed(&mut engine(m), SeqId(9), tokens, 0)
}

/// Feed `seq` the tokens of `all` from `from` on; the next logits.
fn feed(e: &mut Engine, seq: SeqId, all: &[u32], from: usize) -> Vec<u32> {
    let l = e
        .forward(&[SeqChunk::new(seq, from, all[from..].to_vec(), Wanted::Last)])
        .unwrap();
    bits(l.last_for(seq).unwrap())
}

/// An engine's own sequences (the edge's draft) share its prefix cache: a conversation's next
/// turn attaches the pages its last turn published and computes only its new tokens, with the
/// logits of a fresh run bit for bit. Rolling the new turn back into a shared page lets that
/// page go instead of writing into it, so the turn that published it (still running) and a
/// third turn attaching it again are unchanged.
#[test]
fn an_engines_own_sequences_share_its_prefix_cache_exactly() {
    for (dtype, mode) in [
        (GgmlDType::F32, WeightMode::F32),
        (GgmlDType::Q4_0, WeightMode::Native),
    ] {
        let m = model(dtype, mode);
        let mut e = engine(&m);
        let first = text(1, 22);
        let mut second = first.clone();
        second.extend(text(2, 9));

        // Turn one, in chunks, publishing as it goes.
        for start in (0..first.len()).step_by(5) {
            let end = (start + 5).min(first.len());
            e.forward(&[SeqChunk::new(
                SeqId(1),
                start,
                first[start..end].to_vec(),
                Wanted::Last,
            )])
            .unwrap();
            e.publish(SeqId(1), &first[..end]);
        }
        // Turn two attaches the 5 whole pages of the first 21 tokens (20 tokens).
        let n = e.attach_cached(SeqId(2), &second).unwrap();
        assert_eq!(n, 20);
        assert_eq!(e.seq_len(SeqId(2)), 20);
        assert_eq!(feed(&mut e, SeqId(2), &second, n), fresh_last(&m, &second));
        assert!(e.kv().tables.cache_counts().hits >= 5);

        // Turn two rolls back to 18 tokens, inside the fifth page, which turn one holds too: the
        // page is let go (not written), 16 tokens are kept, and the caller feeds from there.
        let kept = e.truncate(SeqId(2), 18).unwrap();
        assert_eq!(kept, 16);
        let other = text(5, 6);
        let mut alt = second[..16].to_vec();
        alt.extend(&other);
        assert_eq!(feed(&mut e, SeqId(2), &alt, 16), fresh_last(&m, &alt));
        // Turn one goes on from its own pages, unchanged.
        let mut more = first.clone();
        more.extend(text(4, 3));
        assert_eq!(feed(&mut e, SeqId(1), &more, 22), fresh_last(&m, &more));
        // Turn one ends; its pages stay cached, and a third turn still gets the first one's
        // logits from them.
        e.free(SeqId(1));
        e.free(SeqId(2));
        assert!(e.kv().tables.num_cached_blocks() >= 5);
        let n = e.attach_cached(SeqId(3), &second).unwrap();
        assert_eq!(n, 20);
        assert_eq!(feed(&mut e, SeqId(3), &second, n), fresh_last(&m, &second));
        assert!(e.kv().tables.conserved());
        // A sequence that holds tokens cannot attach, and nothing writes into a shared page.
        assert!(e.attach_cached(SeqId(3), &second).is_err());
        let mut e2 = engine(&m);
        e2.forward(&[SeqChunk::new(SeqId(1), 0, first.clone(), Wanted::Last)])
            .unwrap();
        e2.publish(SeqId(1), &first);
        e2.attach_cached(SeqId(2), &second).unwrap();
        assert!(e2.keep_tree(SeqId(2), 18, &[18]).is_err());
    }
}
