use super::*;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

fn rand(seed: u64, n: usize) -> Vec<f32> {
    crate::testing::signed_uniform(seed, n, 3)
}

fn stored(dtype: GgmlDType, w: &[f32], rows: usize, cols: usize) -> RowData {
    match dtype {
        GgmlDType::F32 => RowData::f32(w, rows, cols),
        GgmlDType::F16 => RowData::F16(w.iter().map(|&x| f16::from_f32(x)).collect()),
        _ => {
            let t = Tensor::from_slice(w, (rows, cols), &Device::Cpu).unwrap();
            let q = QTensor::quantize(&t, dtype).unwrap();
            let b = q.data().unwrap().into_owned();
            match dtype {
                GgmlDType::Q4_0 => RowData::q4_0(&b),
                GgmlDType::Q4_1 => RowData::q4_1(&b),
                _ => RowData::q8_0(&b),
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
    isa: Isa,
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
    pool.install(|| matmul_on(isa, w, rows, cols, x, n_tok, &mut y));
    y
}

const DTYPES: [GgmlDType; 5] = [
    GgmlDType::F32,
    GgmlDType::F16,
    GgmlDType::Q4_0,
    GgmlDType::Q4_1,
    GgmlDType::Q8_0,
];

#[test]
fn matmul_matches_reference_on_odd_shapes_every_path_and_threads() {
    let shapes = [
        (576, 576),
        (37, 1536),
        (1536, 576),
        (49, 17),
        (21, 100),
        (130, 64),
        (6, 40),
        (49152, 32),
    ];
    for isa in Isa::available() {
        for (si, &(rows, cols)) in shapes.iter().enumerate() {
            for dtype in DTYPES {
                if dtype != GgmlDType::F32 && dtype != GgmlDType::F16 && cols % QK != 0 {
                    continue;
                }
                let w = stored(dtype, &rand(si as u64, rows * cols), rows, cols);
                for n_tok in [1, 2, 3, 5, 9, 13] {
                    let x = rand(100 + si as u64, n_tok * cols);
                    let want = reference(&w, rows, cols, &x, n_tok);
                    let scale = (cols as f64).sqrt();
                    for threads in [1, 2, 3] {
                        let got = run(isa, threads, &w, rows, cols, &x, n_tok);
                        for (g, r) in got.iter().zip(&want) {
                            let err = (*g as f64 - r).abs() / scale;
                            assert!(
                                err < 1e-5,
                                "{isa:?} {dtype:?} {rows}x{cols} n_tok={n_tok} t={threads}: {g} vs {r}"
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn each_row_is_the_same_whatever_the_batch_or_threads() {
    // 30 tokens: three panel tiles of up to 12 (the later ones without prefetches), and
    // every tile width 1..=12 among the slices below.
    const N: usize = 30;
    for (rows, cols) in [(70, 576), (9, 40)] {
        for isa in Isa::available() {
            for dtype in DTYPES {
                if dtype != GgmlDType::F32 && dtype != GgmlDType::F16 && cols % QK != 0 {
                    continue;
                }
                let w = stored(dtype, &rand(9, rows * cols), rows, cols);
                let x = rand(10, N * cols);
                let batched = run(isa, 3, &w, rows, cols, &x, N);
                for n in [1, 2, 3, 5, 7, 10, 11, 12, 13, 25] {
                    for t0 in (0..N - n).step_by(4) {
                        let part = run(isa, 1, &w, rows, cols, &x[t0 * cols..(t0 + n) * cols], n);
                        assert_eq!(
                            &batched[t0 * rows..(t0 + n) * rows],
                            &part[..],
                            "{isa:?} {dtype:?} {rows}x{cols}: tokens {t0}..{}",
                            t0 + n
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn exp_is_within_two_ulp_of_f64() {
    let mut worst = 0f64;
    for i in 0..=2_000_000 {
        let x = -87.0 + 175.0 * i as f32 / 2_000_000.0;
        let (got, want) = (exp(x) as f64, (x as f64).exp());
        let ulp = (want as f32).to_bits();
        let ulp = (f32::from_bits(ulp + 1) - want as f32) as f64;
        worst = worst.max((got - want).abs() / ulp);
    }
    assert!(worst <= 2.0, "exp is {worst} ulp off");
    assert_eq!(exp(0.0), 1.0);
    assert_eq!(exp(-100.0), 0.0);
    assert_eq!(exp(f32::NEG_INFINITY), 0.0);
    assert!(exp(100.0).is_finite() && exp(100.0) > 1e38);
    assert!(exp(f32::NAN).is_nan());
}

#[test]
fn the_avx2_path_gives_the_portable_bits() {
    let (rows, cols) = (70, 576);
    if !Isa::available().contains(&Isa::Avx2) {
        return;
    }
    for dtype in DTYPES {
        let w = stored(dtype, &rand(9, rows * cols), rows, cols);
        let x = rand(10, 11 * cols);
        assert_eq!(
            run(Isa::Portable, 1, &w, rows, cols, &x, 11),
            run(Isa::Avx2, 2, &w, rows, cols, &x, 11),
            "{dtype:?}"
        );
    }
}

#[test]
fn every_path_dequantizes_to_the_same_weights() {
    // A row times one-hot tokens reads the weights back: the AVX-512 dequantization must give
    // the portable path's values (only the reductions may round differently).
    let (rows, cols) = (8, 64);
    for dtype in DTYPES {
        let w = stored(dtype, &rand(3, rows * cols), rows, cols);
        let mut x = vec![0f32; cols * cols];
        for i in 0..cols {
            x[i * cols + i] = 1.0;
        }
        let want = run(Isa::Portable, 1, &w, rows, cols, &x, cols);
        for isa in Isa::available() {
            assert_eq!(
                run(isa, 1, &w, rows, cols, &x, cols),
                want,
                "{isa:?} {dtype:?}"
            );
        }
    }
}
