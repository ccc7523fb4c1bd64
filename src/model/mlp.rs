//! The feed-forward sublayer of a block: `ff1` (d -> d_ff), exact GELU, `ff2` (d_ff -> d).
//!
//! Invariant: `ff2` starts with std 0.02 / sqrt(2 n_layers) (GPT-2's scaling of the
//! residual projections), `ff1` with 0.02; biases start at 0.

use tch::{nn, Tensor};

use crate::model::precision::dense;
use crate::model::{linear, residual_std, ModelConfig};

/// The two linear layers of the feed-forward sublayer (`ff1.*`, `ff2.*`).
#[derive(Debug)]
pub struct Mlp {
    /// d -> d_ff.
    pub ff1: nn::Linear,
    /// d_ff -> d.
    pub ff2: nn::Linear,
}

impl Mlp {
    /// `ff1` then `ff2` under `vs` (in that order: their initializations draw from
    /// libtorch's generator).
    pub fn new(cfg: &ModelConfig, vs: &nn::Path) -> Mlp {
        let ff1 = linear(vs.sub("ff1"), cfg.d_model, cfg.d_ff, 0.02);
        let ff2 = linear(vs.sub("ff2"), cfg.d_ff, cfg.d_model, residual_std(cfg));
        Mlp { ff1, ff2 }
    }

    /// (B, L, d) normalized rows -> (B, L, d).
    pub fn forward(&self, x: &Tensor) -> Tensor {
        let h = dense(x, &self.ff1).gelu("none"); // (B, L, d_ff)
        dense(&h, &self.ff2) // (B, L, d)
    }
}
