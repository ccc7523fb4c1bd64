//! Pre-LayerNorm decoder-only Transformer with FAVOR+ (or softmax) attention and SPE / APE.
//!
//! Variable paths (for weight-decay filters): `tok_embed.weight`, `layers.{i}.norm1.{weight,bias}`,
//! `layers.{i}.attn_qkv.{weight,bias}`, `layers.{i}.qkv_conv` (short convolution, (3d, k)),
//! `layers.{i}.attn_out.*`, `layers.{i}.norm2.*`,
//! `layers.{i}.ff1.*`, `layers.{i}.ff2.*`, `layers.{i}.spe_gate` (gated SPE), `final_norm.*`,
//! `head.*` (untied only), SPE code parameters under `spe.*` (shared) or `layers.{i}.spe.*`.
//!
//! Attention: FAVOR+ (or exact softmax) in every head; with `local_heads` > 0 the first
//! `local_heads` heads of every layer use exact softmax over the last `local_window` tokens
//! instead ([`window_attention`]), on the same SPE-filtered queries and keys
//! (`local_position = "shared"`) or on their own queries and keys turned by RoPE
//! (`"rope"`, [`rope`]; SPE then filters only the FAVOR+ heads).
//!
//! A generation step of a CPU f32 SineSPE FAVOR+ model (local heads, if any, with RoPE; no
//! short convolution) runs wholly on the host ([`Transformer::host_step`]): its dense layers
//! with the kernels of [`crate::model::host`], its RoPE local heads with [`host_ring_step`]
//! and its FAVOR+ heads with [`host_favor_step`], the state updated in place. Other models
//! step through libtorch (RoPE local heads still on the host where their ring allows it).
//! Both paths give the same logits up to summation order, which the recurrence == parallel
//! tests check for every variant.
//!
//! Noise policy:
//! * `forward_t(train = true)`: fresh SPE noise (Z or conv noise, and every layer's gate xi)
//!   from torch's global RNG at each call, shared across the batch; every layer's FAVOR+
//!   projection is redrawn (torch RNG) with probability `redraw_prob` at each call.
//! * `forward_t(train = false)`, `prefill`, `step`: the frozen noise and features set by
//!   [`Transformer::freeze`]. A new model is already frozen with [`DEFAULT_SEED`], so evaluation
//!   never runs on undefined noise; call `freeze(seed)` to pick another realization. Frozen
//!   ConvSPE noise of position p is a pure function of (seed, code, p) (ChaCha8), so any window
//!   and the recurrence see the same codes, with no maximum length.

// `a = a + b` is deliberate: tch's `+=` is an in-place add, which would write into
// tensors that autograd or a caller still holds.
#![allow(clippy::assign_op_pattern)]

use std::sync::{Arc, Mutex};

use anyhow::{Context, Result};
use tch::{nn, nn::Module, Device, Kind, Tensor};

use crate::model::config::{
    AttentionKind, LocalPosition, ModelConfig, PositionalEncoding, ROPE_BASE,
};
use crate::model::favor::{
    causal_linear_attention, host_recurrent_step, recurrent_step, FavorFeatures, HostFeatures,
};
use crate::model::ffi::unit_last_stride;
use crate::model::host::{self, HostLinear, HostNorm};
use crate::model::noise;
use crate::model::spe::{
    draw_xi, frozen_xi, host_filter, sine_filter, sine_filter_applies, spe_filter_with, ConvSpe,
    GateFactors, HostSine, SineFactors, SineSpe, SpeCode,
};
use crate::model::{as_kind, cpu_f32, host_f32};

/// Seed of the noise/features a freshly built model is frozen with.
pub const DEFAULT_SEED: u64 = 0;

/// The epsilon of every layer norm of the model (libtorch's default).
const NORM_EPS: f64 = 1e-5;

#[derive(Debug)]
struct Block {
    norm1: nn::LayerNorm,
    qkv: nn::Linear,
    out: nn::Linear,
    norm2: nn::LayerNorm,
    ff1: nn::Linear,
    ff2: nn::Linear,
    /// (H, D) gate logits of the gated SPE filter.
    gate: Option<Tensor>,
    /// (3d, k) taps of the short causal convolution over the projected q, k, v
    /// (`ModelConfig::short_conv`); tap k-1 weighs the current token.
    conv: Option<Tensor>,
}

#[derive(Debug)]
struct Frozen {
    seed: u64,
    /// Per code: SineSPE noise Z (None for ConvSPE codes, whose noise is generated per position).
    z: Vec<Option<Tensor>>,
    /// Per layer gate noise xi (gated SPE only).
    xi: Vec<Tensor>,
    /// Per layer FAVOR+ projections (FAVOR only).
    features: Vec<FavorFeatures>,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    Train,
    Eval,
    Step,
}

/// Per-layer recurrent memory.
#[derive(Debug)]
pub enum LayerState {
    /// FAVOR+: S = sum phi(k) v^T (B, H, M, Dv), z = sum phi(k) (B, H, M), f32.
    Favor { s: Tensor, z: Tensor },
    /// Softmax reference: growing KV cache (B, H, T, dk) and (B, H, T, Dv).
    Softmax { k: Tensor, v: Tensor },
}

impl LayerState {
    fn map(&self, f: impl Fn(&Tensor) -> Tensor) -> LayerState {
        match self {
            LayerState::Favor { s, z } => LayerState::Favor { s: f(s), z: f(z) },
            LayerState::Softmax { k, v } => LayerState::Softmax { k: f(k), v: f(v) },
        }
    }
}

/// Decoding state: everything needed to continue a batch of sequences at `position`.
/// With FAVOR+ its size is constant (per layer and head S (M x Dv) and z (M), f32, plus one
/// ring buffer of the last k noise columns per ConvSPE code, shared by the batch). A state
/// whose steps run on the host ([`Transformer::host_step`]) also shares, with its copies,
/// one host copy of the weights, made by `begin`.
#[derive(Debug)]
pub struct RecurrentState {
    /// Absolute position of the next token.
    pub position: i64,
    pub layers: Vec<LayerState>,
    /// Per layer with a short convolution: the last k-1 projected q, k, v rows
    /// (B, k-1, 3d), zeros before the first token.
    pub conv_tails: Vec<Option<Tensor>>,
    /// Per layer with local heads: their keys and values of the last positions, in a ring
    /// of `local_window` slots ([`KvRing`]).
    pub windows: Vec<Option<KvRing>>,
    /// Per ConvSPE code: (k, H, D, R); slot p mod k holds the noise column of position p.
    pub rings: Vec<Tensor>,
    /// The frozen seed the state was built with (rings depend on it).
    pub seed: u64,
    pub batch: i64,
    /// What every step needs and no step changes, computed from the weights
    /// by [`Transformer::begin_at`]: a state belongs to the weights it was
    /// begun with.
    cache: StepCache,
}

/// One SPE code over a call's window of positions, as the filters take it.
enum WindowCode {
    /// Stored codes (qbar, kbar), each (L, H, D, R).
    Stored(Tensor, Tensor),
    /// SineSPE codes formed inside the fused filter ([`sine_filter`]): the factors, and
    /// the cosines and sines of the queries' and keys' phases, each (L, H, D, 2K).
    Sine {
        factors: SineFactors,
        omega_q: Tensor,
        omega_k: Tensor,
        start: i64,
    },
}

impl WindowCode {
    /// The filtered queries and keys, (B, H, L, R) each, of (B, L, H, D) q and k.
    fn filter(&self, q: &Tensor, k: &Tensor, gate: Option<&GateFactors>) -> (Tensor, Tensor) {
        match self {
            WindowCode::Stored(qbar, kbar) => (
                spe_filter_with(q, qbar, gate),
                spe_filter_with(k, kbar, gate),
            ),
            WindowCode::Sine {
                factors,
                omega_q,
                omega_k,
                start,
            } => (
                sine_filter(q, omega_q, factors, gate, true, *start),
                sine_filter(k, omega_k, factors, gate, false, *start),
            ),
        }
    }
}

/// The position-independent factors of a step (see [`RecurrentState::cache`]).
#[derive(Debug)]
struct StepCache {
    /// Per SPE code: the SineSPE factors of the frozen noise (None for ConvSPE).
    sine: Vec<Option<SineFactors>>,
    /// Per layer: the gate of the gated SPE filter with the frozen xi.
    gates: Vec<Option<GateFactors>>,
    /// Host copies for [`Transformer::host_step`], where the model allows it
    /// ([`Transformer::host_favor`]).
    host: Option<Arc<HostStep>>,
}

/// What [`Transformer::host_step`] reads: host copies of the weights and of the frozen
/// factors of the FAVOR+ heads.
#[derive(Debug)]
struct HostStep {
    favor: HostFavor,
    /// (V, d) token embeddings; None with a tied head, whose weight they are.
    embed: Option<Vec<f32>>,
    /// sqrt(d) with scaled embeddings.
    embed_scale: Option<f32>,
    layers: Vec<HostLayer>,
    final_norm: HostNorm,
    /// The output head (the embeddings when tied).
    head: HostLinear,
    /// d^-1/2 for the legacy scaled tied head.
    head_scale: Option<f32>,
}

/// One block's weights on the host.
#[derive(Debug)]
struct HostLayer {
    norm1: HostNorm,
    qkv: HostLinear,
    out: HostLinear,
    norm2: HostNorm,
    ff1: HostLinear,
    ff2: HostLinear,
}

/// What [`host_favor_step`] reads, as host copies of the frozen factors of the FAVOR+ heads.
struct HostFavor {
    /// Per SineSPE code (one when shared).
    codes: Vec<HostSine>,
    /// Per layer, with a gated filter: a (H', D) and xi_b (H', D, R).
    gates: Vec<Option<(Vec<f32>, Vec<f32>)>>,
    /// Per layer: the frozen FAVOR+ projection.
    features: Vec<HostFeatures>,
}

impl StepCache {
    fn share(&self) -> StepCache {
        StepCache {
            sine: self
                .sine
                .iter()
                .map(|f| f.as_ref().map(SineFactors::share))
                .collect(),
            gates: self
                .gates
                .iter()
                .map(|g| g.as_ref().map(GateFactors::share))
                .collect(),
            host: self.host.clone(),
        }
    }
}

impl RecurrentState {
    /// Deep copy.
    pub fn copy(&self) -> RecurrentState {
        RecurrentState {
            position: self.position,
            layers: self.layers.iter().map(|l| l.map(|t| t.copy())).collect(),
            conv_tails: self
                .conv_tails
                .iter()
                .map(|t| t.as_ref().map(Tensor::copy))
                .collect(),
            windows: self
                .windows
                .iter()
                .map(|w| w.as_ref().map(|r| r.map(Tensor::copy)))
                .collect(),
            rings: self.rings.iter().map(|t| t.copy()).collect(),
            seed: self.seed,
            batch: self.batch,
            cache: self.cache.share(),
        }
    }

    /// Keeps (or repeats) the batch rows in `indices` (int64 1-D tensor on any device).
    pub fn select(&self, indices: &Tensor) -> RecurrentState {
        let layers: Vec<LayerState> = self
            .layers
            .iter()
            .map(|l| l.map(|t| t.index_select(0, &indices.to_device(t.device()))))
            .collect();
        let conv_tails = self
            .conv_tails
            .iter()
            .map(|t| {
                t.as_ref()
                    .map(|t| t.index_select(0, &indices.to_device(t.device())))
            })
            .collect();
        let rows = |t: &Tensor| t.index_select(0, &indices.to_device(t.device()));
        let windows = self
            .windows
            .iter()
            .map(|w| w.as_ref().map(|r| r.map(rows)))
            .collect();
        RecurrentState {
            position: self.position,
            layers,
            conv_tails,
            windows,
            rings: self.rings.iter().map(|t| t.copy()).collect(),
            seed: self.seed,
            batch: indices.size()[0],
            cache: self.cache.share(),
        }
    }
}

/// The model. See the module docs for the noise policy.
#[derive(Debug)]
pub struct Transformer {
    cfg: ModelConfig,
    device: Device,
    embed: Tensor,
    blocks: Vec<Block>,
    final_norm: nn::LayerNorm,
    head: Option<nn::Linear>,
    codes: Vec<SpeCode>,
    train_features: Mutex<Vec<FavorFeatures>>,
    frozen: Frozen,
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

impl Transformer {
    pub fn new(vs: &nn::Path, cfg: &ModelConfig) -> Result<Transformer> {
        cfg.validate().context("invalid model config")?;
        let device = vs.device();
        let (d, h, hd) = (cfg.d_model, cfg.n_heads, cfg.head_dim());
        let embed = vs.sub("tok_embed").var(
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
        let lin = |p: nn::Path, i: i64, o: i64, std: f64| {
            nn::linear(
                p,
                i,
                o,
                nn::LinearConfig {
                    ws_init: nn::Init::Randn {
                        mean: 0.0,
                        stdev: std,
                    },
                    bs_init: Some(nn::Init::Const(0.0)),
                    bias: true,
                },
            )
        };
        let out_std = 0.02 / ((2 * cfg.n_layers) as f64).sqrt();
        let (gated, shared) = match &cfg.positional {
            PositionalEncoding::SpeSine { gated, shared, .. }
            | PositionalEncoding::SpeConv { gated, shared, .. } => (*gated, *shared),
            _ => (false, true),
        };
        let mut blocks = Vec::new();
        let mut codes = Vec::new();
        let make_code = |p: nn::Path| -> SpeCode {
            match &cfg.positional {
                PositionalEncoding::SpeSine {
                    sines,
                    realizations,
                    freq_init,
                    ..
                } => SpeCode::Sine(SineSpe::new(&p, h, hd, *sines, *realizations, *freq_init)),
                PositionalEncoding::SpeConv {
                    kernel,
                    realizations,
                    ..
                } => SpeCode::Conv(ConvSpe::new(&p, h, hd, *kernel, *realizations)),
                _ => unreachable!(),
            }
        };
        if cfg.positional.is_spe() && shared {
            codes.push(make_code(vs.sub("spe")));
        }
        let ln = || nn::LayerNormConfig {
            eps: NORM_EPS,
            ..Default::default()
        };
        for i in 0..cfg.n_layers {
            let p = vs.sub("layers").sub(i);
            let gate = (cfg.positional.is_spe() && gated).then(|| {
                p.var(
                    "spe_gate",
                    &[h, hd],
                    nn::Init::Randn {
                        mean: 0.0,
                        stdev: 1.0,
                    },
                )
            });
            if cfg.positional.is_spe() && !shared {
                codes.push(make_code(p.sub("spe")));
            }
            let conv = (cfg.short_conv > 0).then(|| {
                // identity at initialization: the current token's tap is 1, the others 0
                let w = p.var("qkv_conv", &[3 * d, cfg.short_conv], nn::Init::Const(0.0));
                tch::no_grad(|| {
                    let _ = w.narrow(1, cfg.short_conv - 1, 1).fill_(1.0);
                });
                w
            });
            blocks.push(Block {
                norm1: nn::layer_norm(p.sub("norm1"), vec![d], ln()),
                qkv: lin(p.sub("attn_qkv"), d, 3 * d, 0.02),
                out: lin(p.sub("attn_out"), d, d, out_std),
                norm2: nn::layer_norm(p.sub("norm2"), vec![d], ln()),
                ff1: lin(p.sub("ff1"), d, cfg.d_ff, 0.02),
                ff2: lin(p.sub("ff2"), cfg.d_ff, d, out_std),
                gate,
                conv,
            });
        }
        let final_norm = nn::layer_norm(vs.sub("final_norm"), vec![d], ln());
        let head = (!cfg.tie_embeddings).then(|| lin(vs.sub("head"), d, cfg.vocab_size, 0.02));
        let train_features = match &cfg.attention {
            AttentionKind::Favor {
                features,
                antithetic,
                ..
            } => (0..cfg.n_layers)
                .map(|_| FavorFeatures::draw(*features, cfg.qk_dim(), *antithetic, device))
                .collect(),
            AttentionKind::Softmax => Vec::new(),
        };
        let mut model = Transformer {
            cfg: cfg.clone(),
            device,
            embed,
            blocks,
            final_norm,
            head,
            codes,
            train_features: Mutex::new(train_features),
            frozen: Frozen {
                seed: DEFAULT_SEED,
                z: vec![],
                xi: vec![],
                features: vec![],
            },
        };
        model.freeze(DEFAULT_SEED);
        Ok(model)
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    pub fn device(&self) -> Device {
        self.device
    }

    /// The FAVOR+ projections training uses between redraws, one per layer.
    /// They belong to a resumable run's state: a resumed run must continue
    /// with the projections the interrupted one had.
    pub fn training_projections(&self) -> Vec<Tensor> {
        self.train_features
            .lock()
            .expect("feature lock")
            .iter()
            .map(|f| f.proj.copy())
            .collect()
    }

    /// Restores projections saved by [`Transformer::training_projections`].
    pub fn set_training_projections(&self, projections: &[Tensor]) -> Result<()> {
        let mut feats = self.train_features.lock().expect("feature lock");
        anyhow::ensure!(
            projections.len() == feats.len(),
            "{} saved FAVOR+ projections for a model with {} layers",
            projections.len(),
            feats.len()
        );
        for (f, p) in feats.iter_mut().zip(projections) {
            anyhow::ensure!(
                p.size() == f.proj.size(),
                "saved FAVOR+ projection of shape {:?}, the model's is {:?}",
                p.size(),
                f.proj.size()
            );
            f.proj = p.to_kind(f.proj.kind()).to_device(self.device);
        }
        Ok(())
    }

    /// Seed of the current frozen noise and features.
    pub fn frozen_seed(&self) -> u64 {
        self.frozen.seed
    }

    /// Changes the chunk length of the chunked linear attention (results change only by f32 rounding).
    pub fn set_chunk_size(&mut self, chunk: i64) {
        assert!(chunk > 0, "chunk size must be positive");
        self.cfg.chunk_size = chunk;
    }

    fn param_kind(&self) -> Kind {
        self.embed.kind()
    }

    /// Freezes SPE noise (Z), gate noise (xi) and FAVOR+ features deterministically from `seed`
    /// (ConvSPE noise is a function of (seed, position) and needs no storage).
    /// Existing `RecurrentState`s are tied to the previous seed and must be recreated.
    pub fn freeze(&mut self, seed: u64) {
        let (h, hd) = (self.cfg.n_heads, self.cfg.head_dim());
        let z = self
            .codes
            .iter()
            .enumerate()
            .map(|(c, code)| match code {
                SpeCode::Sine(s) => Some(s.frozen_z(seed, c as u64)),
                SpeCode::Conv(_) => None,
            })
            .collect();
        let xi = match self.cfg.positional.realizations() {
            Some(r) if self.blocks.iter().any(|b| b.gate.is_some()) => (0..self.cfg.n_layers)
                .map(|i| {
                    frozen_xi(seed, i as u64, h, hd, r, self.device).to_kind(self.param_kind())
                })
                .collect(),
            _ => Vec::new(),
        };
        let features = match &self.cfg.attention {
            AttentionKind::Favor {
                features,
                antithetic,
                ..
            } => (0..self.cfg.n_layers)
                .map(|i| {
                    FavorFeatures::seeded(
                        seed,
                        i as u64,
                        *features,
                        self.cfg.qk_dim(),
                        *antithetic,
                        self.device,
                    )
                })
                .collect(),
            AttentionKind::Softmax => Vec::new(),
        };
        self.frozen = Frozen {
            seed,
            z,
            xi,
            features,
        };
    }

    /// (B, L) int64 tokens at absolute positions offset..offset+L -> (B, L, V) logits.
    pub fn forward_t(&self, tokens: &Tensor, offset: i64, train: bool) -> Tensor {
        let mode = if train { Mode::Train } else { Mode::Eval };
        self.run(tokens, offset, mode, None)
    }

    /// Zero state at position 0 on the model's device (frozen noise of the current seed).
    pub fn begin(&self, batch: i64) -> RecurrentState {
        self.begin_at(batch, 0)
    }

    /// Zero state (empty past) whose next token is at absolute `position`: continuing from it
    /// reproduces `forward_t(tokens, position, false)`.
    pub fn begin_at(&self, batch: i64, position: i64) -> RecurrentState {
        let (h, hd) = (self.cfg.n_heads, self.cfg.head_dim());
        let dk = self.cfg.qk_dim();
        let f = (Kind::Float, self.device);
        let hf = h - self.cfg.local_heads;
        let layers = (0..self.cfg.n_layers)
            .map(|_| match &self.cfg.attention {
                AttentionKind::Favor { features, .. } => LayerState::Favor {
                    s: Tensor::zeros([batch, hf, *features, hd], f),
                    z: Tensor::zeros([batch, hf, *features], f),
                },
                AttentionKind::Softmax => LayerState::Softmax {
                    k: Tensor::zeros([batch, h, 0, dk], f),
                    v: Tensor::zeros([batch, h, 0, hd], f),
                },
            })
            .collect();
        let conv_tails = self
            .blocks
            .iter()
            .map(|b| {
                b.conv.as_ref().map(|w| {
                    let (c, k) = w.size2().expect("(3d, k) taps");
                    Tensor::zeros([batch, k - 1, c], (self.param_kind(), self.device))
                })
            })
            .collect();
        let hl = self.cfg.local_heads;
        let dl = self.cfg.local_qk_dim();
        let windows = (0..self.cfg.n_layers)
            .map(|_| (hl > 0).then(|| KvRing::new(batch, hl, self.cfg.local_window, dl, hd, f)))
            .collect();
        let seed = self.frozen.seed;
        let rings = self
            .codes
            .iter()
            .enumerate()
            .filter_map(|(c, code)| match code {
                SpeCode::Conv(conv) => {
                    let k = conv.kernel;
                    let mut shape = vec![k];
                    shape.extend_from_slice(&conv.column_shape());
                    let mut ring =
                        Tensor::zeros(shape.as_slice(), (self.param_kind(), self.device));
                    // positions position-k+1 ..= position-1
                    let cols = noise::conv_noise_columns(
                        seed,
                        c as u64,
                        position - k + 1,
                        k - 1,
                        &conv.column_shape(),
                        self.device,
                        self.param_kind(),
                    );
                    fill_ring(&mut ring, position - k + 1, &cols);
                    Some(ring)
                }
                SpeCode::Sine(_) => None,
            })
            .collect();
        RecurrentState {
            position,
            layers,
            conv_tails,
            windows,
            rings,
            seed,
            batch,
            cache: tch::no_grad(|| self.step_cache()),
        }
    }

    /// The [`StepCache`] of the current weights and frozen noise.
    fn step_cache(&self) -> StepCache {
        let sine: Vec<Option<SineFactors>> = self
            .codes
            .iter()
            .enumerate()
            .map(|(c, code)| match code {
                SpeCode::Sine(s) => {
                    let (h0, n) = self.spe_heads();
                    Some(
                        s.factors(self.frozen.z[c].as_ref().expect("frozen Z"))
                            .heads(h0, n),
                    )
                }
                SpeCode::Conv(_) => None,
            })
            .collect();
        let gates: Vec<Option<GateFactors>> = self
            .blocks
            .iter()
            .enumerate()
            .map(|(i, b)| {
                b.gate
                    .as_ref()
                    .map(|g| GateFactors::new(g, &self.frozen.xi[i]))
            })
            .collect();
        let host = self.host_favor(&sine, &gates).map(|favor| {
            let cfg = &self.cfg;
            let d = cfg.d_model as f64;
            Arc::new(HostStep {
                favor,
                embed: self.head.is_some().then(|| host_f32(&self.embed)),
                embed_scale: cfg.scaled_embeddings.then(|| d.sqrt() as f32),
                layers: self
                    .blocks
                    .iter()
                    .map(|b| HostLayer {
                        norm1: HostNorm::of(&b.norm1, NORM_EPS),
                        qkv: HostLinear::of(&b.qkv),
                        out: HostLinear::of(&b.out),
                        norm2: HostNorm::of(&b.norm2, NORM_EPS),
                        ff1: HostLinear::of(&b.ff1),
                        ff2: HostLinear::of(&b.ff2),
                    })
                    .collect(),
                final_norm: HostNorm::of(&self.final_norm, NORM_EPS),
                head: match &self.head {
                    Some(h) => HostLinear::of(h),
                    None => HostLinear::new(&self.embed, None),
                },
                head_scale: (self.head.is_none() && cfg.scaled_embeddings)
                    .then(|| d.powf(-0.5) as f32),
            })
        });
        StepCache { sine, gates, host }
    }

    /// The host copies of [`host_favor_step`], for a model whose whole step
    /// [`Transformer::host_step`] can take: FAVOR+ heads filtered by SineSPE codes, f32 on
    /// the CPU, local heads (if any) with RoPE, which [`host_ring_step`] runs on the host
    /// too, and no short convolution.
    fn host_favor(
        &self,
        sine: &[Option<SineFactors>],
        gates: &[Option<GateFactors>],
    ) -> Option<HostFavor> {
        let cfg = &self.cfg;
        let hl = cfg.local_heads;
        let ok = self.device == Device::Cpu
            && self.param_kind() == Kind::Float
            && matches!(cfg.attention, AttentionKind::Favor { .. })
            && matches!(cfg.positional, PositionalEncoding::SpeSine { .. })
            && hl < cfg.n_heads
            && (hl == 0 || cfg.local_position == LocalPosition::Rope)
            && cfg.short_conv == 0;
        if !ok {
            return None;
        }
        let (h0, n) = self.spe_heads();
        Some(HostFavor {
            codes: sine
                .iter()
                .map(|f| f.as_ref().map(SineFactors::host))
                .collect::<Option<_>>()?,
            gates: gates
                .iter()
                .map(|g| g.as_ref().map(|g| g.heads(h0, n).host()))
                .collect(),
            features: self
                .frozen
                .features
                .iter()
                .map(FavorFeatures::host)
                .collect(),
        })
    }

    fn check_state(&self, state: &RecurrentState, batch: i64) {
        assert_eq!(
            state.seed, self.frozen.seed,
            "RecurrentState was built with frozen seed {} but the model is frozen with {}; call begin() again",
            state.seed, self.frozen.seed
        );
        assert_eq!(
            state.batch, batch,
            "RecurrentState batch size {} but tokens have batch {}",
            state.batch, batch
        );
    }

    /// Runs a (B, L) chunk from `state.position` (parallel form, frozen noise), returns
    /// (B, L, V) logits and advances the state. No autograd graph is recorded.
    pub fn prefill(&self, tokens: &Tensor, state: &mut RecurrentState) -> Tensor {
        self.check_state(state, tokens.size()[0]);
        tch::no_grad(|| self.run(tokens, state.position, Mode::Eval, Some(state)))
    }

    /// One token per sequence (B,) -> (B, V) logits; constant time and memory per token with
    /// FAVOR+ (the softmax reference uses a growing KV cache instead: linear in the position).
    /// The state's tensors may be updated in place (a CPU f32 step does so): keep a
    /// [`RecurrentState::copy`] to come back to a position, not a shallow clone of its tensors.
    pub fn step(&self, tokens: &Tensor, state: &mut RecurrentState) -> Tensor {
        let b = tokens.size()[0];
        self.check_state(state, b);
        assert_eq!(tokens.dim(), 1, "step takes one token per sequence, (B,)");
        if let Some(hs) = state.cache.host.clone() {
            if self.device == Device::Cpu
                && self.param_kind() == Kind::Float
                && state.windows.iter().flatten().all(host_step_ok)
            {
                let ids = Vec::<i64>::try_from(&tokens.to_device(Device::Cpu).view([-1]))
                    .expect("int64 token ids");
                return self.host_step(&ids, state, &hs);
            }
        }
        tch::no_grad(|| {
            self.run(
                &tokens.view([b, 1]),
                state.position,
                Mode::Step,
                Some(state),
            )
        })
        .squeeze_dim(1)
    }

    /// [`Transformer::step`] done wholly on the host (`ids`: one token per sequence), for a
    /// CPU f32 SineSPE FAVOR+ model ([`Transformer::host_favor`]): the projections, norms
    /// and feed-forward layers with the kernels of [`host`], the local heads with
    /// [`host_ring_step`] and the FAVOR+ heads with [`host_favor_step`], the state
    /// updated in place. The same math as [`Transformer::run`]'s step, summed in another
    /// order; at batch 1 it costs about the reading of the weights, where the libtorch
    /// step paid as much again in calls.
    fn host_step(&self, ids: &[i64], state: &mut RecurrentState, hs: &HostStep) -> Tensor {
        let cfg = &self.cfg;
        let b = ids.len();
        let (d, h, hd, hl) = (
            cfg.d_model as usize,
            cfg.n_heads as usize,
            cfg.head_dim() as usize,
            cfg.local_heads as usize,
        );
        let vocab = cfg.vocab_size as usize;
        let offset = state.position;
        let mut x = Vec::with_capacity(b * d);
        for &t in ids {
            assert!(
                (0..vocab as i64).contains(&t),
                "token id {t} outside the vocabulary of {vocab}"
            );
            x.extend_from_slice(match &hs.embed {
                Some(e) => &e[t as usize * d..][..d],
                None => hs.head.row(t as usize),
            });
        }
        if let Some(sc) = hs.embed_scale {
            x.iter_mut().for_each(|v| *v *= sc);
        }
        // this position's codes, per SineSPE code (one when shared)
        let codes: Vec<(Vec<f32>, Vec<f32>)> = hs
            .favor
            .codes
            .iter()
            .map(|c| (c.code_at(offset, true), c.code_at(offset, false)))
            .collect();
        let add = |x: &mut [f32], y: &[f32]| x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
        for (i, layer) in hs.layers.iter().enumerate() {
            let qkv = layer.qkv.apply(&layer.norm1.apply(&x), b);
            // (B, H, D): the local heads, then the FAVOR+ ones
            let mut att = vec![0f32; b * d];
            if hl > 0 {
                let ring = state.windows[i]
                    .as_mut()
                    .expect("a state begun by this model has a window per layer");
                let local = host_ring_step(&qkv, b, hl, d, hd, offset, ring);
                for (a, l) in att.chunks_exact_mut(d).zip(local.chunks_exact(hl * hd)) {
                    a[..hl * hd].copy_from_slice(l);
                }
            }
            let LayerState::Favor { s, z } = &mut state.layers[i] else {
                unreachable!("a host step is for FAVOR+ models")
            };
            let code = &codes[if codes.len() == 1 { 0 } else { i }];
            let favor = host_favor_step(&qkv, b, hl, h, hd, &hs.favor, i, code, s, z);
            for (a, f) in att
                .chunks_exact_mut(d)
                .zip(favor.chunks_exact((h - hl) * hd))
            {
                a[hl * hd..].copy_from_slice(f);
            }
            add(&mut x, &layer.out.apply(&att, b));
            let mut ff = layer.ff1.apply(&layer.norm2.apply(&x), b);
            host::gelu(&mut ff);
            add(&mut x, &layer.ff2.apply(&ff, b));
        }
        let mut logits = hs.head.apply(&hs.final_norm.apply(&x), b);
        if let Some(sc) = hs.head_scale {
            logits.iter_mut().for_each(|v| *v *= sc);
        }
        state.position = offset + 1;
        Tensor::from_slice(&logits).view([b as i64, vocab as i64])
    }

    /// The codes of every SPE code over positions offset..offset+L: stored (qbar, kbar),
    /// each (L, H, D, R), or, for SineSPE outside a generation step where the fused
    /// filter applies, what forms them inside it.
    fn window_codes(
        &self,
        offset: i64,
        len: i64,
        mode: Mode,
        state: &mut Option<&mut RecurrentState>,
    ) -> Vec<WindowCode> {
        let seed = self.frozen.seed;
        let (h0, n) = self.spe_heads();
        let mut ring_idx = 0;
        let mut out = Vec::with_capacity(self.codes.len());
        // SineSPE's codes formed inside the fused filter, outside a generation step
        let form_inside = mode != Mode::Step
            && sine_filter_applies(
                self.device,
                self.param_kind(),
                self.cfg.positional.realizations().unwrap_or(0),
            );
        for (c, code) in self.codes.iter().enumerate() {
            let pair = match code {
                SpeCode::Sine(s) => {
                    let factors = match mode {
                        Mode::Train => s.factors(&s.draw_z()).heads(h0, n),
                        Mode::Step => {
                            let st = state.as_deref().expect("step needs a state");
                            st.cache.sine[c]
                                .as_ref()
                                .expect("SineSPE step factors")
                                .share()
                        }
                        Mode::Eval => s
                            .factors(self.frozen.z[c].as_ref().expect("frozen Z"))
                            .heads(h0, n),
                    };
                    if form_inside {
                        let (omega_q, omega_k) = tch::no_grad(|| s.omegas(&factors, offset, len));
                        out.push(WindowCode::Sine {
                            factors,
                            omega_q,
                            omega_k,
                            start: offset,
                        });
                        continue;
                    }
                    s.codes_from(&factors, offset, len)
                }
                SpeCode::Conv(conv) => {
                    let k = conv.kernel;
                    match mode {
                        Mode::Train => conv.codes_from_noise(&conv.draw_noise(len)),
                        Mode::Eval => {
                            let nz = conv.frozen_noise(seed, c as u64, offset, len);
                            if let Some(st) = state.as_deref_mut() {
                                if k > 1 {
                                    let cols = nz.narrow(0, len, k - 1);
                                    fill_ring(&mut st.rings[ring_idx], offset + len - k + 1, &cols);
                                }
                            }
                            conv.codes_from_noise(&nz)
                        }
                        Mode::Step => {
                            let st = state.as_deref_mut().expect("step needs a state");
                            let col = noise::conv_noise_columns(
                                seed,
                                c as u64,
                                offset,
                                1,
                                &conv.column_shape(),
                                self.device,
                                self.param_kind(),
                            );
                            fill_ring(&mut st.rings[ring_idx], offset, &col);
                            conv.codes_from_ring(&st.rings[ring_idx], offset)
                        }
                    }
                }
            };
            let pair = match code {
                SpeCode::Conv(_) => {
                    ring_idx += 1;
                    (pair.0.narrow(1, h0, n), pair.1.narrow(1, h0, n))
                }
                SpeCode::Sine(_) => pair,
            };
            out.push(WindowCode::Stored(pair.0, pair.1));
        }
        out
    }

    /// The heads SPE filters, (first, count): with RoPE local heads only the FAVOR+ ones
    /// after them, every head otherwise (local heads then take theirs from the filtered
    /// queries and keys).
    fn spe_heads(&self) -> (i64, i64) {
        let cfg = &self.cfg;
        let h0 = if cfg.local_heads > 0 && cfg.local_position == LocalPosition::Rope {
            cfg.local_heads
        } else {
            0
        };
        (h0, cfg.n_heads - h0)
    }

    fn run(
        &self,
        tokens: &Tensor,
        offset: i64,
        mode: Mode,
        mut state: Option<&mut RecurrentState>,
    ) -> Tensor {
        let cfg = &self.cfg;
        let (b, l) = tokens.size2().expect("tokens must be (B, L)");
        let (d, h, hd) = (cfg.d_model, cfg.n_heads, cfg.head_dim());
        let train = mode == Mode::Train;
        let p = cfg.dropout;
        let kind = self.param_kind();
        if l == 0 {
            return Tensor::zeros([b, 0, cfg.vocab_size], (Kind::Float, self.device));
        }

        let mut x = Tensor::embedding(
            &self.embed,
            &tokens.to_device(self.device),
            -1,
            false,
            false,
        );
        if cfg.scaled_embeddings {
            x = x * (d as f64).sqrt();
        }
        if cfg.positional == PositionalEncoding::Ape {
            // Sines have RMS 2^-1/2; unscaled embeddings start with std 0.02, so the
            // code is brought to the same scale or it would drown the token.
            let ape = sinusoidal_ape(offset, l, d, self.device).to_kind(kind);
            x = if cfg.scaled_embeddings {
                x + ape
            } else {
                x + ape * (0.02 * std::f64::consts::SQRT_2)
            };
        }
        x = dropout(x, p, train);

        let (h0, _) = self.spe_heads();
        let rope = h0 > 0;
        // (a CPU f32 step of a SineSPE FAVOR+ model goes to host_step instead; the RoPE
        // local heads of a CPU f32 step of other models still run on the host here,
        // host_ring_step)
        let ring_on_host =
            rope && mode == Mode::Step && self.device == Device::Cpu && kind == Kind::Float;
        let codes = self.window_codes(offset, l, mode, &mut state);
        let shared = self.codes.len() == 1;
        let r = cfg.positional.realizations();

        // FAVOR+ features for this call
        let mut train_guard = None;
        if let (
            Mode::Train,
            AttentionKind::Favor {
                features,
                antithetic,
                redraw_prob,
            },
        ) = (mode, &cfg.attention)
        {
            let mut g = self.train_features.lock().unwrap();
            // one coin per training call: all layers' projections are redrawn together
            if *redraw_prob > 0.0
                && Tensor::rand([1], (Kind::Double, Device::Cpu)).double_value(&[0]) < *redraw_prob
            {
                for f in g.iter_mut() {
                    *f = FavorFeatures::draw(*features, cfg.qk_dim(), *antithetic, self.device);
                }
            }
            train_guard = Some(g);
        }

        // RoPE local heads (heads 0..h0, the ones SPE does not filter): a CPU generation
        // step runs them on the host (host_ring_step); otherwise the angles of this call's
        // positions, shared by every layer, are formed once, when a layer first needs them.
        let mut rope_tabs: Option<(Tensor, Tensor)> = None;

        for (i, blk) in self.blocks.iter().enumerate() {
            let hn = x.apply(&blk.norm1);
            let mut qkv = hn.apply(&blk.qkv);
            if let Some(w) = &blk.conv {
                let tail = state.as_deref_mut().map(|s| {
                    s.conv_tails[i]
                        .as_mut()
                        .expect("a state begun by this model has a tail per conv layer")
                });
                qkv = short_conv(&qkv, w, tail);
            }
            // (split, not narrow: the backward of a split is one concatenation, that of
            // each narrow a zero-filled gradient of the whole of qkv, then their sum)
            let [q, k, v] = <[Tensor; 3]>::try_from(qkv.split(d, -1)).expect("3 parts of d");
            let q = q.view([b, l, h, hd]);
            let k = k.view([b, l, h, hd]);
            let v = v.view([b, l, h, hd]).permute([0, 2, 1, 3]);
            let hl = cfg.local_heads;
            let on_host = ring_on_host
                && state
                    .as_deref()
                    .and_then(|s| s.windows[i].as_ref())
                    .is_some_and(host_step_ok);
            // the layer's projections on the host, for the host steps
            let rows = on_host.then(|| host_f32(&qkv));
            let host_local = |ring: &mut KvRing| {
                let rows = rows.as_deref().expect("on_host: rows taken above");
                let out = host_ring_step(
                    rows,
                    b as usize,
                    hl as usize,
                    d as usize,
                    hd as usize,
                    offset,
                    ring,
                );
                Tensor::from_slice(&out).view([b, hl, 1, hd])
            };
            let att = {
                // RoPE local heads take their own queries and keys; SPE filters heads h0..h:
                // only the FAVOR+ heads then, every head otherwise (the local ones taken from
                // it below).
                let (q, k, rope_qk) = if rope {
                    // (h0 = hl: the RoPE heads are the local ones)
                    let ((lq, q), (lk, k)) = (split_heads(&q, 2, h0), split_heads(&k, 2, h0));
                    let qk = (!on_host).then(|| {
                        let t = rope_tabs
                            .get_or_insert_with(|| rope_tables(offset, l, hd, self.device));
                        let (lq, lk) = (lq.expect("h0 > 0"), lk.expect("h0 > 0"));
                        (
                            apply_rope(&lq.permute([0, 2, 1, 3]), t),
                            apply_rope(&lk.permute([0, 2, 1, 3]), t),
                        )
                    });
                    (q, k, qk)
                } else {
                    (q, k, None)
                };
                let (qa, ka) = if let Some(rr) = r {
                    let code = &codes[if shared { 0 } else { i }];
                    let gate = blk.gate.as_ref().map(|g| match mode {
                        Mode::Train => GateFactors::new(g, &draw_xi(h, hd, rr, kind, self.device)),
                        Mode::Step => state
                            .as_deref()
                            .and_then(|s| s.cache.gates[i].as_ref())
                            .expect("gate step factors")
                            .share(),
                        Mode::Eval => GateFactors::new(g, &self.frozen.xi[i]),
                    });
                    let gate = gate.map(|g| g.heads(h0, h - h0));
                    // (the codes are those of heads h0..h already: see window_codes)
                    code.filter(&q, &k, gate.as_ref())
                } else {
                    (q.permute([0, 2, 1, 3]), k.permute([0, 2, 1, 3]))
                };
                let dk = qa.size()[3];
                // the local heads first, over their window; FAVOR+ for the rest (heads
                // hl..h): qa and ka start at head h0, so they hold local heads only when
                // h0 = 0
                let (lv, v) = split_heads(&v, 1, hl);
                let ((lqa, qa), (lka, ka)) = if h0 == 0 {
                    (split_heads(&qa, 1, hl), split_heads(&ka, 1, hl))
                } else {
                    ((None, qa), (None, ka))
                };
                let local = (hl > 0).then(|| {
                    let ring = state.as_deref_mut().map(|s| {
                        s.windows[i]
                            .as_mut()
                            .expect("a state begun by this model has a window per layer")
                    });
                    if on_host {
                        return host_local(ring.expect("on_host: checked above"));
                    }
                    let (lq, lk) = match &rope_qk {
                        Some((lq, lk)) => (lq.shallow_clone(), lk.shallow_clone()),
                        None => (
                            lqa.expect("h0 = 0: qa holds the local heads"),
                            lka.expect("h0 = 0: ka holds the local heads"),
                        ),
                    };
                    let (lq, lk, lv) = (
                        as_kind(&lq, Kind::Float),
                        as_kind(&lk, Kind::Float),
                        as_kind(&lv.expect("hl > 0"), Kind::Float),
                    );
                    let out = match ring {
                        Some(ring) => ring_attention(&lq, &lk, &lv, ring),
                        None => window_attention(&lq, &lk, &lv, cfg.local_window, None),
                    };
                    as_kind(&out, kind)
                });
                let lstate = state.as_deref_mut().map(|s| &mut s.layers[i]);
                let att = match &cfg.attention {
                    AttentionKind::Favor { .. } if hl == h => {
                        local.expect("local heads").permute([0, 2, 1, 3])
                    }
                    AttentionKind::Favor { .. } => {
                        let feats = match &train_guard {
                            Some(g) => &g[i],
                            None => &self.frozen.features[i],
                        };
                        let sc = (dk as f64).powf(-0.25);
                        let pq = feats.scaled_features(&qa, sc, true);
                        let pk = feats.scaled_features(&ka, sc, false);
                        let vf = as_kind(&v, Kind::Float);
                        let out = match lstate {
                            Some(LayerState::Favor { s, z }) => {
                                if mode == Mode::Step {
                                    let (o, s2, z2) = recurrent_step(
                                        &pq.squeeze_dim(2),
                                        &pk.squeeze_dim(2),
                                        &vf.squeeze_dim(2),
                                        s,
                                        z,
                                    );
                                    *s = s2;
                                    *z = z2;
                                    o.unsqueeze(2)
                                } else {
                                    let (o, s2, z2) = causal_linear_attention(
                                        &pq,
                                        &pk,
                                        &vf,
                                        cfg.chunk_size,
                                        Some((s, z)),
                                    );
                                    *s = s2;
                                    *z = z2;
                                    o
                                }
                            }
                            Some(_) => unreachable!("state/attention mismatch"),
                            None => causal_linear_attention(&pq, &pk, &vf, cfg.chunk_size, None).0,
                        };
                        let out = as_kind(&out, kind).permute([0, 2, 1, 3]);
                        match local {
                            // (B, L, H, hd) in one copy, which the reshape below then
                            // views: a concatenation over heads would be a second one
                            Some(l) => Tensor::cat(&[&l.permute([0, 2, 1, 3]), &out], 2),
                            None => out,
                        }
                    }
                    // exact softmax over every earlier position: a window without bound
                    AttentionKind::Softmax => {
                        let cache = match lstate {
                            Some(LayerState::Softmax { k, v }) => Some((k, v)),
                            Some(_) => unreachable!("state/attention mismatch"),
                            None => None,
                        };
                        let out = window_attention(
                            &as_kind(&qa, Kind::Float),
                            &as_kind(&ka, Kind::Float),
                            &as_kind(&v, Kind::Float),
                            UNBOUNDED,
                            cache,
                        );
                        as_kind(&out, kind).permute([0, 2, 1, 3])
                    }
                };
                att
            };
            // att: (B, L, H, hd)
            let att = att.reshape([b, l, d]).apply(&blk.out);
            x = x + dropout(att, p, train);
            let ff = x
                .apply(&blk.norm2)
                .apply(&blk.ff1)
                .gelu("none")
                .apply(&blk.ff2);
            x = x + dropout(ff, p, train);
        }
        drop(train_guard);
        let x = x.apply(&self.final_norm);
        let logits = match &self.head {
            Some(hd) => hd.forward(&x),
            // Legacy scaled tied head: the input embedding enters scaled by sqrt(d), so
            // its row for the current token would give a logit of about sqrt(d) at
            // initialization; rescaling by d^-1/2 starts near ln(V).
            None if cfg.scaled_embeddings => {
                x.matmul(&self.embed.tr()) * (cfg.d_model as f64).powf(-0.5)
            }
            // GPT-2: logits = x E^T with E of std 0.02.
            None => x.matmul(&self.embed.tr()),
        };
        if let Some(st) = state {
            st.position = offset + l;
        }
        as_kind(&logits, Kind::Float)
    }
}

/// `t` cut along `dim` into its first `n` entries (`None` when `n` is 0) and the rest,
/// as views from one split: its backward is one concatenation, where that of two
/// `narrow`s would zero-fill a gradient of the whole of `t` for each and add them.
fn split_heads(t: &Tensor, dim: i64, n: i64) -> (Option<Tensor>, Tensor) {
    if n == 0 {
        return (None, t.shallow_clone());
    }
    let rest = t.size()[dim as usize] - n;
    let [first, rest] =
        <[Tensor; 2]>::try_from(t.split_with_sizes([n, rest], dim)).expect("two parts");
    (Some(first), rest)
}

/// Dropout with probability `p` while training; outside training (and at
/// p = 0) the tensor itself, without a libtorch call: a generation step is a
/// few hundred small calls, and each one costs about as much as its arithmetic.
fn dropout(x: Tensor, p: f64, train: bool) -> Tensor {
    if train && p > 0.0 {
        x.dropout(p, true)
    } else {
        x
    }
}

/// The window of full causal softmax attention: every earlier position.
pub(crate) const UNBOUNDED: i64 = i64::MAX;

/// Causal softmax attention of every query over the `window` most recent
/// positions, itself included: q (B, h, L, dk), k (B, h, L, dk), v (B, h, L, Dv)
/// -> (B, h, L, Dv). `cache` holds the keys and values of positions just
/// before the first query, oldest first (any number: those window or more
/// back are masked out), and is replaced by the last (at most window - 1)
/// positions, those the next call needs. Without a cache, a window that covers the
/// whole call is libtorch's fused causal attention, and a shorter one is
/// [`banded_attention`]; with one, queries go in blocks of `window`, each against
/// at most 2 window - 1 keys: O(L window) time and memory at any length.
/// With `window` = [`UNBOUNDED`] it is plain causal softmax attention, and the
/// cache keeps every position.
pub(crate) fn window_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    window: i64,
    cache: Option<(&mut Tensor, &mut Tensor)>,
) -> Tensor {
    let l = q.size()[2];
    let dk = q.size()[3];
    let Some((ck, cv)) = cache else {
        return if l <= window {
            // The window covers every earlier position: plain causal softmax, which libtorch
            // fuses (no (L, L) mask or separate softmax kept for the backward pass).
            Tensor::scaled_dot_product_attention::<Tensor>(q, k, v, None, 0.0, true, None, false)
        } else {
            banded_attention(q, k, v, window, BAND_BLOCK)
        };
    };
    let (kp, vp) = (Tensor::cat(&[&*ck, k], 2), Tensor::cat(&[&*cv, v], 2));
    let c = kp.size()[2] - l; // cached positions before the first query
    let dev = q.device();
    let mut outs = Vec::new();
    let mut s = 0;
    while s < l {
        let n = window.min(l - s);
        let k0 = (c + s - (window - 1)).max(0);
        let kn = c + s + n - k0;
        let scores = q
            .narrow(2, s, n)
            .matmul(&kp.narrow(2, k0, kn).transpose(-1, -2))
            / (dk as f64).sqrt();
        // One query (a generation step) sees every key of its slice: no mask.
        let scores = if n == 1 {
            scores
        } else {
            scores.masked_fill(
                &outside_band(c + s, n, k0, kn, window, dev),
                f64::NEG_INFINITY,
            )
        };
        outs.push(scores.softmax(-1, None).matmul(&vp.narrow(2, k0, kn)));
        s += n;
    }
    let total = kp.size()[2];
    if window > total {
        // everything stays: the concatenation is already a fresh tensor
        *ck = kp;
        *cv = vp;
    } else {
        let keep = window - 1;
        *ck = kp.narrow(2, total - keep, keep).copy();
        *cv = vp.narrow(2, total - keep, keep).copy();
    }
    if outs.len() == 1 {
        outs.pop().expect("one block")
    } else {
        Tensor::cat(&outs, 2)
    }
}

/// Queries per block of [`banded_attention`] (at most the window). A block of
/// `BAND_BLOCK` queries computes `BAND_BLOCK * ceil((window - 1) / BAND_BLOCK) + BAND_BLOCK`
/// scores per query where `window` are needed: at window 512, 768 (blocks of 128: 640;
/// of 512: 1,024). With each block one fused attention call, fewer, larger calls won:
/// alternated on the training step at window 512, blocks of 256 against 128 were +4.3 to
/// +5.6% at L = 16,384 (batch 2) and +1.6 to +1.8% at 2,048 (batch 8), and blocks of 512
/// 4-6% slower than 256. (Before the fused calls, blocks of 128 had won: 9% off at 2,048
/// against blocks of `window` sliced with `narrow`.)
pub(crate) const BAND_BLOCK: i64 = 256;

/// [`window_attention`] without a cache and with a window shorter than the call: the
/// queries in blocks of `c = min(block, window)` positions, each block against its own keys
/// and those of the `ceil((window - 1) / c)` blocks before it, masked to the band.
/// The blocks are `split` off q, k and v (views, whose backward is one concatenation):
/// slicing each block's keys out of the whole sequence with `narrow` instead would
/// give every block a backward that zero-fills a gradient of the whole sequence, O(L^2 / c)
/// work in all, which made the step 7% slower at L = 16,384.
pub(crate) fn banded_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    window: i64,
    block: i64,
) -> Tensor {
    let dev = q.device();
    let c = block.min(window).max(1);
    let back = ((window - 1 + c - 1) / c) as usize; // earlier key blocks a query block reaches
    let (qs, ks, vs) = (q.split(c, 2), k.split(c, 2), v.split(c, 2));
    // every whole block past the first `back` sees the same band: one mask for all
    let mut shared: Option<Tensor> = None;
    let outs: Vec<Tensor> = (0..qs.len())
        .map(|j| {
            let j0 = j.saturating_sub(back);
            let (keys, vals) = (Tensor::cat(&ks[j0..=j], 2), Tensor::cat(&vs[j0..=j], 2));
            let (n, kn) = (qs[j].size()[2], keys.size()[2]);
            let band = || inside_band(j as i64 * c, n, j0 as i64 * c, kn, window, dev);
            let mask = if j >= back && n == c {
                shared.get_or_insert_with(band).shallow_clone()
            } else {
                band()
            };
            // libtorch's fused attention (scale 1/sqrt(dk)) with the band as its mask: no
            // (n, kn) scores kept for the backward pass
            Tensor::scaled_dot_product_attention::<Tensor>(
                &qs[j],
                &keys,
                &vals,
                Some(mask),
                0.0,
                false,
                None,
                false,
            )
        })
        .collect();
    Tensor::cat(&outs, 2)
}

/// The (n, kn) mask of the scores inside the window (true where a query attends), for
/// queries at positions first_q.. and keys at first_k..: 0 <= lag < window.
fn inside_band(first_q: i64, n: i64, first_k: i64, kn: i64, window: i64, dev: Device) -> Tensor {
    outside_band(first_q, n, first_k, kn, window, dev).logical_not()
}

/// The (n, kn) mask of the scores that fall outside the window, for queries at positions
/// first_q.. and keys at first_k..: the lag of key t behind query i must be 0 <= lag < window.
fn outside_band(first_q: i64, n: i64, first_k: i64, kn: i64, window: i64, dev: Device) -> Tensor {
    let qi = Tensor::arange_start(first_q, first_q + n, (Kind::Int64, dev)).unsqueeze(1);
    let kt = Tensor::arange_start(first_k, first_k + kn, (Kind::Int64, dev)).unsqueeze(0);
    let lag = qi - kt;
    lag.lt(0).logical_or(&lag.ge(window))
}

/// The keys and values a local head still sees, for a batch that steps together: `k`
/// (B, H, C, dk) and `v` (B, H, C, Dv), f32, whose C slots grow (doubling) up to `window`
/// as positions arrive, so a huge window costs only what it holds. Slots 0..len hold the
/// last `len` <= window positions: in order while len < window; once the window is full,
/// rotated, `next` being the slot the next position overwrites (its oldest). Softmax over
/// a set of keys does not see their order: a step writes one slot in place and reads the
/// others where they lie, instead of concatenating and copying the window every token.
#[derive(Debug)]
pub struct KvRing {
    pub k: Tensor,
    pub v: Tensor,
    pub window: i64,
    pub len: i64,
    pub next: i64,
}

/// Slots a new [`KvRing`] starts with (fewer when the window is smaller).
const RING_START: i64 = 64;

impl KvRing {
    /// An empty ring for a window of `window` positions.
    pub fn new(
        batch: i64,
        heads: i64,
        window: i64,
        dk: i64,
        dv: i64,
        opts: (Kind, Device),
    ) -> Self {
        let c = window.min(RING_START);
        KvRing {
            k: Tensor::zeros([batch, heads, c, dk], opts),
            v: Tensor::zeros([batch, heads, c, dv], opts),
            window,
            len: 0,
            next: 0,
        }
    }

    fn capacity(&self) -> i64 {
        self.k.size()[2]
    }

    /// Room for at least `n` slots (n <= window), keeping slots 0..len; only before the
    /// window is full, while the slots are in order.
    fn reserve(&mut self, n: i64) {
        let c = self.capacity();
        if n <= c {
            return;
        }
        let mut c2 = c.max(1);
        while c2 < n {
            c2 *= 2;
        }
        let c2 = c2.min(self.window);
        let grow = |t: &Tensor| {
            let mut size = t.size();
            size[2] = c2 - c;
            Tensor::cat(
                &[t, &Tensor::zeros(size.as_slice(), (t.kind(), t.device()))],
                2,
            )
        };
        self.k = grow(&self.k);
        self.v = grow(&self.v);
    }

    /// The same ring with `f` applied to its tensors (copies, batch rows).
    pub fn map(&self, f: impl Fn(&Tensor) -> Tensor) -> KvRing {
        KvRing {
            k: f(&self.k),
            v: f(&self.v),
            window: self.window,
            len: self.len,
            next: self.next,
        }
    }

    /// The held keys and values, oldest first: (B, H, len, d).
    pub fn chronological(&self) -> (Tensor, Tensor) {
        let (w, n) = (self.window, self.next);
        let order = |t: &Tensor| {
            if self.len < w {
                t.narrow(2, 0, self.len)
            } else {
                Tensor::cat(&[t.narrow(2, n, w - n), t.narrow(2, 0, n)], 2)
            }
        };
        (order(&self.k), order(&self.v))
    }

    /// Takes the slot of one more position, a free one or the oldest, and counts the
    /// position as held; the caller writes its key and value there.
    fn take_slot(&mut self) -> i64 {
        if self.len < self.window {
            self.reserve(self.len + 1);
            self.next = self.len;
        }
        let slot = self.next;
        self.len = (self.len + 1).min(self.window);
        self.next = (self.next + 1) % self.window;
        slot
    }

    /// Writes one position (B, H, 1, d) into a free slot, or over the oldest one.
    fn push(&mut self, k: &Tensor, v: &Tensor) {
        let slot = self.take_slot();
        self.k.narrow(2, slot, 1).copy_(k);
        self.v.narrow(2, slot, 1).copy_(v);
    }

    /// Replaces the content by `k`, `v` (B, H, n, d), oldest first, n < window.
    fn refill(&mut self, k: &Tensor, v: &Tensor) {
        let n = k.size()[2];
        self.reserve(n);
        self.k.narrow(2, 0, n).copy_(k);
        self.v.narrow(2, 0, n).copy_(v);
        self.len = n;
        self.next = n;
    }
}

/// [`window_attention`] with the window kept in `ring`: a single query (a generation
/// step) writes its key into the ring and attends over the ring as it lies; longer pieces
/// go through [`window_attention`] on the keys put back in order, and refill the ring.
pub(crate) fn ring_attention(q: &Tensor, k: &Tensor, v: &Tensor, ring: &mut KvRing) -> Tensor {
    if q.size()[2] == 1 {
        ring.push(k, v);
        let dk = q.size()[3];
        let (rk, rv) = (ring.k.narrow(2, 0, ring.len), ring.v.narrow(2, 0, ring.len));
        return (q.matmul(&rk.transpose(-1, -2)) / (dk as f64).sqrt())
            .softmax(-1, None)
            .matmul(&rv);
    }
    let (mut ck, mut cv) = ring.chronological();
    let out = window_attention(q, k, v, ring.window, Some((&mut ck, &mut cv)));
    ring.refill(&ck, &cv);
    out
}

/// A generation step of RoPE local heads done on the host, in one pass, instead of some
/// thirty small libtorch calls per layer (turning q and k, writing the ring, two matmuls,
/// softmax), which at batch 1 cost more than their arithmetic: the same math as
/// [`rope`] then [`ring_attention`], in f32 (angles formed in f64), summed in another
/// order. `qkv` is the layer's projection for this position, (B, 3 * H_all * D) rows on
/// the host, whose heads 0..hl (of each third) are the local ones; returns their outputs
/// (B, hl, D). Only for a CPU ring of contiguous f32 tensors: see [`host_step_ok`].
pub(crate) fn host_ring_step(
    qkv: &[f32],
    batch: usize,
    hl: usize,
    d_model: usize,
    dim: usize,
    position: i64,
    ring: &mut KvRing,
) -> Vec<f32> {
    assert!(
        host_step_ok(ring)
            && ring.k.size() == [batch as i64, hl as i64, ring.capacity(), dim as i64],
        "host_ring_step: a ring of another shape, kind or device"
    );
    let slot = ring.take_slot() as usize;
    if batch == 0 {
        // (an empty tensor's data pointer may be null)
        return vec![];
    }
    let held = ring.len as usize;
    let cap = ring.capacity() as usize;
    let half = dim / 2;
    // (cos, sin) of this position's angles, as rope_tables forms them
    let turn: Vec<(f32, f32)> = rope_frequencies(dim as i64)
        .iter()
        .map(|w| {
            let a = position as f64 * w;
            (a.cos() as f32, a.sin() as f32)
        })
        .collect();
    let rotate = |x: &[f32], out: &mut [f32]| {
        for (j, &(c, s)) in turn.iter().enumerate() {
            let (x1, x2) = (x[j], x[j + half]);
            out[j] = x1 * c - x2 * s;
            out[j + half] = x1 * s + x2 * c;
        }
    };
    let scale = (dim as f32).sqrt();
    // SAFETY: host_step_ok: both are contiguous f32 CPU tensors of (B, hl, cap, dim)
    // elements, owned by this ring (no other Rust reference to their storage lives
    // while these slices do), and distinct tensors.
    let (kb, vb) = unsafe {
        (
            std::slice::from_raw_parts_mut(ring.k.data_ptr() as *mut f32, batch * hl * cap * dim),
            std::slice::from_raw_parts_mut(ring.v.data_ptr() as *mut f32, batch * hl * cap * dim),
        )
    };
    let mut out = vec![0f32; batch * hl * dim];
    let (mut q, mut scores) = (vec![0f32; dim], vec![0f32; held]);
    for b in 0..batch {
        let row = &qkv[b * 3 * d_model..(b + 1) * 3 * d_model];
        for h in 0..hl {
            let at = |part: usize| &row[part * d_model + h * dim..part * d_model + (h + 1) * dim];
            let base = (b * hl + h) * cap * dim;
            rotate(at(0), &mut q);
            rotate(at(1), &mut kb[base + slot * dim..base + (slot + 1) * dim]);
            vb[base + slot * dim..base + (slot + 1) * dim].copy_from_slice(at(2));
            let keys = &kb[base..base + held * dim];
            for (sc, key) in scores.iter_mut().zip(keys.chunks_exact(dim)) {
                *sc = host::dot(&q, key) / scale;
            }
            let max = scores.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
            let mut sum = 0f32;
            for sc in scores.iter_mut() {
                *sc = (*sc - max).exp();
                sum += *sc;
            }
            let o = &mut out[(b * hl + h) * dim..(b * hl + h + 1) * dim];
            for (&p, val) in scores
                .iter()
                .zip(vb[base..base + held * dim].chunks_exact(dim))
            {
                let p = p / sum;
                for (oi, &vi) in o.iter_mut().zip(val) {
                    *oi += p * vi;
                }
            }
        }
    }
    out
}

impl std::fmt::Debug for HostFavor {
    /// Sizes only: the copies hold tens of thousands of numbers.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostFavor")
            .field("codes", &self.codes.len())
            .field("layers", &self.features.len())
            .field("gated", &self.gates.iter().any(Option::is_some))
            .finish()
    }
}

/// A generation step of the FAVOR+ heads (hl..h) done on the host, in one pass per layer,
/// instead of some forty small libtorch calls (SPE filter with its gate, feature maps,
/// state update): the same math as [`spe_filter_with`], [`FavorFeatures::features`] and
/// [`recurrent_step`], in f32, summed in another order. `qkv` is the layer's projection for
/// this position, (B, 3 * H * D) rows; `code` is this position's (qbar, kbar) of the FAVOR+
/// heads, each (H', D, R). The state s (B, H', M, D) and z (B, H', M) is updated in place
/// (made contiguous first if it is not). Returns the outputs (B, H', D).
#[allow(clippy::too_many_arguments)]
fn host_favor_step(
    qkv: &[f32],
    batch: usize,
    hl: usize,
    h: usize,
    dim: usize,
    host: &HostFavor,
    layer: usize,
    code: &(Vec<f32>, Vec<f32>),
    s: &mut Tensor,
    z: &mut Tensor,
) -> Vec<f32> {
    let hf = h - hl;
    let d_model = h * dim;
    let r = code.0.len() / (hf * dim);
    let feats = &host.features[layer];
    let m = feats.num_features();
    for t in [&mut *s, &mut *z] {
        if !t.is_contiguous() {
            *t = t.contiguous();
        }
    }
    assert!(
        [&*s, &*z].iter().all(|t| cpu_f32(t))
            && s.numel() == batch * hf * m * dim
            && z.numel() == batch * hf * m,
        "FAVOR+ state of another shape, kind or device"
    );
    if batch == 0 {
        // (an empty tensor's data pointer may be null)
        return vec![];
    }
    let (sp, zp) = (s.data_ptr() as *mut f32, z.data_ptr() as *mut f32);
    assert!(
        sp.wrapping_add(s.numel()) <= zp || zp.wrapping_add(z.numel()) <= sp,
        "FAVOR+ state tensors s and z share storage"
    );
    // SAFETY: contiguous f32 CPU tensors of the sizes checked above, not empty, whose
    // storages do not overlap (checked above), owned by the state being stepped: a state
    // begun, copied or selected holds tensors of its own, and a step updates them in place
    // (no other Rust reference to their storage lives while these slices do).
    let (sb, zb) = unsafe {
        (
            std::slice::from_raw_parts_mut(sp, batch * hf * m * dim),
            std::slice::from_raw_parts_mut(zp, batch * hf * m),
        )
    };
    // queries and keys enter the features scaled by dk^-1/4, dk = R
    let sc = (r as f64).powf(-0.25) as f32;
    let (mut xq, mut xk) = (vec![0f32; r], vec![0f32; r]);
    let (mut pq, mut pk) = (vec![0f32; m], vec![0f32; m]);
    let mut out = vec![0f32; batch * hf * dim];
    for b in 0..batch {
        let row = &qkv[b * 3 * d_model..(b + 1) * 3 * d_model];
        for j in 0..hf {
            let head = hl + j;
            let at = |part: usize| &row[part * d_model + head * dim..][..dim];
            let gate = host.gates[layer]
                .as_ref()
                .map(|(a, xi)| (&a[j * dim..][..dim], &xi[j * dim * r..][..dim * r]));
            host_filter(at(0), &code.0[j * dim * r..][..dim * r], gate, &mut xq);
            host_filter(at(1), &code.1[j * dim * r..][..dim * r], gate, &mut xk);
            xq.iter_mut().chain(xk.iter_mut()).for_each(|x| *x *= sc);
            feats.phi(&xq, true, &mut pq);
            feats.phi(&xk, false, &mut pk);
            let st = b * hf + j;
            host_recurrent_step(
                &pq,
                &pk,
                at(2),
                &mut sb[st * m * dim..][..m * dim],
                &mut zb[st * m..][..m],
                &mut out[st * dim..][..dim],
            );
        }
    }
    out
}

/// Whether [`host_ring_step`] may work on `ring`'s storage in place.
pub(crate) fn host_step_ok(ring: &KvRing) -> bool {
    [&ring.k, &ring.v]
        .iter()
        .all(|t| cpu_f32(t) && t.is_contiguous())
        && ring.k.size() == ring.v.size()
}

/// Rotary position embedding of `x` (B, H, L, D), D even, at absolute positions
/// start..start+L: the pair (x_j, x_{j+D/2}) of position p turns by the angle
/// p * ROPE_BASE^(-2j/D). A turned query at p and a turned key at p' then have the dot
/// product of the plain ones with the pair rotations of p - p' between them, so
/// softmax logits depend on the lag only, and a state that caches turned keys can be
/// continued at any offset.
pub fn rope(x: &Tensor, start: i64) -> Tensor {
    let (l, dim) = (x.size()[2], x.size()[3]);
    apply_rope(x, &rope_tables(start, l, dim, x.device()))
}

/// The RoPE tables of positions start..start+len, each (len, dim) f32, in the form
/// [`apply_rope`] uses them: `[cos, cos]` and `[-sin, sin]` of the angles of the dim/2
/// pairs; angles are formed in f64 (positions run past 2^24).
pub(crate) fn rope_tables(start: i64, len: i64, dim: i64, dev: Device) -> (Tensor, Tensor) {
    let w = Tensor::from_slice(&rope_frequencies(dim)).to_device(dev);
    let pos = Tensor::arange_start(start, start + len, (Kind::Double, dev)).unsqueeze(1);
    let ang = pos * w.unsqueeze(0);
    let (cos, sin) = (ang.cos(), ang.sin());
    (
        Tensor::cat(&[&cos, &cos], 1).to_kind(Kind::Float),
        Tensor::cat(&[-&sin, sin], 1).to_kind(Kind::Float),
    )
}

/// The angle per position of each pair j < dim/2, ROPE_BASE^(-2j/dim), in f64.
fn rope_frequencies(dim: i64) -> Vec<f64> {
    (0..dim / 2)
        .map(|j| (j as f64 * (-2.0 * ROPE_BASE.ln() / dim as f64)).exp())
        .collect()
}

/// [`rope`] with precomputed [`rope_tables`]; the result is f32.
///
/// With x = [x1, x2] (the halves of the last axis), the turned pairs are
/// [x1 cos - x2 sin, x1 sin + x2 cos] = x [cos, cos] + [x2, x1] [-sin, sin]: two
/// products and a sum over the whole width, where the halves took four products, two
/// sums and a concatenation over rows of half the width. Both give the same floats
/// (`a + (-b)` is `a - b`, and sums commute).
///
/// On the CPU in f32 both ways are one pass over the rows (`src/model/rope.cpp`),
/// elsewhere [`apply_rope_libtorch`].
pub(crate) fn apply_rope(x: &Tensor, tables: &(Tensor, Tensor)) -> Tensor {
    let (cos, sin) = tables;
    if !(cpu_f32(x) && cpu_f32(cos) && cpu_f32(sin)) {
        return apply_rope_libtorch(x, tables);
    }
    let x = unit_last_stride(x);
    // SAFETY: live tensor handles; the result is a new tensor or null.
    unsafe {
        crate::model::ffi::owned_result(
            crate::model::ffi::cadenza_rope(x.as_ptr(), cos.as_ptr(), sin.as_ptr()),
            "fused RoPE",
        )
    }
}

/// [`apply_rope`] in libtorch calls (any device and kind).
pub(crate) fn apply_rope_libtorch(x: &Tensor, (cos, sin): &(Tensor, Tensor)) -> Tensor {
    let half = x.size()[3] / 2;
    let x = as_kind(x, Kind::Float);
    &x * cos + x.roll([half], [3]) * sin
}

/// Causal depthwise convolution over time: (B, L, C) rows and (C, k) taps ->
/// (B, L, C), y[t] = sum_j w[:, j] x[t - (k-1) + j], with the k-1 rows before
/// the window taken from `tail` (B, k-1, C), or zeros without one; `tail` is
/// then replaced by the window's last k-1 rows (earlier ones when L < k-1).
/// k shifted multiply-adds rather than a grouped conv1d: no transposes, and
/// the same code runs a whole window and a one-token step.
pub(crate) fn short_conv(x: &Tensor, w: &Tensor, tail: Option<&mut Tensor>) -> Tensor {
    let (b, l, c) = x.size3().expect("(B, L, C)");
    let k = w.size()[1];
    let prev = match &tail {
        Some(t) => t.shallow_clone(),
        None => Tensor::zeros([b, k - 1, c], (x.kind(), x.device())),
    };
    let padded = Tensor::cat(&[&prev, x], 1);
    let mut y = padded.narrow(1, k - 1, l) * w.select(1, k - 1);
    for j in 0..k - 1 {
        y = y + padded.narrow(1, j, l) * w.select(1, j);
    }
    if let Some(t) = tail {
        *t = padded.narrow(1, l, k - 1).copy();
    }
    y
}

/// Writes `cols` (n, ...) = noise columns of positions first..first+n into their ring slots.
fn fill_ring(ring: &mut Tensor, first: i64, cols: &Tensor) {
    let k = ring.size()[0];
    let n = cols.size()[0];
    let slots: Vec<i64> = (first..first + n).map(|p| p.rem_euclid(k)).collect();
    let slots = Tensor::from_slice(&slots).to_device(ring.device());
    let _ = ring.index_copy_(0, &slots, &cols.to_kind(ring.kind()));
}
