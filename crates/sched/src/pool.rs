//! Fixed-size KV pages: allocate, share, free, truncate. This is Tandem's one KV allocator: the
//! scheduler owns one for the verifier's sessions (the engine stores K and V in the pages it
//! hands out), and an engine that runs its own sequences (the edge's draft, tests, calibration)
//! keeps one keyed by its sequence ids. (The flags, metrics and wire fields keep their older
//! name, KV *blocks*: `--max-kv-blocks`, `kv_blocks_used`; in the code a *block* is a draft block.)
//!
//! **The prefix cache.** A page whose every slot holds final content (committed tokens) may be
//! *published* under its content address, a [`PageHash`] chained over a salt and every token up
//! to the page's end. A new owner whose tokens have the same addresses *attaches* those pages
//! instead of computing them again. Pages are counted by their holders: a page is *empty* (free),
//! *held* by one owner or more, or *cached* (published, held by none); cached pages are taken
//! back, least recently let go first, only when no empty page is left. A held page that another
//! owner also holds, or that is published, is never written: [`PagePool::truncate`] does not keep
//! one that the owner would write into, and [`PagePool::writable`] lets a caller check its writes.

use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;

use sha2::{Digest, Sha256};

use crate::{SchedError, SessionId};

/// A page's content address: SHA-256 (first 128 bits) chained over a salt and the tokens of every
/// page up to and including this one. Two owners share a page only when their salts and all
/// those tokens are equal (a collision would need two 128-bit digests to agree).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PageHash(pub u128);

impl PageHash {
    /// The address of the page holding `tokens` after the page addressed `prev` (None: the first
    /// page, seeded by `salt`).
    pub fn next(prev: Option<PageHash>, salt: u64, tokens: &[u32]) -> PageHash {
        let mut h = Sha256::new();
        match prev {
            None => {
                h.update(b"tandem kv page\0");
                h.update(salt.to_le_bytes());
            }
            Some(p) => h.update(p.0.to_le_bytes()),
        }
        for t in tokens {
            h.update(t.to_le_bytes());
        }
        let d = h.finalize();
        PageHash(u128::from_le_bytes(
            d[..16].try_into().expect("a digest has 32 bytes"),
        ))
    }

    /// Extend `chain` (the addresses of `tokens`' first pages) to every full page of `tokens`.
    pub fn extend_chain(chain: &mut Vec<PageHash>, salt: u64, page_size: usize, tokens: &[u32]) {
        for page in tokens.chunks_exact(page_size).skip(chain.len()) {
            let h = PageHash::next(chain.last().copied(), salt, page);
            chain.push(h);
        }
    }
}

/// What the prefix cache did, in pages.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct CacheCounts {
    /// Pages attached from the cache instead of computed.
    pub hits: u64,
    /// Pages published.
    pub published: u64,
    /// Cached pages taken back for new content.
    pub evictions: u64,
}

/// Pages of `page_size` token slots, each empty, held by owners `K`, or cached. See the module
/// docs.
#[derive(Debug, Clone)]
pub struct PagePool<K = SessionId> {
    page_size: usize,
    num_pages: usize,
    /// Empty pages (no holder, no content address).
    free: Vec<u32>,
    owned: HashMap<K, Vec<u32>>,
    /// Each page's holders, in the order they took it; the first is charged for it.
    holders: Vec<Vec<K>>,
    /// Each published page's address, and the page at each address.
    address: Vec<Option<PageHash>>,
    index: HashMap<PageHash, u32>,
    /// Cached pages no one holds, by when they were let go (oldest first), and each one's key.
    unheld: BTreeMap<u64, u32>,
    let_go: Vec<u64>,
    clock: u64,
    counts: CacheCounts,
}

impl<K: Copy + Eq + Hash> PagePool<K> {
    pub fn new(num_pages: usize, page_size: usize) -> Result<Self, SchedError> {
        if num_pages == 0 || page_size == 0 {
            return Err(SchedError::InvalidConfig(
                "the KV page pool needs at least one page of at least one token".into(),
            ));
        }
        Ok(Self {
            page_size,
            num_pages,
            // Popped from the end: low ids first.
            free: (0..num_pages as u32).rev().collect(),
            owned: HashMap::new(),
            holders: vec![Vec::new(); num_pages],
            address: vec![None; num_pages],
            index: HashMap::new(),
            unheld: BTreeMap::new(),
            let_go: vec![0; num_pages],
            clock: 0,
            counts: CacheCounts::default(),
        })
    }

    pub fn page_size(&self) -> usize {
        self.page_size
    }
    pub fn num_pages(&self) -> usize {
        self.num_pages
    }
    /// Pages a grow may take: empty ones, and cached ones no one holds (taken back least
    /// recently let go first).
    pub fn num_free(&self) -> usize {
        self.free.len() + self.unheld.len()
    }
    /// Cached pages no one holds.
    pub fn num_cached_unheld(&self) -> usize {
        self.unheld.len()
    }
    pub fn counts(&self) -> CacheCounts {
        self.counts
    }
    /// Pages needed to hold `tokens` token slots.
    pub fn pages_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.page_size)
    }
    pub fn table(&self, s: K) -> &[u32] {
        self.owned.get(&s).map_or(&[], |v| v)
    }
    pub fn held(&self, s: K) -> usize {
        self.table(s).len()
    }
    /// Pages `s` is charged for: those it holds and took first of their holders now (a shared
    /// page counts once, against its earliest holder).
    pub fn charged(&self, s: K) -> usize {
        self.table(s)
            .iter()
            .filter(|&&p| self.holders[p as usize].first() == Some(&s))
            .count()
    }
    /// Extra pages `s` needs to hold `tokens` slots.
    pub fn shortfall(&self, s: K, tokens: usize) -> usize {
        self.pages_for(tokens).saturating_sub(self.held(s))
    }

    /// Grow `s` to hold `tokens` slots; all or nothing.
    pub fn grow(&mut self, s: K, tokens: usize) -> Result<(), SchedError> {
        self.grow_all(&[(s, tokens)])
    }

    /// Grow every `(owner, tokens)` to hold `tokens` slots, all or nothing: when the pool cannot
    /// hold them all, nothing changes and `OutOfBlocks` says how many pages were missing. An
    /// owner named twice is grown to the larger size. Empty pages go first, then cached pages no
    /// one holds, least recently let go first.
    pub fn grow_all(&mut self, plan: &[(K, usize)]) -> Result<(), SchedError> {
        // In the batch's order, so that page ids are handed out deterministically.
        let mut at: HashMap<K, usize> = HashMap::new();
        let mut want: Vec<(K, usize)> = Vec::with_capacity(plan.len());
        for &(s, tokens) in plan {
            match at.get(&s) {
                Some(&i) => want[i].1 = want[i].1.max(tokens),
                None => {
                    at.insert(s, want.len());
                    want.push((s, tokens));
                }
            }
        }
        let needed: usize = want.iter().map(|&(s, t)| self.shortfall(s, t)).sum();
        if needed > self.num_free() {
            return Err(SchedError::OutOfBlocks {
                needed,
                free: self.num_free(),
            });
        }
        for (s, tokens) in want {
            let need = self.shortfall(s, tokens);
            if need == 0 {
                continue;
            }
            let new: Vec<u32> = (0..need).map(|_| self.take(s)).collect();
            self.owned.entry(s).or_default().extend(new);
        }
        Ok(())
    }

    /// An empty page, or else the cached page let go the longest ago, now held by `s` alone.
    fn take(&mut self, s: K) -> u32 {
        let p = match self.free.pop() {
            Some(p) => p,
            None => {
                let (_, p) = self
                    .unheld
                    .pop_first()
                    .expect("invariant: grow checked num_free");
                let h = self.address[p as usize]
                    .take()
                    .expect("invariant: a cached page is published");
                self.index.remove(&h);
                self.counts.evictions += 1;
                p
            }
        };
        self.holders[p as usize] = vec![s];
        p
    }

    /// `s` lets go of page `p`: it goes back empty, or stays cached when published and no one
    /// else holds it.
    fn release(&mut self, s: K, p: u32) {
        let h = &mut self.holders[p as usize];
        if let Some(i) = h.iter().position(|&o| o == s) {
            h.remove(i);
        }
        if h.is_empty() {
            if self.address[p as usize].is_some() {
                self.clock += 1;
                self.let_go[p as usize] = self.clock;
                self.unheld.insert(self.clock, p);
            } else {
                self.free.push(p);
            }
        }
    }

    /// Keep only the pages `s` needs for `tokens` slots, and answer how many slots it keeps: a
    /// partly kept page is one `s` will write into, so when another owner holds it too it is let
    /// go as well (the slots before it are all that is kept, and the owner computes the rest
    /// again), and when `s` alone holds it published, it is no longer published.
    pub fn truncate(&mut self, s: K, tokens: usize) -> usize {
        let mut keep = self.pages_for(tokens);
        let Some(mut t) = self.owned.remove(&s) else {
            return 0;
        };
        let mut kept = tokens.min(t.len() * self.page_size);
        if !tokens.is_multiple_of(self.page_size) && keep <= t.len() && keep > 0 {
            let p = t[keep - 1] as usize;
            if self.holders[p].len() > 1 {
                keep -= 1;
                kept = keep * self.page_size;
            } else if let Some(h) = self.address[p].take() {
                self.index.remove(&h);
            }
        }
        while t.len() > keep {
            let p = t.pop().expect("len > keep ≥ 0");
            self.release(s, p);
        }
        if !t.is_empty() {
            self.owned.insert(s, t);
        }
        kept
    }

    pub fn free_all(&mut self, s: K) {
        self.truncate(s, 0);
    }

    /// The longest run of published pages at the start of `chain`.
    pub fn lookup(&self, chain: &[PageHash]) -> Vec<u32> {
        chain
            .iter()
            .map_while(|h| self.index.get(h).copied())
            .collect()
    }

    /// `s`, which holds nothing, takes `pages` (published ones, from [`PagePool::lookup`]) as its
    /// first pages.
    pub fn attach(&mut self, s: K, pages: &[u32]) -> Result<(), SchedError> {
        if self.held(s) > 0 {
            return Err(SchedError::InvalidConfig(
                "cached pages can only start a table".into(),
            ));
        }
        if let Some(&p) = pages.iter().find(|&&p| {
            self.address
                .get(p as usize)
                .is_none_or(|a| a.is_none_or(|h| self.index.get(&h) != Some(&p)))
        }) {
            return Err(SchedError::InvalidConfig(format!(
                "page {p} is not a published page"
            )));
        }
        for &p in pages {
            let h = &mut self.holders[p as usize];
            if h.is_empty() {
                self.unheld.remove(&self.let_go[p as usize]);
            }
            h.push(s);
        }
        if !pages.is_empty() {
            self.owned.insert(s, pages.to_vec());
            self.counts.hits += pages.len() as u64;
        }
        Ok(())
    }

    /// Publish `s`'s page `i` (every slot of which holds final content) at `address`. Nothing
    /// changes when the page is published already, or another page is published at that address
    /// (this one stays private to `s`). Whether it was published now.
    pub fn publish(&mut self, s: K, i: usize, address: PageHash) -> bool {
        let Some(&p) = self.table(s).get(i) else {
            return false;
        };
        if self.address[p as usize].is_some() || self.index.contains_key(&address) {
            return false;
        }
        self.address[p as usize] = Some(address);
        self.index.insert(address, p);
        self.counts.published += 1;
        true
    }

    /// Whether `s` may write slots `start..end` of its table: every page they fall in is held by
    /// `s` alone and not published.
    pub fn writable(&self, s: K, start: usize, end: usize) -> bool {
        if end <= start {
            return true;
        }
        let t = self.table(s);
        (start / self.page_size..end.div_ceil(self.page_size)).all(|i| {
            t.get(i).is_none_or(|&p| {
                self.holders[p as usize].len() == 1 && self.address[p as usize].is_none()
            })
        })
    }

    /// Every page is empty, cached or held, exactly as its records say; every holder's table
    /// names it once per holding; the index and the addresses agree (for tests).
    pub fn conserved(&self) -> bool {
        let mut seen = vec![0usize; self.num_pages];
        for &p in &self.free {
            let i = p as usize;
            if i >= self.num_pages || seen[i] > 0 {
                return false;
            }
            if !self.holders[i].is_empty() || self.address[i].is_some() {
                return false;
            }
            seen[i] = 1;
        }
        for (&k, &p) in &self.unheld {
            let i = p as usize;
            if i >= self.num_pages || seen[i] > 0 || self.let_go[i] != k {
                return false;
            }
            if !self.holders[i].is_empty() || self.address[i].is_none() {
                return false;
            }
            seen[i] = 1;
        }
        let mut held: HashMap<(u32, K), usize> = HashMap::new();
        for (&s, t) in &self.owned {
            if t.is_empty() {
                return false;
            }
            for &p in t {
                *held.entry((p, s)).or_default() += 1;
            }
        }
        for (i, h) in self.holders.iter().enumerate() {
            if h.is_empty() {
                continue;
            }
            if seen[i] > 0 {
                return false;
            }
            seen[i] = 1;
            for &s in h {
                let n = held.get(&(i as u32, s)).copied().unwrap_or(0);
                if n != h.iter().filter(|&&o| o == s).count() {
                    return false;
                }
            }
        }
        if held
            .keys()
            .any(|(p, s)| !self.holders[*p as usize].contains(s))
        {
            return false;
        }
        let addressed = self.address.iter().flatten().count();
        addressed == self.index.len()
            && self
                .index
                .iter()
                .all(|(h, &p)| self.address[p as usize] == Some(*h))
            && seen.iter().all(|&x| x == 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        Grow(u8, usize),
        Truncate(u8, usize),
        Free(u8),
        /// Owner `.0` publishes its full pages under salt `.1`, then owner `.2` (holding nothing)
        /// attaches what matches the same tokens under salt `.3`.
        Share(u8, u64, u8, u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u8..4, 1usize..30).prop_map(|(s, n)| Op::Grow(s, n)),
            (0u8..4, 0usize..30).prop_map(|(s, n)| Op::Truncate(s, n)),
            (0u8..4).prop_map(Op::Free),
            (0u8..4, 0u64..2, 0u8..4, 0u64..2).prop_map(|(a, x, b, y)| Op::Share(a, x, b, y)),
        ]
    }

    proptest! {
        /// Under any grows, truncations, frees, publications and attachments: every page is
        /// empty, cached or held as its records say (no holder count below zero, none freed
        /// while held); a grow takes only empty or unheld cached pages (every other owner's
        /// table is unchanged); a page shared or published is never kept for writing; and an
        /// owner attaches only pages published under its own salt, for its own tokens.
        #[test]
        fn pages_are_conserved_and_never_taken_from_a_holder(
            ops in proptest::collection::vec(op(), 1..80),
        ) {
            let ps = 4;
            let mut pool: PagePool<u8> = PagePool::new(10, ps).unwrap();
            // Each owner's length, and its tokens (owner-independent: position % 5).
            let mut len = [0usize; 4];
            let tok = |n: usize| (0..n as u32).map(|i| i % 5).collect::<Vec<_>>();
            // Who published each address under which salt.
            let mut salt_of: HashMap<PageHash, u64> = HashMap::new();
            for o in ops {
                let before: Vec<Vec<u32>> = (0..4).map(|s| pool.table(s).to_vec()).collect();
                let mut changed: Option<u8> = None;
                match o {
                    Op::Grow(s, n) => {
                        if pool.grow(s, len[s as usize] + n).is_ok() {
                            prop_assert!(pool.writable(s, len[s as usize], len[s as usize] + n));
                            len[s as usize] += n;
                        }
                        changed = Some(s);
                    }
                    Op::Truncate(s, n) => {
                        let want = n.min(len[s as usize]);
                        let kept = pool.truncate(s, want);
                        prop_assert!(kept <= want);
                        prop_assert!(pool.writable(s, kept, kept + ps));
                        len[s as usize] = kept;
                        changed = Some(s);
                    }
                    Op::Free(s) => {
                        pool.free_all(s);
                        len[s as usize] = 0;
                        changed = Some(s);
                    }
                    Op::Share(a, x, b, y) => {
                        let mut chain = Vec::new();
                        PageHash::extend_chain(&mut chain, x, ps, &tok(len[a as usize]));
                        for (i, &h) in chain.iter().enumerate() {
                            if pool.publish(a, i, h) {
                                salt_of.insert(h, x);
                            }
                        }
                        if a != b && pool.held(b) == 0 {
                            let mut want = Vec::new();
                            PageHash::extend_chain(&mut want, y, ps, &tok(24));
                            let pages = pool.lookup(&want);
                            for p in &pages {
                                let h = pool.address[*p as usize].unwrap();
                                prop_assert_eq!(salt_of[&h], y, "a page of another salt");
                            }
                            pool.attach(b, &pages).unwrap();
                            len[b as usize] = pages.len() * ps;
                            changed = Some(b);
                        }
                    }
                }
                prop_assert!(pool.conserved());
                for s in 0..4u8 {
                    if Some(s) != changed {
                        prop_assert_eq!(pool.table(s), &before[s as usize][..], "owner {}'s pages", s);
                    }
                    prop_assert_eq!(pool.held(s), pool.pages_for(len[s as usize]));
                }
                let charged: usize = (0..4).map(|s| pool.charged(s)).sum();
                let held = pool.num_pages() - pool.free.len() - pool.num_cached_unheld();
                prop_assert_eq!(charged, held, "a held page is charged once");
            }
        }
    }

    #[test]
    fn cached_pages_go_least_recently_let_go_first_and_only_when_nothing_is_empty() {
        let mut pool: PagePool<u8> = PagePool::new(4, 2).unwrap();
        let (a, b) = (
            PageHash::next(None, 0, &[1, 2]),
            PageHash::next(None, 0, &[3, 4]),
        );
        pool.grow(1, 2).unwrap();
        pool.grow(2, 2).unwrap();
        assert!(pool.publish(1, 0, a) && pool.publish(2, 0, b));
        pool.free_all(2);
        pool.free_all(1); // a was let go last
        assert_eq!(pool.num_free(), 4);
        pool.grow(3, 4).unwrap(); // the two empty pages
        assert_eq!(pool.lookup(&[a]).len() + pool.lookup(&[b]).len(), 2);
        pool.grow(3, 6).unwrap(); // b's page goes first
        assert_eq!((pool.lookup(&[a]).len(), pool.lookup(&[b]).len()), (1, 0));
        assert_eq!(pool.counts().evictions, 1);
        // A held cached page is never taken.
        pool.attach(4, &pool.lookup(&[a])).unwrap();
        assert!(pool.grow(3, 8).is_err());
        assert!(pool.conserved());
    }
}
