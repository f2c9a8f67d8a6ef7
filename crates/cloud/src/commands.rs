//! `tandem cloud serve` and `tandem cloud usage`: their flags and how they run (the binary parses
//! them and calls [`run`]): the verifier's start-up (the model, the measured forward cost, the
//! load policy, tenants, TLS, the ledger, metrics and health listeners, the drain on SIGTERM) and
//! the ledger's per-tenant totals.

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use tandem_engine::Engine;
use tandem_models::store::{self as models, ModelSpec};
use tandem_models::EngineArgs;

/// Run `tandem cloud …`.
pub fn run(home: &std::path::Path, cmd: CloudCmd) -> Result<()> {
    match cmd {
        CloudCmd::Serve(a) => cmd_serve(home, a),
        CloudCmd::Usage(a) => cmd_usage(home, a),
        CloudCmd::Cert(a) => cmd_cert(a),
    }
}

// Parsed once per run: the size of the serve flags does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
pub enum CloudCmd {
    /// Serve the target as a tandem.v1 gRPC verifier.
    Serve(ServeArgs),
    /// Per-tenant totals from the usage ledger (what `cloud serve` recorded of each session).
    Usage(UsageArgs),
    /// Make a certificate authority and a server certificate it signs, for a self-hosted
    /// verifier: `cloud serve --tls-cert DIR/server.pem --tls-key DIR/server-key.pem`, edges
    /// `--tls-ca DIR/ca.pem`.
    Cert(CertArgs),
}

#[derive(Args)]
pub struct CertArgs {
    /// Where to write ca.pem, ca-key.pem, server.pem and server-key.pem (created if absent; no
    /// file there is overwritten).
    #[arg(long)]
    pub out: std::path::PathBuf,
    /// The names and addresses the edges reach the verifier by (repeat the flag).
    #[arg(long = "host", default_values = ["localhost", "127.0.0.1"])]
    pub hosts: Vec<String>,
}

/// `tandem cloud cert`: a CA (kept, to sign more later) and a server certificate for `hosts`
/// signed by it; the keys readable by their owner alone.
pub fn cmd_cert(a: CertArgs) -> Result<()> {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
    let files = ["ca.pem", "ca-key.pem", "server.pem", "server-key.pem"].map(|f| a.out.join(f));
    if let Some(f) = files.iter().find(|f| f.exists()) {
        bail!(
            "--out {}: {} exists; not overwriting it",
            a.out.display(),
            f.display()
        );
    }
    if a.hosts.iter().any(|h| h.trim().is_empty()) {
        bail!("--host: an empty name");
    }
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let ca_key = KeyPair::generate()?;
    let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "Tandem verifier CA");
    let ca = ca_params.self_signed(&ca_key)?;
    let issuer = Issuer::new(ca_params, ca_key);
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::new(a.hosts.clone())
        .with_context(|| format!("--host {}", a.hosts.join(", ")))?;
    params.is_ca = IsCa::ExplicitNoCa;
    params
        .distinguished_name
        .push(DnType::CommonName, a.hosts[0].as_str());
    let cert = params.signed_by(&key, &issuer)?;
    let write = |path: &std::path::Path, text: String, secret: bool| -> Result<()> {
        use std::io::Write;
        let mut o = std::fs::OpenOptions::new();
        o.write(true).create_new(true);
        #[cfg(unix)]
        if secret {
            use std::os::unix::fs::OpenOptionsExt;
            o.mode(0o600);
        }
        let _ = secret;
        o.open(path)
            .and_then(|mut f| f.write_all(text.as_bytes()))
            .with_context(|| format!("writing {}", path.display()))
    };
    write(&files[0], ca.pem(), false)?;
    write(&files[1], issuer.key().serialize_pem(), true)?;
    write(&files[2], cert.pem(), false)?;
    write(&files[3], key.serialize_pem(), true)?;
    println!(
        "wrote a CA and a certificate for {} in {}\n  verifier: tandem cloud serve --tls-cert {} --tls-key {} …\n  edges:    --cloud https://{}:PORT --tls-ca {}",
        a.hosts.join(", "),
        a.out.display(),
        files[2].display(),
        files[3].display(),
        a.hosts[0],
        files[0].display()
    );
    Ok(())
}

#[derive(Args)]
pub struct UsageArgs {
    /// The ledger (default: ledger.sqlite in the model directory, as `cloud serve` writes it).
    #[arg(long)]
    pub ledger: Option<std::path::PathBuf>,
    /// Only this tenant (its name in the tenants file).
    #[arg(long)]
    pub tenant: Option<String>,
    /// Only sessions closed since: Unix seconds, or a span ago (`90s`, `30m`, `24h`, `7d`).
    #[arg(long, value_parser = parse_since)]
    pub since: Option<i64>,
    /// Print JSON (a list of per-tenant totals) instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// `--since`: Unix seconds, or `N` followed by s, m, h or d (that long ago), as Unix ms.
fn parse_since(s: &str) -> Result<i64, String> {
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64);
    let bad = || format!("`{s}` is neither Unix seconds nor a span like 30m, 24h or 7d");
    if let Ok(secs) = s.parse::<i64>() {
        return Ok(secs * 1000);
    }
    let (n, unit) = s.split_at(s.len().saturating_sub(1));
    let n: i64 = n.parse().map_err(|_| bad())?;
    let ms = match unit {
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return Err(bad()),
    };
    Ok(now_ms - n * ms)
}

/// The ledger's default place.
pub fn default_ledger(home: &std::path::Path) -> std::path::PathBuf {
    home.join("ledger.sqlite")
}

pub fn cmd_usage(home: &std::path::Path, a: UsageArgs) -> Result<()> {
    let path = a.ledger.unwrap_or_else(|| default_ledger(home));
    if !path.exists() {
        bail!(
            "--ledger {}: no ledger there (cloud serve writes one)",
            path.display()
        );
    }
    let c = crate::ledger::open(&path)?;
    let rows = crate::ledger::totals(&c, a.tenant.as_deref(), a.since.unwrap_or(0))?;
    if a.json {
        println!("{}", serde_json::to_string(&rows)?);
        return Ok(());
    }
    println!("| tenant | sessions | prompt tokens | of them cached | committed tokens | accepted draft tokens | verifier's tokens | of them decoded | verified positions |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for r in rows {
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            r.tenant,
            r.sessions,
            r.prompt_tokens,
            r.cached_prompt_tokens,
            r.committed_tokens,
            r.accepted_draft_tokens,
            r.cloud_tokens,
            r.decoded_tokens,
            r.verified_positions
        );
    }
    Ok(())
}

/// `--weights`: a weight mode a target may run in (not `w4a8`: its 8-bit activations are a
/// draft's shortcut, not the target's answer).
fn target_weights(s: &str) -> std::result::Result<tandem_engine::WeightMode, String> {
    match s.parse()? {
        tandem_engine::WeightMode::W4A8 => Err(
            "w4a8 quantizes the activations to 8 bits: a draft's mode, not a target's (f32, native, f16)"
                .into(),
        ),
        m => Ok(m),
    }
}

#[derive(Args)]
pub struct ServeArgs {
    /// The target: a model of the catalog (smollm2-135m, gemma3-270m, qwen2.5-coder-1.5b,
    /// qwen2.5-coder-0.5b; `target` is SmolLM2) or a GGUF path, in `--weights`.
    #[arg(long, default_value = "target")]
    pub model: ModelSpec,
    /// How the target's weights are held: `f32` (the full-precision cloud model), `native` (the
    /// file's own blocks, Q4_K / Q6_K / Q5_0 / Q8_0 ..., dequantized in the kernels against f32
    /// activations: a quarter to a seventh of the bytes a token) or `f16`. Every mode gives the
    /// same bits at any batch and on every kernel path, so cloud-only and speculation commit the
    /// same text; replicas must serve the same mode (the sessions' text is that mode's).
    #[arg(long, default_value = "f32", value_parser = target_weights)]
    pub weights: tandem_engine::WeightMode,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:50051")]
    pub listen: String,
    /// Serve Prometheus metrics on `GET /metrics` at this address too.
    #[arg(long)]
    pub metrics_listen: Option<String>,
    /// Serve the gRPC health service alone, in plaintext, at this address too (for probes that
    /// cannot speak TLS, e.g. Kubernetes' gRPC probes): `""` and `tandem.v1.Verifier` turn
    /// NOT_SERVING when the verifier drains, `liveness` stays SERVING while it runs.
    #[arg(long)]
    pub health_listen: Option<String>,
    /// Largest draft length (γ) granted to a session.
    #[arg(long, default_value_t = 8)]
    pub max_draft_len: u32,
    /// Largest number of blocks in flight granted to a session.
    #[arg(long, default_value_t = 4)]
    pub max_depth: u32,
    /// Tokens per forward at which the target is saturated: grants shrink (γ halves, depth drops
    /// by one per step, then γ 0: the verifier decodes the sessions itself) as the mean load
    /// nears it, and grow back below half; open sessions learn the new grant with their next
    /// verdict. Default: twice the ridge of the target's forward cost.
    #[arg(long)]
    pub saturation_tokens: Option<f64>,
    /// The target's forward cost as `ONE_TOKEN_MS,MS_PER_TOKEN` (a forward takes the larger of
    /// the one-token time and MS_PER_TOKEN per token). Default: measured at start-up (a few
    /// seconds). With it, a session whose speculation commits slower than cloud decoding would at
    /// the current load is taken over by the verifier on its own.
    #[arg(long)]
    pub forward_cost: Option<tandem_spec::capacity::ForwardCost>,
    /// Keep every session at the γ and depth it asked for (within --max-draft-len and
    /// --max-depth): no load-aware grants, no takeovers. For measuring speculation as such.
    #[arg(long)]
    pub fixed_grants: bool,
    /// Tenants and their API keys (TOML: [[tenant]] name, keys, weight, max_sessions,
    /// max_kv_blocks, tokens_per_s). Every RPC must then carry `authorization: Bearer <key>`.
    #[arg(long)]
    pub tenants: Option<std::path::PathBuf>,
    /// Serve without API keys (one tenant, `default`): only on a loopback address.
    #[arg(long)]
    pub no_auth: bool,
    /// TLS (rustls): this verifier's certificate chain, PEM. With --tls-key.
    #[arg(long, requires = "tls_key")]
    pub tls_cert: Option<std::path::PathBuf>,
    /// TLS: the certificate's private key, PEM. With --tls-cert.
    #[arg(long, requires = "tls_cert")]
    pub tls_key: Option<std::path::PathBuf>,
    /// Serve API keys in plaintext on a non-loopback address: only where a balancer or mesh in
    /// front of this verifier terminates TLS (without it, --tenants off loopback needs TLS).
    #[arg(long)]
    pub insecure_behind_proxy: bool,
    /// The usage ledger: a row per ended session (tenant, times, counts; never content), SQLite
    /// (default: ledger.sqlite in the model directory).
    #[arg(long)]
    pub ledger: Option<std::path::PathBuf>,
    /// Keep no usage ledger.
    #[arg(long, conflicts_with = "ledger")]
    pub no_ledger: bool,
    #[command(flatten)]
    pub verifier: tandem_verifier::VerifierConfig,
    /// On ctrl-c or SIGTERM, let open sessions finish for up to this many seconds.
    #[arg(long, default_value_t = 30.0)]
    pub drain_timeout_s: f64,
    /// How long a session stream may take to send its Open before it is cut, ms.
    #[arg(long, default_value_t = 10_000)]
    pub open_deadline_ms: u64,
    /// How long an open session may go without a message from its edge (a block, an ack)
    /// before it is closed, s.
    #[arg(long, default_value_t = 60.0)]
    pub idle_timeout_s: f64,
    /// A speculation session whose edge has sent nothing (a block, an ack) for this long is
    /// decoded in the background — only in forwards no other tenant waits on — until its edge
    /// speaks again, ms (0: never).
    #[arg(long, default_value_t = tandem_verifier::DEFAULT_QUIET_MS)]
    pub quiet_ms: u64,
    #[command(flatten)]
    pub engine: EngineArgs,
}

pub fn cmd_serve(home: &std::path::Path, a: ServeArgs) -> Result<()> {
    let addr: std::net::SocketAddr = a
        .listen
        .parse()
        .with_context(|| format!("--listen {}: not an address (ip:port)", a.listen))?;
    let tenants = match (&a.tenants, a.no_auth) {
        (Some(_), true) => bail!("--tenants and --no-auth exclude each other"),
        (Some(path), false) => crate::tenants::Tenants::load(path)?,
        (None, true) if addr.ip().is_loopback() => crate::tenants::Tenants::open(),
        (None, true) => bail!(
            "--no-auth is allowed only on a loopback address, not {addr}: give --tenants FILE"
        ),
        (None, false) => bail!(
            "the verifier needs API keys: give --tenants FILE, or --no-auth on a loopback address"
        ),
    };
    let tls = match (&a.tls_cert, &a.tls_key) {
        (Some(c), Some(k)) => Some(crate::grpc::ServerTls {
            cert_pem: std::fs::read(c)
                .with_context(|| format!("--tls-cert {}: cannot read", c.display()))?,
            key_pem: std::fs::read(k)
                .with_context(|| format!("--tls-key {}: cannot read", k.display()))?,
        }),
        _ => None,
    };
    if let Some(t) = &tls {
        t.check().map_err(|e| {
            anyhow::anyhow!("--tls-cert / --tls-key: not a certificate and key rustls takes: {e}")
        })?;
    }
    if tls.is_none() && tenants.auth_required() && !addr.ip().is_loopback() {
        if !a.insecure_behind_proxy {
            bail!(
                "--tenants on {addr}, off loopback, needs TLS (API keys and prompts would cross the network in plaintext): give --tls-cert and --tls-key, or --insecure-behind-proxy where a balancer or mesh in front terminates TLS"
            );
        }
        eprintln!(
            "WARNING: serving API keys and prompts in PLAINTEXT on {addr} (--insecure-behind-proxy): only a proxy that terminates TLS may stand between this verifier and its edges"
        );
    }
    if let Some(x) = a
        .saturation_tokens
        .filter(|x| !(x.is_finite() && *x >= 1.0))
    {
        bail!("--saturation-tokens must be at least 1, got {x}");
    }
    if !(a.drain_timeout_s.is_finite() && a.drain_timeout_s >= 0.0) {
        bail!(
            "--drain-timeout-s must be 0 or more, got {}",
            a.drain_timeout_s
        );
    }
    // At most a year: a timeout that long is "never", and µs past it would overflow.
    if !(a.idle_timeout_s.is_finite() && a.idle_timeout_s > 0.0 && a.idle_timeout_s <= 3.2e7) {
        bail!(
            "--idle-timeout-s must be more than 0 and at most a year (31,536,000), got {}",
            a.idle_timeout_s
        );
    }
    if a.verifier.token_budget <= a.max_draft_len as usize {
        bail!(
            "--token-budget {} must exceed --max-draft-len {} (a block and its correction go in one forward)",
            a.verifier.token_budget,
            a.max_draft_len
        );
    }
    let m = models::load(home, &a.model, Some(a.weights), false)?;
    let mut engine = Engine::new(m.model.clone(), a.engine.config())?;
    let cost = match a.forward_cost {
        Some(c) => c,
        None => crate::measure_forward_cost(&mut engine, &crate::CALIBRATION_SIZES, 3)?.1,
    };
    eprintln!(
        "target forward: {:.1} ms for one token, {:.2} ms per token past the ridge (≈ {:.1} tokens)",
        cost.one_token_ms,
        cost.ms_per_token,
        cost.ridge_tokens()
    );
    let name = m
        .path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let load = tandem_verifier::LoadConfig {
        saturation_tokens: a
            .saturation_tokens
            .unwrap_or(2.0 * cost.ridge_tokens().max(1.0)),
        forward_cost: Some(cost),
        adapt: !a.fixed_grants,
        idle_timeout_ms: Some((a.idle_timeout_s * 1e3).ceil().max(1.0) as u64),
        quiet_ms: (a.quiet_ms > 0).then_some(a.quiet_ms),
        ..tandem_verifier::LoadConfig::new(a.max_draft_len, a.max_depth)
    };
    let info = crate::grpc::ServiceInfo {
        open_deadline: std::time::Duration::from_millis(a.open_deadline_ms.max(1)),
        ..crate::grpc::ServiceInfo::new(&name, &m.model, &m.tokenizer)
    };
    let cfg = tandem_verifier::VerifierConfig { load, ..a.verifier };
    let auth = tenants.auth_required();
    let ledger = if a.no_ledger {
        None
    } else {
        let path = a.ledger.clone().unwrap_or_else(|| default_ledger(home));
        eprintln!("usage ledger: {}", path.display());
        Some(crate::ledger::Ledger::start(&path)?)
    };
    let (service, batcher) = crate::grpc::start_with_ledger(engine, cfg, info, tenants, ledger)?;
    let rt = tandem_proto::runtime()?;
    let served = rt.block_on(async {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("--listen {addr}: cannot bind"))?;
        if let Some(addr) = &a.metrics_listen {
            let ml = tandem_proto::listen("--metrics-listen", addr).await?;
            eprintln!("metrics on http://{}/metrics", ml.local_addr()?);
            let g = service.gauges();
            tokio::spawn(async move {
                if let Err(e) = crate::metrics::serve_metrics(
                    ml,
                    g,
                    std::future::pending(),
                    tandem_http::HEAD_TIMEOUT,
                )
                .await
                {
                    eprintln!("metrics server stopped: {e}");
                }
            });
        }
        let health = match &a.health_listen {
            Some(addr) => {
                let hl = tandem_proto::listen("--health-listen", addr).await?;
                eprintln!("health (plaintext gRPC) on {}", hl.local_addr()?);
                Some(hl)
            }
            None => None,
        };
        eprintln!(
            "tandem verifier listening on {} ({}, {})",
            listener.local_addr()?,
            if auth { "API keys required" } else { "no auth" },
            if tls.is_some() { "TLS" } else { "plaintext" }
        );
        let drain = std::time::Duration::from_secs_f64(a.drain_timeout_s);
        let (failure, watcher) = crate::grpc::batcher_failure(batcher, service.draining());
        let failed = std::sync::Arc::new(std::sync::Mutex::new(None::<String>));
        let record = failed.clone();
        // A signal drains; a failed batcher stops the server at once (health NOT_SERVING first).
        let shutdown = async move {
            tokio::select! {
                _ = tandem_proto::shutdown_signal() => {
                    eprintln!("draining (up to {:.0} s)", drain.as_secs_f64());
                }
                why = failure => {
                    eprintln!("{why}: the verifier stops");
                    *record.lock().unwrap_or_else(|e| e.into_inner()) = Some(why);
                }
            }
        };
        crate::grpc::serve_grpc_tls(service, listener, shutdown, drain, tls.as_ref(), health)
            .await
            .context("serving (a TLS certificate or key that does not parse is refused here)")?;
        let why = failed.lock().unwrap_or_else(|e| e.into_inner()).take();
        anyhow::Ok((why, watcher))
    });
    rt.shutdown_timeout(std::time::Duration::from_secs(2));
    let (why, watcher) = served?;
    if let Some(why) = why {
        bail!("{why}");
    }
    let _ = watcher.join();
    eprintln!("stopped");
    Ok(())
}
