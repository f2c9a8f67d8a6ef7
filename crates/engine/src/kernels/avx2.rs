//! The AVX2 path (AVX2, FMA and F16C): hand-written kernels that compute the bits of the
//! portable path (see the module docs of [`super`]: the same values of the weights, the same
//! fused multiply-adds in the same order, the same fold).
//!
//! - **f32 panels**: 2 panels (32 rows) × up to 2 tokens in registers (each panel column is two
//!   8-lane vectors: 8 accumulators, 4 weight vectors and a broadcast activation fit the 16
//!   registers); one running sum per output over the columns in order, the columns walked in
//!   blocks that stay in L1 while every token tile uses them.
//! - **Quantized and f16 rows**: the 16 lanes of the portable layout as two 8-lane vectors
//!   (element `i` of a reduction in lane `i % 16`), in register tiles of 4 rows × 1 token or 2
//!   rows × up to 2 tokens. A block's 32 weights are decoded in registers (nibbles widened to
//!   32-bit integers, converted, times the block's scale: `w = d·(q − 8)` rounded once, as the
//!   portable dequantization) once per tile and used for every token of it; f16 rows are
//!   converted into an L1 scratch a tile of rows at a time.
//!
//! Every stream of weights asks the L2 for its bytes [`PREFETCH_BYTES`] ahead.

use std::arch::x86_64::*;

use super::{Blocks, Panels, RowData, RowsOut, PANEL, QK};

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

/// A quantized block format, decoded in registers: its 32 weights as four vectors (elements
/// 0..8, 8..16, 16..24, 24..32), each the portable dequantization's value.
trait QBlock {
    /// Bytes of quants per block.
    const QBYTES: usize;
    /// Whether blocks carry a minimum.
    const MIN: bool;
    /// The weights of the block whose scale is `s`, minimum `m` (both in every lane) and quants
    /// at `q`.
    ///
    /// # Safety
    /// `q` must point at `QBYTES` readable bytes.
    unsafe fn weights(s: __m256, m: __m256, q: *const u8) -> [__m256; 4];
}

struct Q4_0;
struct Q4_1;
struct Q8_0;

/// The 32 nibbles of 16 bytes as four vectors of 32-bit codes: elements 0..16 are the low
/// nibbles of bytes 0..16, elements 16..32 their high nibbles.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibble_codes(p: *const u8) -> [__m256; 4] {
    // SAFETY: the caller's block has 16 bytes of nibbles at `p`.
    let v = unsafe { _mm_loadu_si128(p as *const __m128i) };
    let mask = _mm_set1_epi8(0x0f);
    let lo = _mm_and_si128(v, mask);
    let hi = _mm_and_si128(_mm_srli_epi16::<4>(v), mask);
    let widen = |b: __m128i| _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
    [
        widen(lo),
        widen(_mm_srli_si128::<8>(lo)),
        widen(hi),
        widen(_mm_srli_si128::<8>(hi)),
    ]
}

impl QBlock for Q4_0 {
    const QBYTES: usize = 16;
    const MIN: bool = false;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn weights(s: __m256, _m: __m256, q: *const u8) -> [__m256; 4] {
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
    unsafe fn weights(s: __m256, m: __m256, q: *const u8) -> [__m256; 4] {
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
    unsafe fn weights(s: __m256, _m: __m256, q: *const u8) -> [__m256; 4] {
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
/// format has them) and quants.
struct QRows<B> {
    d: [*const half::f16; 4],
    m: [*const half::f16; 4],
    q: [*const u8; 4],
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
        let mut m = [[0f32; SCALE_RUN]; R];
        let nb = cols / QK;
        let mut b0 = 0;
        while b0 < nb {
            let n = (nb - b0).min(SCALE_RUN);
            for r in 0..R {
                // SAFETY: blocks b0..b0 + n of each row are within it.
                unsafe {
                    scales(self.d[r].add(b0), n, &mut d[r]);
                    if B::MIN {
                        scales(self.m[r].add(b0), n, &mut m[r]);
                    }
                }
            }
            for j in 0..n {
                let b = b0 + j;
                for r in 0..R {
                    let q = self.q[r].wrapping_add(b * B::QBYTES);
                    _mm_prefetch::<_MM_HINT_T1>(q.wrapping_add(PREFETCH_BYTES) as *const i8);
                    let (s, mn) = (_mm256_set1_ps(d[r][j]), _mm256_set1_ps(m[r][j]));
                    // SAFETY: block b of row r is within the row.
                    let w = unsafe { B::weights(s, mn, q) };
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

/// Columns of the panels kept in L1 while every token tile walks them (two panels: 16 KiB).
const PANEL_COLS: usize = 128;

/// `P` panels times `T` tokens over columns `k0..k1`, continuing the running sums in `acc`: for
/// each output one fused multiply-add per column, in column order, whatever `P`, `T` or the
/// column blocking. With `PF`, the columns are also asked of L2 [`PREFETCH_BYTES`] ahead.
///
/// # Safety
/// Each panel pointer must cover `k1` columns, each token pointer `k1` floats.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn panel_tile<const P: usize, const T: usize, const PF: bool>(
    w: [*const f32; P],
    x: [*const f32; T],
    k0: usize,
    k1: usize,
    acc: &mut [[Lanes; 2]],
) {
    let mut a: [[Lanes; P]; T] = std::array::from_fn(|t| std::array::from_fn(|p| acc[t][p]));
    for k in k0..k1 {
        let mut wv = [[_mm256_setzero_ps(); 2]; P];
        for (v, &wp) in wv.iter_mut().zip(&w) {
            let p = wp.wrapping_add(k * PANEL);
            if PF {
                _mm_prefetch::<_MM_HINT_T1>(p.wrapping_byte_add(PREFETCH_BYTES) as *const i8);
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
    for (t, at) in a.iter().enumerate() {
        acc[t][..P].copy_from_slice(at);
    }
}

/// [`super::rows_task`] over f32 panels: two panels at a time (a lone last panel is paired with
/// itself, its copy dropped); columns in blocks
/// that stay in L1 while tiles of tokens walk them, the running sums kept between blocks.
#[target_feature(enable = "avx2,fma,f16c")]
fn panels(p: &Panels, cols: usize, x: &[f32], out: &mut RowsOut) {
    let (n_rows, n_tok, r0) = (out.n_rows(), out.n_tok(), out.r0());
    let n_panels = n_rows.div_ceil(PANEL);
    assert!(
        r0.is_multiple_of(PANEL) && x.len() >= n_tok * cols,
        "invariant: tasks start at a panel; x holds n_tok rows"
    );
    let panel_at = |i: usize| p.panel(r0 + i * PANEL, cols).as_ptr() as *const f32;
    let group = 2;
    let zero = [_mm256_setzero_ps(); 2];
    let mut acc = vec![[zero; 2]; n_tok];
    let mut i = 0;
    while i < n_panels {
        let np = (n_panels - i).min(group);
        let w: [*const f32; 2] = std::array::from_fn(|q| panel_at(i + q.min(np - 1)));
        acc.fill([zero; 2]);
        for k0 in (0..cols).step_by(PANEL_COLS) {
            let k1 = (k0 + PANEL_COLS).min(cols);
            let mut t = 0;
            while t < n_tok {
                let nt = (n_tok - t).min(2);
                macro_rules! run {
                    ($p:literal, $t:literal) => {{
                        let xs: [*const f32; $t] =
                            std::array::from_fn(|k| x[(t + k) * cols..].as_ptr());
                        let ws: [*const f32; $p] = std::array::from_fn(|q| w[q]);
                        let a = &mut acc[t..t + $t];
                        // SAFETY: the panels hold `cols` columns (`panel` checks the bounds),
                        // the tokens `cols` floats each.
                        unsafe {
                            if t == 0 {
                                panel_tile::<$p, $t, true>(ws, xs, k0, k1, a)
                            } else {
                                panel_tile::<$p, $t, false>(ws, xs, k0, k1, a)
                            }
                        }
                    }};
                }
                match nt {
                    1 => run!(2, 1),
                    _ => run!(2, 2),
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
        i += np;
    }
}

/// One task of [`super::matmul`]: its rows of the output.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn rows_task(w: &RowData, cols: usize, x: &[f32], out: &mut RowsOut) {
    let (n_rows, n_tok, r0) = (out.n_rows(), out.n_tok(), out.r0());
    assert!(x.len() >= n_tok * cols, "invariant: x holds n_tok rows");
    fn quantized<B: QBlock>(
        b: &Blocks,
        cols: usize,
        r0: usize,
        n_rows: usize,
    ) -> impl FnMut(usize, usize) -> QRows<B> + '_ {
        let nb = cols / QK;
        assert!(
            (r0 + n_rows) * nb <= b.d.len()
                && b.qs.len() == b.d.len() * B::QBYTES
                && (!B::MIN || b.m.len() == b.d.len())
                && cols.is_multiple_of(QK),
            "invariant: whole rows of whole blocks"
        );
        move |i, nr| {
            let row = |k: usize| (r0 + i + k.min(nr - 1)) * nb;
            QRows {
                d: std::array::from_fn(|k| b.d[row(k)..].as_ptr()),
                m: std::array::from_fn(|k| b.m.get(row(k)..).unwrap_or(&[]).as_ptr()),
                q: std::array::from_fn(|k| b.qs[row(k) * B::QBYTES..].as_ptr()),
                format: std::marker::PhantomData,
            }
        }
    }
    // SAFETY (each arm): the row pointers cover whole stored (or scratch) rows, and `x` holds
    // `n_tok` rows (asserted above).
    unsafe {
        match w {
            RowData::Q4_0(b) => tiles(cols, x, out, quantized::<Q4_0>(b, cols, r0, n_rows)),
            RowData::Q4_1(b) => tiles(cols, x, out, quantized::<Q4_1>(b, cols, r0, n_rows)),
            RowData::Q8_0(b) => tiles(cols, x, out, quantized::<Q8_0>(b, cols, r0, n_rows)),
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

/// A block format's integer codes for the 8-bit-activation kernels ([`super::a8`]).
trait A8Block {
    const QBYTES: usize;
    const MIN: bool;
    /// The block's 32 codes as bytes in element order (the 4-bit formats' unsigned nibbles).
    ///
    /// # Safety
    /// `q` must point at `QBYTES` readable bytes; the CPU must support AVX2.
    unsafe fn codes(q: *const u8) -> __m256i;
    /// The eight partial sums `Σ w·x` over elements `4l .. 4l + 4` of the block whose codes
    /// are `w`, with activation codes `x` whose lane sums times 8 are `s8`.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    unsafe fn dot(w: __m256i, x: __m256i, s8: __m256i) -> __m256i;
}

/// Sixteen bytes of nibbles as 32 codes: the low nibbles (elements 0..16), then the high.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibbles(q: *const u8) -> __m256i {
    // SAFETY: the caller's block has 16 bytes of nibbles at `q`.
    let v = unsafe { _mm_loadu_si128(q as *const __m128i) };
    let v = _mm256_set_m128i(_mm_srli_epi16::<4>(v), v);
    _mm256_and_si256(v, _mm256_set1_epi8(0x0f))
}

/// `Σ u·x` over each lane's four elements: `u` unsigned codes below 16 (so no pair of products
/// saturates), `x` signed.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_unsigned(u: __m256i, x: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1))
}

impl A8Block for Q4_0 {
    const QBYTES: usize = 16;
    const MIN: bool = false;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn codes(q: *const u8) -> __m256i {
        // SAFETY: the caller's contract.
        unsafe { nibbles(q) }
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot(w: __m256i, x: __m256i, s8: __m256i) -> __m256i {
        // Σ (q − 8)·x = Σ q·x − 8·Σ x, exactly.
        _mm256_sub_epi32(dot_unsigned(w, x), s8)
    }
}

impl A8Block for Q4_1 {
    const QBYTES: usize = 16;
    const MIN: bool = true;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn codes(q: *const u8) -> __m256i {
        // SAFETY: the caller's contract.
        unsafe { nibbles(q) }
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot(w: __m256i, x: __m256i, _s8: __m256i) -> __m256i {
        dot_unsigned(w, x)
    }
}

impl A8Block for Q8_0 {
    const QBYTES: usize = 32;
    const MIN: bool = false;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn codes(q: *const u8) -> __m256i {
        // SAFETY: the caller's contract.
        unsafe { _mm256_loadu_si256(q as *const __m256i) }
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot(w: __m256i, x: __m256i, _s8: __m256i) -> __m256i {
        // |w| (unsigned, at most 128) times x with w's sign: pairs stay below 2^15.
        let p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
        _mm256_madd_epi16(p, _mm256_set1_epi16(1))
    }
}

/// `R` rows times `T` tokens of an 8-bit-activation matmul, in [`super::a8`]'s order. Each
/// run of 8 blocks converts the rows' scales and multiplies them with the tokens' in vectors
/// (each product rounded once, as the portable path's).
///
/// # Safety
/// The rows must be within `b`, the tokens within `x`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn a8_tile<B: A8Block, const R: usize, const T: usize>(
    b: &Blocks,
    x: &super::a8::Q8Acts,
    rows: [usize; R],
    toks: [usize; T],
) -> [[f32; T]; R] {
    let nb = x.cols / QK;
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    let mut mins = [[0f32; T]; R];
    // The scale products of the run: [row][token][block].
    let mut sc = [[[0f32; SCALE_RUN]; T]; R];
    let mut dw = [0f32; SCALE_RUN];
    let (xd, xqs, xs8) = (x.d.as_ptr(), x.qs.as_ptr(), x.s8.as_ptr());
    let mut b0 = 0;
    while b0 < nb {
        let n = (nb - b0).min(SCALE_RUN);
        for r in 0..R {
            // SAFETY: blocks b0..b0 + n of the row are within it.
            unsafe { scales(b.d.as_ptr().add(rows[r] * nb + b0), n, &mut dw) };
            for (i, &t) in toks.iter().enumerate() {
                if n == SCALE_RUN {
                    // SAFETY: blocks b0..b0 + 8 of token t are within `x`; `sc` holds 8.
                    unsafe {
                        let dx = _mm256_loadu_ps(xd.add(t * nb + b0));
                        let p = _mm256_mul_ps(_mm256_loadu_ps(dw.as_ptr()), dx);
                        _mm256_storeu_ps(sc[r][i].as_mut_ptr(), p);
                    }
                } else {
                    for j in 0..n {
                        sc[r][i][j] = dw[j] * x.d[t * nb + b0 + j];
                    }
                }
            }
        }
        for j in b0..b0 + n {
            let mut xq = [_mm256_setzero_si256(); T];
            let mut s8 = [_mm256_setzero_si256(); T];
            for (i, &t) in toks.iter().enumerate() {
                // SAFETY: token t's block j (32 codes, 8 lane sums) is within `x`.
                unsafe {
                    xq[i] = _mm256_loadu_si256(xqs.add(t * x.cols + j * QK) as *const __m256i);
                    s8[i] = _mm256_loadu_si256(xs8.add((t * nb + j) * 8) as *const __m256i);
                }
            }
            for r in 0..R {
                let k = rows[r] * nb + j;
                let q = b.qs.as_ptr().wrapping_add(k * B::QBYTES);
                if (k * B::QBYTES).is_multiple_of(64) {
                    _mm_prefetch::<_MM_HINT_T1>(q.wrapping_add(PREFETCH_BYTES) as *const i8);
                }
                // SAFETY: block k is within the quants; this function runs on AVX2.
                let w = unsafe { B::codes(q) };
                for i in 0..T {
                    // SAFETY: this function runs on AVX2.
                    let p = _mm256_cvtepi32_ps(unsafe { B::dot(w, xq[i], s8[i]) });
                    let s = _mm256_set1_ps(sc[r][i][j - b0]);
                    acc[r][i] = _mm256_fmadd_ps(s, p, acc[r][i]);
                    if B::MIN {
                        let t = toks[i];
                        mins[r][i] = b.m[k].to_f32().mul_add(x.sum[t * nb + j], mins[r][i]);
                    }
                }
            }
        }
        b0 += n;
    }
    let mut out = [[0f32; T]; R];
    for r in 0..R {
        for i in 0..T {
            let mut lanes = [0f32; 8];
            // SAFETY: `lanes` holds 8 floats.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc[r][i]) };
            out[r][i] = super::a8::fold8(lanes) + mins[r][i];
        }
    }
    out
}

/// Blocks per row that [`a8_flat`] holds the scale products of (SmolLM2's widest rows, 1536
/// columns, have 48).
const A8_FLAT_BLOCKS: usize = 64;

/// [`a8_tile`] in one flat pass over the blocks (rows of at most [`A8_FLAT_BLOCKS`] blocks):
/// every scale product first (in vectors, each rounded once), then per block one load of each
/// token's codes and lane sums for all the rows, each row's codes decoded once and used for every
/// token.
///
/// # Safety
/// The rows must be within `b`, the tokens within `x`; `cols / 32 ≤ A8_FLAT_BLOCKS`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn a8_flat<B: A8Block, const R: usize, const T: usize>(
    b: &Blocks,
    x: &super::a8::Q8Acts,
    rows: [usize; R],
    toks: [usize; T],
) -> [[f32; T]; R] {
    let nb = x.cols / QK;
    assert!(nb <= A8_FLAT_BLOCKS, "invariant: rows of at most 64 blocks");
    let mut sc = [[[0f32; A8_FLAT_BLOCKS]; T]; R];
    let mut dw = [0f32; SCALE_RUN];
    for r in 0..R {
        let mut b0 = 0;
        while b0 < nb {
            let n = (nb - b0).min(SCALE_RUN);
            // SAFETY: blocks b0..b0 + n of the row are within it.
            unsafe { scales(b.d.as_ptr().add(rows[r] * nb + b0), n, &mut dw) };
            for (i, &t) in toks.iter().enumerate() {
                let xd = &x.d[t * nb..(t + 1) * nb];
                let s = &mut sc[r][i];
                if n == SCALE_RUN {
                    // SAFETY: 8 scales of the token from b0 (n == 8), 8 slots of `s` from b0.
                    unsafe {
                        let p = _mm256_mul_ps(
                            _mm256_loadu_ps(dw.as_ptr()),
                            _mm256_loadu_ps(xd.as_ptr().add(b0)),
                        );
                        _mm256_storeu_ps(s.as_mut_ptr().add(b0), p);
                    }
                } else {
                    for j in 0..n {
                        s[b0 + j] = dw[j] * xd[b0 + j];
                    }
                }
            }
            b0 += n;
        }
    }
    let q: [*const u8; R] =
        std::array::from_fn(|r| b.qs.as_ptr().wrapping_add(rows[r] * nb * B::QBYTES));
    let xqs: [*const i8; T] = std::array::from_fn(|i| x.qs.as_ptr().wrapping_add(toks[i] * x.cols));
    let xs8: [*const i32; T] =
        std::array::from_fn(|i| x.s8.as_ptr().wrapping_add(toks[i] * nb * 8));
    let every = (64 / B::QBYTES).max(1);
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    let mut mins = [[0f32; T]; R];
    #[allow(clippy::needless_range_loop)] // j indexes the blocks of every row and token
    for j in 0..nb {
        let mut xv = [_mm256_setzero_si256(); T];
        let mut s8 = [_mm256_setzero_si256(); T];
        for i in 0..T {
            // SAFETY: block j of each token is within `x`.
            unsafe {
                xv[i] = _mm256_loadu_si256(xqs[i].add(j * QK) as *const __m256i);
                s8[i] = _mm256_loadu_si256(xs8[i].add(j * 8) as *const __m256i);
            }
        }
        let fetch = j % every == 0;
        for r in 0..R {
            let qj = q[r].wrapping_add(j * B::QBYTES);
            if fetch {
                _mm_prefetch::<_MM_HINT_T1>(qj.wrapping_add(PREFETCH_BYTES) as *const i8);
            }
            // SAFETY: block j of row r is within the quants; this function runs on AVX2.
            let w = unsafe { B::codes(qj) };
            for i in 0..T {
                // SAFETY: this function runs on AVX2.
                let p = _mm256_cvtepi32_ps(unsafe { B::dot(w, xv[i], s8[i]) });
                acc[r][i] = _mm256_fmadd_ps(_mm256_set1_ps(sc[r][i][j]), p, acc[r][i]);
                if B::MIN {
                    let (k, t) = (rows[r] * nb + j, toks[i]);
                    mins[r][i] = b.m[k].to_f32().mul_add(x.sum[t * nb + j], mins[r][i]);
                }
            }
        }
    }
    std::array::from_fn(|r| {
        std::array::from_fn(|i| {
            let mut lanes = [0f32; 8];
            // SAFETY: `lanes` holds 8 floats.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc[r][i]) };
            super::a8::fold8(lanes) + mins[r][i]
        })
    })
}

/// One task of [`super::a8::matmul_a8`]: its rows, every token; 4 rows × 1 token for a lone
/// token, else 2 rows × up to 3 tokens.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn rows_task_a8(w: &RowData, x: &super::a8::Q8Acts, out: &mut RowsOut) {
    fn run<B: A8Block>(b: &Blocks, x: &super::a8::Q8Acts, out: &mut RowsOut) {
        let (n_rows, n_tok, r0) = (out.n_rows(), out.n_tok(), out.r0());
        let group = if n_tok == 1 { 4 } else { 2 };
        let mut i = 0;
        while i < n_rows {
            let nr = (n_rows - i).min(group);
            let rows = |k: usize| r0 + i + k.min(nr - 1);
            let mut t = 0;
            while t < n_tok {
                let nt = (n_tok - t).min(3);
                let toks = |k: usize| t + k.min(nt - 1);
                let flat = x.cols / QK <= A8_FLAT_BLOCKS;
                macro_rules! run {
                    ($r:literal, $t:literal) => {{
                        let (rs, ts) = (std::array::from_fn(rows), std::array::from_fn(toks));
                        // SAFETY: the rows are the task's, the tokens within `x` (and a flat
                        // tile's rows short enough); the CPU runs AVX2 (the caller's contract).
                        let o = unsafe {
                            match flat {
                                true => a8_flat::<B, $r, $t>(b, x, rs, ts),
                                false => a8_tile::<B, $r, $t>(b, x, rs, ts),
                            }
                        };
                        for (r, row) in o.iter().enumerate().take(nr) {
                            for (k, &v) in row.iter().enumerate().take(nt) {
                                out.put(i + r, t + k, v);
                            }
                        }
                    }};
                }
                match (group, nt) {
                    (4, _) => run!(4, 1),
                    (_, 1) => run!(2, 1),
                    (_, 2) => run!(2, 2),
                    _ => run!(2, 3),
                }
                t += nt;
            }
            i += nr;
        }
    }
    match w {
        RowData::Q4_0(b) => run::<Q4_0>(b, x, out),
        RowData::Q4_1(b) => run::<Q4_1>(b, x, out),
        RowData::Q8_0(b) => run::<Q8_0>(b, x, out),
        _ => panic!("invariant: an 8-bit-activation matmul of a block format"),
    }
}
