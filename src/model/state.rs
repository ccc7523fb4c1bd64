//! The decoding state of the stack ([`RecurrentState`]) and what every step reads but no
//! step changes ([`StepCache`]).
//!
//! Invariants: a state belongs to the weights and the frozen seed it was begun with
//! ([`crate::model::Transformer::begin_at`] records the seed, and the stack refuses a
//! state of another seed); copies and selections share the cache (it never changes) but
//! own every tensor that a step updates in place.

use std::sync::Arc;

use tch::Tensor;

use crate::model::attention::LayerState;
use crate::model::clock::{BarIndex, ClockState};
use crate::model::favor_heads::HostFavor;
use crate::model::host::{HostLinear, HostNorm};
use crate::model::spe::{GateFactors, SineFactors};

/// Decoding state: everything needed to continue a batch of sequences at `position`.
/// With FAVOR+ its size is constant (per layer and head S (M x Dv) and z (M), f32, plus one
/// ring buffer of the last k noise columns per ConvSPE code, shared by the batch). A state
/// whose steps run on the host ([`crate::model::Transformer::step`]) also shares, with its
/// copies, one host copy of the weights, made by `begin`.
#[derive(Debug)]
pub struct RecurrentState {
    /// Absolute position of the next token.
    pub position: i64,
    /// Per layer: its memory of the positions so far.
    pub layers: Vec<LayerState>,
    /// Per ConvSPE code: (k, H, D, R); slot p mod k holds the noise column of position p.
    pub rings: Vec<Tensor>,
    /// The frozen seed the state was built with (rings depend on it).
    pub seed: u64,
    /// Sequences in the batch.
    pub batch: i64,
    /// With musical RoPE, per sequence: the clock after the tokens so far (empty
    /// otherwise; [`crate::model::clock`]).
    pub clock: Vec<ClockState>,
    /// With a bar embedding, per sequence: its bar index after the tokens so far (empty
    /// otherwise; [`crate::model::clock::BarIndex`]).
    pub bars: Vec<BarIndex>,
    /// What every step needs and no step changes, computed from the weights
    /// by [`crate::model::Transformer::begin_at`]: a state belongs to the weights it was
    /// begun with.
    pub(crate) cache: StepCache,
}

/// The position-independent factors of a step (see [`RecurrentState::cache`]).
#[derive(Debug)]
pub(crate) struct StepCache {
    /// Per SPE code: the SineSPE factors of the frozen noise (None for ConvSPE).
    pub sine: Vec<Option<SineFactors>>,
    /// Per layer: the gate of the gated SPE filter with the frozen xi.
    pub gates: Vec<Option<GateFactors>>,
    /// Host copies for the host step, where the model allows it.
    pub host: Option<Arc<HostStep>>,
}

/// What the host step reads: host copies of the weights and of the frozen factors of the
/// FAVOR+ heads.
#[derive(Debug)]
pub(crate) struct HostStep {
    pub favor: HostFavor,
    /// (V, d) token embeddings; None with a tied head, whose weight they are.
    pub embed: Option<Vec<f32>>,
    /// sqrt(d) with scaled embeddings.
    pub embed_scale: Option<f32>,
    /// (N + 1, d) bar embedding, with `bar_embedding`.
    pub bar_embed: Option<Vec<f32>>,
    pub layers: Vec<HostLayer>,
    pub final_norm: HostNorm,
    /// The output head (the embeddings when tied).
    pub head: HostLinear,
    /// d^-1/2 for the legacy scaled tied head.
    pub head_scale: Option<f32>,
}

/// One block's weights on the host.
#[derive(Debug)]
pub(crate) struct HostLayer {
    pub norm1: HostNorm,
    pub qkv: HostLinear,
    pub out: HostLinear,
    pub norm2: HostNorm,
    pub ff1: HostLinear,
    pub ff2: HostLinear,
    /// The FAVOR+ heads' write gate (d -> H' logits), with one.
    pub write_gate: Option<HostLinear>,
}

impl StepCache {
    /// Another handle on the same factors.
    pub fn share(&self) -> StepCache {
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
            layers: self.layers.iter().map(|l| l.map(Tensor::copy)).collect(),
            rings: self.rings.iter().map(|t| t.copy()).collect(),
            seed: self.seed,
            batch: self.batch,
            clock: self.clock.clone(),
            bars: self.bars.clone(),
            cache: self.cache.share(),
        }
    }

    /// Keeps (or repeats) the batch rows in `indices` (int64 1-D tensor on any device).
    pub fn select(&self, indices: &Tensor) -> RecurrentState {
        let rows = |t: &Tensor| t.index_select(0, &indices.to_device(t.device()));
        // the per-sequence host values, where the state has any
        let picked: Vec<usize> = if self.clock.is_empty() && self.bars.is_empty() {
            Vec::new()
        } else {
            Vec::<i64>::try_from(&indices.to_device(tch::Device::Cpu).view([-1]))
                .expect("int64 row indices")
                .into_iter()
                .map(|i| i as usize)
                .collect()
        };
        fn pick<T: Copy>(v: &[T], rows: &[usize]) -> Vec<T> {
            if v.is_empty() {
                Vec::new()
            } else {
                rows.iter().map(|&i| v[i]).collect()
            }
        }
        let (clock, bars) = (pick(&self.clock, &picked), pick(&self.bars, &picked));
        RecurrentState {
            position: self.position,
            layers: self.layers.iter().map(|l| l.map(rows)).collect(),
            rings: self.rings.iter().map(|t| t.copy()).collect(),
            seed: self.seed,
            batch: indices.size()[0],
            clock,
            bars,
            cache: self.cache.share(),
        }
    }
}
