//! Tandem's verifier core: everything the cloud side of speculation decides, with no IO inside —
//! no channels, sockets, clocks, threads, tonic or prometheus. Time comes in as an argument, the
//! target model behind a trait ([`Target`]), and what must happen comes back as plain data.
//!
//! - [`VerifierCore`]: one record per open session (speculation or cloud-only generation), the
//!   multi-tenant scheduler (`tandem-sched`) over the KV page pool, and the load control. A
//!   driver hands it each message from an edge ([`VerifierCore::receive`]) and then runs a turn
//!   ([`VerifierCore::turn`]): the load is looked at (grants, takeovers, handbacks), one ragged
//!   forward runs over every session's planned work (verify blocks first and whole, then chunked
//!   prefill and the recompute of preempted sessions), and the turn returns the messages for the
//!   edges ([`Outgoing`]) and what was observed for metrics ([`Turn`]).
//! - [`control`]: the load adaptation as a pure policy: the grant (γ and depth) planned from the
//!   target's forward cost, and the takeover of a session whose speculation is slower than cloud
//!   decoding. It returns decisions; the core carries them out.
//! - [`Target`]: what the core needs from the target model (the engine, or the simulator's cost
//!   model).
//!
//! Two drivers run this same core: `tandem-cloud`'s batcher thread (the wall clock, the gRPC
//! streams, Prometheus) and `tandem-sim` (simulated time, simulated edges).

pub mod control;
mod drafts;
mod session;
mod step;
mod target;
mod turn;
pub mod usage;
mod verifier_core;

use tandem_engine::EngineError;
use tandem_sched::{SchedError, SessionId};
use tandem_spec::SpecError;

pub use crate::verifier_core::{ContendedBudget, VerifierConfig, VerifierCore, MAX_QUEUED_BLOCKS};
pub use control::{LoadConfig, LoadControl, DEFAULT_QUIET_MS, DEFAULT_SATURATION_TOKENS};
pub use session::{SessionState, VerifierStats};
pub use target::Target;
pub use turn::{ForwardDone, Inbound, Mode, NewSession, Observation, Outgoing, ToEdge, Turn};
pub use usage::{Finish, Usage};

/// What a message to the verifier can be refused with.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum VerifierError {
    #[error("session {0} is not open")]
    UnknownSession(SessionId),
    #[error("session {0} is already open")]
    DuplicateSession(SessionId),
    /// A field of a message is wrong (the text names it).
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Spec(#[from] SpecError),
    #[error(transparent)]
    Sched(#[from] SchedError),
    #[error("{0}")]
    Engine(String),
    /// A constrained session's grammar could not go on (a mask over its limits): it ends.
    #[error("grammar: {0}")]
    Grammar(String),
    /// Its tenant cancelled the session.
    #[error("session {0} was cancelled by its tenant")]
    Cancelled(SessionId),
    /// The verifier is draining or shut down: open the session on another replica.
    #[error("the verifier is shutting down: open the session on another replica")]
    Draining,
    /// Its edge sent nothing (a block, an ack) for the idle timeout: the session is closed.
    #[error("idle: nothing from the edge in {seconds} s; the session is closed")]
    Idle { seconds: f64 },
}

impl From<EngineError> for VerifierError {
    fn from(e: EngineError) -> Self {
        VerifierError::Engine(e.to_string())
    }
}

/// What kind of refusal a [`VerifierError`] is: the transport maps it to its own status codes
/// (gRPC: `NOT_FOUND`, `ALREADY_EXISTS`, `INVALID_ARGUMENT`, `RESOURCE_EXHAUSTED`, `CANCELLED`,
/// `UNAVAILABLE`, `DEADLINE_EXCEEDED`, `INTERNAL`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    NotFound,
    AlreadyExists,
    InvalidArgument,
    /// Refused for load or quota: the same request may succeed later.
    ResourceExhausted,
    /// Ended at its tenant's request.
    Cancelled,
    /// This verifier is going away; another may serve the request.
    Unavailable,
    /// Nothing came in time.
    DeadlineExceeded,
    Internal,
}

impl VerifierError {
    pub fn kind(&self) -> ErrorKind {
        match self {
            VerifierError::UnknownSession(_) => ErrorKind::NotFound,
            VerifierError::DuplicateSession(_) => ErrorKind::AlreadyExists,
            VerifierError::Invalid(_) | VerifierError::Spec(_) => ErrorKind::InvalidArgument,
            VerifierError::Sched(
                SchedError::Saturated { .. }
                | SchedError::QuotaExceeded { .. }
                | SchedError::CannotFit { .. },
            ) => ErrorKind::ResourceExhausted,
            VerifierError::Sched(
                SchedError::PromptTooLarge { .. } | SchedError::BlockTooLarge { .. },
            ) => ErrorKind::InvalidArgument,
            VerifierError::Cancelled(_) => ErrorKind::Cancelled,
            VerifierError::Draining => ErrorKind::Unavailable,
            VerifierError::Idle { .. } => ErrorKind::DeadlineExceeded,
            VerifierError::Grammar(_) => ErrorKind::InvalidArgument,
            VerifierError::Sched(_) | VerifierError::Engine(_) => ErrorKind::Internal,
        }
    }
}
