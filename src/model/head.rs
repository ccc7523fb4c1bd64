//! The output head: the final layer norm (`final_norm.*`), then logits from an untied
//! linear layer with a bias (`head.*`) or from the token embeddings (tied).
//!
//! Invariants: logits leave the model in f32. A tied head with scaled embeddings (the
//! legacy form) divides by sqrt(d): the embeddings enter scaled by sqrt(d), so the row of
//! the current token would otherwise give a logit of about sqrt(d) at initialization.

use tch::{nn, Kind, Tensor};

use crate::model::precision::{dense, dense_weight};
use crate::model::{as_kind, layer_norm, linear, ModelConfig};

/// The final norm and the projection to the vocabulary.
#[derive(Debug)]
pub struct OutputHead {
    /// The final layer norm.
    pub norm: nn::LayerNorm,
    /// The untied projection; None when tied to the embeddings.
    pub linear: Option<nn::Linear>,
    /// (V, d) token embeddings (the same variable as the input's), for a tied head.
    embed: Tensor,
    /// d^-1/2 for the legacy scaled tied head.
    scale: Option<f64>,
}

impl OutputHead {
    /// `final_norm.*`, and `head.*` when untied (std 0.02), under `vs`; `embed` is the
    /// input embedding variable, which a tied head multiplies by.
    pub fn new(cfg: &ModelConfig, vs: &nn::Path, embed: &Tensor) -> OutputHead {
        let norm = layer_norm(vs.sub("final_norm"), cfg.d_model);
        let linear = (!cfg.tie_embeddings)
            .then(|| linear(vs.sub("head"), cfg.d_model, cfg.vocab_size, 0.02));
        let scale =
            (cfg.tie_embeddings && cfg.scaled_embeddings).then(|| (cfg.d_model as f64).powf(-0.5));
        OutputHead {
            norm,
            linear,
            embed: embed.shallow_clone(),
            scale,
        }
    }

    /// (B, L, d) residual stream -> (B, L, V) f32 logits.
    pub fn forward(&self, x: &Tensor) -> Tensor {
        let x = x.apply(&self.norm); // (B, L, d)
        let logits = match (&self.linear, self.scale) {
            (Some(head), _) => dense(&x, head),
            // Legacy scaled tied head (see the module docs): starts near ln(V).
            (None, Some(sc)) => dense_weight(&x, &self.embed, None) * sc,
            // GPT-2: logits = x E^T with E of std 0.02.
            (None, None) => dense_weight(&x, &self.embed, None),
        }; // (B, L, V)
        as_kind(&logits, Kind::Float)
    }
}
