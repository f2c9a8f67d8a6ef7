//! Model architectures: one transformer ([`llama`]: LLaMA-shaped blocks over a ragged batch and a
//! paged KV cache) and, one file per family, what each family changes in it ([`family`]).
pub mod family;
pub mod llama;
