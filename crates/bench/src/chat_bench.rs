//! `tandem bench chat`: conversations, as chat apps and agent loops send them. N users each hold
//! a conversation of T turns (a system prompt, then a question per turn, the whole history sent
//! each turn, answers of up to M tokens); every turn is timed (time to first token, inter-token
//! latency) and its usage read (prompt tokens, and those the verifier's prefix cache served: the
//! rest is the prefill the cloud computed). In the same run, on the same link and cores:
//! speculation through `tandem serve` over HTTP (OpenAI's streamed chat completions) and
//! cloud-only streaming (the verifier's `Generate` RPC over the same rendered history), with the
//! prefix caches on and off (the verifier's, `cloud serve --no-prefix-cache`, and the edge's
//! draft's, `tandem serve --no-prefix-cache`, together). Every user's system
//! prompt names the user, the mode and the level, so that no conversation hits another's pages:
//! what is measured is one conversation's reuse of its own history.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use serde::Serialize;
use tandem_engine::tokenizer::ChatMessage;
use tandem_engine::{CpuSet, Engine, EngineConfig, Tokenizer};
use tandem_models::store::{self as models, ModelSpec};
use tandem_sim::stats::round2;
use tandem_spec::sampling::SamplingParams;

use crate::cloudproc::{CloudProcess, Link};

/// The questions of a conversation, one per turn (cycled past the last).
pub const QUESTIONS: [&str; 12] = [
    "What is a bicycle?",
    "How many wheels does it have, and why?",
    "What are the pedals for?",
    "Why do bicycles have gears?",
    "What is the chain made of?",
    "How do the brakes stop a bicycle?",
    "What is a tandem bicycle?",
    "Who steers a tandem, and who only pedals?",
    "Is a tandem faster than a normal bicycle?",
    "What should a rider wear?",
    "How often should the tyres be pumped?",
    "Summarise our conversation in two sentences.",
];

/// What `bench chat` runs.
#[derive(Debug, Clone)]
pub struct ChatBenchArgs {
    pub home: PathBuf,
    /// Concurrent conversations, one level each.
    pub users: Vec<usize>,
    pub turns: usize,
    pub max_tokens: usize,
    pub rtt_ms: f64,
    /// The prefix caches, the verifier's and the edge's together: on, off, or both (one verifier
    /// process each).
    pub cache: Vec<bool>,
    pub gamma: usize,
    pub depth: usize,
    pub edge_cpus: CpuSet,
    pub cloud_cpus: CpuSet,
}

/// One turn, over the users: means of its requests.
#[derive(Debug, Clone, Serialize)]
pub struct Turn {
    pub turn: usize,
    pub prompt_tokens: f64,
    /// Served by the verifier's prefix cache.
    pub cached_tokens: f64,
    /// Computed by the verifier's prefill: prompt − cached.
    pub prefill_tokens: f64,
    /// Of the tokens before this turn's question (the last prompt and its answer), the share the
    /// cache served (None at the first turn).
    pub history_hit: Option<f64>,
    pub ttft_ms: f64,
    /// The analytic model's time to first token for this turn (`capacity::operate_on`): the
    /// verifier's measured forward cost, this turn's prompt and cached tokens (the hit rate as
    /// an input), the users, the round trip and the token budget.
    pub model_ttft_ms: Option<f64>,
    pub itl_ms: f64,
}

/// One way of serving at one level of users.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// `speculation` (tandem serve over HTTP) or `cloud-only`.
    pub mode: &'static str,
    pub cache: bool,
    pub users: usize,
    pub turns: Vec<Turn>,
    /// Turns that failed (an error instead of an answer).
    pub failed: usize,
    /// Cached over prompt tokens, all turns; and of the history before each turn's question
    /// (turns past the first).
    pub hit_rate: f64,
    pub history_hit: Option<f64>,
    /// The last turn's TTFT over the first's.
    pub ttft_growth: f64,
    pub itl_mean_ms: f64,
    pub wall_s: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatReport {
    pub rtt_ms: f64,
    pub turns: usize,
    pub max_tokens: usize,
    pub gamma: usize,
    pub depth: usize,
    pub rows: Vec<Row>,
}

/// One answered turn of one user.
pub(crate) struct Answered {
    pub(crate) text: String,
    /// Token ids of the answer (cloud-only), or its completion tokens' count (speculation).
    answer_tokens: usize,
    prompt_tokens: usize,
    cached_tokens: usize,
    token_ms: Vec<f64>,
}

/// The messages of a conversation so far.
fn system(user: usize, mode: &str, level: usize) -> ChatMessage {
    ChatMessage {
        role: "system".into(),
        // What tells the conversations apart comes first: within the first page.
        content: format!("[{mode} {user}/{level}] You are a helpful assistant. Answer briefly."),
    }
}

/// One streamed chat completion of `messages` over HTTP, timed token by token.
fn http_turn(
    agent: &ureq::Agent,
    url: &str,
    messages: &[ChatMessage],
    max_tokens: usize,
) -> Result<Answered> {
    let msgs: Vec<serde_json::Value> = messages
        .iter()
        .map(|m| serde_json::json!({"role": m.role, "content": m.content}))
        .collect();
    let mut a = Answered {
        text: String::new(),
        answer_tokens: 0,
        prompt_tokens: 0,
        cached_tokens: 0,
        token_ms: Vec::new(),
    };
    let chunks = crate::serve_bench::chat_stream(agent, url, msgs.into(), max_tokens)?;
    for (now, c) in chunks {
        if let Some(text) = crate::serve_bench::chunk_text(&c) {
            a.token_ms.push(now);
            a.text.push_str(text);
        }
        let u = &c["usage"];
        if let Some(n) = u["completion_tokens"].as_u64() {
            a.answer_tokens = n as usize;
            a.prompt_tokens = u["prompt_tokens"].as_u64().unwrap_or(0) as usize;
            a.cached_tokens = u["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap_or(0) as usize;
        }
    }
    Ok(a)
}

/// One cloud-only turn: the rendered history through the verifier's `Generate` RPC (greedy;
/// under `grammar`'s mask when given: a structured output).
pub(crate) fn cloud_turn(
    rt: &tokio::runtime::Runtime,
    url: &str,
    tok: &Tokenizer,
    messages: &[ChatMessage],
    max_tokens: usize,
    grammar: Option<&tandem_spec::GrammarSource>,
) -> Result<Answered> {
    let ids = tok.encode(&tok.render_chat(messages)?)?;
    let t0 = Instant::now();
    let (mut out, mut token_ms) = (Vec::new(), Vec::new());
    let cached = tandem_edge::grpc::generate_remote_with(
        rt,
        tandem_edge::grpc::Remote::plain(url),
        tok.fingerprint(),
        &ids,
        SamplingParams::default(),
        max_tokens as u32,
        tandem_edge::grpc::GenerateOptions {
            grammar,
            ..Default::default()
        },
        |t| {
            if !tok.is_eog(t) {
                token_ms.push(t0.elapsed().as_secs_f64() * 1e3);
                out.push(t);
            }
        },
    )?;
    Ok(Answered {
        text: tok.decode(&out)?,
        answer_tokens: out.len(),
        prompt_tokens: ids.len(),
        cached_tokens: cached as usize,
        token_ms,
    })
}

/// `n` users at once, each holding a conversation of `turns` turns through `turn`: every
/// user's answered turns (None: the turn failed, and the conversation ended there).
fn conversations(
    n: usize,
    turns: usize,
    mode: &str,
    turn: &(dyn Fn(&[ChatMessage]) -> Result<Answered> + Sync),
) -> Vec<Vec<Option<Answered>>> {
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|u| {
                s.spawn(move || {
                    let mut history = vec![system(u, mode, n)];
                    let mut got = Vec::new();
                    for k in 0..turns {
                        history.push(ChatMessage {
                            role: "user".into(),
                            content: QUESTIONS[k % QUESTIONS.len()].into(),
                        });
                        match turn(&history) {
                            Ok(a) => {
                                history.push(ChatMessage {
                                    role: "assistant".into(),
                                    content: a.text.clone(),
                                });
                                got.push(Some(a));
                            }
                            Err(e) => {
                                tracing::warn!("user {u}, turn {k}: {e:#}");
                                got.push(None);
                                break;
                            }
                        }
                    }
                    got
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or_default())
            .collect()
    })
}

fn mean(x: impl Iterator<Item = f64>) -> f64 {
    let (s, n) = x.fold((0.0, 0usize), |(s, n), v| (s + v, n + 1));
    if n == 0 {
        0.0
    } else {
        s / n as f64
    }
}

/// A row from every user's turns.
fn row(
    mode: &'static str,
    cache: bool,
    users: &[Vec<Option<Answered>>],
    turns: usize,
    wall_s: f64,
) -> Row {
    let failed = users
        .iter()
        .map(|u| u.iter().filter(|t| t.is_none()).count() + turns.saturating_sub(u.len()))
        .sum();
    let mut per_turn = Vec::new();
    let (mut hit_num, mut hit_den) = (0.0, 0.0);
    let mut gaps = Vec::new();
    for k in 0..turns {
        let done: Vec<(&Answered, Option<&Answered>)> = users
            .iter()
            .filter_map(|u| {
                let a = u.get(k)?.as_ref()?;
                let prev = k.checked_sub(1).and_then(|j| u.get(j)?.as_ref());
                Some((a, prev))
            })
            .collect();
        if done.is_empty() {
            continue;
        }
        let history: Vec<f64> = done
            .iter()
            .filter_map(|(a, p)| {
                let p = (*p)?;
                let before = (p.prompt_tokens + p.answer_tokens) as f64;
                hit_num += a.cached_tokens as f64;
                hit_den += before;
                Some(a.cached_tokens as f64 / before.max(1.0))
            })
            .collect();
        for (a, _) in &done {
            gaps.extend(a.token_ms.windows(2).map(|w| w[1] - w[0]));
        }
        per_turn.push(Turn {
            turn: k + 1,
            prompt_tokens: round2(mean(done.iter().map(|(a, _)| a.prompt_tokens as f64))),
            cached_tokens: round2(mean(done.iter().map(|(a, _)| a.cached_tokens as f64))),
            prefill_tokens: round2(mean(
                done.iter()
                    .map(|(a, _)| (a.prompt_tokens - a.cached_tokens) as f64),
            )),
            history_hit: (!history.is_empty()).then(|| round2(mean(history.into_iter()))),
            ttft_ms: round2(mean(
                done.iter().filter_map(|(a, _)| a.token_ms.first().copied()),
            )),
            model_ttft_ms: None,
            itl_ms: round2(mean(done.iter().flat_map(|(a, _)| {
                a.token_ms
                    .windows(2)
                    .map(|w| w[1] - w[0])
                    .collect::<Vec<_>>()
            }))),
        });
    }
    let all: Vec<&Answered> = users.iter().flatten().flatten().collect();
    let prompt: usize = all.iter().map(|a| a.prompt_tokens).sum();
    let cached: usize = all.iter().map(|a| a.cached_tokens).sum();
    let growth = match (per_turn.first(), per_turn.last()) {
        (Some(f), Some(l)) if f.ttft_ms > 0.0 => round2(l.ttft_ms / f.ttft_ms),
        _ => 0.0,
    };
    Row {
        mode,
        cache,
        users: users.len(),
        turns: per_turn,
        failed,
        hit_rate: round2(cached as f64 / prompt.max(1) as f64),
        history_hit: (hit_den > 0.0).then(|| round2(hit_num / hit_den)),
        ttft_growth: growth,
        itl_mean_ms: round2(mean(gaps.into_iter())),
        wall_s: round2(wall_s),
    }
}

/// Put the analytic model's time to first token beside each turn of `r`: the verifier's prefill
/// of the prompt tokens its cache did not hold, after a round trip, at this many users decoding
/// (at γ 0 in both modes: the first token is the verifier's prefill's in both, and α and the
/// draft's speed do not enter it). The model has no term for attention over the history, so
/// what grows with the history past the prefill is the engine's attention.
fn predict(r: &mut Row, cost: Option<&tandem_spec::capacity::ForwardCost>, a: &ChatBenchArgs) {
    let Some(cost) = cost else {
        return;
    };
    let costs = tandem_spec::policy::Costs {
        alpha: 0.0,
        draft_ms: 0.0,
        verify_ms: 0.0,
        verify_ms_per_token: 0.0,
        rtt_ms: a.rtt_ms,
        verdict_ms: 0.0,
    };
    for t in &mut r.turns {
        let w = tandem_spec::capacity::Workload {
            prompt_tokens: t.prompt_tokens.round() as usize,
            cached_tokens: t.cached_tokens.round() as usize,
            new_tokens: a.max_tokens,
            token_budget: tandem_verifier::VerifierConfig::default().token_budget,
            copying: tandem_spec::never_idle::Copying::NONE,
        };
        let o = tandem_spec::capacity::operate_on(&costs, cost, r.users, 0, 1, &w);
        t.model_ttft_ms = Some(round2(o.ttft_ms));
    }
}

pub fn run(a: &ChatBenchArgs, progress: &mut dyn FnMut(&str)) -> Result<ChatReport> {
    if a.users.is_empty() || a.users.contains(&0) || a.turns == 0 || a.max_tokens == 0 {
        bail!("--users, --turns and --max-tokens must be at least 1");
    }
    if a.cache.is_empty() {
        bail!("--cache: on, off, or both");
    }
    let draft = models::load(&a.home, &ModelSpec::DRAFT, None, true)?;
    let target = models::load(&a.home, &ModelSpec::TARGET, None, true)?;
    let edge_cfg = EngineConfig {
        threads: 1,
        // As `tandem serve` has it by default.
        kv_budget_bytes: tandem_edge::commands::DEFAULT_KV_MB << 20,
        kv_block_size: 16,
        cpus: a.edge_cpus,
    };
    let spec = tandem_edge::SpecConfig {
        session: tandem_spec::edge::SessionConfig {
            draft_len: a.gamma,
            depth: a.depth,
            max_new_tokens: a.max_tokens,
            auto: None,
            tree: tandem_spec::TreeConfig::LINEAR,
        },
        rule: tandem_spec::VerifyRule::Greedy,
        params: SamplingParams::default(),
        q_top_k: 32,
        self_draft: true,
        suffix: true,
    };
    let tok = Arc::new(target.tokenizer);
    let mut rows = Vec::new();
    for &cache in &a.cache {
        let extra: Vec<String> = if cache {
            Vec::new()
        } else {
            vec!["--no-prefix-cache".into()]
        };
        let cloud = CloudProcess::start(&a.home, &a.cloud_cpus, &extra)?;
        let model = |r: &mut Row| predict(r, cloud.forward_cost.as_ref(), a);
        let mut link = Link::new()?;
        let front = link.set(&cloud.addr, a.rtt_ms, 0.0)?;
        let serve = crate::serve_bench::InProcessServe::start(
            &front,
            Engine::new(draft.model.clone(), edge_cfg)?,
            tok.clone(),
            spec,
            Duration::from_secs(3),
            cache,
        )?;
        let url = serve.url.clone();
        let agent = ureq::AgentBuilder::new()
            .timeout(Duration::from_secs(600))
            .max_idle_connections_per_host(64)
            .build();
        let grpc = tandem_client::runtime()?;
        for &n in &a.users {
            let on = if cache { "on" } else { "off" };
            progress(&format!(
                "speculation (tandem serve), cache {on}, {n} users"
            ));
            let t0 = Instant::now();
            let users = conversations(n, a.turns, "speculation", &|m| {
                http_turn(&agent, &url, m, a.max_tokens)
            });
            let mut r = row(
                "speculation",
                cache,
                &users,
                a.turns,
                t0.elapsed().as_secs_f64(),
            );
            model(&mut r);
            rows.push(r);
            progress(&format!("cloud-only (Generate), cache {on}, {n} users"));
            let t0 = Instant::now();
            let users = conversations(n, a.turns, "cloud-only", &|m| {
                cloud_turn(&grpc, &front, &tok, m, a.max_tokens, None)
            });
            let mut r = row(
                "cloud-only",
                cache,
                &users,
                a.turns,
                t0.elapsed().as_secs_f64(),
            );
            model(&mut r);
            rows.push(r);
        }
        serve.stop()?;
        drop(grpc);
        drop(link);
        drop(cloud);
    }
    Ok(ChatReport {
        rtt_ms: a.rtt_ms,
        turns: a.turns,
        max_tokens: a.max_tokens,
        gamma: a.gamma,
        depth: a.depth,
        rows,
    })
}

/// The report as markdown: a summary per row, then each row's turns.
pub fn table(r: &ChatReport) -> String {
    let mut s = format!(
        "bench chat: {} turns, answers of up to {} tokens, rtt {} ms, γ {} depth {}\n\n",
        r.turns, r.max_tokens, r.rtt_ms, r.gamma, r.depth
    );
    s.push_str("| mode | prefix cache | users | failed turns | hit rate | history from cache | TTFT first → last turn (ms) | last / first | ITL (ms) | wall (s) |\n");
    s.push_str("|---|---|---|---|---|---|---|---|---|---|\n");
    let pct = |x: f64| format!("{:.0}%", 100.0 * x);
    for row in &r.rows {
        let (f, l) = (
            row.turns.first().map_or(0.0, |t| t.ttft_ms),
            row.turns.last().map_or(0.0, |t| t.ttft_ms),
        );
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {:.0} → {:.0} | {:.2} | {:.1} | {:.1} |\n",
            row.mode,
            if row.cache { "on" } else { "off" },
            row.users,
            row.failed,
            pct(row.hit_rate),
            row.history_hit.map_or("—".into(), pct),
            f,
            l,
            row.ttft_growth,
            row.itl_mean_ms,
            row.wall_s,
        ));
    }
    for row in &r.rows {
        s.push_str(&format!(
            "\n{}, cache {}, {} users:\n\n| turn | prompt tokens | cached | cloud prefill | history from cache | TTFT (ms) | model TTFT (ms) | ITL (ms) |\n|---|---|---|---|---|---|---|---|\n",
            row.mode,
            if row.cache { "on" } else { "off" },
            row.users
        ));
        for t in &row.turns {
            s.push_str(&format!(
                "| {} | {:.0} | {:.0} | {:.0} | {} | {:.0} | {} | {:.1} |\n",
                t.turn,
                t.prompt_tokens,
                t.cached_tokens,
                t.prefill_tokens,
                t.history_hit.map_or("—".into(), pct),
                t.ttft_ms,
                t.model_ttft_ms.map_or("—".into(), |m| format!("{m:.0}")),
                t.itl_ms
            ));
        }
    }
    s
}
