//! The edge's draft tree: the main path plus **lanes**, other paths the draft follows where it
//! was unsure, drafted in the same forward as the main path and carried across blocks until a
//! commit decides between them.
//!
//! Where the draft's probability of its own token is low, the second choice starts a lane
//! (a fork). Every draft step then grows each growing leaf — the main path and each lane — by
//! one token (the drafter runs them as tree nodes of one forward), so all growing paths end at
//! the same position and every block carries the paths over its positions
//! ([`Block::from_paths`]; as many as the grant's side nodes hold: a lane that does not fit stops
//! growing). A lane stays in the blocks as long as it lives: when a commit picks
//! it, its tokens already wait in the blocks behind, so the verifier goes on along it at once
//! instead of a round trip later. A commit that picks the main path ends the lanes that
//! disagree; a commit no path guessed ends them all.
//!
//! Which forks are worth a lane is priced from the draft's measured record by confidence bucket
//! ([`Estimates`]): a lane's chance to be the target's path is its parent path's chance times
//! the bucket's share of positions where the second choice was the target's token.

use serde::{Deserialize, Serialize};

use super::{Hedge, Output, Pipeline, SparseDist};
use crate::pipeline::ConfidenceCount;
use crate::tree::{confidence_bucket, CONFIDENCE_BUCKETS};

/// Token trees: where the edge forks lanes beside the main path.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TreeConfig {
    /// Side nodes per block at most (the verifier's grant; 0: linear blocks).
    pub side_nodes: usize,
    /// Lanes growing beside the main path at most (each costs a token of every draft forward).
    pub lanes: usize,
    /// Fork where the draft's probability of its own token is below this.
    pub below: f32,
    /// Fork only a lane at least this likely to be the target's path (by [`Estimates`]).
    pub min_chance: f32,
}

impl TreeConfig {
    pub const LINEAR: TreeConfig = TreeConfig {
        side_nodes: 0,
        lanes: 0,
        below: 0.0,
        min_chance: 1.0,
    };

    /// Whether blocks may carry lanes.
    pub fn is_tree(&self) -> bool {
        self.lanes > 0 && self.side_nodes > 0
    }
}

/// A `--tree` flag: token trees of this shape, or none.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct TreeArg(pub Option<TreeConfig>);

/// `on` or `off` (a flag that turns a mechanism on or off).
pub fn parse_on_off(s: &str) -> Result<bool, String> {
    match s {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err(format!("`{s}`: on or off")),
    }
}

/// `LANES:BELOW[:MIN]` (lanes growing beside the main path at most, the confidence below which
/// the draft forks one, and the least chance a lane must have to be the target's path; default
/// 0.05), or `none`. Blocks ask for room for every lane: `LANES × 8` side nodes, within the
/// protocol's limit.
pub fn parse_tree(s: &str) -> Result<TreeArg, String> {
    if s == "none" {
        return Ok(TreeArg(None));
    }
    let parts: Vec<&str> = s.split(':').collect();
    let bad = || format!("`{s}` is not LANES:BELOW[:MIN] (e.g. 1:0.5 or 2:0.5:0.05) or none");
    let (l, b, m) = match parts[..] {
        [l, b] => (l, b, "0.05"),
        [l, b, m] => (l, b, m),
        _ => return Err(bad()),
    };
    let lanes: usize = l.parse().map_err(|_| bad())?;
    let t = TreeConfig {
        side_nodes: (lanes * 8).min(crate::tree::MAX_SIDE_NODES),
        lanes,
        below: b.parse().map_err(|_| bad())?,
        min_chance: m.parse().map_err(|_| bad())?,
    };
    if t.lanes == 0 || !(t.below > 0.0 && t.below <= 1.0) || !(0.0..=1.0).contains(&t.min_chance) {
        return Err(format!(
            "`{s}`: at least one lane, the threshold in (0, 1], the least chance in [0, 1]"
        ));
    }
    if t.lanes > 8 {
        return Err(format!("`{s}`: at most 8 lanes"));
    }
    Ok(TreeArg(Some(t)))
}

/// What the drafter produced for one leaf of the frontier.
#[derive(Debug, Clone, PartialEq)]
pub struct Grown {
    pub token: u32,
    /// The draft's distribution there (rejection sampling).
    pub q: Option<SparseDist>,
    /// Its second choice and how sure it was of `token` (token trees).
    pub hedge: Option<Hedge>,
}

/// The leaves the drafter grows next: each is `tokens()[..base]` followed by its own tokens, the
/// main path first; each gets one token ([`Pipeline::on_grown`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frontier {
    pub base: usize,
    pub leaves: Vec<Vec<u32>>,
    /// How many times the main path had been cut back when the frontier was taken: the main
    /// path only grows between cuts, so two frontiers with the same count, base and leaves grow
    /// the same paths (see [`Pipeline::on_grown_at`]).
    pub cuts: u64,
}

/// What the edge knows of a drafted token beyond the token itself.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct NodeInfo {
    pub q: Option<SparseDist>,
    pub hedge: Option<Hedge>,
    /// Its chance to be the target's token if its parent is ([`Estimates`]).
    pub chance: f32,
    /// A fork: the second guess beside its parent's first.
    pub second: bool,
}

impl Default for NodeInfo {
    fn default() -> Self {
        Self {
            q: None,
            hedge: None,
            chance: 1.0,
            second: false,
        }
    }
}

/// A path beside the main one, from the committed length on.
#[derive(Debug, Clone)]
pub(super) struct Lane {
    /// Position of `nodes[0]` (the committed length: commits trim the front).
    pub start: usize,
    pub nodes: Vec<(u32, NodeInfo)>,
    /// Drafted on with the main path (else it keeps only what it already sent).
    pub growing: bool,
}

impl Lane {
    pub fn end(&self) -> usize {
        self.start + self.nodes.len()
    }
    pub fn token(&self, pos: usize) -> Option<u32> {
        pos.checked_sub(self.start)
            .and_then(|i| self.nodes.get(i))
            .map(|n| n.0)
    }
    pub fn tokens(&self, from: usize, to: usize) -> Vec<u32> {
        (from.max(self.start)..to.min(self.end()))
            .map(|p| self.nodes[p - self.start].0)
            .collect()
    }
    /// Its chance to be the target's path.
    pub fn chance(&self) -> f32 {
        self.nodes.iter().map(|n| n.1.chance).product()
    }
}

/// The draft's record by confidence bucket: how often its own token was the target's, and how
/// often the second choice was where it missed — a prior from `bench quant` (the GPTQ draft,
/// teacher-forced), moved by what this session's commits showed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Estimates {
    pub accept: [f32; 5],
    pub cover: [f32; 5],
}

/// `bench quant --drafts w4a16-g32-gptq` (docs/bench/quant-gptq.md): the target's token is the
/// draft's first choice / one of its first two, by the draft's confidence.
const PRIOR_ACCEPT: [f32; 5] = [0.59, 0.83, 0.95, 0.95, 1.0];
const PRIOR_TOP2: [f32; 5] = [0.80, 0.97, 0.99, 0.98, 1.0];
/// The prior counts as this many judged positions per bucket.
const PRIOR_WEIGHT: f32 = 16.0;

impl Estimates {
    pub fn from_counts(counts: &[ConfidenceCount; 5]) -> Self {
        let mut e = Estimates {
            accept: [0.0; 5],
            cover: [0.0; 5],
        };
        for (b, c) in counts.iter().enumerate() {
            let n = PRIOR_WEIGHT + c.judged as f32;
            e.accept[b] = (PRIOR_WEIGHT * PRIOR_ACCEPT[b] + c.accepted as f32) / n;
            e.cover[b] = (PRIOR_WEIGHT * (PRIOR_TOP2[b] - PRIOR_ACCEPT[b]) + c.covered as f32) / n;
        }
        e
    }

    /// The chance that the draft's token is right where it was `p_top` sure of it.
    pub fn accept_at(&self, p_top: f32) -> f32 {
        self.accept[confidence_bucket(p_top)]
    }

    /// The chance that its second choice is right (and its first wrong) there.
    pub fn cover_at(&self, p_top: f32) -> f32 {
        self.cover[confidence_bucket(p_top)]
    }
}

const _: () = assert!(CONFIDENCE_BUCKETS.len() == 5);

impl Pipeline {
    /// Send token trees shaped so from the next draft step on; lanes beyond the new count stop
    /// growing (they keep what they sent).
    pub fn set_tree(&mut self, tree: TreeConfig) {
        self.tree = tree;
        let keep = if tree.is_tree() { tree.lanes } else { 0 };
        let mut growing: Vec<usize> = (0..self.lanes.len())
            .filter(|&k| self.lanes[k].growing)
            .collect();
        growing.sort_by(|&a, &b| self.lanes[b].chance().total_cmp(&self.lanes[a].chance()));
        for &k in growing.iter().skip(keep) {
            self.freeze(k);
        }
        self.lanes.retain(|l| !l.nodes.is_empty());
    }

    pub fn tree(&self) -> TreeConfig {
        self.tree
    }

    /// Stop growing lane `k` and drop what it has not sent.
    fn freeze(&mut self, k: usize) {
        let sent = self.sent;
        let l = &mut self.lanes[k];
        l.growing = false;
        l.nodes.truncate(sent.saturating_sub(l.start));
        // A lane that agrees with the main path wherever it reaches is no lane.
        if (l.start..l.end()).all(|p| l.token(p) == self.tokens.get(p).copied()) {
            l.nodes.clear();
        }
    }

    /// The draft's record so far, by confidence bucket.
    pub fn estimates(&self) -> Estimates {
        Estimates::from_counts(&self.stats.by_confidence)
    }

    /// Lanes growing now.
    pub fn growing_lanes(&self) -> usize {
        self.lanes.iter().filter(|l| l.growing).count()
    }

    /// What the drafter grows next (when [`Pipeline::next`] says `Draft`): the main path and
    /// every growing lane, from where the first of them leaves the main path.
    pub fn frontier(&self) -> Frontier {
        let n = self.tokens.len();
        let growing = || self.lanes.iter().filter(|l| l.growing);
        let base = growing()
            .map(|l| {
                (l.start..l.end())
                    .find(|&p| l.token(p) != self.tokens.get(p).copied())
                    .unwrap_or(l.end())
            })
            .min()
            .unwrap_or(n)
            .min(n);
        let mut leaves = vec![self.tokens[base..].to_vec()];
        leaves.extend(growing().map(|l| l.tokens(base, l.end())));
        Frontier {
            base,
            leaves,
            cuts: self.cuts,
        }
    }

    /// The drafter grew `asked`, a frontier taken before the messages that arrived during its
    /// forward were applied: its tokens are taken ([`on_grown`](Self::on_grown)) when the
    /// pipeline still asks for a draft step and `asked` is still its frontier (then the step
    /// is exactly the one the drafter would take now), and dropped otherwise (`None`: the next
    /// step grows the frontier as it stands).
    pub fn on_grown_at(
        &mut self,
        asked: &Frontier,
        grown: Vec<Grown>,
    ) -> Result<Option<Vec<Output>>, super::SpecError> {
        if self.next() != super::Next::Draft || self.frontier() != *asked {
            self.stats.stale_steps += 1;
            return Ok(None);
        }
        self.on_grown(grown).map(Some)
    }

    /// The drafter grew the [`frontier`](Self::frontier): one token per leaf, in its order.
    pub fn on_grown(&mut self, grown: Vec<Grown>) -> Result<Vec<Output>, super::SpecError> {
        let growing: Vec<usize> = (0..self.lanes.len())
            .filter(|&k| self.lanes[k].growing)
            .collect();
        if grown.len() != 1 + growing.len() {
            return Err(super::SpecError::Protocol(format!(
                "{} tokens grown for a frontier of {} leaves",
                grown.len(),
                1 + growing.len()
            )));
        }
        let est = self.estimates();
        let pos = self.tokens.len();
        let mut grown = grown.into_iter();
        let main = grown.next().expect("invariant: the main leaf");
        // Where each leaf could fork: (chance of the lane, of its fork token given the leaf,
        // the leaf: None for the main path, the fork token).
        let mut forks: Vec<(f32, f32, Option<usize>, u32)> = Vec::new();
        let main_chance = self.path_chance(pos);
        for (k, g) in growing.iter().copied().zip(grown) {
            let info = self.node_info(&g, &est);
            if let Some((c, alt)) = self.fork_of(&g, &est) {
                forks.push((self.lanes[k].chance() * c, c, Some(k), alt));
            }
            let l = &mut self.lanes[k];
            l.growing = !self.eog.contains(&g.token);
            l.nodes.push((g.token, info));
            self.stats.drafted += 1;
        }
        if let Some((c, alt)) = self.fork_of(&main, &est) {
            forks.push((main_chance * c, c, None, alt));
        }
        self.draft_main(main, &est);
        // The likeliest forks first, as many as there is room for.
        forks.sort_by(|a, b| b.0.total_cmp(&a.0));
        for (chance, c, from, alt) in forks {
            if self.growing_lanes() >= self.tree.lanes || chance < self.tree.min_chance {
                break;
            }
            let mut nodes: Vec<(u32, NodeInfo)> = match from {
                None => (self.committed..pos)
                    .map(|p| {
                        (
                            self.tokens[p],
                            self.info.get(&p).cloned().unwrap_or_default(),
                        )
                    })
                    .collect(),
                Some(k) => self.lanes[k].nodes[..pos - self.lanes[k].start].to_vec(),
            };
            // Under rejection sampling the fork is a second draw: from the parent's q without
            // the parent's own token. That is its q should the lane become the main path and the
            // fork go out as a main token.
            let (parent_token, parent_q) = match from {
                None => (
                    self.tokens[pos],
                    self.info.get(&pos).and_then(|i| i.q.clone()),
                ),
                Some(k) => {
                    let n = self.lanes[k].nodes.last().expect("invariant: a grown lane");
                    (n.0, n.1.q.clone())
                }
            };
            nodes.push((
                alt,
                NodeInfo {
                    q: parent_q.map(|q| crate::verify::without(&q, &[parent_token])),
                    hedge: None,
                    chance: c,
                    second: true,
                },
            ));
            self.lanes.push(Lane {
                start: self.committed,
                nodes,
                growing: !self.eog.contains(&alt),
            });
        }
        let mut out = Vec::new();
        self.try_send(&mut out);
        Ok(out)
    }

    /// The main path's chance to be the target's up to (not including) `pos`.
    fn path_chance(&self, pos: usize) -> f32 {
        self.info
            .range(self.committed..pos)
            .map(|(_, i)| i.chance)
            .product()
    }

    fn node_info(&self, g: &Grown, est: &Estimates) -> NodeInfo {
        NodeInfo {
            q: g.q.clone(),
            hedge: g.hedge.filter(|h| h.alt != g.token),
            chance: g.hedge.map_or(1.0, |h| est.accept_at(h.p_top)),
            second: false,
        }
    }

    /// The lane a grown token's second choice would start, if it is worth one: its chance given
    /// the leaf, and its token.
    ///
    /// Also within the verifier's lead (positions it decodes itself before the blocks holding
    /// them arrive): there a lane the target follows spares the edge a restart — its tokens
    /// past the fork are drafted already — though it slows the draft while it lives. Forking
    /// only past the lead spared that cost but lost most of the lanes' gain in the simulator
    /// (lanes covered 7% of misses instead of 35%).
    fn fork_of(&self, g: &Grown, est: &Estimates) -> Option<(f32, u32)> {
        let h = g.hedge?;
        (self.tree.is_tree()
            && h.alt != g.token
            && h.p_top < self.tree.below
            && !self.eog.contains(&g.token))
        .then(|| (est.cover_at(h.p_top), h.alt))
    }

    /// The main path's new token.
    fn draft_main(&mut self, g: Grown, est: &Estimates) {
        let pos = self.tokens.len();
        self.draft_fed = pos;
        let mut info = self.node_info(&g, est);
        if self.eog.contains(&g.token) {
            info.hedge = None;
        }
        self.info.insert(pos, info);
        self.tokens.push(g.token);
        self.stats.drafted += 1;
    }

    /// The lane that guessed the committed `token` at `pos` where the main path did not (the
    /// likeliest, a growing one first), if any.
    pub(super) fn lane_with(&self, pos: usize, token: u32) -> Option<usize> {
        (0..self.lanes.len())
            .filter(|&k| self.lanes[k].token(pos) == Some(token))
            .max_by(|&a, &b| {
                let (la, lb) = (&self.lanes[a], &self.lanes[b]);
                (la.growing, la.chance())
                    .partial_cmp(&(lb.growing, lb.chance()))
                    .unwrap_or(std::cmp::Ordering::Equal)
            })
    }

    /// The committed `token` at `pos` is lane `k`'s: it becomes the main path (from `pos` on);
    /// the lanes that share its token there stay. Returns how many tokens of the old main path
    /// were thrown away.
    pub(super) fn switch_to(&mut self, k: usize, pos: usize) -> usize {
        let lane = self.lanes.remove(k);
        self.lanes.retain(|l| l.token(pos) == lane.token(pos));
        let wasted = self.tokens.len() - pos;
        self.cut_tail(pos);
        for p in pos..lane.end() {
            let (t, info) = lane.nodes[p - lane.start].clone();
            self.tokens.push(t);
            self.info.insert(p, info);
        }
        if !lane.growing {
            // The main path stopped where this lane did: the others stop there too.
            let end = self.tokens.len();
            for l in &mut self.lanes {
                l.growing = false;
                l.nodes.truncate(end.saturating_sub(l.start));
            }
        }
        wasted
    }

    /// The committed token at `pos` agreed with the main path, or replaced it: every lane that
    /// disagrees ends, and those left start at the new committed length.
    pub(super) fn trim_lanes(&mut self, pos: usize, token: u32) {
        self.lanes.retain(|l| l.token(pos) == Some(token));
        for l in &mut self.lanes {
            let cut = (pos + 1).saturating_sub(l.start).min(l.nodes.len());
            l.nodes.drain(..cut);
            l.start = pos + 1;
        }
        self.lanes.retain(|l| !l.nodes.is_empty());
    }

    /// The block over `start .. start + n`: the main path's tokens, and every lane's there as
    /// side nodes, the likeliest first, as many as the grant and the context allow. A lane
    /// that does not fit stops growing.
    pub(super) fn cut_block(&mut self, start: usize, n: usize) -> crate::pipeline::Block {
        let main = self.tokens[start..start + n].to_vec();
        let q: Vec<SparseDist> = self
            .info
            .range(start..start + n)
            .filter_map(|(_, i)| i.q.clone())
            .collect();
        let q = if q.len() == n { q } else { Vec::new() };
        let mut order: Vec<usize> = (0..self.lanes.len()).collect();
        order.sort_by(|&a, &b| self.lanes[b].chance().total_cmp(&self.lanes[a].chance()));
        // Every node takes a KV slot on the verifier: the tree's nodes stay within the limit.
        let room = self
            .limit()
            .saturating_sub(start + n)
            .min(self.tree.side_nodes);
        let index = super::BlockId(self.next_index);
        let build = |lanes: &[usize], this: &Self| {
            let paths: Vec<Vec<u32>> = lanes
                .iter()
                .map(|&k| this.lanes[k].tokens(start, start + n))
                .collect();
            let refs: Vec<&[u32]> = paths.iter().map(|p| p.as_slice()).collect();
            crate::pipeline::Block::from_paths(
                this.epoch,
                index,
                start,
                main.clone(),
                q.clone(),
                &refs,
                |i, o| this.sibling(lanes[i], start + o),
            )
        };
        let mut fit: Vec<usize> = Vec::new();
        let mut block = build(&fit, self);
        let mut dropped = Vec::new();
        for k in order {
            let mut with = fit.clone();
            with.push(k);
            let b = build(&with, self);
            if b.side.len() <= room {
                fit = with;
                block = b;
            } else {
                dropped.push(k);
            }
        }
        for k in dropped {
            self.freeze(k);
        }
        self.lanes.retain(|l| !l.nodes.is_empty());
        block
    }

    /// Whether lane `k`'s node at `pos` is the second draw beside the main path's token there
    /// (the same parent): where the lane leaves the main path, at a fork.
    fn sibling(&self, k: usize, pos: usize) -> bool {
        let l = &self.lanes[k];
        let leaves = (l.start..l.end()).find(|&p| l.token(p) != self.tokens.get(p).copied());
        leaves == Some(pos) && l.nodes[pos - l.start].1.second
    }

    /// Counts of a committed position the main path had drafted with a second choice.
    pub(super) fn count_confidence(&mut self, pos: usize, token: u32) {
        let Some(h) = self.info.get(&pos).and_then(|i| i.hedge) else {
            return;
        };
        let c = &mut self.stats.by_confidence[confidence_bucket(h.p_top)];
        c.judged += 1;
        if self.tokens.get(pos) == Some(&token) {
            c.accepted += 1;
        } else if h.alt == token {
            c.covered += 1;
        }
    }
}
