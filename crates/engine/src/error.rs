//! The engine's one error type. Every variant names what was wrong so that a caller (the CLI, the
//! cloud verifier) can turn it into a message or an RPC status without guessing.

use crate::kv::SeqId;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("cannot read model file {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("model file {path}: {message}")]
    Format { path: String, message: String },
    #[error("model metadata key `{key}`: {message}")]
    Metadata { key: String, message: String },
    #[error("tensor `{name}`: {message}")]
    Tensor { name: String, message: String },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    ChatTemplate(String),
    #[error(
        "KV cache out of blocks: the batch needs {needed} more blocks of {block_size} tokens, \
         {free} are free (pool of {total})"
    )]
    OutOfBlocks {
        needed: usize,
        free: usize,
        total: usize,
        block_size: usize,
    },
    #[error(
        "sequence {seq}: start_pos {got} does not match its KV length {expected} (truncate first)"
    )]
    PositionMismatch {
        seq: SeqId,
        expected: usize,
        got: usize,
    },
    #[error("sequence {seq}: positions up to {end} exceed the model's context length {max}")]
    ContextOverflow { seq: SeqId, end: usize, max: usize },
    #[error("sequence {seq}: token id {token} is outside the vocabulary (size {vocab})")]
    InvalidToken {
        seq: SeqId,
        token: u32,
        vocab: usize,
    },
    #[error("invalid batch: {0}")]
    InvalidBatch(String),
    #[error("sequence {0} is not in the KV cache")]
    UnknownSequence(SeqId),
    #[error("invalid setting `{field}`: {message}")]
    InvalidSetting {
        field: &'static str,
        message: String,
    },
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
}

pub type Result<T, E = EngineError> = std::result::Result<T, E>;
