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

mod file;
mod grid;
mod scheme;

pub use file::*;
pub use grid::*;
pub use scheme::*;

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::file::rel_error;
    use proptest::prelude::*;
    use tandem_engine::kernels::{dequantize_row, RowData};
    use tandem_engine::GgufFile;

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
                draft_vocab: None,
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
            assert_eq!(m.head_vocab(), None);
        }
        // A draft head over some tokens travels in the file and restricts the head at load.
        let ids = [0u32, 7, 42, 95];
        let mut buf = std::io::Cursor::new(Vec::new());
        let calib = Calibration {
            draft_vocab: Some(&ids),
            ..Calibration::default()
        };
        quantize_file(&mut src, &QuantConfig::default(), &calib, &mut buf).unwrap();
        let mut g = GgufFile::from_bytes("draft.gguf", buf.into_inner()).unwrap();
        let m = tandem_engine::LlamaModel::load(&mut g, tandem_engine::WeightMode::Native).unwrap();
        assert_eq!(m.head_vocab(), Some(&ids[..]));
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
