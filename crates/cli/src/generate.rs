//! `tandem quantize` and `tandem info` (`generate` and `demo` are the client's:
//! `tandem_client::commands`).

use super::*;

#[derive(Args)]
pub(crate) struct PullArgs {
    /// smollm2-135m, gemma3-270m, qwen2.5-coder-1.5b or qwen2.5-coder-0.5b.
    #[arg(default_value = "smollm2-135m")]
    pub(crate) name: String,
}

#[derive(Args)]
pub(crate) struct QuantizeArgs {
    /// The model to quantize: a model of the catalog (smollm2-135m, gemma3-270m,
    /// qwen2.5-coder-1.5b, qwen2.5-coder-0.5b).
    #[arg(long, default_value = "smollm2-135m")]
    model: String,
    /// w4a16, w8a16, or f32 (no quantization: the target as an f32 GGUF).
    #[arg(long, default_value = "w4a16")]
    scheme: Scheme,
    /// rtn (round to nearest) or gptq (error feedback, calibrated on the target's activations
    /// over the shipped calibration text: data/calibration/).
    #[arg(long, default_value = "rtn")]
    method: Method,
    /// Weights per scale: 32, 64 or 128.
    #[arg(long, default_value_t = 32)]
    group_size: usize,
    /// Embedding / tied output head: q8_0, f16, f32 or q4_0.
    #[arg(long, default_value = "q8_0")]
    embedding: EmbedPrecision,
    /// A draft head over this many of the most frequent tokens (FR-Spec; default: the whole
    /// vocabulary). The file keeps the whole head (llama.cpp reads it as ever); Tandem scores
    /// only these tokens, the target still judges over all.
    #[arg(long)]
    draft_vocab: Option<usize>,
    /// Output file (default: <home>/models/<model's stem>.<scheme>-g<group>.gguf).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    /// Instead of quantizing: write the calibration text (the target's greedy answers to
    /// data/calibration/prompts.txt, at most 192 tokens each) to this file.
    #[arg(long, value_name = "FILE")]
    write_calibration: Option<PathBuf>,
}

#[derive(Args)]
pub(crate) struct InfoArgs {
    #[arg(long, default_value = "target")]
    model: ModelSpec,
}

pub(crate) fn cmd_quantize(home: &std::path::Path, a: QuantizeArgs) -> Result<()> {
    if let Some(out) = &a.write_calibration {
        return write_calibration(home, out);
    }
    let cfg = QuantConfig {
        scheme: a.scheme,
        method: a.method,
        group_size: a.group_size,
        embedding: a.embedding,
        draft_vocab: a.draft_vocab,
    };
    cfg.validate()?;
    let model = pull::find(&a.model).ok_or_else(|| {
        anyhow::anyhow!(
            "--model {}: no model of the catalog ({})",
            a.model,
            pull::names()
        )
    })?;
    let out = a
        .out
        .unwrap_or_else(|| models::quantized_path_of(home, model, &cfg));
    let r = models::quantize_model(home, model, &cfg, &out, a.json)?;
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
    let out_err = r.per_layer_output();
    println!("| layer | mean relative weight error | mean relative output error (calibration) |\n|---|---|---|");
    for (l, e) in r.per_layer() {
        let o = out_err
            .get(&l)
            .map_or("-".to_string(), |o| format!("{o:.4}"));
        println!("| {l} | {e:.4} | {o} |");
    }
    for t in r.tensors.iter().filter(|t| t.layer.is_none()) {
        println!("| {} ({}) | {:.4} |", t.name, t.format, t.rel_error);
    }
    Ok(())
}

/// The calibration text: the target's greedy answers to the shipped calibration prompts.
fn write_calibration(home: &std::path::Path, out: &std::path::Path) -> Result<()> {
    use tandem_quant::calibration;
    let target = models::load(home, &ModelSpec::TARGET, None, false)?;
    let prompts: Vec<&str> = calibration::PROMPTS
        .lines()
        .filter(|l| !l.trim().is_empty())
        .collect();
    let max_tokens = 192;
    let bar = indicatif::ProgressBar::new(max_tokens as u64);
    bar.set_message(format!("answering {} prompts", prompts.len()));
    let cpus = tandem_engine::CpuSet::allowed().unwrap_or_default();
    let text = calibration::generate(
        &target.model,
        &target.tokenizer,
        &prompts,
        max_tokens,
        cpus,
        &|step| bar.set_position(step as u64),
    )?;
    bar.finish_and_clear();
    std::fs::write(out, &text).with_context(|| format!("writing {}", out.display()))?;
    let tokens = target.tokenizer.encode(&text)?.len();
    println!(
        "wrote {} ({} prompts, {tokens} tokens)",
        out.display(),
        prompts.len()
    );
    Ok(())
}

pub(crate) fn cmd_info(home: &std::path::Path, a: InfoArgs) -> Result<()> {
    let m = models::load(home, &a.model, None, false)?;
    let info = serde_json::json!({
        "path": m.path,
        "config": m.model.cfg,
        "weights": m.model.format(),
        "bytes_per_token": m.model.bytes_per_token(),
        "head_tokens": m.model.head_vocab().map_or(m.model.cfg.vocab, |v| v.len()),
        "tokenizer_fingerprint": m.tokenizer.fingerprint(),
    });
    println!("{}", serde_json::to_string_pretty(&info)?);
    Ok(())
}
