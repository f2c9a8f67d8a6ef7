//! Tandem's speculation core, pure: no tensors, sockets, clocks, threads or hidden randomness.
//!
//! - [`pipeline`]: the edge's pipeline state machine (blocks in flight up to `depth`, epochs,
//!   rollback, commits).
//! - [`edge`]: the edge's session around it ([`EdgeSession`]): the verifier's grant, the
//!   running estimates, the adaptive γ / depth, the decision to reopen after a lost connection.
//!   The edge runtime and the simulator both drive it.
//! - [`cloud_session`]: the cloud's per-session bookkeeping ([`CloudSession`]: the committed
//!   sequence, blocks rebased onto it, what to feed the target for a verify or a decode, the
//!   verdict).
//! - [`verify`]: the rules that judge a draft token against the target's logits (greedy,
//!   sample-and-match, rejection sampling).
//! - [`grammar`]: structured outputs: a JSON schema or grammar compiled with llguidance, which
//!   masks the target's logits on the cloud and the draft's on the edge.
//! - [`suffix`]: model-free drafts that copy: a suffix automaton over a session's tokens.
//! - [`sampling`]: temperature / top-k / top-p with draws keyed by (seed, position).
//! - [`policy`]: the analytic model of one session's speculation and the γ / depth it recommends.
//! - [`never_idle`]: the model of protocol 2 (the verifier decodes a session whenever it has no
//!   usable block of it): a run is paced by the verifier until the edge catches up, then by the edge.
//! - [`capacity`]: the model for many sessions on one verifier: its roofline, queueing, and the
//!   γ, depth and batch token budget it recommends ([`capacity::recommend_fleet`]).
//!
//! Everything is driven by the IO shells (edge runtime, cloud batcher) and by simulated time in
//! tests and the simulator.

pub mod capacity;
pub mod cloud_session;
pub mod edge;
pub mod grammar;
pub mod messages;
pub mod never_idle;
pub mod pipeline;
pub mod policy;
pub mod sampling;
pub mod suffix;
pub mod tree;
pub mod verify;

pub use cloud_session::{
    BlockAction, CloudSession, DecodeRun, Feed, Finished, ACK_EVERY, FLOW_WINDOW,
};
pub use edge::{EdgeSession, Incoming, Measured, Opened, Reaction, SessionConfig};
pub use grammar::{Grammar, GrammarError, GrammarSource, GrammarVocab};
pub use pipeline::{
    Block, BlockId, Decoded, Estimates, Frontier, Grown, Hedge, Next, Output, Pipeline,
    PipelineConfig, PipelineStats, Shape, SparseDist, TreeConfig, Verdict, ACCEPT_POSITIONS,
};
pub use suffix::{GuessRecord, SelfDrafter, SuffixIndex, SuffixPolicy};
pub use tree::{Node, SideNode, Step};
pub use verify::VerifyRule;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    #[error("invalid `{field}`: {message}")]
    InvalidConfig {
        field: &'static str,
        message: String,
    },
    #[error("invalid block: {0}")]
    InvalidBlock(String),
    #[error("protocol violation: {0}")]
    Protocol(String),
    /// A constrained session's grammar cannot go on (its mask is over the limits, or a committed
    /// token is not allowed): the session ends.
    #[error("grammar: {0}")]
    Grammar(String),
}
