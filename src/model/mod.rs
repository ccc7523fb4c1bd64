//! The `cadenza` model: a pre-LayerNorm decoder-only Transformer with FAVOR+ linear attention
//! (or exact softmax attention as a reference) and Stochastic Positional Encoding (SineSPE,
//! ConvSPE, gated, shared or per layer), sinusoidal APE or no positional encoding.
//!
//! * [`Transformer::forward_t`] trains/evaluates on windows at any absolute offset.
//! * [`Transformer::freeze`] fixes every random quantity (SPE noise, gate noise, FAVOR+
//!   features) from a seed so that the model is a deterministic function usable as a
//!   recurrence: [`Transformer::begin`] / [`Transformer::prefill`] / [`Transformer::step`]
//!   give the same logits as the parallel form, at constant cost per token.

pub mod attention;
pub mod block;
pub mod clock;
pub mod config;
pub mod embed;
pub mod favor;
pub mod favor_heads;
pub(crate) mod ffi;
pub mod head;
pub(crate) mod host;
pub mod local;
pub mod mlp;
pub mod noise;
pub mod precision;
pub mod rope;
pub mod spe;
pub mod state;
pub mod transformer;

#[cfg(test)]
mod tests;

pub use config::{
    AttentionKind, FreqInit, LocalPosition, ModelConfig, MusicalRope, PositionalEncoding,
};
pub use precision::Precision;
pub use transformer::{RecurrentState, Transformer};

use tch::{nn, Kind, Tensor};

/// The epsilon of every layer norm of the model (libtorch's default).
pub(crate) const NORM_EPS: f64 = 1e-5;

/// A linear layer with a bias under `p`: weights N(0, std^2), bias 0.
pub(crate) fn linear(p: nn::Path, inputs: i64, outputs: i64, std: f64) -> nn::Linear {
    nn::linear(
        p,
        inputs,
        outputs,
        nn::LinearConfig {
            ws_init: nn::Init::Randn {
                mean: 0.0,
                stdev: std,
            },
            bs_init: Some(nn::Init::Const(0.0)),
            bias: true,
        },
    )
}

/// A layer norm over the last axis of width `d` under `p` (weight 1, bias 0, [`NORM_EPS`]).
pub(crate) fn layer_norm(p: nn::Path, d: i64) -> nn::LayerNorm {
    let cfg = nn::LayerNormConfig {
        eps: NORM_EPS,
        ..Default::default()
    };
    nn::layer_norm(p, vec![d], cfg)
}

/// The initial std of the projections that write into the residual stream (`attn_out`,
/// `ff2`): 0.02 / sqrt(2 n_layers), GPT-2's scaling.
pub(crate) fn residual_std(cfg: &ModelConfig) -> f64 {
    0.02 / ((2 * cfg.n_layers) as f64).sqrt()
}

/// `t` in `kind`, without a libtorch call when it already is (a generation
/// step is a few hundred small calls, each costing about its arithmetic).
pub(crate) fn as_kind(t: &Tensor, kind: Kind) -> Tensor {
    if t.kind() == kind {
        t.shallow_clone()
    } else {
        t.to_kind(kind)
    }
}

/// Whether `t` is an f32 tensor on the CPU: what the fused C++ kernels and the host
/// generation step take.
pub(crate) fn cpu_f32(t: &Tensor) -> bool {
    t.device() == tch::Device::Cpu && t.kind() == Kind::Float
}

/// The elements of `t`, in f32, as a host vector (for the host generation steps).
pub(crate) fn host_f32(t: &Tensor) -> Vec<f32> {
    Vec::<f32>::try_from(&as_kind(t, Kind::Float).contiguous().view([-1]))
        .expect("a tensor that converts to f32 on the host")
}
