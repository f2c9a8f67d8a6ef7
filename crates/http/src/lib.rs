//! Tandem's HTTP/1.1 connections (`tandem serve`'s API, the verifier's `/metrics`): what
//! `axum::serve` does, plus a deadline on each request's head. `axum::serve` gives hyper no
//! timer, so hyper's header-read timeout never applies and a client that sends its headers a
//! byte a second holds its connection (a socket, a task) for as long as it likes; enough of them
//! run the process out of file descriptors.

use std::future::Future;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::task::JoinSet;

/// How long a client may take to send a request's head, from the moment its connection waits
/// for one (a new connection, or a kept-alive one between requests: an idle kept-alive
/// connection is closed after it too, as hyper times it). Hyper's own default.
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(30);

/// Serve `app` on `listener` until `shutdown`; then stop accepting, let each connection finish
/// the request it is answering, and return when all have closed. Each connection sends what it
/// writes at once (TCP_NODELAY: an SSE chunk is one token's text) and is closed when a
/// request's head takes longer than `head_timeout`.
pub async fn serve_http(
    listener: TcpListener,
    app: Router,
    shutdown: impl Future<Output = ()> + Send,
    head_timeout: Duration,
) -> std::io::Result<()> {
    let (closing_tx, closing) = tokio::sync::watch::channel(false);
    let mut conns = JoinSet::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let tcp = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((tcp, _)) => tcp,
                Err(e) => {
                    // Out of file descriptors and the like: wait a little rather than spin.
                    tracing::debug!("accepting a client's connection: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!("TCP_NODELAY not set on a client's connection: {e}");
        }
        let service = TowerToHyperService::new(app.clone());
        let mut closing = closing.clone();
        conns.spawn(async move {
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(head_timeout)
                .serve_connection(TokioIo::new(tcp), service)
                .with_upgrades();
            let mut conn = std::pin::pin!(conn);
            tokio::select! {
                r = conn.as_mut() => {
                    if let Err(e) = r {
                        tracing::trace!("a client's connection ended: {e}");
                    }
                    return;
                }
                _ = closing.wait_for(|c| *c) => conn.as_mut().graceful_shutdown(),
            }
            if let Err(e) = conn.await {
                tracing::trace!("a client's connection ended: {e}");
            }
        });
        // Those that have ended leave the set.
        while conns.try_join_next().is_some() {}
    }
    drop(listener);
    let _ = closing_tx.send(true);
    while conns.join_next().await.is_some() {}
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::get;

    #[test]
    fn a_request_head_that_comes_too_slowly_loses_its_connection_and_others_are_served() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let listener = rt.block_on(TcpListener::bind("127.0.0.1:0")).unwrap();
        let addr = listener.local_addr().unwrap();
        let app = Router::new().route("/", get(|| async { "hello" }));
        let (stop_tx, stop) = tokio::sync::oneshot::channel::<()>();
        let server = rt.spawn(serve_http(
            listener,
            app,
            async {
                let _ = stop.await;
            },
            Duration::from_millis(500),
        ));
        // Closed well before a client sending its head at a byte a second could finish it.
        let answer = tandem_testkit::slow_head_is_cut_and_a_request_is_answered(
            addr,
            "/",
            Duration::from_secs(20),
        );
        assert!(
            answer.starts_with("HTTP/1.1 200") && answer.ends_with("hello"),
            "{answer}"
        );
        let _ = stop_tx.send(());
        rt.block_on(server).unwrap().unwrap();
    }
}
