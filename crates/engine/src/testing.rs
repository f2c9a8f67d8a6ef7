//! Tiny random models of each family built in-process as GGUF images, for tests that need a real
//! forward pass without the model file.

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

use crate::error::Result;
use crate::gguf::GgufFile;

/// Shape of a tiny model.
#[derive(Debug, Clone, Copy)]
pub struct TinySpec {
    pub n_layer: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
    pub dim: usize,
    pub ff_dim: usize,
    pub vocab: usize,
    pub context_len: usize,
    /// Storage of the linear layers (F32, Q4_0, Q4_1, Q8_0...).
    pub dtype: GgmlDType,
    pub seed: u64,
    /// A layer whose output projections (`attn_output`, `ffn_down`) are zero: it adds nothing to
    /// the residual stream, as if it were not there.
    pub silent_layer: Option<usize>,
    /// `general.architecture`: `llama`, `qwen2` (QKV biases), `qwen3` (QK-norm) or `gemma3`
    /// (QK-norm, post-norms, GeGLU, sliding windows of [`Self::window`] tokens).
    pub arch: &'static str,
    /// Each head's width, declared as `attention.key_length` (`None`: `dim / n_head`).
    pub head_dim: Option<usize>,
    /// Gemma 3's sliding window.
    pub window: usize,
}

impl TinySpec {
    /// The default shape as `arch` declares it: Gemma 3 with six layers (five windowed, one
    /// global), a window of 5 tokens and heads wider than the embedding over the heads, Qwen 3
    /// with heads narrower.
    pub fn family(arch: &'static str) -> Self {
        let base = Self {
            arch,
            ..Self::default()
        };
        match arch {
            "gemma3" => Self {
                n_layer: 6,
                head_dim: Some(24),
                window: 5,
                ..base
            },
            "qwen3" => Self {
                head_dim: Some(8),
                ..base
            },
            _ => base,
        }
    }
}

/// The families [`TinySpec::family`] builds.
pub const TINY_FAMILIES: [&str; 4] = ["llama", "qwen2", "qwen3", "gemma3"];

impl Default for TinySpec {
    fn default() -> Self {
        Self {
            n_layer: 2,
            n_head: 4,
            n_kv_head: 2,
            dim: 64,
            ff_dim: 96,
            vocab: 96,
            context_len: 256,
            dtype: GgmlDType::F32,
            seed: 1,
            silent_layer: None,
            arch: "llama",
            head_dim: None,
            window: 0,
        }
    }
}

/// Deterministic pseudo-random values in [-scale, scale).
fn values(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    (0..n as u64)
        .map(|i| (tandem_spec::sampling::uniform(seed, i, 7) as f32 * 2.0 - 1.0) * scale)
        .collect()
}

/// A GGUF image of a random model with `spec`'s shape.
pub fn tiny_gguf(spec: &TinySpec) -> Result<Vec<u8>> {
    tiny_gguf_with(spec, |_, _| Ok(()))
}

/// [`tiny_gguf`] with its metadata and tensors edited by `edit` before it is written (a key or a
/// tensor added, changed or removed: what a model of another kind declares).
pub fn tiny_gguf_with(
    spec: &TinySpec,
    edit: impl FnOnce(&mut Vec<(String, Value)>, &mut Vec<(String, QTensor)>) -> Result<()>,
) -> Result<Vec<u8>> {
    let s = spec;
    let hd = s.head_dim.unwrap_or(s.dim / s.n_head);
    let (qd, kvd) = (s.n_head * hd, s.n_kv_head * hd);
    let gemma = s.arch == "gemma3";
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    let mut seed = s.seed * 1000;
    let mut add =
        |name: String, dims: &[usize], dtype: GgmlDType, scale: f32, offset: f32| -> Result<()> {
            seed += 1;
            let n: usize = dims.iter().product();
            let v: Vec<f32> = values(seed, n, scale)
                .into_iter()
                .map(|x| x + offset)
                .collect();
            let t = Tensor::from_vec(v, dims, &Device::Cpu)?;
            tensors.push((name, QTensor::quantize(&t, dtype)?));
            Ok(())
        };
    add(
        "token_embd.weight".into(),
        &[s.vocab, s.dim],
        GgmlDType::F32,
        1.0,
        0.0,
    )?;
    for l in 0..s.n_layer {
        let n = |x: &str| format!("blk.{l}.{x}.weight");
        let ws = 1.5 / (s.dim as f32).sqrt();
        // Output projections: zero for the silent layer.
        let out_scale = |x: f32| if s.silent_layer == Some(l) { 0.0 } else { x };
        add(n("attn_norm"), &[s.dim], GgmlDType::F32, 0.2, 1.0)?;
        add(n("attn_q"), &[qd, s.dim], s.dtype, ws, 0.0)?;
        add(n("attn_k"), &[kvd, s.dim], s.dtype, ws, 0.0)?;
        add(n("attn_v"), &[kvd, s.dim], s.dtype, ws, 0.0)?;
        if s.arch == "qwen2" {
            for (x, w) in [("attn_q", qd), ("attn_k", kvd), ("attn_v", kvd)] {
                add(format!("blk.{l}.{x}.bias"), &[w], GgmlDType::F32, 0.5, 0.0)?;
            }
        }
        if s.arch == "qwen3" || gemma {
            add(n("attn_q_norm"), &[hd], GgmlDType::F32, 0.2, 1.0)?;
            add(n("attn_k_norm"), &[hd], GgmlDType::F32, 0.2, 1.0)?;
        }
        add(
            n("attn_output"),
            &[s.dim, qd],
            s.dtype,
            out_scale(1.5 / (qd as f32).sqrt()),
            0.0,
        )?;
        if gemma {
            add(n("post_attention_norm"), &[s.dim], GgmlDType::F32, 0.2, 1.0)?;
            add(n("post_ffw_norm"), &[s.dim], GgmlDType::F32, 0.2, 1.0)?;
        }
        add(n("ffn_norm"), &[s.dim], GgmlDType::F32, 0.2, 1.0)?;
        add(n("ffn_gate"), &[s.ff_dim, s.dim], s.dtype, ws, 0.0)?;
        add(n("ffn_up"), &[s.ff_dim, s.dim], s.dtype, ws, 0.0)?;
        add(
            n("ffn_down"),
            &[s.dim, s.ff_dim],
            s.dtype,
            out_scale(1.5 / (s.ff_dim as f32).sqrt()),
            0.0,
        )?;
    }
    add(
        "output_norm.weight".into(),
        &[s.dim],
        GgmlDType::F32,
        0.2,
        1.0,
    )?;
    let a = s.arch;
    let mut meta: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(a.into())),
        (format!("{a}.block_count"), Value::U32(s.n_layer as u32)),
        (
            format!("{a}.context_length"),
            Value::U32(s.context_len as u32),
        ),
        (format!("{a}.embedding_length"), Value::U32(s.dim as u32)),
        (
            format!("{a}.feed_forward_length"),
            Value::U32(s.ff_dim as u32),
        ),
        (
            format!("{a}.attention.head_count"),
            Value::U32(s.n_head as u32),
        ),
        (
            format!("{a}.attention.head_count_kv"),
            Value::U32(s.n_kv_head as u32),
        ),
        (format!("{a}.rope.freq_base"), Value::F32(10_000.0)),
        (
            format!("{a}.attention.layer_norm_rms_epsilon"),
            Value::F32(1e-5),
        ),
        (format!("{a}.vocab_size"), Value::U32(s.vocab as u32)),
    ];
    if let Some(hd) = s.head_dim {
        meta.push((format!("{a}.attention.key_length"), Value::U32(hd as u32)));
        meta.push((format!("{a}.attention.value_length"), Value::U32(hd as u32)));
    }
    if gemma {
        meta.push((
            format!("{a}.attention.sliding_window"),
            Value::U32(s.window as u32),
        ));
        // The global layers' base; the windowed ones' is Gemma 3's own 10 000.
        meta.retain(|(k, _)| k != &format!("{a}.rope.freq_base"));
        meta.push((format!("{a}.rope.freq_base"), Value::F32(1_000_000.0)));
    }
    edit(&mut meta, &mut tensors)?;
    let meta_refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut out = std::io::Cursor::new(Vec::new());
    gguf_file::write(&mut out, &meta_refs, &tensor_refs)?;
    Ok(out.into_inner())
}

/// The tiny model opened as a [`GgufFile`].
pub fn tiny_file(spec: &TinySpec) -> Result<GgufFile> {
    GgufFile::from_bytes("tiny.gguf", tiny_gguf(spec)?)
}

/// `n` pseudo-random values in [−1, 1), reproducible from `(seed, stream)`.
pub fn signed_uniform(seed: u64, n: usize, stream: u64) -> Vec<f32> {
    (0..n as u64)
        .map(|i| tandem_spec::sampling::uniform(seed, i, stream) as f32 * 2.0 - 1.0)
        .collect()
}
