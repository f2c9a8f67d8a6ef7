//! The batcher's watchdog: a server whose batcher died stops, rather than answering every RPC
//! UNAVAILABLE while its health says SERVING.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Watch the batcher thread: the future resolves, with why, if it panics or ends while the server
/// is not draining (every RPC would fail while health said SERVING); it never resolves when the
/// batcher ends with a drain. The returned thread ends when the batcher has (join it to wait for
/// the batcher's last work: the ledger's flush).
pub fn batcher_failure<T: Send + 'static>(
    batcher: std::thread::JoinHandle<T>,
    draining: Arc<AtomicBool>,
) -> (
    impl std::future::Future<Output = String> + Send,
    std::thread::JoinHandle<()>,
) {
    let (tx, rx) = tokio::sync::oneshot::channel::<String>();
    let watcher = std::thread::spawn(move || {
        let why = match batcher.join() {
            Err(p) => {
                let m = p
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| p.downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                Some(format!("the batcher panicked: {m}"))
            }
            Ok(_) if !draining.load(Ordering::Relaxed) => {
                Some("the batcher stopped while serving".to_string())
            }
            Ok(_) => None,
        };
        if let Some(w) = why {
            tracing::error!("{w}");
            let _ = tx.send(w);
        }
    });
    let failed = async move {
        match rx.await {
            Ok(why) => why,
            Err(_) => std::future::pending().await,
        }
    };
    (failed, watcher)
}
