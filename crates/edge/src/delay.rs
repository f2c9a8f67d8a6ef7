//! An in-process delay line: messages arrive `one_way` after they were sent, in order, like one
//! direction of a network link. Used to emulate round-trip times without sockets (the TCP proxy for
//! real gRPC comes with the protocol).

use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::thread;
use std::time::{Duration, Instant};

/// A sender whose messages reach the returned receiver `one_way` later.
pub fn delay_channel<T: Send + 'static>(one_way: Duration) -> (Sender<T>, Receiver<T>) {
    let (tx, rx_in) = channel::<T>();
    if one_way.is_zero() {
        return (tx, rx_in);
    }
    let (tx_out, rx) = channel::<T>();
    let (stamp_tx, stamp_rx) = channel::<(Instant, T)>();
    // Stamp at send time: a first thread takes messages as they come, a second releases them.
    thread::Builder::new()
        .name("tandem-delay-in".into())
        .spawn(move || {
            for m in rx_in {
                if stamp_tx.send((Instant::now() + one_way, m)).is_err() {
                    break;
                }
            }
        })
        .expect("invariant: thread spawn");
    thread::Builder::new()
        .name("tandem-delay-out".into())
        .spawn(move || loop {
            match stamp_rx.recv_timeout(Duration::from_secs(3600)) {
                Ok((at, m)) => {
                    let now = Instant::now();
                    if at > now {
                        thread::sleep(at - now);
                    }
                    if tx_out.send(m).is_err() {
                        break;
                    }
                }
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => break,
            }
        })
        .expect("invariant: thread spawn");
    (tx, rx)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_arrive_late_and_in_order() {
        let (tx, rx) = delay_channel::<u32>(Duration::from_millis(30));
        let t0 = Instant::now();
        for i in 0..5 {
            tx.send(i).unwrap();
        }
        let got: Vec<u32> = (0..5).map(|_| rx.recv().unwrap()).collect();
        assert_eq!(got, vec![0, 1, 2, 3, 4]);
        assert!(t0.elapsed() >= Duration::from_millis(30));
    }
}
