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
                GgmlDType::Q5_0 => RowData::q5_0(&b),
                GgmlDType::Q4K => RowData::q4_k(&b),
                GgmlDType::Q6K => RowData::q6_k(&b),
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

const DTYPES: [GgmlDType; 8] = [
    GgmlDType::F32,
    GgmlDType::F16,
    GgmlDType::Q4_0,
    GgmlDType::Q4_1,
    GgmlDType::Q8_0,
    GgmlDType::Q5_0,
    GgmlDType::Q4K,
    GgmlDType::Q6K,
];

/// Can rows `cols` wide be stored in `dtype`'s blocks?
fn fits(dtype: GgmlDType, cols: usize) -> bool {
    cols.is_multiple_of(dtype.block_size())
}

#[test]
fn matmul_matches_reference_on_odd_shapes_every_path_and_threads() {
    let shapes = [
        (576, 576),
        (37, 1536),
        (19, 2304),
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
                if !fits(dtype, cols) {
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
    for (rows, cols) in [(70, 576), (9, 40), (13, 768)] {
        for isa in Isa::available() {
            for dtype in DTYPES {
                if !fits(dtype, cols) {
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
fn every_path_gives_the_portable_bits() {
    // Every shape a forward runs: one token, chunks of 2..16, a long ragged batch; rows that
    // end a panel or a register tile early; f32 and f16 reductions with a tail past 16.
    let shapes = [
        (70, 576),
        (9, 40),
        (37, 1536),
        (17, 100),
        (130, 64),
        (6, 4864),
    ];
    let paths = Isa::available();
    eprintln!("paths compared with the portable one: {paths:?}");
    for (si, &(rows, cols)) in shapes.iter().enumerate() {
        for dtype in DTYPES {
            if !fits(dtype, cols) {
                continue;
            }
            let w = stored(dtype, &rand(si as u64 + 20, rows * cols), rows, cols);
            for n_tok in (1..=16).chain([30]) {
                let x = rand(40 + n_tok as u64, n_tok * cols);
                let want = run(Isa::Portable, 1, &w, rows, cols, &x, n_tok);
                for &isa in &paths {
                    let got = run(isa, 2, &w, rows, cols, &x, n_tok);
                    let same = got
                        .iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(
                        same,
                        "{isa:?} {dtype:?} {rows}x{cols} n_tok={n_tok}: not the portable bits"
                    );
                }
            }
        }
    }
}

#[test]
fn every_path_dequantizes_to_the_same_weights() {
    // A row times one-hot tokens reads the weights back: every path's dequantization gives the
    // portable path's values.
    let (rows, cols) = (8, 256);
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

#[test]
fn the_block_formats_dequantize_to_ggmls_values_bit_for_bit() {
    // candle's dequantization is ggml's; the repacked blocks give the same f32 weights, and so
    // do the rows picked out of them (the draft's vocabulary head) and the first rows. A zero
    // weight's sign may differ (d·0 + 0 is +0): it cannot change a sum that starts at +0.
    let (rows, cols) = (12, 768);
    for dtype in &DTYPES[2..] {
        let w = rand(80, rows * cols);
        let t = Tensor::from_slice(&w, (rows, cols), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&t, *dtype).unwrap();
        let want: Vec<f32> = q
            .dequantize(&Device::Cpu)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let same = |got: &[f32], want: &[f32]| {
            got.len() == want.len() && got.iter().zip(want).all(|(a, b)| a == b && !a.is_nan())
        };
        let stored = stored(*dtype, &w, rows, cols);
        let mut row = vec![0f32; cols];
        for r in 0..rows {
            dequantize_row(&stored, r, cols, &mut row);
            assert!(
                same(&row, &want[r * cols..(r + 1) * cols]),
                "{dtype:?} row {r}"
            );
        }
        let picked = stored.select_rows(&[7, 2, 11], cols);
        for (i, r) in [7, 2, 11].into_iter().enumerate() {
            dequantize_row(&picked, i, cols, &mut row);
            assert!(
                same(&row, &want[r * cols..(r + 1) * cols]),
                "{dtype:?} picked row {r}"
            );
        }
        let first = stored.first_rows(5, cols);
        dequantize_row(&first, 4, cols, &mut row);
        assert!(
            same(&row, &want[4 * cols..5 * cols]),
            "{dtype:?} first rows"
        );
    }
}

fn run_a8(isa: Isa, threads: usize, w: &RowData, rows: usize, x: &a8::Q8Acts) -> Vec<f32> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    let mut y = vec![0f32; x.n_tok() * rows];
    let w = a8::A8Matrix::pack(w, rows, x.cols).unwrap();
    pool.install(|| a8::matmul_a8_on(isa, &w, x, &mut y));
    y
}

/// The block formats of [`DTYPES`] (all but f32 and f16): those with an 8-bit-activation kernel.
const BLOCK_DTYPES: &[GgmlDType] = DTYPES.split_at(2).1;

#[test]
fn eight_bit_activations_multiply_the_quantized_activations_exactly_on_every_path() {
    // The reference: the dequantized weights times the dequantized activations (dx·xq), in
    // f64; the kernels round each block's scale product and their sums in f32 only.
    // 2304 columns: 72 blocks, past the flat AVX2 tile's 64 (the blocked one).
    // The k-quants take the shapes of whole super-blocks (and 4864: the 0.5B's down projection).
    let shapes = [
        (70, 576),
        (9, 64),
        (37, 1536),
        (130, 96),
        (6, 2304),
        (11, 4864),
        (24, 512),
    ];
    for (si, &(rows, cols)) in shapes.iter().enumerate() {
        for dtype in BLOCK_DTYPES.iter().copied().filter(|&d| fits(d, cols)) {
            let w = stored(dtype, &rand(si as u64 + 60, rows * cols), rows, cols);
            for n_tok in (1..=9).chain([16, 30]) {
                let x = rand(70 + n_tok as u64, n_tok * cols);
                let xq = a8::Q8Acts::quantize(&x, cols);
                let deq: Vec<f32> = xq
                    .qs
                    .iter()
                    .enumerate()
                    .map(|(i, &q)| xq.d[i / QK] * f32::from(q))
                    .collect();
                let want = reference(&w, rows, cols, &deq, n_tok);
                let portable = run_a8(Isa::Portable, 1, &w, rows, &xq);
                let scale = (cols as f64).sqrt();
                for (g, r) in portable.iter().zip(&want) {
                    assert!(
                        (*g as f64 - r).abs() / scale < 1e-5,
                        "{dtype:?} {rows}x{cols} n_tok={n_tok}: {g} vs {r}"
                    );
                }
                for isa in Isa::available() {
                    let got = run_a8(isa, 2, &w, rows, &xq);
                    assert!(
                        got.iter()
                            .zip(&portable)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{isa:?} {dtype:?} {rows}x{cols} n_tok={n_tok}: not the portable bits"
                    );
                }
            }
        }
    }
}

#[test]
fn eight_bit_activations_give_each_row_the_same_bits_whatever_the_batch() {
    let (rows, cols, n) = (70, 768, 30);
    for isa in Isa::available() {
        for &dtype in BLOCK_DTYPES {
            let w = stored(dtype, &rand(61, rows * cols), rows, cols);
            let x = rand(62, n * cols);
            let batched = run_a8(isa, 3, &w, rows, &a8::Q8Acts::quantize(&x, cols));
            for (t0, k) in [(0, 1), (3, 2), (5, 3), (9, 4), (13, 7), (20, 10)] {
                let part = a8::Q8Acts::quantize(&x[t0 * cols..(t0 + k) * cols], cols);
                assert_eq!(
                    &batched[t0 * rows..(t0 + k) * rows],
                    &run_a8(isa, 1, &w, rows, &part)[..],
                    "{isa:?} {dtype:?}: tokens {t0}..{}",
                    t0 + k
                );
            }
        }
    }
}

#[test]
fn the_first_rows_of_a_repacked_matrix_multiply_as_the_repacking_of_the_first_rows() {
    let (rows, cols) = (70, 512);
    let x = a8::Q8Acts::quantize(&rand(64, 3 * cols), cols);
    for &dtype in BLOCK_DTYPES {
        let w = stored(dtype, &rand(63, rows * cols), rows, cols);
        let all = a8::A8Matrix::pack(&w, rows, cols).unwrap();
        for r in [1, 8, 13, 64, 70] {
            let (first, packed) = (
                all.first_rows(r),
                a8::A8Matrix::pack(&w.first_rows(r, cols), r, cols).unwrap(),
            );
            if r % 8 == 0 {
                assert_eq!(first, packed, "{dtype:?}: {r} rows");
            }
            for isa in Isa::available() {
                let (mut y1, mut y2) = (vec![0f32; 3 * r], vec![0f32; 3 * r]);
                a8::matmul_a8_on(isa, &first, &x, &mut y1);
                a8::matmul_a8_on(isa, &packed, &x, &mut y2);
                assert_eq!(y1, y2, "{isa:?} {dtype:?}: {r} rows");
            }
        }
    }
}

#[test]
fn four_dots_at_once_are_four_dots_on_every_path() {
    // Attention's scores: a query head against four K rows; widths a multiple of 16 (the
    // vectors' case) and not (each row alone).
    for n in [16usize, 64, 256, 40, 7] {
        let q = rand(n as u64, n);
        let k: Vec<Vec<f32>> = (0..4).map(|i| rand(100 + i + n as u64, n)).collect();
        let rows = [&k[0][..], &k[1][..], &k[2][..], &k[3][..]];
        let want: Vec<u32> = rows.iter().map(|r| dot(&q, r).to_bits()).collect();
        for isa in Isa::available() {
            let got: Vec<u32> = dots4_on(isa, &q, rows)
                .iter()
                .map(|x| x.to_bits())
                .collect();
            assert_eq!(got, want, "{isa:?} n={n}");
            let one: Vec<u32> = rows.iter().map(|r| dot_on(isa, &q, r).to_bits()).collect();
            assert_eq!(one, want, "{isa:?} n={n}: dot_on");
        }
    }
}
