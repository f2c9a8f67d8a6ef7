//! The `tandem` binary's model commands run for real on SmolLM2: `bench engine --json` and
//! `generate --json` print what their contracts promise (`generate`'s output is the reference's),
//! `quantize` reports its errors and writes a draft that loads and runs, and bad input is refused
//! by name. The model is pulled on first use.

mod common;

use std::process::Command;

use common::*;
use serde_json::Value;
use tandem_engine::{SeqId, WeightMode};

fn tandem(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(args)
        .output()
        .unwrap()
}

/// `bench engine --json` prints one JSON object with the engine-speed keys (a tiny run: one thread,
/// a few tokens, no llama.cpp).
#[test]
fn cli_bench_engine_json_contract() {
    model_path();
    draft_path();
    let out = tandem(&[
        "bench",
        "engine",
        "--threads",
        "1",
        "--repeats",
        "1",
        "--decode-tokens",
        "2",
        "--chunks",
        "1,5",
        "--batch",
        "2",
        "--contexts",
        "100",
        "--no-peer",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    for key in [
        "draft_decode_tok_s",
        "target_decode_tok_s",
        "draft_other_decode_tok_s",
        "bandwidth_gbs",
    ] {
        assert!(v[key].as_f64().is_some_and(|x| x > 0.0), "{key}: {v}");
    }
    assert!(
        v["draft_path"]
            .as_str()
            .is_some_and(|p| p.ends_with(".gguf")),
        "{v}"
    );
    assert!(["portable", "avx2", "avx512"].contains(&v["kernels"].as_str().unwrap()));
    for model in ["target", "draft"] {
        assert!(v["verify_chunk_ms"][model]["5"].as_f64().is_some(), "{v}");
    }
    assert!(v["batch_throughput_tok_s"]["2"].as_f64().is_some(), "{v}");
    let run = &v["runs"][0];
    assert!(
        run["target"]["context_ms"]["100"][1].as_f64().is_some(),
        "{v}"
    );
    assert!(run["target"]["compute_limit_tok_s"]
        .as_f64()
        .is_some_and(|x| x > 0.0));
}

#[test]
fn cli_generate_json_contract() {
    model_path();
    let out = tandem(&[
        "generate",
        "--model",
        "target",
        "--prompt",
        "The capital of France is",
        "--max-tokens",
        "16",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert_eq!(
        stdout.trim_end().lines().count(),
        1,
        "one JSON object on one line: {stdout}"
    );
    let v: Value = serde_json::from_str(&stdout).unwrap();
    for key in [
        "prompt_ids",
        "output_ids",
        "text",
        "ttft_ms",
        "itl_ms",
        "tokens_per_s",
    ] {
        assert!(v.get(key).is_some(), "missing {key}");
    }
    for key in ["mean", "p50", "p99"] {
        assert!(v["itl_ms"][key].as_f64().is_some(), "itl_ms.{key}");
    }
    let case = &fixture("reference.json")["cases"][0];
    assert_eq!(ids(&v["prompt_ids"]), ids(&case["prompt_ids"]));
    assert_eq!(ids(&v["output_ids"])[..], ids(&case["output_ids"])[..16]);
    assert!(v["text"].as_str().unwrap().starts_with(" Paris."));

    // Chat mode stops at the end-of-turn token, sampling is reproducible by seed.
    let chat = tandem(&[
        "generate",
        "--model",
        "draft",
        "--chat",
        "--prompt",
        "What is 2+2?",
        "--max-tokens",
        "64",
        "--json",
    ]);
    assert!(
        chat.status.success(),
        "{}",
        String::from_utf8_lossy(&chat.stderr)
    );
    let v: Value = serde_json::from_slice(&chat.stdout).unwrap();
    assert_eq!(v["finish_reason"], "stop");
    let sampled = |seed: &str| {
        let o = tandem(&[
            "generate",
            "--model",
            "draft",
            "--prompt",
            "Once upon a time",
            "--max-tokens",
            "12",
            "--temperature",
            "0.8",
            "--top-k",
            "40",
            "--top-p",
            "0.95",
            "--seed",
            seed,
            "--json",
        ]);
        assert!(o.status.success());
        ids(&serde_json::from_slice::<Value>(&o.stdout).unwrap()["output_ids"])
    };
    assert_eq!(sampled("7"), sampled("7"));
}

#[test]
fn cli_refuses_bad_input_by_name() {
    let bad = tandem(&["generate", "--model", "/nonexistent.gguf", "--prompt", "x"]);
    assert!(!bad.status.success());
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("--model /nonexistent.gguf: no such file")
    );
    let bad = tandem(&["generate", "--prompt", "x", "--top-p", "1.5"]);
    assert!(String::from_utf8_lossy(&bad.stderr).contains("top_p"));
    for (cpus, says) in [("255", "cpu 255 is not available"), ("1-x", "not a CPU id")] {
        let bad = tandem(&["generate", "--prompt", "x", "--cpus", cpus]);
        let err = String::from_utf8_lossy(&bad.stderr);
        assert!(!bad.status.success() && err.contains(says), "{err}");
    }
    let bad = tandem(&["quantize", "--group-size", "48"]);
    assert!(String::from_utf8_lossy(&bad.stderr).contains("group_size"));
    // A target's weights are f32, its own blocks or f16: 8-bit activations are a draft's.
    for (mode, says) in [
        ("w4a8", "a draft's mode, not a target's"),
        ("int3", "unknown weight mode `int3`"),
    ] {
        let bad = tandem(&["cloud", "serve", "--no-auth", "--weights", mode]);
        let err = String::from_utf8_lossy(&bad.stderr);
        assert!(!bad.status.success() && err.contains(says), "{err}");
    }
    // No pip on PATH and an empty model directory: a message that says what is missing.
    let dir = std::env::temp_dir().join(format!("tandem-nopip-{}", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["pull"])
        .env("TANDEM_HOME", &dir)
        .env("PATH", "/nonexistent")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no Python with pip"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn cli_quantize_reports_and_writes_a_loadable_draft() {
    model_path();
    let dir = std::env::temp_dir().join(format!("tandem-quant-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (scheme, group, bits, max_err) in [("w4a16", "128", 4.0, 0.2), ("w8a16", "32", 8.0, 0.02)] {
        let out_path = dir.join(format!("{scheme}-{group}.gguf"));
        let o = tandem(&[
            "quantize",
            "--scheme",
            scheme,
            "--group-size",
            group,
            "--out",
            out_path.to_str().unwrap(),
            "--json",
        ]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let r: Value = serde_json::from_slice(&o.stdout).unwrap();
        let sbpw = r["scheme_bits_per_weight"].as_f64().unwrap();
        assert!(sbpw > bits && sbpw < bits + 0.6, "scheme bpw {sbpw}");
        for t in r["tensors"].as_array().unwrap() {
            let e = t["rel_error"].as_f64().unwrap();
            assert!(e < max_err, "{}: {e}", t["name"]);
        }
        let (m, tok) = load(&out_path, WeightMode::Native);
        let text = tok
            .decode(&greedy(
                &mut engine(&m),
                SeqId(1),
                &tok.encode("The capital of France is").unwrap(),
                4,
            ))
            .unwrap();
        assert!(!text.trim().is_empty());
    }
    let _ = std::fs::remove_dir_all(dir);
}
