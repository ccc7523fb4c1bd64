//! Model hyper-parameters, presets and validation.
//!
//! Invariants: a [`ModelConfig`] read from a file (JSON `config.json`, a TOML
//! `[model]` table) has no key this struct does not know (a misspelt key is an
//! error, never a silently kept default); an integer field may be written as
//! an integral float (`1e15`), so that its range check names it. A config
//! that passes [`ModelConfig::validate`] has every field finite and within
//! [`bounds`], and at most [`bounds::MAX_VALUES`] parameters and fixed buffers
//! by [`ModelConfig::estimated_values`]: checked from arithmetic alone,
//! before any `VarStore` is built.

use anyhow::{bail, Result};
use serde::{Deserialize, Deserializer, Serialize};

/// Bounds of the [`ModelConfig`] fields (see [`ModelConfig::validate`]).
pub mod bounds {
    /// Largest `vocab_size` (ids are u16).
    pub const MAX_VOCAB: i64 = 1 << 16;
    /// Largest `d_model`.
    pub const MAX_D_MODEL: i64 = 16_384;
    /// Largest `n_layers`.
    pub const MAX_LAYERS: i64 = 512;
    /// Largest `n_heads`.
    pub const MAX_HEADS: i64 = 1024;
    /// Largest `d_ff`.
    pub const MAX_D_FF: i64 = 131_072;
    /// Largest `chunk_size`.
    pub const MAX_CHUNK: i64 = 65_536;
    /// Largest `bar_embedding` (bars a piece's embedding tells apart).
    pub const MAX_BAR_EMBEDDING: i64 = 4096;
    /// Largest `taylor_dim` (1 + n + n^2 features per head).
    pub const MAX_TAYLOR_DIM: i64 = 32;
    /// Largest `musical_spe_bar` (grid steps a bar counts on SineSPE's musical clock).
    pub const MAX_MUSICAL_SPE_BAR: i64 = 65_536;
    /// Largest `positional.sines`.
    pub const MAX_SINES: i64 = 1024;
    /// Largest `positional.realizations`.
    pub const MAX_REALIZATIONS: i64 = 4096;
    /// Largest `positional.kernel`.
    pub const MAX_KERNEL: i64 = 16_384;
    /// Largest `attention.features`.
    pub const MAX_FEATURES: i64 = 16_384;
    /// Largest `short_conv`.
    pub const MAX_SHORT_CONV: i64 = 64;
    /// Largest `local_window`.
    pub const MAX_LOCAL_WINDOW: i64 = 1 << 20;
    /// Most parameters and fixed buffers (random features, SPE noise) of a
    /// model, by [`super::ModelConfig::estimated_values`]: 2^31, 8 GiB in f32.
    pub const MAX_VALUES: u128 = 1 << 31;
}

/// Reads an integer field that may be written as an integral float (`1e15`
/// in JSON, `4.0` in TOML): its value then reaches the range check of
/// [`ModelConfig::validate`], which names the field. A fraction or a value
/// beyond i64 is an error here.
fn int<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<i64, D::Error> {
    struct V;
    impl serde::de::Visitor<'_> for V {
        type Value = i64;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("an integer")
        }
        fn visit_i64<E: serde::de::Error>(self, v: i64) -> std::result::Result<i64, E> {
            Ok(v)
        }
        fn visit_u64<E: serde::de::Error>(self, v: u64) -> std::result::Result<i64, E> {
            i64::try_from(v).map_err(|_| E::custom(format!("{v} is too large an integer")))
        }
        fn visit_f64<E: serde::de::Error>(self, v: f64) -> std::result::Result<i64, E> {
            // 2^63 is the first value past i64::MAX
            if v.fract() == 0.0 && v.abs() < (1u64 << 63) as f64 {
                Ok(v as i64)
            } else {
                Err(E::custom(format!("expected an integer, got {v}")))
            }
        }
    }
    d.deserialize_any(V)
}

/// [`int`] for an optional field (serde calls it only when the field is present).
fn opt_int<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<Option<i64>, D::Error> {
    int(d).map(Some)
}

/// How positions enter the model. Read through [`PositionalFile`], which
/// refuses unknown keys in every variant (serde lets an internally tagged
/// unit variant such as `ape` take any key).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case", from = "PositionalFile")]
pub enum PositionalEncoding {
    /// Sinusoidal stochastic positional encoding (periodic kernel), `sines` = K, `realizations` = R.
    SpeSine {
        sines: i64,
        realizations: i64,
        gated: bool,
        shared: bool,
        /// How the frequencies start (absent in configs written before it existed:
        /// the SPE reference's initialization).
        #[serde(default)]
        freq_init: FreqInit,
    },
    /// Convolutional stochastic positional encoding (finite support kernel of length `kernel`).
    SpeConv {
        kernel: i64,
        realizations: i64,
        gated: bool,
        shared: bool,
    },
    /// Additive sinusoidal absolute positional encoding (no maximum length).
    Ape,
    /// No positional information at all.
    None,
}

impl PositionalEncoding {
    pub fn is_spe(&self) -> bool {
        matches!(
            self,
            PositionalEncoding::SpeSine { .. } | PositionalEncoding::SpeConv { .. }
        )
    }

    /// Number of realizations R when SPE is on.
    pub fn realizations(&self) -> Option<i64> {
        match self {
            PositionalEncoding::SpeSine { realizations, .. }
            | PositionalEncoding::SpeConv { realizations, .. } => Some(*realizations),
            _ => None,
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            PositionalEncoding::SpeSine { .. } => "spe-sine",
            PositionalEncoding::SpeConv { .. } => "spe-conv",
            PositionalEncoding::Ape => "ape",
            PositionalEncoding::None => "none",
        }
    }
}

/// How SineSPE frequencies are initialized. A frequency is f = sigmoid(logit) / 2 cycles
/// per token; its period is 1/f tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FreqInit {
    /// The SPE reference code: logits ~ N(-4, 1), so 99% of the periods are longer than
    /// 12 tokens (median 110): a model cannot tell the previous note from the one before.
    #[default]
    Reference,
    /// Periods log-uniform between [`SPREAD_MIN_PERIOD`] and [`SPREAD_MAX_PERIOD`] tokens:
    /// every scale from one token to a few bars is present from the first step.
    Spread,
}

/// Shortest SineSPE period (tokens) of [`FreqInit::Spread`].
pub const SPREAD_MIN_PERIOD: f64 = 2.2;
/// Longest SineSPE period (tokens) of [`FreqInit::Spread`].
pub const SPREAD_MAX_PERIOD: f64 = 2048.0;

/// What positions the local softmax heads see (see [`ModelConfig::local_position`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LocalPosition {
    /// The same queries and keys as the FAVOR+ heads: SPE-filtered when SPE is on
    /// (configs written before the field). Their logits then carry the SPE estimate of the
    /// relative-position kernel, with its Monte Carlo noise.
    #[default]
    Shared,
    /// Rotary position embedding on the local heads' own queries and keys, which skip SPE:
    /// the logit of a query at p and a key at p' depends on p - p' exactly, with no noise
    /// (RoPE, Su et al. 2021; [`crate::model::rope::rope`]).
    Rope,
}

/// Base of the RoPE angles: pair j of a D-dimensional head turns by p * base^(-2j/D).
pub const ROPE_BASE: f64 = 10000.0;

/// Attention mechanism. Read through [`AttentionFile`], which refuses
/// unknown keys in every variant.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case", from = "AttentionFile")]
pub enum AttentionKind {
    /// FAVOR+ linear attention with `features` positive orthogonal random features.
    Favor {
        features: i64,
        antithetic: bool,
        redraw_prob: f64,
    },
    /// Exact causal softmax attention (reference; quadratic in the length).
    Softmax,
}

/// [`PositionalEncoding`] as a file spells it: every variant a struct, so
/// that an unknown key is refused in each.
#[derive(Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
pub enum PositionalFile {
    /// [`PositionalEncoding::SpeSine`].
    SpeSine {
        #[serde(deserialize_with = "int")]
        sines: i64,
        #[serde(deserialize_with = "int")]
        realizations: i64,
        gated: bool,
        shared: bool,
        #[serde(default)]
        freq_init: FreqInit,
    },
    /// [`PositionalEncoding::SpeConv`].
    SpeConv {
        #[serde(deserialize_with = "int")]
        kernel: i64,
        #[serde(deserialize_with = "int")]
        realizations: i64,
        gated: bool,
        shared: bool,
    },
    /// [`PositionalEncoding::Ape`].
    Ape {},
    /// [`PositionalEncoding::None`].
    None {},
}

impl From<PositionalFile> for PositionalEncoding {
    fn from(f: PositionalFile) -> Self {
        match f {
            PositionalFile::SpeSine {
                sines,
                realizations,
                gated,
                shared,
                freq_init,
            } => PositionalEncoding::SpeSine {
                sines,
                realizations,
                gated,
                shared,
                freq_init,
            },
            PositionalFile::SpeConv {
                kernel,
                realizations,
                gated,
                shared,
            } => PositionalEncoding::SpeConv {
                kernel,
                realizations,
                gated,
                shared,
            },
            PositionalFile::Ape {} => PositionalEncoding::Ape,
            PositionalFile::None {} => PositionalEncoding::None,
        }
    }
}

/// [`AttentionKind`] as a file spells it (see [`PositionalFile`]).
#[derive(Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
pub enum AttentionFile {
    /// [`AttentionKind::Favor`].
    Favor {
        #[serde(deserialize_with = "int")]
        features: i64,
        antithetic: bool,
        redraw_prob: f64,
    },
    /// [`AttentionKind::Softmax`].
    Softmax {},
}

impl From<AttentionFile> for AttentionKind {
    fn from(f: AttentionFile) -> Self {
        match f {
            AttentionFile::Favor {
                features,
                antithetic,
                redraw_prob,
            } => AttentionKind::Favor {
                features,
                antithetic,
                redraw_prob,
            },
            AttentionFile::Softmax {} => AttentionKind::Softmax,
        }
    }
}

/// The model's hyper-parameters (`model` in a run's `config.json`). Every
/// key the configs written so far hold is a field (the later ones default
/// to their old meaning when absent); any other key is refused.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    #[serde(deserialize_with = "int")]
    pub vocab_size: i64,
    #[serde(deserialize_with = "int")]
    pub d_model: i64,
    #[serde(deserialize_with = "int")]
    pub n_layers: i64,
    #[serde(deserialize_with = "int")]
    pub n_heads: i64,
    #[serde(deserialize_with = "int")]
    pub d_ff: i64,
    pub dropout: f64,
    pub positional: PositionalEncoding,
    pub attention: AttentionKind,
    /// Chunk length of the chunked causal linear attention (a pure speed/memory knob),
    /// which runs off the CPU: on the CPU in f32 the fused kernel takes no chunks.
    #[serde(deserialize_with = "int")]
    pub chunk_size: i64,
    /// One matrix for the input embedding and the output head (no bias); otherwise an untied
    /// linear head with a bias.
    pub tie_embeddings: bool,
    /// The scaling of the first models (configs that lack the field): embeddings start with
    /// std d^-1/2, the input is multiplied by sqrt(d) and tied logits by d^-1/2, which caps
    /// the reachable logits by the embedding norms and slowed learning badly
    /// (docs/learning.md). `false`: GPT-2's convention, std 0.02 and no scaling at either end.
    #[serde(default = "legacy_scaled_embeddings")]
    pub scaled_embeddings: bool,
    /// Kernel length of a causal depthwise convolution over time applied to
    /// every query, key and value channel right after their projection, before
    /// SPE and the feature map (0: none, the configs written before it). It lets
    /// each query and key carry its last few tokens, which linear attention
    /// cannot single out by itself (docs/learning.md); the recurrent state keeps
    /// the last `short_conv - 1` projections per layer.
    #[serde(default, deserialize_with = "int")]
    pub short_conv: i64,
    /// Heads of every layer that attend with exact softmax over the last
    /// `local_window` tokens (themselves included) instead of FAVOR+; the other
    /// heads keep FAVOR+ over the whole past. Positions in the local heads: see
    /// `local_position`. 0: none (the configs written before it). Costs
    /// O(window) per token, and the recurrent state keeps the last
    /// `local_window` keys and values of these heads: still constant per token
    /// (docs/learning.md for why: FAVOR+ alone cannot retrieve a recent note
    /// exactly).
    #[serde(default, deserialize_with = "int")]
    pub local_heads: i64,
    /// Tokens a local head sees (see `local_heads`).
    #[serde(default, deserialize_with = "int")]
    pub local_window: i64,
    /// Positions in the local heads: the FAVOR+ heads' SPE-filtered queries and keys
    /// (`shared`, configs written before the field) or RoPE on their own (`rope`).
    #[serde(default)]
    pub local_position: LocalPosition,
    /// RoPE of the local heads partly in musical time ([`MusicalRope`]): some of their
    /// rotary pairs turn by the bar index and the position in the bar instead of the token
    /// index. None (the configs written before it): every pair on the token index.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub musical_rope: Option<MusicalRope>,
    /// Where in the form a token stands, as input: a learned embedding `bar_embed.weight`,
    /// (N + 1, d), zero at initialisation, added to the token embedding. Row `b` is the
    /// `b`-th bar since the last `BOS` (the tokens between `BOS` and the first `Bar` are
    /// row 0; bars past N - 1 share row N - 1); row N stands for "not known", the tokens
    /// of a window before its first `BOS` ([`crate::model::clock::BarIndex`]). None (the
    /// configs written before it): no such input.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "opt_int"
    )]
    pub bar_embedding: Option<i64>,
    /// SineSPE of the FAVOR+ heads in musical time: a token's SPE position is its place on
    /// the clock of `musical_rope` (which it needs; its pair counts may be 0), `bar *
    /// positions + position` grid steps ([`crate::model::clock::ClockState::musical_position`]),
    /// instead of its index, so the FAVOR+ heads' kernel sees "the same place 8 bars back"
    /// as one lag whatever the note density (docs/model.md, "Musical positions"). false
    /// (the configs written before it): the token index.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub musical_spe: bool,
    /// Grid steps one bar counts on SineSPE's musical clock (`musical_spe`, which it needs):
    /// a token's SPE position is `bar * musical_spe_bar + position`. None (the configs
    /// written before it): `musical_rope.positions`, the longest bar the grid spells (288
    /// steps in the compact vocabulary), so positions never fall but a bar spans six 4/4
    /// bars of clock and the spread init's longest period (2,048 steps) is 7 bars. 48 (a
    /// 4/4 bar of the 12-per-beat grid) puts those periods between a 16th note and 42 bars;
    /// a longer bar then reaches into the next bar's steps, which SineSPE allows (its
    /// kernel needs lags, not order; the causal order is the tokens').
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "opt_int"
    )]
    pub musical_spe_bar: Option<i64>,
    /// A write gate on the FAVOR+ heads (`write_gate.*`, d -> H' per layer, zero at
    /// initialisation): each token's key features are scaled by g = sigmoid(w . x + b), one
    /// per FAVOR+ head, so that S = sum g phi(k) v^T and z = sum g phi(k). A token whose
    /// gate closes is not written into the state, and a read, normalised by z, averages over
    /// the tokens written, not over every token of the past (docs/learning.md, "A write
    /// gate"). A uniform gate changes nothing (the normalisation cancels it): a new gate
    /// starts as the ungated heads. The state stays constant per token. false (the configs
    /// written before it): no gate.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub favor_write_gate: bool,
    /// The feature map of the linear-attention heads: None (the configs written before
    /// it), FAVOR+'s positive random features; Some(n), the second-order Taylor map of exp
    /// (Based, Arora et al. 2024) on queries and keys projected to n dims per head
    /// (`taylor_q`, `taylor_k`, (H', dk, n)) and scaled by n^-1/4: phi(x) = [1, x,
    /// vec(x x^T) / sqrt 2], 1 + n + n^2 features, so that phi(q) . phi(k) = 1 + s + s^2 / 2
    /// with s = q . k / sqrt n, a positive kernel with no random draw, whose state grows
    /// with n^2 (docs/learning.md, "The Taylor map inside cadenza"). `attention.features`
    /// is then unused.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "opt_int"
    )]
    pub taylor_dim: Option<i64>,
    /// RoPE on the Taylor map's projected queries and keys (`taylor_dim`, which it needs,
    /// even), on the token index: s = f_q . f_k then depends on their lag as a RoPE
    /// softmax logit does, and the kernel can single out one lag exactly, which SPE's few
    /// sines cannot. false (the configs written before it): no rotation.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub taylor_rope: bool,
}

/// Musical time in the RoPE of the local heads (`local_position = "rope"`): of the
/// `head_dim / 2` rotary pairs, the first ones keep their token-index angles, the next
/// `bar_pairs` turn by the bar index and the last `position_pairs` by the position in the
/// bar (steps of the tokenizer's grid). A query and a key then meet with a rotation that
/// depends on (token lag, bar lag, position lag) only, so "the same place 8 bars back" is
/// one lag whatever the note density (docs/model.md, "Musical positions").
///
/// The clock reads the tokens themselves ([`crate::model::clock`]): `Bar` (and `BOS`)
/// move to the next bar at position 0, `Position_p` sets the position; every other token
/// stays where the last one was. `position_first` and `positions` say which ids are
/// `Position` tokens: training fills them from its vocabulary.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MusicalRope {
    /// Rotary pairs turned by the bar index.
    #[serde(deserialize_with = "int")]
    pub bar_pairs: i64,
    /// Rotary pairs turned by the position in the bar.
    #[serde(deserialize_with = "int")]
    pub position_pairs: i64,
    /// Id of `Position_0` in the vocabulary (filled by training when 0).
    #[serde(default, deserialize_with = "int")]
    pub position_first: i64,
    /// Number of `Position` ids (filled by training when 0).
    #[serde(default, deserialize_with = "int")]
    pub positions: i64,
}

impl MusicalRope {
    /// Highest angle per bar (pair `bar_pairs - 1` has the lowest, 1/32 of it).
    pub const BAR_TOP: f64 = std::f64::consts::FRAC_PI_2;
    /// Ratio of the lowest to the highest angle per bar.
    pub const BAR_SPAN: f64 = 1.0 / 32.0;
    /// Highest angle per grid step of the position in the bar.
    pub const POSITION_TOP: f64 = std::f64::consts::FRAC_PI_2;
    /// Ratio of the lowest to the highest angle per position step.
    pub const POSITION_SPAN: f64 = 1.0 / 64.0;

    /// Pairs left on the token index for a head of `head_dim` dimensions.
    pub fn token_pairs(&self, head_dim: i64) -> i64 {
        head_dim / 2 - self.bar_pairs - self.position_pairs
    }

    /// The angle per unit of each pair of a head of `head_dim` dimensions, with its axis:
    /// the token pairs keep the plain RoPE frequencies of their index, the bar and
    /// position pairs run geometrically from their top angle down by their span.
    pub fn frequencies(&self, head_dim: i64) -> Vec<(Axis, f64)> {
        let plain = crate::model::rope::rope_frequencies(head_dim);
        let t = self.token_pairs(head_dim).max(0) as usize;
        let geometric = |n: i64, top: f64, span: f64, k: i64| {
            if n <= 1 {
                top
            } else {
                top * span.powf(k as f64 / (n - 1) as f64)
            }
        };
        let mut out: Vec<(Axis, f64)> = plain[..t].iter().map(|&w| (Axis::Token, w)).collect();
        out.extend((0..self.bar_pairs).map(|k| {
            let w = geometric(self.bar_pairs, Self::BAR_TOP, Self::BAR_SPAN, k);
            (Axis::Bar, w)
        }));
        out.extend((0..self.position_pairs).map(|k| {
            let w = geometric(
                self.position_pairs,
                Self::POSITION_TOP,
                Self::POSITION_SPAN,
                k,
            );
            (Axis::Position, w)
        }));
        out
    }
}

/// The coordinate a rotary pair turns by (see [`MusicalRope`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Axis {
    /// The token index.
    Token,
    /// The bar index.
    Bar,
    /// The position in the bar.
    Position,
}

fn legacy_scaled_embeddings() -> bool {
    true
}

/// Names accepted by [`ModelConfig::preset`].
pub const PRESETS: &[&str] = &["tiny", "small", "base"];
/// Names accepted by [`ModelConfig::with_positional`].
pub const POSITIONALS: &[&str] = &["spe-sine", "spe-conv", "ape", "none"];

/// (sines K, realizations R, conv kernel) defaults of a preset.
struct SpeDefaults {
    sines: i64,
    realizations: i64,
    kernel: i64,
}

impl ModelConfig {
    /// `tiny` (tests), `small` (a CPU-trainable model), `base` (the SPE paper's pop-piano model).
    /// All use FAVOR+ attention and gated, shared SineSPE.
    pub fn preset(name: &str, vocab_size: i64) -> Result<ModelConfig> {
        // chunk (the chunked form runs on CUDA and in f64 only now): when the CPU ran it
        // too, the `small` model's training step was 3% faster at L = 512 with chunks of 64
        // than of 128 (four alternations), the same at 2,048 and 16,384; its shipped
        // checkpoint keeps the 128 it was trained with (the result is the same either way).
        let (d_model, n_layers, n_heads, d_ff, features, dropout, chunk) = match name {
            "tiny" => (64, 2, 4, 128, 32, 0.0, 64),
            "small" => (256, 4, 4, 1024, 64, 0.0, 64),
            "base" => (512, 24, 8, 2048, 128, 0.1, 128),
            other => bail!(
                "unknown model preset {other:?}; valid presets: {}",
                PRESETS.join(", ")
            ),
        };
        let d = Self::spe_defaults_for(d_model, n_layers);
        let cfg = ModelConfig {
            vocab_size,
            d_model,
            n_layers,
            n_heads,
            d_ff,
            dropout,
            positional: PositionalEncoding::SpeSine {
                sines: d.sines,
                realizations: d.realizations,
                gated: true,
                shared: true,
                freq_init: FreqInit::Spread,
            },
            attention: AttentionKind::Favor {
                features,
                antithetic: false,
                redraw_prob: 0.05,
            },
            chunk_size: chunk,
            tie_embeddings: false,
            scaled_embeddings: false,
            short_conv: 0,
            local_heads: 0,
            local_window: 0,
            local_position: LocalPosition::Shared,
            musical_rope: None,
            bar_embedding: None,
            musical_spe: false,
            musical_spe_bar: None,
            favor_write_gate: false,
            taylor_dim: None,
            taylor_rope: false,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    fn spe_defaults_for(d_model: i64, n_layers: i64) -> SpeDefaults {
        match (d_model, n_layers) {
            (64, 2) => SpeDefaults {
                sines: 5,
                realizations: 16,
                kernel: 16,
            },
            (256, 4) => SpeDefaults {
                sines: 5,
                realizations: 32,
                kernel: 64,
            },
            (512, 24) => SpeDefaults {
                sines: 5,
                realizations: 64,
                kernel: 128,
            },
            _ if d_model <= 64 => SpeDefaults {
                sines: 5,
                realizations: 16,
                kernel: 16,
            },
            _ if d_model <= 256 => SpeDefaults {
                sines: 5,
                realizations: 32,
                kernel: 64,
            },
            _ => SpeDefaults {
                sines: 5,
                realizations: 64,
                kernel: 128,
            },
        }
    }

    /// Switches the positional encoding by name ("spe-sine" | "spe-conv" | "ape" | "none").
    /// R, gated and shared are kept from the current SPE setting when there is one; K and the
    /// conv kernel length come from the current setting or else from the preset matching the size.
    pub fn with_positional(mut self, name: &str) -> Result<ModelConfig> {
        let d = Self::spe_defaults_for(self.d_model, self.n_layers);
        let (mut sines, mut realizations, mut kernel, mut gated, mut shared) =
            (d.sines, d.realizations, d.kernel, true, true);
        let mut freq_init = FreqInit::Spread;
        match &self.positional {
            PositionalEncoding::SpeSine {
                sines: k,
                realizations: r,
                gated: g,
                shared: s,
                freq_init: f,
            } => {
                freq_init = *f;
                sines = *k;
                realizations = *r;
                gated = *g;
                shared = *s;
            }
            PositionalEncoding::SpeConv {
                kernel: k,
                realizations: r,
                gated: g,
                shared: s,
            } => {
                kernel = *k;
                realizations = *r;
                gated = *g;
                shared = *s;
            }
            _ => {}
        }
        self.positional = match name {
            "spe-sine" => PositionalEncoding::SpeSine {
                sines,
                realizations,
                gated,
                shared,
                freq_init,
            },
            "spe-conv" => PositionalEncoding::SpeConv {
                kernel,
                realizations,
                gated,
                shared,
            },
            "ape" => PositionalEncoding::Ape,
            "none" => PositionalEncoding::None,
            other => bail!(
                "unknown positional encoding {other:?}; valid ones: {}",
                POSITIONALS.join(", ")
            ),
        };
        Ok(self)
    }

    /// Per-head dimension of queries, keys and values.
    pub fn head_dim(&self) -> i64 {
        self.d_model / self.n_heads
    }

    /// Dimension of queries/keys as they enter the attention (R with SPE, head dim otherwise).
    pub fn qk_dim(&self) -> i64 {
        self.positional
            .realizations()
            .unwrap_or_else(|| self.head_dim())
    }

    /// Features per linear-attention head, M: 1 + n + n^2 with the Taylor map
    /// (`taylor_dim` n), FAVOR+'s random features otherwise; None without such heads.
    pub fn linear_features(&self) -> Option<i64> {
        match (&self.attention, self.taylor_dim) {
            (AttentionKind::Favor { .. }, Some(n)) => Some(1 + n + n * n),
            (AttentionKind::Favor { features, .. }, None) => Some(*features),
            (AttentionKind::Softmax, _) => None,
        }
    }

    /// Dimension of the local heads' queries and keys: the head dimension under RoPE, the
    /// FAVOR+ heads' [`Self::qk_dim`] otherwise.
    pub fn local_qk_dim(&self) -> i64 {
        match self.local_position {
            LocalPosition::Rope => self.head_dim(),
            LocalPosition::Shared => self.qk_dim(),
        }
    }

    /// The checks of the local heads' settings (part of [`Self::validate`]).
    fn validate_local_heads(&self) -> Result<()> {
        if self.local_heads != 0 {
            if !(0..=self.n_heads).contains(&self.local_heads) {
                bail!(
                    "model config: local_heads must be in 0..=n_heads ({}) (got {})",
                    self.n_heads,
                    self.local_heads
                );
            }
            if self.local_window < 1 {
                bail!(
                    "model config: local_heads needs local_window >= 1 (got {})",
                    self.local_window
                );
            }
            if self.local_position == LocalPosition::Rope && self.head_dim() % 2 != 0 {
                bail!(
                    "model config: local_position = \"rope\" turns pairs of dimensions, so the head dimension must be even (got {})",
                    self.head_dim()
                );
            }
            if self.attention == AttentionKind::Softmax {
                bail!("model config: local_heads mixes local softmax into FAVOR+ attention; with softmax attention every head is exact already");
            }
        }
        if self.local_heads == 0 && self.local_position != LocalPosition::Shared {
            bail!("model config: local_position applies to local heads, and local_heads is 0");
        }
        if let Some(m) = &self.musical_rope {
            if self.local_heads == 0 || self.local_position != LocalPosition::Rope {
                bail!("model config: musical_rope turns the RoPE of local heads; it needs local_heads > 0 and local_position = \"rope\"");
            }
            if m.bar_pairs < 0 || m.position_pairs < 0 || m.token_pairs(self.head_dim()) < 1 {
                bail!(
                    "model config: musical_rope.bar_pairs ({}) and position_pairs ({}) must be >= 0 and leave at least one of the head's {} rotary pairs on the token index",
                    m.bar_pairs,
                    m.position_pairs,
                    self.head_dim() / 2
                );
            }
            if m.positions < 1
                || m.position_first < 0
                || m.position_first + m.positions > self.vocab_size
            {
                bail!(
                    "model config: musical_rope's Position ids {}..{} must be a non-empty range inside the vocabulary of {}",
                    m.position_first,
                    m.position_first + m.positions,
                    self.vocab_size
                );
            }
        }
        if self.musical_spe {
            if !matches!(self.positional, PositionalEncoding::SpeSine { .. }) {
                bail!(
                    "model config: musical_spe puts SineSPE's positions in musical time; it needs positional kind \"spe-sine\" (got \"{}\")",
                    self.positional.name()
                );
            }
            if self.musical_rope.is_none() {
                bail!("model config: musical_spe reads the musical clock of musical_rope; set musical_rope too (bar_pairs = 0 and position_pairs = 0 leave the local heads' RoPE on the token index)");
            }
        }
        Ok(())
    }

    /// Grid steps one bar counts on SineSPE's musical clock: `musical_spe_bar`, or the
    /// longest bar the grid of `m` spells.
    pub fn spe_bar_steps(&self, m: &MusicalRope) -> i64 {
        self.musical_spe_bar.unwrap_or(m.positions)
    }

    /// An upper estimate of the values a model of this config holds:
    /// parameters plus fixed buffers (FAVOR+ random features, SPE noise),
    /// from arithmetic alone (u128, so it never overflows for i64 fields).
    pub fn estimated_values(&self) -> u128 {
        let u = |v: i64| v.max(0) as u128;
        let (v, d, ff, layers, heads) = (
            u(self.vocab_size),
            u(self.d_model),
            u(self.d_ff),
            u(self.n_layers),
            u(self.n_heads),
        );
        let hd = d.checked_div(heads).unwrap_or(d);
        let mut per_layer = 4 * d * d + 4 * d + 2 * d * ff + ff + d + 4 * d;
        per_layer += 3 * d * u(self.short_conv);
        per_layer += match &self.positional {
            PositionalEncoding::SpeSine {
                sines,
                realizations,
                ..
            } => heads * hd * (3 * u(*sines) + 2 * u(*sines) * u(*realizations)),
            PositionalEncoding::SpeConv {
                kernel,
                realizations,
                ..
            } => heads * hd * (2 * u(*kernel) + u(*realizations)),
            PositionalEncoding::Ape | PositionalEncoding::None => 0,
        };
        if let AttentionKind::Favor { features, .. } = &self.attention {
            let qk = u(self.qk_dim()).max(hd);
            per_layer += heads * u(*features) * qk;
        }
        if self.favor_write_gate {
            per_layer += (d + 1) * heads.saturating_sub(u(self.local_heads));
        }
        if let Some(n) = self.taylor_dim {
            per_layer += 2 * heads * u(self.qk_dim()).max(hd) * u(n);
        }
        let head = if self.tie_embeddings { 0 } else { v * d + v };
        v * d + head + 2 * d + layers * per_layer
    }

    /// Checks every setting against its range ([`bounds`]) and the model's
    /// size ([`Self::estimated_values`]), naming the first one out of range:
    /// nothing is allocated before it passes.
    pub fn validate(&self) -> Result<()> {
        use bounds::*;
        let within = |name: &str, v: i64, lo: i64, hi: i64| -> Result<()> {
            if !(lo..=hi).contains(&v) {
                bail!("model config: {name} must be in {lo}..={hi} (got {v})");
            }
            Ok(())
        };
        within("vocab_size", self.vocab_size, 1, MAX_VOCAB)?;
        within("d_model", self.d_model, 1, MAX_D_MODEL)?;
        within("n_layers", self.n_layers, 1, MAX_LAYERS)?;
        within("n_heads", self.n_heads, 1, MAX_HEADS)?;
        within("d_ff", self.d_ff, 1, MAX_D_FF)?;
        within("chunk_size", self.chunk_size, 1, MAX_CHUNK)?;
        if !(0..=MAX_SHORT_CONV).contains(&self.short_conv) {
            bail!(
                "model config: short_conv must be a kernel length in 0..={MAX_SHORT_CONV}, 0 for none (got {})",
                self.short_conv
            );
        }
        within("local_heads", self.local_heads, 0, MAX_HEADS)?;
        within("local_window", self.local_window, 0, MAX_LOCAL_WINDOW)?;
        if let Some(n) = self.bar_embedding {
            within("bar_embedding", n, 1, MAX_BAR_EMBEDDING)?;
        }
        if let Some(n) = self.musical_spe_bar {
            within("musical_spe_bar", n, 1, MAX_MUSICAL_SPE_BAR)?;
            if !self.musical_spe {
                bail!("model config: musical_spe_bar is the bar of SineSPE's musical clock; it needs musical_spe = true");
            }
        }
        if self.d_model % self.n_heads != 0 {
            bail!(
                "model config: d_model ({}) must be divisible by n_heads ({})",
                self.d_model,
                self.n_heads
            );
        }
        if !(0.0..1.0).contains(&self.dropout) {
            bail!(
                "model config: dropout must be a number in [0, 1) (got {})",
                self.dropout
            );
        }
        self.validate_local_heads()?;
        let linear_heads = matches!(self.attention, AttentionKind::Favor { .. })
            && self.local_heads < self.n_heads;
        if self.favor_write_gate && !linear_heads {
            bail!(
                "model config: favor_write_gate gates what the FAVOR+ heads write; it needs \
                 FAVOR+ attention and fewer local_heads than n_heads"
            );
        }
        if let Some(n) = self.taylor_dim {
            within("taylor_dim", n, 1, MAX_TAYLOR_DIM)?;
            if !linear_heads {
                bail!(
                    "model config: taylor_dim is the feature map of the linear-attention heads; \
                     it needs attention kind \"favor\" and fewer local_heads than n_heads"
                );
            }
        }
        if self.taylor_rope && self.taylor_dim.is_none_or(|n| n % 2 != 0) {
            bail!(
                "model config: taylor_rope turns the Taylor map's projected queries and keys; \
                 it needs an even taylor_dim"
            );
        }
        match &self.positional {
            PositionalEncoding::SpeSine {
                sines,
                realizations,
                ..
            } => {
                within("positional.sines", *sines, 1, MAX_SINES)?;
                within(
                    "positional.realizations",
                    *realizations,
                    1,
                    MAX_REALIZATIONS,
                )?;
            }
            PositionalEncoding::SpeConv {
                kernel,
                realizations,
                ..
            } => {
                within("positional.kernel", *kernel, 1, MAX_KERNEL)?;
                within(
                    "positional.realizations",
                    *realizations,
                    1,
                    MAX_REALIZATIONS,
                )?;
            }
            PositionalEncoding::Ape | PositionalEncoding::None => {}
        }
        if let AttentionKind::Favor {
            features,
            antithetic,
            redraw_prob,
        } = &self.attention
        {
            within("attention.features", *features, 1, MAX_FEATURES)?;
            if *antithetic && features % 2 != 0 {
                bail!("model config: antithetic FAVOR+ needs an even number of features (got {features})");
            }
            if !(0.0..=1.0).contains(redraw_prob) {
                bail!("model config: attention.redraw_prob must be a number in [0, 1] (got {redraw_prob})");
            }
        }
        let values = self.estimated_values();
        if values > MAX_VALUES {
            bail!(
                "model config: d_model {}, n_layers {}, d_ff {}, n_heads {} and the attention \
                 and positional settings make about {values} parameters and buffers, more than \
                 the limit of {MAX_VALUES} (8 GiB in f32); make the model smaller",
                self.d_model,
                self.n_layers,
                self.d_ff,
                self.n_heads
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_validate_and_unknown_lists_valid() {
        for p in PRESETS {
            let c = ModelConfig::preset(p, 333).unwrap();
            c.validate().unwrap();
        }
        let base = ModelConfig::preset("base", 333).unwrap();
        assert_eq!(
            (base.n_layers, base.d_model, base.n_heads, base.d_ff),
            (24, 512, 8, 2048)
        );
        let err = ModelConfig::preset("huge", 10).unwrap_err().to_string();
        assert!(
            err.contains("tiny") && err.contains("small") && err.contains("base"),
            "{err}"
        );
    }

    #[test]
    fn with_positional_keeps_r_and_kernel() {
        let c = ModelConfig::preset("small", 100).unwrap();
        let conv = c.clone().with_positional("spe-conv").unwrap();
        assert_eq!(
            conv.positional,
            PositionalEncoding::SpeConv {
                kernel: 64,
                realizations: 32,
                gated: true,
                shared: true
            }
        );
        let back = conv
            .with_positional("ape")
            .unwrap()
            .with_positional("spe-sine")
            .unwrap();
        assert_eq!(back.positional, c.positional);
        assert!(c
            .with_positional("rope")
            .unwrap_err()
            .to_string()
            .contains("spe-conv"));
    }

    #[test]
    fn validate_messages() {
        let mut c = ModelConfig::preset("tiny", 50).unwrap();
        c.n_heads = 3;
        assert!(c.validate().unwrap_err().to_string().contains("divisible"));
        let mut c = ModelConfig::preset("tiny", 50).unwrap();
        c.vocab_size = 0;
        assert!(c.validate().unwrap_err().to_string().contains("vocab_size"));
        let mut c = ModelConfig::preset("tiny", 50).unwrap();
        c.attention = AttentionKind::Favor {
            features: 7,
            antithetic: true,
            redraw_prob: 0.0,
        };
        assert!(c.validate().unwrap_err().to_string().contains("even"));
    }

    #[test]
    fn musical_spe_needs_sine_spe_and_the_clock() {
        let mut c = ModelConfig::preset("tiny", 50).unwrap();
        (c.local_heads, c.local_window, c.local_position) = (2, 8, LocalPosition::Rope);
        c.musical_spe = true;
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("musical_rope"), "{e}");
        c.musical_rope = Some(MusicalRope {
            bar_pairs: 0,
            position_pairs: 0,
            position_first: 4,
            positions: 20,
        });
        c.validate().unwrap();
        let mut conv = c.clone().with_positional("spe-conv").unwrap();
        conv.musical_spe = true;
        let e = conv.validate().unwrap_err().to_string();
        assert!(e.contains("spe-sine") && e.contains("spe-conv"), "{e}");
        // written only when on, so configs without it read back unchanged
        let off = ModelConfig::preset("tiny", 50).unwrap();
        assert!(serde_json::to_value(&off)
            .unwrap()
            .get("musical_spe")
            .is_none());
        let v = serde_json::to_value(&c).unwrap();
        assert_eq!(v["musical_spe"], serde_json::json!(true));
        assert!(v.get("musical_spe_bar").is_none());
        assert_eq!(serde_json::from_value::<ModelConfig>(v).unwrap(), c);
        // the bar of the SPE clock: the grid's longest unless set, only with musical_spe
        let m = c.musical_rope.unwrap();
        assert_eq!(c.spe_bar_steps(&m), 20);
        c.musical_spe_bar = Some(12);
        c.validate().unwrap();
        assert_eq!(c.spe_bar_steps(&m), 12);
        let v = serde_json::to_value(&c).unwrap();
        assert_eq!(v["musical_spe_bar"], serde_json::json!(12));
        assert_eq!(serde_json::from_value::<ModelConfig>(v).unwrap(), c);
        c.musical_spe_bar = Some(0);
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("musical_spe_bar"), "{e}");
        c.musical_spe_bar = Some(12);
        c.musical_spe = false;
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("needs musical_spe"), "{e}");
    }

    #[test]
    fn configs_written_before_the_head_fix_keep_their_meaning() {
        let mut c = ModelConfig::preset("small", 877).unwrap();
        assert!(!c.scaled_embeddings && !c.tie_embeddings);
        c.tie_embeddings = true;
        let mut v = serde_json::to_value(&c).unwrap();
        let obj = v.as_object_mut().unwrap();
        obj.remove("scaled_embeddings");
        obj["positional"]
            .as_object_mut()
            .unwrap()
            .remove("freq_init");
        let old: ModelConfig = serde_json::from_value(v).unwrap();
        assert!(old.scaled_embeddings, "legacy configs are scaled");
        assert!(matches!(
            old.positional,
            PositionalEncoding::SpeSine {
                freq_init: FreqInit::Reference,
                ..
            }
        ));
    }

    #[test]
    fn hostile_sizes_are_refused_before_any_allocation() {
        let tiny = ModelConfig::preset("tiny", 50).unwrap();
        let refused = |change: &dyn Fn(&mut ModelConfig)| {
            let mut c = tiny.clone();
            change(&mut c);
            c.validate().unwrap_err().to_string()
        };
        let e = refused(&|c| c.n_layers = 100_000);
        assert!(e.contains("n_layers") && e.contains("1..=512"), "{e}");
        let e = refused(&|c| c.local_window = 1_000_000_000_000_000);
        assert!(e.contains("local_window"), "{e}");
        let e = refused(&|c| {
            c.attention = AttentionKind::Favor {
                features: i64::MAX,
                antithetic: false,
                redraw_prob: 0.0,
            }
        });
        assert!(e.contains("attention.features"), "{e}");
        let e = refused(&|c| c.dropout = f64::NAN);
        assert!(e.contains("dropout"), "{e}");
        // every field within its range, the whole too big
        let e = refused(&|c| {
            (c.n_layers, c.d_model, c.d_ff) = (512, 16_384, 131_072);
        });
        assert!(e.contains("parameters") && e.contains("2147483648"), "{e}");
        let e = refused(&|c| {
            c.positional = PositionalEncoding::SpeSine {
                sines: 1024,
                realizations: 4096,
                gated: true,
                shared: true,
                freq_init: FreqInit::Spread,
            };
            c.n_layers = 512;
        });
        assert!(e.contains("parameters"), "{e}");
        // the presets are far below the bound; the estimate grows with the size
        let base = ModelConfig::preset("base", 900).unwrap();
        assert!(base.estimated_values() < bounds::MAX_VALUES / 10);
        assert!(base.estimated_values() > tiny.estimated_values());
    }

    #[test]
    fn unknown_keys_are_refused_and_integral_floats_reach_the_range_check() {
        let c = ModelConfig::preset("small", 877).unwrap();
        let v = serde_json::to_value(&c).unwrap();
        let mut bad = v.clone();
        bad["local_head"] = serde_json::json!(2);
        let e = serde_json::from_value::<ModelConfig>(bad)
            .unwrap_err()
            .to_string();
        assert!(e.contains("local_head"), "{e}");
        let mut bad = v.clone();
        bad["positional"]["sine"] = serde_json::json!(5);
        let e = serde_json::from_value::<ModelConfig>(bad)
            .unwrap_err()
            .to_string();
        assert!(e.contains("sine"), "{e}");
        let mut bad = v.clone();
        bad["attention"]["feature"] = serde_json::json!(5);
        assert!(serde_json::from_value::<ModelConfig>(bad).is_err());
        for bad in [r#"{"kind":"ape","x":1}"#, r#"{"kind":"none","sines":5}"#] {
            assert!(
                serde_json::from_str::<PositionalEncoding>(bad).is_err(),
                "{bad}"
            );
        }
        let e = serde_json::from_str::<AttentionKind>(r#"{"kind":"softmax","features":8}"#);
        assert!(e.unwrap_err().to_string().contains("features"));
        assert_eq!(
            serde_json::from_str::<AttentionKind>(r#"{"kind":"softmax"}"#).unwrap(),
            AttentionKind::Softmax
        );
        let mut big = v.clone();
        big["local_window"] = serde_json::json!(1e15);
        let big: ModelConfig = serde_json::from_value(big).unwrap();
        let e = big.validate().unwrap_err().to_string();
        assert!(
            e.contains("local_window") && e.contains("1000000000000000"),
            "{e}"
        );
        let mut frac = v;
        frac["d_model"] = serde_json::json!(2.5);
        let e = serde_json::from_value::<ModelConfig>(frac)
            .unwrap_err()
            .to_string();
        assert!(e.contains("2.5"), "{e}");
        // the shipped model's config still loads and passes
        let text = std::fs::read_to_string("models/cadenza-small/config.json").unwrap();
        let run: serde_json::Value = serde_json::from_str(&text).unwrap();
        let shipped: ModelConfig = serde_json::from_value(run["model"].clone()).unwrap();
        shipped.validate().unwrap();
    }

    #[test]
    fn serde_roundtrip_and_tags() {
        let c = ModelConfig::preset("tiny", 50)
            .unwrap()
            .with_positional("spe-conv")
            .unwrap();
        let s = serde_json::to_string(&c).unwrap();
        assert!(
            s.contains("\"kind\":\"spe-conv\"") && s.contains("\"kind\":\"favor\""),
            "{s}"
        );
        let back: ModelConfig = serde_json::from_str(&s).unwrap();
        assert_eq!(back, c);
        let a: PositionalEncoding = serde_json::from_str(r#"{"kind":"ape"}"#).unwrap();
        assert_eq!(a, PositionalEncoding::Ape);
    }

    #[test]
    fn local_position_defaults_to_shared_and_rope_is_checked() {
        // configs written before the field: the SPE-filtered queries and keys
        let mut c = ModelConfig::preset("small", 877).unwrap();
        c.local_heads = 2;
        c.local_window = 128;
        let mut v = serde_json::to_value(&c).unwrap();
        v.as_object_mut().unwrap().remove("local_position");
        let old: ModelConfig = serde_json::from_value(v.clone()).unwrap();
        assert_eq!(old.local_position, LocalPosition::Shared);
        v["local_position"] = serde_json::json!("rope");
        let rope: ModelConfig = serde_json::from_value(v).unwrap();
        assert_eq!(rope.local_position, LocalPosition::Rope);
        rope.validate().unwrap();
        // RoPE keys are whole heads; shared ones have SPE's R columns
        assert_eq!((rope.local_qk_dim(), old.local_qk_dim()), (64, 32));
        // an odd head dimension cannot be turned in pairs
        let mut odd = rope.clone();
        (odd.d_model, odd.n_heads) = (12, 4);
        assert!(odd.validate().unwrap_err().to_string().contains("even"));
        // without local heads the option means nothing, and is refused
        let mut none = rope;
        none.local_heads = 0;
        assert!(none.validate().is_err());
    }
}
