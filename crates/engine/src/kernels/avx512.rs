//! The AVX-512 path (AVX-512F and FMA): the same lane layout as the portable kernels — element
//! `i` of a reduction lands in lane `i % 16`, the lanes fold by the same pairwise tree — with a
//! fused multiply-add per step (so its bits differ from the portable path's, which rounds the
//! product and the sum apart; within this path every output is computed one way whatever the
//! batch). Quantized rows are dequantized with vector code into an L1 scratch four rows at a
//! time (`w = d·(q − 8)` etc. in f32, the same values as the portable path), then a register tile
//! of 4 rows × up to 4 tokens multiplies them: each weight is loaded once per 4 tokens and each
//! activation once per 4 rows.

use std::arch::x86_64::*;

use super::{RowData, QK};

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

/// Dot products of `R` rows with `T` tokens, all `cols` long (any `cols`: the tail is masked).
///
/// # Safety
/// Every pointer must be valid for `cols` reads.
#[inline]
#[target_feature(enable = "avx512f,fma")]
unsafe fn tile<const R: usize, const T: usize>(
    w: [*const f32; R],
    x: [*const f32; T],
    cols: usize,
) -> [[f32; T]; R] {
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    let mut xv = [_mm512_setzero_ps(); T];
    let full = cols / 16 * 16;
    let mut c = 0;
    while c < full {
        for t in 0..T {
            // SAFETY: c + 16 <= cols.
            xv[t] = unsafe { _mm512_loadu_ps(x[t].add(c)) };
        }
        for r in 0..R {
            // SAFETY: as above.
            let wv = unsafe { _mm512_loadu_ps(w[r].add(c)) };
            for t in 0..T {
                acc[r][t] = _mm512_fmadd_ps(wv, xv[t], acc[r][t]);
            }
        }
        c += 16;
    }
    if full < cols {
        let m: __mmask16 = ((1u32 << (cols - full)) - 1) as u16;
        for t in 0..T {
            // SAFETY: the mask reads only the `cols - full` elements left.
            xv[t] = unsafe { _mm512_maskz_loadu_ps(m, x[t].add(full)) };
        }
        for r in 0..R {
            // SAFETY: as above.
            let wv = unsafe { _mm512_maskz_loadu_ps(m, w[r].add(full)) };
            for t in 0..T {
                acc[r][t] = _mm512_fmadd_ps(wv, xv[t], acc[r][t]);
            }
        }
    }
    let mut out = [[0f32; T]; R];
    for r in 0..R {
        for t in 0..T {
            out[r][t] = fold16(acc[r][t]);
        }
    }
    out
}

/// The f16 scale at `b[at..at + 2]`.
#[inline(always)]
fn h(b: &[u8], at: usize) -> f32 {
    half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// 16 codes (bytes) as f32.
#[inline]
#[target_feature(enable = "avx512f,fma")]
fn u8x16_to_ps(v: __m128i) -> __m512 {
    _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v))
}

/// Dequantize row `row` of `w` (`cols` wide) into `out`, with the portable path's values.
#[inline]
#[target_feature(enable = "avx512f,fma")]
fn dequantize_row(w: &RowData, row: usize, cols: usize, out: &mut [f32]) {
    let out = &mut out[..cols];
    let rb = w.row_bytes(cols);
    match w {
        RowData::F32(d) => out.copy_from_slice(&d[row * cols..(row + 1) * cols]),
        RowData::F16(d) => {
            let src = &d[row * cols..(row + 1) * cols];
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
        RowData::Q4_0(d) => {
            let low = _mm_set1_epi8(0x0f);
            let eight = _mm512_set1_ps(8.0);
            for (b, o) in d[row * rb..(row + 1) * rb]
                .chunks_exact(18)
                .zip(out.chunks_exact_mut(QK))
            {
                let s = _mm512_set1_ps(h(b, 0));
                // SAFETY: 16 bytes of nibbles after the scale; 32 outputs.
                unsafe {
                    let q = _mm_loadu_si128(b.as_ptr().add(2) as *const __m128i);
                    let lo = u8x16_to_ps(_mm_and_si128(q, low));
                    let hi = u8x16_to_ps(_mm_and_si128(_mm_srli_epi16::<4>(q), low));
                    let lo = _mm512_mul_ps(s, _mm512_sub_ps(lo, eight));
                    let hi = _mm512_mul_ps(s, _mm512_sub_ps(hi, eight));
                    _mm512_storeu_ps(o.as_mut_ptr(), lo);
                    _mm512_storeu_ps(o.as_mut_ptr().add(16), hi);
                }
            }
        }
        RowData::Q4_1(d) => {
            let low = _mm_set1_epi8(0x0f);
            for (b, o) in d[row * rb..(row + 1) * rb]
                .chunks_exact(20)
                .zip(out.chunks_exact_mut(QK))
            {
                let (s, m) = (_mm512_set1_ps(h(b, 0)), _mm512_set1_ps(h(b, 2)));
                // SAFETY: 16 bytes of nibbles after scale and minimum; 32 outputs.
                unsafe {
                    let q = _mm_loadu_si128(b.as_ptr().add(4) as *const __m128i);
                    let lo = u8x16_to_ps(_mm_and_si128(q, low));
                    let hi = u8x16_to_ps(_mm_and_si128(_mm_srli_epi16::<4>(q), low));
                    // d·q + m rounded twice, as the portable path does.
                    let lo = _mm512_add_ps(_mm512_mul_ps(s, lo), m);
                    let hi = _mm512_add_ps(_mm512_mul_ps(s, hi), m);
                    _mm512_storeu_ps(o.as_mut_ptr(), lo);
                    _mm512_storeu_ps(o.as_mut_ptr().add(16), hi);
                }
            }
        }
        RowData::Q8_0(d) => {
            for (b, o) in d[row * rb..(row + 1) * rb]
                .chunks_exact(34)
                .zip(out.chunks_exact_mut(QK))
            {
                let s = _mm512_set1_ps(h(b, 0));
                // SAFETY: 32 signed bytes after the scale; 32 outputs.
                unsafe {
                    let q0 = _mm_loadu_si128(b.as_ptr().add(2) as *const __m128i);
                    let q1 = _mm_loadu_si128(b.as_ptr().add(18) as *const __m128i);
                    let lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0));
                    let hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1));
                    _mm512_storeu_ps(o.as_mut_ptr(), _mm512_mul_ps(s, lo));
                    _mm512_storeu_ps(o.as_mut_ptr().add(16), _mm512_mul_ps(s, hi));
                }
            }
        }
    }
}

/// `R` rows × `nt` (1..=4) tokens.
///
/// # Safety
/// As [`tile`].
#[inline]
#[target_feature(enable = "avx512f,fma")]
unsafe fn tile_tokens<const R: usize>(
    w: [*const f32; R],
    x: [*const f32; TILE_TOKENS],
    nt: usize,
    cols: usize,
    mut put: impl FnMut(usize, usize, f32),
) {
    macro_rules! run {
        ($t:literal) => {{
            let mut xs = [std::ptr::null::<f32>(); $t];
            xs.copy_from_slice(&x[..$t]);
            // SAFETY: the caller's pointers are valid for `cols` reads.
            let o = unsafe { tile::<R, $t>(w, xs, cols) };
            for (r, row) in o.iter().enumerate() {
                for (t, &v) in row.iter().enumerate() {
                    put(r, t, v);
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
}

/// One task of [`super::matmul`]: rows `r0..r0 + yt.len() / n_tok` of the transposed output
/// `yt[r, t]`.
///
/// # Safety
/// The CPU must support AVX-512F and FMA.
#[target_feature(enable = "avx512f,fma")]
pub unsafe fn rows_task(w: &RowData, cols: usize, x: &[f32], n_tok: usize, r0: usize, yt: &mut [f32]) {
    assert!(x.len() >= n_tok * cols, "invariant: x holds n_tok rows");
    let n_rows = yt.len() / n_tok;
    let mut scratch = vec![0f32; TILE_ROWS * cols];
    let mut i = 0;
    while i < n_rows {
        let nr = (n_rows - i).min(TILE_ROWS);
        if !matches!(w, RowData::F32(_)) {
            for (k, s) in scratch.chunks_exact_mut(cols).take(nr).enumerate() {
                dequantize_row(w, r0 + i + k, cols, s);
            }
        }
        // Row pointers; a short group repeats its last row (its results are dropped).
        let wp: [*const f32; TILE_ROWS] = std::array::from_fn(|k| {
            let k = k.min(nr - 1);
            match w {
                RowData::F32(d) => d[(r0 + i + k) * cols..].as_ptr(),
                _ => scratch[k * cols..].as_ptr(),
            }
        });
        let yi = &mut yt[i * n_tok..];
        let mut t = 0;
        while t < n_tok {
            let nt = (n_tok - t).min(TILE_TOKENS);
            let xp: [*const f32; TILE_TOKENS] =
                std::array::from_fn(|k| x[(t + k.min(nt - 1)) * cols..].as_ptr());
            // SAFETY: every row pointer covers `cols` weights (a stored row or a scratch row),
            // every token pointer `cols` activations.
            unsafe {
                tile_tokens::<TILE_ROWS>(wp, xp, nt, cols, |r, k, v| {
                    if r < nr {
                        yi[r * n_tok + t + k] = v;
                    }
                })
            };
            t += TILE_TOKENS;
        }
        i += nr;
    }
}
