//! `tandem generate`, `tandem demo` and `tandem netem`: their flags and how they run (the binary
//! parses them and calls [`cmd_generate`], [`cmd_demo`], [`cmd_netem`]).

use std::io::Write;

use anyhow::{bail, Context, Result};
use clap::Args;
use tandem_engine::{CpuSet, Engine, EngineConfig, WeightMode};
use tandem_models::store::{self as models, ModelSpec};
use tandem_spec::sampling::SamplingParams;
use tandem_spec::VerifyRule;

use tandem_edge::commands::{read_tls_ca, ShapeArgs};
use tandem_models::EngineArgs;

use crate::generate::generate;
use crate::Mode;

#[derive(Args)]
pub struct GenerateArgs {
    /// local: run --model alone; edge: the draft alone; cloud: the target alone; sync / async:
    /// speculation, the draft here and the target in an in-process verifier behind --rtt-ms.
    #[arg(long, default_value = "local")]
    pub mode: Mode,
    /// A model of the catalog (smollm2-135m, gemma3-270m, qwen2.5-coder-1.5b, qwen2.5-coder-0.5b:
    /// the f32 target; NAME-draft: its draft, a W4A16 requantization or, for
    /// qwen2.5-coder-1.5b, the 0.5B; `target`, `draft`: SmolLM2's) or a GGUF path. Local mode
    /// runs it; edge, sync and async run its draft (a target's own, or the draft or path named).
    #[arg(long, default_value = "target")]
    pub model: ModelSpec,
    /// The target of sync/async, and the model whose tokenizer cloud mode speaks (default: the
    /// target of --model's family; SmolLM2 for a path). Its tokenizer must be the draft's.
    #[arg(long)]
    pub target: Option<ModelSpec>,
    /// Draft tokens per block (γ), sync/async.
    #[arg(long, default_value_t = 4)]
    pub gamma: usize,
    /// Blocks in flight (async; sync is 1).
    #[arg(long, default_value_t = 3)]
    pub depth: usize,
    /// Emulated network round trip between edge and verifier, ms.
    #[arg(long, default_value_t = 0.0)]
    pub rtt_ms: f64,
    /// Jitter of the emulated link, ± ms per direction (at most half the RTT).
    #[arg(long, default_value_t = 0.0)]
    pub jitter_ms: f64,
    #[command(flatten)]
    pub shape: ShapeArgs,
    /// Threads of the verifier's engine (sync/async).
    #[arg(long, default_value_t = 1)]
    pub cloud_threads: usize,
    /// Pin the in-process verifier's threads to these cores (sync/async; --cpus pins the edge's).
    #[arg(long)]
    pub cloud_cpus: Option<CpuSet>,
    /// A running verifier (`tandem cloud serve`), e.g. http://127.0.0.1:50051: sync and async verify
    /// there, cloud generates there (the `Generate` RPC). Without it, sync and async start a gRPC
    /// verifier in this process on a loopback port, and cloud runs the target here. Either way
    /// --rtt-ms puts an emulated link in front (sync/async).
    #[arg(long)]
    pub cloud: Option<String>,
    /// The tenant's API key for --cloud (a verifier started with --tenants needs one).
    #[arg(long, env = "TANDEM_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// For --cloud https://…: the certificate authority (PEM file) that signed the verifier's
    /// certificate. Default: the public web PKI's roots.
    #[arg(long)]
    pub tls_ca: Option<std::path::PathBuf>,
    /// Weight handling: f32, f16, native (W4A16/W8A16 blocks) or w4a8 (8-bit activations).
    /// Default: f32 for `target`; the draft of edge-only, sync and async as `tandem serve` runs
    /// it (w4a8: 8-bit activations); native otherwise.
    #[arg(long)]
    pub weights: Option<WeightMode>,
    #[arg(long)]
    pub prompt: String,
    /// Wrap the prompt in the model's chat template as a user message.
    #[arg(long)]
    pub chat: bool,
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// 0 keeps every token.
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Print one JSON object on one line instead of streaming text.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub engine: EngineArgs,
}

pub fn cmd_generate(home: &std::path::Path, a: GenerateArgs) -> Result<()> {
    let params = SamplingParams {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        seed: a.seed,
    };
    if let Err(e) = params.validate() {
        bail!("invalid sampling parameters: {e}");
    }
    if a.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    let tls_ca = read_tls_ca(a.tls_ca.as_deref())?;
    let spec = match a.mode {
        Mode::Local => a.model.clone(),
        Mode::EdgeOnly | Mode::Sync | Mode::Async => a.model.draft(),
        // Cloud-only tokenizes with the target sync and async would verify with (a draft given
        // by path speaks its --target's tokens, not the default model's).
        Mode::CloudOnly => a.target.clone().unwrap_or_else(|| a.model.target()),
        // Rows of the benchmarks, not modes of this command (clap never parses them).
        Mode::AsyncAuto | Mode::AsyncTree => a.model.target(),
    };
    let as_draft = matches!(a.mode, Mode::EdgeOnly | Mode::Sync | Mode::Async);
    let mode = a.weights.or(as_draft.then(|| spec.draft_mode()));
    let m = models::load(home, &spec, mode, a.json)?;
    let ids = if a.chat {
        m.tokenizer.encode_chat(&a.prompt)?
    } else {
        m.tokenizer.encode(&a.prompt)?
    };
    let mut stdout = std::io::stdout();
    let mut print = |piece: &str| {
        if !a.json {
            let _ = stdout.write_all(piece.as_bytes());
            let _ = stdout.flush();
        }
    };
    let mut out = if matches!(a.mode, Mode::Sync | Mode::Async) {
        let target_spec = a.target.clone().unwrap_or_else(|| a.model.target());
        let target = models::load(home, &target_spec, None, a.json)?;
        if target.tokenizer.fingerprint() != m.tokenizer.fingerprint() {
            bail!(
                "the draft {spec}'s tokenizer {} differs from the target {target_spec}'s {}: they \
                 cannot share token ids",
                m.tokenizer.fingerprint(),
                target.tokenizer.fingerprint()
            );
        }
        let run = crate::speculate::SpecRun {
            target: target.model.clone(),
            draft: m.model.clone(),
            tokenizer: &m.tokenizer,
            cloud: EngineConfig {
                threads: a.cloud_threads,
                cpus: a.cloud_cpus.unwrap_or_default(),
                ..a.engine.config()
            },
            edge: EngineConfig {
                threads: a.engine.threads.unwrap_or(1),
                ..a.engine.config()
            },
            spec: tandem_edge::SpecConfig {
                session: if a.mode == Mode::Sync {
                    a.shape.session(a.gamma, 1, Some(1), a.max_tokens, a.rtt_ms)
                } else {
                    a.shape
                        .session(a.gamma, a.depth, None, a.max_tokens, a.rtt_ms)
                },
                rule: a.shape.verify.rule(),
                params,
                q_top_k: 32,
                self_draft: a.shape.self_draft,
                suffix: a.shape.suffix,
            },
            rtt_ms: a.rtt_ms,
            jitter_ms: a.jitter_ms,
            cloud_url: a.cloud.clone(),
            api_key: a.api_key.clone(),
            tls_ca: tls_ca.clone(),
            grammar: None,
        };
        crate::speculate::run(&run, &ids, &mut print)?
    } else if let (Mode::CloudOnly, Some(url)) = (a.mode, &a.cloud) {
        crate::generate::generate_remote_with(
            tandem_edge::grpc::Remote {
                url,
                api_key: a.api_key.as_deref(),
                tls_ca: tls_ca.as_deref(),
            },
            &m.tokenizer,
            &ids,
            a.max_tokens,
            &params,
            tandem_edge::grpc::GenerateOptions {
                grammar: None,
                self_draft: a.shape.self_draft,
            },
            &mut print,
        )?
    } else {
        let mut engine = Engine::new(m.model.clone(), a.engine.config())?;
        let mut o = generate(
            &mut engine,
            &m.tokenizer,
            &ids,
            a.max_tokens,
            &params,
            &mut print,
        )?;
        o.mode = match a.mode {
            Mode::EdgeOnly | Mode::CloudOnly => a.mode,
            _ => Mode::Local,
        };
        o
    };
    if out.model.is_empty() {
        out.model = m.path.display().to_string();
    }
    if a.json {
        println!("{}", serde_json::to_string(&out)?);
    } else {
        println!();
        eprintln!(
            "[{} tokens, {}: ttft {:.1} ms, itl mean {:.1} ms p50 {:.1} p99 {:.1}, {:.1} tok/s]",
            out.output_ids.len(),
            out.finish_reason,
            out.ttft_ms,
            out.itl_ms.mean,
            out.itl_ms.p50,
            out.itl_ms.p99,
            out.tokens_per_s
        );
    }
    Ok(())
}

#[derive(Args)]
pub struct DemoArgs {
    /// The model of the catalog to demonstrate (qwen2.5-coder-1.5b, smollm2-135m, gemma3-270m,
    /// qwen2.5-coder-0.5b): its target in the cloud, its draft on the edge. The default is the
    /// paper's regime, Qwen2.5-Coder 1.5B drafted for by its 0.5B sibling (1.6 GB to download,
    /// about 8 GB of memory with the target in f32); smollm2-135m is the small one (0.1 GB,
    /// under 1 GB), its target only 2–4× its draft's cost, where speculation is about even.
    #[arg(long, default_value = "qwen2.5-coder-1.5b")]
    pub model: ModelSpec,
    /// What to ask (default: the model's own demo question, a coding task for a code model).
    #[arg(long)]
    pub prompt: Option<String>,
    #[arg(long, default_value_t = 48)]
    pub max_tokens: usize,
    /// Emulated round trip between the edge and the verifier, ms.
    #[arg(long, default_value_t = 80.0)]
    pub rtt_ms: f64,
    /// Draft tokens per block (default: the model's, measured with `tandem demo --gamma`: 2 for
    /// a 4-bit copy of its target, α ≈ 0.7–0.9 on chat; 6 for Qwen2.5-Coder 0.5B drafting for
    /// the 1.5B, α ≈ 0.9 on code).
    #[arg(long)]
    pub gamma: Option<usize>,
    #[arg(long, default_value_t = 3)]
    pub depth: usize,
    /// Let the adaptive policy re-plan γ and depth from what it measures (α, the draft's and the
    /// verifier's times, the round trip), starting at --gamma.
    #[arg(long)]
    pub auto: bool,
    #[command(flatten)]
    pub engine: EngineArgs,
}

/// The longest block the demo's policy may plan (the verifier's default grant, `cloud serve
/// --max-draft-len`).
const DEMO_MAX_GAMMA: usize = 8;

pub fn cmd_demo(home: &std::path::Path, a: DemoArgs) -> Result<()> {
    let target = models::load(home, &a.model.target(), None, false)?;
    let draft_spec = a.model.draft();
    let draft = models::load(home, &draft_spec, Some(draft_spec.draft_mode()), false)?;
    let prompt = a
        .prompt
        .clone()
        .unwrap_or_else(|| a.model.demo_prompt().to_string());
    let gamma = a.gamma.unwrap_or_else(|| a.model.demo_gamma()).max(1);
    let ids = target.tokenizer.encode_chat(&prompt)?;
    let params = SamplingParams::default();
    println!("user: {prompt}\n");
    let mut rows = Vec::new();
    let one = EngineConfig {
        threads: 1,
        ..a.engine.config()
    };
    // The edge and the verifier each on a core of its own, when there are two.
    let (edge_cpus, cloud_cpus) = CpuSet::edge_and_cloud();
    let edge = EngineConfig {
        cpus: edge_cpus,
        ..one
    };
    let cloud = EngineConfig {
        cpus: cloud_cpus,
        ..one
    };
    // Speculation first, streamed: the draft here, the target behind an emulated link.
    for (mode, depth) in [(Mode::Async, a.depth), (Mode::Sync, 1)] {
        let run = crate::speculate::SpecRun {
            target: target.model.clone(),
            draft: draft.model.clone(),
            tokenizer: &draft.tokenizer,
            cloud,
            edge,
            spec: tandem_edge::SpecConfig {
                session: tandem_spec::edge::SessionConfig {
                    draft_len: gamma,
                    depth,
                    max_new_tokens: a.max_tokens,
                    auto: a.auto.then(|| tandem_spec::edge::AutoShape {
                        max_draft_len: DEMO_MAX_GAMMA.max(gamma),
                        max_depth: depth,
                        prior: tandem_spec::edge::default_prior(a.rtt_ms),
                    }),
                    tree: tandem_spec::TreeConfig::LINEAR,
                },
                rule: VerifyRule::Greedy,
                params,
                q_top_k: 32,
                self_draft: true,
                suffix: true,
            },
            rtt_ms: a.rtt_ms,
            jitter_ms: a.rtt_ms / 10.0,
            cloud_url: None,
            api_key: None,
            tls_ca: None,
            grammar: None,
        };
        let label = format!("assistant ({mode}, {} ms round trip): ", a.rtt_ms);
        print!("{label}");
        let mut live = crate::live::Live::stdout().at_column(label.chars().count());
        let out = crate::speculate::run_shown(&run, &ids, true, &mut |s| live.show(s))?;
        live.finish();
        println!();
        if !live.corrections.is_empty() {
            let list: Vec<String> = live
                .corrections
                .iter()
                .take(8)
                .map(|(d, t)| format!("{d:?}→{t:?}"))
                .collect();
            println!(
                "  {} corrections by the target (draft→target): {}{}",
                live.corrections.len(),
                list.join(", "),
                if live.corrections.len() > 8 {
                    ", …"
                } else {
                    ""
                }
            );
        }
        println!();
        rows.push((mode, out));
    }
    for (mode, spec, cfg) in [
        (Mode::CloudOnly, &target, cloud),
        (Mode::EdgeOnly, &draft, edge),
    ] {
        let mut engine = Engine::new(spec.model.clone(), cfg)?;
        let mut out = generate(
            &mut engine,
            &spec.tokenizer,
            &ids,
            a.max_tokens,
            &params,
            |_| {},
        )?;
        if mode == Mode::CloudOnly {
            // Every streamed token crosses the link once; the first waits for the request too.
            out.ttft_ms += a.rtt_ms;
        }
        rows.push((mode, out));
    }
    let want = rows
        .iter()
        .find(|r| r.0 == Mode::CloudOnly)
        .map(|r| r.1.output_ids.clone())
        .unwrap_or_default();
    println!("| mode | TTFT ms | ITL mean ms | tokens/s | α | E[A] | same tokens as the target |");
    println!("|---|---|---|---|---|---|---|");
    for (mode, o) in &rows {
        let (alpha, ea) = o.spec.as_ref().map_or(("-".into(), "-".into()), |s| {
            (
                format!("{:.2}", s.acceptance_rate),
                format!("{:.2}", s.mean_accepted),
            )
        });
        println!(
            "| {mode} | {:.0} | {:.1} | {:.1} | {alpha} | {ea} | {} |",
            o.ttft_ms,
            o.itl_ms.mean,
            o.tokens_per_s,
            if o.output_ids == want { "yes" } else { "no" }
        );
    }
    println!(
        "\n(one thread each for the edge (cpus {}) and the verifier (cpus {}); cloud-only includes one round trip in its TTFT)",
        if edge_cpus.is_empty() { "any".into() } else { edge_cpus.to_string() },
        if cloud_cpus.is_empty() { "any".into() } else { cloud_cpus.to_string() },
    );
    Ok(())
}

/// `tandem netem`: a link emulator in front of a verifier.
#[derive(Args)]
pub struct NetemArgs {
    #[arg(long)]
    pub listen: String,
    #[arg(long)]
    pub upstream: String,
    #[command(flatten)]
    pub link: crate::netem::NetemConfig,
}

pub fn cmd_netem(a: NetemArgs) -> Result<()> {
    let cfg = a.link;
    cfg.validate()
        .map_err(|e| anyhow::anyhow!("invalid netem setting: {e}"))?;
    let upstream: std::net::SocketAddr = a.upstream.parse().with_context(|| {
        format!(
            "--upstream {}: not an address like 127.0.0.1:50051",
            a.upstream
        )
    })?;
    let rt = crate::runtime()?;
    rt.block_on(async {
        let listener = tandem_proto::listen("--listen", &a.listen).await?;
        eprintln!(
            "netem {} -> {upstream}: rtt {} ms ± {} ms",
            listener.local_addr()?,
            cfg.rtt_ms,
            cfg.jitter_ms
        );
        tokio::select! {
            r = crate::netem::proxy(listener, upstream, cfg) => r?,
            _ = tokio::signal::ctrl_c() => {}
        }
        anyhow::Ok(())
    })
}
