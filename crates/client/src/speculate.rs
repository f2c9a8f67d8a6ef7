//! Speculative generation: the draft runs here and drives the pipeline over a real `tandem.v1` gRPC
//! session — to a running verifier (`--cloud URL`), or to one started in this process on a loopback
//! port behind a netem proxy that adds the round trip. `sync` is the same code with depth 1.

use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use crate::netem::NetemConfig;
use anyhow::{anyhow, Context, Result};
use serde::Serialize;
use tandem_edge::{Link, SpecConfig};
use tandem_engine::tokenizer::TextStream;
use tandem_engine::{Engine, EngineConfig, LlamaModel, Tokenizer};
use tandem_spec::edge::RECONNECT_WINDOW_MS;

use crate::generate::GenOutput;
use tandem_sim::stats::round2;

/// What `generate --json` adds in the speculative modes.
#[derive(Debug, Clone, Serialize)]
pub struct SpecFields {
    pub acceptance_rate: f64,
    pub mean_accepted: f64,
    pub drafted: usize,
    pub wasted_draft_tokens: usize,
    pub stale_blocks: usize,
    /// Token trees: side nodes sent, and committed tokens a lane guessed where the main path
    /// missed (JSON: `branch_hits`, its first name: this output only gains fields).
    pub side_nodes: usize,
    #[serde(rename = "branch_hits")]
    pub lane_hits: usize,
    /// α counting a lane's hit as accepted.
    pub tree_acceptance_rate: f64,
    pub target_forwards: u64,
    pub rounds: usize,
    /// Committed tokens that were drafted and judged right by the target, and the verifier's own
    /// (the first token, corrections, bonuses, tokens it decoded): what the verifier's usage
    /// ledger and metrics count for the session.
    pub accepted_draft_tokens: usize,
    pub cloud_tokens: usize,
    pub gamma: usize,
    pub depth: usize,
    pub rtt_ms: f64,
    pub verify_rule: String,
    /// Whether the policy chose γ and depth (then `gamma` / `depth` are where it ended).
    pub auto: bool,
    /// Draft, verify and round-trip times the edge measured.
    pub measured: tandem_spec::Measured,
    /// Drafted tokens a structured output's grammar forced (drafted without a draft forward).
    pub forced_tokens: usize,
    /// The edge's copies from the session's text (drafted without a draft forward): proposed,
    /// judged by the committed text, right.
    pub copied: tandem_edge::drafter::CopyStats,
    /// Committed tokens the verifier guessed from the session's text while it decoded alone.
    pub verifier_guessed: usize,
}

/// Everything a speculative run needs.
pub struct SpecRun<'a> {
    pub target: Arc<LlamaModel>,
    pub draft: Arc<LlamaModel>,
    pub tokenizer: &'a Tokenizer,
    pub cloud: EngineConfig,
    pub edge: EngineConfig,
    pub spec: SpecConfig,
    /// Emulated round trip (± jitter per direction) to the verifier: a netem proxy in front of the
    /// in-process one, or of `cloud_url`.
    pub rtt_ms: f64,
    pub jitter_ms: f64,
    /// A running verifier (`tandem cloud serve`) to use instead of an in-process one.
    pub cloud_url: Option<String>,
    /// The tenant's API key for `cloud_url` (None: a verifier without tenants).
    pub api_key: Option<String>,
    /// The CA (PEM) that signed an `https://` `cloud_url`'s certificate (None: the web PKI's).
    pub tls_ca: Option<String>,
    /// Structured output: the grammar the answer follows (both sides mask with it).
    pub grammar: Option<tandem_spec::GrammarSource>,
}

/// What a speculative run shows as it goes.
#[derive(Debug, Clone, Copy)]
pub enum Shown<'a> {
    /// Verified text: final.
    Committed(&'a str),
    /// The whole unverified tail as it stands now (replaces the previous one).
    Tentative(&'a str),
    /// The target replaced the draft's token.
    Correction { draft: &'a str, target: &'a str },
}

/// Run one prompt through a verifier (in-process, or gRPC at `cloud_url`) and the edge pipeline,
/// passing verified text to `on_text`.
pub fn run(r: &SpecRun, prompt_ids: &[u32], mut on_text: impl FnMut(&str)) -> Result<GenOutput> {
    run_shown(r, prompt_ids, false, &mut |s| {
        if let Shown::Committed(t) = s {
            on_text(t)
        }
    })
}

/// [`run`], showing corrections too, and with `tentative` the unverified tail after every step
/// (decoded only then: it is work on the edge's loop).
pub fn run_shown(
    r: &SpecRun,
    prompt_ids: &[u32],
    tentative: bool,
    on_show: &mut dyn FnMut(Shown<'_>),
) -> Result<GenOutput> {
    match &r.cloud_url {
        Some(url) if r.rtt_ms > 0.0 => {
            // An emulated link in front of a remote verifier: many edge processes can share one
            // `tandem cloud serve`, each behind its own round trip.
            let upstream = crate::netem::resolve(url).map_err(|e| anyhow!("--cloud {e}"))?;
            let rt = crate::runtime()?;
            let (front, task) = crate::netem::spawn_front(rt.handle(), upstream, link_of(r))
                .map_err(|e| anyhow!("invalid emulated link: {e}"))?;
            let out = run_grpc(r, &front, prompt_ids, tentative, on_show);
            task.abort();
            rt.shutdown_timeout(Duration::from_millis(200));
            out
        }
        Some(url) => run_grpc(r, url, prompt_ids, tentative, on_show),
        None => {
            let local = LocalVerifier::start(r)?;
            let mut out = run_grpc(r, &local.url, prompt_ids, tentative, on_show)?;
            let stats = local.stop()?;
            if let Some(s) = out.spec.as_mut() {
                s.target_forwards = stats.target_forwards;
            }
            Ok(out)
        }
    }
}

fn run_grpc(
    r: &SpecRun,
    url: &str,
    prompt_ids: &[u32],
    tentative: bool,
    on_show: &mut dyn FnMut(Shown<'_>),
) -> Result<GenOutput> {
    let rt = crate::runtime().context("starting the gRPC client runtime")?;
    let mut draft = Engine::new(r.draft.clone(), r.edge).context("draft engine")?;
    // The draft's grammar is compiled before the clock starts (the verifier compiles its own
    // at Open: that is in the time to the first token).
    let grammar = match &r.grammar {
        Some(src) => Some(
            r.tokenizer
                .grammar_vocab(r.draft.cfg.vocab)?
                .compile(src)
                .map_err(|e| anyhow!("the grammar: {e}"))?,
        ),
        None => None,
    };
    let start = Instant::now();
    let req = tandem_edge::grpc::OpenRequest {
        tokenizer_fingerprint: r.tokenizer.fingerprint().to_string(),
        prompt_ids: prompt_ids.to_vec(),
        params: r.spec.params,
        max_tokens: r.spec.session.max_new_tokens as u32,
        rule: r.spec.rule,
        // With the adaptive policy, ask for its bounds; the grant caps them.
        want_draft_len: r
            .spec
            .session
            .auto
            .map_or(r.spec.session.draft_len, |a| a.max_draft_len) as u32,
        want_depth: r
            .spec
            .session
            .auto
            .map_or(r.spec.session.depth, |a| a.max_depth) as u32,
        want_side_nodes: r.spec.session.tree.side_nodes as u32,
        api_key: r.api_key.clone(),
        tls_ca: r.tls_ca.clone(),
        route: None,
        grammar: r.grammar.clone(),
        output_from: None,
        logprobs: None,
        self_draft: r.spec.self_draft,
    };
    let spec = r.spec;
    let (mut link, first) = if spec.session.tree.side_nodes == 0 {
        // Linear blocks: the draft prefills the prompt and drafts on while the Open is on its
        // way, and the first blocks follow the Open (`EdgeSession::opening`).
        let link = tandem_edge::grpc::GrpcLink::start_within(&rt, url, req, RECONNECT_WINDOW_MS)
            .with_context(|| format!("opening a session on {url}"))?;
        tandem_edge::prefill_draft(&mut draft, prompt_ids).context("draft prefill")?;
        (link, None)
    } else {
        // Token trees wait for the grant that bounds their side nodes. The draft prefills the
        // prompt while the verifier prefills it too.
        let (connected, prefilled) = std::thread::scope(|s| {
            let open = s.spawn(|| {
                tandem_edge::grpc::GrpcLink::connect_within(&rt, url, req, RECONNECT_WINDOW_MS)
            });
            let prefilled = tandem_edge::prefill_draft(&mut draft, prompt_ids);
            (open.join(), prefilled)
        });
        let (link, opened) = connected
            .map_err(|_| anyhow!("the gRPC connect thread panicked"))?
            .with_context(|| format!("opening a session on {url}"))?;
        prefilled.context("draft prefill")?;
        (link, Some(tandem_edge::grpc::opened(&opened)))
    };
    let (report, text, forced, copied) = drive(
        r, &spec, &mut draft, grammar, &mut link, prompt_ids, first, start, tentative, on_show,
    )
    .with_context(|| format!("speculating against {url}"))?;
    link.close();
    drop(link);
    rt.shutdown_timeout(Duration::from_millis(200));
    let mut out = finish(r, &spec, prompt_ids, report, text, on_show)?;
    if let Some(s) = out.spec.as_mut() {
        s.forced_tokens = forced;
        s.copied = copied;
    }
    Ok(out)
}

/// Run the edge pipeline on `link`, streaming committed text; returns the report and the text shown.
#[allow(clippy::too_many_arguments)]
fn drive(
    r: &SpecRun,
    spec: &SpecConfig,
    draft: &mut Engine,
    grammar: Option<tandem_spec::Grammar>,
    link: &mut dyn Link,
    prompt_ids: &[u32],
    opened: Option<tandem_spec::Opened>,
    start: Instant,
    tentative: bool,
    on_show: &mut dyn FnMut(Shown<'_>),
) -> Result<(
    tandem_edge::SpecReport,
    String,
    usize,
    tandem_edge::drafter::CopyStats,
)> {
    let tok = r.tokenizer;
    let mut stream = TextStream::default();
    let mut text = String::new();
    let mut drafter = tandem_edge::EngineDrafter::new(draft, prompt_ids, spec);
    if let Some(g) = grammar {
        drafter.constrain(g, prompt_ids.len());
    }
    let report = tandem_edge::run_with(
        &mut drafter,
        tok.eog_ids(),
        prompt_ids,
        opened,
        spec,
        link,
        start,
        |u| {
            let say = |ids: &[u32]| {
                let ids: Vec<u32> = ids.iter().copied().filter(|&t| !tok.is_eog(t)).collect();
                tok.decode(&ids).unwrap_or_default()
            };
            let n = u.committed.len();
            for (i, &id) in u.committed.iter().enumerate() {
                // A rejecting verdict's last committed token is the correction.
                if let (Some((d, t)), true) = (u.correction, i + 1 == n) {
                    let name = |t: u32| {
                        if tok.is_eog(t) {
                            "⟨end⟩".to_string()
                        } else {
                            say(&[t])
                        }
                    };
                    on_show(Shown::Correction {
                        draft: &name(d),
                        target: &name(t),
                    });
                }
                if tok.is_eog(id) {
                    continue;
                }
                if let Ok(piece) = stream.push(tok, id) {
                    if !piece.is_empty() {
                        on_show(Shown::Committed(&piece));
                        text.push_str(&piece);
                    }
                }
            }
            if tentative {
                on_show(Shown::Tentative(&say(u.tentative)));
            }
        },
    )?;
    Ok((
        report,
        text,
        drafter.forced_tokens(),
        drafter.copy_stats().unwrap_or_default(),
    ))
}

/// The emulated link `r` asks for.
fn link_of(r: &SpecRun) -> NetemConfig {
    NetemConfig {
        rtt_ms: r.rtt_ms,
        jitter_ms: r.jitter_ms,
        ..NetemConfig::default()
    }
}

/// A verifier in this process: the batcher on its own thread, the gRPC service on a loopback port,
/// and a netem proxy in front when there is a round trip to emulate.
struct LocalVerifier {
    rt: tokio::runtime::Runtime,
    url: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    server: tokio::task::JoinHandle<Result<(), tandem_cloud::grpc::TransportError>>,
    batcher: thread::JoinHandle<
        tandem_verifier::VerifierCore<tandem_engine::Engine, tandem_cloud::Reply>,
    >,
}

impl LocalVerifier {
    fn start(r: &SpecRun) -> Result<Self> {
        let engine = Engine::new(r.target.clone(), r.cloud).context("verifier engine")?;
        // Grant whatever this edge may ask for.
        let (len, depth) =
            r.spec
                .session
                .auto
                .map_or((r.spec.session.draft_len, r.spec.session.depth), |a| {
                    (
                        a.max_draft_len.max(r.spec.session.draft_len),
                        a.max_depth.max(r.spec.session.depth),
                    )
                });
        let info = tandem_cloud::grpc::ServiceInfo::new("in-process", &r.target, r.tokenizer);
        // The budget holds any block this edge may send, with its correction in front.
        let cfg = tandem_verifier::VerifierConfig {
            token_budget: tandem_verifier::VerifierConfig::default()
                .token_budget
                .max(len + 1),
            load: tandem_cloud::grpc::serving_load(len as u32, depth as u32),
            ..tandem_verifier::VerifierConfig::default()
        };
        let (service, batcher) =
            tandem_cloud::grpc::start(engine, cfg, info, tandem_cloud::tenants::Tenants::open())
                .context("starting the verifier")?;
        let rt = crate::runtime().context("starting the verifier's runtime")?;
        let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
        let addr = listener.local_addr()?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = rt.spawn(tandem_cloud::grpc::serve_grpc(
            service,
            listener,
            async {
                let _ = stopped.await;
            },
            Duration::ZERO,
        ));
        let url = if r.rtt_ms > 0.0 {
            crate::netem::spawn_front(rt.handle(), addr, link_of(r))
                .map_err(|e| anyhow!("invalid emulated link: {e}"))?
                .0
        } else {
            format!("http://{addr}")
        };
        Ok(Self {
            rt,
            url,
            stop: Some(stop),
            server,
            batcher,
        })
    }

    /// Shut the service down and return the verifier's counters.
    fn stop(mut self) -> Result<tandem_verifier::VerifierStats> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        let _ = self.rt.block_on(async {
            tokio::time::timeout(Duration::from_secs(2), &mut self.server).await
        });
        // Dropping the runtime drops every session task and with them the batcher's senders.
        self.rt.shutdown_timeout(Duration::from_millis(200));
        let v = self
            .batcher
            .join()
            .map_err(|_| anyhow!("the verifier thread panicked"))?;
        Ok(v.stats)
    }
}

#[allow(clippy::too_many_arguments)]
fn finish(
    r: &SpecRun,
    spec: &SpecConfig,
    prompt_ids: &[u32],
    report: tandem_edge::SpecReport,
    text: String,
    on_show: &mut dyn FnMut(Shown<'_>),
) -> Result<GenOutput> {
    let tok = r.tokenizer;
    let mut o = crate::generate::output(
        tok,
        prompt_ids,
        report.output_ids.clone(),
        &report.commit_ms,
        &text,
        &mut |t: &str| on_show(Shown::Committed(t)),
    )?;
    let s = report.stats;
    o.mode = crate::Mode::of_depth(spec.session.depth);
    o.weights = format!("{}+{}", r.target.format(), r.draft.format());
    o.threads = r.edge.threads + r.cloud.threads;
    o.spec = Some(SpecFields {
        acceptance_rate: round2(s.acceptance_rate() * 100.0) / 100.0,
        mean_accepted: round2(s.mean_accepted()),
        drafted: s.drafted,
        wasted_draft_tokens: s.wasted_draft_tokens,
        stale_blocks: s.stale_blocks,
        side_nodes: s.side_nodes,
        lane_hits: s.lane_hits,
        tree_acceptance_rate: round2(s.tree_acceptance_rate() * 100.0) / 100.0,
        // Known for the in-process verifier; a shared remote one counts all its tenants'.
        target_forwards: 0,
        rounds: s.verdicts,
        accepted_draft_tokens: s.verdict_accepted,
        cloud_tokens: report.output_ids.len().saturating_sub(s.verdict_accepted),
        gamma: report.measured.final_draft_len,
        depth: report.measured.final_depth,
        rtt_ms: r.rtt_ms,
        verify_rule: format!("{:?}", spec.rule.effective(&spec.params)).to_lowercase(),
        auto: spec.session.auto.is_some(),
        measured: report.measured,
        forced_tokens: 0,
        copied: Default::default(),
        verifier_guessed: s.verifier_guessed,
    });
    Ok(o)
}
