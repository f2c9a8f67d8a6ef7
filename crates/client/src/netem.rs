//! A loopback TCP proxy that emulates a network link: each direction delays every chunk by half the
//! round trip plus jitter (order kept, as TCP keeps it), spaces chunks by the bandwidth, and turns
//! loss into the delay of a retransmission (one more round trip), since a TCP stream cannot lose
//! bytes. Real sockets, real gRPC on top: `tandem netem`, and tests and benchmarks as a library.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc::unbounded_channel;
use tokio::time::Instant;

/// The link a [`proxy`] emulates; the flags of `tandem netem`, checked by
/// [`NetemConfig::validate`].
#[derive(Debug, Clone, Copy, PartialEq, clap::Args)]
pub struct NetemConfig {
    /// Round trip added to the link, ms.
    #[arg(long, default_value_t = 0.0)]
    pub rtt_ms: f64,
    /// Uniform jitter in ±jitter_ms per direction, per chunk.
    #[arg(long, default_value_t = 0.0)]
    pub jitter_ms: f64,
    /// Bandwidth, kbit/s; 0 means unlimited.
    #[arg(long, default_value_t = 0.0)]
    pub bandwidth_kbit: f64,
    /// Chance that a chunk needs a retransmission (costs one more round trip), %.
    #[arg(long, default_value_t = 0.0)]
    pub loss_pct: f64,
    /// Seed of the jitter and loss draws.
    #[arg(skip = 1u64)]
    pub seed: u64,
}

impl Default for NetemConfig {
    fn default() -> Self {
        Self {
            rtt_ms: 0.0,
            jitter_ms: 0.0,
            bandwidth_kbit: 0.0,
            loss_pct: 0.0,
            seed: 1,
        }
    }
}

impl NetemConfig {
    pub fn validate(&self) -> Result<(), String> {
        let ok = |x: f64| x.is_finite() && x >= 0.0;
        if !ok(self.rtt_ms) {
            return Err(format!("rtt_ms must be ≥ 0, got {}", self.rtt_ms));
        }
        if !ok(self.jitter_ms) || self.jitter_ms > self.rtt_ms / 2.0 + 1e-9 {
            return Err(format!(
                "jitter_ms must be in [0, rtt_ms/2], got {}",
                self.jitter_ms
            ));
        }
        if !ok(self.bandwidth_kbit) {
            return Err(format!(
                "bandwidth_kbit must be ≥ 0, got {}",
                self.bandwidth_kbit
            ));
        }
        if !(ok(self.loss_pct) && self.loss_pct < 100.0) {
            return Err(format!(
                "loss_pct must be in [0, 100), got {}",
                self.loss_pct
            ));
        }
        Ok(())
    }
}

/// xorshift64*: the proxy's own deterministic jitter and loss draws.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// One direction: read chunks, release each at its due time, in order.
async fn pump(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, cfg: NetemConfig, seed: u64) {
    let (tx, mut rx) = unbounded_channel::<(Instant, Vec<u8>)>();
    let writer = tokio::spawn(async move {
        while let Some((at, chunk)) = rx.recv().await {
            tokio::time::sleep_until(at).await;
            if to.write_all(&chunk).await.is_err() {
                break;
            }
        }
        let _ = to.shutdown().await;
    });
    let mut rng = Rng(seed | 1);
    let mut last = Instant::now();
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let mut delay = cfg.rtt_ms / 2.0 + (rng.next() * 2.0 - 1.0) * cfg.jitter_ms;
        if rng.next() * 100.0 < cfg.loss_pct {
            delay += cfg.rtt_ms;
        }
        let mut at = Instant::now() + Duration::from_secs_f64(delay.max(0.0) / 1e3);
        if cfg.bandwidth_kbit > 0.0 {
            let wire = Duration::from_secs_f64(n as f64 * 8.0 / (cfg.bandwidth_kbit * 1e3));
            at = at.max(last + wire);
        }
        at = at.max(last); // a stream keeps its order
        last = at;
        if tx.send((at, buf[..n].to_vec())).is_err() {
            break;
        }
    }
    drop(tx);
    let _ = writer.await;
}

/// Accept connections on `listener` and relay each to `upstream` through the emulated link, until
/// the task is dropped.
/// Start a proxy with `cfg` in front of `upstream` on a fresh loopback port, on `rt`; returns its
/// `http://` URL and the task (abort it to stop the link).
pub fn spawn_front(
    rt: &tokio::runtime::Handle,
    upstream: SocketAddr,
    cfg: NetemConfig,
) -> Result<(String, tokio::task::JoinHandle<()>), String> {
    cfg.validate()?;
    let listener = rt
        .block_on(TcpListener::bind("127.0.0.1:0"))
        .map_err(|e| format!("binding the emulated link: {e}"))?;
    let addr = listener
        .local_addr()
        .map_err(|e| format!("binding the emulated link: {e}"))?;
    let task = rt.spawn(async move {
        if let Err(e) = proxy(listener, upstream, cfg).await {
            tracing::warn!("netem proxy stopped: {e}");
        }
    });
    Ok((format!("http://{addr}"), task))
}

/// The socket address behind an `http://host:port` URL.
pub fn resolve(url: &str) -> Result<SocketAddr, String> {
    use std::net::ToSocketAddrs;
    let hostport = url
        .trim_start_matches("http://")
        .trim_start_matches("https://")
        .trim_end_matches('/');
    hostport
        .to_socket_addrs()
        .map_err(|e| format!("{url}: {e}"))?
        .next()
        .ok_or_else(|| format!("{url}: resolves to no address"))
}

pub async fn proxy(
    listener: TcpListener,
    upstream: SocketAddr,
    cfg: NetemConfig,
) -> std::io::Result<()> {
    let mut conn = 0u64;
    loop {
        let (client, _) = listener.accept().await?;
        conn += 1;
        let seed = cfg.seed.wrapping_mul(0x9e37_79b9).wrapping_add(conn);
        tokio::spawn(async move {
            let Ok(server) = TcpStream::connect(upstream).await else {
                return;
            };
            let _ = client.set_nodelay(true);
            let _ = server.set_nodelay(true);
            let (cr, cw) = client.into_split();
            let (sr, sw) = server.into_split();
            let up = tokio::spawn(pump(cr, sw, cfg, seed));
            let down = tokio::spawn(pump(sr, cw, cfg, seed ^ 0xabcd));
            let _ = tokio::join!(up, down);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_settings_are_named() {
        let c = NetemConfig {
            rtt_ms: 10.0,
            jitter_ms: 20.0,
            ..NetemConfig::default()
        };
        assert!(c.validate().unwrap_err().contains("jitter_ms"));
        let c = NetemConfig {
            loss_pct: 100.0,
            ..NetemConfig::default()
        };
        assert!(c.validate().unwrap_err().contains("loss_pct"));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn echo_round_trip_takes_the_rtt() {
        // An echo server behind the proxy: one request/response costs about one round trip.
        let echo = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let echo_addr = echo.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = echo.accept().await.unwrap();
            let mut b = [0u8; 4];
            while s.read_exact(&mut b).await.is_ok() {
                s.write_all(&b).await.unwrap();
            }
        });
        let front = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let front_addr = front.local_addr().unwrap();
        let cfg = NetemConfig {
            rtt_ms: 80.0,
            jitter_ms: 5.0,
            ..NetemConfig::default()
        };
        tokio::spawn(proxy(front, echo_addr, cfg));
        let mut c = TcpStream::connect(front_addr).await.unwrap();
        for i in 0..3u32 {
            let t = Instant::now();
            c.write_all(&i.to_le_bytes()).await.unwrap();
            let mut b = [0u8; 4];
            c.read_exact(&mut b).await.unwrap();
            assert_eq!(u32::from_le_bytes(b), i);
            let ms = t.elapsed().as_secs_f64() * 1e3;
            // The delay line holds each byte for the round trip less the jitter at least; how much
            // longer a busy machine takes is for `bench latency` to measure, not a test.
            assert!(ms >= 70.0, "round trip {ms} ms");
        }
    }
}
