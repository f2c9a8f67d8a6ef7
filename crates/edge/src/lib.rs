//! Tandem's edge runtime: the draft engine drives the speculation [`Pipeline`], blocks go to the
//! verifier over a [`Link`], verdicts come back, and only verified tokens reach the user.
//!
//! The runtime never waits for the network while it may draft: verdicts are applied as soon as they
//! have arrived, and the edge blocks on the link only when the pipeline is full (`depth` blocks in
//! flight). `depth = 1` is synchronous speculation.

pub mod delay;
pub mod grpc;
pub mod netem;

use std::time::Instant;

use serde::Serialize;
use tandem_engine::{Engine, EngineError, SamplingParams, SeqChunk, SeqId, Wanted};
use tandem_spec::sampling::sample;
use tandem_spec::verify::{draft_sample, VerifyRule};
use tandem_spec::{
    Block, Next, Output, Pipeline, PipelineConfig, PipelineStats, SpecError, Verdict,
};

#[derive(Debug, thiserror::Error)]
pub enum EdgeError {
    #[error("the verifier link is closed")]
    LinkClosed,
    #[error("the verifier refused: {0}")]
    Refused(String),
    #[error(transparent)]
    Spec(#[from] SpecError),
    #[error(transparent)]
    Engine(#[from] EngineError),
}

/// The edge's side of a connection to a verifier session.
pub trait Link {
    fn send(&mut self, block: Block) -> Result<(), EdgeError>;
    /// The next verdict: waits for one when `wait`, else returns `None` if none has arrived.
    fn recv(&mut self, wait: bool) -> Result<Option<Verdict>, EdgeError>;
}

#[derive(Debug, Clone, Copy, Serialize)]
pub struct SpecConfig {
    pub draft_len: usize,
    pub depth: usize,
    pub max_new_tokens: usize,
    pub rule: VerifyRule,
    pub params: SamplingParams,
    /// Size of the sparse draft distribution sent for rejection sampling.
    pub q_top_k: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct SpecReport {
    pub output_ids: Vec<u32>,
    /// Milliseconds from `start` (the request) to the commit of each output token.
    pub commit_ms: Vec<f64>,
    pub stats: PipelineStats,
    pub draft_forwards: usize,
}

/// Generate with speculation: `prompt` is already open on the verifier behind `link`, which
/// answered with the target's `first` token.
#[allow(clippy::too_many_arguments)]
pub fn run(
    draft: &mut Engine,
    eog: Vec<u32>,
    prompt: &[u32],
    first: u32,
    cfg: &SpecConfig,
    link: &mut dyn Link,
    start: Instant,
    mut on_commit: impl FnMut(&[u32]),
) -> Result<SpecReport, EdgeError> {
    let seq = SeqId(0);
    draft.free(seq);
    let pcfg = PipelineConfig {
        draft_len: cfg.draft_len,
        depth: cfg.depth,
        max_new_tokens: cfg.max_new_tokens,
    };
    let (mut p, first_out) = Pipeline::with_first(prompt.to_vec(), first, pcfg, eog)?;
    let rule = cfg.rule.effective(&cfg.params);
    let mut commit_ms = Vec::new();
    let mut draft_forwards = 0;
    let mut apply = |outs: Vec<Output>,
                     draft: &mut Engine,
                     link: &mut dyn Link,
                     commit_ms: &mut Vec<f64>|
     -> Result<(), EdgeError> {
        for o in outs {
            match o {
                Output::Send(b) => link.send(b)?,
                Output::Rollback { to } => {
                    let len = draft.seq_len(seq);
                    draft.truncate(seq, to.min(len))?;
                }
                Output::Commit { tokens, .. } => {
                    let t = start.elapsed().as_secs_f64() * 1e3;
                    commit_ms.extend(std::iter::repeat_n(t, tokens.len()));
                    on_commit(&tokens);
                }
            }
        }
        Ok(())
    };
    apply(first_out, draft, link, &mut commit_ms)?;
    loop {
        while let Some(v) = link.recv(false)? {
            let outs = p.on_verdict(v)?;
            apply(outs, draft, link, &mut commit_ms)?;
        }
        match p.next() {
            Next::Done => break,
            Next::Wait => {
                let v = link.recv(true)?.ok_or(EdgeError::LinkClosed)?;
                let outs = p.on_verdict(v)?;
                apply(outs, draft, link, &mut commit_ms)?;
            }
            Next::Draft => {
                let fed = draft.seq_len(seq);
                let toks = p.tokens();
                let logits = draft.forward(&[SeqChunk::new(
                    seq,
                    fed,
                    toks[fed..].to_vec(),
                    Wanted::Last,
                )])?;
                draft_forwards += 1;
                let pos = toks.len() as u64;
                let row = logits.row(0);
                let (t, q) = match rule {
                    VerifyRule::Greedy => (sample(row, &SamplingParams::default(), pos), None),
                    VerifyRule::SampleMatch => {
                        let dp = SamplingParams {
                            seed: cfg.params.seed ^ 0xed6e,
                            ..cfg.params
                        };
                        (sample(row, &dp, pos), None)
                    }
                    VerifyRule::Rejection => {
                        let (t, q) = draft_sample(row, &cfg.params, pos, cfg.q_top_k);
                        (t, Some(q))
                    }
                };
                let outs = p.on_drafted(t, q);
                apply(outs, draft, link, &mut commit_ms)?;
            }
        }
    }
    draft.free(seq);
    Ok(SpecReport {
        output_ids: p.output().to_vec(),
        commit_ms,
        stats: *p.stats(),
        draft_forwards,
    })
}
