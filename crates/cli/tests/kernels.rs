//! Every kernel path this CPU runs (`TANDEM_KERNELS`: portable, avx2, avx512) computes the same
//! logits bit for bit, on the tiny random models (every family) and on SmolLM2 (the f32 target and the Q4_0
//! draft, with f32 and with 8-bit activations), for single sequences and ragged batches. The path is fixed per process, so each runs
//! in a child process of this test binary, which writes its logits' bits to a file.

mod common;

use std::path::Path;
use std::sync::Arc;

use candle_core::quantized::GgmlDType;
use common::*;
use tandem_engine::kernels::Isa;
use tandem_engine::testing::{tiny_file, TinySpec};
use tandem_engine::{Engine, EngineConfig, LlamaModel, SeqChunk, SeqId, Wanted, WeightMode};

/// Where the child writes its logits (set by the parent).
const OUT_VAR: &str = "TANDEM_TEST_LOGITS_OUT";

/// The logits of a fixed workload on `m`: one sequence alone (a prompt, then chunks of 1, 4 and
/// 9 tokens, as a verifier feeds blocks), and three sequences in ragged batches (prompts of
/// different lengths together, then a chunk of each of 1, 3 and 16 tokens), every position's
/// logits in order.
fn workload(m: &Arc<LlamaModel>, threads: usize) -> Vec<f32> {
    let vocab = m.cfg.vocab as u32;
    let tok = |seed: u32, n: usize| -> Vec<u32> {
        (0..n as u32)
            .map(|i| (seed * 7919 + i * 104_729) % vocab)
            .collect()
    };
    let mut e = Engine::new(
        m.clone(),
        EngineConfig {
            threads,
            kv_budget_bytes: 64 << 20,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    let mut out = Vec::new();
    let mut keep = |l: tandem_engine::Logits| {
        for r in 0..l.rows.len() {
            out.extend_from_slice(l.row(r));
        }
    };
    let mut pos = 0;
    for (k, n) in [12usize, 1, 4, 9].into_iter().enumerate() {
        let c = SeqChunk::new(SeqId(0), pos, tok(k as u32, n), Wanted::All);
        keep(e.forward(&[c]).unwrap());
        pos += n;
    }
    let mut at = [0usize; 3];
    for (round, lens) in [[5usize, 11, 2], [1, 3, 16]].into_iter().enumerate() {
        let batch: Vec<SeqChunk> = (0..3)
            .map(|s| {
                let toks = tok(10 + 3 * round as u32 + s as u32, lens[s]);
                SeqChunk::new(SeqId(1 + s as u64), at[s], toks, Wanted::All)
            })
            .collect();
        keep(e.forward(&batch).unwrap());
        for s in 0..3 {
            at[s] += lens[s];
        }
    }
    out
}

fn tiny(dtype: GgmlDType) -> Arc<LlamaModel> {
    let spec = TinySpec {
        dtype,
        dim: 128,
        ff_dim: 192,
        ..TinySpec::default()
    };
    let mode = match dtype {
        GgmlDType::F32 => WeightMode::F32,
        _ => WeightMode::Native,
    };
    Arc::new(LlamaModel::load(&mut tiny_file(&spec).unwrap(), mode).unwrap())
}

/// A tiny model of family `arch` ([`TinySpec::family`]: Gemma 3 with its windows, GeGLU and
/// norms; Qwen with biases or QK-norm), wider than the default.
fn family(arch: &'static str, dtype: GgmlDType) -> Arc<LlamaModel> {
    let spec = TinySpec {
        dtype,
        dim: 128,
        ff_dim: 192,
        ..TinySpec::family(arch)
    };
    let mode = match dtype {
        GgmlDType::F32 => WeightMode::F32,
        _ => WeightMode::Native,
    };
    Arc::new(LlamaModel::load(&mut tiny_file(&spec).unwrap(), mode).unwrap())
}

/// The models compared, by name.
fn models() -> Vec<(&'static str, Arc<LlamaModel>)> {
    vec![
        ("tiny f32", tiny(GgmlDType::F32)),
        ("tiny q4_0", tiny(GgmlDType::Q4_0)),
        ("tiny q8_0", tiny(GgmlDType::Q8_0)),
        ("tiny qwen2 f32", family("qwen2", GgmlDType::F32)),
        ("tiny qwen3 q4_0", family("qwen3", GgmlDType::Q4_0)),
        ("tiny gemma3 f32", family("gemma3", GgmlDType::F32)),
        ("tiny gemma3 q4_0", family("gemma3", GgmlDType::Q4_0)),
        ("SmolLM2 f32 target", target().0.clone()),
        (
            "SmolLM2 q4_0 draft",
            load(draft_path(), WeightMode::Native).0,
        ),
        (
            "SmolLM2 q4_0 draft, 8-bit activations",
            load(draft_path(), WeightMode::W4A8).0,
        ),
    ]
}

/// Run in a child process by the test below: this process's path on every model, written to
/// the file the parent named, one model after another.
#[test]
#[ignore = "run by every_kernel_path_gives_the_same_logits, in a child process per path"]
fn child_writes_its_logits() {
    let path = std::env::var(OUT_VAR).expect("the parent names the output file");
    let mut bytes = Vec::new();
    for (i, (_, m)) in models().iter().enumerate() {
        // Two threads for some models, one for others: the threads split the rows, never a sum.
        let logits = workload(m, 1 + i % 2);
        bytes.extend_from_slice(&(logits.len() as u64).to_le_bytes());
        for v in logits {
            bytes.extend_from_slice(&v.to_bits().to_le_bytes());
        }
    }
    std::fs::write(path, bytes).unwrap();
}

/// Each model's logits in a child's file.
fn read(path: &Path) -> Vec<Vec<u32>> {
    let b = std::fs::read(path).unwrap();
    let mut out = Vec::new();
    let mut at = 0;
    while at < b.len() {
        let n = u64::from_le_bytes(b[at..at + 8].try_into().unwrap()) as usize;
        at += 8;
        out.push(
            b[at..at + 4 * n]
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
                .collect(),
        );
        at += 4 * n;
    }
    out
}

#[test]
fn every_kernel_path_gives_the_same_logits() {
    model_path();
    draft_path();
    let paths = Isa::available();
    eprintln!("kernel paths on this CPU: {paths:?}");
    let dir = std::env::temp_dir().join(format!("tandem-kernels-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let names: Vec<&str> = models().iter().map(|(n, _)| *n).collect();
    let mut runs = Vec::new();
    for isa in &paths {
        let file = dir.join(isa.name());
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "child_writes_its_logits", "--ignored"])
            .env("TANDEM_KERNELS", isa.name())
            .env(OUT_VAR, &file)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "the {} child failed: {}",
            isa.name(),
            String::from_utf8_lossy(&out.stderr)
        );
        runs.push((isa.name(), read(&file)));
    }
    let (base, want) = &runs[0];
    assert_eq!(want.len(), names.len());
    for (name, got) in &runs[1..] {
        for ((model, w), g) in names.iter().zip(want).zip(got) {
            assert_eq!(w.len(), g.len(), "{model}: as many logits");
            if let Some(i) = w.iter().zip(g).position(|(a, b)| a != b) {
                panic!(
                    "{model}: the {name} path's logit {i} is {} ({:#x}), the {base} path's {} ({:#x})",
                    f32::from_bits(g[i]),
                    g[i],
                    f32::from_bits(w[i]),
                    w[i]
                );
            }
        }
        eprintln!("{name}: the {base} path's bits on every model");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
