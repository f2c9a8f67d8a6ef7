//! The SIMD kernels of 8-bit activations ([`crate::kernels::a8`], the draft's): weights repacked
//! at load in groups of eight rows, a block's codes multiplied by broadcast groups of four
//! activation codes, one fused multiply-add per block (two for Q6_K; see the module docs of
//! [`crate::kernels::a8`]). Two kernels share one body: AVX2 (`maddubs`, pairs summed in 16-bit
//! lanes) and AVX-512 VNNI on 256-bit vectors (`vpdpbusd`, four products summed straight into
//! 32-bit lanes). Both compute every block's integer dot products exactly, so they give the
//! same bits.

use std::arch::x86_64::*;

use crate::kernels::a8::{A8Matrix, Format, Q8Acts, GROUP};
use crate::kernels::{RowsOut, K_BLOCKS, QK};

/// One 32-byte chunk of an [`A8Matrix`] group's 4-bit codes as its two groups of elements:
/// the low nibbles (elements `4c ..` of the eight rows), then the high ones (`16 + 4c ..`).
///
/// # Safety
/// `q` must point at 32 readable bytes; the CPU must support AVX2.
#[inline(always)]
unsafe fn nibble_groups(q: *const u8) -> (__m256i, __m256i) {
    // SAFETY: the caller's contract.
    unsafe {
        let v = _mm256_loadu_si256(q as *const __m256i);
        let m = _mm256_set1_epi8(0x0f);
        (
            _mm256_and_si256(v, m),
            _mm256_and_si256(_mm256_srli_epi16::<4>(v), m),
        )
    }
}

/// Four activation codes (elements `e .. e + 4` of a token) in every 32-bit lane.
///
/// # Safety
/// `p` must point at 4 readable bytes; the CPU must support AVX2.
#[inline(always)]
unsafe fn codes4(p: *const i8) -> __m256i {
    // SAFETY: the caller's contract.
    unsafe { _mm256_set1_epi32((p as *const i32).read_unaligned()) }
}

/// `acc` plus, in each 32-bit lane, the sum of the four products of `w`'s unsigned bytes by
/// `x`'s signed ones, exactly. VNNI does it in one instruction; AVX2 sums pairs in 16-bit lanes
/// (`maddubs`: exact while each pair is below 2^15, which the callers' codes keep) and widens.
///
/// # Safety
/// The CPU must support AVX2, and AVX-512 VNNI and VL when `VNNI`.
#[inline(always)]
unsafe fn dot4<const VNNI: bool>(acc: __m256i, w: __m256i, x: __m256i) -> __m256i {
    // SAFETY: the caller's contract.
    unsafe {
        if VNNI {
            _mm256_dpbusd_epi32(acc, w, x)
        } else {
            let p = _mm256_maddubs_epi16(w, x);
            _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)))
        }
    }
}

/// Eight f32 lanes from 8 bytes at `p`, unsigned or signed.
///
/// # Safety
/// `p` must point at 8 readable bytes; the CPU must support AVX2.
#[inline(always)]
unsafe fn bytes8<const SIGNED: bool>(p: *const u8) -> __m256 {
    // SAFETY: the caller's contract.
    unsafe {
        let b = _mm_loadl_epi64(p as *const __m128i);
        _mm256_cvtepi32_ps(if SIGNED {
            _mm256_cvtepi8_epi32(b)
        } else {
            _mm256_cvtepu8_epi32(b)
        })
    }
}

/// `T` tokens times one group of eight rows of an 8-bit-activation matmul ([`super::super::a8`]'s
/// order: per block one exact integer dot product per row and token, two for Q6_K, each one
/// fused multiply-add into the row's running sum). Each block's codes are loaded (and the
/// nibbles unpacked) once for the `T` tokens.
///
/// # Safety
/// `g` must be a group of `w`, `t0 + T` at most `x`'s tokens; the CPU must support AVX2, FMA
/// and F16C, and AVX-512 VNNI and VL when `VNNI`.
#[inline(always)]
unsafe fn a8_group<const T: usize, const VNNI: bool>(
    w: &A8Matrix,
    g: usize,
    x: &Q8Acts,
    t0: usize,
) -> [__m256; T] {
    let f = w.format;
    let (cols, nb) = (x.cols, x.cols / QK);
    let ns = nb / K_BLOCKS;
    let qb = GROUP * f.qbytes();
    let q0 = w.qs.as_ptr().wrapping_add(g * nb * qb);
    let d0 = w.d.as_ptr().wrapping_add(g * nb * GROUP);
    let m0 = w.m.as_ptr().wrapping_add(g * nb * GROUP);
    let sc0 = w.sc.as_ptr().wrapping_add(g * nb * 2 * GROUP);
    let kd0 = w.kd.as_ptr().wrapping_add(g * ns * GROUP);
    let km0 = w.kmin.as_ptr().wrapping_add(g * ns * GROUP);
    // SAFETY: every pointer below stays within group g's blocks of `w` and the tokens'
    // blocks of `x` (the caller's contract); the CPU features are the caller's contract.
    unsafe {
        let zero = _mm256_setzero_si256();
        let mut acc = [_mm256_setzero_ps(); T];
        let mut mins = [_mm256_setzero_ps(); T];
        for j in 0..nb {
            let q = q0.add(j * qb);
            for l in (0..qb).step_by(64) {
                _mm_prefetch::<_MM_HINT_T0>(q.wrapping_add(PREFETCH_A8 + l) as *const i8);
            }
            let xb = |i: usize| x.qs.as_ptr().add((t0 + i) * cols + j * QK);
            // The integer dot products: the whole block's (or Q6_K's first half's), and Q6_K's
            // second half's.
            let mut p = [zero; T];
            let mut p1 = [zero; T];
            match f {
                Format::Q4_0 | Format::Q4_1 | Format::Q4K => {
                    let c: [(__m256i, __m256i); 4] =
                        std::array::from_fn(|k| nibble_groups(q.add(32 * k)));
                    for (i, pi) in p.iter_mut().enumerate() {
                        let xb = xb(i);
                        if VNNI {
                            for (k, ck) in c.iter().enumerate() {
                                *pi = dot4::<true>(*pi, ck.0, codes4(xb.add(4 * k)));
                                *pi = dot4::<true>(*pi, ck.1, codes4(xb.add(16 + 4 * k)));
                            }
                        } else {
                            // Pairs of at most 2·15·127: eight of them stay below 2^15.
                            let mut s = zero;
                            for (k, ck) in c.iter().enumerate() {
                                s = _mm256_add_epi16(
                                    s,
                                    _mm256_maddubs_epi16(ck.0, codes4(xb.add(4 * k))),
                                );
                                s = _mm256_add_epi16(
                                    s,
                                    _mm256_maddubs_epi16(ck.1, codes4(xb.add(16 + 4 * k))),
                                );
                            }
                            *pi = _mm256_madd_epi16(s, _mm256_set1_epi16(1));
                        }
                    }
                }
                Format::Q5_0 | Format::Q6K => {
                    // Unsigned codes below 64: a pair below 2^14, so `dot4` is exact.
                    let c: [__m256i; 8] =
                        std::array::from_fn(
                            |k| _mm256_loadu_si256(q.add(32 * k) as *const __m256i),
                        );
                    for i in 0..T {
                        let xb = xb(i);
                        for (k, ck) in c.iter().enumerate() {
                            let half = if k < 4 { &mut p[i] } else { &mut p1[i] };
                            *half = dot4::<VNNI>(*half, *ck, codes4(xb.add(4 * k)));
                        }
                    }
                    if f == Format::Q5_0 {
                        for i in 0..T {
                            p[i] = _mm256_add_epi32(p[i], p1[i]);
                        }
                    }
                }
                Format::Q8_0 => {
                    for k in 0..8 {
                        let wk = _mm256_loadu_si256(q.add(32 * k) as *const __m256i);
                        let aw = _mm256_sign_epi8(wk, wk);
                        for (i, pi) in p.iter_mut().enumerate() {
                            // |w| (at most 128) times x with w's sign: pairs stay below 2^15.
                            let xk = _mm256_sign_epi8(codes4(xb(i).add(4 * k)), wk);
                            *pi = dot4::<VNNI>(*pi, aw, xk);
                        }
                    }
                }
            }
            // The codes' centring: Σ (q − o)·x = Σ q·x − o·Σ x, exactly.
            let o = f.offset();
            if o != 0 {
                for i in 0..T {
                    let tb = (t0 + i) * nb + j;
                    if f == Format::Q6K {
                        let (s, s0) = (x.qsum[tb], x.qsum0[tb]);
                        p[i] = _mm256_sub_epi32(p[i], _mm256_set1_epi32(o * s0));
                        p1[i] = _mm256_sub_epi32(p1[i], _mm256_set1_epi32(o * (s - s0)));
                    } else {
                        p[i] = _mm256_sub_epi32(p[i], _mm256_set1_epi32(o * x.qsum[tb]));
                    }
                }
            }
            // The block's scales (of its halves) and minimum, as the portable path computes them.
            let sc = sc0.add(j * 2 * GROUP);
            let kd = || _mm256_loadu_ps(kd0.add((j / K_BLOCKS) * GROUP));
            let (s0, s1, mw) = match f {
                Format::Q4K => {
                    let s = _mm256_mul_ps(kd(), bytes8::<false>(sc));
                    let km = _mm256_loadu_ps(km0.add((j / K_BLOCKS) * GROUP));
                    let m = _mm256_mul_ps(km, bytes8::<false>(sc.add(GROUP)));
                    (s, s, _mm256_xor_ps(m, _mm256_set1_ps(-0.0)))
                }
                Format::Q6K => (
                    _mm256_mul_ps(kd(), bytes8::<true>(sc)),
                    _mm256_mul_ps(kd(), bytes8::<true>(sc.add(GROUP))),
                    _mm256_setzero_ps(),
                ),
                _ => {
                    let s = _mm256_cvtph_ps(_mm_loadu_si128(d0.add(j * GROUP) as *const __m128i));
                    let m = if f == Format::Q4_1 {
                        _mm256_cvtph_ps(_mm_loadu_si128(m0.add(j * GROUP) as *const __m128i))
                    } else {
                        _mm256_setzero_ps()
                    };
                    (s, s, m)
                }
            };
            for i in 0..T {
                let tb = (t0 + i) * nb + j;
                let dx = _mm256_set1_ps(x.d[tb]);
                acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(s0, dx), _mm256_cvtepi32_ps(p[i]), acc[i]);
                if f == Format::Q6K {
                    acc[i] =
                        _mm256_fmadd_ps(_mm256_mul_ps(s1, dx), _mm256_cvtepi32_ps(p1[i]), acc[i]);
                }
                if f.has_min() {
                    mins[i] = _mm256_fmadd_ps(mw, _mm256_set1_ps(x.sum[tb]), mins[i]);
                }
            }
        }
        if f.has_min() {
            for i in 0..T {
                acc[i] = _mm256_add_ps(acc[i], mins[i]);
            }
        }
        acc
    }
}

/// Bytes ahead of an [`A8Matrix`] group's quants being read that the kernel asks the L1 for
/// (every line of each block: a sequential stream the hardware prefetcher alone does not keep
/// ahead of the kernel; 6.3 vs 9.6 ms a draft token on one Zen 3 core).
const PREFETCH_A8: usize = 4096;

/// One task of [`crate::kernels::a8::matmul_a8`]: its rows in groups of eight, the tokens up to
/// four at a time (a group's rows, a few KiB, stay in L1 across the token runs).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C, and AVX-512 VNNI and VL when `VNNI`.
#[inline(always)]
unsafe fn rows_task<const VNNI: bool>(w: &A8Matrix, x: &Q8Acts, out: &mut RowsOut) {
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
                    // SAFETY: g is a group of the task's rows, t + $t ≤ n_tok; the CPU
                    // features are the caller's contract.
                    let o = unsafe { a8_group::<$t, VNNI>(w, g, x, t) };
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

/// [`rows_task`] with AVX2's `maddubs`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(in crate::kernels) unsafe fn rows_task_a8(w: &A8Matrix, x: &Q8Acts, out: &mut RowsOut) {
    // SAFETY: the caller's contract.
    unsafe { rows_task::<false>(w, x, out) }
}

/// [`rows_task`] with AVX-512 VNNI's `vpdpbusd` on 256-bit vectors.
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C, AVX-512 VNNI and AVX-512 VL.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
pub(in crate::kernels) unsafe fn rows_task_a8_vnni(w: &A8Matrix, x: &Q8Acts, out: &mut RowsOut) {
    // SAFETY: the caller's contract.
    unsafe { rows_task::<true>(w, x, out) }
}
