//! The edge's session core against a verifier that sends anything: raw protobuf bytes (read
//! through the edge transport's own [`tandem_proto::from_cloud`]), verdicts and decoded tokens
//! with fuzzed fields, lost connections and reopens, between the draft's tokens.
//!
//! Invariants: nothing panics; commits are contiguous, never repeat a position, and never go
//! past the token limit; what was committed is what the session reports as its history.

use prost::Message;
use tandem_proto::v1;
use tandem_proto::FromCloud;
use tandem_spec::edge::Reconnecting;
use tandem_spec::pipeline::{Output, TreeConfig};
use tandem_spec::{EdgeSession, Opened, SessionConfig, Shape};

use crate::Input;

const PROMPT: [u32; 3] = [5, 6, 7];

struct Edge {
    s: EdgeSession,
    /// Committed tokens (the prompt included), as the outputs told them.
    history: Vec<u32>,
    max_new: usize,
    now_us: u64,
}

impl Edge {
    fn outputs(&mut self, out: Vec<Output>) {
        for o in out {
            if let Output::Commit { pos, tokens } = o {
                assert_eq!(pos, self.history.len(), "commits are contiguous");
                self.history.extend(tokens);
                assert!(
                    self.history.len() <= PROMPT.len() + self.max_new,
                    "{} tokens committed past the limit of {}",
                    self.history.len() - PROMPT.len(),
                    self.max_new
                );
            }
        }
        // The session's own history: the reopen of a lost session starts from it.
        assert_eq!(self.s.committed(), &self.history[..], "committed history");
    }

    fn message(&mut self, m: v1::CloudMessage) {
        let bytes = m.encode_to_vec();
        let m = v1::CloudMessage::decode(bytes.as_slice()).expect("what we encoded decodes");
        self.raw(m);
    }

    fn raw(&mut self, m: v1::CloudMessage) {
        if let FromCloud::Message(m) = tandem_proto::from_cloud(m) {
            if let Ok(r) = self.s.on_message(self.now_us, m) {
                self.outputs(r.outputs);
            }
        }
    }
}

/// See the module docs.
pub fn edge_session(data: &[u8]) {
    let mut input = Input::new(data);
    let cfg = SessionConfig {
        draft_len: 1 + input.byte() as usize % 8,
        depth: 1 + input.byte() as usize % 4,
        max_new_tokens: 1 + input.byte() as usize % 64,
        auto: None,
        tree: TreeConfig::LINEAR,
    };
    let grant = match input.byte() % 3 {
        0 => Shape::UNLIMITED,
        g => Shape::new(u32::from(input.byte() % 9), u32::from(g)),
    };
    let opened = Opened {
        first: u32::from(input.byte()),
        grant,
        side_nodes: 0,
    };
    let Ok((s, out)) = EdgeSession::new(0, PROMPT.to_vec(), opened, cfg, vec![255]) else {
        return;
    };
    let mut e = Edge {
        s,
        history: PROMPT.to_vec(),
        max_new: cfg.max_new_tokens,
        now_us: 0,
    };
    e.outputs(out);
    while !input.is_empty() {
        e.now_us += u64::from(input.byte()) * 1000;
        match input.byte() % 8 {
            0..=2 => {
                let token = u32::from(input.byte());
                if e.s.next() == tandem_spec::pipeline::Next::Draft {
                    let out = e.s.on_drafted(e.now_us, token, None, 1.0, false);
                    e.outputs(out);
                }
            }
            3 => {
                if let Ok(m) = v1::CloudMessage::decode(input.chunk()) {
                    e.raw(m);
                }
            }
            4 => {
                let v = v1::Verdict {
                    epoch: u64::from(input.byte() % 4),
                    block: u64::from(input.byte() % 16),
                    accepted: u32::from(input.byte() % 10),
                    token: u32::from(input.byte()),
                    verify_us: 100,
                    grant_draft_len: u32::from(input.byte() % 10),
                    grant_depth: u32::from(input.byte() % 5),
                    side_end: input
                        .byte()
                        .is_multiple_of(2)
                        .then_some(u32::from(input.byte() % 3)),
                };
                e.message(v1::CloudMessage {
                    kind: Some(v1::cloud_message::Kind::Verdict(v)),
                });
            }
            5 => {
                let d = v1::Decoded {
                    epoch: u64::from(input.byte() % 4),
                    position: e.history.len() as u64 + u64::from(input.byte() % 4),
                    token: u32::from(input.byte()),
                    grant_draft_len: u32::from(input.byte() % 10),
                    grant_depth: u32::from(input.byte() % 5),
                    guessed: false,
                };
                e.message(v1::CloudMessage {
                    kind: Some(v1::cloud_message::Kind::Decoded(d)),
                });
            }
            6 => {
                let out = e.s.on_connection_lost();
                e.outputs(out);
                let r = Reconnecting {
                    attempt: u32::from(input.byte()),
                    elapsed_ms: u64::from(input.byte()) * 300,
                    window_ms: 30_000,
                    retry_after_ms: Some(u64::from(input.byte()) * 50),
                    jitter: f64::from(input.byte()) / 256.0,
                };
                // A driver reopens only a session with tokens left to make.
                if let Some(reopen) = e.s.reopen(r).filter(|r| r.max_tokens > 0) {
                    assert!(reopen.after_ms <= r.window_ms - r.elapsed_ms);
                    assert!(reopen.max_tokens <= e.max_new);
                    let out = e.s.on_reopened(u32::from(input.byte()));
                    e.outputs(out);
                }
            }
            _ => {
                let ms = f64::from(input.byte());
                e.s.on_edge_work(ms);
            }
        }
    }
    let _ = e.s.measured();
}
