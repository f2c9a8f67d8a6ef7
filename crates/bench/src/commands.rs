//! `tandem bench …`: the flags of each benchmark and how it is run (the binary parses them and
//! calls [`run`]), and the flags they share: where the report goes ([`ReportArgs`]), the cores
//! ([`Cores`]), llama.cpp beside Tandem ([`PeerArgs`]).

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use std::path::PathBuf;
use tandem_engine::{CpuSet, WeightMode};
use tandem_models::store::{self as models, ModelSpec};
use tandem_quant::{Method, QuantConfig, Scheme};

use crate::engine_bench::{self as bench, BenchArgs};

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
        BenchCmd::Serve(a) => cmd_serve_bench(home, a),
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
    /// `tandem serve` under 1, 4 and 16 concurrent API clients streaming over HTTP (requests/s,
    /// TTFT, ITL), beside one session driven in-process without HTTP and cloud-only streaming,
    /// on the same link and cores.
    Serve(ServeBenchCliArgs),
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

#[derive(Args)]
pub struct SoakBenchArgs {
    #[arg(long, default_value_t = 64)]
    sessions: usize,
    #[arg(long, default_value_t = 10.0)]
    minutes: f64,
    /// Tokens per answer.
    #[arg(long, default_value_t = 48)]
    tokens: usize,
    /// Acceptance rate of the synthetic drafts.
    #[arg(long, default_value_t = 0.7)]
    alpha: f64,
    /// No hostile clients beside the sessions.
    #[arg(long)]
    no_hostile: bool,
    /// Draw memory and throughput over time into this PNG.
    #[arg(long)]
    png: Option<PathBuf>,
    #[command(flatten)]
    cores: Cores,
    #[command(flatten)]
    report: ReportArgs,
}

pub fn cmd_soak_bench(home: &std::path::Path, a: SoakBenchArgs) -> Result<()> {
    if !(a.minutes.is_finite() && a.minutes > 0.0) || a.sessions == 0 || a.tokens < 2 {
        bail!("--minutes must be above 0, --sessions at least 1, --tokens at least 2");
    }
    if !(0.0..=1.0).contains(&a.alpha) {
        bail!("--alpha must be within [0, 1], got {}", a.alpha);
    }
    let (_, cloud_cpus) = a.cores.split();
    let args = crate::soak::SoakArgs {
        home: home.to_path_buf(),
        sessions: a.sessions,
        minutes: a.minutes,
        tokens: a.tokens,
        alpha: a.alpha,
        hostile: !a.no_hostile,
        cloud_cpus,
        png: a.png,
    };
    a.report.run(
        |progress| crate::soak::run(&args, progress),
        crate::soak::table,
    )
}

#[derive(Args)]
pub struct HostileBenchArgs {
    /// The attacks, in order (an unattacked row always comes first).
    #[arg(long, value_delimiter = ',', value_enum, default_values_t = crate::hostile::ALL)]
    attacks: Vec<crate::hostile::Attack>,
    /// Seconds the victim is measured under each attack.
    #[arg(long, default_value_t = 20.0)]
    seconds: f64,
    /// Tokens per victim answer.
    #[arg(long, default_value_t = 48)]
    victim_tokens: u32,
    #[command(flatten)]
    cores: Cores,
    #[command(flatten)]
    report: ReportArgs,
}

pub fn cmd_hostile_bench(home: &std::path::Path, a: HostileBenchArgs) -> Result<()> {
    if !(a.seconds.is_finite() && a.seconds >= 1.0) {
        bail!("--seconds must be at least 1, got {}", a.seconds);
    }
    let (_, cloud_cpus) = a.cores.split();
    let args = crate::hostile::HostileArgs {
        home: home.to_path_buf(),
        attacks: a.attacks,
        seconds: a.seconds,
        victim_tokens: a.victim_tokens.max(1),
        cloud_cpus,
    };
    a.report.run(
        |progress| crate::hostile::run(&args, progress),
        crate::hostile::table,
    )
}

#[derive(Args)]
pub struct ServeBenchCliArgs {
    /// Concurrent API clients, one level each.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    clients: Vec<usize>,
    /// Requests each client sends, one after another.
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    #[arg(long, default_value_t = 48)]
    max_tokens: usize,
    /// Emulated round trip to the verifier, ms.
    #[arg(long, default_value_t = 50.0)]
    rtt_ms: f64,
    #[arg(long, default_value_t = 2)]
    gamma: usize,
    #[arg(long, default_value_t = 3)]
    depth: usize,
    /// Chat prompts (default: the load benchmark's four).
    #[arg(long)]
    prompt: Vec<String>,
    /// Keep every session speculating (the verifier's --fixed-grants: no takeovers), to measure
    /// speculation as such.
    #[arg(long)]
    fixed_grants: bool,
    #[command(flatten)]
    cores: Cores,
    #[command(flatten)]
    report: ReportArgs,
}

pub fn cmd_serve_bench(home: &std::path::Path, a: ServeBenchCliArgs) -> Result<()> {
    let (edge_cpus, cloud_cpus) = a.cores.split();
    let args = crate::serve_bench::ServeBenchArgs {
        home: home.to_path_buf(),
        clients: a.clients,
        rounds: a.rounds,
        max_tokens: a.max_tokens,
        rtt_ms: a.rtt_ms,
        gamma: a.gamma,
        depth: a.depth,
        prompts: if a.prompt.is_empty() {
            crate::load::default_prompts()
        } else {
            a.prompt
        },
        fixed_grants: a.fixed_grants,
        edge_cpus,
        cloud_cpus,
    };
    a.report.run(
        |progress| crate::serve_bench::run(&args, progress),
        crate::serve_bench::table,
    )
}

#[derive(Args)]
pub struct QuantBenchArgs {
    /// A minute or two (CI): three drafts that need no new quantization, 256 corpus tokens, short
    /// outputs.
    #[arg(long)]
    quick: bool,
    /// Corpus tokens scored for perplexity (default 4096; quick 256), in windows of --window.
    #[arg(long)]
    ppl_tokens: Option<usize>,
    #[arg(long, default_value_t = 512)]
    window: usize,
    /// Tokens of the target's continuation per prompt for α and E[A] (default 64; quick 16).
    #[arg(long)]
    alpha_tokens: Option<usize>,
    /// γ at which E[A] is reported.
    #[arg(long, default_value_t = 4)]
    gamma: usize,
    /// Round trip of the end-to-end run, ms.
    #[arg(long, default_value_t = 50.0)]
    rtt_ms: f64,
    /// Tokens per prompt of the end-to-end run (default 32; quick 8).
    #[arg(long)]
    e2e_tokens: Option<usize>,
    /// Skip the end-to-end run (no verifier process).
    #[arg(long)]
    no_e2e: bool,
    /// Layers the layer-skipping draft leaves out (default: 14 to 19).
    #[arg(long, value_delimiter = ',')]
    skip_layers: Option<Vec<usize>>,
    /// Only these drafts (names as in the table, e.g. w4a16-g32,w4a4-g32).
    #[arg(long, value_delimiter = ',')]
    drafts: Option<Vec<String>>,
    #[command(flatten)]
    cores: Cores,
    #[command(flatten)]
    report: ReportArgs,
}

#[derive(Args)]
pub struct PaperBenchArgs {
    /// A few minutes (CI's smoke test): RTT 0 and 50, 1 and 4 sessions, the 4-bit draft, short
    /// outputs and windows. Without it the full run takes about 18 minutes on 2 cores.
    #[arg(long)]
    quick: bool,
    /// Folder for results.json, results.md and the plots.
    #[arg(long, default_value = "bench-paper")]
    out: PathBuf,
    /// Round trips of the one-session sweep, ms (default 0,20,50,100,200; quick: 0,50).
    #[arg(long, value_delimiter = ',')]
    rtts: Option<Vec<f64>>,
    /// Session counts of the load sweep (default 1,4,16,64; quick: 1,4).
    #[arg(long, value_delimiter = ',')]
    sessions: Option<Vec<usize>>,
    /// Round trips at which the load sweep is measured (the simulator covers every --rtts too).
    #[arg(long, value_delimiter = ',', default_value = "50")]
    load_rtts: Vec<f64>,
    /// Draft schemes (groups of 32) (default w4a16,w8a16; quick: w4a16). The first one's α and
    /// speed drive the synthetic edges of the load sweep.
    #[arg(long, value_delimiter = ',')]
    drafts: Option<Vec<DraftChoice>>,
    /// Jitter per direction, as a percentage of the RTT.
    #[arg(long, default_value_t = 10.0)]
    jitter_pct: f64,
    /// Tokens per prompt and per session (default 48; quick: 16).
    #[arg(long)]
    tokens: Option<usize>,
    /// Seconds measured per load row, after the warm-up (default 30 and 20; quick: 6 and 2).
    #[arg(long)]
    duration: Option<f64>,
    #[arg(long)]
    warmup: Option<f64>,
    /// Token trees for the async-tree rows (LANES:BELOW[:MIN], or none).
    #[arg(long, default_value = "2:0.5", value_parser = crate::latency::parse_tree)]
    tree: crate::latency::TreeArg,
    #[command(flatten)]
    cores: Cores,
    #[command(flatten)]
    peer: PeerArgs,
    /// Print results.json instead of results.md.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct LoadBenchArgs {
    #[command(flatten)]
    load: crate::load::LoadArgs,
    #[command(flatten)]
    cores: Cores,
    #[command(flatten)]
    report: ReportArgs,
}

#[derive(Args)]
pub struct LatencyBenchArgs {
    #[command(flatten)]
    latency: crate::latency::LatencyArgs,
    /// Drafts: quantization schemes of the target (w4a16, w8a16, w3a16, w2a16), groups of 32,
    /// rounded to nearest or, with `-gptq` (e.g. w4a16-gptq), calibrated by GPTQ.
    #[arg(long, value_delimiter = ',', default_value = "w4a16,w8a16")]
    drafts: Vec<DraftChoice>,
    #[command(flatten)]
    cores: Cores,
    #[command(flatten)]
    peer: PeerArgs,
    #[command(flatten)]
    report: ReportArgs,
}

#[derive(Args)]
pub struct EngineBenchArgs {
    #[command(flatten)]
    bench: BenchArgs,
    #[command(flatten)]
    peer: PeerArgs,
    #[command(flatten)]
    report: ReportArgs,
}

pub fn cmd_bench(home: &std::path::Path, a: EngineBenchArgs) -> Result<()> {
    a.bench.validate()?;
    let target = models::load(home, &ModelSpec::Target, None, a.report.json)?;
    let draft = models::load(home, &ModelSpec::Draft, None, a.report.json)?;
    let peer = a.peer.find();
    let target_f32 = peer
        .as_ref()
        .map(|_| models::ensure_f32_copy(home))
        .transpose()?;
    let (peer_python, peer_script) = peer.unzip();
    let args = BenchArgs {
        peer_python,
        peer_script,
        ..a.bench
    };

    // The draft as the edge runs it, and with the other activations beside it (f32 beside
    // 8-bit, or 8-bit where the edge keeps f32).
    let other_mode = match draft.model.mode {
        WeightMode::W4A8 => WeightMode::Native,
        _ => WeightMode::W4A8,
    };
    let other = models::load(home, &ModelSpec::Draft, Some(other_mode), true)?;
    let r = bench::run(
        (&target.model, &target.path),
        (&draft.model, &draft.path),
        Some(&other.model),
        target_f32.as_deref(),
        &args,
    )?;
    let first = &r.runs[0];
    let v = serde_json::json!({
        "threads": first.threads,
        "kernels": first.kernels,
        "draft_path": draft.path,
        "draft_decode_tok_s": first.draft.decode_tok_s,
        "target_decode_tok_s": first.target.decode_tok_s,
        "draft_other_decode_tok_s": first.draft_other.as_ref().map(|m| m.decode_tok_s),
        "verify_chunk_ms": { "target": first.target.chunk_ms, "draft": first.draft.chunk_ms },
        "batch_throughput_tok_s": first.target.batch_tok_s,
        "bandwidth_gbs": r.copy_bandwidth_gbs,
        "runs": r.runs,
    });
    report(&v, a.report.out.as_deref(), a.report.json, |_| {
        bench::table(&r)
    })
}

pub fn cmd_load(home: &std::path::Path, a: LoadBenchArgs) -> Result<()> {
    use crate::load;
    let target = models::load(home, &ModelSpec::Target, None, a.report.json)?;
    let two = [
        DraftChoice::rtn(Scheme::W4A16),
        DraftChoice::rtn(Scheme::W8A16),
    ];
    let drafts: Vec<_> = drafts_of(home, &two, a.report.json)?
        .into_iter()
        .map(|d| (d.name, d.model))
        .collect();
    let (edge_cpus, cloud_cpus) = a.cores.split();
    let prompts = if a.load.prompts.is_empty() {
        load::default_prompts()
    } else {
        a.load.prompts.clone()
    };
    let args = load::LoadArgs {
        home: home.to_path_buf(),
        prompts,
        edge_cpus,
        cloud_cpus,
        ..a.load
    };
    let quiet = a.report.json;
    let r = load::run(&args, &target.model, &target.tokenizer, &drafts, |row| {
        if !quiet {
            eprintln!(
                "{} N={} α={:?}: {:.1} tok/s, ITL p50 {:.1} p99 {:.1} ms, batch {:.1}, {} sessions, {} wrong",
                row.mode,
                row.sessions,
                row.alpha,
                row.throughput_tok_s,
                row.itl_ms.p50,
                row.itl_ms.p99,
                row.mean_batch_sessions,
                row.sessions_run,
                row.mismatches + row.failures
            );
        }
    })?;
    report(&r, a.report.out.as_deref(), a.report.json, load::table)
}

/// A draft a benchmark runs: a quantization scheme of the target and how its weights were put
/// on the grid (`w4a16`, `w4a16-gptq`, ...).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DraftChoice {
    scheme: Scheme,
    method: Method,
}

impl DraftChoice {
    const fn rtn(scheme: Scheme) -> Self {
        Self {
            scheme,
            method: Method::Rtn,
        }
    }
}

impl std::str::FromStr for DraftChoice {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let (scheme, method) = match s.strip_suffix("-gptq") {
            Some(scheme) => (scheme, Method::Gptq),
            None => (s, Method::Rtn),
        };
        Ok(Self {
            scheme: scheme.parse()?,
            method,
        })
    }
}

/// The drafts made from the target by these schemes (groups of 32), made on first use.
pub fn drafts_of(
    home: &std::path::Path,
    choices: &[DraftChoice],
    quiet: bool,
) -> Result<Vec<crate::latency::Draft>> {
    choices
        .iter()
        .map(|c| {
            let cfg = QuantConfig {
                scheme: c.scheme,
                method: c.method,
                ..QuantConfig::default()
            };
            cfg.validate()?;
            let path = models::ensure_quantized(home, &cfg, quiet)?;
            let name = match c.method {
                Method::Rtn => format!("{}-g32", c.scheme.name()),
                m => format!("{}-g32-{}", c.scheme.name(), m.name()),
            };
            crate::latency::load_draft(&name, &path)
        })
        .collect()
}

pub fn cmd_quant(home: &std::path::Path, a: QuantBenchArgs) -> Result<()> {
    use crate::quant_study::{self, QuantStudyArgs};
    let q = a.quick;
    let target = models::load(home, &ModelSpec::Target, None, a.report.json)?;
    let (edge_cpus, cloud_cpus) = a.cores.split();
    let skip_layers = a
        .skip_layers
        .clone()
        .unwrap_or(quant_study::SKIPPED_LAYERS.to_vec());
    let all = quant_study::variants();
    let names: Vec<String> = all.iter().map(|v| v.name(skip_layers.len())).collect();
    if let Some(bad) = a.drafts.iter().flatten().find(|d| !names.contains(d)) {
        bail!(
            "--drafts: no draft `{bad}` in the study (there are {})",
            names.join(", ")
        );
    }
    let variants: Vec<_> = all
        .into_iter()
        .zip(&names)
        .filter(|(v, n)| match &a.drafts {
            Some(d) => d.contains(n),
            // Quick: only drafts made from the RTN W4A16 file (no calibration run).
            None => {
                !q || (v.scheme == Scheme::W4A16
                    && v.group == 32
                    && v.method == tandem_quant::Method::Rtn)
            }
        })
        .map(|(v, _)| v)
        .collect();
    let mut e2e_prompts = crate::latency::default_prompts();
    let mut alpha_prompts = crate::load::default_prompts();
    if q {
        e2e_prompts.truncate(1);
        alpha_prompts.truncate(1);
    }
    let latency = (!a.no_e2e).then(|| crate::latency::LatencyArgs {
        home: home.to_path_buf(),
        rtts: vec![a.rtt_ms],
        jitter_frac: 0.1,
        tokens: a.e2e_tokens.unwrap_or(if q { 8 } else { 32 }),
        prompts: e2e_prompts,
        sync_gammas: if q { vec![2] } else { vec![1, 2, 3] },
        max_gamma: 8,
        max_depth: 4,
        // bench quant compares drafts on linear blocks.
        tree: crate::latency::TreeArg(None),
        temperatures: Vec::new(),
        edge_cpus,
        cloud_cpus,
        peer: None,
        peer_target: None,
    });
    let args = QuantStudyArgs {
        home: home.to_path_buf(),
        variants,
        skip_layers,
        ppl_tokens: a.ppl_tokens.unwrap_or(if q { 256 } else { 4096 }),
        window: a.window,
        alpha_prompts,
        alpha_tokens: a.alpha_tokens.unwrap_or(if q { 16 } else { 64 }),
        gamma: a.gamma.max(1),
        latency,
        edge_cpus,
        quiet: a.report.json,
    };
    let quiet = a.report.json;
    let r = quant_study::run(&args, &target.model, &target.tokenizer, |m| {
        if !quiet {
            eprintln!("{m}");
        }
    })?;
    report(
        &r,
        a.report.out.as_deref(),
        a.report.json,
        quant_study::table,
    )
}

pub fn cmd_paper(home: &std::path::Path, a: PaperBenchArgs) -> Result<()> {
    use crate::{latency, load, paper};
    let q = a.quick;
    let target = models::load(home, &ModelSpec::Target, None, a.json)?;
    let schemes = a.drafts.clone().unwrap_or(if q {
        vec![DraftChoice::rtn(Scheme::W4A16)]
    } else {
        vec![
            DraftChoice::rtn(Scheme::W4A16),
            DraftChoice::rtn(Scheme::W8A16),
        ]
    });
    let drafts = drafts_of(home, &schemes, a.json)?;
    let (edge_cpus, cloud_cpus) = a.cores.split();
    let peer = if q { None } else { a.peer.find() };
    let peer_target = peer
        .as_ref()
        .map(|_| models::ensure_f32_copy(home))
        .transpose()?;
    let tokens = a.tokens.unwrap_or(if q { 16 } else { 48 });
    let jitter_frac = a.jitter_pct / 100.0;
    let mut prompts = latency::default_prompts();
    if q {
        prompts.truncate(1);
    }
    let lat = latency::LatencyArgs {
        home: home.to_path_buf(),
        rtts: a.rtts.clone().unwrap_or(if q {
            vec![0.0, 50.0]
        } else {
            vec![0.0, 20.0, 50.0, 100.0, 200.0]
        }),
        jitter_frac,
        tokens,
        prompts,
        sync_gammas: if q { vec![2] } else { vec![1, 2, 3, 4] },
        max_gamma: 8,
        max_depth: 4,
        tree: a.tree,
        temperatures: Vec::new(),
        edge_cpus,
        cloud_cpus,
        peer,
        peer_target,
    };
    let ld = load::LoadArgs {
        home: home.to_path_buf(),
        sessions: a
            .sessions
            .clone()
            .unwrap_or(if q { vec![1, 4] } else { vec![1, 4, 16, 64] }),
        alphas: Vec::new(),
        rtt_ms: 0.0,
        jitter_frac,
        draft_ms: 0.0,
        duration_s: a.duration.unwrap_or(if q { 6.0 } else { 30.0 }),
        warmup_s: a.warmup.unwrap_or(if q { 2.0 } else { 20.0 }),
        gamma: 4,
        depths: if q { vec![2] } else { vec![1, 2] },
        max_new: tokens,
        prompts: load::default_prompts(),
        token_budget: tandem_verifier::VerifierConfig::default().token_budget,
        kv_budget_mb: 2048,
        cloud_only: true,
        // Tree rows beside the async ones (not in the quick run).
        tree: if q {
            crate::latency::TreeArg(None)
        } else {
            a.tree
        },
        cover: 0.6,
        edge_cpus,
        cloud_cpus,
        saturation_tokens: None,
    };
    let args = paper::PaperArgs {
        out_dir: a.out.clone(),
        quick: q,
        latency: lat,
        load: ld,
        load_rtts: a.load_rtts.clone(),
        command: std::env::args().collect::<Vec<_>>().join(" "),
    };
    let quiet = a.json;
    let r = paper::run(&args, &target.model, &target.tokenizer, &drafts, |m| {
        if !quiet {
            eprintln!("{m}");
        }
    })?;
    if a.json {
        println!("{}", serde_json::to_string(&r)?);
    } else {
        print!("{}", paper::markdown(&r));
        eprintln!(
            "wrote results.json, results.md and {} plots into {} ({:.0} s)",
            r.plots.len(),
            a.out.display(),
            r.wall_s
        );
    }
    let failed: Vec<&str> = r
        .sanity
        .iter()
        .filter(|c| !c.ok)
        .map(|c| c.check.as_str())
        .collect();
    if !failed.is_empty() {
        bail!("sanity checks failed: {}", failed.join("; "));
    }
    Ok(())
}

pub fn cmd_latency(home: &std::path::Path, a: LatencyBenchArgs) -> Result<()> {
    use crate::latency;
    let target = models::load(home, &ModelSpec::Target, None, a.report.json)?;
    let drafts = drafts_of(home, &a.drafts, a.report.json)?;
    let (edge_cpus, cloud_cpus) = a.cores.split();
    let peer = a.peer.find();
    let peer_target = peer
        .as_ref()
        .map(|_| models::ensure_f32_copy(home))
        .transpose()?;
    let prompts = if a.latency.prompts.is_empty() {
        latency::default_prompts()
    } else {
        a.latency.prompts.clone()
    };
    let args = latency::LatencyArgs {
        home: home.to_path_buf(),
        prompts,
        edge_cpus,
        cloud_cpus,
        peer,
        peer_target,
        ..a.latency
    };
    let quiet = a.report.json;
    let r = latency::run(&args, &target.model, &target.tokenizer, &drafts, |row| {
        if !quiet {
            eprintln!(
                "{} rtt {} {} γ{} d{}: itl {:.1} ms, α {:.2}",
                row.draft,
                row.rtt_ms,
                row.mode,
                row.gamma,
                row.depth,
                row.itl_ms.mean,
                row.acceptance_rate
            );
        }
    })?;
    report(&r, a.report.out.as_deref(), a.report.json, latency::table)
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
