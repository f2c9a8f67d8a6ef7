//! `tandem serve`'s flags and how it starts (the binary parses them and calls
//! [`cmd_edge_serve`]; the server is [`crate::serve`]), and the speculation flags `generate`
//! shares with it ([`ShapeArgs`], [`RuleChoice`]) and a verifier's certificate authority
//! ([`read_tls_ca`]).

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use tandem_engine::{CpuSet, Engine, EngineConfig};
use tandem_models::store::{self as models, ModelSpec};
use tandem_spec::pipeline::parse_on_off;
use tandem_spec::sampling::SamplingParams;
use tandem_spec::VerifyRule;

#[derive(Args)]
pub struct EdgeServeArgs {
    /// A verifier (`tandem cloud serve`), http://HOST:PORT or https://HOST:PORT; repeat for others
    /// to try in order when one does not answer.
    #[arg(long, required = true)]
    pub cloud: Vec<String>,
    /// Address the HTTP API listens on.
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: String,
    /// The tenant's API key this edge presents to the verifier (one started with --tenants needs
    /// it).
    #[arg(long, env = "TANDEM_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// For https:// verifiers: the certificate authority (PEM file) that signed their
    /// certificates. Default: the public web PKI's roots.
    #[arg(long)]
    pub tls_ca: Option<PathBuf>,
    /// A key local clients must present (`Authorization: Bearer KEY`); repeat for several.
    /// Default: none (on loopback, anyone on this machine may call).
    #[arg(long)]
    pub client_key: Vec<String>,
    /// When no verifier answers, or one is lost mid-answer and cannot be reached again: `local`
    /// finishes the answer with the draft alone and marks those tokens unverified; `none` answers
    /// 503.
    #[arg(long, default_value = "none", value_parser = ["none", "local"])]
    pub fallback: String,
    /// How long opening a session on one verifier may take, ms.
    #[arg(long, default_value_t = 3000)]
    pub connect_timeout_ms: u64,
    /// How long a session whose connection was lost keeps trying to reopen it (waits doubling to
    /// 2 s, jittered, honouring the verifier's retry-after-ms), ms; then 503, or the draft alone
    /// with --fallback local.
    #[arg(long, default_value_t = tandem_spec::edge::RECONNECT_WINDOW_MS)]
    pub reconnect_window_ms: u64,
    /// Do not keep the draft's KV of finished requests for later ones that start the same way
    /// (by default a conversation's next turn prefills only its new tokens into the draft).
    #[arg(long)]
    pub no_prefix_cache: bool,
    /// The model's name in the API (default: a catalog model's file stem, the target's that
    /// answers, e.g. `SmolLM2-135M-Instruct`, `qwen2.5-coder-1.5b-instruct`; a path's file name up
    /// to its first dot).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// The draft: a model of the catalog's (`draft`, the default model's; NAME or NAME-draft,
    /// that model's: `qwen2.5-coder-1.5b` drafts with the 0.5B) or a GGUF path.
    #[arg(long, default_value = "draft")]
    pub model: ModelSpec,
    /// Draft tokens per block (γ).
    #[arg(long, default_value_t = 2)]
    pub gamma: usize,
    /// Blocks in flight.
    #[arg(long, default_value_t = 3)]
    pub depth: usize,
    #[command(flatten)]
    pub shape: ShapeArgs,
    /// Worker threads of the draft engine (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// The draft's KV cache in MiB: what the requests in progress may hold together (each
    /// reserves its prompt and max_tokens; others wait).
    #[arg(long, default_value_t = DEFAULT_KV_MB)]
    pub kv_mb: usize,
    /// Pin the draft engine's threads to these cores.
    #[arg(long)]
    pub cpus: Option<CpuSet>,
}

/// `tandem serve --kv-mb`'s default: the draft's KV of sixteen conversations of ~1,000 tokens.
pub const DEFAULT_KV_MB: usize = 1024;

pub fn cmd_edge_serve(home: &std::path::Path, a: EdgeServeArgs) -> Result<()> {
    for url in &a.cloud {
        if !(url.starts_with("http://") || url.starts_with("https://")) {
            bail!("--cloud {url}: give the verifier as http://HOST:PORT or https://HOST:PORT");
        }
    }
    let tls_ca = read_tls_ca(a.tls_ca.as_deref())?;
    if a.client_key.iter().any(|k| k.trim().is_empty()) {
        bail!("--client-key: a key may not be empty");
    }
    let rt = tandem_proto::runtime()?;
    rt.block_on(check_verifiers(&a.cloud, tls_ca.as_deref()))?;
    // A catalog model's target drafts with its draft, as `generate` does.
    let draft = a.model.draft();
    let m = models::load(home, &draft, Some(draft.draft_mode()), false)?;
    let model_name = a
        .served_model_name
        .clone()
        .unwrap_or_else(|| match &a.model {
            ModelSpec::Named { model, .. } => model.stem.to_string(),
            ModelSpec::Path(_) => m
                .path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.split('.').next())
                .unwrap_or("tandem")
                .to_string(),
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
    let spec = crate::SpecConfig {
        // The prior plans for a 50 ms round trip until the session measures its own.
        session: a
            .shape
            .session(a.gamma.max(1), a.depth.max(1), None, 0, 50.0),
        rule: a.shape.verify.rule(),
        params: SamplingParams::default(),
        q_top_k: 32,
        self_draft: a.shape.self_draft,
        suffix: a.shape.suffix,
    };
    let cfg = crate::serve::ServeConfig {
        clouds: a.cloud.clone(),
        api_key: a.api_key.clone(),
        tls_ca,
        client_keys: a.client_key.clone(),
        model_name: model_name.clone(),
        spec,
        fallback_local: a.fallback == "local",
        connect_timeout: std::time::Duration::from_millis(a.connect_timeout_ms.max(1)),
        reconnect_window: std::time::Duration::from_millis(a.reconnect_window_ms),
        prefix_cache: !a.no_prefix_cache,
    };
    let tok = std::sync::Arc::new(m.tokenizer);
    rt.block_on(async {
        let listener = tandem_proto::listen("--listen", &a.listen).await?;
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
        crate::serve::serve(listener, engine, tok, cfg, tandem_proto::shutdown_signal())
            .await
            .context("serving")?;
        anyhow::Ok(())
    })?;
    rt.shutdown_timeout(std::time::Duration::from_secs(2));
    eprintln!("stopped");
    Ok(())
}

/// `--tls-ca PEM`: the certificate authority's PEM text, when given, checked to hold at least one
/// certificate (and no private key) before anything uses it.
pub fn read_tls_ca(path: Option<&std::path::Path>) -> Result<Option<String>> {
    path.map(|p| {
        let text = std::fs::read_to_string(p)
            .with_context(|| format!("--tls-ca {}: cannot read", p.display()))?;
        check_ca_pem(&text).with_context(|| format!("--tls-ca {}", p.display()))?;
        Ok(text)
    })
    .transpose()
}

/// How many certificates a `--tls-ca` file holds; an error naming what is wrong where it holds
/// none, a private key, or a certificate that does not parse.
pub fn check_ca_pem(text: &str) -> Result<usize> {
    let mut certs = 0;
    for (i, pem) in x509_parser::pem::Pem::iter_from_buffer(text.as_bytes()).enumerate() {
        let pem = pem.map_err(|e| anyhow::anyhow!("PEM block {} does not parse: {e}", i + 1))?;
        if pem.label.contains("PRIVATE KEY") {
            bail!(
                "holds a private key ({}): give the edges the CA's certificate (ca.pem) and keep \
                 keys on the verifier",
                pem.label
            );
        }
        if pem.label == "CERTIFICATE" {
            pem.parse_x509()
                .map_err(|e| anyhow::anyhow!("certificate {} does not parse: {e}", i + 1))?;
            certs += 1;
        }
    }
    if certs == 0 {
        bail!("holds no PEM certificate (-----BEGIN CERTIFICATE-----): give the CA that signed the verifier's certificate (tandem cloud cert writes it as ca.pem)");
    }
    Ok(certs)
}

/// At start-up, one connection to each `https://` verifier, to say whether its certificate is
/// trusted (rather than every request failing later): an untrusted certificate stops the edge,
/// naming why; a verifier not reachable yet is only reported (it may come up after the edge).
pub async fn check_verifiers(clouds: &[String], tls_ca: Option<&str>) -> Result<()> {
    for url in clouds.iter().filter(|u| u.starts_with("https://")) {
        match crate::grpc::client(url, tls_ca).await {
            Ok(_) => eprintln!("verifier {url}: certificate trusted"),
            Err(crate::EdgeError::Unreachable(m)) => {
                eprintln!("verifier {url}: not reachable yet ({m}); each request tries it again")
            }
            Err(crate::EdgeError::Refused(m)) => {
                bail!("verifier {url}: {m}{}", trust_hint(&m, tls_ca))
            }
            Err(e) => bail!("verifier {url}: {e}"),
        }
    }
    Ok(())
}

/// What to do about a certificate the edge does not trust, by rustls's reason.
fn trust_hint(m: &str, tls_ca: Option<&str>) -> &'static str {
    if m.contains("CaUsedAsEndEntity") {
        " (the verifier serves a CA certificate as its own, which TLS clients refuse: make its \
         certificate with `tandem cloud cert`, or openssl with -addext \
         basicConstraints=critical,CA:FALSE)"
    } else if m.contains("UnknownIssuer") && tls_ca.is_none() {
        " (its certificate is not signed by a public CA: give --tls-ca with the CA that signed it)"
    } else if m.contains("UnknownIssuer") {
        " (--tls-ca is not the CA that signed the verifier's certificate)"
    } else if m.contains("NotValidForName") {
        " (the certificate does not name the host in --cloud: use a name it lists, or remake it \
         with --host)"
    } else if m.contains("Expired") || m.contains("NotValidYet") {
        " (outside the certificate's validity period: remake it, or check the clocks)"
    } else {
        ""
    }
}

/// The speculation flags `generate` and `serve` share (γ and depth, whose defaults differ, are
/// each command's own).
#[derive(Args)]
pub struct ShapeArgs {
    /// Let the policy choose γ and depth from what it measures (α, draft and verify time, round
    /// trip), starting at --gamma / --depth, within --max-gamma / --max-depth and the cloud's grant.
    #[arg(long)]
    pub auto: bool,
    #[arg(long, default_value_t = 8)]
    pub max_gamma: usize,
    #[arg(long, default_value_t = 4)]
    pub max_depth: usize,
    /// Token trees: LANES:BELOW[:MIN] grows up to LANES lanes beside the main path, forked where
    /// the draft's confidence is below BELOW (and the lane's chance to be the target's path at
    /// least MIN, default 0.05), carried on across blocks (e.g. 3:0.5); none: linear.
    #[arg(long, value_parser = tandem_spec::pipeline::parse_tree, default_value = "none")]
    pub tree: tandem_spec::pipeline::TreeArg,
    /// How the verifier judges sampled drafts: sample-match, rejection, or auto (greedy when
    /// temperature is 0). auto: sample-and-match with coupled draws, which commits about as
    /// much as rejection sampling and gives the same text for the same seed whatever the timing
    /// (docs/RESULTS.md).
    #[arg(long, default_value = "auto")]
    pub verify: RuleChoice,
    /// Let the verifier draft for itself while it decodes the session alone (after a
    /// correction, until the edge's next blocks catch up): guesses copied from the session's own
    /// text, verified in the same forward (on, off).
    #[arg(long, default_value = "on", action = clap::ArgAction::Set, value_parser = parse_on_off)]
    pub self_draft: bool,
    /// Draft by copying from the session's own text (prompt and output) where the end of what
    /// is drafted matches it, without a forward of the draft model; each match length is used
    /// while its copies turn out right often enough (on, off).
    #[arg(long, default_value = "on", action = clap::ArgAction::Set, value_parser = parse_on_off)]
    pub suffix: bool,
}

impl ShapeArgs {
    /// A session starting at `gamma` and `depth`; with --auto the policy's limits are
    /// --max-gamma and --max-depth (or `max_depth` when the mode fixes it), its prior planned for
    /// `rtt_ms`.
    pub fn session(
        &self,
        gamma: usize,
        depth: usize,
        max_depth: Option<usize>,
        max_new_tokens: usize,
        rtt_ms: f64,
    ) -> tandem_spec::edge::SessionConfig {
        tandem_spec::edge::SessionConfig {
            draft_len: gamma,
            depth,
            max_new_tokens,
            auto: self.auto.then(|| tandem_spec::edge::AutoShape {
                max_draft_len: self.max_gamma.max(1),
                max_depth: max_depth.unwrap_or(self.max_depth).max(1),
                prior: tandem_spec::edge::default_prior(rtt_ms),
            }),
            tree: self.tree.0.unwrap_or(tandem_spec::TreeConfig::LINEAR),
        }
    }
}

/// `--verify`: a verify rule, or the one that commits more for this run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RuleChoice {
    Auto,
    Rule(VerifyRule),
}

impl RuleChoice {
    /// The rule to verify sampled drafts with: sample-and-match unless one was named. Its draws
    /// are coupled (Gumbel-max on noise both models share), so it commits about as much as
    /// rejection sampling (more at high temperatures, where rejection's top-k q misses the
    /// target's tail: `bench rules`), and it alone commits a seeded answer that depends on the
    /// prompt, the parameters and the seed, never on timing.
    pub fn rule(self) -> VerifyRule {
        match self {
            RuleChoice::Rule(r) => r,
            RuleChoice::Auto => VerifyRule::SampleMatch,
        }
    }
}

impl std::str::FromStr for RuleChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(RuleChoice::Auto),
            s => s
                .parse()
                .map(RuleChoice::Rule)
                .map_err(|e: String| format!("{e}, or auto")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Flags {
        #[command(flatten)]
        shape: ShapeArgs,
    }

    #[test]
    fn on_off_flags_take_their_value() {
        let f = Flags::try_parse_from(["t"]).unwrap();
        assert!(f.shape.self_draft && f.shape.suffix, "on by default");
        let f = Flags::try_parse_from(["t", "--self-draft", "off", "--suffix", "off"]).unwrap();
        assert!(!f.shape.self_draft && !f.shape.suffix);
        let f = Flags::try_parse_from(["t", "--self-draft=on", "--suffix", "on"]).unwrap();
        assert!(f.shape.self_draft && f.shape.suffix);
        let e = Flags::try_parse_from(["t", "--suffix", "yes"])
            .err()
            .unwrap();
        assert!(e.to_string().contains("on or off"), "{e}");
    }
}
