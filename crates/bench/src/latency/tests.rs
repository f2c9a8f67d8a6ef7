use super::*;

#[test]
fn chunk_times_fit_a_line_and_pipelined_plans_have_depth() {
    let v = serde_json::json!({"1": 20.0, "3": 30.0, "5": 40.0});
    let (fixed, slope) = fit_chunks(&v).unwrap();
    assert!((fixed - 15.0).abs() < 1e-9 && (slope - 5.0).abs() < 1e-9);
    assert!(fit_chunks(&serde_json::json!({"1": 2.0})).is_none());
    let c = Costs {
        alpha: 0.3,
        draft_ms: 60.0,
        verify_ms: 80.0,
        verify_ms_per_token: 8.0,
        rtt_ms: 0.0,
        verdict_ms: 0.0,
    };
    let (_, d) = plan_pipelined(&c, 8, 4);
    assert!(d >= 2);
    let peer = serde_json::json!({
        "target f32": {"decode_tok_s": 10.0, "chunk_ms": v},
        "d": {"decode_tok_s": 50.0},
    });
    let m = peer_model(&peer, &[("d".into(), c)], &[0.0, 100.0], 8, 4);
    assert_eq!(m.len(), 2);
    assert_eq!(m[0].edge_only_itl_ms, 20.0);
    assert_eq!(m[0].cloud_only_itl_ms, 100.0);
    // Protocol 2: a longer round trip never costs more than the verifier decoding alone
    // (here one chunk of 1 token: 15 + 5·2 ms), which a poor draft is held to.
    assert!(m[1].best_sync_itl_ms >= m[0].best_sync_itl_ms);
    assert!(
        m.iter().all(|m| m.best_async_itl_ms <= 25.0 + 1e-9),
        "{m:?}"
    );
}

#[test]
fn the_structured_workload_parses_and_every_schema_compiles() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../data/structured/extraction.json"
    );
    let work: Vec<StructuredPrompt> =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    assert!(work.len() >= 5);
    // Printable ASCII and an end token: enough for llguidance to compile each schema.
    let tokens: Vec<Vec<u8>> = (0x20u8..0x7f)
        .map(|b| vec![b])
        .chain([b"<end>".to_vec()])
        .collect();
    let mut special = vec![false; tokens.len()];
    special[tokens.len() - 1] = true;
    let end = (tokens.len() - 1) as u32;
    let vocab = tandem_spec::GrammarVocab::new(&tokens, &special, &[end], tokens.len()).unwrap();
    for w in &work {
        assert!(!w.prompt.is_empty());
        vocab
            .compile(&tandem_spec::GrammarSource::JsonSchema(
                w.schema.to_string(),
            ))
            .unwrap_or_else(|e| panic!("{}: {e}", w.prompt));
    }
}
