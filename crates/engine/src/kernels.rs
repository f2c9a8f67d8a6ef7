//! CPU kernels for the weight matmuls: f32 / f16 dense rows and W4A16 / W8A16 rows stored in GGUF's
//! 32-element blocks (Q4_0, Q4_1, Q8_0), dequantized in registers and multiplied with f32
//! activations (activations are never quantized here; that is `WeightMode::W4A8`).
//!
//! **Batch invariance.** Each weight row is first dequantized to f32 (`w = d·(q − 8)` etc.; a no-op
//! for f32 rows), then every output element `y[t, r] = Σ_i W[r, i]·x[t, i]` is reduced in one fixed
//! order that depends only on the reduction length `k`: `LANES` running sums, each walking the row
//! with stride `LANES`, folded by a fixed pairwise tree. Every token uses the same code whatever the
//! number of tokens in the call, and Rust never contracts `a*b+c` into an FMA, so the AVX2 and
//! portable paths give bitwise-equal results. A sequence's logits are therefore identical
//! whether it runs alone or inside a ragged batch, which is what makes greedy verification exact
//! under any batch composition.

use half::f16;
use rayon::prelude::*;

/// Parallel running sums per reduction.
pub const LANES: usize = 16;
/// Elements per GGUF quant block (Q4_0, Q4_1, Q8_0).
pub const QK: usize = 32;
/// Output rows per parallel task.
const ROWS_PER_TASK: usize = 16;
/// Tokens kept hot in cache while a task walks its rows.
const TOKEN_TILE: usize = 64;

/// The storage of one weight matrix `[rows, cols]`, row-major.
#[derive(Debug, Clone)]
pub enum RowData {
    F32(Vec<f32>),
    F16(Vec<f16>),
    /// GGUF Q4_0 blocks: f16 scale `d`, 16 bytes of nibbles; w = d·(q − 8).
    Q4_0(Vec<u8>),
    /// GGUF Q4_1 blocks: f16 scale `d`, f16 minimum `m`, 16 bytes of nibbles; w = d·q + m.
    Q4_1(Vec<u8>),
    /// GGUF Q8_0 blocks: f16 scale `d`, 32 signed bytes; w = d·q.
    Q8_0(Vec<u8>),
}

impl RowData {
    /// Bytes of one stored row of `cols` weights.
    pub fn row_bytes(&self, cols: usize) -> usize {
        match self {
            RowData::F32(_) => cols * 4,
            RowData::F16(_) => cols * 2,
            RowData::Q4_0(_) => cols / QK * 18,
            RowData::Q4_1(_) => cols / QK * 20,
            RowData::Q8_0(_) => cols / QK * 34,
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            RowData::F32(_) => "f32",
            RowData::F16(_) => "f16",
            RowData::Q4_0(_) => "q4_0",
            RowData::Q4_1(_) => "q4_1",
            RowData::Q8_0(_) => "q8_0",
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

#[inline(always)]
fn h(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// One stored row, as the block loop reads it (f16 rows are converted to f32 first).
#[derive(Clone, Copy)]
enum Row<'a> {
    F32(&'a [f32]),
    Q4_0(&'a [u8]),
    Q4_1(&'a [u8]),
    Q8_0(&'a [u8]),
}

/// The f32 values of block `b` (32 weights) of a row.
#[inline(always)]
fn block(row: Row, b: usize) -> [f32; QK] {
    let mut o = [0f32; QK];
    match row {
        Row::F32(rowf) => o.copy_from_slice(&rowf[b * QK..b * QK + QK]),
        Row::Q4_0(row) => {
            let blk: &[u8; 18] = row[b * 18..b * 18 + 18]
                .try_into()
                .expect("invariant: block");
            let s = h(blk, 0);
            for l in 0..16 {
                o[l] = s * ((blk[2 + l] & 0x0f) as f32 - 8.0);
                o[16 + l] = s * ((blk[2 + l] >> 4) as f32 - 8.0);
            }
        }
        Row::Q4_1(row) => {
            let blk: &[u8; 20] = row[b * 20..b * 20 + 20]
                .try_into()
                .expect("invariant: block");
            let (s, m) = (h(blk, 0), h(blk, 2));
            for l in 0..16 {
                o[l] = s * (blk[4 + l] & 0x0f) as f32 + m;
                o[16 + l] = s * (blk[4 + l] >> 4) as f32 + m;
            }
        }
        Row::Q8_0(row) => {
            let blk: &[u8; 34] = row[b * 34..b * 34 + 34]
                .try_into()
                .expect("invariant: block");
            let s = h(blk, 0);
            for l in 0..QK {
                o[l] = s * blk[2 + l] as i8 as f32;
            }
        }
    }
    o
}

/// Dot products of one weight row with `N` token rows. Element `i` of the row always lands in lane
/// `i % LANES`, added in increasing `i`: the same order as [`dot`], whatever `N`.
#[inline(always)]
fn dot_rows<const N: usize>(row: Row, cols: usize, xs: [&[f32]; N]) -> [f32; N] {
    let mut acc = [[0f32; LANES]; N];
    let full = cols / QK;
    for b in 0..full {
        let wb = block(row, b);
        for t in 0..N {
            let x: &[f32; QK] = xs[t][b * QK..b * QK + QK]
                .try_into()
                .expect("invariant: block");
            for l in 0..LANES {
                acc[t][l] += wb[l] * x[l];
            }
            for l in 0..LANES {
                acc[t][l] += wb[LANES + l] * x[LANES + l];
            }
        }
    }
    // Tail (f32 rows only; quantized rows are whole blocks).
    if let Row::F32(rowf) = row {
        for i in full * QK..cols {
            for t in 0..N {
                acc[t][i % LANES] += rowf[i] * xs[t][i];
            }
        }
    }
    let mut out = [0f32; N];
    for t in 0..N {
        out[t] = fold(&acc[t]);
    }
    out
}

/// One task: rows `r0..r0+yt.len()/n_tok` of the transposed output `yt[r, t]`, tokens in tiles
/// that stay in cache, four tokens per pass over a weight row.
#[inline(always)]
fn rows_task(w: &RowData, cols: usize, x: &[f32], n_tok: usize, r0: usize, yt: &mut [f32]) {
    let n_rows = yt.len() / n_tok;
    let mut conv = Vec::new();
    for t0 in (0..n_tok).step_by(TOKEN_TILE) {
        let t1 = (t0 + TOKEN_TILE).min(n_tok);
        for i in 0..n_rows {
            let r = r0 + i;
            let rb = w.row_bytes(cols);
            let row = match w {
                RowData::F32(d) => Row::F32(&d[r * cols..(r + 1) * cols]),
                RowData::F16(_) => {
                    conv.resize(cols, 0.0);
                    dequantize_row_inline(w, r, cols, &mut conv);
                    Row::F32(&conv)
                }
                RowData::Q4_0(d) => Row::Q4_0(&d[r * rb..(r + 1) * rb]),
                RowData::Q4_1(d) => Row::Q4_1(&d[r * rb..(r + 1) * rb]),
                RowData::Q8_0(d) => Row::Q8_0(&d[r * rb..(r + 1) * rb]),
            };
            let yr = &mut yt[i * n_tok..(i + 1) * n_tok];
            let xr = |t: usize| &x[t * cols..(t + 1) * cols];
            let mut t = t0;
            while t + 4 <= t1 {
                let o = dot_rows::<4>(row, cols, [xr(t), xr(t + 1), xr(t + 2), xr(t + 3)]);
                yr[t..t + 4].copy_from_slice(&o);
                t += 4;
            }
            while t < t1 {
                yr[t] = dot_rows::<1>(row, cols, [xr(t)])[0];
                t += 1;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn rows_task_avx2(
    w: &RowData,
    cols: usize,
    x: &[f32],
    n_tok: usize,
    r0: usize,
    yt: &mut [f32],
) {
    rows_task(w, cols, x, n_tok, r0, yt)
}

fn rows_task_dispatch(
    w: &RowData,
    cols: usize,
    x: &[f32],
    n_tok: usize,
    r0: usize,
    yt: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above).
        return unsafe { rows_task_avx2(w, cols, x, n_tok, r0, yt) };
    }
    rows_task(w, cols, x, n_tok, r0, yt)
}

/// `y[t, r] = Σ_i W[r, i]·x[t, i]` for `x: [n_tok, cols]`, `W: [rows, cols]`, `y: [n_tok, rows]`.
/// Runs on the current rayon pool, parallel over output rows.
pub fn matmul(w: &RowData, rows: usize, cols: usize, x: &[f32], n_tok: usize, y: &mut [f32]) {
    debug_assert_eq!(x.len(), n_tok * cols);
    debug_assert_eq!(y.len(), n_tok * rows);
    if n_tok == 1 {
        y.par_chunks_mut(ROWS_PER_TASK)
            .enumerate()
            .for_each(|(c, yc)| rows_task_dispatch(w, cols, x, 1, c * ROWS_PER_TASK, yc));
        return;
    }
    let mut yt = vec![0f32; rows * n_tok];
    yt.par_chunks_mut(ROWS_PER_TASK * n_tok)
        .enumerate()
        .for_each(|(c, yc)| rows_task_dispatch(w, cols, x, n_tok, c * ROWS_PER_TASK, yc));
    for r in 0..rows {
        for t in 0..n_tok {
            y[t * rows + r] = yt[r * n_tok + t];
        }
    }
}

/// Row `row` of the matrix as f32 (embedding lookup).
pub fn dequantize_row(w: &RowData, row: usize, cols: usize, out: &mut [f32]) {
    dequantize_row_inline(w, row, cols, out)
}

#[inline(always)]
fn dequantize_row_inline(w: &RowData, row: usize, cols: usize, out: &mut [f32]) {
    let out = &mut out[..cols];
    match w {
        RowData::F32(d) => out.copy_from_slice(&d[row * cols..(row + 1) * cols]),
        RowData::F16(d) => {
            for (o, v) in out.iter_mut().zip(&d[row * cols..(row + 1) * cols]) {
                *o = v.to_f32();
            }
        }
        RowData::Q4_0(d) => {
            let rb = cols / QK * 18;
            for (blk, o) in d[row * rb..(row + 1) * rb]
                .chunks_exact(18)
                .zip(out.chunks_exact_mut(QK))
            {
                let s = h(blk, 0);
                let q: &[u8; 16] = blk[2..18].try_into().expect("invariant: 18-byte block");
                let o: &mut [f32; QK] = o.try_into().expect("invariant: 32-float block");
                for l in 0..16 {
                    o[l] = s * ((q[l] & 0x0f) as f32 - 8.0);
                    o[16 + l] = s * ((q[l] >> 4) as f32 - 8.0);
                }
            }
        }
        RowData::Q4_1(d) => {
            let rb = cols / QK * 20;
            for (blk, o) in d[row * rb..(row + 1) * rb]
                .chunks_exact(20)
                .zip(out.chunks_exact_mut(QK))
            {
                let (s, m) = (h(blk, 0), h(blk, 2));
                let q: &[u8; 16] = blk[4..20].try_into().expect("invariant: 20-byte block");
                let o: &mut [f32; QK] = o.try_into().expect("invariant: 32-float block");
                for l in 0..16 {
                    o[l] = s * (q[l] & 0x0f) as f32 + m;
                    o[16 + l] = s * (q[l] >> 4) as f32 + m;
                }
            }
        }
        RowData::Q8_0(d) => {
            let rb = cols / QK * 34;
            for (blk, o) in d[row * rb..(row + 1) * rb]
                .chunks_exact(34)
                .zip(out.chunks_exact_mut(QK))
            {
                let s = h(blk, 0);
                let q: &[u8; QK] = blk[2..34].try_into().expect("invariant: 34-byte block");
                let o: &mut [f32; QK] = o.try_into().expect("invariant: 32-float block");
                for l in 0..QK {
                    o[l] = s * q[l] as i8 as f32;
                }
            }
        }
    }
}

/// `LANES`-way dot product in the fixed order every matmul output uses.
#[inline]
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

/// RMS norm of each row of `x: [n, dim]` times `weight`, written to `out`.
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

/// `gate ← silu(gate) · up`, elementwise.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Tensor};

    fn rand(seed: u64, n: usize) -> Vec<f32> {
        (0..n as u64)
            .map(|i| crate::sampler::uniform(seed, i, 3) as f32 * 2.0 - 1.0)
            .collect()
    }

    fn stored(dtype: GgmlDType, w: &[f32], rows: usize, cols: usize) -> RowData {
        match dtype {
            GgmlDType::F32 => RowData::F32(w.to_vec()),
            GgmlDType::F16 => RowData::F16(w.iter().map(|&x| f16::from_f32(x)).collect()),
            _ => {
                let t = Tensor::from_slice(w, (rows, cols), &Device::Cpu).unwrap();
                let q = QTensor::quantize(&t, dtype).unwrap();
                let b = q.data().unwrap().into_owned();
                match dtype {
                    GgmlDType::Q4_0 => RowData::Q4_0(b),
                    GgmlDType::Q4_1 => RowData::Q4_1(b),
                    _ => RowData::Q8_0(b),
                }
            }
        }
    }

    /// Plain reference: dequantize each row, then an f64 dot.
    fn reference(w: &RowData, rows: usize, cols: usize, x: &[f32], n_tok: usize) -> Vec<f64> {
        let mut row = vec![0f32; cols];
        let mut y = vec![0f64; n_tok * rows];
        for r in 0..rows {
            dequantize_row(w, r, cols, &mut row);
            for t in 0..n_tok {
                y[t * rows + r] = row
                    .iter()
                    .zip(&x[t * cols..(t + 1) * cols])
                    .map(|(&a, &b)| a as f64 * b as f64)
                    .sum();
            }
        }
        y
    }

    fn run(
        threads: usize,
        w: &RowData,
        rows: usize,
        cols: usize,
        x: &[f32],
        n_tok: usize,
    ) -> Vec<f32> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let mut y = vec![0f32; n_tok * rows];
        pool.install(|| matmul(w, rows, cols, x, n_tok, &mut y));
        y
    }

    #[test]
    fn matmul_matches_reference_on_odd_shapes_and_threads() {
        let shapes = [
            (576, 576),
            (37, 1536),
            (1536, 576),
            (49, 17),
            (21, 100),
            (130, 64),
        ];
        for (si, &(rows, cols)) in shapes.iter().enumerate() {
            for dtype in [
                GgmlDType::F32,
                GgmlDType::F16,
                GgmlDType::Q4_0,
                GgmlDType::Q4_1,
                GgmlDType::Q8_0,
            ] {
                if dtype != GgmlDType::F32 && dtype != GgmlDType::F16 && cols % QK != 0 {
                    continue;
                }
                let w = stored(dtype, &rand(si as u64, rows * cols), rows, cols);
                for n_tok in [1, 3, 5, 9] {
                    let x = rand(100 + si as u64, n_tok * cols);
                    let want = reference(&w, rows, cols, &x, n_tok);
                    let scale = (cols as f64).sqrt();
                    for threads in [1, 2, 3] {
                        let got = run(threads, &w, rows, cols, &x, n_tok);
                        for (g, r) in got.iter().zip(&want) {
                            let err = (*g as f64 - r).abs() / scale;
                            assert!(
                                err < 1e-5,
                                "{dtype:?} {rows}x{cols} n_tok={n_tok} t={threads}: {g} vs {r}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn each_row_is_the_same_whatever_the_batch_or_isa() {
        let (rows, cols) = (70, 576);
        for dtype in [
            GgmlDType::F32,
            GgmlDType::Q4_0,
            GgmlDType::Q4_1,
            GgmlDType::Q8_0,
        ] {
            let w = stored(dtype, &rand(9, rows * cols), rows, cols);
            let x = rand(10, 11 * cols);
            let batched = run(2, &w, rows, cols, &x, 11);
            for t in 0..11 {
                let alone = run(1, &w, rows, cols, &x[t * cols..(t + 1) * cols], 1);
                assert_eq!(
                    &batched[t * rows..(t + 1) * rows],
                    &alone[..],
                    "{dtype:?} token {t}"
                );
            }
            // The portable path gives the same bits as the dispatched (AVX2 where present) one.
            let mut portable = vec![0f32; rows * 11];
            rows_task(&w, cols, &x, 11, 0, &mut portable);
            for t in 0..11 {
                for r in 0..rows {
                    assert_eq!(portable[r * 11 + t], batched[t * rows + r]);
                }
            }
        }
    }
}
