//! Speculation is lossless in distribution, end to end: the edge loop ([`tandem_edge::run`]) with a
//! real tiny draft engine against the real cloud [`VerifierCore`] on a different tiny target engine.
//! Over many seeds, the token committed at output positions 1 and 2 (both decided by judging
//! drafted tokens) follows the target's sampling distribution there — the marginal over the earlier
//! output tokens, computed exactly by enumerating them — by a χ² test at the 0.999 quantile, for
//! sample-and-match and for rejection sampling, for two sets of sampling parameters and three
//! pipeline shapes (synchronous, blocks in flight that go stale, one-token blocks judged against
//! the pending prediction). The same counts against the draft's own distribution must fail that
//! test, so the test can tell a wrong verifier from a right one; under sample-and-match every run
//! must also reproduce the target's own sample. Seeds are fixed: every run is replayable.

use std::collections::VecDeque;
use std::io::Cursor;
use std::sync::Arc;
use std::time::Instant;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use tandem_edge::{EdgeError, Link, SpecConfig};
use tandem_engine::testing::{tiny_gguf, TinySpec};
use tandem_engine::{
    Engine, EngineConfig, GgufFile, LlamaModel, SeqChunk, SeqId, Wanted, WeightMode,
};
use tandem_sched::{SessionId, TenantId};
use tandem_spec::sampling::SamplingParams;
use tandem_spec::sampling::{distribution, sample, uniform};
use tandem_spec::{Block, PipelineStats, TreeConfig, VerifyRule};
use tandem_verifier::{Inbound, Mode, NewSession, Outgoing, ToEdge, VerifierConfig, VerifierCore};

const VOCAB: usize = 24;
const PROMPT: [u32; 3] = [5, 17, 2];
const RUNS: u64 = 3000;
/// Size of the sparse draft distribution sent for rejection sampling (smaller than the vocabulary,
/// so the target's support is not always covered by the draft's).
const Q_TOP_K: usize = 8;

/// Scale of the output head's random weights: logits with a standard deviation of about 1.5.
const HEAD_SCALE: f32 = 0.33;
const DRAFT_HEAD_NOISE: f32 = 0.6;

/// The tiny random model (seed 11) with its own random output head, plus `head_noise` times
/// independent noise in that head. (With the head tied to the embeddings, a random model all but
/// repeats its last token — a logit gap of about `dim / 3` — which leaves nothing to sample.)
fn model(dtype: GgmlDType, mode: WeightMode, head_noise: f32) -> Arc<LlamaModel> {
    let spec = TinySpec {
        vocab: VOCAB,
        context_len: 64,
        dtype,
        seed: 11,
        ..TinySpec::default()
    };
    let mut r = Cursor::new(tiny_gguf(&spec).unwrap());
    let content = gguf_file::Content::read(&mut r).unwrap();
    let mut tensors: Vec<(String, QTensor)> = content
        .tensor_infos
        .keys()
        .map(|name| {
            let t = content.tensor(&mut r, name, &Device::Cpu).unwrap();
            (name.clone(), t)
        })
        .collect();
    let head: Vec<f32> = (0..(VOCAB * spec.dim) as u64)
        .map(|i| {
            let noise = uniform(2, i, 5) as f32 * 2.0 - 1.0;
            ((uniform(1, i, 5) as f32 * 2.0 - 1.0) + head_noise * noise) * HEAD_SCALE
        })
        .collect();
    let head = Tensor::from_vec(head, (VOCAB, spec.dim), &Device::Cpu).unwrap();
    tensors.push((
        "output.weight".into(),
        QTensor::quantize(&head, GgmlDType::F32).unwrap(),
    ));
    let meta: Vec<(&str, &Value)> = content
        .metadata
        .iter()
        .map(|(k, v)| (k.as_str(), v))
        .collect();
    let tensors: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut out = Cursor::new(Vec::new());
    gguf_file::write(&mut out, &meta, &tensors).unwrap();
    let mut file = GgufFile::from_bytes("tiny.gguf", out.into_inner()).unwrap();
    Arc::new(LlamaModel::load(&mut file, mode).unwrap())
}

fn target_model() -> Arc<LlamaModel> {
    model(GgmlDType::F32, WeightMode::F32, 0.0)
}

/// The target in 4-bit blocks, like a real edge draft, with a perturbed head: close enough that
/// many drafted tokens are accepted, different enough that many are not.
fn draft_model() -> Arc<LlamaModel> {
    model(GgmlDType::Q4_0, WeightMode::Native, DRAFT_HEAD_NOISE)
}

fn engine(m: &Arc<LlamaModel>) -> Engine {
    let cfg = EngineConfig {
        threads: 1,
        kv_budget_bytes: 1 << 20,
        kv_block_size: 4,
        ..EngineConfig::default()
    };
    Engine::new(m.clone(), cfg).unwrap()
}

/// A model's logits after the prompt and after every continuation of one and of two tokens.
struct Tree {
    root: Vec<f32>,
    /// By the first output token.
    one: Vec<Vec<f32>>,
    /// By `t0 * VOCAB + t1`.
    two: Vec<Vec<f32>>,
}

impl Tree {
    fn new(m: &Arc<LlamaModel>) -> Self {
        let mut e = engine(m);
        let n = PROMPT.len();
        let mut rows = |t0: u32, t1: u32| {
            let mut tokens = PROMPT.to_vec();
            tokens.extend([t0, t1]);
            let l = e
                .forward(&[SeqChunk::new(SeqId(0), 0, tokens, Wanted::All)])
                .unwrap();
            e.free(SeqId(0));
            (n - 1..n + 2)
                .map(|i| l.row(i).to_vec())
                .collect::<Vec<_>>()
        };
        let root = rows(0, 0).swap_remove(0);
        let mut one = Vec::with_capacity(VOCAB);
        let mut two = Vec::with_capacity(VOCAB * VOCAB);
        for t0 in 0..VOCAB as u32 {
            for t1 in 0..VOCAB as u32 {
                let r = rows(t0, t1);
                if t1 == 0 {
                    one.push(r[1].clone());
                }
                two.push(r[2].clone());
            }
        }
        Self { root, one, two }
    }

    /// The exact distributions of output tokens 0, 1 and 2 when the model samples under `params`.
    fn marginals(&self, params: &SamplingParams) -> [Vec<f64>; 3] {
        let p0 = dense(&self.root, params);
        let mut p1 = vec![0.0; VOCAB];
        let mut p2 = vec![0.0; VOCAB];
        for (t0, &w0) in p0.iter().enumerate().filter(|(_, &w)| w > 0.0) {
            let d1 = dense(&self.one[t0], params);
            for (t1, &w1) in d1.iter().enumerate().filter(|(_, &w)| w > 0.0) {
                p1[t1] += w0 * w1;
                let d2 = dense(&self.two[t0 * VOCAB + t1], params);
                for (t2, &w2) in d2.iter().enumerate() {
                    p2[t2] += w0 * w1 * w2;
                }
            }
        }
        [p0, p1, p2]
    }

    /// The model's own sampled output under `params` (its seed included).
    fn sampled(&self, params: &SamplingParams) -> Vec<u32> {
        let n = PROMPT.len() as u64;
        let t0 = sample(&self.root, params, n);
        let t1 = sample(&self.one[t0 as usize], params, n + 1);
        let t2 = sample(&self.two[t0 as usize * VOCAB + t1 as usize], params, n + 2);
        vec![t0, t1, t2]
    }
}

/// The sampler's distribution as a dense vector over the vocabulary.
fn dense(logits: &[f32], params: &SamplingParams) -> Vec<f64> {
    let mut p = vec![0.0; logits.len()];
    for (t, x) in distribution(logits, params) {
        p[t as usize] = x as f64;
    }
    p
}

/// A link to a verifier on the same thread, driven as the batcher drives it: each message goes in
/// as it is sent ([`VerifierCore::receive`]), and the verifier turns ([`VerifierCore::turn`])
/// while the edge waits, on a clock that stands at 0. Eager: each block is verified as it is
/// sent, so its verdict is there before the edge drafts again. Lazy: blocks are verified, in
/// order, only when the edge has to wait, so up to `depth` blocks are in flight and later ones
/// may go stale.
struct Local<'a> {
    verifier: &'a mut VerifierCore,
    session: u64,
    /// Blocks reach the verifier only after its next forward (which decodes a token when it has
    /// no block): they land behind it, to be rebased.
    lazy: bool,
    blocks: VecDeque<Block>,
    inbox: VecDeque<tandem_spec::Incoming>,
}

impl Local<'_> {
    fn receive(&mut self, msg: Inbound<()>) {
        self.verifier.receive(0, msg);
    }

    fn deliver(&mut self) {
        let session = SessionId(self.session);
        while let Some(block) = self.blocks.pop_front() {
            self.receive(Inbound::Draft { session, block });
        }
    }

    /// One turn, its messages into the inbox (a refusal is the edge's error). Whether it ran a
    /// forward or sent anything.
    fn turn(&mut self) -> Result<bool, EdgeError> {
        let t = self.verifier.turn(0);
        let busy = t.forward.is_some() || !t.out.is_empty();
        for o in t.out {
            match o.msg {
                ToEdge::Verdict(verdict) => self
                    .inbox
                    .push_back(tandem_spec::Incoming::Verdict(verdict)),
                ToEdge::Decoded(decoded) => self
                    .inbox
                    .push_back(tandem_spec::Incoming::Decoded(decoded)),
                ToEdge::Error { error, .. } => return Err(EdgeError::Refused(error.to_string())),
                other => panic!("unexpected {other:?}"),
            }
        }
        Ok(busy)
    }
}

impl Link for Local<'_> {
    fn send(&mut self, block: Block) -> Result<(), EdgeError> {
        self.blocks.push_back(block);
        if !self.lazy {
            self.deliver();
        }
        Ok(())
    }

    fn ack(&mut self, committed: usize) -> Result<(), EdgeError> {
        let session = SessionId(self.session);
        self.receive(Inbound::Ack { session, committed });
        Ok(())
    }

    fn recv(&mut self, wait: bool) -> Result<Option<tandem_spec::Incoming>, EdgeError> {
        while wait && self.inbox.is_empty() {
            // With no work, a turn sends only the answers to what was received (a refusal).
            let idle = !self.verifier.has_work();
            if !self.turn()? && idle {
                break;
            }
            self.deliver();
        }
        Ok(self.inbox.pop_front())
    }
}

/// χ² of `counts` against `probs`, pooling the cells expected to hold fewer than 5 counts; returns
/// the statistic and the degrees of freedom. A count where the probability is 0 gives infinity.
fn chi2(counts: &[usize], probs: &[f64]) -> (f64, usize) {
    let n = counts.iter().sum::<usize>() as f64;
    if counts.iter().zip(probs).any(|(&c, &p)| c > 0 && p <= 0.0) {
        return (f64::INFINITY, 0);
    }
    let mut cells: Vec<(f64, f64)> = Vec::new();
    let mut pooled = (0.0, 0.0);
    for (&c, &p) in counts.iter().zip(probs) {
        let e = p * n;
        if e >= 5.0 {
            cells.push((c as f64, e));
        } else {
            pooled = (pooled.0 + c as f64, pooled.1 + e);
        }
    }
    if pooled.1 > 0.0 {
        if pooled.1 >= 5.0 || cells.is_empty() {
            cells.push(pooled);
        } else {
            let small = cells
                .iter_mut()
                .min_by(|a, b| a.1.total_cmp(&b.1))
                .expect("invariant: not empty");
            *small = (small.0 + pooled.0, small.1 + pooled.1);
        }
    }
    let x = cells.iter().map(|(o, e)| (o - e).powi(2) / e).sum();
    (x, cells.len().saturating_sub(1))
}

/// The 0.999 quantile of χ² with `dof` degrees of freedom (Wilson–Hilferty; for one degree of
/// freedom it gives 11.2 where the exact value is 10.8).
fn chi2_critical(dof: usize) -> f64 {
    let k = dof.max(1) as f64;
    let z = 3.0902; // the 0.999 quantile of the standard normal
    let a = 2.0 / (9.0 * k);
    k * (1.0 - a + z * a.sqrt()).powi(3)
}

/// One sampling setup and pipeline shape.
struct Case {
    name: &'static str,
    params: SamplingParams,
    draft_len: usize,
    depth: usize,
    lazy: bool,
    max_new_tokens: usize,
    tree: TreeConfig,
}

const T1: SamplingParams = SamplingParams {
    temperature: 1.0,
    top_k: 0,
    top_p: 1.0,
    seed: 0,
};

/// Lanes forked at every drafted token while there is room for them (three beside the main
/// path), carried on across blocks.
const EVERYWHERE: TreeConfig = TreeConfig {
    side_nodes: 8,
    lanes: 3,
    below: 1.01,
    min_chance: 0.0,
};

const T07: SamplingParams = SamplingParams {
    temperature: 0.7,
    top_k: 12,
    top_p: 0.95,
    seed: 0,
};

fn cases() -> [Case; 6] {
    [
        // Output positions 1 and 2 are both judged drafts, in the first block or, after a
        // rejection at 1, in the next.
        Case {
            name: "T=1.0, γ=2, depth 1, eager",
            params: T1,
            draft_len: 2,
            depth: 1,
            lazy: false,
            max_new_tokens: 3,
            tree: TreeConfig::LINEAR,
        },
        // A second block is in flight when the first is judged; a rejection makes it stale and
        // position 2 is drafted again in the next epoch.
        Case {
            name: "T=0.7 top-k 12 top-p 0.95, γ=2, depth 2, lazy",
            params: T07,
            draft_len: 2,
            depth: 2,
            lazy: true,
            max_new_tokens: 5,
            tree: TreeConfig::LINEAR,
        },
        // One-token blocks in flight: after an accepted first block, position 2 is the target's
        // bonus, and the verifier judges the block in flight there against it (the pending
        // prediction), answering a mismatch at once with a verdict the edge finds stale.
        Case {
            name: "T=1.0, γ=1, depth 3, lazy",
            params: T1,
            draft_len: 1,
            depth: 3,
            lazy: true,
            max_new_tokens: 4,
            tree: TreeConfig::LINEAR,
        },
        // Token trees: lanes forked at every drafted token (the second draw beside the main
        // token, then the draft's own draws along the lane); the target's draws pick the path
        // (sample-and-match) or judge the main token, then the fork on what it left, then the
        // lanes from other parents as point masses (rejection sampling). Synchronous, eager:
        // positions 1 and 2 are judged in the first block's tree.
        Case {
            name: "T=1.0, γ=2, depth 1, eager, lanes everywhere",
            params: T1,
            draft_len: 2,
            depth: 1,
            lazy: false,
            // Room past the main path for the side nodes' KV slots.
            max_new_tokens: 6,
            tree: EVERYWHERE,
        },
        // One-token blocks in flight, eager: a lane forked at output position 1 goes on at
        // position 2 in the next block, from its root, beside that block's main token (a point
        // mass there: the draft's own draw after another token, not a second draw beside it).
        Case {
            name: "T=1.0, γ=1, depth 3, eager, lanes everywhere",
            params: T1,
            draft_len: 1,
            depth: 3,
            lazy: false,
            max_new_tokens: 4,
            tree: EVERYWHERE,
        },
        // Lazy, blocks in flight: the verifier's own decodes also divert the trees, and lanes
        // go on in the blocks behind.
        Case {
            name: "T=0.7 top-k 12 top-p 0.95, γ=2, depth 2, lazy, lanes everywhere",
            params: T07,
            draft_len: 2,
            depth: 2,
            lazy: true,
            max_new_tokens: 5,
            tree: EVERYWHERE,
        },
    ]
}

/// Counts of the committed token at output positions 0..3 over `RUNS` seeds (a range of its own
/// for each case), and the summed pipeline counters. Under sample-and-match every run's output
/// must be the target's own sample.
fn committed_counts(
    rule: VerifyRule,
    (ix, case): (usize, &Case),
    target: &Tree,
    verifier: &mut VerifierCore,
    draft: &mut Engine,
) -> ([Vec<usize>; 3], PipelineStats) {
    let mut counts = [vec![0; VOCAB], vec![0; VOCAB], vec![0; VOCAB]];
    let mut stats = PipelineStats::default();
    for run in 0..RUNS {
        let params = SamplingParams {
            seed: ((ix as u64) << 32) + 1_000_003 * run + 7,
            ..case.params
        };
        let cfg = SpecConfig {
            session: tandem_spec::edge::SessionConfig {
                draft_len: case.draft_len,
                depth: case.depth,
                max_new_tokens: case.max_new_tokens,
                auto: None,
                tree: case.tree,
            },
            rule,
            params,
            q_top_k: Q_TOP_K,
            self_draft: true,
            suffix: true,
        };
        let new = NewSession {
            tenant: TenantId(0),
            prompt: PROMPT.to_vec(),
            params,
            max_tokens: case.max_new_tokens,
            eog: vec![],
            mode: Mode::Speculate {
                rule,
                want: tandem_spec::Shape::UNLIMITED,
            },
            grammar: None,
            logprobs: None,
            self_draft: false,
        };
        let session = SessionId(run);
        verifier.receive(
            0,
            Inbound::Open {
                session,
                new,
                handle: (),
            },
        );
        // One forward prefills the prompt (and plans the first decode).
        let t = verifier.turn(0);
        let (first, grant) = match t.out.as_slice() {
            [Outgoing {
                msg: ToEdge::Admitted { .. },
                ..
            }, Outgoing {
                msg: ToEdge::Opened { first, grant, .. },
                ..
            }] => (*first, *grant),
            other => panic!("expected the session to open: {other:?}"),
        };
        let mut link = Local {
            verifier,
            session: run,
            lazy: case.lazy,
            blocks: VecDeque::new(),
            inbox: VecDeque::new(),
        };
        let report = tandem_edge::run(
            draft,
            Vec::new(),
            &PROMPT,
            // (The core bounds no side nodes: the gRPC service does.)
            Some(tandem_spec::Opened {
                first,
                grant,
                side_nodes: usize::MAX,
            }),
            &cfg,
            &mut link,
            Instant::now(),
            |_| {},
        )
        .unwrap();
        verifier.receive(0, Inbound::Close { session });
        let out = report.output_ids;
        assert_eq!(out.len(), case.max_new_tokens, "run {run}: {out:?}");
        if rule == VerifyRule::SampleMatch {
            assert_eq!(
                out[..3],
                target.sampled(&params),
                "run {run}: not the target's own sample"
            );
        }
        for (c, &t) in counts.iter_mut().zip(&out) {
            c[t as usize] += 1;
        }
        let s = report.stats;
        stats.drafted += s.drafted;
        stats.accepted += s.accepted;
        stats.rejections += s.rejections;
        stats.stale_blocks += s.stale_blocks;
        stats.stale_verdicts += s.stale_verdicts;
        stats.lane_hits += s.lane_hits;
        stats.side_nodes += s.side_nodes;
    }
    (counts, stats)
}

fn check(rule: VerifyRule) {
    let started = Instant::now();
    let (tm, dm) = (target_model(), draft_model());
    let (target, draft_tree) = (Tree::new(&tm), Tree::new(&dm));
    let mut verifier = VerifierCore::new(engine(&tm), VerifierConfig::default(), 0).unwrap();
    let mut draft = engine(&dm);
    for (ix, case) in cases().iter().enumerate() {
        let want = target.marginals(&case.params);
        let draft_marginals = draft_tree.marginals(&case.params);
        let before = verifier.stats;
        let (counts, stats) =
            committed_counts(rule, (ix, case), &target, &mut verifier, &mut draft);
        let (early, verified, decoded) = (
            verifier.stats.blocks_covered + verifier.stats.blocks_contradicted
                - before.blocks_covered
                - before.blocks_contradicted,
            verifier.stats.blocks_verified - before.blocks_verified,
            verifier.stats.spec_decoded - before.spec_decoded,
        );
        println!(
            "{rule:?}, {}: {} drafted, {} accepted, {} rejections (acceptance {:.3}), \
             {} stale blocks, {} stale verdicts, {} side nodes, {} lane hits; the verifier: \
             {verified} blocks verified, {early} matched without a forward, {decoded} tokens decoded",
            case.name,
            stats.drafted,
            stats.accepted,
            stats.rejections,
            stats.acceptance_rate(),
            stats.stale_blocks,
            stats.stale_verdicts,
            stats.side_nodes,
            stats.lane_hits,
        );
        for pos in 1..3 {
            let (x, dof) = chi2(&counts[pos], &want[pos]);
            let crit = chi2_critical(dof);
            let (wrong, wrong_dof) = chi2(&counts[pos], &draft_marginals[pos]);
            println!(
                "  position {pos}: χ² {x:.1} ({dof} dof, 0.999 quantile {crit:.1}); \
                 against the draft's distribution χ² {wrong:.1}"
            );
            println!("    counts   {:?}", counts[pos]);
            let expected: Vec<String> = want[pos]
                .iter()
                .map(|p| format!("{:.0}", p * RUNS as f64))
                .collect();
            println!("    expected [{}]", expected.join(", "));
            assert!(
                x < crit,
                "{rule:?}, {}, position {pos}: χ² {x} ≥ {crit} ({dof} dof)",
                case.name
            );
            assert!(
                wrong > 10.0 * chi2_critical(wrong_dof),
                "{rule:?}, {}, position {pos}: the draft's distribution passes too (χ² {wrong})",
                case.name
            );
        }
        let some = RUNS as usize / 20;
        assert!(
            stats.accepted > some && stats.rejections > some,
            "{rule:?}, {}: both verdicts must be common: {stats:?}",
            case.name
        );
        assert!(
            case.tree.side_nodes == 0 || stats.lane_hits > some,
            "{rule:?}, {}: the branches must be committed often: {stats:?}",
            case.name
        );
        assert!(
            case.depth == 1 || (stats.stale_blocks > some && early as usize > RUNS as usize / 100),
            "{rule:?}, {}: blocks in flight must go stale and meet the pending prediction: \
             {stats:?}, {early} decided early",
            case.name
        );
    }
    println!("{rule:?}: {:.1} s", started.elapsed().as_secs_f64());
}

#[test]
fn sample_match_commits_the_target_distribution() {
    check(VerifyRule::SampleMatch);
}

#[test]
fn rejection_sampling_commits_the_target_distribution() {
    check(VerifyRule::Rejection);
}
