//! `tandem bench engine`: single-stream decode, verify-chunk latency and ragged-batch throughput of
//! the target and the draft, the machine's copy bandwidth and the bandwidth limit per weight format;
//! llama.cpp beside them when its peer script is available. Prints a table and one JSON object.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde::Serialize;
use serde_json::Value;
use tandem_engine::kernels;
use tandem_engine::{Engine, EngineConfig, LlamaModel, SeqChunk, SeqId, Wanted};
use tandem_spec::sampling as sampler;

use tandem_sim::stats::round2;

/// What `bench engine` measures (its flags; the peer is set by the caller).
#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// Thread counts to measure, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    pub threads: Vec<usize>,
    #[arg(long, default_value_t = 48)]
    pub decode_tokens: usize,
    #[arg(long, value_delimiter = ',', default_value = "1,2,5,8,16")]
    pub chunks: Vec<usize>,
    #[arg(long = "batch", value_delimiter = ',', default_value = "1,2,4,8,16,32")]
    pub batch_sizes: Vec<usize>,
    /// Repetitions per measurement (the best is kept).
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Context lengths after which one token and a chunk of 32 are timed (a conversation's
    /// later turns: attention over the history).
    #[arg(long, value_delimiter = ',', default_value = "1000")]
    pub contexts: Vec<usize>,
    #[arg(skip)]
    pub peer_python: Option<PathBuf>,
    #[arg(skip)]
    pub peer_script: Option<PathBuf>,
}

impl BenchArgs {
    /// Refuse settings the benchmark cannot run, naming the flag.
    pub fn validate(&self) -> Result<()> {
        if self.threads.is_empty() || self.threads.contains(&0) {
            bail!("--threads: give one or more thread counts, each at least 1");
        }
        if self.chunks.contains(&0) || self.batch_sizes.contains(&0) {
            bail!("--chunks and --batch: sizes must be at least 1");
        }
        if self.repeats == 0 || self.decode_tokens == 0 {
            bail!("--repeats and --decode-tokens must be at least 1");
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct ModelBench {
    pub path: String,
    pub format: String,
    pub decode_tok_s: f64,
    /// Chunk size → ms for one forward of that many new tokens after a 40-token context.
    pub chunk_ms: BTreeMap<usize, f64>,
    /// Sessions → committed-position throughput (tokens/s) of one ragged forward of 5 tokens each.
    pub batch_tok_s: BTreeMap<usize, f64>,
    /// Context length → ms of a forward of one new token and of 32 after that many tokens.
    pub context_ms: BTreeMap<usize, [f64; 2]>,
    pub bytes_per_token: usize,
    pub bandwidth_limit_tok_s: f64,
    /// GFLOP/s of the matmul kernels on a cache-resident block of this model's layer format,
    /// 64 tokens at once, and the tokens/s that rate allows (the compute roofline of a batch).
    pub kernel_gflops: f64,
    pub compute_limit_tok_s: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct ThreadBench {
    pub threads: usize,
    /// The matmul path (`portable`, `avx2`, `avx512`).
    pub kernels: &'static str,
    /// GB/s of summing a 512 MiB buffer with this many threads: the ceiling of decoding.
    pub read_bandwidth_gbs: f64,
    pub target: ModelBench,
    /// The target's own file in its blocks against f32 activations (`cloud serve --weights
    /// native`), where that file is not f32.
    pub target_native: Option<ModelBench>,
    pub draft: ModelBench,
    /// The same draft file with the other activations (f32 beside the edge's 8-bit ones):
    /// decode and chunks.
    pub draft_other: Option<ModelBench>,
    /// llama.cpp on the same files (`null` when the peer is not installed).
    pub peer: Option<Value>,
}

#[derive(Debug, Clone, Serialize)]
pub struct EngineBench {
    pub copy_bandwidth_gbs: f64,
    pub runs: Vec<ThreadBench>,
}

/// GB/s of a large memcpy (bytes copied once per pass).
pub fn copy_bandwidth() -> f64 {
    let n = 256 << 20;
    let src = vec![1u8; n];
    let mut dst = vec![0u8; n];
    dst.copy_from_slice(&src);
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        dst.copy_from_slice(&src);
        std::hint::black_box(&dst);
        best = best.min(t.elapsed().as_secs_f64());
    }
    n as f64 / best / 1e9
}

/// GB/s of reading a 512 MiB buffer (an f32 sum) on `threads` threads.
pub fn read_bandwidth(threads: usize) -> f64 {
    use rayon::prelude::*;
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("invariant: a pool of a positive number of threads");
    let buf = vec![1f32; 128 << 20];
    let mut best = f64::MAX;
    for _ in 0..4 {
        let t = Instant::now();
        let s: f32 = pool.install(|| {
            buf.par_chunks(1 << 16)
                .map(|c| {
                    c.chunks_exact(16)
                        .fold([0f32; 16], |mut a, x| {
                            for l in 0..16 {
                                a[l] += x[l];
                            }
                            a
                        })
                        .iter()
                        .sum::<f32>()
                })
                .sum()
        });
        std::hint::black_box(s);
        best = best.min(t.elapsed().as_secs_f64());
    }
    (buf.len() * 4) as f64 / best / 1e9
}

/// GFLOP/s of the selected matmul kernels (the 8-bit-activation ones for a W4A8 model) on
/// `threads` threads: the first 1024 rows of the
/// model's first FFN up-projection (in this host's caches) times 64 tokens, best of 5. Enough
/// work per call (38 M multiply-adds for SmolLM2's 576 columns) that starting the threads does
/// not count.
pub fn kernel_gflops(model: &LlamaModel, threads: usize) -> f64 {
    let Some(up) = model.ffn_up(0) else {
        return 0.0;
    };
    let (rows, cols, n_tok, reps) = (1024.min(up.rows), up.cols, 64, 4);
    let a8 = up.a8().map(|w| w.first_rows(rows));
    let w = match (&a8, up.data()) {
        (None, Some(d)) => Some(d.first_rows(rows, cols)),
        _ => None,
    };
    let x: Vec<f32> = (0..n_tok * cols)
        .map(|i| sampler::uniform(3, i as u64, 1) as f32 - 0.5)
        .collect();
    let mut y = vec![0f32; n_tok * rows];
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("invariant: a pool of a positive number of threads");
    let mut best = f64::MAX;
    // The kernel the model runs: 8-bit activations (quantized once per call, as a forward
    // does) or f32 ones.
    let mul = |y: &mut [f32]| match &a8 {
        Some(w8) => {
            let xq = kernels::a8::Q8Acts::quantize(&x, cols);
            kernels::a8::matmul_a8(w8, &xq, y)
        }
        None => {
            let w = w
                .as_ref()
                .expect("invariant: a matrix keeps its rows or its repacking");
            kernels::matmul(w, rows, cols, &x, n_tok, y)
        }
    };
    pool.install(|| {
        mul(&mut y);
        for _ in 0..5 {
            let t = Instant::now();
            for _ in 0..reps {
                mul(&mut y);
            }
            best = best.min(t.elapsed().as_secs_f64());
        }
    });
    std::hint::black_box(&y);
    (2 * rows * cols * n_tok * reps) as f64 / best / 1e9
}

fn context(vocab: usize, seed: u64) -> Vec<u32> {
    (0..40)
        .map(|i| (sampler::uniform(seed, i, 5) * (vocab as f64 - 20.0)) as u32 + 17)
        .collect()
}

/// Decode, verify chunks and (with `batches`) ragged batches and the kernels' compute rate.
fn bench_model(
    model: &Arc<LlamaModel>,
    path: &Path,
    threads: usize,
    a: &BenchArgs,
    bw: f64,
    batches: bool,
) -> Result<ModelBench> {
    let cfg = EngineConfig {
        threads,
        kv_budget_bytes: 512 << 20,
        ..EngineConfig::default()
    };
    let mut e = Engine::new(model.clone(), cfg)?;
    let ctx = context(model.cfg.vocab, 1);
    let s = SeqId(0);

    let mut decode = 0f64;
    for _ in 0..a.repeats {
        e.free(s);
        let l = e.forward(&[SeqChunk::new(s, 0, ctx.clone(), Wanted::Last)])?;
        let mut next = sampler::argmax(l.row(0));
        let t = Instant::now();
        for i in 0..a.decode_tokens {
            let l = e.forward(&[SeqChunk::new(s, ctx.len() + i, vec![next], Wanted::Last)])?;
            next = sampler::argmax(l.row(0));
        }
        decode = decode.max(a.decode_tokens as f64 / t.elapsed().as_secs_f64());
    }

    let mut chunk_ms = BTreeMap::new();
    e.free(s);
    e.forward(&[SeqChunk::new(s, 0, ctx.clone(), Wanted::Last)])?;
    for &k in &a.chunks {
        let toks: Vec<u32> = ctx.iter().cycle().take(k).copied().collect();
        let mut best = f64::MAX;
        for _ in 0..a.repeats {
            let t = Instant::now();
            e.forward(&[SeqChunk::new(s, ctx.len(), toks.clone(), Wanted::All)])?;
            best = best.min(t.elapsed().as_secs_f64());
            e.truncate(s, ctx.len())?;
        }
        chunk_ms.insert(k, round2(best * 1e3));
    }
    e.free(s);

    let mut context_ms = BTreeMap::new();
    for &n in &a.contexts {
        let long: Vec<u32> = ctx.iter().cycle().take(n).copied().collect();
        e.free(s);
        if n > 0 {
            e.forward(&[SeqChunk::new(s, 0, long, Wanted::None)])?;
        }
        let mut ms = [0f64; 2];
        for (m, k) in ms.iter_mut().zip([1usize, 32]) {
            let toks: Vec<u32> = ctx.iter().cycle().take(k).copied().collect();
            let mut best = f64::MAX;
            for _ in 0..a.repeats {
                let t = Instant::now();
                e.forward(&[SeqChunk::new(s, n, toks.clone(), Wanted::Last)])?;
                best = best.min(t.elapsed().as_secs_f64());
                e.truncate(s, n)?;
            }
            *m = round2(best * 1e3);
        }
        context_ms.insert(n, ms);
    }
    e.free(s);

    let mut batch_tok_s = BTreeMap::new();
    for &n in a.batch_sizes.iter().filter(|_| batches) {
        let seqs: Vec<SeqId> = (1..=n as u64).map(SeqId).collect();
        for &q in &seqs {
            e.free(q);
            e.forward(&[SeqChunk::new(
                q,
                0,
                context(model.cfg.vocab, q.0),
                Wanted::None,
            )])?;
        }
        let batch: Vec<SeqChunk> = seqs
            .iter()
            .map(|&q| {
                SeqChunk::new(
                    q,
                    40,
                    context(model.cfg.vocab, 100 + q.0)[..5].to_vec(),
                    Wanted::All,
                )
            })
            .collect();
        let mut best = f64::MAX;
        for _ in 0..a.repeats {
            let t = Instant::now();
            e.forward(&batch)?;
            best = best.min(t.elapsed().as_secs_f64());
            for &q in &seqs {
                e.truncate(q, 40)?;
            }
        }
        batch_tok_s.insert(n, round2((n * 5) as f64 / best));
        for &q in &seqs {
            e.free(q);
        }
    }
    let bytes = model.bytes_per_token();
    let gflops = if batches {
        kernel_gflops(model, threads)
    } else {
        0.0
    };
    Ok(ModelBench {
        path: path.display().to_string(),
        format: match model.mode {
            tandem_engine::WeightMode::W4A8 => format!("{} w4a8", model.format()),
            tandem_engine::WeightMode::Native => format!("{} w4a16", model.format()),
            _ => model.format(),
        },
        decode_tok_s: round2(decode),
        chunk_ms,
        batch_tok_s,
        context_ms,
        bytes_per_token: bytes,
        bandwidth_limit_tok_s: round2(bw * 1e9 / bytes as f64),
        kernel_gflops: round2(gflops),
        compute_limit_tok_s: round2(gflops * 1e9 / model.flops_per_token() as f64),
    })
}

/// llama.cpp's figures for `model` through the peer script, or `None` when it is not available.
fn peer(a: &BenchArgs, model: &Path, threads: usize) -> Option<Value> {
    let (py, script) = (a.peer_python.as_ref()?, a.peer_script.as_ref()?);
    peer_bench(py, script, model, threads, &a.chunks, a.decode_tokens)
}

/// Run the peer's `bench.py` on `model`: decode tokens/s and the forward time of each chunk size.
pub fn peer_bench(
    py: &Path,
    script: &Path,
    model: &Path,
    threads: usize,
    chunks: &[usize],
    decode_tokens: usize,
) -> Option<Value> {
    let chunks: Vec<String> = chunks.iter().map(|c| c.to_string()).collect();
    let out = Command::new(py)
        .arg(script)
        .arg(model)
        .args([
            "--threads",
            &threads.to_string(),
            "--chunks",
            &chunks.join(","),
        ])
        .args(["--decode", &decode_tokens.to_string()])
        .output()
        .ok()?;
    if !out.status.success() {
        tracing::warn!(stderr = %String::from_utf8_lossy(&out.stderr), "peer benchmark failed");
        return None;
    }
    serde_json::from_slice(out.stdout.trim_ascii()).ok()
}

pub fn run(
    target: (&Arc<LlamaModel>, &Path),
    target_native: Option<&Arc<LlamaModel>>,
    draft: (&Arc<LlamaModel>, &Path),
    draft_other: Option<&Arc<LlamaModel>>,
    target_f32_gguf: Option<&Path>,
    a: &BenchArgs,
) -> Result<EngineBench> {
    let copy = copy_bandwidth();
    let mut runs = Vec::new();
    for &t in &a.threads {
        let bw = read_bandwidth(t);
        tracing::info!(threads = t, "benchmarking target");
        let tb = bench_model(target.0, target.1, t, a, bw, true).context("target")?;
        tracing::info!(threads = t, "benchmarking the target in its blocks");
        let tn = target_native
            .map(|m| bench_model(m, target.1, t, a, bw, false).context("target, native"))
            .transpose()?;
        tracing::info!(threads = t, "benchmarking draft");
        let db = bench_model(draft.0, draft.1, t, a, bw, true).context("draft")?;
        let other = draft_other
            .map(|m| bench_model(m, draft.1, t, a, bw, true).context("draft, other activations"))
            .transpose()?;
        let peer = if a.peer_python.is_some() {
            let d = peer(a, draft.1, t);
            let f = target_f32_gguf.and_then(|p| peer(a, p, t));
            let n = target_native.and_then(|_| peer(a, target.1, t));
            Some(serde_json::json!({ "draft": d, "target_f32": f, "target_native": n }))
        } else {
            None
        };
        runs.push(ThreadBench {
            threads: t,
            kernels: kernels::Isa::selected().name(),
            read_bandwidth_gbs: round2(bw),
            target: tb,
            target_native: tn,
            draft: db,
            draft_other: other,
            peer,
        });
    }
    Ok(EngineBench {
        copy_bandwidth_gbs: round2(copy),
        runs,
    })
}

fn peer_num(p: &Option<Value>, which: &str, path: &[&str]) -> String {
    let mut v = match p {
        Some(v) => &v[which],
        None => return "-".into(),
    };
    for k in path {
        v = &v[*k];
    }
    v.as_f64().map_or("-".into(), |x| format!("{x:.1}"))
}

/// The models of a run with their labels and their llama.cpp counterparts.
fn models_of(r: &ThreadBench) -> Vec<(&'static str, &ModelBench, &'static str)> {
    let mut v = vec![("target", &r.target, "target_f32")];
    if let Some(n) = &r.target_native {
        v.push(("target, its blocks", n, "target_native"));
    }
    v.push(("draft", &r.draft, "draft"));
    if let Some(w) = &r.draft_other {
        v.push(("draft, other activations", w, "draft"));
    }
    v
}

/// Markdown tables of the results.
pub fn table(b: &EngineBench) -> String {
    let mut s = format!(
        "memcpy bandwidth: {:.1} GB/s (bytes copied once); matmul kernels: {}\n\n",
        b.copy_bandwidth_gbs,
        b.runs.first().map_or("-", |r| r.kernels)
    );
    s += "| threads | model | format | decode tok/s | llama.cpp tok/s | × llama.cpp | MB/token | read GB/s | bandwidth limit tok/s | of it | compute limit tok/s | of it |\n";
    s += "|---|---|---|---|---|---|---|---|---|---|---|---|\n";
    let frac = |x: f64, of: f64| match of > 0.0 {
        true => format!("{:.0}%", 100.0 * x / of),
        false => "-".to_string(),
    };
    for r in &b.runs {
        for (name, m, peer_key) in models_of(r) {
            let peer = peer_num(&r.peer, peer_key, &["decode_tok_s"]);
            let ratio = peer
                .parse::<f64>()
                .map_or("-".to_string(), |p| format!("{:.2}×", m.decode_tok_s / p));
            let compute = match m.compute_limit_tok_s > 0.0 {
                true => format!("{:.0}", m.compute_limit_tok_s),
                false => "-".to_string(),
            };
            s += &format!(
                "| {} | {name} | {} | {:.1} | {peer} | {ratio} | {:.1} | {:.1} | {:.1} | {} | {compute} | {} |\n",
                r.threads,
                m.format,
                m.decode_tok_s,
                m.bytes_per_token as f64 / 1e6,
                r.read_bandwidth_gbs,
                m.bandwidth_limit_tok_s,
                frac(m.decode_tok_s, m.bandwidth_limit_tok_s),
                frac(m.decode_tok_s, m.compute_limit_tok_s),
            );
        }
    }
    s += "\nForward of a chunk of k new tokens on one sequence after 40 tokens (ms; llama.cpp in brackets):\n\n";
    if let Some(r0) = b.runs.first() {
        s += "| threads | model |";
        for k in r0.target.chunk_ms.keys() {
            s += &format!(" k={k} |");
        }
        s += "\n|---|---|";
        s += &"---|".repeat(r0.target.chunk_ms.len());
        s += "\n";
    }
    for r in &b.runs {
        for (name, m, peer_key) in models_of(r) {
            s += &format!("| {} | {name} |", r.threads);
            for (k, v) in &m.chunk_ms {
                let p = peer_num(&r.peer, peer_key, &["chunk_ms", &k.to_string()]);
                s += &format!(" {v:.1} ({p}) |");
            }
            s += "\n";
        }
    }
    s += "\nAfter a long context: a forward of 1 new token and of 32 (ms):\n\n";
    s += "| threads | model | context | 1 token | 32 tokens |\n|---|---|---|---|---|\n";
    for r in &b.runs {
        for (name, m, _) in models_of(r) {
            for (n, [one, chunk]) in &m.context_ms {
                s += &format!("| {} | {name} | {n} | {one:.1} | {chunk:.1} |\n", r.threads);
            }
        }
    }
    s += "\nRagged batch of n sequences × 5 new tokens, one forward (tokens/s):\n\n";
    if let Some(r0) = b.runs.first() {
        s += "| threads | model |";
        for n in r0.target.batch_tok_s.keys() {
            s += &format!(" n={n} |");
        }
        s += " compute limit (kernel GFLOP/s) |";
        s += "\n|---|---|";
        s += &"---|".repeat(r0.target.batch_tok_s.len() + 1);
        s += "\n";
    }
    for r in &b.runs {
        for (name, m) in [("target", &r.target), ("draft", &r.draft)] {
            s += &format!("| {} | {name} |", r.threads);
            for v in m.batch_tok_s.values() {
                s += &format!(" {v:.0} |");
            }
            s += &format!(" {:.0} ({:.1}) |\n", m.compute_limit_tok_s, m.kernel_gflops);
        }
    }
    s
}
