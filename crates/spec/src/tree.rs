//! Token trees: a block's main path plus guesses beside it ([`SideNode`]s), and the one walk both
//! sides use to follow committed tokens through a block.
//!
//! A block's `tokens` are its **main path**: the draft's own choice at each position. A side node
//! is another guess: at block position `k` beside `tokens[k]` (its parent is then the main token
//! before it, or the block's start), or one position after another side node (a continuation).
//! The edge sends side nodes where its draft is unsure; the target's tokens pick the path.
//!
//! Walking a tree from a node with the next committed token ([`step`]) gives one of four steps:
//! the node's **expected** child (its lowest-numbered one: on the main path, the next main token;
//! below a side node, its first continuation), another child (**diverted**: the tokens the edge
//! has in flight after this point guessed the expected child, so both sides move to the next
//! epoch, as for a rejection), no child at all though it has some (**off**: a rejection), or no
//! children (**leaf**: the tree ends here; the token is the target's bonus).

use serde::{Deserialize, Serialize};

use crate::pipeline::Block;

/// A guess beside a block's main path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct SideNode {
    /// Below the block's length γ: the node sits at block position `parent`, beside
    /// `tokens[parent]`. From γ on: it continues side node `parent − γ` (an earlier one).
    pub parent: u32,
    pub token: u32,
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

    /// Walk from `at` with the next committed token.
    pub fn step(&self, at: Node, token: u32) -> Step {
        let kids = self.children(at);
        match kids.iter().position(|&c| self.token(c) == Some(token)) {
            Some(0) => Step::Expected(kids[0]),
            Some(i) => Step::Diverted(kids[i]),
            None if kids.is_empty() => Step::Leaf,
            None => Step::Off,
        }
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
                },
                SideNode {
                    parent: 3,
                    token: 21,
                },
                SideNode {
                    parent: 2,
                    token: 22,
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
        assert_eq!(b.step(Node::Side(1), 3), Step::Leaf);
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
    fn bad_trees_are_refused_by_name() {
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
