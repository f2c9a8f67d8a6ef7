//! LLaMA (and what declares `llama`: SmolLM2, Llama 2 and 3, Mistral): the blocks as
//! [`LlamaConfig`] reads them. RoPE rotates adjacent pairs (the converter permuted `attn_q` and
//! `attn_k` for it); Llama 3.1's RoPE scaling arrives as `rope_freqs.weight`, per-frequency
//! divisors, read with the weights.

use super::super::llama::{LlamaConfig, RopeStyle};
use crate::error::{EngineError, Result};
use crate::gguf::GgufFile;

pub(super) fn configure(g: &GgufFile, cfg: &mut LlamaConfig) -> Result<()> {
    cfg.rope_style = RopeStyle::Adjacent;
    if cfg.qk_norm {
        return Err(EngineError::Tensor {
            name: "blk.0.attn_q_norm.weight".into(),
            message: "QK-norm is not part of `llama` (a Qwen 3 or Gemma 3 GGUF declares its own \
                      architecture)"
                .into(),
        });
    }
    let _ = g;
    Ok(())
}
