//! The edge runtime against a real verifier: SmolLM2's f32 target served in-process over gRPC on a
//! loopback port, the 4-bit draft on the edge. A block the verifier refuses (a per-message
//! error, as a buggy or outdated edge would cause) does not end the answer: the edge reopens the
//! session over what it committed, and the answer is the target's, token for token. The model is
//! pulled on first use.

#[path = "../../cloud/tests/common/mod.rs"]
mod common;

use common::*;

/// The edge's link to a real verifier, which slips one malformed block in after the edge's
/// first: the verifier refuses it (a per-message error), as it would a block a buggy or
/// outdated edge sent.
struct SlipsOneBadBlock {
    inner: tandem_edge::grpc::GrpcLink,
    sent: usize,
}

impl tandem_edge::Link for SlipsOneBadBlock {
    fn send(&mut self, block: tandem_spec::Block) -> Result<(), tandem_edge::EdgeError> {
        self.sent += 1;
        let bad = (self.sent == 1).then(|| tandem_spec::Block {
            tokens: vec![999_999],
            q: vec![],
            side: vec![],
            ..block.clone()
        });
        self.inner.send(block)?;
        if let Some(b) = bad {
            self.inner.send(b)?;
        }
        Ok(())
    }
    fn ack(&mut self, committed: usize) -> Result<(), tandem_edge::EdgeError> {
        self.inner.ack(committed)
    }
    fn recv(
        &mut self,
        wait: bool,
    ) -> Result<Option<tandem_spec::Incoming>, tandem_edge::EdgeError> {
        self.inner.recv(wait)
    }
    fn reopen(
        &mut self,
        history: &[u32],
        max_tokens: usize,
    ) -> Result<u32, tandem_edge::EdgeError> {
        self.inner.reopen(history, max_tokens)
    }
}

#[test]
fn a_refused_message_does_not_end_the_answer() {
    // A verifier that waits for the edge's blocks (5 s), so that the bad one is sent however
    // slow the draft is beside the target (else the verifier can decode the whole answer first).
    let (url, _) = grpc_server_with(
        1e9,
        false,
        tandem_cloud::tenants::Tenants::open(),
        tandem_verifier::VerifierConfig {
            await_drafts_ms: 5_000,
            ..tandem_verifier::VerifierConfig::default()
        },
        256 << 20,
    );
    let (m, tok) = target();
    let prompt = tok.encode_chat("Name three colours.").unwrap();
    let want = {
        let mut e = engine(m);
        let mut ids = greedy(&mut e, tandem_engine::SeqId(0), &prompt, 48);
        if let Some(i) = ids.iter().position(|&t| tok.is_eog(t)) {
            ids.truncate(i + 1);
        }
        ids
    };
    let rt = rt();
    let mut req = greedy_open(tok.fingerprint(), &prompt);
    req.max_tokens = 48;
    let (link, opened) = tandem_edge::grpc::GrpcLink::connect(&rt, &url, req).unwrap();
    let mut link = SlipsOneBadBlock {
        inner: link,
        sent: 0,
    };
    let cfg = tandem_edge::SpecConfig {
        session: tandem_spec::edge::SessionConfig {
            draft_len: 2,
            depth: 2,
            max_new_tokens: 48,
            auto: None,
            tree: tandem_spec::TreeConfig::LINEAR,
        },
        rule: tandem_spec::VerifyRule::Greedy,
        params: tandem_spec::sampling::SamplingParams::default(),
        q_top_k: 32,
        self_draft: true,
        suffix: true,
    };
    let (dm, _) = draft();
    let mut d = engine(dm);
    let report = tandem_edge::run(
        &mut d,
        tok.eog_ids(),
        &prompt,
        Some(tandem_edge::grpc::opened(&opened)),
        &cfg,
        &mut link,
        std::time::Instant::now(),
        |_| {},
    )
    .expect("the answer survives the refusal");
    assert!(link.sent >= 1, "the bad block was sent");
    assert_eq!(
        report.output_ids, want,
        "the target's answer, token for token"
    );
    assert!(report.measured.reconnects >= 1, "the session was reopened");
}
