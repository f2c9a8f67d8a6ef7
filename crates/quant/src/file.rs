//! Quantizing a whole GGUF file: every weight matrix on its grid (by rounding or GPTQ), the
//! embedding at its precision, norms kept, and what each tensor lost ([`Report`]).

use std::collections::BTreeMap;
use std::io::{BufWriter, Seek, Write};

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{ggml_file, GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use rayon::prelude::*;
use serde::Serialize;
use tandem_engine::GgufFile;

use crate::*;

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

pub(crate) fn rel_error(w: &[f32], back: &[f32]) -> f64 {
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
    /// The token ids the draft's head scores, written as `tandem.draft_vocab` (the engine's
    /// `DRAFT_VOCAB_KEY`).
    pub draft_vocab: Option<&'a [u32]>,
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
    if let Some(ids) = calib.draft_vocab {
        meta.retain(|(k, _)| k != tandem_engine::models::llama::DRAFT_VOCAB_KEY);
        meta.push((
            tandem_engine::models::llama::DRAFT_VOCAB_KEY.into(),
            Value::Array(ids.iter().map(|&i| Value::U32(i)).collect()),
        ));
    }
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
