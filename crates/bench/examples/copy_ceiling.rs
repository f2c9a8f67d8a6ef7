//! The most tokens per decode forward the verifier's copies could commit on a copy workload's
//! target outputs (as a `bench latency --workload` report saved them), by way of choosing what
//! to copy: `cargo run --release -p tandem-bench --example copy_ceiling -- data/copy/prompts.json
//! docs/bench/copy.json`.

use anyhow::{bail, Context, Result};
use tandem_bench::latency::{copy_ceilings, read_workload};
use tandem_engine::{GgufFile, Tokenizer};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [workload, report] = &args[..] else {
        bail!("usage: copy_ceiling WORKLOAD.json REPORT.json");
    };
    let home = tandem_models::pull::home_dir(None);
    let model = tandem_models::pull::ensure_model(&home, true)?;
    let tok = Tokenizer::from_gguf(&GgufFile::open(&model)?)?;
    let prompts = read_workload(workload.as_ref(), &tok)?;
    let report: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(report).with_context(|| format!("reading {report}"))?,
    )?;
    let outputs: Vec<Vec<u32>> = serde_json::from_value(report["target_outputs"].clone())
        .context("the report's target_outputs")?;
    if outputs.len() < prompts.len() {
        bail!(
            "{report}: {} outputs for {} requests",
            outputs.len(),
            prompts.len()
        );
    }
    // The report's outputs list the workload's requests first, then the fresh prompts.
    let texts: Vec<(Vec<u32>, Vec<u32>)> = prompts.into_iter().zip(outputs).collect();
    // As many as the verifier feeds at most (`cloud serve --self-draft-max`'s default).
    let guesses = tandem_verifier::VerifierConfig::default().self_draft_max;
    let c = copy_ceilings(&texts, guesses);
    println!(
        "tokens per decode forward, at most {} guesses fed after the longest match: most recent {:.2}, most frequent {:.2}, two most recent {:.2}, oracle {:.2}",
        guesses,
        c.most_recent,
        c.most_frequent,
        c.two_most_recent,
        c.oracle
    );
    Ok(())
}
