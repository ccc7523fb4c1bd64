//! A pre-LayerNorm block: x + attn(norm1(x)), then + mlp(norm2(x)), each branch through
//! dropout while training.
//!
//! Invariants: the residual stream keeps the parameters' kind; dropout is the only
//! randomness a block draws itself (the attention's noise comes in through
//! [`LayerNoise`]), and a block outside training draws none, so [`Block::step`] over a
//! sequence gives [`Block::forward`]'s outputs.

// `a = a + b` is deliberate: tch's `+=` is an in-place add, which would write into
// tensors that autograd or a caller still holds.
#![allow(clippy::assign_op_pattern)]

use tch::{nn, Tensor};

use crate::model::attention::{Attention, LayerNoise, LayerState, Positions};
use crate::model::mlp::Mlp;
use crate::model::{layer_norm, ModelConfig};

/// One layer of the stack (`layers.{i}.*`).
#[derive(Debug)]
pub struct Block {
    /// Norm before the attention.
    pub norm1: nn::LayerNorm,
    /// The attention sublayer.
    pub attn: Attention,
    /// Norm before the feed-forward sublayer.
    pub norm2: nn::LayerNorm,
    /// The feed-forward sublayer.
    pub mlp: Mlp,
    /// Dropout probability of both branches while training.
    dropout: f64,
}

impl Block {
    /// The block under `vs` (`layers.{i}`); `gate` from [`crate::model::attention::spe_gate`],
    /// made before it (the order of the initializations' draws is the model's).
    pub fn new(cfg: &ModelConfig, vs: &nn::Path, gate: Option<Tensor>) -> Block {
        let norm1 = layer_norm(vs.sub("norm1"), cfg.d_model);
        let attn = Attention::new(cfg, vs, gate);
        let norm2 = layer_norm(vs.sub("norm2"), cfg.d_model);
        let mlp = Mlp::new(cfg, vs);
        Block {
            norm1,
            attn,
            norm2,
            mlp,
            dropout: cfg.dropout,
        }
    }

    /// (B, L, d) -> (B, L, d): training (`train`: dropout), evaluation or a prefill
    /// continuing `state`.
    pub fn forward(
        &self,
        x: &Tensor,
        train: bool,
        noise: &LayerNoise,
        pos: &Positions,
        state: Option<&mut LayerState>,
    ) -> Tensor {
        let att = self.attn.forward(&x.apply(&self.norm1), noise, pos, state); // (B, L, d)
        self.feed_forward(x + dropout(att, self.dropout, train), train)
    }

    /// One position, (B, 1, d) -> (B, 1, d), the recurrence on `state`.
    pub fn step(
        &self,
        x: &Tensor,
        noise: &LayerNoise,
        pos: &Positions,
        state: &mut LayerState,
    ) -> Tensor {
        let att = self.attn.step(&x.apply(&self.norm1), noise, pos, state); // (B, 1, d)
        self.feed_forward(x + att, false)
    }

    /// x + mlp(norm2(x)), (B, L, d).
    fn feed_forward(&self, x: Tensor, train: bool) -> Tensor {
        let ff = self.mlp.forward(&x.apply(&self.norm2)); // (B, L, d)
        x + dropout(ff, self.dropout, train)
    }
}

/// Dropout with probability `p` while training; outside training (and at
/// p = 0) the tensor itself, without a libtorch call: a generation step is a
/// few hundred small calls, and each one costs about as much as its arithmetic.
pub(crate) fn dropout(x: Tensor, p: f64, train: bool) -> Tensor {
    if train && p > 0.0 {
        x.dropout(p, true)
    } else {
        x
    }
}
