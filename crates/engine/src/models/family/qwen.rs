//! Qwen 2.5 (`qwen2`: biases on the query, key and value projections) and Qwen 3 (`qwen3`:
//! QK-norm, a head size of its own, no biases). Both rotate halves (NeoX RoPE).

use super::super::llama::{LlamaConfig, RopeStyle};
use crate::error::{EngineError, Result};
use crate::gguf::GgufFile;

pub(super) fn configure_qwen2(g: &GgufFile, cfg: &mut LlamaConfig) -> Result<()> {
    cfg.rope_style = RopeStyle::Halves;
    if !cfg.qkv_bias {
        return Err(EngineError::Tensor {
            name: "blk.0.attn_q.bias".into(),
            message: format!("missing from {} (Qwen 2 has QKV biases)", g.path),
        });
    }
    Ok(())
}

pub(super) fn configure_qwen3(g: &GgufFile, cfg: &mut LlamaConfig) -> Result<()> {
    cfg.rope_style = RopeStyle::Halves;
    if !cfg.qk_norm {
        return Err(EngineError::Tensor {
            name: "blk.0.attn_q_norm.weight".into(),
            message: format!("missing from {} (Qwen 3 has QK-norm)", g.path),
        });
    }
    Ok(())
}
