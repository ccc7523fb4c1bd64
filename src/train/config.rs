//! Training options: one serde struct, written into every run folder.

use serde::{Deserialize, Serialize};

use crate::model::{ModelConfig, Precision};

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

    pub fn validate(&self) -> anyhow::Result<()> {
        use anyhow::ensure;
        ensure!(self.steps >= 1, "steps must be at least 1 (got 0)");
        ensure!(self.seq_len >= 2, "seq_len must be at least 2");
        ensure!(self.batch >= 1, "batch must be at least 1");
        ensure!(
            self.lr > 0.0 && self.lr.is_finite(),
            "lr must be a positive number (got {})",
            self.lr
        );
        ensure!(
            self.min_lr >= 0.0 && self.min_lr.is_finite(),
            "min_lr must be zero or positive (got {})",
            self.min_lr
        );
        ensure!(
            (0.0..1.0).contains(&self.beta1) && (0.0..1.0).contains(&self.beta2),
            "betas must be in [0, 1)"
        );
        ensure!(
            (0.0..0.9).contains(&self.val_fraction),
            "val_fraction must be in [0, 0.9)"
        );
        ensure!(
            (0..=24).contains(&self.transpose),
            "transpose must be in 0..=24"
        );
        ensure!(
            self.val_every >= 1 && self.checkpoint_every >= 1,
            "val_every and checkpoint_every must be >= 1"
        );
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
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunConfig {
    pub model: ModelConfig,
    pub train: TrainConfig,
    pub vocab_hash: String,
    /// The dataset the run was trained on (for `eval` and `--resume`).
    pub dataset: String,
    pub preset: String,
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
    fn toml_overrides_fields() {
        let base = TrainConfig::default();
        let t: toml::Table = toml::from_str("lr = 0.5\nbatch = 3").unwrap();
        let c = merge_table(&base, &t).unwrap();
        assert_eq!((c.lr, c.batch, c.seq_len), (0.5, 3, base.seq_len));
        let bad: toml::Table = toml::from_str("learning_rate = 0.5").unwrap();
        assert!(merge_table(&base, &bad).is_err());
    }
}
