//! The layer's operations besides its matmuls: attention over the paged cache, the residual
//! add, and rotary position embeddings.

use super::*;

/// One query head's attention over its context, `softmax(q·Kᵀ·scale)·V`, with K and V read in
/// place from the paged cache: position `j`'s head starts at `at(j)` in `ks` and `vs`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) fn attend(
    isa: kernels::Isa,
    qv: &[f32],
    ks: &[f32],
    vs: &[f32],
    n_ctx: usize,
    scale: f32,
    at: impl Fn(usize) -> usize,
    out: &mut [f32],
) {
    let hd = qv.len();
    let mut scores = vec![0f32; n_ctx];
    for (j, s) in scores.iter_mut().enumerate() {
        let a = at(j);
        *s = kernels::dot_on(isa, qv, &ks[a..a + hd]) * scale;
    }
    let mut max = f32::NEG_INFINITY;
    for &s in &scores {
        max = max.max(s);
    }
    let mut sum = 0f32;
    for s in scores.iter_mut() {
        *s = kernels::exp(*s - max);
        sum += *s;
    }
    out.fill(0.0);
    for (j, &p) in scores.iter().enumerate() {
        let (w, a) = (p / sum, at(j));
        for (o, &vv) in out.iter_mut().zip(&vs[a..a + hd]) {
            *o += w * vv;
        }
    }
}

/// [`attend`] compiled for the selected path: the same operations in the same order, so the
/// same bits (a closure inside [`LlamaModel::forward_avx2`] is not compiled for its features).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) fn attend_on(
    isa: kernels::Isa,
    qv: &[f32],
    ks: &[f32],
    vs: &[f32],
    n_ctx: usize,
    scale: f32,
    at: impl Fn(usize) -> usize,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2,fma,f16c")]
        fn avx2(
            qv: &[f32],
            ks: &[f32],
            vs: &[f32],
            n_ctx: usize,
            scale: f32,
            at: impl Fn(usize) -> usize,
            out: &mut [f32],
        ) {
            attend(kernels::Isa::Avx2, qv, ks, vs, n_ctx, scale, at, out)
        }
        #[target_feature(enable = "avx512f,avx2,fma,f16c")]
        fn avx512(
            qv: &[f32],
            ks: &[f32],
            vs: &[f32],
            n_ctx: usize,
            scale: f32,
            at: impl Fn(usize) -> usize,
            out: &mut [f32],
        ) {
            attend(kernels::Isa::Avx512, qv, ks, vs, n_ctx, scale, at, out)
        }
        match isa {
            // SAFETY: a path is selected only on a CPU that runs it.
            kernels::Isa::Avx2 => return unsafe { avx2(qv, ks, vs, n_ctx, scale, at, out) },
            // SAFETY: as above.
            kernels::Isa::Avx512 => return unsafe { avx512(qv, ks, vs, n_ctx, scale, at, out) },
            kernels::Isa::Portable => {}
        }
    }
    let _ = isa;
    attend(isa, qv, ks, vs, n_ctx, scale, at, out)
}

#[inline(always)]
pub(super) fn add(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// cos/sin of every token's position, `[n_tok, head_dim/2]`, computed in f64 then rounded.
pub(super) struct RopeTable {
    cos: Vec<f32>,
    sin: Vec<f32>,
    half: usize,
}

impl RopeTable {
    pub(super) fn new(pos: &[usize], head_dim: usize, base: f32) -> Self {
        let half = head_dim / 2;
        let mut cos = Vec::with_capacity(pos.len() * half);
        let mut sin = Vec::with_capacity(pos.len() * half);
        for &p in pos {
            for i in 0..half {
                let theta = (base as f64).powf(-((2 * i) as f64) / head_dim as f64);
                let a = p as f64 * theta;
                cos.push(a.cos() as f32);
                sin.push(a.sin() as f32);
            }
        }
        Self { cos, sin, half }
    }

    /// Rotate adjacent pairs of every head of `x: [n_tok, n_heads, head_dim]`.
    #[inline(always)]
    pub(super) fn apply(&self, x: &mut [f32], n_heads: usize, head_dim: usize) {
        for (t, row) in x.chunks_exact_mut(n_heads * head_dim).enumerate() {
            let (c, s) = (
                &self.cos[t * self.half..(t + 1) * self.half],
                &self.sin[t * self.half..(t + 1) * self.half],
            );
            for head in row.chunks_exact_mut(head_dim) {
                for i in 0..self.half {
                    let (x0, x1) = (head[2 * i], head[2 * i + 1]);
                    head[2 * i] = x0 * c[i] - x1 * s[i];
                    head[2 * i + 1] = x0 * s[i] + x1 * c[i];
                }
            }
        }
    }
}
