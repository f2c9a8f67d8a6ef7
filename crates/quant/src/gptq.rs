//! GPTQ: quantization with error feedback, calibrated on the target's own activations.
//!
//! Rounding each weight to its nearest grid point (RTN) minimizes the error of the weights. What
//! matters is the error of the layer's *output* on real inputs, `‖X·Wᵀ − X·Ŵᵀ‖²`, whose quadratic
//! form in a row of W is the Hessian `H = Σ xᵀx` of the layer's inputs. GPTQ quantizes a row
//! column by column and, after each column, spreads that column's rounding error over the columns
//! not yet quantized, weighted by the inverse Hessian's Cholesky factor (so that correlated inputs
//! absorb the error); then it rounds the next, already corrected, column. Our implementation:
//! - `H` is collected by running the f32 target over a calibration text ([`collect`]), one per
//!   layer input (the four [`Site`]s a layer's seven linear tensors read from);
//! - each context's first token (the attention sink) weighted [`FIRST_TOKEN_WEIGHT`] times;
//! - dampening `H + λ·mean(diag H)·I` (λ = [`GptqConfig::damp`]); an input that is always zero
//!   gets `H_ii = 1` and zero weights;
//! - `U`, the upper Cholesky factor of `H⁻¹`; columns in order, in blocks of
//!   [`GptqConfig::block`], the error inside a block fed forward column by column and to the rest
//!   of the row once per block (one matrix product);
//! - the grid is exactly [`crate::quantize_symmetric`]'s (so the file is the same Q4_0/Q8_0 the
//!   kernels and llama.cpp read): a group's scale is fixed when its first column is reached, from
//!   the group's weights as corrected so far.
//!
//! With [`GptqConfig::feedback`] off it is RTN, byte for byte.

use std::collections::BTreeMap;
use std::sync::Arc;

use half::f16;
use nalgebra::DMatrix;
use rayon::prelude::*;
use tandem_engine::{CpuSet, LlamaModel, SeqChunk, SeqId, Site, Wanted};

use crate::{check_shapes, pack_blocks, Grid, QuantError, Result};

/// How much a context's first token counts in the Hessians, against any other token. It is the
/// attention sink: every later token attends to it, so an error in its keys and values reaches
/// them all. Measured once on SmolLM2 with a throwaway probe (`eval::perplexity` on 2,048 tokens
/// of the Rust Book; the target 15.9, RTN 19.4): weight 1 gave 21.0 (worse than RTN), leaving
/// each window's first 4 tokens out 28.9 (at dampening 0.01), weights 6 / 16 / 40 / 128 gave
/// 19.1 / 18.2 / 18.6 / 19.0. `tandem bench quant` measures the file made with 16.
pub const FIRST_TOKEN_WEIGHT: f32 = 16.0;

/// GPTQ's settings.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct GptqConfig {
    /// Dampening, as a share of the Hessian's mean diagonal.
    pub damp: f64,
    /// Columns per lazy-update block.
    pub block: usize,
    /// Feed each column's rounding error forward (off: plain rounding, for comparison).
    pub feedback: bool,
    /// Quantize the columns in order of decreasing Hessian diagonal (GPTQ's "act-order"): the
    /// inputs with the most energy first, while the most columns are left to absorb their error.
    /// A group's scale is still one per 32 consecutive columns of the file, fixed when the first
    /// of its columns is reached.
    pub act_order: bool,
}

impl Default for GptqConfig {
    fn default() -> Self {
        Self {
            // 0.1 rather than GPTQ's usual 0.01: 14k calibration tokens against inputs of up to
            // 1,536 features; the stronger prior generalizes better to other text.
            damp: 0.1,
            block: 128,
            feedback: true,
            act_order: true,
        }
    }
}

/// The Hessians of the linear layers' inputs, `Σ xᵀx` over the calibration tokens, per
/// (layer, site).
#[derive(Debug, Clone, Default)]
pub struct Hessians {
    pub tokens: usize,
    pub by_site: BTreeMap<(usize, Site), DMatrix<f64>>,
}

impl Hessians {
    /// The Hessian of the input of the linear tensor `name` (`blk.N.attn_q.weight`, ...).
    pub fn of_tensor(&self, name: &str) -> Option<&DMatrix<f64>> {
        self.by_site.get(&Site::of_tensor(name)?)
    }
}

/// Run the (f32) target over `tokens` in windows of `window` tokens (each a fresh context, fed in
/// chunks of at most 128) and sum each layer input's `xᵀx` (its first token's weighted by
/// [`FIRST_TOKEN_WEIGHT`]). `progress` is told the tokens done.
pub fn collect(
    model: &Arc<LlamaModel>,
    tokens: &[u32],
    window: usize,
    cpus: CpuSet,
    progress: &(dyn Fn(usize) + Sync),
) -> Result<Hessians> {
    if tokens.is_empty() || window == 0 {
        return Err(QuantError::InvalidSetting {
            field: "calibration",
            message: "no calibration tokens".into(),
        });
    }
    let mut e = crate::eval::engine(model, cpus, 128 << 20)?;
    // f32 sums per window (GEMMs over the window's tokens, accumulated in place), added into
    // the f64 totals once per window.
    let mut h = Hessians::default();
    let mut done = 0;
    for (w, win) in tokens.chunks(window).enumerate() {
        let seq = SeqId(w as u64);
        let mut rows: BTreeMap<(usize, Site), Vec<f32>> = BTreeMap::new();
        let mut pos = 0;
        for chunk in win.chunks(128) {
            let mut keep = |layer: usize, site: Site, x: &[f32]| {
                rows.entry((layer, site)).or_default().extend_from_slice(x);
            };
            e.forward_observed(
                &[SeqChunk::new(seq, pos, chunk.to_vec(), Wanted::None)],
                &mut keep,
            )?;
            pos += chunk.len();
        }
        e.free(seq);
        let n = win.len();
        // The window's first token is the attention sink every later token reads: its rows
        // count FIRST_TOKEN_WEIGHT times.
        let sink = FIRST_TOKEN_WEIGHT.sqrt();
        for x in rows.values_mut() {
            let width = x.len() / n;
            x[..width].iter_mut().for_each(|v| *v *= sink);
        }
        let sums: Vec<((usize, Site), DMatrix<f32>)> = rows
            .into_par_iter()
            .map(|(k, x)| {
                // Row-major rows are the columns of xᵀ: the product is a plain GEMM.
                let width = x.len() / n;
                let xt = DMatrix::from_column_slice(width, n, &x);
                let x = xt.transpose();
                (k, xt * x)
            })
            .collect();
        for (k, s) in sums {
            let s = s.cast::<f64>();
            match h.by_site.get_mut(&k) {
                Some(acc) => *acc += s,
                None => {
                    h.by_site.insert(k, s);
                }
            }
        }
        done += n;
        progress(done);
    }
    h.tokens = done;
    Ok(h)
}

/// GPTQ of the rows of `w` (`cols` wide, a multiple of 32) against the Hessian `h` of the layer's
/// inputs, into [`crate::quantize_symmetric`]'s blocks and grid (groups of `group` weights along
/// a row).
pub fn quantize(
    w: &[f32],
    cols: usize,
    h: &DMatrix<f64>,
    group: usize,
    bits: usize,
    cfg: &GptqConfig,
) -> Result<Vec<u8>> {
    check_shapes(w, cols, group, bits);
    if h.nrows() != cols || h.ncols() != cols {
        return Err(QuantError::InvalidSetting {
            field: "calibration",
            message: format!(
                "a Hessian of {}×{} for rows of {cols} weights",
                h.nrows(),
                h.ncols()
            ),
        });
    }
    let rows = w.len() / cols;
    let grid = Grid::new(bits);
    let mut wm = DMatrix::from_row_slice(rows, cols, w).cast::<f64>();
    let mut h = h.clone();
    for i in 0..cols {
        if h[(i, i)] == 0.0 {
            // An input that is always zero: its weights never matter.
            h[(i, i)] = 1.0;
            wm.column_mut(i).fill(0.0);
        }
    }
    let damp = cfg.damp * h.diagonal().mean();
    for i in 0..cols {
        h[(i, i)] += damp;
    }
    // The order columns are quantized in: `order[k]` is the file's column quantized k-th; the
    // weights and the Hessian are permuted to it, and `at[c]` is where file column `c` went.
    let mut order: Vec<usize> = (0..cols).collect();
    if cfg.act_order {
        order.sort_by(|&a, &b| h[(b, b)].total_cmp(&h[(a, a)]).then(a.cmp(&b)));
    }
    let mut at = vec![0; cols];
    for (k, &c) in order.iter().enumerate() {
        at[c] = k;
    }
    let h = DMatrix::from_fn(cols, cols, |i, j| h[(order[i], order[j])]);
    let mut wm = DMatrix::from_fn(rows, cols, |r, k| wm[(r, order[k])]);
    let u = upper_factor_of_inverse(h)?;

    let groups = cols.div_ceil(group);
    let mut scales = vec![f16::ZERO; rows * groups];
    let mut scaled = vec![false; groups];
    let mut levels = vec![0f32; rows * cols];
    let block = cfg.block.max(1);
    for i1 in (0..cols).step_by(block) {
        let i2 = (i1 + block).min(cols);
        let mut err = DMatrix::<f64>::zeros(rows, i2 - i1);
        for i in i1..i2 {
            let c = order[i];
            let g = c / group;
            if !scaled[g] {
                // The group's first column reached: its scale from the group as corrected so far.
                scaled[g] = true;
                let members: Vec<usize> = (g * group..((g + 1) * group).min(cols))
                    .map(|m| at[m])
                    .collect();
                for r in 0..rows {
                    scales[r * groups + g] = grid.scale(members.iter().map(|&k| wm[(r, k)] as f32));
                }
            }
            let uii = u[(i, i)];
            for r in 0..rows {
                let d = scales[r * groups + g].to_f32();
                let inv = if d != 0.0 { 1.0 / d } else { 0.0 };
                let x = wm[(r, i)];
                let q = grid.level(x as f32, inv);
                levels[r * cols + c] = q;
                err[(r, i - i1)] = (x - (q * d) as f64) / uii;
            }
            if cfg.feedback {
                for j in i + 1..i2 {
                    let uij = u[(i, j)];
                    for r in 0..rows {
                        wm[(r, j)] -= err[(r, i - i1)] * uij;
                    }
                }
            }
        }
        if cfg.feedback && i2 < cols {
            let update = &err * u.view((i1, i2), (i2 - i1, cols - i2));
            let mut rest = wm.columns_mut(i2, cols - i2);
            rest -= update;
        }
    }

    Ok(pack_blocks(&grid, cols, group, &scales, &levels))
}

/// `U`, upper triangular with `H⁻¹ = Uᵀ·U`, by one Cholesky factorization and one triangular
/// inverse: with `J` the reversal, `J·H·J = M·Mᵀ` gives `H⁻¹ = (J·M⁻ᵀ·J)·(J·M⁻¹·J)`, and
/// `J·M⁻¹·J` is upper triangular.
fn upper_factor_of_inverse(h: DMatrix<f64>) -> Result<DMatrix<f64>> {
    let n = h.nrows();
    let not_pd = || QuantError::InvalidSetting {
        field: "calibration",
        message: "the inputs' Hessian is not positive definite even after dampening".into(),
    };
    let flipped = DMatrix::from_fn(n, n, |i, j| h[(n - 1 - i, n - 1 - j)]);
    let m = flipped.cholesky().ok_or_else(not_pd)?.unpack();
    let m_inv = m
        .solve_lower_triangular(&DMatrix::identity(n, n))
        .ok_or_else(not_pd)?;
    Ok(DMatrix::from_fn(n, n, |i, j| m_inv[(n - 1 - i, n - 1 - j)]))
}

/// The output error of quantized rows `back` against `w` on the inputs behind `h`, relative:
/// `sqrt(tr(ΔW·H·ΔWᵀ) / tr(W·H·Wᵀ))`.
pub fn output_error(w: &[f32], back: &[f32], cols: usize, h: &DMatrix<f64>) -> f64 {
    let rows = w.len() / cols;
    let wm = DMatrix::from_row_slice(rows, cols, w).cast::<f64>();
    let bm = DMatrix::from_row_slice(rows, cols, back).cast::<f64>();
    let dm = &wm - &bm;
    let quad = |m: &DMatrix<f64>| (m * h).component_mul(m).sum();
    (quad(&dm) / quad(&wm).max(f64::MIN_POSITIVE)).sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quantize_symmetric;
    use tandem_engine::kernels::{dequantize_row, RowData};

    fn back(bytes: &[u8], bits: usize, n: usize) -> Vec<f32> {
        let data = if bits <= 4 {
            RowData::q4_0(bytes)
        } else {
            RowData::q8_0(bytes)
        };
        let mut out = vec![0f32; n];
        dequantize_row(&data, 0, n, &mut out);
        out
    }

    /// Deterministic pseudo-random numbers in [−1, 1).
    fn noise(seed: u64, n: usize) -> Vec<f32> {
        let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    /// Inputs whose features are correlated (mixtures of a few sources) and of unequal scale, as
    /// a layer's are; and their Hessian.
    fn inputs(n: usize, cols: usize) -> (DMatrix<f64>, DMatrix<f64>) {
        let z = DMatrix::from_row_slice(n, 8, &noise(1, n * 8)).cast::<f64>();
        let mix = DMatrix::from_row_slice(8, cols, &noise(2, 8 * cols)).cast::<f64>();
        let own = DMatrix::from_row_slice(n, cols, &noise(3, n * cols)).cast::<f64>() * 0.1;
        let x = z * mix + own;
        let h = x.transpose() * &x;
        (x, h)
    }

    #[test]
    fn error_feedback_lowers_the_output_error_and_without_it_gptq_is_rtn() {
        let (rows, cols) = (48, 128);
        let w = noise(7, rows * cols);
        let (_, h) = inputs(512, cols);
        for (bits, group) in [(4, 32), (4, 128), (3, 64), (8, 32)] {
            let rtn = quantize_symmetric(&w, cols, group, bits);
            let off = GptqConfig {
                feedback: false,
                ..GptqConfig::default()
            };
            let plain = quantize(&w, cols, &h, group, bits, &off).unwrap();
            assert_eq!(
                plain, rtn,
                "{bits} bits, groups of {group}: plain rounding is RTN"
            );
            let gptq = quantize(&w, cols, &h, group, bits, &GptqConfig::default()).unwrap();
            let n = rows * cols;
            let (e_rtn, e_gptq) = (
                output_error(&w, &back(&rtn, bits, n), cols, &h),
                output_error(&w, &back(&gptq, bits, n), cols, &h),
            );
            assert!(
                e_gptq < 0.8 * e_rtn,
                "{bits} bits, groups of {group}: GPTQ {e_gptq:.4} against RTN {e_rtn:.4}"
            );
        }
    }

    #[test]
    fn the_upper_factor_is_that_of_the_inverse() {
        let (_, h) = inputs(100, 40);
        let u = upper_factor_of_inverse(h.clone()).unwrap();
        let want = h
            .cholesky()
            .unwrap()
            .inverse()
            .cholesky()
            .unwrap()
            .l()
            .transpose();
        assert!(
            (0..40).all(|i| (0..i).all(|j| u[(i, j)] == 0.0)),
            "upper triangular"
        );
        assert!(
            (&u - &want).abs().max() < 1e-9 * want.abs().max(),
            "{}",
            (&u - &want).abs().max()
        );
    }

    #[test]
    fn a_dead_input_gets_zero_weights_and_a_bad_hessian_is_refused() {
        let (rows, cols) = (4, 32);
        let w = noise(9, rows * cols);
        let (_, mut h) = inputs(64, cols);
        h.row_mut(5).fill(0.0);
        h.column_mut(5).fill(0.0);
        let q = quantize(&w, cols, &h, 32, 4, &GptqConfig::default()).unwrap();
        let b = back(&q, 4, rows * cols);
        assert!((0..rows).all(|r| b[r * cols + 5] == 0.0));
        let wrong = DMatrix::<f64>::identity(16, 16);
        let e = quantize(&w, cols, &wrong, 32, 4, &GptqConfig::default()).unwrap_err();
        assert!(e.to_string().contains("Hessian of 16×16"), "{e}");
    }
}
