//! What proposes draft tokens: the draft model ([`EngineDrafter`]), or anything else that
//! implements [`Drafter`] (the synthetic edges of the load generator and the tests: [`crate::synthetic`]).

use tandem_engine::{Engine, Logits, Parent, SeqChunk, SeqId, Wanted};
use tandem_spec::sampling::{sample, second_choice, SamplingParams};
pub use tandem_spec::suffix::{Copier, CopyStats};
use tandem_spec::verify::{draft_sample, draft_sibling, VerifyRule};
use tandem_spec::{Grammar, Hedge};

use crate::{EdgeError, SpecConfig};

/// One proposed token.
#[derive(Debug, Clone)]
pub struct Proposal {
    pub token: u32,
    /// The draft's sparse distribution at this position (rejection sampling only).
    pub q: Option<Vec<(u32, f32)>>,
    /// This call also fed the prompt (its time is a prefill, not a draft step).
    pub prefill: bool,
    /// The draft's second choice there and how sure it was of `token` (for token trees).
    pub hedge: Option<Hedge>,
}

pub trait Drafter {
    /// Grow each leaf of the draft tree by one token: leaf `i` is `base` (prompt, committed and
    /// drafted tokens every leaf shares) followed by `leaves[i]`. Returns one proposal per leaf,
    /// in order. A linear draft has one leaf, empty: the next token after `base`.
    fn grow(&mut self, base: &[u32], leaves: &[Vec<u32>]) -> Result<Vec<Proposal>, EdgeError>;
    /// The session's committed tokens (prompt included) before a [`grow`](Self::grow): what a
    /// drafter that copies from the text may copy, and how its copies turned out.
    fn committed(&mut self, _tokens: &[u32]) {}
    /// The next token after `tokens`.
    fn propose(&mut self, tokens: &[u32]) -> Result<Proposal, EdgeError> {
        let mut p = self.grow(tokens, &[Vec::new()])?;
        Ok(p.remove(0))
    }
    /// Forget everything drafted past the first `len` tokens.
    fn rollback(&mut self, len: usize) -> Result<(), EdgeError>;
}

/// How many leading tokens `a` and `b` share.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// The sequence a lone session drafts on.
const SEQ: SeqId = SeqId(0);

/// Feed `prompt` through the draft model ahead of [`crate::run`] — while the verifier prefills
/// the same prompt — so that the first block does not wait for the draft's own prefill.
pub fn prefill_draft(draft: &mut Engine, prompt: &[u32]) -> Result<(), EdgeError> {
    prefill_seq(draft, SEQ, prompt)
}

/// [`prefill_draft`] for the draft sequence `seq`.
pub fn prefill_seq(draft: &mut Engine, seq: SeqId, prompt: &[u32]) -> Result<(), EdgeError> {
    draft.free(seq);
    draft.forward(&[SeqChunk::new(seq, 0, prompt.to_vec(), Wanted::Last)])?;
    Ok(())
}

/// One session's sequence in the draft model: what its KV slots hold, and how it draws.
///
/// The KV holds the tokens every leaf of the draft tree shares as linear slots and the tree
/// below them as tree nodes; it is kept across forwards and reconciled with each step's leaves by
/// token path (a slot's K and V depend only on the tokens on its path), so the caller never says
/// what changed: tokens that left every leaf are dropped, the base's path through the tree
/// becomes linear again, and only the new tip of each leaf is fed. A step is planned
/// ([`DraftSeq::plan`]: one chunk), run in a forward — alone ([`EngineDrafter`]) or beside other
/// sessions' chunks in one ragged batch — and finished ([`DraftSeq::finish`]: the rule's draw at
/// each leaf).
pub struct DraftSeq {
    seq: SeqId,
    rule: VerifyRule,
    params: SamplingParams,
    q_top_k: usize,
    /// The session sends token trees: each draw also names the draft's second choice (a pass
    /// over the vocabulary, skipped without trees).
    hedges: bool,
    /// The tokens of the sequence's linear slots.
    linear: Vec<u32>,
    /// Its tree nodes after them (slot `linear.len() + i`): token and parent slot.
    tail: Vec<(u32, usize)>,
    /// A structured output: the grammar every drafted token follows (its state moved to each
    /// path drafted on), and the prompt's length (where the output starts).
    grammar: Option<(Grammar, usize)>,
    /// Tokens drafted without a forward because the grammar forced them.
    forced_tokens: usize,
    /// Drafts that copy from the session's text (None: the model drafts every token).
    copier: Option<Copier>,
}

/// A planned draft step of one sequence: its chunk, then what [`DraftSeq::finish`] needs.
pub struct DraftStep {
    pub chunk: SeqChunk,
    /// Each leaf's tip, as an index into the chunk's tokens; the rows asked for (ascending).
    wanted: Vec<usize>,
    rows: Vec<usize>,
    /// The position each leaf's next token will have.
    positions: Vec<u64>,
    /// Each leaf's whole path (a constrained session's grammar follows it).
    paths: Vec<Vec<u32>>,
    parents: Vec<Option<usize>>,
    prefill: bool,
}

impl DraftSeq {
    /// Sequence `seq` of `engine`, which holds nothing or exactly `prompt` (see
    /// [`prefill_seq`]), drawing as `cfg` says.
    pub fn new(engine: &mut Engine, seq: SeqId, prompt: &[u32], cfg: &SpecConfig) -> Self {
        let linear = if engine.seq_len(seq) == prompt.len() && !engine.has_tree(seq) {
            prompt.to_vec()
        } else {
            engine.free(seq);
            Vec::new()
        };
        Self {
            seq,
            rule: cfg.rule.effective(&cfg.params),
            params: cfg.params,
            q_top_k: cfg.q_top_k,
            hedges: cfg.session.tree.is_tree(),
            linear,
            tail: Vec::new(),
            grammar: None,
            forced_tokens: 0,
            copier: cfg.suffix.then(|| Copier::new(prompt)),
        }
    }

    /// Copy from the session's text where it matches (see [`Copier`]), beside the model.
    pub fn copy(&mut self, copier: Copier) {
        self.copier = Some(copier);
    }

    /// What the copier proposed so far (None: it does not copy).
    pub fn copy_stats(&self) -> Option<CopyStats> {
        self.copier.as_ref().map(Copier::stats)
    }

    /// How many of `tokens`, from the first, the sequence's KV holds (as linear slots).
    pub fn held(&self, tokens: &[u32]) -> usize {
        self.linear
            .iter()
            .zip(tokens)
            .take_while(|(a, b)| a == b)
            .count()
    }

    /// Tell the copier the session's committed tokens (prompt included): what it copies from,
    /// and what judges its copies. Nothing without a copier.
    pub fn sync(&mut self, committed: &[u32]) {
        if let Some(c) = &mut self.copier {
            c.sync(committed);
        }
    }

    /// The tokens drafted without a forward of the draft model at every leaf (`base` followed
    /// by `leaves[i]`), if any: what the grammar forces ([`DraftSeq::forced`]), else, on a linear
    /// draft, the copier's guess (from the committed tokens last told: [`DraftSeq::sync`]).
    pub fn skip_forward(
        &mut self,
        base: &[u32],
        leaves: &[Vec<u32>],
    ) -> Result<Option<Vec<Proposal>>, EdgeError> {
        if let Some(p) = self.forced(base, leaves)? {
            return Ok(Some(p));
        }
        let (Some(c), [leaf]) = (&mut self.copier, leaves) else {
            return Ok(None);
        };
        let path = [base, &leaf[..]].concat();
        let Some((token, m)) = c.guess(&path) else {
            return Ok(None);
        };
        // Under a grammar, only a token it allows.
        if let Some(g) = self.seek(&path)? {
            if !g
                .allows(token)
                .map_err(|e| EdgeError::Spec(tandem_spec::SpecError::Grammar(e.to_string())))?
            {
                return Ok(None);
            }
        }
        let c = self.copier.as_mut().expect("invariant: checked above");
        c.proposed(path.len(), token, &m);
        Ok(Some(vec![Proposal {
            token,
            // A copy is a point mass: the target accepts it with its own probability.
            q: (self.rule == VerifyRule::Rejection).then(|| vec![(token, 1.0)]),
            prefill: false,
            hedge: None,
        }]))
    }

    /// Tokens drafted so far without a forward, forced by the grammar.
    pub fn forced_tokens(&self) -> usize {
        self.forced_tokens
    }

    /// Constrain what the sequence drafts to `grammar` (a structured output), whose output starts
    /// after the `prompt_len` prompt tokens: each draw is from the draft's row masked by the
    /// grammar's state on its path.
    pub fn constrain(&mut self, grammar: Grammar, prompt_len: usize) {
        self.grammar = Some((grammar, prompt_len));
    }

    /// Move the grammar to the state after `path` (prompt and output), if constrained. A path
    /// the grammar does not allow (a token tree's side guess, or tokens past the output's end)
    /// can never be committed: `Ok(None)` then too, and it is drafted on unmasked.
    fn seek(&mut self, path: &[u32]) -> Result<Option<&mut Grammar>, EdgeError> {
        let Some((g, prompt_len)) = &mut self.grammar else {
            return Ok(None);
        };
        match g.seek(path.get(*prompt_len..).unwrap_or(&[])) {
            Ok(()) => Ok(Some(g)),
            Err(tandem_spec::GrammarError::Rejected { .. }) => Ok(None),
            Err(e) => Err(EdgeError::Spec(tandem_spec::SpecError::Grammar(
                e.to_string(),
            ))),
        }
    }

    /// A constrained session whose grammar allows exactly one token at every leaf (`base`
    /// followed by `leaves[i]`): those tokens, drafted without a forward of the draft model
    /// (their KV is fed with the next step that needs it). None when some leaf has a choice, or
    /// the session is not constrained.
    pub fn forced(
        &mut self,
        base: &[u32],
        leaves: &[Vec<u32>],
    ) -> Result<Option<Vec<Proposal>>, EdgeError> {
        if self.grammar.is_none() || base.is_empty() {
            return Ok(None);
        }
        let mut out = Vec::with_capacity(leaves.len());
        for l in leaves {
            let path = [base, &l[..]].concat();
            let Some(g) = self.seek(&path)? else {
                return Ok(None);
            };
            let Some(t) = g
                .forced()
                .map_err(|e| EdgeError::Spec(tandem_spec::SpecError::Grammar(e.to_string())))?
            else {
                return Ok(None);
            };
            out.push(Proposal {
                token: t,
                q: (self.rule == VerifyRule::Rejection).then(|| vec![(t, 1.0)]),
                prefill: false,
                hedge: None,
            });
        }
        self.forced_tokens += out.len();
        Ok(Some(out))
    }

    pub fn seq(&self) -> SeqId {
        self.seq
    }

    /// Start the sequence, which holds nothing yet, with what the engine's prefix cache holds of
    /// `prompt` (an earlier turn of the same conversation left it there: [`DraftSeq::publish`]);
    /// answers the prompt tokens it did not have to feed.
    pub fn attach_cached(
        &mut self,
        engine: &mut Engine,
        prompt: &[u32],
    ) -> Result<usize, EdgeError> {
        if !self.linear.is_empty() || !self.tail.is_empty() {
            return Ok(0);
        }
        let n = engine.attach_cached(self.seq, prompt)?;
        self.linear = prompt[..n].to_vec();
        Ok(n)
    }

    /// Offer the engine's prefix cache the sequence's linear slots as far as they hold `done`
    /// (prompt and committed tokens: what a later turn's prompt starts with). Drafted tokens
    /// past it are not offered: most are rejected, and would only push older turns out.
    pub fn publish(&self, engine: &mut Engine, done: &[u32]) {
        let n = common_prefix(&self.linear, done);
        engine.publish(self.seq, &self.linear[..n]);
    }

    /// The tail slot holding `token` as a child of slot `parent`.
    fn child(&self, parent: usize, token: u32) -> Option<usize> {
        let l = self.linear.len();
        self.tail
            .iter()
            .position(|&(t, p)| p == parent && t == token)
            .map(|i| l + i)
    }

    /// How far `path` runs in the draft's KV: tokens matched, and the slot of the last.
    fn reach(&self, path: &[u32]) -> (usize, Option<usize>) {
        let mut m = common_prefix(&self.linear, path);
        let mut at = m.checked_sub(1);
        while m < path.len() {
            match at.and_then(|a| self.child(a, path[m])) {
                Some(s) => at = Some(s),
                None => break,
            }
            m += 1;
        }
        (m, at)
    }

    /// Keep of the draft's KV what the `paths` still use (each but its tip, which the next
    /// forward feeds for its logits): the linear run as far as some path follows it, and the
    /// tree nodes on some path.
    fn reconcile(&mut self, engine: &mut Engine, paths: &[Vec<u32>]) -> Result<(), EdgeError> {
        let lin = paths
            .iter()
            .map(|p| common_prefix(&self.linear, &p[..p.len() - 1]))
            .max()
            .unwrap_or(0);
        if lin < self.linear.len() {
            // Less is kept when slot `lin` falls in a page another sequence shares through the
            // prefix cache: the slots from that page's start are fed again.
            let kept = engine.truncate(self.seq, lin)?;
            self.linear.truncate(kept);
            self.tail.clear();
        }
        let l = self.linear.len();
        let mut keep = Vec::new();
        for p in paths {
            let mut at = common_prefix(&self.linear, &p[..p.len() - 1]).checked_sub(1);
            let m = at.map_or(0, |a| a + 1);
            for &t in &p[m..p.len() - 1] {
                match at.and_then(|a| self.child(a, t)) {
                    Some(s) => {
                        keep.push(s);
                        at = Some(s);
                    }
                    None => break,
                }
            }
        }
        keep.sort_unstable();
        keep.dedup();
        if keep.len() < self.tail.len() {
            engine.keep_tree(self.seq, l, &keep)?;
            let moved: std::collections::HashMap<usize, usize> =
                keep.iter().enumerate().map(|(i, &s)| (s, l + i)).collect();
            let tail: Vec<(u32, usize)> = keep
                .iter()
                .map(|&s| {
                    let (t, p) = self.tail[s - l];
                    (t, if p < l { p } else { moved[&p] })
                })
                .collect();
            self.tail.clear();
            for (t, p) in tail {
                self.push_slot(t, Some(p));
            }
        }
        Ok(())
    }

    /// Record a slot the engine now holds (`parent`: none for the first): linear when it
    /// continues the linear run, as the engine counts it.
    fn push_slot(&mut self, token: u32, parent: Option<usize>) {
        match parent {
            None => self.linear.push(token),
            Some(p) if self.tail.is_empty() && p + 1 == self.linear.len() => {
                self.linear.push(token)
            }
            Some(p) => self.tail.push((token, p)),
        }
    }

    /// The step that grows each leaf (`base` followed by `leaves[i]`) by one token: the KV
    /// is reconciled with the leaves now, and the chunk feeds what it lacks of each path (each
    /// tip always; paths that share a prefix share its new nodes).
    pub fn grow_step(
        &mut self,
        engine: &mut Engine,
        base: &[u32],
        leaves: &[Vec<u32>],
    ) -> Result<DraftStep, EdgeError> {
        if base.is_empty() || leaves.is_empty() {
            return Err(EdgeError::Spec(tandem_spec::SpecError::Protocol(
                "a draft step needs a prompt and at least one leaf".into(),
            )));
        }
        let paths: Vec<Vec<u32>> = leaves.iter().map(|l| [base, &l[..]].concat()).collect();
        self.reconcile(engine, &paths)?;
        // A forward that feeds the whole prompt is a prefill, not a draft step.
        let prefill = self.linear.is_empty();
        let start = self.linear.len() + self.tail.len();
        let (mut tokens, mut parents) = (Vec::new(), Vec::<Option<usize>>::new());
        let mut wanted = Vec::with_capacity(paths.len());
        for p in &paths {
            let (m, mut at) = self.reach(&p[..p.len() - 1]);
            for (j, &t) in p.iter().enumerate().skip(m) {
                let shared = (j + 1 < p.len())
                    .then(|| (0..tokens.len()).find(|&i| tokens[i] == t && parents[i] == at))
                    .flatten();
                at = Some(match shared {
                    Some(i) => start + i,
                    None => {
                        tokens.push(t);
                        parents.push(at);
                        start + tokens.len() - 1
                    }
                });
            }
            wanted.push(at.expect("invariant: a path has a token") - start);
        }
        let mut rows = wanted.clone();
        rows.sort_unstable();
        rows.dedup();
        let chunk_parents = parents
            .iter()
            .map(|p| p.map_or(Parent::Previous, Parent::Slot))
            .collect();
        Ok(DraftStep {
            chunk: SeqChunk::tree(
                self.seq,
                start,
                tokens,
                chunk_parents,
                Wanted::At(rows.clone()),
            ),
            wanted,
            rows,
            positions: paths.iter().map(|p| p.len() as u64).collect(),
            paths,
            parents,
            prefill,
        })
    }

    /// After the forward that ran `step` (alone or in a batch, `logits` its output): record
    /// the slots it filled and draw each leaf's next token.
    pub fn finish(&mut self, step: DraftStep, logits: &Logits) -> Result<Vec<Proposal>, EdgeError> {
        let mine: Vec<&[f32]> = logits.for_seq(self.seq).map(|(_, r)| r).collect();
        if mine.len() != step.rows.len() {
            return Err(EdgeError::Spec(tandem_spec::SpecError::Protocol(format!(
                "{} logits rows for a draft step that asked for {}",
                mine.len(),
                step.rows.len()
            ))));
        }
        for (&t, &p) in step.chunk.tokens.iter().zip(&step.parents) {
            self.push_slot(t, p);
        }
        let mut out = Vec::with_capacity(step.wanted.len());
        for ((w, &pos), path) in step.wanted.iter().zip(&step.positions).zip(&step.paths) {
            let row = step
                .rows
                .binary_search(w)
                .expect("invariant: each leaf's row was asked for");
            let masked = match self.seek(path)? {
                Some(g) => Some(g.mask(mine[row]).map_err(|e| {
                    EdgeError::Spec(tandem_spec::SpecError::Grammar(e.to_string()))
                })?),
                None => None,
            };
            let mut p = self.choose(masked.as_deref().unwrap_or(mine[row]), pos);
            if let (Some(c), 1) = (&mut self.copier, step.wanted.len()) {
                c.drafted(pos as usize, p.token);
            }
            // A second guess the grammar does not allow is no guess.
            if let (Some(m), Some(h)) = (&masked, &p.hedge) {
                if !m.get(h.alt as usize).is_some_and(|l| l.is_finite()) {
                    p.hedge = None;
                }
            }
            out.push(Proposal {
                prefill: step.prefill,
                ..p
            });
        }
        Ok(out)
    }

    /// The sequence is over: free its KV.
    pub fn free(&mut self, engine: &mut Engine) {
        engine.free(self.seq);
        self.linear.clear();
        self.tail.clear();
    }

    /// The rule's token at `pos` from the draft's logits there, its distribution when the rule
    /// needs it, and the second choice.
    fn choose(&self, row: &[f32], pos: u64) -> Proposal {
        let (token, q, params) = match self.rule {
            VerifyRule::Greedy => {
                let p = SamplingParams::default();
                (sample(row, &p, pos), None, p)
            }
            // The target draws its token at `pos` by Gumbel-max on noise keyed by (seed, pos,
            // token); the draft draws from its own distribution on the same noise, so wherever
            // the two distributions are close it draws the same token (coupled draws). The
            // target's draw does not depend on the draft's: lossless either way.
            VerifyRule::SampleMatch => (sample(row, &self.params, pos), None, self.params),
            VerifyRule::Rejection => {
                let (t, q) = draft_sample(row, &self.params, pos, self.q_top_k);
                // The second guess: a second draw from q, without the first (see
                // `draft_sibling`), and how likely the drawn token was.
                let hedge = self
                    .hedges
                    .then(|| {
                        let p_top = q.iter().find(|e| e.0 == t).map_or(0.0, |e| e.1);
                        draft_sibling(&q, t, self.params.seed, pos).map(|alt| Hedge { alt, p_top })
                    })
                    .flatten();
                return Proposal {
                    token: t,
                    q: Some(q),
                    prefill: false,
                    hedge,
                };
            }
        };
        let hedge = self
            .hedges
            .then(|| second_choice(row, &params, token))
            .flatten()
            .map(|(alt, p_top)| Hedge { alt, p_top });
        Proposal {
            token,
            q,
            prefill: false,
            hedge,
        }
    }
}

/// The draft model for one session: its [`DraftSeq`] run alone, one forward per step.
pub struct EngineDrafter<'a> {
    engine: &'a mut Engine,
    seq: DraftSeq,
}

impl<'a> EngineDrafter<'a> {
    /// A drafter over `engine`, whose sequence holds nothing or exactly `prompt` (see
    /// [`prefill_draft`]).
    pub fn new(engine: &'a mut Engine, prompt: &[u32], cfg: &SpecConfig) -> Self {
        let seq = DraftSeq::new(engine, SEQ, prompt, cfg);
        Self { engine, seq }
    }

    /// Draft under `grammar` (a structured output) after the `prompt_len` prompt tokens.
    pub fn constrain(&mut self, grammar: Grammar, prompt_len: usize) {
        self.seq.constrain(grammar, prompt_len);
    }

    /// Tokens drafted without a forward, forced by the grammar.
    pub fn forced_tokens(&self) -> usize {
        self.seq.forced_tokens()
    }

    /// Copy from the session's text where it matches (see [`Copier`]).
    pub fn copy(&mut self, copier: Copier) {
        self.seq.copy(copier);
    }

    /// What the copier proposed so far.
    pub fn copy_stats(&self) -> Option<CopyStats> {
        self.seq.copy_stats()
    }
}

impl Drafter for EngineDrafter<'_> {
    fn committed(&mut self, tokens: &[u32]) {
        self.seq.sync(tokens);
    }

    fn grow(&mut self, base: &[u32], leaves: &[Vec<u32>]) -> Result<Vec<Proposal>, EdgeError> {
        if let Some(p) = self.seq.skip_forward(base, leaves)? {
            return Ok(p);
        }
        let step = self.seq.grow_step(self.engine, base, leaves)?;
        let logits = self.engine.forward(std::slice::from_ref(&step.chunk))?;
        self.seq.finish(step, &logits)
    }

    fn rollback(&mut self, len: usize) -> Result<(), EdgeError> {
        // The next `grow` drops what its leaves no longer use; only the end frees the sequence.
        if len == 0 {
            self.seq.free(self.engine);
        }
        Ok(())
    }
}
