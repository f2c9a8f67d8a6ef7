//! `tandem bench serve`: the edge daemon under concurrent API clients. One verifier process
//! (pinned to the cloud's core) behind an emulated round trip; `tandem serve`'s HTTP server and
//! draft engine in this process (the draft pinned to the edge's core); N clients stream chat
//! completions at once over real HTTP (OpenAI's SSE chunks) and time every token as it arrives.
//! In the same run, on the same link and cores: one session driven in-process without HTTP (the
//! edge's speculation loop, as `generate --mode async` runs it), and at every N as many
//! cloud-only streams (the verifier's `Generate` RPC: the baseline every speculative row is
//! compared with).

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use serde::Serialize;
use tandem_engine::{CpuSet, Engine, EngineConfig};
use tandem_models::store::{self as models, ModelSpec};
use tandem_sim::stats::{round2, Summary};
use tandem_spec::sampling::SamplingParams;

use crate::cloudproc::{CloudProcess, Link};

/// What `bench serve` runs.
#[derive(Debug, Clone)]
pub struct ServeBenchArgs {
    pub home: PathBuf,
    /// Concurrent API clients, one level each.
    pub clients: Vec<usize>,
    /// Requests each client sends, one after another.
    pub rounds: usize,
    /// Cloud-only and tandem serve, this many times at each number of clients, the two in turn
    /// first (the machine's noise, and its drift within a pair, against the figures'
    /// differences: the ratios' median over the repeats).
    pub repeats: usize,
    pub max_tokens: usize,
    pub rtt_ms: f64,
    pub gamma: usize,
    pub depth: usize,
    pub prompts: Vec<String>,
    /// The edge's draft, as `tandem serve --model` takes it (the target is its catalog model's,
    /// else the default target).
    pub draft: ModelSpec,
    /// How the draft's weights run.
    pub draft_weights: tandem_engine::WeightMode,
    /// The verifier keeps every session speculating (`cloud serve --fixed-grants`): no takeovers.
    pub fixed_grants: bool,
    /// More flags for the verifier (`cloud serve`).
    pub cloud_args: Vec<String>,
    pub edge_cpus: CpuSet,
    pub cloud_cpus: CpuSet,
}

/// One row: a way of serving, at one number of concurrent clients.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// `http` (tandem serve), `in-process` (the same speculation without HTTP), `cloud-only`.
    pub mode: &'static str,
    pub clients: usize,
    /// Which repeat of this number of clients (from 0; the in-process row has one).
    pub repeat: usize,
    pub requests: usize,
    /// Completion tokens, all requests.
    pub tokens: usize,
    pub wall_s: f64,
    pub requests_per_s: f64,
    pub tokens_per_s: f64,
    /// Time to the first token, over requests.
    pub ttft_ms: Summary,
    /// Inter-token latency: its mean and p99 over every gap between tokens of every request;
    /// each request's own p99, the median request's and the worst request's.
    pub itl_mean_ms: f64,
    pub itl_p99_all_ms: f64,
    pub itl_p99_median_request_ms: f64,
    pub itl_p99_ms: f64,
    /// From a request's last token to its end (the stream's `[DONE]`; cloud-only: the call's
    /// return, its client runtime's shutdown included; in process: the end of generation's
    /// token), mean over requests: time a client that sends its next request after the end
    /// waits for.
    pub after_last_token_ms: f64,
    /// Accepted over judged draft positions, over the requests (speculative rows that were
    /// judged at all).
    pub alpha: Option<f64>,
    /// Committed tokens that were accepted draft tokens (the rest are the verifier's own: its
    /// first token, corrections, bonuses, and tokens it decoded when it took the session over).
    pub draft_share: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ServeReport {
    /// The edge's draft (`draft`: the default one), and how its weights ran.
    pub draft: String,
    pub draft_weights: String,
    pub rtt_ms: f64,
    pub fixed_grants: bool,
    pub cloud_args: Vec<String>,
    pub gamma: usize,
    pub depth: usize,
    pub max_tokens: usize,
    pub repeats: usize,
    pub rows: Vec<Row>,
    /// Mean ITL of one HTTP client over the in-process session's, minus one (0.03: HTTP adds 3%).
    pub http_itl_overhead: Option<f64>,
    /// tandem serve over cloud-only, at each number of clients and repeat.
    pub versus: Vec<Versus>,
    /// Each ratio's median, least and greatest over the repeats, at each number of clients.
    pub versus_over_repeats: Vec<VersusSpread>,
}

/// [`Versus`]'s figures over the repeats at one number of clients: each field taken on its own
/// (the least tokens/s and the least TTFT may come from different repeats), so their `repeat`
/// is 0.
#[derive(Debug, Clone, Serialize)]
pub struct VersusSpread {
    pub clients: usize,
    pub repeats: usize,
    pub median: Versus,
    pub min: Versus,
    pub max: Versus,
}

/// tandem serve's figures over cloud-only's at one number of clients (1.1: 10% more).
#[derive(Debug, Clone, Serialize)]
pub struct Versus {
    pub clients: usize,
    pub repeat: usize,
    pub tokens_per_s: f64,
    pub ttft_mean: f64,
    pub ttft_p99: f64,
    /// The worst request's p99 ITL, the median request's, and the p99 over every gap.
    pub itl_p99_worst_request: f64,
    pub itl_p99_median_request: f64,
    pub itl_p99_all: f64,
}

/// tandem serve against cloud-only at each number of clients both rows have.
fn versus(rows: &[Row]) -> Vec<Versus> {
    let ratio = |a: f64, b: f64| if b > 0.0 { round2(a / b) } else { 0.0 };
    rows.iter()
        .filter(|h| h.mode == "http")
        .filter_map(|h| {
            let c = rows.iter().find(|c| {
                c.mode == "cloud-only" && c.clients == h.clients && c.repeat == h.repeat
            })?;
            Some(Versus {
                clients: h.clients,
                repeat: h.repeat,
                tokens_per_s: ratio(h.tokens_per_s, c.tokens_per_s),
                ttft_mean: ratio(h.ttft_ms.mean, c.ttft_ms.mean),
                ttft_p99: ratio(h.ttft_ms.p99, c.ttft_ms.p99),
                itl_p99_worst_request: ratio(h.itl_p99_ms, c.itl_p99_ms),
                itl_p99_median_request: ratio(
                    h.itl_p99_median_request_ms,
                    c.itl_p99_median_request_ms,
                ),
                itl_p99_all: ratio(h.itl_p99_all_ms, c.itl_p99_all_ms),
            })
        })
        .collect()
}

/// Each ratio of `versus` over the repeats at each number of clients, in the order first met.
fn over_repeats(versus: &[Versus]) -> Vec<VersusSpread> {
    let mut clients: Vec<usize> = Vec::new();
    for v in versus {
        if !clients.contains(&v.clients) {
            clients.push(v.clients);
        }
    }
    clients
        .into_iter()
        .map(|n| {
            let vs: Vec<&Versus> = versus.iter().filter(|v| v.clients == n).collect();
            // One figure of every repeat, sorted: its median (the mean of the middle two for an
            // even count), least and greatest.
            let pick = |f: fn(&Versus) -> f64| {
                let mut x: Vec<f64> = vs.iter().map(|v| f(v)).collect();
                x.sort_by(f64::total_cmp);
                let m = x.len() / 2;
                let median = if x.len() % 2 == 1 {
                    x[m]
                } else {
                    (x[m - 1] + x[m]) / 2.0
                };
                (round2(median), x[0], x[x.len() - 1])
            };
            let fields: [fn(&Versus) -> f64; 6] = [
                |v| v.tokens_per_s,
                |v| v.ttft_mean,
                |v| v.ttft_p99,
                |v| v.itl_p99_worst_request,
                |v| v.itl_p99_median_request,
                |v| v.itl_p99_all,
            ];
            let got: Vec<(f64, f64, f64)> = fields.iter().map(|&f| pick(f)).collect();
            let make = |which: fn(&(f64, f64, f64)) -> f64| Versus {
                clients: n,
                repeat: 0,
                tokens_per_s: which(&got[0]),
                ttft_mean: which(&got[1]),
                ttft_p99: which(&got[2]),
                itl_p99_worst_request: which(&got[3]),
                itl_p99_median_request: which(&got[4]),
                itl_p99_all: which(&got[5]),
            };
            VersusSpread {
                clients: n,
                repeats: vs.len(),
                median: make(|g| g.0),
                min: make(|g| g.1),
                max: make(|g| g.2),
            }
        })
        .collect()
}

/// One request's timing: the time of each token from the request, ms.
struct Timed {
    token_ms: Vec<f64>,
    /// When the request was done (the stream's end, or the call's return), ms.
    end_ms: f64,
    tokens: usize,
    accepted: usize,
    judged: usize,
}

/// A row from its requests' timings over `wall_s`.
fn row(mode: &'static str, clients: usize, repeat: usize, timed: &[Timed], wall_s: f64) -> Row {
    let tokens: usize = timed.iter().map(|t| t.tokens).sum();
    let ttft: Vec<f64> = timed
        .iter()
        .filter_map(|t| t.token_ms.first().copied())
        .collect();
    let per_request: Vec<Vec<f64>> = timed
        .iter()
        .map(|t| t.token_ms.windows(2).map(|w| w[1] - w[0]).collect())
        .collect();
    let gaps = per_request.concat();
    let p99s: Vec<f64> = per_request.iter().map(|g| Summary::of(g).p99).collect();
    let worst_p99 = p99s.iter().copied().fold(0.0, f64::max);
    let gap_summary = Summary::of(&gaps);
    let (acc, judged) = timed
        .iter()
        .fold((0, 0), |(a, j), t| (a + t.accepted, j + t.judged));
    let after: Vec<f64> = timed
        .iter()
        .filter_map(|t| t.token_ms.last().map(|l| t.end_ms - l))
        .collect();
    let s = Summary::of(&ttft);
    Row {
        mode,
        clients,
        repeat,
        requests: timed.len(),
        tokens,
        wall_s: round2(wall_s),
        requests_per_s: round2(timed.len() as f64 / wall_s),
        tokens_per_s: round2(tokens as f64 / wall_s),
        ttft_ms: Summary {
            mean: round2(s.mean),
            p50: round2(s.p50),
            p99: round2(s.p99),
        },
        itl_mean_ms: round2(gap_summary.mean),
        itl_p99_all_ms: round2(gap_summary.p99),
        itl_p99_median_request_ms: round2(Summary::of(&p99s).p50),
        itl_p99_ms: round2(worst_p99),
        after_last_token_ms: round2(Summary::of(&after).mean),
        alpha: (judged > 0).then(|| round2(acc as f64 / judged as f64)),
        draft_share: (mode != "cloud-only" && tokens > 0)
            .then(|| round2(acc as f64 / tokens as f64)),
    }
}

/// `n` clients at once, each sending `rounds` requests one after another (request `i` of them
/// all: client `c`'s round `r` is `c + r·n`); their timings and the wall time.
fn concurrently(
    n: usize,
    rounds: usize,
    request: &(dyn Fn(usize) -> Result<Timed> + Sync),
) -> Result<(Vec<Timed>, f64)> {
    let t0 = Instant::now();
    let results: Vec<Result<Vec<Timed>>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|c| s.spawn(move || (0..rounds).map(|r| request(c + r * n)).collect()))
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow!("a client panicked")))
            })
            .collect()
    });
    let wall = t0.elapsed().as_secs_f64();
    let mut timed = Vec::new();
    for r in results {
        timed.extend(r?);
    }
    Ok((timed, wall))
}

/// A streamed chat completion of `messages` (with usage) over HTTP: each chunk as it arrived,
/// with its time from the request (ms). An error event is an error.
pub(crate) fn chat_stream(
    agent: &ureq::Agent,
    url: &str,
    messages: serde_json::Value,
    max_tokens: usize,
) -> Result<Vec<(f64, serde_json::Value)>> {
    let t0 = Instant::now();
    let body = serde_json::json!({
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let resp = agent
        .post(url)
        .send_json(body)
        .map_err(|e| anyhow!("POST {url}: {e}"))?;
    let mut chunks = Vec::new();
    for line in BufReader::new(resp.into_reader()).lines() {
        let line = line?;
        let Some(data) = line.strip_prefix("data: ") else {
            if line.starts_with("event: error") {
                bail!("the server sent an error event");
            }
            continue;
        };
        if data == "[DONE]" {
            break;
        }
        let now = t0.elapsed().as_secs_f64() * 1e3;
        chunks.push((now, serde_json::from_str(data)?));
    }
    Ok(chunks)
}

/// A chunk's text, when it carries some (each content chunk is one committed token's text).
pub(crate) fn chunk_text(c: &serde_json::Value) -> Option<&str> {
    c["choices"][0]["delta"]["content"]
        .as_str()
        .filter(|t| !t.is_empty())
}

/// One streamed chat completion over HTTP, timed token by token.
fn http_request(agent: &ureq::Agent, url: &str, prompt: &str, max_tokens: usize) -> Result<Timed> {
    let messages = serde_json::json!([{"role": "user", "content": prompt}]);
    let t0 = Instant::now();
    let mut t = Timed {
        end_ms: 0.0,
        token_ms: Vec::new(),
        tokens: 0,
        accepted: 0,
        judged: 0,
    };
    let chunks = chat_stream(agent, url, messages, max_tokens)?;
    t.end_ms = t0.elapsed().as_secs_f64() * 1e3;
    for (now, c) in chunks {
        if chunk_text(&c).is_some() {
            t.token_ms.push(now);
        }
        if let Some(n) = c["usage"]["completion_tokens"].as_u64() {
            t.tokens = n as usize;
        }
        let ext = &c["tandem"];
        if ext["num_drafts"].is_u64() {
            // α over judged positions: accepted, and judged = accepted / α.
            let a = ext["num_accepted_draft_tokens"].as_u64().unwrap_or(0) as usize;
            let alpha = ext["alpha"].as_f64().unwrap_or(0.0);
            t.accepted = a;
            t.judged = if alpha > 0.0 {
                (a as f64 / alpha).round() as usize
            } else {
                0
            };
        }
    }
    Ok(t)
}

pub fn run(a: &ServeBenchArgs, progress: &mut dyn FnMut(&str)) -> Result<ServeReport> {
    if a.clients.is_empty()
        || a.clients.contains(&0)
        || a.rounds == 0
        || a.repeats == 0
        || a.max_tokens == 0
    {
        bail!("--clients, --rounds, --repeats and --max-tokens must be at least 1");
    }
    if a.prompts.is_empty() {
        bail!("no prompts");
    }
    let draft = models::load(&a.home, &a.draft, Some(a.draft_weights), true)
        .with_context(|| format!("the draft {}", a.draft))?;
    let target = models::load(&a.home, &a.draft.target(), None, true)?;
    // The verifier serves the draft's target (unless a --cloud-arg names another model).
    let serves = (!a.cloud_args.iter().any(|c| c.starts_with("--model")))
        .then(|| format!("--model={}", a.draft.target()));
    let extra: Vec<String> = serves
        .into_iter()
        .chain(a.fixed_grants.then(|| "--fixed-grants".to_string()))
        .chain(a.cloud_args.iter().cloned())
        .collect();
    let cloud = CloudProcess::start(&a.home, &a.cloud_cpus, &extra)?;
    let mut link = Link::new()?;
    let front = link.set(&cloud.addr, a.rtt_ms, 0.0)?;
    let edge_cfg = EngineConfig {
        threads: 1,
        kv_budget_bytes: 512 << 20,
        kv_block_size: 16,
        cpus: a.edge_cpus,
    };
    let session = tandem_spec::edge::SessionConfig {
        draft_len: a.gamma,
        depth: a.depth,
        max_new_tokens: a.max_tokens,
        auto: None,
        tree: tandem_spec::TreeConfig::LINEAR,
    };
    let spec = tandem_edge::SpecConfig {
        session,
        rule: tandem_spec::VerifyRule::Rejection,
        params: SamplingParams::default(),
        q_top_k: 32,
        self_draft: true,
        suffix: true,
    };
    let prompt = |i: usize| a.prompts[i % a.prompts.len()].as_str();
    let mut rows = Vec::new();

    // One session in-process, no HTTP: the same requests one after another.
    progress("in-process, 1 client");
    let run = tandem_client::speculate::SpecRun {
        target: target.model.clone(),
        draft: draft.model.clone(),
        tokenizer: &draft.tokenizer,
        cloud: edge_cfg,
        edge: edge_cfg,
        spec,
        rtt_ms: a.rtt_ms,
        jitter_ms: 0.0,
        cloud_url: Some(format!("http://{}", cloud.addr)),
        api_key: None,
        tls_ca: None,
        grammar: None,
    };
    let t0 = Instant::now();
    let mut timed = Vec::new();
    for i in 0..a.rounds {
        let ids = draft.tokenizer.encode_chat(prompt(i))?;
        let out = tandem_client::speculate::run(&run, &ids, |_| {})?;
        let s = out.spec.as_ref();
        let judged = s.map_or(0, |s| {
            if s.acceptance_rate > 0.0 {
                (s.accepted_draft_tokens as f64 / s.acceptance_rate).round() as usize
            } else {
                0
            }
        });
        timed.push(Timed {
            end_ms: out.token_ms.last().copied().unwrap_or(0.0),
            token_ms: untimed_end(&out),
            tokens: out.output_ids.len(),
            accepted: s.map_or(0, |s| s.accepted_draft_tokens),
            judged,
        });
    }
    rows.push(row("in-process", 1, 0, &timed, t0.elapsed().as_secs_f64()));

    // tandem serve in this process, N clients over HTTP.
    // The target's tokenizer is the draft's (the verifier checks the fingerprint).
    let serve = InProcessServe::start(
        &front,
        Engine::new(draft.model.clone(), edge_cfg)?,
        Arc::new(target.tokenizer),
        spec,
        Duration::from_secs(10),
        true,
    )?;
    let url = serve.url.clone();
    let agent = ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(600))
        .max_idle_connections_per_host(64)
        .build();
    let cloud_only = |i: usize| -> Result<Timed> {
        let ids = draft.tokenizer.encode_chat(prompt(i))?;
        let t0 = Instant::now();
        let out = tandem_client::generate::generate_remote(
            tandem_edge::grpc::Remote {
                url: &front,
                api_key: None,
                tls_ca: None,
            },
            &draft.tokenizer,
            &ids,
            a.max_tokens,
            &SamplingParams::default(),
            |_| {},
        )?;
        let end_ms = t0.elapsed().as_secs_f64() * 1e3;
        Ok(Timed {
            end_ms,
            token_ms: untimed_end(&out),
            tokens: out.output_ids.len(),
            accepted: 0,
            judged: 0,
        })
    };
    for &n in &a.clients {
        // Cloud-only streaming (the verifier decodes every token: the Generate RPC) and tandem
        // serve, with the same N clients and prompts; the pair again for each repeat, the two
        // in turn first (a machine that drifts within a pair favours neither).
        for r in 0..a.repeats {
            let of = if a.repeats > 1 {
                format!(" (repeat {} of {})", r + 1, a.repeats)
            } else {
                String::new()
            };
            for mode in pair_order(r) {
                if mode == "cloud-only" {
                    progress(&format!("cloud-only, {n} clients{of}"));
                    let (timed, wall) = concurrently(n, a.rounds, &cloud_only)?;
                    rows.push(row("cloud-only", n, r, &timed, wall));
                } else {
                    progress(&format!("tandem serve over HTTP, {n} clients{of}"));
                    let (timed, wall) = concurrently(n, a.rounds, &|i| {
                        http_request(&agent, &url, prompt(i), a.max_tokens)
                    })?;
                    rows.push(row("http", n, r, &timed, wall));
                }
            }
        }
    }
    // The daemon's session readers go with their runtime, before the proxy under their streams.
    serve.stop()?;
    drop(link);
    let mean = |mode: &str| {
        rows.iter()
            .find(|r| r.mode == mode && r.clients == 1 && r.repeat == 0)
            .map(|r| r.itl_mean_ms)
    };
    let http_itl_overhead = match (mean("http"), mean("in-process")) {
        (Some(h), Some(i)) if i > 0.0 => Some(round2((h / i - 1.0) * 100.0) / 100.0),
        _ => None,
    };
    Ok(ServeReport {
        draft: a.draft.to_string(),
        draft_weights: format!("{:?}", a.draft_weights).to_lowercase(),
        rtt_ms: a.rtt_ms,
        fixed_grants: a.fixed_grants,
        cloud_args: a.cloud_args.clone(),
        gamma: a.gamma,
        depth: a.depth,
        max_tokens: a.max_tokens,
        repeats: a.repeats,
        versus: versus(&rows),
        versus_over_repeats: over_repeats(&versus(&rows)),
        rows,
        http_itl_overhead,
    })
}

/// The order of repeat `r`'s pair: cloud-only first in even repeats, tandem serve in odd ones.
fn pair_order(r: usize) -> [&'static str; 2] {
    if r.is_multiple_of(2) {
        ["cloud-only", "http"]
    } else {
        ["http", "cloud-only"]
    }
}

/// The tokens' times without the end of generation's (a client sees no text for it).
fn untimed_end(out: &tandem_client::generate::GenOutput) -> Vec<f64> {
    let mut t = out.token_ms.clone();
    if out.finish_reason == "stop" {
        t.pop();
    }
    t
}

/// The report as markdown.
pub fn table(r: &ServeReport) -> String {
    let with = if r.cloud_args.is_empty() {
        String::new()
    } else {
        format!(", the verifier run with {}", r.cloud_args.join(" "))
    };
    let mut s = format!(
        "tandem serve: draft {} ({}), rtt {} ms, γ {} depth {}, {} tokens per answer, {}{with}\n\n",
        r.draft,
        r.draft_weights,
        r.rtt_ms,
        r.gamma,
        r.depth,
        r.max_tokens,
        if r.fixed_grants {
            "fixed grants (every session speculates)"
        } else {
            "the verifier's grants (it takes over sessions that speculation would slow)"
        }
    );
    s.push_str("| mode | clients | repeat | requests | tokens | req/s | tok/s | TTFT mean ms | TTFT p99 ms | ITL mean ms | ITL p99 ms (all gaps) | ITL p99 ms (median request) | ITL p99 ms (worst request) | last token to end ms | α | draft share |\n");
    s.push_str("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for row in &r.rows {
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} | {:.2} | {:.1} | {:.0} | {:.0} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {} | {} |\n",
            row.mode,
            row.clients,
            row.repeat + 1,
            row.requests,
            row.tokens,
            row.requests_per_s,
            row.tokens_per_s,
            row.ttft_ms.mean,
            row.ttft_ms.p99,
            row.itl_mean_ms,
            row.itl_p99_all_ms,
            row.itl_p99_median_request_ms,
            row.itl_p99_ms,
            row.after_last_token_ms,
            row.alpha.map_or("–".into(), |a| format!("{a:.2}")),
            row.draft_share.map_or("–".into(), |a| format!("{a:.2}"))
        ));
    }
    if !r.versus.is_empty() {
        s.push_str("\ntandem serve over cloud-only at the same number of clients:\n\n");
        s.push_str("| clients | repeat | tok/s | TTFT mean | TTFT p99 | ITL p99 (worst request) | ITL p99 (median request) | ITL p99 (all gaps) |\n");
        s.push_str("|---|---|---|---|---|---|---|---|\n");
        for v in &r.versus {
            s.push_str(&format!(
                "| {} | {} | {:.2}× | {:.2}× | {:.2}× | {:.2}× | {:.2}× | {:.2}× |\n",
                v.clients,
                v.repeat + 1,
                v.tokens_per_s,
                v.ttft_mean,
                v.ttft_p99,
                v.itl_p99_worst_request,
                v.itl_p99_median_request,
                v.itl_p99_all
            ));
        }
    }
    if r.repeats > 1 && !r.versus_over_repeats.is_empty() {
        s.push_str(&format!(
            "\nThe same over {} repeats: median (least–greatest):\n\n",
            r.repeats
        ));
        s.push_str("| clients | tok/s | TTFT mean | TTFT p99 | ITL p99 (worst request) | ITL p99 (median request) | ITL p99 (all gaps) |\n");
        s.push_str("|---|---|---|---|---|---|---|\n");
        for o in &r.versus_over_repeats {
            let cell = |f: fn(&Versus) -> f64| {
                format!("{:.2}× ({:.2}–{:.2})", f(&o.median), f(&o.min), f(&o.max))
            };
            s.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} | {} |\n",
                o.clients,
                cell(|v| v.tokens_per_s),
                cell(|v| v.ttft_mean),
                cell(|v| v.ttft_p99),
                cell(|v| v.itl_p99_worst_request),
                cell(|v| v.itl_p99_median_request),
                cell(|v| v.itl_p99_all)
            ));
        }
    }
    if let Some(o) = r.http_itl_overhead {
        s.push_str(&format!(
            "\nHTTP adds {:+.1}% to one client's mean ITL (against the same session in-process).\n",
            o * 100.0
        ));
    }
    s
}

/// `tandem serve` in this process on a loopback port, in front of the verifier at `cloud`: the
/// benchmarks' edge daemon (`bench serve`, `bench chat`), the shipped configuration but for the
/// session shape, the connect timeout and the prefix cache.
pub struct InProcessServe {
    rt: tokio::runtime::Runtime,
    /// Its chat completions endpoint.
    pub url: String,
    stop: tokio::sync::oneshot::Sender<()>,
    server: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl InProcessServe {
    pub fn start(
        cloud: &str,
        engine: Engine,
        tok: Arc<tandem_engine::Tokenizer>,
        spec: tandem_edge::SpecConfig,
        connect_timeout: Duration,
        prefix_cache: bool,
    ) -> Result<Self> {
        let rt = tandem_client::runtime()?;
        let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
        let addr = listener.local_addr()?;
        let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let cfg = tandem_edge::serve::ServeConfig {
            clouds: vec![cloud.to_string()],
            api_key: None,
            tls_ca: None,
            client_keys: Vec::new(),
            model_name: "bench".into(),
            spec,
            fallback_local: false,
            connect_timeout,
            reconnect_window: Duration::from_millis(tandem_spec::edge::RECONNECT_WINDOW_MS),
            prefix_cache,
        };
        let server = rt.spawn(tandem_edge::serve::serve(
            listener,
            engine,
            tok,
            cfg,
            async move {
                let _ = stop_rx.await;
            },
        ));
        Ok(Self {
            rt,
            url: format!("http://{addr}/v1/chat/completions"),
            stop,
            server,
        })
    }

    /// Stop serving and wait for the daemon's end; its runtime (and the session readers on it)
    /// goes with it.
    pub fn stop(self) -> Result<()> {
        let _ = self.stop.send(());
        self.rt
            .block_on(self.server)
            .context("the server task")?
            .context("serving")?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(clients: usize, repeat: usize, x: f64) -> Versus {
        Versus {
            clients,
            repeat,
            tokens_per_s: x,
            ttft_mean: 2.0 * x,
            ttft_p99: x,
            itl_p99_worst_request: 10.0 - x,
            itl_p99_median_request: x,
            itl_p99_all: x,
        }
    }

    fn timed(gap_ms: f64) -> Timed {
        Timed {
            token_ms: (0..10).map(|i| 100.0 + gap_ms * i as f64).collect(),
            end_ms: 100.0 + gap_ms * 9.0,
            tokens: 10,
            accepted: 0,
            judged: 0,
        }
    }

    #[test]
    fn the_header_names_the_draft_and_the_flags_the_verifier_ran_with() {
        let mut r = ServeReport {
            draft: "/m/SmolLM2-135M-Instruct.w8a16-g32.gguf".into(),
            draft_weights: "w4a8".into(),
            rtt_ms: 50.0,
            fixed_grants: false,
            cloud_args: Vec::new(),
            gamma: 2,
            depth: 3,
            max_tokens: 48,
            repeats: 1,
            rows: Vec::new(),
            http_itl_overhead: None,
            versus: Vec::new(),
            versus_over_repeats: Vec::new(),
        };
        let first = |r: &ServeReport| table(r).lines().next().unwrap().to_string();
        assert!(
            first(&r)
                .starts_with("tandem serve: draft /m/SmolLM2-135M-Instruct.w8a16-g32.gguf (w4a8),"),
            "{}",
            first(&r)
        );
        assert!(
            first(&r).ends_with("speculation would slow)"),
            "{}",
            first(&r)
        );
        r.cloud_args = vec!["--forward-cost=1,100".into(), "--quiet-ms=0".into()];
        assert!(
            first(&r).ends_with(
                "speculation would slow), the verifier run with --forward-cost=1,100 --quiet-ms=0"
            ),
            "{}",
            first(&r)
        );
    }

    #[test]
    fn the_two_modes_take_turns_going_first() {
        let orders: Vec<_> = (0..4).map(pair_order).collect();
        assert_eq!(orders[0], ["cloud-only", "http"]);
        assert_eq!(orders[1], ["http", "cloud-only"]);
        assert_eq!(orders[2], orders[0]);
        assert_eq!(orders[3], orders[1]);
    }

    #[test]
    fn tandem_serve_is_set_against_cloud_only_of_the_same_clients_and_repeat() {
        // Cloud-only's gaps 20 ms then 40 ms; tandem serve's 10 ms in both repeats: the first
        // repeat's p99 gap is half of cloud-only's, the second's a quarter.
        let rows = [
            row("in-process", 1, 0, &[timed(5.0)], 1.0),
            row("cloud-only", 1, 0, &[timed(20.0)], 1.0),
            row("http", 1, 0, &[timed(10.0)], 1.0),
            row("cloud-only", 1, 1, &[timed(40.0)], 1.0),
            row("http", 1, 1, &[timed(10.0)], 2.0),
        ];
        let vs = versus(&rows);
        assert_eq!(vs.len(), 2);
        assert_eq!((vs[0].repeat, vs[0].itl_p99_all), (0, 0.5));
        assert_eq!((vs[1].repeat, vs[1].itl_p99_all), (1, 0.25));
        assert_eq!(
            vs[1].tokens_per_s, 0.5,
            "the second repeat's wall was twice as long"
        );
        let o = over_repeats(&vs);
        assert_eq!((o[0].repeats, o[0].median.itl_p99_all), (2, 0.38));
    }

    #[test]
    fn each_ratio_is_summed_up_over_the_repeats_of_its_own_number_of_clients() {
        let vs = [
            v(1, 0, 1.3),
            v(4, 0, 0.9),
            v(1, 1, 1.0),
            v(4, 1, 1.1),
            v(1, 2, 1.2),
        ];
        let o = over_repeats(&vs);
        assert_eq!(o.iter().map(|o| o.clients).collect::<Vec<_>>(), [1, 4]);
        assert_eq!(o[0].repeats, 3);
        assert_eq!(o[0].median.tokens_per_s, 1.2);
        assert_eq!((o[0].min.tokens_per_s, o[0].max.tokens_per_s), (1.0, 1.3));
        assert_eq!(o[0].median.ttft_mean, 2.4);
        // Each field is sorted on its own: the least worst-request ratio is of another repeat.
        assert_eq!(o[0].min.itl_p99_worst_request, 10.0 - 1.3);
        // An even count: the mean of the middle two.
        assert_eq!(o[1].median.tokens_per_s, 1.0);
        assert_eq!((o[1].min.tokens_per_s, o[1].max.tokens_per_s), (0.9, 1.1));
    }
}
