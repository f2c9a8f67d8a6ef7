use crate::*;

pub(super) use runs::cfg as runs_cfg;

mod runs {
    use super::*;

    pub(crate) fn cfg(users: usize, gamma: usize) -> SimConfig {
        SimConfig {
            users,
            replicas: 1,
            alpha: 0.8,
            draft_ms: 11.0,
            rtt_ms: 50.0,
            rtt_spread_pct: 0.0,
            jitter_pct: 10.0,
            tree: tandem_spec::pipeline::TreeArg(None),
            cover: 0.6,
            leaf_cost: 0.3,
            gamma,
            depth: 2,
            adaptive: false,
            prompt_tokens: 1,
            prefix_hit: 0.0,
            new_tokens: 200,
            copy_share: 0.0,
            copy_span: 12.0,
            self_draft: true,
            suffix: true,
            token_budget: 64,
            kv_blocks: 8192,
            cost: ForwardCost {
                one_token_ms: 44.0,
                ms_per_token: 2.2,
            },
            warmup_s: 5.0,
            duration_s: 20.0,
            seed: 3,
        }
    }

    #[test]
    fn the_simulation_is_lossless_and_speculation_never_commits_less_than_cloud_only() {
        for users in [1, 4, 16, 64] {
            let cloud = simulate(&cfg(users, 0)).unwrap();
            // As `cloud serve` runs by default: grants follow the load.
            let spec = simulate(&SimConfig {
                adaptive: true,
                ..cfg(users, 4)
            })
            .unwrap();
            println!("{users} users: cloud-only {cloud:?}\n  speculation {spec:?}");
            for r in [&cloud, &spec] {
                assert_eq!((r.wrong_tokens, r.protocol_errors), (0, 0), "{r:?}");
                assert!(r.tokens_per_s > 0.0 && r.forwards > 0, "{r:?}");
            }
            // The model of cloud-only decoding agrees with the simulation.
            let ratio = cloud.tokens_per_s / cloud.predicted_tokens_per_s;
            assert!((0.85..1.15).contains(&ratio), "{users} users: {cloud:?}");
            // The verifier decodes a speculation session whenever it has no block to verify, so
            // speculation commits at least what cloud-only does (within the simulation's noise).
            assert!(
                spec.tokens_per_s >= 0.97 * cloud.tokens_per_s,
                "{users} users: {spec:?} against {cloud:?}"
            );
        }
    }

    #[test]
    fn lanes_of_the_draft_tree_are_lossless_at_any_load() {
        for users in [1, 4, 16] {
            let c = SimConfig {
                rtt_ms: 100.0,
                alpha: 0.85,
                adaptive: true,
                tree: tandem_spec::pipeline::parse_tree("2:0.5:0.0").unwrap(),
                ..cfg(users, 2)
            };
            let r = simulate(&c).unwrap();
            assert_eq!((r.wrong_tokens, r.protocol_errors), (0, 0), "{users} users");
            assert!(r.tokens_per_s > 0.0);
        }
    }

    #[test]
    fn the_simulation_is_deterministic_and_spreads_users_over_replicas() {
        let mut c = cfg(40, 4);
        c.adaptive = true;
        c.replicas = 4;
        c.rtt_spread_pct = 50.0;
        c.prompt_tokens = 30;
        c.new_tokens = 40;
        let (a, b) = (simulate(&c).unwrap(), simulate(&c).unwrap());
        assert_eq!(
            (
                a.tokens_per_s,
                a.itl_ms,
                a.forwards,
                a.events,
                a.sessions_done
            ),
            (
                b.tokens_per_s,
                b.itl_ms,
                b.forwards,
                b.events,
                b.sessions_done
            )
        );
        assert_eq!((a.wrong_tokens, a.protocol_errors), (0, 0), "{a:?}");
        // Four replicas of ten users each serve what one replica of ten does, four times.
        let mut one = c.clone();
        one.users = 10;
        one.replicas = 1;
        let o = simulate(&one).unwrap();
        let ratio = a.tokens_per_s / (4.0 * o.tokens_per_s);
        assert!((0.85..1.15).contains(&ratio), "{a:?} vs 4 × {o:?}");
    }

    #[test]
    fn a_shared_history_is_served_by_the_prefix_cache_and_the_model_follows() {
        // Conversations' late turns: 400-token prompts, 90% of each the user's history.
        let mut c = cfg(2, 0);
        c.prompt_tokens = 400;
        c.new_tokens = 40;
        let cold = simulate(&c).unwrap();
        c.prefix_hit = 0.9;
        let warm = simulate(&c).unwrap();
        for r in [&cold, &warm] {
            assert_eq!((r.wrong_tokens, r.protocol_errors), (0, 0), "{r:?}");
        }
        // The replica's real scheduler serves the history from its cache (whole pages of it,
        // after each user's first session), and the first token comes sooner.
        assert_eq!(cold.prefix_hit, 0.0, "{cold:?}");
        assert!((0.75..=0.9).contains(&warm.prefix_hit), "{warm:?}");
        assert!(
            warm.ttft_ms.mean < 0.5 * cold.ttft_ms.mean,
            "{cold:?} {warm:?}"
        );
        // The model, given the hit rate, predicts the throughput within 10% and the cache's
        // gain in time to first token within 25%. (Its absolute TTFT is 30–40% short here: it
        // has no wait for the forward in flight when a prompt arrives.)
        for r in [&cold, &warm] {
            let err = (r.predicted_tokens_per_s - r.tokens_per_s).abs() / r.tokens_per_s;
            assert!(err < 0.1, "{r:?}");
        }
        let gain = cold.ttft_ms.mean / warm.ttft_ms.mean;
        let predicted = cold.predicted_ttft_ms / warm.predicted_ttft_ms;
        assert!(
            (predicted / gain - 1.0).abs() < 0.25,
            "gain {gain:.2}, predicted {predicted:.2}: {cold:?} {warm:?}"
        );
    }

    #[test]
    fn jittery_links_keep_each_streams_order() {
        // Blocks sent every 5 ms over a 200 ms ± 50% link would overtake each other if each
        // message took its own jitter alone; a stream keeps its order.
        let mut c = cfg(4, 1);
        (c.draft_ms, c.rtt_ms, c.jitter_pct, c.depth) = (5.0, 200.0, 50.0, 4);
        for adaptive in [false, true] {
            c.adaptive = adaptive;
            let r = simulate(&c).unwrap();
            assert_eq!((r.wrong_tokens, r.protocol_errors), (0, 0), "{r:?}");
            assert!(r.tokens_per_s > 0.0, "{r:?}");
        }
    }

    #[test]
    fn bad_settings_are_refused_by_name() {
        for (c, want) in [
            (
                SimConfig {
                    alpha: 1.5,
                    ..cfg(1, 4)
                },
                "--alpha",
            ),
            (
                SimConfig {
                    users: 0,
                    ..cfg(1, 4)
                },
                "--sessions",
            ),
            (
                SimConfig {
                    token_budget: 4,
                    ..cfg(1, 4)
                },
                "--token-budget",
            ),
            (
                SimConfig {
                    new_tokens: 0,
                    ..cfg(1, 4)
                },
                "--tokens",
            ),
            (
                SimConfig {
                    copy_share: 1.0,
                    ..cfg(1, 4)
                },
                "--copy-share",
            ),
        ] {
            let e = simulate(&c).unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
        }
    }
}

mod copying {
    use super::runs_cfg as cfg;
    use super::*;

    /// Texts that copy half their output from earlier in themselves, at 100 ms: every row
    /// lossless; each side's drafts that copy are used where they are on and only there; with
    /// both, async beats cloud-only with the verifier's copies; the model follows every row.
    #[test]
    fn a_text_that_copies_itself_is_drafted_by_both_sides_and_stays_lossless() {
        let run = |gamma, self_draft, suffix, copy_share| {
            simulate(&SimConfig {
                prompt_tokens: 100,
                new_tokens: 96,
                copy_share,
                rtt_ms: 100.0,
                duration_s: 60.0,
                self_draft,
                suffix,
                ..cfg(1, gamma)
            })
            .unwrap()
        };
        let plain = run(0, false, false, 0.5);
        let cloud = run(0, true, false, 0.5);
        let model_only = run(4, false, false, 0.5);
        let edge = run(4, false, true, 0.5);
        let both = run(4, true, true, 0.5);
        for r in [&plain, &cloud, &model_only, &edge, &both] {
            assert_eq!((r.wrong_tokens, r.protocol_errors), (0, 0), "{r:?}");
            assert!((0.4..0.6).contains(&r.copy_share), "{r:?}");
            let gap = (r.predicted_itl_ms - r.itl_ms.mean).abs() / r.itl_ms.mean;
            assert!(gap < 0.15, "the model is {:.0}% off: {r:?}", gap * 100.0);
        }
        // Only the sides that copy do.
        for r in [&plain, &model_only, &edge] {
            assert_eq!(r.self_drafted_share, 0.0, "{r:?}");
        }
        for r in [&plain, &cloud, &model_only] {
            assert_eq!(r.edge_copied_share, 0.0, "{r:?}");
        }
        assert!(cloud.self_drafted_share > 0.2, "{cloud:?}");
        assert!(both.self_drafted_share > 0.1, "{both:?}");
        for r in [&edge, &both] {
            assert!(
                r.edge_copied_share > 0.3 && r.edge_copy_acceptance > 0.8,
                "{r:?}"
            );
        }
        // Each source commits faster than without it.
        assert!(cloud.itl_ms.mean < 0.8 * plain.itl_ms.mean);
        assert!(edge.itl_ms.mean < model_only.itl_ms.mean);
        assert!(both.itl_ms.mean < edge.itl_ms.mean);
        assert!(both.itl_ms.mean < cloud.itl_ms.mean);
        // A text that never copies: the verifier's guesses (after chance matches) cost nothing
        // that shows.
        let (fresh_off, fresh_on) = (run(0, false, false, 0.0), run(0, true, false, 0.0));
        assert!(
            fresh_on.itl_ms.mean <= 1.02 * fresh_off.itl_ms.mean,
            "{fresh_on:?}"
        );
        assert_eq!(fresh_on.wrong_tokens, 0);
    }
}

mod adaptive {
    use super::*;

    #[test]
    fn an_adaptive_replica_takes_over_under_load_and_stays_lossless() {
        let base = SimConfig {
            users: 32,
            replicas: 1,
            alpha: 0.6,
            draft_ms: 20.0,
            rtt_ms: 50.0,
            rtt_spread_pct: 20.0,
            jitter_pct: 10.0,
            tree: tandem_spec::pipeline::TreeArg(None),
            cover: 0.6,
            leaf_cost: DEFAULT_LEAF_COST,
            gamma: 4,
            depth: 2,
            adaptive: true,
            prompt_tokens: 30,
            prefix_hit: 0.0,
            new_tokens: 40,
            copy_share: 0.0,
            copy_span: 12.0,
            self_draft: true,
            suffix: true,
            token_budget: 64,
            kv_blocks: 8192,
            cost: ForwardCost {
                one_token_ms: 52.0,
                ms_per_token: 3.5,
            },
            warmup_s: 10.0,
            duration_s: 30.0,
            seed: 5,
        };
        let adaptive = simulate(&base).unwrap();
        let fixed = simulate(&SimConfig {
            adaptive: false,
            ..base.clone()
        })
        .unwrap();
        assert_eq!(adaptive.wrong_tokens + fixed.wrong_tokens, 0);
        assert_eq!(adaptive.protocol_errors + fixed.protocol_errors, 0);
        assert!(
            adaptive.takeovers > 0 && adaptive.cloud_decoded_share > 0.8,
            "{adaptive:?}"
        );
        // Held to its shape, a session is still decoded by the verifier whenever it has no block
        // to verify.
        assert!(
            fixed.cloud_decoded_share > 0.0 && fixed.takeovers == 0,
            "{fixed:?}"
        );
        assert!(
            adaptive.tokens_per_s > fixed.tokens_per_s,
            "{adaptive:?} vs {fixed:?}"
        );
        // One user with a good draft and a far verifier keeps speculating.
        let alone = simulate(&SimConfig {
            users: 1,
            alpha: 0.95,
            rtt_ms: 20.0,
            draft_ms: 10.0,
            ..base
        })
        .unwrap();
        assert!(alone.cloud_decoded_share < 0.2, "{alone:?}");
    }
}

#[test]
fn on_off_flags_take_their_value() {
    use clap::Parser;
    #[derive(Parser)]
    struct Flags {
        #[command(flatten)]
        sim: SimConfig,
    }
    let f = Flags::try_parse_from(["t"]).unwrap();
    assert!(f.sim.self_draft && f.sim.suffix, "on by default");
    let f = Flags::try_parse_from(["t", "--self-draft", "off", "--suffix", "off"]).unwrap();
    assert!(!f.sim.self_draft && !f.sim.suffix);
}
