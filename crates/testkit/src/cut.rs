//! A dropped network that drops on an event, not on a clock: a TCP relay in front of a gRPC
//! server that severs its first connection once the server has sent a given number of gRPC
//! messages over it. A cut after N milliseconds is a test of how fast the machine is (on a fast
//! CPU the whole answer is done before it); a cut after the k-th message lands in the middle of
//! any answer that takes more than k messages, on every machine.
//!
//! It reads the server's side of the connection as HTTP/2 frames (cleartext, as the tests'
//! verifiers speak it) and each stream's DATA as gRPC's length-prefixed messages; the bytes pass
//! through unchanged.

use std::collections::HashMap;
use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A relay on a fresh loopback port to `upstream`: its first connection is cut (both sockets
/// closed) right after the chunk that carries the server's `after`-th gRPC message has been
/// passed on; later connections pass untouched.
pub fn cutting_relay(upstream: SocketAddr, after: usize) -> SocketAddr {
    crate::on_loopback(move |l| async move {
        let mut first = true;
        loop {
            let (mut client, _) = l.accept().await.expect("accepting on loopback");
            let cut = std::mem::take(&mut first);
            tokio::spawn(async move {
                let Ok(mut server) = tokio::net::TcpStream::connect(upstream).await else {
                    return;
                };
                if !cut {
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    return;
                }
                let (mut from_client, mut to_client) = client.into_split();
                let (mut from_server, mut to_server) = server.into_split();
                let up = tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut from_client, &mut to_server).await;
                });
                let mut count = GrpcMessages::default();
                let mut buf = vec![0u8; 16 << 10];
                loop {
                    let n = match from_server.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    };
                    if to_client.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                    if count.feed(&buf[..n]) >= after {
                        break;
                    }
                }
                // Dropping every half closes both connections: the dropped network.
                up.abort();
            });
        }
    })
}

/// Counts the gRPC messages in a server's side of an HTTP/2 connection, fed in arbitrary chunks.
#[derive(Default)]
struct GrpcMessages {
    /// Bytes of the frame being read (header and payload), until it is whole.
    frame: Vec<u8>,
    /// Each stream's DATA not yet a whole message.
    streams: HashMap<u32, Vec<u8>>,
    messages: usize,
}

impl GrpcMessages {
    /// Takes the next bytes; returns how many whole messages were seen so far.
    fn feed(&mut self, mut bytes: &[u8]) -> usize {
        while !bytes.is_empty() {
            let need = if self.frame.len() < 9 {
                9 - self.frame.len()
            } else {
                9 + frame_len(&self.frame) - self.frame.len()
            };
            let take = need.min(bytes.len());
            self.frame.extend_from_slice(&bytes[..take]);
            bytes = &bytes[take..];
            if self.frame.len() >= 9 && self.frame.len() == 9 + frame_len(&self.frame) {
                self.frame_done();
            }
        }
        self.messages
    }

    fn frame_done(&mut self) {
        let frame = std::mem::take(&mut self.frame);
        let (kind, flags) = (frame[3], frame[4]);
        let stream = u32::from_be_bytes([frame[5], frame[6], frame[7], frame[8]]) & 0x7fff_ffff;
        const DATA: u8 = 0;
        const PADDED: u8 = 0x8;
        if kind != DATA {
            return;
        }
        let mut payload = &frame[9..];
        if flags & PADDED != 0 && !payload.is_empty() {
            let pad = payload[0] as usize;
            payload = &payload[1..payload.len().saturating_sub(pad).max(1)];
        }
        let buf = self.streams.entry(stream).or_default();
        buf.extend_from_slice(payload);
        // A gRPC message: a compression flag, a 4-byte big-endian length, the message.
        while buf.len() >= 5 {
            let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
            if buf.len() < 5 + len {
                break;
            }
            buf.drain(..5 + len);
            self.messages += 1;
        }
    }
}

fn frame_len(header: &[u8]) -> usize {
    (header[0] as usize) << 16 | (header[1] as usize) << 8 | header[2] as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(kind: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let n = payload.len();
        let mut f = vec![(n >> 16) as u8, (n >> 8) as u8, n as u8, kind, 0];
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    fn message(body: &[u8]) -> Vec<u8> {
        let mut m = vec![0];
        m.extend_from_slice(&(body.len() as u32).to_be_bytes());
        m.extend_from_slice(body);
        m
    }

    #[test]
    fn messages_are_counted_across_frames_chunks_and_streams() {
        let settings = frame(4, 0, &[0; 6]);
        let (a, b, c) = (message(b"opened"), message(b""), message(&[7; 300]));
        // Two messages in one DATA frame; one split over two frames; another stream between.
        let mut two = a.clone();
        two.extend_from_slice(&b);
        let mut wire = settings;
        wire.extend(frame(0, 1, &two));
        wire.extend(frame(0, 1, &c[..100]));
        wire.extend(frame(1, 3, &[0; 12]));
        wire.extend(frame(0, 3, &message(b"other")));
        wire.extend(frame(0, 1, &c[100..]));
        let mut seen = Vec::new();
        let mut m = GrpcMessages::default();
        for chunk in wire.chunks(7) {
            seen.push(m.feed(chunk));
        }
        assert_eq!(*seen.last().unwrap(), 4);
        assert!(seen.windows(2).all(|w| w[0] <= w[1]));
        // The split message counts only once its last byte came.
        let mut m = GrpcMessages::default();
        let cut = wire.len() - 1;
        assert_eq!(m.feed(&wire[..cut]), 3);
        assert_eq!(m.feed(&wire[cut..]), 4);
    }
}
