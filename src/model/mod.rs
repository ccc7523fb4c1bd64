//! The `cadenza` model: a pre-LayerNorm decoder-only Transformer with FAVOR+ linear attention
//! (or exact softmax attention as a reference) and Stochastic Positional Encoding (SineSPE,
//! ConvSPE, gated, shared or per layer), sinusoidal APE or no positional encoding.
//!
//! * [`Transformer::forward_t`] trains/evaluates on windows at any absolute offset.
//! * [`Transformer::freeze`] fixes every random quantity (SPE noise, gate noise, FAVOR+
//!   features) from a seed so that the model is a deterministic function usable as a
//!   recurrence: [`Transformer::begin`] / [`Transformer::prefill`] / [`Transformer::step`]
//!   give the same logits as the parallel form, at constant cost per token.

pub mod config;
pub mod favor;
pub(crate) mod ffi;
pub(crate) mod host;
pub mod noise;
pub mod spe;
pub mod transformer;

#[cfg(test)]
mod tests;

pub use config::{AttentionKind, FreqInit, LocalPosition, ModelConfig, PositionalEncoding};
pub use transformer::{RecurrentState, Transformer};

use tch::{Kind, Tensor};

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
