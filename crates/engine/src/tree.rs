//! Token trees in a sequence: several guesses for the same positions, verified in one forward.
//!
//! A sequence's KV slots are **linear** up to some length (slot `s` holds position `s` and
//! attends to slots `0..=s`) and may end in a **tail** of tree nodes. A tree node names its
//! parent slot; it sits one position after its parent and attends to what its parent attends to,
//! plus itself. Siblings therefore share a position (the RoPE angle) but not a slot, and no node
//! sees another branch. Keeping one path ([`crate::Engine::keep_path`]) moves its nodes' K and V
//! down to consecutive slots; since a node's context is its ancestors in slot order, the kept
//! slots are exactly what a linear run of that path would have computed.

/// What one KV slot (one token) attends to: the linear slots `0..linear`, then the tail slots
/// `extra` (ascending; the token's own slot last), at RoPE position `pos`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeCtx {
    pub pos: usize,
    pub linear: usize,
    pub extra: Vec<usize>,
}

impl NodeCtx {
    /// The linear slot `s`.
    pub fn linear(s: usize) -> Self {
        Self {
            pos: s,
            linear: s + 1,
            extra: Vec::new(),
        }
    }

    /// A node at `slot` whose parent attends to `self`.
    pub fn child(&self, slot: usize) -> Self {
        let mut extra = self.extra.clone();
        extra.push(slot);
        let mut c = Self {
            pos: self.pos + 1,
            linear: self.linear,
            extra,
        };
        c.normalize();
        c
    }

    /// A node at `pos` that attends to the linear slots `0..linear` and then `extra` (its own
    /// slot last), in normal form.
    pub fn from_parts(pos: usize, linear: usize, extra: Vec<usize>) -> Self {
        let mut c = Self { pos, linear, extra };
        c.normalize();
        c
    }

    /// Slots in context.
    pub fn len(&self) -> usize {
        self.linear + self.extra.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The `j`-th slot in context.
    #[inline(always)]
    pub fn slot(&self, j: usize) -> usize {
        if j < self.linear {
            j
        } else {
            self.extra[j - self.linear]
        }
    }

    /// A node at `slot` whose parent is before the sequence's first slot (position 0).
    pub fn first(slot: usize) -> Self {
        let mut c = Self {
            pos: 0,
            linear: 0,
            extra: vec![slot],
        };
        c.normalize();
        c
    }

    /// Fold tail slots that continue the linear run into it: the same context, one form.
    fn normalize(&mut self) {
        let run = self
            .extra
            .iter()
            .enumerate()
            .take_while(|&(i, &s)| s == self.linear + i)
            .count();
        self.linear += run;
        self.extra.drain(..run);
    }
}

/// Where one token of a chunk sits: after the slot before it (a linear chunk) or as the child of
/// a slot (a tree chunk).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Parent {
    /// The slot just before, in a sequence with no tree nodes before this token.
    Previous,
    /// This earlier slot of the sequence (in the KV cache or earlier in the chunk).
    Slot(usize),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_child_of_the_last_linear_slot_is_linear_and_a_sibling_is_not() {
        let last = NodeCtx::linear(4);
        assert_eq!(last.child(5), NodeCtx::linear(5));
        let sibling = last.child(6);
        assert_eq!(
            (sibling.pos, sibling.linear, sibling.extra.clone()),
            (5, 5, vec![6])
        );
        let grandchild = sibling.child(7);
        assert_eq!((grandchild.pos, grandchild.len()), (6, 7));
        assert_eq!(
            (0..grandchild.len())
                .map(|j| grandchild.slot(j))
                .collect::<Vec<_>>(),
            vec![0, 1, 2, 3, 4, 6, 7]
        );
        assert_eq!(NodeCtx::first(0), NodeCtx::linear(0));
        assert_eq!(NodeCtx::first(3).extra, vec![3]);
    }
}
