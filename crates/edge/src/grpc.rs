//! The edge's gRPC link to a `tandem.v1.Verifier`: opens a `Session` stream, sends draft blocks and
//! hands verdicts to the (synchronous) edge runtime. The stream runs on a tokio runtime; the edge
//! thread blocks on a channel only when its pipeline is full.

use tandem_proto::v1::verifier_client::VerifierClient;
use tandem_proto::v1::{cloud_message, edge_message, Ack, EdgeMessage, Open, Opened};
use tandem_proto::{rule_to_proto, PROTOCOL_VERSION};
use tandem_spec::sampling::SamplingParams;
use tandem_spec::{Block, Verdict, VerifyRule};
use tokio::runtime::Runtime;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use tokio_stream::wrappers::UnboundedReceiverStream;

use tandem_spec::Incoming;

use crate::{EdgeError, Link};

/// What the edge asks for when it opens a session.
#[derive(Debug, Clone)]
pub struct OpenRequest {
    pub tokenizer_fingerprint: String,
    pub prompt_ids: Vec<u32>,
    pub params: SamplingParams,
    pub max_tokens: u32,
    pub rule: VerifyRule,
    pub want_draft_len: u32,
    pub want_depth: u32,
    /// Side nodes per block for token trees (0: linear blocks).
    pub want_side_nodes: u32,
    /// The tenant's API key, sent as `authorization: Bearer <key>` (None: a verifier without
    /// tenants).
    pub api_key: Option<String>,
}

/// `msg` as a request that carries `api_key`.
pub fn authorized<T>(msg: T, api_key: Option<&str>) -> Result<tonic::Request<T>, EdgeError> {
    let mut r = tonic::Request::new(msg);
    if let Some(k) = api_key {
        let v = format!("Bearer {k}")
            .parse()
            .map_err(|_| refused("the API key is not a valid header value"))?;
        r.metadata_mut().insert("authorization", v);
    }
    Ok(r)
}

/// A refusal that keeps the status code's name (e.g. `ResourceExhausted: ... retry after ...`).
fn status(s: tonic::Status) -> EdgeError {
    EdgeError::Refused(format!("{:?}: {}", s.code(), s.message()))
}

pub struct GrpcLink {
    out: UnboundedSender<EdgeMessage>,
    verdicts: UnboundedReceiver<Result<Incoming, EdgeError>>,
    /// What reopening a session after a lost connection needs.
    rt: tokio::runtime::Handle,
    url: String,
    req: OpenRequest,
}

fn refused(e: impl std::fmt::Display) -> EdgeError {
    EdgeError::Refused(e.to_string())
}

impl GrpcLink {
    /// Connect to `url`, open the session and wait for `Opened` (which carries the granted γ and
    /// depth and the target's first token).
    pub fn connect(rt: &Runtime, url: &str, req: OpenRequest) -> Result<(Self, Opened), EdgeError> {
        Self::open(rt.handle().clone(), url, req)
    }

    fn open(
        rt: tokio::runtime::Handle,
        url: &str,
        req: OpenRequest,
    ) -> Result<(Self, Opened), EdgeError> {
        let keep = req.clone();
        let handle = rt.clone();
        rt.block_on(async move {
            let mut client = VerifierClient::connect(url.to_string())
                .await
                .map_err(refused)?;
            let (out, rx) = unbounded_channel::<EdgeMessage>();
            let open = Open {
                protocol_version: PROTOCOL_VERSION,
                tokenizer_fingerprint: req.tokenizer_fingerprint,
                prompt_ids: req.prompt_ids,
                params: Some(req.params.into()),
                max_tokens: req.max_tokens,
                rule: rule_to_proto(req.rule) as i32,
                want_draft_len: req.want_draft_len,
                want_depth: req.want_depth,
                want_side_nodes: req.want_side_nodes,
            };
            out.send(EdgeMessage {
                kind: Some(edge_message::Kind::Open(open)),
            })
            .map_err(|_| EdgeError::LinkClosed)?;
            let stream = authorized(UnboundedReceiverStream::new(rx), req.api_key.as_deref())?;
            let mut inbound = client.session(stream).await.map_err(status)?.into_inner();
            let opened = match inbound.message().await.map_err(status)? {
                Some(m) => match m.kind {
                    Some(cloud_message::Kind::Opened(o)) => o,
                    Some(cloud_message::Kind::Error(e)) => return Err(refused(e.message)),
                    _ => return Err(refused("the verifier did not open the session")),
                },
                None => return Err(EdgeError::LinkClosed),
            };
            let (vtx, verdicts) = unbounded_channel();
            tokio::spawn(async move {
                loop {
                    let m = match inbound.message().await {
                        Ok(Some(m)) => m,
                        Ok(None) => break,
                        // A broken stream: the verifier's own refusals come as messages.
                        Err(s) => {
                            tracing::warn!("the session stream broke: {}", s.message());
                            let _ = vtx.send(Err(EdgeError::LinkClosed));
                            break;
                        }
                    };
                    let item = match m.kind {
                        Some(cloud_message::Kind::Verdict(v)) => {
                            Ok(Incoming::Verdict(Verdict::from(v)))
                        }
                        Some(cloud_message::Kind::Decoded(d)) => {
                            Ok(Incoming::Decoded(tandem_spec::Decoded::from(d)))
                        }
                        Some(cloud_message::Kind::Error(e)) => Err(refused(e.message)),
                        _ => continue,
                    };
                    if vtx.send(item).is_err() {
                        break;
                    }
                }
            });
            Ok((
                Self {
                    out,
                    verdicts,
                    rt: handle,
                    url: url.to_string(),
                    req: keep,
                },
                opened,
            ))
        })
    }

    /// End the session politely.
    pub fn close(&self) {
        let _ = self.out.send(EdgeMessage {
            kind: Some(edge_message::Kind::Close(Default::default())),
        });
    }
}

impl Link for GrpcLink {
    fn send(&mut self, block: Block) -> Result<(), EdgeError> {
        self.out
            .send(EdgeMessage {
                kind: Some(edge_message::Kind::Draft((&block).into())),
            })
            .map_err(|_| EdgeError::LinkClosed)
    }

    fn ack(&mut self, committed: usize) -> Result<(), EdgeError> {
        self.out
            .send(EdgeMessage {
                kind: Some(edge_message::Kind::Ack(Ack {
                    committed: committed as u64,
                })),
            })
            .map_err(|_| EdgeError::LinkClosed)
    }

    fn reopen(&mut self, history: &[u32], max_tokens: usize) -> Result<u32, EdgeError> {
        let req = OpenRequest {
            prompt_ids: history.to_vec(),
            max_tokens: max_tokens as u32,
            ..self.req.clone()
        };
        let (fresh, opened) = Self::open(self.rt.clone(), &self.url, req)?;
        *self = fresh;
        Ok(opened.first_token)
    }

    fn recv(&mut self, wait: bool) -> Result<Option<Incoming>, EdgeError> {
        let item = if wait {
            self.verdicts.blocking_recv()
        } else {
            match self.verdicts.try_recv() {
                Ok(v) => Some(v),
                Err(tokio::sync::mpsc::error::TryRecvError::Empty) => return Ok(None),
                Err(_) => None,
            }
        };
        match item {
            Some(v) => v.map(Some),
            None => Err(EdgeError::LinkClosed),
        }
    }
}

/// Cloud-only generation (the baseline): the verifier decodes every token itself and streams them.
/// Calls `on_token` with each token as it arrives.
#[allow(clippy::too_many_arguments)]
pub fn generate_remote(
    rt: &Runtime,
    url: &str,
    api_key: Option<&str>,
    tokenizer_fingerprint: &str,
    prompt_ids: &[u32],
    params: SamplingParams,
    max_tokens: u32,
    mut on_token: impl FnMut(u32),
) -> Result<(), EdgeError> {
    rt.block_on(async {
        let mut client = VerifierClient::connect(url.to_string())
            .await
            .map_err(refused)?;
        let req = tandem_proto::v1::GenerateRequest {
            tokenizer_fingerprint: tokenizer_fingerprint.to_string(),
            prompt_ids: prompt_ids.to_vec(),
            params: Some(params.into()),
            max_tokens,
        };
        let mut stream = client
            .generate(authorized(req, api_key)?)
            .await
            .map_err(status)?
            .into_inner();
        while let Some(r) = stream.message().await.map_err(status)? {
            for t in r.tokens {
                on_token(t);
            }
            if r.done {
                break;
            }
        }
        Ok(())
    })
}
