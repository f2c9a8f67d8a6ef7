//! Speculative generation with an in-process verifier: the target runs in its own thread behind a
//! delay line that emulates the network's round trip, the draft runs here and drives the pipeline.
//! `sync` is the same code with depth 1.

use std::sync::mpsc::{Receiver, Sender};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context, Result};
use serde::Serialize;
use tandem_cloud::{serve, ToCloud, ToEdge, Verifier};
use tandem_edge::delay::delay_channel;
use tandem_edge::{EdgeError, Link, SpecConfig};
use tandem_engine::tokenizer::TextStream;
use tandem_engine::{Engine, EngineConfig, LlamaModel, Tokenizer};
use tandem_spec::{Block, Verdict};

use crate::generate::GenOutput;
use crate::stats::round2;

/// What `generate --json` adds in the speculative modes.
#[derive(Debug, Clone, Serialize)]
pub struct SpecFields {
    pub acceptance_rate: f64,
    pub mean_accepted: f64,
    pub drafted: usize,
    pub wasted_draft_tokens: usize,
    pub stale_blocks: usize,
    pub target_forwards: u64,
    pub rounds: usize,
    pub gamma: usize,
    pub depth: usize,
    pub rtt_ms: f64,
    pub verify_rule: String,
    /// Whether the policy chose γ and depth (then `gamma` / `depth` are where it ended).
    pub auto: bool,
    /// Draft, verify and round-trip times the edge measured.
    pub measured: tandem_edge::Measured,
}

struct InProcessLink {
    session: u64,
    tx: Sender<ToCloud>,
    rx: Receiver<ToEdge>,
}

impl InProcessLink {
    fn map(m: ToEdge) -> Result<Option<Verdict>, EdgeError> {
        match m {
            ToEdge::Verdict(v) => Ok(Some(v)),
            ToEdge::Error { message } => Err(EdgeError::Refused(message)),
            ToEdge::Opened { .. } | ToEdge::Token { .. } => Ok(None),
        }
    }
}

impl Link for InProcessLink {
    fn send(&mut self, block: Block) -> Result<(), EdgeError> {
        self.tx
            .send(ToCloud::Draft {
                session: self.session,
                block,
            })
            .map_err(|_| EdgeError::LinkClosed)
    }

    fn recv(&mut self, wait: bool) -> Result<Option<Verdict>, EdgeError> {
        loop {
            let m = if wait {
                self.rx.recv().map_err(|_| EdgeError::LinkClosed)?
            } else {
                match self.rx.try_recv() {
                    Ok(m) => m,
                    Err(std::sync::mpsc::TryRecvError::Empty) => return Ok(None),
                    Err(_) => return Err(EdgeError::LinkClosed),
                }
            };
            if let Some(v) = Self::map(m)? {
                return Ok(Some(v));
            }
        }
    }
}

/// Everything a speculative run needs.
pub struct SpecRun<'a> {
    pub target: Arc<LlamaModel>,
    pub draft: Arc<LlamaModel>,
    pub tokenizer: &'a Tokenizer,
    pub cloud: EngineConfig,
    pub edge: EngineConfig,
    pub spec: SpecConfig,
    /// Emulated round trip of the in-process link (ignored with `cloud_url`).
    pub rtt_ms: f64,
    /// A running verifier (`tandem cloud serve`) to use instead of an in-process one.
    pub cloud_url: Option<String>,
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
    run_shown(r, prompt_ids, &mut |s| {
        if let Shown::Committed(t) = s {
            on_text(t)
        }
    })
}

/// [`run`], showing tentative tokens and corrections too.
pub fn run_shown(
    r: &SpecRun,
    prompt_ids: &[u32],
    on_show: &mut dyn FnMut(Shown<'_>),
) -> Result<GenOutput> {
    match &r.cloud_url {
        Some(url) => run_grpc(r, url, prompt_ids, on_show),
        None => run_in_process(r, prompt_ids, on_show),
    }
}

fn run_grpc(
    r: &SpecRun,
    url: &str,
    prompt_ids: &[u32],
    on_show: &mut dyn FnMut(Shown<'_>),
) -> Result<GenOutput> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .context("starting the gRPC client runtime")?;
    let mut draft = Engine::new(r.draft.clone(), r.edge).context("draft engine")?;
    let start = Instant::now();
    let req = tandem_edge::grpc::OpenRequest {
        tokenizer_fingerprint: r.tokenizer.fingerprint().to_string(),
        prompt_ids: prompt_ids.to_vec(),
        params: r.spec.params,
        max_tokens: r.spec.max_new_tokens as u32,
        rule: r.spec.rule,
        // With the adaptive policy, ask for its bounds; the grant caps them.
        want_draft_len: r.spec.auto.map_or(r.spec.draft_len, |a| a.max_draft_len) as u32,
        want_depth: r.spec.auto.map_or(r.spec.depth, |a| a.max_depth) as u32,
    };
    // The draft prefills the prompt while the verifier prefills it too.
    let (connected, prefilled) = std::thread::scope(|s| {
        let open = s.spawn(|| tandem_edge::grpc::GrpcLink::connect(&rt, url, req));
        let prefilled = tandem_edge::prefill_draft(&mut draft, prompt_ids);
        (open.join(), prefilled)
    });
    let (mut link, opened) = connected
        .map_err(|_| anyhow!("the gRPC connect thread panicked"))?
        .with_context(|| format!("opening a session on {url}"))?;
    prefilled.context("draft prefill")?;
    let (granted_len, granted_depth) = (opened.draft_len as usize, opened.depth as usize);
    let spec = SpecConfig {
        draft_len: r.spec.draft_len.min(granted_len),
        depth: r.spec.depth.min(granted_depth),
        auto: r.spec.auto.map(|a| tandem_edge::AutoShape {
            max_draft_len: granted_len,
            max_depth: granted_depth,
            ..a
        }),
        ..r.spec
    };
    let (report, text) = drive(
        r,
        &spec,
        &mut draft,
        &mut link,
        prompt_ids,
        opened.first_token,
        start,
        on_show,
    )?;
    link.close();
    drop(link);
    rt.shutdown_timeout(Duration::from_millis(200));
    finish(r, &spec, prompt_ids, report, text, None, on_show)
}

/// Run the edge pipeline on `link`, streaming committed text; returns the report and the text shown.
#[allow(clippy::too_many_arguments)]
fn drive(
    r: &SpecRun,
    spec: &SpecConfig,
    draft: &mut Engine,
    link: &mut dyn Link,
    prompt_ids: &[u32],
    first: u32,
    start: Instant,
    on_show: &mut dyn FnMut(Shown<'_>),
) -> Result<(tandem_edge::SpecReport, String)> {
    let tok = r.tokenizer;
    let mut stream = TextStream::default();
    let mut text = String::new();
    let report = tandem_edge::run(
        draft,
        tok.eog_ids(),
        prompt_ids,
        first,
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
                    on_show(Shown::Correction {
                        draft: &say(&[d]),
                        target: &say(&[t]),
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
            on_show(Shown::Tentative(&say(u.tentative)));
        },
    )?;
    Ok((report, text))
}

fn run_in_process(
    r: &SpecRun,
    prompt_ids: &[u32],
    on_show: &mut dyn FnMut(Shown<'_>),
) -> Result<GenOutput> {
    let one_way = Duration::from_secs_f64(r.rtt_ms / 2e3);
    let (to_cloud, cloud_rx) = delay_channel::<ToCloud>(one_way);
    let (reply_tx, reply_rx) = delay_channel::<ToEdge>(one_way);
    let target_engine = Engine::new(r.target.clone(), r.cloud).context("verifier engine")?;
    let server = thread::Builder::new()
        .name("tandem-verifier".into())
        .spawn(move || serve(Verifier::new(target_engine), cloud_rx, Default::default()))
        .context("starting the verifier thread")?;
    let mut draft = Engine::new(r.draft.clone(), r.edge).context("draft engine")?;
    let start = Instant::now();
    let session = 1;
    to_cloud
        .send(ToCloud::Open {
            session,
            prompt: prompt_ids.to_vec(),
            params: r.spec.params,
            rule: r.spec.rule,
            reply: tandem_cloud::reply_to(reply_tx),
        })
        .map_err(|_| anyhow!("the verifier stopped"))?;
    // The draft prefills the prompt while the verifier prefills it too.
    tandem_edge::prefill_draft(&mut draft, prompt_ids).context("draft prefill")?;
    let first = match reply_rx.recv() {
        Ok(ToEdge::Opened { first, .. }) => first,
        Ok(ToEdge::Error { message }) => {
            return Err(anyhow!("the verifier refused the session: {message}"))
        }
        Ok(ToEdge::Verdict(_) | ToEdge::Token { .. }) | Err(_) => {
            return Err(anyhow!("the verifier did not open the session"))
        }
    };
    let mut link = InProcessLink {
        session,
        tx: to_cloud.clone(),
        rx: reply_rx,
    };
    let (report, text) = drive(
        r, &r.spec, &mut draft, &mut link, prompt_ids, first, start, on_show,
    )?;
    let _ = to_cloud.send(ToCloud::Close { session });
    drop(link);
    drop(to_cloud);
    let verifier = server
        .join()
        .map_err(|_| anyhow!("the verifier thread panicked"))?;
    finish(
        r,
        &r.spec,
        prompt_ids,
        report,
        text,
        Some(verifier.stats.target_forwards),
        on_show,
    )
}

#[allow(clippy::too_many_arguments)]
fn finish(
    r: &SpecRun,
    spec: &SpecConfig,
    prompt_ids: &[u32],
    report: tandem_edge::SpecReport,
    text: String,
    target_forwards: Option<u64>,
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
    o.mode = if spec.depth == 1 { "sync" } else { "async" };
    o.weights = format!("{}+{}", r.target.format(), r.draft.format());
    o.threads = r.edge.threads + r.cloud.threads;
    o.spec = Some(SpecFields {
        acceptance_rate: round2(s.acceptance_rate() * 100.0) / 100.0,
        mean_accepted: round2(s.mean_accepted()),
        drafted: s.drafted,
        wasted_draft_tokens: s.wasted_draft_tokens,
        stale_blocks: s.stale_blocks,
        // Counted by the in-process verifier; a remote one reports it in its metrics.
        target_forwards: target_forwards.unwrap_or(0),
        rounds: s.verdicts,
        gamma: report.measured.final_draft_len,
        depth: report.measured.final_depth,
        rtt_ms: if r.cloud_url.is_some() { 0.0 } else { r.rtt_ms },
        verify_rule: format!("{:?}", spec.rule.effective(&spec.params)).to_lowercase(),
        auto: spec.auto.is_some(),
        measured: report.measured,
    });
    Ok(o)
}
