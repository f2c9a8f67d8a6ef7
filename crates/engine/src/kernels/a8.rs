//! W4A8 / W8A8: quantized weights times activations quantized to 8 bits, with integer dot
//! products (the draft's fast path; the target never takes it).
//!
//! Each token's activations are quantized per 32-element block, as GGUF's Q8_0: a scale
//! `dx = max|x| / 127` and codes `xq = round(x·(1/dx))` (ties to even), by plain Rust on every
//! path. One output `y[t, r]` is then, over the row's blocks `j` in order:
//! - eight integer partial sums per block, `P[j, l] = Σ w_i·xq_i` over the block's elements
//!   `4l .. 4l + 4` (`w` the weight's integer code: `q − 8` for Q4_0, `q` for Q4_1 and Q8_0),
//!   exact however they are computed;
//! - eight running sums `acc[l] = fma(d_j·dx_j, P[j, l], acc[l])` (the product rounded once),
//!   folded as `(l, l + 4)`, then `(l, l + 2)`, then `(0, 1)`;
//! - Q4_1 adds its minimums: `mins = fma(m_j, dx_j·Σ xq_j, mins)`, and `y = fold + mins`.
//!
//! So every path (the portable loops here, the AVX2 kernels with `maddubs`) gives the same bits,
//! whatever the batch.

use super::{Blocks, Isa, RowData, RowsOut, QK};

/// Activations quantized per 32-element block: `n_tok` rows of `cols`.
#[derive(Debug, Clone, Default)]
pub struct Q8Acts {
    pub(crate) cols: usize,
    /// Scale of each block, token-major: `d[t·nb + j]`.
    pub(crate) d: Vec<f32>,
    /// `dx·Σ xq` of each block (the minimums' term of Q4_1).
    pub(crate) sum: Vec<f32>,
    /// The codes, token-major, in element order.
    pub(crate) qs: Vec<i8>,
    /// Eight times the sum of each block's elements `4l .. 4l + 4`, 8 per block: what turns
    /// the unsigned 4-bit codes' dot products into the centred ones (`Σ (q − 8)·x`).
    pub(crate) s8: Vec<i32>,
}

impl Q8Acts {
    /// Quantize `x: [n_tok, cols]` (`cols` a multiple of 32).
    pub fn quantize(x: &[f32], cols: usize) -> Q8Acts {
        assert!(
            cols.is_multiple_of(QK) && x.len().is_multiple_of(cols.max(1)),
            "invariant: whole rows of whole blocks"
        );
        let nb = x.len() / QK;
        let mut a = Q8Acts {
            cols,
            d: Vec::with_capacity(nb),
            sum: Vec::with_capacity(nb),
            qs: vec![0; x.len()],
            s8: Vec::with_capacity(nb * 8),
        };
        for (xb, qb) in x.chunks_exact(QK).zip(a.qs.chunks_exact_mut(QK)) {
            let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            let id = if d > 0.0 { 1.0 / d } else { 0.0 };
            let mut s = 0i32;
            for (q, &v) in qb.iter_mut().zip(xb) {
                *q = round_even(v * id) as i8;
                s += i32::from(*q);
            }
            a.d.push(d);
            a.sum.push(d * s as f32);
            a.s8.extend(
                qb.chunks_exact(4)
                    .map(|c| 8 * c.iter().map(|&q| i32::from(q)).sum::<i32>()),
            );
        }
        a
    }

    pub fn n_tok(&self) -> usize {
        self.qs.len() / self.cols.max(1)
    }
}

/// `v` (at most 2^22 in magnitude) rounded to the nearest integer, ties to even: adding and
/// taking away 1.5·2^23 leaves no bits below the units. Plain arithmetic (no library call on a
/// build target without a rounding instruction), the same bits as `round_ties_even`.
#[inline(always)]
fn round_even(v: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0;
    (v + MAGIC) - MAGIC
}

/// The weights' block formats with an 8-bit-activation kernel.
pub fn supported(w: &RowData) -> bool {
    matches!(w, RowData::Q4_0(_) | RowData::Q4_1(_) | RowData::Q8_0(_))
}

/// The integer code of element `i` of a block's quants `q`.
#[inline(always)]
fn code(w: &RowData, q: &[u8], i: usize) -> i32 {
    match w {
        RowData::Q4_0(_) => i32::from(if i < 16 { q[i] & 15 } else { q[i - 16] >> 4 }) - 8,
        RowData::Q4_1(_) => i32::from(if i < 16 { q[i] & 15 } else { q[i - 16] >> 4 }),
        _ => i32::from(q[i] as i8),
    }
}

/// Bytes of quants per block of `w`'s format.
pub(crate) fn qbytes(w: &RowData) -> usize {
    match w {
        RowData::Q8_0(_) => 32,
        _ => 16,
    }
}

/// The blocks of `w` (a format [`supported`] names).
pub(crate) fn blocks(w: &RowData) -> &Blocks {
    match w {
        RowData::Q4_0(b) | RowData::Q4_1(b) | RowData::Q8_0(b) => b,
        _ => panic!("invariant: an 8-bit-activation matmul of a block format"),
    }
}

/// The eight running sums folded (see the module docs).
#[inline(always)]
pub(crate) fn fold8(a: [f32; 8]) -> f32 {
    let b = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    let c = [b[0] + b[2], b[1] + b[3]];
    c[0] + c[1]
}

/// One task on the portable path: rows `out.r0()..` for every token.
fn rows_task(w: &RowData, x: &Q8Acts, out: &mut RowsOut) {
    let b = blocks(w);
    let (cols, nb, qb) = (x.cols, x.cols / QK, qbytes(w));
    for i in 0..out.n_rows() {
        let row = out.r0() + i;
        for t in 0..out.n_tok() {
            let mut acc = [0f32; 8];
            let mut mins = 0f32;
            for j in 0..nb {
                let k = row * nb + j;
                let q = &b.qs[k * qb..(k + 1) * qb];
                let xq = &x.qs[t * cols + j * QK..t * cols + (j + 1) * QK];
                let s = b.d[k].to_f32() * x.d[t * nb + j];
                for (l, a) in acc.iter_mut().enumerate() {
                    let p: i32 = (4 * l..4 * l + 4)
                        .map(|e| code(w, q, e) * i32::from(xq[e]))
                        .sum();
                    *a = s.mul_add(p as f32, *a);
                }
                if let Some(m) = b.m.get(k) {
                    mins = m.to_f32().mul_add(x.sum[t * nb + j], mins);
                }
            }
            out.put(i, t, fold8(acc) + mins);
        }
    }
}

/// `y[t, r] = Σ_i W[r, i]·x[t, i]` with `x` quantized to 8 bits ([`Q8Acts`]): `W` a block
/// format ([`supported`]), `y: [n_tok, rows]`. On the current rayon pool, on the
/// [`Isa::selected`] path.
pub fn matmul_a8(w: &RowData, rows: usize, x: &Q8Acts, y: &mut [f32]) {
    matmul_a8_on(Isa::selected(), w, rows, x, y)
}

/// [`matmul_a8`] on a given path (which this CPU must run).
pub fn matmul_a8_on(isa: Isa, w: &RowData, rows: usize, x: &Q8Acts, y: &mut [f32]) {
    let n_tok = x.n_tok();
    let nb = x.cols / QK;
    assert!(
        supported(w)
            && y.len() == n_tok * rows
            && blocks(w).d.len() >= rows * nb
            && blocks(w).qs.len() == blocks(w).d.len() * qbytes(w)
            && (!matches!(w, RowData::Q4_1(_)) || blocks(w).m.len() == blocks(w).d.len()),
        "invariant: y is [n_tok, rows] and W whole rows of whole blocks"
    );
    super::for_each_task(rows, n_tok, y, |out| {
        #[cfg(target_arch = "x86_64")]
        if isa != Isa::Portable {
            assert!(
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                    && std::arch::is_x86_feature_detected!("f16c"),
                "invariant: a SIMD path on a CPU with AVX2"
            );
            // SAFETY: the CPU supports AVX2, FMA and F16C (checked just above); an AVX-512
            // CPU runs the AVX2 kernel, which gives the same bits.
            return unsafe { super::avx2::rows_task_a8(w, x, out) };
        }
        let _ = isa;
        rows_task(w, x, out)
    });
}

#[cfg(test)]
mod tests {
    #[test]
    fn rounding_is_round_ties_even() {
        for i in -300_000..=300_000 {
            let v = i as f32 / 2048.0;
            assert_eq!(super::round_even(v), v.round_ties_even(), "{v}");
        }
        for v in [0.5f32, 1.5, 2.5, -0.5, -1.5, 126.5, -127.0, 127.49998] {
            assert_eq!(super::round_even(v), v.round_ties_even(), "{v}");
        }
    }
}
