//! Gemma 3: QK-norm, RMS norms before and after attention and the FFN, GeGLU (GELU's tanh
//! form), embeddings multiplied by √dim, the head tied to the embedding, and sliding-window
//! layers interleaved with global ones: five windowed layers, then a global one, the windowed
//! ones with a RoPE base of 10 000 and the global ones with `rope.freq_base` (and its linear
//! scaling, where declared). The GGUF converter has already added Gemma's `1 +` to every norm
//! weight, so they are plain RMS norms here.
//!
//! Attention scores are scaled by 1/√head_dim, except in the 27B model (62 layers), whose
//! `query_pre_attn_scalar` is the embedding over the heads.

use super::super::llama::{Activation, LlamaConfig, RopeStyle};
use crate::error::{EngineError, Result};
use crate::gguf::GgufFile;

/// Every `PATTERN`-th layer (the last of each group) attends over the whole context.
const PATTERN: usize = 6;
/// The RoPE base of the windowed layers (not in the GGUF: Gemma 3's own).
const WINDOWED_ROPE_BASE: f32 = 10_000.0;
/// The layer count of Gemma 3 27B, whose attention scale differs.
const LAYERS_27B: usize = 62;

pub(super) fn configure(g: &GgufFile, cfg: &mut LlamaConfig) -> Result<()> {
    cfg.rope_style = RopeStyle::Halves;
    cfg.activation = Activation::Gelu;
    cfg.embed_scale = Some((cfg.dim as f32).sqrt());
    cfg.post_norms = true;
    for t in [
        "blk.0.attn_q_norm.weight",
        "blk.0.post_attention_norm.weight",
        "blk.0.post_ffw_norm.weight",
    ] {
        if !g.has_tensor(t) {
            return Err(EngineError::Tensor {
                name: t.into(),
                message: format!("missing from {} (Gemma 3 has it)", g.path),
            });
        }
    }
    if cfg.n_layer == LAYERS_27B {
        cfg.attn_scale = 1.0 / ((cfg.dim / cfg.n_head) as f32).sqrt();
    }
    let window = g
        .usize("gemma3.attention.sliding_window")
        .map_err(|_| EngineError::Metadata {
            key: "gemma3.attention.sliding_window".into(),
            message: "missing (Gemma 3 interleaves sliding-window layers)".into(),
        })?;
    if window == 0 {
        return Err(EngineError::Metadata {
            key: "gemma3.attention.sliding_window".into(),
            message: "a window of 0 tokens".into(),
        });
    }
    cfg.window = Some(window);
    cfg.rope_base_windowed = WINDOWED_ROPE_BASE;
    cfg.windowed = (0..cfg.n_layer.min(1 << 16))
        .map(|l| l % PATTERN < PATTERN - 1)
        .collect();
    Ok(())
}
