//! Servers on loopback ports, and the runtime the tests' clients run on.

/// Run `serve` on a fresh loopback listener, in a thread with its own runtime; returns the address.
pub fn on_loopback<F, Fut>(serve: F) -> std::net::SocketAddr
where
    F: FnOnce(tokio::net::TcpListener) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()>,
{
    let (addr_tx, addr_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            addr_tx.send(l.local_addr().unwrap()).unwrap();
            serve(l).await;
        });
    });
    addr_rx.recv().unwrap()
}

/// A tokio runtime with one worker, for a test's clients.
pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap()
}
