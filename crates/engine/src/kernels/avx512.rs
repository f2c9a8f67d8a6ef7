//! The AVX-512 path (AVX-512F and FMA): a fused multiply-add per step, in the portable path's
//! order and with its weights' values, so its bits are the portable path's (see [`super`]).
//!
//! - **f32 panels**: a GEMM micro-kernel over `P` 16-row panels × up to `T` tokens in registers
//!   (8 × 3, 4 × 6 or 2 × 12: at most 24 accumulators), one running sum per output over the
//!   columns in order; the columns are walked in blocks that stay in L1 while every token tile
//!   uses them. With few tokens, more panels at once: more weight streams in flight.
//! - **Quantized and f16 rows**: the portable lane layout (element `i` of a reduction in lane
//!   `i % 16`, the lanes folded by the same pairwise tree) in register tiles of 4 rows × up to 4
//!   tokens: each weight is loaded once per 4 tokens and each activation once per 4 rows.
//!   Quantized blocks (W4A16 and W8A16) are decoded in registers, 32 weights at a time, with the
//!   same values as the portable path's dequantization (`w = d·(q − 8)` etc. in f32), and used
//!   for every token of the tile: a 4-bit block through a 16-entry table of its weights
//!   (`d·(c − 8)` for each code `c`, one multiply per block) indexed by the nibbles. f16 rows are
//!   converted into an L1 scratch four rows at a time.
//!
//! The quantized streams ask the L2 for their bytes [`PREFETCH_BYTES`] ahead, the f32 panels
//! for the next group of panels' (more streams in flight): with the decode this cheap, a single
//! core streams the weights faster than the hardware prefetcher alone fetches them.

use std::arch::x86_64::*;

use super::{KFormat, Panels, RowData, RowsOut, PANEL, QK};

/// Rows and tokens of one register tile.
const TILE_ROWS: usize = 4;
const TILE_TOKENS: usize = 4;

/// Lanes `i` and `i + 8`, then `i + 4`, `i + 2`, `i + 1`: the portable `fold`'s tree.
#[inline]
#[target_feature(enable = "avx512f,fma")]
fn fold16(v: __m512) -> f32 {
    let lo = _mm512_castps512_ps256(v);
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
    let s8 = _mm256_add_ps(lo, hi);
    let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    let s1 = _mm_add_ss(s2, _mm_shuffle_ps::<0b01>(s2, s2));
    _mm_cvtss_f32(s1)
}

/// A tile's accumulators folded to its sums.
#[inline]
#[target_feature(enable = "avx512f,fma")]
fn fold_tile<const T: usize>(acc: [[__m512; T]; TILE_ROWS]) -> [[f32; T]; TILE_ROWS] {
    let mut out = [[0f32; T]; TILE_ROWS];
    for (o, a) in out.iter_mut().zip(&acc) {
        for t in 0..T {
            o[t] = fold16(a[t]);
        }
    }
    out
}

/// Dot products of 4 rows with `T` tokens, all `cols` long (any `cols`: the tail is masked). The
/// rows are unrolled by hand so that the 4·T accumulators stay in registers.
///
/// # Safety
/// Every pointer must be valid for `cols` reads.
#[inline]
#[target_feature(enable = "avx512f,fma")]
unsafe fn tile<const T: usize>(
    w: [*const f32; TILE_ROWS],
    x: [*const f32; T],
    cols: usize,
) -> [[f32; T]; TILE_ROWS] {
    let (mut a0, mut a1, mut a2, mut a3) = (
        [_mm512_setzero_ps(); T],
        [_mm512_setzero_ps(); T],
        [_mm512_setzero_ps(); T],
        [_mm512_setzero_ps(); T],
    );
    let mut xv = [_mm512_setzero_ps(); T];
    macro_rules! row {
        ($acc:ident, $r:literal, $load:expr) => {{
            let wv = $load(w[$r]);
            for t in 0..T {
                $acc[t] = _mm512_fmadd_ps(wv, xv[t], $acc[t]);
            }
        }};
    }
    let full = cols / 16 * 16;
    let mut c = 0;
    while c < full {
        for t in 0..T {
            // SAFETY: c + 16 <= cols.
            xv[t] = unsafe { _mm512_loadu_ps(x[t].add(c)) };
        }
        // SAFETY (each row): as above.
        let load = |p: *const f32| unsafe { _mm512_loadu_ps(p.add(c)) };
        row!(a0, 0, load);
        row!(a1, 1, load);
        row!(a2, 2, load);
        row!(a3, 3, load);
        c += 16;
    }
    if full < cols {
        let m: __mmask16 = ((1u32 << (cols - full)) - 1) as u16;
        for t in 0..T {
            // SAFETY: the mask reads only the `cols - full` elements left.
            xv[t] = unsafe { _mm512_maskz_loadu_ps(m, x[t].add(full)) };
        }
        // SAFETY (each row): as above.
        let load = |p: *const f32| unsafe { _mm512_maskz_loadu_ps(m, p.add(full)) };
        row!(a0, 0, load);
        row!(a1, 1, load);
        row!(a2, 2, load);
        row!(a3, 3, load);
    }
    fold_tile([a0, a1, a2, a3])
}

/// Row `row` of f16 weights (`cols` wide) as f32 into `out` (exact).
#[inline]
#[target_feature(enable = "avx512f,fma")]
fn f16_row(d: &[half::f16], row: usize, cols: usize, out: &mut [f32]) {
    let (src, out) = (&d[row * cols..(row + 1) * cols], &mut out[..cols]);
    let full = cols / 16 * 16;
    for c in (0..full).step_by(16) {
        // SAFETY: c + 16 <= cols for both slices; f16 is two bytes.
        unsafe {
            let v = _mm256_loadu_si256(src.as_ptr().add(c) as *const __m256i);
            _mm512_storeu_ps(out.as_mut_ptr().add(c), _mm512_cvtph_ps(v));
        }
    }
    for c in full..cols {
        out[c] = src[c].to_f32();
    }
}

/// A quantized block format, decoded in registers: its 32 weights as two vectors (elements 0..16
/// and 16..32 of the block: element `i` in lane `i % 16`), with the scratch path's values.
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
    unsafe fn weights(s: __m512, s1: __m512, m: __m512, q: *const u8) -> (__m512, __m512);
}

struct Q4_0;
struct Q4_1;
struct Q8_0;
struct Q5_0;
struct Q4K;
struct Q6K;

/// The 32 nibbles of 16 bytes as two vectors of 32-bit lanes whose low four bits are the
/// nibbles of elements 0..16 and 16..32: the bytes widened once, then shifted for the high
/// nibbles. The bits above the fourth are not cleared: `vpermps` reads only the low four.
#[inline]
#[target_feature(enable = "avx512f,fma")]
unsafe fn nibble_indices(p: *const u8) -> (__m512i, __m512i) {
    // SAFETY: the caller's block has 16 bytes of nibbles at `p`.
    let q = _mm512_cvtepu8_epi32(unsafe { _mm_loadu_si128(p as *const __m128i) });
    (q, _mm512_srli_epi32::<4>(q))
}

/// The weights of a 4-bit block: `table[c]` is the weight of code `c`, looked up by nibble.
#[inline]
#[target_feature(enable = "avx512f,fma")]
unsafe fn nibble_weights(table: __m512, q: *const u8) -> (__m512, __m512) {
    // SAFETY: the caller's contract.
    let (lo, hi) = unsafe { nibble_indices(q) };
    (
        _mm512_permutexvar_ps(lo, table),
        _mm512_permutexvar_ps(hi, table),
    )
}

impl QBlock for Q4_0 {
    const QBYTES: usize = 16;
    const MIN: bool = false;
    #[inline]
    #[target_feature(enable = "avx512f,fma")]
    unsafe fn weights(s: __m512, _s1: __m512, _m: __m512, q: *const u8) -> (__m512, __m512) {
        // d·(q − 8) for q = 0..16, each rounded once as the scratch path's product.
        let codes = _mm512_setr_ps(
            -8.0, -7.0, -6.0, -5.0, -4.0, -3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0,
        );
        // SAFETY: the caller's contract.
        unsafe { nibble_weights(_mm512_mul_ps(s, codes), q) }
    }
}

impl QBlock for Q4_1 {
    const QBYTES: usize = 16;
    const MIN: bool = true;
    #[inline]
    #[target_feature(enable = "avx512f,fma")]
    unsafe fn weights(s: __m512, _s1: __m512, m: __m512, q: *const u8) -> (__m512, __m512) {
        // d·q + m for q = 0..16, rounded twice as the scratch path does.
        // SAFETY: the caller's contract.
        unsafe { scaled_nibbles_plus_min(s, m, q) }
    }
}

/// `s·q + m` for the 4-bit codes `q` of a block in Q4_0's nibble layout (a product, then a
/// sum: not fused), through a 16-entry table.
#[inline]
#[target_feature(enable = "avx512f,fma")]
unsafe fn scaled_nibbles_plus_min(s: __m512, m: __m512, q: *const u8) -> (__m512, __m512) {
    let codes = _mm512_setr_ps(
        0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
    );
    // SAFETY: the caller's contract.
    unsafe { nibble_weights(_mm512_add_ps(_mm512_mul_ps(s, codes), m), q) }
}

/// Codes of `4 + h` bits: the nibbles of the 16 bytes at `q` (Q4_0's layout, elements 0..16 and
/// 16..32), with `h` high bits above them taken from `hi0` / `hi1` (each lane's bits already
/// shifted down to bit 0), as exact f32 values less `centre`.
#[inline]
#[target_feature(enable = "avx512f,fma")]
unsafe fn wide_codes(
    q: *const u8,
    hi0: __m512i,
    hi1: __m512i,
    h_mask: i32,
    centre: f32,
) -> (__m512, __m512) {
    // SAFETY: the caller's contract: 16 bytes of nibbles at `q`.
    let (lo, hi) = unsafe { nibble_indices(q) };
    let (nib, hm) = (_mm512_set1_epi32(0x0f), _mm512_set1_epi32(h_mask));
    let code = |n: __m512i, h: __m512i| {
        let c = _mm512_or_si512(
            _mm512_and_si512(n, nib),
            _mm512_slli_epi32::<4>(_mm512_and_si512(h, hm)),
        );
        _mm512_sub_ps(_mm512_cvtepi32_ps(c), _mm512_set1_ps(centre))
    };
    (code(lo, hi0), code(hi, hi1))
}

impl QBlock for Q5_0 {
    const QBYTES: usize = 20;
    const MIN: bool = false;
    #[inline]
    #[target_feature(enable = "avx512f,fma")]
    unsafe fn weights(s: __m512, _s1: __m512, _m: __m512, q: *const u8) -> (__m512, __m512) {
        // d·(q − 16), rounded once; element i's fifth bit is bit i of the first word.
        // SAFETY: the caller's contract: 4 bytes of high bits, then 16 of nibbles.
        let qh = _mm512_set1_epi32(unsafe { (q as *const i32).read_unaligned() });
        let shift0 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        let shift1 = _mm512_add_epi32(shift0, _mm512_set1_epi32(16));
        let (h0, h1) = (_mm512_srlv_epi32(qh, shift0), _mm512_srlv_epi32(qh, shift1));
        // SAFETY: as above.
        let (c0, c1) = unsafe { wide_codes(q.add(4), h0, h1, 1, 16.0) };
        (_mm512_mul_ps(s, c0), _mm512_mul_ps(s, c1))
    }
}

impl QBlock for Q4K {
    const QBYTES: usize = 16;
    const MIN: bool = true;
    const K: Option<KFormat> = Some(KFormat::Q4K);
    #[inline]
    #[target_feature(enable = "avx512f,fma")]
    unsafe fn weights(s: __m512, _s1: __m512, m: __m512, q: *const u8) -> (__m512, __m512) {
        // (d·sc)·q + (−dmin·mn): the product exact, the sum rounded once.
        // SAFETY: the caller's contract.
        unsafe { scaled_nibbles_plus_min(s, m, q) }
    }
}

impl QBlock for Q6K {
    const QBYTES: usize = 24;
    const MIN: bool = false;
    const K: Option<KFormat> = Some(KFormat::Q6K);
    #[inline]
    #[target_feature(enable = "avx512f,fma")]
    unsafe fn weights(s: __m512, s1: __m512, _m: __m512, q: *const u8) -> (__m512, __m512) {
        // (d·sc)·(q − 32), rounded once; element i's high pair at bit 2·(i / 8) of byte
        // 16 + i % 8: the eight bytes widened twice over, shifted per lane.
        // SAFETY: the caller's contract: 16 bytes of nibbles, then 8 of high pairs.
        let h = unsafe { _mm_loadl_epi64(q.add(16) as *const __m128i) };
        let h = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(h, h));
        let shift0 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
        let shift1 = _mm512_add_epi32(shift0, _mm512_set1_epi32(4));
        let (h0, h1) = (_mm512_srlv_epi32(h, shift0), _mm512_srlv_epi32(h, shift1));
        // SAFETY: as above.
        let (c0, c1) = unsafe { wide_codes(q, h0, h1, 3, 32.0) };
        (_mm512_mul_ps(s, c0), _mm512_mul_ps(s1, c1))
    }
}

impl QBlock for Q8_0 {
    const QBYTES: usize = 32;
    const MIN: bool = false;
    #[inline]
    #[target_feature(enable = "avx512f,fma")]
    unsafe fn weights(s: __m512, _s1: __m512, _m: __m512, q: *const u8) -> (__m512, __m512) {
        // SAFETY: 32 signed bytes at `q`.
        let (q0, q1) = unsafe {
            (
                _mm_loadu_si128(q as *const __m128i),
                _mm_loadu_si128(q.add(16) as *const __m128i),
            )
        };
        (
            _mm512_mul_ps(s, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0))),
            _mm512_mul_ps(s, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1))),
        )
    }
}

/// Bytes ahead of the quants being read that each row asks the L2 to fetch: the rows of a
/// matrix lie one after another, so this is the same stream a few dozen rows on. Measured on
/// the draft's decode (8–32 KiB all beat the hardware prefetcher alone by about a third).
const PREFETCH_BYTES: usize = 16 << 10;

/// Blocks whose scales are converted together.
const SCALE_RUN: usize = 16;

/// `n ≤ 16` f16 values at `p` as f32 into `out`: one conversion for a whole run (exact either
/// way).
#[inline]
#[target_feature(enable = "avx512f,fma")]
unsafe fn scales(p: *const half::f16, n: usize, out: &mut [f32; SCALE_RUN]) {
    if n == SCALE_RUN {
        // SAFETY: 16 f16 values (32 bytes) at `p`.
        let v = unsafe { _mm256_loadu_si256(p as *const __m256i) };
        // SAFETY: `out` holds 16 floats.
        unsafe { _mm512_storeu_ps(out.as_mut_ptr(), _mm512_cvtph_ps(v)) };
    } else {
        for (j, o) in out.iter_mut().take(n).enumerate() {
            // SAFETY: `n` values at `p`.
            *o = unsafe { p.add(j).read() }.to_f32();
        }
    }
}

/// The halves' scales and the minimums of the 16 k-quant blocks `b0..b0 + 16` of a row (two
/// super-blocks: `b0` a multiple of 16), in vectors: [`super::k_params`]'s values (each product
/// exact; the minimum's sign flipped, not subtracted from 0).
///
/// # Safety
/// The pointers must cover the row's blocks `b0..b0 + 16` (`km` read for Q4_K only).
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx512f,fma")]
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
    // SAFETY: 32 scale bytes of the row's blocks b0..b0 + 16.
    let pairs =
        _mm512_cvtepu16_epi32(unsafe { _mm256_loadu_si256(sc.add(2 * b0) as *const __m256i) });
    // SAFETY: super-blocks sb and sb + 1 of the row.
    let per_block = |v: *const f32| unsafe {
        _mm512_mask_blend_ps(
            0xff00,
            _mm512_set1_ps(v.add(sb).read()),
            _mm512_set1_ps(v.add(sb + 1).read()),
        )
    };
    let d = per_block(kd);
    match format {
        KFormat::Q4K => {
            let lo = _mm512_and_si512(pairs, _mm512_set1_epi32(0xff));
            let hi = _mm512_srli_epi32::<8>(pairs);
            let mins = _mm512_mul_ps(per_block(km), _mm512_cvtepi32_ps(hi));
            let neg = _mm512_xor_si512(_mm512_castps_si512(mins), _mm512_set1_epi32(i32::MIN));
            // SAFETY: each array holds 16 floats.
            unsafe {
                _mm512_storeu_ps(s0.as_mut_ptr(), _mm512_mul_ps(d, _mm512_cvtepi32_ps(lo)));
                _mm512_storeu_ps(m.as_mut_ptr(), _mm512_castsi512_ps(neg));
            }
        }
        KFormat::Q6K => {
            // The bytes are signed: each moved to the top of its lane and shifted back down.
            let lo = _mm512_srai_epi32::<24>(_mm512_slli_epi32::<24>(pairs));
            let hi = _mm512_srai_epi32::<24>(_mm512_slli_epi32::<16>(pairs));
            // SAFETY: each array holds 16 floats.
            unsafe {
                _mm512_storeu_ps(s0.as_mut_ptr(), _mm512_mul_ps(d, _mm512_cvtepi32_ps(lo)));
                _mm512_storeu_ps(s1.as_mut_ptr(), _mm512_mul_ps(d, _mm512_cvtepi32_ps(hi)));
            }
        }
    }
}

/// Dot products of 4 quantized rows (`cols / 32` blocks each) with `T` tokens: each block is
/// decoded in registers once per tile and multiplied with every token, in the order and with the
/// values of [`tile`] over dequantized rows (so the bits are the same). Scales are converted 16
/// blocks at a time. The rows are unrolled by hand so that the 4·T accumulators stay in
/// registers.
///
/// # Safety
/// Row pointers valid for `cols / 32` blocks (scales, minimums when `B::MIN`, quants), token
/// pointers for `cols` floats; `cols % 32 == 0`.
#[inline]
#[target_feature(enable = "avx512f,fma")]
unsafe fn qtile<B: QBlock, const T: usize>(
    rows: &QRows<B>,
    x: [*const f32; T],
    cols: usize,
) -> [[f32; T]; TILE_ROWS] {
    let (mut a0, mut a1, mut a2, mut a3) = (
        [_mm512_setzero_ps(); T],
        [_mm512_setzero_ps(); T],
        [_mm512_setzero_ps(); T],
        [_mm512_setzero_ps(); T],
    );
    let (mut x0, mut x1) = ([_mm512_setzero_ps(); T], [_mm512_setzero_ps(); T]);
    let mut d = [[0f32; SCALE_RUN]; TILE_ROWS];
    let mut d1 = [[0f32; SCALE_RUN]; TILE_ROWS];
    let mut m = [[0f32; SCALE_RUN]; TILE_ROWS];
    let nb = cols / QK;
    let mut b0 = 0;
    while b0 < nb {
        let n = (nb - b0).min(SCALE_RUN);
        for r in 0..TILE_ROWS {
            // SAFETY: blocks b0..b0 + n of each row are within it.
            unsafe {
                match B::K {
                    None => {
                        scales(rows.p.d[r].add(b0), n, &mut d[r]);
                        if B::MIN {
                            scales(rows.p.m[r].add(b0), n, &mut m[r]);
                        }
                    }
                    Some(format) if n == SCALE_RUN => {
                        let p = &rows.p;
                        let (s0, s1, mn) = (&mut d[r], &mut d1[r], &mut m[r]);
                        k_scales(format, p.kd[r], p.km[r], p.sc[r], b0, s0, s1, mn);
                    }
                    Some(format) => {
                        let (s0, s1, mn) = (&mut d[r], &mut d1[r], &mut m[r]);
                        super::k_params_run(format, &rows.p, r, b0, n, s0, s1, mn);
                    }
                }
            }
        }
        for j in 0..n {
            let b = b0 + j;
            for t in 0..T {
                // SAFETY: block b's 32 activations are within `cols`.
                unsafe {
                    x0[t] = _mm512_loadu_ps(x[t].add(b * QK));
                    x1[t] = _mm512_loadu_ps(x[t].add(b * QK + 16));
                }
            }
            macro_rules! row {
                ($acc:ident, $r:literal) => {{
                    let q = rows.p.q[$r].wrapping_add(b * B::QBYTES);
                    // A k-quant row asks once per cache line (Qwen 1.5B's decode, Zen 4: 121 ms
                    // a token asking every block, 113 once a line).
                    if B::K.is_none() || (b * B::QBYTES) % 64 < B::QBYTES {
                        _mm_prefetch::<_MM_HINT_T1>(q.wrapping_add(PREFETCH_BYTES) as *const i8);
                    }
                    let (s, mn) = (_mm512_set1_ps(d[$r][j]), _mm512_set1_ps(m[$r][j]));
                    let s1 = if B::K == Some(KFormat::Q6K) {
                        _mm512_set1_ps(d1[$r][j])
                    } else {
                        s
                    };
                    // SAFETY: block b of row $r is within the row.
                    let (w0, w1) = unsafe { B::weights(s, s1, mn, q) };
                    for t in 0..T {
                        $acc[t] = _mm512_fmadd_ps(w0, x0[t], $acc[t]);
                        $acc[t] = _mm512_fmadd_ps(w1, x1[t], $acc[t]);
                    }
                }};
            }
            row!(a0, 0);
            row!(a1, 1);
            row!(a2, 2);
            row!(a3, 3);
        }
        b0 += n;
    }
    fold_tile([a0, a1, a2, a3])
}

/// Four rows of one storage kind, ready to multiply with up to 4 tokens.
trait Rows {
    /// # Safety
    /// The rows' pointers cover whole rows of `cols` weights; the tokens' `cols` floats each.
    unsafe fn tile<const T: usize>(&self, x: [*const f32; T], cols: usize)
        -> [[f32; T]; TILE_ROWS];
}

/// Rows of f32 weights converted into a scratch (f16 storage).
struct F32Rows([*const f32; TILE_ROWS]);

/// Rows of quantized blocks, decoded in registers: each row's first scale, minimum (when the
/// format has them) and quants; for a k-quant format, its first super-block's scale and scale
/// of minimums, and its first block's scale bytes.
struct QRows<B> {
    p: super::RowPtrs<TILE_ROWS>,
    format: std::marker::PhantomData<B>,
}

impl Rows for F32Rows {
    #[inline]
    #[target_feature(enable = "avx512f,fma")]
    unsafe fn tile<const T: usize>(
        &self,
        x: [*const f32; T],
        cols: usize,
    ) -> [[f32; T]; TILE_ROWS] {
        // SAFETY: the caller's contract.
        unsafe { tile::<T>(self.0, x, cols) }
    }
}

impl<B: QBlock> Rows for QRows<B> {
    #[inline]
    #[target_feature(enable = "avx512f,fma")]
    unsafe fn tile<const T: usize>(
        &self,
        x: [*const f32; T],
        cols: usize,
    ) -> [[f32; T]; TILE_ROWS] {
        // SAFETY: the caller's contract.
        unsafe { qtile::<B, T>(self, x, cols) }
    }
}

/// The task's rows of the output (groups of 4: `rows_of(i, nr)` gives group `i`'s `nr` rows, a
/// short group repeating its last row, whose results are dropped) and every token of `x`, in
/// tiles of up to 4 tokens.
///
/// # Safety
/// `rows_of` must give pointers that cover whole rows; `x` holds `n_tok` rows of `cols`.
#[inline]
#[target_feature(enable = "avx512f,fma")]
unsafe fn tiles<R: Rows>(
    cols: usize,
    x: &[f32],
    out: &mut RowsOut,
    mut rows_of: impl FnMut(usize, usize) -> R,
) {
    let (n_rows, n_tok) = (out.n_rows(), out.n_tok());
    let mut i = 0;
    while i < n_rows {
        let nr = (n_rows - i).min(TILE_ROWS);
        let rows = rows_of(i, nr);
        let mut t = 0;
        while t < n_tok {
            let nt = (n_tok - t).min(TILE_TOKENS);
            let xp: [*const f32; TILE_TOKENS] =
                std::array::from_fn(|k| x[(t + k.min(nt - 1)) * cols..].as_ptr());
            let mut put = |r: usize, k: usize, v: f32| {
                if r < nr {
                    out.put(i + r, t + k, v);
                }
            };
            macro_rules! run {
                ($t:literal) => {{
                    let mut xs = [std::ptr::null::<f32>(); $t];
                    xs.copy_from_slice(&xp[..$t]);
                    // SAFETY: the caller's row pointers, token pointers `cols` floats each.
                    let o = unsafe { rows.tile::<$t>(xs, cols) };
                    for (r, row) in o.iter().enumerate() {
                        for (k, &v) in row.iter().enumerate() {
                            put(r, k, v);
                        }
                    }
                }};
            }
            match nt {
                1 => run!(1),
                2 => run!(2),
                3 => run!(3),
                _ => run!(4),
            }
            t += TILE_TOKENS;
        }
        i += nr;
    }
}

/// Tokens of one tile of two panels: 2 × 12 accumulators, two weight columns and a broadcast
/// activation fill the 32 vector registers.
const PANEL_TOKENS: usize = 12;
/// Columns of two panels kept in L1 (32 KiB) while every token tile walks them (of `P` panels:
/// `2 / P` as many, the same bytes).
const PANEL_COLS: usize = 256;

/// `P` panels (16·P rows) times `T` tokens over columns `k0..k1`, continuing the running sums in
/// `acc`: for each output one fused multiply-add per column, in column order, whatever `P`, `T`
/// or the column blocking (so the bits never depend on the batch).
///
/// With `PF`, each column read also asks L2 for the bytes `ahead` of it: the first tile over a
/// block streams it from memory, the later ones find it in L1 and skip the extra instructions.
///
/// # Safety
/// Each panel pointer must cover `k1` columns, each token pointer `k1` floats.
#[inline]
#[target_feature(enable = "avx512f,fma")]
unsafe fn panel_tile<const P: usize, const T: usize, const PF: bool>(
    w: [*const f32; P],
    x: [*const f32; T],
    k0: usize,
    k1: usize,
    acc: &mut [[__m512; P]],
    ahead: usize,
) {
    let mut a: [[__m512; P]; T] = std::array::from_fn(|t| acc[t]);
    for k in k0..k1 {
        let p: [*const f32; P] = std::array::from_fn(|q| w[q].wrapping_add(k * PANEL));
        if PF {
            for q in p {
                _mm_prefetch::<_MM_HINT_T1>(q.wrapping_byte_add(ahead) as *const i8);
            }
        }
        // SAFETY: column k of every panel is within it (aligned: one cache line each).
        let wv: [__m512; P] = std::array::from_fn(|q| unsafe { _mm512_load_ps(p[q]) });
        for t in 0..T {
            // SAFETY: k < k1.
            let xb = _mm512_set1_ps(unsafe { x[t].add(k).read() });
            for q in 0..P {
                a[t][q] = _mm512_fmadd_ps(wv[q], xb, a[t][q]);
            }
        }
    }
    acc[..T].copy_from_slice(&a);
}

/// [`rows_task`] over f32 panels: `P` panels at a time (a short last group repeats its last
/// panel, the copies dropped) times up to `T` tokens; the tokens split into near-equal tiles,
/// the columns walked in blocks that stay in L1 while the tiles use them, the running sums kept
/// between blocks. The first tile asks L2 for the same column of the next group of panels
/// (within [`super::NEXT_GROUP_MAX_BYTES`]), which keeps `P` more streams in flight than asking
/// for its own panels' bytes ahead did
/// (`examples/panel_streams.rs`, Zen 4, the layers' matrices, best of 20 passes, the two
/// builds alternated three times: 1 and 3 tokens the same, 2 tokens 20.9–21.3 ms → 20.0–20.7,
/// 5 tokens 22.6–23.1 → 20.9–21.5, 7 tokens 27.6–27.9 → 22.4–23.0, 8 tokens 29.0–29.4 →
/// 24.5–25.0, 16 tokens 44.7–47.7 → 40.2–40.4; the head over 7 tokens 6.3–6.4 → 4.9–6.0;
/// measured before the cap, which changed nothing measurable there).
#[inline]
#[target_feature(enable = "avx512f,fma")]
fn panel_tiles<const P: usize, const T: usize>(
    p: &Panels,
    cols: usize,
    x: &[f32],
    out: &mut RowsOut,
) {
    let (n_rows, n_tok, r0) = (out.n_rows(), out.n_tok(), out.r0());
    let n_panels = n_rows.div_ceil(PANEL);
    assert!(
        r0.is_multiple_of(PANEL) && x.len() >= n_tok * cols,
        "invariant: tasks start at a panel; x holds n_tok rows"
    );
    let panel_at = |i: usize| p.panel(r0 + i * PANEL, cols).as_ptr() as *const f32;
    let mut acc = vec![[_mm512_setzero_ps(); P]; n_tok];
    let (tiles, block) = (n_tok.div_ceil(T), PANEL_COLS * 2 / P);
    // The same column of the next group of panels, read once this group is done (a group too
    // large for L2 to keep until then: its own bytes ahead).
    let next = super::next_group_bytes(P, cols).unwrap_or(PREFETCH_BYTES);
    let mut i = 0;
    while i < n_panels {
        let np = (n_panels - i).min(P);
        let w: [*const f32; P] = std::array::from_fn(|q| panel_at(i + q.min(np - 1)));
        acc.fill([_mm512_setzero_ps(); P]);
        for k0 in (0..cols).step_by(block) {
            let k1 = (k0 + block).min(cols);
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
                            if tile == 0 {
                                panel_tile::<P, $t, true>(w, xs, k0, k1, a, next)
                            } else {
                                panel_tile::<P, $t, false>(w, xs, k0, k1, a, next)
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
                    6 => run!(6),
                    7 => run!(7),
                    8 => run!(8),
                    9 => run!(9),
                    10 => run!(10),
                    11 => run!(11),
                    _ => run!(12),
                }
                t += nt;
            }
        }
        for (t, a) in acc.iter().enumerate() {
            for (q, v) in a.iter().enumerate().take(np) {
                let r = (i + q) * PANEL;
                let n = PANEL.min(n_rows - r);
                let at = out.span(r, t, n);
                // SAFETY: `span` gave room for `n` floats; the mask writes only those.
                unsafe { _mm512_mask_storeu_ps(at, ((1u32 << n) - 1) as u16, *v) };
            }
        }
        i += np;
    }
}

/// [`rows_task`] over f32 panels, in register tiles of `P` panels × up to `T` tokens
/// ([`panel_tiles`]): 8 × 3 for up to three tokens, 4 × 6 for up to six, 2 × 12 for more. A
/// single core's stream from memory is limited by the misses it keeps in flight: with two panels
/// at a time a decode read the target's layers at ~20 GB/s and a chunk of two at ~18 (of ~26 the
/// core reads a plain buffer at, Zen 4); with eight, ~25 and ~22.
#[target_feature(enable = "avx512f,fma")]
fn panels(p: &Panels, cols: usize, x: &[f32], out: &mut RowsOut) {
    match out.n_tok() {
        ..=3 => panel_tiles::<8, 3>(p, cols, x, out),
        4..=6 => panel_tiles::<4, 6>(p, cols, x, out),
        _ => panel_tiles::<2, PANEL_TOKENS>(p, cols, x, out),
    }
}

/// One task of [`super::matmul`]: its rows of the output.
///
/// # Safety
/// The CPU must support AVX-512F and FMA.
#[target_feature(enable = "avx512f,fma")]
pub(super) unsafe fn rows_task(w: &RowData, cols: usize, x: &[f32], out: &mut RowsOut) {
    let (n_rows, n_tok, r0) = (out.n_rows(), out.n_tok(), out.r0());
    assert!(x.len() >= n_tok * cols, "invariant: x holds n_tok rows");
    fn quantized<'a, B: QBlock>(
        w: &'a RowData,
        cols: usize,
        r0: usize,
        n_rows: usize,
    ) -> impl FnMut(usize, usize) -> QRows<B> + 'a {
        let ptrs = super::row_ptrs::<TILE_ROWS>(w, B::QBYTES, B::MIN, cols, r0, n_rows);
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
                let mut scratch = vec![0f32; TILE_ROWS * cols];
                tiles(cols, x, out, |i, nr| {
                    for (k, s) in scratch.chunks_exact_mut(cols).take(nr).enumerate() {
                        f16_row(d, r0 + i + k, cols, s);
                    }
                    F32Rows(std::array::from_fn(|k| {
                        scratch[k.min(nr - 1) * cols..].as_ptr()
                    }))
                })
            }
        }
    }
}
