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
            Box::new(|m, _| set(m, "general.architecture", Value::String("gemma3".into()))),
            "`gemma3` is not supported (supported: llama)",
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
            "sliding-window attention (512 tokens)",
        ),
        (
            Box::new(|m, _| set(m, "llama.attention.key_length", Value::U32(32))),
            "llama.attention.key_length",
        ),
        (
            Box::new(|m, _| set(m, "llama.rope.dimension_count", Value::U32(8))),
            "partial rotary",
        ),
        (
            Box::new(|_, t| tensor(t, "rope_freqs.weight")),
            "rope_freqs.weight",
        ),
        (
            Box::new(|_, t| tensor(t, "blk.0.attn_q.bias")),
            "attention biases",
        ),
        (
            Box::new(|_, t| tensor(t, "blk.0.attn_q_norm.weight")),
            "QK-norm",
        ),
        (
            Box::new(|_, t| tensor(t, "blk.0.post_attention_norm.weight")),
            "norms after attention",
        ),
    ];
    for (edit, want) in cases {
        let e = load(&*edit).unwrap_err().to_string();
        assert!(e.contains(want), "{e} (wanted `{want}`)");
    }
    // What changes nothing is not refused: no scaling, a head size equal to the embedding over
    // the heads, a dense model.
    assert!(load(&|m, _| {
        set(m, "llama.rope.scaling.type", Value::String("none".into()));
        set(m, "llama.attention.key_length", Value::U32(16));
        set(m, "llama.expert_count", Value::U32(0));
    })
    .is_ok());
}
