//! The layer's operations besides its matmuls: attention over the paged cache, the residual
//! add, and rotary position embeddings.

use super::*;

/// Positions whose V rows one pass of the query heads reads together (they stay in L1 while
/// each head accumulates them).
const TILE: usize = 64;
/// Columns of an output row the value pass keeps in registers.
const COLS: usize = 64;
/// Tokens of one sequence whose attention runs together (sharing the reads of their common
/// context).
pub(super) const TOKENS_PER_BLOCK: usize = 8;

/// How many leading positions every context of `rows` has, at the same place: what a block's
/// [`attend`] shares the reads of. The same for every layer and KV head, so found once a forward.
pub(super) fn shared_context(rows: &[&[usize]]) -> usize {
    rows.iter()
        .skip(1)
        .fold(rows.first().map_or(0, |r| r.len()), |n, r| {
            n.min(r.iter().zip(rows[0]).take_while(|(a, b)| a == b).count())
        })
}

/// Query heads attending over the paged cache, `softmax(q·Kᵀ·scale)·V` each: for each token `b`
/// of a block, the `rep` heads `qs[b]` (`[rep, head_dim]`) that read one KV head, over the
/// context `rows[b]` (position `j`'s head starts at `rows[b][j] + off` in `ks` and `vs`; its first
/// `shared` positions are every token's, [`shared_context`]),
/// written to `out[b]` (`[rep, head_dim]`).
///
/// Each head's result is bit for bit that of attending alone, on every path and whatever the
/// block: the same operations in the same order for each (one dot per position, the softmax's
/// max, exponentials and sum in position order, each weight divided by the sum, the values
/// accumulated in position order). The heads only share reads: over the positions every token of
/// the block has (a chunk's tokens share their sequence's history), a K row serves every head's
/// dot at once, and a tile of V rows every head's accumulation, kept in registers a block of
/// columns at a time.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) fn attend(
    isa: kernels::Isa,
    qs: &[&[f32]],
    head_dim: usize,
    ks: &[f32],
    vs: &[f32],
    rows: &[&[usize]],
    shared: usize,
    off: usize,
    scale: f32,
    out: &mut [&mut [f32]],
) {
    let hd = head_dim;
    let rep = qs.first().map_or(0, |q| q.len() / hd);
    // Each (token, head)'s scores, then its weights: row `b * rep + h`, `rows[b].len()` long.
    let mut start = Vec::with_capacity(qs.len() * rep + 1);
    start.push(0);
    for r in rows {
        for _ in 0..rep {
            start.push(start.last().expect("invariant: started") + r.len());
        }
    }
    let mut w = vec![0f32; *start.last().expect("invariant: started")];
    // Four positions at a time (their K rows serve every head), then one at a time.
    let k_row = |rb: &[usize], j: usize| {
        let a = rb[j] + off;
        &ks[a..a + hd]
    };
    let mut j = 0;
    while j + 4 <= shared {
        let k4 = [0, 1, 2, 3].map(|x| k_row(rows[0], j + x));
        for (b, q) in qs.iter().enumerate() {
            for (h, qh) in q.chunks_exact(hd).enumerate() {
                let d = kernels::dots4_on(isa, qh, k4);
                let at = start[b * rep + h] + j;
                for (x, v) in w[at..at + 4].iter_mut().zip(d) {
                    *x = v * scale;
                }
            }
        }
        j += 4;
    }
    for j in j..shared {
        let k = k_row(rows[0], j);
        for (b, q) in qs.iter().enumerate() {
            for (h, qh) in q.chunks_exact(hd).enumerate() {
                w[start[b * rep + h] + j] = kernels::dot_on(isa, qh, k) * scale;
            }
        }
    }
    for (b, q) in qs.iter().enumerate() {
        for j in shared..rows[b].len() {
            let k = k_row(rows[b], j);
            for (h, qh) in q.chunks_exact(hd).enumerate() {
                w[start[b * rep + h] + j] = kernels::dot_on(isa, qh, k) * scale;
            }
        }
    }
    for i in 0..start.len() - 1 {
        let s = &mut w[start[i]..start[i + 1]];
        let mut max = f32::NEG_INFINITY;
        for &x in s.iter() {
            max = max.max(x);
        }
        for x in s.iter_mut() {
            *x = kernels::exp(*x - max);
        }
        let mut sum = 0f32;
        for &x in s.iter() {
            sum += x;
        }
        for x in s.iter_mut() {
            *x /= sum;
        }
    }
    for o in out.iter_mut() {
        o.fill(0.0);
    }
    for j0 in (0..shared).step_by(TILE) {
        let j1 = (j0 + TILE).min(shared);
        for (b, o) in out.iter_mut().enumerate() {
            for (h, oh) in o.chunks_exact_mut(hd).enumerate() {
                let i = b * rep + h;
                accumulate(oh, &w[start[i]..start[i + 1]], vs, rows[b], off, j0, j1);
            }
        }
    }
    for (b, o) in out.iter_mut().enumerate() {
        for (h, oh) in o.chunks_exact_mut(hd).enumerate() {
            let i = b * rep + h;
            accumulate(
                oh,
                &w[start[i]..start[i + 1]],
                vs,
                rows[b],
                off,
                shared,
                rows[b].len(),
            );
        }
    }
}

/// One head accumulates the values of positions `j0..j1` (weights `wr`, rows `rb` offset by
/// `off`) into its output `o`, in position order. A function, not a closure: inlined, it is
/// compiled for the caller's path.
#[inline(always)]
fn accumulate(
    o: &mut [f32],
    wr: &[f32],
    vs: &[f32],
    rb: &[usize],
    off: usize,
    j0: usize,
    j1: usize,
) {
    let hd = o.len();
    let mut c0 = 0;
    while c0 + COLS <= hd {
        let mut acc: [f32; COLS] = o[c0..c0 + COLS]
            .try_into()
            .expect("invariant: COLS columns");
        for j in j0..j1 {
            let (p, a) = (wr[j], rb[j] + off + c0);
            let v: &[f32; COLS] = vs[a..a + COLS].try_into().expect("invariant: COLS columns");
            for i in 0..COLS {
                acc[i] += p * v[i];
            }
        }
        o[c0..c0 + COLS].copy_from_slice(&acc);
        c0 += COLS;
    }
    if c0 < hd {
        let o = &mut o[c0..];
        for j in j0..j1 {
            let (p, a) = (wr[j], rb[j] + off + c0);
            for (x, &vv) in o.iter_mut().zip(&vs[a..a + hd - c0]) {
                *x += p * vv;
            }
        }
    }
}

/// [`attend`] compiled for the selected path: the same operations in the same order, so the
/// same bits (a closure inside [`LlamaModel::forward_avx2`] is not compiled for its features).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) fn attend_on(
    isa: kernels::Isa,
    qs: &[&[f32]],
    head_dim: usize,
    ks: &[f32],
    vs: &[f32],
    rows: &[&[usize]],
    shared: usize,
    off: usize,
    scale: f32,
    out: &mut [&mut [f32]],
) {
    #[cfg(target_arch = "x86_64")]
    {
        #[allow(clippy::too_many_arguments)]
        #[target_feature(enable = "avx2,fma,f16c")]
        fn avx2(
            qs: &[&[f32]],
            head_dim: usize,
            ks: &[f32],
            vs: &[f32],
            rows: &[&[usize]],
            shared: usize,
            off: usize,
            scale: f32,
            out: &mut [&mut [f32]],
        ) {
            attend(
                kernels::Isa::Avx2,
                qs,
                head_dim,
                ks,
                vs,
                rows,
                shared,
                off,
                scale,
                out,
            )
        }
        #[allow(clippy::too_many_arguments)]
        #[target_feature(enable = "avx512f,avx2,fma,f16c")]
        fn avx512(
            qs: &[&[f32]],
            head_dim: usize,
            ks: &[f32],
            vs: &[f32],
            rows: &[&[usize]],
            shared: usize,
            off: usize,
            scale: f32,
            out: &mut [&mut [f32]],
        ) {
            attend(
                kernels::Isa::Avx512,
                qs,
                head_dim,
                ks,
                vs,
                rows,
                shared,
                off,
                scale,
                out,
            )
        }
        match isa {
            // SAFETY: a path is selected only on a CPU that runs it.
            kernels::Isa::Avx2 => {
                return unsafe { avx2(qs, head_dim, ks, vs, rows, shared, off, scale, out) }
            }
            // SAFETY: as above.
            kernels::Isa::Avx512 => {
                return unsafe { avx512(qs, head_dim, ks, vs, rows, shared, off, scale, out) }
            }
            kernels::Isa::Portable => {}
        }
    }
    let _ = isa;
    attend(isa, qs, head_dim, ks, vs, rows, shared, off, scale, out)
}

#[inline(always)]
pub(super) fn add(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// `b` added to every row of `x` (`b.len()` wide).
#[inline(always)]
pub(super) fn add_rows(x: &mut [f32], b: &[f32]) {
    for row in x.chunks_exact_mut(b.len()) {
        add(row, b);
    }
}

/// cos/sin of every token's position, `[n_tok, head_dim/2]`, computed in f64 then rounded:
/// frequency `i` turns `scale · pos · base^(−2i/head_dim) / factor[i]`.
pub(super) struct RopeTable {
    cos: Vec<f32>,
    sin: Vec<f32>,
    half: usize,
    style: RopeStyle,
}

impl RopeTable {
    pub(super) fn new(
        pos: &[usize],
        head_dim: usize,
        base: f32,
        scale: f32,
        factors: Option<&[f32]>,
        style: RopeStyle,
    ) -> Self {
        let half = head_dim / 2;
        let mut cos = Vec::with_capacity(pos.len() * half);
        let mut sin = Vec::with_capacity(pos.len() * half);
        for &p in pos {
            for i in 0..half {
                let mut theta = (base as f64).powf(-((2 * i) as f64) / head_dim as f64);
                if let Some(f) = factors {
                    theta /= f[i] as f64;
                }
                // (× 1.0 is exact: unscaled positions keep their bits.)
                let a = p as f64 * scale as f64 * theta;
                cos.push(a.cos() as f32);
                sin.push(a.sin() as f32);
            }
        }
        Self {
            cos,
            sin,
            half,
            style,
        }
    }

    /// Rotate the pairs of every head of `x: [n_tok, n_heads, head_dim]`: adjacent ones, or
    /// each dimension of the first half with its twin in the second.
    #[inline(always)]
    pub(super) fn apply(&self, x: &mut [f32], n_heads: usize, head_dim: usize) {
        for (t, row) in x.chunks_exact_mut(n_heads * head_dim).enumerate() {
            let (c, s) = (
                &self.cos[t * self.half..(t + 1) * self.half],
                &self.sin[t * self.half..(t + 1) * self.half],
            );
            for head in row.chunks_exact_mut(head_dim) {
                match self.style {
                    RopeStyle::Adjacent => {
                        for i in 0..self.half {
                            let (x0, x1) = (head[2 * i], head[2 * i + 1]);
                            head[2 * i] = x0 * c[i] - x1 * s[i];
                            head[2 * i + 1] = x0 * s[i] + x1 * c[i];
                        }
                    }
                    RopeStyle::Halves => {
                        let (lo, hi) = head.split_at_mut(self.half);
                        for i in 0..self.half {
                            let (x0, x1) = (lo[i], hi[i]);
                            lo[i] = x0 * c[i] - x1 * s[i];
                            hi[i] = x0 * s[i] + x1 * c[i];
                        }
                    }
                }
            }
        }
    }
}
