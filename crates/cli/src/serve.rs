//! `tandem serve`: the edge daemon, an OpenAI-compatible HTTP server in front of the draft model
//! and speculation against one or more verifiers (the work is in `tandem_edge::serve`).

use super::*;

#[derive(Args)]
pub(crate) struct EdgeServeArgs {
    /// A verifier (`tandem cloud serve`), http://HOST:PORT or https://HOST:PORT; repeat for others
    /// to try in order when one does not answer.
    #[arg(long, required = true)]
    cloud: Vec<String>,
    /// Address the HTTP API listens on.
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: String,
    /// The tenant's API key this edge presents to the verifier (one started with --tenants needs
    /// it).
    #[arg(long, env = "TANDEM_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// For https:// verifiers: the certificate authority (PEM file) that signed their
    /// certificates. Default: the public web PKI's roots.
    #[arg(long)]
    tls_ca: Option<PathBuf>,
    /// A key local clients must present (`Authorization: Bearer KEY`); repeat for several.
    /// Default: none (on loopback, anyone on this machine may call).
    #[arg(long)]
    client_key: Vec<String>,
    /// When no verifier answers, or one is lost mid-answer and cannot be reached again: `local`
    /// finishes the answer with the draft alone and marks those tokens unverified; `none` answers
    /// 503.
    #[arg(long, default_value = "none", value_parser = ["none", "local"])]
    fallback: String,
    /// How long opening a session on one verifier may take, ms.
    #[arg(long, default_value_t = 3000)]
    connect_timeout_ms: u64,
    /// How long a session whose connection was lost keeps trying to reopen it (waits doubling to
    /// 2 s, jittered, honouring the verifier's retry-after-ms), ms; then 503, or the draft alone
    /// with --fallback local.
    #[arg(long, default_value_t = tandem_spec::edge::RECONNECT_WINDOW_MS)]
    reconnect_window_ms: u64,
    /// The model's name in the API (default: the draft file's name up to its first dot).
    #[arg(long)]
    served_model_name: Option<String>,
    /// The draft: `draft` (made from the target on first use) or a GGUF path.
    #[arg(long, default_value = "draft")]
    model: ModelSpec,
    /// Draft tokens per block (γ).
    #[arg(long, default_value_t = 2)]
    gamma: usize,
    /// Blocks in flight.
    #[arg(long, default_value_t = 3)]
    depth: usize,
    #[command(flatten)]
    shape: ShapeArgs,
    /// Worker threads of the draft engine (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
    /// The draft's KV cache in MiB: what the requests in progress may hold together (each
    /// reserves its prompt and max_tokens; others wait).
    #[arg(long, default_value_t = 1024)]
    kv_mb: usize,
    /// Pin the draft engine's threads to these cores.
    #[arg(long)]
    cpus: Option<CpuSet>,
}

pub(crate) fn cmd_edge_serve(home: &std::path::Path, a: EdgeServeArgs) -> Result<()> {
    for url in &a.cloud {
        if !(url.starts_with("http://") || url.starts_with("https://")) {
            bail!("--cloud {url}: give the verifier as http://HOST:PORT or https://HOST:PORT");
        }
    }
    let tls_ca = read_tls_ca(a.tls_ca.as_deref())?;
    if a.client_key.iter().any(|k| k.trim().is_empty()) {
        bail!("--client-key: a key may not be empty");
    }
    let m = models::load(home, &a.model, None, false)?;
    let model_name = a.served_model_name.clone().unwrap_or_else(|| {
        m.path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.split('.').next())
            .unwrap_or("tandem")
            .to_string()
    });
    let engine = Engine::new(
        m.model.clone(),
        EngineConfig {
            threads: a.threads.unwrap_or_else(|| EngineConfig::default().threads),
            kv_budget_bytes: a.kv_mb << 20,
            kv_block_size: 16,
            cpus: a.cpus.unwrap_or_default(),
        },
    )?;
    let spec = tandem_edge::SpecConfig {
        // The prior plans for a 50 ms round trip until the session measures its own.
        session: a
            .shape
            .session(a.gamma.max(1), a.depth.max(1), None, 0, 50.0),
        rule: a.shape.verify.rule(),
        params: SamplingParams::default(),
        q_top_k: 32,
    };
    let cfg = tandem_edge::serve::ServeConfig {
        clouds: a.cloud.clone(),
        api_key: a.api_key.clone(),
        tls_ca,
        client_keys: a.client_key.clone(),
        model_name: model_name.clone(),
        spec,
        fallback_local: a.fallback == "local",
        connect_timeout: std::time::Duration::from_millis(a.connect_timeout_ms.max(1)),
        reconnect_window: std::time::Duration::from_millis(a.reconnect_window_ms),
    };
    let tok = std::sync::Arc::new(m.tokenizer);
    let rt = tandem_client::runtime()?;
    rt.block_on(async {
        let listener = listen("--listen", &a.listen).await?;
        eprintln!(
            "tandem serve listening on http://{} (model {model_name}, verifier {}{}{})",
            listener.local_addr()?,
            a.cloud.join(", "),
            if a.client_key.is_empty() {
                ""
            } else {
                ", client keys required"
            },
            if a.fallback == "local" {
                ", falls back to the draft alone"
            } else {
                ""
            }
        );
        tandem_edge::serve::serve(listener, engine, tok, cfg, shutdown_signal())
            .await
            .context("serving")?;
        anyhow::Ok(())
    })?;
    rt.shutdown_timeout(std::time::Duration::from_secs(2));
    eprintln!("stopped");
    Ok(())
}
