//! Model-free drafts that copy: a suffix automaton over a session's token ids (its prompt, the
//! conversation before it, every token it commits), which proposes what followed the longest
//! earlier occurrence of the text's current end.
//!
//! Much of what people ask a served model copies its input (code edits, corrections, JSON that
//! quotes the text, answers that read a document or a tool's result back): there the
//! continuation of the longest earlier match is a good guess, at no model cost. Both sides use
//! it: the edge beside its draft model, the verifier for a session it decodes alone (while the
//! edge's correction travels), where each guess it verifies in the same forward saves a forward.
//!
//! The automaton is built online, one token at a time, in amortized constant time per token plus
//! the walk along the new state's suffix links that keeps each state's occurrence count and its
//! two most recent end positions (bounded by [`MAX_WALK`]: past it, deeper states keep an older
//! occurrence, still a real and earlier one). After each token, [`SuffixIndex::longest`] is the
//! longest suffix of the text that also ends earlier: its length, how often it occurred before,
//! and where it last did; [`SuffixIndex::after`] copies what followed there.

use std::collections::{HashMap, VecDeque};

/// The most suffix-link steps one token's walk updates (the rest keep older statistics).
pub const MAX_WALK: usize = 1024;

const NONE: u32 = u32::MAX;

#[derive(Debug, Clone)]
struct State {
    /// The longest text this state stands for.
    len: u32,
    /// Its suffix link (NONE at the root).
    link: u32,
    /// Positions where its texts end: how many, the last one, and the one before it.
    count: u32,
    last_end: u32,
    prev_end: u32,
}

/// The longest suffix of the text that also ends at an earlier position.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Match {
    /// Its length in tokens (at least 1).
    pub len: usize,
    /// The earlier positions where it ends (its frequency before now).
    pub count: usize,
    /// The most recent of them: what followed it starts at `end + 1`.
    pub end: usize,
}

/// How the verifier turns matches into guesses: none below `min_match` tokens matched, then
/// `factor` guesses per matched token, at most `max_tokens` (each priced by [`SelfDrafter`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SuffixPolicy {
    pub min_match: usize,
    pub factor: f64,
    pub max_tokens: usize,
}

/// A guessed position's cost beside a one-position forward when nothing measured says better.
pub const DEFAULT_POSITION_COST: f64 = 0.1;

impl SuffixPolicy {
    /// The verifier's unless told otherwise: a match of one token or more, two guesses per
    /// matched token, at most sixteen (each priced by its record).
    pub const DEFAULT: SuffixPolicy = SuffixPolicy {
        min_match: 1,
        factor: 2.0,
        max_tokens: 16,
    };

    /// Guesses to take from a match of `len` tokens.
    pub fn guesses(&self, len: usize) -> usize {
        if len < self.min_match.max(1) {
            return 0;
        }
        ((len as f64 * self.factor).ceil() as usize).min(self.max_tokens)
    }
}

impl Default for SuffixPolicy {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// A suffix automaton over token ids, built as tokens come.
#[derive(Debug, Clone)]
pub struct SuffixIndex {
    text: Vec<u32>,
    states: Vec<State>,
    /// Transitions `(state, token) → state`, and the tokens each state has one for (to copy a
    /// state's transitions when it is split).
    next: HashMap<(u32, u32), u32>,
    out: Vec<Vec<u32>>,
    /// The state of the whole text.
    last: u32,
    /// The longest earlier match of the text's end, found when its last token came.
    found: Option<Match>,
}

impl Default for SuffixIndex {
    fn default() -> Self {
        Self::new()
    }
}

impl SuffixIndex {
    pub fn new() -> Self {
        Self {
            text: Vec::new(),
            states: vec![State {
                len: 0,
                link: NONE,
                count: 0,
                last_end: NONE,
                prev_end: NONE,
            }],
            next: HashMap::new(),
            out: vec![Vec::new()],
            last: 0,
            found: None,
        }
    }

    /// An index of `tokens`.
    pub fn of(tokens: &[u32]) -> Self {
        let mut s = Self::new();
        s.extend(tokens);
        s
    }

    /// The text indexed so far.
    pub fn text(&self) -> &[u32] {
        &self.text
    }

    pub fn len(&self) -> usize {
        self.text.len()
    }

    pub fn is_empty(&self) -> bool {
        self.text.is_empty()
    }

    pub fn extend(&mut self, tokens: &[u32]) {
        for &t in tokens {
            self.push(t);
        }
    }

    /// Append `token` to the text.
    pub fn push(&mut self, token: u32) {
        let i = self.text.len() as u32;
        self.text.push(token);
        let cur = self.states.len() as u32;
        self.states.push(State {
            len: self.states[self.last as usize].len + 1,
            link: 0,
            count: 1,
            last_end: i,
            prev_end: NONE,
        });
        self.out.push(Vec::new());
        let mut p = self.last;
        while p != NONE && !self.next.contains_key(&(p, token)) {
            self.next.insert((p, token), cur);
            self.out[p as usize].push(token);
            p = self.states[p as usize].link;
        }
        if p != NONE {
            let q = self.next[&(p, token)];
            if self.states[p as usize].len + 1 == self.states[q as usize].len {
                self.states[cur as usize].link = q;
            } else {
                // Split q: the clone stands for its texts up to len(p) + 1, which now end here too.
                let clone = self.states.len() as u32;
                let mut c = self.states[q as usize].clone();
                c.len = self.states[p as usize].len + 1;
                self.states.push(c);
                let tokens = self.out[q as usize].clone();
                for &t in &tokens {
                    let to = self.next[&(q, t)];
                    self.next.insert((clone, t), to);
                }
                self.out.push(tokens);
                while p != NONE && self.next.get(&(p, token)) == Some(&q) {
                    self.next.insert((p, token), clone);
                    p = self.states[p as usize].link;
                }
                self.states[q as usize].link = clone;
                self.states[cur as usize].link = clone;
            }
        }
        self.last = cur;
        // Every state on the new one's suffix path now also ends here.
        let mut s = self.states[cur as usize].link;
        self.found = match s {
            0 => None,
            _ => {
                let st = &self.states[s as usize];
                Some(Match {
                    len: st.len as usize,
                    count: st.count as usize,
                    end: st.last_end as usize,
                })
            }
        };
        let mut walked = 0;
        while s != 0 && s != NONE && walked < MAX_WALK {
            let st = &mut self.states[s as usize];
            st.count += 1;
            st.prev_end = st.last_end;
            st.last_end = i;
            s = st.link;
            walked += 1;
        }
    }

    /// The longest suffix of the text that also ends earlier, if any.
    pub fn longest(&self) -> Option<Match> {
        self.found
    }

    /// The longest suffix of `tail` (a text that need not be indexed: the committed text and
    /// tokens drafted after it) that occurs in the indexed text ending before its last position,
    /// and the most recent such occurrence: what followed it is a guess of what follows `tail`.
    /// Read from `tail`'s start, in time linear in its length.
    pub fn match_end(&self, tail: &[u32]) -> Option<Match> {
        // The longest suffix of what was read that occurs anywhere: state and length.
        let (mut s, mut len) = (0u32, 0usize);
        for &t in tail {
            loop {
                if let Some(&to) = self.next.get(&(s, t)) {
                    s = to;
                    len += 1;
                    break;
                }
                if s == 0 {
                    len = 0;
                    break;
                }
                s = self.states[s as usize].link;
                len = self.states[s as usize].len as usize;
            }
        }
        // Its occurrences share their ends with every length the state stands for; one that ends
        // before the text's last position leaves something to copy, else a shorter match.
        let last = self.text.len().checked_sub(1)? as u32;
        while s != 0 {
            let st = &self.states[s as usize];
            let end = [st.last_end, st.prev_end]
                .into_iter()
                .find(|&e| e != NONE && e < last);
            if let Some(end) = end {
                let count = st.count as usize - usize::from(st.last_end == last);
                return Some(Match {
                    len,
                    count,
                    end: end as usize,
                });
            }
            s = st.link;
            len = self.states[s as usize].len as usize;
        }
        None
    }

    /// The tokens that followed `m` (from [`longest`](Self::longest) or
    /// [`match_end`](Self::match_end)), at most `max`.
    pub fn after(&self, m: &Match, max: usize) -> &[u32] {
        let from = (m.end + 1).min(self.text.len());
        &self.text[from..(from + max).min(self.text.len())]
    }
}

/// Match lengths from which each bucket of a [`GuessRecord`] starts.
const BUCKETS: [usize; 5] = [1, 2, 4, 8, 16];
/// A bucket's record before any guess: (accepted, rejected) as if half were right.
const PRIOR: (f64, f64) = (1.0, 1.0);
const DECAY: f64 = 0.95;
/// A session's record starts from the verifier's, weighed as this many judged runs per bucket:
/// its own guesses soon outweigh it.
const PRIOR_WEIGHT: f64 = 2.0;
/// A bucket priced out still feeds one guess at every this many matches in it, so that its
/// record can recover when the text starts copying.
const PROBE_EVERY: u32 = 32;

/// How often guesses copied after matches of each length were accepted: decayed (accepted,
/// rejected) per bucket of match lengths, a rejection counted once per judged run (so that
/// `accepted / (accepted + rejected)` is the chance the next guess is taken once those before it
/// were). Each session keeps one; the verifier keeps one over all its sessions, from which each
/// new session's starts ([`GuessRecord::prior`]): on a workload whose text seldom copies, a
/// session does not relearn that at every start.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GuessRecord {
    buckets: [(f64, f64); BUCKETS.len()],
}

impl Default for GuessRecord {
    fn default() -> Self {
        Self {
            buckets: [PRIOR; BUCKETS.len()],
        }
    }
}

/// One judged run of guesses: the bucket of the match they followed, how many were fed and how
/// many the target took.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Judged {
    pub bucket: usize,
    pub guessed: usize,
    pub accepted: usize,
}

impl GuessRecord {
    fn bucket(len: usize) -> usize {
        BUCKETS.iter().rposition(|&b| len >= b).unwrap_or(0)
    }

    /// The chance a guess after a match of `len` tokens is taken once those before it were.
    pub fn alpha(&self, len: usize) -> f64 {
        let (a, r) = self.buckets[Self::bucket(len)];
        a / (a + r).max(1e-12)
    }

    pub fn judge(&mut self, j: &Judged) {
        if j.guessed == 0 {
            return;
        }
        let r = &mut self.buckets[j.bucket.min(BUCKETS.len() - 1)];
        r.0 = DECAY * r.0 + j.accepted as f64;
        r.1 = DECAY * r.1 + f64::from(u8::from(j.accepted < j.guessed));
    }

    /// A session's starting record: this one's acceptance per bucket, weighed as
    /// [`PRIOR_WEIGHT`] judged runs (as much as it holds, where it holds less).
    pub fn prior(&self) -> GuessRecord {
        let mut p = *self;
        for (a, r) in &mut p.buckets {
            let w = (*a + *r).min(PRIOR_WEIGHT) / (*a + *r).max(1e-12);
            (*a, *r) = (*a * w, *r * w);
        }
        p
    }
}

/// The verifier's own drafts for one session: its text indexed, and how often its guesses after
/// matches of each length were accepted ([`GuessRecord`], starting from the verifier's), which
/// prices them: it feeds the number of guesses `k` that commits the most tokens per unit of
/// forward time, `(1 + a + a² + … + a^k) / (1 + k·c)` for a guess's acceptance `a` after such a
/// match and a position's cost `c` (the caller's: what the verifier measured) times the sessions that
/// share the forward (each waits for the position; only this one gains by it; the caller's
/// [`SelfDrafter::guesses`]): none where its
/// guesses are seldom right (but one at every [`PROBE_EVERY`]-th such match), nor in a forward
/// many sessions share.
#[derive(Debug, Clone)]
pub struct SelfDrafter {
    index: SuffixIndex,
    policy: SuffixPolicy,
    record: GuessRecord,
    /// Matches of each bucket priced out since its last probe.
    held: [u32; BUCKETS.len()],
    /// The bucket of the guesses last proposed, until they are judged.
    proposed: Option<usize>,
}

impl SelfDrafter {
    /// A drafter over `text` whose record starts from `record`'s ([`GuessRecord::prior`]).
    pub fn new(text: &[u32], policy: SuffixPolicy, record: &GuessRecord) -> Self {
        Self {
            index: SuffixIndex::of(text),
            policy,
            record: record.prior(),
            held: [0; BUCKETS.len()],
            proposed: None,
        }
    }

    pub fn extend(&mut self, tokens: &[u32]) {
        self.index.extend(tokens);
    }

    pub fn push(&mut self, token: u32) {
        self.index.push(token);
    }

    /// The guesses to feed now, at most `most`, stopping after an end token of `eog`, when a
    /// position costs `cost` of a one-token forward (the sessions it delays counted: a
    /// position's cost times the sessions sharing the forward).
    pub fn guesses(&mut self, most: usize, eog: &[u32], cost: f64) -> Vec<u32> {
        self.proposed = None;
        let Some(m) = self.index.longest() else {
            return Vec::new();
        };
        let b = GuessRecord::bucket(m.len);
        let most = self.policy.guesses(m.len).min(most);
        let mut k = priced(self.record.alpha(m.len), cost, most);
        if k == 0 && most > 0 {
            self.held[b] += 1;
            if self.held[b].is_multiple_of(PROBE_EVERY) {
                k = 1;
            }
        }
        let mut g = self.index.after(&m, k).to_vec();
        if let Some(e) = g.iter().position(|t| eog.contains(t)) {
            g.truncate(e + 1);
        }
        if !g.is_empty() {
            self.proposed = Some(b);
        }
        g
    }

    /// The guesses last proposed were fed: `guessed` of them, `accepted` taken by the target.
    /// Returns the judgement, for the verifier's record ([`GuessRecord::judge`]).
    pub fn judged(&mut self, guessed: usize, accepted: usize) -> Option<Judged> {
        let bucket = self.proposed.take()?;
        let j = Judged {
            bucket,
            guessed,
            accepted,
        };
        self.record.judge(&j);
        (guessed > 0).then_some(j)
    }
}

/// The number of guesses (at most `most`) that commits the most tokens per unit of forward time
/// when each is taken with probability `a` once those before it were, and each costs `cost` of
/// a one-position forward: 0 when even one does not pay.
pub fn priced(a: f64, cost: f64, most: usize) -> usize {
    let (mut best, mut best_rate) = (0, 1.0);
    let (mut tokens, mut p) = (1.0, 1.0);
    for k in 1..=most {
        p *= a.clamp(0.0, 1.0);
        tokens += p;
        let rate = tokens / (1.0 + k as f64 * cost.max(0.0));
        if rate > best_rate * (1.0 + 1e-9) {
            (best, best_rate) = (k, rate);
        }
    }
    best
}

/// The edge's suffix drafter: guesses copied from the committed text (prompt and output) where
/// the end of the path drafted on matches it for long enough, proposed without a forward of the
/// draft model (the next step that needs their KV feeds them in one chunk). Each source is
/// priced by how often its tokens turned out right, judged by the committed text: copies by the
/// length of the match they followed, the model's own tokens as one. A copy replaces the model's
/// token where copies after matches of its length are right at least as often as the model's
/// tokens (less [`COPY_MARGIN`]: a copy saves a draft forward) and at least [`COPY_MIN_ALPHA`].
#[derive(Debug, Clone)]
pub struct Copier {
    index: SuffixIndex,
    /// Proposals not yet judged by the committed text: position, token, and the match-length
    /// bucket of a copy (None: the model's).
    pending: VecDeque<(usize, u32, Option<usize>)>,
    /// Decayed (right, judged) of the model's own tokens.
    model: (f64, f64),
    /// Decayed (right, judged) of the copies of each bucket of match lengths, and the guesses
    /// each held back since its last copy (one in [`COPY_PROBE_EVERY`] is copied anyway, so that
    /// a bucket whose copies turn right again is used again).
    record: [(f64, f64); COPY_BUCKETS.len()],
    held: [u32; COPY_BUCKETS.len()],
    stats: CopyStats,
}

/// What a copier proposed and how much of it the committed text confirmed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct CopyStats {
    /// Tokens proposed by copy, and those of them judged (the committed text reached their
    /// position) and right.
    pub copied: usize,
    pub judged: usize,
    pub right: usize,
}

/// The edge copies after matches of this many tokens or more (a copy per draft step).
pub const COPY_MIN_MATCH: usize = 2;

/// Match lengths from which each bucket of the copier's record starts.
const COPY_BUCKETS: [usize; 4] = [1, 3, 6, 12];
/// Copies of a bucket right less often than this leave the draft to the model.
pub const COPY_MIN_ALPHA: f64 = 0.5;
/// How much less often than the model's tokens a copy may be right and still replace one.
pub const COPY_MARGIN: f64 = 0.05;
/// The model's record before any of its tokens is judged: about the W4A16 draft's α.
const MODEL_PRIOR: (f64, f64) = (3.2, 4.0);
/// A bucket's record before any copy (hits, judged): worth trying (above the model's prior).
const COPY_PRIOR: (f64, f64) = (3.6, 4.0);
/// A bucket below [`COPY_MIN_ALPHA`] still copies one guess in this many.
const COPY_PROBE_EVERY: u32 = 8;
const COPY_DECAY: f64 = 0.95;
/// The path's tokens read back to find a match (longer matches are as good as this long).
const COPY_WINDOW: usize = 48;

impl Copier {
    /// A copier over `prompt`, copying after matches of [`COPY_MIN_MATCH`] tokens or more.
    pub fn new(prompt: &[u32]) -> Self {
        Self {
            index: SuffixIndex::of(prompt),
            pending: Default::default(),
            model: MODEL_PRIOR,
            record: [COPY_PRIOR; COPY_BUCKETS.len()],
            held: [0; COPY_BUCKETS.len()],
            stats: CopyStats::default(),
        }
    }

    pub fn stats(&self) -> CopyStats {
        self.stats
    }

    fn bucket(len: usize) -> usize {
        COPY_BUCKETS.iter().rposition(|&b| len >= b).unwrap_or(0)
    }

    /// Take in the committed text: the index grows with it, and the copies it reached are judged.
    pub fn sync(&mut self, committed: &[u32]) {
        let n = self.index.len();
        // (The committed text only grows: its last indexed token tells a continuation.)
        if committed.len() < n || (n > 0 && committed[n - 1] != self.index.text()[n - 1]) {
            // Another text (not a continuation: never within a session): start over.
            self.index = SuffixIndex::of(committed);
        } else {
            self.index.extend(&committed[n..]);
        }
        while let Some(&(pos, token, b)) = self.pending.front() {
            if pos >= committed.len() {
                break;
            }
            self.pending.pop_front();
            let right = committed[pos] == token;
            let r = match b {
                Some(b) => &mut self.record[b],
                None => &mut self.model,
            };
            *r = (
                COPY_DECAY * r.0 + f64::from(u8::from(right)),
                COPY_DECAY * r.1 + 1.0,
            );
            if b.is_some() {
                self.stats.judged += 1;
                self.stats.right += usize::from(right);
            }
        }
    }

    /// The model drafted `token` at `pos` (a linear draft's): judged like a copy, for the price.
    pub fn drafted(&mut self, pos: usize, token: u32) {
        // Only the newest proposal at a position is judged: a later one replaces it.
        while self.pending.back().is_some_and(|&(p, _, _)| p >= pos) {
            self.pending.pop_back();
        }
        self.pending.push_back((pos, token, None));
    }

    /// A copy of what followed the longest earlier match of `path`'s end, when the match is long
    /// enough and copies after matches of its length have been right often enough.
    pub fn guess(&mut self, path: &[u32]) -> Option<(u32, Match)> {
        let tail = &path[path.len().saturating_sub(COPY_WINDOW)..];
        let m = self.index.match_end(tail)?;
        if m.len < COPY_MIN_MATCH {
            return None;
        }
        let b = Self::bucket(m.len);
        let (right, judged) = self.record[b];
        let model = self.model.0 / self.model.1;
        if right < judged * COPY_MIN_ALPHA.max(model - COPY_MARGIN) {
            self.held[b] += 1;
            if !self.held[b].is_multiple_of(COPY_PROBE_EVERY) {
                return None;
            }
        }
        self.index.after(&m, 1).first().map(|&t| (t, m))
    }

    /// `token` was proposed at `pos` by copy after a match `m`.
    pub fn proposed(&mut self, pos: usize, token: u32, m: &Match) {
        self.stats.copied += 1;
        while self.pending.back().is_some_and(|&(p, _, _)| p >= pos) {
            self.pending.pop_back();
        }
        self.pending
            .push_back((pos, token, Some(Self::bucket(m.len))));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_copier_copies_after_a_match_and_stops_where_its_copies_go_wrong() {
        // "a b c d e ... a b" → "c", then (the path drafted on) "a b c" → "d".
        let prompt = [1, 2, 3, 4, 5, 9, 1, 2];
        let mut c = Copier::new(&prompt);
        c.sync(&prompt);
        assert_eq!(c.guess(&prompt).map(|g| g.0), Some(3));
        assert_eq!(c.guess(&[&prompt[..], &[3]].concat()).map(|g| g.0), Some(4));
        // A match of one token is too short.
        assert_eq!(c.guess(&[5, 9, 7, 1]), None);
        // Copies after two-token matches keep turning out wrong: that length stops copying.
        let mut text = prompt.to_vec();
        let mut copied = 0;
        for k in 0..40 {
            text.extend([20 + k, 1, 2]); // the target said otherwise, then "a b" again
            c.sync(&text);
            if let Some((t, m)) = c.guess(&text) {
                assert_eq!(m.len, 2, "step {k}");
                c.proposed(text.len(), t, &m);
                copied += 1;
            }
        }
        // A miss or two, then one probe in eight.
        assert!((4..=8).contains(&copied), "{copied} copies of 40");
        assert_eq!(c.stats().right, 0);
    }

    #[test]
    fn guesses_are_priced_by_their_acceptance_and_cost() {
        // Seldom right: none. Often right: many, fewer as positions cost more.
        assert_eq!(priced(0.05, 0.1, 16), 0);
        assert_eq!(priced(0.9, 0.0, 16), 16);
        assert!(priced(0.9, 0.05, 16) > priced(0.9, 0.2, 16));
        assert!(priced(0.9, 0.2, 16) >= 1);
        assert_eq!(priced(0.9, 0.1, 3), 3);
        // The drafter learns: after rejections of its guesses after one-token matches, it stops.
        let mut d = SelfDrafter::new(
            &[1, 2, 3, 1],
            SuffixPolicy::DEFAULT,
            &GuessRecord::default(),
        );
        assert!(
            d.guesses(8, &[], 16.0 * DEFAULT_POSITION_COST).is_empty(),
            "a forward of 16 sessions"
        );
        assert_eq!(d.guesses(8, &[], DEFAULT_POSITION_COST), vec![2, 3]);
        d.judged(2, 0);
        let mut stops = false;
        for _ in 0..10 {
            let g = d.guesses(8, &[], DEFAULT_POSITION_COST);
            if g.is_empty() {
                stops = true;
                break;
            }
            d.judged(g.len(), 0);
        }
        assert!(stops, "it kept guessing after misses");
        // An end token ends the guesses.
        let mut d = SelfDrafter::new(
            &[1, 2, 7, 5, 1],
            SuffixPolicy::DEFAULT,
            &GuessRecord::default(),
        );
        assert_eq!(d.guesses(8, &[7], DEFAULT_POSITION_COST), vec![2, 7]);
    }

    #[test]
    fn a_session_starts_from_the_verifiers_record_and_probes_what_it_priced_out() {
        // The verifier's sessions' guesses after one-token matches were always rejected.
        let mut fleet = GuessRecord::default();
        for _ in 0..20 {
            let mut d = SelfDrafter::new(&[1, 2, 3, 1], SuffixPolicy::DEFAULT, &fleet);
            for _ in 0..30 {
                let g = d.guesses(8, &[], DEFAULT_POSITION_COST);
                if let Some(j) = d.judged(g.len(), 0) {
                    fleet.judge(&j);
                }
            }
        }
        assert!(fleet.alpha(1) < 0.1, "{fleet:?}");
        assert_eq!(fleet.alpha(5), 0.5, "other buckets untouched");
        // A new session starts priced out there: a probe now and then, not a relearning.
        let mut d = SelfDrafter::new(&[1, 2, 3, 1], SuffixPolicy::DEFAULT, &fleet);
        let n = 2 * PROBE_EVERY as usize;
        let fed: usize = (0..n)
            .map(|_| d.guesses(8, &[], DEFAULT_POSITION_COST).len())
            .sum();
        assert_eq!(fed, 2, "two probes of one guess in {n} matches");
        // A new session still guesses after longer matches, and its own record outweighs the
        // verifier's soon: accepted probes price its guesses in again.
        let mut d = SelfDrafter::new(&[1, 2, 3, 4, 5, 1, 2, 3, 4], SuffixPolicy::DEFAULT, &fleet);
        assert_eq!(
            d.guesses(8, &[], DEFAULT_POSITION_COST),
            vec![5, 1],
            "as many as pay at α 0.5"
        );
        let mut d = SelfDrafter::new(&[1, 2, 3, 1], SuffixPolicy::DEFAULT, &fleet);
        for _ in 0..PROBE_EVERY + 8 {
            let g = d.guesses(8, &[], DEFAULT_POSITION_COST);
            d.judged(g.len(), g.len());
        }
        assert_eq!(
            d.guesses(8, &[], DEFAULT_POSITION_COST).len(),
            2,
            "all a one-token match allows"
        );
        // The prior weighs as two judged runs.
        let p = fleet.prior();
        let (a, r) = p.buckets[0];
        assert!((a + r - PRIOR_WEIGHT).abs() < 1e-9 && (p.alpha(1) - fleet.alpha(1)).abs() < 1e-9);
    }

    /// The longest suffix of `tail` that occurs in `text` ending before its last position, its
    /// count of such occurrences and the most recent, by trying every length and end.
    fn brute_end(text: &[u32], tail: &[u32]) -> Option<Match> {
        let n = text.len();
        for len in (1..=tail.len()).rev() {
            let suffix = &tail[tail.len() - len..];
            let ends: Vec<usize> = (len.saturating_sub(1)..n.saturating_sub(1))
                .filter(|&e| e + 1 >= len && &text[e + 1 - len..=e] == suffix)
                .collect();
            if let Some(&end) = ends.last() {
                return Some(Match {
                    len,
                    count: ends.len(),
                    end,
                });
            }
        }
        None
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        /// A tail read against the index (the committed text and drafted tokens after it) finds
        /// the brute force's match.
        #[test]
        fn a_tails_match_is_the_brute_forces(
            text in prop::collection::vec(0u32..4, 1..120),
            drafted in prop::collection::vec(0u32..4, 0..12),
            from in 0usize..130,
        ) {
            let s = SuffixIndex::of(&text);
            let mut tail = text[from.min(text.len())..].to_vec();
            tail.extend(&drafted);
            let got = s.match_end(&tail);
            let want = brute_end(&text, &tail);
            prop_assert_eq!(got, want);
            // With nothing drafted, the text's own end is the index's match.
            if drafted.is_empty() && from == 0 {
                prop_assert_eq!(got, s.longest());
            }
        }

        /// After every token, the automaton's match is the brute-force one: the same length,
        /// the same count of earlier occurrences, the same most recent end; and the proposal is
        /// what followed there.
        #[test]
        fn the_longest_match_is_the_brute_forces(
            text in prop::collection::vec(0u32..4, 1..160),
            big in prop::collection::vec(0u32..50_000, 0..40),
        ) {
            for text in [text, big] {
                let mut s = SuffixIndex::new();
                for (i, &t) in text.iter().enumerate() {
                    s.push(t);
                    // The text's own end is a tail read against it.
                    let want = brute_end(&text[..=i], &text[..=i]);
                    prop_assert_eq!(s.longest(), want, "after {} tokens", i + 1);
                    if let Some(m) = s.longest() {
                        let p = s.after(&m, 5);
                        let from = m.end + 1;
                        prop_assert_eq!(p, &text[from..(from + 5).min(i + 1)]);
                    }
                }
            }
        }
    }

    /// What a policy takes from the index's match: its guesses, at most `most`.
    fn guesses(s: &SuffixIndex, policy: &SuffixPolicy, most: usize) -> Vec<u32> {
        s.longest().map_or_else(Vec::new, |m| {
            s.after(&m, policy.guesses(m.len).min(most)).to_vec()
        })
    }

    #[test]
    fn a_repeated_span_is_proposed_from_its_last_occurrence() {
        // ". a b c" occurred once before the end, "a b" twice.
        let mut s = SuffixIndex::of(&[1, 2, 3, 4, 9, 1, 2, 3, 5, 9, 1, 2]);
        assert_eq!(
            s.longest(),
            Some(Match {
                len: 3,
                count: 1,
                end: 6
            })
        );
        assert_eq!(s.after(&s.longest().unwrap(), 4), &[3, 5, 9, 1]);
        s.push(3);
        assert_eq!(
            s.after(&s.longest().unwrap(), 2),
            &[5, 9],
            "the most recent occurrence"
        );
        let policy = SuffixPolicy {
            min_match: 2,
            factor: 1.0,
            max_tokens: 8,
        };
        assert_eq!(
            guesses(&s, &policy, 8),
            vec![5, 9, 1, 2],
            "a guess per matched token"
        );
        assert_eq!(
            guesses(&s, &policy, 3),
            vec![5, 9, 1],
            "at most what is asked"
        );
        // Too short a match proposes nothing under the policy.
        let s = SuffixIndex::of(&[1, 2, 3, 1]);
        assert_eq!(s.longest().map(|m| m.len), Some(1));
        assert!(guesses(&s, &policy, 8).is_empty());
        assert_eq!(
            guesses(&s, &SuffixPolicy::DEFAULT, 8),
            vec![2, 3],
            "two per matched token"
        );
    }

    #[test]
    fn a_long_run_of_one_token_stays_cheap_and_right() {
        let mut s = SuffixIndex::new();
        for _ in 0..3 * MAX_WALK {
            s.push(7);
        }
        let m = s.longest().unwrap();
        assert_eq!(m.len, 3 * MAX_WALK - 1);
        assert_eq!(m.end, 3 * MAX_WALK - 2);
        assert_eq!(s.after(&s.longest().unwrap(), 3), &[7]);
    }
}
