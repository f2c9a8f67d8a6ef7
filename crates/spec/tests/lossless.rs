//! The edge pipeline against the real verifier bookkeeping, with a fake target and draft, under
//! arbitrary interleavings of drafting, block delivery, the verifier's own decode steps (blocks
//! land before, during and after them: stale, partly and wholly agreeing), verdict delivery,
//! dropped connections, reshapes, lead changes and grants of γ 0 and back: the committed sequence
//! is exactly the target's greedy continuation (or, sampled, its draw by position under
//! sample-and-match; under a structured output's grammar, from its masked rows), no unverified token is ever committed, no
//! position is told or committed twice, the two sides' epochs never drift, and the target's KV
//! holds exactly the committed tokens after each forward. Blocks may be token trees (second
//! choices and branches beside the main path).

use std::collections::VecDeque;

use proptest::prelude::*;
use std::cell::Cell;

use tandem_spec::sampling::{sample, uniform, SamplingParams};
use tandem_spec::suffix::SuffixPolicy;
use tandem_spec::{
    Block, BlockAction, CloudSession, Decoded, Feed, Frontier, Grammar, GrammarSource,
    GrammarVocab, Grown, Hedge, Next, Output, Pipeline, PipelineConfig, Shape, TreeConfig, Verdict,
    VerifyRule,
};

const VOCAB: usize = 8;
const EOG: u32 = 7;

/// The fake target's greedy token at `pos` after `last`: at about half the positions a
/// function of `last` alone (so its text repeats itself and copies are often right, as a
/// verifier drafting for itself from the session's text finds), at the others a draw.
fn target(last: u32, pos: usize, seed: u64) -> u32 {
    if uniform(seed, pos as u64, 11) < 0.5 {
        return (last * 3 + 1 + (seed % 2) as u32) % (VOCAB as u32 - 1);
    }
    let t = (uniform(seed, (pos as u64) << 8 | last as u64, 9) * VOCAB as f64) as u32;
    // Make end-of-generation rare.
    if t == EOG && uniform(seed, pos as u64, 10) < 0.8 {
        (last + 1) % (VOCAB as u32 - 1)
    } else {
        t
    }
}

fn logits_for(t: u32) -> Vec<f32> {
    let mut l = vec![0f32; VOCAB];
    l[t as usize] = 4.0;
    l
}

/// A structured output over the toy vocabulary (tokens 0–6 are the bytes `a`–`g`, 7 the end):
/// `a` or `b` must be followed by `c`, `d` by `e` (forced tokens), `f` and `g` stand alone, and
/// the end may come only between groups. The fake target's favourite is often not allowed.
fn toy_grammar() -> Grammar {
    thread_local! {
        static COMPILED: Grammar = compile_toy_grammar();
    }
    COMPILED.with(Grammar::clone)
}

fn compile_toy_grammar() -> Grammar {
    let tokens: Vec<Vec<u8>> = (b'a'..=b'g')
        .map(|b| vec![b])
        .chain([b"<|end|>".to_vec()])
        .collect();
    let mut special = vec![false; VOCAB];
    special[EOG as usize] = true;
    GrammarVocab::new(&tokens, &special, &[EOG], VOCAB)
        .unwrap()
        .compile(&GrammarSource::Lark(
            r#"start: (("a" | "b") "c" | "d" "e" | "f" | "g")*"#.into(),
        ))
        .unwrap()
}

thread_local! {
    /// How the target draws in this case (greedy unless a sampled case sets it; the verify rule
    /// is then sample-and-match): proptest runs a test's cases one after another on one thread.
    static PARAMS: Cell<SamplingParams> = Cell::new(SamplingParams::default());
    /// The verifier drafts for itself from the session's text when it decodes (this case).
    static SELF_DRAFT: Cell<bool> = const { Cell::new(false) };
    /// Blocks of the edge that reached positions the verifier had committed from its own
    /// accepted guesses: verified past them, dropped as covered, dropped as contradicted (the
    /// edge's drafted tokens there rolled back by the verifier's own drafts).
    static OVER_GUESSES: Cell<[usize; 3]> = const { Cell::new([0; 3]) };
}

fn over_guesses(i: usize) {
    OVER_GUESSES.with(|c| {
        let mut v = c.get();
        v[i] += 1;
        c.set(v);
    });
}

/// The verifier's self-drafting policy in these tests: any match, up to five guesses, whose
/// positions cost nothing (so that it keeps guessing however often it misses).
const SELF_POLICY: SuffixPolicy = SuffixPolicy {
    min_match: 1,
    factor: 2.0,
    max_tokens: 5,
};

/// The target's token at `pos` after `last` under `grammar` (at its state there). Greedy: its
/// favourite when allowed, else the first allowed token (the masked row's argmax: the others tie
/// at 0). Sampled: the draw by position from its row, masked.
fn masked_target(grammar: Option<&mut Grammar>, last: u32, pos: usize, seed: u64) -> u32 {
    let t = target(last, pos, seed);
    let params = PARAMS.with(Cell::get);
    if !params.is_greedy() {
        let mut row = logits_for(t);
        if let Some(g) = grammar {
            row = g.mask(&row).unwrap();
        }
        return sample(&row, &params, pos as u64);
    }
    let Some(g) = grammar else {
        return t;
    };
    if g.allows(t).unwrap() {
        t
    } else {
        (0..VOCAB as u32).find(|&x| g.allows(x).unwrap()).unwrap()
    }
}

/// The grammar at its state after `output`, or None where the grammar does not allow it (a draft
/// gone astray).
fn grammar_after(output: &[u32]) -> Option<Grammar> {
    let mut g = toy_grammar();
    g.seek(output).ok().map(|()| g)
}

/// The draft guesses the target's token with probability alpha, else a wrong one; a constrained
/// session's draft guesses the target's token under the grammar (after the output from
/// `output_from` on).
fn draft_for(seq: &[u32], seed: u64, alpha: f64, salt: u64, output_from: Option<usize>) -> u32 {
    let pos = seq.len();
    let mut g = output_from.and_then(|f| grammar_after(&seq[f..]));
    let t = masked_target(g.as_mut(), *seq.last().unwrap(), pos, seed);
    if uniform(seed ^ 0xd4af, (pos as u64) << 16 | salt, 4) < alpha {
        t
    } else {
        (t + 1 + (salt % 3) as u32) % VOCAB as u32
    }
}

/// The draft guesses the target's token with probability alpha, else a wrong one.
fn draft(seq: &[u32], seed: u64, alpha: f64, salt: u64) -> u32 {
    let pos = seq.len();
    let t = target(*seq.last().unwrap(), pos, seed);
    if uniform(seed ^ 0xd4af, (pos as u64) << 16 | salt, 4) < alpha {
        t
    } else {
        (t + 1 + (salt % 3) as u32) % VOCAB as u32
    }
}

/// The draft's second choice beside `token`: often the target's token when the draft missed.
fn hedge(seq: &[u32], token: u32, seed: u64, salt: u64) -> Option<Hedge> {
    let pos = seq.len();
    let t = target(*seq.last().unwrap(), pos, seed);
    let u = uniform(seed ^ 0x4ed9, (pos as u64) << 16 | salt, 5);
    let alt = if t != token && u < 0.6 {
        t
    } else {
        (token + 1 + (salt % 5) as u32) % VOCAB as u32
    };
    (alt != token).then_some(Hedge {
        alt,
        p_top: uniform(seed ^ 0x4ed9, (pos as u64) << 16 | salt, 6) as f32 * 0.6,
    })
}

fn oracle(prompt: &[u32], max_new: usize, seed: u64, constrained: bool) -> Vec<u32> {
    let mut seq = prompt.to_vec();
    let mut out = Vec::new();
    let mut g = constrained.then(toy_grammar);
    while out.len() < max_new {
        let t = masked_target(g.as_mut(), *seq.last().unwrap(), seq.len(), seed);
        if let Some(g) = &mut g {
            g.advance(t).unwrap();
        }
        seq.push(t);
        out.push(t);
        if t == EOG {
            break;
        }
    }
    out
}

/// The cloud side: verifier bookkeeping plus an emulated target KV holding real token history.
struct Cloud {
    session: CloudSession,
    kv: Vec<u32>,
    seed: u64,
    /// Blocks received, not yet planned.
    queue: VecDeque<Block>,
    /// Verify blocks (false: the grant is γ 0 and the verifier decodes every token; blocks still
    /// queued are only matched once they are covered).
    verify: bool,
    /// A grant to send with the next decoded token.
    grant: Option<Shape>,
    limit: usize,
    /// The next position the cloud tells the edge: each exactly once.
    told: usize,
    /// The last position committed from one of the verifier's own accepted guesses.
    guessed_at: Option<usize>,
}

/// What the verifier sends the edge.
#[derive(Debug, Clone, Copy)]
enum ToEdge {
    Verdict(Verdict),
    Decoded(Decoded),
}

impl Cloud {
    /// Open (or re-open) a session from the edge's committed history: the first token is
    /// committed and told at once.
    /// A constrained session's `grammar` is at its state after the output in `history` (a
    /// reopen sends it as part of the prompt).
    fn open(history: &[u32], seed: u64, limit: usize, mut grammar: Option<Grammar>) -> (Self, u32) {
        let first = masked_target(
            grammar.as_mut(),
            *history.last().unwrap(),
            history.len(),
            seed,
        );
        // Greedy, or sample-and-match under sampled parameters (`VerifyRule::effective`).
        let mut session = CloudSession::new(
            VerifyRule::Greedy,
            PARAMS.with(Cell::get),
            history,
            first,
            10_000,
        );
        if let Some(mut g) = grammar {
            g.advance(first).unwrap();
            session = session.constrain(g);
        }
        if SELF_DRAFT.with(Cell::get) {
            session = session.with_self_draft(SELF_POLICY, &Default::default());
        }
        let c = Self {
            session,
            kv: history.to_vec(),
            seed,
            queue: VecDeque::new(),
            verify: true,
            grant: None,
            limit,
            told: history.len() + 1,
            guessed_at: None,
        };
        (c, first)
    }

    fn ended(&self) -> bool {
        let c = self.session.committed();
        c.len() >= self.limit || c.last() == Some(&EOG)
    }

    fn receive(&mut self, b: Block) -> Result<(), TestCaseError> {
        self.session
            .check(&b)
            .and_then(|()| self.session.accept_index(&b))
            .map_err(|e| TestCaseError::fail(format!("the edge sent a bad block: {e}")))?;
        self.queue.push_back(b);
        Ok(())
    }

    /// Run `plan` on the emulated target: the logits rows it asks for (each token's from its
    /// own position: a tree's siblings share one).
    fn forward(&mut self, plan: &Feed) -> Vec<Vec<f32>> {
        assert_eq!(
            self.kv.len(),
            plan.start_pos,
            "plan starts at the KV length"
        );
        let mut pos: Vec<usize> = Vec::new();
        for i in 0..plan.tokens.len() {
            pos.push(match plan.parents.get(i) {
                Some(&q) if i > 0 => pos[q] + 1,
                _ => plan.start_pos + i,
            });
        }
        plan.logits_at
            .iter()
            .map(|&i| logits_for(target(plan.tokens[i], pos[i] + 1, self.seed)))
            .collect()
    }

    /// The target's KV after `plan` and its verdict: the fed tokens of the accepted path only.
    fn keep(&mut self, plan: &Feed, keep: &[usize], kv_len: usize) -> Result<(), TestCaseError> {
        if plan.is_tree() {
            self.kv.push(plan.tokens[0]);
            self.kv.extend(keep.iter().map(|&j| plan.tokens[j]));
        } else {
            self.kv.extend_from_slice(&plan.tokens);
        }
        self.kv.truncate(kv_len);
        prop_assert_eq!(
            &self.kv[..],
            &self.session.committed()[..kv_len],
            "the KV holds the committed tokens"
        );
        Ok(())
    }

    /// [`Cloud::step_all`] where it tells at most one message.
    fn step(&mut self) -> Result<Option<ToEdge>, TestCaseError> {
        let mut m = self.step_all()?;
        assert!(m.len() <= 1, "one message: {m:?}");
        Ok(m.pop())
    }

    /// One forward of the verifier for this session: the oldest usable block verified, or the
    /// next token decoded (with the verifier's own guesses, when it drafts for itself: each
    /// token committed is told as decoded). Blocks that need no forward are dropped on the way.
    fn step_all(&mut self) -> Result<Vec<ToEdge>, TestCaseError> {
        if self.ended() {
            return Ok(Vec::new());
        }
        while let Some(b) = self.queue.front().cloned() {
            let over = self.guessed_at.is_some_and(|g| g >= b.start_pos);
            match self.session.block_action(&b) {
                Ok(BlockAction::Stale) => {
                    self.queue.pop_front();
                }
                Ok(BlockAction::Covered) => {
                    if over {
                        over_guesses(1);
                    }
                    self.queue.pop_front();
                }
                Ok(BlockAction::Contradicted { .. }) => {
                    if over {
                        over_guesses(2);
                    }
                    self.queue.pop_front();
                }
                Ok(BlockAction::Forward(plan)) if self.verify => {
                    if over {
                        over_guesses(0);
                    }
                    self.queue.pop_front();
                    let rows = self.forward(&plan);
                    let refs: Vec<&[f32]> = rows.iter().map(|r| &r[..]).collect();
                    let f = self
                        .session
                        .finish(&b, &plan, &refs)
                        .expect("rows match the plan");
                    self.keep(&plan, &f.keep, f.kv_len)?;
                    let end = b.start_pos + f.verdict.accepted + 1;
                    prop_assert!(end > self.told, "a verdict re-tells position {}", self.told);
                    self.told = end;
                    return Ok(vec![ToEdge::Verdict(f.verdict)]);
                }
                Ok(BlockAction::Forward(_)) => break,
                Err(e) => return Err(TestCaseError::fail(format!("planning a block: {e}"))),
            }
        }
        let guesses = self
            .session
            .self_guesses(usize::MAX, self.limit, &[EOG], 0.0);
        let plan = self
            .session
            .decode_feed_with(&guesses)
            .expect("below the context limit");
        let rows = self.forward(&plan);
        let refs: Vec<&[f32]> = rows.iter().map(|r| &r[..]).collect();
        let run = self.session.finish_decode_run(&plan, &refs).unwrap();
        prop_assert_eq!(run.guessed, guesses.len());
        self.keep(&plan, &[], self.session.kv_len())?;
        let mut told = Vec::new();
        for mut d in run.decoded {
            prop_assert_eq!(d.pos, self.told, "each position is told once, in order");
            if d.guessed {
                self.guessed_at = Some(d.pos);
            }
            self.told += 1;
            d.grant = self.grant.take();
            told.push(ToEdge::Decoded(d));
        }
        Ok(told)
    }
}

#[derive(Debug, Clone, Copy)]
enum Step {
    /// A draft step (or the end of the one in its forward: see `DraftStart`).
    Draft,
    /// A draft step whose forward runs while the steps after it go on (messages reach the edge
    /// meanwhile); its tokens come at the next `Draft` (`Pipeline::on_grown_at`).
    DraftStart,
    /// A block reaches the verifier's queue.
    DeliverBlock,
    /// One forward of the verifier for the session.
    CloudForward,
    DeliverToEdge,
    DropConnection,
    /// The policy changes γ and depth mid-stream.
    Reshape(usize, usize),
    /// The edge keeps this many more blocks in flight for the verifier's lead.
    Lead(usize),
    /// The verifier's grant becomes γ 0 (it stops verifying, decodes every token) or back.
    TakeOver,
    HandBack,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        6 => Just(Step::Draft),
        2 => Just(Step::DraftStart),
        3 => Just(Step::DeliverBlock),
        3 => Just(Step::CloudForward),
        4 => Just(Step::DeliverToEdge),
        1 => Just(Step::DropConnection),
        1 => (1usize..8, 1usize..5).prop_map(|(g, d)| Step::Reshape(g, d)),
        1 => (0usize..12).prop_map(Step::Lead),
        1 => Just(Step::TakeOver),
        1 => Just(Step::HandBack),
    ]
}

#[allow(clippy::too_many_arguments)]
fn run(
    seed: u64,
    alpha: f64,
    gamma: usize,
    depth: usize,
    max_new: usize,
    tree: TreeConfig,
    schedule: &[Step],
    constrained: bool,
) -> Result<(), TestCaseError> {
    let prompt: Vec<u32> = (0..3).map(|i| (seed as u32 + i) % 7).collect();
    let want = oracle(&prompt, max_new, seed, constrained);
    let cfg = PipelineConfig {
        draft_len: gamma,
        depth,
        max_new_tokens: max_new,
    };
    let limit = prompt.len() + max_new;
    let output_from = constrained.then_some(prompt.len());
    let (mut cloud, first) = Cloud::open(&prompt, seed, limit, constrained.then(toy_grammar));
    let (mut edge, outs) = Pipeline::with_first(prompt.clone(), first, cfg, vec![EOG]).unwrap();
    edge.set_tree(tree);
    let (mut to_cloud, mut to_edge) = (VecDeque::<Block>::new(), VecDeque::<ToEdge>::new());
    let mut committed: Vec<u32> = Vec::new();
    let mut draft_kv = 0usize;
    let mut salt = 0u64;
    // Every leaf of frontier `f` grows a token (the main path first).
    let grow = |edge: &Pipeline, f: &Frontier, salt: &mut u64| -> Vec<Grown> {
        f.leaves
            .iter()
            .map(|leaf| {
                *salt += 1;
                let mut seq = edge.tokens()[..f.base].to_vec();
                seq.extend(leaf);
                let t = draft_for(&seq, seed, alpha, *salt, output_from);
                let h = hedge(&seq, t, seed, *salt);
                Grown {
                    token: t,
                    q: None,
                    hedge: h,
                }
            })
            .collect()
    };
    // A draft step in its forward: the frontier it grows and its tokens.
    let mut in_forward: Option<(Frontier, Vec<Grown>, Vec<u32>)> = None;
    let handle = |outs: Vec<Output>,
                  committed: &mut Vec<u32>,
                  draft_kv: &mut usize,
                  to_cloud: &mut VecDeque<Block>|
     -> Result<(), TestCaseError> {
        for o in outs {
            match o {
                Output::Send(b) => to_cloud.push_back(b),
                // Flow control is the edge session's (this test drives the pipeline itself).
                Output::Ack { .. } => {}
                Output::Rollback { to } => {
                    prop_assert!(
                        to < *draft_kv + 1,
                        "rollback to {} beyond fed {}",
                        to,
                        draft_kv
                    );
                    *draft_kv = to;
                }
                Output::Commit { pos, tokens } => {
                    prop_assert_eq!(
                        pos,
                        prompt.len() + committed.len(),
                        "commits are contiguous, never repeated"
                    );
                    for (i, t) in tokens.iter().enumerate() {
                        let k = committed.len() + i;
                        prop_assert!(k < want.len(), "committed past the end");
                        prop_assert_eq!(*t, want[k], "committed token {} is not the target's", k);
                    }
                    committed.extend(tokens);
                }
            }
        }
        Ok(())
    };
    handle(outs, &mut committed, &mut draft_kv, &mut to_cloud)?;
    let mut i = 0;
    let mut steps = 0;
    while edge.next() != Next::Done {
        steps += 1;
        prop_assert!(steps < 20_000, "no progress");
        // Follow the schedule, then a fair round-robin.
        let s = schedule.get(i).copied().unwrap_or(match steps % 4 {
            0 => Step::Draft,
            1 => Step::DeliverBlock,
            2 => Step::DeliverToEdge,
            _ => Step::CloudForward,
        });
        i += 1;
        match s {
            Step::Draft if in_forward.is_some() => {
                let (f, grown, path) = in_forward.take().expect("checked");
                let fed = edge.tokens().len();
                let taken = edge
                    .on_grown_at(&f, grown)
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                if let Some(outs) = taken {
                    // Still the frontier: the step is the one the drafter would take now, its
                    // token drawn after the very path it follows.
                    prop_assert_eq!(fed + 1, edge.tokens().len());
                    prop_assert_eq!(&edge.tokens()[..fed], &path[..], "a token on another path");
                    draft_kv = fed;
                    handle(outs, &mut committed, &mut draft_kv, &mut to_cloud)?;
                }
            }
            Step::DraftStart if in_forward.is_none() && edge.next() == Next::Draft => {
                draft_kv = edge.tokens().len();
                let f = edge.frontier();
                let grown = grow(&edge, &f, &mut salt);
                in_forward = Some((f, grown, edge.tokens().to_vec()));
            }
            Step::Draft if edge.next() == Next::Draft => {
                prop_assert!(edge.draft_fed() <= edge.tokens().len());
                // The shell feeds everything before drafting.
                draft_kv = edge.tokens().len();
                let f = edge.frontier();
                let grown = grow(&edge, &f, &mut salt);
                let outs = edge
                    .on_grown(grown)
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                prop_assert_eq!(edge.draft_fed() + 1, edge.tokens().len());
                handle(outs, &mut committed, &mut draft_kv, &mut to_cloud)?;
            }
            Step::DeliverBlock => {
                if let Some(b) = to_cloud.pop_front() {
                    cloud.receive(b)?;
                }
            }
            Step::CloudForward => to_edge.extend(cloud.step_all()?),
            Step::DeliverToEdge => {
                let outs = match to_edge.pop_front() {
                    Some(ToEdge::Verdict(v)) => edge.on_verdict(v),
                    Some(ToEdge::Decoded(d)) => edge.on_decoded(d).map(|mut o| {
                        if let Some(g) = d.grant {
                            o.extend(edge.set_drafting(g.draft_len > 0));
                        }
                        o
                    }),
                    None => Ok(Vec::new()),
                }
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
                handle(outs, &mut committed, &mut draft_kv, &mut to_cloud)?;
            }
            Step::TakeOver => {
                cloud.verify = false;
                cloud.grant = Some(Shape::new(0, 1));
            }
            Step::HandBack => {
                cloud.verify = true;
                cloud.grant = Some(Shape::new(2, 2));
            }
            Step::DropConnection => {
                // A step in its forward when the connection goes is the old session's.
                in_forward = None;
                to_cloud.clear();
                to_edge.clear();
                let outs = edge.on_connection_lost();
                handle(outs, &mut committed, &mut draft_kv, &mut to_cloud)?;
                let history = edge.tokens()[..edge.committed_len()].to_vec();
                let grammar = constrained.then(|| {
                    grammar_after(&history[prompt.len()..]).expect("committed tokens are allowed")
                });
                let (c, first) = Cloud::open(&history, seed, limit, grammar);
                cloud = c;
                let outs = edge.on_reopened(first);
                handle(outs, &mut committed, &mut draft_kv, &mut to_cloud)?;
            }
            Step::Reshape(g, d) => {
                let outs = edge
                    .set_shape(g, d)
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                handle(outs, &mut committed, &mut draft_kv, &mut to_cloud)?;
            }
            Step::Lead(l) => {
                let outs = edge.set_lead(l);
                handle(outs, &mut committed, &mut draft_kv, &mut to_cloud)?;
            }
            _ => {}
        }
        // The two sides move epochs together: a verdict is never of an epoch the edge left, and
        // once nothing is on the way, both are at the same one — while the generation goes on
        // (a lane that ends with the end-of-generation token inside its block is off the tree
        // for the verifier, which commits its correction after it; the edge, done, takes no
        // more).
        prop_assert_eq!(edge.stats().stale_verdicts, 0, "a verdict went stale");
        if edge.next() != Next::Done
            && to_cloud.is_empty()
            && to_edge.is_empty()
            && cloud.queue.is_empty()
        {
            prop_assert_eq!(edge.epoch(), cloud.session.epoch(), "the epochs drifted");
        }
    }
    prop_assert_eq!(&committed, &want);
    prop_assert_eq!(edge.output(), &want[..]);
    let s = edge.stats();
    prop_assert!(s.accepted <= s.drafted);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, ..ProptestConfig::default() })]
    #[test]
    fn committed_sequence_is_the_targets(
        seed in 0u64..10_000,
        alpha in prop_oneof![Just(0.0), Just(0.5), Just(0.8), Just(1.0), 0.0f64..1.0],
        gamma in 1usize..8,
        depth in 1usize..5,
        max_new in 1usize..40,
        tree in prop_oneof![
            1 => Just(TreeConfig::LINEAR),
            2 => (1usize..12, 1usize..4, 0.4f32..1.0, prop_oneof![Just(0.0f32), 0.0f32..0.1]).prop_map(
                |(side_nodes, lanes, below, min_chance)| {
                    TreeConfig { side_nodes, lanes, below, min_chance }
                }
            ),
        ],
        schedule in proptest::collection::vec(step(), 0..300),
        self_draft in any::<bool>(),
    ) {
        SELF_DRAFT.with(|c| c.set(self_draft));
        run(seed, alpha, gamma, depth, max_new, tree, &schedule, false)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, ..ProptestConfig::default() })]

    /// The same under a grammar (a structured output): the committed sequence is the target's
    /// greedy continuation under the grammar's mask, whatever the draft proposes (tokens the
    /// grammar forbids, the target's unmasked favourite among them, included).
    #[test]
    fn a_constrained_sessions_committed_sequence_is_the_targets_under_its_grammar(
        seed in 0u64..10_000,
        alpha in prop_oneof![Just(0.0), Just(0.8), Just(1.0), 0.0f64..1.0],
        gamma in 1usize..8,
        depth in 1usize..5,
        max_new in 1usize..40,
        tree in prop_oneof![
            1 => Just(TreeConfig::LINEAR),
            1 => (1usize..12, 1usize..4, 0.4f32..1.0).prop_map(
                |(side_nodes, lanes, below)| {
                    TreeConfig { side_nodes, lanes, below, min_chance: 0.0 }
                }
            ),
        ],
        schedule in proptest::collection::vec(step(), 0..300),
        self_draft in any::<bool>(),
    ) {
        SELF_DRAFT.with(|c| c.set(self_draft));
        run(seed, alpha, gamma, depth, max_new, tree, &schedule, true)?;
    }

    /// Sampled (sample-and-match, the default rule): the committed sequence is the target's own
    /// seeded draw by position from its masked rows, free and under the grammar, on linear blocks
    /// and over trees — the same text for (prompt, parameters, seed) whatever the interleaving of
    /// drafts, deliveries and the verifier's own decoding.
    #[test]
    fn a_sampled_sessions_committed_sequence_is_the_targets_draw_free_and_constrained(
        seed in 0u64..10_000,
        temperature in prop_oneof![Just(0.7f32), Just(1.0f32), 0.3f32..1.5],
        alpha in prop_oneof![Just(0.0), Just(0.8), Just(1.0), 0.0f64..1.0],
        gamma in 1usize..8,
        depth in 1usize..5,
        max_new in 1usize..40,
        constrained in any::<bool>(),
        tree in prop_oneof![
            2 => Just(TreeConfig::LINEAR),
            1 => (1usize..12, 1usize..4, 0.4f32..1.0).prop_map(
                |(side_nodes, lanes, below)| {
                    TreeConfig { side_nodes, lanes, below, min_chance: 0.0 }
                }
            ),
        ],
        schedule in proptest::collection::vec(step(), 0..300),
        self_draft in any::<bool>(),
    ) {
        SELF_DRAFT.with(|c| c.set(self_draft));
        PARAMS.with(|p| p.set(SamplingParams { temperature, top_k: 0, top_p: 1.0, seed }));
        let r = run(seed, alpha, gamma, depth, max_new, tree, &schedule, constrained);
        PARAMS.with(|p| p.set(SamplingParams::default()));
        r?;
    }
}

/// The interleavings the lossless properties run do meet the verifier's own drafts: edge blocks
/// arrive over tokens it committed from its guesses and are verified past them, dropped as
/// covered, and dropped as contradicted (the edge's drafted tokens rolled back by them), every
/// run still the target's.
#[test]
fn edge_blocks_arrive_over_the_verifiers_own_drafts() {
    use proptest::test_runner::{Config, TestRunner};
    let mut runner = TestRunner::new_with_rng(
        Config {
            cases: 400,
            ..Config::default()
        },
        proptest::test_runner::TestRng::deterministic_rng(
            proptest::test_runner::RngAlgorithm::ChaCha,
        ),
    );
    SELF_DRAFT.with(|c| c.set(true));
    OVER_GUESSES.with(|c| c.set([0; 3]));
    let cases = (
        0u64..10_000,
        prop_oneof![Just(0.5), Just(0.8), 0.0f64..1.0],
        1usize..8,
        1usize..5,
        10usize..40,
        proptest::collection::vec(step(), 50..300),
    );
    runner
        .run(&cases, |(seed, alpha, gamma, depth, max_new, schedule)| {
            run(
                seed,
                alpha,
                gamma,
                depth,
                max_new,
                TreeConfig::LINEAR,
                &schedule,
                false,
            )
        })
        .unwrap();
    SELF_DRAFT.with(|c| c.set(false));
    let [verified, covered, contradicted] = OVER_GUESSES.with(Cell::get);
    assert!(
        verified > 0 && covered > 0 && contradicted > 0,
        "over the verifier's guesses: {verified} verified, {covered} covered, {contradicted} contradicted"
    );
}

#[test]
fn async_pipelining_keeps_blocks_in_flight() {
    // A perfect draft with depth 3 keeps three blocks in flight while verdicts are slow.
    let prompt = vec![1, 2, 3];
    let cfg = PipelineConfig {
        draft_len: 4,
        depth: 3,
        max_new_tokens: 64,
    };
    let (mut edge, _) = Pipeline::with_first(prompt, 6, cfg, vec![EOG]).unwrap();
    let mut sent = 0;
    while edge.next() == Next::Draft {
        let t = draft(edge.tokens(), 5, 1.0, 0);
        sent += edge
            .on_drafted(t, None)
            .iter()
            .filter(|o| matches!(o, Output::Send(_)))
            .count();
    }
    assert_eq!(sent, 3);
    assert_eq!(edge.blocks_in_flight(), 3);
    assert_eq!(edge.next(), Next::Wait);
}

#[test]
fn depth_one_is_synchronous() {
    // With one block in flight the edge waits for its verdict; after a whole block passes, the
    // bonus is committed and the next block starts after it.
    let prompt = vec![1, 2, 3];
    let cfg = PipelineConfig {
        draft_len: 3,
        depth: 1,
        max_new_tokens: 64,
    };
    let (mut cloud, first) = Cloud::open(&prompt, 5, 67, None);
    let (mut edge, _) = Pipeline::with_first(prompt.clone(), first, cfg, vec![EOG]).unwrap();
    let mut block = None;
    while edge.next() == Next::Draft {
        let t = draft(edge.tokens(), 5, 1.0, 0);
        for o in edge.on_drafted(t, None) {
            if let Output::Send(b) = o {
                block = Some(b);
            }
        }
    }
    assert_eq!(edge.next(), Next::Wait);
    assert_eq!(
        edge.tokens().len(),
        prompt.len() + 4,
        "the first token and a block, nothing past it"
    );
    cloud.receive(block.unwrap()).unwrap();
    let Some(ToEdge::Verdict(v)) = cloud.step().unwrap() else {
        panic!("a verdict")
    };
    assert_eq!(v.accepted, 3);
    let outs = edge.on_verdict(v).unwrap();
    let committed: usize = outs
        .iter()
        .map(|o| match o {
            Output::Commit { tokens, .. } => tokens.len(),
            _ => 0,
        })
        .sum();
    assert_eq!(committed, 4, "three drafted tokens and the bonus");
    assert_eq!(edge.next(), Next::Draft);
}

#[test]
fn a_block_that_lands_behind_the_verifier_is_matched_then_verified() {
    // The verifier decodes two tokens while a perfect block of four travels: the two are matched
    // for free, the other two verified, and the verdict commits them and the bonus.
    let prompt = vec![1, 2, 3];
    let cfg = PipelineConfig {
        draft_len: 4,
        depth: 1,
        max_new_tokens: 64,
    };
    let (mut cloud, first) = Cloud::open(&prompt, 9, 67, None);
    let (mut edge, _) = Pipeline::with_first(prompt, first, cfg, vec![EOG]).unwrap();
    let mut block = None;
    while edge.next() == Next::Draft {
        let t = draft(edge.tokens(), 9, 1.0, 0);
        for o in edge.on_drafted(t, None) {
            if let Output::Send(b) = o {
                block = Some(b);
            }
        }
    }
    let mut decoded = Vec::new();
    for _ in 0..2 {
        let Some(ToEdge::Decoded(d)) = cloud.step().unwrap() else {
            panic!("a decode")
        };
        decoded.push(d);
    }
    cloud.receive(block.unwrap()).unwrap();
    let Some(ToEdge::Verdict(v)) = cloud.step().unwrap() else {
        panic!("a verdict")
    };
    assert_eq!((v.accepted, cloud.session.verified_positions), (4, 2));
    let before = edge.stats().drafted;
    for d in decoded {
        let out = edge.on_decoded(d).unwrap();
        assert!(
            !out.iter().any(|o| matches!(o, Output::Rollback { .. })),
            "{out:?}"
        );
    }
    assert_eq!(
        (edge.committed_len(), edge.epoch()),
        (6, 0),
        "agreeing decodes keep the tail"
    );
    edge.on_verdict(v).unwrap();
    assert_eq!(
        edge.committed_len(),
        9,
        "the rest of the block and the bonus"
    );
    assert_eq!(edge.stats().drafted, before, "nothing drafted again");
}

#[test]
fn a_verifier_drafting_for_itself_commits_several_tokens_per_forward_and_the_targets_text() {
    // The verifier decodes alone (no edge block comes), guessing from the session's own text:
    // the text is the target's, and some forwards commit accepted guesses besides the token.
    SELF_DRAFT.with(|c| c.set(true));
    let (mut guessed, mut forwards, mut tokens) = (0, 0, 0);
    for seed in 0..40 {
        let prompt = vec![1, 2, 3];
        let want = oracle(&prompt, 60, seed, false);
        let (mut cloud, first) = Cloud::open(&prompt, seed, prompt.len() + 60, None);
        let mut out = vec![first];
        while !cloud.ended() {
            forwards += 1;
            for m in cloud.step_all().unwrap() {
                let ToEdge::Decoded(d) = m else {
                    panic!("no block was sent")
                };
                guessed += d.guessed as usize;
                out.push(d.token);
            }
        }
        tokens += out.len() - 1;
        assert_eq!(out, want, "seed {seed}");
    }
    SELF_DRAFT.with(|c| c.set(false));
    assert!(
        guessed * 5 > tokens,
        "{guessed} of {tokens} tokens were accepted guesses ({forwards} forwards)"
    );
}
