//! Qwen 2.5 (`qwen2`: biases on the query, key and value projections) and Qwen 3 (`qwen3`:
//! QK-norm, a head size of its own, no biases). Both rotate halves (NeoX RoPE).

use super::super::llama::{LlamaConfig, RopeStyle};
use crate::error::{EngineError, Result};
use crate::gguf::GgufFile;

pub(super) fn configure_qwen2(g: &GgufFile, cfg: &mut LlamaConfig) -> Result<()> {
    cfg.rope_style = RopeStyle::Halves;
    require(
        g,
        cfg.qkv_bias,
        "blk.0.attn_q.bias",
        "Qwen 2 has QKV biases",
    )
}

pub(super) fn configure_qwen3(g: &GgufFile, cfg: &mut LlamaConfig) -> Result<()> {
    cfg.rope_style = RopeStyle::Halves;
    require(
        g,
        cfg.qk_norm,
        "blk.0.attn_q_norm.weight",
        "Qwen 3 has QK-norm",
    )
}

/// Refuse a file without `tensor`, what the family is made of.
fn require(g: &GgufFile, present: bool, tensor: &str, why: &str) -> Result<()> {
    if present {
        return Ok(());
    }
    Err(EngineError::Tensor {
        name: tensor.into(),
        message: format!("missing from {} ({why})", g.path),
    })
}
