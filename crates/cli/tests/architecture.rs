//! The dependency rules `docs/ARCHITECTURE.md` states, checked on the workspace's resolved graph
//! (`cargo metadata`, offline, as locked): a crate "links" a package when a chain of normal
//! (not dev, not build) dependencies leads from it to the package.
//!
//! - The IO-free cores, `tandem-spec` and `tandem-sched`, link no async runtime, RPC stack or
//!   engine: no tokio, tonic, candle or `tandem-engine`.
//! - The simulator links no server stack: no tonic, axum or prometheus.
//! - Only the binary (`tandem-cli`) depends on `tandem-bench`.
//! - The test-only support crate, `tandem-testkit`, is only ever a dev-dependency.
//! - No dev-dependency closes a cycle: a crate's tests never depend on a crate that links it
//!   (as the edge's tests once did on the benchmarks, which link the edge).
//!
//! A broken rule names the chain that breaks it.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::process::Command;

/// The workspace's graph of normal dependencies, and its members' dev-dependencies, by package
/// name.
struct Graph {
    deps: BTreeMap<String, BTreeSet<String>>,
    dev: BTreeMap<String, BTreeSet<String>>,
    members: BTreeSet<String>,
}

impl Graph {
    fn load() -> Self {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
        // This machine's platform only: the others' dependencies are not downloaded.
        let rustc = Command::new("rustc")
            .arg("-vV")
            .output()
            .expect("running rustc -vV");
        let host = String::from_utf8_lossy(&rustc.stdout)
            .lines()
            .find_map(|l| l.strip_prefix("host: ").map(str::to_string))
            .expect("rustc -vV names the host");
        let out = Command::new(cargo)
            .args(["metadata", "--format-version", "1", "--offline", "--locked"])
            .args(["--filter-platform", &host])
            .current_dir(root)
            .output()
            .expect("running cargo metadata");
        assert!(
            out.status.success(),
            "cargo metadata failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let m: serde_json::Value = serde_json::from_slice(&out.stdout).expect("its JSON");
        let name_of: BTreeMap<&str, &str> = m["packages"]
            .as_array()
            .expect("packages")
            .iter()
            .map(|p| (p["id"].as_str().unwrap(), p["name"].as_str().unwrap()))
            .collect();
        let members = m["workspace_members"]
            .as_array()
            .expect("workspace_members")
            .iter()
            .map(|id| name_of[id.as_str().unwrap()].to_string())
            .collect();
        let mut deps: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        let mut dev: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for node in m["resolve"]["nodes"].as_array().expect("resolve.nodes") {
            let from = name_of[node["id"].as_str().unwrap()].to_string();
            deps.entry(from.clone()).or_default();
            for d in node["deps"].as_array().expect("deps") {
                let to = name_of[d["pkg"].as_str().unwrap()].to_string();
                for k in d["dep_kinds"].as_array().expect("dep_kinds") {
                    let into = match k["kind"].as_str() {
                        None => &mut deps,
                        Some("dev") => &mut dev,
                        Some(_) => continue,
                    };
                    into.entry(from.clone()).or_default().insert(to.clone());
                }
            }
        }
        Self { deps, dev, members }
    }

    /// The chain of normal dependencies from `from` to the first package that `bad` picks, if
    /// any (breadth first: the shortest).
    fn path_to(&self, from: &str, bad: impl Fn(&str) -> bool) -> Option<Vec<String>> {
        let mut parent: BTreeMap<&str, &str> = BTreeMap::new();
        let mut queue = VecDeque::from([from]);
        let mut seen = BTreeSet::from([from]);
        while let Some(at) = queue.pop_front() {
            for d in self.deps.get(at).into_iter().flatten() {
                if !seen.insert(d.as_str()) {
                    continue;
                }
                parent.insert(d.as_str(), at);
                if bad(d) {
                    let mut path = vec![d.clone()];
                    let mut p = at;
                    while p != from {
                        path.push(p.to_string());
                        p = parent[p];
                    }
                    path.push(from.to_string());
                    path.reverse();
                    return Some(path);
                }
                queue.push_back(d.as_str());
            }
        }
        None
    }
}

/// Every rule broken in `g`, one line each.
fn broken(g: &Graph) -> Vec<String> {
    let mut out = Vec::new();
    let mut forbid = |krate: &str, what: &str, bad: &dyn Fn(&str) -> bool| {
        if let Some(p) = g.path_to(krate, bad) {
            out.push(format!("{krate} links {what}: {}", p.join(" -> ")));
        }
    };
    for core in ["tandem-spec", "tandem-sched"] {
        forbid(core, "an async runtime, an RPC stack or the engine", &|n| {
            n == "tokio" || n == "tonic" || n.starts_with("candle") || n == "tandem-engine"
        });
    }
    forbid("tandem-sim", "a server stack", &|n| {
        matches!(n, "tonic" | "axum" | "prometheus")
    });
    for m in &g.members {
        let on_bench = g.deps[m].contains("tandem-bench")
            || g.dev.get(m).is_some_and(|d| d.contains("tandem-bench"));
        if m != "tandem-cli" && m != "tandem-bench" && on_bench {
            out.push(format!("{m} depends on tandem-bench (only the binary may)"));
        }
        if g.deps[m].contains("tandem-testkit") {
            out.push(format!("{m} depends on tandem-testkit (only tests may)"));
        }
        for d in g.dev.get(m).into_iter().flatten() {
            if d == m || !g.members.contains(d) {
                continue;
            }
            if let Some(p) = g.path_to(d, |n| n == m) {
                out.push(format!(
                    "{m}'s tests depend on {d}, which links {m}: {}",
                    p.join(" -> ")
                ));
            }
        }
    }
    out
}

#[test]
fn the_dependency_rules_of_the_architecture_page_hold() {
    let g = Graph::load();
    for krate in [
        "tandem-spec",
        "tandem-sched",
        "tandem-sim",
        "tandem-bench",
        "tandem-testkit",
    ] {
        assert!(
            g.members.contains(krate),
            "{krate} is not a workspace member"
        );
    }
    let broken = broken(&g);
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}

#[test]
fn a_broken_rule_is_found_and_named_by_its_chain() {
    // The real graph with one planted edge each: the scheduler through the protocol crate to
    // tonic, the edge on the benchmarks, the cloud on the test support, and the edge's tests on
    // the client (which links the edge).
    let mut g = Graph::load();
    g.deps
        .get_mut("tandem-sched")
        .unwrap()
        .insert("tandem-proto".into());
    g.deps
        .get_mut("tandem-edge")
        .unwrap()
        .insert("tandem-bench".into());
    g.dev
        .entry("tandem-edge".into())
        .or_default()
        .insert("tandem-client".into());
    g.deps
        .get_mut("tandem-cloud")
        .unwrap()
        .insert("tandem-testkit".into());
    let broken = broken(&g);
    assert!(
        broken.iter().any(|l| l.starts_with("tandem-sched links")
            && l.contains("tandem-sched -> tandem-proto -> ")),
        "{broken:?}"
    );
    assert!(
        broken
            .iter()
            .any(|l| l == "tandem-edge depends on tandem-bench (only the binary may)"),
        "{broken:?}"
    );
    assert!(
        broken
            .iter()
            .any(|l| l == "tandem-cloud depends on tandem-testkit (only tests may)"),
        "{broken:?}"
    );
    assert!(
        broken.iter().any(|l| l.starts_with(
            "tandem-edge's tests depend on tandem-client, which links tandem-edge: tandem-client -> "
        ) && l.ends_with(" -> tandem-edge")),
        "{broken:?}"
    );
}
