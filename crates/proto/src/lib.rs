//! `tandem.v1`: generated protobuf types and the gRPC service, plus conversions to the domain types
//! of `tandem-spec`. Nothing else lives here.

pub mod v1 {
    tonic::include_proto!("tandem.v1");
}

/// The protocol version this build speaks.
pub const PROTOCOL_VERSION: u32 = 7;

/// The most entries one drafted position's distribution `q` may hold (and never more than the
/// vocabulary): the edge sends its top-k (32 by default), and the verifier's work on a `q` is
/// linear in its size, on the one thread that serves every tenant.
pub const MAX_Q_ENTRIES: usize = 256;

/// How far above 1 a distribution's mass may add up (rounding of f32 probabilities).
pub const Q_MASS_SLACK: f64 = 1e-3;

use tandem_spec::sampling::SamplingParams;
use tandem_spec::{Block, BlockId, Decoded, GrammarSource, Shape, SideNode, Verdict, VerifyRule};

/// A field-named reason why a message is not valid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct FieldError {
    pub field: &'static str,
    pub message: String,
}

fn bad(field: &'static str, message: impl Into<String>) -> FieldError {
    FieldError {
        field,
        message: message.into(),
    }
}

impl From<SamplingParams> for v1::SamplingParams {
    fn from(p: SamplingParams) -> Self {
        Self {
            temperature: p.temperature,
            top_k: p.top_k as u32,
            top_p: p.top_p,
            seed: p.seed,
        }
    }
}

impl From<&GrammarSource> for v1::Grammar {
    fn from(g: &GrammarSource) -> Self {
        let (kind, source) = match g {
            GrammarSource::JsonSchema(s) => (v1::GrammarKind::JsonSchema, s.clone()),
            GrammarSource::JsonObject => (v1::GrammarKind::JsonObject, String::new()),
            GrammarSource::Lark(s) => (v1::GrammarKind::Lark, s.clone()),
        };
        Self {
            kind: kind as i32,
            source,
            resumed: 0,
        }
    }
}

/// A structured output's grammar, as it came (`grammar` names the field; not yet compiled), and
/// how many of the prompt's last tokens are its output already (`Grammar.resumed`).
pub fn grammar_from_proto(
    g: Option<v1::Grammar>,
) -> Result<Option<(GrammarSource, usize)>, FieldError> {
    let Some(g) = g else {
        return Ok(None);
    };
    let resumed = g.resumed as usize;
    let source = match v1::GrammarKind::try_from(g.kind) {
        Ok(v1::GrammarKind::JsonSchema) => Ok(GrammarSource::JsonSchema(g.source)),
        Ok(v1::GrammarKind::JsonObject) if g.source.is_empty() => Ok(GrammarSource::JsonObject),
        Ok(v1::GrammarKind::JsonObject) => {
            Err(bad("grammar.source", "a JSON object grammar has no source"))
        }
        Ok(v1::GrammarKind::Lark) => Ok(GrammarSource::Lark(g.source)),
        _ => Err(bad(
            "grammar.kind",
            format!(
                "{} is not a grammar kind (JSON_SCHEMA, JSON_OBJECT, LARK)",
                g.kind
            ),
        )),
    }?;
    Ok(Some((source, resumed)))
}

impl From<&tandem_spec::sampling::TokenLogprob> for v1::TokenLogprob {
    fn from(l: &tandem_spec::sampling::TokenLogprob) -> Self {
        Self {
            position: l.pos as u64,
            token: l.token,
            logprob: l.logprob,
            top: l
                .top
                .iter()
                .map(|&(token, logprob)| v1::TopLogprob { token, logprob })
                .collect(),
        }
    }
}

impl From<v1::TokenLogprob> for tandem_spec::sampling::TokenLogprob {
    fn from(l: v1::TokenLogprob) -> Self {
        Self {
            pos: l.position as usize,
            token: l.token,
            logprob: l.logprob,
            top: l.top.into_iter().map(|t| (t.token, t.logprob)).collect(),
        }
    }
}

/// Sampling parameters checked for range (`params` names the field).
pub fn params_from_proto(p: Option<v1::SamplingParams>) -> Result<SamplingParams, FieldError> {
    {
        let p = p.unwrap_or_default();
        let s = SamplingParams {
            temperature: p.temperature,
            top_k: p.top_k as usize,
            top_p: if p.top_p == 0.0 { 1.0 } else { p.top_p },
            seed: p.seed,
        };
        s.validate().map_err(|m| bad("params", m))?;
        Ok(s)
    }
}

pub fn rule_from_proto(r: i32) -> Result<VerifyRule, FieldError> {
    match v1::VerifyRule::try_from(r) {
        Ok(v1::VerifyRule::Unspecified) | Ok(v1::VerifyRule::SampleMatch) => {
            Ok(VerifyRule::SampleMatch)
        }
        Ok(v1::VerifyRule::Greedy) => Ok(VerifyRule::Greedy),
        Ok(v1::VerifyRule::Rejection) => Ok(VerifyRule::Rejection),
        Err(_) => Err(bad("rule", format!("unknown verify rule {r}"))),
    }
}

pub fn rule_to_proto(r: VerifyRule) -> v1::VerifyRule {
    match r {
        VerifyRule::Greedy => v1::VerifyRule::Greedy,
        VerifyRule::SampleMatch => v1::VerifyRule::SampleMatch,
        VerifyRule::Rejection => v1::VerifyRule::Rejection,
    }
}

impl From<&Block> for v1::Draft {
    fn from(b: &Block) -> Self {
        Self {
            epoch: b.epoch,
            block: b.index.0,
            start_pos: b.start_pos as u64,
            tokens: b.tokens.clone(),
            side: b
                .side
                .iter()
                .map(|s| v1::SideNode {
                    parent: s.parent,
                    token: s.token,
                    point: s.point,
                })
                .collect(),
            session_id: 0,
            q: b.q
                .iter()
                .map(|d| v1::SparseDist {
                    entries: d
                        .iter()
                        .map(|&(token, prob)| v1::TokenProb { token, prob })
                        .collect(),
                })
                .collect(),
        }
    }
}

/// A draft block checked against the vocabulary, the granted draft length and the granted side
/// nodes (the tree's shape is checked by the session: `CloudSession::check`).
pub fn block_from_proto(
    d: v1::Draft,
    vocab: usize,
    max_len: usize,
    max_side: usize,
) -> Result<Block, FieldError> {
    if d.tokens.is_empty() {
        return Err(bad("draft.tokens", "a block needs at least one token"));
    }
    if d.tokens.len() > max_len {
        return Err(bad(
            "draft.tokens",
            format!(
                "{} tokens exceed the granted draft length {max_len}",
                d.tokens.len()
            ),
        ));
    }
    if let Some(t) = d.tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(bad(
            "draft.tokens",
            format!("token id {t} is outside the vocabulary ({vocab})"),
        ));
    }
    if !d.q.is_empty() && d.q.len() != d.tokens.len() {
        return Err(bad(
            "draft.q",
            format!("{} distributions for {} tokens", d.q.len(), d.tokens.len()),
        ));
    }
    if d.side.len() > max_side {
        return Err(bad(
            "draft.side",
            format!("{} side nodes exceed the {max_side} granted", d.side.len()),
        ));
    }
    if let Some(s) = d.side.iter().find(|s| s.token as usize >= vocab) {
        return Err(bad(
            "draft.side",
            format!("token id {} is outside the vocabulary ({vocab})", s.token),
        ));
    }
    let cap = MAX_Q_ENTRIES.min(vocab);
    let mut q = Vec::with_capacity(d.q.len());
    for (i, dist) in d.q.into_iter().enumerate() {
        if dist.entries.len() > cap {
            return Err(bad(
                "draft.q",
                format!(
                    "the distribution at position {i} has {} entries; at most {cap}",
                    dist.entries.len()
                ),
            ));
        }
        let mut v = Vec::with_capacity(dist.entries.len());
        let mut mass = 0.0f64;
        for e in dist.entries {
            if e.token as usize >= vocab || !(e.prob.is_finite() && e.prob >= 0.0 && e.prob <= 1.0)
            {
                return Err(bad(
                    "draft.q",
                    format!("entry ({}, {}) is not a token probability", e.token, e.prob),
                ));
            }
            mass += e.prob as f64;
            v.push((e.token, e.prob));
        }
        if mass > 1.0 + Q_MASS_SLACK {
            return Err(bad(
                "draft.q",
                format!("the distribution at position {i} adds up to {mass:.4}, more than 1"),
            ));
        }
        // At most MAX_Q_ENTRIES: sorting a copy of the ids finds a repeated one.
        let mut ids: Vec<u32> = v.iter().map(|e| e.0).collect();
        ids.sort_unstable();
        if let Some(w) = ids.windows(2).find(|w| w[0] == w[1]) {
            return Err(bad(
                "draft.q",
                format!(
                    "the distribution at position {i} names token {} twice",
                    w[0]
                ),
            ));
        }
        q.push(v);
    }
    Ok(Block {
        epoch: d.epoch,
        index: BlockId(d.block),
        start_pos: d.start_pos as usize,
        tokens: d.tokens,
        q,
        side: d
            .side
            .iter()
            .map(|s| SideNode {
                parent: s.parent,
                token: s.token,
                point: s.point,
            })
            .collect(),
    })
}

impl From<Verdict> for v1::Verdict {
    fn from(v: Verdict) -> Self {
        Self {
            epoch: v.epoch,
            block: v.block.0,
            accepted: v.accepted as u32,
            token: v.token,
            verify_us: v.verify_us,
            grant_draft_len: v.grant.map_or(0, |g| g.draft_len),
            grant_depth: v.grant.map_or(0, |g| g.depth),
            side_end: v.side_end,
        }
    }
}

impl From<v1::Verdict> for Verdict {
    fn from(v: v1::Verdict) -> Self {
        Self {
            epoch: v.epoch,
            block: BlockId(v.block),
            accepted: v.accepted as usize,
            side_end: v.side_end,
            token: v.token,
            verify_us: v.verify_us,
            grant: (v.grant_depth > 0).then_some(Shape::new(v.grant_draft_len, v.grant_depth)),
        }
    }
}

impl From<Decoded> for v1::Decoded {
    fn from(d: Decoded) -> Self {
        Self {
            epoch: d.epoch,
            position: d.pos as u64,
            token: d.token,
            grant_draft_len: d.grant.map_or(0, |g| g.draft_len),
            grant_depth: d.grant.map_or(0, |g| g.depth.max(1)),
            guessed: d.guessed,
        }
    }
}

impl From<v1::Decoded> for Decoded {
    fn from(d: v1::Decoded) -> Self {
        Self {
            epoch: d.epoch,
            pos: d.position as usize,
            token: d.token,
            grant: (d.grant_depth > 0).then_some(Shape::new(d.grant_draft_len, d.grant_depth)),
            guessed: d.guessed,
        }
    }
}

/// What a message on a session's stream from the verifier is to the edge.
#[derive(Debug, Clone, PartialEq)]
pub enum FromCloud {
    /// A verdict or a decoded token, for the edge's session core.
    Message(tandem_spec::edge::Incoming),
    /// The verifier refused one of the edge's messages (the text says why).
    Refused(String),
    /// Nothing for the session core (an `Opened` repeated, an empty message).
    Other,
}

/// Read one message from the verifier (the edge's transport and its fuzzer share this).
pub fn from_cloud(m: v1::CloudMessage) -> FromCloud {
    use tandem_spec::edge::Incoming;
    match m.kind {
        Some(v1::cloud_message::Kind::Verdict(v)) => {
            FromCloud::Message(Incoming::Verdict(v.into()))
        }
        Some(v1::cloud_message::Kind::Decoded(d)) => {
            FromCloud::Message(Incoming::Decoded(d.into()))
        }
        Some(v1::cloud_message::Kind::Error(e)) => FromCloud::Refused(e.message),
        _ => FromCloud::Other,
    }
}

/// An `Open` over `prompt` for a tokenizer of `fingerprint`, asking for `want` (γ, depth) on
/// linear blocks, at this protocol's version, with `params`, verify rule `rule` (the wire's
/// number) and `max_tokens`: what the benchmarks' and the tests' hand-driven sessions send.
pub fn open_message(
    fingerprint: &str,
    prompt: &[u32],
    params: Option<v1::SamplingParams>,
    rule: i32,
    max_tokens: u32,
    want: (u32, u32),
) -> v1::EdgeMessage {
    v1::EdgeMessage {
        kind: Some(v1::edge_message::Kind::Open(v1::Open {
            protocol_version: PROTOCOL_VERSION,
            tokenizer_fingerprint: fingerprint.to_string(),
            prompt_ids: prompt.to_vec(),
            params,
            max_tokens,
            rule,
            want_draft_len: want.0,
            want_depth: want.1,
            want_side_nodes: 0,
            grammar: None,
            logprobs: false,
            top_logprobs: 0,
            self_draft: false,
        })),
    }
}

/// Bind `addr`, the address flag `flag` names (within a runtime); a failure names both.
pub async fn listen(flag: &str, addr: &str) -> std::io::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| std::io::Error::new(e.kind(), format!("{flag} {addr}: cannot bind: {e}")))
}

/// Ctrl-c or SIGTERM: when a server starts its drain.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}

/// The small tokio runtime every network piece runs on (gRPC clients and servers, the emulated
/// link): one worker, so it never competes with an engine for a core.
pub fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_round_trip_and_bad_ones_name_the_field() {
        let b = Block {
            epoch: 2,
            index: tandem_spec::BlockId(7),
            start_pos: 40,
            tokens: vec![1, 2, 3],
            q: vec![],
            side: vec![
                SideNode {
                    parent: 1,
                    token: 9,
                    point: false,
                },
                SideNode {
                    parent: 3,
                    token: 4,
                    point: true,
                },
            ],
        };
        assert_eq!(block_from_proto(v1::Draft::from(&b), 100, 8, 2).unwrap(), b);
        let e = block_from_proto(v1::Draft::from(&b), 3, 8, 2).unwrap_err();
        assert_eq!(e.field, "draft.tokens");
        let e = block_from_proto(v1::Draft::from(&b), 100, 8, 1).unwrap_err();
        assert_eq!(e.field, "draft.side");
        let e = block_from_proto(v1::Draft::from(&b), 100, 2, 2).unwrap_err();
        assert!(e.message.contains("granted draft length"), "{e}");
        // A q past the cap (the stall: one entry repeated ~360k times), with a token twice, or
        // with more than all the mass is refused by name, before any verifier work.
        let with_q = |entries: Vec<(u32, f32)>| {
            let mut d = v1::Draft::from(&b);
            let dist = v1::SparseDist {
                entries: entries
                    .into_iter()
                    .map(|(token, prob)| v1::TokenProb { token, prob })
                    .collect(),
            };
            d.q = vec![dist; 3];
            d
        };
        let huge = with_q(vec![(5, 1e-6); 360_000]);
        let e = block_from_proto(huge, 100_000, 8, 2).unwrap_err();
        assert_eq!(e.field, "draft.q");
        assert!(e.message.contains("at most 256"), "{e}");
        let e = block_from_proto(with_q(vec![(5, 1e-6); 101]), 100, 8, 2).unwrap_err();
        assert!(e.message.contains("at most 100"), "{e}");
        let e =
            block_from_proto(with_q(vec![(5, 0.2), (6, 0.3), (5, 0.1)]), 100, 8, 2).unwrap_err();
        assert!(e.message.contains("names token 5 twice"), "{e}");
        let e = block_from_proto(with_q(vec![(5, 0.7), (6, 0.6)]), 100, 8, 2).unwrap_err();
        assert!(e.message.contains("more than 1"), "{e}");
        let ok = block_from_proto(with_q(vec![(5, 0.7), (6, 0.3)]), 100, 8, 2).unwrap();
        assert_eq!(ok.q.len(), 3);
        let bad_p = v1::SamplingParams {
            temperature: -1.0,
            ..Default::default()
        };
        assert_eq!(params_from_proto(Some(bad_p)).unwrap_err().field, "params");
        // A verdict's path end goes through the wire, absent or not.
        for side_end in [None, Some(0), Some(5)] {
            let v = Verdict {
                epoch: 1,
                block: BlockId(2),
                accepted: 3,
                side_end,
                token: 8,
                verify_us: 0,
                grant: None,
            };
            assert_eq!(Verdict::from(v1::Verdict::from(v)), v);
        }
    }
}
