//! Reading GGUF files (through candle's reader) with errors that name the file, key or tensor.

use std::fs::File;
use std::io::{BufReader, Cursor, Read, Seek};
use std::path::Path;

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::QTensor;
use candle_core::Device;

use crate::error::{EngineError, Result};

trait ReadSeek: Read + Seek + Send {}
impl<T: Read + Seek + Send> ReadSeek for T {}

/// An open GGUF file: its metadata and a reader for its tensors.
pub struct GgufFile {
    pub path: String,
    pub content: Content,
    reader: Box<dyn ReadSeek>,
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self> {
        let name = path.display().to_string();
        let file = File::open(path).map_err(|source| EngineError::Io {
            path: name.clone(),
            source,
        })?;
        Self::from_reader(name, Box::new(BufReader::new(file)))
    }

    /// A GGUF image held in memory (tests build tiny models this way).
    pub fn from_bytes(name: &str, bytes: Vec<u8>) -> Result<Self> {
        Self::from_reader(name.to_string(), Box::new(Cursor::new(bytes)))
    }

    fn from_reader(path: String, mut reader: Box<dyn ReadSeek>) -> Result<Self> {
        let content = Content::read(&mut reader).map_err(|e| EngineError::Format {
            path: path.clone(),
            message: format!("not a readable GGUF file: {e}"),
        })?;
        Ok(Self {
            path,
            content,
            reader,
        })
    }

    pub fn value(&self, key: &str) -> Result<&Value> {
        self.content
            .metadata
            .get(key)
            .ok_or_else(|| EngineError::Metadata {
                key: key.into(),
                message: "missing".into(),
            })
    }

    pub(crate) fn bad(key: &str, e: impl std::fmt::Display) -> EngineError {
        EngineError::Metadata {
            key: key.into(),
            message: e.to_string(),
        }
    }

    pub fn u64(&self, key: &str) -> Result<u64> {
        let v = self.value(key)?;
        v.to_u64()
            .or_else(|_| v.to_u32().map(u64::from))
            .or_else(|_| v.to_i32().map(|x| x as u64))
            .map_err(|e| Self::bad(key, e))
    }

    pub fn usize(&self, key: &str) -> Result<usize> {
        Ok(self.u64(key)? as usize)
    }

    pub fn f32(&self, key: &str) -> Result<f32> {
        let v = self.value(key)?;
        v.to_f32()
            .or_else(|_| v.to_f64().map(|x| x as f32))
            .map_err(|e| Self::bad(key, e))
    }

    pub fn string(&self, key: &str) -> Result<&str> {
        self.value(key)?
            .to_string()
            .map(|s| s.as_str())
            .map_err(|e| Self::bad(key, e))
    }

    pub fn bool_or(&self, key: &str, default: bool) -> bool {
        self.content
            .metadata
            .get(key)
            .and_then(|v| v.to_bool().ok())
            .unwrap_or(default)
    }

    pub fn array(&self, key: &str) -> Result<&Vec<Value>> {
        self.value(key)?.to_vec().map_err(|e| Self::bad(key, e))
    }

    /// The weights' count of values, all tensors together (×4: their bytes in f32).
    pub fn num_values(&self) -> u64 {
        self.content
            .tensor_infos
            .values()
            .map(|t| t.shape.elem_count() as u64)
            .sum()
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    /// The tensor `name`, with its shape checked against `dims` (row-major, `[rows, cols]`).
    pub fn tensor(&mut self, name: &str, dims: &[usize]) -> Result<QTensor> {
        let info = self
            .content
            .tensor_infos
            .get(name)
            .ok_or_else(|| EngineError::Tensor {
                name: name.into(),
                message: format!("missing from {}", self.path),
            })?;
        if info.shape.dims() != dims {
            return Err(EngineError::Tensor {
                name: name.into(),
                message: format!("shape {:?}, expected {dims:?}", info.shape.dims()),
            });
        }
        let offset = self.content.tensor_data_offset;
        info.read(&mut self.reader, offset, &Device::Cpu)
            .map_err(|e| EngineError::Tensor {
                name: name.into(),
                message: e.to_string(),
            })
    }

    /// The tensor `name` dequantized to f32, flattened.
    pub fn tensor_f32(&mut self, name: &str, dims: &[usize]) -> Result<Vec<f32>> {
        let t = self.tensor(name, dims)?;
        dequantize_f32(name, &t)
    }
}

pub fn dequantize_f32(name: &str, t: &QTensor) -> Result<Vec<f32>> {
    let wrap = |e: candle_core::Error| EngineError::Tensor {
        name: name.into(),
        message: e.to_string(),
    };
    t.dequantize(&Device::Cpu)
        .and_then(|d| d.flatten_all())
        .and_then(|d| d.to_vec1::<f32>())
        .map_err(wrap)
}
