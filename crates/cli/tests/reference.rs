//! SmolLM2-135M-Instruct on the engine against the independent numpy reference
//! (`fixtures/make_fixtures.py`): the tokenizer and chat template, the target's logits and greedy
//! output, batching that changes no token, the default draft's agreement with the target, and the
//! draft with 8-bit activations. The model is pulled on first use.

mod common;

use common::*;
use tandem_engine::{SeqChunk, SeqId, Wanted, WeightMode};
use tandem_spec::sampling as sampler;

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

/// The byte-level BPE pre-tokenizers of the other families (Llama 3's `llama-bpe`, `qwen2`) and
/// SmolLM2's own, each on SmolLM2's vocabulary and merges, give llama.cpp's ids
/// (`fixtures/pretokenizers.json`, `fixtures/make_pretokenizer_fixture.py`).
#[test]
fn bpe_pre_tokenizers_give_llama_cpps_ids() {
    use candle_core::quantized::gguf_file::Value;
    let f = fixture("pretokenizers.json");
    for pre in ["smollm", "llama-bpe", "qwen2"] {
        let mut g = tandem_engine::GgufFile::open(model_path()).unwrap();
        g.content
            .metadata
            .insert("tokenizer.ggml.pre".into(), Value::String(pre.into()));
        let tok = tandem_engine::Tokenizer::from_gguf(&g).unwrap();
        let cases = f[pre].as_array().unwrap();
        assert!(cases.len() >= 20);
        for case in cases {
            let text = case["text"].as_str().unwrap();
            assert_eq!(
                tok.encode(text).unwrap(),
                ids(&case["ids"]),
                "{pre}: {text:?}"
            );
        }
    }
    // The three split the corpus differently somewhere (SmolLM2's vocabulary has no token of two
    // digits, so Llama 3's three-digit groups and Qwen's single digits agree on it).
    let differ = |a: &str, b: &str| {
        f[a].as_array()
            .unwrap()
            .iter()
            .zip(f[b].as_array().unwrap())
            .filter(|(x, y)| x["ids"] != y["ids"])
            .count()
    };
    assert!(differ("smollm", "llama-bpe") > 0 && differ("smollm", "qwen2") > 0);
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
        let margins = floats(&case["top2_margin"]);
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
