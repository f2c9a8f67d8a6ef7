//! SmolLM2-135M-Instruct for the tests: the files (pulled and made on first use), the models
//! loaded once per test binary, and greedy decoding on the engine as the reference that
//! speculation must reproduce.

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use tandem_engine::{
    Engine, EngineConfig, GgufFile, LlamaModel, SeqChunk, SeqId, Tokenizer, Wanted, WeightMode,
};
use tandem_models::{pull, store};
use tandem_spec::sampling::argmax;

/// The model store: `$TANDEM_HOME`, or the default that `tandem pull` uses.
pub fn home() -> PathBuf {
    pull::home_dir(None)
}

/// The target's GGUF file, pulled (SHA-256 checked) on first use.
pub fn model_path() -> &'static PathBuf {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| pull::ensure_model(&home(), true).expect("pull the model"))
}

/// The default draft's GGUF file (the target's W4A16 copy), made on first use.
pub fn draft_path() -> &'static PathBuf {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| store::ensure_draft(&home(), true).expect("make the draft"))
}

/// The model in the GGUF file at `path`, with its weights as `mode` says, and its tokenizer.
pub fn load(path: &Path, mode: WeightMode) -> (Arc<LlamaModel>, Tokenizer) {
    let mut g = GgufFile::open(path).unwrap();
    let tok = Tokenizer::from_gguf(&g).unwrap();
    (Arc::new(LlamaModel::load(&mut g, mode).unwrap()), tok)
}

/// The target with f32 weights, loaded once per test binary.
pub fn target() -> &'static (Arc<LlamaModel>, Tokenizer) {
    static T: OnceLock<(Arc<LlamaModel>, Tokenizer)> = OnceLock::new();
    T.get_or_init(|| load(model_path(), WeightMode::F32))
}

/// The default draft with its own (4-bit) weights, loaded once per test binary.
pub fn draft() -> &'static (Arc<LlamaModel>, Tokenizer) {
    static DRAFT: OnceLock<(Arc<LlamaModel>, Tokenizer)> = OnceLock::new();
    DRAFT.get_or_init(|| load(draft_path(), WeightMode::Native))
}

/// An engine on `m` with two threads and the default KV cache.
pub fn engine(m: &Arc<LlamaModel>) -> Engine {
    Engine::new(
        m.clone(),
        EngineConfig {
            threads: 2,
            ..EngineConfig::default()
        },
    )
    .unwrap()
}

/// An engine over `m` of its own: one thread, a KV cache of `kv_mb` MiB.
pub fn lone_engine(m: &Arc<LlamaModel>, kv_mb: usize) -> Engine {
    Engine::new(
        m.clone(),
        EngineConfig {
            threads: 1,
            kv_budget_bytes: kv_mb << 20,
            ..EngineConfig::default()
        },
    )
    .unwrap()
}

/// `n` tokens decoded greedily after `prompt`, one forward each, as sequence `seq` (freed after).
pub fn greedy(e: &mut Engine, seq: SeqId, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut out = Vec::new();
    let mut chunk = SeqChunk::new(seq, 0, prompt.to_vec(), Wanted::Last);
    for _ in 0..n {
        let l = e.forward(std::slice::from_ref(&chunk)).unwrap();
        let next = argmax(l.row(0));
        out.push(next);
        chunk = SeqChunk::new(
            seq,
            chunk.start_pos + chunk.tokens.len(),
            vec![next],
            Wanted::Last,
        );
    }
    e.free(seq);
    out
}

/// `n` tokens after `prompt` decoded in-process by the target alone, each drawn by `params` (greedy
/// or sampled by position) from the logits masked by `grammar` (structured outputs), cut after
/// the first end-of-generation token: what a constrained session over `prompt` commits.
pub fn constrained(
    prompt: &[u32],
    n: usize,
    grammar: &tandem_spec::GrammarSource,
    params: &tandem_spec::sampling::SamplingParams,
) -> Vec<u32> {
    let (m, tok) = target();
    constrained_on((m, tok), prompt, n, grammar, params)
}

/// [`constrained`] with model `m` and its tokenizer.
pub fn constrained_on(
    (m, tok): (&Arc<LlamaModel>, &Tokenizer),
    prompt: &[u32],
    n: usize,
    grammar: &tandem_spec::GrammarSource,
    params: &tandem_spec::sampling::SamplingParams,
) -> Vec<u32> {
    let mut e = lone_engine(m, 64);
    let mut g = tok
        .grammar_vocab(m.cfg.vocab)
        .unwrap()
        .compile(grammar)
        .unwrap();
    let seq = SeqId(0);
    let mut out = Vec::new();
    let mut chunk = SeqChunk::new(seq, 0, prompt.to_vec(), Wanted::Last);
    for i in 0..n {
        let l = e.forward(std::slice::from_ref(&chunk)).unwrap();
        let masked = g.mask(l.row(0)).unwrap();
        let next = tandem_spec::sampling::sample(&masked, params, (prompt.len() + i) as u64);
        g.advance(next).unwrap();
        out.push(next);
        if tok.is_eog(next) {
            break;
        }
        chunk = SeqChunk::new(
            seq,
            chunk.start_pos + chunk.tokens.len(),
            vec![next],
            Wanted::Last,
        );
    }
    out
}

/// The target's own logits rows at each token of `output` after `prompt`: row `i` is the one the
/// token `output[i]` was chosen from (one forward over the whole sequence).
pub fn rows_of(prompt: &[u32], output: &[u32]) -> Vec<Vec<f32>> {
    let (m, _) = target();
    let mut e = engine(m);
    let all: Vec<u32> = prompt.iter().chain(output).copied().collect();
    let at: Vec<usize> = (prompt.len() - 1..all.len() - 1).collect();
    let l = e
        .forward(&[SeqChunk::new(SeqId(0), 0, all, Wanted::At(at.clone()))])
        .unwrap();
    (0..at.len()).map(|i| l.row(i).to_vec()).collect()
}

/// The target's greedy continuation of `prompt` (at most `n` tokens, decoded as sequence `seq` on
/// an engine of its own: one thread, a 32 MiB KV cache), cut after its first end-of-generation
/// token: what a greedy session over `prompt` commits.
pub fn target_answer(prompt: &[u32], n: usize, seq: u64) -> Vec<u32> {
    let (m, tok) = target();
    let mut e = lone_engine(m, 32);
    let out = greedy(&mut e, SeqId(seq), prompt, n);
    let cut = out
        .iter()
        .position(|&t| tok.is_eog(t))
        .map_or(out.len(), |i| i + 1);
    out[..cut].to_vec()
}

/// `n` chat prompts, each asking for one fact about a topic of its own (sixteen topics, then
/// they repeat), encoded with the target's chat template.
pub fn fact_prompts(n: usize) -> Vec<Vec<u32>> {
    let (_, tok) = target();
    let topics = [
        "the moon",
        "rivers",
        "honey bees",
        "volcanoes",
        "the piano",
        "glass",
        "owls",
        "tea",
        "bridges",
        "snow",
        "maps",
        "copper",
        "whales",
        "clocks",
        "deserts",
        "paper",
    ];
    topics
        .iter()
        .cycle()
        .take(n)
        .map(|t| {
            tok.encode_chat(&format!("Tell me one fact about {t}."))
                .unwrap()
        })
        .collect()
}
