//! `tandem bench latency`: what a user waits for, mode by mode, over an emulated network.
//!
//! The verifier runs as its own process (`tandem cloud serve`), pinned to its own cores; the edge
//! runs here, pinned to others; between them a netem proxy adds the round trip (± jitter) to every
//! gRPC byte. For each draft and each RTT it measures edge-only (the draft alone), cloud-only (the
//! `Generate` RPC), synchronous speculation at each γ of a sweep, asynchronous speculation at the
//! γ / depth the policy plans from the calibration run, and the adaptive policy (`--auto`). Every
//! speculative run is checked token for token against the cloud-only output, and its ITL is compared
//! with the analytic model's prediction from the α, draft time, verify time and round trip measured
//! in that same run.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use tandem_client::Mode;

use anyhow::{bail, Context, Result};
use serde::Serialize;
use serde_json::Value;
use tandem_edge::SpecConfig;
use tandem_engine::{CpuSet, Engine, EngineConfig, LlamaModel, Tokenizer};
use tandem_spec::edge::AutoShape;
use tandem_spec::never_idle;
use tandem_spec::policy::{lane_alpha, Costs};
use tandem_spec::sampling::SamplingParams;
use tandem_spec::{TreeConfig, VerifyRule};

const LINEAR: TreeConfig = TreeConfig::LINEAR;

use crate::cloudproc::{CloudProcess, Link};
use tandem_client::generate::{generate, generate_remote, GenOutput};
use tandem_client::speculate::SpecRun;
use tandem_sim::stats::{round2, Summary};

mod copy;
mod report;
pub use copy::{copy_ceilings, copy_table, read as read_workload, CopyCeilings};
use report::summarize;
pub use report::table;

/// What `bench latency` runs (its flags; the model directory, the cores and the peer are set by
/// the caller).
#[derive(Debug, Clone, clap::Args)]
pub struct LatencyArgs {
    #[arg(skip)]
    pub home: PathBuf,
    /// The verifier's `--model` (a catalog name or a path; empty: the default target).
    #[arg(skip)]
    pub model: String,
    /// Round trips to emulate, ms.
    #[arg(long, value_delimiter = ',', default_value = "0,20,50,100,200")]
    pub rtts: Vec<f64>,
    /// Jitter per direction, as a percentage of the RTT.
    #[arg(long = "jitter-pct", default_value = "10", value_parser = crate::percent)]
    pub jitter_frac: f64,
    /// Tokens generated per prompt.
    #[arg(long, default_value_t = 48)]
    pub tokens: usize,
    /// Chat prompts (repeat the flag for several; default: a few built-in ones).
    #[arg(long = "prompt")]
    pub prompts: Vec<String>,
    /// Feed the prompts as plain text, not wrapped in the chat template (a base model, such as
    /// Gemma 3 270M, answers a chat turn off its training; text to continue is what it is for).
    #[arg(long)]
    pub plain: bool,
    /// γ values of the synchronous sweep.
    #[arg(long, value_delimiter = ',', default_value = "1,2,3,4")]
    pub sync_gammas: Vec<usize>,
    #[arg(long, default_value_t = 8)]
    pub max_gamma: usize,
    #[arg(long, default_value_t = 4)]
    pub max_depth: usize,
    /// Token trees for the async-tree rows: lanes beside the main path at most, the draft
    /// confidence below which it forks one, and the least chance a lane must have
    /// (`LANES:BELOW[:MIN]`; `none`: no tree rows).
    #[arg(long, default_value = "2:0.5", value_parser = parse_tree)]
    pub tree: TreeArg,
    /// Sampling temperatures to measure the verify rules at (top-k 40, top-p 0.95, one seed):
    /// at each RTT, cloud-only sampled, and async by sample-and-match, by rejection sampling
    /// on linear blocks and over trees. None: greedy rows only.
    #[arg(long, value_delimiter = ',')]
    pub temperatures: Vec<f32>,
    #[arg(skip)]
    pub edge_cpus: CpuSet,
    #[arg(skip)]
    pub cloud_cpus: CpuSet,
    /// llama.cpp's python and bench.py, to show its forward times beside ours.
    #[arg(skip)]
    pub peer: Option<(PathBuf, PathBuf)>,
    /// The target as an f32 GGUF for llama.cpp (it cannot read the pulled file's dequantized form).
    #[arg(skip)]
    pub peer_target: Option<PathBuf>,
    /// A structured-output workload instead of the sweep: a JSON list of `{"prompt", "schema"}`
    /// (e.g. data/structured/extraction.json). At each RTT: cloud-only and async speculation (the
    /// edge's default adaptive shape) with each prompt's schema, and the same prompts free.
    #[arg(long)]
    pub structured: Option<PathBuf>,
    /// A workload of requests that copy their input instead of the sweep: a JSON list of
    /// `{"kind", "messages"}` chats (e.g. data/copy/prompts.json), run beside the fresh-text
    /// prompts (--prompt). At each RTT: cloud-only, cloud-only with the verifier drafting for
    /// itself, and async speculation (the edge's default adaptive shape) with the draft model
    /// alone, with the edge's copies beside it, and with the verifier's own drafts too.
    #[arg(long)]
    pub workload: Option<PathBuf>,
}

impl LatencyArgs {
    /// `extra` flags for the verifier process, after the `--model` it serves.
    pub fn cloud_flags(&self, extra: &[&str]) -> Vec<String> {
        let model = (!self.model.is_empty()).then_some(["--model", self.model.as_str()]);
        model
            .into_iter()
            .flatten()
            .chain(extra.iter().copied())
            .map(str::to_string)
            .collect()
    }

    /// Refuse settings the sweep cannot run, naming the flag.
    pub fn validate(&self) -> Result<()> {
        if self.rtts.is_empty() || self.prompts.is_empty() || self.sync_gammas.is_empty() {
            bail!("--rtts, --prompt and --sync-gammas must each name at least one value");
        }
        if self.max_gamma == 0 || self.max_depth == 0 || self.sync_gammas.contains(&0) {
            bail!("--max-gamma, --max-depth and every --sync-gammas must be at least 1");
        }
        if let Some(r) = self.rtts.iter().find(|r| !(r.is_finite() && **r >= 0.0)) {
            bail!("--rtts: {r} is not a round trip in ms (0 or more)");
        }
        Ok(())
    }
}

pub use tandem_spec::pipeline::{parse_tree, TreeArg};

/// The chat prompts of the one-session sweep when none are given.
pub fn default_prompts() -> Vec<String> {
    vec![
        "Write a short story about a robot who learns to paint.".to_string(),
        "Explain how a bicycle works, step by step.".to_string(),
    ]
}

/// One draft under test.
pub struct Draft {
    pub name: String,
    pub path: PathBuf,
    pub model: Arc<LlamaModel>,
}

/// One mode at one RTT, over all prompts.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub draft: String,
    pub rtt_ms: f64,
    pub mode: Mode,
    /// Sampling temperature (0: greedy) and the verify rule of a speculative row.
    pub temperature: f32,
    pub rule: String,
    pub gamma: usize,
    pub depth: usize,
    pub ttft_ms: f64,
    pub itl_ms: Summary,
    pub acceptance_rate: f64,
    /// α counting a token tree's lane hits as accepted (= `acceptance_rate` without trees).
    pub tree_acceptance_rate: f64,
    pub mean_accepted: f64,
    pub wasted_draft_tokens: usize,
    pub drafted: usize,
    /// Token trees: side nodes sent and committed tokens a lane guessed (JSON: `branch_hits`,
    /// its first name).
    pub side_nodes: usize,
    #[serde(rename = "branch_hits")]
    pub lane_hits: usize,
    pub tokens: usize,
    /// Measured draft forward, verifier forward and round trip (ms; speculative modes).
    pub draft_ms: f64,
    pub verify_ms: f64,
    pub net_ms: f64,
    /// The edge's own work per verdict outside draft forwards (see `Measured::verdict_ms`).
    pub verdict_ms: f64,
    /// The link's mean round trip: a block's mean time from send to verdict less the verifier's
    /// mean forward (meaningful for synchronous rows, where no block waits behind another).
    pub link_rtt_ms: f64,
    /// The analytic model's ITL from this run's own measurements, and the relative error.
    pub predicted_itl_ms: Option<f64>,
    pub model_error: Option<f64>,
    /// Every prompt's output equals the cloud-only (target) output.
    pub same_as_target: Option<bool>,
    /// Under each prompt's JSON schema (a structured-output row), and the drafted tokens its
    /// grammar forced (drafted without a draft forward).
    pub schema: bool,
    pub forced_tokens: usize,
    /// A workload's rows (`--workload`): which prompts ("copy" or "fresh"), and whether the edge
    /// copied from the session's text and the verifier drafted for itself.
    pub workload: String,
    pub suffix: bool,
    pub self_draft: bool,
    /// The edge's copies: proposed, judged by the committed text, right.
    pub copied: tandem_edge::drafter::CopyStats,
    /// Committed tokens by source: drafted tokens the target accepted (the model's and the
    /// copies), the verifier's own guesses it accepted, and the rest of the verifier's own
    /// (first tokens, corrections, bonuses, decoded tokens).
    pub accepted_draft_tokens: usize,
    pub verifier_guessed: usize,
    pub cloud_tokens: usize,
    /// The verifier's guesses over the row, from its metrics: fed, accepted.
    pub verifier_guesses: (u64, u64),
    /// Tokens the verifier told as decoded (its own guesses included).
    pub cloud_decoded: usize,
}

/// Per draft and RTT: async against the best sync.
#[derive(Debug, Clone, Serialize)]
pub struct Verdict {
    pub draft: String,
    pub rtt_ms: f64,
    pub best_sync_gamma: usize,
    pub best_sync_itl_ms: f64,
    pub async_itl_ms: f64,
    pub auto_itl_ms: f64,
    /// The async-tree row's ITL (0 without one).
    pub tree_itl_ms: f64,
    /// Async (planned) ITL over the best sync ITL.
    pub async_over_sync: f64,
    pub edge_only_itl_ms: f64,
    pub cloud_only_itl_ms: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct LatencyReport {
    pub tokens: usize,
    pub prompts: usize,
    pub jitter_frac: f64,
    pub edge_cpus: String,
    pub cloud_cpus: String,
    /// Per draft: the costs measured at the first RTT, from which async's γ / depth were planned.
    pub calibration: Vec<(String, Costs)>,
    pub rows: Vec<Row>,
    /// The cloud-only (target) output of each prompt, against which every other row was checked.
    pub target_outputs: Vec<Vec<u32>>,
    pub summary: Vec<Verdict>,
    /// llama.cpp on the same files, 1 thread (decode tok/s, chunk forward ms), when installed.
    pub peer: Option<Value>,
    /// The analytic model with llama.cpp's forward times and the calibration's α: where the same
    /// protocol would land on a faster engine.
    pub peer_model: Vec<PeerModel>,
}

#[derive(Debug, Clone, Serialize)]
pub struct PeerModel {
    pub draft: String,
    pub rtt_ms: f64,
    pub edge_only_itl_ms: f64,
    pub cloud_only_itl_ms: f64,
    pub best_sync_itl_ms: f64,
    pub best_async_itl_ms: f64,
}

/// Least-squares `fixed + slope · k` through llama.cpp's chunk times.
fn fit_chunks(chunk_ms: &Value) -> Option<(f64, f64)> {
    let pts: Vec<(f64, f64)> = chunk_ms
        .as_object()?
        .iter()
        .filter_map(|(k, v)| Some((k.parse::<f64>().ok()?, v.as_f64()?)))
        .collect();
    let n = pts.len() as f64;
    if pts.len() < 2 {
        return None;
    }
    let (mx, my) = (
        pts.iter().map(|p| p.0).sum::<f64>() / n,
        pts.iter().map(|p| p.1).sum::<f64>() / n,
    );
    let sxx: f64 = pts.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let sxy: f64 = pts.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let slope = (sxy / sxx).max(0.0);
    Some((my - slope * mx, slope))
}

fn peer_model(
    peer: &Value,
    calibration: &[(String, Costs)],
    rtts: &[f64],
    max_gamma: usize,
    max_depth: usize,
) -> Vec<PeerModel> {
    let mut out = Vec::new();
    let target = &peer["target f32"];
    let (Some(t_tok_s), Some((v0, v1))) = (
        target["decode_tok_s"].as_f64(),
        fit_chunks(&target["chunk_ms"]),
    ) else {
        return out;
    };
    for (name, c) in calibration {
        let Some(d_tok_s) = peer[name]["decode_tok_s"].as_f64() else {
            continue;
        };
        for &rtt in rtts {
            let costs = Costs {
                alpha: c.alpha,
                draft_ms: 1e3 / d_tok_s,
                verify_ms: v0,
                verify_ms_per_token: v1,
                rtt_ms: rtt + c.rtt_ms,
                verdict_ms: c.verdict_ms,
            };
            let sync = (1..=max_gamma)
                .map(|g| never_idle::itl_ms(&costs, g, 1))
                .fold(f64::MAX, f64::min);
            let (g, d) = plan_pipelined(&costs, max_gamma, max_depth);
            out.push(PeerModel {
                draft: name.clone(),
                rtt_ms: rtt,
                edge_only_itl_ms: round2(1e3 / d_tok_s),
                cloud_only_itl_ms: round2(1e3 / t_tok_s),
                best_sync_itl_ms: round2(sync),
                best_async_itl_ms: round2(never_idle::itl_ms(&costs, g, d)),
            });
        }
    }
    out
}

/// Several prompts' outputs of one mode, folded into a row.
fn fold(draft: &str, rtt: f64, mode: Mode, outs: &[GenOutput], want: &[Vec<u32>]) -> Row {
    let n = outs.len().max(1) as f64;
    let mean = |f: &dyn Fn(&GenOutput) -> f64| outs.iter().map(f).sum::<f64>() / n;
    // The mean gap over all prompts weighs each prompt by its gaps; p50 is the prompts' mean p50
    // and p99 the worst prompt's.
    let gaps: f64 = outs
        .iter()
        .map(|o| o.output_ids.len().saturating_sub(1) as f64)
        .sum();
    let itl_mean = if gaps > 0.0 {
        outs.iter()
            .map(|o| o.itl_ms.mean * o.output_ids.len().saturating_sub(1) as f64)
            .sum::<f64>()
            / gaps
    } else {
        0.0
    };
    let spec = |f: &dyn Fn(&tandem_client::speculate::SpecFields) -> f64| {
        mean(&|o: &GenOutput| o.spec.as_ref().map_or(0.0, f))
    };
    let first = outs.first().and_then(|o| o.spec.as_ref());
    Row {
        draft: draft.to_string(),
        rtt_ms: rtt,
        mode,
        temperature: 0.0,
        rule: first.map_or("-".into(), |s| s.verify_rule.clone()),
        gamma: first.map_or(0, |s| s.gamma),
        depth: first.map_or(0, |s| s.depth),
        ttft_ms: round2(mean(&|o| o.ttft_ms)),
        itl_ms: Summary {
            mean: round2(itl_mean),
            p50: round2(mean(&|o| o.itl_ms.p50)),
            p99: round2(outs.iter().map(|o| o.itl_ms.p99).fold(0.0, f64::max)),
        },
        acceptance_rate: round2(spec(&|s| s.acceptance_rate)),
        tree_acceptance_rate: round2(spec(&|s| s.tree_acceptance_rate)),
        side_nodes: outs
            .iter()
            .filter_map(|o| o.spec.as_ref().map(|s| s.side_nodes))
            .sum(),
        lane_hits: outs
            .iter()
            .filter_map(|o| o.spec.as_ref().map(|s| s.lane_hits))
            .sum(),
        mean_accepted: round2(spec(&|s| s.mean_accepted)),
        wasted_draft_tokens: outs
            .iter()
            .filter_map(|o| o.spec.as_ref().map(|s| s.wasted_draft_tokens))
            .sum(),
        drafted: outs
            .iter()
            .filter_map(|o| o.spec.as_ref().map(|s| s.drafted))
            .sum(),
        tokens: outs.iter().map(|o| o.output_ids.len()).sum(),
        draft_ms: round2(spec(&|s| s.measured.draft_ms)),
        verify_ms: round2(spec(&|s| s.measured.verify_ms)),
        net_ms: round2(spec(&|s| s.measured.net_ms)),
        verdict_ms: round2(spec(&|s| s.measured.verdict_ms)),
        link_rtt_ms: round2(spec(&|s| {
            (s.measured.block_round_trip_ms - s.measured.verify_ms).max(0.0)
        })),
        predicted_itl_ms: None,
        model_error: None,
        same_as_target: (!want.is_empty())
            .then(|| outs.iter().zip(want).all(|(o, w)| &o.output_ids == w)),
        schema: false,
        forced_tokens: outs
            .iter()
            .filter_map(|o| o.spec.as_ref().map(|s| s.forced_tokens))
            .sum(),
        workload: String::new(),
        suffix: false,
        self_draft: false,
        copied: outs
            .iter()
            .filter_map(|o| o.spec.as_ref().map(|s| s.copied))
            .fold(Default::default(), |a, c| tandem_edge::drafter::CopyStats {
                copied: a.copied + c.copied,
                judged: a.judged + c.judged,
                right: a.right + c.right,
            }),
        accepted_draft_tokens: outs
            .iter()
            .filter_map(|o| o.spec.as_ref().map(|s| s.accepted_draft_tokens))
            .sum(),
        verifier_guessed: outs
            .iter()
            .filter_map(|o| o.spec.as_ref().map(|s| s.verifier_guessed))
            .sum(),
        cloud_tokens: outs
            .iter()
            .map(|o| {
                o.spec
                    .as_ref()
                    .map_or(o.output_ids.len(), |s| s.cloud_tokens)
            })
            .sum(),
        verifier_guesses: (0, 0),
        cloud_decoded: outs
            .iter()
            .map(|o| {
                o.spec
                    .as_ref()
                    .map_or(o.output_ids.len(), |s| s.measured.cloud_decoded)
            })
            .sum(),
    }
}

/// One prompt of a structured-output workload.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct StructuredPrompt {
    pub prompt: String,
    pub schema: Value,
}

/// The structured-output workload (`--structured`): at each RTT, cloud-only and async
/// speculation with the edge's default adaptive shape, each prompt under its schema and free.
fn structured(
    a: &LatencyArgs,
    path: &Path,
    target: &Arc<LlamaModel>,
    tok: &Tokenizer,
    drafts: &[Draft],
    mut progress: impl FnMut(&Row),
) -> Result<LatencyReport> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("--structured {}", path.display()))?;
    let work: Vec<StructuredPrompt> = serde_json::from_str(&text).with_context(|| {
        format!(
            "--structured {}: a list of {{prompt, schema}}",
            path.display()
        )
    })?;
    if work.is_empty() {
        bail!("--structured {}: no prompts", path.display());
    }
    let prompts: Vec<Vec<u32>> = work
        .iter()
        .map(|w| tok.encode_chat(&w.prompt))
        .collect::<Result<_, _>>()?;
    let schemas: Vec<tandem_spec::GrammarSource> = work
        .iter()
        .map(|w| tandem_spec::GrammarSource::JsonSchema(w.schema.to_string()))
        .collect();
    // The verifier as shipped: adaptive grants, its own takeovers.
    let cloud = CloudProcess::start(&a.home, &a.cloud_cpus, &a.cloud_flags(&[]))?;
    let mut link = Link::new()?;
    let mut rows: Vec<Row> = Vec::new();
    let mut want_all: Vec<Vec<u32>> = Vec::new();
    for &rtt in &a.rtts {
        let url = link.set(&cloud.addr, rtt, rtt * a.jitter_frac)?;
        for schema in [false, true] {
            let grammar = |i: usize| schema.then(|| &schemas[i]);
            let outs = prompts
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    tandem_client::generate::generate_remote_with(
                        tandem_edge::grpc::Remote::plain(&url),
                        tok,
                        p,
                        a.tokens,
                        &SamplingParams::default(),
                        tandem_edge::grpc::GenerateOptions {
                            grammar: grammar(i),
                            self_draft: false,
                        },
                        |_| {},
                    )
                })
                .collect::<Result<Vec<_>>>()?;
            let want: Vec<Vec<u32>> = outs.iter().map(|o| o.output_ids.clone()).collect();
            let mut r = fold("-", rtt, Mode::CloudOnly, &outs, &want);
            r.schema = schema;
            progress(&r);
            rows.push(r);
            for d in drafts {
                let auto = AutoShape {
                    max_draft_len: a.max_gamma,
                    max_depth: a.max_depth,
                    prior: tandem_spec::edge::default_prior(rtt),
                };
                let outs = sampled_runs(
                    a,
                    (target, d, tok, url.as_str(), &prompts[..]),
                    (4, 2, Some(auto), LINEAR),
                    VerifyRule::Greedy,
                    SamplingParams::default(),
                    schema.then_some(&schemas[..]),
                )?;
                let mut r = fold(&d.name, rtt, Mode::AsyncAuto, &outs, &want);
                r.schema = schema;
                progress(&r);
                rows.push(r);
            }
            if schema && want_all.is_empty() {
                want_all = want;
            }
        }
    }
    drop(link);
    drop(cloud);
    Ok(LatencyReport {
        peer_model: Vec::new(),
        tokens: a.tokens,
        prompts: prompts.len(),
        jitter_frac: a.jitter_frac,
        edge_cpus: a.edge_cpus.to_string(),
        cloud_cpus: a.cloud_cpus.to_string(),
        calibration: Vec::new(),
        rows,
        target_outputs: want_all,
        summary: Vec::new(),
        peer: None,
    })
}

/// The model's ITL for `r`, over sessions as long as the row's (`prompts` outputs of `r.tokens`
/// tokens in all; each one's first token comes from the prefill): the row's α and draft time,
/// the emulated round trip `rtt_ms`, and for the verifier's forward the cloud-only ITL measured
/// at this RTT (`decode_ms`: what one forward of this session costs the verifier). The row's own
/// verify and network times are not the model's inputs under protocol 2: a block's verdict comes
/// whenever the verifier reaches it, not a round trip after it was sent.
///
/// Trees enter as the linear draft that commits as many tokens per run ([`lane_alpha`]: a miss a
/// lane covered is a hit), with the share of misses the row's lanes covered; what they cost is
/// in the row's draft time.
fn predict(r: &mut Row, rtt_ms: f64, decode_ms: f64, prompts: usize) {
    let a = r.acceptance_rate;
    let cover = if a < 1.0 {
        ((r.tree_acceptance_rate - a) / (1.0 - a)).clamp(0.0, 1.0)
    } else {
        0.0
    };
    let c = Costs {
        alpha: lane_alpha(a, cover),
        draft_ms: r.draft_ms,
        verify_ms: decode_ms,
        verify_ms_per_token: 0.0,
        rtt_ms,
        verdict_ms: r.verdict_ms,
    };
    let gaps = (r.tokens / prompts.max(1)).saturating_sub(1);
    let p = never_idle::session_itl_ms(&c, r.gamma, r.depth, gaps);
    r.predicted_itl_ms = Some(round2(p));
    r.model_error = Some(round2((r.itl_ms.mean - p) / p * 100.0) / 100.0);
}

/// Costs pooled over the sync sweep at one RTT: α and draft time averaged, verify time fitted as
/// `fixed + per_token · (γ + 1)`.
fn calibrate(rows: &[&Row]) -> Costs {
    let n = rows.len().max(1) as f64;
    let alpha = rows.iter().map(|r| r.acceptance_rate).sum::<f64>() / n;
    let draft_ms = rows.iter().map(|r| r.draft_ms).sum::<f64>() / n;
    let rtt_ms = rows.iter().map(|r| r.net_ms).sum::<f64>() / n;
    let verdict_ms = rows.iter().map(|r| r.verdict_ms).sum::<f64>() / n;
    let xs: Vec<f64> = rows.iter().map(|r| (r.gamma + 1) as f64).collect();
    let ys: Vec<f64> = rows.iter().map(|r| r.verify_ms).collect();
    let (mx, my) = (xs.iter().sum::<f64>() / n, ys.iter().sum::<f64>() / n);
    let sxx: f64 = xs.iter().map(|x| (x - mx) * (x - mx)).sum();
    let sxy: f64 = xs.iter().zip(&ys).map(|(x, y)| (x - mx) * (y - my)).sum();
    let slope = if sxx > 0.0 { (sxy / sxx).max(0.0) } else { 0.0 };
    Costs {
        alpha,
        draft_ms,
        verify_ms: my - slope * mx,
        verify_ms_per_token: slope,
        rtt_ms,
        verdict_ms,
    }
}

#[allow(clippy::too_many_arguments)]
fn spec_runs(
    a: &LatencyArgs,
    target: &Arc<LlamaModel>,
    d: &Draft,
    tok: &Tokenizer,
    url: &str,
    prompts: &[Vec<u32>],
    gamma: usize,
    depth: usize,
    auto: Option<AutoShape>,
    tree: TreeConfig,
) -> Result<Vec<GenOutput>> {
    sampled_runs(
        a,
        (target, d, tok, url, prompts),
        (gamma, depth, auto, tree),
        VerifyRule::Greedy,
        SamplingParams::default(),
        None,
    )
}

/// Who and what a run speaks to: the target, the draft, the tokenizer, the verifier's URL and
/// the prompts.
type Party<'a> = (
    &'a Arc<LlamaModel>,
    &'a Draft,
    &'a Tokenizer,
    &'a str,
    &'a [Vec<u32>],
);

/// [`spec_runs`] under a verify rule and sampling parameters: (γ, depth, policy, tree).
fn sampled_runs(
    a: &LatencyArgs,
    party: Party<'_>,
    shape: (usize, usize, Option<AutoShape>, TreeConfig),
    rule: VerifyRule,
    params: SamplingParams,
    grammars: Option<&[tandem_spec::GrammarSource]>,
) -> Result<Vec<GenOutput>> {
    sourced_runs(a, party, shape, rule, params, grammars, Sources::DEFAULT)
}

/// Where a run's drafts come from besides the draft model: the edge's copies from the session's
/// text (`suffix`) and the verifier's own (`self_draft`).
#[derive(Debug, Clone, Copy)]
struct Sources {
    suffix: bool,
    self_draft: bool,
}

impl Sources {
    /// The edge's defaults (`--suffix on --self-draft on`).
    const DEFAULT: Sources = Sources {
        suffix: true,
        self_draft: true,
    };
}

/// [`sampled_runs`] with the drafts' `sources`.
fn sourced_runs(
    a: &LatencyArgs,
    (target, d, tok, url, prompts): Party<'_>,
    (gamma, depth, auto, tree): (usize, usize, Option<AutoShape>, TreeConfig),
    rule: VerifyRule,
    params: SamplingParams,
    grammars: Option<&[tandem_spec::GrammarSource]>,
    sources: Sources,
) -> Result<Vec<GenOutput>> {
    let edge = EngineConfig {
        threads: a.edge_cpus.len().max(1),
        cpus: a.edge_cpus,
        ..EngineConfig::default()
    };
    let mut run = SpecRun {
        target: target.clone(),
        draft: d.model.clone(),
        tokenizer: tok,
        // The verifier is the other process; this engine setting is unused with `cloud_url`.
        cloud: edge,
        edge,
        spec: SpecConfig {
            session: tandem_spec::edge::SessionConfig {
                draft_len: gamma,
                depth,
                max_new_tokens: a.tokens,
                auto,
                tree,
            },
            rule,
            params,
            q_top_k: 32,
            self_draft: sources.self_draft,
            suffix: sources.suffix,
        },
        rtt_ms: 0.0,
        jitter_ms: 0.0,
        cloud_url: Some(url.to_string()),
        api_key: None,
        tls_ca: None,
        grammar: None,
    };
    prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            run.grammar = grammars.map(|g| g[i].clone());
            tandem_client::speculate::run(&run, p, |_| {})
        })
        .collect()
}

/// Run the whole benchmark. `progress` hears about each finished row.
pub fn run(
    a: &LatencyArgs,
    target: &Arc<LlamaModel>,
    tok: &Tokenizer,
    drafts: &[Draft],
    mut progress: impl FnMut(&Row),
) -> Result<LatencyReport> {
    a.validate()?;
    if let Some(path) = &a.structured {
        return structured(a, path, target, tok, drafts, progress);
    }
    if let Some(path) = &a.workload {
        return copy::workload(a, path, target, tok, drafts, progress);
    }
    let prompts: Vec<Vec<u32>> = a
        .prompts
        .iter()
        .map(|p| match a.plain {
            true => tok.encode(p),
            false => tok.encode_chat(p),
        })
        .collect::<Result<_, _>>()?;
    let cloud = CloudProcess::start(
        &a.home,
        &a.cloud_cpus,
        // Each mode measured as such: the verifier neither shrinks grants nor takes over.
        &a.cloud_flags(&[
            "--max-draft-len",
            &a.max_gamma.to_string(),
            "--max-depth",
            &a.max_depth.to_string(),
            "--fixed-grants",
        ]),
    )?;
    let mut link = Link::new()?;
    let mut rows: Vec<Row> = Vec::new();
    let mut emit = |r: Row, rows: &mut Vec<Row>| {
        progress(&r);
        rows.push(r);
    };
    let edge_cfg = EngineConfig {
        threads: a.edge_cpus.len().max(1),
        cpus: a.edge_cpus,
        ..EngineConfig::default()
    };
    // Edge-only: the draft alone, no network.
    for d in drafts {
        let mut e = Engine::new(d.model.clone(), edge_cfg)?;
        let outs = prompts
            .iter()
            .map(|p| generate(&mut e, tok, p, a.tokens, &SamplingParams::default(), |_| {}))
            .collect::<Result<Vec<_>>>()?;
        emit(fold(&d.name, 0.0, Mode::EdgeOnly, &outs, &[]), &mut rows);
    }
    let mut want: Vec<Vec<u32>> = Vec::new();
    let mut calibration: Vec<(String, Costs)> = Vec::new();
    for &rtt in &a.rtts {
        let url = link.set(&cloud.addr, rtt, rtt * a.jitter_frac)?;
        let outs = prompts
            .iter()
            .map(|p| {
                generate_remote(
                    tandem_edge::grpc::Remote::plain(&url),
                    tok,
                    p,
                    a.tokens,
                    &SamplingParams::default(),
                    |_| {},
                )
            })
            .collect::<Result<Vec<_>>>()?;
        if want.is_empty() {
            want = outs.iter().map(|o| o.output_ids.clone()).collect();
        }
        let cloud_only = fold("-", rtt, Mode::CloudOnly, &outs, &want);
        let decode_ms = cloud_only.itl_ms.mean;
        emit(cloud_only, &mut rows);
        for d in drafts {
            let mut sync_rows = Vec::new();
            for &g in &a.sync_gammas {
                let outs = spec_runs(a, target, d, tok, &url, &prompts, g, 1, None, LINEAR)?;
                let mut r = fold(&d.name, rtt, Mode::Sync, &outs, &want);
                predict(&mut r, rtt, decode_ms, prompts.len());
                sync_rows.push(r.clone());
                emit(r, &mut rows);
            }
            let costs = match calibration.iter().find(|c| c.0 == d.name) {
                Some(c) => c.1,
                None => {
                    let c = calibrate(&sync_rows.iter().collect::<Vec<_>>());
                    calibration.push((d.name.clone(), c));
                    c
                }
            };
            // Plan for this RTT from the calibration's α and draft time, the emulated round trip
            // and the verifier's forward as cloud-only measured it.
            let (gamma, depth) = plan_pipelined(
                &Costs {
                    rtt_ms: rtt,
                    verify_ms: decode_ms,
                    verify_ms_per_token: 0.0,
                    ..costs
                },
                a.max_gamma,
                a.max_depth,
            );
            let outs = spec_runs(
                a, target, d, tok, &url, &prompts, gamma, depth, None, LINEAR,
            )?;
            let mut r = fold(&d.name, rtt, Mode::Async, &outs, &want);
            predict(&mut r, rtt, decode_ms, prompts.len());
            emit(r, &mut rows);
            if let Some(tree) = a.tree.0 {
                let outs = spec_runs(a, target, d, tok, &url, &prompts, gamma, depth, None, tree)?;
                let mut r = fold(&d.name, rtt, Mode::AsyncTree, &outs, &want);
                predict(&mut r, rtt, decode_ms, prompts.len());
                emit(r, &mut rows);
            }
            let auto = AutoShape {
                max_draft_len: a.max_gamma,
                max_depth: a.max_depth,
                prior: tandem_spec::edge::default_prior(rtt),
            };
            let outs = spec_runs(a, target, d, tok, &url, &prompts, 4, 2, Some(auto), LINEAR)?;
            let mut r = fold(&d.name, rtt, Mode::AsyncAuto, &outs, &want);
            predict(&mut r, rtt, decode_ms, prompts.len());
            emit(r, &mut rows);
        }
        // Sampling: cloud-only at each temperature, then each rule at async's shape. Only
        // sample-and-match reproduces the target's own draws token for token (checked);
        // rejection sampling matches their distribution (tested in the suite, not here).
        for &t in &a.temperatures {
            let params = SamplingParams {
                temperature: t,
                top_k: 40,
                top_p: 0.95,
                seed: 7,
            };
            let outs = prompts
                .iter()
                .map(|p| {
                    generate_remote(
                        tandem_edge::grpc::Remote::plain(&url),
                        tok,
                        p,
                        a.tokens,
                        &params,
                        |_| {},
                    )
                })
                .collect::<Result<Vec<_>>>()?;
            let own: Vec<Vec<u32>> = outs.iter().map(|o| o.output_ids.clone()).collect();
            let mut r = fold("-", rtt, Mode::CloudOnly, &outs, &own);
            r.temperature = t;
            emit(r, &mut rows);
            for d in drafts {
                let Some(shape) = rows
                    .iter()
                    .find(|r| r.draft == d.name && r.rtt_ms == rtt && r.mode == Mode::Async)
                    .map(|r| (r.gamma, r.depth))
                else {
                    continue;
                };
                let party = (target, d, tok, url.as_str(), &prompts[..]);
                let cases = [
                    (Mode::Async, VerifyRule::SampleMatch, LINEAR),
                    (Mode::Async, VerifyRule::Rejection, LINEAR),
                ]
                .into_iter()
                .chain(a.tree.0.into_iter().flat_map(|tr| {
                    [VerifyRule::SampleMatch, VerifyRule::Rejection]
                        .map(|rule| (Mode::AsyncTree, rule, tr))
                }));
                for (mode, rule, tree) in cases {
                    let outs =
                        sampled_runs(a, party, (shape.0, shape.1, None, tree), rule, params, None)?;
                    let check: &[Vec<u32>] = if rule == VerifyRule::SampleMatch {
                        &own
                    } else {
                        &[]
                    };
                    let mut r = fold(&d.name, rtt, mode, &outs, check);
                    r.temperature = t;
                    let decode_ms = rows
                        .iter()
                        .find(|x| {
                            x.mode == Mode::CloudOnly && x.rtt_ms == rtt && x.temperature == t
                        })
                        .map_or(0.0, |x| x.itl_ms.mean);
                    predict(&mut r, rtt, decode_ms, prompts.len());
                    emit(r, &mut rows);
                }
            }
        }
    }
    drop(link);
    drop(cloud);
    let summary = summarize(&rows, drafts, &a.rtts);
    let peer = a.peer.as_ref().map(|(py, script)| {
        let mut v = serde_json::Map::new();
        let files = drafts
            .iter()
            .map(|d| (d.name.clone(), d.path.clone()))
            .chain(
                a.peer_target
                    .iter()
                    .map(|p| ("target f32".to_string(), p.clone())),
            );
        for (name, path) in files {
            v.insert(
                name,
                crate::engine_bench::peer_bench(py, script, &path, 1, &[1, 2, 3, 5, 7, 9], 32)
                    .unwrap_or(Value::Null),
            );
        }
        Value::Object(v)
    });
    let peer_model = peer.as_ref().map_or(Vec::new(), |p| {
        peer_model(p, &calibration, &a.rtts, a.max_gamma, a.max_depth)
    });
    Ok(LatencyReport {
        peer_model,
        tokens: a.tokens,
        prompts: prompts.len(),
        jitter_frac: a.jitter_frac,
        edge_cpus: a.edge_cpus.to_string(),
        cloud_cpus: a.cloud_cpus.to_string(),
        calibration,
        rows,
        target_outputs: want,
        summary,
        peer,
    })
}

/// The γ and depth (≥ 2: this row measures pipelining even where the policy would not pipeline)
/// with the lowest predicted async ITL.
fn plan_pipelined(c: &Costs, max_gamma: usize, max_depth: usize) -> (usize, usize) {
    let mut best = (f64::MAX, 1, 2);
    for g in 1..=max_gamma.max(1) {
        for d in 2..=max_depth.max(2) {
            let t = never_idle::itl_ms(c, g, d);
            if t < best.0 * (1.0 - 1e-9) {
                best = (t, g, d);
            }
        }
    }
    (best.1, best.2)
}

/// Where the peer's python and bench script are, if installed (and not turned off).
pub fn find_peer(python: Option<PathBuf>, script: Option<PathBuf>) -> Option<(PathBuf, PathBuf)> {
    let py = python.or_else(|| {
        std::env::var_os("HOME")
            .map(|h| PathBuf::from(h).join(".cache/tandem-peer/venv/bin/python"))
            .filter(|p| p.is_file())
    })?;
    let script = script
        .or_else(|| Some(PathBuf::from("../shared/peer/bench.py")).filter(|p| p.is_file()))?;
    Some((py, script))
}

/// Check a draft file exists and load it.
pub fn load_draft(name: &str, path: &Path) -> Result<Draft> {
    load_draft_in(name, path, tandem_engine::WeightMode::Native)
}

/// [`load_draft`] in weight mode `mode`.
pub fn load_draft_in(name: &str, path: &Path, mode: tandem_engine::WeightMode) -> Result<Draft> {
    let mut g = tandem_engine::GgufFile::open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    let model =
        LlamaModel::load(&mut g, mode).with_context(|| format!("loading {}", path.display()))?;
    Ok(Draft {
        name: name.to_string(),
        path: path.to_path_buf(),
        model: Arc::new(model),
    })
}

#[cfg(test)]
mod tests;
