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
    /// Q4_0/Q4_1/Q8_0 tensors kept in their blocks and dequantized in registers against f32
    /// activations (W4A16 / W8A16); other tensors as f32.
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

/// Model hyper-parameters, read from GGUF metadata.
#[derive(Debug, Clone, Serialize)]
pub struct LlamaConfig {
    pub arch: String,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
    pub dim: usize,
    pub ff_dim: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub context_len: usize,
    pub rms_eps: f32,
    pub rope_base: f32,
}

/// The `general.architecture` values this code loads.
pub const SUPPORTED_ARCHITECTURES: [&str; 1] = ["llama"];

impl LlamaConfig {
    /// The configuration a GGUF declares, refusing by name what this code would load wrong:
    /// another architecture, a mixture of experts, RoPE scaling, sliding windows, a head size
    /// other than the embedding over the heads, partial rotary, attention biases, QK-norm.
    pub fn from_gguf(g: &GgufFile) -> Result<Self> {
        let arch = g.string("general.architecture")?.to_string();
        if !SUPPORTED_ARCHITECTURES.contains(&arch.as_str()) {
            return Err(EngineError::Metadata {
                key: "general.architecture".into(),
                message: format!(
                    "`{arch}` is not supported (supported: {})",
                    SUPPORTED_ARCHITECTURES.join(", ")
                ),
            });
        }
        let prefix = arch.clone();
        let k = |s: &str| format!("{prefix}.{s}");
        let n_head = g.usize(&k("attention.head_count"))?;
        let dim = g.usize(&k("embedding_length"))?;
        let vocab = match g.array("tokenizer.ggml.tokens") {
            Ok(v) => v.len(),
            Err(_) => g.usize(&k("vocab_size"))?,
        };
        let cfg = Self {
            n_layer: g.usize(&k("block_count"))?,
            n_head,
            n_kv_head: g.usize(&k("attention.head_count_kv")).unwrap_or(n_head),
            dim,
            ff_dim: g.usize(&k("feed_forward_length"))?,
            head_dim: dim / n_head.max(1),
            vocab,
            context_len: g.usize(&k("context_length"))?,
            rms_eps: g.f32(&k("attention.layer_norm_rms_epsilon"))?,
            rope_base: g.f32(&k("rope.freq_base")).unwrap_or(10_000.0),
            arch,
        };
        let bad = |key: &str, message: String| EngineError::Metadata {
            key: k(key),
            message,
        };
        if cfg.n_head == 0 || !cfg.dim.is_multiple_of(cfg.n_head) || !cfg.head_dim.is_multiple_of(2)
        {
            return Err(bad(
                "attention.head_count",
                format!("{} heads do not divide embedding {}", cfg.n_head, cfg.dim),
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
        // What the LLaMA code here would load wrong: refused by name.
        if let Ok(n) = g.usize(&k("expert_count")) {
            if n > 0 {
                return Err(bad(
                    "expert_count",
                    format!("a mixture of experts ({n} experts) is not supported"),
                ));
            }
        }
        if let Ok(t) = g.string(&k("rope.scaling.type")) {
            if t != "none" {
                return Err(bad(
                    "rope.scaling.type",
                    format!("RoPE scaling `{t}` is not supported"),
                ));
            }
        }
        if let Ok(w) = g.usize(&k("attention.sliding_window")) {
            return Err(bad(
                "attention.sliding_window",
                format!("sliding-window attention ({w} tokens) is not supported"),
            ));
        }
        for key in ["attention.key_length", "attention.value_length"] {
            if let Ok(n) = g.usize(&k(key)) {
                if n != cfg.head_dim {
                    return Err(bad(
                        key,
                        format!(
                            "a head size of {n} (the embedding over the heads is {}) is not supported",
                            cfg.head_dim
                        ),
                    ));
                }
            }
        }
        for (tensor, what) in [
            (
                "rope_freqs.weight",
                "per-dimension RoPE frequencies (Llama 3's RoPE scaling)",
            ),
            ("blk.0.attn_q.bias", "attention biases (Qwen 2's)"),
            ("blk.0.attn_q_norm.weight", "QK-norm (Qwen 3's, Gemma 3's)"),
            (
                "blk.0.post_attention_norm.weight",
                "norms after attention (Gemma's)",
            ),
        ] {
            if g.has_tensor(tensor) {
                return Err(EngineError::Tensor {
                    name: tensor.into(),
                    message: format!("{what} are not supported"),
                });
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
        Ok(cfg)
    }

    pub fn kv_dim(&self) -> usize {
        self.n_kv_head * self.head_dim
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
    wo: Linear,
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
    layers: Vec<Layer>,
    norm: Vec<f32>,
    /// `None` when the head is tied to the embedding.
    head: Option<Linear>,
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
        let (d, kvd, ff) = (cfg.dim, cfg.kv_dim(), cfg.ff_dim);
        let embed = Linear::load(g, "token_embd.weight", cfg.vocab, d, mode, true)?;
        // (Grown as the layers load: a corrupt header's block count is not a size to reserve.)
        let mut layers = Vec::new();
        for l in 0..cfg.n_layer {
            let n = |s: &str| format!("blk.{l}.{s}.weight");
            layers.push(Layer {
                attn_norm: g.tensor_f32(&n("attn_norm"), &[d])?,
                wq: Linear::load(g, &n("attn_q"), d, d, mode, false)?,
                wk: Linear::load(g, &n("attn_k"), kvd, d, mode, false)?,
                wv: Linear::load(g, &n("attn_v"), kvd, d, mode, false)?,
                wo: Linear::load(g, &n("attn_output"), d, d, mode, false)?,
                ffn_norm: g.tensor_f32(&n("ffn_norm"), &[d])?,
                gate: Linear::load(g, &n("ffn_gate"), ff, d, mode, false)?,
                up: Linear::load(g, &n("ffn_up"), ff, d, mode, false)?,
                down: Linear::load(g, &n("ffn_down"), d, ff, mode, false)?,
            });
        }
        let norm = g.tensor_f32("output_norm.weight", &[d])?;
        let head = if g.has_tensor("output.weight") {
            Some(Linear::load(g, "output.weight", cfg.vocab, d, mode, false)?)
        } else {
            None
        };
        Ok(Self {
            cfg,
            mode,
            embed,
            skip: vec![false; layers.len()],
            layers,
            norm,
            head,
            act_bits: None,
        })
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
        weights
            + self.layers.len() * 8 * self.cfg.dim
            + self.head().bytes()
            + self.embed.bytes() / self.cfg.vocab
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
        let head = self.head();
        self.layer_linears()
            .map(|w| 2 * w.rows * w.cols)
            .sum::<usize>()
            + 2 * head.rows * head.cols
    }

    /// Storage format name of the linear layers (`q4_0`, `f32`, ...), or `mixed`.
    pub fn format(&self) -> String {
        let l = &self.layers[0];
        let names: Vec<&str> = [&l.wq, &l.wk, &l.wv, &l.wo, &l.gate, &l.up, &l.down]
            .iter()
            .map(|w| w.format_name())
            .collect();
        if names.iter().all(|n| *n == names[0]) {
            names[0].to_string()
        } else {
            "mixed".to_string()
        }
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
        let (d, kvd, hd, ff) = (c.dim, c.kv_dim(), c.head_dim, c.ff_dim);
        let n_tok: usize = batch.iter().map(|s| s.tokens.len()).sum();
        let mut seq_of = Vec::with_capacity(n_tok);
        for (i, s) in batch.iter().enumerate() {
            seq_of.extend(std::iter::repeat_n(i, s.tokens.len()));
        }
        let pos: Vec<usize> = ctx.iter().map(|c| c.pos).collect();
        let rope = RopeTable::new(&pos, hd, c.rope_base);

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
        }
        let mut h = vec![0f32; n_tok * d];
        let mut q = vec![0f32; n_tok * d]; // [n_tok, n_head, head_dim]
        let mut k = vec![0f32; n_tok * kvd]; // [n_tok, n_kv_head, head_dim]
        let mut v = vec![0f32; n_tok * kvd];
        let mut att = vec![0f32; n_tok * d];
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
        // Each block with the positions its tokens' contexts share.
        let blocks: Vec<(usize, usize, usize)> = spans
            .into_iter()
            .map(|(t0, t1)| {
                let rows: Vec<&[usize]> = rows_at[t0..t1].iter().map(Vec::as_slice).collect();
                (t0, t1, ops::shared_context(&rows))
            })
            .collect();

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
            kernels::rms_norm(&x, &l.attn_norm, c.rms_eps, &mut h);
            fake(&mut h, d);
            seen(li, Site::Attention, &h);
            l.wq.forward(&h, n_tok, &mut q)?;
            l.wk.forward(&h, n_tok, &mut k)?;
            l.wv.forward(&h, n_tok, &mut v)?;
            rope.apply(&mut q, c.n_head, hd);
            rope.apply(&mut k, c.n_kv_head, hd);
            let (ks, vs) = (&mut kv.k[li], &mut kv.v[li]);
            for (t, &slot) in slots.iter().enumerate() {
                ks[slot * kvd..(slot + 1) * kvd].copy_from_slice(&k[t * kvd..(t + 1) * kvd]);
                vs[slot * kvd..(slot + 1) * kvd].copy_from_slice(&v[t * kvd..(t + 1) * kvd]);
            }
            let (ks, vs) = (&kv.k[li], &kv.v[li]);
            let rep = c.n_head / c.n_kv_head;
            let scale = 1.0 / (hd as f32).sqrt();
            // One task per block of a sequence's tokens and KV head: the query heads that read
            // it, together.
            let mut by_head: Vec<Vec<&mut [f32]>> = (0..c.n_kv_head)
                .map(|_| Vec::with_capacity(n_tok))
                .collect();
            for row in att.chunks_mut(d) {
                for (cell, h) in row.chunks_mut(rep * hd).zip(by_head.iter_mut()) {
                    h.push(cell);
                }
            }
            let mut by_head: Vec<_> = by_head.into_iter().map(|h| h.into_iter()).collect();
            let mut tasks = Vec::with_capacity(blocks.len() * c.n_kv_head);
            for &(t0, t1, shared) in &blocks {
                for (kvh, cells) in by_head.iter_mut().enumerate() {
                    let outs: Vec<&mut [f32]> = cells.take(t1 - t0).collect();
                    tasks.push((t0, t1, shared, kvh, outs));
                }
            }
            tasks
                .into_par_iter()
                .for_each(|(t0, t1, shared, kvh, mut outs)| {
                    let qs: Vec<&[f32]> = (t0..t1)
                        .map(|t| &q[t * d + kvh * rep * hd..t * d + (kvh + 1) * rep * hd])
                        .collect();
                    let rows: Vec<&[usize]> = (t0..t1).map(|t| rows_at[t].as_slice()).collect();
                    attend_on(
                        isa,
                        &qs,
                        hd,
                        ks,
                        vs,
                        &rows,
                        shared,
                        kvh * hd,
                        scale,
                        &mut outs,
                    )
                });
            fake(&mut att, d);
            seen(li, Site::AttentionOutput, &att);
            l.wo.forward(&att, n_tok, &mut o)?;
            add(&mut x, &o);
            kernels::rms_norm(&x, &l.ffn_norm, c.rms_eps, &mut h);
            fake(&mut h, d);
            seen(li, Site::Ffn, &h);
            l.gate.forward(&h, n_tok, &mut g)?;
            l.up.forward(&h, n_tok, &mut u)?;
            kernels::silu_mul(&mut g, &u);
            fake(&mut g, ff);
            seen(li, Site::FfnDown, &g);
            l.down.forward(&g, n_tok, &mut o)?;
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
        let mut data = vec![0f32; n_out * c.vocab]; // [num_wanted, vocab]
        if n_out > 0 {
            self.head().forward(&normed, n_out, &mut data)?;
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
