//! The shipped deployment files, read as a cluster would read them (kubectl and kubeconform cannot
//! be installed here): every manifest parses, and the fields that make a rollout safe hold — the
//! probes ask the verifier's plaintext health listener for the right services, the ports and
//! secrets line up with the flags, every flag is one `tandem cloud serve` takes, and termination
//! waits for the drain. (The nginx configuration is run, `nginx -t` first, in front of real
//! replicas in `deploy_failover.rs`.)

use std::path::{Path, PathBuf};

use yaml_rust2::{Yaml, YamlLoader};

fn k8s_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/k8s")
}

/// Every document of every manifest, with its file's name.
fn manifests() -> Vec<(String, Yaml)> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(k8s_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    assert!(!files.is_empty());
    let mut out = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        let docs = YamlLoader::load_from_str(&text)
            .unwrap_or_else(|e| panic!("{}: not YAML: {e}", f.display()));
        for d in docs {
            assert!(
                d["apiVersion"].as_str().is_some() && d["kind"].as_str().is_some(),
                "{}: a manifest names its apiVersion and kind",
                f.display()
            );
            out.push((f.file_name().unwrap().to_string_lossy().into_owned(), d));
        }
    }
    out
}

fn of_kind<'a>(all: &'a [(String, Yaml)], kind: &str) -> Vec<&'a Yaml> {
    all.iter()
        .filter(|(_, d)| d["kind"].as_str() == Some(kind))
        .map(|(_, d)| d)
        .collect()
}

fn strs(y: &Yaml) -> Vec<String> {
    y.as_vec()
        .unwrap_or_else(|| panic!("a list: {y:?}"))
        .iter()
        .map(|v| match v {
            Yaml::String(s) => s.clone(),
            Yaml::Integer(i) => i.to_string(),
            other => panic!("a string: {other:?}"),
        })
        .collect()
}

/// The value of `--flag` in `args`.
fn flag<'a>(args: &'a [String], name: &str) -> &'a str {
    let i = args
        .iter()
        .position(|a| a == name)
        .unwrap_or_else(|| panic!("{name} in {args:?}"));
    &args[i + 1]
}

fn port_of(addr: &str) -> i64 {
    addr.rsplit(':').next().unwrap().parse().unwrap()
}

#[test]
fn the_kubernetes_manifests_probe_drain_and_mount_what_the_verifier_reads() {
    let all = manifests();
    let deployments = of_kind(&all, "Deployment");
    assert_eq!(deployments.len(), 1);
    let d = deployments[0];
    let pod = &d["spec"]["template"];
    let labels = pod["metadata"]["labels"].as_hash().unwrap();
    let selector = d["spec"]["selector"]["matchLabels"].as_hash().unwrap();
    for (k, v) in selector {
        assert_eq!(
            labels.get(k),
            Some(v),
            "the selector matches the pod's labels"
        );
    }
    assert!(d["spec"]["replicas"].as_i64().unwrap() >= 2, "replicas");
    let spec = &pod["spec"];
    let containers = spec["containers"].as_vec().unwrap();
    let c = containers
        .iter()
        .find(|c| c["name"].as_str() == Some("verifier"))
        .expect("a verifier container");
    let args = strs(&c["args"]);
    assert_eq!(&args[..2], ["cloud", "serve"]);

    // Every flag is one `tandem cloud serve` takes.
    let help = std::process::Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["cloud", "serve", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    for a in args.iter().filter(|a| a.starts_with("--")) {
        assert!(help.contains(&format!("{a} ")), "cloud serve takes {a}");
    }

    // Ports: the container's named ports are the flags' ports.
    let ports: Vec<(String, i64)> = c["ports"]
        .as_vec()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["name"].as_str().unwrap().to_string(),
                p["containerPort"].as_i64().unwrap(),
            )
        })
        .collect();
    let port = |name: &str| {
        ports
            .iter()
            .find(|(n, _)| n == name)
            .unwrap_or_else(|| panic!("a port named {name}: {ports:?}"))
            .1
    };
    assert_eq!(port("grpc"), port_of(flag(&args, "--listen")));
    assert_eq!(port("health"), port_of(flag(&args, "--health-listen")));
    assert_eq!(port("metrics"), port_of(flag(&args, "--metrics-listen")));

    // Probes: gRPC, on the plaintext health listener; readiness asks for the verifier (a drain
    // turns it), liveness and startup for `liveness` (a drain does not).
    let health = port("health");
    for (probe, service) in [
        ("readinessProbe", "tandem.v1.Verifier"),
        ("livenessProbe", tandem_cloud::grpc::LIVENESS),
        ("startupProbe", tandem_cloud::grpc::LIVENESS),
    ] {
        let g = &c[probe]["grpc"];
        assert_eq!(
            g["port"].as_i64(),
            Some(health),
            "{probe} asks the health port"
        );
        assert_eq!(g["service"].as_str(), Some(service), "{probe}'s service");
    }

    // Termination waits for the drain and its last second.
    let drain: f64 = flag(&args, "--drain-timeout-s").parse().unwrap();
    let grace = spec["terminationGracePeriodSeconds"].as_i64().unwrap() as f64;
    assert!(
        grace >= drain + 1.0,
        "grace {grace} s < drain {drain} s + 1"
    );

    // Secrets: the tenants file and the TLS pair are read from the mounted secrets.
    let volumes = spec["volumes"].as_vec().unwrap();
    let mounts = c["volumeMounts"].as_vec().unwrap();
    let secret_path = |secret: &str| -> String {
        let vol = volumes
            .iter()
            .find(|v| v["secret"]["secretName"].as_str() == Some(secret))
            .unwrap_or_else(|| panic!("a volume of the secret {secret}"));
        let m = mounts
            .iter()
            .find(|m| m["name"] == vol["name"])
            .unwrap_or_else(|| panic!("the secret {secret} is mounted"));
        m["mountPath"].as_str().unwrap().to_string()
    };
    let tenants = secret_path("tandem-tenants");
    assert!(flag(&args, "--tenants").starts_with(&format!("{tenants}/")));
    let tls = secret_path("tandem-tls");
    // A `kubernetes.io/tls` secret holds tls.crt and tls.key.
    assert_eq!(flag(&args, "--tls-cert"), format!("{tls}/tls.crt"));
    assert_eq!(flag(&args, "--tls-key"), format!("{tls}/tls.key"));
    assert!(
        !args.contains(&"--no-auth".to_string()),
        "API keys are required"
    );

    // The ConfigMap the container reads exists.
    let cm_name = c["envFrom"][0]["configMapRef"]["name"].as_str().unwrap();
    assert!(
        of_kind(&all, "ConfigMap")
            .iter()
            .any(|m| m["metadata"]["name"].as_str() == Some(cm_name)),
        "the ConfigMap {cm_name} is shipped"
    );

    // The Service selects these pods and sends gRPC to the gRPC port.
    let services = of_kind(&all, "Service");
    assert_eq!(services.len(), 1);
    let s = services[0];
    for (k, v) in s["spec"]["selector"].as_hash().unwrap() {
        assert_eq!(labels.get(k), Some(v), "the Service selects the pods");
    }
    let grpc = s["spec"]["ports"]
        .as_vec()
        .unwrap()
        .iter()
        .find(|p| p["name"].as_str() == Some("grpc"))
        .expect("a grpc port");
    assert_eq!(grpc["targetPort"].as_str(), Some("grpc"));
}
