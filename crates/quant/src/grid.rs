//! The symmetric grid: a group's scale from its largest magnitude, each weight rounded to a
//! level, packed as GGUF Q4_0 / Q8_0 blocks (see the crate docs).

use half::f16;

use crate::QK;

/// Symmetric quantization of the rows of `w` (`cols` wide, a multiple of 32) into Q4_0 (`bits` 2,
/// 3 or 4) or Q8_0 (`bits = 8`) blocks. Each row is cut into groups of `group` weights (the last
/// group of a row is shorter when `cols` is not a multiple of `group`, e.g. 576 = 4·128 + 64); every
/// block of a group carries the group's scale. A b-bit grid below 8 has the levels −2^(b−1) ..
/// 2^(b−1) − 1, with the value of largest magnitude on −2^(b−1).
pub fn quantize_symmetric(w: &[f32], cols: usize, group: usize, bits: usize) -> Vec<u8> {
    check_shapes(w, cols, group, bits);
    let grid = Grid::new(bits);
    let (rows, groups) = (w.len() / cols, cols.div_ceil(group));
    let mut scales = Vec::with_capacity(rows * groups);
    let mut levels = Vec::with_capacity(w.len());
    for row in w.chunks_exact(cols) {
        for g in row.chunks(group) {
            let d16 = grid.scale(g.iter().copied());
            let dq = d16.to_f32();
            let inv = if dq != 0.0 { 1.0 / dq } else { 0.0 };
            scales.push(d16);
            levels.extend(g.iter().map(|&x| grid.level(x, inv)));
        }
    }
    pack_blocks(&grid, cols, group, &scales, &levels)
}

pub(crate) fn check_shapes(w: &[f32], cols: usize, group: usize, bits: usize) {
    assert!(
        group.is_multiple_of(QK)
            && cols.is_multiple_of(QK)
            && w.len().is_multiple_of(cols)
            && matches!(bits, 2..=4 | 8),
        "invariant: caller checked the shapes and the bits"
    );
}

/// The symmetric grid of `bits` (2–4: Q4_0's container, 8: Q8_0's): a group's scale from its
/// weights, and a weight's code (its level, unsigned as stored) given the inverse scale.
#[derive(Clone, Copy)]
pub(crate) struct Grid {
    low: bool,
    qmax: f32,
}

impl Grid {
    pub(crate) fn new(bits: usize) -> Self {
        let low = bits <= 4;
        Self {
            low,
            qmax: if low {
                (1u32 << (bits - 1)) as f32
            } else {
                127.0
            },
        }
    }

    /// The group's scale, f16 as stored (the value of largest magnitude lands on the lowest level
    /// for a low-bit grid; ±127 steps for 8 bits).
    pub(crate) fn scale(&self, g: impl Iterator<Item = f32>) -> f16 {
        let d = if self.low {
            let m = g.fold(0f32, |a, x| if x.abs() > a.abs() { x } else { a });
            m / -self.qmax
        } else {
            g.fold(0f32, |a, x| a.max(x.abs())) / self.qmax
        };
        f16::from_f32(d)
    }

    /// The level of `x` (signed) at inverse scale `inv`.
    pub(crate) fn level(&self, x: f32, inv: f32) -> f32 {
        if self.low {
            (x * inv).round().clamp(-self.qmax, self.qmax - 1.0)
        } else {
            (x * inv).round().clamp(-127.0, 127.0)
        }
    }
}

/// Rows of signed `levels` (`cols` each) and their groups' `scales` (`cols / group` rounded up
/// per row) as Q4_0 blocks (codes offset by 8, two per byte: a block's first half in the low
/// nibbles) or Q8_0 blocks (i8), every block carrying its group's scale.
pub(crate) fn pack_blocks(
    grid: &Grid,
    cols: usize,
    group: usize,
    scales: &[f16],
    levels: &[f32],
) -> Vec<u8> {
    let groups = cols.div_ceil(group);
    let mut out = Vec::with_capacity(levels.len() / QK * if grid.low { 18 } else { 34 });
    for (r, row) in levels.chunks_exact(cols).enumerate() {
        for (b, lv) in row.chunks_exact(QK).enumerate() {
            out.extend_from_slice(&scales[r * groups + b * QK / group].to_le_bytes());
            if grid.low {
                for l in 0..QK / 2 {
                    out.push((lv[l] + 8.0) as u8 | (((lv[l + QK / 2] + 8.0) as u8) << 4));
                }
            } else {
                out.extend(lv.iter().map(|&q| (q as i8) as u8));
            }
        }
    }
    out
}
