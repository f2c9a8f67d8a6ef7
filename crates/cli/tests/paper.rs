//! `tandem bench paper --quick`, run for real as CI's smoke test of the whole comparison: a real
//! verifier process, real edges over netem, synthetic edges under load, the simulator and the
//! model. Its own sanity checks must pass (every mode produced tokens, every output is the
//! target's, the plots are PNGs), and the report must hold every part the full run has.
//! It has its own test binary so that it does not share the cores with the other tests.

mod common;

use std::process::Command;

use common::*;
use serde_json::Value;

#[test]
fn bench_paper_quick_runs_checks_itself_and_writes_every_part() {
    model_path();
    draft_path();
    let dir = std::env::temp_dir().join(format!("tandem-paper-{}", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["bench", "paper", "--quick", "--out"])
        .arg(&dir)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "bench paper --quick failed:\n{stderr}"
    );
    let md = String::from_utf8_lossy(&out.stdout);
    let r: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("results.json")).unwrap()).unwrap();
    // Sanity checks: all present and all passed.
    let sanity = r["sanity"].as_array().unwrap();
    assert!(sanity.len() >= 8, "{sanity:?}");
    for c in sanity {
        assert_eq!(c["ok"], Value::Bool(true), "{c}");
    }
    // Every mode of the one-session sweep at every RTT, outputs equal to the target's.
    let rows = r["latency"]["rows"].as_array().unwrap();
    for rtt in [0.0, 50.0] {
        for mode in ["cloud-only", "sync", "async"] {
            let row = rows
                .iter()
                .find(|x| x["mode"] == mode && x["rtt_ms"].as_f64() == Some(rtt))
                .unwrap_or_else(|| panic!("no {mode} row at RTT {rtt}"));
            assert_eq!(row["same_as_target"], Value::Bool(true), "{row}");
            assert!(row["tokens"].as_u64().unwrap() > 0);
        }
    }
    assert!(rows.iter().any(|x| x["mode"] == "edge-only"));
    // Under load: cloud-only and speculation at 1 and 4 sessions, no wrong session.
    let load = r["load"][0]["rows"].as_array().unwrap();
    for n in [1, 4] {
        for mode in ["cloud-only", "async"] {
            let row = load
                .iter()
                .find(|x| x["mode"] == mode && x["sessions"] == n)
                .unwrap_or_else(|| panic!("no {mode} row at {n} sessions"));
            assert!(row["throughput_tok_s"].as_f64().unwrap() > 0.0, "{row}");
            assert_eq!(row["mismatches"], 0, "{row}");
        }
    }
    // The model beside each speculative measurement, and the simulator beside each load row.
    let checks = r["checks"].as_array().unwrap();
    assert!(checks.iter().any(|c| c["setting"] == "1 session"));
    assert!(checks
        .iter()
        .any(|c| c["setting"] == "load" && c["simulated"].as_f64().is_some()));
    for c in checks {
        assert!(c["predicted"].as_f64().unwrap() > 0.0, "{c}");
    }
    // The simulator covered every RTT × sessions × mode.
    assert_eq!(r["simulated"].as_array().unwrap().len(), 2 * 2 * 2);
    // α and E[A] per draft.
    let d = &r["drafts"][0];
    assert!(d["alpha"].as_f64().unwrap() > 0.0 && d["size_mb"].as_f64().unwrap() > 10.0);
    // The plots and the Markdown that shows them.
    for p in r["plots"].as_array().unwrap() {
        let name = p.as_str().unwrap();
        assert!(
            md.contains(&format!("({name})")),
            "results.md does not show {name}"
        );
        assert!(std::fs::metadata(dir.join(name)).unwrap().len() > 2048);
    }
    assert_eq!(r["plots"].as_array().unwrap().len(), 5);
    assert_eq!(
        std::fs::read_to_string(dir.join("results.md")).unwrap(),
        md.to_string()
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// Settings are checked before the first measurement, and the error names the flag.
#[test]
fn bench_paper_refuses_bad_settings_by_name_before_measuring() {
    model_path();
    draft_path();
    for (flag, value) in [
        ("--sessions", "4,0"),
        ("--load-rtts", "-5"),
        ("--rtts", "NaN"),
        ("--tokens", "1"),
    ] {
        let dir = std::env::temp_dir().join(format!(
            "tandem-paper-refused-{}-{}",
            std::process::id(),
            flag.trim_start_matches('-')
        ));
        let _ = std::fs::remove_dir_all(&dir);
        let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
            .args([
                "bench",
                "paper",
                "--quick",
                &format!("{flag}={value}"),
                "--out",
            ])
            .arg(&dir)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flag} {value} was accepted");
        assert!(err.contains(flag), "{flag} {value}: {err}");
        assert!(
            !err.contains("one session, real edges"),
            "{flag} {value}: refused only after measuring"
        );
        // Nothing was measured, so nothing was written.
        assert!(!dir.join("results.json").exists(), "{flag} {value}");
    }
}
