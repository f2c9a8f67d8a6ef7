//! The service benchmarks' flags and runners: `bench serve`, `bench hostile`, `bench soak`.

use anyhow::{bail, Context, Result};
use clap::Args;
use tandem_models::store::ModelSpec;

use super::*;

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
    /// Real edges: a `tandem serve` process and --sessions API clients sending it conversations,
    /// JSON-schema answers and answers that copy from their prompt, each checked (instead of
    /// synthetic edges speaking gRPC).
    #[arg(long)]
    serve: bool,
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
    let (edge_cpus, cloud_cpus) = a.cores.split();
    let args = crate::soak::SoakArgs {
        serve: a.serve,
        edge_cpus,
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
    /// Who attacks: tandem (the project's own client) or grpcio (an independent one written
    /// from the protocol, scripts/hostile_grpcio.py; scripts/grpc-deps installs it).
    #[arg(long, default_value = "tandem", value_parser = ["tandem", "grpcio"])]
    attacker: String,
    /// The Python that runs the grpcio attacker (default: what scripts/grpc-deps prints).
    #[arg(long)]
    attacker_python: Option<PathBuf>,
    /// A flag for the verifier (`tandem cloud serve`), e.g. --cloud-arg=--quiet-ms=0 to measure
    /// without quiet sessions going to the background; repeat for several.
    #[arg(long, allow_hyphen_values = true)]
    cloud_arg: Vec<String>,
    #[command(flatten)]
    cores: Cores,
    #[command(flatten)]
    report: ReportArgs,
}

/// The Python with grpcio that `scripts/grpc-deps` installs (it says where).
fn grpc_python() -> Result<PathBuf> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/grpc-deps");
    let out = std::process::Command::new(script)
        .output()
        .with_context(|| format!("running {script}"))?;
    if !out.status.success() {
        bail!(
            "{script} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("GRPC_PYTHON="))
        .map(PathBuf::from)
        .with_context(|| format!("{script} did not say GRPC_PYTHON=…"))
}

pub fn cmd_hostile_bench(home: &std::path::Path, a: HostileBenchArgs) -> Result<()> {
    if !(a.seconds.is_finite() && a.seconds >= 1.0) {
        bail!("--seconds must be at least 1, got {}", a.seconds);
    }
    let (_, cloud_cpus) = a.cores.split();
    let attacker = match (a.attacker.as_str(), a.attacker_python) {
        ("grpcio", Some(python)) => crate::hostile::Attacker::Grpcio { python },
        ("grpcio", None) => crate::hostile::Attacker::Grpcio {
            python: grpc_python()?,
        },
        _ => crate::hostile::Attacker::Tandem,
    };
    let args = crate::hostile::HostileArgs {
        home: home.to_path_buf(),
        attacker,
        cloud_args: a.cloud_arg,
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
    /// Cloud-only and tandem serve this many times at each number of clients, the two in turn
    /// first; the table adds each ratio's median (least–greatest) over them.
    #[arg(long, default_value_t = 1)]
    repeats: usize,
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
    /// The edge's draft, as `tandem serve --model` takes it: `draft` (the default, W4A16 by
    /// GPTQ, made on first use), a catalog model's `NAME-draft`, or a GGUF path (e.g. the W8A16
    /// file `tandem quantize --scheme w8a16` writes). The target is the draft's catalog model's.
    #[arg(long, default_value = "draft")]
    draft: ModelSpec,
    /// The draft's weight handling, as `generate --weights` takes it: native (its blocks, f32
    /// activations) or w4a8 (8-bit activations and integer dot products). Default: as `tandem
    /// serve` runs the draft (w4a8: 8-bit activations).
    #[arg(long)]
    draft_weights: Option<tandem_engine::WeightMode>,
    /// Keep every session speculating (the verifier's --fixed-grants: no takeovers), to measure
    /// speculation as such.
    #[arg(long)]
    fixed_grants: bool,
    /// A flag for the verifier (`tandem cloud serve`), e.g. --cloud-arg=--forward-cost=1,100 to
    /// have it decode every session itself; repeat for several.
    #[arg(long, allow_hyphen_values = true)]
    cloud_arg: Vec<String>,
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
        repeats: a.repeats,
        max_tokens: a.max_tokens,
        rtt_ms: a.rtt_ms,
        gamma: a.gamma,
        depth: a.depth,
        prompts: if a.prompt.is_empty() {
            crate::load::default_prompts()
        } else {
            a.prompt
        },
        draft_weights: a.draft_weights.unwrap_or_else(|| a.draft.draft_mode()),
        draft: a.draft,
        fixed_grants: a.fixed_grants,
        cloud_args: a.cloud_arg,
        edge_cpus,
        cloud_cpus,
    };
    a.report.run(
        |progress| crate::serve_bench::run(&args, progress),
        crate::serve_bench::table,
    )
}

#[derive(Args)]
pub struct ChatBenchCliArgs {
    /// Concurrent conversations, one level each.
    #[arg(long, value_delimiter = ',', default_value = "1,16")]
    users: Vec<usize>,
    /// Turns of each conversation (12: about 1,500 tokens of history by the last).
    #[arg(long, default_value_t = 12)]
    turns: usize,
    /// Tokens per answer at most.
    #[arg(long, default_value_t = 96)]
    max_tokens: usize,
    /// Emulated round trip to the verifier, ms.
    #[arg(long, default_value_t = 50.0)]
    rtt_ms: f64,
    /// The prefix caches (the verifier's and the edge's together): on, off, or on,off (a
    /// verifier process each).
    #[arg(long, value_delimiter = ',', default_value = "on,off")]
    cache: Vec<OnOff>,
    #[arg(long, default_value_t = 2)]
    gamma: usize,
    #[arg(long, default_value_t = 3)]
    depth: usize,
    #[command(flatten)]
    cores: Cores,
    #[command(flatten)]
    report: ReportArgs,
}

/// A switch given as `on` or `off`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OnOff {
    On,
    Off,
}

pub fn cmd_chat_bench(home: &std::path::Path, a: ChatBenchCliArgs) -> Result<()> {
    let (edge_cpus, cloud_cpus) = a.cores.split();
    let args = crate::chat_bench::ChatBenchArgs {
        home: home.to_path_buf(),
        users: a.users,
        turns: a.turns,
        max_tokens: a.max_tokens,
        rtt_ms: a.rtt_ms,
        cache: a.cache.iter().map(|c| *c == OnOff::On).collect(),
        gamma: a.gamma,
        depth: a.depth,
        edge_cpus,
        cloud_cpus,
    };
    a.report.run(
        |progress| crate::chat_bench::run(&args, progress),
        crate::chat_bench::table,
    )
}
