//! Training options: one serde struct, written into every run folder.
//!
//! Invariants: a [`TrainConfig`] or [`RunConfig`] read from a file has no key
//! these structs do not know; one that passes [`TrainConfig::validate`] has
//! every number finite and within [`bounds`] (named with its flag where it has
//! one), so that it is checked before any allocation and a `config.json`
//! written from it never holds a `null`.

use serde::{Deserialize, Serialize};

/// Bounds of the [`TrainConfig`] fields and of the thread flags.
pub mod bounds {
    /// Largest `steps`, `warmup_steps`, `val_every` and `checkpoint_every`.
    pub const MAX_STEPS: u64 = 1_000_000_000;
    /// Largest `seq_len`.
    pub const MAX_SEQ_LEN: i64 = 1 << 20;
    /// Largest `batch`.
    pub const MAX_BATCH: i64 = 1 << 16;
    /// Most tokens of one training step: `batch` x (`seq_len` + 1).
    pub const MAX_STEP_TOKENS: i64 = 1 << 24;
    /// Largest `weight_decay`.
    pub const MAX_WEIGHT_DECAY: f64 = 1.0;
    /// Largest `eps`.
    pub const MAX_EPS: f64 = 1.0;
    /// Largest `grad_clip`.
    pub const MAX_GRAD_CLIP: f64 = 1e6;
    /// Largest `val_windows`.
    pub const MAX_VAL_WINDOWS: usize = 1 << 20;
    /// Most libtorch threads (`threads`, `--threads`); 0 means all cores.
    pub const MAX_THREADS: usize = 1024;
}

/// Refuses a thread count above [`bounds::MAX_THREADS`], naming `flag`:
/// libtorch's OpenMP aborts the process on an impossible count, which would
/// leave a run folder locked.
pub fn check_threads(threads: usize, flag: &str) -> anyhow::Result<()> {
    if threads > bounds::MAX_THREADS {
        anyhow::bail!(
            "{flag} {threads}: at most {} threads (0 = all cores; this machine has {})",
            bounds::MAX_THREADS,
            std::thread::available_parallelism().map_or(1, |n| n.get())
        );
    }
    Ok(())
}

/// Refuses a validation share outside [0, 0.9) (NaN included), naming `what`.
pub fn check_val_fraction(v: f64, what: &str) -> anyhow::Result<()> {
    if !(0.0..0.9).contains(&v) {
        anyhow::bail!("{what} must be a number in [0, 0.9) (got {v})");
    }
    Ok(())
}

use crate::model::{ModelConfig, Precision};

/// For `skip_serializing_if`: a share left at 0 is not written, so the configs of
/// runs that never set it read as they did before it existed.
fn is_zero(x: &f64) -> bool {
    *x == 0.0
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainConfig {
    /// Optimizer steps in all.
    pub steps: u64,
    /// Tokens per training window.
    pub seq_len: i64,
    pub batch: i64,
    /// Peak learning rate (after warm-up).
    pub lr: f64,
    /// Learning rate at the end of the cosine decay.
    pub min_lr: f64,
    pub warmup_steps: u64,
    pub weight_decay: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// Clip gradients to this global norm (0 = off).
    pub grad_clip: f64,
    /// Random transposition range in semitones (never applied to drums).
    pub transpose: i64,
    /// Share of pieces held out for validation.
    pub val_fraction: f64,
    /// Validate every N steps.
    pub val_every: u64,
    /// Validation windows (at most) per validation.
    pub val_windows: usize,
    /// Write a checkpoint every N steps.
    pub checkpoint_every: u64,
    pub seed: u64,
    /// CPU threads for libtorch (0 = all cores).
    pub threads: usize,
    /// Precision of the model's dense products (see `model::precision`). A new run's
    /// `auto` is resolved for its device before the config is saved, so a saved run holds
    /// `f32` or `bf16` and resumes with it; runs saved before this field trained in f32.
    #[serde(default = "crate::model::precision::f32_before_it_was_recorded")]
    pub precision: Precision,
    /// Share of training windows that begin at a piece's start (its BOS) rather than at
    /// a bar line drawn uniformly over the piece, so that the model sees whole forms from
    /// their first bar often (0: the uniform draw alone, as runs saved before it).
    pub piece_starts: f64,
    /// Share of training windows drawn whole from one piece at least as long as the
    /// window, so that every position has its own piece's past behind it as far back
    /// as the window reaches ([`crate::train::data::Batcher::with_one_piece_windows`];
    /// 0: the plain draw, which runs on into further pieces, as runs saved before it).
    #[serde(skip_serializing_if = "is_zero")]
    pub one_piece_windows: f64,
    /// With a bar embedding: every training and validation window starts its bar
    /// index from the bar of its piece it begins in, instead of from "not known"
    /// until a `BOS` (false, as runs saved before it), so the table learns from
    /// every window, not only from those that hold a piece's start.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub window_bars: bool,
    /// Draw the pieces a window enters at their BOS uniformly over the pieces, not in
    /// proportion to length, so that the model learns to open a piece in each style as
    /// often as the corpus's pieces do ([`crate::train::data::Batcher::with_openings_by_piece`];
    /// false: in proportion to length, as runs saved before it).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub openings_by_piece: bool,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            steps: 2000,
            seq_len: 512,
            batch: 8,
            lr: 1e-3,
            min_lr: 5e-5,
            warmup_steps: 100,
            weight_decay: 0.01,
            beta1: 0.9,
            beta2: 0.98,
            eps: 1e-8,
            grad_clip: 1.0,
            transpose: 6,
            val_fraction: 0.05,
            val_every: 200,
            val_windows: 32,
            checkpoint_every: 200,
            seed: 0,
            threads: 0,
            precision: Precision::Auto,
            piece_starts: 0.0,
            one_piece_windows: 0.0,
            window_bars: false,
            openings_by_piece: false,
        }
    }
}

impl TrainConfig {
    /// Sensible defaults for a model preset.
    pub fn for_preset(preset: &str) -> TrainConfig {
        match preset {
            "tiny" => TrainConfig {
                steps: 60,
                seq_len: 128,
                batch: 8,
                lr: 3e-3,
                warmup_steps: 10,
                val_every: 20,
                val_windows: 16,
                checkpoint_every: 20,
                ..TrainConfig::default()
            },
            "base" => TrainConfig {
                steps: 100_000,
                seq_len: 2048,
                batch: 4,
                lr: 2e-4,
                min_lr: 5e-6,
                warmup_steps: 200,
                grad_clip: 0.5,
                val_every: 1000,
                checkpoint_every: 1000,
                ..TrainConfig::default()
            },
            _ => TrainConfig::default(),
        }
    }

    /// Checks every field against its range ([`bounds`]), naming it (and
    /// its flag where it has one): NaN and infinities are refused everywhere.
    pub fn validate(&self) -> anyhow::Result<()> {
        use anyhow::ensure;
        use bounds::*;
        let number = |name: &str, v: f64, lo: f64, hi: f64, lo_open: bool| -> anyhow::Result<()> {
            let above = if lo_open { v > lo } else { v >= lo };
            ensure!(
                above && v <= hi,
                "{name} must be a finite number in {}{lo}, {hi}] (got {v})",
                if lo_open { "(" } else { "[" }
            );
            Ok(())
        };
        ensure!(self.steps >= 1, "steps must be at least 1 (--steps; got 0)");
        ensure!(
            self.steps <= MAX_STEPS,
            "steps must be in 1..={MAX_STEPS} (--steps; got {})",
            self.steps
        );
        ensure!(
            (2..=MAX_SEQ_LEN).contains(&self.seq_len),
            "seq_len (--seq-len) must be in 2..={MAX_SEQ_LEN} (got {})",
            self.seq_len
        );
        ensure!(
            (1..=MAX_BATCH).contains(&self.batch),
            "batch (--batch) must be in 1..={MAX_BATCH} (got {})",
            self.batch
        );
        let step_tokens = self.batch * (self.seq_len + 1);
        ensure!(
            step_tokens <= MAX_STEP_TOKENS,
            "batch (--batch) {} x (seq_len (--seq-len) {} + 1) makes {step_tokens} tokens per \
             step, more than {MAX_STEP_TOKENS}",
            self.batch,
            self.seq_len
        );
        number("piece_starts", self.piece_starts, 0.0, 1.0, false)?;
        number("one_piece_windows", self.one_piece_windows, 0.0, 1.0, false)?;
        // no upper bound but finiteness: a huge rate is a divergence that
        // training reports at its first step, naming --lr
        ensure!(
            self.lr > 0.0 && self.lr.is_finite(),
            "lr must be a positive finite number (--lr; got {})",
            self.lr
        );
        number("min_lr", self.min_lr, 0.0, f64::MAX, false)?;
        ensure!(
            self.min_lr <= self.lr,
            "min_lr ({}) must not be above lr ({}): the schedule decays from lr to min_lr",
            self.min_lr,
            self.lr
        );
        ensure!(
            self.warmup_steps <= MAX_STEPS,
            "warmup_steps must be in 0..={MAX_STEPS} (got {})",
            self.warmup_steps
        );
        number(
            "weight_decay",
            self.weight_decay,
            0.0,
            MAX_WEIGHT_DECAY,
            false,
        )?;
        ensure!(
            (0.0..1.0).contains(&self.beta1),
            "beta1 must be a number in [0, 1) (got {})",
            self.beta1
        );
        ensure!(
            (0.0..1.0).contains(&self.beta2),
            "beta2 must be a number in [0, 1) (got {})",
            self.beta2
        );
        number("eps", self.eps, 0.0, MAX_EPS, true)?;
        number(
            "grad_clip (0 = off)",
            self.grad_clip,
            0.0,
            MAX_GRAD_CLIP,
            false,
        )?;
        check_val_fraction(self.val_fraction, "val_fraction")?;
        ensure!(
            (0..=24).contains(&self.transpose),
            "transpose must be in 0..=24 (got {})",
            self.transpose
        );
        ensure!(
            (1..=MAX_STEPS).contains(&self.val_every),
            "val_every must be in 1..={MAX_STEPS} (got {})",
            self.val_every
        );
        ensure!(
            (1..=MAX_STEPS).contains(&self.checkpoint_every),
            "checkpoint_every must be in 1..={MAX_STEPS} (got {})",
            self.checkpoint_every
        );
        ensure!(
            self.val_windows <= MAX_VAL_WINDOWS,
            "val_windows must be in 0..={MAX_VAL_WINDOWS} (got {})",
            self.val_windows
        );
        check_threads(self.threads, "threads")?;
        Ok(())
    }

    /// Learning rate at `step` (0-based): linear warm-up, then cosine decay.
    pub fn lr_at(&self, step: u64) -> f64 {
        if step < self.warmup_steps {
            return self.lr * (step + 1) as f64 / self.warmup_steps as f64;
        }
        let span = self.steps.saturating_sub(self.warmup_steps).max(1) as f64;
        let t = ((step - self.warmup_steps) as f64 / span).min(1.0);
        self.min_lr + 0.5 * (self.lr - self.min_lr) * (1.0 + (std::f64::consts::PI * t).cos())
    }
}

/// Everything that defines a run, saved as `config.json` in the run folder.
/// Every key the runs written so far hold is a field; any other is refused.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunConfig {
    pub model: ModelConfig,
    pub train: TrainConfig,
    pub vocab_hash: String,
    /// The dataset the run was trained on (for `eval` and `--resume`).
    pub dataset: String,
    pub preset: String,
    /// The trained model whose weights the run started from (`train --init`), as given;
    /// None for a run from freshly drawn weights.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init: Option<String>,
}

/// Optional overrides from a TOML file: `[model]` and `[train]` tables.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigFile {
    pub preset: Option<String>,
    pub positional: Option<String>,
    #[serde(default)]
    pub model: Option<toml::Table>,
    #[serde(default)]
    pub train: Option<toml::Table>,
}

/// Applies a TOML table on top of a serializable value (field by field).
pub fn merge_table<T: Serialize + for<'de> Deserialize<'de>>(
    base: &T,
    table: &toml::Table,
) -> anyhow::Result<T> {
    let mut value = toml::Table::try_from(base)?;
    for (k, v) in table {
        value.insert(k.clone(), v.clone());
    }
    Ok(T::deserialize(toml::Value::Table(value))?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_warms_up_then_decays_to_min() {
        let c = TrainConfig {
            steps: 100,
            warmup_steps: 10,
            lr: 1.0,
            min_lr: 0.1,
            ..TrainConfig::default()
        };
        assert!((c.lr_at(0) - 0.1).abs() < 1e-12);
        assert!((c.lr_at(9) - 1.0).abs() < 1e-12);
        assert!(c.lr_at(50) < c.lr_at(20));
        assert!((c.lr_at(100) - 0.1).abs() < 1e-9);
    }

    #[test]
    fn runs_saved_before_the_precision_field_load_as_f32() {
        let mut v = serde_json::to_value(TrainConfig::default()).unwrap();
        assert_eq!(v["precision"], "auto");
        v.as_object_mut().unwrap().remove("precision");
        let old: TrainConfig = serde_json::from_value(v).unwrap();
        assert_eq!(old.precision, Precision::F32);
        let t: toml::Table = toml::from_str("precision = \"bf16\"").unwrap();
        let c = merge_table(&TrainConfig::default(), &t).unwrap();
        assert_eq!(c.precision, Precision::Bf16);
        let t: toml::Table = toml::from_str("precision = \"fp8\"").unwrap();
        assert!(merge_table(&TrainConfig::default(), &t).is_err());
    }

    #[test]
    fn hostile_training_values_are_refused_naming_the_field() {
        type Change = fn(&mut TrainConfig);
        let cases: [(&str, Change); 15] = [
            ("grad_clip", |c| c.grad_clip = f64::NAN),
            ("weight_decay", |c| c.weight_decay = f64::NAN),
            ("grad_clip", |c| c.grad_clip = -1.0),
            ("weight_decay", |c| c.weight_decay = -0.1),
            ("eps", |c| c.eps = -1e-8),
            ("eps", |c| c.eps = 0.0),
            ("min_lr", |c| c.min_lr = 2.0 * c.lr),
            ("--lr; got inf", |c| c.lr = f64::INFINITY),
            ("batch (--batch)", |c| c.batch = 100_000_000),
            ("--seq-len", |c| c.seq_len = 100_000_000),
            ("--batch", |c| (c.batch, c.seq_len) = (65_536, 1024)),
            ("--steps; got 18446744073709551615", |c| c.steps = u64::MAX),
            ("beta2", |c| c.beta2 = f64::NAN),
            ("val_fraction", |c| c.val_fraction = f64::NAN),
            ("threads", |c| c.threads = 100_000),
        ];
        for (name, change) in cases {
            let mut c = TrainConfig::default();
            change(&mut c);
            let e = format!("{:#}", c.validate().unwrap_err());
            assert!(e.contains(name), "{name}: {e}");
        }
        TrainConfig {
            grad_clip: 0.0,
            weight_decay: 0.0,
            min_lr: 1e-3,
            ..TrainConfig::default()
        }
        .validate()
        .unwrap();
        assert!(check_threads(1024, "--threads").is_ok());
        let e = check_threads(100_000, "--threads").unwrap_err().to_string();
        assert!(e.contains("--threads 100000") && e.contains("1024"), "{e}");
    }

    #[test]
    fn the_shipped_run_config_loads_and_unknown_keys_are_refused() {
        let text = std::fs::read_to_string("models/cadenza-small/config.json").unwrap();
        let c: RunConfig = serde_json::from_str(&text).unwrap();
        c.model.validate().unwrap();
        c.train.validate().unwrap();
        let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
        v["datasets"] = serde_json::json!("x");
        let e = serde_json::from_value::<RunConfig>(v)
            .unwrap_err()
            .to_string();
        assert!(e.contains("datasets"), "{e}");
        let t: toml::Table = toml::from_str("local_head = 2").unwrap();
        let e = format!("{:#}", merge_table(&c.model, &t).unwrap_err());
        assert!(e.contains("local_head"), "{e}");
    }

    #[test]
    fn toml_overrides_fields() {
        let base = TrainConfig::default();
        let t: toml::Table = toml::from_str("lr = 0.5\nbatch = 3").unwrap();
        let c = merge_table(&base, &t).unwrap();
        assert_eq!((c.lr, c.batch, c.seq_len), (0.5, 3, base.seq_len));
        let bad: toml::Table = toml::from_str("learning_rate = 0.5").unwrap();
        assert!(merge_table(&base, &bad).is_err());
    }
}
