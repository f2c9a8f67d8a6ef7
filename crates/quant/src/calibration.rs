//! The calibration text GPTQ collects the target's activations on (`data/calibration/`): the
//! target's own greedy answers, in its chat template, to the chat prompts written for it
//! (`prompts.txt`), which are distinct from the prompts the benchmarks measure α on and from the
//! perplexity corpus. A draft is right when it predicts what the target says next in a chat, so
//! the target's chat turns are the inputs its errors matter on. [`generate`] makes the text
//! (`tandem quantize --write-calibration`); it is shipped, so quantizing never generates.

use std::sync::Arc;

use tandem_engine::{CpuSet, LlamaModel, SeqChunk, SeqId, Tokenizer, Wanted};

use crate::Result;

/// The shipped calibration text.
pub const TEXT: &str = include_str!("../../../data/calibration/smollm2-chat.txt");

/// The prompts it answers, one per line.
pub const PROMPTS: &str = include_str!("../../../data/calibration/prompts.txt");

/// The target's greedy answer (at most `max_tokens` tokens) to each of `prompts`, each rendered
/// with the chat template and closed by the end-of-turn token: all of them decoded together, one
/// ragged batch per step.
pub fn generate(
    model: &Arc<LlamaModel>,
    tok: &Tokenizer,
    prompts: &[&str],
    max_tokens: usize,
    cpus: CpuSet,
    progress: &dyn Fn(usize),
) -> Result<String> {
    let mut e = crate::eval::engine(model, cpus, 1 << 30)?;
    let greedy = |row: &[f32]| {
        row.iter()
            .enumerate()
            .fold(
                (0, f32::NEG_INFINITY),
                |b, (i, &x)| if x > b.1 { (i, x) } else { b },
            )
            .0 as u32
    };
    let prompts: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| tok.encode_chat(p))
        .collect::<std::result::Result<_, _>>()?;
    // Each sequence's tokens so far, and whether it is still answering.
    let mut seqs: Vec<(Vec<u32>, usize, bool)> =
        prompts.iter().map(|p| (p.clone(), p.len(), true)).collect();
    let mut fed = vec![0usize; seqs.len()];
    for step in 0..max_tokens {
        let live: Vec<usize> = (0..seqs.len()).filter(|&i| seqs[i].2).collect();
        if live.is_empty() {
            break;
        }
        let batch: Vec<SeqChunk> = live
            .iter()
            .map(|&i| {
                SeqChunk::new(
                    SeqId(i as u64),
                    fed[i],
                    seqs[i].0[fed[i]..].to_vec(),
                    Wanted::Last,
                )
            })
            .collect();
        let logits = e.forward(&batch)?;
        for (r, &i) in live.iter().enumerate() {
            fed[i] = seqs[i].0.len();
            let t = greedy(logits.row(r));
            seqs[i].0.push(t);
            if tok.is_eog(t) {
                seqs[i].2 = false;
            }
        }
        progress(step + 1);
    }
    let mut text = String::new();
    for (ids, prompt_len, _) in &seqs {
        text += &tok.decode(&ids[..*prompt_len])?;
        let answer = &ids[*prompt_len..];
        let ended = answer.last().is_some_and(|&t| tok.is_eog(t));
        let body = if ended {
            &answer[..answer.len() - 1]
        } else {
            answer
        };
        text += &tok.decode(body)?;
        text += "<|im_end|>\n";
    }
    Ok(text)
}
