//! Every file of every committed fuzz corpus (`fuzz/corpus/<target>/`), replayed through its
//! harness: what the fuzzers found stays fixed under an ordinary `cargo test`.

use std::path::PathBuf;

fn replay(target: &str, harness: fn(&[u8])) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/corpus")
        .join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("the corpus {}: {e}", dir.display()))
        .map(|e| e.expect("a corpus entry").path())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "the corpus {} is empty", dir.display());
    for f in &files {
        let data = std::fs::read(f).expect("a corpus file");
        let r = std::panic::catch_unwind(|| harness(&data));
        assert!(r.is_ok(), "{target}: {} fails", f.display());
    }
    eprintln!("{target}: {} inputs replayed", files.len());
}

#[test]
fn verifier_stream_corpus() {
    replay("verifier_stream", tandem_fuzz::verifier_stream);
}

#[test]
fn edge_session_corpus() {
    replay("edge_session", tandem_fuzz::edge_session);
}

#[test]
fn tenants_file_corpus() {
    replay("tenants_file", tandem_fuzz::tenants_file);
}

#[test]
fn gguf_corpus() {
    replay("gguf", tandem_fuzz::gguf);
}

#[test]
fn tokenizer_corpus() {
    replay("tokenizer", tandem_fuzz::tokenizer);
}

/// The GGUF corpus's seed: a tiny valid model (the fuzzer mutates it from there). Run by hand.
#[test]
#[ignore = "writes fuzz/corpus/gguf/seed-tiny-model"]
fn write_the_gguf_seed() {
    let bytes = tandem_engine::testing::tiny_gguf(&tandem_engine::testing::TinySpec::default())
        .expect("a tiny model");
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/gguf/seed-tiny-model");
    std::fs::write(path, bytes).expect("write the seed");
}
