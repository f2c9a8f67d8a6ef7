//! The model of protocol 2's speculation (the verifier never idles a session), for one session on
//! an otherwise idle verifier.
//!
//! Think in runs again: a run starts when the verifier commits a token the edge's draft did not
//! have (a correction, or the first token at Open) and ends at the next one. Through a run the
//! verifier never waits: each forward it verifies the oldest block that has landed and reaches
//! past its committed tokens, or else decodes the session's next token itself. The edge learns
//! the run's first token half a round trip later, rolls back and drafts on from it, feeding in
//! one forward whatever the verifier streamed meanwhile. Its first blocks therefore land behind
//! the verifier, covered; only when the edge, drafting faster than the verifier decodes, has
//! caught up do its blocks reach past the committed tokens and commit several tokens a forward.
//! From then on the session is paced by the edge. So a run of K tokens the draft gets right
//! costs `S(K + 1)`, where `S(j)` is the time at which an endless run commits its j-th token —
//! never later than `j` decode forwards, which is cloud-only's pace.
//!
//! `S` is computed by stepping the schedule once (blocks of γ, at most `depth` plus the lead in
//! blocks in flight); the run lengths are geometric in α as in [`crate::policy`], and a session
//! of n tokens is the same recursion over the tokens left.
//!
//! Drafts that copy ([`crate::suffix`]) enter in two places. The verifier's own guesses make each
//! of its decode forwards commit more than one token: a share of the positions lies in spans the
//! session's text already holds, where it feeds `guesses` guesses, each right with the copied
//! spans' acceptance ([`Copying`]); the schedule's decodes commit and compute that many on
//! average. The edge's copies cost it no forward: its draft time per token is the model's times
//! the share of its tokens the model drafts, and its α is the mix of both sources' (the caller's
//! [`Costs`]).

use crate::policy::Costs;

/// Longest session the recursion runs over; a longer one is computed as this long (its start,
/// the one run that begins with an idle edge, is well under 1% of it).
const SESSION_MAX: usize = 2048;

/// A forward of the session that computes `positions` positions.
fn positions_ms(c: &Costs, positions: f64) -> f64 {
    c.verify_ms + c.verify_ms_per_token * positions
}

/// The verifier's own drafts while it decodes a session alone: `share` of the positions lie in
/// copied spans (the session's text holds them already), where it feeds `guesses` guesses, each
/// right with probability `alpha` once the ones before it were. None outside them.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Copying {
    pub share: f64,
    pub alpha: f64,
    pub guesses: usize,
}

impl Copying {
    /// No guesses: one token a decode.
    pub const NONE: Copying = Copying {
        share: 0.0,
        alpha: 0.0,
        guesses: 0,
    };

    /// Tokens a decode forward commits on average: `1 + share · (α + α² + … + α^guesses)`.
    pub fn tokens_per_decode(&self) -> f64 {
        let a = self.alpha.clamp(0.0, 1.0);
        let run: f64 = (1..=self.guesses as i32).map(|i| a.powi(i)).sum();
        1.0 + self.share.clamp(0.0, 1.0) * run
    }

    /// Positions a decode forward computes on average: `1 + share · guesses`.
    pub fn positions_per_decode(&self) -> f64 {
        1.0 + self.share.clamp(0.0, 1.0) * self.guesses as f64
    }

    /// The copying that gives a run's measured rates: `tokens` and `positions` per decode
    /// forward, with at most `guesses` guesses in a copied span (the share from the positions,
    /// then the acceptance that gives the tokens).
    pub fn from_rates(tokens: f64, positions: f64, guesses: usize) -> Copying {
        let k = guesses.max(1);
        let share = ((positions - 1.0) / k as f64).clamp(0.0, 1.0);
        let mut c = Copying {
            share,
            alpha: 0.0,
            guesses: k,
        };
        if share <= 0.0 {
            return Copying::NONE;
        }
        let (mut lo, mut hi) = (0.0f64, 1.0f64);
        for _ in 0..60 {
            c.alpha = (lo + hi) / 2.0;
            if c.tokens_per_decode() < tokens {
                lo = c.alpha;
            } else {
                hi = c.alpha;
            }
        }
        c
    }
}

/// Cloud-only's ITL when the verifier drafts for the session as `copying` says: a decode forward
/// per `tokens_per_decode` tokens.
pub fn cloud_only_itl_ms(c: &Costs, copying: &Copying) -> f64 {
    positions_ms(c, copying.positions_per_decode()) / copying.tokens_per_decode()
}

/// An endless run's schedule, per committed token `j` (from 0): when it is committed, and the
/// positions the verifier computed for the session and the forwards it ran for it by then (a
/// decode is one position, a block's verification its new tokens plus the last committed one).
#[derive(Debug, Clone, Default)]
pub struct Schedule {
    pub commit: Vec<f64>,
    pub positions: Vec<f64>,
    pub forwards: Vec<f64>,
}

/// The schedule `S(1..=n)` of an endless run that starts with a token committed at time 0, with
/// the edge `reaction` ms late to act on it (busy in a draft forward).
pub fn run_schedule(c: &Costs, gamma: usize, depth: usize, n: usize, reaction: f64) -> Schedule {
    run_schedule_copying(c, gamma, depth, n, reaction, &Copying::NONE)
}

/// [`run_schedule`] with the verifier's own drafts in its decodes (`copying`): decoding alone,
/// it commits a token per `positions_ms(positions per decode) / tokens per decode` (the fluid
/// limit of decodes that commit several tokens: the runs stay the draft's, and a correction
/// still starts one).
pub fn run_schedule_copying(
    c: &Costs,
    gamma: usize,
    depth: usize,
    n: usize,
    reaction: f64,
    copying: &Copying,
) -> Schedule {
    let per_decode = copying.tokens_per_decode();
    let decode_positions = copying.positions_per_decode() / per_decode;
    let g = gamma.max(1);
    let half = c.rtt_ms / 2.0;
    let decode = cloud_only_itl_ms(c, copying);
    // The verifier's lead in tokens when a block lands: the edge keeps that much more in flight.
    let lead = (c.rtt_ms / decode).ceil() as usize;
    let max_in_flight =
        (depth.max(1) + lead.div_ceil(g)).min(crate::pipeline::MAX_BLOCKS_IN_FLIGHT);
    let step = c.draft_ms.max(1e-3) + c.verdict_ms;

    // Verifier state: committed tokens of the run, the time its current forward ends, the
    // positions and forwards so far.
    let mut commit = Vec::with_capacity(n);
    let (mut positions, mut forwards) = (Vec::with_capacity(n), Vec::with_capacity(n));
    let mut v_time = 0.0f64;
    let (mut v_positions, mut v_forwards) = (0.0f64, 0.0f64);
    // Edge state: drafted frontier, tokens sent, its clock; blocks: (end, landing time).
    let mut e_time = half + reaction;
    let (mut drafted, mut sent) = (0usize, 0usize);
    let mut blocks: Vec<(usize, f64)> = Vec::new();
    let mut next_block = 0;
    // Commits the edge has heard of (each reaches it half a round trip after), and the blocks
    // those answer: both only grow, as its clock does.
    let (mut known, mut answered) = (0usize, 0usize);
    while commit.len() < n {
        // Let the edge work until the verifier's next forward starts.
        while e_time <= v_time {
            while commit.get(known).is_some_and(|&t| t + half <= e_time) {
                known += 1;
            }
            while blocks.get(answered).is_some_and(|&(end, _)| end <= known) {
                answered += 1;
            }
            let flying = blocks.len() - answered;
            if flying >= max_in_flight && drafted >= known {
                // Full: wait for the next commit to reach it.
                match commit.get(known) {
                    Some(&t) => e_time = e_time.max(t + half),
                    None => break,
                }
                continue;
            }
            // A forward feeds what was streamed past its tail, and drafts one token.
            drafted = drafted.max(known) + 1;
            sent = sent.max(known);
            e_time += step;
            if drafted - sent >= g {
                sent = drafted;
                blocks.push((drafted, e_time + half));
            }
        }
        // The verifier plans its forward at v_time: the oldest landed block reaching past it.
        let j = commit.len();
        while next_block < blocks.len() && blocks[next_block].0 <= j {
            next_block += 1; // covered
        }
        let usable = blocks
            .get(next_block)
            .filter(|&&(_, land)| land <= v_time)
            .map(|&(end, _)| end);
        let (fed, fresh, share, ms) = match usable {
            Some(end) => {
                next_block += 1;
                let fed = (end - j + 1) as f64;
                (fed, end - j + 1, 1.0, positions_ms(c, fed))
            }
            // Decoding alone: a token's share of a decode (its guesses included).
            None => (decode_positions, 1, 1.0 / per_decode, decode),
        };
        v_time += ms;
        v_positions += fed;
        v_forwards += share;
        for _ in 0..fresh.min(n - commit.len()) {
            commit.push(v_time);
            positions.push(v_positions);
            forwards.push(v_forwards);
        }
    }
    Schedule {
        commit,
        positions,
        forwards,
    }
}

/// Expected inter-token latency of a session that commits `tokens` tokens after its first.
pub fn session_itl_ms(c: &Costs, gamma: usize, depth: usize, tokens: usize) -> f64 {
    session_itl_ms_copying(c, gamma, depth, tokens, &Copying::NONE)
}

/// [`session_itl_ms`] with the verifier's own drafts in its decodes ([`Copying`]).
pub fn session_itl_ms_copying(
    c: &Costs,
    gamma: usize,
    depth: usize,
    tokens: usize,
    copying: &Copying,
) -> f64 {
    let n = tokens.clamp(1, SESSION_MAX);
    let a = c.alpha.clamp(0.0, 1.0);
    let first = run_schedule_copying(c, gamma, depth, n, 0.0, copying).commit;
    let later = run_schedule_copying(c, gamma, depth, n, c.draft_ms / 2.0, copying).commit;
    // P(K = k) for k tokens the draft gets right before the next correction, and P(K ≥ k).
    let p = |k: usize| (1.0 - a) * a.powi(k as i32);
    let at_least = |k: usize| a.powi(k as i32);
    // t[m]: expected time to commit m more tokens from the start of a (later) run.
    let expect = |m: usize, s: &[f64], t: &[f64]| {
        let mut e = 0.0;
        for k in 0..m {
            e += p(k) * (s[k] + t[m - k - 1]);
        }
        e + at_least(m) * s[m - 1]
    };
    let mut t = vec![0.0f64; n + 1];
    for m in 1..n {
        t[m] = expect(m, &later, &t);
    }
    expect(n, &first, &t) / n as f64
}

/// What an endless session costs in the steady state.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Steady {
    /// Mean gap between committed tokens.
    pub itl_ms: f64,
    /// Positions the verifier computes for the session per forward (its chunk: 1 for a decode).
    pub positions_per_forward: f64,
    /// Tokens committed per forward of the session.
    pub tokens_per_forward: f64,
}

/// The steady state of an endless session, by renewal: runs of K + 1 tokens (K geometric in α)
/// follow one another, each costing `S(K + 1)` from its start, so the ITL is
/// `E[S(K + 1)] / E[K + 1]`, and the positions and forwards likewise. Runs longer than
/// [`SESSION_MAX`] are counted at the rates the schedule ends with. One schedule and a sum:
/// cheap enough for the edge to re-plan with at every verdict.
pub fn steady(c: &Costs, gamma: usize, depth: usize) -> Steady {
    steady_copying(c, gamma, depth, &Copying::NONE)
}

/// [`steady`] with the verifier's own drafts in its decodes ([`Copying`]).
pub fn steady_copying(c: &Costs, gamma: usize, depth: usize, copying: &Copying) -> Steady {
    let a = c.alpha.clamp(0.0, 1.0);
    let tokens = if a < 1.0 - 1e-12 {
        1.0 / (1.0 - a)
    } else {
        f64::INFINITY
    };
    // Only as long a schedule as the runs need (P(K ≥ n) below 1e-9), at most SESSION_MAX.
    let n = if a <= 0.0 {
        1
    } else if !tokens.is_finite() {
        SESSION_MAX
    } else {
        ((1e-9f64.ln() / a.ln()).ceil() as usize).clamp(2, SESSION_MAX)
    };
    let s = run_schedule_copying(c, gamma, depth, n, c.draft_ms / 2.0, copying);
    // The final rate of each (per token), over the schedule's last quarter (commits come a block
    // at a time).
    let w = (n / 4).max(1);
    let rate = |v: &[f64]| {
        if n > w {
            (v[n - 1] - v[n - 1 - w]) / w as f64
        } else {
            v[0]
        }
    };
    let mean = |v: &[f64]| {
        if !tokens.is_finite() {
            return rate(v);
        }
        let mut e = 0.0;
        let mut p = 1.0 - a; // P(K = k)
        for &x in v {
            e += p * x;
            p *= a;
        }
        // P(K ≥ n) = aⁿ: those runs reach v(n), then go on at the final rate for K + 1 − n more
        // tokens (1/(1 − α) on average past the n-th).
        e += a.powi(n as i32) * (v[n - 1] + rate(v) * tokens);
        e / tokens
    };
    let (time, positions, forwards) = (mean(&s.commit), mean(&s.positions), mean(&s.forwards));
    Steady {
        itl_ms: time,
        positions_per_forward: positions / forwards,
        tokens_per_forward: 1.0 / forwards,
    }
}

/// Steady-state ITL ([`steady`]).
pub fn itl_ms(c: &Costs, gamma: usize, depth: usize) -> f64 {
    steady(c, gamma, depth).itl_ms
}

/// The γ (≤ `max_gamma`) and depth (≤ `max_depth`) with the lowest steady-state ITL, and that
/// ITL (ties go to the shorter block, then the shallower pipeline: less drafting wasted).
pub fn best_shape(c: &Costs, max_gamma: usize, max_depth: usize) -> (usize, usize, f64) {
    let mut best = (1, 1, f64::MAX);
    for g in 1..=max_gamma.max(1) {
        for d in 1..=max_depth.max(1) {
            let t = itl_ms(c, g, d);
            if t < best.2 * (1.0 - 1e-9) {
                best = (g, d, t);
            }
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    fn costs(alpha: f64, draft_ms: f64, rtt_ms: f64) -> Costs {
        Costs {
            alpha,
            draft_ms,
            verify_ms: 50.0,
            verify_ms_per_token: 0.0,
            rtt_ms,
            verdict_ms: 0.0,
        }
    }

    #[test]
    fn a_draft_slower_than_the_verifiers_decode_leaves_cloud_only_pace() {
        for rtt in [0.0, 100.0, 200.0] {
            let itl = session_itl_ms(&costs(0.9, 80.0, rtt), 4, 2, 48);
            assert!((itl - 50.0).abs() < 1e-9, "rtt {rtt}: {itl}");
        }
        // A useless draft, however fast, too.
        let itl = session_itl_ms(&costs(0.0, 5.0, 100.0), 4, 2, 48);
        assert!((itl - 50.0).abs() < 1e-9, "{itl}");
    }

    #[test]
    fn a_perfect_fast_draft_is_paced_by_the_edge_once_caught_up() {
        // α 1: one run; the edge drafts 20 ms tokens, the verifier decodes in 50 ms (and verifies
        // at most a block a forward: γ new tokens, the bonus being the next block's first).
        // Deep enough that the blocks in flight cover the round trip (else it is Little's law:
        // tokens in flight over the time a block takes to be answered).
        let s = run_schedule(&costs(1.0, 20.0, 100.0), 4, 8, 400, 0.0).commit;
        assert!(s.windows(2).all(|w| w[0] <= w[1]));
        // It starts at the verifier's pace ...
        assert_eq!(s[0], 50.0);
        // ... and ends at the edge's: 100 tokens take about 100 draft forwards.
        let late = (s[399] - s[299]) / 100.0;
        assert!((late - 20.0).abs() < 1.0, "{late}");
        // Never behind cloud-only.
        assert!(s
            .iter()
            .enumerate()
            .all(|(j, &t)| t <= 50.0 * (j + 1) as f64));
    }

    #[test]
    fn the_steady_state_is_the_long_sessions_itl() {
        for (alpha, draft, rtt) in [(0.0, 10.0, 50.0), (0.67, 14.0, 100.0), (0.96, 19.0, 200.0)] {
            let c = costs(alpha, draft, rtt);
            for (g, d) in [(1, 1), (4, 2), (8, 4)] {
                let (steady, long) = (itl_ms(&c, g, d), session_itl_ms(&c, g, d, SESSION_MAX));
                assert!(
                    (steady / long - 1.0).abs() < 0.01,
                    "α {alpha} γ {g} d {d}: {steady} against {long}"
                );
            }
        }
        // α 1: the edge's pace, once caught up: a block of 4 a forward, bonus included.
        let s = steady(&costs(1.0, 20.0, 100.0), 4, 8);
        assert!((s.itl_ms - 20.0).abs() < 0.5, "{s:?}");
        // A useless draft: the verifier decodes, one position and one token a forward.
        let s = steady(&costs(0.0, 20.0, 100.0), 4, 2);
        assert_eq!((s.positions_per_forward, s.tokens_per_forward), (1.0, 1.0));
    }

    #[test]
    fn the_verifiers_own_guesses_commit_their_mean_per_decode() {
        let k = Copying {
            share: 0.5,
            alpha: 0.8,
            guesses: 4,
        };
        let per = 1.0 + 0.5 * (0.8 + 0.64 + 0.512 + 0.4096);
        assert!((k.tokens_per_decode() - per).abs() < 1e-12);
        assert_eq!(k.positions_per_decode(), 3.0);
        // The rates give back the copying.
        let back = Copying::from_rates(per, 3.0, 4);
        assert!((back.share - 0.5).abs() < 1e-12 && (back.alpha - 0.8).abs() < 1e-9);
        // A useless draft: the verifier alone, at `per` tokens a decode of 3 positions.
        let c = Costs {
            verify_ms_per_token: 2.0,
            ..costs(0.0, 20.0, 100.0)
        };
        let want = (50.0 + 2.0 * 3.0) / per;
        assert!((cloud_only_itl_ms(&c, &k) - want).abs() < 1e-9);
        let itl = session_itl_ms_copying(&c, 4, 2, 400, &k);
        assert!((itl / want - 1.0).abs() < 0.02, "{itl} against {want}");
        // Without guesses, the plain model.
        assert_eq!(
            session_itl_ms_copying(&c, 4, 2, 48, &Copying::NONE),
            session_itl_ms(&c, 4, 2, 48)
        );
        // With a good draft at a long round trip, the guesses fill the verifier's decodes after
        // each correction: faster than either alone.
        let c = costs(0.8, 15.0, 200.0);
        let both = session_itl_ms_copying(&c, 4, 2, 200, &k);
        assert!(both < session_itl_ms(&c, 4, 2, 200) && both < cloud_only_itl_ms(&c, &k));
    }

    #[test]
    fn a_longer_round_trip_costs_a_correction_more_cloud_paced_tokens() {
        let itl = |rtt| session_itl_ms(&costs(0.9, 15.0, rtt), 4, 2, 200);
        let (near, far) = (itl(0.0), itl(200.0));
        assert!(near < far && far < 50.0, "{near} {far}");
    }

    /// What the README says the model gives against a 46 ms cloud-only ITL, best shape over
    /// γ ≤ 8 and depth ≤ 4, for 48-token answers: the inputs and this machine's.
    #[test]
    fn the_readmes_ratios_to_cloud_only_follow_from_these_inputs() {
        let ratio = |alpha: f64, draft_ms: f64, rtt_ms: f64| {
            let c = Costs {
                verify_ms: 46.0,
                verdict_ms: 0.5,
                ..costs(alpha, draft_ms, rtt_ms)
            };
            let best = (1..=8)
                .flat_map(|g| (1..=4).map(move |d| (g, d)))
                .map(|(g, d)| session_itl_ms(&c, g, d, 47))
                .fold(f64::MAX, f64::min);
            (best / 46.0 * 100.0).round() / 100.0
        };
        let cases = [
            // The issue's: α 0.76 with 13 ms drafts; the 8-bit draft at 10 ms.
            ((0.76, 13.0), (0.85, 0.95)),
            ((0.96, 10.0), (0.44, 0.54)),
            // This machine's: α 0.67 on the bench's prompts; the 8-bit draft at 19 ms.
            ((0.67, 13.0), (0.92, 0.98)),
            ((0.96, 18.6), (0.61, 0.70)),
        ];
        for ((alpha, draft), (at100, at200)) in cases {
            assert_eq!(
                (ratio(alpha, draft, 100.0), ratio(alpha, draft, 200.0)),
                (at100, at200),
                "α {alpha}, {draft} ms drafts"
            );
        }
    }
}
