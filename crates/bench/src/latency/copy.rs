//! `bench latency --workload FILE`: requests that copy their input (code edits, corrections,
//! extraction, quoting, a chat that refers back) beside the fresh-text prompts, with each source
//! of drafts added in turn: the draft model alone, the edge's copies from the session's text,
//! and the verifier's own guesses while it decodes a session alone (and, as the fair peer,
//! cloud-only with the verifier's own guesses). Every output is checked against cloud-only's.

use super::*;

/// One request of a workload: a chat ending with the user's turn, and what kind of copying it
/// asks for.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct ChatPrompt {
    pub kind: String,
    pub messages: Vec<Message>,
}

#[derive(Debug, Clone, serde::Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

/// The async rows: (the edge's copies, the verifier's own drafts).
const ASYNC_ROWS: [(bool, bool); 3] = [(false, false), (true, false), (true, true)];

/// The verifier's counters of its own guesses: fed, accepted.
/// The verifier's guesses fed and accepted so far, once it has settled (the last row's sessions
/// may still be finishing their forwards when their clients are done: two reads 100 ms apart
/// agree, or a second passed).
fn guesses(cloud: &CloudProcess) -> Result<(u64, u64)> {
    let read = || -> Result<(u64, u64)> {
        let m = crate::load::parse_metrics(&cloud.scrape()?);
        let get = |k: &str| m.get(k).copied().unwrap_or(0.0) as u64;
        Ok((
            get("tandem:self_draft_guesses_total"),
            get("tandem:self_drafted_tokens_total"),
        ))
    };
    let mut last = read()?;
    for _ in 0..10 {
        std::thread::sleep(std::time::Duration::from_millis(100));
        let now = read()?;
        if now == last {
            break;
        }
        last = now;
    }
    Ok(last)
}

/// Read a workload file: its chats, encoded with the model's template.
pub fn read(path: &Path, tok: &Tokenizer) -> Result<Vec<Vec<u32>>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("--workload {}", path.display()))?;
    let work: Vec<ChatPrompt> = serde_json::from_str(&text).with_context(|| {
        format!(
            "--workload {}: a list of {{kind, messages: [{{role, content}}]}}",
            path.display()
        )
    })?;
    if work.is_empty() {
        bail!("--workload {}: no requests", path.display());
    }
    work.iter()
        .enumerate()
        .map(|(i, w)| {
            if w.messages.last().is_none_or(|m| m.role != "user") {
                bail!(
                    "--workload {}: request {i} ({}) does not end with the user's turn",
                    path.display(),
                    w.kind
                );
            }
            let messages: Vec<tandem_engine::tokenizer::ChatMessage> = w
                .messages
                .iter()
                .map(|m| tandem_engine::tokenizer::ChatMessage {
                    role: m.role.clone(),
                    content: m.content.clone(),
                })
                .collect();
            Ok(tok.encode(&tok.render_chat(&messages)?)?)
        })
        .collect()
}

/// See the module docs.
pub(super) fn workload(
    a: &LatencyArgs,
    path: &Path,
    target: &Arc<LlamaModel>,
    tok: &Tokenizer,
    drafts: &[Draft],
    mut progress: impl FnMut(&Row),
) -> Result<LatencyReport> {
    let copy = read(path, tok)?;
    let fresh: Vec<Vec<u32>> = a
        .prompts
        .iter()
        .map(|p| tok.encode_chat(p))
        .collect::<Result<_, _>>()?;
    // The verifier as shipped (adaptive grants, drafting for itself where asked), its metrics
    // read for its guesses.
    let cloud = CloudProcess::start(
        &a.home,
        &a.cloud_cpus,
        &a.cloud_flags(&["--metrics-listen", "127.0.0.1:0"]),
    )?;
    let mut link = Link::new()?;
    let mut rows: Vec<Row> = Vec::new();
    let mut target_outputs = Vec::new();
    for &rtt in &a.rtts {
        let url = link.set(&cloud.addr, rtt, rtt * a.jitter_frac)?;
        for (name, prompts) in [("copy", &copy), ("fresh", &fresh)] {
            let mut want: Vec<Vec<u32>> = Vec::new();
            let mut emit = |mut r: Row, before: (u64, u64), rows: &mut Vec<Row>| -> Result<()> {
                let after = guesses(&cloud)?;
                r.workload = name.to_string();
                r.verifier_guesses = (after.0 - before.0, after.1 - before.1);
                progress(&r);
                rows.push(r);
                Ok(())
            };
            for self_draft in [false, true] {
                let before = guesses(&cloud)?;
                let outs = prompts
                    .iter()
                    .map(|p| {
                        tandem_client::generate::generate_remote_with(
                            tandem_edge::grpc::Remote::plain(&url),
                            tok,
                            p,
                            a.tokens,
                            &SamplingParams::default(),
                            tandem_edge::grpc::GenerateOptions {
                                grammar: None,
                                self_draft,
                            },
                            |_| {},
                        )
                    })
                    .collect::<Result<Vec<_>>>()?;
                if want.is_empty() {
                    want = outs.iter().map(|o| o.output_ids.clone()).collect();
                }
                let mut r = fold("-", rtt, Mode::CloudOnly, &outs, &want);
                r.self_draft = self_draft;
                emit(r, before, &mut rows)?;
            }
            for d in drafts {
                let auto = AutoShape {
                    max_draft_len: a.max_gamma,
                    max_depth: a.max_depth,
                    prior: tandem_spec::edge::default_prior(rtt),
                };
                for (suffix, self_draft) in ASYNC_ROWS {
                    let before = guesses(&cloud)?;
                    let outs = sourced_runs(
                        a,
                        (target, d, tok, url.as_str(), &prompts[..]),
                        (4, 2, Some(auto), LINEAR),
                        VerifyRule::Greedy,
                        SamplingParams::default(),
                        None,
                        Sources { suffix, self_draft },
                    )?;
                    let mut r = fold(&d.name, rtt, Mode::AsyncAuto, &outs, &want);
                    r.suffix = suffix;
                    r.self_draft = self_draft;
                    emit(r, before, &mut rows)?;
                }
            }
            if target_outputs.len() < copy.len() + fresh.len() {
                target_outputs.extend(want);
            }
        }
    }
    drop(link);
    drop(cloud);
    predict_all(&mut rows, copy.len(), fresh.len());
    Ok(LatencyReport {
        peer_model: Vec::new(),
        tokens: a.tokens,
        prompts: copy.len() + fresh.len(),
        jitter_frac: a.jitter_frac,
        edge_cpus: a.edge_cpus.to_string(),
        cloud_cpus: a.cloud_cpus.to_string(),
        calibration: Vec::new(),
        rows,
        target_outputs,
        summary: Vec::new(),
        peer: None,
    })
}

/// The verifier's own drafts in a row, as the model takes them: tokens and positions per decode
/// forward, from the tokens it decoded (its accepted guesses among them) and the guesses it fed.
fn copying_of(r: &Row) -> never_idle::Copying {
    let (fed, accepted) = r.verifier_guesses;
    let decodes = r.cloud_decoded.saturating_sub(accepted as usize).max(1) as f64;
    never_idle::Copying::from_rates(
        r.cloud_decoded.max(1) as f64 / decodes,
        1.0 + fed as f64 / decodes,
        tandem_verifier::VerifierConfig::default().self_draft_max,
    )
}

/// The model beside each row ([`never_idle::session_itl_ms_copying`]), per workload and RTT:
/// a one-position decode costs plain cloud-only's ITL, and each guess fed beside it what the
/// cloud-only row with the verifier's guesses says (calibrated on that row: its prediction is its
/// measurement); the async rows take their own α, draft time (a forward per token the model
/// drafted, none for a copy), the round trip and their verifier's guesses.
fn predict_all(rows: &mut [Row], copy_prompts: usize, fresh_prompts: usize) {
    let groups: Vec<(String, f64)> = rows
        .iter()
        .map(|r| (r.workload.clone(), r.rtt_ms))
        .collect();
    for (w, rtt) in groups {
        let find = |rows: &[Row], self_draft: bool| {
            rows.iter()
                .find(|r| {
                    r.workload == w
                        && r.rtt_ms == rtt
                        && r.mode == Mode::CloudOnly
                        && r.self_draft == self_draft
                })
                .cloned()
        };
        let (Some(plain), Some(own)) = (find(rows, false), find(rows, true)) else {
            continue;
        };
        let d0 = plain.itl_ms.mean;
        let k = copying_of(&own);
        let per_position = if k.positions_per_decode() > 1.0 {
            ((own.itl_ms.mean * k.tokens_per_decode() - d0) / (k.positions_per_decode() - 1.0))
                .max(0.0)
        } else {
            0.0
        };
        let prompts = if w == "copy" {
            copy_prompts
        } else {
            fresh_prompts
        };
        for r in rows
            .iter_mut()
            .filter(|r| r.workload == w && r.rtt_ms == rtt)
        {
            let copying = if r.self_draft {
                copying_of(r)
            } else {
                never_idle::Copying::NONE
            };
            let model_share = match r.drafted {
                0 => 1.0,
                n => 1.0 - r.copied.copied as f64 / n as f64,
            };
            let c = Costs {
                alpha: r.acceptance_rate,
                draft_ms: r.draft_ms * model_share.max(0.0),
                verify_ms: d0 - per_position,
                verify_ms_per_token: per_position,
                rtt_ms: rtt,
                verdict_ms: r.verdict_ms,
            };
            let p = match r.mode {
                Mode::CloudOnly => never_idle::cloud_only_itl_ms(&c, &copying),
                _ => {
                    let gaps = (r.tokens / prompts.max(1)).saturating_sub(1);
                    never_idle::session_itl_ms_copying(&c, r.gamma, r.depth, gaps, &copying)
                }
            };
            r.predicted_itl_ms = Some(round2(p));
            r.model_error = Some(round2((r.itl_ms.mean - p) / p * 100.0) / 100.0);
        }
    }
}

/// The workload's table: each row beside its workload's plain cloud-only ITL, and which source
/// committed how many tokens.
pub fn copy_table(r: &LatencyReport) -> String {
    let mut s = super::report::header(r);
    s += "| workload | RTT ms | mode | edge copies | verifier drafts | TTFT ms | ITL mean | p99 | × cloud-only | model ITL (err) | α (all drafts) | copies right / judged (proposed) | verifier guesses accepted / fed | committed: drafts accepted · verifier guessed · verifier's own | = target |\n";
    s += "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
    for x in &r.rows {
        let spec = x.mode != Mode::CloudOnly;
        let base = r
            .rows
            .iter()
            .find(|b| {
                b.workload == x.workload
                    && b.rtt_ms == x.rtt_ms
                    && b.mode == Mode::CloudOnly
                    && !b.self_draft
            })
            .map_or(0.0, |b| b.itl_ms.mean);
        let on = |b: bool| if b { "on" } else { "off" };
        s += &format!(
            "| {} | {:.0} | {} | {} | {} | {:.0} | {:.1} | {:.1} | {} | {} | {} | {} | {} | {} · {} · {} | {} |\n",
            x.workload,
            x.rtt_ms,
            x.mode,
            if spec { on(x.suffix) } else { "-" },
            on(x.self_draft),
            x.ttft_ms,
            x.itl_ms.mean,
            x.itl_ms.p99,
            if base > 0.0 { format!("{:.2}", x.itl_ms.mean / base) } else { "-".into() },
            match (x.predicted_itl_ms, x.model_error) {
                (Some(p), Some(e)) => format!("{p:.1} ({:+.0}%)", e * 100.0),
                _ => "-".into(),
            },
            if spec { format!("{:.2}", x.acceptance_rate) } else { "-".into() },
            if spec && x.suffix {
                format!("{} / {} ({})", x.copied.right, x.copied.judged, x.copied.copied)
            } else {
                "-".into()
            },
            if x.self_draft {
                format!("{} / {}", x.verifier_guesses.1, x.verifier_guesses.0)
            } else {
                "-".into()
            },
            x.accepted_draft_tokens,
            if spec { x.verifier_guessed } else { x.verifier_guesses.1 as usize },
            x.cloud_tokens
                .saturating_sub(if spec { x.verifier_guessed } else { x.verifier_guesses.1 as usize }),
            x.same_as_target.map_or("-", |b| if b { "yes" } else { "NO" }),
        );
    }
    s
}

/// How many tokens per decode forward the verifier's copies could commit at most on a set of
/// texts (each a prompt and the target's output), by brute force: at each decode, the longest
/// suffix of the committed text that occurred earlier, up to `guesses` guesses fed
/// after it, every one of them accepted while right. Per way of choosing what to copy: the most
/// recent occurrence (what [`tandem_spec::SelfDrafter`] copies), the occurrence whose next token
/// is the most frequent, both of the two most recent (a two-branch guess tree), and an oracle
/// that takes the best of every earlier occurrence of every matching suffix. None is priced:
/// every guess is fed, so these bound what pricing and position costs leave.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct CopyCeilings {
    pub most_recent: f64,
    pub most_frequent: f64,
    pub two_most_recent: f64,
    pub oracle: f64,
}

/// The longest suffix [`copy_ceilings`] tries to match.
const CEILING_MATCH: usize = 64;

/// How a ceiling copies: the guesses the text takes at `n` after the longest match, `l` tokens
/// long, whose earlier occurrences end at `ends`.
type Choose<'a> = &'a dyn Fn(&[u32], usize, usize, &[usize]) -> usize;

/// [`CopyCeilings`] of `texts`: `(prompt, output)` pairs, the output's first token committed at
/// the open (not by a decode), at most `guesses` guesses a decode.
pub fn copy_ceilings(texts: &[(Vec<u32>, Vec<u32>)], guesses: usize) -> CopyCeilings {
    // Ends `e < n − 1` of the earlier occurrences of the `l` tokens before `n`.
    let ends = |t: &[u32], n: usize, l: usize| -> Vec<usize> {
        (l - 1..n - 1)
            .filter(|&e| t[e + 1 - l..=e] == t[n - l..n])
            .collect()
    };
    // Guesses copied from after `e` that the text takes at `n`.
    let run = |t: &[u32], n: usize, e: usize| {
        (0..guesses)
            .take_while(|&a| n + a < t.len() && t[e + 1 + a] == t[n + a])
            .count()
    };
    let per_decode = |choose: Choose| {
        let (mut tokens, mut decodes) = (0, 0);
        for (prompt, output) in texts {
            let t = [&prompt[..], &output[..]].concat();
            let mut n = prompt.len() + 1;
            while n < t.len() {
                let best = (1..=CEILING_MATCH.min(n - 1))
                    .rev()
                    .map(|l| (l, ends(&t, n, l)))
                    .find(|(_, e)| !e.is_empty())
                    .map_or(0, |(l, e)| choose(&t, n, l, &e));
                n += best + 1;
                decodes += 1;
            }
            tokens += output.len().saturating_sub(1);
        }
        tokens as f64 / decodes.max(1) as f64
    };
    let most_frequent = |t: &[u32], n: usize, _: usize, e: &[usize]| {
        let count = |x: u32| e.iter().filter(|&&f| t[f + 1] == x).count();
        let top = e.iter().map(|&f| count(t[f + 1])).max().unwrap_or(0);
        let pick = e.iter().rev().find(|&&f| count(t[f + 1]) == top);
        pick.map_or(0, |&f| run(t, n, f))
    };
    let oracle = |t: &[u32], n: usize, l: usize, _: &[usize]| {
        (1..=l)
            .flat_map(|k| ends(t, n, k).into_iter().rev().take(50))
            .map(|f| run(t, n, f))
            .max()
            .unwrap_or(0)
    };
    CopyCeilings {
        most_recent: per_decode(&|t, n, _, e| run(t, n, e[e.len() - 1])),
        most_frequent: per_decode(&most_frequent),
        two_most_recent: per_decode(&|t, n, _, e| {
            e.iter()
                .rev()
                .take(2)
                .map(|&f| run(t, n, f))
                .max()
                .unwrap_or(0)
        }),
        oracle: per_decode(&oracle),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ceilings_of_a_text_that_repeats_itself() {
        // The output repeats the prompt's "1 2 3 4 5": after its first token (committed at the
        // open), one decode copies "2 3 4 5" and commits its own "6".
        let c = copy_ceilings(&[(vec![9, 1, 2, 3, 4, 5, 8], vec![1, 2, 3, 4, 5, 6])], 16);
        assert_eq!((c.most_recent, c.oracle), (5.0, 5.0));
        // After "1", the most recent occurrence went on with "3", the older one with "2" (the
        // output's): only a choice that looks past the most recent one copies it.
        let c = copy_ceilings(&[(vec![1, 2, 7, 1, 3, 9], vec![1, 2, 5])], 16);
        assert_eq!(
            (c.most_recent, c.most_frequent, c.two_most_recent, c.oracle),
            (1.0, 1.0, 2.0, 2.0)
        );
        // A text that never repeats: one token a decode.
        let fresh = copy_ceilings(&[(vec![1, 2, 3], vec![4, 5, 6, 7])], 16);
        assert_eq!((fresh.most_recent, fresh.oracle), (1.0, 1.0));
    }
}
