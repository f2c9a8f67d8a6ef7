//! W4A8 / W8A8: quantized weights times activations quantized to 8 bits, with integer dot
//! products (the draft's fast path; the target never takes it).
//!
//! Each token's activations are quantized per 32-element block, as GGUF's Q8_0: a scale
//! `dx = max|x| / 127` and codes `xq = round(x·(1/dx))` (ties to even), by plain Rust on every
//! path. One output `y[t, r]` is then, over the row's blocks `j` in order:
//! - the block's integer dot product `P[j] = Σ w_i·xq_i` over its 32 elements (`w` the weight's
//!   integer code: `q − 8` for Q4_0, `q` for Q4_1 and Q8_0), exact however it is computed (and
//!   exact in f32: `|P| < 2^24`);
//! - one running sum `acc = fma(d_j·dx_j, P[j], acc)` (the scale product rounded once);
//! - Q4_1 adds its minimums: `mins = fma(m_j, dx_j·Σ xq_j, mins)`, and `y = acc + mins`.
//!
//! So every path (the portable loops here, the AVX2 kernel) gives the same bits, whatever the
//! batch. The weights are repacked at load ([`A8Matrix`]) so that one vector holds a code
//! group of eight rows: the AVX2 kernel multiplies eight rows at once against a broadcast
//! group of four activation codes, sums a block's products in 16-bit lanes and converts one
//! vector per block.

use half::f16;

use super::{Isa, RowData, RowsOut, QK};

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
    /// Eight times the sum of each block's codes: what turns the unsigned 4-bit codes' dot
    /// products into the centred ones (`Σ (q − 8)·x`).
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
            s8: Vec::with_capacity(nb),
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
            a.s8.push(8 * s);
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

/// Rows of an [`A8Matrix`] group: one 32-bit lane of a 256-bit vector each.
pub(crate) const GROUP: usize = 8;

/// The block formats of an [`A8Matrix`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Format {
    /// Unsigned nibbles `q`, code `q − 8`.
    Q4_0,
    /// Unsigned nibbles `q`, code `q`, and a minimum.
    Q4_1,
    /// Signed bytes.
    Q8_0,
}

impl Format {
    /// Bytes of quants per row and block.
    pub(crate) fn qbytes(self) -> usize {
        match self {
            Format::Q8_0 => 32,
            _ => 16,
        }
    }
}

/// A block-format matrix repacked for 8-bit activations: rows in groups of eight (the last
/// padded with rows of scale 0), each group's blocks in order. Block `j` of group `g` holds
/// - the eight rows' scales (and Q4_1's minimums) side by side: `d[(g·nb + j)·8 + lane]`;
/// - their quants in 32-byte chunks: chunk `c` is bytes `4c .. 4c + 4` of each row's block,
///   row after row. For the 4-bit formats (16 bytes a block, element `i < 16` in byte `i`'s
///   low nibble, `16 + i` in its high one) a chunk's low nibbles are each row's elements
///   `4c .. 4c + 4` and its high nibbles elements `16 + 4c ..`: unpacked, every vector is one
///   group of four consecutive elements of the eight rows.
#[derive(Debug, Clone, PartialEq)]
pub struct A8Matrix {
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) format: Format,
    pub(crate) d: Vec<f16>,
    pub(crate) m: Vec<f16>,
    pub(crate) qs: Vec<u8>,
}

impl A8Matrix {
    /// `w` (`rows × cols`, a format [`supported`] names) repacked; `None` for another format.
    pub fn pack(w: &RowData, rows: usize, cols: usize) -> Option<A8Matrix> {
        let (format, b) = match w {
            RowData::Q4_0(b) => (Format::Q4_0, b),
            RowData::Q4_1(b) => (Format::Q4_1, b),
            RowData::Q8_0(b) => (Format::Q8_0, b),
            _ => return None,
        };
        let (nb, qb) = (cols / QK, format.qbytes());
        assert!(
            cols.is_multiple_of(QK) && b.d.len() >= rows * nb && b.qs.len() >= rows * nb * qb,
            "invariant: whole rows of whole blocks"
        );
        let groups = rows.div_ceil(GROUP);
        let mut m = A8Matrix {
            rows,
            cols,
            format,
            d: vec![f16::ZERO; groups * nb * GROUP],
            m: vec![
                f16::ZERO;
                if b.m.is_empty() {
                    0
                } else {
                    groups * nb * GROUP
                }
            ],
            qs: vec![0; groups * nb * GROUP * qb],
        };
        for r in 0..rows {
            let (g, lane) = (r / GROUP, r % GROUP);
            for j in 0..nb {
                let (k, at) = (r * nb + j, g * nb + j);
                m.d[at * GROUP + lane] = b.d[k];
                if let Some(&v) = b.m.get(k) {
                    m.m[at * GROUP + lane] = v;
                }
                let src = &b.qs[k * qb..(k + 1) * qb];
                let dst = &mut m.qs[at * GROUP * qb..(at + 1) * GROUP * qb];
                for c in 0..qb / 4 {
                    let o = c * GROUP * 4 + lane * 4;
                    dst[o..o + 4].copy_from_slice(&src[4 * c..4 * c + 4]);
                }
            }
        }
        Some(m)
    }

    /// The storage format's name.
    pub fn format_name(&self) -> &'static str {
        match self.format {
            Format::Q4_0 => "q4_0",
            Format::Q4_1 => "q4_1",
            Format::Q8_0 => "q8_0",
        }
    }

    /// The first `rows` rows (at most [`A8Matrix::rows`]; the groups are stored in order). The
    /// last group keeps the rows past `rows` in its lanes, computed but never written out.
    pub fn first_rows(&self, rows: usize) -> A8Matrix {
        assert!(rows <= self.rows, "invariant: rows of the matrix");
        let per_group = self.cols / QK * GROUP;
        let g = rows.div_ceil(GROUP) * per_group;
        A8Matrix {
            rows,
            cols: self.cols,
            format: self.format,
            d: self.d[..g].to_vec(),
            m: self.m[..g.min(self.m.len())].to_vec(),
            qs: self.qs[..g * self.format.qbytes()].to_vec(),
        }
    }

    /// Bytes read to multiply by this matrix once (its rows', not the padding's).
    pub fn bytes(&self) -> usize {
        let per_block = 2 + if self.m.is_empty() { 0 } else { 2 } + self.format.qbytes();
        self.rows * self.cols / QK * per_block
    }

    /// The integer code of element `i` of row `r`'s block `j`.
    fn code(&self, r: usize, j: usize, i: usize) -> i32 {
        let (g, lane, nb, qb) = (r / GROUP, r % GROUP, self.cols / QK, self.format.qbytes());
        let base = (g * nb + j) * GROUP * qb;
        let byte = |e: usize| self.qs[base + (e / 4) * GROUP * 4 + lane * 4 + e % 4];
        match self.format {
            Format::Q4_0 => {
                i32::from(if i < 16 {
                    byte(i) & 15
                } else {
                    byte(i - 16) >> 4
                }) - 8
            }
            Format::Q4_1 => i32::from(if i < 16 {
                byte(i) & 15
            } else {
                byte(i - 16) >> 4
            }),
            Format::Q8_0 => i32::from(byte(i) as i8),
        }
    }
}

/// One task on the portable path: rows `out.r0()..` for every token.
fn rows_task(w: &A8Matrix, x: &Q8Acts, out: &mut RowsOut) {
    let (cols, nb, n_tok) = (x.cols, x.cols / QK, out.n_tok());
    let (mut acc, mut mins) = (vec![0f32; n_tok], vec![0f32; n_tok]);
    for i in 0..out.n_rows() {
        let r = out.r0() + i;
        let (g, lane) = (r / GROUP, r % GROUP);
        acc.fill(0.0);
        mins.fill(0.0);
        for j in 0..nb {
            let at = (g * nb + j) * GROUP + lane;
            let codes: [i32; QK] = std::array::from_fn(|e| w.code(r, j, e));
            let dw = w.d[at].to_f32();
            for t in 0..n_tok {
                let xq = &x.qs[t * cols + j * QK..t * cols + (j + 1) * QK];
                let p: i32 = codes.iter().zip(xq).map(|(&c, &q)| c * i32::from(q)).sum();
                acc[t] = (dw * x.d[t * nb + j]).mul_add(p as f32, acc[t]);
                if let Some(m) = w.m.get(at) {
                    mins[t] = m.to_f32().mul_add(x.sum[t * nb + j], mins[t]);
                }
            }
        }
        for t in 0..n_tok {
            out.put(i, t, acc[t] + mins[t]);
        }
    }
}

/// `y[t, r] = Σ_i W[r, i]·x[t, i]` with `x` quantized to 8 bits ([`Q8Acts`]), `y: [n_tok,
/// rows]`. On the current rayon pool, on the [`Isa::selected`] path.
pub fn matmul_a8(w: &A8Matrix, x: &Q8Acts, y: &mut [f32]) {
    matmul_a8_on(Isa::selected(), w, x, y)
}

/// [`matmul_a8`] on a given path (which this CPU must run).
pub fn matmul_a8_on(isa: Isa, w: &A8Matrix, x: &Q8Acts, y: &mut [f32]) {
    let n_tok = x.n_tok();
    assert!(
        x.cols == w.cols && y.len() == n_tok * w.rows,
        "invariant: x is [n_tok, cols] and y [n_tok, rows]"
    );
    const { assert!(super::ROWS_PER_TASK.is_multiple_of(GROUP)) };
    super::for_each_task(w.rows, n_tok, y, |out| {
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
