//! W4A8 / W8A8: quantized weights times activations quantized to 8 bits, with integer dot
//! products (the draft's fast path; `cloud serve` never takes it).
//!
//! Each token's activations are quantized per 32-element block, as GGUF's Q8_0: a scale
//! `dx = max|x| / 127` and codes `xq = round(x·(1/dx))` (ties to even), by plain Rust on every
//! path. One output `y[t, r]` is then, over the row's blocks `j` in order:
//! - the block's integer dot product `P[j] = Σ w_i·xq_i` over its 32 elements (`w` the weight's
//!   integer code: `q − 8` for Q4_0, `q − 16` for Q5_0, `q` for Q4_1, Q4_K and Q8_0), exact
//!   however it is computed (and exact in f32: `|P| < 2^24`);
//! - one running sum `acc = fma(s_j·dx_j, P[j], acc)` (the scale product rounded once), `s_j`
//!   the block's scale (Q4_K: `d·sc`, exact in f32);
//! - Q6_K has a scale per 16 weights: two integer dot products `P0`, `P1` (codes `q − 32`) and
//!   two fused multiply-adds, the first half's first;
//! - Q4_1 and Q4_K add their minimums: `mins = fma(m_j, dx_j·Σ xq_j, mins)` (Q4_K's
//!   `m = −(dmin·mn)`, exact), and `y = acc + mins`.
//!
//! So every path (the portable loops here, the AVX2 kernel, the AVX-512 VNNI one) gives the same
//! bits, whatever the batch. The weights are repacked at load ([`A8Matrix`]) so that one vector
//! holds a code group of eight rows: the SIMD kernels multiply eight rows at once against a
//! broadcast group of four activation codes and convert one vector per block (two for Q6_K).

use half::f16;

use super::{Isa, RowData, RowsOut, K_BLOCKS, QK};

/// Activations quantized per 32-element block: `n_tok` rows of `cols`.
#[derive(Debug, Clone, Default)]
pub struct Q8Acts {
    pub(crate) cols: usize,
    /// Scale of each block, token-major: `d[t·nb + j]`.
    pub(crate) d: Vec<f32>,
    /// `dx·Σ xq` of each block (the minimums' term of Q4_1 and Q4_K).
    pub(crate) sum: Vec<f32>,
    /// The codes, token-major, in element order.
    pub(crate) qs: Vec<i8>,
    /// The sum of each block's codes, and of its first 16 codes: what turns the unsigned codes'
    /// dot products into the centred ones (`Σ (q − 8)·x = Σ q·x − 8·Σ x`).
    pub(crate) qsum: Vec<i32>,
    pub(crate) qsum0: Vec<i32>,
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
            qsum: Vec::with_capacity(nb),
            qsum0: Vec::with_capacity(nb),
        };
        for (xb, qb) in x.chunks_exact(QK).zip(a.qs.chunks_exact_mut(QK)) {
            let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            let id = if d > 0.0 { 1.0 / d } else { 0.0 };
            let (mut s, mut s0) = (0i32, 0i32);
            for (i, (q, &v)) in qb.iter_mut().zip(xb).enumerate() {
                *q = round_even(v * id) as i8;
                s += i32::from(*q);
                if i == 15 {
                    s0 = s;
                }
            }
            a.d.push(d);
            a.sum.push(d * s as f32);
            a.qsum.push(s);
            a.qsum0.push(s0);
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
    /// Unsigned 5-bit codes `q`, a byte each, code `q − 16`.
    Q5_0,
    /// Unsigned nibbles `q`, code `q`; a scale and a minimum from the super-block's.
    Q4K,
    /// Unsigned 6-bit codes `q`, a byte each, code `q − 32`; a scale per 16 weights.
    Q6K,
}

impl Format {
    /// Bytes of quants per row and block.
    pub(crate) fn qbytes(self) -> usize {
        match self {
            Format::Q4_0 | Format::Q4_1 | Format::Q4K => 16,
            Format::Q8_0 | Format::Q5_0 | Format::Q6K => 32,
        }
    }

    /// The codes are nibbles (two a byte).
    pub(crate) fn nibbles(self) -> bool {
        self.qbytes() == 16
    }

    /// What the stored unsigned code is centred by.
    pub(crate) fn offset(self) -> i32 {
        match self {
            Format::Q4_0 => 8,
            Format::Q5_0 => 16,
            Format::Q6K => 32,
            Format::Q4_1 | Format::Q4K | Format::Q8_0 => 0,
        }
    }

    /// The format adds a minimum per block.
    pub(crate) fn has_min(self) -> bool {
        matches!(self, Format::Q4_1 | Format::Q4K)
    }

    /// The scales come from super-blocks (`kd`, `kmin`, `sc`), not an f16 per block.
    pub(crate) fn super_blocks(self) -> bool {
        matches!(self, Format::Q4K | Format::Q6K)
    }
}

/// A block-format matrix repacked for 8-bit activations: rows in groups of eight (the last
/// padded with rows of scale 0), each group's blocks in order. Block `j` of group `g` holds
/// - the eight rows' scales (and Q4_1's minimums) side by side: `d[(g·nb + j)·8 + lane]`; a
///   k-quant format instead the super-block's scale (and scale of minimums) for each lane,
///   `kd[(g·ns + j / 8)·8 + lane]` (`ns` super-blocks a row), and two bytes a lane, the
///   first of each lane then the second: `sc[(g·nb + j)·16 + h·8 + lane]` (Q4_K the 6-bit scale
///   and minimum, Q6_K the signed scales of the two halves);
/// - their quants in 32-byte chunks: chunk `c` is bytes `4c .. 4c + 4` of each row's block,
///   row after row. For the 4-bit formats (16 bytes a block, element `i < 16` in byte `i`'s
///   low nibble, `16 + i` in its high one) a chunk's low nibbles are each row's elements
///   `4c .. 4c + 4` and its high nibbles elements `16 + 4c ..`: unpacked, every vector is one
///   group of four consecutive elements of the eight rows. The byte formats (Q8_0, Q5_0, Q6_K:
///   32 bytes a block, element `i` in byte `i`) hold elements `4c .. 4c + 4` in chunk `c`.
#[derive(Debug, Clone, PartialEq)]
pub struct A8Matrix {
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) format: Format,
    pub(crate) d: Vec<f16>,
    pub(crate) m: Vec<f16>,
    pub(crate) kd: Vec<f32>,
    pub(crate) kmin: Vec<f32>,
    pub(crate) sc: Vec<u8>,
    pub(crate) qs: Vec<u8>,
}

/// Block `k` of the whole matrix as `(scale, minimum, the two scale bytes, its 32 unsigned or
/// signed codes a byte each in element order, or its 16 nibble bytes first)`.
type Unpacked = (f16, Option<f16>, [u8; 2], [u8; QK]);

impl A8Matrix {
    /// `w` (`rows × cols`) repacked; `None` for a format without an 8-bit-activation kernel
    /// (f32, f16).
    pub fn pack(w: &RowData, rows: usize, cols: usize) -> Option<A8Matrix> {
        let format = match w {
            RowData::Q4_0(_) => Format::Q4_0,
            RowData::Q4_1(_) => Format::Q4_1,
            RowData::Q8_0(_) => Format::Q8_0,
            RowData::Q5_0(_) => Format::Q5_0,
            RowData::Q4K(_) => Format::Q4K,
            RowData::Q6K(_) => Format::Q6K,
            RowData::F32(_) | RowData::F16(_) => return None,
        };
        let (nb, qb) = (cols / QK, format.qbytes());
        let ns = if format.super_blocks() {
            nb / K_BLOCKS
        } else {
            0
        };
        assert!(
            cols.is_multiple_of(QK) && (ns * K_BLOCKS == nb || !format.super_blocks()),
            "invariant: whole rows of whole blocks"
        );
        // Block k of the matrix, whatever its storage.
        let block = |k: usize| -> Unpacked {
            let mut q = [0u8; QK];
            match w {
                RowData::Q4_0(b) | RowData::Q4_1(b) | RowData::Q8_0(b) => {
                    q[..qb].copy_from_slice(&b.qs[k * qb..(k + 1) * qb]);
                    (b.d[k], b.m.get(k).copied(), [0; 2], q)
                }
                RowData::Q5_0(b) => (
                    b.d[k],
                    None,
                    [0; 2],
                    super::q5_0_codes(&b.qs[k * 20..(k + 1) * 20]),
                ),
                RowData::Q4K(b) => {
                    q[..qb].copy_from_slice(&b.qs[k * qb..(k + 1) * qb]);
                    (f16::ZERO, None, [b.sc[2 * k], b.sc[2 * k + 1]], q)
                }
                RowData::Q6K(b) => (
                    f16::ZERO,
                    None,
                    [b.sc[2 * k], b.sc[2 * k + 1]],
                    super::kquant::q6k_codes(&b.qs[k * 24..(k + 1) * 24]),
                ),
                RowData::F32(_) | RowData::F16(_) => unreachable!("invariant: a block format"),
            }
        };
        let groups = rows.div_ceil(GROUP);
        let per = groups * nb * GROUP;
        let mut m = A8Matrix {
            rows,
            cols,
            format,
            d: vec![f16::ZERO; if format.super_blocks() { 0 } else { per }],
            m: vec![f16::ZERO; if format == Format::Q4_1 { per } else { 0 }],
            kd: vec![0.0; groups * ns * GROUP],
            kmin: vec![
                0.0;
                if format == Format::Q4K {
                    groups * ns * GROUP
                } else {
                    0
                }
            ],
            sc: vec![0; if format.super_blocks() { 2 * per } else { 0 }],
            qs: vec![0; per * qb],
        };
        for r in 0..rows {
            let (g, lane) = (r / GROUP, r % GROUP);
            for s in 0..ns {
                let (RowData::Q4K(b) | RowData::Q6K(b)) = w else {
                    unreachable!("invariant: super-blocks")
                };
                m.kd[(g * ns + s) * GROUP + lane] = b.d[r * ns + s];
                if let Some(&v) = b.dmin.get(r * ns + s) {
                    m.kmin[(g * ns + s) * GROUP + lane] = v;
                }
            }
            for j in 0..nb {
                let (k, at) = (r * nb + j, g * nb + j);
                let (d, mn, sc, src) = block(k);
                if let Some(v) = m.d.get_mut(at * GROUP + lane) {
                    *v = d;
                }
                if let (Some(v), Some(mn)) = (m.m.get_mut(at * GROUP + lane), mn) {
                    *v = mn;
                }
                if format.super_blocks() {
                    m.sc[at * 2 * GROUP + lane] = sc[0];
                    m.sc[at * 2 * GROUP + GROUP + lane] = sc[1];
                }
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
            Format::Q5_0 => "q5_0",
            Format::Q4K => "q4_k",
            Format::Q6K => "q6_k",
        }
    }

    /// The first `rows` rows (at most [`A8Matrix::rows`]; the groups are stored in order). The
    /// last group keeps the rows past `rows` in its lanes, computed but never written out.
    pub fn first_rows(&self, rows: usize) -> A8Matrix {
        assert!(rows <= self.rows, "invariant: rows of the matrix");
        let nb = self.cols / QK;
        let g = rows.div_ceil(GROUP);
        let per = g * nb * GROUP;
        let ks = g * (nb / K_BLOCKS) * GROUP;
        A8Matrix {
            rows,
            cols: self.cols,
            format: self.format,
            d: self.d[..per.min(self.d.len())].to_vec(),
            m: self.m[..per.min(self.m.len())].to_vec(),
            kd: self.kd[..ks.min(self.kd.len())].to_vec(),
            kmin: self.kmin[..ks.min(self.kmin.len())].to_vec(),
            sc: self.sc[..(2 * per).min(self.sc.len())].to_vec(),
            qs: self.qs[..per * self.format.qbytes()].to_vec(),
        }
    }

    /// Bytes read to multiply by this matrix once (its rows', not the padding's).
    pub fn bytes(&self) -> usize {
        let nb = self.cols / QK;
        let ns = nb / K_BLOCKS;
        let scales = match self.format {
            Format::Q4_0 | Format::Q8_0 | Format::Q5_0 => 2 * nb,
            Format::Q4_1 => 4 * nb,
            // Two scale bytes a block, and the super-blocks' f32 scales (and minimums' scales).
            Format::Q4K => 2 * nb + 8 * ns,
            Format::Q6K => 2 * nb + 4 * ns,
        };
        self.rows * (nb * self.format.qbytes() + scales)
    }

    /// The integer code of element `i` of row `r`'s block `j`, uncentred (signed for Q8_0).
    fn code(&self, r: usize, j: usize, i: usize) -> i32 {
        let (g, lane, nb, qb) = (r / GROUP, r % GROUP, self.cols / QK, self.format.qbytes());
        let base = (g * nb + j) * GROUP * qb;
        let byte = |e: usize| self.qs[base + (e / 4) * GROUP * 4 + lane * 4 + e % 4];
        match self.format {
            Format::Q8_0 => i32::from(byte(i) as i8),
            f if f.nibbles() => i32::from(if i < 16 {
                byte(i) & 15
            } else {
                byte(i - 16) >> 4
            }),
            _ => i32::from(byte(i)),
        }
    }

    /// Row `r`'s block `j`: the scales of its halves (equal but for Q6_K) and its minimum.
    pub(crate) fn params(&self, r: usize, j: usize) -> (f32, f32, f32) {
        let (g, lane, nb) = (r / GROUP, r % GROUP, self.cols / QK);
        let at = (g * nb + j) * GROUP + lane;
        let ks = (g * (nb / K_BLOCKS) + j / K_BLOCKS) * GROUP + lane;
        let sc = |h: usize| self.sc[(g * nb + j) * 2 * GROUP + h * GROUP + lane];
        match self.format {
            Format::Q4K => {
                let s = self.kd[ks] * f32::from(sc(0));
                (s, s, -(self.kmin[ks] * f32::from(sc(1))))
            }
            Format::Q6K => (
                self.kd[ks] * f32::from(sc(0) as i8),
                self.kd[ks] * f32::from(sc(1) as i8),
                0.0,
            ),
            _ => {
                let s = self.d[at].to_f32();
                (s, s, self.m.get(at).map_or(0.0, |m| m.to_f32()))
            }
        }
    }
}

/// One task on the portable path: rows `out.r0()..` for every token.
fn rows_task(w: &A8Matrix, x: &Q8Acts, out: &mut RowsOut) {
    let (cols, nb, n_tok) = (x.cols, x.cols / QK, out.n_tok());
    let f = w.format;
    let (mut acc, mut mins) = (vec![0f32; n_tok], vec![0f32; n_tok]);
    for i in 0..out.n_rows() {
        let r = out.r0() + i;
        acc.fill(0.0);
        mins.fill(0.0);
        for j in 0..nb {
            let codes: [i32; QK] = std::array::from_fn(|e| w.code(r, j, e));
            let (s0, s1, m) = w.params(r, j);
            for t in 0..n_tok {
                let tb = t * nb + j;
                let xq = &x.qs[t * cols + j * QK..t * cols + (j + 1) * QK];
                let dot = |a: usize, z: usize| -> i32 {
                    codes[a..z]
                        .iter()
                        .zip(&xq[a..z])
                        .map(|(&c, &q)| c * i32::from(q))
                        .sum()
                };
                let dx = x.d[tb];
                if f == Format::Q6K {
                    let p0 = dot(0, 16) - f.offset() * x.qsum0[tb];
                    let p1 = dot(16, QK) - f.offset() * (x.qsum[tb] - x.qsum0[tb]);
                    acc[t] = (s0 * dx).mul_add(p0 as f32, acc[t]);
                    acc[t] = (s1 * dx).mul_add(p1 as f32, acc[t]);
                } else {
                    let p = dot(0, QK) - f.offset() * x.qsum[tb];
                    acc[t] = (s0 * dx).mul_add(p as f32, acc[t]);
                }
                if f.has_min() {
                    mins[t] = m.mul_add(x.sum[tb], mins[t]);
                }
            }
        }
        for t in 0..n_tok {
            out.put(
                i,
                t,
                if f.has_min() {
                    acc[t] + mins[t]
                } else {
                    acc[t]
                },
            );
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
            use std::arch::is_x86_feature_detected as has;
            assert!(
                has!("avx2") && has!("fma") && has!("f16c"),
                "invariant: a SIMD path on a CPU with AVX2"
            );
            if isa == Isa::Avx512 && has!("avx512f") && has!("avx512vl") && has!("avx512vnni") {
                // SAFETY: the CPU supports AVX2, FMA, F16C and AVX-512 VNNI and VL (checked
                // just above).
                return unsafe { super::avx2::rows_task_a8_vnni(w, x, out) };
            }
            // SAFETY: the CPU supports AVX2, FMA and F16C (checked just above); an AVX-512
            // CPU without VNNI runs the AVX2 kernel, which gives the same bits.
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
