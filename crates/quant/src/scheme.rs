//! The drafts one can ask for: the scheme (weight and activation bits), the group, the
//! embedding's precision, the method (round to nearest, or GPTQ), as one [`QuantConfig`].

use candle_core::quantized::GgmlDType;
use serde::Serialize;

use crate::{QuantError, Result, QK};

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
    pub(crate) fn dtype(self) -> GgmlDType {
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
    /// A draft head over this many of the most frequent tokens (FR-Spec; `None`: the whole
    /// vocabulary). The ids arrive in [`crate::Calibration::draft_vocab`].
    pub draft_vocab: Option<usize>,
}

impl Default for QuantConfig {
    fn default() -> Self {
        Self {
            scheme: Scheme::W4A16,
            method: Method::Rtn,
            group_size: 32,
            embedding: EmbedPrecision::Q8_0,
            draft_vocab: None,
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
