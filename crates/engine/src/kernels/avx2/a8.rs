//! The AVX2 kernel of 8-bit activations ([`crate::kernels::a8`], the draft's): weights repacked
//! at load in groups of eight rows, a block's codes multiplied (`maddubs`) by broadcast groups of
//! four activation codes and summed in 16-bit lanes, one fused multiply-add per block (see the
//! module docs of [`super`]).

use std::arch::x86_64::*;

use crate::kernels::{RowsOut, QK};

/// One 32-byte chunk of an [`A8Matrix`] group's 4-bit codes as its two groups of elements:
/// the low nibbles (elements `4c ..` of the eight rows), then the high ones (`16 + 4c ..`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibble_groups(q: *const u8) -> (__m256i, __m256i) {
    // SAFETY: the caller's chunk has 32 bytes at `q`.
    let v = unsafe { _mm256_loadu_si256(q as *const __m256i) };
    let m = _mm256_set1_epi8(0x0f);
    (
        _mm256_and_si256(v, m),
        _mm256_and_si256(_mm256_srli_epi16::<4>(v), m),
    )
}

/// Four activation codes (elements `e .. e + 4` of a token) in every 32-bit lane.
///
/// # Safety
/// `p` must point at 4 readable bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn codes4(p: *const i8) -> __m256i {
    // SAFETY: the caller's contract.
    _mm256_set1_epi32(unsafe { (p as *const i32).read_unaligned() })
}

/// `T` tokens times one group of eight rows of an 8-bit-activation matmul ([`super::a8`]'s
/// order: per block one exact integer dot product per row and token, one fused multiply-add
/// into the row's running sum). Each block's codes are unpacked once for the `T` tokens; the
/// 4-bit formats sum a block's eight code groups in 16-bit lanes (at most 16·15·127 in
/// magnitude), Q8_0 widens each group's pairs to 32 bits.
///
/// # Safety
/// `g` must be a group of `w`, `t0 + T` at most `x`'s tokens; the CPU must support AVX2.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn a8_group<const T: usize>(
    w: &crate::kernels::a8::A8Matrix,
    g: usize,
    x: &crate::kernels::a8::Q8Acts,
    t0: usize,
) -> [__m256; T] {
    use crate::kernels::a8::{Format, GROUP};
    let (cols, nb) = (x.cols, x.cols / QK);
    let qb = GROUP * w.format.qbytes();
    let q0 = w.qs.as_ptr().wrapping_add(g * nb * qb);
    let d0 = w.d.as_ptr().wrapping_add(g * nb * GROUP);
    let m0 = w.m.as_ptr().wrapping_add(g * nb * GROUP);
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); T];
    let mut mins = [_mm256_setzero_ps(); T];
    for j in 0..nb {
        let q = q0.wrapping_add(j * qb);
        for l in (0..qb).step_by(64) {
            _mm_prefetch::<_MM_HINT_T0>(q.wrapping_add(PREFETCH_A8 + l) as *const i8);
        }
        // SAFETY: block j of group g: 8 scales (and minimums), `qb` bytes of quants.
        let dw = unsafe { _mm256_cvtph_ps(_mm_loadu_si128(d0.add(j * GROUP) as *const __m128i)) };
        let mut p = [_mm256_setzero_si256(); T];
        match w.format {
            Format::Q4_0 | Format::Q4_1 => {
                // SAFETY: the block's four chunks.
                let c: [(__m256i, __m256i); 4] =
                    std::array::from_fn(|k| unsafe { nibble_groups(q.add(32 * k)) });
                for (i, pi) in p.iter_mut().enumerate() {
                    let xb = x.qs.as_ptr().wrapping_add((t0 + i) * cols + j * QK);
                    // SAFETY: the token's block j: 32 codes.
                    let mut s = unsafe {
                        _mm256_add_epi16(
                            _mm256_maddubs_epi16(c[0].0, codes4(xb)),
                            _mm256_maddubs_epi16(c[0].1, codes4(xb.add(16))),
                        )
                    };
                    for (k, ck) in c.iter().enumerate().skip(1) {
                        // SAFETY: as above.
                        unsafe {
                            s = _mm256_add_epi16(
                                s,
                                _mm256_maddubs_epi16(ck.0, codes4(xb.add(4 * k))),
                            );
                            s = _mm256_add_epi16(
                                s,
                                _mm256_maddubs_epi16(ck.1, codes4(xb.add(16 + 4 * k))),
                            );
                        }
                    }
                    *pi = _mm256_madd_epi16(s, ones);
                    if w.format == Format::Q4_0 {
                        // Σ (q − 8)·x = Σ q·x − 8·Σ x, exactly.
                        let s8 = x.s8[(t0 + i) * nb + j];
                        *pi = _mm256_sub_epi32(*pi, _mm256_set1_epi32(s8));
                    }
                }
            }
            Format::Q8_0 => {
                for k in 0..8 {
                    // SAFETY: chunk k of the block.
                    let wk = unsafe { _mm256_loadu_si256(q.add(32 * k) as *const __m256i) };
                    let aw = _mm256_sign_epi8(wk, wk);
                    for (i, pi) in p.iter_mut().enumerate() {
                        let xb = x.qs.as_ptr().wrapping_add((t0 + i) * cols + j * QK);
                        // SAFETY: the token's block j: 32 codes.
                        let xk = unsafe { codes4(xb.add(4 * k)) };
                        // |w| (at most 128) times x with w's sign: pairs stay below 2^15.
                        let pk = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(xk, wk));
                        *pi = _mm256_add_epi32(*pi, _mm256_madd_epi16(pk, ones));
                    }
                }
            }
        }
        let mw = match w.format {
            // SAFETY: the block's 8 minimums.
            Format::Q4_1 => unsafe {
                _mm256_cvtph_ps(_mm_loadu_si128(m0.add(j * GROUP) as *const __m128i))
            },
            _ => _mm256_setzero_ps(),
        };
        for i in 0..T {
            let tb = (t0 + i) * nb + j;
            let s = _mm256_mul_ps(dw, _mm256_set1_ps(x.d[tb]));
            acc[i] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(p[i]), acc[i]);
            if w.format == Format::Q4_1 {
                mins[i] = _mm256_fmadd_ps(mw, _mm256_set1_ps(x.sum[tb]), mins[i]);
            }
        }
    }
    if w.format == Format::Q4_1 {
        for i in 0..T {
            acc[i] = _mm256_add_ps(acc[i], mins[i]);
        }
    }
    acc
}

/// Bytes ahead of an [`A8Matrix`] group's quants being read that the kernel asks the L1 for
/// (every line of each block: a sequential stream the hardware prefetcher alone does not keep
/// ahead of the kernel; 6.3 vs 9.6 ms a draft token on one Zen 3 core).
const PREFETCH_A8: usize = 4096;

/// One task of [`crate::kernels::a8::matmul_a8`]: its rows in groups of eight, the tokens up to four at
/// a time (a group's rows, a few KiB, stay in L1 across the token runs).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(in crate::kernels) unsafe fn rows_task_a8(
    w: &crate::kernels::a8::A8Matrix,
    x: &crate::kernels::a8::Q8Acts,
    out: &mut RowsOut,
) {
    use crate::kernels::a8::GROUP;
    let (n_rows, n_tok, r0) = (out.n_rows(), out.n_tok(), out.r0());
    debug_assert!(r0.is_multiple_of(GROUP));
    let mut i = 0;
    while i < n_rows {
        let g = (r0 + i) / GROUP;
        let nr = (n_rows - i).min(GROUP);
        let mut t = 0;
        while t < n_tok {
            let nt = (n_tok - t).min(4);
            let mut lanes = [[0f32; GROUP]; 4];
            macro_rules! run {
                ($t:literal) => {{
                    // SAFETY: g is a group of the task's rows, t + $t ≤ n_tok; AVX2 (the
                    // caller's contract).
                    let o = unsafe { a8_group::<$t>(w, g, x, t) };
                    for (k, v) in o.iter().enumerate() {
                        // SAFETY: 8 floats.
                        unsafe { _mm256_storeu_ps(lanes[k].as_mut_ptr(), *v) };
                    }
                }};
            }
            match nt {
                1 => run!(1),
                2 => run!(2),
                3 => run!(3),
                _ => run!(4),
            }
            for (k, l) in lanes.iter().enumerate().take(nt) {
                for (r, &v) in l.iter().enumerate().take(nr) {
                    out.put(i + r, t + k, v);
                }
            }
            t += nt;
        }
        i += nr;
    }
}
