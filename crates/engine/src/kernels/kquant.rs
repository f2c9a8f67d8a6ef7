//! GGUF's k-quant super-blocks (Q4_K, Q6_K) for the kernels of [`super`]: repacked at load into
//! 32-weight blocks the SIMD paths decode as they decode Q4_0's, and each block's scales and
//! minimum from its super-block, by plain Rust (the portable path's dequantization, the SIMD
//! paths' runs shorter than a vector).

use half::f16;

use super::{RowPtrs, K_BLOCKS, QK, QK_K};

/// GGUF's k-quant super-blocks of 256 weights (Q4_K, Q6_K), repacked at load into eight blocks of
/// 32 whose quants are laid out as Q4_0's (element `l` in the low nibble of byte `l`, element
/// `16 + l` in its high nibble), so that the kernels decode them as they decode Q4_0 blocks. The
/// values are exactly GGUF's (llama.cpp's dequantization):
/// - **Q4_K**: block `j` of super-block `s` has the 6-bit scale `sc` and minimum `mn` unpacked
///   from GGUF's 12 bytes; its weights are `(d·sc)·q + (−(dmin·mn))` (`d·sc` and `dmin·mn`
///   exact in f32, the product with a 4-bit code exact too: one rounding, the sum's);
/// - **Q6_K**: each 16 weights have a signed 8-bit scale `sc`; the weights are
///   `(d·sc)·(q − 32)` (`d·sc` exact, the product rounded once), the 6-bit code `q` stored as
///   16 bytes of low nibbles and 8 bytes of high bit pairs (element `i`'s in byte `i % 8` at
///   bit `2·(i / 8)`).
///
/// The super-block scales are held as f32 (exact), so that a kernel converts nothing per block:
/// 152 bytes a Q4_K super-block (GGUF's 144: the scales unpacked to a byte each), 212 a Q6_K one
/// (GGUF's 210).
#[derive(Debug, Clone)]
pub struct SuperBlocks {
    /// Each super-block's scale.
    pub(super) d: Vec<f32>,
    /// Each super-block's scale of minimums (Q4_K; empty for Q6_K).
    pub(super) dmin: Vec<f32>,
    /// Two bytes a 32-weight block: Q4_K its scale and minimum (6 bits each), Q6_K the signed
    /// scales of its two halves.
    pub(super) sc: Vec<u8>,
    /// The quants of each 32-weight block: 16 bytes (Q4_K) or 24 (Q6_K).
    pub(super) qs: Vec<u8>,
}

/// The k-quant formats [`SuperBlocks`] holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum KFormat {
    Q4K,
    Q6K,
}

impl KFormat {
    /// Bytes of one GGUF super-block.
    fn gguf_bytes(self) -> usize {
        match self {
            KFormat::Q4K => 144,
            KFormat::Q6K => 210,
        }
    }

    /// Bytes of quants of one repacked 32-weight block.
    pub(super) fn qbytes(self) -> usize {
        match self {
            KFormat::Q4K => 16,
            KFormat::Q6K => 24,
        }
    }
}

/// Q4_K's 6-bit scale and minimum of block `j` (0..8) from the super-block's 12 bytes (GGUF's
/// packing: blocks 0..4 in the low six bits of bytes `j` and `j + 4`; blocks 4..8 their low
/// four bits in byte `j + 4`'s nibbles and their high two in the top bits of bytes `j − 4`
/// and `j`).
fn q4k_scale_min(j: usize, q: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// 32 codes (each < 16) in Q4_0's nibble layout.
fn pack_nibbles(codes: &[u8]) -> [u8; 16] {
    std::array::from_fn(|l| (codes[l] & 0x0f) | ((codes[16 + l] & 0x0f) << 4))
}

impl SuperBlocks {
    pub(super) fn from_gguf(bytes: &[u8], format: KFormat) -> SuperBlocks {
        let size = format.gguf_bytes();
        assert!(
            bytes.len().is_multiple_of(size),
            "invariant: GGUF data of whole {size}-byte super-blocks ({} bytes)",
            bytes.len()
        );
        let n = bytes.len() / size;
        let mut b = SuperBlocks {
            d: Vec::with_capacity(n),
            dmin: Vec::with_capacity(if format == KFormat::Q4K { n } else { 0 }),
            sc: Vec::with_capacity(n * K_BLOCKS * 2),
            qs: Vec::with_capacity(n * K_BLOCKS * format.qbytes()),
        };
        for blk in bytes.chunks_exact(size) {
            match format {
                KFormat::Q4K => {
                    // d, dmin, 12 bytes of scales, 128 of quants: block 2i the low nibbles of
                    // quant bytes 32i..32i + 32, block 2i + 1 their high nibbles.
                    b.d.push(f16::from_le_bytes([blk[0], blk[1]]).to_f32());
                    b.dmin.push(f16::from_le_bytes([blk[2], blk[3]]).to_f32());
                    let scales: &[u8; 12] = blk[4..16].try_into().expect("invariant: 12 bytes");
                    let qs = &blk[16..144];
                    for j in 0..K_BLOCKS {
                        let (sc, mn) = q4k_scale_min(j, scales);
                        b.sc.extend_from_slice(&[sc, mn]);
                        let bytes = &qs[32 * (j / 2)..32 * (j / 2) + 32];
                        let codes: Vec<u8> = bytes.iter().map(|&v| v >> (4 * (j % 2))).collect();
                        b.qs.extend_from_slice(&pack_nibbles(&codes));
                    }
                }
                KFormat::Q6K => {
                    // 128 bytes of low nibbles, 64 of high bit pairs, 16 signed scales, d. In
                    // each half (128 weights) element l < 32 of its four quarters: the low
                    // nibble of ql[l], ql[l + 32], then their high nibbles; the high pair at
                    // bits 0, 2, 4, 6 of qh[l].
                    let (ql, qh) = (&blk[..128], &blk[128..192]);
                    let scales = &blk[192..208];
                    b.d.push(f16::from_le_bytes([blk[208], blk[209]]).to_f32());
                    let mut codes = [0u8; QK_K];
                    for half in 0..2 {
                        let (ql, qh) = (&ql[64 * half..], &qh[32 * half..]);
                        for l in 0..32 {
                            let y = &mut codes[128 * half..];
                            y[l] = (ql[l] & 0x0f) | ((qh[l] & 3) << 4);
                            y[l + 32] = (ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4);
                            y[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
                            y[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
                        }
                    }
                    for (j, c) in codes.chunks_exact(QK).enumerate() {
                        b.sc.extend_from_slice(&[scales[2 * j], scales[2 * j + 1]]);
                        b.qs.extend_from_slice(&pack_nibbles(c));
                        b.qs.extend((0..8).map(|i| {
                            (0..4).fold(0u8, |h, k| h | ((c[i + 8 * k] >> 4) << (2 * k)))
                        }));
                    }
                }
            }
        }
        b
    }

    /// Bytes of quants of each 32-weight block.
    fn qbytes(&self) -> usize {
        self.qs.len() / (self.sc.len() / 2).max(1)
    }

    /// The super-blocks `a..z`.
    fn extend_from(&mut self, src: &SuperBlocks, a: usize, z: usize) {
        let q = src.qbytes() * K_BLOCKS;
        self.d.extend_from_slice(&src.d[a..z]);
        if !src.dmin.is_empty() {
            self.dmin.extend_from_slice(&src.dmin[a..z]);
        }
        self.sc
            .extend_from_slice(&src.sc[a * 2 * K_BLOCKS..z * 2 * K_BLOCKS]);
        self.qs.extend_from_slice(&src.qs[a * q..z * q]);
    }

    fn empty() -> SuperBlocks {
        SuperBlocks {
            d: Vec::new(),
            dmin: Vec::new(),
            sc: Vec::new(),
            qs: Vec::new(),
        }
    }

    /// The super-blocks of rows `rows` (each `per_row` super-blocks), in that order.
    pub(super) fn rows(&self, rows: &[u32], per_row: usize) -> SuperBlocks {
        let mut b = SuperBlocks::empty();
        for &r in rows {
            b.extend_from(self, r as usize * per_row, (r as usize + 1) * per_row);
        }
        b
    }

    /// The first `n` super-blocks.
    pub(super) fn first(&self, n: usize) -> SuperBlocks {
        let mut b = SuperBlocks::empty();
        b.extend_from(self, 0, n);
        b
    }

    /// The scales of the halves (elements 0..16 and 16..32) and the minimum of 32-weight block
    /// `k` of the matrix, in `format`.
    #[inline(always)]
    fn params(&self, format: KFormat, k: usize) -> (f32, f32, f32) {
        let sc = [self.sc[2 * k], self.sc[2 * k + 1]];
        match format {
            KFormat::Q4K => q4k_params(self.d[k / K_BLOCKS], self.dmin[k / K_BLOCKS], sc),
            KFormat::Q6K => q6k_params(self.d[k / K_BLOCKS], sc),
        }
    }
}

/// The halves' scales and the minimum of block `b` of a row of k-quant blocks whose first
/// super-block's scales are at `d` (and `dmin`, Q4_K) and whose blocks' scale bytes start at
/// `sc`: [`SuperBlocks::params`] from pointers, for the SIMD kernels.
///
/// # Safety
/// The pointers must cover block `b` of the row (`dmin` read for Q4_K only).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
#[inline(always)]
unsafe fn k_params(
    format: KFormat,
    d: *const f32,
    dmin: *const f32,
    sc: *const u8,
    b: usize,
) -> (f32, f32, f32) {
    // SAFETY: the caller's contract.
    unsafe {
        let sc = [sc.add(2 * b).read(), sc.add(2 * b + 1).read()];
        let d = d.add(b / K_BLOCKS).read();
        match format {
            KFormat::Q4K => q4k_params(d, dmin.add(b / K_BLOCKS).read(), sc),
            KFormat::Q6K => q6k_params(d, sc),
        }
    }
}

/// [`k_params`] of blocks `b0..b0 + n` of row `r` of `p`, into `s0`, `s1` and `m` (a run
/// shorter than the SIMD kernels' vectors).
///
/// # Safety
/// `p`'s row `r` must cover blocks `b0..b0 + n`; the slices must hold `n` floats.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) unsafe fn k_params_run<const N: usize>(
    format: KFormat,
    p: &RowPtrs<N>,
    r: usize,
    b0: usize,
    n: usize,
    s0: &mut [f32],
    s1: &mut [f32],
    m: &mut [f32],
) {
    for j in 0..n {
        // SAFETY: the caller's contract.
        (s0[j], s1[j], m[j]) = unsafe { k_params(format, p.kd[r], p.km[r], p.sc[r], b0 + j) };
    }
}

/// A Q4_K block's scale (both halves) and minimum: `d·sc` and `−(dmin·mn)`, exact in f32.
#[inline(always)]
fn q4k_params(d: f32, dmin: f32, sc: [u8; 2]) -> (f32, f32, f32) {
    let s = d * f32::from(sc[0]);
    (s, s, -(dmin * f32::from(sc[1])))
}

/// A Q6_K block's two scales `d·sc` (exact in f32); no minimum.
#[inline(always)]
fn q6k_params(d: f32, sc: [u8; 2]) -> (f32, f32, f32) {
    (d * f32::from(sc[0] as i8), d * f32::from(sc[1] as i8), 0.0)
}

/// Dequantize row `row` (`cols` wide, whole super-blocks) of k-quant blocks into `out`:
/// `w = s·q + m` (Q4_K: `s·q` exact, one rounding) or `w = s·(q − 32)` (Q6_K), each half of a
/// block with its own scale.
#[inline(always)]
pub(super) fn deq_k_row(
    b: &SuperBlocks,
    format: KFormat,
    row: usize,
    cols: usize,
    out: &mut [f32],
) {
    let (k0, qb) = (row * (cols / QK), format.qbytes());
    for (j, o) in out[..cols].chunks_exact_mut(QK).enumerate() {
        let k = k0 + j;
        let (s0, s1, m) = b.params(format, k);
        let q = &b.qs[k * qb..(k + 1) * qb];
        match format {
            KFormat::Q4K => {
                for l in 0..16 {
                    o[l] = s0 * f32::from(q[l] & 0x0f) + m;
                    o[16 + l] = s1 * f32::from(q[l] >> 4) + m;
                }
            }
            KFormat::Q6K => {
                let c = q6k_codes(q);
                for l in 0..16 {
                    o[l] = s0 * (f32::from(c[l]) - 32.0);
                    o[16 + l] = s1 * (f32::from(c[16 + l]) - 32.0);
                }
            }
        }
    }
}

/// A repacked Q6_K block's 32 unsigned 6-bit codes (uncentred) from its 24 bytes: 16 of
/// nibbles in Q4_0's layout, 8 of high bit pairs (element `i`'s in byte `i % 8` at bit
/// `2·(i / 8)`).
#[inline(always)]
pub(super) fn q6k_codes(q: &[u8]) -> [u8; QK] {
    std::array::from_fn(|i| {
        let lo = if i < 16 { q[i] & 0x0f } else { q[i - 16] >> 4 };
        lo | (((q[16 + i % 8] >> (2 * (i / 8))) & 3) << 4)
    })
}
