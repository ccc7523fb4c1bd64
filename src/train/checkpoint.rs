//! Run folders and checkpoints.
//!
//! ```text
//! RUN_DIR/config.json         resolved model + training config, vocabulary hash
//! RUN_DIR/vocab.json          the vocabulary the model was trained with
//! RUN_DIR/checkpoint/         model.safetensors, optimizer.safetensors, state.json
//! RUN_DIR/metrics.jsonl       one JSON object per step / validation
//! RUN_DIR/loss.png            loss curves
//! ```
//! A checkpoint folder is written under a temporary name and renamed into
//! place, so `checkpoint/` is always complete; the previous one is kept as
//! `checkpoint.old/` until the new one is in place.

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
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).ok();
    }
    std::fs::create_dir_all(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
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
    std::fs::rename(&tmp, &dst)
        .with_context(|| format!("cannot move {} into place", tmp.display()))?;
    if old.exists() {
        std::fs::remove_dir_all(&old).ok();
    }
    Ok(())
}

/// A trained model ready to use, with what it was trained with.
pub struct LoadedModel {
    pub vs: VarStore,
    pub model: Transformer,
    pub config: RunConfig,
    pub vocab: Vocab,
    pub state: Option<TrainState>,
    pub dir: PathBuf,
}

/// Loads a run folder (or a shipped model folder) onto `device`. Errors name
/// the file and say what does not match.
pub fn load_model(run: &Path, device: Device) -> Result<LoadedModel> {
    if !run.is_dir() {
        bail!("model folder {} does not exist", run.display());
    }
    // A checkpoint folder inside a run (RUN/best, RUN/checkpoint): the run's
    // config and vocabulary with these weights.
    let (run, only) = match run.parent() {
        Some(parent)
            if !run.join(CONFIG_FILE).is_file()
                && run.join(MODEL_FILE).is_file()
                && parent.join(CONFIG_FILE).is_file() =>
        {
            (parent, Some(run.to_path_buf()))
        }
        _ => (run, None),
    };
    let config: RunConfig = read_json(&run.join(CONFIG_FILE))?;
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
    vs.load(&weights).map_err(|e| {
        anyhow::anyhow!(
            "{}: does not fit the model described by {} ({e})",
            weights.display(),
            run.join(CONFIG_FILE).display()
        )
    })?;
    let state = read_json(&ckpt.join(STATE_FILE)).ok();
    Ok(LoadedModel {
        vs,
        model,
        config,
        vocab,
        state,
        dir: ckpt,
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
pub fn load_training_projections(dir: &Path, model: &Transformer) -> Result<()> {
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
