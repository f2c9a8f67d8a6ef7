//! The AVX2 path (AVX2, FMA and F16C): hand-written kernels that compute the bits of the
//! portable path (see the module docs of [`super`]: the same values of the weights, the same
//! fused multiply-adds in the same order, the same fold).
//!
//! - **f32 panels**: 8 panels (128 rows) × 1 token in registers (each panel column is two 8-lane
//!   vectors: 16 accumulators, the weights read by the multiply-adds themselves), 4 panels × 2
//!   tokens, 1 panel × up to 6 tokens for more (one pass over the weights
//!   carries the compute of several tokens; with few tokens, more weight streams at once keep
//!   more of them in flight); one running sum per output over the columns in order, the
//!   columns walked in blocks that stay in L1 while every token tile uses them.
//! - **Quantized and f16 rows**: the 16 lanes of the portable layout as two 8-lane vectors
//!   (element `i` of a reduction in lane `i % 16`), in register tiles of 4 rows × 1 token or 2
//!   rows × up to 2 tokens. A block's 32 weights are decoded in registers (nibbles widened to
//!   32-bit integers, converted, times the block's scale: `w = d·(q − 8)` rounded once, as the
//!   portable dequantization) once per tile and used for every token of it; f16 rows are
//!   converted into an L1 scratch a tile of rows at a time.
//!
//! - **8-bit activations** ([`super::a8`], the draft's): weights repacked at load in groups of
//!   eight rows, one 32-bit lane each; a block's 32 codes of the eight rows are eight vectors
//!   (four consecutive elements per row), each multiplied (`maddubs`) by a broadcast group of
//!   four activation codes and summed in 16-bit lanes; one conversion and one fused
//!   multiply-add per block, eight rows at once.
//! - **Attention's dot products**: the portable 16-lane sum as two vectors (a multiply then an
//!   add a step, as the portable code: the same bits).
//!
//! Every stream of weights asks the L2 for bytes ahead of it: its own [`PREFETCH_BYTES`] ahead,
//! or, for f32 panels of one token, the next group of panels' instead, of two tokens both
//! ([`Ahead`]); the 8-bit kernel asks the L1, [`PREFETCH_A8`] ahead.

use std::arch::x86_64::*;

use super::{KFormat, Panels, RowData, RowsOut, PANEL, QK};

mod a8;
pub(super) use a8::{rows_task_a8, rows_task_a8_vnni};

/// Bytes ahead of the weights being read that each row asks the L2 to fetch.
const PREFETCH_BYTES: usize = 16 << 10;

/// Lanes of the portable layout: two vectors of 8, lanes 0..8 and 8..16.
type Lanes = [__m256; 2];

/// The portable `fold`: lanes `i` and `i + 8`, then `i + 4`, `i + 2`, `i + 1`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn fold16(v: Lanes) -> f32 {
    let s8 = _mm256_add_ps(v[0], v[1]);
    let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    let s1 = _mm_add_ss(s2, _mm_shuffle_ps::<0b01>(s2, s2));
    _mm_cvtss_f32(s1)
}

/// The portable [`super::dot`] in vectors: 16 lanes (element `i` in lane `i % 16`), a multiply
/// then an add a step, the same fold; the same bits.
///
/// # Safety
/// The CPU must support AVX2.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot16(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut v = [_mm256_setzero_ps(); 2];
    let full = n / 16 * 16;
    let mut i = 0;
    while i < full {
        for (h, acc) in v.iter_mut().enumerate() {
            // SAFETY: elements i..i + 16 are within both slices.
            let (x, y) = unsafe {
                (
                    _mm256_loadu_ps(pa.add(i + 8 * h)),
                    _mm256_loadu_ps(pb.add(i + 8 * h)),
                )
            };
            *acc = _mm256_add_ps(*acc, _mm256_mul_ps(x, y));
        }
        i += 16;
    }
    if full < n {
        let mut lanes = [0f32; 16];
        // SAFETY: `lanes` holds 16 floats.
        unsafe {
            _mm256_storeu_ps(lanes.as_mut_ptr(), v[0]);
            _mm256_storeu_ps(lanes.as_mut_ptr().add(8), v[1]);
        }
        for (l, (x, y)) in a[full..n].iter().zip(&b[full..n]).enumerate() {
            lanes[l] += x * y;
        }
        // SAFETY: as above.
        v = unsafe {
            [
                _mm256_loadu_ps(lanes.as_ptr()),
                _mm256_loadu_ps(lanes.as_ptr().add(8)),
            ]
        };
    }
    fold16(v)
}

/// [`dot16`] of `q` with each of four rows `k`: the same lanes, multiplies, adds and fold for
/// each, so the same four bits; the fold of the four runs side by side in vectors (each level
/// adds the same lane pairs as `fold16`), and `q` is loaded once for the four.
///
/// # Safety
/// The CPU must support AVX2.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dots4(q: &[f32], k: [&[f32]; 4]) -> [f32; 4] {
    let n = q.len();
    if !n.is_multiple_of(16) || k.iter().any(|k| k.len() != n) {
        // SAFETY: as the caller's.
        return k.map(|k| unsafe { dot16(q, k) });
    }
    let pq = q.as_ptr();
    let pk = k.map(|k| k.as_ptr());
    let mut acc = [[_mm256_setzero_ps(); 2]; 4];
    let mut i = 0;
    while i < n {
        // SAFETY: elements i..i + 16 are within `q` and every `k` (all n long).
        unsafe {
            let q0 = _mm256_loadu_ps(pq.add(i));
            let q1 = _mm256_loadu_ps(pq.add(i + 8));
            for (a, p) in acc.iter_mut().zip(&pk) {
                a[0] = _mm256_add_ps(a[0], _mm256_mul_ps(q0, _mm256_loadu_ps(p.add(i))));
                a[1] = _mm256_add_ps(a[1], _mm256_mul_ps(q1, _mm256_loadu_ps(p.add(i + 8))));
            }
        }
        i += 16;
    }
    // Lanes i and i + 8, for each row.
    let s = acc.map(|a| _mm256_add_ps(a[0], a[1]));
    // Lanes i and i + 4: rows 0 and 1 in one vector, 2 and 3 in another.
    let t01 = _mm256_add_ps(
        _mm256_permute2f128_ps::<0x20>(s[0], s[1]),
        _mm256_permute2f128_ps::<0x31>(s[0], s[1]),
    );
    let t23 = _mm256_add_ps(
        _mm256_permute2f128_ps::<0x20>(s[2], s[3]),
        _mm256_permute2f128_ps::<0x31>(s[2], s[3]),
    );
    // Lanes i and i + 2: [u0 u1 | u0 u1] of rows 0, 2 (low half) and 1, 3 (high half).
    let u = _mm256_add_ps(
        _mm256_shuffle_ps::<0x44>(t01, t23),
        _mm256_shuffle_ps::<0xEE>(t01, t23),
    );
    // Lanes 0 and 1: rows 0, 2 in lanes 0, 1 and rows 1, 3 in lanes 4, 5.
    let r = _mm256_add_ps(
        _mm256_shuffle_ps::<0x88>(u, u),
        _mm256_shuffle_ps::<0xDD>(u, u),
    );
    let mut out = [0f32; 8];
    // SAFETY: `out` holds 8 floats.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), r) };
    [out[0], out[4], out[1], out[5]]
}

/// A quantized block format, decoded in registers: its 32 weights as four vectors (elements
/// 0..8, 8..16, 16..24, 24..32), each the portable dequantization's value.
trait QBlock {
    /// Bytes of quants per block.
    const QBYTES: usize;
    /// Whether blocks carry a minimum.
    const MIN: bool;
    /// The k-quant format whose super-blocks give the blocks' scales (else each block's f16
    /// scale and minimum are stored with it).
    const K: Option<KFormat> = None;
    /// The weights of the block whose scale is `s` (`s1` for elements 16..32 where the halves
    /// have scales of their own, Q6_K), minimum `m` (each in every lane) and quants at `q`.
    ///
    /// # Safety
    /// `q` must point at `QBYTES` readable bytes.
    unsafe fn weights(s: __m256, s1: __m256, m: __m256, q: *const u8) -> [__m256; 4];
}

struct Q4_0;
struct Q4_1;
struct Q8_0;
struct Q5_0;
struct Q4K;
struct Q6K;

/// The 32 nibbles of 16 bytes as four vectors of 32-bit integers: elements 0..16 are the low
/// nibbles of bytes 0..16, elements 16..32 their high nibbles.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibble_ints(p: *const u8) -> [__m256i; 4] {
    // SAFETY: the caller's block has 16 bytes of nibbles at `p`.
    let v = unsafe { _mm_loadu_si128(p as *const __m128i) };
    let mask = _mm_set1_epi8(0x0f);
    let lo = _mm_and_si128(v, mask);
    let hi = _mm_and_si128(_mm_srli_epi16::<4>(v), mask);
    [
        _mm256_cvtepu8_epi32(lo),
        _mm256_cvtepu8_epi32(_mm_srli_si128::<8>(lo)),
        _mm256_cvtepu8_epi32(hi),
        _mm256_cvtepu8_epi32(_mm_srli_si128::<8>(hi)),
    ]
}

/// [`nibble_ints`] as exact f32 values.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibble_codes(p: *const u8) -> [__m256; 4] {
    // SAFETY: the caller's contract.
    unsafe { nibble_ints(p) }.map(|c| _mm256_cvtepi32_ps(c))
}

/// Codes of `4 + h` bits: the nibbles of the 16 bytes at `q` (Q4_0's layout), with the high
/// bits of each group of eight elements from `hi[k]` (each lane's bits shifted down to bit 0,
/// `h_mask` keeping them), as exact f32 values less `centre`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn wide_codes(q: *const u8, hi: [__m256i; 4], h_mask: i32, centre: f32) -> [__m256; 4] {
    // SAFETY: the caller's contract: 16 bytes of nibbles at `q`.
    let n = unsafe { nibble_ints(q) };
    let hm = _mm256_set1_epi32(h_mask);
    [0, 1, 2, 3].map(|k| {
        let c = _mm256_or_si256(n[k], _mm256_slli_epi32::<4>(_mm256_and_si256(hi[k], hm)));
        _mm256_sub_ps(_mm256_cvtepi32_ps(c), _mm256_set1_ps(centre))
    })
}

impl QBlock for Q5_0 {
    const QBYTES: usize = 20;
    const MIN: bool = false;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn weights(s: __m256, _s1: __m256, _m: __m256, q: *const u8) -> [__m256; 4] {
        // d·(q − 16), rounded once; element i's fifth bit is bit i of the first word.
        // SAFETY: the caller's contract: 4 bytes of high bits, then 16 of nibbles.
        let qh = _mm256_set1_epi32(unsafe { (q as *const i32).read_unaligned() });
        let shift = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        let hi = [0, 8, 16, 24]
            .map(|k| _mm256_srlv_epi32(qh, _mm256_add_epi32(shift, _mm256_set1_epi32(k))));
        // SAFETY: as above.
        unsafe { wide_codes(q.add(4), hi, 1, 16.0) }.map(|c| _mm256_mul_ps(s, c))
    }
}

impl QBlock for Q4K {
    const QBYTES: usize = 16;
    const MIN: bool = true;
    const K: Option<KFormat> = Some(KFormat::Q4K);
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn weights(s: __m256, _s1: __m256, m: __m256, q: *const u8) -> [__m256; 4] {
        // (d·sc)·q + (−dmin·mn): the product exact, the sum rounded once.
        // SAFETY: the caller's contract.
        unsafe { nibble_codes(q) }.map(|c| _mm256_add_ps(_mm256_mul_ps(s, c), m))
    }
}

impl QBlock for Q6K {
    const QBYTES: usize = 24;
    const MIN: bool = false;
    const K: Option<KFormat> = Some(KFormat::Q6K);
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn weights(s: __m256, s1: __m256, _m: __m256, q: *const u8) -> [__m256; 4] {
        // (d·sc)·(q − 32), rounded once; element i's high pair at bit 2·(i / 8) of byte
        // 16 + i % 8: the eight bytes widened once, shifted by 0, 2, 4, 6.
        // SAFETY: the caller's contract: 16 bytes of nibbles, then 8 of high pairs.
        let h = _mm256_cvtepu8_epi32(unsafe { _mm_loadl_epi64(q.add(16) as *const __m128i) });
        let hi = [
            h,
            _mm256_srli_epi32::<2>(h),
            _mm256_srli_epi32::<4>(h),
            _mm256_srli_epi32::<6>(h),
        ];
        // SAFETY: as above.
        let c = unsafe { wide_codes(q, hi, 3, 32.0) };
        [
            _mm256_mul_ps(s, c[0]),
            _mm256_mul_ps(s, c[1]),
            _mm256_mul_ps(s1, c[2]),
            _mm256_mul_ps(s1, c[3]),
        ]
    }
}

impl QBlock for Q4_0 {
    const QBYTES: usize = 16;
    const MIN: bool = false;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn weights(s: __m256, _s1: __m256, _m: __m256, q: *const u8) -> [__m256; 4] {
        // d·(q − 8): q − 8 is exact, the product rounded once.
        let eight = _mm256_set1_ps(8.0);
        // SAFETY: the caller's contract.
        unsafe { nibble_codes(q) }.map(|c| _mm256_mul_ps(s, _mm256_sub_ps(c, eight)))
    }
}

impl QBlock for Q4_1 {
    const QBYTES: usize = 16;
    const MIN: bool = true;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn weights(s: __m256, _s1: __m256, m: __m256, q: *const u8) -> [__m256; 4] {
        // d·q + m, rounded twice (a product, then a sum: not fused).
        // SAFETY: the caller's contract.
        unsafe { nibble_codes(q) }.map(|c| _mm256_add_ps(_mm256_mul_ps(s, c), m))
    }
}

impl QBlock for Q8_0 {
    const QBYTES: usize = 32;
    const MIN: bool = false;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn weights(s: __m256, _s1: __m256, _m: __m256, q: *const u8) -> [__m256; 4] {
        let code = |k: usize| {
            // SAFETY: 32 signed bytes at `q`; k < 4.
            let b = unsafe { _mm_loadl_epi64(q.add(8 * k) as *const __m128i) };
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b))
        };
        [0, 1, 2, 3].map(|k| _mm256_mul_ps(s, code(k)))
    }
}

/// Blocks whose scales are converted together.
const SCALE_RUN: usize = 8;

/// `n ≤ 8` f16 values at `p` as f32 into `out` (exact either way).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scales(p: *const half::f16, n: usize, out: &mut [f32; SCALE_RUN]) {
    if n == SCALE_RUN {
        // SAFETY: 8 f16 values (16 bytes) at `p`; `out` holds 8 floats.
        unsafe {
            let v = _mm_loadu_si128(p as *const __m128i);
            _mm256_storeu_ps(out.as_mut_ptr(), _mm256_cvtph_ps(v));
        }
    } else {
        for (j, o) in out.iter_mut().take(n).enumerate() {
            // SAFETY: `n` values at `p`.
            *o = unsafe { p.add(j).read() }.to_f32();
        }
    }
}

/// The halves' scales and the minimums of the 8 k-quant blocks `b0..b0 + 8` of a row (one
/// super-block: `b0` a multiple of 8), in vectors: [`super::k_params`]'s values (each product
/// exact; the minimum's sign flipped, not subtracted from 0).
///
/// # Safety
/// The pointers must cover the row's blocks `b0..b0 + 8` (`km` read for Q4_K only).
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k_scales(
    format: KFormat,
    kd: *const f32,
    km: *const f32,
    sc: *const u8,
    b0: usize,
    s0: &mut [f32; SCALE_RUN],
    s1: &mut [f32; SCALE_RUN],
    m: &mut [f32; SCALE_RUN],
) {
    let sb = b0 / super::K_BLOCKS;
    // Lane j: block b0 + j's two bytes, the first in the low eight bits.
    // SAFETY: 16 scale bytes of the row's blocks b0..b0 + 8.
    let pairs = _mm256_cvtepu16_epi32(unsafe { _mm_loadu_si128(sc.add(2 * b0) as *const __m128i) });
    // SAFETY: super-block sb of the row.
    let d = _mm256_set1_ps(unsafe { kd.add(sb).read() });
    match format {
        KFormat::Q4K => {
            let lo = _mm256_and_si256(pairs, _mm256_set1_epi32(0xff));
            let hi = _mm256_srli_epi32::<8>(pairs);
            // SAFETY: as above.
            let dmin = _mm256_set1_ps(unsafe { km.add(sb).read() });
            let mins = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(hi));
            let neg = _mm256_xor_ps(mins, _mm256_set1_ps(-0.0));
            // SAFETY: each array holds 8 floats.
            unsafe {
                _mm256_storeu_ps(s0.as_mut_ptr(), _mm256_mul_ps(d, _mm256_cvtepi32_ps(lo)));
                _mm256_storeu_ps(m.as_mut_ptr(), neg);
            }
        }
        KFormat::Q6K => {
            // The bytes are signed: each moved to the top of its lane and shifted back down.
            let lo = _mm256_srai_epi32::<24>(_mm256_slli_epi32::<24>(pairs));
            let hi = _mm256_srai_epi32::<24>(_mm256_slli_epi32::<16>(pairs));
            // SAFETY: each array holds 8 floats.
            unsafe {
                _mm256_storeu_ps(s0.as_mut_ptr(), _mm256_mul_ps(d, _mm256_cvtepi32_ps(lo)));
                _mm256_storeu_ps(s1.as_mut_ptr(), _mm256_mul_ps(d, _mm256_cvtepi32_ps(hi)));
            }
        }
    }
}

/// Four rows of one storage kind, ready to multiply with a tile of tokens.
trait Rows {
    /// Dot products of the first `R` rows with `T` tokens.
    ///
    /// # Safety
    /// The rows' pointers cover whole rows of `cols` weights; the tokens' `cols` floats each.
    unsafe fn tile<const R: usize, const T: usize>(
        &self,
        x: [*const f32; T],
        cols: usize,
    ) -> [[f32; T]; R];
}

/// Rows of f32 weights in a scratch (f16 storage, converted).
struct F32Rows([*const f32; 4]);

/// Rows of quantized blocks, decoded in registers: each row's first scale, minimum (when the
/// format has them) and quants; for a k-quant format, its first super-block's scale and scale
/// of minimums, and its first block's scale bytes.
struct QRows<B> {
    p: super::RowPtrs<4>,
    format: std::marker::PhantomData<B>,
}

impl Rows for F32Rows {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile<const R: usize, const T: usize>(
        &self,
        x: [*const f32; T],
        cols: usize,
    ) -> [[f32; T]; R] {
        let mut acc = [[[_mm256_setzero_ps(); 2]; T]; R];
        let full = cols / 16 * 16;
        let mut c = 0;
        while c < full {
            for (a, &w) in acc.iter_mut().zip(&self.0) {
                // SAFETY: c + 16 <= cols.
                let wv = unsafe { [_mm256_loadu_ps(w.add(c)), _mm256_loadu_ps(w.add(c + 8))] };
                for (a, &xt) in a.iter_mut().zip(&x) {
                    for h in 0..2 {
                        // SAFETY: as above.
                        let xv = unsafe { _mm256_loadu_ps(xt.add(c + 8 * h)) };
                        a[h] = _mm256_fmadd_ps(wv[h], xv, a[h]);
                    }
                }
            }
            c += 16;
        }
        let mut out = [[0f32; T]; R];
        for ((o, a), &w) in out.iter_mut().zip(&acc).zip(&self.0) {
            for ((o, a), &xt) in o.iter_mut().zip(a).zip(&x) {
                // The tail: element i in lane i − full, fused as the portable path.
                let mut lanes = [[0f32; 8]; 2];
                // SAFETY: `lanes` holds 16 floats.
                unsafe {
                    _mm256_storeu_ps(lanes[0].as_mut_ptr(), a[0]);
                    _mm256_storeu_ps(lanes[1].as_mut_ptr(), a[1]);
                }
                for i in full..cols {
                    let l = &mut lanes[(i - full) / 8][(i - full) % 8];
                    // SAFETY: i < cols.
                    *l = unsafe { w.add(i).read().mul_add(xt.add(i).read(), *l) };
                }
                // SAFETY: as above.
                *o = fold16(unsafe {
                    [
                        _mm256_loadu_ps(lanes[0].as_ptr()),
                        _mm256_loadu_ps(lanes[1].as_ptr()),
                    ]
                });
            }
        }
        out
    }
}

impl<B: QBlock> Rows for QRows<B> {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile<const R: usize, const T: usize>(
        &self,
        x: [*const f32; T],
        cols: usize,
    ) -> [[f32; T]; R] {
        let mut acc = [[[_mm256_setzero_ps(); 2]; T]; R];
        let mut d = [[0f32; SCALE_RUN]; R];
        let mut d1 = [[0f32; SCALE_RUN]; R];
        let mut m = [[0f32; SCALE_RUN]; R];
        let nb = cols / QK;
        let mut b0 = 0;
        while b0 < nb {
            let n = (nb - b0).min(SCALE_RUN);
            for r in 0..R {
                // SAFETY: blocks b0..b0 + n of each row are within it.
                unsafe {
                    match B::K {
                        None => {
                            scales(self.p.d[r].add(b0), n, &mut d[r]);
                            if B::MIN {
                                scales(self.p.m[r].add(b0), n, &mut m[r]);
                            }
                        }
                        Some(format) if n == SCALE_RUN => {
                            let p = &self.p;
                            let (s0, s1, mn) = (&mut d[r], &mut d1[r], &mut m[r]);
                            k_scales(format, p.kd[r], p.km[r], p.sc[r], b0, s0, s1, mn);
                        }
                        Some(format) => {
                            let (s0, s1, mn) = (&mut d[r], &mut d1[r], &mut m[r]);
                            super::k_params_run(format, &self.p, r, b0, n, s0, s1, mn);
                        }
                    }
                }
            }
            for j in 0..n {
                let b = b0 + j;
                for r in 0..R {
                    let q = self.p.q[r].wrapping_add(b * B::QBYTES);
                    _mm_prefetch::<_MM_HINT_T1>(q.wrapping_add(PREFETCH_BYTES) as *const i8);
                    let (s, mn) = (_mm256_set1_ps(d[r][j]), _mm256_set1_ps(m[r][j]));
                    let s1 = if B::K == Some(KFormat::Q6K) {
                        _mm256_set1_ps(d1[r][j])
                    } else {
                        s
                    };
                    // SAFETY: block b of row r is within the row.
                    let w = unsafe { B::weights(s, s1, mn, q) };
                    for (a, &xt) in acc[r].iter_mut().zip(&x) {
                        // Elements 0..8 and 16..24 go to lanes 0..8, 8..16 and 24..32 to
                        // lanes 8..16, in increasing element order.
                        for (k, &wk) in w.iter().enumerate() {
                            // SAFETY: block b's 32 activations are within `cols`.
                            let xv = unsafe { _mm256_loadu_ps(xt.add(b * QK + 8 * k)) };
                            a[k % 2] = _mm256_fmadd_ps(wk, xv, a[k % 2]);
                        }
                    }
                }
            }
            b0 += n;
        }
        let mut out = [[0f32; T]; R];
        for (o, a) in out.iter_mut().zip(&acc) {
            for (o, &a) in o.iter_mut().zip(a) {
                *o = fold16(a);
            }
        }
        out
    }
}

/// The task's rows of the output and every token of `x`: 4 rows × 1 token for a lone token,
/// else 2 rows × up to 2 tokens (a short group repeats its last row or token, whose results are
/// dropped). `rows_of(i, nr)` gives the `nr` rows from `i`.
///
/// # Safety
/// `rows_of` must give pointers that cover whole rows; `x` holds `n_tok` rows of `cols`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tiles<Rw: Rows>(
    cols: usize,
    x: &[f32],
    out: &mut RowsOut,
    mut rows_of: impl FnMut(usize, usize) -> Rw,
) {
    let (n_rows, n_tok) = (out.n_rows(), out.n_tok());
    let group = if n_tok == 1 { 4 } else { 2 };
    let mut i = 0;
    while i < n_rows {
        let nr = (n_rows - i).min(group);
        let rows = rows_of(i, nr);
        let mut t = 0;
        while t < n_tok {
            let nt = (n_tok - t).min(2);
            let xp: [*const f32; 2] =
                std::array::from_fn(|k| x[(t + k.min(nt - 1)) * cols..].as_ptr());
            let mut put = |r: usize, k: usize, v: f32| {
                if r < nr && k < nt {
                    out.put(i + r, t + k, v);
                }
            };
            macro_rules! run {
                ($r:literal, $t:literal) => {{
                    let mut xs = [std::ptr::null::<f32>(); $t];
                    xs.copy_from_slice(&xp[..$t]);
                    // SAFETY: the caller's row pointers, token pointers `cols` floats each.
                    let o = unsafe { rows.tile::<$r, $t>(xs, cols) };
                    for (r, row) in o.iter().enumerate() {
                        for (k, &v) in row.iter().enumerate() {
                            put(r, k, v);
                        }
                    }
                }};
            }
            match (group, nt) {
                (4, _) => run!(4, 1),
                (_, 1) => run!(2, 1),
                _ => run!(2, 2),
            }
            t += nt;
        }
        i += nr;
    }
}

/// Columns of the panels kept in L1 while every token tile walks them (one panel: 8 KiB; a
/// tile of eight or four panels is alone over its tokens and reads each column once).
const PANEL_COLS: usize = 128;

/// `P` panels times `T` tokens over columns `k0..k1`, continuing the running sums in `acc`: for
/// each output one fused multiply-add per column, in column order, whatever `P`, `T` or the
/// column blocking. The first `PF` distances of `ahead` (bytes) are asked of L2 for each
/// column read (see [`Ahead`]).
///
/// # Safety
/// Each panel pointer must cover `k1` columns, each token pointer `k1` floats.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn panel_tile<const P: usize, const T: usize, const PF: usize>(
    w: [*const f32; P],
    x: [*const f32; T],
    k0: usize,
    k1: usize,
    acc: &mut [[Lanes; P]],
    ahead: [usize; 2],
) {
    let mut a: [[Lanes; P]; T] = std::array::from_fn(|t| acc[t]);
    for k in k0..k1 {
        let mut wv = [[_mm256_setzero_ps(); 2]; P];
        for (v, &wp) in wv.iter_mut().zip(&w) {
            let p = wp.wrapping_add(k * PANEL);
            for &d in &ahead[..PF] {
                _mm_prefetch::<_MM_HINT_T1>(p.wrapping_byte_add(d) as *const i8);
            }
            // SAFETY: column k of the panel is within it (aligned: one cache line).
            *v = unsafe { [_mm256_load_ps(p), _mm256_load_ps(p.add(8))] };
        }
        for (at, &xt) in a.iter_mut().zip(&x) {
            // SAFETY: k < k1.
            let xb = _mm256_set1_ps(unsafe { xt.add(k).read() });
            for (ap, v) in at.iter_mut().zip(&wv) {
                ap[0] = _mm256_fmadd_ps(v[0], xb, ap[0]);
                ap[1] = _mm256_fmadd_ps(v[1], xb, ap[1]);
            }
        }
    }
    acc[..T].copy_from_slice(&a);
}

/// The f32 panels `P` at a time (a short last group repeats its last panel, the copies
/// dropped) times up to `T` tokens in registers. One pass over the weights (the stream from
/// memory) carries the compute of up to `T` tokens, so the two overlap: two panels × two tokens
/// for five tokens left the later tiles' compute after the first tile's stream (a 5-token
/// verify cost 1.4 single-token forwards on a Zen 3). The tokens are split into near-equal
/// tiles; the columns walked in blocks that stay in L1 across them, the running sums kept
/// between blocks.
#[target_feature(enable = "avx2,fma,f16c")]
fn panel_tiles<const P: usize, const T: usize>(
    panel_at: impl Fn(usize) -> *const f32,
    n_panels: usize,
    cols: usize,
    x: &[f32],
    out: &mut RowsOut,
    ahead: Ahead,
) {
    let (n_rows, n_tok) = (out.n_rows(), out.n_tok());
    let tiles = n_tok.div_ceil(T);
    // The same column of the next group of panels, read once this group is done; a group too
    // large for L2 to keep until then asks for its own bytes ahead only.
    let (ahead, next) = match super::next_group_bytes(P, cols) {
        Some(next) => (ahead, next),
        None => (Ahead::Stream, 0),
    };
    let zero = [_mm256_setzero_ps(); 2];
    let mut acc = vec![[zero; P]; n_tok];
    for i in (0..n_panels).step_by(P) {
        let np = (n_panels - i).min(P);
        let w: [*const f32; P] = std::array::from_fn(|q| panel_at(i + q.min(np - 1)));
        acc.fill([zero; P]);
        for k0 in (0..cols).step_by(PANEL_COLS) {
            let k1 = (k0 + PANEL_COLS).min(cols);
            let mut t = 0;
            for tile in 0..tiles {
                let nt = (n_tok - t).div_ceil(tiles - tile).min(T);
                macro_rules! run {
                    ($t:literal) => {{
                        let xs: [*const f32; $t] =
                            std::array::from_fn(|k| x[(t + k) * cols..].as_ptr());
                        let a = &mut acc[t..t + $t];
                        // SAFETY: the panels hold `cols` columns (`panel` checks the bounds),
                        // the tokens `cols` floats each.
                        unsafe {
                            match (tile, ahead) {
                                (1.., _) => panel_tile::<P, $t, 0>(w, xs, k0, k1, a, [0; 2]),
                                (0, Ahead::Stream) => {
                                    panel_tile::<P, $t, 1>(w, xs, k0, k1, a, [PREFETCH_BYTES, 0])
                                }
                                (0, Ahead::NextGroup) => {
                                    panel_tile::<P, $t, 1>(w, xs, k0, k1, a, [next, 0])
                                }
                                (0, Ahead::Both) => {
                                    panel_tile::<P, $t, 2>(w, xs, k0, k1, a, [PREFETCH_BYTES, next])
                                }
                            }
                        }
                    }};
                }
                match nt {
                    1 => run!(1),
                    2 => run!(2),
                    3 => run!(3),
                    4 => run!(4),
                    5 => run!(5),
                    _ => run!(6),
                }
                t += nt;
            }
        }
        for (t, a) in acc.iter().enumerate() {
            for (q, v) in a.iter().enumerate().take(np) {
                let r = (i + q) * PANEL;
                let n = PANEL.min(n_rows - r);
                let mut lanes = [0f32; PANEL];
                // SAFETY: `lanes` holds 16 floats.
                unsafe {
                    _mm256_storeu_ps(lanes.as_mut_ptr(), v[0]);
                    _mm256_storeu_ps(lanes.as_mut_ptr().add(8), v[1]);
                }
                for (j, &l) in lanes.iter().enumerate().take(n) {
                    out.put(r + j, t, l);
                }
            }
        }
    }
}

/// [`super::rows_task`] over f32 panels, in register tiles of `P` panels × up to `T` tokens
/// ([`panel_tiles`]): 8 × 1 for one token, 4 × 2 for two, 1 × 6 for three or more.
/// A single core's stream from memory is limited by the misses it keeps in flight: walking 8
/// panels at once for a decode (4 for two tokens) instead of 2 read the target's layers ~15%
/// faster (AVX2 forced on a Zen 4), and asking L2 for the next group's panels while this group
/// is read keeps more in flight still ([`Ahead`]). Three tokens take one panel at a time: 2 × 3
/// needs 17 registers of 16 (12 sums, 4 weights, a broadcast) and its spills cost more than the
/// second stream gains (`examples/panel_streams.rs`, the builds alternated five times: the
/// layers 26.0–26.9 ms with 2 × 3 against 23.4–25.1).
#[target_feature(enable = "avx2,fma,f16c")]
fn panels(p: &Panels, cols: usize, x: &[f32], out: &mut RowsOut) {
    let (n_rows, n_tok, r0) = (out.n_rows(), out.n_tok(), out.r0());
    let n_panels = n_rows.div_ceil(PANEL);
    assert!(
        r0.is_multiple_of(PANEL) && x.len() >= n_tok * cols,
        "invariant: tasks start at a panel; x holds n_tok rows"
    );
    let panel_at = |i: usize| p.panel(r0 + i * PANEL, cols).as_ptr() as *const f32;
    match n_tok {
        1 => panel_tiles::<8, 1>(panel_at, n_panels, cols, x, out, Ahead::NextGroup),
        2 => panel_tiles::<4, 2>(panel_at, n_panels, cols, x, out, Ahead::Both),
        _ => panel_tiles::<1, 6>(panel_at, n_panels, cols, x, out, Ahead::Stream),
    }
}

/// What the first token tile of a group of f32 panels asks of L2 as it reads each column (the
/// later tiles find the block in L1). `examples/panel_streams.rs`, AVX2 forced on a Zen 4, the
/// layers' matrices and the head, best of 20 passes, against asking only for the own panels'
/// bytes ahead (and 2 × 3 tiles for three tokens), the two builds alternated five times: two
/// tokens 22.6–23.8 ms → 20.9–22.9 (the head 5.6–5.8 → 5.0–5.2), three 26.0–26.9 → 23.4–25.1,
/// one 19.1–21.0 → 19.0–19.8 (the head 4.7–5.1 → 4.5–4.8). Both distances for one token were
/// slower (two prefetches a column in a loop of two loads and two multiply-adds), the next
/// group for one panel × 3–7 tokens too.
/// A group larger than [`super::NEXT_GROUP_MAX_BYTES`] asks for its own stream only.
#[derive(Debug, Clone, Copy)]
enum Ahead {
    /// The same panel [`PREFETCH_BYTES`] ahead.
    Stream,
    /// The same column of the next group of panels: `P` more streams in flight.
    NextGroup,
    /// Both.
    Both,
}

/// One task of [`super::matmul`]: its rows of the output.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn rows_task(w: &RowData, cols: usize, x: &[f32], out: &mut RowsOut) {
    let (n_rows, n_tok, r0) = (out.n_rows(), out.n_tok(), out.r0());
    assert!(x.len() >= n_tok * cols, "invariant: x holds n_tok rows");
    fn quantized<'a, B: QBlock>(
        w: &'a RowData,
        cols: usize,
        r0: usize,
        n_rows: usize,
    ) -> impl FnMut(usize, usize) -> QRows<B> + 'a {
        let ptrs = super::row_ptrs::<4>(w, B::QBYTES, B::MIN, cols, r0, n_rows);
        move |i, nr| QRows {
            p: ptrs(i, nr),
            format: std::marker::PhantomData,
        }
    }
    // SAFETY (each arm): the row pointers cover whole stored (or scratch) rows, and `x` holds
    // `n_tok` rows (asserted above).
    unsafe {
        match w {
            RowData::Q4_0(_) => tiles(cols, x, out, quantized::<Q4_0>(w, cols, r0, n_rows)),
            RowData::Q4_1(_) => tiles(cols, x, out, quantized::<Q4_1>(w, cols, r0, n_rows)),
            RowData::Q8_0(_) => tiles(cols, x, out, quantized::<Q8_0>(w, cols, r0, n_rows)),
            RowData::Q5_0(_) => tiles(cols, x, out, quantized::<Q5_0>(w, cols, r0, n_rows)),
            RowData::Q4K(_) => tiles(cols, x, out, quantized::<Q4K>(w, cols, r0, n_rows)),
            RowData::Q6K(_) => tiles(cols, x, out, quantized::<Q6K>(w, cols, r0, n_rows)),
            RowData::F32(p) => panels(p, cols, x, out),
            RowData::F16(d) => {
                let mut scratch = vec![0f32; 4 * cols];
                tiles(cols, x, out, |i, nr| {
                    for (k, s) in scratch.chunks_exact_mut(cols).take(nr).enumerate() {
                        let src = &d[(r0 + i + k) * cols..(r0 + i + k + 1) * cols];
                        f16_row(src, s);
                    }
                    F32Rows(std::array::from_fn(|k| {
                        scratch[k.min(nr - 1) * cols..].as_ptr()
                    }))
                })
            }
        }
    }
}

/// f16 weights `src` as f32 into `out` (exact).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn f16_row(src: &[half::f16], out: &mut [f32]) {
    let cols = src.len();
    let full = cols / 8 * 8;
    for c in (0..full).step_by(8) {
        // SAFETY: c + 8 <= cols for both slices; f16 is two bytes.
        unsafe {
            let v = _mm_loadu_si128(src.as_ptr().add(c) as *const __m128i);
            _mm256_storeu_ps(out.as_mut_ptr().add(c), _mm256_cvtph_ps(v));
        }
    }
    for c in full..cols {
        out[c] = src[c].to_f32();
    }
}
