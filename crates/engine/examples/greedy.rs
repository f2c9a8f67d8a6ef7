//! Greedy decoding and tokenization of a GGUF model, written as JSON for comparing Tandem with
//! another engine on the same file (`scripts/peer_check.py` runs llama.cpp beside it).
//!
//! ```sh
//! cargo run --release -p tandem-engine --example greedy -- MODEL TEXTS.json OUT.json [STEPS]
//! ```
//! `TEXTS.json` is a list of strings. For each, `OUT.json` holds its ids (the model's own
//! tokenization: special tokens matched, BOS where the model adds one) and, when `STEPS` > 0
//! (default 64), the greedy continuation of those ids (f32 weights) with, at each step, the
//! eight highest logits (`[id, logit]`) and the margin between the first two.

use std::sync::Arc;

use serde::Serialize;
use tandem_engine::{
    Engine, EngineConfig, GgufFile, LlamaModel, SeqChunk, SeqId, Tokenizer, Wanted, WeightMode,
};

#[derive(Serialize)]
struct Out {
    text: String,
    ids: Vec<u32>,
    greedy: Vec<u32>,
    top: Vec<Vec<(u32, f32)>>,
    margin: Vec<f32>,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [model, texts, out, rest @ ..] = args.as_slice() else {
        return Err("usage: greedy MODEL TEXTS.json OUT.json [STEPS]".into());
    };
    let steps: usize = rest.first().map_or(Ok(64), |s| s.parse())?;
    let texts: Vec<String> = serde_json::from_str(&std::fs::read_to_string(texts)?)?;
    let mut g = GgufFile::open(std::path::Path::new(model))?;
    let tok = Tokenizer::from_gguf(&g)?;
    let model = if steps > 0 {
        Some(Arc::new(LlamaModel::load(&mut g, WeightMode::F32)?))
    } else {
        None
    };
    let mut results = Vec::new();
    for text in texts {
        let ids = tok.encode(&text)?;
        let (mut greedy, mut top, mut margin) = (Vec::new(), Vec::new(), Vec::new());
        if let Some(m) = &model {
            let mut engine = Engine::new(m.clone(), EngineConfig::default())?;
            let mut feed = ids.clone();
            let mut pos = 0;
            for _ in 0..steps {
                let n = feed.len();
                let logits = engine.forward(&[SeqChunk::new(SeqId(0), pos, feed, Wanted::Last)])?;
                pos += n;
                let row = logits.row(0);
                let mut order: Vec<usize> = (0..row.len()).collect();
                order.select_nth_unstable_by(8, |&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
                let mut best: Vec<usize> = order[..8].to_vec();
                best.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
                top.push(best.iter().map(|&i| (i as u32, row[i])).collect());
                margin.push(row[best[0]] - row[best[1]]);
                let next = best[0] as u32;
                greedy.push(next);
                if tok.is_eog(next) {
                    break;
                }
                feed = vec![next];
            }
        }
        results.push(Out {
            text,
            ids,
            greedy,
            top,
            margin,
        });
    }
    std::fs::write(out, serde_json::to_string(&results)?)?;
    Ok(())
}
