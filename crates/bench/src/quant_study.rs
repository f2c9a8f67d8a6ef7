//! `tandem bench quant`: which draft to make from the target. Every draft here is made from the
//! target by `tandem quantize` (W4A16 at groups of 32, 64 and 128, W8A16, W3A16, W2A16), by
//! fake-quantizing its activations per token before every layer matmul (W4A4, W8A8), or by
//! leaving layers out (a layer-skipping draft). For each: its size, its perplexity on a shipped
//! English corpus, its greedy α and E[A] against the target, its decode speed on one core, and
//! the end-to-end ITL of asynchronous speculation with it over an emulated round trip (the real
//! verifier in its own process, netem between).

use std::path::PathBuf;
use std::sync::Arc;
use tandem_client::Mode;

use anyhow::{bail, Context, Result};
use serde::Serialize;
use tandem_engine::{CpuSet, Engine, EngineConfig, GgufFile, LlamaModel, Tokenizer, WeightMode};
use tandem_quant::{Method, QuantConfig, Scheme};
use tandem_spec::sampling::SamplingParams;

use crate::latency::{Draft, LatencyArgs};
use tandem_quant::eval::{mean_accepted, perplexity};
use tandem_sim::stats::round2;

/// The corpus of the perplexity column (see `data/corpus/README.md`: the Rust Book's prose,
/// MIT OR Apache-2.0).
pub const CORPUS: &str = include_str!("../../../data/corpus/rust-book-prose.txt");
pub const CORPUS_SOURCE: &str = "The Rust Programming Language (the Rust Book), chapters 3, 4 and 8, prose paragraphs; rust-docs 1.95.0; MIT OR Apache-2.0 (data/corpus/README.md)";

/// The layers the layer-skipping draft leaves out by default: a contiguous block of 6 of
/// SmolLM2-135M's 30, in the middle. A small search on 512 corpus tokens (`--skip-layers`) found
/// contiguous middle blocks far better than spread ones: 16-19 perplexity 33 (α 0.52), 14-19 43
/// (0.43), 12-19 61 (0.34), against 275 for every other layer from 10 to 24 and 61,000 for 24-27.
pub const SKIPPED_LAYERS: [usize; 6] = [14, 15, 16, 17, 18, 19];

/// One draft of the study.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Variant {
    pub scheme: Scheme,
    pub method: Method,
    pub group: usize,
    /// Activations fake-quantized per token to this many bits (None: 16-bit, as the weights'
    /// dequantized values meet f32 activations).
    pub act_bits: Option<u32>,
    /// Leave out the study's skipped layers.
    pub skip: bool,
    /// Activations quantized to 8 bits per 32-element block and multiplied by integer dot
    /// products (`WeightMode::W4A8`, the engine's real kernels; `act_bits` is then 8).
    pub int8: bool,
}

impl Variant {
    /// Its name, when the layer-skipping drafts leave out `skipped` layers.
    pub fn name(&self, skipped: usize) -> String {
        let w = self.scheme.bits();
        let a = self.act_bits.map_or("16".to_string(), |b| b.to_string());
        let mut s = format!("w{w}a{a}-g{}", self.group);
        if self.skip {
            s.push_str(&format!("-skip{skipped}"));
        }
        if self.method != Method::Rtn {
            s.push_str(&format!("-{}", self.method.name()));
        }
        if self.int8 {
            s.push_str("-int8");
        }
        s
    }
}

/// The study's drafts, in the order of the table.
pub fn variants() -> Vec<Variant> {
    let v = |scheme, group, act_bits, skip| Variant {
        scheme,
        method: Method::Rtn,
        group,
        act_bits,
        skip,
        int8: false,
    };
    let gptq = |scheme, group| Variant {
        method: Method::Gptq,
        ..v(scheme, group, None, false)
    };
    vec![
        v(Scheme::W8A16, 32, None, false),
        v(Scheme::W4A16, 32, None, false),
        gptq(Scheme::W4A16, 32),
        Variant {
            act_bits: Some(8),
            int8: true,
            ..gptq(Scheme::W4A16, 32)
        },
        gptq(Scheme::W4A16, 128),
        gptq(Scheme::W3A16, 32),
        v(Scheme::W4A16, 64, None, false),
        v(Scheme::W4A16, 128, None, false),
        v(Scheme::W3A16, 32, None, false),
        v(Scheme::W2A16, 32, None, false),
        v(Scheme::W8A16, 32, Some(8), false),
        v(Scheme::W4A16, 32, Some(4), false),
        v(Scheme::W4A16, 32, None, true),
    ]
}

#[derive(Debug, Clone)]
pub struct QuantStudyArgs {
    pub home: PathBuf,
    /// The model whose drafts are studied.
    pub model: &'static tandem_models::pull::CatalogModel,
    pub variants: Vec<Variant>,
    /// The layers a layer-skipping variant leaves out.
    pub skip_layers: Vec<usize>,
    /// Tokens of the corpus scored (its first ones), in windows of `window`.
    pub ppl_tokens: usize,
    pub window: usize,
    /// Chat prompts and tokens per prompt for α and E[A] (teacher-forced on the target's greedy
    /// continuation).
    pub alpha_prompts: Vec<String>,
    pub alpha_tokens: usize,
    /// γ at which E[A] is reported.
    pub gamma: usize,
    /// The end-to-end run: round trip, prompts, tokens; `None` skips it.
    pub latency: Option<LatencyArgs>,
    pub edge_cpus: CpuSet,
    pub quiet: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct QuantRow {
    pub draft: String,
    pub weight_bits: usize,
    pub group: usize,
    pub act_bits: Option<u32>,
    /// The engine's 8-bit-activation kernels (else fake-quantized per token).
    pub int8: bool,
    pub skipped_layers: Vec<usize>,
    /// The file as stored (3- and 2-bit grids sit in 4-bit blocks), and at the scheme's own bits
    /// per weight (payload plus an f16 scale per group) with the same embedding.
    pub file_mb: f64,
    pub scheme_mb: f64,
    pub perplexity: f64,
    /// Greedy α against the target (teacher-forced), and E[A] at `gamma`: measured (mean over
    /// every start position of min(matching run, γ) + 1) and from α by the formula.
    pub alpha: f64,
    pub mean_accepted: f64,
    pub mean_accepted_model: f64,
    /// Decode speed on the edge's core (greedy, best of two runs of the α prompts' length, before
    /// the verifier starts).
    pub draft_tok_s: f64,
    /// Asynchronous speculation end to end at the study's RTT (γ and depth planned from a
    /// synchronous calibration run), and the best synchronous ITL beside it.
    pub async_itl_ms: Option<f64>,
    pub async_shape: Option<(usize, usize)>,
    pub best_sync_itl_ms: Option<f64>,
    /// Every speculative output equal to the target's.
    pub same_as_target: Option<bool>,
    /// The teacher-forced guesses by the draft's confidence: how often its argmax, and its top
    /// two, held the target's token.
    pub confidence: Vec<tandem_quant::eval::Bucket>,
}

#[derive(Debug, Clone, Serialize)]
pub struct QuantReport {
    pub corpus: String,
    pub ppl_tokens: usize,
    pub window: usize,
    pub target_perplexity: f64,
    pub gamma: usize,
    pub alpha_prompts: usize,
    pub alpha_tokens: usize,
    pub rtt_ms: Option<f64>,
    pub cloud_only_itl_ms: Option<f64>,
    pub rows: Vec<QuantRow>,
}

fn load_variant(
    home: &std::path::Path,
    model: &tandem_models::pull::CatalogModel,
    v: &Variant,
    skip: &[usize],
    quiet: bool,
) -> Result<(Draft, f64, f64)> {
    let cfg = QuantConfig {
        scheme: v.scheme,
        method: v.method,
        group_size: v.group,
        ..QuantConfig::default()
    };
    cfg.validate()?;
    let path = tandem_models::store::ensure_quantized_of(home, model, &cfg, quiet)?;
    let mut g = GgufFile::open(&path).with_context(|| format!("opening {}", path.display()))?;
    let mode = match v.int8 {
        true => WeightMode::W4A8,
        false => WeightMode::Native,
    };
    let mut model =
        LlamaModel::load(&mut g, mode).with_context(|| format!("loading {}", path.display()))?;
    if !v.int8 {
        model.set_activation_bits(v.act_bits)?;
    }
    if v.skip {
        model.skip_layers(skip)?;
    }
    // Sizes: the file, and the file with its linear layers at the scheme's own bits per weight
    // (each matrix at its own row width: the group overhead depends on it).
    let file = std::fs::metadata(&path)?.len() as f64;
    let c = &model.cfg;
    let kept = (c.n_layer - model.skipped_layers().len()) as f64;
    let (d, kvd, ff) = (c.dim as f64, c.kv_dim() as f64, c.ff_dim as f64);
    // (weights, row width) of one layer's matrices: q, k, v, o and gate, up take rows of `dim`.
    let shapes = [
        (d * (2.0 * d + 2.0 * kvd + 2.0 * ff), c.dim),
        (ff * d, c.ff_dim),
    ];
    let stored_bits = v.scheme.stored_bits_per_weight();
    let (mut stored, mut scheme) = (0.0, 0.0);
    for (weights, cols) in shapes {
        stored += c.n_layer as f64 * weights * stored_bits / 8.0;
        scheme += kept * weights * cfg.scheme_bits_per_weight(cols) / 8.0;
    }
    let scheme_bytes = file - stored + scheme;
    Ok((
        Draft {
            name: v.name(model.skipped_layers().len()),
            path,
            model: Arc::new(model),
        },
        round2(file / 1e6),
        round2(scheme_bytes / 1e6),
    ))
}

/// Run the study; `log` hears about progress.
pub fn run(
    a: &QuantStudyArgs,
    target: &Arc<LlamaModel>,
    tok: &Tokenizer,
    mut log: impl FnMut(&str),
) -> Result<QuantReport> {
    if a.variants.is_empty() {
        bail!("no draft to study");
    }
    if a.ppl_tokens < 2 || a.window < 2 {
        bail!(
            "--ppl-tokens ({}) and --window ({}) must each be at least 2 tokens",
            a.ppl_tokens,
            a.window
        );
    }
    if a.alpha_prompts.is_empty() || a.alpha_tokens == 0 {
        bail!("α needs at least one prompt and --alpha-tokens of at least 1");
    }
    let corpus = tok.encode(CORPUS)?;
    let ppl_tokens = a.ppl_tokens.min(corpus.len());
    let corpus = &corpus[..ppl_tokens];
    log(&format!("target perplexity on {ppl_tokens} tokens"));
    let target_ppl = perplexity(target, corpus, a.window, a.edge_cpus)?;
    // The target's greedy continuations, for α.
    let mut te = Engine::new(
        target.clone(),
        EngineConfig {
            threads: a.edge_cpus.len().max(1),
            cpus: a.edge_cpus,
            ..EngineConfig::default()
        },
    )?;
    let mut pairs = Vec::new();
    for p in &a.alpha_prompts {
        let ids = tok.encode_chat(p)?;
        let o = tandem_client::generate::generate(
            &mut te,
            tok,
            &ids,
            a.alpha_tokens,
            &SamplingParams::default(),
            |_| {},
        )?;
        pairs.push((ids, o.output_ids));
    }
    drop(te);
    let mut drafts = Vec::new();
    let mut rows = Vec::new();
    for v in &a.variants {
        let (d, file_mb, scheme_mb) = load_variant(&a.home, a.model, v, &a.skip_layers, a.quiet)?;
        log(&format!("{}: perplexity, α, decode speed", d.name));
        let ppl = perplexity(&d.model, corpus, a.window, a.edge_cpus)?;
        let guesses = pairs
            .iter()
            .map(|(p, w)| tandem_quant::eval::teacher_forced_guesses(&d.model, p, w))
            .collect::<Result<Vec<_>, _>>()?;
        let hits: Vec<Vec<bool>> = guesses
            .iter()
            .map(|g| g.iter().map(|x| x.first).collect())
            .collect();
        let confidence = tandem_quant::eval::by_confidence(&guesses.concat());
        // Decode speed on the edge's core, the verifier not yet started: best of two runs.
        let mut speed = 0f64;
        let mut e = Engine::new(
            d.model.clone(),
            EngineConfig {
                threads: a.edge_cpus.len().max(1),
                cpus: a.edge_cpus,
                ..EngineConfig::default()
            },
        )?;
        for _ in 0..2 {
            let o = tandem_client::generate::generate(
                &mut e,
                tok,
                &pairs[0].0,
                a.alpha_tokens.max(8),
                &SamplingParams::default(),
                |_| {},
            )?;
            speed = speed.max(o.tokens_per_s);
        }
        drop(e);
        let judged: usize = hits.iter().map(Vec::len).sum();
        let alpha = hits.iter().flatten().filter(|&&h| h).count() as f64 / judged.max(1) as f64;
        rows.push(QuantRow {
            draft: d.name.clone(),
            weight_bits: v.scheme.bits(),
            group: v.group,
            act_bits: v.act_bits,
            int8: v.int8,
            skipped_layers: d.model.skipped_layers(),
            file_mb,
            scheme_mb,
            perplexity: round2(ppl),
            alpha: round2(alpha),
            mean_accepted: round2(mean_accepted(&hits, a.gamma)),
            mean_accepted_model: round2(tandem_spec::policy::expected_accepted(alpha, a.gamma)),
            draft_tok_s: round2(speed),
            confidence,
            async_itl_ms: None,
            async_shape: None,
            best_sync_itl_ms: None,
            same_as_target: None,
        });
        drafts.push(d);
    }
    let (mut rtt, mut cloud_only) = (None, None);
    if let Some(l) = &a.latency {
        log("end to end: every draft against the real verifier over netem");
        let r = crate::latency::run(l, target, tok, &drafts, |r| {
            log(&format!(
                "  {} {} γ{} d{}: ITL {:.1} ms",
                r.draft, r.mode, r.gamma, r.depth, r.itl_ms.mean
            ))
        })?;
        rtt = l.rtts.first().copied();
        for row in &mut rows {
            let mine: Vec<_> = r.rows.iter().filter(|x| x.draft == row.draft).collect();
            if let Some(x) = mine.iter().find(|x| x.mode == Mode::Async) {
                row.async_itl_ms = Some(x.itl_ms.mean);
                row.async_shape = Some((x.gamma, x.depth));
            }
            row.best_sync_itl_ms = mine
                .iter()
                .filter(|x| x.mode == Mode::Sync)
                .map(|x| x.itl_ms.mean)
                .reduce(f64::min);
            row.same_as_target = Some(
                mine.iter()
                    .filter(|x| x.mode != Mode::EdgeOnly)
                    .all(|x| x.same_as_target == Some(true)),
            );
        }
        cloud_only = r
            .rows
            .iter()
            .find(|x| x.mode == Mode::CloudOnly)
            .map(|x| x.itl_ms.mean);
    }
    Ok(QuantReport {
        corpus: CORPUS_SOURCE.to_string(),
        ppl_tokens,
        window: a.window,
        target_perplexity: round2(target_ppl),
        gamma: a.gamma,
        alpha_prompts: a.alpha_prompts.len(),
        alpha_tokens: a.alpha_tokens,
        rtt_ms: rtt,
        cloud_only_itl_ms: cloud_only,
        rows,
    })
}

/// The study as a Markdown table.
pub fn table(r: &QuantReport) -> String {
    let mut s = format!(
        "Perplexity: the first {} tokens of {}, windows of {}; the target (f32) scores {:.2}.\nα and E[A]: greedy, teacher-forced on the target's continuations of {} chat prompts × {} tokens; E[A] at γ {}.\n",
        r.ppl_tokens, r.corpus, r.window, r.target_perplexity, r.alpha_prompts, r.alpha_tokens, r.gamma
    );
    if let (Some(rtt), Some(c)) = (r.rtt_ms, r.cloud_only_itl_ms) {
        s.push_str(&format!(
            "End to end: RTT {rtt} ms, the verifier in its own process; cloud-only ITL {c:.1} ms.\n"
        ));
    }
    s.push_str("\n| draft | weights | activations | layers | MB as stored | MB at scheme bits | perplexity | × target | α | E[A] measured / from α | draft tok/s | async ITL ms (γ, depth) | best sync ITL ms | = target |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for x in &r.rows {
        let opt = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.1}"));
        s.push_str(&format!(
            "| {} | {}-bit, g{} | {} | {} | {:.1} | {:.1} | {:.2} | {:.2} | {:.2} | {:.2} / {:.2} | {:.1} | {}{} | {} | {} |\n",
            x.draft,
            x.weight_bits,
            x.group,
            match (x.act_bits, x.int8) {
                (None, _) => "16-bit".to_string(),
                (Some(b), true) => format!("{b}-bit per 32 (integer kernels)"),
                (Some(b), false) => format!("{b}-bit per token (fake)"),
            },
            if x.skipped_layers.is_empty() {
                "all".to_string()
            } else {
                format!("skips {:?}", x.skipped_layers)
            },
            x.file_mb,
            x.scheme_mb,
            x.perplexity,
            x.perplexity / r.target_perplexity.max(1e-9),
            x.alpha,
            x.mean_accepted,
            x.mean_accepted_model,
            x.draft_tok_s,
            opt(x.async_itl_ms),
            x.async_shape.map_or(String::new(), |(g, d)| format!(" ({g}, {d})")),
            opt(x.best_sync_itl_ms),
            x.same_as_target.map_or("-", |b| if b { "yes" } else { "NO" }),
        ));
    }
    s += "\nBy the draft's confidence (its top-1 probability), teacher-forced: positions, and the share where its argmax / its top two held the target's token:\n\n| draft |";
    let buckets = tandem_quant::eval::CONFIDENCE_BUCKETS;
    for (lo, hi) in buckets {
        s += &format!(" p {lo:.1}–{:.1} |", hi.min(1.0));
    }
    s += "\n|---|";
    s += &"---|".repeat(buckets.len());
    s += "\n";
    for x in &r.rows {
        s += &format!("| {} |", x.draft);
        for b in &x.confidence {
            s += &format!(
                " {}: {:.2} / {:.2} |",
                b.positions, b.first, b.first_or_second
            );
        }
        s += "\n";
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variant_names_say_bits_group_and_skips() {
        let n: Vec<String> = variants().iter().map(|v| v.name(6)).collect();
        assert!(n.contains(&"w4a4-g32".to_string()));
        assert!(n.contains(&"w8a8-g32".to_string()));
        assert!(n.contains(&"w2a16-g32".to_string()));
        assert!(n.contains(&"w4a16-g32-skip6".to_string()));
        let mut dedup = n.clone();
        dedup.sort();
        dedup.dedup();
        assert_eq!(dedup.len(), n.len());
    }

    #[test]
    fn the_corpus_is_english_prose_of_some_length() {
        assert!(CORPUS.len() > 100_000);
        assert!(CORPUS.contains("ownership"));
        assert!(!CORPUS.contains("<p>"));
    }
}
