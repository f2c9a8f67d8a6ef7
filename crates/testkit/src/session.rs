//! A verifier session driven by hand over the raw gRPC stream (`Verifier.Session`), for tests
//! that send the verifier exactly the messages they mean to, well-formed or not, and read every
//! answer.

use std::time::Duration;

use tandem_proto::v1::verifier_client::VerifierClient;
use tandem_proto::v1::{
    cloud_message, edge_message, CloudMessage, Draft, EdgeMessage, SamplingParams, Verdict,
};
use tokio::sync::mpsc::{unbounded_channel, UnboundedSender};
use tonic::{Code, Request, Status, Streaming};

use crate::model::target;

/// `msg` as a request carrying `key` as its bearer token (None: no `authorization` header).
pub fn authorized<T>(msg: T, key: Option<&str>) -> Request<T> {
    let mut r = Request::new(msg);
    if let Some(k) = key {
        r.metadata_mut()
            .insert("authorization", format!("Bearer {k}").parse().unwrap());
    }
    r
}

/// An Open over `prompt` for a tokenizer of `fingerprint`: γ 4, depth 2, linear blocks, this
/// protocol's version, with `params`, verify rule `rule` (the wire's number) and `max_tokens`.
pub fn open_message(
    fingerprint: &str,
    prompt: &[u32],
    params: Option<SamplingParams>,
    rule: i32,
    max_tokens: u32,
) -> EdgeMessage {
    tandem_proto::open_message(fingerprint, prompt, params, rule, max_tokens, (4, 2))
}

/// A session driven by hand over a raw stream.
pub struct Raw {
    /// What the test sends the verifier.
    pub out: UnboundedSender<EdgeMessage>,
    /// What the verifier sends back.
    pub inbound: Streaming<CloudMessage>,
    /// The session's id, from its `Opened`.
    pub session: u64,
    /// The first token, committed at Open.
    pub first: u32,
    /// The position after the first token: where the session's first block starts.
    pub start: usize,
    /// Tokens the verifier decoded and sent since Open.
    pub decoded: usize,
}

/// A greedy session over `prompt` (400 tokens at most) on the verifier at `url`, as the tenant
/// whose API key is `key`, its `Opened` read; or the status that refused it.
pub async fn open_raw(url: &str, key: Option<&str>, prompt: &[u32]) -> Result<Raw, Status> {
    let (_, tok) = target();
    let mut c = VerifierClient::connect(url.to_string()).await.unwrap();
    let (out, rx) = unbounded_channel();
    out.send(open_message(tok.fingerprint(), prompt, None, 0, 400))
        .unwrap();
    let stream = tokio_stream::wrappers::UnboundedReceiverStream::new(rx);
    let mut inbound = c.session(authorized(stream, key)).await?.into_inner();
    // Admitted (before the prefill), then Opened.
    let mut first = inbound.message().await?.and_then(|m| m.kind);
    if let Some(cloud_message::Kind::Admitted(_)) = first {
        first = inbound.message().await?.and_then(|m| m.kind);
    }
    match first {
        Some(cloud_message::Kind::Opened(o)) => Ok(Raw {
            out,
            inbound,
            session: o.session_id,
            first: o.first_token,
            start: prompt.len() + 1,
            decoded: 0,
        }),
        other => panic!("expected Opened, got {other:?}"),
    }
}

impl Raw {
    /// Send `d` as a Draft message.
    pub fn draft(&self, d: Draft) {
        self.out
            .send(EdgeMessage {
                kind: Some(edge_message::Kind::Draft(d)),
            })
            .unwrap();
    }

    /// The next message: a decoded token (checked to come at the next position), a verdict or
    /// a refusal (its code and text).
    pub async fn message(&mut self) -> Result<Reply, (Code, String)> {
        match tokio::time::timeout(Duration::from_secs(60), self.inbound.message()).await {
            Ok(Ok(Some(CloudMessage {
                kind: Some(cloud_message::Kind::Decoded(d)),
            }))) => {
                assert_eq!(
                    d.position as usize,
                    self.start + self.decoded,
                    "each position once, in order"
                );
                self.decoded += 1;
                Ok(Reply::Decoded)
            }
            Ok(Ok(Some(CloudMessage {
                kind: Some(cloud_message::Kind::Verdict(v)),
            }))) => Ok(Reply::Verdict(v)),
            Ok(Ok(Some(CloudMessage {
                kind: Some(cloud_message::Kind::Error(e)),
            }))) => Err((Code::from_i32(e.code as i32), e.message)),
            Ok(Err(s)) => Err((s.code(), s.message().to_string())),
            other => panic!("unexpected {other:?}"),
        }
    }

    /// The next verdict (Ok) or refusal, past the tokens the verifier decodes meanwhile.
    pub async fn next(&mut self) -> Result<Verdict, (Code, String)> {
        loop {
            if let Reply::Verdict(v) = self.message().await? {
                return Ok(v);
            }
        }
    }
}

/// What a raw session's next message was, past refusals.
pub enum Reply {
    /// A token the verifier decoded for the session, at the next position.
    Decoded,
    /// The verdict on a block.
    Verdict(Verdict),
}
