//! The usage ledger against real processes: `tandem cloud serve --tenants … --ledger FILE` serves
//! speculation and cloud-only generations of two tenants (`tandem generate` as the edges); once
//! it has stopped (SIGTERM, a drain), `tandem cloud usage --json` holds per tenant exactly what
//! the edges saw — sessions, prompt tokens, committed tokens, accepted draft tokens and the
//! verifier's own —, and a restarted verifier adds to it. The ledger holds counts, never content.

mod common;

use std::path::Path;
use std::process::Command;

use common::*;
use serde_json::Value;

const KEY_A: &str = "tk-ledger-tenant-a-000";
const KEY_B: &str = "tk-ledger-tenant-b-000";

fn serve(tenants: &Path, ledger: &Path) -> Proc {
    let (t, l) = (tenants.to_str().unwrap(), ledger.to_str().unwrap());
    // Fixed grants and awaited drafts: the verifier neither takes a session over nor decodes
    // one alone while its edge sends a block within 5 s, so every block the speculation
    // sessions send is judged. Otherwise, with a
    // draft slower than the target (an AVX2 CPU, a busy machine), every token can be the
    // verifier's, and the accepted drafts below would count nothing.
    verifier(&[
        "--tenants",
        t,
        "--ledger",
        l,
        "--drain-timeout-s",
        "5",
        "--fixed-grants",
        "--await-drafts-ms",
        "5000",
    ])
}

/// SIGTERM, and wait for the drain to end the process.
fn stop(mut p: Proc) {
    let status = p.terminate();
    assert!(status.success(), "the verifier exited with {status}");
}

/// One edge's run: its JSON.
fn edge(port: u16, key: &str, mode: &str, prompt: &str, tokens: usize) -> Value {
    let stdout = stdout_of(
        "tandem generate",
        Command::new(env!("CARGO_BIN_EXE_tandem"))
            .args(["generate", "--model", "draft", "--mode", mode])
            .args(["--cloud", &format!("http://127.0.0.1:{port}")])
            .args(["--api-key", key, "--chat", "--prompt", prompt, "--json"])
            .args(["--max-tokens", &tokens.to_string()]),
    );
    serde_json::from_slice(&stdout).unwrap()
}

/// What the edges saw, per tenant: sessions, prompt, committed, accepted draft and the
/// verifier's tokens.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
struct Seen([u64; 5]);

impl Seen {
    fn add(&mut self, v: &Value) {
        let n = |k: &str| v[k].as_array().map_or(0, |a| a.len() as u64);
        let committed = n("output_ids");
        let accepted = v["accepted_draft_tokens"].as_u64().unwrap_or(0);
        self.0[0] += 1;
        self.0[1] += n("prompt_ids");
        self.0[2] += committed;
        self.0[3] += accepted;
        self.0[4] += committed - accepted;
    }
}

fn usage(ledger: &Path) -> Vec<Value> {
    let stdout = stdout_of(
        "tandem cloud usage",
        Command::new(env!("CARGO_BIN_EXE_tandem"))
            .args(["cloud", "usage", "--json", "--ledger"])
            .arg(ledger),
    );
    serde_json::from_slice::<Value>(&stdout)
        .unwrap()
        .as_array()
        .unwrap()
        .clone()
}

fn totals(rows: &[Value], tenant: &str) -> Seen {
    let r = rows
        .iter()
        .find(|r| r["tenant"] == tenant)
        .unwrap_or_else(|| panic!("no row for {tenant}: {rows:?}"));
    let n = |k: &str| r[k].as_u64().unwrap();
    Seen([
        n("sessions"),
        n("prompt_tokens"),
        n("committed_tokens"),
        n("accepted_draft_tokens"),
        n("cloud_tokens"),
    ])
}

#[test]
fn the_ledger_holds_what_the_edges_saw_and_survives_a_restart() {
    model_path();
    draft_path();
    let dir = std::env::temp_dir().join(format!("tandem-ledger-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let tenants = dir.join("tenants.toml");
    std::fs::write(
        &tenants,
        format!(
            "[[tenant]]\nname = \"a\"\nkeys = [\"{KEY_A}\"]\n\n[[tenant]]\nname = \"b\"\nkeys = [\"{KEY_B}\"]\n"
        ),
    )
    .unwrap();
    let ledger = dir.join("ledger.sqlite");
    let (mut a, mut b) = (Seen::default(), Seen::default());

    let verifier = serve(&tenants, &ledger);
    let port = verifier.port;
    // Some drafts must be accepted for the check below to mean anything: every block is
    // judged (see `serve`), and the draft is right about 85% of the time.
    a.add(&edge(port, KEY_A, "async", "Name three colours.", 24));
    a.add(&edge(port, KEY_A, "cloud", "Say hello.", 8));
    b.add(&edge(port, KEY_B, "async", "What is a bicycle?", 16));
    stop(verifier);
    let rows = usage(&ledger);
    assert_eq!(totals(&rows, "a"), a, "tenant a: {rows:?}");
    assert_eq!(totals(&rows, "b"), b, "tenant b: {rows:?}");
    assert!(a.0[3] > 0, "some drafts were accepted: {a:?}");

    // A restarted verifier keeps the rows and adds to them.
    let verifier = serve(&tenants, &ledger);
    let port = verifier.port;
    b.add(&edge(port, KEY_B, "sync", "Count to five.", 12));
    stop(verifier);
    let rows = usage(&ledger);
    assert_eq!(totals(&rows, "a"), a);
    assert_eq!(totals(&rows, "b"), b);

    // Counts, never content: no column holds text but the tenant's name and the reason.
    let c = tandem_cloud::ledger::open(&ledger).unwrap();
    let q = c.prepare("SELECT * FROM sessions LIMIT 1").unwrap();
    let cols: Vec<String> = q.column_names().iter().map(|s| s.to_string()).collect();
    assert!(
        cols.iter()
            .all(|c| !c.contains("text") && !c.contains("token_ids") && !c.contains("prompt_ids")),
        "{cols:?}"
    );
    drop(q);
    drop(c);
    let _ = std::fs::remove_dir_all(&dir);
}
