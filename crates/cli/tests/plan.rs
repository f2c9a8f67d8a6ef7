//! `tandem plan` run as a process: the analytic model's recommendations and its refusals.

use std::process::Command;

/// `tandem plan` for α 0.8, an 11 ms draft and a 50 ms round trip, plus `extra`.
fn plan(extra: &[&str]) -> (bool, String, String) {
    let mut args = vec![
        "plan",
        "--alpha",
        "0.8",
        "--draft-ms",
        "11",
        "--rtt-ms",
        "50",
    ];
    args.extend_from_slice(extra);
    tandem(&args)
}

fn tandem(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(args)
        .output()
        .expect("the tandem binary runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn plan_pipelines_alone_and_hands_a_crowd_to_the_verifier() {
    let (ok, out, err) = tandem(&[
        "plan",
        "--alpha",
        "0.9",
        "--draft-ms",
        "10",
        "--rtt-ms",
        "100",
        "--verify-ms",
        "44",
        "--verify-ms-per-token",
        "2.2",
        "--sessions",
        "1,256",
        "--json",
    ]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let alone = &v["plans"][0];
    assert!(alone["best"]["depth"].as_u64().unwrap() >= 2, "{alone}");
    assert!(alone["best"]["itl_ms"].as_f64() < alone["best_sync"]["itl_ms"].as_f64());
    assert!(alone["best"]["itl_ms"].as_f64() < alone["cloud_only"]["itl_ms"].as_f64());
    let crowd = &v["plans"][1];
    assert_eq!(crowd["best"]["gamma"], 0, "{crowd}");
    assert_eq!(crowd["token_budget"], 256);
    assert!((v["forward"]["one_token_ms"].as_f64().unwrap() - 44.0).abs() < 1e-9);
}

#[test]
fn plan_takes_the_roofline_from_the_machine_or_a_bench_report() {
    let machine = [
        "--bandwidth-gbs",
        "10",
        "--gflops",
        "100",
        "--weights-mb",
        "500",
        "--gflop-per-token",
        "0.25",
        "--json",
    ];
    let (ok, out, err) = plan(&machine);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let f = &v["forward"];
    assert!(
        (f["one_token_ms"].as_f64().unwrap() - 50.0).abs() < 1e-9,
        "{v}"
    );
    assert!(
        (f["ms_per_token"].as_f64().unwrap() - 2.5).abs() < 1e-9,
        "{v}"
    );
    let report = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/bench/engine.json");
    let (ok, out, err) = plan(&["--engine-json", report, "--sessions", "1,4,16"]);
    assert!(ok, "{err}");
    assert!(out.contains("| 16 |") && out.contains("ridge"), "{out}");
}

#[test]
fn plan_refuses_bad_input_by_name() {
    let roof = ["--verify-ms", "40", "--gflops", "100"];
    for (extra, want) in [
        (vec!["--alpha", "1.5"], "--alpha"),
        (vec!["--sessions", "0"], "--sessions"),
        (vec!["--max-gamma", "0"], "--max-gamma"),
    ] {
        let args: Vec<&str> = ["plan", "--draft-ms", "10", "--rtt-ms", "50"]
            .into_iter()
            .chain(roof)
            .chain(if extra[0] == "--alpha" {
                vec![]
            } else {
                vec!["--alpha", "0.8"]
            })
            .chain(extra)
            .collect();
        let (ok, _, err) = tandem(&args);
        assert!(!ok && err.contains(want), "{args:?}: {err}");
    }
    let (ok, _, err) = plan(&["--verify-ms", "40", "--gflops=-3"]);
    assert!(!ok && err.contains("--gflops"), "{err}");
    let (ok, _, err) = plan(&[]);
    assert!(!ok && err.contains("--verify-ms"), "{err}");
    let (ok, _, err) = plan(&["--engine-json", "/nonexistent/engine.json"]);
    assert!(!ok && err.contains("/nonexistent/engine.json"), "{err}");
}
