//! CPU kernels for the weight matmuls: f32 / f16 dense rows and W4A16 / W8A16 rows stored in GGUF's
//! 32-element blocks (Q4_0, Q4_1, Q8_0), dequantized in registers and multiplied with f32
//! activations (activations are never quantized here; that is `WeightMode::W4A8`).
//!
//! **Batch invariance.** Every output element `y[t, r] = Σ_i W[r, i]·x[t, i]` is reduced in one fixed
//! order that depends only on the reduction length `k`: `LANES` running sums, each walking the row
//! with stride `LANES`, folded by a fixed pairwise tree. Tokens processed four at a time use the same
//! per-token arithmetic as tokens processed alone, and Rust never contracts `a*b+c` into an FMA, so the
//! AVX2 and portable paths give bitwise-equal results. A sequence's logits are therefore identical
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

/// Dot products of one stored row with `N` activation rows, each reduced in the fixed order.
#[inline(always)]
fn dot_row<const N: usize>(w: &RowData, row: usize, cols: usize, xs: [&[f32]; N]) -> [f32; N] {
    let mut acc = [[0f32; LANES]; N];
    match w {
        RowData::F32(d) => {
            let wr = &d[row * cols..(row + 1) * cols];
            let full = cols / LANES * LANES;
            for c in (0..full).step_by(LANES) {
                let ww = &wr[c..c + LANES];
                for t in 0..N {
                    let xx = &xs[t][c..c + LANES];
                    for l in 0..LANES {
                        acc[t][l] += ww[l] * xx[l];
                    }
                }
            }
            for i in full..cols {
                for t in 0..N {
                    acc[t][i - full] += wr[i] * xs[t][i];
                }
            }
        }
        RowData::F16(d) => {
            let wr = &d[row * cols..(row + 1) * cols];
            let full = cols / LANES * LANES;
            let mut ww = [0f32; LANES];
            for c in (0..full).step_by(LANES) {
                for l in 0..LANES {
                    ww[l] = wr[c + l].to_f32();
                }
                for t in 0..N {
                    let xx = &xs[t][c..c + LANES];
                    for l in 0..LANES {
                        acc[t][l] += ww[l] * xx[l];
                    }
                }
            }
            for i in full..cols {
                for t in 0..N {
                    acc[t][i - full] += wr[i].to_f32() * xs[t][i];
                }
            }
        }
        RowData::Q4_0(d) => {
            let rb = cols / QK * 18;
            let wr = &d[row * rb..(row + 1) * rb];
            for (b, blk) in wr.chunks_exact(18).enumerate() {
                let s = h(blk, 0);
                let (mut lo, mut hi) = ([0f32; LANES], [0f32; LANES]);
                for l in 0..LANES {
                    lo[l] = (blk[2 + l] & 0x0f) as f32 - 8.0;
                    hi[l] = (blk[2 + l] >> 4) as f32 - 8.0;
                }
                for t in 0..N {
                    let xx = &xs[t][b * QK..b * QK + QK];
                    for l in 0..LANES {
                        acc[t][l] += s * (lo[l] * xx[l] + hi[l] * xx[LANES + l]);
                    }
                }
            }
        }
        RowData::Q4_1(d) => {
            let rb = cols / QK * 20;
            let wr = &d[row * rb..(row + 1) * rb];
            for (b, blk) in wr.chunks_exact(20).enumerate() {
                let (s, m) = (h(blk, 0), h(blk, 2));
                let (mut lo, mut hi) = ([0f32; LANES], [0f32; LANES]);
                for l in 0..LANES {
                    lo[l] = (blk[4 + l] & 0x0f) as f32;
                    hi[l] = (blk[4 + l] >> 4) as f32;
                }
                for t in 0..N {
                    let xx = &xs[t][b * QK..b * QK + QK];
                    for l in 0..LANES {
                        acc[t][l] += s * (lo[l] * xx[l] + hi[l] * xx[LANES + l])
                            + m * (xx[l] + xx[LANES + l]);
                    }
                }
            }
        }
        RowData::Q8_0(d) => {
            let rb = cols / QK * 34;
            let wr = &d[row * rb..(row + 1) * rb];
            for (b, blk) in wr.chunks_exact(34).enumerate() {
                let s = h(blk, 0);
                let (mut lo, mut hi) = ([0f32; LANES], [0f32; LANES]);
                for l in 0..LANES {
                    lo[l] = blk[2 + l] as i8 as f32;
                    hi[l] = blk[2 + LANES + l] as i8 as f32;
                }
                for t in 0..N {
                    let xx = &xs[t][b * QK..b * QK + QK];
                    for l in 0..LANES {
                        acc[t][l] += s * (lo[l] * xx[l] + hi[l] * xx[LANES + l]);
                    }
                }
            }
        }
    }
    let mut out = [0f32; N];
    for t in 0..N {
        out[t] = fold(&acc[t]);
    }
    out
}

/// One task: rows `r0..r0+out.len()/n_tok` of the transposed output `yt[r, t]`.
#[inline(always)]
fn rows_task(w: &RowData, cols: usize, x: &[f32], n_tok: usize, r0: usize, yt: &mut [f32]) {
    let n_rows = yt.len() / n_tok;
    for t0 in (0..n_tok).step_by(TOKEN_TILE) {
        let t1 = (t0 + TOKEN_TILE).min(n_tok);
        for i in 0..n_rows {
            let r = r0 + i;
            let yr = &mut yt[i * n_tok..(i + 1) * n_tok];
            let mut t = t0;
            while t + 4 <= t1 {
                let xs = [
                    &x[t * cols..(t + 1) * cols],
                    &x[(t + 1) * cols..(t + 2) * cols],
                    &x[(t + 2) * cols..(t + 3) * cols],
                    &x[(t + 3) * cols..(t + 4) * cols],
                ];
                let o = dot_row::<4>(w, r, cols, xs);
                yr[t..t + 4].copy_from_slice(&o);
                t += 4;
            }
            while t < t1 {
                yr[t] = dot_row::<1>(w, r, cols, [&x[t * cols..(t + 1) * cols]])[0];
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
    match w {
        RowData::F32(d) => out.copy_from_slice(&d[row * cols..(row + 1) * cols]),
        RowData::F16(d) => {
            for (o, v) in out.iter_mut().zip(&d[row * cols..(row + 1) * cols]) {
                *o = v.to_f32();
            }
        }
        RowData::Q4_0(d) => {
            let rb = cols / QK * 18;
            for (b, blk) in d[row * rb..(row + 1) * rb].chunks_exact(18).enumerate() {
                let s = h(blk, 0);
                for l in 0..16 {
                    out[b * QK + l] = s * ((blk[2 + l] & 0x0f) as f32 - 8.0);
                    out[b * QK + 16 + l] = s * ((blk[2 + l] >> 4) as f32 - 8.0);
                }
            }
        }
        RowData::Q4_1(d) => {
            let rb = cols / QK * 20;
            for (b, blk) in d[row * rb..(row + 1) * rb].chunks_exact(20).enumerate() {
                let (s, m) = (h(blk, 0), h(blk, 2));
                for l in 0..16 {
                    out[b * QK + l] = s * (blk[4 + l] & 0x0f) as f32 + m;
                    out[b * QK + 16 + l] = s * (blk[4 + l] >> 4) as f32 + m;
                }
            }
        }
        RowData::Q8_0(d) => {
            let rb = cols / QK * 34;
            for (b, blk) in d[row * rb..(row + 1) * rb].chunks_exact(34).enumerate() {
                let s = h(blk, 0);
                for l in 0..QK {
                    out[b * QK + l] = s * blk[2 + l] as i8 as f32;
                }
            }
        }
    }
}

/// `LANES`-way dot product in the same fixed order as the matmul (attention scores).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let full = a.len() / LANES * LANES;
    for c in (0..full).step_by(LANES) {
        for l in 0..LANES {
            acc[l] += a[c + l] * b[c + l];
        }
    }
    for i in full..a.len() {
        acc[i - full] += a[i] * b[i];
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
