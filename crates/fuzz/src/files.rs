//! What a deployment feeds in from files and users: the tenants file, a GGUF model, and text for
//! the tokenizer and the chat template.

use std::sync::OnceLock;

use tandem_engine::tokenizer::{ChatMessage, TextStream};
use tandem_engine::{GgufFile, LlamaConfig, LlamaModel, Tokenizer, WeightMode};

use crate::Input;

/// `tandem cloud serve --tenants FILE`: parsed or refused by name; a parsed file authenticates
/// only its own keys.
pub fn tenants_file(data: &[u8]) {
    let mut input = Input::new(data);
    let header = String::from_utf8_lossy(input.chunk()).into_owned();
    let text = String::from_utf8_lossy(input.take(usize::MAX));
    let Ok(t) = tandem_cloud::tenants::Tenants::from_toml(&text) else {
        return;
    };
    assert!(t.auth_required(), "a tenants file turns authentication on");
    let _ = format!("{t:?}");
    // A key is at least 16 printable characters: shorter headers never get in.
    if let Ok(id) = t.authenticate(Some(&header)) {
        let key = header.strip_prefix("Bearer ").unwrap_or(&header);
        assert!(key.len() >= 16, "{key:?} authenticated as {id:?}");
    }
    assert!(t.authenticate(None).is_err(), "no header gets in");
}

/// A model file: its metadata, tokenizer, configuration and weights are read or refused with an
/// error, never a panic or an allocation the file's size does not back.
pub fn gguf(data: &[u8]) {
    let Ok(mut g) = GgufFile::from_bytes("fuzz.gguf", data.to_vec()) else {
        return;
    };
    if let Ok(t) = Tokenizer::from_gguf(&g) {
        let _ = t.encode("Hello, world! 123");
        let _ = t.decode(&[0, 1, 2]);
    }
    if LlamaConfig::from_gguf(&g).is_ok() {
        let _ = LlamaModel::load(&mut g, WeightMode::F32);
    }
}

/// SmolLM2's tokenizer (the model is pulled on first use), and which bytes its vocabulary has a
/// token of their own for.
fn smollm2() -> &'static (Tokenizer, [bool; 256]) {
    static T: OnceLock<(Tokenizer, [bool; 256])> = OnceLock::new();
    T.get_or_init(|| {
        let home = tandem_models::pull::home_dir(None);
        let path = tandem_models::pull::ensure_model(&home, true).expect("pull the model");
        let g = GgufFile::open(&path).expect("open the model");
        let t = Tokenizer::from_gguf(&g).expect("the model's tokenizer");
        // Byte-level BPE writes byte b as one character: itself where it is printable (and not a
        // space), else U+0100 + its rank among the others (GPT-2's table).
        let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let mut char_of = [0u32; 256];
        let mut n = 0;
        for b in 0..=255u8 {
            char_of[b as usize] = if printable(b) {
                u32::from(b)
            } else {
                n += 1;
                255 + n
            };
        }
        let single: std::collections::HashSet<u32> = g
            .array("tokenizer.ggml.tokens")
            .expect("the vocabulary")
            .iter()
            .filter_map(|v| {
                let s = v.to_string().ok()?;
                let mut cs = s.chars();
                let c = cs.next()?;
                cs.next().is_none().then_some(c as u32)
            })
            .collect();
        let mut has = [false; 256];
        for b in 0..256 {
            has[b] = single.contains(&char_of[b]);
        }
        (t, has)
    })
}

/// Text through the tokenizer and back, ids through the decoder and the streaming decoder, and
/// text through the chat template.
pub fn tokenizer(data: &[u8]) {
    let (t, has) = smollm2();
    let mut input = Input::new(data);
    match input.byte() % 3 {
        0 => {
            let text = String::from_utf8_lossy(input.take(usize::MAX));
            let ids = t.encode(&text).expect("any text encodes");
            let start = t.encode("").expect("empty text encodes").len();
            let back = t.decode(&ids[start..]).expect("its own ids decode");
            // A byte the vocabulary has no token for is dropped, as the model's own tokenizer
            // (transformers, llama.cpp) drops it: SmolLM2 lacks six control bytes and at least
            // 0xF2 (it begins 4-byte UTF-8 sequences). Nothing else may change.
            let kept: Vec<u8> = text.bytes().filter(|&b| has[b as usize]).collect();
            let kept = String::from_utf8_lossy(&kept);
            assert_eq!(back, kept, "decode(encode(text)) is the text");
            let mut stream = TextStream::default();
            let mut printed = String::new();
            for &id in &ids[start..] {
                printed += &stream.push(t, id).expect("its own ids decode");
            }
            assert!(
                kept.starts_with(&printed),
                "streamed {printed:?} of {kept:?}"
            );
        }
        1 => {
            let ids: Vec<u32> = input
                .take(usize::MAX)
                .chunks(2)
                .map(|c| u32::from(c[0]) << 8 | u32::from(*c.get(1).unwrap_or(&0)))
                .collect();
            let whole = t.decode(&ids);
            let mut stream = TextStream::default();
            for &id in &ids {
                if stream.push(t, id).is_err() {
                    assert!(whole.is_err(), "an id the stream refused decodes whole");
                    break;
                }
            }
        }
        _ => {
            let content = String::from_utf8_lossy(input.take(usize::MAX)).into_owned();
            let text = t
                .render_chat(&[ChatMessage {
                    role: "user".into(),
                    content: content.clone(),
                }])
                .expect("any message renders");
            assert!(
                text.contains(&content),
                "the rendered chat holds the message"
            );
        }
    }
}
