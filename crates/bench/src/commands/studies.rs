//! The studies' flags and runners: `bench engine`, `bench latency`, `bench load`, `bench paper`
//! (its presets), `bench quant`.

use anyhow::{bail, Result};
use clap::Args;
use tandem_models::store::{self as models, ModelSpec};

use super::*;
use tandem_quant::Scheme;

use crate::engine_bench::{self as bench, BenchArgs};

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
    /// Tokens per prompt of the end-to-end run (default 32; quick 16).
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
    model: ModelArg,
    #[command(flatten)]
    report: ReportArgs,
}

#[derive(Args)]
pub struct RulesBenchArgs {
    #[arg(long, value_delimiter = ',', default_value = "0.3,0.8,1.2")]
    temperatures: Vec<f32>,
    /// Tokens of the target's sampled continuation per prompt.
    #[arg(long, default_value_t = 48)]
    tokens: usize,
    /// Seeds per position of the coupled rule's estimate.
    #[arg(long, default_value_t = 64)]
    seeds: u64,
    /// Engine threads (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
    #[command(flatten)]
    model: ModelArg,
    #[command(flatten)]
    report: ReportArgs,
}

pub fn cmd_rules(home: &std::path::Path, a: RulesBenchArgs) -> Result<()> {
    use crate::rules_study::{self, RulesArgs};
    let model = a.model.catalog()?;
    let quiet = a.report.json;
    let target = models::load(home, &ModelSpec::target_of(model), None, quiet)?;
    let draft_spec = ModelSpec::Named { model, draft: true };
    let draft = models::load(home, &draft_spec, None, quiet)?;
    let args = RulesArgs {
        temperatures: a.temperatures.clone(),
        prompts: crate::load::default_prompts(),
        tokens: a.tokens,
        seeds: a.seeds,
        // The edge's default (`tandem serve`, `generate`).
        q_top_k: 32,
        threads: a
            .threads
            .unwrap_or_else(|| tandem_engine::EngineConfig::default().threads),
    };
    let names = (
        ModelSpec::target_of(model).to_string(),
        draft_spec.to_string(),
    );
    a.report.run(
        |log| {
            rules_study::run(
                &args,
                (&target.model, &draft.model),
                (&names.0, &names.1),
                &target.tokenizer,
                log,
            )
        },
        rules_study::table,
    )
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
    /// Drafts: `catalog` (the model's catalog draft, another model, as the edge runs it) or
    /// quantization schemes of the target (w4a16, w8a16, w3a16, w2a16), groups of 32, rounded to
    /// nearest or, with `-gptq` (e.g. w4a16-gptq), calibrated by GPTQ. Default: `catalog` for a
    /// model that has one (qwen2.5-coder-1.5b), else w4a16,w8a16.
    #[arg(long, value_delimiter = ',')]
    drafts: Option<Vec<DraftChoice>>,
    #[command(flatten)]
    cores: Cores,
    #[command(flatten)]
    peer: PeerArgs,
    #[command(flatten)]
    model: ModelArg,
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
    model: ModelArg,
    #[command(flatten)]
    report: ReportArgs,
}

pub fn cmd_bench(home: &std::path::Path, a: EngineBenchArgs) -> Result<()> {
    a.bench.validate()?;
    let model = a.model.catalog()?;
    let spec = ModelSpec::target_of(model);
    let target = models::load(home, &spec, None, a.report.json)?;
    let draft = models::load(home, &spec.draft(), None, a.report.json)?;
    let peer = a.peer.find();
    let target_f32 = peer
        .as_ref()
        .map(|_| models::ensure_f32_copy_of(home, model))
        .transpose()?;
    let (peer_python, peer_script) = peer.unzip();
    let args = BenchArgs {
        peer_python,
        peer_script,
        ..a.bench
    };

    // The draft as the edge runs it, and with the other activations beside it (f32 beside
    // the edge's 8-bit ones; 8-bit beside a draft loaded with f32 ones).
    let other_mode = match draft.model.mode {
        WeightMode::W4A8 => WeightMode::Native,
        _ => WeightMode::W4A8,
    };
    let other = models::load(home, &spec.draft(), Some(other_mode), true)?;
    // The target's file in its own blocks (what `cloud serve --weights native` runs), unless
    // the file is f32 already.
    let native = Some(models::load(home, &spec, Some(WeightMode::Native), true)?)
        .filter(|n| n.model.format() != "f32");
    let r = bench::run(
        (&target.model, &target.path),
        native.as_ref().map(|n| &n.model),
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
        "target_native_decode_tok_s": first.target_native.as_ref().map(|m| m.decode_tok_s),
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
    let target = models::load(home, &ModelSpec::TARGET, None, a.report.json)?;
    let two = [
        DraftChoice::rtn(Scheme::W4A16),
        DraftChoice::rtn(Scheme::W8A16),
    ];
    let drafts: Vec<_> = drafts_of(home, &tandem_models::pull::SMOLLM2, &two, a.report.json)?
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

pub fn cmd_quant(home: &std::path::Path, a: QuantBenchArgs) -> Result<()> {
    use crate::quant_study::{self, QuantStudyArgs};
    let q = a.quick;
    let model = a.model.catalog()?;
    let target = models::load(home, &ModelSpec::target_of(model), None, a.report.json)?;
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
        model: model.name.to_string(),
        rtts: vec![a.rtt_ms],
        jitter_frac: 0.1,
        // Quick: 16, not fewer: the verifier, its prompt cached, would decode a shorter answer
        // whole while the draft still prefills, and no speculation would be measured.
        tokens: a.e2e_tokens.unwrap_or(if q { 16 } else { 32 }),
        prompts: e2e_prompts,
        plain: false,
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
        structured: None,
        workload: None,
    });
    let args = QuantStudyArgs {
        home: home.to_path_buf(),
        model,
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
    let target = models::load(home, &ModelSpec::TARGET, None, a.json)?;
    let schemes = a.drafts.clone().unwrap_or(if q {
        vec![DraftChoice::rtn(Scheme::W4A16)]
    } else {
        vec![
            DraftChoice::rtn(Scheme::W4A16),
            DraftChoice::rtn(Scheme::W8A16),
        ]
    });
    let drafts = drafts_of(home, &tandem_models::pull::SMOLLM2, &schemes, a.json)?;
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
        model: String::new(),
        rtts: a.rtts.clone().unwrap_or(if q {
            vec![0.0, 50.0]
        } else {
            vec![0.0, 20.0, 50.0, 100.0, 200.0]
        }),
        jitter_frac,
        tokens,
        prompts,
        plain: false,
        sync_gammas: if q { vec![2] } else { vec![1, 2, 3, 4] },
        max_gamma: 8,
        max_depth: 4,
        tree: a.tree,
        temperatures: Vec::new(),
        edge_cpus,
        cloud_cpus,
        peer,
        peer_target,
        structured: None,
        workload: None,
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
        self_drafts: vec![true],
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
    let model = a.model.catalog()?;
    let target = models::load(home, &ModelSpec::target_of(model), None, a.report.json)?;
    let choices = a
        .drafts
        .clone()
        .unwrap_or_else(|| DraftChoice::defaults_for(model));
    let drafts = drafts_of(home, model, &choices, a.report.json)?;
    let (edge_cpus, cloud_cpus) = a.cores.split();
    let peer = a.peer.find();
    let peer_target = peer
        .as_ref()
        .map(|_| models::ensure_f32_copy_of(home, model))
        .transpose()?;
    let prompts = if a.latency.prompts.is_empty() {
        latency::default_prompts()
    } else {
        a.latency.prompts.clone()
    };
    let args = latency::LatencyArgs {
        home: home.to_path_buf(),
        model: model.name.to_string(),
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
    let table = match args.workload {
        Some(_) => latency::copy_table,
        None => latency::table,
    };
    report(&r, a.report.out.as_deref(), a.report.json, table)
}
