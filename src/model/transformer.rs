//! The stack: embeddings ([`Embeddings`]), `n_layers` pre-LayerNorm blocks ([`Block`]:
//! attention, [`crate::model::attention::Attention`], and feed-forward,
//! [`crate::model::mlp::Mlp`]), the output head ([`OutputHead`]); the model's noise
//! (SPE codes, gate xi, FAVOR+ projections), drawn or frozen; and the recurrent form.
//!
//! Variable paths (for weight-decay filters): `tok_embed.weight`, `bar_embed.weight` (with
//! `bar_embedding`; zeros, drawn from no generator), `layers.{i}.norm1.{weight,bias}`,
//! `layers.{i}.attn_qkv.{weight,bias}`, `layers.{i}.qkv_conv` (short convolution, (3d, k)),
//! `layers.{i}.attn_out.*`, `layers.{i}.norm2.*`,
//! `layers.{i}.ff1.*`, `layers.{i}.ff2.*`, `layers.{i}.spe_gate` (gated SPE), `final_norm.*`,
//! `head.*` (untied only), SPE code parameters under `spe.*` (shared) or `layers.{i}.spe.*`.
//! The parameters are made in the order their initializations draw from libtorch's
//! generator: `tok_embed`, the shared SPE code, then per layer `spe_gate`, its own SPE code,
//! `attn_qkv`, `attn_out`, `ff1`, `ff2`; then `head` and the training FAVOR+ projections.
//!
//! Attention: FAVOR+ (or exact softmax) in every head; with `local_heads` > 0 the first
//! `local_heads` heads of every layer use exact softmax over the last `local_window` tokens
//! instead ([`crate::model::local::window_attention`]), on the same SPE-filtered queries and
//! keys (`local_position = "shared"`) or on their own queries and keys turned by RoPE
//! (`"rope"`, [`crate::model::rope::rope`]; SPE then filters only the FAVOR+ heads).
//!
//! A generation step of a CPU f32 SineSPE FAVOR+ model (local heads, if any, with RoPE; no
//! short convolution) runs wholly on the host ([`Transformer::host_step`]): its dense layers
//! with the kernels of [`crate::model::host`], its RoPE local heads with
//! [`crate::model::local::host_ring_step`] and its FAVOR+ heads with [`host_favor_step`],
//! the state updated in place. Other models step through libtorch (RoPE local heads still
//! on the host where their ring allows it). Both paths give the same logits up to summation
//! order, which the recurrence == parallel tests check for every variant.
//!
//! Noise policy:
//! * [`Transformer::forward_train`]: fresh SPE noise (Z or conv noise, and every layer's
//!   gate xi) from torch's global RNG at each call, shared across the batch; every layer's
//!   FAVOR+ projection is redrawn (torch RNG) with probability `redraw_prob` at each call,
//!   the coin tossed after the SPE noise is drawn. The training projections are plain data
//!   of the model, changed only there (and by [`Transformer::set_training_projections`]).
//! * `forward_t(train = true)`: the same, with the training projections as they are.
//! * `forward_t(train = false)`, `prefill`, `step`: the frozen noise and features set by
//!   [`Transformer::freeze`]. A new model is already frozen with [`DEFAULT_SEED`], so evaluation
//!   never runs on undefined noise; call `freeze(seed)` to pick another realization. Frozen
//!   ConvSPE noise of position p is a pure function of (seed, code, p) (ChaCha8), so any window
//!   and the recurrence see the same codes, with no maximum length.

use std::sync::Arc;

use anyhow::{Context, Result};
use tch::{nn, Device, Kind, Tensor};

use crate::model::attention::{spe_first_head, spe_gate, LayerNoise, Positions, WindowCode};
use crate::model::block::{dropout, Block};
use crate::model::clock::{self, BarIndex, ClockState};
use crate::model::config::{AttentionKind, LocalPosition, ModelConfig, PositionalEncoding};
use crate::model::embed::Embeddings;
use crate::model::favor::FavorFeatures;
use crate::model::favor_heads::{host_favor_step, HostFavor};
use crate::model::head::OutputHead;
use crate::model::host::{self, HostLinear, HostNorm};
use crate::model::local::{host_ring_step, host_step_ok};
use crate::model::noise;
use crate::model::precision::{self, Precision, Resolved};
use crate::model::spe::{
    draw_xi, frozen_xi, sine_filter_applies, ConvSpe, GateFactors, SineFactors, SineSpe, SpeCode,
};
use crate::model::state::{HostLayer, HostStep, StepCache};
use crate::model::{host_f32, NORM_EPS};

pub use crate::model::attention::{GlobalState, LayerState};
pub use crate::model::embed::sinusoidal_ape;
pub use crate::model::local::KvRing;
pub use crate::model::rope::rope;
pub use crate::model::state::RecurrentState;

/// Seed of the noise/features a freshly built model is frozen with.
pub const DEFAULT_SEED: u64 = 0;

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

/// The model. See the module docs for the noise policy.
#[derive(Debug)]
pub struct Transformer {
    cfg: ModelConfig,
    device: Device,
    embed: Embeddings,
    blocks: Vec<Block>,
    head: OutputHead,
    codes: Vec<SpeCode>,
    /// Per layer: the FAVOR+ projection training uses between redraws (empty for softmax).
    train_features: Vec<FavorFeatures>,
    frozen: Frozen,
    /// The precision of the dense products (resolved: f32 or bf16; see [`precision`]).
    precision: Precision,
}

impl Transformer {
    /// The model under `vs`, its parameters drawn from libtorch's generator (in the order
    /// of the module docs), frozen with [`DEFAULT_SEED`].
    pub fn new(vs: &nn::Path, cfg: &ModelConfig) -> Result<Transformer> {
        cfg.validate().context("invalid model config")?;
        let device = vs.device();
        let embed = Embeddings::new(cfg, vs);
        let shared = !matches!(
            cfg.positional,
            PositionalEncoding::SpeSine { shared: false, .. }
                | PositionalEncoding::SpeConv { shared: false, .. }
        );
        let mut codes = Vec::new();
        if cfg.positional.is_spe() && shared {
            codes.push(spe_code(cfg, &vs.sub("spe")));
        }
        let mut blocks = Vec::new();
        for i in 0..cfg.n_layers {
            let p = vs.sub("layers").sub(i);
            let gate = spe_gate(cfg, &p);
            if cfg.positional.is_spe() && !shared {
                codes.push(spe_code(cfg, &p.sub("spe")));
            }
            blocks.push(Block::new(cfg, &p, gate));
        }
        let head = OutputHead::new(cfg, vs, &embed.weight);
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
            head,
            codes,
            train_features,
            frozen: Frozen {
                seed: DEFAULT_SEED,
                z: vec![],
                xi: vec![],
                features: vec![],
            },
            precision: Precision::F32,
        };
        model.freeze(DEFAULT_SEED);
        Ok(model)
    }

    /// Sets the precision of the dense products (see [`precision`]): `auto` is resolved for
    /// the model's device. Recurrent states begun before keep the host weights of the
    /// precision they began with. Returns what was chosen and why.
    pub fn set_precision(&mut self, precision: Precision) -> Resolved {
        let resolved = precision.resolve(self.device);
        self.precision = resolved.precision;
        resolved
    }

    /// The precision of the dense products (f32 or bf16).
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The device of its parameters.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The FAVOR+ projections training uses between redraws, one per layer.
    /// They belong to a resumable run's state: a resumed run must continue
    /// with the projections the interrupted one had.
    pub fn training_projections(&self) -> Vec<Tensor> {
        self.train_features.iter().map(|f| f.proj.copy()).collect()
    }

    /// Restores projections saved by [`Transformer::training_projections`].
    pub fn set_training_projections(&mut self, projections: &[Tensor]) -> Result<()> {
        let feats = &mut self.train_features;
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
        for b in &mut self.blocks {
            b.attn.set_chunk_size(chunk);
        }
    }

    fn param_kind(&self) -> Kind {
        self.embed.weight.kind()
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
            Some(r) if self.blocks.iter().any(|b| b.attn.gate.is_some()) => (0..self.cfg.n_layers)
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
    /// `train`: dropout and fresh SPE noise, with the training FAVOR+ projections as they
    /// are (a training step goes through [`Transformer::forward_train`], which may redraw
    /// them); otherwise the frozen noise and features.
    pub fn forward_t(&self, tokens: &Tensor, offset: i64, train: bool) -> Tensor {
        self.forward_from(tokens, offset, train, None)
    }

    /// [`Transformer::forward_t`] of windows whose bar index is known (see
    /// [`Transformer::forward_train_from`]).
    pub fn forward_from(
        &self,
        tokens: &Tensor,
        offset: i64,
        train: bool,
        bars: Option<&[i64]>,
    ) -> Tensor {
        let mode = if train { Mode::Train } else { Mode::Eval };
        self.run(tokens, offset, mode, None, bars)
    }

    /// The forward of a training step, (B, L) tokens at offset..offset+L -> (B, L, V)
    /// logits: dropout and fresh SPE noise, and, with probability `redraw_prob`, new
    /// training FAVOR+ projections for every layer, kept for the later steps (hence
    /// `&mut self`: the projections are the model's own data, and only a training step,
    /// which holds the model mutably for its update anyway, changes them).
    pub fn forward_train(&mut self, tokens: &Tensor, offset: i64) -> Tensor {
        self.forward_train_from(tokens, offset, None)
    }

    /// [`Transformer::forward_train`] of windows whose bar index is known: `bars[b]`
    /// bars of its piece lie before sequence b's first token (with a bar embedding;
    /// None, or a model without one: "not known" until a `BOS`).
    pub fn forward_train_from(
        &mut self,
        tokens: &Tensor,
        offset: i64,
        bars: Option<&[i64]>,
    ) -> Tensor {
        let clock = self.clock_coordinates(tokens, None);
        let Some((x, codes)) = self.enter(
            tokens,
            offset,
            Mode::Train,
            &mut None,
            bars,
            clock.as_deref(),
        ) else {
            return self.no_logits(tokens);
        };
        self.toss_redraw();
        precision::scope(self.precision, || {
            self.layers(x, &codes, offset, clock, Mode::Train, None)
        })
    }

    /// With musical RoPE, the clock coordinates of (B, L) `tokens`, one row per sequence,
    /// from the state's clocks (which they advance) or from a fresh clock.
    fn clock_coordinates(
        &self,
        tokens: &Tensor,
        state: Option<&mut RecurrentState>,
    ) -> Option<Vec<Vec<ClockState>>> {
        let m = self.cfg.musical_rope.as_ref()?;
        let (rows, b) = token_rows(tokens);
        let mut fresh = vec![ClockState::default(); b];
        let clocks = match state {
            Some(s) => &mut s.clock,
            None => &mut fresh,
        };
        Some(
            rows.iter()
                .zip(clocks.iter_mut())
                .map(|(row, c)| clock::coordinates(row, c, m))
                .collect(),
        )
    }

    /// With a bar embedding, the (B, L) rows of (B, L) `tokens` in it, one row per
    /// sequence, from the state's bar indices (which they advance), else from `known`
    /// (bars before each sequence), else from "not known".
    fn bar_rows(
        &self,
        tokens: &Tensor,
        state: Option<&mut RecurrentState>,
        known: Option<&[i64]>,
    ) -> Option<Tensor> {
        let n = self.cfg.bar_embedding?;
        let (rows, b) = token_rows(tokens);
        let mut fresh: Vec<BarIndex> = match known {
            Some(k) => {
                assert_eq!(k.len(), b, "one bar index per sequence");
                k.iter().map(|&n| BarIndex(Some(n))).collect()
            }
            None => vec![BarIndex::default(); b],
        };
        let at = match state {
            Some(s) => &mut s.bars,
            None => &mut fresh,
        };
        let bars: Vec<i64> = rows
            .iter()
            .zip(at.iter_mut())
            .flat_map(|(row, a)| clock::bar_rows(row, a, n))
            .collect();
        Some(Tensor::from_slice(&bars).view_as(tokens))
    }

    /// One coin per training call: on heads every layer's training projection is redrawn
    /// (torch's generator, like the coin).
    fn toss_redraw(&mut self) {
        if let AttentionKind::Favor {
            features,
            antithetic,
            redraw_prob,
        } = &self.cfg.attention
        {
            if *redraw_prob > 0.0
                && Tensor::rand([1], (Kind::Double, Device::Cpu)).double_value(&[0]) < *redraw_prob
            {
                for f in self.train_features.iter_mut() {
                    *f =
                        FavorFeatures::draw(*features, self.cfg.qk_dim(), *antithetic, self.device);
                }
            }
        }
    }

    /// Zero state at position 0 on the model's device (frozen noise of the current seed).
    pub fn begin(&self, batch: i64) -> RecurrentState {
        self.begin_at(batch, 0)
    }

    /// Zero state (empty past) whose next token is at absolute `position`: continuing from it
    /// reproduces `forward_t(tokens, position, false)`.
    pub fn begin_at(&self, batch: i64, position: i64) -> RecurrentState {
        let layers = self.blocks.iter().map(|b| b.attn.begin(batch)).collect();
        let rings = self
            .codes
            .iter()
            .enumerate()
            .filter_map(|(c, code)| match code {
                SpeCode::Conv(conv) => Some(self.conv_ring(c, conv, position)),
                SpeCode::Sine(_) => None,
            })
            .collect();
        RecurrentState {
            position,
            layers,
            rings,
            seed: self.frozen.seed,
            batch,
            clock: if self.cfg.musical_rope.is_some() {
                vec![ClockState::default(); batch.max(0) as usize]
            } else {
                Vec::new()
            },
            bars: if self.cfg.bar_embedding.is_some() {
                vec![BarIndex::default(); batch.max(0) as usize]
            } else {
                Vec::new()
            },
            cache: tch::no_grad(|| self.step_cache()),
        }
    }

    /// The ring (k, H, D, R) of ConvSPE code `c` for a state whose next token is at
    /// `position`: the frozen noise columns of the k-1 positions before it.
    fn conv_ring(&self, c: usize, conv: &ConvSpe, position: i64) -> Tensor {
        let k = conv.kernel;
        let mut shape = vec![k];
        shape.extend_from_slice(&conv.column_shape());
        let mut ring = Tensor::zeros(shape.as_slice(), (self.param_kind(), self.device));
        // positions position-k+1 ..= position-1
        let cols = noise::conv_noise_columns(
            self.frozen.seed,
            c as u64,
            position - k + 1,
            k - 1,
            &conv.column_shape(),
            self.device,
            self.param_kind(),
        );
        fill_ring(&mut ring, position - k + 1, &cols);
        ring
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
                b.attn
                    .gate
                    .as_ref()
                    .map(|g| GateFactors::new(g, &self.frozen.xi[i]))
            })
            .collect();
        let host = self
            .host_favor(&sine, &gates)
            .map(|favor| Arc::new(self.host_copies(favor)));
        StepCache { sine, gates, host }
    }

    /// Host copies of the weights for [`Transformer::host_step`], those of the dense
    /// products in bf16 when the model's precision is bf16.
    fn host_copies(&self, favor: HostFavor) -> HostStep {
        let cfg = &self.cfg;
        let bf16 = self.precision.is_bf16();
        let d = cfg.d_model as f64;
        let weight = &self.embed.weight;
        HostStep {
            favor,
            // a tied head's rows are the embedding; in bf16 they are rounded, the embedding
            // stays f32 (as in the parallel pass)
            embed: (self.head.linear.is_some() || bf16).then(|| host_f32(weight)),
            embed_scale: cfg.scaled_embeddings.then(|| d.sqrt() as f32),
            bar_embed: self.embed.bar.as_ref().map(host_f32),
            layers: self
                .blocks
                .iter()
                .map(|b| HostLayer {
                    norm1: HostNorm::of(&b.norm1, NORM_EPS),
                    qkv: HostLinear::of(&b.attn.qkv, bf16),
                    out: HostLinear::of(&b.attn.out, bf16),
                    norm2: HostNorm::of(&b.norm2, NORM_EPS),
                    ff1: HostLinear::of(&b.mlp.ff1, bf16),
                    ff2: HostLinear::of(&b.mlp.ff2, bf16),
                    write_gate: b.attn.write_gate.as_ref().map(|w| HostLinear::of(w, bf16)),
                })
                .collect(),
            final_norm: HostNorm::of(&self.head.norm, NORM_EPS),
            head: match &self.head.linear {
                Some(h) => HostLinear::of(h, bf16),
                None => HostLinear::new(weight, None, bf16),
            },
            head_scale: (self.head.linear.is_none() && cfg.scaled_embeddings)
                .then(|| d.powf(-0.5) as f32),
        }
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
            && cfg.short_conv == 0
            && cfg.taylor_dim.is_none();
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
        tch::no_grad(|| self.run(tokens, state.position, Mode::Eval, Some(state), None))
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
                && state
                    .layers
                    .iter()
                    .filter_map(|l| l.window.as_ref())
                    .all(host_step_ok)
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
                None,
            )
        })
        .squeeze_dim(1)
    }

    /// [`Transformer::step`] done wholly on the host (`ids`: one token per sequence), for a
    /// CPU f32 SineSPE FAVOR+ model ([`Transformer::host_favor`]): the projections, norms
    /// and feed-forward layers with the kernels of [`host`], the local heads with
    /// [`crate::model::local::host_ring_step`] and the FAVOR+ heads with [`host_favor_step`], the state
    /// updated in place. The same math as [`Transformer::step`] through libtorch, summed in another
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
            match &hs.embed {
                Some(e) => x.extend_from_slice(&e[t as usize * d..][..d]),
                None => hs.head.push_row(t as usize, &mut x),
            }
        }
        if let Some(sc) = hs.embed_scale {
            x.iter_mut().for_each(|v| *v *= sc);
        }
        if let Some(bar) = &hs.bar_embed {
            let n = cfg
                .bar_embedding
                .expect("a bar table comes with bar_embedding");
            for ((row, &t), at) in x.chunks_exact_mut(d).zip(ids).zip(state.bars.iter_mut()) {
                let r = at.advance(t, n) as usize;
                row.iter_mut()
                    .zip(&bar[r * d..][..d])
                    .for_each(|(a, b)| *a += b);
            }
        }
        // the clock after this token: the local heads' RoPE turns of this position (one
        // list, or one per sequence), and the SPE positions in musical time
        let mut pos = Positions::new(offset, true);
        pos.musical = cfg.musical_rope.map(|m| {
            let coords = ids.iter().zip(state.clock.iter_mut());
            (m, coords.map(|(&t, c)| vec![c.advance(t, &m)]).collect())
        });
        let spe_at: Vec<i64> = match &pos.musical {
            Some((m, coords)) if cfg.musical_spe => {
                let span = cfg.spe_bar_steps(m);
                coords.iter().map(|c| c[0].musical_position(span)).collect()
            }
            _ => vec![offset],
        };
        // this position's codes, per SineSPE code (one when shared): one per sequence in
        // musical time, one for all of them on the token index
        let codes: Vec<Vec<(Vec<f32>, Vec<f32>)>> = hs
            .favor
            .codes
            .iter()
            .map(|c| {
                let at = |&p: &i64| (c.code_at(p, true), c.code_at(p, false));
                spe_at.iter().map(at).collect()
            })
            .collect();
        let turns = if hl > 0 {
            pos.turns(hd as i64)
        } else {
            Vec::new()
        };
        let add = |x: &mut [f32], y: &[f32]| x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
        for (i, layer) in hs.layers.iter().enumerate() {
            let normed = layer.norm1.apply(&x);
            let qkv = layer.qkv.apply(&normed, b);
            // (B, H') gates of what the FAVOR+ heads write, with a write gate
            let write = layer.write_gate.as_ref().map(|w| {
                let mut g = w.apply(&normed, b);
                g.iter_mut().for_each(|v| *v = 1.0 / (1.0 + (-*v).exp()));
                g
            });
            // (B, H, D): the local heads, then the FAVOR+ ones
            let mut att = vec![0f32; b * d];
            if hl > 0 {
                let ring = state.layers[i]
                    .window
                    .as_mut()
                    .expect("a state begun by this model has a window per layer");
                let local = host_ring_step(&qkv, b, hl, d, hd, &turns, ring);
                for (a, l) in att.chunks_exact_mut(d).zip(local.chunks_exact(hl * hd)) {
                    a[..hl * hd].copy_from_slice(l);
                }
            }
            let GlobalState::Favor { s, z } = &mut state.layers[i].heads else {
                unreachable!("a host step is for FAVOR+ models")
            };
            let code = &codes[if codes.len() == 1 { 0 } else { i }];
            let favor = host_favor_step(
                &qkv,
                b,
                hl,
                h,
                hd,
                &hs.favor,
                i,
                code,
                write.as_deref(),
                s,
                z,
            );
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
    /// filter applies, what forms them inside it; with SPE in musical time, SineSPE's
    /// codes at every sequence's `clock` coordinates. Training draws their noise (torch
    /// RNG, in the order of the codes); a state's ConvSPE rings are kept up to date.
    fn window_codes(
        &self,
        offset: i64,
        len: i64,
        mode: Mode,
        state: &mut Option<&mut RecurrentState>,
        clock: Option<&[Vec<ClockState>]>,
    ) -> Vec<WindowCode> {
        let (h0, n) = self.spe_heads();
        let mut ring_idx = 0;
        let mut out = Vec::with_capacity(self.codes.len());
        for (c, code) in self.codes.iter().enumerate() {
            out.push(match code {
                SpeCode::Sine(s) => {
                    self.sine_window(c, s, (offset, len, clock), mode, state.as_deref())
                }
                SpeCode::Conv(conv) => {
                    let ring = state.as_deref_mut().map(|st| &mut st.rings[ring_idx]);
                    ring_idx += 1;
                    let (qbar, kbar) = self.conv_window(c, conv, offset, len, mode, ring);
                    WindowCode::Stored(qbar.narrow(1, h0, n), kbar.narrow(1, h0, n))
                }
            });
        }
        out
    }

    /// The window of SineSPE code `c` (heads h0..h) over positions offset..offset+len:
    /// its factors (drawn, frozen, or the state's), formed inside the fused filter outside
    /// a generation step where it applies; with SPE in musical time, stored codes at the
    /// `clock` coordinates of every sequence.
    fn sine_window(
        &self,
        c: usize,
        s: &SineSpe,
        (offset, len, clock): (i64, i64, Option<&[Vec<ClockState>]>),
        mode: Mode,
        state: Option<&RecurrentState>,
    ) -> WindowCode {
        let (h0, n) = self.spe_heads();
        let factors = match mode {
            Mode::Train => s.factors(&s.draw_z()).heads(h0, n),
            Mode::Step => state.expect("step needs a state").cache.sine[c]
                .as_ref()
                .expect("SineSPE step factors")
                .share(),
            Mode::Eval => s
                .factors(self.frozen.z[c].as_ref().expect("frozen Z"))
                .heads(h0, n),
        };
        if self.cfg.musical_spe {
            let m = self
                .cfg
                .musical_rope
                .as_ref()
                .expect("musical_spe is validated to come with musical_rope");
            let rows = clock.expect("a model with musical_spe reads the clock of every call");
            let span = self.cfg.spe_bar_steps(m);
            let at: Vec<f64> = rows
                .iter()
                .flatten()
                .map(|c| c.musical_position(span) as f64)
                .collect();
            let at = Tensor::from_slice(&at).to_device(self.device);
            let (qbar, kbar) = s.codes_at(&factors, &at); // (B L, H', D, R)
            let shape = |t: Tensor| {
                let mut dims = vec![rows.len() as i64, len];
                dims.extend_from_slice(&t.size()[1..]);
                t.view(dims.as_slice())
            };
            return WindowCode::PerSequence(shape(qbar), shape(kbar)); // (B, L, H', D, R)
        }
        // SineSPE's codes formed inside the fused filter, outside a generation step
        let form_inside = mode != Mode::Step
            && sine_filter_applies(
                self.device,
                self.param_kind(),
                self.cfg.positional.realizations().unwrap_or(0),
            );
        if form_inside {
            let (omega_q, omega_k) = tch::no_grad(|| s.omegas(&factors, offset, len));
            return WindowCode::Sine {
                factors,
                omega_q,
                omega_k,
                start: offset,
            };
        }
        let (qbar, kbar) = s.codes_from(&factors, offset, len);
        WindowCode::Stored(qbar, kbar)
    }

    /// The codes (qbar, kbar), each (L, H, D, R), of ConvSPE code `c` over
    /// offset..offset+len: from fresh noise (training), from the frozen noise (advancing a
    /// state's `ring` to the window's end), or from the ring of a generation step.
    fn conv_window(
        &self,
        c: usize,
        conv: &ConvSpe,
        offset: i64,
        len: i64,
        mode: Mode,
        ring: Option<&mut Tensor>,
    ) -> (Tensor, Tensor) {
        let (seed, k) = (self.frozen.seed, conv.kernel);
        match mode {
            Mode::Train => conv.codes_from_noise(&conv.draw_noise(len)),
            Mode::Eval => {
                let nz = conv.frozen_noise(seed, c as u64, offset, len);
                if let Some(ring) = ring {
                    if k > 1 {
                        let cols = nz.narrow(0, len, k - 1);
                        fill_ring(ring, offset + len - k + 1, &cols);
                    }
                }
                conv.codes_from_noise(&nz)
            }
            Mode::Step => {
                let ring = ring.expect("step needs a state");
                let col = noise::conv_noise_columns(
                    seed,
                    c as u64,
                    offset,
                    1,
                    &conv.column_shape(),
                    self.device,
                    self.param_kind(),
                );
                fill_ring(ring, offset, &col);
                conv.codes_from_ring(ring, offset)
            }
        }
    }

    /// The heads SPE filters, (first, count): with RoPE local heads only the FAVOR+ ones
    /// after them, every head otherwise (local heads then take theirs from the filtered
    /// queries and keys).
    fn spe_heads(&self) -> (i64, i64) {
        let h0 = spe_first_head(&self.cfg);
        (h0, self.cfg.n_heads - h0)
    }

    /// (B, 0, V) logits of an empty call.
    fn no_logits(&self, tokens: &Tensor) -> Tensor {
        let b = tokens.size()[0];
        Tensor::zeros([b, 0, self.cfg.vocab_size], (Kind::Float, self.device))
    }

    /// A call in `mode` (a training one without a redraw): embeddings, codes, layers, head.
    fn run(
        &self,
        tokens: &Tensor,
        offset: i64,
        mode: Mode,
        mut state: Option<&mut RecurrentState>,
        known_bars: Option<&[i64]>,
    ) -> Tensor {
        let clock = self.clock_coordinates(tokens, state.as_deref_mut());
        let Some((x, codes)) = self.enter(
            tokens,
            offset,
            mode,
            &mut state,
            known_bars,
            clock.as_deref(),
        ) else {
            return self.no_logits(tokens);
        };
        precision::scope(self.precision, || {
            self.layers(x, &codes, offset, clock, mode, state)
        })
    }

    /// What comes before the layers: the embedded tokens (B, L, d) after dropout, and the
    /// SPE codes of the call's window (at the tokens' `clock` coordinates with SPE in
    /// musical time); None for an empty call.
    fn enter(
        &self,
        tokens: &Tensor,
        offset: i64,
        mode: Mode,
        state: &mut Option<&mut RecurrentState>,
        known_bars: Option<&[i64]>,
        clock: Option<&[Vec<ClockState>]>,
    ) -> Option<(Tensor, Vec<WindowCode>)> {
        let (_, l) = tokens.size2().expect("tokens must be (B, L)");
        if l == 0 {
            return None;
        }
        let bars = self.bar_rows(tokens, state.as_deref_mut(), known_bars); // (B, L)
        let x = self.embed.forward(tokens, offset, bars.as_ref()); // (B, L, d)
        let x = dropout(x, self.cfg.dropout, mode == Mode::Train);
        let codes = self.window_codes(offset, l, mode, state, clock);
        Some((x, codes))
    }

    /// The layers over `x` (B, L, d) at offset.., then the head: (B, L, V) f32 logits;
    /// advances `state` past the call.
    fn layers(
        &self,
        mut x: Tensor,
        codes: &[WindowCode],
        offset: i64,
        clock: Option<Vec<Vec<ClockState>>>,
        mode: Mode,
        mut state: Option<&mut RecurrentState>,
    ) -> Tensor {
        let l = x.size()[1];
        // (a CPU f32 step of a SineSPE FAVOR+ model goes to host_step instead; the RoPE
        // local heads of a CPU f32 step of other models still run on the host,
        // host_ring_step)
        let ring_on_host = self.spe_heads().0 > 0
            && mode == Mode::Step
            && self.device == Device::Cpu
            && self.param_kind() == Kind::Float;
        let mut pos = Positions::new(offset, ring_on_host);
        pos.musical = self.cfg.musical_rope.zip(clock);
        let features = match mode {
            Mode::Train => &self.train_features,
            Mode::Eval | Mode::Step => &self.frozen.features,
        };
        for (i, blk) in self.blocks.iter().enumerate() {
            let noise = LayerNoise {
                code: codes.get(if codes.len() == 1 { 0 } else { i }),
                gate: self.layer_gate(i, mode, state.as_deref()),
                features: features.get(i),
            };
            let layer = state.as_deref_mut().map(|s| &mut s.layers[i]);
            x = match (mode, layer) {
                (Mode::Step, Some(st)) => blk.step(&x, &noise, &pos, st),
                (_, st) => blk.forward(&x, mode == Mode::Train, &noise, &pos, st),
            }; // (B, L, d)
        }
        let logits = self.head.forward(&x); // (B, L, V)
        if let Some(st) = state {
            st.position = offset + l;
        }
        logits
    }

    /// Layer `i`'s gated-filter factors of heads h0..h: a fresh xi (training, torch RNG),
    /// the frozen one, or the state's (a step).
    fn layer_gate(
        &self,
        i: usize,
        mode: Mode,
        state: Option<&RecurrentState>,
    ) -> Option<GateFactors> {
        let g = self.blocks[i].attn.gate.as_ref()?;
        let (h, hd) = (self.cfg.n_heads, self.cfg.head_dim());
        let r = self.cfg.positional.realizations()?;
        let gate = match mode {
            Mode::Train => GateFactors::new(g, &draw_xi(h, hd, r, self.param_kind(), self.device)),
            Mode::Step => state
                .and_then(|s| s.cache.gates[i].as_ref())
                .expect("gate step factors")
                .share(),
            Mode::Eval => GateFactors::new(g, &self.frozen.xi[i]),
        };
        let (h0, n) = self.spe_heads();
        Some(gate.heads(h0, n))
    }
}

/// One SPE code's parameters under `p` (`spe.*` or `layers.{i}.spe.*`).
/// The ids of (B, L) int64 `tokens` on the host, one Vec per sequence, and B.
fn token_rows(tokens: &Tensor) -> (Vec<Vec<i64>>, usize) {
    let (b, l) = tokens.size2().expect("tokens must be (B, L)");
    let ids = Vec::<i64>::try_from(&tokens.to_device(Device::Cpu).contiguous().view([-1]))
        .expect("int64 token ids");
    let rows = ids.chunks(l.max(1) as usize).map(<[i64]>::to_vec).collect();
    (rows, b as usize)
}

fn spe_code(cfg: &ModelConfig, p: &nn::Path) -> SpeCode {
    let (h, hd) = (cfg.n_heads, cfg.head_dim());
    match &cfg.positional {
        PositionalEncoding::SpeSine {
            sines,
            realizations,
            freq_init,
            ..
        } => SpeCode::Sine(SineSpe::new(p, h, hd, *sines, *realizations, *freq_init)),
        PositionalEncoding::SpeConv {
            kernel,
            realizations,
            ..
        } => SpeCode::Conv(ConvSpe::new(p, h, hd, *kernel, *realizations)),
        _ => unreachable!("spe_code: a model without SPE has no code"),
    }
}

/// Writes `cols` (n, ...) = noise columns of positions first..first+n into their ring slots.
fn fill_ring(ring: &mut Tensor, first: i64, cols: &Tensor) {
    let k = ring.size()[0];
    let n = cols.size()[0];
    let slots: Vec<i64> = (first..first + n).map(|p| p.rem_euclid(k)).collect();
    let slots = Tensor::from_slice(&slots).to_device(ring.device());
    let _ = ring.index_copy_(0, &slots, &cols.to_kind(ring.kind()));
}
