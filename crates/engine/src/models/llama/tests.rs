use super::*;

fn rand(seed: u64, n: usize) -> Vec<f32> {
    crate::testing::signed_uniform(seed, n, 7)
}

/// Plain f64 attention of one head over positions laid out `at(j) = stride·j + off`.
fn reference(
    q: &[f32],
    ks: &[f32],
    vs: &[f32],
    n_ctx: usize,
    at: impl Fn(usize) -> usize,
) -> Vec<f64> {
    let hd = q.len();
    let scale = 1.0 / (hd as f64).sqrt();
    let s: Vec<f64> = (0..n_ctx)
        .map(|j| {
            (0..hd)
                .map(|i| q[i] as f64 * ks[at(j) + i] as f64)
                .sum::<f64>()
                * scale
        })
        .collect();
    let max = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = s.iter().map(|v| (v - max).exp()).collect();
    let sum: f64 = e.iter().sum();
    (0..hd)
        .map(|i| (0..n_ctx).map(|j| e[j] / sum * vs[at(j) + i] as f64).sum())
        .collect()
}

#[test]
fn attention_matches_a_plain_reference() {
    for hd in [64usize, 40, 160] {
        for n_ctx in [1usize, 7, 150] {
            let stride = 3 * hd; // other heads' slots between this head's positions
            let at = |j: usize| j * stride + hd;
            let ks = rand(1, n_ctx * stride + 2 * hd);
            let vs = rand(2, n_ctx * stride + 2 * hd);
            // Two tokens of three query heads that read the same KV head, the second's context
            // the first's and one more position: together and each head alone give the same
            // bits, and each the reference's.
            let qs: Vec<f32> = rand(3, 6 * hd).iter().map(|v| v * 4.0).collect();
            let scale = 1.0 / (hd as f32).sqrt();
            let rows: Vec<usize> = (0..n_ctx + 1).map(|j| j * stride).collect();
            let ctx = [&rows[..n_ctx], &rows[..]];
            let mut together = vec![0f32; 6 * hd];
            {
                let (a, b) = together.split_at_mut(3 * hd);
                attend(
                    kernels::Isa::Portable,
                    &[&qs[..3 * hd], &qs[3 * hd..]],
                    hd,
                    &ks,
                    &vs,
                    &ctx,
                    shared_context(&ctx),
                    hd,
                    scale,
                    &mut [a, b],
                );
            }
            for (i, q) in qs.chunks_exact(hd).enumerate() {
                let n = ctx[i / 3].len();
                let want = reference(q, &ks, &vs, n, at);
                let mut alone = vec![0f32; hd];
                attend(
                    kernels::Isa::Portable,
                    &[q],
                    hd,
                    &ks,
                    &vs,
                    &[ctx[i / 3]],
                    ctx[i / 3].len(),
                    hd,
                    scale,
                    &mut [&mut alone],
                );
                let got = &together[i * hd..(i + 1) * hd];
                assert_eq!(
                    got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    alone.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    "hd {hd} n_ctx {n}: head {i} together and alone differ"
                );
                for (g, w) in got.iter().zip(&want) {
                    assert!(
                        (*g as f64 - w).abs() < 1e-5,
                        "hd {hd} n_ctx {n}: {g} vs {w}"
                    );
                }
            }
        }
    }
}
