//! `tandem bench quant --quick`, run for real: drafts made from the target's 4-bit copy (W4A16,
//! W4A4 by activation fake-quantization, a layer-skipping draft), scored on the shipped corpus and
//! run end to end against a real verifier process.

mod common;

use std::process::Command;

use common::*;
use serde_json::Value;

#[test]
fn bench_quant_quick_measures_every_column_and_orders_the_drafts() {
    model_path();
    draft_path();
    let stdout = stdout_of(
        "tandem bench quant",
        Command::new(env!("CARGO_BIN_EXE_tandem")).args(["bench", "quant", "--quick", "--json"]),
    );
    let r: Value = serde_json::from_slice(&stdout).unwrap();
    let target = r["target_perplexity"].as_f64().unwrap();
    assert!(target > 1.0 && target < 100.0, "target perplexity {target}");
    let rows = r["rows"].as_array().unwrap();
    let row = |name: &str| {
        rows.iter()
            .find(|x| x["draft"] == name)
            .unwrap_or_else(|| panic!("no {name} row"))
    };
    let (w4, w4a4, skip) = (row("w4a16-g32"), row("w4a4-g32"), row("w4a16-g32-skip6"));
    for x in [w4, w4a4, skip] {
        assert!(x["perplexity"].as_f64().unwrap() > 1.0, "{x}");
        assert!(x["draft_tok_s"].as_f64().unwrap() > 0.0, "{x}");
        assert!(x["async_itl_ms"].as_f64().unwrap() > 0.0, "{x}");
        assert_eq!(x["same_as_target"], Value::Bool(true), "{x}");
        let a = x["alpha"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&a));
    }
    // The 4-bit draft tracks the target; 4-bit activations do not (the paper's argument).
    let p = |x: &Value| x["perplexity"].as_f64().unwrap();
    assert!(
        p(w4) < 2.0 * target,
        "W4A16 perplexity {} vs {target}",
        p(w4)
    );
    assert!(p(w4a4) > 2.0 * p(w4), "W4A4 {} vs W4A16 {}", p(w4a4), p(w4));
    assert!(w4["alpha"].as_f64().unwrap() > w4a4["alpha"].as_f64().unwrap());
    // The layer-skipping draft leaves out the default block of layers.
    assert_eq!(
        skip["skipped_layers"],
        serde_json::json!([14, 15, 16, 17, 18, 19])
    );
    assert_eq!(w4["skipped_layers"], serde_json::json!([]));
}
