//! What each session used, told once when it ends: the record the usage ledger writes and the
//! request metrics count. Counts only, never content.
//!
//! Every committed token is counted once: as an **accepted draft token** (a drafted token the
//! target judged right in a forward) or as a **cloud token** (one the verifier produced itself:
//! the first token, a correction, a bonus, a token it decoded with no block to verify, every
//! token of a cloud-only generation). A drafted token that matched a position the verifier had
//! already decoded is the verifier's (it was never judged). The edge counts the same split from
//! its verdicts (their accepted runs are the accepted draft tokens).

use serde::Serialize;
use tandem_sched::{SessionId, TenantId};

use crate::session::{Session, Work};

/// Why a session ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Finish {
    /// It committed an end-of-generation token.
    Stop,
    /// It committed every token it asked for.
    Length,
    /// Its edge closed it before either.
    Abort,
    /// Its tenant cancelled it.
    Cancelled,
    /// It failed for good (a refusal that ends a session).
    Error,
    /// The verifier shut down around it (the end of a drain).
    Shutdown,
}

impl Finish {
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
            Finish::Abort => "abort",
            Finish::Cancelled => "cancelled",
            Finish::Error => "error",
            Finish::Shutdown => "shutdown",
        }
    }

    pub const ALL: [Finish; 6] = [
        Finish::Stop,
        Finish::Length,
        Finish::Abort,
        Finish::Cancelled,
        Finish::Error,
        Finish::Shutdown,
    ];
}

/// One ended session's counts and times (µs on the driver's clock).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Usage {
    pub session: SessionId,
    pub tenant: TenantId,
    /// Speculation (the edge drafted) or a cloud-only generation.
    pub speculative: bool,
    pub prompt_tokens: usize,
    /// Of its prompt tokens, those served from the prefix cache (OpenAI's
    /// `prompt_tokens_details.cached_tokens`).
    pub cached_tokens: usize,
    /// New tokens committed (up to the first end-of-generation token).
    pub committed_tokens: usize,
    /// Drafted tokens fed to the target in a forward (past the committed ones: those after a
    /// rejection are computed, not judged), and the accepted ones among them.
    pub drafted_tokens: usize,
    pub accepted_draft_tokens: usize,
    /// Committed tokens the verifier produced itself: committed − accepted draft tokens.
    pub cloud_tokens: usize,
    /// Of those, the tokens it decoded in forwards with no block of the session to verify.
    pub decoded_tokens: usize,
    /// Positions the target verified (drafted tokens judged).
    pub verified_positions: u64,
    pub opened_us: u64,
    /// When its prompt started to be prefilled (the end of its wait in the queue).
    pub scheduled_us: Option<u64>,
    pub first_token_us: Option<u64>,
    pub closed_us: u64,
    pub finish: Finish,
}

/// What the core counts of a session as its events go out (see `VerifierCore::turn`).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Counts {
    /// Prompt tokens served from the prefix cache.
    pub cached: usize,
    pub drafted: usize,
    pub accepted: usize,
    pub decoded: usize,
    /// When its prompt's first chunk went into a forward.
    pub scheduled_us: Option<u64>,
    pub first_token_us: Option<u64>,
    /// It ended with a fatal error.
    pub failed: bool,
}

impl Usage {
    /// The record of `s` (session `id`) ending at `now_us`; `why` None: stop or length by what
    /// it committed, else an error if it failed, else its edge aborted it.
    pub(crate) fn of<H>(id: SessionId, s: &Session<H>, now_us: u64, why: Option<Finish>) -> Self {
        let c = s.counts;
        let (speculative, output, limit, eog, verified) = match &s.work {
            Work::Spec { vs, limit, eog, .. } => (
                true,
                vs.as_ref().map_or_else(Vec::new, |v| v.output().to_vec()),
                limit - s.prompt_len,
                &eog[..],
                vs.as_ref().map_or(0, |v| v.verified_positions),
            ),
            // The tokens fed, then the last one sampled.
            Work::Generation {
                max_tokens,
                eog,
                next,
                ..
            } => (
                false,
                s.history[s.prompt_len.min(s.history.len())..]
                    .iter()
                    .copied()
                    .chain(*next)
                    .collect(),
                *max_tokens,
                &eog[..],
                0,
            ),
        };
        let stop = output.iter().position(|t| eog.contains(t));
        let committed = stop.map_or(output.len(), |i| i + 1).min(limit);
        let finish = why.unwrap_or(if stop.is_some_and(|i| i < limit) {
            Finish::Stop
        } else if committed >= limit {
            Finish::Length
        } else if c.failed {
            Finish::Error
        } else {
            Finish::Abort
        });
        let accepted = c.accepted.min(committed);
        Usage {
            session: id,
            tenant: s.tenant,
            speculative,
            prompt_tokens: s.prompt_len,
            cached_tokens: c.cached,
            committed_tokens: committed,
            drafted_tokens: c.drafted,
            accepted_draft_tokens: accepted,
            cloud_tokens: committed - accepted,
            decoded_tokens: c.decoded,
            verified_positions: verified,
            opened_us: s.meter.opened_us,
            scheduled_us: c.scheduled_us,
            first_token_us: c.first_token_us,
            closed_us: now_us,
            finish,
        }
    }
}
