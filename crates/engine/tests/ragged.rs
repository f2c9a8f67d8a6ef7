//! Ragged batches and the paged KV cache on tiny random models built in-process.

use std::sync::Arc;

use candle_core::quantized::GgmlDType;
use tandem_engine::testing::{tiny_file, TinySpec, TINY_FAMILIES};
use tandem_engine::{
    Engine, EngineConfig, EngineError, LlamaModel, SeqChunk, SeqId, Wanted, WeightMode,
};
use tandem_spec::sampling as sampler;

fn model(dtype: GgmlDType, mode: WeightMode) -> Arc<LlamaModel> {
    model_of("llama", dtype, mode)
}

/// A tiny model of family `arch` (see [`TinySpec::family`]).
fn model_of(arch: &'static str, dtype: GgmlDType, mode: WeightMode) -> Arc<LlamaModel> {
    let mut spec = TinySpec {
        dtype,
        ..TinySpec::family(arch)
    };
    if dtype.block_size() > spec.dim {
        // k-quant super-blocks of 256: rows at least that wide.
        (spec.dim, spec.ff_dim) = (dtype.block_size(), 2 * dtype.block_size());
    }
    Arc::new(LlamaModel::load(&mut tiny_file(&spec).unwrap(), mode).unwrap())
}

fn engine(m: &Arc<LlamaModel>, threads: usize) -> Engine {
    let cfg = EngineConfig {
        threads,
        kv_budget_bytes: 4 << 20,
        kv_block_size: 4,
        ..EngineConfig::default()
    };
    Engine::new(m.clone(), cfg).unwrap()
}

fn prompt(seed: u64, n: usize, vocab: usize) -> Vec<u32> {
    (0..n as u64)
        .map(|i| (sampler::uniform(seed, i, 1) * vocab as f64) as u32)
        .collect()
}

/// Logits of every position of `tokens`, fed in chunks of `chunk` tokens.
fn alone(m: &Arc<LlamaModel>, tokens: &[u32], chunk: usize) -> Vec<Vec<f32>> {
    let mut e = engine(m, 1);
    let mut out = Vec::new();
    for (i, c) in tokens.chunks(chunk).enumerate() {
        let l = e
            .forward(&[SeqChunk::new(SeqId(0), i * chunk, c.to_vec(), Wanted::All)])
            .unwrap();
        out.extend((0..l.rows.len()).map(|r| l.row(r).to_vec()));
    }
    out
}

fn assert_close(a: &[f32], b: &[f32], what: &str) {
    let norm = b.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-6);
    let diff = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y) * (x - y))
        .sum::<f32>()
        .sqrt();
    assert!(
        diff / norm <= 1e-4,
        "{what}: relative error {}",
        diff / norm
    );
}

#[test]
fn ragged_batch_equals_each_sequence_alone() {
    let formats = [
        (GgmlDType::F32, WeightMode::F32),
        (GgmlDType::Q4_0, WeightMode::Native),
        (GgmlDType::Q4_1, WeightMode::Native),
        (GgmlDType::Q8_0, WeightMode::Native),
        (GgmlDType::Q5_0, WeightMode::Native),
        (GgmlDType::Q4K, WeightMode::Native),
        (GgmlDType::Q6K, WeightMode::Native),
        (GgmlDType::F32, WeightMode::F16),
        // 8-bit activations (the edge's draft) on every block format with an integer kernel.
        (GgmlDType::Q4_0, WeightMode::W4A8),
        (GgmlDType::Q8_0, WeightMode::W4A8),
        (GgmlDType::Q5_0, WeightMode::W4A8),
        (GgmlDType::Q4K, WeightMode::W4A8),
        (GgmlDType::Q6K, WeightMode::W4A8),
    ];
    // Every format on LLaMA; every family in f32 and in Q4_0 blocks (Gemma 3's windows of 5
    // tokens are shorter than the sequences).
    let cases =
        formats
            .iter()
            .map(|&(d, m)| ("llama", d, m))
            .chain(TINY_FAMILIES[1..].iter().flat_map(|&a| {
                [
                    (a, GgmlDType::F32, WeightMode::F32),
                    (a, GgmlDType::Q4_0, WeightMode::Native),
                ]
            }));
    for (arch, dtype, mode) in cases {
        let m = model_of(arch, dtype, mode);
        let mode = (arch, mode);
        let v = m.cfg.vocab;
        let seqs: Vec<Vec<u32>> = (0..4).map(|s| prompt(s, 7 + 5 * s as usize, v)).collect();
        let refs: Vec<Vec<Vec<f32>>> = seqs.iter().map(|t| alone(&m, t, 64)).collect();
        // Batched: prefill different prefix lengths, then continue each sequence with a ragged chunk.
        let mut e = engine(&m, 2);
        let split = [3usize, 1, 9, 12];
        let first: Vec<SeqChunk> = (0..4)
            .map(|s| {
                SeqChunk::new(
                    SeqId(s as u64),
                    0,
                    seqs[s][..split[s]].to_vec(),
                    Wanted::All,
                )
            })
            .collect();
        let l1 = e.forward(&first).unwrap();
        let rest: Vec<SeqChunk> = (0..4)
            .map(|s| {
                SeqChunk::new(
                    SeqId(s as u64),
                    split[s],
                    seqs[s][split[s]..].to_vec(),
                    Wanted::All,
                )
            })
            .collect();
        let l2 = e.forward(&rest).unwrap();
        for (s, want) in refs.iter().enumerate() {
            let got: Vec<Vec<f32>> = l1
                .for_seq(SeqId(s as u64))
                .chain(l2.for_seq(SeqId(s as u64)))
                .map(|(_, r)| r.to_vec())
                .collect();
            assert_eq!(got.len(), want.len());
            for (p, (g, r)) in got.iter().zip(want).enumerate() {
                assert_close(g, r, &format!("{mode:?} seq {s} pos {p}"));
            }
        }
    }
}

#[test]
fn logits_only_where_asked() {
    let m = model(GgmlDType::F32, WeightMode::F32);
    let mut e = engine(&m, 1);
    let toks = prompt(3, 10, m.cfg.vocab);
    let l = e
        .forward(&[
            SeqChunk::new(SeqId(1), 0, toks.clone(), Wanted::At(vec![2, 7])),
            SeqChunk::new(SeqId(2), 0, toks[..4].to_vec(), Wanted::None),
            SeqChunk::new(SeqId(3), 0, toks[..5].to_vec(), Wanted::Last),
        ])
        .unwrap();
    assert_eq!(l.data.len(), 3 * m.cfg.vocab);
    let pos: Vec<(u64, usize)> = l.rows.iter().map(|r| (r.seq.0, r.pos)).collect();
    assert_eq!(pos, vec![(1, 2), (1, 7), (3, 4)]);
    let full = alone(&m, &toks, 64);
    assert_close(l.row(1), &full[7], "row for position 7");
}

#[test]
fn truncate_then_continue_equals_a_fresh_run() {
    let m = model(GgmlDType::Q4_0, WeightMode::Native);
    let v = m.cfg.vocab;
    let good = prompt(5, 20, v);
    let mut e = engine(&m, 2);
    // Feed 14 tokens of which the last 6 are a rejected draft, roll back to 8, continue correctly.
    let mut wrong = good[..8].to_vec();
    wrong.extend(prompt(99, 6, v));
    e.forward(&[SeqChunk::new(SeqId(4), 0, wrong, Wanted::Last)])
        .unwrap();
    e.truncate(SeqId(4), 8).unwrap();
    assert_eq!(e.seq_len(SeqId(4)), 8);
    let l = e
        .forward(&[SeqChunk::new(SeqId(4), 8, good[8..].to_vec(), Wanted::All)])
        .unwrap();
    let fresh = alone(&m, &good, 64);
    for (i, (_, row)) in l.for_seq(SeqId(4)).enumerate() {
        assert_eq!(row, &fresh[8 + i][..], "position {}", 8 + i);
    }
}

#[test]
fn greedy_decoding_is_identical_alone_or_batched() {
    for arch in TINY_FAMILIES {
        let m = model_of(arch, GgmlDType::F32, WeightMode::F32);
        let v = m.cfg.vocab;
        let greedy = |e: &mut Engine, seqs: &[(u64, Vec<u32>)], steps: usize| -> Vec<Vec<u32>> {
            let mut out = vec![Vec::new(); seqs.len()];
            let mut chunks: Vec<SeqChunk> = seqs
                .iter()
                .map(|(s, p)| SeqChunk::new(SeqId(*s), 0, p.clone(), Wanted::Last))
                .collect();
            for _ in 0..steps {
                let l = e.forward(&chunks).unwrap();
                for (i, c) in chunks.iter_mut().enumerate() {
                    let next = sampler::argmax(l.last_for(c.seq).unwrap());
                    out[i].push(next);
                    c.start_pos += c.tokens.len();
                    c.tokens = vec![next];
                }
            }
            out
        };
        let seqs: Vec<(u64, Vec<u32>)> = (0..5)
            .map(|s| (s, prompt(s + 20, 3 + 4 * s as usize, v)))
            .collect();
        let mut batched_engine = engine(&m, 2);
        let batched = greedy(&mut batched_engine, &seqs, 12);
        for (i, s) in seqs.iter().enumerate() {
            let alone = greedy(&mut engine(&m, 1), std::slice::from_ref(s), 12);
            assert_eq!(alone[0], batched[i], "{arch} sequence {i}");
        }
    }
}

#[test]
fn kv_exhaustion_is_a_typed_error_and_keeps_state() {
    let m = model(GgmlDType::F32, WeightMode::F32);
    // 2 layers, kv_dim 32, block of 4 tokens: 2*2*4*32*4 = 2 KiB per block; 6 blocks.
    let cfg = EngineConfig {
        threads: 1,
        kv_budget_bytes: 6 * 2048,
        kv_block_size: 4,
        ..EngineConfig::default()
    };
    let mut e = Engine::new(m.clone(), cfg).unwrap();
    let toks = prompt(1, 16, m.cfg.vocab);
    e.forward(&[SeqChunk::new(SeqId(1), 0, toks.clone(), Wanted::Last)])
        .unwrap();
    let err = e
        .forward(&[SeqChunk::new(
            SeqId(2),
            0,
            toks[..12].to_vec(),
            Wanted::Last,
        )])
        .unwrap_err();
    assert!(
        matches!(
            err,
            EngineError::OutOfBlocks {
                needed: 3,
                free: 2,
                total: 6,
                block_size: 4
            }
        ),
        "{err}"
    );
    assert_eq!(e.seq_len(SeqId(1)), 16);
    assert_eq!(e.seq_len(SeqId(2)), 0);
    assert_eq!(e.kv().tables.num_free_blocks(), 2);
    e.free(SeqId(1));
    e.forward(&[SeqChunk::new(
        SeqId(2),
        0,
        toks[..12].to_vec(),
        Wanted::Last,
    )])
    .unwrap();
}

#[test]
fn bad_batches_are_refused_by_name() {
    let m = model(GgmlDType::F32, WeightMode::F32);
    let mut e = engine(&m, 1);
    let bad_tok = SeqChunk::new(SeqId(1), 0, vec![1, 9999], Wanted::Last);
    assert!(matches!(
        e.forward(&[bad_tok]),
        Err(EngineError::InvalidToken { token: 9999, .. })
    ));
    let gap = SeqChunk::new(SeqId(1), 3, vec![1], Wanted::Last);
    assert!(matches!(
        e.forward(&[gap]),
        Err(EngineError::PositionMismatch {
            expected: 0,
            got: 3,
            ..
        })
    ));
    let a = SeqChunk::new(SeqId(1), 0, vec![1], Wanted::Last);
    assert!(matches!(
        e.forward(&[a.clone(), a]),
        Err(EngineError::InvalidBatch(_))
    ));
    let long = SeqChunk::new(SeqId(1), 0, vec![1; 300], Wanted::Last);
    assert!(matches!(
        e.forward(&[long]),
        Err(EngineError::ContextOverflow {
            end: 300,
            max: 256,
            ..
        })
    ));
    assert_eq!(e.seq_len(SeqId(1)), 0);
}

/// A skipped layer is left out exactly: skipping a layer that adds nothing to the residual stream
/// (zero output projections) leaves every logit as it was, and skipping a real one changes them.
#[test]
fn skipped_layers_are_left_out_exactly() {
    let spec = TinySpec {
        n_layer: 3,
        silent_layer: Some(1),
        ..TinySpec::default()
    };
    let load = || LlamaModel::load(&mut tiny_file(&spec).unwrap(), WeightMode::Native).unwrap();
    let tokens = prompt(5, 12, spec.vocab);
    let full = alone(&Arc::new(load()), &tokens, 5);
    let mut m = load();
    m.skip_layers(&[1]).unwrap();
    assert_eq!(m.skipped_layers(), vec![1]);
    let skipped = alone(&Arc::new(m), &tokens, 5);
    for (a, b) in skipped.iter().zip(&full) {
        assert_close(a, b, "silent layer skipped");
    }
    let mut m = load();
    m.skip_layers(&[2]).unwrap();
    let other = alone(&Arc::new(m), &tokens, 5);
    assert!(other.iter().zip(&full).any(|(a, b)| a != b));
    let mut m = load();
    let e = m.skip_layers(&[3]).unwrap_err().to_string();
    assert!(e.contains("skip_layers") && e.contains("layer 3"), "{e}");
    assert!(m.skip_layers(&[0, 1, 2]).is_err());
    let e = m.skip_layers(&[1, 1]).unwrap_err().to_string();
    assert!(e.contains("layer 1 is listed twice"), "{e}");
}

/// Activation fake-quantization: 8 bits stays close to the unquantized forward, 4 bits drifts
/// further, and the grid is checked on its own.
#[test]
fn activation_fake_quantization_costs_more_at_fewer_bits() {
    let load = || {
        LlamaModel::load(
            &mut tiny_file(&TinySpec::default()).unwrap(),
            WeightMode::Native,
        )
        .unwrap()
    };
    let tokens = prompt(9, 10, 96);
    let base = alone(&Arc::new(load()), &tokens, 10);
    let err = |bits: u32| {
        let mut m = load();
        m.set_activation_bits(Some(bits)).unwrap();
        let l = alone(&Arc::new(m), &tokens, 10);
        let (mut num, mut den) = (0f64, 0f64);
        for (a, b) in l.iter().flatten().zip(base.iter().flatten()) {
            num += ((a - b) as f64).powi(2);
            den += (*b as f64).powi(2);
        }
        (num / den).sqrt()
    };
    let (e8, e4) = (err(8), err(4));
    assert!(e8 > 0.0 && e8 < 0.02, "8-bit error {e8}");
    assert!(e4 > 3.0 * e8, "4-bit error {e4} vs 8-bit {e8}");
    assert!(load().set_activation_bits(Some(9)).is_err());
    // The grid: every value is a multiple of the row's step, within half a step of the input.
    let mut x = vec![0.3f32, -1.2, 0.05, 0.9, 0.0, 0.0, 0.0, 0.0];
    let orig = x.clone();
    tandem_engine::models::llama::fake_quantize_rows(&mut x, 4, 4);
    let step = 1.2 / 7.0;
    for (a, b) in x[..4].iter().zip(&orig[..4]) {
        assert!((a - b).abs() <= step / 2.0 + 1e-6, "{a} vs {b}");
        assert!(
            ((a / step).round() - a / step).abs() < 1e-4,
            "{a} off the grid"
        );
    }
    assert_eq!(&x[4..], &[0.0; 4], "a zero row stays zero");
}
