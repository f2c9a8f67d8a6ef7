//! Gemma 3 270M, pulled on first use (`tandem pull gemma3-270m`), against llama.cpp on the same
//! weights (`fixtures/gemma3.json`, made by `fixtures/make_peer_fixture.py` on the F32 copy of
//! the file): the SentencePiece tokenizer's ids on a multilingual corpus with code, emoji and
//! whitespace runs, the target's first logits and greedy tokens; speculation with a W4A16 draft
//! of it through a real verifier gives the target's tokens; and a verifier serving Gemma refuses
//! a SmolLM2 draft at Open, naming both tokenizers.

mod common;

use std::sync::{Arc, OnceLock};

use common::*;
use tandem_engine::{GgufFile, LlamaModel, Tokenizer, WeightMode};
use tandem_models::{pull, store};

/// A step whose top-2 logit margin (llama.cpp's) is below this may flip between the two
/// engines: their logits differ by up to 0.032 over the fixture's 512 steps (f32 arithmetic in
/// another order, llama.cpp's f16 KV cache and table-driven GELU), so a margin under twice that
/// can change order; 0.1 leaves room.
const NEAR_TIE: f64 = 0.1;

fn gemma_path() -> &'static std::path::PathBuf {
    static P: OnceLock<std::path::PathBuf> = OnceLock::new();
    P.get_or_init(|| pull::ensure(&home(), &pull::GEMMA3, true).expect("pull gemma3-270m"))
}

fn gemma() -> &'static (Arc<LlamaModel>, Tokenizer) {
    static M: OnceLock<(Arc<LlamaModel>, Tokenizer)> = OnceLock::new();
    M.get_or_init(|| load(gemma_path(), WeightMode::F32))
}

#[test]
fn gemma_tokenizer_gives_llama_cpps_ids() {
    let (_, tok) = gemma();
    let f = fixture("gemma3.json");
    let cases = f["tokenizer"].as_array().unwrap();
    assert!(cases.len() >= 20);
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let want = ids(&case["ids"]);
        assert_eq!(tok.encode(text).unwrap(), want, "encoding {text:?}");
        // Without the BOS the model adds, the ids spell the text again.
        assert_eq!(want[0], 2, "BOS first");
        assert_eq!(tok.decode(&want[1..]).unwrap(), text, "decoding {text:?}");
    }
    // The chat turn format (the GGUF carries no template: Tandem's own of Gemma's).
    let turn = tok
        .encode_chat("Hi")
        .map(|ids| tok.decode(&ids).unwrap())
        .unwrap();
    assert_eq!(
        turn,
        "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    );
    assert!(
        tok.is_eog(106) && tok.is_eog(1),
        "<end_of_turn> and <eos> end generation"
    );
}

#[test]
fn gemma_target_gives_llama_cpps_logits_and_greedy_tokens() {
    let (m, _) = gemma();
    let (compared, worst) = against_peer(m, "gemma3.json", NEAR_TIE);
    // The first step's highest logits, within twice the measured difference.
    assert!(worst < 0.065, "first logits off by {worst}");
    assert!(
        compared >= 100,
        "only {compared} greedy steps were clear of near-ties"
    );
}

/// A W4A16 draft of Gemma (round-to-nearest: seconds to make, where GPTQ takes minutes) through
/// an in-process gRPC verifier, async with two blocks in flight behind a 20 ms link: the
/// target's greedy tokens.
#[test]
fn gemma_speculation_gives_the_targets_tokens() {
    let (m, tok) = gemma();
    let cfg = tandem_quant::QuantConfig::default();
    let draft_path = store::ensure_quantized_of(&home(), &pull::GEMMA3, &cfg, true).unwrap();
    let mut g = GgufFile::open(&draft_path).unwrap();
    let dtok = Tokenizer::from_gguf(&g).unwrap();
    assert_eq!(dtok.fingerprint(), tok.fingerprint());
    let draft = Arc::new(LlamaModel::load(&mut g, WeightMode::Native).unwrap());
    let prompt = tok.encode_chat("Name three primary colors.").unwrap();
    let want = greedy(&mut engine(m), tandem_engine::SeqId(3), &prompt, 40);
    // A verifier that waits for the edge's blocks: some are judged however fast the machine
    // (one that never idles a session may decode every token before a block lands).
    let (url, _) = awaiting_server_of((m, tok, "gemma-3-270m"));
    let out = speculate_pair((m, &draft), tok, &prompt, 40, (3, 2), (&url, 20.0));
    let n = out.output_ids.len();
    assert!(n > 0);
    assert_eq!(out.output_ids, want[..n], "speculation changed a token");
    let s = out.spec.as_ref().unwrap();
    assert!(s.accepted_draft_tokens > 0, "no draft token was accepted");
}

/// `tandem cloud serve --model gemma3-270m` refuses a SmolLM2 draft at Open, naming both
/// tokenizers' fingerprints; the same edge against a SmolLM2 verifier runs.
#[test]
fn a_verifier_serving_gemma_refuses_a_smollm2_draft_by_name() {
    gemma_path();
    assert_refuses_smollm2_draft("gemma3-270m", gemma().1.fingerprint());
}
