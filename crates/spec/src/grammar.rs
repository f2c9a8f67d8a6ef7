//! Structured outputs: a grammar (a JSON schema, any JSON object, or a Lark grammar) that the
//! output must follow, compiled with `llguidance` over the model's byte-level vocabulary
//! (`toktrie`).
//!
//! Both sides hold one [`Grammar`] per constrained session. The verifier masks the target's
//! logits at every position it judges or decodes with the grammar's state after the committed
//! tokens ([`Grammar::mask`]), then applies its rule to the masked row, so the committed output is
//! the target's own output under the grammar (greedy or sampled) — the same as a cloud-only
//! generation with the same grammar. The edge masks its draft the same way along each path it
//! drafts ([`Grammar::seek`]), so it proposes only allowed tokens; where the grammar allows exactly
//! one token ([`Grammar::forced`]) the edge drafts it without a draft forward, and the target,
//! masked, cannot but accept it.
//!
//! A schema or grammar `llguidance` refuses, or one over the size and compile-time limits
//! ([`LIMITS`]), is an error naming what is wrong ([`GrammarError`]).

use std::sync::Arc;

use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::toktrie::{ApproximateTokEnv, SimpleVob, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use serde::{Deserialize, Serialize};

/// What a constrained session's output must follow, as it travels in `Open` (protocol 6).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", content = "source", rename_all = "snake_case")]
pub enum GrammarSource {
    /// A JSON schema (its JSON text), as OpenAI's `response_format: json_schema`.
    JsonSchema(String),
    /// Any JSON object, as OpenAI's `response_format: json_object`.
    JsonObject,
    /// A grammar in llguidance's Lark syntax.
    Lark(String),
}

impl GrammarSource {
    /// Its size in bytes (what the size limit counts).
    pub fn len(&self) -> usize {
        match self {
            Self::JsonSchema(s) | Self::Lark(s) => s.len(),
            Self::JsonObject => 0,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The JSON output's layout: compact separators, no free whitespace (a small model given
    /// free whitespace can fill its whole budget with newlines; fixed separators are also tokens
    /// the grammar forces). A Lark grammar's `%json {…}` takes it as the schema's `x-guidance`.
    pub fn json_layout() -> serde_json::Value {
        serde_json::json!({
            "whitespace_flexible": false,
            "item_separator": ", ",
            "key_separator": ": ",
        })
    }

    fn top_level(&self) -> Result<TopLevelGrammar, GrammarError> {
        let schema = |mut v: serde_json::Value| {
            if let Some(o) = v.as_object_mut() {
                o.insert("x-guidance".into(), Self::json_layout());
            }
            TopLevelGrammar::from_json_schema(v)
        };
        match self {
            Self::JsonSchema(s) => {
                let v: serde_json::Value = serde_json::from_str(s)
                    .map_err(|e| GrammarError::Invalid(format!("the schema is not JSON: {e}")))?;
                if !v.is_object() && !v.is_boolean() {
                    return Err(GrammarError::Invalid(format!(
                        "a schema is a JSON object, got {}",
                        short(s)
                    )));
                }
                Ok(schema(v))
            }
            Self::JsonObject => Ok(schema(serde_json::json!({"type": "object"}))),
            Self::Lark(s) => Ok(TopLevelGrammar::from_lark(s.clone())),
        }
    }
}

fn short(s: &str) -> String {
    let mut t: String = s.chars().take(80).collect();
    if t.len() < s.len() {
        t.push('…');
    }
    t
}

/// The limits a grammar is compiled and run under: its source's size, and llguidance's fuel for
/// building its lexer (compile time) and for each mask (time per token).
pub const MAX_SOURCE_BYTES: usize = 64 * 1024;
pub const LIMITS: ParserLimits = ParserLimits {
    max_items_in_row: 2000,
    initial_lexer_fuel: 1_000_000,
    step_lexer_fuel: 200_000,
    step_max_items: 50_000,
    max_lexer_states: 50_000,
    max_grammar_size: 200_000,
    precompute_large_lexemes: true,
    verbose_errors: true,
};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GrammarError {
    /// The schema or grammar is refused (it does not parse, uses what llguidance does not
    /// support, or is over a limit).
    #[error("{0}")]
    Invalid(String),
    /// A token the grammar does not allow was committed (a bug, or a verifier and an edge that
    /// disagree about the grammar).
    #[error("the grammar does not allow token {token} after {consumed} tokens: {message}")]
    Rejected {
        token: u32,
        consumed: usize,
        message: String,
    },
}

/// A model's vocabulary as grammars see it: each token's bytes, built once per model and shared
/// by every session's grammar.
#[derive(Clone)]
pub struct GrammarVocab {
    factory: Arc<ParserFactory>,
    vocab_size: usize,
}

impl std::fmt::Debug for GrammarVocab {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GrammarVocab({} tokens)", self.vocab_size)
    }
}

impl GrammarVocab {
    /// `tokens[i]`: token `i`'s bytes; `special[i]`: a control token (never produced by a
    /// grammar but for the end); `eos`: the end-of-generation tokens, which the grammar allows
    /// once its output is complete. `logits` is the width of the model's logits rows (at least
    /// the vocabulary).
    pub fn new(
        tokens: &[Vec<u8>],
        special: &[bool],
        eos: &[u32],
        logits: usize,
    ) -> Result<Self, GrammarError> {
        let (&first, _) = eos
            .split_first()
            .ok_or_else(|| GrammarError::Invalid("the vocabulary has no end token".into()))?;
        let words: Vec<Vec<u8>> = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| {
                if special.get(i).copied().unwrap_or(false) {
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend_from_slice(t);
                    w
                } else {
                    t.clone()
                }
            })
            .collect();
        let vocab_size = logits.max(words.len());
        let info = TokRxInfo::new(vocab_size as u32, first);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(eos);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory =
            ParserFactory::new_simple(&env).map_err(|e| GrammarError::Invalid(e.to_string()))?;
        factory.set_stderr_log_level(0);
        factory.quiet();
        *factory.limits_mut() = LIMITS;
        Ok(Self {
            factory: Arc::new(factory),
            vocab_size,
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Compile `source` for one session.
    pub fn compile(&self, source: &GrammarSource) -> Result<Grammar, GrammarError> {
        if source.len() > MAX_SOURCE_BYTES {
            return Err(GrammarError::Invalid(format!(
                "the grammar is {} bytes, over the limit of {MAX_SOURCE_BYTES}",
                source.len()
            )));
        }
        let parser = self
            .factory
            .create_parser(source.top_level()?)
            .map_err(|e| GrammarError::Invalid(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(GrammarError::Invalid(e));
        }
        Ok(Grammar {
            source: source.clone(),
            matcher,
            consumed: Vec::new(),
            mask: None,
            ended: 0,
            vocab_size: self.vocab_size,
        })
    }
}

/// One session's grammar: its state after the output tokens it has consumed.
#[derive(Clone)]
pub struct Grammar {
    source: GrammarSource,
    matcher: Matcher,
    /// The output tokens consumed, in order.
    consumed: Vec<u32>,
    /// The mask at the current state, once computed.
    mask: Option<SimpleVob>,
    /// End tokens consumed after the output was complete (the matcher has stopped and takes no
    /// more: they are counted here).
    ended: usize,
    vocab_size: usize,
}

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammar")
            .field("source", &self.source)
            .field("consumed", &self.consumed.len())
            .finish()
    }
}

/// Two grammars are the same when compiled from the same source and at the same state.
impl PartialEq for Grammar {
    fn eq(&self, other: &Self) -> bool {
        self.source == other.source && self.consumed == other.consumed
    }
}

impl Grammar {
    /// The output tokens consumed.
    pub fn consumed(&self) -> &[u32] {
        &self.consumed
    }

    /// The tokens allowed next.
    fn allowed(&mut self) -> Result<&SimpleVob, GrammarError> {
        if self.mask.is_none() {
            let m = self
                .matcher
                .compute_mask_or_eos()
                .map_err(|e| GrammarError::Invalid(format!("computing the mask: {e}")))?;
            self.mask = Some(m);
        }
        Ok(self.mask.as_ref().expect("just computed"))
    }

    /// Whether `token` is allowed next.
    pub fn allows(&mut self, token: u32) -> Result<bool, GrammarError> {
        Ok(self.allowed()?.is_allowed(token))
    }

    /// `logits` with every token the grammar does not allow next set to −∞.
    pub fn mask(&mut self, logits: &[f32]) -> Result<Vec<f32>, GrammarError> {
        let allowed = self.allowed()?;
        let mut out = vec![f32::NEG_INFINITY; logits.len()];
        allowed.iter_set_entries(|i| {
            if let Some(&l) = logits.get(i) {
                out[i] = l;
            }
        });
        Ok(out)
    }

    /// The one token the grammar allows next, if it allows exactly one.
    pub fn forced(&mut self) -> Result<Option<u32>, GrammarError> {
        let allowed = self.allowed()?;
        Ok(if allowed.num_set() == 1 {
            allowed.first_bit_set().map(|t| t as u32)
        } else {
            None
        })
    }

    /// Consume `token` (committed or drafted).
    pub fn advance(&mut self, token: u32) -> Result<(), GrammarError> {
        if self.matcher.is_stopped() {
            // The output is complete: only end tokens follow.
            if !self.allows(token)? {
                return Err(GrammarError::Rejected {
                    token,
                    consumed: self.consumed.len(),
                    message: "the output is complete: only an end token may follow".into(),
                });
            }
            self.ended += 1;
            self.consumed.push(token);
            return Ok(());
        }
        self.mask = None;
        self.matcher
            .consume_token(token)
            .map_err(|e| GrammarError::Rejected {
                token,
                consumed: self.consumed.len(),
                message: e.to_string(),
            })?;
        self.consumed.push(token);
        Ok(())
    }

    /// Forget the last `n` tokens consumed.
    pub fn rollback(&mut self, n: usize) -> Result<(), GrammarError> {
        let n = n.min(self.consumed.len());
        if n == 0 {
            return Ok(());
        }
        let after_stop = n.min(self.ended);
        self.ended -= after_stop;
        if n > after_stop {
            self.mask = None;
            self.matcher
                .rollback(n - after_stop)
                .map_err(|e| GrammarError::Invalid(format!("rolling back {n} tokens: {e}")))?;
        }
        self.consumed.truncate(self.consumed.len() - n);
        Ok(())
    }

    /// Move to the state after the output `tokens`: roll back to what they share with the tokens
    /// consumed, then consume the rest.
    pub fn seek(&mut self, tokens: &[u32]) -> Result<(), GrammarError> {
        let shared = self
            .consumed
            .iter()
            .zip(tokens)
            .take_while(|(a, b)| a == b)
            .count();
        self.rollback(self.consumed.len() - shared)?;
        for &t in &tokens[shared..] {
            self.advance(t)?;
        }
        Ok(())
    }

    /// The width of the logits rows it masks.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A toy vocabulary: every printable ASCII byte, a few multi-byte pieces, and an end token.
    pub(crate) fn toy_vocab() -> (Vec<Vec<u8>>, Vec<bool>, u32) {
        let mut tokens: Vec<Vec<u8>> = (0x20u8..0x7f).map(|b| vec![b]).collect();
        for w in ["{\"", "\": ", "\"}", "true", "false", "name", "age", ", \""] {
            tokens.push(w.as_bytes().to_vec());
        }
        tokens.push(b"<|end|>".to_vec());
        let mut special = vec![false; tokens.len()];
        *special.last_mut().unwrap() = true;
        let eos = (tokens.len() - 1) as u32;
        (tokens, special, eos)
    }

    fn vocab() -> (GrammarVocab, Vec<Vec<u8>>, u32) {
        let (t, s, e) = toy_vocab();
        (GrammarVocab::new(&t, &s, &[e], t.len()).unwrap(), t, e)
    }

    fn id(tokens: &[Vec<u8>], s: &str) -> u32 {
        tokens.iter().position(|t| t == s.as_bytes()).unwrap() as u32
    }

    #[test]
    fn a_schema_masks_forces_and_ends() {
        let (v, tokens, eos) = vocab();
        let schema = r#"{"type":"object","properties":{"ok":{"type":"boolean"}},"required":["ok"],"additionalProperties":false}"#;
        let mut g = v
            .compile(&GrammarSource::JsonSchema(schema.into()))
            .unwrap();
        // Only `{` can start it; then the key is forced byte by byte.
        let logits = vec![1.0; v.vocab_size()];
        let m = g.mask(&logits).unwrap();
        let open = id(&tokens, "{");
        assert!(m[open as usize].is_finite());
        assert!(m[id(&tokens, "a") as usize].is_infinite());
        let mut out = Vec::new();
        // Follow the forced tokens, then choose `true`.
        for _ in 0..40 {
            let next = match g.forced().unwrap() {
                Some(t) => t,
                None if g.allows(id(&tokens, "true")).unwrap() => id(&tokens, "true"),
                None if g.allows(id(&tokens, "{\"")).unwrap() => id(&tokens, "{\""),
                None => {
                    let m = g.mask(&logits).unwrap();
                    m.iter().position(|l| l.is_finite()).unwrap() as u32
                }
            };
            if next == eos {
                break;
            }
            g.advance(next).unwrap();
            out.extend_from_slice(&tokens[next as usize]);
        }
        assert_eq!(String::from_utf8(out).unwrap(), r#"{"ok": true}"#);
        assert_eq!(g.forced().unwrap(), Some(eos), "only the end is left");
        // The end is consumed (the session ends there), and can be rolled back.
        g.advance(eos).unwrap();
        assert!(g.advance(id(&tokens, "a")).is_err());
        g.rollback(2).unwrap();
        assert_eq!(g.forced().unwrap(), Some(id(&tokens, "}")));
        // A token it does not allow is refused by name.
        let mut h = v.compile(&GrammarSource::JsonObject).unwrap();
        assert!(matches!(
            h.advance(id(&tokens, "a")),
            Err(GrammarError::Rejected { .. })
        ));
    }

    #[test]
    fn seek_and_rollback_return_to_the_same_state() {
        let (v, tokens, _) = vocab();
        let mut g = v.compile(&GrammarSource::JsonObject).unwrap();
        let path: Vec<u32> = ["{\"", "name", "\": ", "\"", "x"]
            .iter()
            .map(|s| id(&tokens, s))
            .collect();
        g.seek(&path).unwrap();
        let logits = vec![0.5; v.vocab_size()];
        let at_end = g.mask(&logits).unwrap();
        g.seek(&path[..2]).unwrap();
        assert_eq!(g.consumed(), &path[..2]);
        g.seek(&path).unwrap();
        assert_eq!(g.mask(&logits).unwrap(), at_end);
    }

    #[test]
    fn bad_schemas_and_grammars_are_refused_by_name() {
        let (v, _, _) = vocab();
        for bad in [
            GrammarSource::JsonSchema("{not json".into()),
            GrammarSource::JsonSchema("[1, 2]".into()),
            GrammarSource::JsonSchema(r#"{"type": "wibble"}"#.into()),
            GrammarSource::Lark("start: ( ".into()),
            GrammarSource::Lark("x".repeat(MAX_SOURCE_BYTES + 1)),
        ] {
            let e = v.compile(&bad).unwrap_err();
            assert!(
                matches!(e, GrammarError::Invalid(ref m) if !m.is_empty()),
                "{bad:?}: {e}"
            );
        }
    }
}
