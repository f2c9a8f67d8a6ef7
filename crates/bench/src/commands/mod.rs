//! `tandem bench …`: the flags of each benchmark and how it is run (the binary parses them and
//! calls [`run`]), and the flags they share: where the report goes ([`ReportArgs`]), the cores
//! ([`Cores`]), llama.cpp beside Tandem ([`PeerArgs`]).

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use std::path::PathBuf;
use tandem_engine::{CpuSet, WeightMode};
use tandem_models::store as models;
use tandem_quant::{Method, QuantConfig, Scheme};

mod service;
mod studies;

pub use service::*;
pub use studies::*;

/// `tandem bench [--netns …] <benchmark>`.
#[derive(Args)]
pub struct BenchTop {
    #[command(flatten)]
    pub net: NetArgs,
    #[command(subcommand)]
    pub cmd: BenchCmd,
}

/// Run `tandem bench …`: across network namespaces (entered before any thread starts, held to
/// the end) when asked.
pub fn run(home: &std::path::Path, b: BenchTop) -> Result<()> {
    let _net = b.net.enter()?;
    match b.cmd {
        BenchCmd::Engine(a) => cmd_bench(home, a),
        BenchCmd::Latency(a) => cmd_latency(home, a),
        BenchCmd::Load(a) => cmd_load(home, a),
        BenchCmd::Paper(a) => cmd_paper(home, a),
        BenchCmd::Quant(a) => cmd_quant(home, a),
        BenchCmd::Rules(a) => cmd_rules(home, a),
        BenchCmd::Serve(a) => cmd_serve_bench(home, a),
        BenchCmd::Chat(a) => cmd_chat_bench(home, a),
        BenchCmd::Hostile(a) => cmd_hostile_bench(home, a),
        BenchCmd::Soak(a) => cmd_soak_bench(home, a),
    }
}

/// Where the benchmark's edges and verifier talk: loopback through the project's proxy (delay,
/// jitter), or two network namespaces joined by veth.
#[derive(Args)]
pub struct NetArgs {
    /// Run the verifier in a network namespace and every edge and client in another, joined by a
    /// veth pair whose rate and loss the kernel applies (tbf, nftables), the round trip still
    /// from the project's proxy (root, iproute2 and nftables).
    #[arg(long)]
    netns: bool,
    #[command(flatten)]
    link: crate::netns::KernelLink,
}

impl NetArgs {
    /// Enter the namespaces (with --netns): the guard that deletes them.
    pub fn enter(&self) -> Result<Option<crate::netns::Netns>> {
        if !self.netns {
            if self.link != crate::netns::KernelLink::default() {
                bail!("--link-rate-kbit and --link-loss-pct shape the veth link: give --netns too");
            }
            return Ok(None);
        }
        let ns = crate::netns::enter(self.link)?;
        eprintln!("across network namespaces: {}", self.link.describe());
        Ok(Some(ns))
    }
}

#[derive(Subcommand)]
pub enum BenchCmd {
    /// Decode speed, verify-chunk latency and batch throughput of the target and the draft.
    Engine(EngineBenchArgs),
    /// TTFT / ITL / α / E[A] of edge-only, cloud-only, sync and async over emulated round trips,
    /// with the verifier in its own process on its own cores; the analytic model beside each.
    Latency(LatencyBenchArgs),
    /// One verifier, many edges: N synthetic edges (right with probability α, D ms per token)
    /// speaking the real protocol over an emulated link, beside N cloud-only clients; throughput,
    /// ITL, batch size and queue time per N and α, and the target's roofline.
    Load(LoadBenchArgs),
    /// The paper's comparison in one go: edge-only, cloud-only, sync and async over RTTs with real
    /// edges, the verifier under 1-64 sessions, the simulator and the model beside every
    /// measurement; writes results.json, results.md and PNG plots, and checks them.
    Paper(PaperBenchArgs),
    /// The drafts one could make from the target (W4A16 g32/64/128, W8A16, W3A16, W2A16, W4A4,
    /// W8A8, a layer-skipping draft): size, perplexity on a shipped English corpus, α and E[A]
    /// against the target, decode speed, and async ITL end to end.
    Quant(QuantBenchArgs),
    /// Verify rules when both models sample, at each temperature: the chance a position's draft
    /// token is committed under rejection sampling, coupled sample-and-match (the rule that makes
    /// a seeded answer reproducible) and sample-and-match on one uniform, on the target's own
    /// sampled continuations with the default draft (teacher-forced, no network).
    Rules(RulesBenchArgs),
    /// `tandem serve` under 1, 4 and 16 concurrent API clients streaming over HTTP (requests/s,
    /// TTFT, ITL), beside one session driven in-process without HTTP and cloud-only streaming,
    /// on the same link and cores.
    Serve(ServeBenchCliArgs),
    /// Conversations: N users each hold a multi-turn chat (the whole history sent each turn),
    /// through tandem serve and cloud-only, with the verifier's prefix cache on and off; time to
    /// first token, ITL and the cloud's prefill per turn.
    Chat(ChatBenchCliArgs),
    /// What hostile clients do to another tenant: a victim streams cloud-only answers while an
    /// attacker runs each attack in turn (oversized q, a flood of bad drafts, 1,100 idle
    /// sessions, 300 streams without Open, one-byte-a-second readers, frozen peers); the victim's
    /// largest gap and token rate against its unattacked rate in the same run.
    Hostile(HostileBenchArgs),
    /// One verifier under churn for minutes: N synthetic edges open session after session (each
    /// answer checked against the target's), hostile clients take turns beside them, and the
    /// verifier's memory and throughput are sampled every 10 s (a PNG with --png).
    Soak(SoakBenchArgs),
}

/// A draft a benchmark runs: a quantization scheme of the target and how its weights were put
/// on the grid (`w4a16`, `w4a16-gptq`, ...), with `-vK` a head over the K most frequent tokens
/// (`w4a16-gptq-v32768`); or `catalog`, the model's catalog draft as the edge runs it (another
/// model, pulled: Qwen2.5-Coder 0.5B for the 1.5B).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DraftChoice {
    Quantized {
        scheme: Scheme,
        method: Method,
        vocab: Option<usize>,
    },
    Catalog,
}

impl DraftChoice {
    const fn rtn(scheme: Scheme) -> Self {
        Self::Quantized {
            scheme,
            method: Method::Rtn,
            vocab: None,
        }
    }

    /// The drafts a benchmark of `model` runs unless told: its catalog draft where it has one
    /// (another model), else the 4- and 8-bit requantizations of its target.
    pub fn defaults_for(model: &tandem_models::pull::CatalogModel) -> Vec<DraftChoice> {
        match model.draft_model {
            Some(_) => vec![DraftChoice::Catalog],
            None => vec![
                DraftChoice::rtn(Scheme::W4A16),
                DraftChoice::rtn(Scheme::W8A16),
            ],
        }
    }
}

impl std::str::FromStr for DraftChoice {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        if s == "catalog" {
            return Ok(Self::Catalog);
        }
        let (s, vocab) = match s.rsplit_once("-v") {
            Some((rest, k)) if k.parse::<usize>().is_ok() => {
                (rest, Some(k.parse::<usize>().map_err(|e| e.to_string())?))
            }
            _ => (s, None),
        };
        let (scheme, method) = match s.strip_suffix("-gptq") {
            Some(scheme) => (scheme, Method::Gptq),
            None => (s, Method::Rtn),
        };
        Ok(Self::Quantized {
            scheme: scheme.parse()?,
            method,
            vocab,
        })
    }
}

/// Which model of the catalog a benchmark measures.
#[derive(Args)]
pub struct ModelArg {
    /// The model of the catalog (smollm2-135m, gemma3-270m, qwen2.5-coder-1.5b,
    /// qwen2.5-coder-0.5b): its f32 target and its drafts.
    #[arg(long, default_value = "smollm2-135m")]
    pub model: String,
}

impl ModelArg {
    pub fn catalog(&self) -> Result<&'static tandem_models::pull::CatalogModel> {
        tandem_models::pull::find(&self.model).ok_or_else(|| {
            anyhow::anyhow!(
                "--model {}: no model of the catalog ({})",
                self.model,
                tandem_models::pull::names()
            )
        })
    }
}

/// The drafts made from `model`'s target by these schemes (groups of 32), made on first use.
pub fn drafts_of(
    home: &std::path::Path,
    model: &'static tandem_models::pull::CatalogModel,
    choices: &[DraftChoice],
    quiet: bool,
) -> Result<Vec<crate::latency::Draft>> {
    choices
        .iter()
        .map(|c| {
            let (scheme, method, vocab) = match *c {
                DraftChoice::Catalog => {
                    let spec = tandem_models::store::ModelSpec::Named { model, draft: true };
                    if model.draft_model.is_none() {
                        bail!(
                            "--drafts catalog: {} has no catalog draft of its own (its drafts are requantizations: w4a16, w8a16, ...)",
                            model.name
                        );
                    }
                    let path = models::resolve_path(home, &spec, quiet)?;
                    let name = path
                        .file_stem()
                        .map(|s| s.to_string_lossy().into_owned())
                        .unwrap_or_default();
                    return crate::latency::load_draft_in(&name, &path, spec.draft_mode());
                }
                DraftChoice::Quantized {
                    scheme,
                    method,
                    vocab,
                } => (scheme, method, vocab),
            };
            let cfg = QuantConfig {
                scheme,
                method,
                draft_vocab: vocab,
                ..QuantConfig::default()
            };
            cfg.validate()?;
            let path = models::ensure_quantized_of(home, model, &cfg, quiet)?;
            let mut name = match method {
                Method::Rtn => format!("{}-g32", scheme.name()),
                m => format!("{}-g32-{}", scheme.name(), m.name()),
            };
            if let Some(k) = vocab {
                name.push_str(&format!("-v{k}"));
            }
            crate::latency::load_draft(&name, &path)
        })
        .collect()
}

/// Where a benchmark's report goes.
#[derive(Args)]
pub struct ReportArgs {
    /// Also write the JSON report to this file.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Print the JSON report instead of tables.
    #[arg(long)]
    pub json: bool,
}

impl ReportArgs {
    /// Run a benchmark that tells its progress in lines (on stderr, unless the report is
    /// JSON), then report what it returned.
    pub fn run<R: serde::Serialize>(
        &self,
        bench: impl FnOnce(&mut dyn FnMut(&str)) -> Result<R>,
        table: impl Fn(&R) -> String,
    ) -> Result<()> {
        let quiet = self.json;
        let r = bench(&mut |what| {
            if !quiet {
                eprintln!("{what}");
            }
        })?;
        report(&r, self.out.as_deref(), self.json, table)
    }
}

/// Where a benchmark's edge and verifier run.
#[derive(Args)]
pub struct Cores {
    /// The edge's cores, this process (default: the first core it may use; with one core, no
    /// pinning).
    #[arg(long)]
    pub edge_cpus: Option<CpuSet>,
    /// The verifier process's cores (default: the second core this process may use).
    #[arg(long)]
    pub cloud_cpus: Option<CpuSet>,
}

impl Cores {
    /// The edge's and the verifier's cores, defaults filled in.
    pub fn split(&self) -> (CpuSet, CpuSet) {
        let (edge, cloud) = CpuSet::edge_and_cloud();
        (
            self.edge_cpus.unwrap_or(edge),
            self.cloud_cpus.unwrap_or(cloud),
        )
    }
}

/// llama.cpp beside Tandem (`../shared/peer`), when installed.
#[derive(Args)]
pub struct PeerArgs {
    /// Python with llama-cpp-python (../shared/peer/setup.sh prints it); default: the peer venv if present.
    #[arg(long, env = "TANDEM_PEER_PYTHON")]
    pub peer_python: Option<PathBuf>,
    /// The peer's bench.py (default: ../shared/peer/bench.py if present).
    #[arg(long)]
    pub peer_script: Option<PathBuf>,
    /// Do not run llama.cpp beside Tandem even when it is installed.
    #[arg(long)]
    pub no_peer: bool,
}

impl PeerArgs {
    pub fn find(&self) -> Option<(PathBuf, PathBuf)> {
        crate::latency::find_peer(self.peer_python.clone(), self.peer_script.clone())
            .filter(|_| !self.no_peer)
    }
}

/// Write `r` as JSON to `out` (when given), and print it: JSON, or the `table` of it.
pub fn report<R: serde::Serialize>(
    r: &R,
    out: Option<&std::path::Path>,
    json: bool,
    table: impl Fn(&R) -> String,
) -> Result<()> {
    let text = serde_json::to_string(r)?;
    if let Some(p) = out {
        std::fs::write(p, &text).with_context(|| format!("writing {}", p.display()))?;
    }
    if json {
        println!("{text}");
    } else {
        print!("{}", table(r));
    }
    Ok(())
}
