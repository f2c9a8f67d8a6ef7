//! SmolLM2-135M-Instruct against the independent numpy reference (fixtures/make_fixtures.py), and
//! the `tandem` binary run for real. The model is pulled on first use.

mod common;

use std::path::Path;
use std::process::Command;
use std::sync::OnceLock;

use common::*;
use serde_json::Value;
use tandem_engine::{EngineConfig, SeqChunk, SeqId, Wanted, WeightMode};
use tandem_spec::sampling as sampler;

fn fixture(name: &str) -> Value {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(name);
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
}

#[test]
fn tokenizer_matches_the_reference_tokenizer() {
    let (_, tok) = target();
    let f = fixture("tokenizer.json");
    for case in f["strings"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        assert_eq!(
            tok.encode(text).unwrap(),
            ids(&case["ids"]),
            "encoding {text:?}"
        );
        let want_text = tok.decode(&ids(&case["ids"])).unwrap();
        assert_eq!(want_text, text, "decoding {text:?}");
    }
    for case in f["chat"].as_array().unwrap() {
        let user = case["user"].as_str().unwrap();
        let rendered = tok
            .render_chat(&[tandem_engine::tokenizer::ChatMessage {
                role: "user".into(),
                content: user.into(),
            }])
            .unwrap();
        assert_eq!(rendered, case["rendered"].as_str().unwrap());
    }
}

#[test]
fn target_logits_match_the_reference() {
    let (m, _) = target();
    for case in fixture("reference.json")["cases"].as_array().unwrap() {
        let prompt = ids(&case["prompt_ids"]);
        let mut e = engine(m);
        let l = e
            .forward(&[SeqChunk::new(SeqId(1), 0, prompt, Wanted::Last)])
            .unwrap();
        let row = l.row(0);
        let fl = &case["first_logits"];
        let mut worst = 0f64;
        for (idk, vk) in [("top_ids", "top_values"), ("probe_ids", "probe_values")] {
            for (i, v) in ids(&fl[idk]).iter().zip(fl[vk].as_array().unwrap()) {
                worst = worst.max((row[*i as usize] as f64 - v.as_f64().unwrap()).abs());
            }
        }
        assert!(worst < 2e-3, "{}: max |Δlogit| {worst}", case["prompt"]);
        let top: Vec<u32> = ids(&fl["top_ids"]);
        assert_eq!(sampler::argmax(row), top[0]);
    }
}

#[test]
fn target_greedy_matches_the_reference() {
    let (m, _) = target();
    for case in fixture("reference.json")["cases"].as_array().unwrap() {
        let want = ids(&case["output_ids"]);
        let margins: Vec<f64> = case["top2_margin"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        // A step whose top-2 gap is tiny may flip under another summation order: compare up to it.
        let exact = margins
            .iter()
            .position(|&g| g < 0.02)
            .map_or(want.len(), |i| i + 1);
        let got = greedy(&mut engine(m), SeqId(2), &ids(&case["prompt_ids"]), exact);
        assert_eq!(got[..exact], want[..exact], "{}", case["prompt"]);
    }
}

#[test]
fn greedy_is_identical_alone_or_batched() {
    let (m, tok) = target();
    let prompts = [
        "The capital of France is",
        "def add(a, b):",
        "My favourite colour is",
        "1, 2, 3, 4,",
    ];
    let enc: Vec<Vec<u32>> = prompts.iter().map(|p| tok.encode(p).unwrap()).collect();
    let n = 10;
    let mut e = engine(m);
    let mut outs = vec![Vec::new(); enc.len()];
    let mut chunks: Vec<SeqChunk> = enc
        .iter()
        .enumerate()
        .map(|(i, p)| SeqChunk::new(SeqId(i as u64), 0, p.clone(), Wanted::Last))
        .collect();
    for _ in 0..n {
        let l = e.forward(&chunks).unwrap();
        for (i, c) in chunks.iter_mut().enumerate() {
            let next = sampler::argmax(l.last_for(c.seq).unwrap());
            outs[i].push(next);
            *c = SeqChunk::new(
                c.seq,
                c.start_pos + c.tokens.len(),
                vec![next],
                Wanted::Last,
            );
        }
    }
    for (i, p) in enc.iter().enumerate() {
        assert_eq!(
            greedy(&mut engine(m), SeqId(9), p, n),
            outs[i],
            "{}",
            prompts[i]
        );
    }
}

/// Teacher-forced greedy acceptance of the default draft on the reference continuations: a sane
/// W4A16 draft agrees with the target most of the time (llama.cpp measured α ≈ 0.76 for this grid).
#[test]
fn default_draft_tracks_the_target() {
    let (draft, dtok) = load(draft_path(), WeightMode::Native);
    let (_, ttok) = target();
    assert_eq!(
        dtok.fingerprint(),
        ttok.fingerprint(),
        "draft and target share the tokenizer"
    );
    assert_eq!(draft.format(), "q4_0");
    let (mut hits, mut total) = (0, 0);
    for case in fixture("reference.json")["cases"].as_array().unwrap() {
        let prompt = ids(&case["prompt_ids"]);
        let out = ids(&case["output_ids"]);
        let mut all = prompt.clone();
        all.extend(&out);
        let mut e = engine(&draft);
        let want: Vec<usize> = (prompt.len() - 1..all.len() - 1).collect();
        let l = e
            .forward(&[SeqChunk::new(SeqId(3), 0, all, Wanted::At(want))])
            .unwrap();
        for (i, t) in out.iter().enumerate() {
            hits += (sampler::argmax(l.row(i)) == *t) as usize;
            total += 1;
        }
    }
    let alpha = hits as f64 / total as f64;
    eprintln!("default draft teacher-forced greedy acceptance: {alpha:.3} over {total} tokens");
    assert!(alpha > 0.5, "alpha {alpha}");
}

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

#[test]
fn w4a8_variant_runs() {
    let (m, tok) = load(draft_path(), WeightMode::W4A8);
    let out = greedy(
        &mut engine(&m),
        SeqId(1),
        &tok.encode("The capital of France is").unwrap(),
        6,
    );
    assert_eq!(out.len(), 6);
}

fn spec_run(
    prompt: &[u32],
    gamma: usize,
    depth: usize,
    rtt_ms: f64,
    params: tandem_spec::sampling::SamplingParams,
    rule: tandem_spec::VerifyRule,
    max_new: usize,
) -> Vec<u32> {
    spec_out(prompt, gamma, depth, rtt_ms, params, rule, max_new, None).output_ids
}

/// Sync (depth 1) and async speculation commit exactly the target's greedy output, whatever γ,
/// depth and round trip.
#[test]
fn speculation_is_lossless_greedy() {
    let (m, tok) = target();
    let prompts = [
        tok.encode("The capital of France is").unwrap(),
        tok.encode_chat("Explain how a bicycle stays upright while moving.")
            .unwrap(),
    ];
    let n = 20;
    for (pi, p) in prompts.iter().enumerate() {
        let want = greedy(&mut engine(m), SeqId(5), p, n);
        let configs: &[(usize, usize, f64)] = if pi == 0 {
            &[
                (1, 1, 0.0),
                (4, 1, 50.0),
                (8, 1, 0.0),
                (2, 2, 0.0),
                (4, 3, 50.0),
                (3, 4, 150.0),
            ]
        } else {
            &[(4, 1, 0.0), (5, 2, 50.0), (8, 4, 20.0)]
        };
        for &(g, d, rtt) in configs {
            let got = spec_run(
                p,
                g,
                d,
                rtt,
                tandem_spec::sampling::SamplingParams::default(),
                tandem_spec::VerifyRule::Greedy,
                n,
            );
            assert_eq!(got, want, "prompt {pi}, γ={g} depth={d} rtt={rtt}");
        }
    }
}

/// The adaptive policy re-plans γ and depth from what it measures; the output stays the target's,
/// and what it measured is what the link and the models cost.
#[test]
fn adaptive_policy_is_lossless_and_measures_the_link() {
    let (m, tok) = target();
    let (d, _) = draft();
    let p = tok
        .encode_chat("Explain how a bicycle stays upright while moving.")
        .unwrap();
    let n = 40;
    let want = greedy(&mut engine(m), SeqId(6), &p, n);
    let one = EngineConfig {
        threads: 1,
        ..EngineConfig::default()
    };
    for (depth, rtt) in [(1, 60.0), (2, 60.0)] {
        let run = tandem_client::speculate::SpecRun {
            target: m.clone(),
            draft: d.clone(),
            tokenizer: tok,
            cloud: one,
            edge: one,
            spec: tandem_edge::SpecConfig {
                session: tandem_spec::edge::SessionConfig {
                    draft_len: 1,
                    depth,
                    max_new_tokens: n,
                    auto: Some(tandem_spec::edge::AutoShape {
                        max_draft_len: 8,
                        max_depth: depth,
                        prior: tandem_spec::edge::default_prior(rtt),
                    }),
                    tree: tandem_spec::TreeConfig::LINEAR,
                },
                rule: tandem_spec::VerifyRule::Greedy,
                params: tandem_spec::sampling::SamplingParams::default(),
                q_top_k: 32,
            },
            rtt_ms: rtt,
            jitter_ms: 0.0,
            // Behind the delay line, a verifier that verifies every block.
            cloud_url: Some(awaiting_server().clone()),
            api_key: None,
            tls_ca: None,
        };
        let out = tandem_client::speculate::run(&run, &p, |_| {}).unwrap();
        assert_eq!(out.output_ids, want, "depth {depth}");
        let s = out.spec.unwrap();
        let mm = s.measured;
        eprintln!("auto depth ≤ {depth}: {mm:?}");
        assert!(s.auto);
        assert!(mm.draft_ms > 1.0 && mm.verify_ms > 1.0, "{mm:?}");
        // The delay line adds the round trip; the policy sees at least that (how much more a
        // busy machine adds is measured by `bench latency`).
        assert!(mm.net_ms >= rtt * 0.95, "{mm:?}");
        assert!(mm.final_depth <= depth && mm.final_draft_len <= 8, "{mm:?}");
        // Which shape it ends at depends on this CPU: where the draft is slower than the target
        // (an AVX2 laptop on the portable kernels), no shape beats the verifier's own pace and
        // γ 1 stays. That the policy re-plans when its model predicts a clear gain is
        // `tandem_spec::edge`'s test on a test clock.
    }
}

/// Protocol 2 over a real TCP link with delay (0, 50 and 150 ms round trips, ±10% jitter), where
/// blocks land behind the tokens the verifier decodes meanwhile: greedy speculation is the
/// target's greedy output, sample-and-match the target's own seeded sample, and a draft that is
/// always wrong still finishes with the target's output.
#[test]
fn every_rule_stays_the_targets_through_netem_at_0_50_and_150_ms() {
    let (m, tok) = target();
    let upstream: std::net::SocketAddr =
        grpc_server().trim_start_matches("http://").parse().unwrap();
    let p = tok
        .encode("The history of the printing press begins in")
        .unwrap();
    let want = greedy(&mut engine(m), SeqId(7), &p, 16);
    let params = tandem_spec::sampling::SamplingParams {
        temperature: 0.9,
        top_k: 40,
        top_p: 0.95,
        seed: 11,
    };
    let sampled = tandem_client::generate::generate(&mut engine(m), tok, &p, 16, &params, |_| {})
        .unwrap()
        .output_ids;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    for rtt in [0.0, 50.0, 150.0] {
        let addr = on_loopback(move |l| async move {
            let cfg = tandem_client::netem::NetemConfig {
                rtt_ms: rtt,
                jitter_ms: rtt / 10.0,
                ..Default::default()
            };
            tandem_client::netem::proxy(l, upstream, cfg).await.unwrap();
        });
        let url = format!("http://{addr}");
        let greedy_p = tandem_spec::sampling::SamplingParams::default();
        let rule = tandem_spec::VerifyRule::Greedy;
        let out = spec_out(&p, 3, 2, 0.0, greedy_p, rule, 16, Some(url.clone()));
        assert_eq!(out.output_ids, want, "greedy at {rtt} ms");
        let rule = tandem_spec::VerifyRule::SampleMatch;
        let out = spec_out(&p, 3, 2, 0.0, params, rule, 16, Some(url.clone()));
        assert_eq!(out.output_ids, sampled, "sample-and-match at {rtt} ms");
        let wrong = tandem_bench::load::SyntheticEdge {
            alpha: 0.0,
            draft_ms: 5.0,
            gamma: 3,
            depth: 2,
            seed: 3,
            vocab: m.cfg.vocab as u32,
            tree: tandem_spec::TreeConfig::LINEAR,
            cover: 0.0,
        };
        let out = tandem_bench::load::synthetic_session(&rt, &url, tok, &p, &want, wrong).unwrap();
        assert_eq!(out.output_ids, want, "an always-wrong draft at {rtt} ms");
    }
}

/// With sample-and-match, speculation commits exactly what the target samples by itself with the
/// same seed: every position's draw is keyed by (seed, position).
#[test]
fn sample_and_match_reproduces_the_targets_own_sampling() {
    let (m, tok) = target();
    let p = tok.encode("Once upon a time").unwrap();
    let params = tandem_spec::sampling::SamplingParams {
        temperature: 0.9,
        top_k: 40,
        top_p: 0.95,
        seed: 11,
    };
    let mut e = engine(m);
    let out = tandem_client::generate::generate(&mut e, tok, &p, 16, &params, |_| {}).unwrap();
    let got = spec_run(
        &p,
        4,
        3,
        20.0,
        params,
        tandem_spec::VerifyRule::SampleMatch,
        16,
    );
    assert_eq!(got, out.output_ids);
}

/// A real gRPC verifier on a loopback port, serving the f32 target; returns its URL.
fn grpc_server() -> &'static String {
    static URL: OnceLock<String> = OnceLock::new();
    URL.get_or_init(|| new_grpc_server(tandem_cloud::grpc::DEFAULT_SATURATION_TOKENS).0)
}

/// How long a verifier of these tests waits for a session's next block before decoding a token
/// alone: longer than the slowest draft here takes for a block (8 tokens at 0.23 s on a busy
/// AVX2 machine on the portable kernels).
const AWAIT_DRAFTS_MS: u64 = 5_000;

/// [`grpc_server`] that awaits its edges' blocks (`--await-drafts-ms`): it verifies every block
/// and decodes no speculating session alone while its draft keeps up, so a test of what happens
/// to drafts sees them judged however slow the draft is beside the target (on a CPU where the
/// 4-bit draft is slower than the f32 target, the default verifier decodes every token before a
/// block lands).
fn awaiting_server() -> &'static String {
    static URL: OnceLock<String> = OnceLock::new();
    URL.get_or_init(|| new_awaiting_server().0)
}

/// A new verifier that awaits its edges' blocks (see [`awaiting_server`]): its URL and gauges.
fn new_awaiting_server() -> (String, std::sync::Arc<tandem_cloud::Gauges>) {
    grpc_server_with(
        tandem_cloud::grpc::DEFAULT_SATURATION_TOKENS,
        false,
        tandem_cloud::tenants::Tenants::open(),
        tandem_verifier::VerifierConfig {
            await_drafts_ms: AWAIT_DRAFTS_MS,
            ..tandem_verifier::VerifierConfig::default()
        },
        256 << 20,
    )
}

/// Grants follow the load: while a generation keeps a verifier (saturated at 1 token per forward)
/// busy, the grant shrinks a level every few forwards down to γ 0 — the verifier decodes sessions
/// itself: a new session is granted γ 0, and a session opened before gets the target's tokens
/// streamed instead of verdicts; once the verifier is idle again, grants grow back a level at a
/// time.
#[test]
fn grants_shrink_under_load_and_grow_back() {
    use tandem_edge::Link;
    use tandem_proto::v1::verifier_client::VerifierClient;
    let (_, tok) = target();
    let url = new_grpc_server(1.0).0;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let p = tok
        .encode_chat("Write a long story about a dragon.")
        .unwrap();
    // Probes ask for one token: the first, committed at Open, so the verifier has nothing to
    // decode for them (a decode would be load at a saturation of one token per forward).
    let connect = |rt: &tokio::runtime::Runtime, max_tokens: u32| {
        let req = tandem_edge::grpc::OpenRequest {
            max_tokens,
            want_draft_len: 8,
            want_depth: 4,
            ..greedy_open(tok.fingerprint(), &p)
        };
        tandem_edge::grpc::GrpcLink::connect(rt, &url, req).unwrap()
    };
    let open = |rt: &tokio::runtime::Runtime| {
        let (link, o) = connect(rt, 1);
        link.close();
        (o.draft_len, o.depth)
    };
    let (mut early, opened) = connect(&rt, 8);
    assert_eq!((opened.draft_len, opened.depth), (8, 4), "idle");
    let mut c = rt.block_on(VerifierClient::connect(url.clone())).unwrap();
    let mut stream = rt
        .block_on(c.generate(tandem_proto::v1::GenerateRequest {
            tokenizer_fingerprint: tok.fingerprint().to_string(),
            prompt_ids: p.clone(),
            params: None,
            max_tokens: 400,
        }))
        .unwrap()
        .into_inner();
    // 40 forwards at about one token each: all four levels down.
    for _ in 0..40 {
        rt.block_on(stream.message()).unwrap().unwrap();
    }
    assert_eq!(open(&rt), (0, 1), "under load");
    // The session opened at (8, 4) drafted nothing: the verifier decoded it all along, each of
    // its tokens once and in order after the first, and told it each smaller grant on the way.
    let mut decoded = Vec::new();
    while decoded.len() < 7 {
        match early.recv(true).unwrap() {
            Some(tandem_spec::Incoming::Decoded(d)) => decoded.push(d),
            other => panic!("expected decoded tokens, got {other:?}"),
        }
    }
    let positions: Vec<usize> = decoded.iter().map(|d| d.pos).collect();
    assert_eq!(
        positions,
        (p.len() + 1..p.len() + 8).collect::<Vec<_>>(),
        "{decoded:?}"
    );
    let grants: Vec<tandem_spec::Shape> = decoded.iter().filter_map(|d| d.grant).collect();
    assert!(
        grants.windows(2).all(|w| w[0] >= w[1]),
        "grants only shrink under load: {grants:?}"
    );
    early.close();
    drop(stream);
    // Idle again, the grant climbs back to the full one and never shrinks on the way (one level
    // per idle spell: the verifier's own test times that on its clock). Each probe opens a
    // session, so probes are further apart than an idle spell; the bound only keeps a broken
    // build from hanging.
    let gap = std::time::Duration::from_millis(2 * tandem_verifier::control::IDLE_RELAX_MS);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let mut idle: Vec<(u32, u32)> = Vec::new();
    while idle.last() != Some(&(8, 4)) && std::time::Instant::now() < deadline {
        std::thread::sleep(gap);
        let g = open(&rt);
        if idle.last() != Some(&g) {
            idle.push(g);
        }
    }
    assert!(idle.windows(2).all(|w| w[0] <= w[1]), "{idle:?}");
    assert_eq!(idle.last(), Some(&(8, 4)), "idle again: {idle:?}");
}

/// `/metrics` is served over real HTTP, parses as Prometheus text, and counts what a speculative
/// session did.
#[test]
fn metrics_are_scraped_over_http_and_parse() {
    use std::io::{Read, Write};
    let (_, tok) = target();
    // Its own verifier (the counters are its alone), awaiting the edge's blocks: some are
    // verified with accepted tokens however slow the draft.
    let (url, g) = new_awaiting_server();
    let maddr = on_loopback(move |l| async move {
        tandem_cloud::metrics::serve_metrics(l, g, std::future::pending())
            .await
            .unwrap();
    });
    let p = tok.encode("The capital of France is").unwrap();
    let out = spec_out(
        &p,
        4,
        2,
        0.0,
        tandem_spec::sampling::SamplingParams::default(),
        tandem_spec::VerifyRule::Greedy,
        48,
        Some(url),
    );
    // The session's usage is counted when the verifier takes its edge's Close: scrape until it
    // is there.
    let scrape = || {
        let mut c = std::net::TcpStream::connect(maddr).unwrap();
        c.write_all(b"GET /metrics HTTP/1.1\r\nHost: tandem\r\nConnection: close\r\n\r\n")
            .unwrap();
        let mut resp = String::new();
        c.read_to_string(&mut resp).unwrap();
        let (head, body) = resp.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        let mut values = std::collections::HashMap::new();
        for line in body
            .lines()
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
        {
            let (name, value) = line.rsplit_once(' ').unwrap();
            let v: f64 = value
                .parse()
                .unwrap_or_else(|_| panic!("not a value: {line}"));
            values.insert(name.to_string(), v);
        }
        (values, body.to_string())
    };
    let ended = |v: &std::collections::HashMap<String, f64>| -> f64 {
        v.iter()
            .filter(|(k, _)| k.starts_with("tandem:request_success_total"))
            .map(|(_, x)| x)
            .sum()
    };
    // (The running gauge is set at the batcher's turn after the one that ended the session:
    // wait for both, with no time limit.)
    let (mut values, mut body) = scrape();
    while ended(&values) < 1.0 || values.get("tandem:num_requests_running") != Some(&0.0) {
        std::thread::sleep(std::time::Duration::from_millis(20));
        (values, body) = scrape();
    }
    let s = out.spec.unwrap();
    // Every verdict the edge applied was a verified draft (some it found stale on arrival).
    let drafts = values["tandem:spec_decode_num_drafts_total"];
    assert!(
        drafts >= s.rounds as f64 && drafts <= (s.rounds + s.stale_blocks + 2) as f64,
        "{drafts} drafts for {} rounds: {body}",
        s.rounds
    );
    assert!(values["tandem:spec_decode_num_accepted_tokens_total"] >= 1.0);
    assert!(values["tandem:time_to_first_token_seconds_count"] >= 1.0);
    assert!(values["tandem:target_forwards_total"] >= 2.0);
    assert!(
        values.contains_key("tandem:spec_decode_num_accepted_tokens_per_pos_total{position=\"0\"}")
    );
    // The session's usage, counted once each, as the edge counted it.
    let reason = if out.finish_reason == "stop" {
        "stop"
    } else {
        "length"
    };
    let key = format!("tandem:request_success_total{{finished_reason=\"{reason}\"}}");
    assert_eq!((ended(&values), values[&key]), (1.0, 1.0), "{body}");
    assert_eq!(values["tandem:prompt_tokens_total"], p.len() as f64);
    assert_eq!(
        values["tandem:generation_tokens_total"],
        out.output_ids.len() as f64
    );
    assert_eq!(
        values["tandem:spec_decode_num_accepted_tokens_total"], s.accepted_draft_tokens as f64,
        "{body}"
    );
    assert_eq!(values["tandem:cloud_tokens_total"], s.cloud_tokens as f64);
    assert_eq!(values["tandem:num_requests_running"], 0.0);
    assert!((0.0..=1.0).contains(&values["tandem:draft_acceptance_rate"]));
    assert!(values["tandem:e2e_request_latency_seconds_count"] == 1.0);
}

/// A TCP relay to `upstream` that severs its first connection after `cut_ms`; later ones pass.
fn cutting_relay(upstream: std::net::SocketAddr, cut_ms: u64) -> std::net::SocketAddr {
    on_loopback(move |l| async move {
        let mut first = true;
        loop {
            let (mut c, _) = l.accept().await.unwrap();
            let cut = std::mem::take(&mut first);
            tokio::spawn(async move {
                let mut u = tokio::net::TcpStream::connect(upstream).await.unwrap();
                let relay = tokio::io::copy_bidirectional(&mut c, &mut u);
                if cut {
                    // Dropping both sockets mid-stream is the dropped network.
                    let _ =
                        tokio::time::timeout(std::time::Duration::from_millis(cut_ms), relay).await;
                } else {
                    let _ = relay.await;
                }
            });
        }
    })
}

/// The network drops in the middle of a generation: the edge keeps what was verified, opens a new
/// session over the committed history, and the output is still exactly the target's.
#[test]
fn a_dropped_connection_is_reopened_and_the_output_stays_the_targets() {
    let (m, tok) = target();
    let upstream: std::net::SocketAddr =
        grpc_server().trim_start_matches("http://").parse().unwrap();
    let relay = cutting_relay(upstream, 1000);
    let p = tok
        .encode_chat("Explain how a bicycle stays upright while moving.")
        .unwrap();
    let n = 64;
    let want = greedy(&mut engine(m), SeqId(9), &p, n);
    let out = spec_out(
        &p,
        3,
        2,
        0.0,
        tandem_spec::sampling::SamplingParams::default(),
        tandem_spec::VerifyRule::Greedy,
        n,
        Some(format!("http://{relay}")),
    );
    assert_eq!(out.output_ids, want);
    let s = out.spec.unwrap();
    assert!(s.measured.reconnects >= 1, "{:?}", s.measured);
}

/// The standard health service answers; a client that hangs up in the middle of a cloud-only
/// generation or a speculation session stops costing the verifier forwards and KV blocks.
#[test]
fn grpc_health_and_hung_up_clients_are_freed() {
    use tandem_proto::v1::verifier_client::VerifierClient;
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::{health_client::HealthClient, HealthCheckRequest};
    let (_, tok) = target();
    let url = new_grpc_server(tandem_cloud::grpc::DEFAULT_SATURATION_TOKENS).0;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let p = tok
        .encode_chat("Write a long story about a dragon and a knight.")
        .unwrap();
    rt.block_on(async {
        let ch = tonic::transport::Endpoint::from_shared(url.clone())
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut h = HealthClient::new(ch.clone());
        for service in ["", "tandem.v1.Verifier"] {
            let r = h
                .check(HealthCheckRequest {
                    service: service.into(),
                })
                .await
                .unwrap()
                .into_inner();
            assert_eq!(r.status, ServingStatus::Serving as i32, "{service:?}");
        }
        let unknown = h
            .check(HealthCheckRequest {
                service: "tandem.v9.Nope".into(),
            })
            .await
            .unwrap_err();
        assert_eq!(unknown.code(), tonic::Code::NotFound);

        let mut c = VerifierClient::new(ch);
        let load = |mut c: VerifierClient<tonic::transport::Channel>| async move {
            let r = c
                .info(tandem_proto::v1::InfoRequest {})
                .await
                .unwrap()
                .into_inner();
            r.load.unwrap()
        };
        let mut s = c
            .generate(tandem_proto::v1::GenerateRequest {
                tokenizer_fingerprint: tok.fingerprint().to_string(),
                prompt_ids: p.clone(),
                params: None,
                max_tokens: 500,
            })
            .await
            .unwrap()
            .into_inner();
        for _ in 0..3 {
            s.message().await.unwrap().unwrap();
        }
        let busy = load(c.clone()).await;
        assert_eq!(busy.generations, 1, "{busy:?}");
        assert!(busy.kv_blocks_used > 0, "{busy:?}");
        drop(s);
        let mut freed = None;
        for _ in 0..100 {
            let l = load(c.clone()).await;
            if l.generations == 0 && l.kv_blocks_used == 0 {
                freed = Some(l);
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        let freed = freed.expect("the hung-up generation was not freed within 5 s");
        // It stopped well short of the 500 tokens asked for.
        assert!(
            freed.target_forwards < busy.target_forwards + 100,
            "{busy:?} -> {freed:?}"
        );
    });
}

#[test]
fn speculation_over_real_grpc_is_lossless() {
    let (m, tok) = target();
    let url = grpc_server().clone();
    let p = tok.encode_chat("What is the capital of France?").unwrap();
    let want = greedy(&mut engine(m), SeqId(6), &p, 16);
    for (g, d) in [(4, 1), (3, 3), (8, 4)] {
        let greedy_p = tandem_spec::sampling::SamplingParams::default();
        let out = spec_out(
            &p,
            g,
            d,
            0.0,
            greedy_p,
            tandem_spec::VerifyRule::Greedy,
            16,
            Some(url.clone()),
        );
        let cut = want
            .iter()
            .position(|&t| tok.is_eog(t))
            .map_or(want.len(), |i| i + 1);
        assert_eq!(out.output_ids, want[..cut], "γ={g} depth={d}");
    }
}

#[test]
fn grpc_refuses_bad_sessions_and_drafts_by_name() {
    use tandem_edge::grpc::GrpcLink;
    use tandem_edge::Link;
    let (_, tok) = target();
    let url = grpc_server().clone();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let open = |fp: &str, ids: Vec<u32>| greedy_open(fp, &ids);
    let prompt = tok.encode("The capital of France is").unwrap();
    let err = GrpcLink::connect(&rt, &url, open("0123", prompt.clone()))
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("tokenizer_fingerprint"), "{err}");
    let err = GrpcLink::connect(&rt, &url, open(tok.fingerprint(), vec![1, 999_999]))
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("open.prompt_ids") && err.contains("999999"),
        "{err}"
    );
    let mut long = open(tok.fingerprint(), prompt.clone());
    long.max_tokens = 100_000;
    let err = GrpcLink::connect(&rt, &url, long)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("context length"), "{err}");

    // A bad draft is refused by name and the session goes on.
    let (mut link, opened) =
        GrpcLink::connect(&rt, &url, open(tok.fingerprint(), prompt.clone())).unwrap();
    let start = prompt.len() + 1; // after the committed first token
    let block_at = |tokens: Vec<u32>, index: u64, start_pos: usize| tandem_spec::Block {
        epoch: 0,
        index: tandem_spec::BlockId(index),
        start_pos,
        tokens,
        q: vec![],
        side: vec![],
    };
    let block = |tokens: Vec<u32>, index: u64| block_at(tokens, index, start);
    // Past the tokens the verifier decodes meanwhile (each position once, in order), the next
    // refusal.
    let mut decoded = Vec::new();
    let mut refusal = |link: &mut GrpcLink| loop {
        match link.recv(true) {
            Ok(Some(tandem_spec::Incoming::Decoded(d))) => decoded.push(d.pos),
            Err(e) => break e.to_string(),
            other => panic!("expected a refusal, got {other:?}"),
        }
    };
    link.send(block(vec![5, 999_999], 0)).unwrap();
    let err = refusal(&mut link);
    assert!(
        err.contains("draft.tokens") && err.contains("999999"),
        "{err}"
    );
    link.send(block(vec![5; 9], 1)).unwrap();
    let err = refusal(&mut link);
    assert!(err.contains("granted draft length"), "{err}");
    link.send(block_at(vec![5], 2, start - 2)).unwrap();
    let err = refusal(&mut link);
    assert!(err.contains("starts at position"), "{err}");
    // The session goes on: the verifier keeps decoding it.
    match link.recv(true).unwrap() {
        Some(tandem_spec::Incoming::Decoded(d)) => decoded.push(d.pos),
        other => panic!("expected decoded tokens, got {other:?}"),
    }
    assert_eq!(
        decoded,
        (start..start + decoded.len()).collect::<Vec<_>>(),
        "each position once, in order"
    );
    let _ = opened;

    // An edge that drafts from its Open on: a refused Open comes from its first read, by name
    // (not a lost connection to reopen); on an open session, blocks sent right behind the Open
    // are read once it opens, after `Opened` (the first token's commit), and a bad one is
    // refused by name after it.
    let mut early = GrpcLink::start(&rt, &url, open("0123", prompt.clone())).unwrap();
    match early.recv(true) {
        Err(e @ tandem_edge::EdgeError::NotOpened(_)) => {
            assert!(e.to_string().contains("tokenizer_fingerprint"), "{e}")
        }
        other => panic!("expected the open refused, got {other:?}"),
    }
    let mut early = GrpcLink::start(&rt, &url, open(tok.fingerprint(), prompt.clone())).unwrap();
    let n = prompt.len();
    early.send(block_at(vec![5], 0, n - 1)).unwrap();
    match early.recv(true).unwrap() {
        Some(tandem_spec::Incoming::Opened(o)) => {
            assert_eq!(o.first, opened.first_token, "the same prompt's first token");
            assert!(o.grant.draft_len > 0, "{o:?}");
        }
        other => panic!("expected the first token, got {other:?}"),
    }
    let err = loop {
        match early.recv(true) {
            Ok(Some(tandem_spec::Incoming::Decoded(_))) => {}
            Err(e) => break e.to_string(),
            other => panic!("expected a refusal, got {other:?}"),
        }
    };
    assert!(err.contains("inside the prompt"), "{err}");
}

/// Through the emulated link (real TCP proxy, jitter) the output is still the target's, and the
/// first token costs at least one round trip.
#[test]
fn speculation_through_netem_is_lossless() {
    let (m, tok) = target();
    let upstream: std::net::SocketAddr =
        grpc_server().trim_start_matches("http://").parse().unwrap();
    let addr = on_loopback(move |l| async move {
        let cfg = tandem_client::netem::NetemConfig {
            rtt_ms: 60.0,
            jitter_ms: 10.0,
            ..Default::default()
        };
        tandem_client::netem::proxy(l, upstream, cfg).await.unwrap();
    });
    let url = format!("http://{addr}");
    let p = tok
        .encode("The history of the printing press begins in")
        .unwrap();
    let want = greedy(&mut engine(m), SeqId(7), &p, 16);
    // Through a proxy the test runs, and (last) through the one the edge puts in front of a
    // remote verifier when given both --cloud and --rtt-ms.
    let direct = grpc_server().clone();
    for (g, d, via, rtt) in [(4, 1, &url, 0.0), (4, 3, &url, 0.0), (3, 2, &direct, 60.0)] {
        let greedy_p = tandem_spec::sampling::SamplingParams::default();
        let out = spec_out(
            &p,
            g,
            d,
            rtt,
            greedy_p,
            tandem_spec::VerifyRule::Greedy,
            16,
            Some(via.clone()),
        );
        assert_eq!(out.output_ids, want, "γ={g} depth={d}");
        assert_eq!(out.spec.as_ref().unwrap().rtt_ms, rtt);
        assert!(
            out.ttft_ms >= 50.0,
            "ttft {} ms through a 60 ms link",
            out.ttft_ms
        );
    }
}

/// Cloud-only generation over gRPC streams exactly the target's greedy tokens.
#[test]
fn grpc_generate_is_the_targets_greedy_output() {
    use tandem_proto::v1::verifier_client::VerifierClient;
    let (m, tok) = target();
    let url = grpc_server().clone();
    let p = tok.encode("The capital of France is").unwrap();
    let want = greedy(&mut engine(m), SeqId(8), &p, 12);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let got: Vec<u32> = rt.block_on(async {
        let mut c = VerifierClient::connect(url).await.unwrap();
        let req = tandem_proto::v1::GenerateRequest {
            tokenizer_fingerprint: tok.fingerprint().to_string(),
            prompt_ids: p.clone(),
            params: None,
            max_tokens: 12,
        };
        let mut s = c.generate(req.clone()).await.unwrap().into_inner();
        let mut out = Vec::new();
        while let Some(r) = s.message().await.unwrap() {
            out.extend(r.tokens);
            if r.done {
                break;
            }
        }
        let bad = tandem_proto::v1::GenerateRequest {
            prompt_ids: vec![],
            ..req
        };
        let err = c.generate(bad).await.unwrap_err();
        assert!(err.message().contains("prompt_ids"), "{}", err.message());
        out
    });
    assert_eq!(got, want);
}

/// Token trees on SmolLM2 through a real gRPC verifier. Hand-made trees (the main path right,
/// a side branch right, every path wrong): whatever the verifier decoded before the block
/// landed, every token it commits is the target's, and a verdict names a path of its block. The
/// edge runtime with trees (greedy, and sample-and-match at temperature 0.9): the output is the
/// target's own.
#[test]
fn token_trees_over_real_grpc_commit_the_targets_tokens() {
    use tandem_edge::grpc::{GrpcLink, OpenRequest};
    use tandem_edge::Link;
    use tandem_spec::{Incoming, SideNode};
    let (m, tok) = target();
    let url = grpc_server().clone();
    let prompt = tok.encode_chat("Name three colours.").unwrap();
    let want = greedy(&mut engine(m), SeqId(9), &prompt, 16);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let not = |t: u32| (t + 1) % 1000;
    let w = |i: usize| want[i];
    let side = |parent, token| SideNode {
        parent,
        token,
        point: false,
    };
    let cases: Vec<(&str, Vec<u32>, Vec<SideNode>)> = vec![
        (
            "main path right",
            want[1..9].to_vec(),
            vec![side(4, not(w(5))), side(6, not(w(7)))],
        ),
        (
            "side branch right",
            [&want[1..5], &[not(w(5)), w(6), w(7), w(8)][..]].concat(),
            vec![
                side(2, not(w(3))),
                side(4, w(5)),
                side(9, w(6)),
                side(10, w(7)),
            ],
        ),
        (
            "every path wrong",
            [&want[1..5], &[not(w(5)), not(w(6))][..]].concat(),
            vec![side(4, not(not(w(5)))), side(6, w(7))],
        ),
    ];
    // A tree is granted only as many side nodes as fit one forward with γ and the committed
    // token (the test server: a budget of 64 tokens, γ up to 8).
    let tree_open = |want_side_nodes| OpenRequest {
        want_draft_len: 8,
        want_side_nodes,
        ..greedy_open(tok.fingerprint(), &prompt)
    };
    let (link, opened) = GrpcLink::connect(&rt, &url, tree_open(1000)).unwrap();
    assert_eq!(opened.side_nodes, 64 - 8 - 1);
    link.close();
    let mut side_verdicts = 0;
    // A lane across two blocks: block 0's branch beside its third token runs to its end, and
    // block 1 carries it on from its root (whatever is committed before it), beside a main path
    // that went on from block 0's main path. Committing the lane keeps block 1: it is verified
    // along the lane, not dropped as stale.
    let lane_blocks = {
        let s0 = prompt.len() + 1;
        vec![
            tandem_spec::Block {
                epoch: 0,
                index: tandem_spec::BlockId(0),
                start_pos: s0,
                tokens: vec![w(1), w(2), not(w(3)), not(w(4))],
                q: vec![],
                side: vec![side(2, w(3)), side(4, w(4))],
            },
            tandem_spec::Block {
                epoch: 0,
                index: tandem_spec::BlockId(1),
                start_pos: s0 + 4,
                tokens: vec![not(w(5)), w(6), w(7), w(8)],
                q: vec![],
                side: vec![side(0, w(5)), side(4, w(6)), side(5, w(7)), side(6, w(8))],
            },
        ]
    };
    {
        let (mut link, _) = GrpcLink::connect(&rt, &url, tree_open(8)).unwrap();
        for b in &lane_blocks {
            link.send(b.clone()).unwrap();
        }
        let mut told = vec![w(0)];
        let mut lane_verdicts = 0;
        while told.len() < 16 {
            match link.recv(true).unwrap().expect("a message") {
                Incoming::Decoded(d) => told.push(d.token),
                Incoming::Opened(o) => panic!("a second Opened: {o:?}"),
                Incoming::Verdict(v) => {
                    let b = &lane_blocks[v.block.0 as usize];
                    let path = b.named_path(v.accepted, v.side_end).expect("a path");
                    let known = prompt.len() + told.len() - b.start_pos;
                    told.extend(path[known..].iter().map(|&n| b.token(n).unwrap()));
                    told.push(v.token);
                    lane_verdicts += usize::from(v.block.0 == 1 && v.side_end.is_some());
                    assert_eq!(v.epoch, 0, "a diversion moves no epoch");
                }
            }
        }
        told.truncate(16);
        assert_eq!(told, want, "a lane across two blocks");
        assert_eq!(lane_verdicts, 1, "block 1 was verified along the lane");
        link.close();
    }
    for (name, tokens, side_nodes) in cases {
        let (mut link, opened) = GrpcLink::connect(&rt, &url, tree_open(8)).unwrap();
        assert_eq!((opened.first_token, opened.side_nodes), (w(0), 8));
        let block = tandem_spec::Block {
            epoch: 0,
            index: tandem_spec::BlockId(0),
            start_pos: prompt.len() + 1,
            tokens,
            q: vec![],
            side: side_nodes,
        };
        link.send(block.clone()).unwrap();
        // Every position the verifier tells, once and in order, is the target's.
        let mut told = vec![w(0)];
        while told.len() < 16 {
            match link.recv(true).unwrap().expect("a message") {
                Incoming::Decoded(d) => {
                    assert_eq!(d.pos, prompt.len() + told.len(), "{name}");
                    told.push(d.token);
                }
                Incoming::Opened(o) => panic!("{name}: a second Opened: {o:?}"),
                Incoming::Verdict(v) => {
                    let path = block
                        .named_path(v.accepted, v.side_end)
                        .unwrap_or_else(|| panic!("{name}: {v:?} names no path of the block"));
                    let known = prompt.len() + told.len() - block.start_pos;
                    told.extend(path[known..].iter().map(|&n| block.token(n).unwrap()));
                    told.push(v.token);
                    side_verdicts += usize::from(v.side_end.is_some());
                }
            }
        }
        told.truncate(16);
        assert_eq!(told, want, "{name}");
        link.close();
    }
    eprintln!("{side_verdicts} verdicts ended in a branch");

    // The edge runtime drafting trees: the target's greedy output, and its own sampling. The
    // verifier awaits the blocks, so every tree the edge drafts is judged.
    let url = awaiting_server();
    let cut = want
        .iter()
        .position(|&t| tok.is_eog(t))
        .map_or(want.len(), |i| i + 1);
    let mut sent = 0;
    for (g, d, tree) in [
        (
            4,
            2,
            tandem_spec::TreeConfig {
                side_nodes: 8,
                lanes: 2,
                below: 0.6,
                min_chance: 0.0,
            },
        ),
        (
            3,
            3,
            tandem_spec::TreeConfig {
                side_nodes: 9,
                lanes: 3,
                below: 0.8,
                min_chance: 0.0,
            },
        ),
    ] {
        let out = spec_out_as(
            None,
            &prompt,
            g,
            d,
            0.0,
            tandem_spec::sampling::SamplingParams::default(),
            tandem_spec::VerifyRule::Greedy,
            16,
            Some(url.clone()),
            tree,
        );
        assert_eq!(out.output_ids, want[..cut], "γ={g} depth={d} {tree:?}");
        sent += out.spec.as_ref().unwrap().side_nodes;
    }
    assert!(
        sent > 0,
        "the draft was unsure somewhere: side nodes went out"
    );
    let p = tok.encode("Once upon a time").unwrap();
    let params = tandem_spec::sampling::SamplingParams {
        temperature: 0.9,
        top_k: 40,
        top_p: 0.95,
        seed: 11,
    };
    // Long enough that the draft is unsure somewhere, where it forks lanes.
    const SAMPLED: usize = 40;
    let own = tandem_client::generate::generate(&mut engine(m), tok, &p, SAMPLED, &params, |_| {})
        .unwrap()
        .output_ids;
    let runs = |rule, check: &dyn Fn(&[u32])| {
        let out = spec_out_as(
            None,
            &p,
            4,
            2,
            0.0,
            params,
            rule,
            SAMPLED,
            Some(url.clone()),
            tandem_spec::TreeConfig {
                side_nodes: 8,
                lanes: 2,
                below: 0.9,
                min_chance: 0.0,
            },
        );
        check(&out.output_ids);
        let stats = out.spec.as_ref().unwrap();
        assert!(
            stats.side_nodes > 0,
            "{rule:?}: side nodes went out: {stats:?}"
        );
    };
    runs(tandem_spec::VerifyRule::SampleMatch, &|ids| {
        assert_eq!(ids, own, "sample-and-match over trees")
    });
    // Rejection sampling over trees goes through too (its distribution is tested on the tiny
    // models, crates/edge/tests/distribution.rs): the verifier judges the main tokens with their
    // q and the second draws beside them on what the main token left.
    runs(tandem_spec::VerifyRule::Rejection, &|ids| {
        assert!(
            ids.len() == SAMPLED || ids.last().is_some_and(|&t| tok.is_eog(t)),
            "{ids:?}"
        )
    });
}
