//! Run folders and checkpoints.
//!
//! ```text
//! RUN_DIR/config.json         resolved model + training config, vocabulary hash
//!                             and the dataset, relative to RUN_DIR
//! RUN_DIR/generation_config.json  sampling defaults of `generate` (GenerationConfig)
//! RUN_DIR/vocab.json          the vocabulary the model was trained with
//! RUN_DIR/checkpoint/         model.safetensors, optimizer.safetensors, state.json
//! RUN_DIR/metrics.jsonl       one JSON object per step / validation
//! RUN_DIR/loss.png            loss curves
//! ```
//! No machine's paths are written: `config.json` names the dataset relative
//! to the run folder (an absolute path only where there is no relative one),
//! and readers join it to the run folder ([`dataset_path`]).
//!
//! A checkpoint folder is written under a temporary name and renamed into
//! place, so `checkpoint/` is always complete; the previous one is kept as
//! `checkpoint.old/` until the new one is in place.
//!
//! While a process trains in a run folder it holds `RUN_DIR/train.lock`
//! ([`RunLock`]): created atomically (`create_new`) and holding its pid. A
//! second process is refused with the holder's pid; a lock whose process is
//! gone (killed) is taken over with a warning. Temporary files and folders of
//! dead processes (`.checkpoint.tmp-<pid>`, `.NAME.<pid>.tmp`) are removed when
//! the lock is taken.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use tch::nn::VarStore;
use tch::Device;

use super::adamw::AdamW;
use super::config::RunConfig;
use crate::model::Transformer;
use crate::tokenizer::Vocab;

pub const CONFIG_FILE: &str = "config.json";
/// Sampling defaults of the model ([`GenerationConfig`]), beside `config.json`.
pub const GENERATION_CONFIG_FILE: &str = "generation_config.json";
pub const VOCAB_FILE: &str = "vocab.json";
pub const CHECKPOINT_DIR: &str = "checkpoint";
/// The weights of the best validation loss (`--model RUN/best` uses them).
pub const BEST_DIR: &str = "best";
pub const MODEL_FILE: &str = "model.safetensors";
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
pub const STATE_FILE: &str = "state.json";
/// FAVOR+ projections in use by training (between redraws).
pub const FEATURES_FILE: &str = "train_features.safetensors";

/// Progress that a resumed run needs besides weights and moments. The data
/// order and every random draw are functions of (seed, step), so the step is
/// the whole RNG state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainState {
    pub step: u64,
    pub seed: u64,
    pub best_val_loss: Option<f64>,
    pub last_val_loss: Option<f64>,
    pub tokens_seen: u64,
}

pub use crate::util::{read_json, write_json};

pub const LOCK_FILE: &str = "train.lock";

/// Exclusive use of a run folder by this process; released on drop.
#[derive(Debug)]
pub struct RunLock {
    path: PathBuf,
}

impl RunLock {
    /// Takes the lock of `run` (which must exist), or says who holds it.
    pub fn acquire(run: &Path) -> Result<RunLock> {
        let path = run.join(LOCK_FILE);
        let me = std::process::id();
        for _ in 0..2 {
            match std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&path)
            {
                Ok(mut f) => {
                    use std::io::Write;
                    writeln!(f, "{me}")
                        .with_context(|| format!("cannot write {}", path.display()))?;
                    for p in crate::util::clean_stale_temps(run) {
                        tracing::warn!("removed {} left by a process that was killed", p.display());
                    }
                    return Ok(RunLock { path });
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    let text = std::fs::read_to_string(&path).unwrap_or_default();
                    let holder = text.trim().parse::<u32>().ok();
                    match holder {
                        Some(pid) if pid != me && crate::util::pid_alive(pid) != Some(false) => {
                            bail!(
                                "{} is in use: process {pid} is training in it (lock {}); \
                                 wait for it to finish, or remove the lock if process {pid} \
                                 is not a cadenza run",
                                run.display(),
                                path.display()
                            );
                        }
                        _ => {
                            tracing::warn!(
                                "{}: taking over the stale lock of process {} \
                                 (no longer running)",
                                run.display(),
                                holder.map_or("?".to_string(), |p| p.to_string())
                            );
                            std::fs::remove_file(&path)
                                .with_context(|| format!("cannot remove {}", path.display()))?;
                        }
                    }
                }
                Err(e) => {
                    return Err(e).with_context(|| format!("cannot create {}", path.display()))
                }
            }
        }
        bail!(
            "{}: another process took the lock {} at the same time",
            run.display(),
            path.display()
        )
    }
}

impl Drop for RunLock {
    fn drop(&mut self) {
        let mine = std::fs::read_to_string(&self.path)
            .ok()
            .and_then(|t| t.trim().parse::<u32>().ok())
            == Some(std::process::id());
        if mine {
            std::fs::remove_file(&self.path).ok();
        }
    }
}

/// Where the newest complete checkpoint of a run is (or a model folder with
/// `model.safetensors` directly in it, as shipped under `models/`).
pub fn checkpoint_dir(run: &Path) -> Option<PathBuf> {
    [CHECKPOINT_DIR, "checkpoint.old", "."]
        .iter()
        .map(|d| run.join(d))
        .find(|d| d.join(MODEL_FILE).is_file())
}

/// Writes a complete checkpoint atomically.
pub fn save_checkpoint(
    run: &Path,
    vs: &VarStore,
    model: &Transformer,
    opt: Option<&AdamW>,
    state: &TrainState,
) -> Result<()> {
    save_to(run, CHECKPOINT_DIR, vs, model, opt, state)
}

/// Writes the weights with the best validation loss so far to `run/best`
/// (no optimizer state: it is for use, not for resuming).
pub fn save_best(run: &Path, vs: &VarStore, model: &Transformer, state: &TrainState) -> Result<()> {
    save_to(run, BEST_DIR, vs, model, None, state)
}

/// Writes a checkpoint into `run/name` atomically: a temporary folder, then
/// renames, so a kill at any point leaves the previous one or the new one.
fn save_to(
    run: &Path,
    name: &str,
    vs: &VarStore,
    model: &Transformer,
    opt: Option<&AdamW>,
    state: &TrainState,
) -> Result<()> {
    let tmp = run.join(format!(".{name}.tmp-{}", std::process::id()));
    let r = save_to_tmp(run, name, &tmp, vs, model, opt, state);
    if r.is_err() && tmp.exists() {
        // A full disk must not stay full of a half-written checkpoint.
        std::fs::remove_dir_all(&tmp).ok();
    }
    r
}

fn save_to_tmp(
    run: &Path,
    name: &str,
    tmp: &Path,
    vs: &VarStore,
    model: &Transformer,
    opt: Option<&AdamW>,
    state: &TrainState,
) -> Result<()> {
    if tmp.exists() {
        std::fs::remove_dir_all(tmp).ok();
    }
    std::fs::create_dir_all(tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
    vs.save(tmp.join(MODEL_FILE))
        .with_context(|| format!("cannot write {}", tmp.join(MODEL_FILE).display()))?;
    if let Some(opt) = opt {
        opt.save(&tmp.join(OPTIMIZER_FILE))?;
    }
    let projections: Vec<(String, tch::Tensor)> = model
        .training_projections()
        .into_iter()
        .enumerate()
        .map(|(i, t)| (format!("layer{i}"), t))
        .collect();
    if !projections.is_empty() {
        let path = tmp.join(FEATURES_FILE);
        tch::Tensor::write_safetensors(&projections, &path)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    write_json(&tmp.join(STATE_FILE), state)?;
    let dst = run.join(name);
    let old = run.join(format!("{name}.old"));
    if dst.exists() {
        if old.exists() {
            std::fs::remove_dir_all(&old)
                .with_context(|| format!("cannot remove {}", old.display()))?;
        }
        std::fs::rename(&dst, &old).with_context(|| format!("cannot move {}", dst.display()))?;
    }
    std::fs::rename(tmp, &dst)
        .with_context(|| format!("cannot move {} into place", tmp.display()))?;
    if old.exists() {
        std::fs::remove_dir_all(&old).ok();
    }
    Ok(())
}

/// The checkpoint a resumed run continues from; an error when there is none
/// (never a silent restart from step 0).
pub fn resume_dir(run: &Path) -> Result<PathBuf> {
    [CHECKPOINT_DIR, "checkpoint.old"]
        .iter()
        .map(|d| run.join(d))
        .find(|d| d.join(MODEL_FILE).is_file())
        .with_context(|| {
            format!(
                "--resume: {} has no checkpoint ({} missing); start a new run in another \
                 folder instead",
                run.display(),
                run.join(CHECKPOINT_DIR).join(MODEL_FILE).display()
            )
        })
}

/// (name, dtype, shape) of every tensor in a safetensors file, read from its
/// header alone; errors name the file.
pub fn safetensors_header(path: &Path) -> Result<Vec<(String, String, Vec<i64>)>> {
    use std::io::Read;
    let len = std::fs::metadata(path)
        .with_context(|| format!("cannot read {}", path.display()))?
        .len();
    let mut f =
        std::fs::File::open(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut n = [0u8; 8];
    f.read_exact(&mut n)
        .with_context(|| format!("{}: not a safetensors file (too short)", path.display()))?;
    let n = u64::from_le_bytes(n);
    if n > len.saturating_sub(8) || n > 100 << 20 {
        bail!(
            "{}: not a safetensors file (header of {n} bytes in a {len}-byte file)",
            path.display()
        );
    }
    let mut header = vec![0u8; n as usize];
    f.read_exact(&mut header)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let json: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&header)
        .with_context(|| format!("{}: not a safetensors file (bad header)", path.display()))?;
    let data_len = len - 8 - n;
    let mut out = Vec::new();
    for (name, v) in json {
        if name == "__metadata__" {
            continue;
        }
        let dtype = v["dtype"].as_str().unwrap_or("?").to_string();
        let shape: Option<Vec<i64>> = v["shape"]
            .as_array()
            .and_then(|a| a.iter().map(|x| x.as_i64()).collect());
        let offsets: Option<Vec<u64>> = v["data_offsets"]
            .as_array()
            .and_then(|a| a.iter().map(|x| x.as_u64()).collect());
        let (Some(shape), Some(offsets)) = (shape, offsets) else {
            bail!("{}: tensor {name} has a bad header entry", path.display());
        };
        if offsets.len() != 2 || offsets[0] > offsets[1] || offsets[1] > data_len {
            bail!(
                "{}: tensor {name} lies outside the file (truncated?)",
                path.display()
            );
        }
        out.push((name, dtype, shape));
    }
    out.sort();
    Ok(out)
}

/// Layer indices named in tensor names ("layers.3.attn..." -> 3).
fn layer_count(names: impl Iterator<Item = String>) -> usize {
    names
        .filter_map(|n| {
            n.strip_prefix("layers.")?
                .split('.')
                .next()?
                .parse::<usize>()
                .ok()
        })
        .map(|i| i + 1)
        .max()
        .unwrap_or(0)
}

/// Checks that the weights at `weights` fit the model built in `vs` from the
/// config at `config`: the same tensors with the same shapes. The message
/// names both files and says what differs (layer count, d_model, a shape).
pub fn check_weights(weights: &Path, vs: &VarStore, config: &Path) -> Result<()> {
    check_weights_lacking(weights, vs, config, &[])
}

/// [`check_weights`], except that the weights may lack the tensors named in `may_lack`
/// (tables that a new model adds and that start at zero, for `train --init`).
pub fn check_weights_lacking(
    weights: &Path,
    vs: &VarStore,
    config: &Path,
    may_lack: &[&str],
) -> Result<()> {
    let file = safetensors_header(weights)?;
    let expected: std::collections::BTreeMap<String, Vec<i64>> = vs
        .variables()
        .into_iter()
        .map(|(n, t)| (n, t.size()))
        .collect();
    let (wl, cl) = (
        layer_count(file.iter().map(|(n, _, _)| n.clone())),
        layer_count(expected.keys().cloned()),
    );
    if wl != cl {
        bail!(
            "{}: the weights have {wl} layer(s) but {} describes {cl}",
            weights.display(),
            config.display()
        );
    }
    for (name, dtype, shape) in &file {
        match expected.get(name) {
            None => bail!(
                "{}: holds tensor {name}, which the model described by {} does not have",
                weights.display(),
                config.display()
            ),
            Some(want) if want != shape => bail!(
                "{}: tensor {name} is {shape:?} but {} describes {want:?} (check d_model, \
                 d_ff, n_heads and vocab_size)",
                weights.display(),
                config.display()
            ),
            Some(_) if !matches!(dtype.as_str(), "F32" | "F16" | "BF16" | "F64") => bail!(
                "{}: tensor {name} holds {dtype} values, not floating point",
                weights.display()
            ),
            _ => {}
        }
    }
    let have: std::collections::BTreeSet<&String> = file.iter().map(|(n, _, _)| n).collect();
    if let Some(missing) = expected
        .keys()
        .find(|n| !have.contains(n) && !may_lack.iter().any(|m| lacks_by_name(n, m)))
    {
        bail!(
            "{}: tensor {missing} of the model described by {} is missing",
            weights.display(),
            config.display()
        );
    }
    Ok(())
}

/// Whether tensor `name` is the one `may_lack` names: the same name, or a layer's
/// (`layers.{i}.` then `may_lack`).
fn lacks_by_name(name: &str, may_lack: &str) -> bool {
    name == may_lack
        || name
            .strip_prefix("layers.")
            .and_then(|r| r.split_once('.'))
            .is_some_and(|(i, rest)| i.parse::<u64>().is_ok() && rest == may_lack)
}

/// Refuses weights with NaN or infinite values, naming the tensor.
pub fn check_finite(weights: &Path, vs: &VarStore) -> Result<()> {
    let mut vars: Vec<(String, tch::Tensor)> = vs.variables().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    for (name, t) in vars {
        let finite = tch::no_grad(|| t.isfinite().all().int64_value(&[])) != 0;
        if !finite {
            bail!(
                "{}: tensor {name} holds NaN or infinite values (a diverged or corrupt \
                 checkpoint)",
                weights.display()
            );
        }
    }
    Ok(())
}

/// The defaults `cadenza generate` samples with when a flag is not given
/// (`generation_config.json`; every key is the flag of the same name, with
/// `_` for `-`). Flags win over the file, the file over the built-in
/// defaults ([`GenerationConfig::default`]), which are `generate`'s own.
/// Keys left out keep their defaults; an unknown key is an error, so that a
/// misspelt setting is not silently ignored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GenerationConfig {
    /// `--tokens`: tokens generated after the prompt.
    pub tokens: usize,
    /// `--min-tokens`: the model may end a piece after this many tokens.
    pub min_tokens: Option<usize>,
    /// `--allow-early-end`: the model may end a piece anywhere.
    pub allow_early_end: bool,
    /// `--max-bars`: stop when the piece reaches this many bars.
    pub max_bars: Option<usize>,
    /// `--set`: a set of tunes, a new one where the model ends one.
    pub set: bool,
    /// `--temperature`.
    pub temperature: f64,
    /// `--top-k` (0 = off).
    pub top_k: usize,
    /// `--top-p` (1 = off).
    pub top_p: f64,
    /// `--min-p` (0 = off).
    pub min_p: f64,
    /// The grammar constraint (`--unconstrained` turns it off).
    pub constrained: bool,
    /// The repetition guard (`--no-repetition-guard` turns it off).
    pub repetition_guard: bool,
    /// `--max-note-quarters`.
    pub max_note_quarters: f64,
    /// `--max-same-pitch`.
    pub max_same_pitch: usize,
    /// `--max-phrase-repeats`.
    pub max_phrase_repeats: usize,
    /// `--max-long-phrase-repeats`.
    pub max_long_phrase_repeats: usize,
    /// `--programs`.
    pub programs: String,
}

impl Default for GenerationConfig {
    fn default() -> Self {
        let s = crate::sample::SampleConfig::default();
        GenerationConfig {
            tokens: s.max_tokens,
            min_tokens: None,
            allow_early_end: false,
            max_bars: s.max_bars,
            set: s.set,
            temperature: s.temperature,
            top_k: s.top_k,
            top_p: s.top_p,
            min_p: s.min_p,
            constrained: s.constrained,
            repetition_guard: s.guard.enabled,
            max_note_quarters: s.guard.max_note_quarters,
            max_same_pitch: s.guard.max_same_pitch,
            max_phrase_repeats: s.guard.max_phrase_repeats,
            max_long_phrase_repeats: s.guard.max_long_phrase_repeats,
            programs: "prompt".into(),
        }
    }
}

impl GenerationConfig {
    /// The sampler's earliest end (`SampleConfig::earliest_end`) that
    /// `min_tokens` and `allow_early_end` give.
    pub fn earliest_end(&self) -> Option<usize> {
        match (self.min_tokens, self.allow_early_end) {
            (Some(m), _) => Some(m),
            (None, true) => Some(0),
            (None, false) => None,
        }
    }

    /// Checks every value as `generate` would check its flag.
    pub fn validate(&self) -> Result<()> {
        crate::sample::SampleConfig {
            max_tokens: self.tokens,
            max_bars: self.max_bars,
            set: self.set,
            earliest_end: self.earliest_end(),
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            guard: crate::sample::GuardConfig {
                enabled: self.repetition_guard,
                max_note_quarters: self.max_note_quarters,
                max_same_pitch: self.max_same_pitch,
                max_phrase_repeats: self.max_phrase_repeats,
                max_long_phrase_repeats: self.max_long_phrase_repeats,
            },
            ..Default::default()
        }
        .validate()?;
        crate::sample::pieces::parse_programs(&self.programs, &[])?;
        Ok(())
    }
}

/// The folder that holds a model's `config.json`: `model` itself, or the run
/// around it when `model` is one of its checkpoint folders (`RUN/best`).
pub fn run_folder(model: &Path) -> &Path {
    match model.parent() {
        Some(parent)
            if !model.join(CONFIG_FILE).is_file()
                && model.join(MODEL_FILE).is_file()
                && parent.join(CONFIG_FILE).is_file() =>
        {
            parent
        }
        _ => model,
    }
}

/// The sampling defaults of the model in `model` (a run, one of its
/// checkpoints, or a shipped folder), with the file they came from: the
/// built-in defaults and `None` when it has no `generation_config.json`. A
/// file that does not parse or holds a bad value is an error naming it.
pub fn read_generation_config(model: &Path) -> Result<(GenerationConfig, Option<PathBuf>)> {
    let path = run_folder(model).join(GENERATION_CONFIG_FILE);
    if !path.exists() {
        return Ok((GenerationConfig::default(), None));
    }
    // serde takes a struct from a JSON array too (its fields in order): only
    // an object names the settings it holds
    let value: serde_json::Value = read_json(&path)?;
    if !value.is_object() {
        bail!(
            "{}: expected a JSON object of sampling settings",
            path.display()
        );
    }
    let g: GenerationConfig = serde_json::from_value(value)
        .with_context(|| format!("{}: unexpected content", path.display()))?;
    g.validate()
        .with_context(|| format!("{}: bad sampling default", path.display()))?;
    Ok((g, Some(path)))
}

/// Writes the built-in sampling defaults into run folder `run`, unless it has
/// its own `generation_config.json` already (which is kept).
pub fn write_generation_config(run: &Path) -> Result<()> {
    let path = run.join(GENERATION_CONFIG_FILE);
    if path.exists() {
        return Ok(());
    }
    write_json(&path, &GenerationConfig::default())
}

/// `data` as `config.json` records it: relative to run folder `run` (both
/// resolved), or absolute where they share no root.
pub fn relative_dataset(run: &Path, data: &Path) -> String {
    let (Ok(r), Ok(d)) = (run.canonicalize(), data.canonicalize()) else {
        return data.display().to_string();
    };
    let rc: Vec<_> = r.components().collect();
    let dc: Vec<_> = d.components().collect();
    let common = rc.iter().zip(&dc).take_while(|(a, b)| a == b).count();
    if common == 0 {
        return d.display().to_string();
    }
    let mut rel = PathBuf::new();
    for _ in common..rc.len() {
        rel.push("..");
    }
    for c in &dc[common..] {
        rel.push(c);
    }
    if rel.as_os_str().is_empty() {
        ".".into()
    } else {
        rel.display().to_string()
    }
}

/// Where the dataset a run's `config.json` records is: joined to the run
/// folder (an absolute path, as older runs wrote, stays as it is).
pub fn dataset_path(run: &Path, config: &RunConfig) -> PathBuf {
    run.join(&config.dataset)
}

/// A trained model ready to use, with what it was trained with.
pub struct LoadedModel {
    pub vs: VarStore,
    pub model: Transformer,
    pub config: RunConfig,
    pub vocab: Vocab,
    pub state: Option<TrainState>,
    /// The checkpoint folder the weights came from.
    pub dir: PathBuf,
    /// The folder of `config.json` and `vocab.json` ([`run_folder`]).
    pub run: PathBuf,
}

/// Loads a run folder (or a shipped model folder) onto `device`. Errors name
/// the file and say what does not match.
pub fn load_model(run: &Path, device: Device) -> Result<LoadedModel> {
    if !run.is_dir() {
        bail!("model folder {} does not exist", run.display());
    }
    // A checkpoint folder inside a run (RUN/best, RUN/checkpoint): the run's
    // config and vocabulary with these weights.
    let (run, only) = match run_folder(run) {
        parent if parent != run => (parent, Some(run.to_path_buf())),
        _ => (run, None),
    };
    let config: RunConfig = read_json(&run.join(CONFIG_FILE))?;
    config.model.validate().with_context(|| {
        format!(
            "{}: invalid model configuration",
            run.join(CONFIG_FILE).display()
        )
    })?;
    let vocab = Vocab::load(&run.join(VOCAB_FILE))?;
    check_vocab(&config, &vocab, &run.join(VOCAB_FILE))?;
    let ckpt = only.or_else(|| checkpoint_dir(run)).with_context(|| {
        format!(
            "{}: no checkpoint ({}/{MODEL_FILE} missing)",
            run.display(),
            CHECKPOINT_DIR
        )
    })?;
    let mut vs = VarStore::new(device);
    let model = Transformer::new(&vs.root(), &config.model)
        .with_context(|| format!("{}: bad model config", run.join(CONFIG_FILE).display()))?;
    let weights = ckpt.join(MODEL_FILE);
    check_weights(&weights, &vs, &run.join(CONFIG_FILE))?;
    vs.load(&weights).map_err(|e| {
        anyhow::anyhow!(
            "{}: does not fit the model described by {} ({e})",
            weights.display(),
            run.join(CONFIG_FILE).display()
        )
    })?;
    check_finite(&weights, &vs)?;
    let state = read_json(&ckpt.join(STATE_FILE)).ok();
    Ok(LoadedModel {
        vs,
        model,
        config,
        vocab,
        state,
        dir: ckpt,
        run: run.to_path_buf(),
    })
}

/// Refuses a vocabulary that the model was not trained with.
pub fn check_vocab(config: &RunConfig, vocab: &Vocab, path: &Path) -> Result<()> {
    if vocab.hash() != config.vocab_hash {
        bail!(
            "{}: vocabulary {} is not the one the model was trained with ({})",
            path.display(),
            vocab.hash(),
            config.vocab_hash
        );
    }
    if vocab.len() as i64 != config.model.vocab_size {
        bail!(
            "{}: vocabulary has {} tokens, the model {}",
            path.display(),
            vocab.len(),
            config.model.vocab_size
        );
    }
    Ok(())
}

/// `cpu`, `cuda`, `cuda:N`, or `auto` (CUDA when available).
pub fn parse_device(s: Option<&str>) -> Result<Device> {
    match s.unwrap_or("auto") {
        "auto" => Ok(Device::cuda_if_available()),
        "cpu" => Ok(Device::Cpu),
        "cuda" => {
            if !tch::Cuda::is_available() {
                bail!("--device cuda: no CUDA device is available (libtorch sees none)");
            }
            Ok(Device::Cuda(0))
        }
        other => match other
            .strip_prefix("cuda:")
            .and_then(|n| n.parse::<usize>().ok())
        {
            Some(n) if tch::Cuda::is_available() && (n as i64) < tch::Cuda::device_count() => {
                Ok(Device::Cuda(n))
            }
            Some(_) => bail!("--device {other}: no such CUDA device"),
            None => bail!("--device {other}: expected cpu, cuda, cuda:N or auto"),
        },
    }
}

/// Restores the training projections saved with a checkpoint (if any).
pub fn load_training_projections(dir: &Path, model: &mut Transformer) -> Result<()> {
    let path = dir.join(FEATURES_FILE);
    if !path.is_file() {
        return Ok(());
    }
    let mut named = tch::Tensor::read_safetensors(&path)
        .with_context(|| format!("cannot read {}", path.display()))?;
    named.sort_by_key(|(n, _)| n.trim_start_matches("layer").parse::<usize>().unwrap_or(0));
    let tensors: Vec<tch::Tensor> = named.into_iter().map(|(_, t)| t).collect();
    model
        .set_training_projections(&tensors)
        .with_context(|| format!("{}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::lacks_by_name;

    #[test]
    fn a_layer_tensor_may_be_lacked_in_every_layer_and_nothing_else() {
        assert!(lacks_by_name("bar_embed.weight", "bar_embed.weight"));
        assert!(lacks_by_name(
            "layers.0.write_gate.weight",
            "write_gate.weight"
        ));
        assert!(lacks_by_name(
            "layers.12.write_gate.bias",
            "write_gate.bias"
        ));
        assert!(!lacks_by_name(
            "layers.0.write_gate.bias",
            "write_gate.weight"
        ));
        assert!(!lacks_by_name(
            "layers.x.write_gate.weight",
            "write_gate.weight"
        ));
        assert!(!lacks_by_name(
            "other.write_gate.weight",
            "write_gate.weight"
        ));
        assert!(!lacks_by_name(
            "layers.0.attn_qkv.weight",
            "write_gate.weight"
        ));
    }
}
