//! A client that starts an HTTP request and never finishes its head (a slowloris), beside a
//! whole request on another connection: what a server's head deadline is tested with.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// Open a connection to `addr` and send the first bytes of a request head (`GET /`), then, on a
/// second connection, the whole `GET path` (`Connection: close`) and read its answer; then wait up to
/// `wait` for the server to close the first. Returns the whole request's answer (as text).
/// Panics unless the server closed the slow connection within `wait`, sending nothing or a 408.
pub fn slow_head_is_cut_and_a_request_is_answered(
    addr: SocketAddr,
    path: &str,
    wait: Duration,
) -> String {
    let mut slow = TcpStream::connect(addr).expect("connect the slow client");
    slow.set_read_timeout(Some(wait)).unwrap();
    slow.write_all(&b"GET /"[..])
        .expect("send the head's first bytes");
    let mut ok = TcpStream::connect(addr).expect("connect the whole request");
    write!(
        ok,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut answer = String::new();
    ok.read_to_string(&mut answer).expect("read the answer");
    // Closed by the server: end of stream (after a 408 or nothing), or a reset.
    let mut rest = Vec::new();
    let closed = slow.read_to_end(&mut rest);
    assert!(
        closed.is_ok()
            || closed
                .as_ref()
                .is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionReset),
        "the slow client's connection was not closed within {wait:?}: {closed:?}"
    );
    let text = String::from_utf8_lossy(&rest);
    assert!(
        rest.is_empty() || text.starts_with("HTTP/1.1 408"),
        "{text}"
    );
    answer
}
