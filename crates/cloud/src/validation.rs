//! Every message from an edge becomes a valid domain value, or a `tonic::Status` that names the
//! offending field, before anything reaches the batcher. What needs the session's state (positions,
//! epochs, block order) is checked by the session itself (`tandem_spec::CloudSession`) and
//! refused the same way, without touching any other session.

use tandem_proto::v1::{self, edge_message, ModelInfo};
use tandem_proto::{
    block_from_proto, grammar_from_proto, params_from_proto, rule_from_proto, PROTOCOL_VERSION,
};
use tandem_sched::SessionId;
use tandem_spec::sampling::SamplingParams;
use tandem_spec::{Block, Grammar, GrammarSource, GrammarVocab, VerifyRule};
use tandem_verifier::Inbound;
use tonic::Status;

fn invalid(field: &str, message: impl std::fmt::Display) -> Status {
    Status::invalid_argument(format!("{field}: {message}"))
}

/// A prompt of known tokens that, with `max_tokens` more, fits the context.
fn prompt(field: &str, ids: Vec<u32>, max_tokens: u32, m: &ModelInfo) -> Result<Vec<u32>, Status> {
    if ids.is_empty() {
        return Err(invalid(
            &format!("{field}.prompt_ids"),
            "the prompt is empty",
        ));
    }
    if let Some(t) = ids.iter().find(|&&t| t >= m.vocab_size) {
        return Err(invalid(
            &format!("{field}.prompt_ids"),
            format!("token id {t} is outside the vocabulary ({})", m.vocab_size),
        ));
    }
    if max_tokens == 0 {
        return Err(invalid(
            &format!("{field}.max_tokens"),
            "must be at least 1",
        ));
    }
    if ids.len() as u64 + max_tokens as u64 > m.context_length as u64 {
        return Err(invalid(
            &format!("{field}.max_tokens"),
            format!(
                "prompt ({}) plus max_tokens ({max_tokens}) exceed the context length {}",
                ids.len(),
                m.context_length
            ),
        ));
    }
    Ok(ids)
}

fn fingerprint(field: &str, got: &str, m: &ModelInfo) -> Result<(), Status> {
    if got != m.tokenizer_fingerprint {
        return Err(invalid(
            &format!("{field}.tokenizer_fingerprint"),
            format!(
                "the edge's tokenizer {got} does not match the served model's {}: the draft and \
                 the target must share one tokenizer",
                m.tokenizer_fingerprint
            ),
        ));
    }
    Ok(())
}

#[derive(Debug, Clone)]
pub struct ValidOpen {
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    pub rule: VerifyRule,
    pub max_tokens: usize,
    pub want_draft_len: u32,
    pub want_depth: u32,
    pub want_side_nodes: u32,
    /// Structured output: the grammar as it came ([`compile`] makes it a session's), and how
    /// many of the prompt's last tokens are its output already.
    pub grammar: Option<(GrammarSource, usize)>,
    /// The target's log-probabilities asked for, with this many alternatives each.
    pub logprobs: Option<usize>,
    /// The edge lets the verifier draft for the session from its own text.
    pub self_draft: bool,
}

/// Compile a structured output's `source` (the request's field `field`) over the served model's
/// vocabulary, off the runtime's thread (a schema may take milliseconds): a source llguidance
/// refuses, or one over the limits, is `INVALID_ARGUMENT` naming the field; a verifier without
/// a grammar vocabulary refuses every grammar by name.
pub async fn compile(
    field: &str,
    source: Option<(GrammarSource, usize)>,
    prompt: &[u32],
    vocab: Option<&GrammarVocab>,
) -> Result<Option<Grammar>, Status> {
    let Some((source, resumed)) = source else {
        return Ok(None);
    };
    let Some(vocab) = vocab.cloned() else {
        return Err(invalid(
            field,
            "this verifier has no grammar support for its model",
        ));
    };
    if resumed > prompt.len() {
        return Err(invalid(
            &format!("{field}.resumed"),
            format!("{resumed} tokens of output in a prompt of {}", prompt.len()),
        ));
    }
    let output = prompt[prompt.len() - resumed..].to_vec();
    let mut g = tokio::task::spawn_blocking(move || vocab.compile(&source))
        .await
        .map_err(|e| Status::internal(format!("{field}: compiling: {e}")))?
        .map_err(|e| invalid(field, e))?;
    for &t in &output {
        g.advance(t)
            .map_err(|e| invalid(&format!("{field}.resumed"), e))?;
    }
    Ok(Some(g))
}

pub fn open(o: v1::Open, m: &ModelInfo) -> Result<ValidOpen, Status> {
    if o.protocol_version != PROTOCOL_VERSION {
        return Err(invalid(
            "open.protocol_version",
            format!(
                "{} is not supported (this verifier speaks {PROTOCOL_VERSION})",
                o.protocol_version
            ),
        ));
    }
    fingerprint("open", &o.tokenizer_fingerprint, m)?;
    let prompt = prompt("open", o.prompt_ids, o.max_tokens, m)?;
    Ok(ValidOpen {
        prompt,
        params: params_from_proto(o.params).map_err(|e| invalid("open.params", e.message))?,
        rule: rule_from_proto(o.rule).map_err(|e| invalid("open.rule", e.message))?,
        max_tokens: o.max_tokens as usize,
        want_draft_len: o.want_draft_len,
        want_depth: o.want_depth,
        want_side_nodes: o.want_side_nodes,
        grammar: grammar_from_proto(o.grammar)
            .map_err(|e| invalid(&format!("open.{}", e.field), e.message))?,
        logprobs: match (o.logprobs, o.top_logprobs as usize) {
            (false, 0) => None,
            (false, _) => {
                return Err(invalid(
                    "open.top_logprobs",
                    "alternatives are sent with logprobs only",
                ))
            }
            (true, k) if k > tandem_spec::sampling::MAX_TOP_LOGPROBS => {
                return Err(invalid(
                    "open.top_logprobs",
                    format!(
                        "{k} alternatives, at most {}",
                        tandem_spec::sampling::MAX_TOP_LOGPROBS
                    ),
                ))
            }
            (true, k) => Some(k),
        },
        self_draft: o.self_draft,
    })
}

#[derive(Debug, Clone)]
pub struct ValidGenerate {
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    pub max_tokens: usize,
    pub grammar: Option<(GrammarSource, usize)>,
    /// The verifier drafts for the generation from its own text.
    pub self_draft: bool,
}

pub fn generate(r: v1::GenerateRequest, m: &ModelInfo) -> Result<ValidGenerate, Status> {
    fingerprint("generate", &r.tokenizer_fingerprint, m)?;
    let prompt = prompt("generate", r.prompt_ids, r.max_tokens, m)?;
    Ok(ValidGenerate {
        prompt,
        params: params_from_proto(r.params).map_err(|e| invalid("generate.params", e.message))?,
        max_tokens: r.max_tokens as usize,
        grammar: grammar_from_proto(r.grammar)
            .map_err(|e| invalid(&format!("generate.{}", e.field), e.message))?,
        self_draft: r.self_draft,
    })
}

/// A draft block on the stream of `session`, with at most `max_len` (the granted γ) tokens and
/// `max_side` side nodes.
pub fn draft(
    mut d: v1::Draft,
    session: u64,
    vocab: usize,
    max_len: usize,
    max_side: usize,
    uses_q: bool,
) -> Result<Block, Status> {
    if d.session_id != 0 && d.session_id != session {
        return Err(Status::not_found(format!(
            "draft.session_id: {} is not this stream's session; blocks go on their own session's stream",
            d.session_id
        )));
    }
    let mut block = block_from_proto(std::mem::take(&mut d), vocab, max_len, max_side)
        .map_err(|e| Status::invalid_argument(e.to_string()))?;
    if !uses_q {
        // Only rejection sampling reads the draft's distributions: nothing else keeps them.
        block.q = Vec::new();
    }
    Ok(block)
}

/// What the service does with one message on an open session's stream.
#[derive(Debug)]
pub enum OnStream<H> {
    /// Hand it to the verifier core.
    Core(Inbound<H>),
    /// Refuse this message and go on (refusals count towards the stream's budget).
    Refuse(Status),
    /// The edge closed the session.
    End,
}

/// An open session's stream as validation sees it: the session, and the limits its blocks are
/// checked against (the vocabulary, the γ and side nodes granted at Open, whether the rule reads
/// the draft's distributions). Every message after Open goes through [`SessionStream::message`],
/// in the server and in the fuzzer alike.
#[derive(Debug, Clone, Copy)]
pub struct SessionStream {
    pub session: SessionId,
    pub vocab: usize,
    pub max_len: usize,
    pub max_side: usize,
    pub uses_q: bool,
}

impl SessionStream {
    pub fn message<H>(&self, m: v1::EdgeMessage) -> OnStream<H> {
        let session = self.session;
        match m.kind {
            Some(edge_message::Kind::Draft(d)) => match draft(
                d,
                session.0,
                self.vocab,
                self.max_len,
                self.max_side,
                self.uses_q,
            ) {
                Ok(block) => OnStream::Core(Inbound::Draft { session, block }),
                Err(e) => OnStream::Refuse(e),
            },
            Some(edge_message::Kind::Ack(a)) => OnStream::Core(Inbound::Ack {
                session,
                committed: usize::try_from(a.committed).unwrap_or(usize::MAX),
            }),
            Some(edge_message::Kind::Open(_)) => {
                OnStream::Refuse(invalid("open", "the session is already open"))
            }
            None => OnStream::Refuse(invalid("kind", "empty message")),
            Some(edge_message::Kind::Close(_)) => OnStream::End,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model() -> ModelInfo {
        ModelInfo {
            name: "m".into(),
            tokenizer_fingerprint: "abc".into(),
            vocab_size: 100,
            context_length: 64,
            weights: "f32".into(),
        }
    }

    fn good() -> v1::Open {
        v1::Open {
            protocol_version: PROTOCOL_VERSION,
            tokenizer_fingerprint: "abc".into(),
            prompt_ids: vec![1, 2, 3],
            params: None,
            max_tokens: 8,
            rule: 0,
            want_draft_len: 4,
            want_depth: 2,
            want_side_nodes: 0,
            grammar: None,
            logprobs: false,
            top_logprobs: 0,
            self_draft: true,
        }
    }

    #[test]
    fn each_bad_field_is_named() {
        let m = model();
        assert!(open(good(), &m).is_ok());
        let cases: Vec<(v1::Open, &str)> = vec![
            (
                v1::Open {
                    protocol_version: 9,
                    ..good()
                },
                "open.protocol_version",
            ),
            (
                v1::Open {
                    tokenizer_fingerprint: "x".into(),
                    ..good()
                },
                "open.tokenizer_fingerprint",
            ),
            (
                v1::Open {
                    prompt_ids: vec![],
                    ..good()
                },
                "open.prompt_ids",
            ),
            (
                v1::Open {
                    prompt_ids: vec![100],
                    ..good()
                },
                "open.prompt_ids",
            ),
            (
                v1::Open {
                    max_tokens: 0,
                    ..good()
                },
                "open.max_tokens",
            ),
            (
                v1::Open {
                    max_tokens: 62,
                    ..good()
                },
                "open.max_tokens",
            ),
            (v1::Open { rule: 77, ..good() }, "open.rule"),
            (
                v1::Open {
                    params: Some(v1::SamplingParams {
                        temperature: -1.0,
                        ..Default::default()
                    }),
                    ..good()
                },
                "open.params",
            ),
        ];
        for (o, field) in cases {
            let e = open(o, &m).unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument);
            assert!(e.message().starts_with(field), "{field}: {}", e.message());
        }
        let d = v1::Draft {
            tokens: vec![5],
            session_id: 3,
            ..Default::default()
        };
        assert_eq!(
            draft(d.clone(), 4, 100, 4, 0, true).unwrap_err().code(),
            tonic::Code::NotFound
        );
        assert!(draft(d.clone(), 3, 100, 4, 0, true).is_ok());
        let e = draft(
            v1::Draft {
                tokens: vec![1; 5],
                ..d.clone()
            },
            3,
            100,
            4,
            0,
            true,
        )
        .unwrap_err();
        assert!(e.message().starts_with("draft.tokens"), "{}", e.message());
        // Side nodes beyond the grant, or outside the vocabulary, are refused by name.
        let side = |token| v1::SideNode {
            parent: 0,
            token,
            point: false,
        };
        let tree = v1::Draft {
            side: vec![side(7), side(8)],
            ..d.clone()
        };
        assert!(draft(tree.clone(), 3, 100, 4, 2, true).is_ok());
        let e = draft(tree, 3, 100, 4, 1, true).unwrap_err();
        assert!(
            e.message().contains("2 side nodes exceed the 1 granted"),
            "{}",
            e.message()
        );
        let e = draft(
            v1::Draft {
                side: vec![side(100)],
                ..d
            },
            3,
            100,
            4,
            2,
            true,
        )
        .unwrap_err();
        assert!(e.message().starts_with("draft.side") && e.message().contains("100"));
    }

    /// Only rejection sampling reads q: for any other rule a block keeps none (a greedy
    /// session's edge that sends q anyway costs the verifier nothing past validation).
    #[test]
    fn q_is_kept_only_for_the_rule_that_reads_it() {
        let q = v1::SparseDist {
            entries: vec![
                v1::TokenProb {
                    token: 5,
                    prob: 0.6,
                },
                v1::TokenProb {
                    token: 6,
                    prob: 0.4,
                },
            ],
        };
        let d = v1::Draft {
            tokens: vec![5, 6],
            q: vec![q.clone(), q],
            ..Default::default()
        };
        assert_eq!(draft(d.clone(), 3, 100, 4, 0, true).unwrap().q.len(), 2);
        assert!(draft(d, 3, 100, 4, 0, false).unwrap().q.is_empty());
    }
}
