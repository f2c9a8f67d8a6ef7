//! The messages both sides of a speculation session exchange, as the IO-free cores see them:
//! the edge's draft blocks and the verifier's verdicts and decoded tokens, with the shape (γ,
//! depth) a grant carries. (`tandem-proto` maps them to and from the wire.)

use serde::{Deserialize, Serialize};

/// Blocks an edge may have in flight at most (a verifier queues no more per session).
pub const MAX_BLOCKS_IN_FLIGHT: usize = 16;

/// A sparse draft distribution `(token, probability)` for one position (rejection sampling).
pub type SparseDist = Vec<(u32, f32)>;

/// A block's number within its session: 0, 1, 2, … in the order the edge sent them.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
pub struct BlockId(pub u64);

impl std::fmt::Display for BlockId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Drafted tokens sent for verification together.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Block {
    pub epoch: u64,
    pub index: BlockId,
    /// Position of the first drafted token.
    pub start_pos: usize,
    pub tokens: Vec<u32>,
    /// The draft's distribution at each token (empty unless the verify rule needs it).
    pub q: Vec<SparseDist>,
    /// Guesses beside the main path `tokens` (a token tree; see [`crate::tree`]).
    #[serde(default)]
    pub side: Vec<crate::tree::SideNode>,
}

/// How speculation is shaped: γ drafted tokens per block (`draft_len`), up to `depth` blocks in
/// flight. What a verifier grants a session; γ 0 in a grant means the verifier decodes the
/// session itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Shape {
    pub draft_len: u32,
    pub depth: u32,
}

impl Shape {
    pub const fn new(draft_len: u32, depth: u32) -> Self {
        Self { draft_len, depth }
    }

    /// No limit: what a session without a grant may use.
    pub const UNLIMITED: Shape = Shape::new(u32::MAX, u32::MAX);
}

impl From<(u32, u32)> for Shape {
    fn from((draft_len, depth): (u32, u32)) -> Self {
        Self { draft_len, depth }
    }
}

/// `shape == (γ, depth)`, as tests and tables write it.
impl PartialEq<(u32, u32)> for Shape {
    fn eq(&self, other: &(u32, u32)) -> bool {
        (self.draft_len, self.depth) == *other
    }
}

/// The cloud's answer to one block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Verdict {
    pub epoch: u64,
    pub block: BlockId,
    /// Drafted tokens from the block's start that the target accepted: the main path's first
    /// `accepted`, or the path to side node `side_end`.
    pub accepted: usize,
    /// The accepted path ends on this side node (a token tree's branch won).
    #[serde(default)]
    pub side_end: Option<u32>,
    /// The target's token at `start_pos + accepted`: correction, or bonus when all were accepted.
    pub token: u32,
    /// Microseconds the verifier's forward pass took for this verdict (0 when it was decided
    /// without one); the edge's policy reads it to tell verify time from network time.
    #[serde(default)]
    pub verify_us: u32,
    /// A new grant from a verifier whose load changed: from now on at most this γ and depth.
    #[serde(default)]
    pub grant: Option<Shape>,
}

/// A token the verifier decoded itself, in a forward in which it had no block of the session to
/// verify. It does not move the epoch: blocks in flight are rebased against it. `grant`: the
/// verifier's load changed this session's grant (γ 0: draft nothing, the verifier decodes every
/// token; more: draft again within it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Decoded {
    /// The verifier's epoch when it decoded the token (never ahead of the edge's).
    pub epoch: u64,
    /// Absolute position of the token.
    pub pos: usize,
    pub token: u32,
    pub grant: Option<Shape>,
    /// The verifier guessed it from the session's own text and the target accepted it, in the
    /// forward that decoded the token after it (see [`crate::suffix`]): told apart for the
    /// edge's accounting only.
    #[serde(default)]
    pub guessed: bool,
}
