//! LLaMA-family transformer (SmolLM2 and kin) over a ragged batch and a paged KV cache.
//!
//! GGUF layout notes: `attn_q`/`attn_k` rows are permuted by the converter so RoPE rotates adjacent
//! pairs `(x[2i], x[2i+1])` by `pos·base^(−2i/head_dim)` (llama.cpp's "normal" mode); query head `h`
//! reads KV head `h / (n_head / n_kv_head)`; the output head is tied to `token_embd` when
//! `output.weight` is absent.

use candle_core::quantized::GgmlDType;
use half::f16;
use rayon::prelude::*;
use serde::Serialize;

use crate::batch::{Logits, LogitsRow, SeqChunk};
use crate::error::{EngineError, Result};
use crate::gguf::{dequantize_f32, GgufFile};
use crate::kernels::{self, RowData};
use crate::kv::PagedKvCache;
use crate::tree::NodeCtx;

mod ops;
use ops::{add, attend_on, RopeTable};
#[cfg(test)]
use ops::{attend, shared_context};

/// How weights are held in memory and multiplied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum WeightMode {
    /// Every tensor dequantized to f32 (the cloud target).
    F32,
    /// Every tensor dequantized to f16 storage, f32 arithmetic.
    F16,
    /// Q4_0/Q4_1/Q5_0/Q8_0/Q4_K/Q6_K tensors kept in their blocks and dequantized in registers
    /// against f32 activations (W4A16 / W8A16); other tensors as f32.
    Native,
    /// As `Native`, with each block-format tensor's input quantized to 8 bits per 32-element
    /// block and multiplied by integer dot products ([`kernels::a8`]: W4A8 / W8A8). For a draft
    /// only: its logits are not the f32-activation ones.
    W4A8,
}

impl std::str::FromStr for WeightMode {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "f32" => Ok(Self::F32),
            "f16" => Ok(Self::F16),
            "native" | "w4a16" => Ok(Self::Native),
            "w4a8" => Ok(Self::W4A8),
            _ => Err(format!(
                "unknown weight mode `{s}` (f32, f16, native, w4a8)"
            )),
        }
    }
}

/// Where a layer's linear tensors read their input: what a forward can show an observer
/// ([`crate::Engine::forward_observed`]), for calibrating a quantizer on the real activations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub enum Site {
    /// The attention norm's output: the input of `attn_q`, `attn_k` and `attn_v`.
    Attention,
    /// The heads' attention output: the input of `attn_output`.
    AttentionOutput,
    /// The FFN norm's output: the input of `ffn_gate` and `ffn_up`.
    Ffn,
    /// The gated activation: the input of `ffn_down`.
    FfnDown,
}

impl Site {
    /// The layer and site whose input a linear tensor of layer `blk.N` reads, by its GGUF name.
    pub fn of_tensor(name: &str) -> Option<(usize, Site)> {
        let rest = name.strip_prefix("blk.")?;
        let (layer, tensor) = rest.split_once('.')?;
        let site = match tensor {
            "attn_q.weight" | "attn_k.weight" | "attn_v.weight" => Site::Attention,
            "attn_output.weight" => Site::AttentionOutput,
            "ffn_gate.weight" | "ffn_up.weight" => Site::Ffn,
            "ffn_down.weight" => Site::FfnDown,
            _ => return None,
        };
        Some((layer.parse().ok()?, site))
    }
}

/// Called with each layer's input rows at each [`Site`] (`[tokens, width]`, row-major) during a
/// forward.
pub type Observer<'a> = &'a mut (dyn FnMut(usize, Site, &[f32]) + Send);

/// How RoPE pairs a head's dimensions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RopeStyle {
    /// `(x[2i], x[2i+1])`: llama.cpp's "normal" mode, LLaMA's GGUF layout (the converter
    /// permutes `attn_q`/`attn_k` rows for it).
    Adjacent,
    /// `(x[i], x[i + head_dim/2])`: llama.cpp's "NeoX" mode (Qwen, Gemma).
    Halves,
}

/// The FFN's gate activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Activation {
    /// `silu(gate) · up` (SwiGLU: LLaMA, Qwen, Mistral).
    Silu,
    /// `gelu_tanh(gate) · up` (GeGLU: Gemma).
    Gelu,
}

/// Model hyper-parameters, read from GGUF metadata: the shared LLaMA-shaped blocks and what each
/// family changes in them (see [`super::family`]).
#[derive(Debug, Clone, Serialize)]
pub struct LlamaConfig {
    pub arch: String,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
    pub dim: usize,
    pub ff_dim: usize,
    /// Each head's width (`attention.key_length` where declared, else `dim / n_head`).
    pub head_dim: usize,
    pub vocab: usize,
    pub context_len: usize,
    pub rms_eps: f32,
    pub rope_base: f32,
    pub rope_style: RopeStyle,
    /// Positions are multiplied by this before RoPE (linear RoPE scaling: 1 / factor).
    pub rope_scale: f32,
    /// Per-frequency divisors (`rope_freqs.weight`, Llama 3's RoPE scaling): loaded with the
    /// weights.
    pub rope_freq_factors: bool,
    /// Attention scores are `q·k · attn_scale`.
    pub attn_scale: f32,
    /// The embedding rows are multiplied by this (Gemma: √dim).
    pub embed_scale: Option<f32>,
    pub activation: Activation,
    /// RMS norms of each query and key head before RoPE (`attn_q_norm`, `attn_k_norm`).
    pub qk_norm: bool,
    /// RMS norms of the attention and FFN outputs before the residual add
    /// (`post_attention_norm`, `post_ffw_norm`).
    pub post_norms: bool,
    /// Biases on the query, key and value projections (`attn_q.bias`...).
    pub qkv_bias: bool,
    /// Sliding-window attention: the window (a token attends to itself and the `window − 1`
    /// positions before it) and the RoPE base of the layers that use it.
    pub window: Option<usize>,
    pub rope_base_windowed: f32,
    /// Which layers attend within the window (the others, and layers past its end, over the
    /// whole context).
    pub windowed: Vec<bool>,
}

/// A draft GGUF's list of the token ids its head scores (FR-Spec: the frequent part of a large
/// vocabulary, read once a token instead of all of it); the target verifies over the whole
/// vocabulary, so what is committed does not change. llama.cpp ignores the key.
pub const DRAFT_VOCAB_KEY: &str = "tandem.draft_vocab";

/// The `general.architecture` values this code loads.
pub const SUPPORTED_ARCHITECTURES: [&str; 4] = ["llama", "qwen2", "qwen3", "gemma3"];

impl LlamaConfig {
    /// The configuration a GGUF declares, refusing by name what this code would load wrong:
    /// another architecture, a mixture of experts, RoPE scaling other than linear or Llama 3's,
    /// a sliding window outside Gemma 3, partial rotary, a value head unlike the key head.
    pub fn from_gguf(g: &GgufFile) -> Result<Self> {
        let arch = g.string("general.architecture")?.to_string();
        if !SUPPORTED_ARCHITECTURES.contains(&arch.as_str()) {
            return Err(EngineError::Metadata {
                key: "general.architecture".into(),
                message: format!(
                    "`{arch}` is not supported (supported: {}; Mistral's and Llama 3's GGUFs \
                     declare `llama`)",
                    SUPPORTED_ARCHITECTURES.join(", ")
                ),
            });
        }
        let prefix = arch.clone();
        let k = |s: &str| format!("{prefix}.{s}");
        let n_head = g.usize(&k("attention.head_count"))?;
        let dim = g.usize(&k("embedding_length"))?;
        let n_layer = g.usize(&k("block_count"))?;
        let vocab = match g.array("tokenizer.ggml.tokens") {
            Ok(v) => v.len(),
            Err(_) => g.usize(&k("vocab_size"))?,
        };
        let bad = |key: &str, message: String| EngineError::Metadata {
            key: k(key),
            message,
        };
        if n_head == 0 {
            return Err(bad("attention.head_count", "no attention heads".into()));
        }
        let head_dim = match g.usize(&k("attention.key_length")) {
            Ok(n) => n,
            Err(_) if dim.is_multiple_of(n_head) => dim / n_head,
            Err(_) => {
                return Err(bad(
                    "attention.head_count",
                    format!("{n_head} heads do not divide embedding {dim}"),
                ))
            }
        };
        let rope_base = g.f32(&k("rope.freq_base")).unwrap_or(10_000.0);
        let mut cfg = Self {
            n_layer,
            n_head,
            n_kv_head: g.usize(&k("attention.head_count_kv")).unwrap_or(n_head),
            dim,
            ff_dim: g.usize(&k("feed_forward_length"))?,
            head_dim,
            vocab,
            context_len: g.usize(&k("context_length"))?,
            rms_eps: g.f32(&k("attention.layer_norm_rms_epsilon"))?,
            rope_base,
            rope_style: RopeStyle::Adjacent,
            rope_scale: 1.0,
            rope_freq_factors: g.has_tensor("rope_freqs.weight"),
            attn_scale: 1.0 / (head_dim as f32).sqrt(),
            embed_scale: None,
            activation: Activation::Silu,
            qk_norm: g.has_tensor("blk.0.attn_q_norm.weight"),
            post_norms: false,
            qkv_bias: g.has_tensor("blk.0.attn_q.bias"),
            window: None,
            rope_base_windowed: rope_base,
            windowed: Vec::new(),
            arch,
        };
        if cfg.head_dim == 0 || !cfg.head_dim.is_multiple_of(2) {
            return Err(bad(
                "attention.key_length",
                format!("a head size of {} is not even", cfg.head_dim),
            ));
        }
        if cfg.n_kv_head == 0 || !cfg.n_head.is_multiple_of(cfg.n_kv_head) {
            return Err(bad(
                "attention.head_count_kv",
                format!(
                    "{} KV heads do not divide {} heads",
                    cfg.n_kv_head, cfg.n_head
                ),
            ));
        }
        if let Ok(n) = g.usize(&k("attention.value_length")) {
            if n != cfg.head_dim {
                return Err(bad(
                    "attention.value_length",
                    format!(
                        "value heads of {n} beside key heads of {} are not supported",
                        cfg.head_dim
                    ),
                ));
            }
        }
        // What every family here refuses by name.
        if let Ok(n) = g.usize(&k("expert_count")) {
            if n > 0 {
                return Err(bad(
                    "expert_count",
                    format!("a mixture of experts ({n} experts) is not supported"),
                ));
            }
        }
        match g.string(&k("rope.scaling.type")) {
            Ok("none") | Err(_) => {}
            Ok("linear") => {
                let f = g.f32(&k("rope.scaling.factor")).unwrap_or(1.0);
                if !(f.is_finite() && f > 0.0) {
                    return Err(bad(
                        "rope.scaling.factor",
                        format!("a linear RoPE scaling factor of {f} is not positive"),
                    ));
                }
                cfg.rope_scale = 1.0 / f;
            }
            Ok(t) => {
                return Err(bad(
                    "rope.scaling.type",
                    format!("RoPE scaling `{t}` is not supported (none, linear, Llama 3's)"),
                ))
            }
        }
        if let Ok(rot) = g.usize(&k("rope.dimension_count")) {
            if rot != cfg.head_dim {
                return Err(bad(
                    "rope.dimension_count",
                    format!(
                        "partial rotary ({rot} of {}) is not supported",
                        cfg.head_dim
                    ),
                ));
            }
        }
        for key in ["attn_logit_softcapping", "final_logit_softcapping"] {
            if g.value(&k(key)).is_ok() {
                return Err(bad(key, "logit soft-capping is not supported".into()));
            }
        }
        super::family::configure(g, &mut cfg)?;
        if cfg.window.is_none() {
            if let Ok(w) = g.usize(&k("attention.sliding_window")) {
                return Err(bad(
                    "attention.sliding_window",
                    format!("sliding-window attention ({w} tokens) is supported for gemma3 only"),
                ));
            }
        }
        for (tensor, what) in [
            ("blk.0.attn_output.bias", "attention output biases"),
            ("blk.0.ffn_gate_inp.weight", "expert routers"),
        ] {
            if g.has_tensor(tensor) {
                return Err(EngineError::Tensor {
                    name: tensor.into(),
                    message: format!("{what} are not supported"),
                });
            }
        }
        if !cfg.post_norms && g.has_tensor("blk.0.post_attention_norm.weight") {
            return Err(EngineError::Tensor {
                name: "blk.0.post_attention_norm.weight".into(),
                message: format!("norms after attention are not part of `{}`", cfg.arch),
            });
        }
        Ok(cfg)
    }

    pub fn kv_dim(&self) -> usize {
        self.n_kv_head * self.head_dim
    }

    /// The width of all query heads together (the input of `attn_output`).
    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }

    /// Does layer `layer` attend within the sliding window?
    pub fn is_windowed(&self, layer: usize) -> bool {
        self.window.is_some() && self.windowed.get(layer).copied().unwrap_or(false)
    }
}

/// One weight matrix `[rows, cols]`: its rows as stored, its repacking for 8-bit activations,
/// or both (at least one).
pub struct Linear {
    pub rows: usize,
    pub cols: usize,
    /// The rows in their storage format: for the f32-activation kernels and the embedding's
    /// lookups (`None` once repacked for 8-bit activations, unless asked to keep them).
    data: Option<RowData>,
    /// `WeightMode::W4A8` on a block format: the weights repacked for 8-bit activations
    /// ([`kernels::a8`]).
    a8: Option<kernels::a8::A8Matrix>,
}

impl Linear {
    /// Load `name`; `keep_rows`: keep the rows as stored even when repacked (the embedding,
    /// whose rows are looked up).
    fn load(
        g: &mut GgufFile,
        name: &str,
        rows: usize,
        cols: usize,
        mode: WeightMode,
        keep_rows: bool,
    ) -> Result<Self> {
        let t = g.tensor(name, &[rows, cols])?;
        let dtype = t.dtype();
        let wrap = |e: candle_core::Error| EngineError::Tensor {
            name: name.into(),
            message: e.to_string(),
        };
        let raw = |t: &candle_core::quantized::QTensor| -> Result<Vec<u8>> {
            Ok(t.data().map_err(wrap)?.into_owned())
        };
        let data = match (mode, dtype) {
            (WeightMode::F16, _) => RowData::F16(
                dequantize_f32(name, &t)?
                    .into_iter()
                    .map(f16::from_f32)
                    .collect(),
            ),
            (WeightMode::Native | WeightMode::W4A8, GgmlDType::Q4_0) => RowData::q4_0(&raw(&t)?),
            (WeightMode::Native | WeightMode::W4A8, GgmlDType::Q4_1) => RowData::q4_1(&raw(&t)?),
            (WeightMode::Native | WeightMode::W4A8, GgmlDType::Q8_0) => RowData::q8_0(&raw(&t)?),
            (WeightMode::Native | WeightMode::W4A8, GgmlDType::Q5_0) => RowData::q5_0(&raw(&t)?),
            (WeightMode::Native | WeightMode::W4A8, GgmlDType::Q4K) => RowData::q4_k(&raw(&t)?),
            (WeightMode::Native | WeightMode::W4A8, GgmlDType::Q6K) => RowData::q6_k(&raw(&t)?),
            (WeightMode::Native | WeightMode::W4A8, GgmlDType::F16) => {
                let b = raw(&t)?;
                RowData::F16(
                    b.chunks_exact(2)
                        .map(|c| f16::from_le_bytes([c[0], c[1]]))
                        .collect(),
                )
            }
            _ => RowData::f32(&dequantize_f32(name, &t)?, rows, cols),
        };
        let a8 = match mode {
            WeightMode::W4A8 => kernels::a8::A8Matrix::pack(&data, rows, cols),
            _ => None,
        };
        let data = (a8.is_none() || keep_rows).then_some(data);
        Ok(Self {
            rows,
            cols,
            data,
            a8,
        })
    }

    /// The rows as stored (`None` for a matrix kept only repacked for 8-bit activations).
    pub fn data(&self) -> Option<&RowData> {
        self.data.as_ref()
    }

    /// The repacking for 8-bit activations, when the model runs them.
    pub fn a8(&self) -> Option<&kernels::a8::A8Matrix> {
        self.a8.as_ref()
    }

    /// The storage format's name (`q4_0`, `f32`, ...).
    pub fn format_name(&self) -> &'static str {
        match (&self.data, &self.a8) {
            (Some(d), _) => d.name(),
            (None, Some(w)) => w.format_name(),
            (None, None) => unreachable!("invariant: a matrix keeps its rows or its repacking"),
        }
    }

    /// `y[n_tok, rows] = x[n_tok, cols] · Wᵀ`.
    fn forward(&self, x: &[f32], n_tok: usize, y: &mut [f32]) -> Result<()> {
        match (&self.a8, &self.data) {
            (Some(w), _) => {
                let xq = kernels::a8::Q8Acts::quantize(&x[..n_tok * self.cols], self.cols);
                kernels::a8::matmul_a8(w, &xq, y);
            }
            (None, Some(d)) => kernels::matmul(d, self.rows, self.cols, x, n_tok, y),
            (None, None) => unreachable!("invariant: a matrix keeps its rows or its repacking"),
        }
        Ok(())
    }

    /// Bytes read to multiply by this matrix once.
    pub fn bytes(&self) -> usize {
        match (&self.a8, &self.data) {
            (Some(w), _) => w.bytes(),
            (None, Some(d)) => d.row_bytes(self.cols) * self.rows,
            (None, None) => 0,
        }
    }
}

struct Layer {
    attn_norm: Vec<f32>,
    wq: Linear,
    wk: Linear,
    wv: Linear,
    /// Biases of `wq`, `wk`, `wv` (Qwen 2).
    bias: Option<[Vec<f32>; 3]>,
    /// Per-head RMS norms of the queries and keys (Qwen 3, Gemma 3).
    qk_norm: Option<[Vec<f32>; 2]>,
    wo: Linear,
    /// RMS norms of the attention's and the FFN's outputs (Gemma 3).
    post_norms: Option<[Vec<f32>; 2]>,
    ffn_norm: Vec<f32>,
    gate: Linear,
    up: Linear,
    down: Linear,
}

/// The model's weights. Immutable once loaded; share it behind an `Arc`.
pub struct LlamaModel {
    pub cfg: LlamaConfig,
    pub mode: WeightMode,
    embed: Linear,
    /// Per-frequency RoPE divisors (`rope_freqs.weight`), where the model has them.
    rope_factors: Option<Vec<f32>>,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    /// `None` when the head is tied to the embedding.
    head: Option<Linear>,
    /// A draft's head over part of the vocabulary ([`DRAFT_VOCAB_KEY`]): the token ids and
    /// their rows of the head; the other logits are −∞.
    head_subset: Option<(Vec<u32>, Linear)>,
    /// Draft variants for the quantization study (both off by default): each token's activations
    /// fake-quantized to this many bits before every layer matmul, and layers left out.
    act_bits: Option<u32>,
    skip: Vec<bool>,
}

/// Symmetric per-token fake quantization of the rows (`width` wide) of `x` to `bits` bits:
/// `x ← round(x / s)·s` with `s = max|row| / (2^(bits−1) − 1)`, clamped to the grid.
///
/// # Panics
/// If `bits` is outside 2..=8 ([`LlamaModel::set_activation_bits`] checks it first).
pub fn fake_quantize_rows(x: &mut [f32], width: usize, bits: u32) {
    assert!(
        (2..=8).contains(&bits),
        "activation bits {bits} outside 2..=8"
    );
    let qmax = ((1u32 << (bits - 1)) - 1) as f32;
    for row in x.chunks_exact_mut(width) {
        let amax = row.iter().fold(0f32, |a, v| a.max(v.abs()));
        if amax == 0.0 {
            continue;
        }
        let s = amax / qmax;
        for v in row.iter_mut() {
            *v = (*v / s).round().clamp(-qmax, qmax) * s;
        }
    }
}

impl LlamaModel {
    pub fn load(g: &mut GgufFile, mode: WeightMode) -> Result<Self> {
        let cfg = LlamaConfig::from_gguf(g)?;
        let (d, qd, kvd, ff, hd) = (cfg.dim, cfg.q_dim(), cfg.kv_dim(), cfg.ff_dim, cfg.head_dim);
        let embed = Linear::load(g, "token_embd.weight", cfg.vocab, d, mode, true)?;
        let rope_factors = if cfg.rope_freq_factors {
            let f = g.tensor_f32("rope_freqs.weight", &[hd / 2])?;
            if let Some(bad) = f.iter().find(|v| !(v.is_finite() && **v > 0.0)) {
                return Err(EngineError::Tensor {
                    name: "rope_freqs.weight".into(),
                    message: format!("a RoPE frequency divisor of {bad} is not positive"),
                });
            }
            Some(f)
        } else {
            None
        };
        // (Grown as the layers load: a corrupt header's block count is not a size to reserve.)
        let mut layers = Vec::new();
        for l in 0..cfg.n_layer {
            let n = |s: &str| format!("blk.{l}.{s}.weight");
            let b = |s: &str| format!("blk.{l}.{s}.bias");
            layers.push(Layer {
                attn_norm: g.tensor_f32(&n("attn_norm"), &[d])?,
                wq: Linear::load(g, &n("attn_q"), qd, d, mode, false)?,
                wk: Linear::load(g, &n("attn_k"), kvd, d, mode, false)?,
                wv: Linear::load(g, &n("attn_v"), kvd, d, mode, false)?,
                bias: match cfg.qkv_bias {
                    true => Some([
                        g.tensor_f32(&b("attn_q"), &[qd])?,
                        g.tensor_f32(&b("attn_k"), &[kvd])?,
                        g.tensor_f32(&b("attn_v"), &[kvd])?,
                    ]),
                    false => None,
                },
                qk_norm: match cfg.qk_norm {
                    true => Some([
                        g.tensor_f32(&n("attn_q_norm"), &[hd])?,
                        g.tensor_f32(&n("attn_k_norm"), &[hd])?,
                    ]),
                    false => None,
                },
                wo: Linear::load(g, &n("attn_output"), d, qd, mode, false)?,
                post_norms: match cfg.post_norms {
                    true => Some([
                        g.tensor_f32(&n("post_attention_norm"), &[d])?,
                        g.tensor_f32(&n("post_ffw_norm"), &[d])?,
                    ]),
                    false => None,
                },
                ffn_norm: g.tensor_f32(&n("ffn_norm"), &[d])?,
                gate: Linear::load(g, &n("ffn_gate"), ff, d, mode, false)?,
                up: Linear::load(g, &n("ffn_up"), ff, d, mode, false)?,
                down: Linear::load(g, &n("ffn_down"), d, ff, mode, false)?,
            });
        }
        let norm = g.tensor_f32("output_norm.weight", &[d])?;
        let draft_vocab: Option<Vec<u32>> = match g.array(DRAFT_VOCAB_KEY) {
            Ok(v) => Some(
                v.iter()
                    .map(|x| x.to_u32().map_err(|e| GgufFile::bad(DRAFT_VOCAB_KEY, e)))
                    .collect::<Result<_>>()?,
            ),
            Err(_) => None,
        };
        let head = if g.has_tensor("output.weight") {
            let keep = draft_vocab.is_some();
            Some(Linear::load(g, "output.weight", cfg.vocab, d, mode, keep)?)
        } else {
            None
        };
        let mut m = Self {
            cfg,
            mode,
            embed,
            rope_factors,
            skip: vec![false; layers.len()],
            layers,
            norm,
            head,
            head_subset: None,
            act_bits: None,
        };
        if let Some(ids) = draft_vocab {
            m.restrict_head(ids)?;
        }
        Ok(m)
    }

    /// Score only the tokens `ids` (the others' logits −∞): a draft's head over the frequent part
    /// of a large vocabulary. Refuses an empty list, a repeated id or one past the vocabulary.
    pub fn restrict_head(&mut self, mut ids: Vec<u32>) -> Result<()> {
        let bad = |message: String| EngineError::Metadata {
            key: DRAFT_VOCAB_KEY.into(),
            message,
        };
        ids.sort_unstable();
        if ids.is_empty() {
            return Err(bad("no token ids".into()));
        }
        if let Some(w) = ids.windows(2).find(|w| w[0] == w[1]) {
            return Err(bad(format!("token {} is listed twice", w[0])));
        }
        if let Some(&last) = ids.last().filter(|&&l| l as usize >= self.cfg.vocab) {
            return Err(bad(format!(
                "token {last} is past the vocabulary ({} tokens)",
                self.cfg.vocab
            )));
        }
        let head = self.head();
        let rows = head.data().ok_or_else(|| {
            bad("the head was loaded without its rows (load the file with the key)".into())
        })?;
        let data = rows.select_rows(&ids, head.cols);
        let a8 = match self.mode {
            WeightMode::W4A8 => kernels::a8::A8Matrix::pack(&data, ids.len(), head.cols),
            _ => None,
        };
        let sub = Linear {
            rows: ids.len(),
            cols: head.cols,
            data: a8.is_none().then_some(data),
            a8,
        };
        self.head_subset = Some((ids, sub));
        Ok(())
    }

    /// The token ids the head scores, when it scores part of the vocabulary.
    pub fn head_vocab(&self) -> Option<&[u32]> {
        self.head_subset.as_ref().map(|(ids, _)| ids.as_slice())
    }

    /// Fake-quantize each token's activations to `bits` (2–8) before every layer matmul (the
    /// W4A4 / W8A8 drafts of the quantization study), or not (`None`). It changes the numbers
    /// only: the matmuls still run on f32 activations.
    pub fn set_activation_bits(&mut self, bits: Option<u32>) -> Result<()> {
        if let Some(b) = bits.filter(|b| !(2..=8).contains(b)) {
            return Err(EngineError::InvalidSetting {
                field: "activation_bits",
                message: format!("{b} is not within 2..=8"),
            });
        }
        self.act_bits = bits;
        Ok(())
    }

    /// Leave these layers out of the forward (a layer-skipping draft made from the same weights).
    pub fn skip_layers(&mut self, layers: &[usize]) -> Result<()> {
        let n = self.layers.len();
        if let Some(&l) = layers.iter().find(|&&l| l >= n) {
            return Err(EngineError::InvalidSetting {
                field: "skip_layers",
                message: format!("layer {l} does not exist (the model has {n})"),
            });
        }
        if let Some(&l) = layers
            .iter()
            .enumerate()
            .find(|(i, l)| layers[..*i].contains(l))
            .map(|(_, l)| l)
        {
            return Err(EngineError::InvalidSetting {
                field: "skip_layers",
                message: format!("layer {l} is listed twice"),
            });
        }
        if layers.len() >= n {
            return Err(EngineError::InvalidSetting {
                field: "skip_layers",
                message: format!("skipping {} of {n} layers leaves none", layers.len()),
            });
        }
        self.skip = (0..n).map(|l| layers.contains(&l)).collect();
        Ok(())
    }

    /// The layers the forward leaves out.
    pub fn skipped_layers(&self) -> Vec<usize> {
        (0..self.skip.len()).filter(|&l| self.skip[l]).collect()
    }

    /// Layer `layer`'s FFN up-projection (a matrix in the layers' storage format).
    pub fn ffn_up(&self, layer: usize) -> Option<&Linear> {
        self.layers.get(layer).map(|l| &l.up)
    }

    fn head(&self) -> &Linear {
        self.head.as_ref().unwrap_or(&self.embed)
    }

    /// Bytes of weights read for one decoded token (every matrix once, one embedding row).
    pub fn bytes_per_token(&self) -> usize {
        let weights: usize = self.layer_linears().map(|w| w.bytes()).sum();
        let head = match &self.head_subset {
            Some((_, sub)) => sub.bytes(),
            None => self.head().bytes(),
        };
        weights + self.layers.len() * 8 * self.cfg.dim + head + self.embed.bytes() / self.cfg.vocab
    }

    /// Every weight matrix of every layer.
    fn layer_linears(&self) -> impl Iterator<Item = &Linear> {
        self.layers
            .iter()
            .flat_map(|l| [&l.wq, &l.wk, &l.wv, &l.wo, &l.gate, &l.up, &l.down])
    }

    /// Multiply-add FLOPs of the weight matmuls for one token (2 per weight; attention over the
    /// context is extra).
    pub fn flops_per_token(&self) -> usize {
        let head = self
            .head_subset
            .as_ref()
            .map_or(self.head(), |(_, sub)| sub);
        self.layer_linears()
            .map(|w| 2 * w.rows * w.cols)
            .sum::<usize>()
            + 2 * head.rows * head.cols
    }

    /// Storage format name of the linear layers (`q4_0`, `f32`, ...); of a file that mixes
    /// them, each format once in the order met (`q5_0+q4_k+q6_k`).
    pub fn format(&self) -> String {
        let mut names: Vec<&str> = Vec::new();
        for l in &self.layers {
            for w in [&l.wq, &l.wk, &l.wv, &l.wo, &l.gate, &l.up, &l.down] {
                if !names.contains(&w.format_name()) {
                    names.push(w.format_name());
                }
            }
        }
        names.join("+")
    }

    /// Run one ragged batch. The caller has validated the batch and the block tables (see
    /// [`crate::Engine::forward`]): `tables[i]` holds chunk `i`'s KV blocks, `slots[t]` is the KV
    /// slot of token `t` and `ctx[t]` its position and what it attends to.
    /// `observe`, when given, sees every layer's input at each [`Site`].
    pub(crate) fn forward(
        &self,
        batch: &[SeqChunk],
        kv: &mut PagedKvCache,
        tables: &[&[u32]],
        slots: &[usize],
        ctx: &[NodeCtx],
        observe: Option<Observer<'_>>,
    ) -> Result<Logits> {
        #[cfg(target_arch = "x86_64")]
        match kernels::Isa::selected() {
            // SAFETY: a path is selected only on a CPU that runs it.
            kernels::Isa::Avx512 => unsafe {
                return self.forward_avx512(batch, kv, tables, slots, ctx, observe);
            },
            // SAFETY: as above.
            kernels::Isa::Avx2 => unsafe {
                return self.forward_avx2(batch, kv, tables, slots, ctx, observe);
            },
            kernels::Isa::Portable => {}
        }
        self.forward_with(batch, kv, tables, slots, ctx, observe)
    }

    /// [`Self::forward`] with the code around the matmuls (norms, RoPE, attention, activations)
    /// compiled for AVX2: the same operations in the same order (Rust never fuses a multiply and
    /// an add by itself, nor reorders a sum), so the same bits as the baseline build, in fewer
    /// instructions.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn forward_avx2(
        &self,
        batch: &[SeqChunk],
        kv: &mut PagedKvCache,
        tables: &[&[u32]],
        slots: &[usize],
        ctx: &[NodeCtx],
        observe: Option<Observer<'_>>,
    ) -> Result<Logits> {
        self.forward_with(batch, kv, tables, slots, ctx, observe)
    }

    /// [`Self::forward_avx2`] for AVX-512.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,fma")]
    fn forward_avx512(
        &self,
        batch: &[SeqChunk],
        kv: &mut PagedKvCache,
        tables: &[&[u32]],
        slots: &[usize],
        ctx: &[NodeCtx],
        observe: Option<Observer<'_>>,
    ) -> Result<Logits> {
        self.forward_with(batch, kv, tables, slots, ctx, observe)
    }

    #[inline(always)]
    fn forward_with(
        &self,
        batch: &[SeqChunk],
        kv: &mut PagedKvCache,
        tables: &[&[u32]],
        slots: &[usize],
        ctx: &[NodeCtx],
        mut observe: Option<Observer<'_>>,
    ) -> Result<Logits> {
        let c = &self.cfg;
        let (d, qd, kvd, hd, ff) = (c.dim, c.q_dim(), c.kv_dim(), c.head_dim, c.ff_dim);
        let n_tok: usize = batch.iter().map(|s| s.tokens.len()).sum();
        let mut seq_of = Vec::with_capacity(n_tok);
        for (i, s) in batch.iter().enumerate() {
            seq_of.extend(std::iter::repeat_n(i, s.tokens.len()));
        }
        let pos: Vec<usize> = ctx.iter().map(|c| c.pos).collect();
        let factors = self.rope_factors.as_deref();
        let rope = RopeTable::new(&pos, hd, c.rope_base, c.rope_scale, factors, c.rope_style);
        let rope_windowed = c
            .window
            .map(|_| RopeTable::new(&pos, hd, c.rope_base_windowed, 1.0, factors, c.rope_style));

        let mut x = vec![0f32; n_tok * d]; // [n_tok, dim]
        for (t, tok) in batch.iter().flat_map(|s| s.tokens.iter()).enumerate() {
            kernels::dequantize_row(
                self.embed
                    .data()
                    .expect("invariant: the embedding keeps its rows"),
                *tok as usize,
                d,
                &mut x[t * d..(t + 1) * d],
            );
            if let Some(s) = c.embed_scale {
                for v in &mut x[t * d..(t + 1) * d] {
                    *v *= s;
                }
            }
        }
        let mut h = vec![0f32; n_tok * d];
        let mut q = vec![0f32; n_tok * qd]; // [n_tok, n_head, head_dim]
        let mut k = vec![0f32; n_tok * kvd]; // [n_tok, n_kv_head, head_dim]
        let mut v = vec![0f32; n_tok * kvd];
        let mut att = vec![0f32; n_tok * qd];
        let mut o = vec![0f32; n_tok * d];
        let mut g = vec![0f32; n_tok * ff];
        let mut u = vec![0f32; n_tok * ff];

        let bs = kv.tables.page_size();
        let isa = kernels::Isa::selected();
        // Where each token's context positions sit in a layer's cache (in units of kv rows):
        // the same for every layer and head, so the block-table lookups run once a forward.
        let rows_at: Vec<Vec<usize>> = (0..n_tok)
            .map(|t| {
                let (table, cx) = (tables[seq_of[t]], &ctx[t]);
                (0..cx.len())
                    .map(|j| {
                        let s = cx.slot(j);
                        (table[s / bs] as usize * bs + s % bs) * kvd
                    })
                    .collect()
            })
            .collect();

        // Blocks of consecutive tokens of one sequence, whose attention runs together.
        let mut spans: Vec<(usize, usize)> = Vec::new();
        for t in 0..n_tok {
            match spans.last_mut() {
                Some((t0, t1)) if seq_of[*t0] == seq_of[t] && *t1 - *t0 < ops::TOKENS_PER_BLOCK => {
                    *t1 = t + 1
                }
                _ => spans.push((t, t + 1)),
            }
        }
        // Each token's context in the layers over the whole context and, where the model has
        // them, in the sliding-window layers (the last `window` positions of it: a context's
        // `j`-th slot holds position `j`, see `NodeCtx`), and each block with the positions its
        // tokens' contexts share.
        let full: Vec<&[usize]> = rows_at.iter().map(Vec::as_slice).collect();
        let windowed: Option<Vec<&[usize]>> = c.window.map(|w| {
            rows_at
                .iter()
                .map(|r| &r[r.len().saturating_sub(w)..])
                .collect()
        });
        let blocks_of = |ctx: &[&[usize]]| -> Vec<(usize, usize, usize)> {
            spans
                .iter()
                .map(|&(t0, t1)| (t0, t1, ops::shared_context(&ctx[t0..t1])))
                .collect()
        };
        let blocks_full = blocks_of(&full);
        let blocks_windowed = windowed.as_deref().map(blocks_of);

        let fake = |x: &mut [f32], width: usize| {
            if let Some(b) = self.act_bits {
                fake_quantize_rows(x, width, b);
            }
        };
        let mut seen = |li: usize, site: Site, x: &[f32]| {
            if let Some(o) = observe.as_mut() {
                o(li, site, x);
            }
        };
        for (li, l) in self.layers.iter().enumerate() {
            if self.skip[li] {
                continue;
            }
            let (ctx_rows, blocks, rope) = match (
                c.is_windowed(li),
                &windowed,
                &blocks_windowed,
                &rope_windowed,
            ) {
                (true, Some(w), Some(b), Some(r)) => (w.as_slice(), b.as_slice(), r),
                _ => (full.as_slice(), blocks_full.as_slice(), &rope),
            };
            kernels::rms_norm(&x, &l.attn_norm, c.rms_eps, &mut h);
            fake(&mut h, d);
            seen(li, Site::Attention, &h);
            l.wq.forward(&h, n_tok, &mut q)?;
            l.wk.forward(&h, n_tok, &mut k)?;
            l.wv.forward(&h, n_tok, &mut v)?;
            if let Some([bq, bk, bv]) = &l.bias {
                ops::add_rows(&mut q, bq);
                ops::add_rows(&mut k, bk);
                ops::add_rows(&mut v, bv);
            }
            if let Some([qn, kn]) = &l.qk_norm {
                kernels::rms_norm_in_place(&mut q, qn, c.rms_eps);
                kernels::rms_norm_in_place(&mut k, kn, c.rms_eps);
            }
            rope.apply(&mut q, c.n_head, hd);
            rope.apply(&mut k, c.n_kv_head, hd);
            let (ks, vs) = (&mut kv.k[li], &mut kv.v[li]);
            for (t, &slot) in slots.iter().enumerate() {
                ks[slot * kvd..(slot + 1) * kvd].copy_from_slice(&k[t * kvd..(t + 1) * kvd]);
                vs[slot * kvd..(slot + 1) * kvd].copy_from_slice(&v[t * kvd..(t + 1) * kvd]);
            }
            let (ks, vs) = (&kv.k[li], &kv.v[li]);
            let rep = c.n_head / c.n_kv_head;
            let scale = c.attn_scale;
            // One task per block of a sequence's tokens and KV head: the query heads that read
            // it, together.
            let mut by_head: Vec<Vec<&mut [f32]>> = (0..c.n_kv_head)
                .map(|_| Vec::with_capacity(n_tok))
                .collect();
            for row in att.chunks_mut(qd) {
                for (cell, h) in row.chunks_mut(rep * hd).zip(by_head.iter_mut()) {
                    h.push(cell);
                }
            }
            let mut by_head: Vec<_> = by_head.into_iter().map(|h| h.into_iter()).collect();
            let mut tasks = Vec::with_capacity(blocks.len() * c.n_kv_head);
            for &(t0, t1, shared) in blocks {
                for (kvh, cells) in by_head.iter_mut().enumerate() {
                    let outs: Vec<&mut [f32]> = cells.take(t1 - t0).collect();
                    tasks.push((t0, t1, shared, kvh, outs));
                }
            }
            tasks
                .into_par_iter()
                .for_each(|(t0, t1, shared, kvh, mut outs)| {
                    let qs: Vec<&[f32]> = (t0..t1)
                        .map(|t| &q[t * qd + kvh * rep * hd..t * qd + (kvh + 1) * rep * hd])
                        .collect();
                    let rows = &ctx_rows[t0..t1];
                    attend_on(
                        isa,
                        &qs,
                        hd,
                        ks,
                        vs,
                        rows,
                        shared,
                        kvh * hd,
                        scale,
                        &mut outs,
                    )
                });
            fake(&mut att, qd);
            seen(li, Site::AttentionOutput, &att);
            l.wo.forward(&att, n_tok, &mut o)?;
            if let Some([after_attention, _]) = &l.post_norms {
                kernels::rms_norm_in_place(&mut o, after_attention, c.rms_eps);
            }
            add(&mut x, &o);
            kernels::rms_norm(&x, &l.ffn_norm, c.rms_eps, &mut h);
            fake(&mut h, d);
            seen(li, Site::Ffn, &h);
            l.gate.forward(&h, n_tok, &mut g)?;
            l.up.forward(&h, n_tok, &mut u)?;
            match c.activation {
                Activation::Silu => kernels::silu_mul(&mut g, &u),
                Activation::Gelu => kernels::gelu_mul(&mut g, &u),
            }
            fake(&mut g, ff);
            seen(li, Site::FfnDown, &g);
            l.down.forward(&g, n_tok, &mut o)?;
            if let Some([_, after_ffn]) = &l.post_norms {
                kernels::rms_norm_in_place(&mut o, after_ffn, c.rms_eps);
            }
            add(&mut x, &o);
        }

        // Final norm and LM head only at the wanted positions.
        let mut rows = Vec::new();
        let mut t0 = 0;
        for s in batch {
            for i in s.logits.indices(s.tokens.len()) {
                rows.push(LogitsRow {
                    seq: s.seq,
                    index: i,
                    pos: pos[t0 + i],
                    token: t0 + i,
                });
            }
            t0 += s.tokens.len();
        }
        let n_out = rows.len();
        let mut sel = vec![0f32; n_out * d]; // [num_wanted, dim]
        for (r, row) in rows.iter().enumerate() {
            sel[r * d..(r + 1) * d].copy_from_slice(&x[row.token * d..(row.token + 1) * d]);
        }
        let mut normed = vec![0f32; n_out * d];
        kernels::rms_norm(&sel, &self.norm, c.rms_eps, &mut normed);
        // [num_wanted, vocab]; a head over part of the vocabulary leaves the rest at −∞.
        let fill = match self.head_subset {
            Some(_) => f32::NEG_INFINITY,
            None => 0.0,
        };
        let mut data = vec![fill; n_out * c.vocab];
        match (&self.head_subset, n_out > 0) {
            (_, false) => {}
            (None, true) => self.head().forward(&normed, n_out, &mut data)?,
            (Some((ids, sub)), true) => {
                let k = ids.len();
                let mut part = vec![0f32; n_out * k];
                sub.forward(&normed, n_out, &mut part)?;
                for (row, scores) in data.chunks_exact_mut(c.vocab).zip(part.chunks_exact(k)) {
                    for (&id, &s) in ids.iter().zip(scores) {
                        row[id as usize] = s;
                    }
                }
            }
        }
        Ok(Logits {
            vocab: c.vocab,
            data,
            rows,
        })
    }
}

#[cfg(test)]
mod tests;
