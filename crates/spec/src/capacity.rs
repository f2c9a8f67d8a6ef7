//! The analytic model for many sessions sharing one verifier: the target's forward time as a
//! roofline, how N sessions share its forwards, and the γ, depth and batch token budget it
//! recommends. One session with the verifier to itself is [`crate::never_idle`]'s model, which
//! this one calls for each session's own schedule.
//!
//! **Roofline.** A forward of n tokens costs `max(t₁, s·n)`: at least the time to stream the
//! weights once (`t₁`, memory-bound), and `s` per token once its FLOPs dominate. From the
//! machine: `t₁ = weight bytes / bandwidth`, `s = FLOPs per token / FLOP rate`; or fitted to
//! measured forwards ([`ForwardCost::fit`]). The ridge `t₁ / s` is where the two meet.
//!
//! **Sharing.** Under protocol 2 the verifier never idles a decoding session: every forward
//! carries one chunk per session, a decode (one position) or a block's tokens past the committed
//! ones (plus the last committed token). So a forward holds `N · c` positions (`c` the mean chunk)
//! and takes `F = max(t₁, s·N·c)`, or k forwards per round once that passes the token budget; each
//! session then runs [`crate::never_idle`]'s schedule with `k·F` as its decode time, which gives
//! its ITL and its chunk — a slower forward lets the edge catch up with the verifier's lead more
//! often, so chunks grow with load. The fixed point of the two is the operating point. γ 0 is
//! cloud decoding: every session in every forward, one token each, `ITL = max(t₁, s·N)`.
//! [`operate_on`] adds the workload: prompts, finite sessions, the budget and saturation.

use serde::{Deserialize, Serialize};

use crate::never_idle::{steady_copying, Copying, Steady};
use crate::policy::Costs;

/// Weight of a new memory-bound forward's time in the one-token time ([`ForwardCost::observe`]).
const OBSERVE_SMOOTHING: f64 = 0.05;

/// The target's forward time against tokens per forward, as a roofline: a forward costs at least
/// the time of one token (reading the weights), and `ms_per_token` per token once compute-bound.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ForwardCost {
    pub one_token_ms: f64,
    pub ms_per_token: f64,
}

/// `ONE_TOKEN_MS,MS_PER_TOKEN`, both positive (the flags that take a forward cost).
impl std::str::FromStr for ForwardCost {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (a, b) = s
            .split_once(',')
            .ok_or_else(|| format!("{s:?}: give ONE_TOKEN_MS,MS_PER_TOKEN (e.g. 100,12.5)"))?;
        let num = |x: &str, what: &str| {
            x.trim()
                .parse::<f64>()
                .ok()
                .filter(|v| v.is_finite() && *v > 0.0)
                .ok_or_else(|| format!("{what} {x:?} is not a positive number of milliseconds"))
        };
        Ok(ForwardCost {
            one_token_ms: num(a, "ONE_TOKEN_MS")?,
            ms_per_token: num(b, "MS_PER_TOKEN")?,
        })
    }
}

impl ForwardCost {
    /// Fit to measured `(tokens, ms)` points, smallest first: the slope by least squares over the
    /// large sizes (at least a quarter of the largest; the last two if fewer qualify), the
    /// one-token time the median over the sizes up to 4 below them (all memory-bound, so one
    /// noisy run does not set it; the smallest size's time when none is that small). `None`
    /// unless there are two sizes.
    pub fn fit(points: &[(usize, f64)]) -> Option<Self> {
        if points.len() < 2 || points.iter().any(|p| !(p.1.is_finite() && p.1 > 0.0)) {
            return None;
        }
        let largest = points[points.len() - 1].0;
        let from = points
            .iter()
            .position(|p| p.0 * 4 >= largest)
            .unwrap_or(0)
            .min(points.len() - 2);
        let tail = &points[from..];
        let k = tail.len() as f64;
        let mx = tail.iter().map(|p| p.0 as f64).sum::<f64>() / k;
        let my = tail.iter().map(|p| p.1).sum::<f64>() / k;
        let den = tail.iter().map(|p| (p.0 as f64 - mx).powi(2)).sum::<f64>();
        if den == 0.0 {
            return None;
        }
        let slope = tail
            .iter()
            .map(|p| (p.0 as f64 - mx) * (p.1 - my))
            .sum::<f64>()
            / den;
        let mut small: Vec<f64> = points[..from]
            .iter()
            .filter(|p| p.0 <= 4)
            .map(|p| p.1)
            .collect();
        if small.is_empty() {
            small.push(points[0].1);
        }
        small.sort_by(f64::total_cmp);
        Some(Self {
            one_token_ms: small[(small.len() - 1) / 2],
            ms_per_token: slope.max(1e-6),
        })
    }

    /// A forward of `tokens` tokens took `ms`: one well below the ridge (memory-bound, so its
    /// time is the one-token time) moves the one-token time towards it. The start-up calibration
    /// runs cold and alone; this follows the time forwards take while serving.
    pub fn observe(&mut self, tokens: usize, ms: f64) {
        let below = tokens >= 1 && (tokens as f64) * 2.0 <= self.ridge_tokens();
        if below && ms.is_finite() && ms > 0.0 {
            self.one_token_ms += OBSERVE_SMOOTHING * (ms - self.one_token_ms);
        }
    }

    /// Predicted time of a forward of `tokens` tokens.
    pub fn ms(&self, tokens: f64) -> f64 {
        self.one_token_ms.max(self.ms_per_token * tokens)
    }

    /// Tokens per forward where the target turns compute-bound.
    pub fn ridge_tokens(&self) -> f64 {
        self.one_token_ms / self.ms_per_token
    }
}

impl ForwardCost {
    /// The roofline of a machine: every forward streams `weight_bytes` at `bandwidth_gbs`, and
    /// each token costs `flops_per_token` at `gflops`.
    pub fn from_machine(
        weight_bytes: f64,
        bandwidth_gbs: f64,
        flops_per_token: f64,
        gflops: f64,
    ) -> Self {
        Self {
            one_token_ms: weight_bytes / (bandwidth_gbs * 1e6),
            ms_per_token: flops_per_token / (gflops * 1e6),
        }
    }
}

/// One way to serve N sessions and what the model predicts for it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Operating {
    /// Drafted tokens per block; 0: the verifier decodes every session itself.
    pub gamma: usize,
    /// Blocks in flight per session (1: synchronous).
    pub depth: usize,
    /// Mean inter-token latency of each session.
    pub itl_ms: f64,
    /// Committed tokens per second, all sessions together.
    pub tokens_per_s: f64,
    /// Tokens (positions) per forward.
    pub batch_tokens: f64,
    /// One forward's time.
    pub forward_ms: f64,
    /// Tokens committed per forward of a session (1 when the verifier only decodes).
    pub tokens_per_block: f64,
    /// Time to first token (0 for endless sessions without prompts).
    pub ttft_ms: f64,
}

/// What each session asks of the verifier besides its verify blocks: closed-loop users open
/// session after session, each with a prompt to prefill, and the verifier's forwards hold at most
/// `token_budget` tokens.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Workload {
    pub prompt_tokens: usize,
    /// Of them, those the verifier's prefix cache holds (a conversation's history): the prefill
    /// computes only the rest.
    pub cached_tokens: usize,
    /// New tokens per session.
    pub new_tokens: usize,
    pub token_budget: usize,
    /// The verifier's own drafts in its decodes (a text that copies itself; [`Copying::NONE`]:
    /// none).
    pub copying: Copying,
}

impl Workload {
    /// Endless sessions with no prompt and no budget: the steady state of decoding alone.
    pub const DECODE: Workload = Workload {
        prompt_tokens: 0,
        cached_tokens: 0,
        new_tokens: usize::MAX,
        token_budget: usize::MAX,
        copying: Copying::NONE,
    };
}

/// [`Operating`] for `sessions` sessions at γ and depth (γ 0: cloud decoding) with endless
/// sessions ([`Workload::DECODE`]). `c` gives α, the draft time per token and the round trip
/// (its verify fields are not used: the forward cost gives them).
pub fn operate(
    c: &Costs,
    f: &ForwardCost,
    sessions: usize,
    gamma: usize,
    depth: usize,
) -> Operating {
    operate_on(c, f, sessions, gamma, depth, &Workload::DECODE)
}

/// [`operate`] for a workload of finite sessions. A session's life is its time to first token
/// (`TTFT = RTT + wait + the forwards its prompt takes`, at what the budget leaves of each) then
/// `new_tokens − 1` inter-token gaps; users are decoding for that share of their cycle, and the
/// verifier's forwards also carry the prompts arriving meanwhile. Past the token budget, one
/// round of work takes several forwards.
pub fn operate_on(
    c: &Costs,
    f: &ForwardCost,
    sessions: usize,
    gamma: usize,
    depth: usize,
    w: &Workload,
) -> Operating {
    let n = sessions.max(1) as f64;
    let budget = (w.token_budget.max(1) as f64).min(1e12);
    // The prefill computes what the prefix cache does not hold.
    let (prompt, m) = (
        w.prompt_tokens.saturating_sub(w.cached_tokens) as f64,
        (w.new_tokens.max(1) as f64).min(1e12),
    );
    let depth = if gamma == 0 { 1 } else { depth.max(1) };
    // One session's steady state with the verifier running a forward of `ms` for it (one chunk
    // per session per forward: a decode or a block's new tokens), per protocol 2's model.
    // Its decodes carry the verifier's own guesses where the text copies itself.
    let session = |ms: f64| {
        if gamma == 0 {
            Steady {
                itl_ms: ms / w.copying.tokens_per_decode(),
                positions_per_forward: w.copying.positions_per_decode(),
                tokens_per_forward: w.copying.tokens_per_decode(),
            }
        } else {
            steady_copying(
                &Costs {
                    verify_ms: ms,
                    verify_ms_per_token: 0.0,
                    ..*c
                },
                gamma,
                depth,
                &w.copying,
            )
        }
    };
    // Fixed point over the forward's size and time and the decoding share. Every decoding
    // session has a chunk in every round of forwards (the verifier never idles it); a round
    // takes k forwards when its positions pass the token budget.
    let mut st = session(f.ms(1.0));
    let (mut fwd, mut k, mut share) = (f.ms(1.0), 1.0f64, 1.0f64);
    let (mut itl, mut ttft, mut tokens) = (st.itl_ms, 0.0f64, 1.0f64);
    for _ in 0..200 {
        let active = (n * share).max(1.0).min(n);
        let cycle = ttft + (m - 1.0) * itl;
        let prompts_per_ms = if prompt > 0.0 {
            n * prompt / cycle.max(1e-9)
        } else {
            0.0
        };
        let verify_tokens = active * st.positions_per_forward;
        let k_new = (verify_tokens / budget).max(1.0);
        let room = (budget - verify_tokens / k_new).max(budget / 4.0).max(1.0);
        let chunk = prompt.min(room);
        // The roofline is convex: a forward that carries a prompt chunk costs far more than one
        // that does not, so the mean forward is the mix of the two, not the forward of the mean.
        let with_prompt = if chunk > 0.0 {
            (prompts_per_ms * fwd / chunk).min(1.0)
        } else {
            0.0
        };
        let fwd_plain = f.ms(verify_tokens / k_new);
        let fwd_prompt = f.ms((verify_tokens / k_new + chunk).min(budget));
        let fwd_new = with_prompt * fwd_prompt + (1.0 - with_prompt) * fwd_plain;
        let st_new = session(k_new * fwd_new);
        // Finite sessions wait at least a round trip and a forward for their first token; a
        // prompt gets what verify work leaves of each forward (at least a quarter: the
        // scheduler's reserve for waiting prompts).
        let ttft_new = if prompt > 0.0 || m < 1e11 {
            c.rtt_ms + fwd_prompt * (prompt / room).ceil().max(1.0)
        } else {
            0.0
        };
        let share_new = if m > 1e11 {
            1.0
        } else {
            let decoding = (m - 1.0) * st_new.itl_ms;
            decoding / (decoding + ttft_new).max(1e-9)
        };
        let moved = (fwd_new - fwd).abs() + (st_new.itl_ms - itl).abs() + (ttft_new - ttft).abs();
        fwd += 0.5 * (fwd_new - fwd);
        k += 0.5 * (k_new - k);
        ttft += 0.5 * (ttft_new - ttft);
        share += 0.5 * (share_new - share);
        st = session(k * fwd);
        itl = st.itl_ms;
        tokens = verify_tokens / k_new + with_prompt * chunk;
        if moved < 1e-9 {
            break;
        }
    }
    let active = (n * share).max(1.0).min(n);
    let mut tokens_per_s = if m > 1e11 {
        active * 1e3 / itl
    } else {
        n * m * 1e3 / (ttft + (m - 1.0) * itl)
    };
    // Saturation: the verifier computes at most a full budget per forward. Each committed token
    // costs its share of its session's chunks plus its session's prompt; beyond that rate new
    // prompts queue (decoding goes first), so the time to first token absorbs the excess while
    // decoding sessions keep their pace at full forwards.
    let full = budget.min(1e6);
    let positions_per_ms = full / f.ms(full);
    let per_token =
        st.positions_per_forward / st.tokens_per_forward + if m > 1e11 { 0.0 } else { prompt / m };
    let cap = positions_per_ms / per_token * 1e3;
    if tokens_per_s > cap && budget < 1e11 {
        tokens_per_s = cap;
        fwd = f.ms(full);
        tokens = full;
        // Every decoding session's chunk, in rounds of full forwards.
        let rounds = (active * st.positions_per_forward / full).max(1.0);
        st = session(rounds * fwd);
        itl = st.itl_ms;
        if m < 1e11 {
            ttft = (n * m * 1e3 / cap - (m - 1.0) * itl).max(ttft);
        }
    }
    Operating {
        gamma,
        depth,
        itl_ms: itl,
        tokens_per_s,
        batch_tokens: tokens,
        forward_ms: fwd,
        tokens_per_block: st.tokens_per_forward,
        ttft_ms: ttft,
    }
}

/// The pipeline's stages for one session at γ (ms): drafting a block, the network, and the
/// verifier's latency for it. Asynchronous speculation runs at the slowest of the three; it is
/// balanced when `verify ≈ γ·draft + network`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Stages {
    pub draft_ms: f64,
    pub network_ms: f64,
    pub verify_ms: f64,
    /// The γ at which `verify ≈ γ·draft + network` (`None`: verification is always the faster).
    pub balanced_gamma: Option<f64>,
}

/// What [`recommend_fleet`] recommends for N sessions.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct FleetRecommendation {
    pub sessions: usize,
    /// The shape with the most committed tokens per second (γ 0: the verifier should decode the
    /// sessions).
    pub best: Operating,
    /// The best synchronous shape (depth 1, γ ≥ 1).
    pub best_sync: Operating,
    /// Cloud-only serving of the same sessions.
    pub cloud_only: Operating,
    /// Tokens per forward the scheduler should allow: every session's block in one forward, and
    /// at least the ridge (prompt chunks fill forwards up to where they turn compute-bound).
    pub token_budget: usize,
    pub ridge_tokens: f64,
    pub stages: Stages,
}

/// Recommend γ (≤ `max_gamma`), depth (≤ `max_depth`) and a batch token budget for `sessions`
/// sessions of workload `w`: the shape with the most committed tokens per second, which for a
/// fixed number of closed-loop users is the shortest session (time to first token plus the
/// inter-token gaps; for endless sessions, the lowest ITL). Ties go to the smaller γ and depth.
pub fn recommend_fleet(
    c: &Costs,
    f: &ForwardCost,
    sessions: usize,
    max_gamma: usize,
    max_depth: usize,
    w: &Workload,
) -> FleetRecommendation {
    let cloud_only = operate_on(c, f, sessions, 0, 1, w);
    let mut best = cloud_only;
    let mut best_sync: Option<Operating> = None;
    let better =
        |o: &Operating, than: &Operating| o.tokens_per_s > than.tokens_per_s * (1.0 + 1e-9);
    for g in 1..=max_gamma.max(1) {
        for d in 1..=max_depth.max(1) {
            let o = operate_on(c, f, sessions, g, d, w);
            if better(&o, &best) {
                best = o;
            }
            if d == 1 && best_sync.is_none_or(|s| better(&o, &s)) {
                best_sync = Some(o);
            }
        }
    }
    let best_sync = best_sync.expect("invariant: γ 1 at depth 1 is always a candidate");
    // The stages of the speculative shape: the best one, or the best synchronous one when the
    // verifier should decode.
    let shape = if best.gamma > 0 { best } else { best_sync };
    let g = shape.gamma as f64;
    let verify = shape.forward_ms;
    let network = c.rtt_ms;
    let balanced_gamma = (verify > network).then(|| (verify - network) / c.draft_ms.max(1e-9));
    let budget = (sessions as f64 * (best.gamma as f64 + 1.0)).max(f.ridge_tokens());
    FleetRecommendation {
        sessions,
        best,
        best_sync,
        cloud_only,
        token_budget: (budget.min(1e15).ceil() as usize).div_ceil(8) * 8,
        ridge_tokens: f.ridge_tokens(),
        stages: Stages {
            draft_ms: g * c.draft_ms,
            network_ms: network,
            verify_ms: verify,
            balanced_gamma,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_roofline_fit_finds_the_ridge() {
        // 100 ms up to 10 tokens, then 10 ms per token.
        let pts: Vec<(usize, f64)> = [1usize, 2, 4, 8, 16, 32, 64]
            .iter()
            .map(|&n| (n, (10.0 * n as f64).max(100.0)))
            .collect();
        let c = ForwardCost::fit(&pts).unwrap();
        assert!((c.ms_per_token - 10.0).abs() < 1e-9);
        assert!((c.ridge_tokens() - 10.0).abs() < 1e-9);
        assert_eq!(c.ms(4.0), 100.0);
        assert!((c.ms(40.0) - 400.0).abs() < 1e-9);
        // The one-token time is the median of the small sizes; the slope ignores them.
        let noisy =
            ForwardCost::fit(&[(1, 130.0), (2, 95.0), (4, 100.0), (32, 320.0), (64, 640.0)])
                .unwrap();
        assert_eq!(noisy.one_token_ms, 100.0);
        assert!((noisy.ms_per_token - 10.0).abs() < 1e-9);
        let two = ForwardCost::fit(&[(1, 100.0), (32, 320.0)]).unwrap();
        assert!((two.ms_per_token - 220.0 / 31.0).abs() < 1e-9);
        // Serving refines the one-token time from memory-bound forwards only.
        let mut c = ForwardCost {
            one_token_ms: 100.0,
            ms_per_token: 10.0,
        };
        c.observe(30, 50.0);
        assert_eq!(
            c.one_token_ms, 100.0,
            "past the ridge: not a one-token time"
        );
        for _ in 0..200 {
            c.observe(2, 80.0);
        }
        assert!((c.one_token_ms - 80.0).abs() < 0.1);
        assert!(ForwardCost::fit(&[(1, 100.0)]).is_none());
        assert!(ForwardCost::fit(&[(1, 100.0), (1, 100.0)]).is_none());
        assert!(ForwardCost::fit(&[(1, f64::NAN), (8, 100.0)]).is_none());
    }

    fn costs(alpha: f64, draft_ms: f64, rtt_ms: f64) -> Costs {
        Costs {
            alpha,
            draft_ms,
            verify_ms: 0.0,
            verify_ms_per_token: 0.0,
            rtt_ms,
            verdict_ms: 0.0,
        }
    }

    const FWD: ForwardCost = ForwardCost {
        one_token_ms: 44.0,
        ms_per_token: 2.2,
    };

    #[test]
    fn the_roofline_comes_from_bandwidth_and_flops() {
        // 538 MB at 10 GB/s, 0.27 GFLOP per token at 120 GFLOP/s.
        let f = ForwardCost::from_machine(538e6, 10.0, 0.27e9, 120.0);
        assert!((f.one_token_ms - 53.8).abs() < 1e-9);
        assert!((f.ms_per_token - 2.25).abs() < 1e-9);
        assert!((f.ridge_tokens() - 53.8 / 2.25).abs() < 1e-9);
    }

    #[test]
    fn one_session_is_the_single_session_model_with_the_forward_as_decode_time() {
        let c = costs(0.8, 10.0, 50.0);
        for (g, d) in [(4, 1), (3, 2), (1, 1)] {
            let o = operate(&c, &FWD, 1, g, d);
            // Below the ridge every forward costs the one-token time.
            let alone = Costs {
                verify_ms: FWD.one_token_ms,
                ..c
            };
            let s = crate::never_idle::steady(&alone, g, d);
            assert!((o.itl_ms - s.itl_ms).abs() < 1e-6, "{o:?} {s:?}");
            assert!((o.batch_tokens - s.positions_per_forward).abs() < 1e-9);
            assert!(o.itl_ms < FWD.one_token_ms, "a good draft beats decoding");
        }
    }

    #[test]
    fn cloud_decoding_is_one_forward_per_token_for_everyone() {
        let c = costs(0.8, 10.0, 50.0);
        assert_eq!(operate(&c, &FWD, 1, 0, 1).itl_ms, 44.0);
        assert_eq!(operate(&c, &FWD, 10, 0, 1).itl_ms, 44.0, "below the ridge");
        let o = operate(&c, &FWD, 100, 0, 1);
        assert!((o.itl_ms - 220.0).abs() < 1e-9);
        assert!((o.tokens_per_s - 100.0 * 1e3 / 220.0).abs() < 1e-9);
    }

    #[test]
    fn load_fills_forwards_up_to_the_compute_bound() {
        let c = costs(0.8, 10.0, 50.0);
        let few = operate(&c, &FWD, 2, 4, 1);
        let many = operate(&c, &FWD, 64, 4, 1);
        assert!(many.batch_tokens > few.batch_tokens);
        assert!(many.forward_ms > few.forward_ms && many.itl_ms > few.itl_ms);
        // Throughput cannot pass the compute roofline: each committed token costs its session's
        // positions per committed token.
        let per_token = many.batch_tokens / 64.0 / many.tokens_per_block;
        let cap = 1e3 / FWD.ms_per_token / per_token;
        assert!(many.tokens_per_s <= cap * 1.0001, "{many:?} vs {cap}");
        assert!(many.tokens_per_s > 0.8 * cap, "{many:?} vs {cap}");
        // Below the ridge more sessions commit more, at the same ITL; past it a verified
        // position costs as much as a decoded token and the rejected ones are waste, so a fixed
        // γ 4 commits less than the verifier decoding everyone (why the grant shrinks γ).
        let mut last = 0.0;
        for n in [1, 2, 4, 8] {
            let o = operate(&c, &FWD, n, 4, 1);
            assert!(
                o.tokens_per_s > last && o.itl_ms == few.itl_ms,
                "n {n}: {o:?}"
            );
            last = o.tokens_per_s;
        }
        assert!(many.tokens_per_s < operate(&c, &FWD, 64, 0, 1).tokens_per_s);
    }

    #[test]
    fn a_cached_history_is_not_prefilled_again() {
        // A conversation's late turn: 1,000 prompt tokens, 960 of them the prefix cache's.
        let c = costs(0.8, 11.0, 50.0);
        let turn = |cached| Workload {
            prompt_tokens: 1000,
            cached_tokens: cached,
            new_tokens: 96,
            token_budget: 256,
            copying: Copying::NONE,
        };
        let (cold, warm) = (
            operate_on(&c, &FWD, 1, 0, 1, &turn(0)),
            operate_on(&c, &FWD, 1, 0, 1, &turn(960)),
        );
        // Cold, the prompt takes four forwards of the budget; warm, its 40 new tokens ride one.
        assert!(cold.ttft_ms > 50.0 + 3.0 * FWD.ms(200.0), "{cold:?}");
        assert!(warm.ttft_ms < 50.0 + 1.5 * FWD.ms(64.0), "{warm:?}");
        // Warm, the turn is a 40-token prompt's.
        let short = operate_on(
            &c,
            &FWD,
            1,
            0,
            1,
            &Workload {
                prompt_tokens: 40,
                cached_tokens: 0,
                ..turn(0)
            },
        );
        assert!(
            (warm.ttft_ms - short.ttft_ms).abs() < 1e-9,
            "{warm:?} {short:?}"
        );
        // A crowd's throughput cap counts only the prefill computed.
        let (cold, warm) = (
            operate_on(&c, &FWD, 256, 0, 1, &turn(0)),
            operate_on(&c, &FWD, 256, 0, 1, &turn(960)),
        );
        assert!(
            warm.tokens_per_s > 3.0 * cold.tokens_per_s,
            "{cold:?} {warm:?}"
        );
    }

    #[test]
    fn prompts_load_the_verifier_and_saturation_moves_into_the_time_to_first_token() {
        let c = costs(0.8, 11.0, 50.0);
        let w = Workload {
            cached_tokens: 0,
            prompt_tokens: 40,
            new_tokens: 48,
            token_budget: 64,
            copying: Copying::NONE,
        };
        // Alone: the prompt rides one forward after a round trip.
        let alone = operate_on(&c, &FWD, 1, 0, 1, &w);
        assert!(
            alone.ttft_ms > 50.0 + 44.0 && alone.ttft_ms < 50.0 + 2.0 * FWD.ms(64.0),
            "{alone:?}"
        );
        assert!(alone.tokens_per_s < operate(&c, &FWD, 1, 0, 1).tokens_per_s);
        // A crowd: full forwards; each committed token costs itself and 40/48 of a prompt.
        for gamma in [0, 4] {
            let crowd = operate_on(&c, &FWD, 256, gamma, 2, &w);
            let chunk = crate::never_idle::steady(
                &Costs {
                    verify_ms: crowd.forward_ms,
                    ..c
                },
                gamma.max(1),
                2,
            );
            let per = if gamma == 0 {
                1.0
            } else {
                chunk.positions_per_forward / chunk.tokens_per_forward
            } + 40.0 / 48.0;
            let cap = 64.0 / FWD.ms(64.0) / per * 1e3;
            assert!((crowd.tokens_per_s - cap).abs() < 1e-6, "{crowd:?}");
            assert!(crowd.ttft_ms > 10_000.0, "{crowd:?}");
            assert_eq!(crowd.batch_tokens, 64.0);
        }
        // Finite sessions without prompts still wait a round trip and a forward for their first
        // token, and every result stays finite at the edges of the inputs.
        let short = Workload {
            cached_tokens: 0,
            prompt_tokens: 0,
            new_tokens: 1,
            token_budget: usize::MAX,
            copying: Copying::NONE,
        };
        let one = operate_on(&c, &FWD, 1, 0, 1, &short);
        assert!(
            (one.ttft_ms - 94.0).abs() < 1e-6 && one.tokens_per_s.is_finite(),
            "{one:?}"
        );
        for alpha in [0.0, 0.5, 1.0] {
            for (g, d) in [(0, 1), (1, 1), (4, 3)] {
                for w in [Workload::DECODE, w, short] {
                    let o = operate_on(&costs(alpha, 11.0, 50.0), &FWD, 3, g, d, &w);
                    assert!(
                        o.itl_ms.is_finite() && o.tokens_per_s.is_finite() && o.tokens_per_s > 0.0,
                        "α {alpha} γ {g} depth {d} {w:?}: {o:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn the_plan_speculates_alone_and_hands_decoding_to_the_verifier_under_load() {
        // A fast, accurate draft far from the cloud: pipelined speculation.
        let alone = recommend_fleet(&costs(0.9, 10.0, 100.0), &FWD, 1, 8, 4, &Workload::DECODE);
        assert!(alone.best.gamma >= 2 && alone.best.depth >= 2, "{alone:?}");
        assert!(alone.best.itl_ms < alone.best_sync.itl_ms);
        assert!(alone.best.itl_ms < alone.cloud_only.itl_ms);
        // Many sessions with a mediocre draft: past the ridge every rejected position is waste.
        let crowd = recommend_fleet(&costs(0.6, 20.0, 50.0), &FWD, 256, 8, 4, &Workload::DECODE);
        assert_eq!(crowd.best.gamma, 0, "{crowd:?}");
        assert_eq!(crowd.token_budget, 256);
        // The budget never drops below the ridge, in multiples of 8.
        assert_eq!(alone.token_budget, 24);
        // The stages: verify 44 ms + no wait against 100 ms of network: verification never bounds.
        assert_eq!(alone.stages.balanced_gamma, None);
        let near = recommend_fleet(&costs(0.9, 10.0, 4.0), &FWD, 1, 8, 4, &Workload::DECODE);
        let bg = near.stages.balanced_gamma.unwrap();
        assert!(bg > 3.0 && bg < 5.0, "{near:?}");
    }
}
