//! Session ids that reveal nothing: the n-th session opened gets `permute(n)`, a keyed
//! permutation of 64-bit numbers (a four-round Feistel network whose round function is SHA-256
//! under a key drawn from the OS at start-up). Distinct counters give distinct ids, so ids never
//! collide, while neither their order nor their differences tell how many sessions the verifier
//! has served.

use sha2::{Digest, Sha256};

/// A keyed permutation of the u64s; 0 is never an id (it means "no session" on the wire).
pub struct SessionIds {
    key: [u8; 32],
    next: std::sync::atomic::AtomicU64,
}

impl SessionIds {
    /// A fresh key from the operating system's generator.
    pub fn new() -> Self {
        let mut key = [0u8; 32];
        getrandom::fill(&mut key).expect("the operating system's random generator");
        Self::with_key(key)
    }

    pub fn with_key(key: [u8; 32]) -> Self {
        Self {
            key,
            next: std::sync::atomic::AtomicU64::new(0),
        }
    }

    fn round(&self, r: u8, half: u32) -> u32 {
        let mut h = Sha256::new();
        h.update(self.key);
        h.update([r]);
        h.update(half.to_le_bytes());
        let d = h.finalize();
        u32::from_le_bytes([d[0], d[1], d[2], d[3]])
    }

    /// The permutation.
    pub fn permute(&self, n: u64) -> u64 {
        let (mut l, mut r) = ((n >> 32) as u32, n as u32);
        for i in 0..4 {
            let f = self.round(i, r);
            (l, r) = (r, l ^ f);
        }
        ((l as u64) << 32) | r as u64
    }

    /// The next session's id.
    pub fn next(&self) -> u64 {
        loop {
            let n = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let id = self.permute(n);
            if id != 0 {
                return id;
            }
        }
    }
}

impl Default for SessionIds {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_distinct_and_say_nothing_of_the_count() {
        let ids = SessionIds::with_key([7; 32]);
        let v: Vec<u64> = (0..100_000).map(|_| ids.next()).collect();
        let set: std::collections::HashSet<u64> = v.iter().copied().collect();
        assert_eq!(set.len(), v.len(), "no two sessions share an id");
        assert!(!v.contains(&0));
        // Neither sequential nor a constant stride; about half of the bits differ.
        let diffs: std::collections::HashSet<u64> =
            v.windows(2).map(|w| w[1].wrapping_sub(w[0])).collect();
        assert!(diffs.len() > 99_000, "{} distinct steps", diffs.len());
        let flipped: u32 = v.windows(2).map(|w| (w[0] ^ w[1]).count_ones()).sum();
        let mean = flipped as f64 / (v.len() - 1) as f64;
        assert!((28.0..36.0).contains(&mean), "{mean} bits flip per step");
        // Another key, other ids.
        let other = SessionIds::with_key([8; 32]);
        assert_ne!(other.permute(0), ids.permute(0));
    }
}
