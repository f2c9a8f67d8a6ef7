//! CPU kernels for the weight matmuls: f32 / f16 dense rows and quantized rows stored in GGUF's
//! 32-element blocks (Q4_0, Q4_1, Q5_0, Q8_0) or its 256-element k-quant super-blocks (Q4_K,
//! Q6_K, repacked at load into 32-element blocks), dequantized in registers and multiplied with
//! f32 activations (activations are never quantized here; that is `WeightMode::W4A8`).
//!
//! **Batch invariance.** Every output element `y[t, r] = Σ_i W[r, i]·x[t, i]` is reduced in one
//! fixed order that depends only on the reduction length, never on the number of tokens in the
//! call, their tiling, or the threads:
//! - f32 weights ([`Panels`]): one running sum per output, over `i` in order;
//! - f16 and quantized weights (each row dequantized to f32: `w = d·(q − 8)` etc.): `LANES`
//!   running sums, each walking the row with stride `LANES`, folded by a fixed pairwise tree.
//!
//! **The same bits on every instruction set.** Each step of a running sum is one fused
//! multiply-add, `acc = fma(w, x, acc)` (`f32::mul_add` in the portable code, `vfmadd` in the
//! AVX2 and AVX-512 kernels), and a weight's value is computed the same way on every path (a
//! Q4_0 weight is `d·(q − 8)` rounded once, a Q4_1 weight `d·q + m` rounded twice). So every
//! path gives every output bit for bit the same: a sequence's logits are identical whether it
//! runs alone or inside a ragged batch (what makes greedy verification exact under any batch
//! composition), and on any x86 CPU (what lets a session fail over between verifier replicas on
//! different hardware and continue the target's output).

pub mod a8;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod kquant;

use half::f16;
pub use kquant::SuperBlocks;
use kquant::{deq_k_row, k_params_run, KFormat};
use rayon::prelude::*;

/// Parallel running sums per reduction.
pub const LANES: usize = 16;
/// Elements per GGUF quant block (Q4_0, Q4_1, Q5_0, Q8_0), and per block of a repacked k-quant
/// super-block.
pub const QK: usize = 32;
/// Elements per GGUF k-quant super-block (Q4_K, Q6_K).
pub const QK_K: usize = 256;
/// 32-element blocks per super-block.
const K_BLOCKS: usize = QK_K / QK;
/// Output rows per parallel task (a multiple of [`PANEL`]).
const ROWS_PER_TASK: usize = 128;
/// Rows of an f32 weight panel.
pub const PANEL: usize = 16;
const _: () = assert!(ROWS_PER_TASK.is_multiple_of(PANEL));
/// The most bytes ahead an f32 panel kernel asks L2 for the next group of panels' columns: one
/// group of panels is read between that prefetch and its use, so a group larger than a good
/// part of L2 would have its lines evicted before they are read (the AVX2 machines this runs on
/// have 512 KiB to 2 MiB of L2 a core). SmolLM2-135M's groups of 8 panels over 576 columns
/// (288 KiB) are within it; its down projection's (1536 columns: 768 KiB) are not, and ask for
/// their own stream ahead instead.
const NEXT_GROUP_MAX_BYTES: usize = 384 << 10;

/// Bytes from a column of a group of `p` f32 panels of `cols` columns to the same column of the
/// next group, when a kernel may prefetch that far ([`NEXT_GROUP_MAX_BYTES`]).
fn next_group_bytes(p: usize, cols: usize) -> Option<usize> {
    let bytes = p * cols * PANEL * std::mem::size_of::<f32>();
    (bytes <= NEXT_GROUP_MAX_BYTES).then_some(bytes)
}

/// Tokens kept hot in cache while a task walks its rows.
const TOKEN_TILE: usize = 64;
/// Tokens sharing one pass over a weight row (their accumulators stay in registers).
const TOKENS_PER_PASS: usize = 4;

/// The storage of one weight matrix `[rows, cols]` (rows in order; see each variant's layout).
#[derive(Debug, Clone)]
pub enum RowData {
    F32(Panels),
    F16(Vec<f16>),
    /// GGUF Q4_0 blocks: f16 scale `d`, 32 nibbles `q`; w = d·(q − 8).
    Q4_0(Blocks),
    /// GGUF Q4_1 blocks: f16 scale `d`, f16 minimum `m`, 32 nibbles `q`; w = d·q + m.
    Q4_1(Blocks),
    /// GGUF Q8_0 blocks: f16 scale `d`, 32 signed bytes `q`; w = d·q.
    Q8_0(Blocks),
    /// GGUF Q5_0 blocks: f16 scale `d`, 32 five-bit codes `q` (4 bytes of high bits, then 16 of
    /// nibbles); w = d·(q − 16).
    Q5_0(Blocks),
    /// GGUF Q4_K super-blocks (see [`SuperBlocks`]): w = (d·s)·q − dmin·m.
    Q4K(SuperBlocks),
    /// GGUF Q6_K super-blocks (see [`SuperBlocks`]): w = (d·s)·(q − 32), a scale `s` per 16
    /// weights.
    Q6K(SuperBlocks),
}

/// f32 rows repacked at load into panels of [`PANEL`] rows stored column by column: weight
/// `(r, k)` is at `(r / 16)·16·cols + k·16 + r % 16`, the last panel padded with zero rows. A
/// kernel reads one 16-row column per step and multiplies it with one activation broadcast to
/// every lane, so each output is a plain running sum over `k` in order, the same for any number
/// of tokens, with no fold across lanes.
#[derive(Debug, Clone)]
pub struct Panels(Vec<Column>);

/// One column of a panel: 16 weights on a cache line of their own.
#[derive(Debug, Clone, Copy, Default)]
#[repr(C, align(64))]
struct Column([f32; PANEL]);

impl Panels {
    /// Repack row-major `w: [rows, cols]`.
    pub fn from_rows(w: &[f32], rows: usize, cols: usize) -> Panels {
        assert_eq!(
            w.len(),
            rows * cols,
            "invariant: a whole [rows, cols] matrix"
        );
        let mut out = vec![Column::default(); rows.div_ceil(PANEL) * cols];
        for (r, row) in w.chunks_exact(cols.max(1)).enumerate() {
            let panel = &mut out[r / PANEL * cols..];
            for (k, &v) in row.iter().enumerate() {
                panel[k].0[r % PANEL] = v;
            }
        }
        Panels(out)
    }

    /// The columns of the panel holding row `r` (a multiple of 16).
    fn panel(&self, r: usize, cols: usize) -> &[Column] {
        &self.0[r / PANEL * cols..(r / PANEL + 1) * cols]
    }

    /// Row `r` (`cols` wide) into `out`.
    fn row(&self, r: usize, cols: usize, out: &mut [f32]) {
        for (o, c) in out[..cols].iter_mut().zip(self.panel(r, cols)) {
            *o = c.0[r % PANEL];
        }
    }
}

/// Quantized rows in GGUF's 32-weight blocks, repacked at load: the f16 scales (and Q4_1's
/// minimums) in arrays of their own, apart from the quants, so that a kernel converts 16 scales
/// in one instruction and streams the quants without gaps. Block `k` of the matrix (row-major,
/// `cols / 32` per row) has scale `d[k]` and quants `qs[k·Q..(k + 1)·Q]` (`Q` = 16 bytes of
/// nibbles, or 32 signed bytes); the values are exactly GGUF's.
#[derive(Debug, Clone)]
pub struct Blocks {
    d: Vec<f16>,
    m: Vec<f16>,
    qs: Vec<u8>,
}

impl Blocks {
    /// Split GGUF blocks: a 2-byte scale, with `min` a 2-byte minimum, then `quant_bytes` bytes.
    fn from_gguf(bytes: &[u8], min: bool, quant_bytes: usize) -> Blocks {
        let head = if min { 4 } else { 2 };
        let block = head + quant_bytes;
        assert!(
            bytes.len().is_multiple_of(block),
            "invariant: GGUF data of whole {block}-byte blocks ({} bytes)",
            bytes.len()
        );
        let n = bytes.len() / block;
        let mut b = Blocks {
            d: Vec::with_capacity(n),
            m: Vec::with_capacity(if min { n } else { 0 }),
            qs: Vec::with_capacity(n * quant_bytes),
        };
        for blk in bytes.chunks_exact(block) {
            b.d.push(f16::from_le_bytes([blk[0], blk[1]]));
            if min {
                b.m.push(f16::from_le_bytes([blk[2], blk[3]]));
            }
            b.qs.extend_from_slice(&blk[head..]);
        }
        b
    }

    /// The blocks of rows `rows` (each `per_row` blocks), in that order.
    fn rows(&self, rows: &[u32], per_row: usize) -> Blocks {
        let q = self.qs.len() / self.d.len().max(1);
        let mut b = Blocks {
            d: Vec::with_capacity(rows.len() * per_row),
            m: Vec::new(),
            qs: Vec::with_capacity(rows.len() * per_row * q),
        };
        for &r in rows {
            let (a, z) = (r as usize * per_row, (r as usize + 1) * per_row);
            b.d.extend_from_slice(&self.d[a..z]);
            if !self.m.is_empty() {
                b.m.extend_from_slice(&self.m[a..z]);
            }
            b.qs.extend_from_slice(&self.qs[a * q..z * q]);
        }
        b
    }

    /// The first `n` blocks.
    fn first(&self, n: usize) -> Blocks {
        let q = self.qs.len() / self.d.len().max(1);
        Blocks {
            d: self.d[..n].to_vec(),
            m: self.m[..n.min(self.m.len())].to_vec(),
            qs: self.qs[..n * q].to_vec(),
        }
    }
}

/// Pointers to `N` rows of quantized blocks, for the SIMD kernels: each row's first scale and
/// minimum (a k-quant format: its first super-block's scale and scale of minimums, and its
/// first block's scale bytes at `sc`) and quants.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
#[derive(Clone, Copy)]
struct RowPtrs<const N: usize> {
    d: [*const f16; N],
    m: [*const f16; N],
    /// A k-quant format's super-block scales and scales of minimums (f32).
    kd: [*const f32; N],
    km: [*const f32; N],
    sc: [*const u8; N],
    q: [*const u8; N],
}

/// The rows of a task over quantized `w` (`qbytes` of quants a block; with `min`, a minimum
/// each): `rows_of(i, nr)` points at the task's rows `i..i + nr` (`nr ≤ N`, a short group
/// repeating its last row). `None` for f32 and f16 rows.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn row_ptrs<const N: usize>(
    w: &RowData,
    qbytes: usize,
    min: bool,
    cols: usize,
    r0: usize,
    n_rows: usize,
) -> impl Fn(usize, usize) -> RowPtrs<N> + '_ {
    let nb = cols / QK;
    type Parts<'a> = (
        &'a [f16],
        &'a [f16],
        &'a [f32],
        &'a [f32],
        &'a [u8],
        &'a [u8],
    );
    let (d, m, kd, km, sc, qs): Parts = match w {
        RowData::Q4_0(b) | RowData::Q4_1(b) | RowData::Q8_0(b) | RowData::Q5_0(b) => {
            (&b.d, &b.m, &[], &[], &[], &b.qs)
        }
        RowData::Q4K(b) | RowData::Q6K(b) => (&[], &[], &b.d, &b.dmin, &b.sc, &b.qs),
        RowData::F32(_) | RowData::F16(_) => panic!("invariant: quantized rows"),
    };
    let per_d = if kd.is_empty() { 1 } else { K_BLOCKS };
    let blocks = d.len() + kd.len() * K_BLOCKS;
    assert!(
        cols.is_multiple_of(QK * per_d)
            && (r0 + n_rows) * nb <= blocks
            && qs.len() == blocks * qbytes
            && (!min || m.len() + km.len() == d.len() + kd.len())
            && (per_d == 1 || sc.len() == blocks * 2),
        "invariant: whole rows of whole blocks"
    );
    move |i, nr| {
        let row = |k: usize| (r0 + i + k.min(nr - 1)) * nb;
        let at = |v: &[f16], k: usize| v.get(row(k)..).unwrap_or(&[]).as_ptr();
        let at_k = |v: &[f32], k: usize| v.get(row(k) / K_BLOCKS..).unwrap_or(&[]).as_ptr();
        RowPtrs {
            d: std::array::from_fn(|k| at(d, k)),
            m: std::array::from_fn(|k| at(m, k)),
            kd: std::array::from_fn(|k| at_k(kd, k)),
            km: std::array::from_fn(|k| at_k(km, k)),
            sc: std::array::from_fn(|k| sc.get(row(k) * 2..).unwrap_or(&[]).as_ptr()),
            q: std::array::from_fn(|k| qs[row(k) * qbytes..].as_ptr()),
        }
    }
}

impl RowData {
    /// Rows `rows` of this `cols`-wide matrix, in that order, in its format: the same values.
    pub fn select_rows(&self, rows: &[u32], cols: usize) -> RowData {
        match self {
            RowData::F32(_) => {
                let mut w = vec![0f32; rows.len() * cols];
                for (out, &r) in w.chunks_exact_mut(cols).zip(rows) {
                    dequantize_row(self, r as usize, cols, out);
                }
                RowData::f32(&w, rows.len(), cols)
            }
            RowData::F16(d) => RowData::F16(
                rows.iter()
                    .flat_map(|&r| &d[r as usize * cols..(r as usize + 1) * cols])
                    .copied()
                    .collect(),
            ),
            RowData::Q4_0(b) => RowData::Q4_0(b.rows(rows, cols / QK)),
            RowData::Q4_1(b) => RowData::Q4_1(b.rows(rows, cols / QK)),
            RowData::Q8_0(b) => RowData::Q8_0(b.rows(rows, cols / QK)),
            RowData::Q5_0(b) => RowData::Q5_0(b.rows(rows, cols / QK)),
            RowData::Q4K(b) => RowData::Q4K(b.rows(rows, cols / QK_K)),
            RowData::Q6K(b) => RowData::Q6K(b.rows(rows, cols / QK_K)),
        }
    }

    /// f32 rows from row-major `w: [rows, cols]`.
    pub fn f32(w: &[f32], rows: usize, cols: usize) -> RowData {
        RowData::F32(Panels::from_rows(w, rows, cols))
    }

    /// Q4_0 rows from GGUF's 18-byte blocks.
    pub fn q4_0(gguf: &[u8]) -> RowData {
        RowData::Q4_0(Blocks::from_gguf(gguf, false, 16))
    }

    /// Q4_1 rows from GGUF's 20-byte blocks.
    pub fn q4_1(gguf: &[u8]) -> RowData {
        RowData::Q4_1(Blocks::from_gguf(gguf, true, 16))
    }

    /// Q8_0 rows from GGUF's 34-byte blocks.
    pub fn q8_0(gguf: &[u8]) -> RowData {
        RowData::Q8_0(Blocks::from_gguf(gguf, false, 32))
    }

    /// Q5_0 rows from GGUF's 22-byte blocks.
    pub fn q5_0(gguf: &[u8]) -> RowData {
        RowData::Q5_0(Blocks::from_gguf(gguf, false, 20))
    }

    /// Q4_K rows from GGUF's 144-byte super-blocks.
    pub fn q4_k(gguf: &[u8]) -> RowData {
        RowData::Q4K(SuperBlocks::from_gguf(gguf, KFormat::Q4K))
    }

    /// Q6_K rows from GGUF's 210-byte super-blocks.
    pub fn q6_k(gguf: &[u8]) -> RowData {
        RowData::Q6K(SuperBlocks::from_gguf(gguf, KFormat::Q6K))
    }

    /// Bytes of one stored row of `cols` weights.
    pub fn row_bytes(&self, cols: usize) -> usize {
        match self {
            RowData::F32(_) => cols * 4,
            RowData::F16(_) => cols * 2,
            RowData::Q4_0(_) => cols / QK * 18,
            RowData::Q4_1(_) => cols / QK * 20,
            RowData::Q8_0(_) => cols / QK * 34,
            RowData::Q5_0(_) => cols / QK * 22,
            RowData::Q4K(_) => cols / QK_K * 152,
            RowData::Q6K(_) => cols / QK_K * 212,
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            RowData::F32(_) => "f32",
            RowData::F16(_) => "f16",
            RowData::Q4_0(_) => "q4_0",
            RowData::Q4_1(_) => "q4_1",
            RowData::Q8_0(_) => "q8_0",
            RowData::Q5_0(_) => "q5_0",
            RowData::Q4K(_) => "q4_k",
            RowData::Q6K(_) => "q6_k",
        }
    }

    /// The first `rows` rows (`cols` wide).
    pub fn first_rows(&self, rows: usize, cols: usize) -> RowData {
        let (n, b) = (rows * cols, rows * cols / QK);
        match self {
            RowData::F32(p) => RowData::F32(Panels(p.0[..rows.div_ceil(PANEL) * cols].to_vec())),
            RowData::F16(v) => RowData::F16(v[..n].to_vec()),
            RowData::Q4_0(q) => RowData::Q4_0(q.first(b)),
            RowData::Q4_1(q) => RowData::Q4_1(q.first(b)),
            RowData::Q8_0(q) => RowData::Q8_0(q.first(b)),
            RowData::Q5_0(q) => RowData::Q5_0(q.first(b)),
            RowData::Q4K(q) => RowData::Q4K(q.first(n / QK_K)),
            RowData::Q6K(q) => RowData::Q6K(q.first(n / QK_K)),
        }
    }
}

#[inline(always)]
fn fold(acc: &[f32; LANES]) -> f32 {
    let mut a = *acc;
    let mut w = LANES / 2;
    while w > 0 {
        for i in 0..w {
            a[i] += a[i + w];
        }
        w /= 2;
    }
    a[0]
}

/// Dot products of one f32 weight row with `N` token rows. Element `i` always lands in lane
/// `i % LANES`, fused into it in increasing `i`, whatever `N`.
#[inline(always)]
fn dot_rows<const N: usize>(w: &[f32], xs: [&[f32]; N]) -> [f32; N] {
    let cols = w.len();
    for x in &xs {
        assert!(
            x.len() == cols,
            "invariant: token rows are as wide as the weight row"
        );
    }
    let mut acc = [[0f32; LANES]; N];
    let full = cols / LANES * LANES;
    let mut c = 0;
    while c < full {
        let wc: &[f32; LANES] = w[c..c + LANES].try_into().expect("invariant: in bounds");
        for t in 0..N {
            let xc: &[f32; LANES] = xs[t][c..c + LANES]
                .try_into()
                .expect("invariant: in bounds");
            for l in 0..LANES {
                acc[t][l] = wc[l].mul_add(xc[l], acc[t][l]);
            }
        }
        c += LANES;
    }
    for i in full..cols {
        for t in 0..N {
            acc[t][i - full] = w[i].mul_add(xs[t][i], acc[t][i - full]);
        }
    }
    let mut out = [0f32; N];
    for t in 0..N {
        out[t] = fold(&acc[t]);
    }
    out
}

/// The quants of one block format: `QBYTES` bytes decode to 32 integer codes.
trait Block {
    const QBYTES: usize;
    /// The block's integer codes as exact f32 values (centred for symmetric formats).
    fn codes(q: &[u8]) -> [f32; QK];
}

/// Q4_0: 16 bytes of nibbles, element `l` in the low nibble of byte `l`, element `16 + l` in its
/// high nibble; centred by 8.
struct BQ4_0;
/// Q4_1: the nibbles as Q4_0, not centred.
struct BQ4_1;
/// Q8_0: 32 signed bytes.
struct BQ8_0;

/// Q5_0: 4 bytes of high bits (element `i`'s at bit `i` of the little-endian word), then the
/// nibbles as Q4_0; centred by 16.
struct BQ5_0;

impl Block for BQ5_0 {
    const QBYTES: usize = 20;
    #[inline(always)]
    fn codes(b: &[u8]) -> [f32; QK] {
        q5_0_codes(b).map(|c| f32::from(c) - 16.0)
    }
}

/// A Q5_0 block's 32 unsigned 5-bit codes (uncentred) from its 20 bytes of quants.
#[inline(always)]
fn q5_0_codes(b: &[u8]) -> [u8; QK] {
    let b: &[u8; 20] = b.try_into().expect("invariant: whole block");
    let qh = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    std::array::from_fn(|i| {
        let lo = if i < 16 {
            b[4 + i] & 0x0f
        } else {
            b[4 + i - 16] >> 4
        };
        lo | (((qh >> i) & 1) << 4) as u8
    })
}

impl Block for BQ4_0 {
    const QBYTES: usize = 16;
    #[inline(always)]
    fn codes(b: &[u8]) -> [f32; QK] {
        let b: &[u8; 16] = b.try_into().expect("invariant: whole block");
        let mut q = [0f32; QK];
        for l in 0..16 {
            q[l] = (b[l] & 0x0f) as f32 - 8.0;
            q[16 + l] = (b[l] >> 4) as f32 - 8.0;
        }
        q
    }
}

impl Block for BQ4_1 {
    const QBYTES: usize = 16;
    #[inline(always)]
    fn codes(b: &[u8]) -> [f32; QK] {
        let b: &[u8; 16] = b.try_into().expect("invariant: whole block");
        let mut q = [0f32; QK];
        for l in 0..16 {
            q[l] = (b[l] & 0x0f) as f32;
            q[16 + l] = (b[l] >> 4) as f32;
        }
        q
    }
}

impl Block for BQ8_0 {
    const QBYTES: usize = 32;
    #[inline(always)]
    fn codes(b: &[u8]) -> [f32; QK] {
        let b: &[u8; 32] = b.try_into().expect("invariant: whole block");
        let mut q = [0f32; QK];
        for l in 0..QK {
            q[l] = b[l] as i8 as f32;
        }
        q
    }
}

/// Dequantize row `row` (`cols` wide) into `out` block by block: `w = d·q + m` in f32 (`m` = 0
/// for the formats without a minimum).
#[inline(always)]
fn deq_row<B: Block>(b: &Blocks, row: usize, cols: usize, out: &mut [f32]) {
    let k0 = row * (cols / QK);
    for (j, o) in out[..cols].chunks_exact_mut(QK).enumerate() {
        let k = k0 + j;
        let q = B::codes(&b.qs[k * B::QBYTES..(k + 1) * B::QBYTES]);
        let s = b.d[k].to_f32();
        let m = b.m.get(k).map_or(0.0, |m| m.to_f32());
        for l in 0..QK {
            o[l] = s * q[l] + m;
        }
    }
}

/// One task's share of a matmul's output `y[t, r]` (`rows` wide, `n_tok` tokens): rows
/// `r0..r0 + n`. The tasks of one matmul write disjoint rows of the same buffer, in place, so
/// this holds a pointer; [`RowsOut::put`] checks every write against the task's rows.
pub(crate) struct RowsOut<'a> {
    y: *mut f32,
    rows: usize,
    n_tok: usize,
    r0: usize,
    n: usize,
    _y: std::marker::PhantomData<&'a mut [f32]>,
}

impl RowsOut<'_> {
    /// First output row.
    fn r0(&self) -> usize {
        self.r0
    }

    /// Output rows of this task.
    fn n_rows(&self) -> usize {
        self.n
    }

    fn n_tok(&self) -> usize {
        self.n_tok
    }

    /// Where `y[t, r0 + i .. r0 + i + n]` lies, to be written (`n` floats, contiguous).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    #[inline(always)]
    fn span(&mut self, i: usize, t: usize, n: usize) -> *mut f32 {
        assert!(
            i + n <= self.n && t < self.n_tok,
            "invariant: a task writes its own rows"
        );
        // SAFETY: in bounds of `y` (checked against the task's rows).
        unsafe { self.y.add(t * self.rows + self.r0 + i) }
    }

    /// `y[t, r0 + i] = v`.
    #[inline(always)]
    fn put(&mut self, i: usize, t: usize, v: f32) {
        assert!(
            i < self.n && t < self.n_tok,
            "invariant: a task writes its own rows"
        );
        // SAFETY: in bounds (checked), and no other task writes row r0 + i (`matmul_on`).
        unsafe { *self.y.add(t * self.rows + self.r0 + i) = v };
    }
}

/// `y`'s base pointer, shared by the tasks of one matmul (see [`RowsOut`]).
#[derive(Clone, Copy)]
struct SharedOut(*mut f32);
// SAFETY: the tasks that share it write disjoint rows.
unsafe impl Send for SharedOut {}
// SAFETY: as above.
unsafe impl Sync for SharedOut {}

impl SharedOut {
    /// The pointer (a method, so that closures capture the whole `Sync` wrapper).
    fn ptr(&self) -> *mut f32 {
        self.0
    }
}

/// One task: rows `out.r0()..` of the output. f32 panels are
/// summed column by column (see [`Panels`]). Any other stored row is dequantized once into an
/// f32 scratch row (in L1; W4A16: `w = d·(q − 8)` in f32) and dotted with the tile's tokens four
/// at a time, so weights are read from memory once per call however many tokens share it.
#[inline(always)]
fn rows_task(w: &RowData, cols: usize, x: &[f32], out: &mut RowsOut) {
    let (n_rows, n_tok, r0) = (out.n_rows(), out.n_tok(), out.r0());
    let xr = |t: usize| &x[t * cols..(t + 1) * cols];
    if let RowData::F32(p) = w {
        return panel_rows(p, cols, x, out);
    }
    let mut scratch = vec![0f32; cols];
    for t0 in (0..n_tok).step_by(TOKEN_TILE) {
        let t1 = (t0 + TOKEN_TILE).min(n_tok);
        for i in 0..n_rows {
            dequantize_row_inline(w, r0 + i, cols, &mut scratch);
            let wr: &[f32] = &scratch;
            let mut t = t0;
            while t < t1 {
                // Only the tokens there are (a lone token costs one dot, not four).
                let n = (t1 - t).min(TOKENS_PER_PASS);
                let mut v = [0f32; TOKENS_PER_PASS];
                match n {
                    1 => v[..1].copy_from_slice(&dot_rows::<1>(wr, [xr(t)])),
                    2 => v[..2].copy_from_slice(&dot_rows::<2>(wr, [xr(t), xr(t + 1)])),
                    3 => v[..3].copy_from_slice(&dot_rows::<3>(wr, [xr(t), xr(t + 1), xr(t + 2)])),
                    _ => v.copy_from_slice(&dot_rows::<4>(
                        wr,
                        [xr(t), xr(t + 1), xr(t + 2), xr(t + 3)],
                    )),
                }
                for (k, &v) in v[..n].iter().enumerate() {
                    out.put(i, t + k, v);
                }
                t += n;
            }
        }
    }
}

/// [`rows_task`] over f32 panels: for each output, a running sum over `k` in order (one fused
/// multiply-add a step), four tokens per pass over the panel.
#[inline(always)]
fn panel_rows(p: &Panels, cols: usize, x: &[f32], out: &mut RowsOut) {
    let (n_rows, n_tok, r0) = (out.n_rows(), out.n_tok(), out.r0());
    assert!(
        r0.is_multiple_of(PANEL) && (r0 + n_rows).div_ceil(PANEL) * cols <= p.0.len(),
        "invariant: tasks start at a panel, within the matrix"
    );
    for pr in (0..n_rows).step_by(PANEL) {
        let panel = p.panel(r0 + pr, cols);
        for t0 in (0..n_tok).step_by(TOKENS_PER_PASS) {
            let nt = (n_tok - t0).min(TOKENS_PER_PASS);
            // Absent tokens repeat the last one; their sums are dropped.
            let xs: [&[f32]; TOKENS_PER_PASS] = std::array::from_fn(|k| {
                let t = t0 + k.min(nt - 1);
                &x[t * cols..(t + 1) * cols]
            });
            let mut acc = [[0f32; PANEL]; TOKENS_PER_PASS];
            for (k, wk) in panel.iter().enumerate() {
                for (a, xt) in acc.iter_mut().zip(&xs) {
                    let xv = xt[k];
                    for (a, &w) in a.iter_mut().zip(&wk.0) {
                        *a = w.mul_add(xv, *a);
                    }
                }
            }
            for (k, a) in acc.iter().enumerate().take(nt) {
                for (j, &v) in a.iter().enumerate().take(n_rows - pr) {
                    out.put(pr + j, t0 + k, v);
                }
            }
        }
    }
}

/// The instruction sets the matmul kernels have a path for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Isa {
    /// Plain Rust, the reference: fused multiply-adds through `f32::mul_add` (a library call
    /// where the build target has no FMA instruction: slow, but the same bits).
    Portable,
    /// AVX2, FMA and F16C kernels: panel tiles for f32, register tiles of 4 rows × 1 token or
    /// 2 rows × 3 tokens for quantized and f16 rows.
    Avx2,
    /// AVX-512F and FMA kernels: a panel GEMM for f32, 4 × 4 register tiles for quantized and
    /// f16 rows.
    Avx512,
}

impl Isa {
    /// Every path this CPU can run, slowest first.
    pub fn available() -> Vec<Isa> {
        let mut v = vec![Isa::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
                && std::arch::is_x86_feature_detected!("f16c")
            {
                v.push(Isa::Avx2);
            }
            if std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("fma")
            {
                v.push(Isa::Avx512);
            }
        }
        v
    }

    /// The path matmuls take: the fastest available, or the one named by `TANDEM_KERNELS`
    /// (`portable`, `avx2`, `avx512`) when this CPU can run it. Fixed for the process, so that
    /// every forward computes every output the same way.
    pub fn selected() -> Isa {
        static SELECTED: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
        *SELECTED.get_or_init(|| {
            let avail = Isa::available();
            let best = *avail.last().expect("invariant: portable is always there");
            match std::env::var("TANDEM_KERNELS").ok().as_deref() {
                None | Some("") => best,
                Some(name) => match avail.iter().find(|i| i.name() == name) {
                    Some(&i) => i,
                    None => {
                        tracing::warn!(
                            "TANDEM_KERNELS={name}: not a kernel path this CPU runs (have {:?}); using {}",
                            avail, best.name()
                        );
                        best
                    }
                },
            }
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }
}

fn rows_task_on(isa: Isa, w: &RowData, cols: usize, x: &[f32], out: &mut RowsOut) {
    #[cfg(target_arch = "x86_64")]
    match isa {
        Isa::Avx512 => {
            assert!(
                std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("fma"),
                "invariant: AVX-512 chosen on a CPU with it"
            );
            // SAFETY: the CPU supports AVX-512F and FMA (checked just above).
            return unsafe { avx512::rows_task(w, cols, x, out) };
        }
        Isa::Avx2 => {
            assert!(
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                    && std::arch::is_x86_feature_detected!("f16c"),
                "invariant: AVX2 chosen on a CPU with it"
            );
            // SAFETY: the CPU supports AVX2, FMA and F16C (checked just above).
            return unsafe { avx2::rows_task(w, cols, x, out) };
        }
        Isa::Portable => {}
    }
    let _ = isa;
    rows_task(w, cols, x, out)
}

/// `y[t, r] = Σ_i W[r, i]·x[t, i]` for `x: [n_tok, cols]`, `W: [rows, cols]`, `y: [n_tok, rows]`.
/// Runs on the current rayon pool, parallel over output rows, on the [`Isa::selected`] path.
pub fn matmul(w: &RowData, rows: usize, cols: usize, x: &[f32], n_tok: usize, y: &mut [f32]) {
    matmul_on(Isa::selected(), w, rows, cols, x, n_tok, y)
}

/// [`matmul`] on a given path (which this CPU must run: see [`Isa::available`]).
pub fn matmul_on(
    isa: Isa,
    w: &RowData,
    rows: usize,
    cols: usize,
    x: &[f32],
    n_tok: usize,
    y: &mut [f32],
) {
    assert!(
        x.len() == n_tok * cols && y.len() == n_tok * rows,
        "invariant: x is [n_tok, cols] and y [n_tok, rows]"
    );
    for_each_task(rows, n_tok, y, |out| rows_task_on(isa, w, cols, x, out));
}

/// Split the output `y: [n_tok, rows]` into tasks of [`ROWS_PER_TASK`] rows and run `task` on
/// each, in parallel on the current rayon pool.
fn for_each_task(rows: usize, n_tok: usize, y: &mut [f32], task: impl Fn(&mut RowsOut) + Sync) {
    assert_eq!(y.len(), n_tok * rows, "invariant: y is [n_tok, rows]");
    let shared = SharedOut(y.as_mut_ptr());
    (0..rows.div_ceil(ROWS_PER_TASK))
        .into_par_iter()
        .for_each(|c| {
            let r0 = c * ROWS_PER_TASK;
            // Each task writes rows r0..r0 + n only; `y` stays borrowed until they all return.
            let mut out = RowsOut {
                y: shared.ptr(),
                rows,
                n_tok,
                r0,
                n: ROWS_PER_TASK.min(rows - r0),
                _y: std::marker::PhantomData,
            };
            task(&mut out)
        });
}

/// Row `row` of the matrix as f32 (embedding lookup).
pub fn dequantize_row(w: &RowData, row: usize, cols: usize, out: &mut [f32]) {
    dequantize_row_inline(w, row, cols, out)
}

#[inline(always)]
fn dequantize_row_inline(w: &RowData, row: usize, cols: usize, out: &mut [f32]) {
    let out = &mut out[..cols];
    match w {
        RowData::F32(p) => p.row(row, cols, out),
        RowData::F16(d) => {
            for (o, v) in out.iter_mut().zip(&d[row * cols..(row + 1) * cols]) {
                *o = v.to_f32();
            }
        }
        RowData::Q4_0(b) => deq_row::<BQ4_0>(b, row, cols, out),
        RowData::Q4_1(b) => deq_row::<BQ4_1>(b, row, cols, out),
        RowData::Q8_0(b) => deq_row::<BQ8_0>(b, row, cols, out),
        RowData::Q5_0(b) => deq_row::<BQ5_0>(b, row, cols, out),
        RowData::Q4K(b) => deq_k_row(b, KFormat::Q4K, row, cols, out),
        RowData::Q6K(b) => deq_k_row(b, KFormat::Q6K, row, cols, out),
    }
}

/// `LANES`-way dot product (element `i` in lane `i % LANES`, the lanes folded as the matmuls
/// fold theirs), a multiply and an add a step: for the attention's scores and the norms, which
/// run the same code on every path.
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    dot_inline(a, b)
}

#[inline(always)]
fn dot_inline(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        let x: &[f32; LANES] = x.try_into().expect("invariant: exact chunk");
        let y: &[f32; LANES] = y.try_into().expect("invariant: exact chunk");
        for l in 0..LANES {
            acc[l] += x[l] * y[l];
        }
    }
    for (l, (x, y)) in ra.iter().zip(rb).enumerate() {
        acc[l] += x * y;
    }
    fold(&acc)
}

/// [`dot`] on a given path (which this CPU must run): the same bits in vectors.
#[inline(always)]
pub fn dot_on(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Portable {
        // SAFETY: a SIMD path is selected (or asked for) only on a CPU with AVX2.
        return unsafe { avx2::dot16(a, b) };
    }
    let _ = isa;
    dot_inline(a, b)
}

/// [`dot_on`] of `q` with each of four rows, bit for bit.
#[inline(always)]
pub fn dots4_on(isa: Isa, q: &[f32], k: [&[f32]; 4]) -> [f32; 4] {
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Portable {
        // SAFETY: a SIMD path is selected (or asked for) only on a CPU with AVX2.
        return unsafe { avx2::dots4(q, k) };
    }
    let _ = isa;
    k.map(|k| dot_inline(q, k))
}

/// RMS norm of each row of `x: [n, dim]` times `weight`, written to `out`.
#[inline(always)]
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let dim = weight.len();
    for (xr, or) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
        let ms = dot(xr, xr) / dim as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        for ((o, &v), &w) in or.iter_mut().zip(xr).zip(weight) {
            *o = v * inv * w;
        }
    }
}

/// [`rms_norm`] of `x`'s rows written over them (the same bits).
#[inline(always)]
pub fn rms_norm_in_place(x: &mut [f32], weight: &[f32], eps: f32) {
    let dim = weight.len();
    for xr in x.chunks_exact_mut(dim) {
        let ms = dot(xr, xr) / dim as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        for (v, &w) in xr.iter_mut().zip(weight) {
            *v = *v * inv * w;
        }
    }
}

/// `gate ← gelu(gate) · up`, elementwise, GELU in its tanh form
/// (`½x(1 + tanh(√(2/π)(x + 0.044715x³)))`, as Gemma is trained), `tanh y = 1 − 2/(e^{2y} + 1)`
/// with [`exp`]: the same bits on every path.
#[inline(always)]
pub fn gelu_mul(gate: &mut [f32], up: &[f32]) {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    for (g, &u) in gate.iter_mut().zip(up) {
        let x = *g;
        let y = SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x);
        let tanh = 1.0 - 2.0 / (exp(2.0 * y) + 1.0);
        *g = 0.5 * x * (1.0 + tanh) * u;
    }
}

/// `gate ← silu(gate) · up`, elementwise.
#[inline(always)]
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + exp(-*g)) * u;
    }
}

/// `e^x` in f32, within 2 ulp for normal results; 0 below −87.3, `e^88` (finite) above 88;
/// NaN stays NaN. Branch-free plain arithmetic, so a loop of it vectorizes, and every
/// build computes the same bits (no library call whose version could differ).
///
/// `x = n·ln 2 + r` with `|r| ≤ ln 2 / 2` (ln 2 in two parts, so `r` is exact), `e^r` by a
/// degree-7 polynomial (Taylor's to `r⁷/7!`), and `2^n` put in the exponent bits.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 in two parts: LN2_HI = 355/512 has 9 significant bits, so n·LN2_HI is exact.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding then subtracting 1.5·2^23 rounds to the nearest integer (|v| < 2^22).
    const ROUND: f32 = 12_582_912.0;
    let under = x < -87.3;
    let x = x.clamp(-87.3, 88.0);
    let n = (x * LOG2E + ROUND) - ROUND;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let mut p = 1.0 / 5040.0;
    for c in [
        1.0 / 720.0,
        1.0 / 120.0,
        1.0 / 24.0,
        1.0 / 6.0,
        0.5,
        1.0,
        1.0,
    ] {
        p = p * r + c;
    }
    let two_n = f32::from_bits(((n as i32 + 127) as u32) << 23);
    if under {
        0.0
    } else {
        p * two_n
    }
}

#[cfg(test)]
mod tests;
