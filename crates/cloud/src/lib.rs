//! Tandem's cloud verifier: the target engine shared by every tenant.
//!
//! - [`verifier`]: the [`Verifier`] — engine plus the multi-tenant scheduler (`tandem-sched`); each
//!   iteration one ragged forward over every session's planned work (verify blocks first, then
//!   chunked prefill and recompute), paged KV with preemption, per-tenant fairness and quotas.
//! - [`batcher`]: the actor that owns the verifier and runs the iteration loop, fed by messages
//!   ([`ToCloud`]) and answering through each session's [`Reply`].
//! - [`validation`]: every incoming protobuf message becomes a valid domain value or a
//!   field-named `INVALID_ARGUMENT` before anything is queued.
//! - [`tenants`]: API keys → tenants (`--tenants` TOML), their weights and quotas.
//! - [`grpc`]: the `tandem.v1.Verifier` service, health, admission, drain; [`metrics`]: Prometheus.

pub mod batcher;
pub mod control;
pub mod grpc;
pub mod metrics;
pub mod tenants;
pub mod validation;
pub mod verifier;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::Sender;

use tandem_engine::{EngineError, SamplingParams};
pub use tandem_sched::SchedError;
use tandem_sched::{SessionId, TenantId};
use tandem_spec::{Block, Decoded, SpecError, Verdict, VerifyRule};

pub use batcher::serve;
pub use tandem_sched::{ForwardCost, GrantPolicy};
pub use verifier::{
    Event, SessionState, Target, TenantStats, Verifier, VerifierConfig, VerifierStats,
};

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CloudError {
    #[error("session {0} is not open")]
    UnknownSession(u64),
    #[error("session {0} is already open")]
    DuplicateSession(u64),
    /// A field of a message is wrong (the text names it).
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Spec(#[from] SpecError),
    #[error(transparent)]
    Sched(SchedError),
    #[error("{0}")]
    Engine(String),
}

impl From<EngineError> for CloudError {
    fn from(e: EngineError) -> Self {
        CloudError::Engine(e.to_string())
    }
}

impl CloudError {
    /// The gRPC status code this error is answered with.
    pub fn code(&self) -> tonic::Code {
        use tonic::Code;
        match self {
            CloudError::UnknownSession(_) => Code::NotFound,
            CloudError::DuplicateSession(_) => Code::AlreadyExists,
            CloudError::Invalid(_) | CloudError::Spec(_) => Code::InvalidArgument,
            CloudError::Sched(
                SchedError::Saturated { .. }
                | SchedError::QuotaExceeded { .. }
                | SchedError::CannotFit { .. },
            ) => Code::ResourceExhausted,
            CloudError::Sched(
                SchedError::PromptTooLarge { .. } | SchedError::BlockTooLarge { .. },
            ) => Code::InvalidArgument,
            CloudError::Sched(_) | CloudError::Engine(_) => Code::Internal,
        }
    }
}

/// Live load of a verifier, updated by [`serve`] after every iteration and read by the `Info` RPC,
/// admission in the service, and its Prometheus metrics.
#[derive(Default)]
pub struct Gauges {
    pub metrics: metrics::Metrics,
    /// Open speculation sessions.
    pub sessions: AtomicU64,
    /// Running cloud-only generations.
    pub generations: AtomicU64,
    pub kv_blocks_used: AtomicU64,
    pub kv_blocks_total: AtomicU64,
    pub target_forwards: AtomicU64,
    /// Tokens per forward (running mean), in hundredths.
    pub tokens_per_forward_x100: AtomicU64,
    /// Prompt (and recompute) tokens waiting for prefill.
    pub waiting_tokens: AtomicU64,
}

impl Gauges {
    fn update(&self, v: &Verifier) {
        let pool = v.scheduler().pool();
        let set = |g: &AtomicU64, x: usize| g.store(x as u64, Ordering::Relaxed);
        let (spec, gen) = v.counts();
        set(&self.sessions, spec);
        set(&self.generations, gen);
        set(&self.kv_blocks_used, pool.num_blocks() - pool.num_free());
        set(&self.kv_blocks_total, pool.num_blocks());
        set(&self.waiting_tokens, v.scheduler().waiting_tokens());
        self.target_forwards
            .store(v.stats.target_forwards, Ordering::Relaxed);
        self.tokens_per_forward_x100.store(
            (v.stats.tokens_per_forward * 100.0).round() as u64,
            Ordering::Relaxed,
        );
    }
}

/// Where the batcher sends a session's messages (a channel of the in-process link, or a gRPC
/// stream). Returns false when the edge is gone: the batcher then frees the session.
pub type Reply = Box<dyn Fn(ToEdge) -> bool + Send>;

/// A [`Reply`] into a std channel.
pub fn reply_to(tx: Sender<ToEdge>) -> Reply {
    Box::new(move |m| tx.send(m).is_ok())
}

/// Messages to the batcher.
pub enum ToCloud {
    Open {
        session: SessionId,
        tenant: TenantId,
        prompt: Vec<u32>,
        params: SamplingParams,
        rule: VerifyRule,
        /// The γ and depth the edge asked for (within the service's limits): its grants never
        /// exceed them.
        want: (u32, u32),
        /// New tokens at most, and the end-of-generation ids (for when the verifier decodes it).
        max_tokens: usize,
        eog: Vec<u32>,
        reply: Reply,
    },
    Draft {
        session: SessionId,
        block: Block,
    },
    /// Cloud-only generation: the verifier decodes every token.
    Generate {
        session: SessionId,
        tenant: TenantId,
        prompt: Vec<u32>,
        params: SamplingParams,
        max_tokens: usize,
        eog: Vec<u32>,
        reply: Reply,
    },
    Close {
        session: SessionId,
    },
    /// The state of an open session (`None`: not open).
    Query {
        session: SessionId,
        reply: Box<dyn FnOnce(Option<SessionState>) + Send>,
    },
}

/// Messages to an edge.
#[derive(Debug, Clone)]
pub enum ToEdge {
    Opened {
        session: SessionId,
        first: u32,
        /// The γ and depth granted now.
        grant: (u32, u32),
    },
    Verdict(Verdict),
    /// A token the verifier decoded itself for a speculation session it took over (`resume`: the
    /// last one, with the grant to draft again with).
    Decoded(Decoded),
    /// A token of a cloud-only generation.
    Token {
        token: u32,
        done: bool,
    },
    Error {
        code: tonic::Code,
        message: String,
        /// When refused for load: try again after about this long.
        retry_after_ms: Option<u64>,
        /// The session is over (refused at admission, or a generation that failed).
        fatal: bool,
    },
}

impl ToEdge {
    fn error(e: &CloudError, fatal: bool) -> Self {
        ToEdge::Error {
            code: e.code(),
            message: e.to_string(),
            retry_after_ms: None,
            fatal,
        }
    }
}

/// Time the target's forward of a chunk of `n` new tokens for each of `sizes` (ascending; the
/// median of `reps` runs each) and fit its roofline ([`tandem_sched::ForwardCost`]). The engine
/// is left as it was found (the scratch sequence is freed).
pub fn measure_forward_cost(
    engine: &mut tandem_engine::Engine,
    sizes: &[usize],
    reps: usize,
) -> Result<(Vec<(usize, f64)>, tandem_sched::ForwardCost), CloudError> {
    use tandem_engine::{SeqChunk, SeqId, Wanted};
    let scratch = SeqId(u64::MAX);
    let mut points = Vec::new();
    for &n in sizes {
        let tokens: Vec<u32> = (0..n as u32).map(|i| 100 + i).collect();
        let mut t = Vec::new();
        for _ in 0..reps.max(1) {
            let t0 = std::time::Instant::now();
            let r = engine.forward(&[SeqChunk::new(scratch, 0, tokens.clone(), Wanted::Last)]);
            t.push(t0.elapsed().as_secs_f64() * 1e3);
            engine.free(scratch);
            r?;
        }
        t.sort_by(f64::total_cmp);
        points.push((n, t[t.len() / 2]));
    }
    let cost = tandem_sched::ForwardCost::fit(&points).ok_or_else(|| {
        CloudError::Engine(format!(
            "cannot fit a roofline to the forward times {points:?}"
        ))
    })?;
    Ok((points, cost))
}

/// Forward sizes `cloud serve` times at start-up: three memory-bound ones for the one-token time,
/// two compute-bound ones for the slope (about 3 s for SmolLM2 on one core).
pub const CALIBRATION_SIZES: [usize; 5] = [1, 2, 4, 24, 48];
