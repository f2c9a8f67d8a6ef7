//! Token trees: a block's main path plus guesses beside it ([`SideNode`]s), and the one walk both
//! sides use to follow committed tokens through a block.
//!
//! A block's `tokens` are its **main path**: the draft's own choice at each position. A side node
//! is another guess: at block position `k` beside `tokens[k]` (its parent is then the main token
//! before it, or the block's start), or one position after another side node (a continuation).
//! The edge sends side nodes where its draft is unsure; the target's tokens pick the path.
//!
//! A block covers the positions of its main path, `start_pos .. start_pos + γ`, and every side
//! node lies within them. Its root is **whatever token is committed at `start_pos − 1`**: the
//! edge drafts a tree of paths (lanes) that continue across blocks, so a block's guesses at its
//! first position may continue different paths of the block before it; the committed tokens pick
//! which. A block is the trie of the edge's paths over its positions ([`Block::from_paths`]).
//!
//! Walking a tree from a node with the next committed token ([`Block::step`]) gives one of four
//! steps: the node's **expected** child (its lowest-numbered one: on the main path, the next main
//! token; below a side node, its first continuation), another child (**diverted**: a lane of the
//! edge's tree guessed it; the blocks behind carry that lane too, so nothing is stale), no child
//! that holds the token — or none at all inside the block's positions — (**off**: a rejection;
//! both sides move to the next epoch and drop the blocks behind), or no children past the block's
//! last position (**leaf**: the token is the target's bonus, and the next block's walk goes on).

use serde::{Deserialize, Serialize};

use crate::pipeline::{Block, BlockId, SparseDist};

/// A guess beside a block's main path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct SideNode {
    /// Below the block's length γ: the node sits at block position `parent`, beside
    /// `tokens[parent]`. From γ on: it continues side node `parent − γ` (an earlier one).
    pub parent: u32,
    pub token: u32,
    /// Under rejection sampling: the edge chose this token without drawing it beside the main
    /// token (a lane's own token, or a continuation), so it is judged as a point mass. False: a
    /// side node beside a main token is the second draw from that token's `q`, without it
    /// ([`crate::verify::draft_sibling`]). A node continuing a side node is always a point mass.
    #[serde(default)]
    pub point: bool,
}

/// A node of a block's tree.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Node {
    /// Before the block: the committed token at `start_pos − 1`.
    Root,
    /// `tokens[k]`.
    Main(usize),
    /// `side[m]`.
    Side(usize),
}

/// One step of a walk; see the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    Expected(Node),
    Diverted(Node),
    Off,
    Leaf,
}

/// What a draft forward costs per extra leaf of the draft tree, as a share of a one-token
/// forward: `bench engine`'s chunk of 2 tokens on the W4A16 draft, one thread (1.24× on this
/// project's AMD EPYC machine, 1.20× on the Intel one). The simulator's and the synthetic
/// draft's model of a tree's drafting time.
pub const DEFAULT_LEAF_COST: f64 = 0.25;

/// Side nodes a block may carry at most.
pub const MAX_SIDE_NODES: usize = 64;

/// Buckets of the draft's probability of its own token, `[lower, upper)`: where it is unsure
/// enough to branch, and what each bucket's guesses are worth.
pub const CONFIDENCE_BUCKETS: [(f32, f32); 5] =
    [(0.0, 0.3), (0.3, 0.5), (0.5, 0.7), (0.7, 0.9), (0.9, 1.01)];

/// The bucket of [`CONFIDENCE_BUCKETS`] that holds `p`.
pub fn confidence_bucket(p: f32) -> usize {
    CONFIDENCE_BUCKETS
        .iter()
        .position(|&(_, upper)| p < upper)
        .unwrap_or(CONFIDENCE_BUCKETS.len() - 1)
}

impl Block {
    /// Whether the block carries side nodes.
    pub fn is_tree(&self) -> bool {
        !self.side.is_empty()
    }

    /// Block positions past `start_pos` (0 for the first token; the root is −1, as `None`).
    pub fn offset(&self, n: Node) -> Option<usize> {
        match n {
            Node::Root => None,
            Node::Main(k) => Some(k),
            Node::Side(m) => {
                let p = self.side[m].parent as usize;
                let g = self.tokens.len();
                if p < g {
                    Some(p)
                } else {
                    Some(self.offset(Node::Side(p - g))? + 1)
                }
            }
        }
    }

    /// Tokens from the block's start to `n`, inclusive (the root has none).
    pub fn path_len(&self, n: Node) -> usize {
        self.offset(n).map_or(0, |o| o + 1)
    }

    pub fn token(&self, n: Node) -> Option<u32> {
        match n {
            Node::Root => None,
            Node::Main(k) => Some(self.tokens[k]),
            Node::Side(m) => Some(self.side[m].token),
        }
    }

    /// The parent of a node (the root has none).
    pub fn parent(&self, n: Node) -> Option<Node> {
        match n {
            Node::Root => None,
            Node::Main(0) => Some(Node::Root),
            Node::Main(k) => Some(Node::Main(k - 1)),
            Node::Side(m) => {
                let (p, g) = (self.side[m].parent as usize, self.tokens.len());
                Some(match p {
                    0 => Node::Root,
                    p if p < g => Node::Main(p - 1),
                    p => Node::Side(p - g),
                })
            }
        }
    }

    /// The children of `n`, the expected one first.
    pub fn children(&self, n: Node) -> Vec<Node> {
        let g = self.tokens.len();
        let mut out = Vec::new();
        // Side nodes hang at a block position (beside a main token) or below a side node.
        let hang = match n {
            Node::Root => Some(0),
            Node::Main(k) if k + 1 < g => Some(k + 1),
            Node::Main(_) => None,
            Node::Side(m) => Some(g + m),
        };
        match n {
            Node::Root if g > 0 => out.push(Node::Main(0)),
            Node::Main(k) if k + 1 < g => out.push(Node::Main(k + 1)),
            _ => {}
        }
        if let Some(h) = hang {
            out.extend(
                self.side
                    .iter()
                    .enumerate()
                    .filter(|(_, s)| s.parent as usize == h)
                    .map(|(m, _)| Node::Side(m)),
            );
        }
        out
    }

    /// Walk from `at` with the next committed token. A node without children inside the block's
    /// positions (a lane that ended early) is off the tree for any token, as a rejection is.
    pub fn step(&self, at: Node, token: u32) -> Step {
        let kids = self.children(at);
        match kids.iter().position(|&c| self.token(c) == Some(token)) {
            Some(0) => Step::Expected(kids[0]),
            Some(i) => Step::Diverted(kids[i]),
            None if kids.is_empty() && self.at_end(at) => Step::Leaf,
            None => Step::Off,
        }
    }

    /// Whether `n` sits on the block's last position (its children would lie past the block).
    pub fn at_end(&self, n: Node) -> bool {
        self.path_len(n) == self.tokens.len()
    }

    /// The nodes from the block's start to `n`, in order (the root excluded).
    pub fn path_to(&self, n: Node) -> Vec<Node> {
        let mut path = Vec::new();
        let mut at = n;
        while at != Node::Root {
            path.push(at);
            at = self
                .parent(at)
                .expect("invariant: only the root has no parent");
        }
        path.reverse();
        path
    }

    /// The path a verdict names: `accepted` tokens from the start, ending on side node
    /// `side_end` if given (else on the main path). None when that is no path of this block.
    pub fn named_path(&self, accepted: usize, side_end: Option<u32>) -> Option<Vec<Node>> {
        match side_end {
            None => {
                (accepted <= self.tokens.len()).then(|| (0..accepted).map(Node::Main).collect())
            }
            Some(m) if (m as usize) < self.side.len() => {
                let p = self.path_to(Node::Side(m as usize));
                (p.len() == accepted).then_some(p)
            }
            Some(_) => None,
        }
    }

    /// The expected path below `n`: its expected child, that one's, and so on.
    pub fn expected_below(&self, n: Node) -> Vec<Node> {
        let mut out = Vec::new();
        let mut at = n;
        while let Some(&c) = self.children(at).first() {
            out.push(c);
            at = c;
        }
        out
    }

    /// A well-formed tree: side parents point back, no two children of a node share a token.
    pub fn check_tree(&self) -> Result<(), String> {
        let g = self.tokens.len();
        if self.side.len() > MAX_SIDE_NODES {
            return Err(format!(
                "{} side nodes, at most {MAX_SIDE_NODES}",
                self.side.len()
            ));
        }
        for (m, s) in self.side.iter().enumerate() {
            let p = s.parent as usize;
            if p >= g && p - g >= m {
                return Err(format!(
                    "side node {m} continues side node {}, which is not an earlier one",
                    p - g
                ));
            }
            if self.path_len(Node::Side(m)) > g {
                return Err(format!(
                    "side node {m} lies past the block's last position {} (a tree stays within its main path's positions; the next block continues it)",
                    g - 1
                ));
            }
        }
        for n in std::iter::once(Node::Root)
            .chain((0..g).map(Node::Main))
            .chain((0..self.side.len()).map(Node::Side))
        {
            let kids = self.children(n);
            for (i, &a) in kids.iter().enumerate() {
                if kids[..i].iter().any(|&b| self.token(b) == self.token(a)) {
                    return Err(format!(
                        "two guesses of token {} at block position {}",
                        self.token(a).unwrap_or_default(),
                        self.offset(a).unwrap_or_default()
                    ));
                }
            }
        }
        Ok(())
    }

    /// The deepest block position any node reaches, plus one.
    pub fn reach(&self) -> usize {
        (0..self.side.len())
            .map(|m| self.path_len(Node::Side(m)))
            .chain(std::iter::once(self.tokens.len()))
            .max()
            .unwrap_or(0)
    }

    /// The block over positions `start_pos .. start_pos + main.len()` whose main path is `main`
    /// and whose side nodes hold every other path's tokens there: the trie of the paths from the
    /// block's root (each path's tokens at those positions, from the first on; shorter paths
    /// ended early). A path's node is a point mass unless `sibling(path, offset)` says it is the
    /// second draw beside the main token there. The paths with a second draw go in first, so
    /// that a second draw is the first side node beside its main token: the verifier judges it
    /// right after the main token, as a draw from the main token's q without it, and only then
    /// the point masses there (another lane's token from before the block).
    pub fn from_paths(
        epoch: u64,
        index: BlockId,
        start_pos: usize,
        main: Vec<u32>,
        q: Vec<SparseDist>,
        others: &[&[u32]],
        sibling: impl Fn(usize, usize) -> bool,
    ) -> Block {
        let g = main.len();
        let mut b = Block {
            epoch,
            index,
            start_pos,
            tokens: main,
            q,
            side: Vec::new(),
        };
        let mut order: Vec<usize> = (0..others.len()).collect();
        order.sort_by_key(|&k| !(0..others[k].len().min(g)).any(|o| sibling(k, o)));
        for k in order {
            let path = others[k];
            let mut at = Node::Root;
            for (o, &token) in path.iter().take(g).enumerate() {
                if let Some(c) = b
                    .children(at)
                    .into_iter()
                    .find(|&c| b.token(c) == Some(token))
                {
                    at = c;
                    continue;
                }
                let parent = match at {
                    Node::Root => 0,
                    Node::Main(i) => i as u32 + 1,
                    Node::Side(m) => (g + m) as u32,
                };
                let beside_main = matches!(at, Node::Root | Node::Main(_));
                b.side.push(SideNode {
                    parent,
                    token,
                    point: !(beside_main && sibling(k, o)),
                });
                at = Node::Side(b.side.len() - 1);
            }
        }
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::BlockId;

    /// Main 10 11 12; 20 beside 10 (continued by 21); 22 beside 12.
    fn block() -> Block {
        Block {
            epoch: 0,
            index: BlockId(0),
            start_pos: 5,
            tokens: vec![10, 11, 12],
            q: vec![],
            side: vec![
                SideNode {
                    parent: 0,
                    token: 20,
                    point: false,
                },
                SideNode {
                    parent: 3,
                    token: 21,
                    point: true,
                },
                SideNode {
                    parent: 2,
                    token: 22,
                    point: false,
                },
            ],
        }
    }

    #[test]
    fn a_walk_follows_expected_children_diverts_to_side_ones_and_ends_at_leaves() {
        let b = block();
        b.check_tree().unwrap();
        assert_eq!(b.step(Node::Root, 10), Step::Expected(Node::Main(0)));
        assert_eq!(b.step(Node::Root, 20), Step::Diverted(Node::Side(0)));
        assert_eq!(b.step(Node::Root, 7), Step::Off);
        assert_eq!(b.step(Node::Side(0), 21), Step::Expected(Node::Side(1)));
        // 21 ends at block position 1 of 3: off for any token; 22 at the last position: a leaf.
        assert_eq!(b.step(Node::Side(1), 3), Step::Off);
        assert_eq!(b.step(Node::Side(2), 3), Step::Leaf);
        assert!(b.at_end(Node::Side(2)) && !b.at_end(Node::Side(1)));
        assert_eq!(b.step(Node::Main(1), 22), Step::Diverted(Node::Side(2)));
        assert_eq!(
            b.step(Node::Main(2), 1),
            Step::Leaf,
            "no guess past the block"
        );
        assert_eq!(b.offset(Node::Side(1)), Some(1));
        assert_eq!(b.path_to(Node::Side(1)), vec![Node::Side(0), Node::Side(1)]);
        assert_eq!(
            b.named_path(3, Some(2)),
            Some(vec![Node::Main(0), Node::Main(1), Node::Side(2)])
        );
        assert_eq!(b.named_path(2, Some(2)), None, "the wrong length");
        assert_eq!(b.expected_below(Node::Side(0)), vec![Node::Side(1)]);
        assert_eq!(b.reach(), 3);
    }

    #[test]
    fn a_block_is_the_trie_of_the_paths_over_its_positions() {
        // Main 10 11 12; a lane 10 20 21 (forked beside 11, its second draw), one 30 31 32
        // continuing a path of the block before (a point mass), one ending early: 30 33.
        let lanes: [&[u32]; 3] = [&[10, 20, 21], &[30, 31, 32], &[30, 33]];
        let b = Block::from_paths(
            2,
            BlockId(7),
            5,
            vec![10, 11, 12],
            vec![],
            &lanes,
            |k, o| k == 0 && o == 1,
        );
        b.check_tree().unwrap();
        let sides: Vec<(u32, u32, bool)> = b
            .side
            .iter()
            .map(|s| (s.parent, s.token, s.point))
            .collect();
        assert_eq!(
            sides,
            vec![
                (1, 20, false),
                (3, 21, true),
                (0, 30, true),
                (5, 31, true),
                (6, 32, true),
                (5, 33, true),
            ]
        );
        assert_eq!(b.step(Node::Root, 30), Step::Diverted(Node::Side(2)));
        assert_eq!(b.step(Node::Side(5), 1), Step::Off, "ended early");
        assert_eq!(b.step(Node::Side(4), 1), Step::Leaf);
        // A second draw goes in before the point masses beside the same main token, even when
        // its lane comes later (the verifier judges it right after the main token); a point
        // with the same token merges into it.
        let lanes: [&[u32]; 3] = [&[30, 31], &[40, 41], &[40, 42]];
        let b = Block::from_paths(0, BlockId(0), 5, vec![10, 11], vec![], &lanes, |k, o| {
            k == 1 && o == 0
        });
        let sides: Vec<(u32, u32, bool)> = b
            .side
            .iter()
            .map(|s| (s.parent, s.token, s.point))
            .collect();
        assert_eq!(
            sides,
            vec![
                (0, 40, false),
                (2, 41, true),
                (0, 30, true),
                (4, 31, true),
                (2, 42, true),
            ]
        );
    }

    #[test]
    fn bad_trees_are_refused_by_name() {
        let mut b = block();
        b.side.push(SideNode {
            parent: 3 + 2,
            token: 40,
            point: true,
        }); // continues 22, at position 3: past the block
        assert!(b
            .check_tree()
            .unwrap_err()
            .contains("past the block's last position 2"));
        let mut b = block();
        b.side[1].parent = 4; // continues side node 1: itself
        assert!(b.check_tree().unwrap_err().contains("not an earlier one"));
        let mut b = block();
        b.side[2].token = 12;
        assert!(b
            .check_tree()
            .unwrap_err()
            .contains("two guesses of token 12 at block position 2"));
    }
}
