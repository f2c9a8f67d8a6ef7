//! The f32 panel kernel over the SmolLM2-135M target's 30 layers' matrices (425 MB a pass, so
//! from memory), each matrix once a pass, on one thread: ms and GB/s for each token count given
//! (default 1 2 3 5 8), the best of 20 passes; then the tied head (49152 × 576, 113 MB) alone. It times the kernels of the checkout it is built
//! from; to compare two kernels, build each (`git checkout REV -- crates/engine/src/kernels`)
//! and alternate the binaries. `TANDEM_KERNELS=avx2` forces the AVX2 path.
//! `cargo run --release -p tandem-bench --example panel_streams -- 1 2 3 5 8`

use std::time::Instant;
use tandem_engine::kernels::{matmul, Isa, RowData};

fn main() {
    let mut ks: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("token counts"))
        .collect();
    if ks.is_empty() {
        ks = vec![1, 2, 3, 5, 8];
    }
    // wq, wk, wv, wo, gate, up, down of one layer: (rows, cols).
    let shapes = [
        (576, 576),
        (192, 576),
        (192, 576),
        (576, 576),
        (1536, 576),
        (1536, 576),
        (576, 1536),
    ];
    let ws: Vec<(RowData, usize, usize)> = (0..30)
        .flat_map(|_| shapes)
        .map(|(r, c)| {
            let w: Vec<f32> = (0..r * c)
                .map(|i| ((i * 7919) % 1000) as f32 * 1e-3)
                .collect();
            (RowData::f32(&w, r, c), r, c)
        })
        .collect();
    let bytes: usize = ws.iter().map(|(_, r, c)| r * c * 4).sum();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .expect("a one-thread pool");
    println!("kernels: {}", Isa::selected().name());
    pool.install(|| {
        for &k in &ks {
            let x: Vec<f32> = (0..k * 1536).map(|i| (i % 13) as f32).collect();
            let mut y = vec![0f32; k * 1536];
            let mut best = f64::MAX;
            for _ in 0..20 {
                let t = Instant::now();
                for (w, r, c) in &ws {
                    matmul(w, *r, *c, &x[..k * c], k, &mut y[..k * r]);
                }
                best = best.min(t.elapsed().as_secs_f64());
            }
            println!(
                "{k} tokens: {:.2} ms, {:.1} GB/s",
                best * 1e3,
                bytes as f64 / best / 1e9
            );
        }
        let (hr, hc) = (49152, 576);
        let w: Vec<f32> = (0..hr * hc)
            .map(|i| ((i * 7919) % 1000) as f32 * 1e-3)
            .collect();
        let head = RowData::f32(&w, hr, hc);
        drop(w);
        for &k in &ks {
            let x: Vec<f32> = (0..k * hc).map(|i| (i % 13) as f32).collect();
            let mut y = vec![0f32; k * hr];
            let mut best = f64::MAX;
            for _ in 0..20 {
                let t = Instant::now();
                matmul(&head, hr, hc, &x, k, &mut y);
                best = best.min(t.elapsed().as_secs_f64());
            }
            println!(
                "head, {k} tokens: {:.2} ms, {:.1} GB/s",
                best * 1e3,
                (hr * hc * 4) as f64 / best / 1e9
            );
        }
    });
}
