//! The input embeddings: token embeddings (`tok_embed.weight`, (V, d)) and, with
//! `positional = "ape"`, the sinusoidal absolute positional encoding added to them; with
//! `bar_embedding = N`, a learned row per bar of the piece (`bar_embed.weight`,
//! (N + 1, d)) added as well.
//!
//! Invariants: the sinusoidal code of a position depends on that position only (any window
//! at any offset sees the same code), is formed in f64 and added in the model's kind. With
//! unscaled embeddings (std 0.02) the code (RMS 2^-1/2) is brought to the tokens' scale;
//! scaled embeddings (std d^-1/2, times sqrt(d)) take it as it is. The bar embedding
//! starts at zero, so a model given one computes at first exactly what it computed
//! without it (`train --init` from a model without the table starts from that model).

// `a = a + b` is deliberate: tch's `+=` is an in-place add, which would write into
// tensors that autograd or a caller still holds.
#![allow(clippy::assign_op_pattern)]

use tch::{nn, Device, Kind, Tensor};

use crate::model::config::{ModelConfig, PositionalEncoding};

/// Token embeddings, and the sinusoidal APE when the model uses it.
#[derive(Debug)]
pub struct Embeddings {
    /// (V, d) token embeddings; also the output head's weight when tied.
    pub weight: Tensor,
    /// (N + 1, d) bar embedding ([`ModelConfig::bar_embedding`]).
    pub bar: Option<Tensor>,
    d_model: i64,
    scaled: bool,
    ape: bool,
}

impl Embeddings {
    /// `tok_embed.weight` under `vs`, of std d^-1/2 with scaled embeddings, 0.02 otherwise.
    pub fn new(cfg: &ModelConfig, vs: &nn::Path) -> Embeddings {
        let d = cfg.d_model;
        let weight = vs.sub("tok_embed").var(
            "weight",
            &[cfg.vocab_size, d],
            nn::Init::Randn {
                mean: 0.0,
                stdev: if cfg.scaled_embeddings {
                    (d as f64).powf(-0.5)
                } else {
                    0.02
                },
            },
        );
        let bar = cfg
            .bar_embedding
            .map(|n| vs.sub("bar_embed").zeros("weight", &[n + 1, d]));
        Embeddings {
            weight,
            bar,
            d_model: d,
            scaled: cfg.scaled_embeddings,
            ape: cfg.positional == PositionalEncoding::Ape,
        }
    }

    /// (B, L) int64 tokens at absolute positions offset..offset+L -> (B, L, d), in the
    /// embeddings' kind (before dropout). `bars`: (B, L) int64 rows of the bar embedding
    /// ([`crate::model::clock::bar_rows`]), given exactly when the model has one.
    pub fn forward(&self, tokens: &Tensor, offset: i64, bars: Option<&Tensor>) -> Tensor {
        let d = self.d_model;
        let device = self.weight.device();
        let mut x = Tensor::embedding(&self.weight, &tokens.to_device(device), -1, false, false); // (B, L, d)
        if self.scaled {
            x = x * (d as f64).sqrt();
        }
        if self.ape {
            let l = tokens.size()[1];
            // Sines have RMS 2^-1/2; unscaled embeddings start with std 0.02, so the
            // code is brought to the same scale or it would drown the token.
            let ape = sinusoidal_ape(offset, l, d, device).to_kind(self.weight.kind()); // (L, d)
            x = if self.scaled {
                x + ape
            } else {
                x + ape * (0.02 * std::f64::consts::SQRT_2)
            };
        }
        match (&self.bar, bars) {
            (Some(w), Some(rows)) => {
                x = x + Tensor::embedding(w, &rows.to_device(device), -1, false, false);
            }
            (None, None) => {}
            (w, _) => panic!(
                "bar rows must be given exactly when the model has a bar embedding (it {})",
                if w.is_some() { "has one" } else { "has none" }
            ),
        }
        x
    }
}

/// Sinusoidal absolute positional encoding for positions start..start+len: (len, d) f32.
pub fn sinusoidal_ape(start: i64, len: i64, d: i64, device: Device) -> Tensor {
    let half = (d + 1) / 2;
    let i = Tensor::arange(half, (Kind::Double, device));
    let w = (i * (-2.0 * (10000f64).ln() / d as f64)).exp();
    let pos = Tensor::arange_start(start, start + len, (Kind::Double, device)).unsqueeze(1);
    let ang = pos * w.unsqueeze(0);
    Tensor::stack(&[ang.sin(), ang.cos()], -1)
        .reshape([len, 2 * half])
        .narrow(1, 0, d)
        .to_kind(Kind::Float)
}
