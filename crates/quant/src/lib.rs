//! Tandem's weight quantizer: makes the edge draft from the cloud target.
//!
//! **Grid.** W4A16 uses *symmetric* 4-bit groups: in each group of `g` weights the value of largest
//! magnitude `m` fixes the scale `d = m / −8` (stored as f16), and each weight becomes
//! `q = clamp(round(w/d) + 8, 0, 15)`, read back as `d·(q − 8)`. This is GGUF's Q4_0 layout, so a
//! group of 32 is written as standard Q4_0 blocks that llama.cpp loads too; groups of 64 and 128 are
//! written as Q4_0 blocks whose scales are shared within the group (the file still spends 4.5 bits
//! per weight; the scheme's own cost is 4 + 16/g). W8A16 is symmetric 8-bit, `d = max|w| / 127`, in
//! Q8_0 blocks. The source model's own grid (asymmetric Q4_1 with a minimum) is deliberately not
//! offered: a draft on the target's own grid reproduces it exactly and would measure nothing.
//!
//! The embedding (tied to the output head) has its own precision, Q8_0 by default; norm vectors stay
//! f32. Activations are never quantized: that is what the `A16` means.

pub mod calibration;
pub mod eval;
pub mod gptq;

use std::collections::BTreeMap;
use std::io::{BufWriter, Seek, Write};

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{ggml_file, GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use half::f16;
use rayon::prelude::*;
use serde::Serialize;
use tandem_engine::GgufFile;

pub const QK: usize = 32;

#[derive(Debug, thiserror::Error)]
pub enum QuantError {
    #[error("invalid setting `{field}`: {message}")]
    InvalidSetting {
        field: &'static str,
        message: String,
    },
    #[error(transparent)]
    Engine(#[from] tandem_engine::EngineError),
    #[error("tensor `{name}`: {message}")]
    Tensor { name: String, message: String },
    #[error("writing {path}: {message}")]
    Write { path: String, message: String },
}

pub type Result<T, E = QuantError> = std::result::Result<T, E>;

/// Weight bits and activation bits of a draft.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Scheme {
    W4A16,
    W8A16,
    /// 3- and 2-bit symmetric grids (levels −4..3 and −2..1 times the group's scale), stored in
    /// Q4_0 blocks: the numbers are the low-bit grid's, the file and the kernel are 4-bit's.
    W3A16,
    W2A16,
    /// No quantization: the target written out as f32 (for running other engines on it).
    F32,
}

impl std::str::FromStr for Scheme {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "w4a16" => Ok(Self::W4A16),
            "w8a16" => Ok(Self::W8A16),
            "w3a16" => Ok(Self::W3A16),
            "w2a16" => Ok(Self::W2A16),
            "f32" => Ok(Self::F32),
            _ => Err(format!(
                "unknown scheme `{s}` (w4a16, w8a16, w3a16, w2a16, f32)"
            )),
        }
    }
}

impl Scheme {
    pub fn name(self) -> &'static str {
        match self {
            Self::W4A16 => "w4a16",
            Self::W8A16 => "w8a16",
            Self::W3A16 => "w3a16",
            Self::W2A16 => "w2a16",
            Self::F32 => "f32",
        }
    }
    /// Bits per weight of the grid.
    pub fn bits(self) -> usize {
        match self {
            Self::W4A16 => 4,
            Self::W8A16 => 8,
            Self::W3A16 => 3,
            Self::W2A16 => 2,
            Self::F32 => 32,
        }
    }
    /// Bits per weight of the scheme's linear layers as stored in the file: Q4_0 blocks (2-, 3-
    /// and 4-bit grids) spend 18 bytes per 32 weights, Q8_0 blocks 34.
    pub fn stored_bits_per_weight(self) -> f64 {
        match self.dtype() {
            GgmlDType::Q4_0 => 18.0 * 8.0 / QK as f64,
            GgmlDType::Q8_0 => 34.0 * 8.0 / QK as f64,
            _ => 32.0,
        }
    }
    fn dtype(self) -> GgmlDType {
        match self {
            Self::W4A16 | Self::W3A16 | Self::W2A16 => GgmlDType::Q4_0,
            Self::W8A16 => GgmlDType::Q8_0,
            Self::F32 => GgmlDType::F32,
        }
    }
}

/// Storage of the embedding / tied output head.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum EmbedPrecision {
    F32,
    F16,
    Q8_0,
    Q4_0,
}

impl std::str::FromStr for EmbedPrecision {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "f32" => Ok(Self::F32),
            "f16" => Ok(Self::F16),
            "q8_0" => Ok(Self::Q8_0),
            "q4_0" => Ok(Self::Q4_0),
            _ => Err(format!(
                "unknown embedding precision `{s}` (f32, f16, q8_0, q4_0)"
            )),
        }
    }
}

/// How the linear layers' weights are put on the grid.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Method {
    /// Round each weight to the nearest level.
    Rtn,
    /// [`gptq`]: error feedback weighted by the Hessian of the layer's inputs on a calibration
    /// text.
    Gptq,
}

impl std::str::FromStr for Method {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "rtn" => Ok(Self::Rtn),
            "gptq" => Ok(Self::Gptq),
            _ => Err(format!("unknown quantization method `{s}` (rtn, gptq)")),
        }
    }
}

impl Method {
    pub fn name(self) -> &'static str {
        match self {
            Self::Rtn => "rtn",
            Self::Gptq => "gptq",
        }
    }
}

#[derive(Debug, Clone, Copy, Serialize)]
pub struct QuantConfig {
    pub scheme: Scheme,
    pub method: Method,
    /// Weights per scale: 32, 64 or 128.
    pub group_size: usize,
    pub embedding: EmbedPrecision,
}

impl Default for QuantConfig {
    fn default() -> Self {
        Self {
            scheme: Scheme::W4A16,
            method: Method::Rtn,
            group_size: 32,
            embedding: EmbedPrecision::Q8_0,
        }
    }
}

impl QuantConfig {
    pub fn validate(&self) -> Result<()> {
        if ![32, 64, 128].contains(&self.group_size) {
            return Err(QuantError::InvalidSetting {
                field: "group_size",
                message: format!("{} is not one of 32, 64, 128", self.group_size),
            });
        }
        if self.method == Method::Gptq && self.scheme == Scheme::F32 {
            return Err(QuantError::InvalidSetting {
                field: "method",
                message: "gptq quantizes to a grid; the f32 scheme has none".into(),
            });
        }
        Ok(())
    }

    /// Bits per weight of the scheme itself for rows of `cols` weights: payload plus one f16 scale
    /// per group.
    pub fn scheme_bits_per_weight(&self, cols: usize) -> f64 {
        if self.scheme == Scheme::F32 {
            return 32.0;
        }
        self.scheme.bits() as f64 + 16.0 * cols.div_ceil(self.group_size) as f64 / cols as f64
    }
}

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

fn check_shapes(w: &[f32], cols: usize, group: usize, bits: usize) {
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
fn pack_blocks(grid: &Grid, cols: usize, group: usize, scales: &[f16], levels: &[f32]) -> Vec<u8> {
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

/// Per-tensor result of quantization.
#[derive(Debug, Clone, Serialize)]
pub struct TensorReport {
    pub name: String,
    pub layer: Option<usize>,
    pub format: String,
    pub params: usize,
    pub bytes: usize,
    /// ‖W − Ŵ‖ / ‖W‖ over the tensor.
    pub rel_error: f64,
    /// The same for the layer's output on the calibration inputs (when quantized with them):
    /// `sqrt(tr(ΔW·H·ΔWᵀ) / tr(W·H·Wᵀ))`, H the Hessian of its inputs.
    pub rel_output_error: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub config: QuantConfig,
    pub scheme_bits_per_weight: f64,
    /// Bits per weight of the quantized linear layers as stored in the file.
    pub file_bits_per_weight: f64,
    pub file_bytes: u64,
    pub tensors: Vec<TensorReport>,
}

impl Report {
    /// Mean relative weight error of each layer's linear tensors, by layer index.
    pub fn per_layer(&self) -> BTreeMap<usize, f64> {
        self.mean_by_layer(|t| Some(t.rel_error))
    }

    /// Mean relative output error on the calibration inputs of each layer's linear tensors, when
    /// they were quantized with the Hessians.
    pub fn per_layer_output(&self) -> BTreeMap<usize, f64> {
        self.mean_by_layer(|t| t.rel_output_error)
    }

    fn mean_by_layer(&self, of: impl Fn(&TensorReport) -> Option<f64>) -> BTreeMap<usize, f64> {
        let mut acc: BTreeMap<usize, (f64, usize)> = BTreeMap::new();
        for t in &self.tensors {
            if let (Some(l), Some(x)) = (t.layer, of(t)) {
                let e = acc.entry(l).or_default();
                e.0 += x;
                e.1 += 1;
            }
        }
        acc.into_iter()
            .map(|(l, (s, n))| (l, s / n as f64))
            .collect()
    }
}

fn rel_error(w: &[f32], back: &[f32]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (&a, &b) in w.iter().zip(back) {
        num += (a as f64 - b as f64).powi(2);
        den += (a as f64).powi(2);
    }
    (num / den.max(f64::MIN_POSITIVE)).sqrt()
}

fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("blk.")?.split('.').next()?.parse().ok()
}

fn qerr(name: &str) -> impl Fn(candle_core::Error) -> QuantError + '_ {
    move |e| QuantError::Tensor {
        name: name.into(),
        message: e.to_string(),
    }
}

/// What quantizing a file may be calibrated with, and told about its progress.
#[derive(Clone, Copy, Default)]
pub struct Calibration<'a> {
    /// The Hessians of the target's layer inputs ([`gptq::collect`]): required by GPTQ, and with
    /// any method they give each tensor's output error.
    pub hessians: Option<&'a gptq::Hessians>,
    pub gptq: gptq::GptqConfig,
    /// Told (tensors done, tensors in all) as the file is made.
    pub progress: Option<&'a (dyn Fn(usize, usize) + Sync)>,
}

/// One tensor of the draft, with its report (matrices) and its scheme bits (linear layers).
struct Made {
    tensor: QTensor,
    report: Option<TensorReport>,
    scheme_bits: Option<(f64, usize)>,
}

fn quantize_tensor(
    name: &str,
    dims: &[usize],
    w: &[f32],
    cfg: &QuantConfig,
    calib: &Calibration<'_>,
) -> Result<Made> {
    let is_embed = name == "token_embd.weight" || name == "output.weight";
    let linear = dims.len() == 2 && !is_embed;
    let target = if linear && cfg.scheme == Scheme::F32 {
        None
    } else if linear {
        Some((cfg.scheme.dtype(), cfg.group_size))
    } else if is_embed {
        match cfg.embedding {
            EmbedPrecision::Q8_0 => Some((GgmlDType::Q8_0, QK)),
            EmbedPrecision::Q4_0 => Some((GgmlDType::Q4_0, QK)),
            EmbedPrecision::F16 => Some((GgmlDType::F16, 0)),
            EmbedPrecision::F32 => None,
        }
    } else {
        None
    };
    let cols = *dims.last().unwrap_or(&0);
    let qt = match target {
        Some((dtype @ (GgmlDType::Q4_0 | GgmlDType::Q8_0), group)) => {
            if !cols.is_multiple_of(QK) {
                return Err(QuantError::Tensor {
                    name: name.to_string(),
                    message: format!("{cols} columns are not a multiple of {QK}"),
                });
            }
            let bits = if dtype == GgmlDType::Q4_0 {
                cfg.scheme.bits().min(4)
            } else {
                8
            };
            let hessian = calib.hessians.and_then(|h| h.of_tensor(name));
            let bytes = match (cfg.method, linear) {
                (Method::Gptq, true) => {
                    let h = hessian.ok_or_else(|| QuantError::Tensor {
                        name: name.to_string(),
                        message: "no calibration Hessian for this tensor's input".into(),
                    })?;
                    gptq::quantize(w, cols, h, group, bits, &calib.gptq)?
                }
                _ => quantize_symmetric(w, cols, group, bits),
            };
            ggml_file::qtensor_from_ggml(dtype, &bytes, dims.to_vec(), &Device::Cpu)
                .map_err(qerr(name))?
        }
        Some((dtype, _)) => {
            let t = Tensor::from_slice(w, dims, &Device::Cpu).map_err(qerr(name))?;
            QTensor::quantize(&t, dtype).map_err(qerr(name))?
        }
        None => {
            let t = Tensor::from_slice(w, dims, &Device::Cpu).map_err(qerr(name))?;
            QTensor::quantize(&t, GgmlDType::F32).map_err(qerr(name))?
        }
    };
    let report = if dims.len() == 2 {
        let back = tandem_engine::gguf::dequantize_f32(name, &qt)?;
        let h = calib.hessians.and_then(|h| h.of_tensor(name));
        Some(TensorReport {
            rel_output_error: h.map(|h| gptq::output_error(w, &back, cols, h)),
            name: name.to_string(),
            layer: layer_of(name),
            format: format!("{:?}", qt.dtype()).to_lowercase(),
            params: w.len(),
            bytes: qt.storage_size_in_bytes(),
            rel_error: rel_error(w, &back),
        })
    } else {
        None
    };
    Ok(Made {
        tensor: qt,
        report,
        scheme_bits: linear.then(|| (cfg.scheme_bits_per_weight(cols), w.len())),
    })
}

/// Quantize the model in `src` (read as f32) and write the draft to `out`.
pub fn quantize_file<W: Write + Seek>(
    src: &mut GgufFile,
    cfg: &QuantConfig,
    calib: &Calibration<'_>,
    out: &mut W,
) -> Result<Report> {
    cfg.validate()?;
    if cfg.method == Method::Gptq && calib.hessians.is_none() {
        return Err(QuantError::InvalidSetting {
            field: "method",
            message: "gptq needs the calibration Hessians".into(),
        });
    }
    let mut infos: Vec<(String, Vec<usize>, u64)> = src
        .content
        .tensor_infos
        .iter()
        .map(|(n, i)| (n.clone(), i.shape.dims().to_vec(), i.offset))
        .collect();
    infos.sort_by_key(|(_, _, off)| *off);
    let weights: Vec<(String, Vec<usize>, Vec<f32>)> = infos
        .into_iter()
        .map(|(name, dims, _)| {
            let w = src.tensor_f32(&name, &dims)?;
            Ok((name, dims, w))
        })
        .collect::<Result<_>>()?;
    // Each tensor on its own, in parallel (GPTQ's factorizations dominate).
    let total = weights.len();
    let done = std::sync::atomic::AtomicUsize::new(0);
    let made: Vec<Made> = weights
        .par_iter()
        .map(|(name, dims, w)| {
            let m = quantize_tensor(name, dims, w, cfg, calib);
            let n = done.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
            if let Some(p) = calib.progress {
                p(n, total);
            }
            m
        })
        .collect::<Result<_>>()?;
    let mut tensors: Vec<(String, QTensor)> = Vec::with_capacity(made.len());
    let mut reports = Vec::new();
    let mut scheme_bits = Vec::new();
    for (m, (name, _, _)) in made.into_iter().zip(weights) {
        reports.extend(m.report);
        scheme_bits.extend(m.scheme_bits);
        tensors.push((name, m.tensor));
    }

    let mut meta: Vec<(String, Value)> = src
        .content
        .metadata
        .iter()
        .filter(|(k, _)| !matches!(k.as_str(), "general.alignment" | "general.file_type"))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let file_type = match cfg.scheme {
        Scheme::W4A16 | Scheme::W3A16 | Scheme::W2A16 => 2, // MOSTLY_Q4_0
        Scheme::W8A16 => 7,                                 // MOSTLY_Q8_0
        Scheme::F32 => 0,                                   // ALL_F32
    };
    meta.push(("general.file_type".into(), Value::U32(file_type)));
    meta.push((
        "tandem.quant.scheme".into(),
        Value::String(cfg.scheme.name().into()),
    ));
    meta.push((
        "tandem.quant.method".into(),
        Value::String(cfg.method.name().into()),
    ));
    meta.push((
        "tandem.quant.group_size".into(),
        Value::U32(cfg.group_size as u32),
    ));
    meta.sort_by(|a, b| a.0.cmp(&b.0));
    let meta_refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut w = BufWriter::new(out);
    let werr = |e: &dyn std::fmt::Display| QuantError::Write {
        path: "output".into(),
        message: e.to_string(),
    };
    gguf_file::write(&mut w, &meta_refs, &tensor_refs).map_err(|e| werr(&e))?;
    w.flush().map_err(|e| werr(&e))?;
    let file_bytes = w.stream_position().map_err(|e| werr(&e))?;

    let (lp, lb) = reports
        .iter()
        .filter(|t| t.layer.is_some())
        .fold((0usize, 0usize), |(p, b), t| (p + t.params, b + t.bytes));
    Ok(Report {
        config: *cfg,
        scheme_bits_per_weight: scheme_bits.iter().map(|(b, n)| b * *n as f64).sum::<f64>()
            / scheme_bits
                .iter()
                .map(|(_, n)| *n as f64)
                .sum::<f64>()
                .max(1.0),
        file_bits_per_weight: lb as f64 * 8.0 / lp.max(1) as f64,
        file_bytes,
        tensors: reports,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use tandem_engine::kernels::{dequantize_row, RowData};

    fn back(bytes: Vec<u8>, bits: usize, n: usize) -> Vec<f32> {
        let data = if bits <= 4 {
            RowData::q4_0(&bytes)
        } else {
            RowData::q8_0(&bytes)
        };
        let mut out = vec![0f32; n];
        dequantize_row(&data, 0, n, &mut out);
        out
    }

    proptest! {
        /// Every weight comes back within the grid's bound: half a step when rounded inside the
        /// range, one step for the one value clipped at +8·d (4-bit), plus the f16 rounding of d.
        #[test]
        fn round_trip_error_is_within_the_scheme_bound(
            w in proptest::collection::vec(-4.0f32..4.0, 128),
            group in prop_oneof![Just(32usize), Just(64), Just(128)],
            bits in prop_oneof![Just(2usize), Just(3), Just(4), Just(8)],
        ) {
            let q = quantize_symmetric(&w, 128, group, bits);
            prop_assert_eq!(q.len(), 128 / QK * if bits <= 4 { 18 } else { 34 });
            let r = back(q.clone(), bits, 128);
            if bits < 4 {
                // Only the grid's 2^bits levels are used: codes 8 − 2^(b−1) ..= 8 + 2^(b−1) − 1.
                let half = 1u8 << (bits - 1);
                for b in q.chunks_exact(18) {
                    for &byte in &b[2..] {
                        for c in [byte & 15, byte >> 4] {
                            prop_assert!((8 - half..8 + half).contains(&c), "code {}", c);
                        }
                    }
                }
            }
            for (g, (wg, rg)) in w.chunks(group).zip(r.chunks(group)).enumerate() {
                let amax = wg.iter().fold(0f32, |a, x| a.max(x.abs()));
                let d = amax / if bits <= 4 { (1u32 << (bits - 1)) as f32 } else { 127.0 };
                let slack = d * 2e-3 + 1e-7;
                for (x, y) in wg.iter().zip(rg) {
                    let err = (x - y).abs();
                    // The positive end of a low-bit grid stops one step short of +amax.
                    let bound = if bits <= 4 && (x.abs() - amax).abs() < d * 0.5 { d } else { d * 0.5 };
                    prop_assert!(err <= bound + slack, "group {} value {} -> {} (d {})", g, x, y, d);
                }
            }
        }
    }

    #[test]
    fn group_scales_are_shared_across_blocks() {
        // Blocks of very different magnitude: one scale for all of them wastes resolution.
        let w: Vec<f32> = (0..128)
            .map(|i| (i as f32 * 0.37).sin() * 4f32.powi(i / 32))
            .collect();
        let q = quantize_symmetric(&w, 128, 128, 4);
        let scales: Vec<[u8; 2]> = q.chunks(18).map(|b| [b[0], b[1]]).collect();
        assert!(scales.iter().all(|s| *s == scales[0]));
        let q32 = quantize_symmetric(&w, 128, 32, 4);
        let r32 = back(q32, 4, 128);
        let r128 = back(q, 4, 128);
        assert!(
            rel_error(&w, &r32) < rel_error(&w, &r128),
            "smaller groups are more precise"
        );
    }

    #[test]
    fn gptq_lowers_every_layers_output_error_on_the_calibration_inputs_and_loads() {
        use std::sync::Arc;
        use tandem_engine::testing::{tiny_file, TinySpec};
        let mut src = tiny_file(&TinySpec::default()).unwrap();
        let target = Arc::new(
            tandem_engine::LlamaModel::load(&mut src, tandem_engine::WeightMode::F32).unwrap(),
        );
        let vocab = target.cfg.vocab as u32;
        let tokens: Vec<u32> = (0..600u32).map(|i| (i * 37 + i / 7) % vocab).collect();
        let h = gptq::collect(&target, &tokens, 200, Default::default(), &|_| {}).unwrap();
        assert_eq!(h.tokens, 600);
        let mut run = |method| {
            let cfg = QuantConfig {
                method,
                ..QuantConfig::default()
            };
            let calib = Calibration {
                hessians: Some(&h),
                ..Calibration::default()
            };
            let mut buf = std::io::Cursor::new(Vec::new());
            let rep = quantize_file(&mut src, &cfg, &calib, &mut buf).unwrap();
            (rep, buf.into_inner())
        };
        let (rtn, _) = run(Method::Rtn);
        let (gptq, bytes) = run(Method::Gptq);
        assert!(run(Method::Gptq).1 == bytes, "deterministic");
        let mut linear = 0;
        for (r, g) in rtn.tensors.iter().zip(&gptq.tensors) {
            let (Some(er), Some(eg)) = (r.rel_output_error, g.rel_output_error) else {
                continue;
            };
            linear += 1;
            assert!(eg < er, "{}: GPTQ {eg:.4} against RTN {er:.4}", g.name);
        }
        assert_eq!(
            linear,
            7 * target.cfg.n_layer,
            "every linear tensor has its Hessian"
        );
        let mut g = GgufFile::from_bytes("gptq.gguf", bytes).unwrap();
        assert_eq!(g.string("tandem.quant.method").unwrap(), "gptq");
        let m = tandem_engine::LlamaModel::load(&mut g, tandem_engine::WeightMode::Native).unwrap();
        assert_eq!(m.format(), "q4_0");
        // GPTQ without its Hessians is refused by name.
        let cfg = QuantConfig {
            method: Method::Gptq,
            ..QuantConfig::default()
        };
        let mut sink = std::io::Cursor::new(Vec::new());
        let err = quantize_file(&mut src, &cfg, &Calibration::default(), &mut sink).unwrap_err();
        assert!(err.to_string().contains("calibration Hessians"), "{err}");
    }

    #[test]
    fn tiny_model_quantizes_and_loads_back() {
        use tandem_engine::testing::{tiny_file, TinySpec};
        let mut src = tiny_file(&TinySpec::default()).unwrap();
        for scheme in [Scheme::W4A16, Scheme::W8A16] {
            // 128-wide groups on 64- and 96-wide rows: short last groups.
            let cfg = QuantConfig {
                scheme,
                method: Method::Rtn,
                group_size: 128,
                embedding: EmbedPrecision::Q8_0,
            };
            let mut buf = std::io::Cursor::new(Vec::new());
            let rep = quantize_file(&mut src, &cfg, &Calibration::default(), &mut buf).unwrap();
            let bound = if scheme == Scheme::W4A16 { 0.2 } else { 0.01 };
            for t in &rep.tensors {
                assert!(t.rel_error < bound, "{}: {}", t.name, t.rel_error);
            }
            let mut g = GgufFile::from_bytes("draft.gguf", buf.into_inner()).unwrap();
            assert_eq!(g.string("tandem.quant.scheme").unwrap(), scheme.name());
            let m =
                tandem_engine::LlamaModel::load(&mut g, tandem_engine::WeightMode::Native).unwrap();
            let want = if scheme == Scheme::W4A16 {
                "q4_0"
            } else {
                "q8_0"
            };
            assert_eq!(m.format(), want);
        }
        let bad = QuantConfig {
            group_size: 48,
            ..QuantConfig::default()
        };
        let err = quantize_file(
            &mut src,
            &bad,
            &Calibration::default(),
            &mut std::io::Cursor::new(Vec::new()),
        )
        .unwrap_err();
        assert!(err.to_string().contains("group_size"), "{err}");
    }
}
