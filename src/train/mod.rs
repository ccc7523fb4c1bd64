//! Training: a token dataset in, a self-describing run folder out.
//!
//! Every random draw of step `s` (batch windows, transpositions, dropout, SPE
//! noise, feature redraws) is seeded from (seed, s), so a run killed at any
//! point and resumed from its last checkpoint reproduces the losses of an
//! uninterrupted run.

pub mod adamw;
pub mod checkpoint;
pub mod config;
pub mod data;
pub mod distributed;
pub mod eval;

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

use crate::model::{ModelConfig, Precision, Transformer};
use crate::tokenizer::dataset::{self, Dataset};
use crate::tokenizer::{Vocab, PAD_ID};
use adamw::AdamW;
use checkpoint::{TrainState, CONFIG_FILE, VOCAB_FILE};
use config::{ConfigFile, RunConfig, TrainConfig};

pub const METRICS_FILE: &str = "metrics.jsonl";
/// Most bytes of training batches `export-probe` writes (`train.bin`): 4 GiB.
pub const MAX_PROBE_BYTES: u128 = 4 << 30;
pub const PLOT_FILE: &str = "loss.png";

/// What the `train` command asks for. `None` fields fall back to the config
/// file, then to the preset.
#[derive(Debug, Clone, Default)]
pub struct TrainOptions {
    pub run_dir: PathBuf,
    pub data: Option<PathBuf>,
    pub preset: Option<String>,
    pub positional: Option<String>,
    pub config_file: Option<PathBuf>,
    pub steps: Option<u64>,
    pub seq_len: Option<i64>,
    pub batch: Option<i64>,
    pub lr: Option<f64>,
    pub seed: Option<u64>,
    pub device: Option<String>,
    pub vocab: Option<PathBuf>,
    pub resume: bool,
    /// With `resume`: accept a new `steps` (re-stretches the schedule).
    pub extend: bool,
    /// Stop after this step even though `steps` is larger (tests and time-boxed runs).
    pub stop_after: Option<u64>,
    /// libtorch CPU threads (overrides the config; may change on resume).
    pub threads: Option<usize>,
    /// Precision of the dense products (overrides the config's; a resumed run keeps its own).
    pub precision: Option<Precision>,
    /// Start from this trained model's weights (same vocabulary and parameter shapes).
    pub init: Option<PathBuf>,
    pub progress: bool,
    /// This process's place in a data-parallel run (one process by default).
    pub dist: distributed::Dist,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Metrics {
    pub step: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub train_loss: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_loss: Option<f64>,
    pub lr: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grad_norm: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens_per_s: Option<f64>,
    /// Seconds of the step spent summing gradients over the ranks (runs of several ranks).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comm_s: Option<f64>,
    /// Seconds of the step spent waiting for the slowest rank to finish its backward.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wait_s: Option<f64>,
}

#[derive(Debug, Clone)]
pub struct TrainSummary {
    pub steps_done: u64,
    pub last_train_loss: f64,
    pub last_val_loss: Option<f64>,
    pub tokens_per_s: f64,
    pub interrupted: bool,
}

/// Opens a dataset, or tokenizes MIDI files into `run_dir/dataset` first.
pub fn resolve_dataset(data: &Path, run_dir: &Path, vocab: &Vocab) -> Result<PathBuf> {
    if data.join(dataset::MANIFEST_FILE).is_file() {
        return Ok(data.to_path_buf());
    }
    let out = run_dir.join("dataset");
    if out.join(dataset::MANIFEST_FILE).is_file() {
        return Ok(out);
    }
    let files = dataset::collect_midi_files(&[data.to_path_buf()])?;
    if files.is_empty() {
        bail!(
            "{}: neither a dataset (no {}) nor a folder with MIDI files",
            data.display(),
            dataset::MANIFEST_FILE
        );
    }
    tracing::info!(
        "tokenizing {} MIDI files from {} ...",
        files.len(),
        data.display()
    );
    let mut writer = dataset::DatasetWriter::create(&out, vocab)?;
    writer.tokenize(&files, &crate::limits::Limits::default(), &|| {})?;
    let m = writer.finish()?;
    for s in &m.skipped {
        tracing::warn!("skipped {}: {}", s.path, s.reason);
    }
    Ok(out)
}

/// Resolves the run's configuration: saved (resume) or preset < file < flags.
fn resolve_config(o: &TrainOptions, vocab: &Vocab) -> Result<RunConfig> {
    let saved = o.run_dir.join(CONFIG_FILE);
    if o.resume {
        let mut c: RunConfig = checkpoint::read_json(&saved)
            .with_context(|| format!("--resume: {} is not a run folder", o.run_dir.display()))?;
        if let Some(s) = o.steps.filter(|&s| s != c.train.steps) {
            if !o.extend {
                bail!(
                    "--resume continues the saved schedule of {} steps exactly; to change its \
                     length pass --extend with --steps {s} (the cosine decay is then stretched \
                     from the current step to the new end, so the learning rate jumps up), or \
                     plan long runs with --steps N --stop-after M and resume them",
                    c.train.steps
                );
            }
            c.train.steps = s;
        }
        c.model
            .validate()
            .and_then(|_| c.train.validate())
            .with_context(|| format!("{}: invalid run configuration", saved.display()))?;
        if o.preset.is_some()
            || o.seq_len.is_some()
            || o.batch.is_some()
            || o.config_file.is_some()
            || o.lr.is_some()
            || o.positional.is_some()
            || o.init.is_some()
        {
            bail!(
                "--resume continues the saved configuration; only --steps and --threads may change"
            );
        }
        return Ok(c);
    }
    let file: ConfigFile = match &o.config_file {
        Some(p) => {
            let text = crate::limits::read_text(p, crate::limits::MAX_CONFIG_BYTES)
                .with_context(|| format!("cannot read config {}", p.display()))?;
            toml::from_str(&text).with_context(|| format!("{}: bad config", p.display()))?
        }
        None => ConfigFile::default(),
    };
    let preset = o
        .preset
        .clone()
        .or(file.preset.clone())
        .unwrap_or_else(|| "small".into());
    let mut model = ModelConfig::preset(&preset, vocab.len() as i64)?;
    if let Some(p) = o.positional.as_ref().or(file.positional.as_ref()) {
        model = model.with_positional(p)?;
    }
    let mut train = TrainConfig::for_preset(&preset);
    let file_name = || {
        o.config_file
            .as_ref()
            .map_or("config".to_string(), |p| p.display().to_string())
    };
    if let Some(t) = &file.model {
        model = config::merge_table(&model, t)
            .with_context(|| format!("{}: bad [model] table", file_name()))?;
    }
    if let Some(t) = &file.train {
        train = config::merge_table(&train, t)
            .with_context(|| format!("{}: bad [train] table", file_name()))?;
    }
    if let Some(v) = o.steps {
        train.steps = v;
    }
    if let Some(v) = o.seq_len {
        train.seq_len = v;
    }
    if let Some(v) = o.batch {
        train.batch = v;
    }
    if let Some(v) = o.lr {
        train.lr = v;
    }
    if let Some(v) = o.seed {
        train.seed = v;
    }
    if let Some(v) = o.precision {
        train.precision = v;
    }
    model.vocab_size = vocab.len() as i64;
    if let Some(m) = model.musical_rope.as_mut() {
        // the clock's Position ids come from the run's vocabulary
        let r = vocab.range(crate::tokenizer::TokenType::Position);
        (m.position_first, m.positions) = (r.start as i64, (r.end - r.start) as i64);
    }
    let source = match &o.config_file {
        Some(p) => format!("{} and the command-line flags", p.display()),
        None => "the command-line flags".to_string(),
    };
    model
        .validate()
        .with_context(|| format!("invalid model configuration from {source}"))?;
    train
        .validate()
        .with_context(|| format!("invalid training configuration from {source}"))?;
    Ok(RunConfig {
        model,
        train,
        vocab_hash: vocab.hash().to_string(),
        dataset: String::new(),
        preset,
        init: o.init.as_ref().map(|p| p.display().to_string()),
    })
}

/// The tensors a model may add to the one it is initialised from (`--init`): tables that
/// start at zero, so that the new model first computes what the old one did (a name
/// without a layer stands for that tensor of every layer: `layers.{i}.write_gate.weight`).
const INIT_MAY_LACK: &[&str] = &["bar_embed.weight", "write_gate.weight", "write_gate.bias"];

/// Copies the weights of the trained model `init` (a run or model folder) into `vs`,
/// refusing a model of another vocabulary or other parameter shapes. Only the weights
/// come over: the optimizer starts fresh, and the FAVOR+ training projections are the
/// new run's own draws.
fn init_weights(init: &Path, cfg: &RunConfig, vs: &mut VarStore, config: &Path) -> Result<()> {
    let src = checkpoint::load_model(init, Device::Cpu)
        .with_context(|| format!("--init {}", init.display()))?;
    if src.config.vocab_hash != cfg.vocab_hash {
        bail!(
            "--init {}: the model was trained with vocabulary {}, this run uses {}",
            init.display(),
            src.config.vocab_hash,
            cfg.vocab_hash
        );
    }
    let weights = src.dir.join(checkpoint::MODEL_FILE);
    checkpoint::check_weights_lacking(&weights, vs, config, INIT_MAY_LACK)
        .with_context(|| format!("--init {}", init.display()))?;
    let fresh = vs
        .load_partial(&weights)
        .map_err(|e| anyhow::anyhow!("--init {}: {e}", weights.display()))?;
    tracing::info!("weights from {}", weights.display());
    for name in fresh {
        tracing::info!("{name}: not in {}, starts at zero", weights.display());
    }
    Ok(())
}

/// The run's precision made concrete for `device`: a new run's `auto` resolved and stored
/// in `train` (so that the saved config says what it trained in); a resumed run keeps its
/// own and refuses a `--precision` that would change it.
fn resolve_precision(
    o: &TrainOptions,
    train: &mut TrainConfig,
    device: Device,
) -> Result<crate::model::precision::Resolved> {
    if o.resume {
        if train.precision == Precision::Auto {
            bail!(
                "{}: precision \"auto\" in a saved run (a run saves f32 or bf16)",
                o.run_dir.join(CONFIG_FILE).display()
            );
        }
        if let Some(p) = o.precision {
            let asked = p.resolve(device).precision;
            if asked != train.precision {
                bail!(
                    "--resume continues the run in {}, as it started; --precision {p} \
                     (here: {asked}) would change what it computes",
                    train.precision
                );
            }
        }
        return Ok(crate::model::precision::Resolved {
            precision: train.precision,
            reason: "the run's own".into(),
        });
    }
    let r = train.precision.resolve(device);
    train.precision = r.precision;
    Ok(r)
}

static INTERRUPTED: OnceLock<Arc<AtomicBool>> = OnceLock::new();

/// Ctrl-C sets a flag that the loop checks; the run saves and stops.
fn interrupt_flag() -> Arc<AtomicBool> {
    INTERRUPTED
        .get_or_init(|| {
            let flag = Arc::new(AtomicBool::new(false));
            let f = flag.clone();
            // A second handler cannot be installed; the flag then stays unused.
            let _ = ctrlc::set_handler(move || f.store(true, Ordering::SeqCst));
            flag
        })
        .clone()
}

pub fn set_threads(threads: usize) {
    let n = if threads == 0 {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    } else {
        threads
    };
    tch::set_num_threads(n as i32);
}

/// Mean cross-entropy of next-token prediction over non-PAD targets.
pub fn lm_loss(model: &Transformer, batch: &Tensor, train: bool) -> Tensor {
    next_token_loss(batch, |input| model.forward_t(input, 0, train))
}

/// [`lm_loss`] of a training step: [`Transformer::forward_train`], which may redraw the
/// FAVOR+ projections. `bars`: the bar index each row starts from (`window_bars`).
pub fn train_loss(model: &mut Transformer, batch: &Tensor, bars: Option<&[i64]>) -> Tensor {
    next_token_loss(batch, |input| model.forward_train_from(input, 0, bars))
}

fn next_token_loss(batch: &Tensor, forward: impl FnOnce(&Tensor) -> Tensor) -> Tensor {
    let l = batch.size()[1];
    let input = batch.narrow(1, 0, l - 1);
    let target = batch.narrow(1, 1, l - 1);
    let logits = forward(&input);
    let v = logits.size()[2];
    logits
        .to_kind(Kind::Float)
        .view([-1, v])
        .cross_entropy_loss::<Tensor>(
            &target.reshape([-1]),
            None,
            tch::Reduction::Mean,
            PAD_ID as i64,
            0.0,
        )
}

fn to_batch(ids: &[i64], rows: i64, device: Device) -> Tensor {
    Tensor::from_slice(ids).view([rows, -1]).to_device(device)
}

/// Mean validation loss over fixed windows (frozen noise). `bars`, one per window:
/// the bar index each starts from (`window_bars`; None: "not known" until a `BOS`).
pub fn validation_loss(
    model: &Transformer,
    windows: &[Vec<u32>],
    bars: Option<&[i64]>,
    batch: usize,
    device: Device,
) -> f64 {
    tch::no_grad(|| {
        let (mut sum, mut count) = (0.0, 0.0);
        let batch = batch.max(1);
        for (c, chunk) in windows.chunks(batch).enumerate() {
            let known = bars.map(|b| &b[c * batch..c * batch + chunk.len()]);
            let ids: Vec<i64> = chunk.iter().flatten().map(|&t| t as i64).collect();
            let b = to_batch(&ids, chunk.len() as i64, device);
            let n = b
                .narrow(1, 1, b.size()[1] - 1)
                .ne(PAD_ID as i64)
                .sum(Kind::Float)
                .double_value(&[]);
            if n > 0.0 {
                let loss = next_token_loss(&b, |input| model.forward_from(input, 0, false, known));
                sum += loss.double_value(&[]) * n;
                count += n;
            }
        }
        if count > 0.0 {
            sum / count
        } else {
            f64::NAN
        }
    })
}

fn append_metrics(run: &Path, m: &Metrics) -> Result<()> {
    let path = run.join(METRICS_FILE);
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .with_context(|| format!("cannot open {}", path.display()))?;
    writeln!(f, "{}", serde_json::to_string(m)?)
        .with_context(|| format!("cannot write {}", path.display()))
}

/// Reads the metrics log, keeping records up to `max_step` (what a resumed
/// run must not repeat is dropped).
pub fn read_metrics(run: &Path) -> Result<Vec<Metrics>> {
    let path = run.join(METRICS_FILE);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(_) => return Ok(Vec::new()),
    };
    Ok(text
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect())
}

fn truncate_metrics(run: &Path, max_step: u64) -> Result<()> {
    let kept: Vec<Metrics> = read_metrics(run)?
        .into_iter()
        .filter(|m| m.step <= max_step)
        .collect();
    let mut text = String::new();
    for m in &kept {
        text.push_str(&serde_json::to_string(m)?);
        text.push('\n');
    }
    crate::util::write_atomic(&run.join(METRICS_FILE), text.as_bytes())
}

fn plot_losses(run: &Path) -> Result<()> {
    use crate::render::{line_plot_png, Series};
    let metrics = read_metrics(run)?;
    let train: Vec<(f64, f64)> = metrics
        .iter()
        .filter_map(|m| m.train_loss.map(|l| (m.step as f64, l)))
        .collect();
    // Smooth the noisy per-step loss for reading.
    let k = (train.len() / 50).max(1);
    let smooth: Vec<(f64, f64)> = train
        .chunks(k)
        .map(|c| {
            let n = c.len() as f64;
            (
                c.iter().map(|p| p.0).sum::<f64>() / n,
                c.iter().map(|p| p.1).sum::<f64>() / n,
            )
        })
        .collect();
    let val: Vec<(f64, f64)> = metrics
        .iter()
        .filter_map(|m| m.val_loss.map(|l| (m.step as f64, l)))
        .collect();
    line_plot_png(
        "Loss",
        "step",
        "cross-entropy (nats/token)",
        &[
            Series {
                name: "train".into(),
                points: smooth,
            },
            Series {
                name: "validation".into(),
                points: val,
            },
        ],
        &run.join(PLOT_FILE),
    )
}

/// Writes the exact batches a run with these options would train on, and the
/// validation windows `cadenza eval --max-len SEQ_LEN` scores (the first
/// `seq_len + 1` tokens of every held-out piece), for outside reference
/// models (`scripts/reference/`). Format: `scripts/reference/README.md`.
pub fn export_probe(o: &TrainOptions, out: &Path) -> Result<()> {
    use crate::tokenizer::TokenType;
    let vocab = match &o.vocab {
        Some(p) => Vocab::load(p)?,
        None => Vocab::new(Default::default())?,
    };
    let cfg = resolve_config(o, &vocab)?;
    let tc = &cfg.train;
    let data = o.data.as_ref().context("--data is required")?;
    if !data.join(dataset::MANIFEST_FILE).is_file() {
        bail!(
            "{}: export needs a dataset made by `cadenza tokenize`",
            data.display()
        );
    }
    let ds = Dataset::open(data)?;
    if ds.vocab.hash() != vocab.hash() {
        bail!(
            "dataset {} has another vocabulary than {}",
            data.display(),
            vocab.hash()
        );
    }
    if out.exists() {
        bail!("{} exists; choose a new folder", out.display());
    }
    let window = tc.seq_len as usize + 1;
    let steps = o.stop_after.unwrap_or(tc.steps).min(tc.steps);
    // checked before the folder is made: the batches are built in memory
    let train_bytes = steps as u128 * tc.batch as u128 * window as u128 * 4;
    if train_bytes > MAX_PROBE_BYTES {
        bail!(
            "--steps {steps} x --batch {} x (--seq-len {} + 1) tokens make {} MiB of training \
             batches, more than the {} MiB a probe may hold; export fewer steps or smaller batches",
            tc.batch,
            tc.seq_len,
            train_bytes >> 20,
            MAX_PROBE_BYTES >> 20
        );
    }
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    let split = data::split(&ds, tc.seed, tc.val_fraction);
    let batcher = data::Batcher::for_config(&split.train, &vocab, tc);
    let mut train = Vec::with_capacity(steps as usize * tc.batch as usize * window * 4);
    for step in 0..steps {
        for id in batcher.batch(step, tc.batch as usize, window) {
            train.extend_from_slice(&(id as u32).to_le_bytes());
        }
    }
    crate::util::write_atomic(&out.join("train.bin"), &train)?;
    let (mut val, mut ctx, mut sources) = (Vec::new(), Vec::new(), Vec::new());
    for p in &split.val {
        let mut ids = p.ids[..p.ids.len().min(window)].to_vec();
        let masks = crate::eval::context_masks(&ids, &vocab, crate::eval::CONTEXT_BARS);
        ids.resize(window, PAD_ID);
        for &id in &ids {
            val.extend_from_slice(&id.to_le_bytes());
        }
        for t in 0..window - 1 {
            ctx.extend_from_slice(&masks.get(t).copied().unwrap_or(0).to_le_bytes());
        }
        sources.push(crate::eval::source_group(&p.source));
    }
    crate::util::write_atomic(&out.join("val.bin"), &val)?;
    crate::util::write_atomic(&out.join("val_ctx.bin"), &ctx)?;
    let types = [
        TokenType::Pad,
        TokenType::Bos,
        TokenType::Eos,
        TokenType::Bar,
        TokenType::TimeSig,
        TokenType::Position,
        TokenType::Tempo,
        TokenType::Program,
        TokenType::Pitch,
        TokenType::PitchDrum,
        TokenType::Velocity,
        TokenType::Duration,
    ];
    let token_type: Vec<usize> = (0..vocab.len() as u32)
        .map(|id| {
            let k = vocab.kind(id).unwrap_or(TokenType::Pad);
            types.iter().position(|&t| t == k).unwrap_or(0)
        })
        .collect();
    let pitch_class: Vec<i32> = (0..vocab.len() as u32)
        .map(|id| crate::eval::pitch_class(&vocab, id).map_or(-1, |c| c as i32))
        .collect();
    let features = match &cfg.model.attention {
        crate::model::AttentionKind::Favor { features, .. } => *features,
        crate::model::AttentionKind::Softmax => 0,
    };
    let meta = serde_json::json!({
        "seq_len": tc.seq_len,
        "batch": tc.batch,
        "steps": steps,
        "vocab_size": vocab.len(),
        "pad_id": PAD_ID,
        "types": types.iter().map(|t| t.to_string()).collect::<Vec<_>>(),
        "token_type": token_type,
        "pitch_class": pitch_class,
        "val_windows": sources.len(),
        "val_sources": sources,
        "model": {
            "d_model": cfg.model.d_model,
            "n_layers": cfg.model.n_layers,
            "n_heads": cfg.model.n_heads,
            "d_ff": cfg.model.d_ff,
            "favor_features": features,
        },
        "train": tc,
        "vocab_hash": vocab.hash(),
    });
    checkpoint::write_json(&out.join("meta.json"), &meta)
}

/// "1h02m", "3m05s", "12s".
fn clock(secs: f64) -> String {
    let s = secs.max(0.0).round() as u64;
    match (s / 3600, s / 60 % 60, s % 60) {
        (0, 0, sec) => format!("{sec}s"),
        (0, m, sec) => format!("{m}m{sec:02}s"),
        (h, m, _) => format!("{h}h{m:02}m"),
    }
}

/// Refuses flags of `train` that no run can use, before anything is created
/// or locked: `--threads` above the bound, `--stop-after 0`.
fn check_train_flags(o: &TrainOptions) -> Result<()> {
    if let Some(t) = o.threads {
        config::check_threads(t, "--threads")?;
    }
    if o.stop_after == Some(0) {
        bail!("--stop-after 0 would stop before the first step; give a step of at least 1");
    }
    Ok(())
}

/// With `--resume`: refuses a `--steps` (with `--extend`) or `--stop-after`
/// that is not after the step the run's checkpoint has reached, before the
/// run's config is rewritten.
fn check_resume_step(o: &TrainOptions, cfg: &RunConfig) -> Result<()> {
    let dir = checkpoint::resume_dir(&o.run_dir)?;
    let state: TrainState = checkpoint::read_json(&dir.join(checkpoint::STATE_FILE))?;
    if o.extend && cfg.train.steps <= state.step {
        bail!(
            "--extend --steps {}: {} is at step {} already; give more steps than that",
            cfg.train.steps,
            o.run_dir.display(),
            state.step
        );
    }
    if let Some(s) = o.stop_after.filter(|&s| s <= state.step) {
        bail!(
            "--stop-after {s}: {} is at step {} already; give a later step",
            o.run_dir.display(),
            state.step
        );
    }
    Ok(())
}

/// Refuses ranks that would not train the same model on the same data over the same
/// steps (a run of several ranks; see [`distributed`]).
fn check_ranks_agree(
    dist: &distributed::Dist,
    cfg: &RunConfig,
    vocab: &Vocab,
    split: &data::Split,
    steps: (u64, u64),
) -> Result<()> {
    if dist.is_single() {
        return Ok(());
    }
    let mut c = cfg.clone();
    // the threads and the dataset's path may differ between machines
    c.train.threads = 0;
    c.dataset.clear();
    let pieces = split.train.iter().chain(&split.val).map(|p| &p.ids[..]);
    let schedule = [steps.0.to_le_bytes(), steps.1.to_le_bytes()].concat();
    dist.check_same(&[
        (
            "configuration",
            distributed::fingerprint(serde_json::to_vec(&c)?),
        ),
        ("vocabulary", distributed::fingerprint(vocab.hash().bytes())),
        ("data", distributed::fingerprint_ids(pieces)),
        ("start or stop step", distributed::fingerprint(schedule)),
        (
            "version of cadenza",
            distributed::fingerprint(env!("CARGO_PKG_VERSION").bytes()),
        ),
    ])
}

/// Gives every rank rank 0's parameters and FAVOR+ training projections; returns the
/// trainable parameters in the order every rank sums their gradients (by name).
fn broadcast_model(
    dist: &distributed::Dist,
    vs: &VarStore,
    model: &mut Transformer,
) -> Result<Vec<Tensor>> {
    let mut vars: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    let all: Vec<Tensor> = vars.iter().map(|v| v.1.shallow_clone()).collect();
    dist.broadcast(&all)?;
    let projections = model.training_projections();
    if !dist.is_single() && !projections.is_empty() {
        dist.broadcast(&projections)?;
        model.set_training_projections(&projections)?;
    }
    Ok(vars
        .into_iter()
        .filter(|v| v.1.requires_grad())
        .map(|v| v.1)
        .collect())
}

/// What a step of several ranks reports beside its loss.
#[derive(Debug, Clone, Copy)]
struct StepComm {
    /// Seconds spent summing gradients (the ranks already met: the transfer).
    seconds: f64,
    /// Seconds spent in the first collective of the step, waiting for the slowest rank.
    wait: f64,
    /// Whether some rank was interrupted (Ctrl-C, SIGTERM).
    stop: bool,
}

/// One rank's part of a step of several ranks: the loss of its rows of the global batch
/// `ids` (each row starting from its bar index in `bars`, with `window_bars`), weighted by their share of its targets, backpropagated; the loss and the
/// interrupt flag summed over the ranks (where they wait for the slowest), then the
/// gradients. Returns the global batch's mean loss.
fn rank_step(
    dist: &distributed::Dist,
    model: &mut Transformer,
    params: &[Tensor],
    (ids, bars): (&[i64], Option<&[i64]>),
    window: usize,
    device: Device,
    flag: &AtomicBool,
) -> Result<(f64, StepComm)> {
    let rows = dist.rows(ids.len() / window);
    let weight = distributed::target_weight(ids, window, rows.clone());
    if weight == 0.0 {
        bail!(
            "{}the rows {rows:?} of the step's batch hold no target token",
            dist.tag()
        );
    }
    let mine = &ids[rows.start * window..rows.end * window];
    let batch = to_batch(mine, rows.len() as i64, device);
    let loss = train_loss(model, &batch, bars.map(|b| &b[rows.clone()])) * weight;
    loss.backward();
    let mut sums = [
        loss.double_value(&[]),
        flag.load(Ordering::SeqCst) as u8 as f64,
    ];
    let t0 = Instant::now();
    dist.sum_scalars(&mut sums);
    let wait = t0.elapsed().as_secs_f64();
    let seconds = dist.sum_gradients(params)?.as_secs_f64();
    Ok((
        sums[0],
        StepComm {
            seconds,
            wait,
            stop: sums[1] > 0.0,
        },
    ))
}

/// Trains (or resumes) a run.
pub fn train(o: &TrainOptions) -> Result<TrainSummary> {
    let run = &o.run_dir;
    let dist = &o.dist;
    check_train_flags(o)?;
    // Rank 0 alone writes the run folder; the others read it once it has.
    if !dist.is_root() {
        dist.barrier();
    }
    if o.resume && !run.join(CONFIG_FILE).is_file() {
        bail!(
            "--resume: {} is not a run folder (no {CONFIG_FILE})",
            run.display()
        );
    }
    if dist.is_root() {
        std::fs::create_dir_all(run).with_context(|| format!("cannot create {}", run.display()))?;
    }
    // One process (one job) trains in a run folder at a time.
    let _lock = dist
        .is_root()
        .then(|| checkpoint::RunLock::acquire(run))
        .transpose()?;
    let vocab = if o.resume {
        Vocab::load(&run.join(VOCAB_FILE))?
    } else {
        match &o.vocab {
            Some(p) => Vocab::load(p)?,
            None => Vocab::new(Default::default())?,
        }
    };
    let mut cfg = resolve_config(o, &vocab)?;
    if cfg.train.window_bars && cfg.model.bar_embedding.is_none() {
        bail!(
            "[train] window_bars = true needs a bar embedding to start: set [model] \
             bar_embedding (docs/model.md)"
        );
    }
    dist.check_batch(cfg.train.batch)?;
    if o.resume {
        check_resume_step(o, &cfg)?;
    }
    checkpoint::check_vocab(&cfg, &vocab, &run.join(VOCAB_FILE))?;
    let device = dist.device(
        o.device.as_deref(),
        checkpoint::parse_device(o.device.as_deref())?,
    )?;
    let precision = resolve_precision(o, &mut cfg.train, device)?;
    if !o.resume && dist.is_root() && checkpoint::checkpoint_dir(run).is_some() {
        bail!(
            "{} already holds a trained run: pass --resume to continue it, or choose another folder",
            run.display()
        );
    }
    if let Some(d) = &o.data {
        if crate::util::same_file(d, run) {
            bail!(
                "-o {} is the --data folder: a run needs a folder of its own",
                run.display()
            );
        }
    }
    let data_path = match (&o.data, o.resume) {
        (Some(d), _) => resolve_dataset(d, run, &vocab)?,
        (None, true) => checkpoint::dataset_path(run, &cfg),
        (None, false) => bail!("--data is required for a new run"),
    };
    let ds = Dataset::open(&data_path)?;
    if ds.vocab.hash() != vocab.hash() {
        bail!(
            "dataset {} was tokenized with vocabulary {}, the run uses {}",
            data_path.display(),
            ds.vocab.hash(),
            vocab.hash()
        );
    }
    cfg.dataset = checkpoint::relative_dataset(run, &data_path);
    if dist.is_root() {
        if !o.resume {
            checkpoint::write_json(&run.join(CONFIG_FILE), &cfg)?;
            vocab.save(&run.join(VOCAB_FILE))?;
        } else if o.extend {
            // The new schedule length is part of the run from now on.
            checkpoint::write_json(&run.join(CONFIG_FILE), &cfg)?;
        }
        // The sampling defaults `generate` reads beside the config (a run
        // resumed from before they existed gets them too; one edited is kept).
        checkpoint::write_generation_config(run)?;
        dist.barrier();
    }
    if let Some(t) = o.threads {
        cfg.train.threads = t;
    }
    let tc = cfg.train.clone();
    set_threads(tc.threads);

    let split = data::split(&ds, tc.seed, tc.val_fraction);
    if split.train.is_empty() {
        bail!("{}: the dataset has no pieces", data_path.display());
    }
    let train_tokens: usize = split.train.iter().map(|p| p.ids.len()).sum();
    if tc.seq_len as usize + 1 > train_tokens {
        bail!(
            "--seq-len {} is longer than all {train_tokens} training tokens of {}; \
             choose a shorter --seq-len or a bigger dataset",
            tc.seq_len,
            data_path.display()
        );
    }
    let batcher = data::Batcher::for_config(&split.train, &vocab, &tc);
    let window = tc.seq_len as usize + 1;
    let (val_windows, val_bars): (Vec<Vec<u32>>, Vec<i64>) =
        data::validation_windows_with_bars(&split.val, window, tc.val_windows)
            .into_iter()
            .unzip();
    let val_bars = tc.window_bars.then_some(val_bars.as_slice());

    tch::manual_seed(tc.seed as i64);
    let mut vs = VarStore::new(device);
    let mut model = Transformer::new(&vs.root(), &cfg.model)?;
    model.freeze(tc.seed);
    model.set_precision(tc.precision);
    tracing::info!("precision: {precision}");
    let mut opt = AdamW::new(vs.variables(), tc.beta1, tc.beta2, tc.eps, tc.weight_decay);
    let mut state = TrainState {
        step: 0,
        seed: tc.seed,
        best_val_loss: None,
        last_val_loss: None,
        tokens_seen: 0,
    };
    if o.resume {
        // A resumed run continues its checkpoint or fails: restarting from
        // step 0 in its folder would silently replace its history.
        let dir = checkpoint::resume_dir(run)?;
        let weights = dir.join(checkpoint::MODEL_FILE);
        checkpoint::check_weights(&weights, &vs, &run.join(CONFIG_FILE))?;
        vs.load(&weights)
            .map_err(|e| anyhow::anyhow!("{}: {e}", weights.display()))?;
        opt.load(&dir.join(checkpoint::OPTIMIZER_FILE))?;
        if !model.training_projections().is_empty()
            && !dir.join(checkpoint::FEATURES_FILE).is_file()
        {
            bail!(
                "--resume: {} is missing: the run's FAVOR+ features cannot be restored, \
                 so it would not continue as it was",
                dir.join(checkpoint::FEATURES_FILE).display()
            );
        }
        checkpoint::load_training_projections(&dir, &mut model)?;
        state = checkpoint::read_json(&dir.join(checkpoint::STATE_FILE))?;
        if dist.is_root() {
            truncate_metrics(run, state.step)?;
        }
    } else {
        if let Some(init) = &o.init {
            init_weights(init, &cfg, &mut vs, &run.join(CONFIG_FILE))?;
        }
        if dist.is_root() {
            truncate_metrics(run, 0)?;
        }
    }
    let params = broadcast_model(dist, &vs, &mut model)?;
    let last_step = o.stop_after.unwrap_or(tc.steps).min(tc.steps);
    check_ranks_agree(dist, &cfg, &vocab, &split, (state.step, last_step))?;
    let flag = interrupt_flag();
    let pb = if o.progress && dist.is_root() {
        indicatif::ProgressBar::new(tc.steps)
    } else {
        indicatif::ProgressBar::hidden()
    };
    pb.set_style(
        indicatif::ProgressStyle::with_template(
            "{spinner} [{bar:30}] step {pos}/{len} {msg} ETA {eta}",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    pb.set_position(state.step);
    let tokens_per_step = (tc.batch * tc.seq_len) as f64;
    let started = Instant::now();
    let start_step = state.step;
    let mut last_loss = f64::NAN;
    let mut interrupted = false;
    while state.step < last_step {
        let step = state.step;
        let t0 = Instant::now();
        tch::manual_seed((tc.seed ^ step.wrapping_mul(0x2545_f491_4f6c_dd1d)) as i64 & i64::MAX);
        let (ids, bars) = batcher.batch_with_bars(step, tc.batch as usize, window);
        let bars = tc.window_bars.then_some(bars.as_slice());
        let lr = tc.lr_at(step);
        opt.zero_grad();
        let (loss, comm) = if dist.is_single() {
            let batch = to_batch(&ids, tc.batch, device);
            let loss = train_loss(&mut model, &batch, bars);
            loss.backward();
            (loss.double_value(&[]), None)
        } else {
            let (loss, comm) = rank_step(
                dist,
                &mut model,
                &params,
                (&ids, bars),
                window,
                device,
                &flag,
            )?;
            (loss, Some(comm))
        };
        let grad_norm = opt.clip_grad_norm(tc.grad_clip);
        opt.update(lr);
        last_loss = loss;
        if !last_loss.is_finite() {
            bail!(
                "{}: training diverged at step {step} (loss {last_loss}, learning rate {lr:.2e} \
                 from {}); lower --lr",
                run.display(),
                run.join(CONFIG_FILE).display()
            );
        }
        state.step += 1;
        state.tokens_seen += tokens_per_step as u64;
        let tps = tokens_per_step / t0.elapsed().as_secs_f64().max(1e-9);
        let mut m = Metrics {
            step: state.step,
            train_loss: Some(last_loss),
            val_loss: None,
            lr,
            grad_norm: Some(grad_norm),
            tokens_per_s: Some(tps),
            comm_s: comm.map(|c| c.seconds),
            wait_s: comm.map(|c| c.wait),
        };
        let done = state.step >= last_step;
        // several ranks stop together: at the step where one of them saw the flag
        interrupted = comm.map_or_else(|| flag.load(Ordering::SeqCst), |c| c.stop);
        if !dist.is_root() {
            if interrupted {
                break;
            }
            continue;
        }
        let mut improved = false;
        if state.step.is_multiple_of(tc.val_every) || done {
            let v = validation_loss(&model, &val_windows, val_bars, tc.batch as usize, device);
            m.val_loss = Some(v);
            state.last_val_loss = Some(v);
            if state.best_val_loss.is_none_or(|b| v < b) {
                state.best_val_loss = Some(v);
                improved = true;
            }
            if !o.progress || !std::io::stderr().is_terminal() {
                let spent = started.elapsed().as_secs_f64();
                let left = (last_step - state.step) as f64 * spent
                    / (state.step - start_step).max(1) as f64;
                tracing::info!(
                    "step {}/{}: train {last_loss:.4} val {v:.4}{} lr {lr:.2e} {tps:.0} tok/s, {} elapsed, {} to go",
                    state.step,
                    tc.steps,
                    if improved { " (best)" } else { "" },
                    clock(spent),
                    clock(left)
                );
            }
        }
        append_metrics(run, &m)?;
        if m.val_loss.is_some() {
            plot_losses(run)?;
        }
        if improved {
            checkpoint::save_best(run, &vs, &model, &state)?;
        }
        if state.step.is_multiple_of(tc.checkpoint_every) || done || interrupted {
            checkpoint::save_checkpoint(run, &vs, &model, Some(&opt), &state)?;
        }
        pb.set_position(state.step);
        pb.set_message(format!(
            "loss {last_loss:.3}{} {tps:.0} tok/s",
            state
                .last_val_loss
                .map(|v| format!(" val {v:.3}"))
                .unwrap_or_default()
        ));
        if interrupted {
            pb.println("interrupted: checkpoint saved; continue with --resume");
            break;
        }
    }
    pb.finish_and_clear();
    let elapsed = started.elapsed().as_secs_f64();
    Ok(TrainSummary {
        steps_done: state.step,
        last_train_loss: last_loss,
        last_val_loss: state.last_val_loss,
        tokens_per_s: (state.step - start_step) as f64 * tokens_per_step / elapsed.max(1e-9),
        interrupted,
    })
}
