//! Tandem's engine: a LLaMA-family transformer that serves both sides of speculation.
//!
//! - One forward takes a **ragged batch** ([`SeqChunk`]s: a sequence id, its start position, its new
//!   tokens and which of them need logits); every token of every sequence goes through the weight
//!   matmuls together, attention reads only that sequence's KV, and logits come back only where
//!   asked ([`Logits`], `[num_wanted, vocab]`).
//! - The **paged KV cache** ([`kv`]) hands out fixed-size blocks from a pool sized by a memory
//!   budget; sequences can be truncated (draft rejected) and freed; running out is
//!   [`EngineError::OutOfBlocks`], never a panic.
//! - Weights are f32 (the cloud target), f16, or GGUF blocks (Q4_0, Q4_1, Q5_0, Q8_0, and the
//!   Q4_K / Q6_K super-blocks) multiplied with f32 activations (W4A16, the edge draft) by
//!   [`kernels`], whose reductions do not depend on the batch, so a
//!   sequence's logits are the same alone or batched, and every kernel path (portable, AVX2,
//!   AVX-512) gives the same bits. `WeightMode::W4A8` quantizes a draft's activations to 8 bits
//!   for integer dot products ([`kernels::a8`]).
//! - [`tokenizer`] builds the byte-level BPE and chat template from the GGUF metadata.

pub mod affinity;
pub mod batch;
pub mod engine;
pub mod error;
pub mod gguf;
pub mod kernels;
pub mod kv;
pub mod models;
pub mod testing;
pub mod tokenizer;
pub mod tree;

pub use affinity::CpuSet;
pub use batch::{Logits, LogitsRow, SeqChunk, Wanted};
pub use engine::{Engine, EngineConfig};
pub use error::{EngineError, Result};
pub use gguf::GgufFile;
pub use kv::SeqId;
pub use models::llama::{
    Activation, LlamaConfig, LlamaModel, Observer, RopeStyle, Site, WeightMode,
};
pub use tokenizer::Tokenizer;
pub use tree::{NodeCtx, Parent};
