//! Tandem's simulator (`tandem simulate`): a discrete-event simulation of many edges and verifier
//! replicas on simulated time. The protocol code is the real one, and the same: each edge is an
//! [`EdgeSession`](tandem_spec::EdgeSession) and each replica a
//! [`VerifierCore`](tandem_verifier::VerifierCore) — the cores the edge runtime and `tandem cloud
//! serve`'s batcher drive — here driven by simulated time. Only the models are replaced:
//! - the target ([`SimTarget`]) answers a forward with the roofline's time ([`ForwardCost`],
//!   from `tandem bench engine` or `cloud serve`'s calibration) and logits whose greedy token at
//!   every position is a fixed pseudo-random function of (session, position, the token fed
//!   there): the "target's output";
//! - each edge drafts a token in `draft_ms`, right with probability α (with token trees, every
//!   leaf of its draft tree in one forward, unsure at every miss, its second choice right for
//!   `cover` of them);
//! - each message crosses the network in half its session's round trip, with jitter, in order.
//!
//! Each replica adapts to its load as `cloud serve` does (grants planned from the forward cost,
//! takeovers by pace) unless the shape is held fixed. Every committed token is checked against
//! the target's output, so the simulation also tests that the protocol stays lossless at any
//! scale.
//!
//! The crate links neither tonic nor axum nor prometheus: the cores it drives are IO-free.
//! `world` is the event loop, `target` the simulated target, `report` one run end to end;
//! [`stats`] holds the latency summaries the benchmarks share.

mod report;
pub mod stats;
mod target;
mod world;

use serde::Serialize;
use tandem_spec::capacity::ForwardCost;

pub use report::{simulate, table};
pub use target::{target_token, CopySpans, SimTarget, Texts, VOCAB};

use crate::stats::Summary;

/// What a simulation can be refused with.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SimError {
    /// A setting is out of range (the text names its flag).
    #[error("{0}")]
    InvalidConfig(String),
    #[error("replica {replica}: {message}")]
    Replica { replica: usize, message: String },
}

/// The simulator's default target forward cost: `cloud serve --threads 1` on this project's CI
/// machine.
pub const DEFAULT_FORWARD_COST: ForwardCost = ForwardCost {
    one_token_ms: 44.0,
    ms_per_token: 2.2,
};

pub use tandem_spec::tree::DEFAULT_LEAF_COST;

/// What one simulation runs. Its flags are `tandem simulate`'s (which sweeps `users` and the
/// cloud-only baseline, and finds the forward cost).
#[derive(Debug, Clone, Serialize, clap::Args)]
pub struct SimConfig {
    /// Closed-loop users: each opens session after session (`tandem simulate --sessions`).
    #[arg(skip = 1usize)]
    pub users: usize,
    /// Verifier replicas; users are spread over them round-robin.
    #[arg(long, default_value_t = 1)]
    pub replicas: usize,
    /// Greedy acceptance rate per drafted token.
    #[arg(long, default_value_t = 0.8)]
    pub alpha: f64,
    /// The draft's time per token, ms.
    #[arg(long, default_value_t = 20.0)]
    pub draft_ms: f64,
    /// Mean round trip, ms.
    #[arg(long, default_value_t = 50.0)]
    pub rtt_ms: f64,
    /// Each session's round trip is drawn within ± this share of --rtt-ms.
    #[arg(long, default_value_t = 0.0)]
    pub rtt_spread_pct: f64,
    /// Each message's half of the round trip varies by ± this share.
    #[arg(long, default_value_t = 10.0)]
    pub jitter_pct: f64,
    /// Token trees (`LANES:BELOW[:MIN]`, as `generate --tree`; none: linear blocks). The draft
    /// is unsure at every miss and as often at a hit, and its second choice is the target's
    /// token for --cover of its misses.
    #[arg(long, default_value = "none", value_parser = tandem_spec::pipeline::parse_tree)]
    pub tree: tandem_spec::pipeline::TreeArg,
    #[arg(long, default_value_t = 0.6)]
    pub cover: f64,
    /// A draft forward over n leaves of the draft tree takes (1 + leaf-cost·(n − 1)) draft
    /// forwards.
    #[arg(long, default_value_t = DEFAULT_LEAF_COST)]
    pub leaf_cost: f64,
    /// Draft length (0: cloud-only, the verifier decodes every session).
    #[arg(long, default_value_t = 4)]
    pub gamma: usize,
    #[arg(long, default_value_t = 2)]
    pub depth: usize,
    /// Replicas adapt γ and depth to their load and take slow sessions over, as `cloud serve`
    /// does; `--fixed-shape` holds every session's γ and depth.
    #[arg(long = "fixed-shape", action = clap::ArgAction::SetFalse)]
    pub adaptive: bool,
    #[arg(long, default_value_t = 40)]
    pub prompt_tokens: usize,
    /// The share of each prompt a user's sessions have in common (a conversation's history):
    /// after the user's first session, the replica's prefix cache holds it.
    #[arg(long, default_value_t = 0.0)]
    pub prefix_hit: f64,
    /// New tokens per session.
    #[arg(long = "tokens", default_value_t = 48)]
    pub new_tokens: usize,
    /// The share of each session's output that copies spans of its own text (the prompt and the
    /// output before), as code edits, corrections and quotes do; 0: it never copies.
    #[arg(long, default_value_t = 0.0)]
    pub copy_share: f64,
    /// Mean length of a copied span, tokens.
    #[arg(long, default_value_t = 12.0)]
    pub copy_span: f64,
    /// The replicas draft for each session from its own text while they decode it alone
    /// (`generate --self-draft`; on, off).
    #[arg(long, default_value = "on", action = clap::ArgAction::Set,
          value_parser = tandem_spec::pipeline::parse_on_off)]
    pub self_draft: bool,
    /// Each edge copies from its session's text beside its draft, on linear drafts
    /// (`generate --suffix`; on, off).
    #[arg(long, default_value = "on", action = clap::ArgAction::Set,
          value_parser = tandem_spec::pipeline::parse_on_off)]
    pub suffix: bool,
    #[arg(long, default_value_t = 64)]
    pub token_budget: usize,
    /// KV blocks of 16 token slots per replica.
    #[arg(long, default_value_t = 65536)]
    pub kv_blocks: usize,
    /// The target's forward cost (`tandem simulate --forward-cost` or `--engine-json`).
    #[arg(skip = DEFAULT_FORWARD_COST)]
    pub cost: ForwardCost,
    /// Simulated seconds before measuring, and measured.
    #[arg(long = "warmup-s", default_value_t = 20.0)]
    pub warmup_s: f64,
    #[arg(long = "duration-s", default_value_t = 40.0)]
    pub duration_s: f64,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

/// One simulation's measurements (same definitions as `bench load`) beside the analytic model's
/// prediction for the same inputs.
#[derive(Debug, Clone, Serialize)]
pub struct SimRow {
    pub users: usize,
    pub replicas: usize,
    pub gamma: usize,
    pub depth: usize,
    pub adaptive: bool,
    pub tokens_per_s: f64,
    pub itl_ms: Summary,
    pub ttft_ms: Summary,
    pub tokens_per_forward: f64,
    pub forwards: u64,
    /// Busy share of the replicas over the window.
    pub utilization: f64,
    pub sessions_done: usize,
    /// Committed tokens that differ from the target's output (must be 0).
    pub wrong_tokens: usize,
    /// Messages refused at either end (must be 0).
    pub protocol_errors: usize,
    /// Share of the committed tokens the replicas decoded themselves (taken over or γ 0), over
    /// the whole run.
    pub cloud_decoded_share: f64,
    pub takeovers: usize,
    pub acceptance: f64,
    /// Share of the prompt tokens the replicas' prefix caches served (the model is given
    /// `--prefix-hit`).
    pub prefix_hit: f64,
    /// Share of the main path's misses a lane of the draft tree covered (token trees).
    pub lane_cover: f64,
    /// Share of the output the target's texts copied (`--copy-share`, as drawn).
    pub copy_share: f64,
    /// Share of the committed tokens that were the replicas' own accepted guesses, and the
    /// share of their guesses accepted.
    pub self_drafted_share: f64,
    pub self_draft_acceptance: f64,
    /// Tokens the edges proposed by copy per committed token, and the share of those judged
    /// that were right (sessions done).
    pub edge_copied_share: f64,
    pub edge_copy_acceptance: f64,
    pub predicted_itl_ms: f64,
    pub predicted_tokens_per_s: f64,
    pub predicted_ttft_ms: f64,
    /// Events processed and the wall time the simulation took.
    pub events: u64,
    pub wall_s: f64,
}

impl SimConfig {
    /// Refuse settings the simulation cannot run, naming the flag.
    pub fn validate(&self) -> Result<(), SimError> {
        let bad = SimError::InvalidConfig;
        if self.users == 0 || self.replicas == 0 {
            return Err(bad("--sessions and --replicas must be at least 1".into()));
        }
        if !(0.0..=1.0).contains(&self.alpha) {
            return Err(bad(format!(
                "--alpha must be within 0..=1, got {}",
                self.alpha
            )));
        }
        if self.gamma > 0 && self.depth == 0 {
            return Err(bad("--depth must be at least 1".into()));
        }
        if self.gamma + 1 > self.token_budget {
            return Err(bad(format!(
                "--token-budget {} must exceed --gamma {}",
                self.token_budget, self.gamma
            )));
        }
        if !(0.0..=1.0).contains(&self.cover) || self.leaf_cost < 0.0 {
            return Err(bad(format!(
                "--cover must be within 0..=1 and --leaf-cost at least 0, got {} and {}",
                self.cover, self.leaf_cost
            )));
        }
        if self.new_tokens == 0 || self.prompt_tokens == 0 {
            return Err(bad("--tokens and --prompt-tokens must be at least 1".into()));
        }
        if !(0.0..1.0).contains(&self.copy_share) || self.copy_span < 1.0 {
            return Err(bad(format!(
                "--copy-share must be within 0..1 and --copy-span at least 1, got {} and {}",
                self.copy_share, self.copy_span
            )));
        }
        if !(0.0..1.0).contains(&self.prefix_hit) {
            return Err(bad(format!(
                "--prefix-hit must be within 0..1, got {}",
                self.prefix_hit
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
