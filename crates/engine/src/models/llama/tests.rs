use super::*;

fn rand(seed: u64, n: usize) -> Vec<f32> {
    crate::testing::signed_uniform(seed, n, 7)
}

/// Plain f64 attention of one head over positions laid out `at(j) = stride·j + off`.
fn reference(
    q: &[f32],
    ks: &[f32],
    vs: &[f32],
    n_ctx: usize,
    at: impl Fn(usize) -> usize,
) -> Vec<f64> {
    let hd = q.len();
    let scale = 1.0 / (hd as f64).sqrt();
    let s: Vec<f64> = (0..n_ctx)
        .map(|j| {
            (0..hd)
                .map(|i| q[i] as f64 * ks[at(j) + i] as f64)
                .sum::<f64>()
                * scale
        })
        .collect();
    let max = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = s.iter().map(|v| (v - max).exp()).collect();
    let sum: f64 = e.iter().sum();
    (0..hd)
        .map(|i| (0..n_ctx).map(|j| e[j] / sum * vs[at(j) + i] as f64).sum())
        .collect()
}

#[test]
fn attention_matches_a_plain_reference() {
    for hd in [64usize, 40, 160] {
        for n_ctx in [1usize, 7, 150] {
            let stride = 3 * hd; // other heads' slots between this head's positions
            let at = |j: usize| j * stride + hd;
            let ks = rand(1, n_ctx * stride + 2 * hd);
            let vs = rand(2, n_ctx * stride + 2 * hd);
            // Two tokens of three query heads that read the same KV head, the second's context
            // the first's and one more position: together and each head alone give the same
            // bits, and each the reference's.
            let qs: Vec<f32> = rand(3, 6 * hd).iter().map(|v| v * 4.0).collect();
            let scale = 1.0 / (hd as f32).sqrt();
            let rows: Vec<usize> = (0..n_ctx + 1).map(|j| j * stride).collect();
            let ctx = [&rows[..n_ctx], &rows[..]];
            let mut together = vec![0f32; 6 * hd];
            {
                let (a, b) = together.split_at_mut(3 * hd);
                attend(
                    kernels::Isa::Portable,
                    &[&qs[..3 * hd], &qs[3 * hd..]],
                    hd,
                    &ks,
                    &vs,
                    &ctx,
                    shared_context(&ctx),
                    hd,
                    scale,
                    &mut [a, b],
                );
            }
            for (i, q) in qs.chunks_exact(hd).enumerate() {
                let n = ctx[i / 3].len();
                let want = reference(q, &ks, &vs, n, at);
                let mut alone = vec![0f32; hd];
                attend(
                    kernels::Isa::Portable,
                    &[q],
                    hd,
                    &ks,
                    &vs,
                    &[ctx[i / 3]],
                    ctx[i / 3].len(),
                    hd,
                    scale,
                    &mut [&mut alone],
                );
                let got = &together[i * hd..(i + 1) * hd];
                assert_eq!(
                    got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    alone.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    "hd {hd} n_ctx {n}: head {i} together and alone differ"
                );
                for (g, w) in got.iter().zip(&want) {
                    assert!(
                        (*g as f64 - w).abs() < 1e-5,
                        "hd {hd} n_ctx {n}: {g} vs {w}"
                    );
                }
            }
        }
    }
}

/// What this LLaMA code would load wrong is refused, naming the key or tensor that declares it.
#[test]
fn models_of_other_kinds_are_refused_by_name() {
    use crate::testing::{tiny_gguf_with, TinySpec};
    use candle_core::quantized::gguf_file::Value;
    use candle_core::quantized::QTensor;
    type Meta = Vec<(String, Value)>;
    type Tensors = Vec<(String, QTensor)>;
    let spec = TinySpec::default();
    let load = |edit: &dyn Fn(&mut Meta, &mut Tensors)| {
        let bytes = tiny_gguf_with(&spec, |m, t| {
            edit(m, t);
            Ok(())
        })
        .unwrap();
        let g = GgufFile::from_bytes("tiny.gguf", bytes).unwrap();
        LlamaConfig::from_gguf(&g).map(|_| ())
    };
    let set = |m: &mut Meta, key: &str, v: Value| {
        m.retain(|(k, _)| k != key);
        m.push((key.to_string(), v));
    };
    let tensor = |t: &mut Tensors, name: &str| {
        let q = t[1].1.dequantize(&candle_core::Device::Cpu).unwrap();
        let q = QTensor::quantize(&q, candle_core::quantized::GgmlDType::F32).unwrap();
        t.push((name.to_string(), q));
    };
    assert!(load(&|_, _| ()).is_ok(), "the tiny model itself loads");
    type Edit<'a> = Box<dyn Fn(&mut Meta, &mut Tensors) + 'a>;
    let cases: Vec<(Edit, &str)> = vec![
        (
            Box::new(|m, _| set(m, "general.architecture", Value::String("gemma2".into()))),
            "`gemma2` is not supported (supported: llama, qwen2, qwen3, gemma3",
        ),
        (
            Box::new(|m, _| set(m, "llama.expert_count", Value::U32(8))),
            "llama.expert_count",
        ),
        (
            Box::new(|m, _| set(m, "llama.rope.scaling.type", Value::String("yarn".into()))),
            "RoPE scaling `yarn`",
        ),
        (
            Box::new(|m, _| set(m, "llama.attention.sliding_window", Value::U32(512))),
            "sliding-window attention (512 tokens) is supported for gemma3 only",
        ),
        (
            Box::new(|m, _| set(m, "llama.attention.value_length", Value::U32(32))),
            "value heads of 32 beside key heads of 16",
        ),
        (
            Box::new(|m, _| set(m, "llama.rope.dimension_count", Value::U32(8))),
            "partial rotary",
        ),
        (
            Box::new(|m, _| set(m, "llama.final_logit_softcapping", Value::F32(30.0))),
            "logit soft-capping",
        ),
        (
            Box::new(|_, t| tensor(t, "blk.0.attn_output.bias")),
            "attention output biases",
        ),
        (
            Box::new(|_, t| tensor(t, "blk.0.attn_q_norm.weight")),
            "QK-norm is not part of `llama`",
        ),
        (
            Box::new(|_, t| tensor(t, "blk.0.post_attention_norm.weight")),
            "norms after attention are not part of `llama`",
        ),
    ];
    for (edit, want) in cases {
        let e = load(&*edit).unwrap_err().to_string();
        assert!(e.contains(want), "{e} (wanted `{want}`)");
    }
    // What changes nothing is not refused: no scaling, a head size equal to the embedding over
    // the heads, a dense model; nor what is supported: linear scaling.
    assert!(load(&|m, _| {
        set(m, "llama.rope.scaling.type", Value::String("none".into()));
        set(m, "llama.attention.key_length", Value::U32(16));
        set(m, "llama.expert_count", Value::U32(0));
    })
    .is_ok());
    assert!(load(&|m, _| {
        set(m, "llama.rope.scaling.type", Value::String("linear".into()));
        set(m, "llama.rope.scaling.factor", Value::F32(4.0));
    })
    .is_ok());
    // A family without what it is made of is refused, naming the tensor.
    let gemma = TinySpec::family("gemma3");
    let bytes = tiny_gguf_with(&gemma, |_, t| {
        t.retain(|(n, _)| !n.ends_with("post_ffw_norm.weight"));
        Ok(())
    })
    .unwrap();
    let g = GgufFile::from_bytes("tiny.gguf", bytes).unwrap();
    let e = LlamaConfig::from_gguf(&g).unwrap_err().to_string();
    assert!(e.contains("blk.0.post_ffw_norm.weight"), "{e}");
}

/// Each family's tiny model loads with its features on, and its sliding-window layers read only
/// the window: a one-layer Gemma 3 gives the last token of a long text the logits it gives the
/// window's tokens alone (RoPE sees only distances; the rest is rounding). Planting the bug
/// (every layer over the whole context) fails it.
#[test]
fn families_load_and_a_window_reads_only_the_window() {
    use crate::testing::{tiny_file, TinySpec, TINY_FAMILIES};
    use crate::{Engine, EngineConfig, SeqChunk, SeqId, Wanted};
    use std::sync::Arc;
    for arch in TINY_FAMILIES {
        let m = LlamaModel::load(
            &mut tiny_file(&TinySpec::family(arch)).unwrap(),
            WeightMode::F32,
        )
        .unwrap();
        let c = &m.cfg;
        assert_eq!(c.arch, arch);
        assert_eq!(c.qkv_bias, arch == "qwen2", "{arch}");
        assert_eq!(c.qk_norm, arch == "qwen3" || arch == "gemma3", "{arch}");
        assert_eq!(c.post_norms, arch == "gemma3", "{arch}");
        let halves = arch != "llama";
        assert_eq!(c.rope_style == RopeStyle::Halves, halves, "{arch}");
        if arch == "gemma3" {
            let windowed: Vec<bool> = (0..c.n_layer).map(|l| c.is_windowed(l)).collect();
            assert_eq!(windowed, [true, true, true, true, true, false]);
            assert_eq!(c.activation, Activation::Gelu);
            assert_eq!(c.embed_scale, Some(8.0));
        }
    }
    let spec = TinySpec {
        n_layer: 1,
        window: 4,
        ..TinySpec::family("gemma3")
    };
    let m = Arc::new(LlamaModel::load(&mut tiny_file(&spec).unwrap(), WeightMode::F32).unwrap());
    assert!(m.cfg.is_windowed(0));
    let last = |tokens: &[u32]| {
        let mut e = Engine::new(m.clone(), EngineConfig::default()).unwrap();
        e.forward(&[SeqChunk::new(SeqId(0), 0, tokens.to_vec(), Wanted::Last)])
            .unwrap()
            .row(0)
            .to_vec()
    };
    let text: Vec<u32> = (0..23u32)
        .map(|i| (i * 37 + 5) % spec.vocab as u32)
        .collect();
    let window = &text[text.len() - 4..];
    let (long, short) = (last(&text), last(window));
    let err = long
        .iter()
        .zip(&short)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(err < 1e-4, "the window's logits differ by {err}");
    // The window's first token matters: the comparison can see a change of context.
    let mut changed = text.clone();
    let first = changed.len() - 4;
    changed[first] = (changed[first] + 1) % spec.vocab as u32;
    let moved = last(&changed)
        .iter()
        .zip(&long)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(
        moved > 1e-2,
        "the window's first token moved the logits by {moved} only"
    );
}

/// A draft head over part of the vocabulary scores those tokens as the whole head does, bit for
/// bit, in every weight mode; the others are −∞; the GGUF key restricts it at load; bad lists
/// are refused by name.
#[test]
fn a_restricted_head_scores_its_tokens_as_the_whole_head() {
    use crate::testing::{tiny_gguf_with, TinySpec};
    use crate::{Engine, EngineConfig, SeqChunk, SeqId, Wanted};
    use candle_core::quantized::gguf_file::Value;
    use candle_core::quantized::GgmlDType;
    use std::sync::Arc;
    let ids: Vec<u32> = vec![90, 3, 17, 40, 41, 0];
    let logits = |m: LlamaModel| {
        let mut e = Engine::new(Arc::new(m), EngineConfig::default()).unwrap();
        let l = e
            .forward(&[SeqChunk::new(SeqId(0), 0, vec![5, 9, 77, 3], Wanted::All)])
            .unwrap();
        (0..l.rows.len())
            .map(|r| l.row(r).to_vec())
            .collect::<Vec<_>>()
    };
    for (dtype, mode) in [
        (GgmlDType::F32, WeightMode::F32),
        (GgmlDType::Q8_0, WeightMode::Native),
        (GgmlDType::Q4_0, WeightMode::W4A8),
    ] {
        let spec = TinySpec {
            dtype,
            ..TinySpec::family("gemma3")
        };
        let bytes = tiny_gguf_with(&spec, |_, _| Ok(())).unwrap();
        let load = |b: Vec<u8>| LlamaModel::load(&mut GgufFile::from_bytes("t", b).unwrap(), mode);
        let full = logits(load(bytes.clone()).unwrap());
        let mut m = load(bytes.clone()).unwrap();
        m.restrict_head(ids.clone()).unwrap();
        assert!(m.bytes_per_token() < load(bytes.clone()).unwrap().bytes_per_token());
        let part = logits(m);
        for (f, p) in full.iter().zip(&part) {
            for (t, (a, b)) in f.iter().zip(p).enumerate() {
                if ids.contains(&(t as u32)) {
                    assert_eq!(a.to_bits(), b.to_bits(), "{mode:?} token {t}");
                } else {
                    assert_eq!(*b, f32::NEG_INFINITY, "{mode:?} token {t}");
                }
            }
        }
        // The key in the file does the same at load.
        let keyed = tiny_gguf_with(&spec, |meta, _| {
            meta.push((
                DRAFT_VOCAB_KEY.into(),
                Value::Array(ids.iter().map(|&i| Value::U32(i)).collect()),
            ));
            Ok(())
        })
        .unwrap();
        let m = load(keyed).unwrap();
        let mut sorted = ids.clone();
        sorted.sort_unstable();
        assert_eq!(m.head_vocab(), Some(&sorted[..]));
        assert_eq!(logits(m), part);
    }
    let mut m = LlamaModel::load(
        &mut crate::testing::tiny_file(&TinySpec::default()).unwrap(),
        WeightMode::F32,
    )
    .unwrap();
    for (bad, want) in [
        (vec![], "no token ids"),
        (vec![3, 4, 3], "token 3 is listed twice"),
        (vec![1, 96], "token 96 is past the vocabulary (96 tokens)"),
    ] {
        let e = m.restrict_head(bad).unwrap_err().to_string();
        assert!(e.contains(want) && e.contains(DRAFT_VOCAB_KEY), "{e}");
    }
}

/// Every GGUF weight type the issue names loads and dequantizes to the weights it stores: a tiny
/// model whose linear layers are in that type gives logits close to the same model's in f32
/// (cosine ≥ 0.999 at 8 bits and more, ≥ 0.98 at 4 to 6), in the f32 target's mode and, where
/// the type has its own kernels, in the draft's.
#[test]
fn every_gguf_weight_type_loads() {
    use crate::testing::{tiny_file, TinySpec};
    use crate::{Engine, EngineConfig, SeqChunk, SeqId, Wanted};
    use candle_core::quantized::GgmlDType as T;
    use std::sync::Arc;
    let spec = |dtype| TinySpec {
        dtype,
        dim: 256,
        ff_dim: 512,
        ..TinySpec::family("llama")
    };
    let logits = |dtype, mode| {
        let m = LlamaModel::load(&mut tiny_file(&spec(dtype)).unwrap(), mode).unwrap();
        let mut e = Engine::new(Arc::new(m), EngineConfig::default()).unwrap();
        let l = e
            .forward(&[SeqChunk::new(
                SeqId(0),
                0,
                vec![5, 9, 77, 3, 60],
                Wanted::All,
            )])
            .unwrap();
        l.data
    };
    let want = logits(T::F32, WeightMode::F32);
    let cos = |a: &[f32]| {
        let dot: f64 = a
            .iter()
            .zip(&want)
            .map(|(x, y)| *x as f64 * *y as f64)
            .sum();
        let n = |v: &[f32]| v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
        dot / (n(a) * n(&want))
    };
    for (dtype, least) in [
        (T::F16, 0.999),
        (T::BF16, 0.999),
        (T::Q8_0, 0.999),
        (T::Q6K, 0.98),
        (T::Q5K, 0.98),
        (T::Q5_0, 0.98),
        (T::Q5_1, 0.98),
        (T::Q4K, 0.98),
        (T::Q4_0, 0.98),
        (T::Q4_1, 0.98),
    ] {
        let c = cos(&logits(dtype, WeightMode::F32));
        assert!(
            c >= least,
            "{dtype:?}: cosine {c} to the f32 model's logits"
        );
        let c = cos(&logits(dtype, WeightMode::Native));
        assert!(c >= least, "{dtype:?} native: cosine {c}");
    }
}
