//! Serving the gRPC service: the transport's limits and keepalive, TLS, the health service, and
//! the drain on shutdown.

use std::sync::atomic::Ordering;
use std::time::Duration;

use tandem_proto::v1::verifier_server::VerifierServer;

use super::{ask, Service, KEEPALIVE, MAX_STREAMS_PER_CONNECTION};
use crate::ToCloud;

/// A verifier's TLS identity: its certificate chain and its private key, PEM.
#[derive(Debug, Clone)]
pub struct ServerTls {
    pub cert_pem: Vec<u8>,
    pub key_pem: Vec<u8>,
}

impl ServerTls {
    /// Whether rustls takes the certificate and key (checked before a server starts, so that a
    /// bad file is refused at once and by name).
    pub fn check(&self) -> Result<(), String> {
        if let Some(why) = ca_as_its_own(&self.cert_pem) {
            return Err(why);
        }
        let id = tonic::transport::Identity::from_pem(&self.cert_pem, &self.key_pem);
        tonic::transport::Server::builder()
            .tls_config(tonic::transport::ServerTlsConfig::new().identity(id))
            .map(|_| ())
            .map_err(|e| {
                let mut s = e.to_string();
                let mut at = std::error::Error::source(&e);
                while let Some(c) = at {
                    s.push_str(&format!(": {c}"));
                    at = c.source();
                }
                s
            })
    }
}

/// Why the certificate `pem` (its first) cannot be a server's own: it is a CA certificate, as
/// `openssl req -x509` makes unless told otherwise, which every TLS client refuses as the
/// server's (rustls: `CaUsedAsEndEntity`). `None` when it is not, or cannot be read (rustls then
/// says why).
pub fn ca_as_its_own(pem: &[u8]) -> Option<String> {
    let (_, block) = x509_parser::pem::parse_x509_pem(pem).ok()?;
    let cert = block.parse_x509().ok()?;
    let ca = cert.basic_constraints().ok()??.value.ca;
    ca.then(|| {
        "the certificate is a CA certificate (basicConstraints CA:TRUE, what `openssl req -x509` \
         makes unless told otherwise), and TLS clients refuse a CA as the server's own \
         certificate (rustls: CaUsedAsEndEntity): every edge would fail to connect. Make one that \
         is not: `openssl req -x509 -newkey rsa:2048 -nodes -keyout key.pem -out cert.pem -subj \
         /CN=localhost -addext subjectAltName=DNS:localhost,IP:127.0.0.1 -addext \
         basicConstraints=critical,CA:FALSE` and give the edges cert.pem as --tls-ca; or a CA and \
         a server certificate it signs"
            .to_string()
    })
}

/// [`serve_grpc_tls`] in plaintext (loopback, or behind a proxy that terminates TLS).
pub async fn serve_grpc(
    service: Service,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send,
    drain_timeout: Duration,
) -> Result<(), tonic::transport::Error> {
    serve_grpc_tls(service, listener, shutdown, drain_timeout, None, None).await
}

/// Serve `service` on `listener` with the standard gRPC health service (`grpc.health.v1.Health`:
/// `""` and `tandem.v1.Verifier` SERVING), over TLS (rustls) when `tls` is given. When
/// `shutdown` resolves it drains: health turns NOT_SERVING, new sessions are refused with
/// UNAVAILABLE, open ones run until they end or `drain_timeout` passes (then their streams end
/// with UNAVAILABLE), and the server stops. A certificate or key that does not parse is an error
/// before anything is served.
///
/// With `health`, the same health service is served there too, in plaintext and alone (for
/// probes that cannot speak TLS, such as Kubernetes' gRPC probes), with one more service name,
/// [`LIVENESS`], SERVING for as long as the process serves (a drain does not turn it: a
/// draining verifier is alive, only not ready).
pub async fn serve_grpc_tls(
    service: Service,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send,
    drain_timeout: Duration,
    tls: Option<&ServerTls>,
    health_listener: Option<tokio::net::TcpListener>,
) -> Result<(), tonic::transport::Error> {
    // The builder's TCP options do not reach connections accepted from a listener of our own:
    // they are set on the incoming stream (`incoming`).
    let mut builder = tonic::transport::Server::builder()
        .max_concurrent_streams(Some(MAX_STREAMS_PER_CONNECTION))
        .http2_keepalive_interval(Some(KEEPALIVE))
        .http2_keepalive_timeout(Some(KEEPALIVE));
    if let Some(t) = tls {
        let id = tonic::transport::Identity::from_pem(&t.cert_pem, &t.key_pem);
        builder = builder.tls_config(tonic::transport::ServerTlsConfig::new().identity(id))?;
    }
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter.set_serving::<VerifierServer<Service>>().await;
    reporter
        .set_service_status("", tonic_health::ServingStatus::Serving)
        .await;
    reporter
        .set_service_status(LIVENESS, tonic_health::ServingStatus::Serving)
        .await;
    if let Some(l) = health_listener {
        let probes = tonic::transport::Server::builder()
            .add_service(health.clone())
            .serve_with_incoming(incoming(l));
        tokio::spawn(async move {
            if let Err(e) = probes.await {
                tracing::error!("the health listener stopped: {e}");
            }
        });
    }
    let (draining, batcher) = (service.draining.clone(), service.batcher.clone());
    let (drained_tx, drained_rx) = tokio::sync::oneshot::channel::<()>();
    let drain = async move {
        shutdown.await;
        draining.store(true, Ordering::Relaxed);
        reporter.set_not_serving::<VerifierServer<Service>>().await;
        reporter
            .set_service_status("", tonic_health::ServingStatus::NotServing)
            .await;
        let deadline = tokio::time::Instant::now() + drain_timeout;
        // The core stops admitting with the first Drain; its answer counts what is still open
        // after it, so no session can slip in between the count and the shut-down.
        loop {
            match ask(&batcher, |reply| ToCloud::Drain { reply }).await {
                Ok(0) | Err(_) => break,
                Ok(_) if tokio::time::Instant::now() >= deadline => {
                    let _ = ask(&batcher, |reply| ToCloud::ShutDown {
                        reply: Box::new(move || reply(())),
                    })
                    .await;
                    break;
                }
                Ok(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
        tracing::info!("drained");
        let _ = drained_tx.send(());
    };
    let server = builder
        .add_service(health)
        .add_service(service.into_server())
        .serve_with_incoming_shutdown(incoming(listener), drain);
    // Once drained, connections get a moment to flush their last messages; one whose client does
    // not read (its stream can never finish) does not hold the shutdown past it.
    tokio::select! {
        r = server => r,
        _ = async {
            if drained_rx.await.is_ok() {
                tokio::time::sleep(DRAIN_GRACE).await;
            } else {
                std::future::pending::<()>().await;
            }
        } => {
            tracing::warn!(
                "connections still open {} ms after the drain: closing them",
                DRAIN_GRACE.as_millis()
            );
            Ok(())
        }
    }
}

/// The connections `listener` accepts, with TCP_NODELAY (a committed token goes out when it
/// is written: with Nagle's algorithm a token written while the last one's segment waits for a
/// delayed ACK waited for it, up to 40 ms, each time the edge's own messages put that ACK in
/// its interactive mode) and TCP keepalive (30 s).
fn incoming(listener: tokio::net::TcpListener) -> tonic::transport::server::TcpIncoming {
    tonic::transport::server::TcpIncoming::from(listener)
        .with_nodelay(Some(true))
        .with_keepalive(Some(Duration::from_secs(30)))
}

/// The health service name that stays SERVING while the process serves, draining or not (a
/// liveness probe's; readiness asks for `""` or `tandem.v1.Verifier`, which a drain turns).
pub const LIVENESS: &str = "liveness";

/// How long connections may take to flush after the drain before the server closes them.
pub const DRAIN_GRACE: Duration = Duration::from_secs(1);

#[cfg(test)]
mod tests {
    use tokio_stream::StreamExt;

    #[tokio::test]
    async fn accepted_connections_send_each_message_at_once() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut incoming = super::incoming(listener);
        let _client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let accepted = incoming.next().await.unwrap().unwrap();
        assert!(
            accepted.nodelay().unwrap(),
            "TCP_NODELAY on the verifier's side"
        );
    }
}
