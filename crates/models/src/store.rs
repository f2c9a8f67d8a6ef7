//! Which model file a command means: `target` (the pulled GGUF, dequantized to f32), `draft` (Tandem's
//! default W4A16 group-32 requantization, made on first use) or a path to any GGUF file.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::{ModelError, Result, WithContext};
use tandem_engine::{GgufFile, LlamaModel, Tokenizer, WeightMode};
use tandem_quant::gptq::{self, Hessians};
use tandem_quant::{calibration, Calibration, Method, QuantConfig, Report};

use crate::pull::{self, CatalogModel};

/// A model a command means: a catalog model's target (`smollm2-135m`, `gemma3-270m`,
/// `qwen2.5-coder-1.5b`, `qwen2.5-coder-0.5b`; `target` is the default one), its draft
/// (`NAME-draft`: Tandem's W4A16 requantization of it, made on first use, or the smaller model
/// the catalog pairs it with, `qwen2.5-coder-1.5b-draft` being the 0.5B; `draft` is the default
/// model's) or a GGUF path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSpec {
    Named {
        model: &'static CatalogModel,
        draft: bool,
    },
    Path(PathBuf),
}

impl std::str::FromStr for ModelSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let named = |model, draft| Self::Named { model, draft };
        Ok(match s {
            "target" => Self::TARGET,
            "draft" => Self::DRAFT,
            s => match (pull::find(s), s.strip_suffix("-draft").and_then(pull::find)) {
                (Some(m), _) => named(m, false),
                (None, Some(m)) => named(m, true),
                (None, None) => {
                    let p = PathBuf::from(s);
                    if p.extension().is_none() && !s.contains('/') && !p.exists() {
                        return Err(format!(
                            "`{s}` is no model of the catalog ({}, each with its `-draft`; \
                             `target`, `draft`) nor a GGUF path",
                            pull::names()
                        ));
                    }
                    Self::Path(p)
                }
            },
        })
    }
}

impl std::fmt::Display for ModelSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Named {
                model,
                draft: false,
            } => write!(f, "{}", model.name),
            Self::Named { model, draft: true } => write!(f, "{}-draft", model.name),
            Self::Path(p) => write!(f, "{}", p.display()),
        }
    }
}

impl ModelSpec {
    /// The default model's target (SmolLM2-135M-Instruct in f32).
    pub const TARGET: Self = Self::Named {
        model: &pull::SMOLLM2,
        draft: false,
    };
    /// The default model's draft.
    pub const DRAFT: Self = Self::Named {
        model: &pull::SMOLLM2,
        draft: true,
    };

    /// A catalog model's target.
    pub fn target_of(model: &'static CatalogModel) -> Self {
        Self::Named {
            model,
            draft: false,
        }
    }

    /// Is this a catalog model's target?
    pub fn is_target(&self) -> bool {
        matches!(self, Self::Named { draft: false, .. })
    }

    /// The draft that goes with this spec: a target's own draft; a draft or a path is itself.
    pub fn draft(&self) -> Self {
        match self {
            Self::Named { model, .. } => Self::Named { model, draft: true },
            p => p.clone(),
        }
    }

    /// The target that goes with this spec: a catalog draft's target, else the default target
    /// (a path says nothing of its family; name the target where it is another).
    pub fn target(&self) -> Self {
        match self {
            Self::Named { model, .. } => Self::target_of(model),
            Self::Path(_) => Self::TARGET,
        }
    }

    /// What `tandem demo` asks this model unless told: its catalog model's question (the
    /// target's, for a draft), a general one for a path.
    pub fn demo_prompt(&self) -> &'static str {
        match self {
            Self::Named { model, .. } => model.demo_prompt,
            Self::Path(_) => crate::pull::SMOLLM2.demo_prompt,
        }
    }

    /// The draft length `tandem demo` uses unless told: its catalog model's, 2 for a path.
    pub fn demo_gamma(&self) -> usize {
        match self {
            Self::Named { model, .. } => model.demo_gamma,
            Self::Path(_) => crate::pull::SMOLLM2.demo_gamma,
        }
    }

    /// Weight mode a spec runs in unless told otherwise: a target in f32; a draft in its
    /// blocks with 8-bit activations and integer dot products (W4A8), on every kernel path:
    /// the Qwen2.5-Coder 0.5B in its own Q5_0 / Q4_K / Q6_K / Q8_0 blocks decodes 41 tokens/s
    /// on one AMD Zen 4 core with AVX-512 VNNI (37 with the AVX2 kernel) against 21–22 with f32
    /// activations and llama.cpp's 27 (docs/bench/qwen-native/); on an AVX2 Zen 3, SmolLM2's
    /// draft 97 tokens/s against 51 at the same teacher-forced α, 0.86 (`bench quant`). Other
    /// files in their blocks with f32 activations.
    pub fn default_mode(&self) -> WeightMode {
        self.mode_as(false)
    }

    /// Weight mode of this spec run as the edge's draft: a GGUF path as a catalog draft runs
    /// (8-bit activations: [`ModelSpec::default_mode`]), a catalog model as its own default. A
    /// draft only proposes: its activations' precision moves α, never the committed text.
    pub fn draft_mode(&self) -> WeightMode {
        self.mode_as(true)
    }

    /// The weight mode run as the edge's draft or not: a catalog target in f32; a draft (a
    /// catalog draft, or anything run as the draft) in its blocks with 8-bit activations; any
    /// other file in its blocks.
    fn mode_as(&self, as_draft: bool) -> WeightMode {
        let draft = match self {
            Self::Named { draft: false, .. } => return WeightMode::F32,
            Self::Named { draft: true, .. } => true,
            Self::Path(_) => as_draft,
        };
        if draft {
            WeightMode::W4A8
        } else {
            WeightMode::Native
        }
    }
}

/// A model ready to run, with its tokenizer.
pub struct Loaded {
    pub path: PathBuf,
    pub model: Arc<LlamaModel>,
    pub tokenizer: Tokenizer,
}

pub fn resolve_path(home: &Path, spec: &ModelSpec, quiet: bool) -> Result<PathBuf> {
    match spec {
        ModelSpec::Named {
            model,
            draft: false,
        } => pull::ensure(home, model, quiet),
        ModelSpec::Named { model, draft: true } => ensure_draft_of(home, model, quiet),
        ModelSpec::Path(p) => {
            if !p.is_file() {
                return Err(ModelError::Refused(format!(
                    "--model {}: no such file (use a model of the catalog: {}, each with its \
                     `-draft`; `target`, `draft`; or a GGUF path)",
                    p.display(),
                    pull::names()
                )));
            }
            Ok(p.clone())
        }
    }
}

pub fn load(
    home: &Path,
    spec: &ModelSpec,
    mode: Option<WeightMode>,
    quiet: bool,
) -> Result<Loaded> {
    let path = resolve_path(home, spec, quiet)?;
    let mode = mode.unwrap_or_else(|| spec.default_mode());
    let mut g = GgufFile::open(&path)?;
    if mode == WeightMode::F32 {
        fits_in_memory(&path, 4 * g.num_values(), available_memory())?;
    }
    let tokenizer =
        Tokenizer::from_gguf(&g).with_context(|| format!("tokenizer of {}", path.display()))?;
    let model =
        LlamaModel::load(&mut g, mode).with_context(|| format!("loading {}", path.display()))?;
    Ok(Loaded {
        path,
        model: Arc::new(model),
        tokenizer,
    })
}

/// A field of Linux's `/proc/meminfo` (`MemTotal`, `MemAvailable`, …), bytes; None where it
/// cannot be read.
pub fn meminfo_bytes(field: &str) -> Option<u64> {
    std::fs::read_to_string("/proc/meminfo")
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .map(|kb| kb * 1024)
}

/// The memory this machine has available now, bytes.
fn available_memory() -> Option<u64> {
    meminfo_bytes("MemAvailable")
}

/// Refuse, before loading, weights of `bytes` in f32 that the `available` memory cannot hold
/// (the kernel would kill the process part way through instead), naming both and what holds
/// the file in less.
fn fits_in_memory(path: &Path, bytes: u64, available: Option<u64>) -> Result<()> {
    match available {
        Some(free) if bytes > free => Err(ModelError::Refused(format!(
            "{} in f32 takes {:.1} GB and this machine has {:.1} GB of memory available: free \
             some, or hold the weights in the file's own blocks (`--weights native` for `cloud \
             serve` and `generate`), or choose a smaller model (`--model smollm2-135m`)",
            path.file_name().unwrap_or_default().to_string_lossy(),
            bytes as f64 / 1e9,
            free as f64 / 1e9
        ))),
        _ => Ok(()),
    }
}

/// Quantize the pulled default target with `cfg` into `out` (written beside, then renamed into
/// place).
pub fn quantize_target(home: &Path, cfg: &QuantConfig, out: &Path, quiet: bool) -> Result<Report> {
    quantize_model(home, &pull::SMOLLM2, cfg, out, quiet)
}

/// Quantize the pulled `model` with `cfg` into `out`.
pub fn quantize_model(
    home: &Path,
    model: &CatalogModel,
    cfg: &QuantConfig,
    out: &Path,
    quiet: bool,
) -> Result<Report> {
    let src = pull::ensure(home, model, quiet)?;
    let mut g = GgufFile::open(&src)?;
    let dir = out
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let part = dir.join(format!(
        ".{}.{}.part",
        out.file_name().and_then(|n| n.to_str()).unwrap_or("draft"),
        std::process::id()
    ));
    let hessians = match cfg.method {
        Method::Gptq => Some(calibrated(&src, &mut g, quiet)?),
        Method::Rtn => None,
    };
    let bar = (!quiet).then(|| bar(0, "quantizing tensors"));
    let t0 = std::time::Instant::now();
    let progress = |done: usize, total: usize| {
        if let Some(b) = &bar {
            b.set_length(total as u64);
            b.set_position(done as u64);
        }
    };
    let vocab = match cfg.draft_vocab {
        Some(k) => Some(draft_vocab(&g, k)?),
        None => None,
    };
    let calib = Calibration {
        hessians: hessians.as_deref(),
        progress: Some(&progress),
        draft_vocab: vocab.as_deref(),
        ..Calibration::default()
    };
    let mut f = fs::File::create(&part).with_context(|| format!("creating {}", part.display()))?;
    let report = tandem_quant::quantize_file(&mut g, cfg, &calib, &mut f);
    if let Some(b) = &bar {
        b.finish_and_clear();
        eprintln!("quantized in {:.1} s", t0.elapsed().as_secs_f64());
    }
    drop(f);
    match report {
        Ok(r) => {
            fs::rename(&part, out).with_context(|| format!("writing {}", out.display()))?;
            Ok(r)
        }
        Err(e) => {
            let _ = fs::remove_file(&part);
            Err(e.into())
        }
    }
}

fn bar(len: u64, what: &str) -> indicatif::ProgressBar {
    let b = indicatif::ProgressBar::new(len);
    b.set_style(
        indicatif::ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} ({eta})")
            .expect("invariant: a valid template")
            .progress_chars("=> "),
    );
    b.set_message(what.to_string());
    b
}

/// The Hessians of the target's layer inputs on the shipped calibration text
/// ([`tandem_quant::calibration`]), for GPTQ.
fn calibrate(g: &mut GgufFile, quiet: bool) -> Result<Hessians> {
    let tok = Tokenizer::from_gguf(g).context("the target's tokenizer")?;
    let tokens = tok
        .encode(calibration::TEXT)
        .context("tokenizing the calibration text")?;
    let model = Arc::new(LlamaModel::load(g, WeightMode::F32).context("loading the target")?);
    let bar = (!quiet).then(|| bar(tokens.len() as u64, "calibrating on the target"));
    let progress = |done: usize| {
        if let Some(b) = &bar {
            b.set_position(done as u64);
        }
    };
    let cpus = tandem_engine::CpuSet::allowed().unwrap_or_default();
    let t0 = std::time::Instant::now();
    let h = gptq::collect(&model, &tokens, CALIBRATION_WINDOW, cpus, &progress)
        .context("collecting the calibration Hessians")?;
    if let Some(b) = &bar {
        b.finish_and_clear();
        eprintln!(
            "calibrated on {} tokens of the target's chat turns in {:.1} s",
            h.tokens,
            t0.elapsed().as_secs_f64()
        );
    }
    Ok(h)
}

/// The Hessians for the target at `src`, collected once per process (a study makes several GPTQ
/// drafts from the same target).
fn calibrated(src: &Path, g: &mut GgufFile, quiet: bool) -> Result<Arc<Hessians>> {
    static MEMO: std::sync::Mutex<Option<(PathBuf, Arc<Hessians>)>> = std::sync::Mutex::new(None);
    let mut memo = MEMO.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((p, h)) = memo.as_ref() {
        if p == src {
            return Ok(h.clone());
        }
    }
    let h = Arc::new(calibrate(g, quiet)?);
    *memo = Some((src.to_path_buf(), h.clone()));
    Ok(h)
}

/// The `k` token ids a draft's head keeps ([`Tokenizer::frequency_order`]): those that end
/// generation and mark chat turns, the byte and user-defined tokens, then the most frequent in
/// the calibration text (the target's chat answers), then the vocabulary's own order.
fn draft_vocab(g: &GgufFile, k: usize) -> Result<Vec<u32>> {
    let tok = Tokenizer::from_gguf(g).context("the target's tokenizer")?;
    let n = tok.vocab_size();
    if k == 0 || k > n {
        return Err(ModelError::Refused(format!(
            "a draft head over {k} tokens: the vocabulary has {n}"
        )));
    }
    let turns = ["user", "assistant", "user"].map(|role| tandem_engine::tokenizer::ChatMessage {
        role: role.into(),
        content: "Hi".into(),
    });
    let chat = tok.render_chat(&turns).unwrap_or_default();
    let mut ids = tok
        .frequency_order(calibration::TEXT, &chat)
        .context("ranking the vocabulary")?;
    ids.truncate(k);
    Ok(ids)
}

/// Tokens per calibration context (each window starts afresh, as a chat does).
const CALIBRATION_WINDOW: usize = 512;

/// Where a quantized copy of the default target with `cfg` lives by default.
pub fn quantized_path(home: &Path, cfg: &QuantConfig) -> PathBuf {
    quantized_path_of(home, &pull::SMOLLM2, cfg)
}

/// Where a quantized copy of `model` with `cfg` lives by default.
pub fn quantized_path_of(home: &Path, model: &CatalogModel, cfg: &QuantConfig) -> PathBuf {
    let stem = model.stem;
    let name = match cfg.scheme {
        tandem_quant::Scheme::F32 => format!("{stem}.f32.gguf"),
        s => format!(
            "{stem}.{}-g{}{}{}.gguf",
            s.name(),
            cfg.group_size,
            match cfg.method {
                Method::Rtn => "",
                Method::Gptq => "-gptq",
            },
            cfg.draft_vocab.map_or(String::new(), |k| format!("-v{k}"))
        ),
    };
    pull::models_dir(home).join(name)
}

/// A quantized copy of the default target with `cfg`, made on first use.
pub fn ensure_quantized(home: &Path, cfg: &QuantConfig, quiet: bool) -> Result<PathBuf> {
    ensure_quantized_of(home, &pull::SMOLLM2, cfg, quiet)
}

/// A quantized copy of `model` with `cfg`, made on first use.
pub fn ensure_quantized_of(
    home: &Path,
    model: &CatalogModel,
    cfg: &QuantConfig,
    quiet: bool,
) -> Result<PathBuf> {
    let out = quantized_path_of(home, model, cfg);
    if out.is_file() {
        return Ok(out);
    }
    if !quiet {
        eprintln!(
            "making {} (scheme {}, groups of {})",
            out.display(),
            cfg.scheme.name(),
            cfg.group_size
        );
    }
    quantize_model(home, model, cfg, &out, quiet)?;
    Ok(out)
}

/// The default draft's quantization: W4A16, groups of 32, by GPTQ (with act-order). Measured
/// against round-to-nearest of the same file size (`tandem bench quant --drafts
/// w4a16-g32,w4a16-g32-gptq --no-e2e --alpha-tokens 96`): perplexity 1.10× the target's against
/// 1.20×, greedy α 0.84 against 0.74, the same decode speed; making it takes about two minutes
/// on two cores, once.
pub fn default_draft() -> QuantConfig {
    QuantConfig {
        method: tandem_quant::Method::Gptq,
        ..QuantConfig::default()
    }
}

/// The default draft ([`default_draft`]), made from the default target on first use.
pub fn ensure_draft(home: &Path, quiet: bool) -> Result<PathBuf> {
    ensure_draft_of(home, &pull::SMOLLM2, quiet)
}

/// `model`'s draft: the smaller model of its family the catalog pairs it with, pulled
/// (`model.draft_model`), else [`default_draft`] (with the head over `model.draft_vocab` tokens
/// where the catalog says so), made from it on first use.
pub fn ensure_draft_of(home: &Path, model: &CatalogModel, quiet: bool) -> Result<PathBuf> {
    if let Some(other) = model.draft_model {
        return pull::ensure(home, other, quiet);
    }
    let cfg = QuantConfig {
        draft_vocab: model.draft_vocab,
        ..default_draft()
    };
    ensure_quantized_of(home, model, &cfg, quiet)
}

/// The default target as an f32 GGUF (embedding included), for llama.cpp to run beside Tandem.
pub fn ensure_f32_copy(home: &Path) -> Result<PathBuf> {
    ensure_f32_copy_of(home, &pull::SMOLLM2)
}

/// `model`'s target as an f32 GGUF (embedding included).
pub fn ensure_f32_copy_of(home: &Path, model: &CatalogModel) -> Result<PathBuf> {
    let cfg = QuantConfig {
        scheme: tandem_quant::Scheme::F32,
        embedding: tandem_quant::EmbedPrecision::F32,
        ..QuantConfig::default()
    };
    ensure_quantized_of(home, model, &cfg, true).context("writing the f32 target for llama.cpp")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f32_weights_over_the_available_memory_are_refused_naming_both() {
        let p = Path::new("/m/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf");
        let e = fits_in_memory(p, 6_170_000_000, Some(4_000_000_000)).unwrap_err();
        let m = e.to_string();
        assert!(
            m.contains("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf in f32 takes 6.2 GB")
                && m.contains("4.0 GB of memory available")
                && m.contains("--weights native"),
            "{m}"
        );
        assert!(fits_in_memory(p, 6_170_000_000, Some(8_000_000_000)).is_ok());
        assert!(
            fits_in_memory(p, 6_170_000_000, None).is_ok(),
            "unknown: tried"
        );
        assert!(
            available_memory().is_some_and(|b| b > 0),
            "Linux has /proc/meminfo"
        );
    }

    #[test]
    fn the_qwen_pair_drafts_with_the_smaller_model_from_its_chunks_in_order() {
        let target: ModelSpec = "qwen2.5-coder-1.5b".parse().unwrap();
        let draft: ModelSpec = "qwen2.5-coder-1.5b-draft".parse().unwrap();
        assert_eq!(target.draft(), draft);
        assert_eq!(draft.target(), target);
        assert_eq!(
            pull::QWEN_CODER_15B.draft_model,
            Some(&pull::QWEN_CODER_05B)
        );
        // The 0.5B is a model of its own too (its draft a requantization, as the others').
        let small: ModelSpec = "qwen2.5-coder-0.5b".parse().unwrap();
        assert!(small.is_target() && pull::QWEN_CODER_05B.draft_model.is_none());
        // As the draft, it runs in its own blocks (8-bit activations off the AVX-512 path).
        assert_eq!(draft.draft_mode(), ModelSpec::DRAFT.draft_mode());
        for (m, n) in [(&pull::QWEN_CODER_15B, 22), (&pull::QWEN_CODER_05B, 6)] {
            assert_eq!(m.wheels.len(), n, "{}", m.name);
            for (i, w) in m.wheels.iter().enumerate() {
                let part = format!("/data/part{:02}.bin", i + 1);
                assert!(w.member.ends_with(&part), "{}: {}", m.name, w.member);
                assert!(
                    w.package.contains(&format!("-part{}==", i + 1)),
                    "{}",
                    w.package
                );
                assert_eq!(w.sha256.len(), 64);
            }
        }
    }

    #[test]
    fn a_draft_given_by_path_runs_as_the_catalog_draft() {
        let path: ModelSpec = "/m/SmolLM2-135M-Instruct.w8a16-g32.gguf".parse().unwrap();
        assert_eq!(path.draft_mode(), ModelSpec::DRAFT.default_mode());
        // Elsewhere (a target, `generate --mode local`) a path keeps its blocks' own mode.
        assert_eq!(path.default_mode(), WeightMode::Native);
        assert_eq!(ModelSpec::TARGET.draft_mode(), WeightMode::F32);
        assert_eq!(
            ModelSpec::DRAFT.draft_mode(),
            ModelSpec::DRAFT.default_mode()
        );
        assert_eq!(path.draft_mode(), WeightMode::W4A8);
        assert_eq!(ModelSpec::DRAFT.default_mode(), WeightMode::W4A8);
        assert_eq!(
            ModelSpec::Named {
                model: &pull::QWEN_CODER_05B,
                draft: true
            }
            .draft_mode(),
            WeightMode::W4A8
        );
    }
}
