//! SentencePiece-style tokenization from a GGUF (`tokenizer.ggml.model = llama`: Gemma, LLaMA 2,
//! Mistral): the text's spaces become `▁`, then, from its characters, the adjacent pair whose
//! concatenation is the vocabulary's highest-scoring token is merged, again and again (ties go to
//! the leftmost pair); a character no token spells falls back to its bytes' `<0xXX>` tokens.
//! Special tokens (control and user-defined) are matched in the raw text first, the longest
//! first over the whole text, as llama.cpp partitions it.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

use aho_corasick::AhoCorasick;

use crate::error::{EngineError, Result};

/// SentencePiece's space.
const SPACE: char = '\u{2581}';

pub(super) struct Spm {
    /// A token's id by its text (a text spelled twice maps to its last id, as llama.cpp's map).
    ids: HashMap<String, u32>,
    scores: Vec<f32>,
    /// `<0xXX>`'s id for each byte.
    bytes: [Option<u32>; 256],
    /// The special tokens (control and user-defined) and a matcher for their texts.
    special: Vec<u32>,
    special_texts: Vec<String>,
    matcher: Option<AhoCorasick>,
    add_space_prefix: bool,
}

/// A pair of adjacent symbols whose concatenation is a token.
struct Bigram {
    left: usize,
    right: usize,
    score: f32,
    size: usize,
}

impl PartialEq for Bigram {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for Bigram {}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Bigram {
    /// The best pair is the greatest: the higher score, then the leftmost.
    fn cmp(&self, o: &Self) -> Ordering {
        self.score
            .total_cmp(&o.score)
            .then_with(|| o.left.cmp(&self.left))
    }
}

/// One symbol of the text: bytes `start..start + len`, linked to its neighbours.
#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

impl Spm {
    pub(super) fn new(
        tokens: &[String],
        scores: Vec<f32>,
        special: Vec<u32>,
        add_space_prefix: bool,
    ) -> Result<Self> {
        if scores.len() != tokens.len() {
            return Err(EngineError::Metadata {
                key: "tokenizer.ggml.scores".into(),
                message: format!("{} scores for {} tokens", scores.len(), tokens.len()),
            });
        }
        let mut ids = HashMap::with_capacity(tokens.len());
        for (i, t) in tokens.iter().enumerate() {
            ids.insert(t.clone(), i as u32);
        }
        let mut bytes = [None; 256];
        for (b, slot) in bytes.iter_mut().enumerate() {
            *slot = ids
                .get(&format!("<0x{b:02X}>"))
                .or_else(|| {
                    std::str::from_utf8(&[b as u8])
                        .ok()
                        .and_then(|s| ids.get(s))
                })
                .copied();
        }
        // (A special token with no text can never be matched: left out.)
        let special: Vec<u32> = special
            .into_iter()
            .filter(|&i| !tokens[i as usize].is_empty())
            .collect();
        let special_texts: Vec<String> = special
            .iter()
            .map(|&i| tokens[i as usize].clone())
            .collect();
        let matcher = if special_texts.is_empty() {
            None
        } else {
            Some(
                AhoCorasick::new(&special_texts)
                    .map_err(|e| EngineError::Tokenizer(format!("special tokens: {e}")))?,
            )
        };
        Ok(Self {
            ids,
            scores,
            bytes,
            special,
            special_texts,
            matcher,
            add_space_prefix,
        })
    }

    /// The ids of `text` (no BOS).
    pub(super) fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let mut out = Vec::new();
        let mut prev_special = true;
        for piece in self.partition(text) {
            match piece {
                Piece::Special(id) => {
                    out.push(id);
                    prev_special = true;
                }
                Piece::Text(t) => {
                    let mut s = String::with_capacity(t.len() + 3);
                    if self.add_space_prefix && prev_special {
                        s.push(' ');
                    }
                    s.push_str(t);
                    let s = s.replace(' ', &SPACE.to_string());
                    self.merge(&s, &mut out)?;
                    prev_special = false;
                }
            }
        }
        Ok(out)
    }

    /// Split `text` at the special tokens in it: the longest special token first, at each of
    /// its occurrences in the text not yet taken, then the next longest in what is left.
    fn partition<'a>(&self, text: &'a str) -> Vec<Piece<'a>> {
        let mut pieces = vec![Piece::Text(text)];
        let Some(ac) = &self.matcher else {
            return pieces;
        };
        // Only the special tokens the text holds somewhere, longest first (then by id).
        let mut present: Vec<usize> = ac
            .find_overlapping_iter(text)
            .map(|m| m.pattern().as_usize())
            .collect();
        present.sort_unstable_by(|&a, &b| {
            self.special_texts[b]
                .len()
                .cmp(&self.special_texts[a].len())
                .then(self.special[a].cmp(&self.special[b]))
        });
        present.dedup();
        for i in present {
            let (needle, id) = (self.special_texts[i].as_str(), self.special[i]);
            let mut next = Vec::with_capacity(pieces.len());
            for p in pieces {
                let Piece::Text(mut t) = p else {
                    next.push(p);
                    continue;
                };
                while let Some(at) = t.find(needle) {
                    if at > 0 {
                        next.push(Piece::Text(&t[..at]));
                    }
                    next.push(Piece::Special(id));
                    t = &t[at + needle.len()..];
                }
                if !t.is_empty() {
                    next.push(Piece::Text(t));
                }
            }
            pieces = next;
        }
        pieces
    }

    /// Merge `text`'s characters by score and append the tokens.
    fn merge(&self, text: &str, out: &mut Vec<u32>) -> Result<()> {
        if text.is_empty() {
            return Ok(());
        }
        let mut syms: Vec<Symbol> = Vec::with_capacity(text.len());
        for (i, (start, c)) in text.char_indices().enumerate() {
            syms.push(Symbol {
                start,
                len: c.len_utf8(),
                prev: i.checked_sub(1),
                next: None,
            });
            if i > 0 {
                syms[i - 1].next = Some(i);
            }
        }
        let mut queue = BinaryHeap::new();
        let bigram = |syms: &[Symbol], l: Option<usize>, r: Option<usize>| -> Option<Bigram> {
            let (l, r) = (l?, r?);
            let (a, b) = (syms[l], syms[r]);
            let id = *self.ids.get(&text[a.start..b.start + b.len])?;
            Some(Bigram {
                left: l,
                right: r,
                score: self.scores[id as usize],
                size: a.len + b.len,
            })
        };
        for i in 1..syms.len() {
            queue.extend(bigram(&syms, Some(i - 1), Some(i)));
        }
        while let Some(b) = queue.pop() {
            let (l, r) = (syms[b.left], syms[b.right]);
            if l.len == 0 || r.len == 0 || l.len + r.len != b.size {
                continue; // one side was merged since
            }
            syms[b.left].len += r.len;
            syms[b.right].len = 0;
            syms[b.left].next = r.next;
            if let Some(n) = r.next {
                syms[n].prev = Some(b.left);
            }
            queue.extend(bigram(&syms, syms[b.left].prev, Some(b.left)));
            queue.extend(bigram(&syms, Some(b.left), syms[b.left].next));
        }
        let mut at = Some(0);
        while let Some(i) = at {
            let s = syms[i];
            let piece = &text[s.start..s.start + s.len];
            // A merged symbol is a token by construction; a lone character may not be.
            match self.ids.get(piece) {
                Some(&id) => out.push(id),
                None => {
                    for &b in piece.as_bytes() {
                        out.push(self.bytes[b as usize].ok_or_else(|| {
                            EngineError::Tokenizer(format!(
                                "the vocabulary has no token for {piece:?} nor for its byte \
                                 0x{b:02X}"
                            ))
                        })?);
                    }
                }
            }
            at = s.next;
        }
        Ok(())
    }
}

enum Piece<'a> {
    Text(&'a str),
    Special(u32),
}

/// The bytes a normal token stands for: its text with `▁` for spaces.
pub(super) fn piece_bytes(text: &str) -> Vec<u8> {
    text.replace(SPACE, " ").into_bytes()
}

/// The byte a `<0xXX>` token stands for.
pub(super) fn byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    (hex.len() == 2).then(|| u8::from_str_radix(hex, 16).ok())?
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A vocabulary: `<unk>`, `<s>` (control), the 256 byte tokens, then the given pieces with
    /// their scores.
    fn spm(pieces: &[(&str, f32)], special: &[&str], prefix: bool) -> (Spm, Vec<String>) {
        let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into()];
        let mut scores = vec![0.0, 0.0];
        for b in 0..256 {
            tokens.push(format!("<0x{b:02X}>"));
            scores.push(0.0);
        }
        for (p, s) in pieces {
            tokens.push(p.to_string());
            scores.push(*s);
        }
        let mut special_ids = vec![1];
        for s in special {
            special_ids.push(tokens.len() as u32);
            tokens.push(s.to_string());
            scores.push(0.0);
        }
        (
            Spm::new(&tokens, scores, special_ids, prefix).unwrap(),
            tokens,
        )
    }

    fn texts(ids: &[u32], tokens: &[String]) -> Vec<String> {
        ids.iter().map(|&i| tokens[i as usize].clone()).collect()
    }

    #[test]
    fn pairs_merge_by_score_and_ties_go_left() {
        // "abc": ab (score 1) beats bc (0.5); then abc is a token.
        let (t, v) = spm(
            &[
                ("a", 0.),
                ("b", 0.),
                ("c", 0.),
                ("ab", 1.),
                ("bc", 0.5),
                ("abc", 0.2),
            ],
            &[],
            false,
        );
        assert_eq!(texts(&t.encode("abc").unwrap(), &v), ["abc"]);
        // Without abc: ab, then c.
        let (t, v) = spm(
            &[("a", 0.), ("b", 0.), ("c", 0.), ("ab", 1.), ("bc", 0.5)],
            &[],
            false,
        );
        assert_eq!(texts(&t.encode("abc").unwrap(), &v), ["ab", "c"]);
        // bc scoring higher wins the middle letter.
        let (t, v) = spm(
            &[("a", 0.), ("b", 0.), ("c", 0.), ("ab", 0.5), ("bc", 1.)],
            &[],
            false,
        );
        assert_eq!(texts(&t.encode("abc").unwrap(), &v), ["a", "bc"]);
        // "aaa" with one pair token: the leftmost pair merges first.
        let (t, v) = spm(&[("a", 0.), ("aa", 1.)], &[], false);
        assert_eq!(texts(&t.encode("aaa").unwrap(), &v), ["aa", "a"]);
    }

    #[test]
    fn spaces_become_the_metaspace_and_unknown_characters_their_bytes() {
        let (t, v) = spm(
            &[("▁", 0.), ("h", 0.), ("i", 0.), ("▁hi", 2.), ("hi", 1.)],
            &[],
            true,
        );
        // The prefix space, then "hi" a word.
        assert_eq!(texts(&t.encode("hi hi").unwrap(), &v), ["▁hi", "▁hi"]);
        let (t, v) = spm(&[("▁", 0.), ("h", 0.), ("i", 0.), ("hi", 1.)], &[], false);
        assert_eq!(texts(&t.encode("hi").unwrap(), &v), ["hi"]);
        // "é" is no token: its two UTF-8 bytes.
        assert_eq!(texts(&t.encode("é").unwrap(), &v), ["<0xC3>", "<0xA9>"]);
        assert_eq!(byte_token("<0xA9>"), Some(0xA9));
        assert_eq!(byte_token("<0xA>"), None);
        assert_eq!(piece_bytes("▁hi▁"), b" hi ");
        assert!(t.encode("").unwrap().is_empty());
    }

    #[test]
    fn special_tokens_are_matched_first_the_longest_first() {
        let (t, v) = spm(
            &[("a", 0.), ("b", 0.), ("ab", 1.), ("\n", 0.)],
            &["<turn>", "\n\n", "\n\n\n"],
            false,
        );
        assert_eq!(
            texts(&t.encode("a<turn>ab<s>").unwrap(), &v),
            ["a", "<turn>", "ab", "<s>"]
        );
        // Five newlines: the three-newline token first, then the two.
        assert_eq!(
            texts(&t.encode("a\n\n\n\n\nb").unwrap(), &v),
            ["a", "\n\n\n", "\n\n", "b"]
        );
        // A special token's text split by another is not matched.
        assert_eq!(texts(&t.encode("<tu").unwrap(), &v).len(), 3);
    }
}
