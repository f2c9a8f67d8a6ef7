//! Single-model generation (`tandem generate`): prefill the prompt, then decode one token per forward
//! until an end-of-generation token or the token limit.

use crate::Mode;
use std::time::Instant;

use anyhow::{Context, Result};
use serde::Serialize;
use tandem_engine::tokenizer::TextStream;
use tandem_engine::{Engine, SeqChunk, SeqId, Tokenizer, Wanted};
use tandem_spec::sampling as sampler;
use tandem_spec::sampling::SamplingParams;

use tandem_sim::stats::{StreamTiming, Summary};

/// What `generate --json` prints (one object, one line). Later modes add fields, never remove them.
#[derive(Debug, Clone, Serialize)]
pub struct GenOutput {
    pub prompt_ids: Vec<u32>,
    /// Generated ids; an end-of-generation token, when reached, is the last one.
    pub output_ids: Vec<u32>,
    /// Generated text, without the end-of-generation token.
    pub text: String,
    /// `stop` (end-of-generation token) or `length` (token limit).
    pub finish_reason: &'static str,
    /// From the start of the prefill to the first generated token.
    pub ttft_ms: f64,
    /// Between consecutive generated tokens.
    pub itl_ms: Summary,
    /// Decode rate: generated tokens after the first, over the time after the first.
    pub tokens_per_s: f64,
    pub mode: Mode,
    pub model: String,
    pub weights: String,
    pub threads: usize,
    pub tokenizer_fingerprint: String,
    /// Speculative modes only.
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub spec: Option<crate::speculate::SpecFields>,
    /// Each generated token's commit time, ms since the request.
    #[serde(skip)]
    pub token_ms: Vec<f64>,
}

/// Generate up to `max_tokens` after `prompt_ids` on sequence 0 of `engine`, calling `on_text` with
/// each printable piece as it is produced.
pub fn generate(
    engine: &mut Engine,
    tok: &Tokenizer,
    prompt_ids: &[u32],
    max_tokens: usize,
    params: &SamplingParams,
    mut on_text: impl FnMut(&str),
) -> Result<GenOutput> {
    anyhow::ensure!(
        !prompt_ids.is_empty(),
        "the prompt is empty: there is nothing to continue"
    );
    let seq = SeqId(0);
    engine.free(seq);
    let start = Instant::now();
    let mut times = Vec::with_capacity(max_tokens);
    let mut out = Vec::with_capacity(max_tokens);
    let mut stream = TextStream::default();
    let mut text = String::new();
    let mut chunk = SeqChunk::new(seq, 0, prompt_ids.to_vec(), Wanted::Last);
    while out.len() < max_tokens {
        let logits = engine.forward(std::slice::from_ref(&chunk))?;
        let pos = chunk.start_pos + chunk.tokens.len();
        let next = sampler::sample(logits.row(0), params, pos as u64);
        times.push(start.elapsed().as_secs_f64() * 1e3);
        out.push(next);
        if tok.is_eog(next) {
            break;
        }
        let piece = stream.push(tok, next)?;
        if !piece.is_empty() {
            on_text(&piece);
            text.push_str(&piece);
        }
        chunk = SeqChunk::new(seq, pos, vec![next], Wanted::Last);
    }
    engine.free(seq);
    let model = engine.model();
    let mut o = output(tok, prompt_ids, out, &times, &text, &mut on_text)?;
    o.weights = format!("{:?}/{}", model.mode, model.format()).to_lowercase();
    o.threads = engine.threads();
    Ok(o)
}

/// The [`GenOutput`] of a finished stream: `out` the tokens, `times` their commit times (ms since
/// the request), `printed` the text already passed to `on_text`.
pub fn output(
    tok: &Tokenizer,
    prompt_ids: &[u32],
    out: Vec<u32>,
    times: &[f64],
    printed: &str,
    on_text: &mut impl FnMut(&str),
) -> Result<GenOutput> {
    let timing = StreamTiming::of(times);
    let text_all = final_text(tok, &out, printed, on_text)?;
    Ok(GenOutput {
        prompt_ids: prompt_ids.to_vec(),
        finish_reason: if out.last().is_some_and(|&t| tok.is_eog(t)) {
            "stop"
        } else {
            "length"
        },
        output_ids: out,
        text: text_all,
        ttft_ms: timing.ttft_ms,
        itl_ms: timing.itl_ms,
        tokens_per_s: timing.tokens_per_s,
        mode: Mode::Local,
        model: String::new(),
        weights: String::new(),
        threads: 0,
        tokenizer_fingerprint: tok.fingerprint().to_string(),
        spec: None,
        token_ms: times.to_vec(),
    })
}

/// Cloud-only generation through a running verifier's `Generate` RPC at `url`.
pub fn generate_remote(
    remote: tandem_edge::grpc::Remote<'_>,
    tok: &Tokenizer,
    prompt_ids: &[u32],
    max_tokens: usize,
    params: &SamplingParams,
    on_text: impl FnMut(&str),
) -> Result<GenOutput> {
    generate_remote_with(
        remote,
        tok,
        prompt_ids,
        max_tokens,
        params,
        Default::default(),
        on_text,
    )
}

/// [`generate_remote`] with options: a structured output's grammar (the verifier masks the
/// target), the verifier's own suffix drafts.
pub fn generate_remote_with(
    remote: tandem_edge::grpc::Remote<'_>,
    tok: &Tokenizer,
    prompt_ids: &[u32],
    max_tokens: usize,
    params: &SamplingParams,
    options: tandem_edge::grpc::GenerateOptions<'_>,
    mut on_text: impl FnMut(&str),
) -> Result<GenOutput> {
    let rt = crate::runtime()?;
    let start = Instant::now();
    let (mut out, mut times) = (Vec::new(), Vec::new());
    let mut stream = TextStream::default();
    let mut text = String::new();
    tandem_edge::grpc::generate_remote_with(
        &rt,
        remote,
        tok.fingerprint(),
        prompt_ids,
        *params,
        max_tokens as u32,
        options,
        |t| {
            times.push(start.elapsed().as_secs_f64() * 1e3);
            out.push(t);
            if !tok.is_eog(t) {
                if let Ok(piece) = stream.push(tok, t) {
                    on_text(&piece);
                    text.push_str(&piece);
                }
            }
        },
    )
    .with_context(|| format!("cloud-only generation on {}", remote.url))?;
    rt.shutdown_timeout(std::time::Duration::from_millis(200));
    let mut o = output(tok, prompt_ids, out, &times, &text, &mut on_text)?;
    o.mode = Mode::CloudOnly;
    o.model = remote.url.to_string();
    Ok(o)
}

/// The whole output as text (end-of-generation tokens left out), passing `on_text` whatever the
/// stream still held back (a character cut at the end).
pub fn final_text(
    tok: &Tokenizer,
    out: &[u32],
    printed: &str,
    on_text: &mut impl FnMut(&str),
) -> Result<String> {
    let ids: Vec<u32> = out.iter().copied().filter(|&t| !tok.is_eog(t)).collect();
    let text = tok.decode(&ids)?;
    if let Some(rest) = text.get(printed.len()..).filter(|r| !r.is_empty()) {
        on_text(rest);
    }
    Ok(text)
}
