//! What each family's GGUF declares beyond the LLaMA blocks, one file per family:
//!
//! | `general.architecture` | RoPE pairs | norms | FFN | other |
//! |---|---|---|---|---|
//! | `llama` (LLaMA, SmolLM2, Llama 3, Mistral) | adjacent | pre | SwiGLU | Llama 3: `rope_freqs` |
//! | `qwen2` (Qwen 2.5) | halves | pre | SwiGLU | QKV biases |
//! | `qwen3` (Qwen 3) | halves | pre, QK-norm | SwiGLU | |
//! | `gemma3` (Gemma 3) | halves | pre and post, QK-norm | GeGLU | √dim embedding, sliding windows, tied head |
//!
//! Everything else (GQA, head sizes, linear RoPE scaling, tied heads) is read the same way for
//! every family by [`super::llama::LlamaConfig::from_gguf`].

use super::llama::LlamaConfig;
use crate::error::Result;
use crate::gguf::GgufFile;

mod gemma3;
mod llama;
mod qwen;

/// Set what `cfg.arch`'s family changes; refuse by name what this code would load wrong.
pub(crate) fn configure(g: &GgufFile, cfg: &mut LlamaConfig) -> Result<()> {
    match cfg.arch.as_str() {
        "llama" => llama::configure(g, cfg),
        "qwen2" => qwen::configure_qwen2(g, cfg),
        "qwen3" => qwen::configure_qwen3(g, cfg),
        "gemma3" => gemma3::configure(g, cfg),
        other => unreachable!("invariant: `{other}` was checked against SUPPORTED_ARCHITECTURES"),
    }
}
