//! The verifier's adaptation to its load: the grant (γ and depth) every speculation session may
//! use, planned from the target's forward cost ([`GrantPolicy`]), and the takeover of a session
//! whose speculation commits more slowly than cloud decoding would ([`tandem_sched::pace`]). Pure
//! bookkeeping on a clock the caller passes in: the batcher drives it with the wall clock, `tandem
//! simulate` with simulated time, so both run the same decisions.

use std::collections::BTreeMap;

use tandem_sched::pace::prefer_cloud;
use tandem_sched::{GrantPolicy, Pace, SessionId};
use tandem_spec::{Decoded, Verdict};

use crate::verifier::{Event, Target, Verifier};

/// Forwards between two looks at the load by the grant policy (each moves one level at most).
pub const GRANT_EVERY: u64 = 2;

/// Idle this long (ms), the verifier counts as unloaded and the grant relaxes a level (per turn).
/// Shorter gaps are normal between rounds of speculation (edges drafting, blocks on the wire) and
/// do not count.
pub const IDLE_RELAX_MS: u64 = 250;

/// Decay per verdict of the accepted and judged counts behind the grant's α.
pub const ALPHA_DECAY: f64 = 0.99;

/// The α the grant plans with before any verdict (about the W4A16 draft's).
const PRIOR_ALPHA: f64 = 0.8;

#[derive(Debug, Clone)]
struct Ctl {
    /// What a speculation session asked for (None: a cloud-only generation).
    want: Option<(u32, u32)>,
    /// What it was last told it may use.
    granted: (u32, u32),
    /// The verifier decodes it itself.
    cloud: bool,
    /// Its speculative pace, for a takeover of its own.
    pace: Pace,
}

/// See the module docs.
#[derive(Debug, Clone)]
pub struct LoadControl {
    grants: GrantPolicy,
    sessions: BTreeMap<SessionId, Ctl>,
    graded_at: u64,
    last_forward_ms: u64,
    accepted_recent: f64,
    judged_recent: f64,
}

impl LoadControl {
    pub fn new(grants: GrantPolicy, now_ms: u64) -> Self {
        Self {
            grants,
            sessions: BTreeMap::new(),
            graded_at: 0,
            last_forward_ms: now_ms,
            accepted_recent: 0.0,
            judged_recent: 0.0,
        }
    }

    pub fn grants(&self) -> &GrantPolicy {
        &self.grants
    }

    /// A session was admitted; `want` is a speculation session's (γ, depth), None for a
    /// cloud-only generation (which counts in the load but has no grant).
    pub fn open(&mut self, id: SessionId, want: Option<(u32, u32)>) {
        self.sessions.insert(
            id,
            Ctl {
                want,
                granted: (0, 0),
                cloud: false,
                pace: Pace::default(),
            },
        );
    }

    pub fn close(&mut self, id: SessionId) {
        self.sessions.remove(&id);
    }

    /// Whether the verifier decodes `id` itself.
    pub fn is_cloud(&self, id: SessionId) -> bool {
        self.sessions.get(&id).is_some_and(|c| c.cloud)
    }

    /// Look at the load, once per turn before the iteration runs: relax the grant after an idle
    /// spell, or re-plan it every [`GRANT_EVERY`] forwards; then take over (or hand back) every
    /// session the grant or its pace says should change hands. Returns the events of those
    /// changes and how many were takeovers.
    pub fn turn<T: Target>(&mut self, now_ms: u64, v: &mut Verifier<T>) -> (Vec<Event>, usize) {
        if now_ms.saturating_sub(self.last_forward_ms) >= IDLE_RELAX_MS {
            self.last_forward_ms = now_ms;
            v.stats.tokens_per_forward = 0.0;
            self.grants.grant(0.0);
        } else if v.stats.target_forwards >= self.graded_at + GRANT_EVERY {
            self.graded_at = v.stats.target_forwards;
            let alpha = if self.judged_recent > 0.0 {
                self.accepted_recent / self.judged_recent
            } else {
                PRIOR_ALPHA
            };
            self.grants
                .grant_by_model(self.sessions.len(), alpha, v.stats.tokens_per_forward);
        }
        // Past the ridge every session is taken over (γ 0); below it, each one whose speculation
        // commits slower than cloud decoding would at this load.
        let (grant_g, _) = self.grants.current();
        let cloud_itl = self.grants.cloud_itl_ms(self.sessions.len());
        let (mut events, mut takeovers) = (Vec::new(), 0);
        for (&id, c) in self.sessions.iter_mut() {
            if c.want.is_none() {
                continue;
            }
            let cloud = grant_g == 0
                || cloud_itl.is_some_and(|i| prefer_cloud(c.pace.ms_per_token(), i, c.cloud));
            if c.cloud != cloud {
                c.cloud = cloud;
                c.pace.restart();
                takeovers += usize::from(cloud);
                events.extend(v.set_cloud_decode(id, cloud));
            }
        }
        (events, takeovers)
    }

    /// A forward of `tokens` tokens ended at `now_ms`, after `ms`.
    pub fn on_forward(&mut self, now_ms: u64, tokens: usize, ms: f64) {
        self.last_forward_ms = now_ms;
        self.grants.observe_forward(tokens, ms);
    }

    /// The grant within `want` at the current level (γ 0: the verifier decodes).
    fn grant_for(&self, want: (u32, u32)) -> (u32, u32) {
        let (g, d) = self.grants.current();
        if g == 0 {
            (0, 1)
        } else {
            (want.0.min(g).max(1), want.1.min(d).max(1))
        }
    }

    /// The grant to send with a speculation session's `Opened`.
    pub fn on_opened(&mut self, id: SessionId) -> (u32, u32) {
        let Some(want) = self.sessions.get(&id).map(|c| c.want) else {
            return (1, 1);
        };
        let g = self.grant_for(want.unwrap_or((1, 1)));
        if let Some(c) = self.sessions.get_mut(&id) {
            c.granted = g;
        }
        g
    }

    /// A verdict for `id` that judged `drafted` tokens is going out at `now_ms`: it carries a new
    /// grant when the session's changed, and feeds the α and the session's pace.
    pub fn on_verdict(
        &mut self,
        id: SessionId,
        verdict: &mut Verdict,
        drafted: usize,
        now_ms: u64,
    ) {
        let Some(want) = self.sessions.get(&id).map(|c| c.want) else {
            return;
        };
        if let Some(want) = want {
            let now = self.grant_for(want);
            let c = self.sessions.get_mut(&id).expect("invariant: present");
            if now != c.granted {
                verdict.grant = Some(now);
                c.granted = now;
            }
        }
        let accepted = verdict.accepted.min(drafted);
        if drafted > 0 {
            let judged = accepted + usize::from(accepted < drafted);
            self.accepted_recent = ALPHA_DECAY * self.accepted_recent + accepted as f64;
            self.judged_recent = ALPHA_DECAY * self.judged_recent + judged as f64;
        }
        let c = self.sessions.get_mut(&id).expect("invariant: present");
        if !c.cloud {
            c.pace.on_commit(now_ms, accepted + 1);
        }
    }

    /// A token the verifier decoded for `id` is going out; the last one (`handback`) carries the
    /// grant the edge resumes with.
    pub fn on_decoded(&mut self, id: SessionId, handback: bool, decoded: &mut Decoded) {
        if !handback {
            return;
        }
        let Some(want) = self.sessions.get(&id).map(|c| c.want) else {
            return;
        };
        let (g, d) = self.grant_for(want.unwrap_or((1, 1)));
        let resume = (g.max(1), d.max(1));
        decoded.resume = Some(resume);
        if let Some(c) = self.sessions.get_mut(&id) {
            c.granted = resume;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_engine::{EngineError, Logits, SamplingParams, SeqChunk};
    use tandem_sched::ForwardCost;
    use tandem_spec::VerifyRule;

    /// A target whose greedy token after position p is `p % 15 + 1`, each forward taking 1 ms.
    struct Flat;

    impl Target for Flat {
        fn vocab(&self) -> usize {
            16
        }
        fn context_len(&self) -> usize {
            4096
        }
        fn kv_geometry(&self) -> (usize, usize) {
            (16, 4096)
        }
        fn forward_timed(
            &mut self,
            batch: &[SeqChunk],
            _tables: &[Vec<u32>],
        ) -> (Result<Logits, EngineError>, u32) {
            let l = Logits::one_hot(batch, 16, |_, pos, _| ((pos + 1) % 15 + 1) as u32);
            (Ok(l), 1000)
        }
    }

    fn control() -> LoadControl {
        let cost = ForwardCost {
            one_token_ms: 44.0,
            ms_per_token: 2.2,
        };
        LoadControl::new(
            GrantPolicy::new(4, 2, 40.0)
                .with_cloud_decode()
                .with_pace(cost),
            0,
        )
    }

    fn open(v: &mut Verifier<Flat>, c: &mut LoadControl, id: SessionId) {
        let prompt = [3, 4, 5];
        v.open(
            id,
            0,
            &prompt,
            SamplingParams::default(),
            VerifyRule::Greedy,
            40,
            vec![],
        )
        .unwrap();
        c.open(id, Some((4, 2)));
    }

    #[test]
    fn a_crowd_is_taken_over_and_the_grant_relaxes_when_the_verifier_idles() {
        let mut v = Verifier::new(Flat, crate::VerifierConfig::default()).unwrap();
        let mut c = control();
        for id in 0..64 {
            open(&mut v, &mut c, id);
        }
        let (mut now, mut takeovers, mut n_decoded) = (0u64, 0, 0);
        for _ in 0..40 {
            let (events, t) = c.turn(now, &mut v);
            takeovers += t;
            for e in events.into_iter().chain(v.step(now)) {
                if let Event::Decoded {
                    session,
                    mut decoded,
                    handback,
                } = e
                {
                    c.on_decoded(session, handback, &mut decoded);
                    n_decoded += 1;
                }
            }
            c.on_forward(now + 1, v.stats.last_batch.1, 1.0);
            now += 1;
        }
        // 64 sessions of γ 4 are far past the ridge (≈ 20 tokens): γ 0, every one decoded by the
        // verifier.
        assert_eq!(c.grants().current(), (0, 1));
        assert_eq!(takeovers, 64);
        assert!((0..64).all(|id| c.is_cloud(id)));
        assert!(
            n_decoded >= 64,
            "every session got decoded tokens: {n_decoded}"
        );
        // Idle spells relax the grant a level each.
        let before = c.grants().current();
        for k in 1..=4 {
            c.turn(now + k * IDLE_RELAX_MS, &mut v);
        }
        assert_ne!(c.grants().current(), before, "relaxed");
        // A closed session no longer counts.
        c.close(3);
        assert!(!c.is_cloud(3));
    }

    #[test]
    fn verdicts_carry_a_grant_only_when_it_changed() {
        let mut c = control();
        c.open(1, Some((4, 2)));
        c.open(2, None);
        assert_eq!(
            c.on_opened(1),
            (4, 2),
            "an idle verifier grants what was asked"
        );
        let mut v = Verdict {
            epoch: 0,
            block: 0,
            accepted: 2,
            token: 5,
            verify_us: 1000,
            grant: None,
        };
        c.on_verdict(1, &mut v, 4, 10);
        assert_eq!(v.grant, None, "unchanged");
        // A cloud-only generation has no grant to carry.
        c.on_verdict(2, &mut v, 0, 10);
        assert_eq!(v.grant, None);
        let mut d = Decoded {
            epoch: 1,
            pos: 9,
            token: 3,
            resume: None,
        };
        c.on_decoded(1, false, &mut d);
        assert_eq!(d.resume, None);
        c.on_decoded(1, true, &mut d);
        assert_eq!(d.resume, Some((4, 2)), "handed back within the grant");
    }
}
