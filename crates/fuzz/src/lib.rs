//! Tandem's fuzz harnesses. Each function takes the fuzzer's bytes and drives the real code a
//! hostile peer or a corrupt file reaches; `fuzz/fuzz_targets/*.rs` (cargo-fuzz, libFuzzer) call
//! them, and `tests/corpus.rs` replays every committed corpus file through them under an
//! ordinary `cargo test`, so CI keeps what the fuzzers found.
//!
//! - [`verifier_stream`]: protobuf decode → validation → the verifier core, for up to four
//!   sessions at once, each driven by an honest edge session core, by raw messages, or both.
//! - [`edge_session`]: the edge's session core fed arbitrary messages from a "verifier".
//! - [`tenants_file`], [`gguf`], [`tokenizer`]: the files and text a deployment feeds in.
//!
//! A harness panics only on a broken invariant: a refusal with an error is the right answer to
//! bad input.

mod edge;
mod files;
mod verifier;

pub use edge::edge_session;
pub use files::{gguf, tenants_file, tokenizer};
pub use verifier::verifier_stream;

/// The fuzzer's bytes, read front to back; past the end every read is 0 or empty.
pub(crate) struct Input<'a>(&'a [u8]);

impl<'a> Input<'a> {
    pub(crate) fn new(data: &'a [u8]) -> Self {
        Self(data)
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub(crate) fn byte(&mut self) -> u8 {
        match self.0.split_first() {
            Some((&b, rest)) => {
                self.0 = rest;
                b
            }
            None => 0,
        }
    }

    pub(crate) fn take(&mut self, n: usize) -> &'a [u8] {
        let (a, b) = self.0.split_at(n.min(self.0.len()));
        self.0 = b;
        a
    }

    /// A length-prefixed chunk (one length byte).
    pub(crate) fn chunk(&mut self) -> &'a [u8] {
        let n = self.byte() as usize;
        self.take(n)
    }
}
