//! What proposes draft tokens: the draft model ([`EngineDrafter`]), or anything else that
//! implements [`Drafter`] (the load generator's synthetic edges, `tandem_bench::synthetic`).

use tandem_engine::{Engine, Parent, SeqChunk, SeqId, Wanted};
use tandem_spec::sampling::{argmax, sample, second_choice, SamplingParams};
use tandem_spec::verify::{draft_sample, draft_sibling, VerifyRule};
use tandem_spec::{BranchJob, Hedge};

use crate::{EdgeError, SpecConfig};

/// One proposed token.
#[derive(Debug, Clone)]
pub struct Proposal {
    pub token: u32,
    /// The draft's sparse distribution at this position (rejection sampling only).
    pub q: Option<Vec<(u32, f32)>>,
    /// This call also fed the prompt (its time is a prefill, not a draft step).
    pub prefill: bool,
    /// The draft's second choice there and how sure it was of `token` (for token trees).
    pub hedge: Option<Hedge>,
}

pub trait Drafter {
    /// The next token after `tokens` (prompt, committed and drafted tokens so far).
    fn propose(&mut self, tokens: &[u32]) -> Result<Proposal, EdgeError>;
    /// Forget everything drafted past the first `len` tokens.
    fn rollback(&mut self, len: usize) -> Result<(), EdgeError>;
    /// Draft `job`'s branch after `tokens` (prompt, committed and drafted so far: the branch
    /// hangs beside `tokens[job.pos]`). Returns its tokens (`job.first` first) and the forwards
    /// it took; the draft's state after it is as before.
    fn branch(&mut self, tokens: &[u32], job: BranchJob) -> Result<(Vec<u32>, usize), EdgeError>;
}

/// The sequence the edge drafts on.
const SEQ: SeqId = SeqId(0);

/// Feed `prompt` through the draft model ahead of [`crate::run`] — while the verifier prefills
/// the same prompt — so that the first block does not wait for the draft's own prefill.
pub fn prefill_draft(draft: &mut Engine, prompt: &[u32]) -> Result<(), EdgeError> {
    draft.free(SEQ);
    draft.forward(&[SeqChunk::new(SEQ, 0, prompt.to_vec(), Wanted::Last)])?;
    Ok(())
}

/// The draft model: one forward over the tokens it has not fed yet, then the rule's sampling.
pub struct EngineDrafter<'a> {
    engine: &'a mut Engine,
    rule: VerifyRule,
    params: SamplingParams,
    q_top_k: usize,
    /// The session sends token trees: each draw also names the draft's second choice (a pass
    /// over the vocabulary, skipped without trees).
    hedges: bool,
}

impl<'a> EngineDrafter<'a> {
    /// A drafter over `engine`, whose sequence holds nothing or exactly the `prompt_len`-token
    /// prompt.
    pub fn new(engine: &'a mut Engine, prompt_len: usize, cfg: &SpecConfig) -> Self {
        if engine.seq_len(SEQ) != prompt_len {
            engine.free(SEQ);
        }
        Self {
            engine,
            rule: cfg.rule.effective(&cfg.params),
            params: cfg.params,
            q_top_k: cfg.q_top_k,
            hedges: cfg.session.tree.side_nodes > 0,
        }
    }
}

impl EngineDrafter<'_> {
    /// The rule's token at `pos` from the draft's logits there, its distribution when the rule
    /// needs it, and the second choice.
    fn choose(&self, row: &[f32], pos: u64) -> Proposal {
        let (token, q, params) = match self.rule {
            VerifyRule::Greedy => {
                let p = SamplingParams::default();
                (sample(row, &p, pos), None, p)
            }
            // The target draws its token at `pos` by inverse CDF on one uniform keyed by (seed,
            // pos); the draft draws from its own distribution on the same uniform, so wherever
            // the two distributions are close it draws the same token (coupled draws). The
            // target's draw does not depend on the draft's: lossless either way.
            VerifyRule::SampleMatch => (sample(row, &self.params, pos), None, self.params),
            VerifyRule::Rejection => {
                let (t, q) = draft_sample(row, &self.params, pos, self.q_top_k);
                // The second guess: a second draw from q, without the first (see
                // `draft_sibling`), and how likely the drawn token was.
                let hedge = self
                    .hedges
                    .then(|| {
                        let p_top = q.iter().find(|e| e.0 == t).map_or(0.0, |e| e.1);
                        draft_sibling(&q, t, self.params.seed, pos).map(|alt| Hedge { alt, p_top })
                    })
                    .flatten();
                return Proposal {
                    token: t,
                    q: Some(q),
                    prefill: false,
                    hedge,
                };
            }
        };
        let hedge = self
            .hedges
            .then(|| second_choice(row, &params, token))
            .flatten()
            .map(|(alt, p_top)| Hedge { alt, p_top });
        Proposal {
            token,
            q,
            prefill: false,
            hedge,
        }
    }
}

impl Drafter for EngineDrafter<'_> {
    fn propose(&mut self, toks: &[u32]) -> Result<Proposal, EdgeError> {
        let fed = self.engine.seq_len(SEQ);
        // A forward that feeds the whole prompt is a prefill, not a draft step.
        let prefill = fed == 0;
        let logits =
            self.engine
                .forward(&[SeqChunk::new(SEQ, fed, toks[fed..].to_vec(), Wanted::Last)])?;
        Ok(Proposal {
            prefill,
            ..self.choose(logits.row(0), toks.len() as u64)
        })
    }

    fn branch(&mut self, toks: &[u32], job: BranchJob) -> Result<(Vec<u32>, usize), EdgeError> {
        let fed = self.engine.seq_len(SEQ);
        if job.pos == 0 || job.pos > fed || job.pos >= toks.len() {
            return Err(EdgeError::Spec(tandem_spec::SpecError::Protocol(format!(
                "a branch at position {} of a draft that fed {fed} of {} tokens",
                job.pos,
                toks.len()
            ))));
        }
        // The branch grows as tree nodes after the fed tokens, each the child of the one before
        // (the first, of the main path's token before it); then it is cut off again.
        let mut out = vec![job.first];
        let mut parent = job.pos - 1;
        let grown = (|| -> Result<(), EdgeError> {
            for i in 1..job.len {
                let slot = fed + i - 1;
                let logits = self.engine.forward(&[SeqChunk::tree(
                    SEQ,
                    slot,
                    vec![out[i - 1]],
                    vec![Parent::Slot(parent)],
                    Wanted::Last,
                )])?;
                let (row, pos) = (logits.row(0), (job.pos + i) as u64);
                // Under rejection sampling a branch's tokens are point masses, committed with
                // the target's probability of them: the draft's likeliest token is the best bet.
                out.push(if self.rule == VerifyRule::Rejection {
                    argmax(row)
                } else {
                    self.choose(row, pos).token
                });
                parent = slot;
            }
            Ok(())
        })();
        self.engine.truncate(SEQ, fed)?;
        grown?;
        Ok((out, job.len - 1))
    }

    fn rollback(&mut self, len: usize) -> Result<(), EdgeError> {
        if len == 0 {
            self.engine.free(SEQ);
            return Ok(());
        }
        let have = self.engine.seq_len(SEQ);
        self.engine.truncate(SEQ, len.min(have))?;
        Ok(())
    }
}
