//! The analytic model of protocol 1's speculation (the verifier waits for the edge's blocks),
//! which the capacity model and the benches' synchronous rows still use, and the running
//! estimates of its inputs that the edge's policy plans with (by protocol 2's model:
//! [`crate::never_idle`]).
//!
//! With per-token acceptance rate α and γ drafted tokens per block, the tokens committed per verify
//! round are `E[A] = (1 − α^(γ+1)) / (1 − α)` (accepted prefix plus the cloud's token).
//! Synchronous speculation pays every round in full: `T_sync = γ·T_draft + T_net + T_verify(γ)`.
//! Asynchronous speculation overlaps the stages: while blocks are accepted whole the edge commits a
//! block per `max(γ·T_draft, T_verify)` (with enough depth to cover the round trip); a rejection
//! flushes the pipeline and the next verdict is a full round away again.

use std::collections::VecDeque;

use serde::Serialize;

/// Measured inputs of the model (milliseconds).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Costs {
    /// Greedy acceptance rate per drafted token.
    pub alpha: f64,
    /// Draft time per token.
    pub draft_ms: f64,
    /// Verify time of a block: fixed part plus per-token part.
    pub verify_ms: f64,
    pub verify_ms_per_token: f64,
    /// Network round trip.
    pub rtt_ms: f64,
    /// The edge's own work per verdict outside draft forwards: handling the verdict, rolling the
    /// draft back, sending the next block. It runs on the drafting thread, so it adds to the
    /// drafting stage.
    pub verdict_ms: f64,
}

/// Expected tokens committed per verify round with γ drafted tokens.
pub fn expected_accepted(alpha: f64, gamma: usize) -> f64 {
    if (1.0 - alpha).abs() < 1e-12 {
        return gamma as f64 + 1.0;
    }
    (1.0 - alpha.powi(gamma as i32 + 1)) / (1.0 - alpha)
}

/// Token trees in the model: the per-token acceptance a linear draft would need to commit as many
/// tokens per run as a draft of acceptance `alpha` whose lanes hold the target's token at `cover`
/// of its misses.
///
/// A lane goes on across blocks as long as it lives (see `pipeline::lanes`): when a commit picks
/// it, the blocks behind already carry it and the run goes on as after a hit. So a covered miss
/// is a hit, `α' = α + (1 − α) · cover`. What the lanes cost is in the draft's forward time (one
/// token more per lane in every forward) and in the verifier's positions.
pub fn lane_alpha(alpha: f64, cover: f64) -> f64 {
    let a = alpha.clamp(0.0, 1.0);
    a + (1.0 - a) * cover.clamp(0.0, 1.0)
}

fn verify_time(c: &Costs, gamma: usize) -> f64 {
    c.verify_ms + c.verify_ms_per_token * (gamma + 1) as f64
}

/// The edge's time per block: γ draft forwards and the handling of the block's verdict.
fn draft_stage(c: &Costs, gamma: usize) -> f64 {
    gamma as f64 * c.draft_ms + c.verdict_ms
}

/// One synchronous round: draft γ, send, verify, answer, handle the answer.
pub fn sync_round_ms(c: &Costs, gamma: usize) -> f64 {
    draft_stage(c, gamma) + c.rtt_ms + verify_time(c, gamma)
}

/// Expected inter-token latency of synchronous speculation.
pub fn sync_itl_ms(c: &Costs, gamma: usize) -> f64 {
    sync_round_ms(c, gamma) / expected_accepted(c.alpha, gamma)
}

/// Expected inter-token latency of asynchronous speculation with γ and `depth` blocks in flight
/// (`depth` 1 is synchronous speculation).
///
/// Think in runs: a run starts when a correction is known and ends at the next rejected token.
/// The edge drafts on without waiting, so after the run's first verdict (a full round away, plus
/// the rest of the draft forward the edge was running when the correction came: half of one on
/// average when it was busy) one verdict arrives per pipeline period
/// `max(γ·T_draft, T_verify, round / depth)`. A run of K accepted tokens (K geometric with
/// parameter α) commits K + 1 tokens and ends at the verdict of block ⌊K/γ⌋ — one block earlier
/// when the rejected token opens its block, because the previous verdict's bonus already tells the
/// edge that its next drafted token is wrong.
pub fn async_itl_ms(c: &Costs, gamma: usize, depth: usize) -> f64 {
    if depth <= 1 {
        return sync_itl_ms(c, gamma);
    }
    let a = c.alpha.clamp(0.0, 1.0);
    let g = gamma.max(1);
    let p = pipelined(c, g, depth);
    if a > 1.0 - 1e-9 {
        return p.period / g as f64;
    }
    // Periods after the run's first verdict until the rejection is seen.
    let extra = verdicts_per_run(a, g) - 1.0;
    let tokens = 1.0 / (1.0 - a);
    (p.round + p.reaction + p.period * extra) / tokens
}

/// The times of the pipelined schedule at γ and depth: a full round (the first verdict of a
/// run), the period between later verdicts, and the reaction delay after a correction (half a
/// draft forward, when the edge was busy drafting).
struct Pipelined {
    round: f64,
    period: f64,
    reaction: f64,
}

fn pipelined(c: &Costs, gamma: usize, depth: usize) -> Pipelined {
    let round = sync_round_ms(c, gamma);
    let period = draft_stage(c, gamma)
        .max(verify_time(c, gamma))
        .max(round / depth.max(1) as f64);
    let busy = (draft_stage(c, gamma) / period).min(1.0);
    Pipelined {
        round,
        period,
        reaction: busy * c.draft_ms / 2.0,
    }
}

/// Verdicts until a pipelined run of k accepted tokens (then a rejection) shows the rejection:
/// block ⌊k/γ⌋'s, one earlier when the rejected token opens its block. The same count is the
/// verdicts that commit k + 1 tokens: after j accepted verdicts j·γ + 1 tokens are known (each
/// verdict's bonus token is the next block's first).
fn run_verdicts(k: usize, gamma: usize) -> usize {
    k / gamma + 1 - usize::from(k >= gamma && k.is_multiple_of(gamma))
}

/// Sessions longer than this use the steady-state ITL (the finite-session correction is below
/// 1% there and its recursion grows with the square of the length).
const SESSION_DP_MAX: usize = 2048;

/// Expected ITL over a session that commits `tokens` tokens after its first (which comes with the
/// prompt's prefill), rather than in the steady state of an endless one.
///
/// A short session pays for its start: the first block's verdict is a full round away, as after a
/// rejection, so a session of n tokens holds about one run more than n·(1 − α). It also ends
/// inside a run, whose later blocks it does not wait for. With α 0.96 and 47 gaps that is a
/// third more runs than the steady state counts. The recursion runs over the tokens left:
/// `T(m) = Σₖ P(K = k)·(run(k) + T(m − k − 1))`, with the run that reaches m cut at its last
/// needed verdict; synchronous rounds the same way (each commits min(K + 1, γ + 1) tokens).
pub fn session_itl_ms(c: &Costs, gamma: usize, depth: usize, tokens: usize) -> f64 {
    if tokens == 0 || tokens > SESSION_DP_MAX {
        return async_itl_ms(c, gamma, depth);
    }
    let a = c.alpha.clamp(0.0, 1.0);
    let g = gamma.max(1);
    let round = sync_round_ms(c, g);
    // P(K = k) for k accepted tokens before the first rejection, and P(K ≥ k).
    let p = |k: usize| (1.0 - a) * a.powi(k as i32);
    let at_least = |k: usize| a.powi(k as i32);
    let mut t = vec![0.0f64; tokens + 1];
    if depth <= 1 {
        for m in 1..=tokens {
            let mut e = 0.0;
            for k in 0..g {
                e += p(k) * (round + t[m.saturating_sub(k + 1)]);
            }
            e += at_least(g) * (round + t[m.saturating_sub(g + 1)]);
            t[m] = e;
        }
        return t[tokens] / tokens as f64;
    }
    let pipe = pipelined(c, g, depth);
    // Time of a run of k accepted tokens (then a rejection). The run that reaches the session's
    // m-th token ends at the verdict that commits it: the one a rejection there would show.
    let run = |k: usize, react: f64| round + react + pipe.period * (run_verdicts(k, g) - 1) as f64;
    let expect = |m: usize, react: f64, t: &[f64]| {
        let mut e = 0.0;
        for k in 0..m {
            e += p(k) * (run(k, react) + t[m - k - 1]);
        }
        e + at_least(m) * run(m - 1, react)
    };
    for m in 1..tokens {
        t[m] = expect(m, pipe.reaction, &t);
    }
    // The session's first run starts from an idle edge: no reaction delay.
    expect(tokens, 0.0, &t) / tokens as f64
}

/// Expected verdicts in a pipelined run (α < 1, γ ≥ 1): the first, plus one per block until the
/// one that shows the rejection — block ⌊K/γ⌋ for K accepted tokens (K geometric: P(K = k) =
/// (1 − α)·αᵏ), one earlier when the rejected token opens its block (the previous verdict's bonus
/// already showed it). In closed form: E⌊K/γ⌋ = αᵞ/(1 − αᵞ), less P(K ≥ γ, γ | K) =
/// (1 − α)·αᵞ/(1 − αᵞ).
pub fn verdicts_per_run(alpha: f64, gamma: usize) -> f64 {
    let (a, g) = (alpha.clamp(0.0, 1.0 - 1e-12), gamma.max(1) as i32);
    let ag = a.powi(g);
    1.0 + a * ag / (1.0 - ag)
}

/// Running estimates of the model's inputs, from what the edge observes: its own draft forwards,
/// and for each verdict the time from sending the block to the verdict's arrival and the verifier's
/// forward time (`Verdict::verify_us`). Pure: the caller measures the times.
#[derive(Debug, Clone)]
pub struct Estimator {
    prior: Costs,
    draft_ms: Option<f64>,
    verify_ms: Option<f64>,
    /// Recent samples of (arrival − send − verify): the network plus any queueing and the edge's
    /// reaction delay; the smallest recent one is the round trip.
    net: VecDeque<f64>,
    /// The edge's work outside draft forwards so far (ms), and the verdicts it handled.
    edge_work: (f64, usize),
}

/// Weight of the newest sample in the running means.
const EWMA: f64 = 0.2;
/// Samples kept for the round-trip minimum.
const NET_WINDOW: usize = 16;
/// Pseudo-observations of the prior α (keeps the first few verdicts from swinging the plan).
const ALPHA_PRIOR_WEIGHT: f64 = 8.0;

impl Estimator {
    pub fn new(prior: Costs) -> Self {
        Self {
            prior,
            draft_ms: None,
            verify_ms: None,
            net: VecDeque::new(),
            edge_work: (0.0, 0),
        }
    }

    /// The edge spent `ms` outside draft forwards and waiting, handling `verdicts` verdicts.
    pub fn on_edge_work(&mut self, ms: f64, verdicts: usize) {
        self.edge_work.0 += ms.max(0.0);
        self.edge_work.1 += verdicts;
    }

    /// The edge's work outside draft forwards per verdict so far (`None` before the first).
    pub fn edge_ms_per_verdict(&self) -> Option<f64> {
        let (ms, n) = self.edge_work;
        (n > 0).then(|| ms / n as f64)
    }

    fn ewma(slot: &mut Option<f64>, x: f64) {
        *slot = Some(slot.map_or(x, |m| m + EWMA * (x - m)));
    }

    /// One draft forward took `ms`.
    pub fn on_draft(&mut self, ms: f64) {
        Self::ewma(&mut self.draft_ms, ms);
    }

    /// A verdict arrived `round_trip_ms` after its block was sent; the verifier's forward took
    /// `verify_ms` (0: it needed none).
    pub fn on_verdict(&mut self, round_trip_ms: f64, verify_ms: f64) {
        if verify_ms > 0.0 {
            Self::ewma(&mut self.verify_ms, verify_ms);
        }
        if self.net.len() == NET_WINDOW {
            self.net.pop_front();
        }
        self.net.push_back((round_trip_ms - verify_ms).max(0.0));
    }

    /// The current estimate; α blends the prior with the accepted / judged counts so far.
    pub fn costs(&self, accepted: usize, judged: usize) -> Costs {
        let alpha = (accepted as f64 + self.prior.alpha * ALPHA_PRIOR_WEIGHT)
            / (judged as f64 + ALPHA_PRIOR_WEIGHT);
        Costs {
            alpha,
            draft_ms: self.draft_ms.unwrap_or(self.prior.draft_ms),
            verify_ms: self.verify_ms.unwrap_or(self.prior.verify_ms),
            verify_ms_per_token: if self.verify_ms.is_some() {
                0.0
            } else {
                self.prior.verify_ms_per_token
            },
            rtt_ms: self
                .net
                .iter()
                .copied()
                .reduce(f64::min)
                .unwrap_or(self.prior.rtt_ms),
            verdict_ms: self.edge_ms_per_verdict().unwrap_or(self.prior.verdict_ms),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn costs(alpha: f64, rtt: f64) -> Costs {
        Costs {
            alpha,
            draft_ms: 15.0,
            verify_ms: 30.0,
            verify_ms_per_token: 2.0,
            rtt_ms: rtt,
            verdict_ms: 0.0,
        }
    }

    #[test]
    fn the_edges_work_per_verdict_lengthens_the_drafting_stage() {
        let c = costs(0.9, 50.0);
        let busy = Costs {
            verdict_ms: 5.0,
            ..c
        };
        assert!((sync_round_ms(&busy, 4) - sync_round_ms(&c, 4) - 5.0).abs() < 1e-9);
        // Drafting-bound (period = γ·draft + handling): a perfect draft slows by 5 ms a block.
        let (p0, p1) = (Costs { alpha: 1.0, ..c }, Costs { alpha: 1.0, ..busy });
        let d = async_itl_ms(&p1, 4, 8) - async_itl_ms(&p0, 4, 8);
        assert!((d - 5.0 / 4.0).abs() < 1e-9, "{d}");
    }

    /// Monte Carlo of a session: runs of K accepted tokens (geometric), timed by the model's own
    /// rules (a full round, then a period per further verdict; sync: a round per block). It checks
    /// the recursion's bookkeeping (which run ends the session, the first run's missing reaction
    /// delay), not the rules themselves: the benchmarks check those against measurements.
    fn monte_carlo(c: &Costs, gamma: usize, depth: usize, tokens: usize, n: usize) -> f64 {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut uniform = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 11) as f64 / (1u64 << 53) as f64
        };
        let Pipelined {
            round,
            period,
            reaction,
        } = pipelined(c, gamma, depth);
        let mut total = 0.0;
        for _ in 0..n {
            let (mut left, mut first) = (tokens, true);
            while left > 0 {
                let mut k = 0;
                while uniform() < c.alpha {
                    k += 1;
                }
                if depth <= 1 {
                    total += round;
                    left = left.saturating_sub(k.min(gamma) + 1);
                    continue;
                }
                total += round + if first { 0.0 } else { reaction };
                first = false;
                // The run commits k + 1 tokens, or ends the session at its last token.
                let needed = run_verdicts(k.min(left - 1), gamma);
                total += period * (needed - 1) as f64;
                left = left.saturating_sub(k + 1);
            }
        }
        total / (n * tokens) as f64
    }

    #[test]
    fn short_sessions_pay_for_their_start() {
        for (a, g, d) in [(0.96, 3, 3), (0.7, 2, 3), (0.96, 4, 1), (0.6, 2, 1)] {
            let c = costs(a, 50.0);
            let s = session_itl_ms(&c, g, d, 47);
            let mc = monte_carlo(&c, g, d, 47, 100_000);
            assert!(
                (s - mc).abs() < 0.01 * mc,
                "α {a} γ {g} depth {d}: {s} vs {mc}"
            );
            // Long sessions approach the steady state.
            let steady = if d <= 1 {
                sync_itl_ms(&c, g)
            } else {
                async_itl_ms(&c, g, d)
            };
            let long = session_itl_ms(&c, g, d, 2000);
            assert!((long - steady).abs() < 0.01 * steady, "{long} vs {steady}");
        }
        // A good draft's pipeline is hurt most: its few runs each pay a full round (here 11%).
        let c = costs(0.96, 50.0);
        let (short, steady) = (session_itl_ms(&c, 3, 3, 47), async_itl_ms(&c, 3, 3));
        assert!(short > 1.08 * steady, "{short} vs {steady}");
        // No length given: the steady state (powi may round differently where it is inlined).
        assert!((session_itl_ms(&c, 3, 3, 0) - steady).abs() < 1e-9 * steady);
    }

    #[test]
    fn a_lane_that_covers_a_miss_counts_as_a_hit() {
        // α 0.85, lanes covering 60% of misses: α 0.94, runs of 16.7 tokens instead of 6.7.
        let a = lane_alpha(0.85, 0.6);
        assert!((a - 0.94).abs() < 1e-12, "{a}");
        assert_eq!(lane_alpha(0.85, 0.0), 0.85);
        assert_eq!(lane_alpha(0.85, 1.0), 1.0);
    }

    #[test]
    fn expected_accepted_matches_the_closed_form_edges() {
        assert!((expected_accepted(0.0, 4) - 1.0).abs() < 1e-12);
        assert!((expected_accepted(1.0, 4) - 5.0).abs() < 1e-12);
        assert!((expected_accepted(0.5, 1) - 1.5).abs() < 1e-12);
    }

    #[test]
    fn verdicts_per_run_is_the_sum_over_run_lengths() {
        for (a, g) in [(0.8f64, 4usize), (0.6, 1), (0.95, 3), (0.3, 8), (0.999, 4)] {
            // Sum over K = k (geometric): block ⌊k/γ⌋, one earlier when the rejection opens a block.
            let mut sum = 1.0;
            for k in 0..200_000usize {
                let b = k / g - usize::from(k >= g && k.is_multiple_of(g));
                sum += (1.0 - a) * a.powi(k as i32) * b as f64;
            }
            let closed = verdicts_per_run(a, g);
            assert!(
                (closed - sum).abs() < 1e-6 * sum,
                "α {a} γ {g}: {closed} vs {sum}"
            );
        }
        // Continuous into α → 1: one verdict per γ tokens of an ever longer run.
        let near = verdicts_per_run(1.0 - 1e-9, 4);
        assert!((near * 4.0 * 1e-9 - 1.0).abs() < 1e-3, "{near}");
    }

    #[test]
    fn depth_one_is_sync_and_depth_helps_only_with_a_good_draft() {
        let c = costs(0.75, 100.0);
        assert_eq!(async_itl_ms(&c, 4, 1), sync_itl_ms(&c, 4));
        assert!(async_itl_ms(&c, 2, 3) < async_itl_ms(&c, 2, 1));
        // A perfect draft streams one block per period.
        let perfect = costs(1.0, 100.0);
        assert!((async_itl_ms(&perfect, 4, 6) - 15.0).abs() < 1e-9);
        // Monotone in α.
        let (lo, hi) = (costs(0.5, 100.0), costs(0.9, 100.0));
        assert!(async_itl_ms(&hi, 4, 3) < async_itl_ms(&lo, 4, 3));
    }

    #[test]
    fn estimator_converges_to_what_it_observes() {
        let mut e = Estimator::new(costs(0.5, 10.0));
        assert_eq!(e.costs(0, 0), costs(0.5, 10.0));
        for i in 0..50 {
            e.on_draft(40.0);
            // Queueing sometimes inflates a round trip; the minimum is the network.
            e.on_verdict(80.0 + 60.0 + (i % 3) as f64 * 25.0, 60.0);
        }
        let c = e.costs(900, 1000);
        assert!((c.draft_ms - 40.0).abs() < 1e-6, "{c:?}");
        assert!((c.verify_ms - 60.0).abs() < 1e-6, "{c:?}");
        assert!((c.rtt_ms - 80.0).abs() < 1e-6, "{c:?}");
        assert!((c.alpha - 0.9).abs() < 0.01, "{c:?}");
    }
}
