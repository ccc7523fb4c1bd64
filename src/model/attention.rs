//! The attention sublayer of a block: the q, k, v projection (`attn_qkv.*`, with an optional
//! short causal convolution `qkv_conv`), the positional treatment of the queries and keys
//! (the SPE filter with its gate `spe_gate`, RoPE for RoPE local heads), the local softmax
//! heads ([`LocalHeads`]), the global heads (FAVOR+, [`FavorHeads`], or exact softmax), and
//! the output projection (`attn_out.*`).
//!
//! Head layout: heads 0..hl are local, hl..h global. SPE filters heads h0..h: with RoPE
//! local heads (h0 = hl) only the global ones, which the local ones then skip; otherwise
//! (h0 = 0) every head, the local ones taking their queries and keys from the filtered ones.
//!
//! Invariants:
//! * [`Attention::step`] on one position after a state carried over positions 0..p gives
//!   the output [`Attention::forward`] gives at p over the whole sequence (same noise): the
//!   state ([`LayerState`]) holds exactly what later positions read (FAVOR+ sums, the
//!   softmax reference's KV cache, the local heads' ring, the convolution's tail).
//! * Causality: the output at a position depends on that position and earlier ones only.
//! * Nothing here draws random numbers: the noise of a call (SPE codes, gate xi, FAVOR+
//!   projection) comes in through [`LayerNoise`], drawn or frozen by the stack.

// `a = a + b` is deliberate: tch's `+=` is an in-place add, which would write into
// tensors that autograd or a caller still holds.
#![allow(clippy::assign_op_pattern)]

use std::cell::OnceCell;

use tch::{nn, Kind, Tensor};

use crate::model::clock::ClockState;
use crate::model::config::MusicalRope;
use crate::model::config::{LocalPosition, ModelConfig, PositionalEncoding};
use crate::model::favor::FavorFeatures;
use crate::model::favor_heads::{FavorHeads, FeatureMap};
use crate::model::local::{host_step_ok, window_attention, KvRing, LocalHeads, UNBOUNDED};
use crate::model::precision::dense;
use crate::model::rope::{
    apply_rope, apply_rope_libtorch, musical_rope_tables, rope_tables, turn_of,
};
use crate::model::spe::{sine_filter, spe_filter_each, spe_filter_with, GateFactors, SineFactors};
use crate::model::{as_kind, host_f32, linear, residual_std};

/// One layer's recurrent memory: what its later positions read of the earlier ones.
#[derive(Debug)]
pub struct LayerState {
    /// The global heads' memory.
    pub heads: GlobalState,
    /// With a short convolution: the last k-1 projected q, k, v rows (B, k-1, 3d), zeros
    /// before the first token.
    pub conv_tail: Option<Tensor>,
    /// With local heads: their keys and values of the last positions, in a ring of
    /// `local_window` slots ([`KvRing`]).
    pub window: Option<KvRing>,
}

/// The memory of the global heads of a layer.
#[derive(Debug)]
pub enum GlobalState {
    /// FAVOR+: S = sum phi(k) v^T (B, H', M, Dv), z = sum phi(k) (B, H', M), f32.
    Favor { s: Tensor, z: Tensor },
    /// Softmax reference: growing KV cache (B, H, T, dk) and (B, H, T, Dv).
    Softmax { k: Tensor, v: Tensor },
}

impl LayerState {
    /// The same state with `f` applied to every tensor (copies, batch rows).
    pub fn map(&self, f: impl Fn(&Tensor) -> Tensor) -> LayerState {
        LayerState {
            heads: match &self.heads {
                GlobalState::Favor { s, z } => GlobalState::Favor { s: f(s), z: f(z) },
                GlobalState::Softmax { k, v } => GlobalState::Softmax { k: f(k), v: f(v) },
            },
            conv_tail: self.conv_tail.as_ref().map(&f),
            window: self.window.as_ref().map(|r| r.map(&f)),
        }
    }
}

/// One SPE code over a call's window of positions, as the filters take it.
pub enum WindowCode {
    /// Stored codes (qbar, kbar), each (L, H, D, R).
    Stored(Tensor, Tensor),
    /// Stored codes of every sequence's own positions (SPE in musical time), each
    /// (B, L, H, D, R).
    PerSequence(Tensor, Tensor),
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
            WindowCode::PerSequence(qbar, kbar) => (
                spe_filter_each(q, qbar, gate),
                spe_filter_each(k, kbar, gate),
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

/// The random quantities one call gives a layer, drawn (training) or frozen by the stack.
pub struct LayerNoise<'a> {
    /// This layer's SPE code over the call's positions (None without SPE).
    pub code: Option<&'a WindowCode>,
    /// The gated filter's factors, of the filtered heads h0..h.
    pub gate: Option<GateFactors>,
    /// The FAVOR+ projection (None for softmax attention).
    pub features: Option<&'a FavorFeatures>,
}

/// The positions of a call, shared by its layers.
pub struct Positions {
    /// Absolute position of the call's first token.
    pub offset: i64,
    /// RoPE tables of the call's positions, formed when a layer first needs them.
    pub rope: OnceCell<(Tensor, Tensor)>,
    /// Whether a generation step may run RoPE local heads on the host
    /// ([`LocalHeads::host_step`]: CPU f32, where the ring allows it).
    pub ring_on_host: bool,
    /// With musical RoPE: its settings and the coordinates of the call's tokens, one row
    /// per sequence ([`crate::model::clock`]).
    pub musical: Option<(MusicalRope, Vec<Vec<ClockState>>)>,
}

impl Positions {
    /// The positions of a call starting at `offset`, no RoPE tables formed yet.
    pub fn new(offset: i64, ring_on_host: bool) -> Positions {
        Positions {
            offset,
            rope: OnceCell::new(),
            ring_on_host,
            musical: None,
        }
    }

    /// The RoPE tables of the call's `l` positions for heads of width `hd`: (L, hd) on the
    /// token index, (B, 1, L, hd) with musical coordinates.
    fn rope_tables(&self, l: i64, hd: i64, dev: tch::Device) -> &(Tensor, Tensor) {
        self.rope.get_or_init(|| match &self.musical {
            Some((m, coords)) => musical_rope_tables(coords, self.offset, hd, m, dev),
            None => rope_tables(self.offset, l, hd, dev),
        })
    }

    /// The pair turns of a one-token call, one list per sequence (one shared list on the
    /// token index).
    pub(crate) fn turns(&self, hd: i64) -> Vec<Vec<(f32, f32)>> {
        match &self.musical {
            Some((m, coords)) => coords
                .iter()
                .map(|row| turn_of(Some(m), hd, self.offset, row[0]))
                .collect(),
            None => vec![turn_of(None, hd, self.offset, ClockState::default())],
        }
    }
}

/// The global heads of a layer.
#[derive(Debug)]
enum GlobalHeads {
    Favor(FavorHeads),
    /// Exact causal softmax over every earlier position: a window without bound.
    Softmax,
}

/// The queries, keys and values of a call after their positional treatment.
struct Heads {
    /// Queries, keys of the local heads (B, hl, L, dl), and their values (B, hl, L, hd);
    /// None for the queries and keys of a host ring step, which turns them itself.
    local_qk: Option<(Tensor, Tensor)>,
    local_v: Option<Tensor>,
    /// Queries and keys of the global heads, (B, H', L, dk), and values (B, H', L, hd).
    q: Tensor,
    k: Tensor,
    v: Tensor,
    /// The global heads' write gates (B, H', L), with a write gate.
    write: Option<Tensor>,
    /// The RoPE tables of the Taylor map's projections ((L, n) each), with `taylor_rope`.
    turns: Option<(Tensor, Tensor)>,
}

/// The attention sublayer (see the module docs).
#[derive(Debug)]
pub struct Attention {
    /// d -> 3d: q, k, v of every head.
    pub qkv: nn::Linear,
    /// d -> d output projection.
    pub out: nn::Linear,
    /// (H, D) gate logits of the gated SPE filter.
    pub gate: Option<Tensor>,
    /// (3d, k) taps of the short causal convolution over the projected q, k, v
    /// (`ModelConfig::short_conv`); tap k-1 weighs the current token.
    pub conv: Option<Tensor>,
    /// d -> H' logits of the FAVOR+ heads' write gate (`ModelConfig::favor_write_gate`).
    pub write_gate: Option<nn::Linear>,
    /// With the Taylor map (`ModelConfig::taylor_dim` n): the query and key projections
    /// `taylor_q`, `taylor_k`, (H', dk, n) each.
    pub taylor: Option<(Tensor, Tensor)>,
    /// RoPE on the Taylor map's projections (`ModelConfig::taylor_rope`).
    taylor_rope: bool,
    local: Option<LocalHeads>,
    global: GlobalHeads,
    /// d_model, heads, head width.
    dims: (i64, i64, i64),
    /// Key width of the global heads (R with SPE).
    qk_dim: i64,
    /// The first head SPE filters.
    h0: i64,
}

/// The gate logits `spe_gate` (H, D), N(0, 1), of a layer with a gated SPE filter.
/// (Made before the layer's own SPE code and its other weights, in the order their
/// initializations draw from libtorch's generator.)
pub(crate) fn spe_gate(cfg: &ModelConfig, layer: &nn::Path) -> Option<Tensor> {
    let gated = match &cfg.positional {
        PositionalEncoding::SpeSine { gated, .. } | PositionalEncoding::SpeConv { gated, .. } => {
            *gated
        }
        _ => false,
    };
    gated.then(|| {
        layer.var(
            "spe_gate",
            &[cfg.n_heads, cfg.head_dim()],
            nn::Init::Randn {
                mean: 0.0,
                stdev: 1.0,
            },
        )
    })
}

/// The first head SPE filters (see the module docs).
pub(crate) fn spe_first_head(cfg: &ModelConfig) -> i64 {
    if cfg.local_heads > 0 && cfg.local_position == LocalPosition::Rope {
        cfg.local_heads
    } else {
        0
    }
}

impl Attention {
    /// `qkv_conv` (identity at initialization), `attn_qkv.*` (std 0.02) and `attn_out.*`
    /// (std 0.02 / sqrt(2 n_layers)) under `vs`, the layer's path; `gate` from [`spe_gate`].
    pub fn new(cfg: &ModelConfig, vs: &nn::Path, gate: Option<Tensor>) -> Attention {
        let d = cfg.d_model;
        let conv = (cfg.short_conv > 0).then(|| {
            // identity at initialization: the current token's tap is 1, the others 0
            let w = vs.var("qkv_conv", &[3 * d, cfg.short_conv], nn::Init::Const(0.0));
            tch::no_grad(|| {
                let _ = w.narrow(1, cfg.short_conv - 1, 1).fill_(1.0);
            });
            w
        });
        let qkv = linear(vs.sub("attn_qkv"), d, 3 * d, 0.02);
        let out = linear(vs.sub("attn_out"), d, d, residual_std(cfg));
        let global_heads = cfg.n_heads - cfg.local_heads;
        // zero weights and bias (no draw from the generator): every gate 1/2, which the
        // normalisation of the read cancels
        let write_gate = cfg.favor_write_gate.then(|| {
            let p = vs.sub("write_gate");
            nn::Linear {
                ws: p.var("weight", &[global_heads, d], nn::Init::Const(0.0)),
                bs: Some(p.var("bias", &[global_heads], nn::Init::Const(0.0))),
            }
        });
        let local = (cfg.local_heads > 0).then_some(LocalHeads {
            heads: cfg.local_heads,
            window: cfg.local_window,
            dk: cfg.local_qk_dim(),
        });
        let global = match cfg.linear_features() {
            Some(features) => GlobalHeads::Favor(FavorHeads {
                chunk: cfg.chunk_size,
                features,
            }),
            None => GlobalHeads::Softmax,
        };
        // N(0, 1/dk): s = f_q . f_k starts at the scale of q . k / sqrt(dk)
        let taylor = cfg.taylor_dim.map(|n| {
            let dk = cfg.qk_dim();
            let init = nn::Init::Randn {
                mean: 0.0,
                stdev: (dk as f64).powf(-0.5),
            };
            (
                vs.var("taylor_q", &[global_heads, dk, n], init),
                vs.var("taylor_k", &[global_heads, dk, n], init),
            )
        });
        Attention {
            qkv,
            out,
            gate,
            conv,
            write_gate,
            taylor,
            taylor_rope: cfg.taylor_rope,
            local,
            global,
            dims: (d, cfg.n_heads, cfg.head_dim()),
            qk_dim: cfg.qk_dim(),
            h0: spe_first_head(cfg),
        }
    }

    /// Changes the chunk length of the chunked linear attention.
    pub fn set_chunk_size(&mut self, chunk: i64) {
        if let GlobalHeads::Favor(f) = &mut self.global {
            f.chunk = chunk;
        }
    }

    /// The zero state (empty past) of a batch of `batch` sequences.
    pub fn begin(&self, batch: i64) -> LayerState {
        let (_, h, hd) = self.dims;
        let device = self.qkv.ws.device();
        let f = (Kind::Float, device);
        let hl = self.local.map_or(0, |l| l.heads);
        let heads = match &self.global {
            GlobalHeads::Favor(fh) => GlobalState::Favor {
                s: Tensor::zeros([batch, h - hl, fh.features, hd], f),
                z: Tensor::zeros([batch, h - hl, fh.features], f),
            },
            GlobalHeads::Softmax => GlobalState::Softmax {
                k: Tensor::zeros([batch, h, 0, self.qk_dim], f),
                v: Tensor::zeros([batch, h, 0, hd], f),
            },
        };
        let conv_tail = self.conv.as_ref().map(|w| {
            let (c, k) = w.size2().expect("(3d, k) taps");
            Tensor::zeros([batch, k - 1, c], (self.kind(), device))
        });
        let window = self
            .local
            .map(|l| KvRing::new(batch, l.heads, l.window, l.dk, hd, f));
        LayerState {
            heads,
            conv_tail,
            window,
        }
    }

    /// The parameters' kind, which the output keeps.
    fn kind(&self) -> Kind {
        self.qkv.ws.kind()
    }

    /// (B, L, d) normalized rows -> (B, L, d), training, evaluation or a prefill: with a
    /// `state` the call continues it and advances it.
    pub fn forward(
        &self,
        x: &Tensor,
        noise: &LayerNoise,
        pos: &Positions,
        state: Option<&mut LayerState>,
    ) -> Tensor {
        self.attend(x, noise, pos, state, false)
    }

    /// One position per sequence, (B, 1, d) normalized rows -> (B, 1, d): the recurrence
    /// on `state`, the same output as [`Attention::forward`] over the whole sequence.
    pub fn step(
        &self,
        x: &Tensor,
        noise: &LayerNoise,
        pos: &Positions,
        state: &mut LayerState,
    ) -> Tensor {
        self.attend(x, noise, pos, Some(state), true)
    }

    fn attend(
        &self,
        x: &Tensor,
        noise: &LayerNoise,
        pos: &Positions,
        mut state: Option<&mut LayerState>,
        step: bool,
    ) -> Tensor {
        let (b, l, _) = x.size3().expect("(B, L, d)");
        let (d, _, hd) = self.dims;
        let tail = state.as_deref_mut().and_then(|s| s.conv_tail.as_mut());
        let qkv = self.project(x, tail); // (B, L, 3d)
        let on_host = step
            && pos.ring_on_host
            && state
                .as_deref()
                .and_then(|s| s.window.as_ref())
                .is_some_and(host_step_ok);
        // the layer's projections on the host, for the host ring step
        let rows = on_host.then(|| host_f32(&qkv));
        let mut heads = self.position_heads(&qkv, b, l, noise, pos, on_host);
        heads.write = self.write_gates(x); // (B, H', L)
                                           // the turns of the Taylor map's projections, on the token index
        heads.turns = self
            .taylor
            .as_ref()
            .filter(|_| self.taylor_rope)
            .map(|(tq, _)| {
                rope_tables(pos.offset, l, tq.size()[2], x.device()) // (L, n) each
            });
        let local = self.local.map(|lh| {
            let ring = state.as_deref_mut().map(|s| {
                s.window
                    .as_mut()
                    .expect("a state begun by this model has a window per layer")
            });
            if on_host {
                let rows = rows.as_deref().expect("on_host: rows taken above");
                let ring = ring.expect("on_host: checked above");
                return lh.host_step(rows, b, d, hd, &pos.turns(hd), ring);
            }
            let (lq, lk) = heads.local_qk.as_ref().expect("local queries and keys");
            let lv = heads.local_v.as_ref().expect("hl > 0");
            lh.forward(lq, lk, lv, ring, self.kind()) // (B, hl, L, hd)
        });
        let global = state.map(|s| &mut s.heads);
        let att = self.global_heads(&heads, local, noise, global, step); // (B, L, H, hd)
        dense(&att.reshape([b, l, d]), &self.out) // (B, L, d)
    }

    /// The write gates of the FAVOR+ heads for (B, L, d) normalized rows: (B, H', L) in
    /// (0, 1), f32; None without a write gate.
    fn write_gates(&self, x: &Tensor) -> Option<Tensor> {
        self.write_gate.as_ref().map(|w| {
            as_kind(&dense(x, w), Kind::Float)
                .sigmoid()
                .permute([0, 2, 1])
        })
    }

    /// (B, L, d) -> (B, L, 3d) projected q, k, v, through the short convolution when the
    /// layer has one (continuing and advancing `tail`).
    fn project(&self, x: &Tensor, tail: Option<&mut Tensor>) -> Tensor {
        let qkv = dense(x, &self.qkv); // (B, L, 3d)
        match &self.conv {
            Some(w) => short_conv(&qkv, w, tail),
            None => qkv,
        }
    }

    /// The heads of (B, L, 3d) projections after their positional treatment: RoPE for
    /// RoPE local heads (not for a host ring step, which turns them itself), the SPE filter
    /// on heads h0..h; then the local heads split off the rest.
    fn position_heads(
        &self,
        qkv: &Tensor,
        b: i64,
        l: i64,
        noise: &LayerNoise,
        pos: &Positions,
        on_host: bool,
    ) -> Heads {
        let (d, h, hd) = self.dims;
        let (h0, hl) = (self.h0, self.local.map_or(0, |l| l.heads));
        // (split, not narrow: the backward of a split is one concatenation, that of
        // each narrow a zero-filled gradient of the whole of qkv, then their sum)
        let [q, k, v] = <[Tensor; 3]>::try_from(qkv.split(d, -1)).expect("3 parts of d");
        let q = q.view([b, l, h, hd]); // (B, L, H, hd)
        let k = k.view([b, l, h, hd]); // (B, L, H, hd)
        let v = v.view([b, l, h, hd]).permute([0, 2, 1, 3]); // (B, H, L, hd)
                                                             // RoPE local heads take their own queries and keys; SPE filters heads h0..h: only
                                                             // the global heads then, every head otherwise (the local ones taken from it below).
        let (q, k, rope_qk) = if h0 > 0 {
            // (h0 = hl: the RoPE heads are the local ones)
            let ((lq, q), (lk, k)) = (split_heads(&q, 2, h0), split_heads(&k, 2, h0));
            let qk = (!on_host).then(|| {
                let t = pos.rope_tables(l, hd, qkv.device());
                let (lq, lk) = (lq.expect("h0 > 0"), lk.expect("h0 > 0"));
                // (per-sequence musical tables go through libtorch's broadcast)
                let turn = if pos.musical.is_some() {
                    apply_rope_libtorch
                } else {
                    apply_rope
                };
                (
                    turn(&lq.permute([0, 2, 1, 3]), t), // (B, hl, L, hd)
                    turn(&lk.permute([0, 2, 1, 3]), t), // (B, hl, L, hd)
                )
            });
            (q, k, qk)
        } else {
            (q, k, None)
        };
        let (qa, ka) = match noise.code {
            // (the codes are those of heads h0..h already: see Transformer::window_codes)
            Some(code) => code.filter(&q, &k, noise.gate.as_ref()), // (B, H - h0, L, R)
            None => (q.permute([0, 2, 1, 3]), k.permute([0, 2, 1, 3])), // (B, H, L, hd)
        };
        // qa and ka start at head h0, so they hold local heads only when h0 = 0
        let (local_v, v) = split_heads(&v, 1, hl);
        let ((lqa, qa), (lka, ka)) = if h0 == 0 {
            (split_heads(&qa, 1, hl), split_heads(&ka, 1, hl))
        } else {
            ((None, qa), (None, ka))
        };
        let local_qk = rope_qk.or_else(|| lqa.zip(lka));
        Heads {
            local_qk,
            local_v,
            q: qa,
            k: ka,
            v,
            write: None,
            turns: None,
        }
    }

    /// The global heads over `heads`, joined after the `local` heads' outputs
    /// (B, hl, L, hd): (B, L, H, hd) in the parameters' kind.
    fn global_heads(
        &self,
        heads: &Heads,
        local: Option<Tensor>,
        noise: &LayerNoise,
        state: Option<&mut GlobalState>,
        step: bool,
    ) -> Tensor {
        let (_, h, _) = self.dims;
        let hl = self.local.map_or(0, |l| l.heads);
        let kind = self.kind();
        let (q, k, v) = (&heads.q, &heads.k, &heads.v);
        let (write, turns) = (heads.write.as_ref(), heads.turns.as_ref());
        match &self.global {
            GlobalHeads::Favor(_) if hl == h => local.expect("local heads").permute([0, 2, 1, 3]),
            GlobalHeads::Favor(fh) => {
                let feats = match &self.taylor {
                    Some((q, k)) => FeatureMap::Taylor { q, k, rope: turns },
                    None => {
                        FeatureMap::Favor(noise.features.expect("FAVOR+ features for every layer"))
                    }
                };
                let out = match state {
                    Some(GlobalState::Favor { s, z }) if step => {
                        fh.step(q, k, v, write, feats, s, z)
                    }
                    Some(GlobalState::Favor { s, z }) => {
                        fh.forward(q, k, v, write, feats, Some((s, z)))
                    }
                    Some(_) => unreachable!("state/attention mismatch"),
                    None => fh.forward(q, k, v, write, feats, None),
                }; // (B, H', L, hd)
                let out = as_kind(&out, kind).permute([0, 2, 1, 3]); // (B, L, H', hd)
                match local {
                    // (B, L, H, hd) in one copy, which the reshape after it then
                    // views: a concatenation over heads would be a second one
                    Some(l) => Tensor::cat(&[&l.permute([0, 2, 1, 3]), &out], 2),
                    None => out,
                }
            }
            GlobalHeads::Softmax => {
                let cache = match state {
                    Some(GlobalState::Softmax { k, v }) => Some((k, v)),
                    Some(_) => unreachable!("state/attention mismatch"),
                    None => None,
                };
                let out = window_attention(
                    &as_kind(q, Kind::Float),
                    &as_kind(k, Kind::Float),
                    &as_kind(v, Kind::Float),
                    UNBOUNDED,
                    cache,
                ); // (B, H, L, hd)
                as_kind(&out, kind).permute([0, 2, 1, 3])
            }
        }
    }
}

/// `t` cut along `dim` into its first `n` entries (`None` when `n` is 0) and the rest,
/// as views from one split: its backward is one concatenation, where that of two
/// `narrow`s would zero-fill a gradient of the whole of `t` for each and add them.
pub(crate) fn split_heads(t: &Tensor, dim: i64, n: i64) -> (Option<Tensor>, Tensor) {
    if n == 0 {
        return (None, t.shallow_clone());
    }
    let rest = t.size()[dim as usize] - n;
    let [first, rest] =
        <[Tensor; 2]>::try_from(t.split_with_sizes([n, rest], dim)).expect("two parts");
    (Some(first), rest)
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
