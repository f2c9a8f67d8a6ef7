//! The tokenizer and chat template stored in a GGUF file.
//!
//! `tokenizer.ggml.model = llama` is SentencePiece-style ([`spm`]: Gemma's 262k vocabulary with
//! byte fallback); a GGUF without a chat template whose vocabulary has Gemma's turn markers gets
//! Gemma's turn format ([`GEMMA_TEMPLATE`]).
//! `tokenizer.ggml.model = gpt2` is a byte-level BPE (the `tokenizers` crate's BPE with the GGUF
//! vocabulary and merges). The pre-tokenizer follows `tokenizer.ggml.pre`: `smollm` (and the
//! StarCoder family it copies) splits every digit on its own first, then applies GPT-2's byte-level
//! split. Control tokens (`token_type = 3`) and user-defined tokens (4) are matched whole in the
//! input, as llama.cpp does with special tokens enabled.

use std::collections::HashSet;

use minijinja::{context, Environment};
use serde::Serialize;
use sha2::{Digest, Sha256};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer as HfTokenizer};

use crate::error::{EngineError, Result};
use crate::gguf::GgufFile;

mod spm;

/// Llama 3's pre-tokenizer split (`tokenizer.ggml.pre = llama-bpe`): contractions, letters with
/// one leading non-letter, numbers of up to three digits, punctuation runs, newlines, spaces.
const LLAMA3_SPLIT: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen 2's (`qwen2`): Llama 3's with every digit on its own.
const QWEN2_SPLIT: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

const TOKEN_TYPE_CONTROL: i32 = 3;
const TOKEN_TYPE_USER_DEFINED: i32 = 4;
const TOKEN_TYPE_BYTE: i32 = 6;

/// Gemma's turn format (Tandem's own template of it, used where a Gemma GGUF carries none): a
/// system message opens the first user turn, the assistant's role is `model`. No BOS: the
/// tokenizer adds it.
pub const GEMMA_TEMPLATE: &str = "\
{%- if messages and messages[0].role == 'system' -%}
{%- set system = messages[0].content ~ '\\n\\n' -%}{%- set turns = messages[1:] -%}
{%- else -%}{%- set system = '' -%}{%- set turns = messages -%}{%- endif -%}
{%- for m in turns -%}
{{ '<start_of_turn>' ~ ('model' if m.role == 'assistant' else m.role) ~ '\\n' ~ \
(system if loop.first else '') ~ (m.content | trim) ~ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}";

/// How the text becomes ids.
enum Model {
    /// Byte-level BPE through the `tokenizers` crate.
    Bpe(Box<HfTokenizer>),
    /// SentencePiece-style merges by score.
    Spm(Box<spm::Spm>),
}

/// One chat message for the template.
#[derive(Debug, Clone, Serialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

pub struct Tokenizer {
    inner: Model,
    chat_template: Option<String>,
    eog: HashSet<u32>,
    add_bos: Option<u32>,
    bos_text: String,
    eos_text: String,
    fingerprint: String,
    /// Each token's text as the vocabulary spells it (byte-level: GPT-2's byte alphabet), and
    /// whether it is a control token (for grammars: [`Tokenizer::grammar_vocab`]).
    texts: Vec<String>,
    special: Vec<bool>,
    /// For a SentencePiece vocabulary: each token's byte, where it is a `<0xXX>` token.
    byte_tokens: Option<Vec<Option<u8>>>,
    /// Each token's GGUF type (1 normal, 3 control, 4 user-defined, 6 byte).
    types: Vec<i32>,
    /// How likely the vocabulary itself ranks each token, higher first: SentencePiece's score,
    /// a BPE's merge order (earlier ids are earlier merges).
    prior: Vec<f32>,
}

/// GPT-2's byte-level alphabet backwards: the byte a vocabulary character stands for. Printable
/// bytes stand for themselves; the others (0–32, 127–160, 173) are spelled, in order, by the
/// characters from U+0100 on.
fn byte_of(c: char) -> Option<u8> {
    let printable =
        |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let c = c as u32;
    if c < 256 {
        return printable(c).then_some(c as u8);
    }
    (0u32..256)
        .filter(|&b| !printable(b))
        .nth((c - 256) as usize)
        .map(|b| b as u8)
}

fn tok_err(e: impl std::fmt::Display) -> EngineError {
    EngineError::Tokenizer(e.to_string())
}

impl Tokenizer {
    pub fn from_gguf(g: &GgufFile) -> Result<Self> {
        let model = g.string("tokenizer.ggml.model")?;
        let pre_name = g.string("tokenizer.ggml.pre").unwrap_or("default");
        let tokens: Vec<String> = g
            .array("tokenizer.ggml.tokens")?
            .iter()
            .map(|v| v.to_string().cloned().map_err(tok_err))
            .collect::<Result<_>>()?;
        let types: Vec<i32> = match g.array("tokenizer.ggml.token_type") {
            Ok(v) => v.iter().map(|t| t.to_i32().unwrap_or(1)).collect(),
            Err(_) => vec![1; tokens.len()],
        };
        if types.len() != tokens.len() {
            return Err(EngineError::Metadata {
                key: "tokenizer.ggml.token_type".into(),
                message: format!("{} types for {} tokens", types.len(), tokens.len()),
            });
        }
        let special: Vec<u32> = types
            .iter()
            .enumerate()
            .filter(|(_, &t)| t == TOKEN_TYPE_CONTROL || t == TOKEN_TYPE_USER_DEFINED)
            .map(|(i, _)| i as u32)
            .collect();
        let mut merges: Vec<(String, String)> = Vec::new();
        let mut scores: Vec<f32> = Vec::new();
        let add_space_prefix = g.bool_or("tokenizer.ggml.add_space_prefix", model == "llama");
        let inner = match model {
            "gpt2" => {
                merges = g
                    .array("tokenizer.ggml.merges")?
                    .iter()
                    .map(|v| {
                        let s = v.to_string().map_err(tok_err)?;
                        let (a, b) = s
                            .split_once(' ')
                            .ok_or_else(|| tok_err(format!("merge `{s}` has no space")))?;
                        Ok((a.to_string(), b.to_string()))
                    })
                    .collect::<Result<_>>()?;
                Model::Bpe(Box::new(Self::bpe(pre_name, &tokens, &merges, &special)?))
            }
            "llama" => {
                scores = g
                    .array("tokenizer.ggml.scores")?
                    .iter()
                    .map(|v| {
                        v.to_f32()
                            .or_else(|_| v.to_f64().map(|x| x as f32))
                            .map_err(tok_err)
                    })
                    .collect::<Result<_>>()?;
                Model::Spm(Box::new(spm::Spm::new(
                    &tokens,
                    scores.clone(),
                    special.clone(),
                    add_space_prefix,
                )?))
            }
            other => {
                return Err(EngineError::Metadata {
                    key: "tokenizer.ggml.model".into(),
                    message: format!(
                        "`{other}` is not supported (byte-level BPE `gpt2`, SentencePiece-style \
                         `llama`)"
                    ),
                })
            }
        };
        let id = |key: &str| g.u64(key).ok().map(|v| v as u32);
        let (bos, eos) = (
            id("tokenizer.ggml.bos_token_id"),
            id("tokenizer.ggml.eos_token_id"),
        );
        // End of generation: the EOS id plus the chat end markers, as llama.cpp derives it.
        let mut eog: HashSet<u32> = eos.into_iter().collect();
        for (i, t) in tokens.iter().enumerate() {
            if matches!(
                t.as_str(),
                "<|endoftext|>" | "<|im_end|>" | "<|eot_id|>" | "<|end|>" | "<end_of_turn>"
            ) {
                eog.insert(i as u32);
            }
        }
        let add_bos = if g.bool_or("tokenizer.ggml.add_bos_token", false) {
            bos
        } else {
            None
        };
        let text_of = |i: Option<u32>| {
            i.and_then(|i| tokens.get(i as usize).cloned())
                .unwrap_or_default()
        };

        let mut h = Sha256::new();
        h.update(b"tandem-tokenizer-v1\0");
        h.update(model.as_bytes());
        h.update([0]);
        h.update(pre_name.as_bytes());
        h.update([0]);
        for t in &tokens {
            h.update(t.as_bytes());
            h.update([0]);
        }
        h.update([1]);
        if matches!(inner, Model::Spm(_)) {
            // (A BPE's fingerprint stays what it was before SentencePiece vocabularies came.)
            for (sc, t) in scores.iter().zip(&types) {
                h.update(sc.to_le_bytes());
                h.update(t.to_le_bytes());
            }
            h.update([add_space_prefix as u8, 1]);
        }
        for (a, b) in &merges {
            h.update(a.as_bytes());
            h.update([b' ']);
            h.update(b.as_bytes());
            h.update([0]);
        }
        h.update([1]);
        let mut eog_sorted: Vec<u32> = eog.iter().copied().collect();
        eog_sorted.sort_unstable();
        for ids in [
            &special,
            &eog_sorted,
            &bos.into_iter().collect(),
            &add_bos.into_iter().collect(),
        ] {
            for i in ids.iter() {
                h.update(i.to_le_bytes());
            }
            h.update([2]);
        }
        let digest = h.finalize();
        let fingerprint = digest[..16].iter().map(|b| format!("{b:02x}")).collect();

        let mut is_special = vec![false; tokens.len()];
        for &i in &special {
            is_special[i as usize] = true;
        }
        let (bos_text, eos_text) = (text_of(bos), text_of(eos));
        let byte_tokens = matches!(inner, Model::Spm(_)).then(|| {
            tokens
                .iter()
                .zip(&types)
                .map(|(t, &ty)| match ty {
                    TOKEN_TYPE_BYTE => spm::byte_token(t),
                    _ => None,
                })
                .collect()
        });
        let chat_template = g
            .string("tokenizer.chat_template")
            .ok()
            .map(str::to_string)
            .or_else(|| {
                tokens
                    .iter()
                    .any(|t| t == "<start_of_turn>")
                    .then(|| GEMMA_TEMPLATE.to_string())
            });
        let prior: Vec<f32> = match scores.len() == tokens.len() {
            true => scores.clone(),
            false => (0..tokens.len()).map(|i| -(i as f32)).collect(),
        };
        Ok(Self {
            types,
            prior,
            byte_tokens,
            texts: tokens,
            special: is_special,
            inner,
            chat_template,
            eog,
            add_bos,
            bos_text,
            eos_text,
            fingerprint,
        })
    }

    /// The byte-level BPE over `tokens` and `merges`, its pre-tokenizer `pre_name`'s.
    fn bpe(
        pre_name: &str,
        tokens: &[String],
        merges: &[(String, String)],
        special: &[u32],
    ) -> Result<HfTokenizer> {
        enum Pre {
            Gpt2 { split_digits: bool },
            Split(&'static str),
        }
        let pre = match pre_name {
            "smollm" | "starcoder" | "refact" => Pre::Gpt2 { split_digits: true },
            "gpt-2" | "gpt2" | "default" => Pre::Gpt2 {
                split_digits: false,
            },
            "llama-bpe" | "llama3" => Pre::Split(LLAMA3_SPLIT),
            "qwen2" => Pre::Split(QWEN2_SPLIT),
            other => {
                return Err(EngineError::Metadata {
                    key: "tokenizer.ggml.pre".into(),
                    message: format!(
                        "pre-tokenizer `{other}` is not supported (smollm, gpt-2, llama-bpe, qwen2)"
                    ),
                })
            }
        };
        let vocab: tokenizers::models::bpe::Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        // Llama 3's tokenizer takes a piece the vocabulary spells whole as it is (llama.cpp's
        // `ignore_merges`).
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges.to_vec())
            .ignore_merges(matches!(pre, Pre::Split(LLAMA3_SPLIT)))
            .build()
            .map_err(tok_err)?;
        let mut inner = HfTokenizer::new(bpe);
        let pre: PreTokenizerWrapper = match pre {
            Pre::Gpt2 { split_digits: true } => Sequence::new(vec![
                Digits::new(true).into(),
                ByteLevel::new(false, true, true).into(),
            ])
            .into(),
            Pre::Gpt2 {
                split_digits: false,
            } => ByteLevel::new(false, true, true).into(),
            Pre::Split(re) => {
                let split = Split::new(
                    SplitPattern::Regex(re.into()),
                    SplitDelimiterBehavior::Isolated,
                    false,
                )
                .map_err(tok_err)?;
                Sequence::new(vec![
                    split.into(),
                    ByteLevel::new(false, true, false).into(),
                ])
                .into()
            }
        };
        inner.with_pre_tokenizer(Some(pre));
        inner.with_decoder(Some(ByteLevelDecoder::default()));
        let added: Vec<AddedToken> = special
            .iter()
            .map(|&i| AddedToken::from(tokens[i as usize].clone(), true))
            .collect();
        inner.add_special_tokens(added).map_err(tok_err)?;
        Ok(inner)
    }

    /// Token ids of `text`; special tokens written in the text are matched whole. A byte the
    /// vocabulary has no token for is dropped, as the model's own tokenizer (transformers,
    /// llama.cpp) drops it: SmolLM2's lacks six control bytes, U+0004, U+0006, U+000D (carriage
    /// return), U+000E, U+0010 and U+001D, and at least 0xF2, which begins 4-byte UTF-8
    /// sequences (found by the tokenizer fuzzer).
    ///
    /// BOS is added where the model asks for it, unless the text already begins with it (a chat
    /// template that writes `bos_token`).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let body = match &self.inner {
            Model::Bpe(t) => t
                .encode_fast(text, false)
                .map_err(tok_err)?
                .get_ids()
                .to_vec(),
            Model::Spm(t) => t.encode(text)?,
        };
        let mut ids = Vec::with_capacity(body.len() + 1);
        if let Some(b) = self.add_bos.filter(|b| body.first() != Some(b)) {
            ids.push(b);
        }
        ids.extend_from_slice(&body);
        Ok(ids)
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        match &self.inner {
            Model::Bpe(t) => t.decode(ids, false).map_err(tok_err),
            Model::Spm(_) => {
                let bytes: Vec<u8> = ids.iter().flat_map(|&i| self.token_bytes(i)).collect();
                Ok(String::from_utf8_lossy(&bytes).into_owned())
            }
        }
    }

    pub fn vocab_size(&self) -> usize {
        match &self.inner {
            Model::Bpe(t) => t.get_vocab_size(true),
            Model::Spm(_) => self.texts.len(),
        }
    }

    /// The end-of-generation ids, ascending.
    pub fn eog_ids(&self) -> Vec<u32> {
        let mut v: Vec<u32> = self.eog.iter().copied().collect();
        v.sort_unstable();
        v
    }

    /// The vocabulary as grammars see it (structured outputs): each token's bytes, built once
    /// per model; `logits` is the width of the model's logits rows.
    pub fn grammar_vocab(&self, logits: usize) -> Result<tandem_spec::GrammarVocab> {
        let bytes: Vec<Vec<u8>> = (0..self.texts.len() as u32)
            .map(|i| self.token_bytes(i))
            .collect();
        tandem_spec::GrammarVocab::new(&bytes, &self.special, &self.eog_ids(), logits)
            .map_err(|e| EngineError::Tokenizer(format!("the grammar vocabulary: {e}")))
    }

    /// The bytes token `id` stands for (a control token: its text; none outside the vocabulary).
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let Some(t) = self.texts.get(id as usize) else {
            return Vec::new();
        };
        if self.special[id as usize] {
            return t.as_bytes().to_vec();
        }
        if let Some(bytes) = &self.byte_tokens {
            return match bytes[id as usize] {
                Some(b) => vec![b],
                None => spm::piece_bytes(t),
            };
        }
        // A character outside the alphabet (none in a byte-level vocabulary) keeps its UTF-8.
        t.chars()
            .flat_map(|c| match byte_of(c) {
                Some(b) => vec![b],
                None => c.to_string().into_bytes(),
            })
            .collect()
    }

    /// Every token id, the ones a draft head should keep first ([`crate::LlamaModel::restrict_head`]
    /// takes a prefix): the end-of-generation and BOS ids, the tokens of `chat` (a rendered
    /// conversation: its turn markers), the byte and user-defined tokens (whitespace runs),
    /// then the tokens of `text` by how often it uses them, then the rest in the vocabulary's
    /// own order ([`Self::prior`]: SentencePiece scores, BPE merge order), control tokens last.
    pub fn frequency_order(&self, text: &str, chat: &str) -> Result<Vec<u32>> {
        let n = self.texts.len();
        let mut rank = vec![(3u8, 0u64, 0f32); n];
        let mut count = vec![0u64; n];
        for id in self.encode(text)? {
            count[id as usize] += 1;
        }
        for (i, r) in rank.iter_mut().enumerate() {
            let t = self.types[i];
            *r = match t {
                TOKEN_TYPE_BYTE | TOKEN_TYPE_USER_DEFINED => (1, 0, 0.0),
                TOKEN_TYPE_CONTROL => (4, 0, self.prior[i]),
                _ if count[i] > 0 => (2, count[i], 0.0),
                _ => (3, 0, self.prior[i]),
            };
        }
        for id in self
            .eog
            .iter()
            .copied()
            .chain(self.add_bos)
            .chain(self.encode(chat)?)
        {
            rank[id as usize] = (0, 0, 0.0);
        }
        let mut ids: Vec<u32> = (0..n as u32).collect();
        ids.sort_by(|&a, &b| {
            let (x, y) = (rank[a as usize], rank[b as usize]);
            x.0.cmp(&y.0)
                .then(y.1.cmp(&x.1))
                .then(y.2.total_cmp(&x.2))
                .then(a.cmp(&b))
        });
        Ok(ids)
    }

    /// Is `id` an end-of-generation token?
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.contains(&id)
    }

    /// Hex digest of vocabulary, merges, pre-tokenizer and special ids: two models whose
    /// fingerprints differ cannot share token ids.
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    /// Render `messages` with the model's chat template, ending with the assistant's turn.
    pub fn render_chat(&self, messages: &[ChatMessage]) -> Result<String> {
        let messages: Vec<serde_json::Value> = messages
            .iter()
            .map(|m| serde_json::json!({"role": m.role, "content": m.content}))
            .collect();
        self.render_chat_with(&messages, None)
    }

    /// Render chat `messages` as OpenAI's (an assistant's `tool_calls` with their `arguments` as
    /// JSON objects, as templates expect them) and the functions the model may call (`tools`,
    /// each `{"type": "function", "function": {…}}`), ending with the assistant's turn.
    pub fn render_chat_with(
        &self,
        messages: &[serde_json::Value],
        tools: Option<&[serde_json::Value]>,
    ) -> Result<String> {
        let src = self.chat_template.as_deref().ok_or_else(|| {
            EngineError::ChatTemplate("the model has no tokenizer.chat_template".into())
        })?;
        render(src, messages, tools, &self.bos_text, &self.eos_text)
    }

    /// Whether the model calls tools in tags of its own: its chat template renders `tools`, and
    /// `<tool_call>` and `</tool_call>` are each one control token of its vocabulary (Qwen2.5's
    /// and Hermes' format: `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>`).
    pub fn calls_tools_in_tags(&self) -> bool {
        let template = self.chat_template.as_deref().unwrap_or_default();
        let one_token = |t: &str| {
            self.texts
                .iter()
                .position(|x| x == t)
                .is_some_and(|i| self.special[i])
        };
        template.contains("tools")
            && template.contains(TOOL_CALL_OPEN)
            && one_token(TOOL_CALL_OPEN)
            && one_token(TOOL_CALL_CLOSE)
    }

    /// Token ids of a single user message wrapped in the chat template.
    pub fn encode_chat(&self, user: &str) -> Result<Vec<u32>> {
        let text = self.render_chat(&[ChatMessage {
            role: "user".into(),
            content: user.into(),
        }])?;
        self.encode(&text)
    }
}

/// The tags a model that calls tools in tags writes around each call
/// ([`Tokenizer::calls_tools_in_tags`]).
pub const TOOL_CALL_OPEN: &str = "<tool_call>";
pub const TOOL_CALL_CLOSE: &str = "</tool_call>";

/// `messages` rendered by the Jinja template `src`, ending with the assistant's turn; `tools`,
/// when given, is the template's `tools`.
fn render<M: Serialize>(
    src: &str,
    messages: &[M],
    tools: Option<&[serde_json::Value]>,
    bos: &str,
    eos: &str,
) -> Result<String> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.add_filter("tojson", tojson);
    env.add_template("chat", src)
        .map_err(|e| EngineError::ChatTemplate(e.to_string()))?;
    env.get_template("chat")
        .and_then(|t| {
            t.render(context! {
                messages => messages,
                tools => tools,
                add_generation_prompt => true,
                bos_token => bos,
                eos_token => eos,
            })
        })
        .map_err(|e| EngineError::ChatTemplate(e.to_string()))
}

/// Jinja's `tojson` as the models' own templates were rendered in training (Python's
/// `json.dumps`: `", "` and `": "` between items, keys in their order, no HTML escapes, text
/// as it is), not minijinja's compact and HTML-safe form. `indent` is Python's too.
fn tojson(
    value: minijinja::Value,
    kwargs: minijinja::value::Kwargs,
) -> std::result::Result<minijinja::Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let v = serde_json::to_value(&value).map_err(|e| {
        minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, e.to_string())
    })?;
    let mut out = String::new();
    python_json(&v, indent, 0, &mut out);
    Ok(minijinja::Value::from_safe_string(out))
}

fn python_json(v: &serde_json::Value, indent: Option<usize>, depth: usize, out: &mut String) {
    use serde_json::Value as J;
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    let (item_sep, key_sep) = if indent.is_some() {
        (",", ": ")
    } else {
        (", ", ": ")
    };
    match v {
        J::Array(a) if !a.is_empty() => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                python_json(x, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        J::Object(o) if !o.is_empty() => {
            out.push('{');
            for (i, (k, x)) in o.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                out.push_str(&J::String(k.clone()).to_string());
                out.push_str(key_sep);
                python_json(x, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
        other => out.push_str(&other.to_string()),
    }
}

/// Turns a growing list of token ids into text pieces that are safe to print: a piece is held back
/// while it ends inside a multi-byte character.
#[derive(Default)]
pub struct TextStream {
    ids: Vec<u32>,
    printed: usize,
}

impl TextStream {
    /// Add `id`; returns the newly printable text.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String> {
        self.ids.push(id);
        let text = tok.decode(&self.ids)?;
        let Some(new) = text
            .get(self.printed..)
            .filter(|_| !text.ends_with('\u{FFFD}'))
        else {
            return Ok(String::new());
        };
        let new = new.to_string();
        self.printed = text.len();
        Ok(new)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Templates' `tojson` writes what Python's `json.dumps(x, ensure_ascii=False)` writes (how
    /// the models' templates were rendered in training): keys in their order, `", "` and `": "`,
    /// no HTML escapes; `indent` as Python's.
    #[test]
    fn tojson_writes_what_pythons_json_dumps_writes() {
        let tools = [
            serde_json::json!({"type": "function", "function": {"name": "f<x>",
            "parameters": {"b": [1, 2.5, "é & 'q'"], "a": {}, "c": []}}}),
        ];
        let one = render("{{ tools[0] | tojson }}", &[()], Some(&tools), "", "").unwrap();
        assert_eq!(
            one,
            r#"{"type": "function", "function": {"name": "f<x>", "parameters": {"b": [1, 2.5, "é & 'q'"], "a": {}, "c": []}}}"#
        );
        let indented = render(
            "{{ tools[0].function.parameters | tojson(indent=2) }}",
            &[()],
            Some(&tools),
            "",
            "",
        )
        .unwrap();
        assert_eq!(
            indented,
            "{\n  \"b\": [\n    1,\n    2.5,\n    \"é & 'q'\"\n  ],\n  \"a\": {},\n  \"c\": []\n}"
        );
    }

    #[test]
    fn gemmas_turn_format() {
        let m = |role: &str, content: &str| ChatMessage {
            role: role.into(),
            content: content.into(),
        };
        let one = render(
            GEMMA_TEMPLATE,
            &[m("user", "Hi there ")],
            None,
            "<bos>",
            "<eos>",
        )
        .unwrap();
        assert_eq!(
            one,
            "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n"
        );
        let chat = render(
            GEMMA_TEMPLATE,
            &[
                m("system", "Be brief."),
                m("user", "Hi"),
                m("assistant", "Hello!"),
                m("user", "Bye"),
            ],
            None,
            "<bos>",
            "<eos>",
        )
        .unwrap();
        assert_eq!(
            chat,
            "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n\
             <start_of_turn>model\nHello!<end_of_turn>\n\
             <start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
        );
    }
}
