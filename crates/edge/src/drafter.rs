//! What proposes draft tokens: the draft model ([`EngineDrafter`]), or anything else that
//! implements [`Drafter`] (the load generator's synthetic edges, `tandem_bench::synthetic`).

use tandem_engine::{Engine, SeqChunk, SeqId, Wanted};
use tandem_spec::sampling::sample;
use tandem_spec::sampling::SamplingParams;
use tandem_spec::verify::{draft_sample, VerifyRule};

use crate::{EdgeError, SpecConfig};

/// One proposed token.
#[derive(Debug, Clone)]
pub struct Proposal {
    pub token: u32,
    /// The draft's sparse distribution at this position (rejection sampling only).
    pub q: Option<Vec<(u32, f32)>>,
    /// This call also fed the prompt (its time is a prefill, not a draft step).
    pub prefill: bool,
}

pub trait Drafter {
    /// The next token after `tokens` (prompt, committed and drafted tokens so far).
    fn propose(&mut self, tokens: &[u32]) -> Result<Proposal, EdgeError>;
    /// Forget everything drafted past the first `len` tokens.
    fn rollback(&mut self, len: usize) -> Result<(), EdgeError>;
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
        let pos = toks.len() as u64;
        let row = logits.row(0);
        let (token, q) = match self.rule {
            VerifyRule::Greedy => (sample(row, &SamplingParams::default(), pos), None),
            VerifyRule::SampleMatch => {
                let dp = SamplingParams {
                    seed: self.params.seed ^ 0xed6e,
                    ..self.params
                };
                (sample(row, &dp, pos), None)
            }
            VerifyRule::Rejection => {
                let (t, q) = draft_sample(row, &self.params, pos, self.q_top_k);
                (t, Some(q))
            }
        };
        Ok(Proposal { token, q, prefill })
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
