//! The FAVOR+ heads of a layer: causal linear attention over the SPE-filtered (or plain)
//! queries and keys, through positive random features (Performer), or through the
//! second-order Taylor map of exp ([`FeatureMap::Taylor`], `ModelConfig::taylor_dim`).
//!
//! Invariants:
//! * Queries and keys enter the feature map scaled by dk^-1/4 (dk = R with SPE, the head
//!   width otherwise); features, prefix sums and the state are f32 whatever the model's kind.
//! * The parallel form ([`FavorHeads::forward`], chunked or fused) and the recurrence
//!   ([`FavorHeads::step`], one token: z += phi(k); S += phi(k) v^T; out = phi(q) S /
//!   (phi(q) . z)) give the same outputs; a state carried between calls makes any split of
//!   a sequence give the outputs of the whole.
//! * The host step ([`host_favor_step`]) is the same math as the SPE filter, the feature
//!   map and [`recurrent_step`], in f32, summed in another order.

// `a = a * b` is deliberate: tch's `*=` is an in-place product, which would write into
// tensors that autograd still holds (the feature map keeps its output for its backward).
#![allow(clippy::assign_op_pattern)]

use tch::{Kind, Tensor};

use crate::model::cpu_f32;
use crate::model::favor::{
    causal_linear_attention, host_recurrent_step, recurrent_step, FavorFeatures, HostFeatures,
};
use crate::model::spe::{host_filter, HostSine};

/// The feature map of a layer's linear heads, for one call.
#[derive(Debug, Clone, Copy)]
pub enum FeatureMap<'a> {
    /// FAVOR+'s positive random features, drawn per layer.
    Favor(&'a FavorFeatures),
    /// The Taylor map on queries and keys projected by `q` and `k`, (H', dk, n) each, the
    /// projections turned by the RoPE tables `rope` ((L, n) each) when given.
    Taylor {
        q: &'a Tensor,
        k: &'a Tensor,
        rope: Option<&'a (Tensor, Tensor)>,
    },
}

/// The second-order Taylor map of exp of x (B, H', L, dk) projected by `proj` (H', dk, n),
/// turned by the RoPE tables `rope` ((L, n) each, [`crate::model::rope::rope_tables`])
/// when given, and scaled by n^-1/4: f = x proj n^-1/4, phi = [1, f, vec(f f^T) / sqrt 2],
/// (B, H', L, 1 + n + n^2) f32, so that phi(q) . phi(k) = 1 + s + s^2 / 2 with s = f_q .
/// f_k, which is at least 1/2: the read's denominator never comes near zero.
pub fn taylor_features(x: &Tensor, proj: &Tensor, rope: Option<&(Tensor, Tensor)>) -> Tensor {
    let n = proj.size()[2];
    let mut f = crate::model::as_kind(x, Kind::Float)
        .matmul(&crate::model::as_kind(proj, Kind::Float).unsqueeze(0))
        * (n as f64).powf(-0.25); // (B, H', L, n)
    if let Some(t) = rope {
        f = crate::model::rope::apply_rope_libtorch(&f, t);
    }
    let outer =
        (f.unsqueeze(-1) * f.unsqueeze(-2)).flatten(-2, -1) * std::f64::consts::FRAC_1_SQRT_2; // (B, H', L, n^2)
    Tensor::cat(&[f.ones_like().narrow(-1, 0, 1), f, outer], -1)
}

/// The FAVOR+ heads of a layer (those after its local heads). They own no parameters:
/// their projection is drawn per layer ([`FavorFeatures`]) and passed in per call.
#[derive(Debug, Clone, Copy)]
pub struct FavorHeads {
    /// Chunk length of the chunked linear attention.
    pub chunk: i64,
    /// Random features M per head.
    pub features: i64,
}

impl FavorHeads {
    /// The feature maps of q, k (B, H', L, dk) (FAVOR+'s of q and k scaled by dk^-1/4), the
    /// keys' weighed by their `write` gates (B, H', L) when there are some, and v (B, H',
    /// L, Dv), in f32.
    fn features(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        write: Option<&Tensor>,
        map: FeatureMap,
    ) -> [Tensor; 3] {
        let (pq, mut pk) = match map {
            FeatureMap::Favor(feats) => {
                let sc = (q.size()[3] as f64).powf(-0.25);
                (
                    feats.scaled_features(q, sc, true),  // (B, H', L, M)
                    feats.scaled_features(k, sc, false), // (B, H', L, M)
                )
            }
            FeatureMap::Taylor { q: tq, k: tk, rope } => {
                (taylor_features(q, tq, rope), taylor_features(k, tk, rope))
            }
        };
        if let Some(g) = write {
            pk = pk * g.unsqueeze(-1); // (B, H', L, M)
        }
        let vf = crate::model::as_kind(v, Kind::Float); // (B, H', L, Dv)
        [pq, pk, vf]
    }

    /// Causal linear attention of q, k (B, H', L, dk) and v (B, H', L, Dv), the keys
    /// written with weights `write` (B, H', L) when given, -> (B, H', L, Dv) f32. With a
    /// `state` (s (B, H', M, Dv), z (B, H', M)) the sums start from it, and it is replaced
    /// by the sums after the last position.
    pub fn forward(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        write: Option<&Tensor>,
        map: FeatureMap,
        state: Option<(&mut Tensor, &mut Tensor)>,
    ) -> Tensor {
        let [pq, pk, vf] = Self::features(q, k, v, write, map);
        match state {
            Some((s, z)) => {
                let (o, s2, z2) =
                    causal_linear_attention(&pq, &pk, &vf, self.chunk, Some((&*s, &*z)));
                *s = s2;
                *z = z2;
                o
            }
            None => causal_linear_attention(&pq, &pk, &vf, self.chunk, None).0,
        } // (B, H', L, Dv)
    }

    /// One position: q, k (B, H', 1, dk), v (B, H', 1, Dv), `write` gates (B, H', 1) ->
    /// (B, H', 1, Dv) f32, the recurrence on s (B, H', M, Dv) and z (B, H', M), which it
    /// replaces.
    #[allow(clippy::too_many_arguments)]
    pub fn step(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        write: Option<&Tensor>,
        map: FeatureMap,
        s: &mut Tensor,
        z: &mut Tensor,
    ) -> Tensor {
        let [pq, pk, vf] = Self::features(q, k, v, write, map);
        let (o, s2, z2) = recurrent_step(
            &pq.squeeze_dim(2), // (B, H', M)
            &pk.squeeze_dim(2), // (B, H', M)
            &vf.squeeze_dim(2), // (B, H', Dv)
            s,
            z,
        );
        *s = s2;
        *z = z2;
        o.unsqueeze(2) // (B, H', 1, Dv)
    }
}

/// What [`host_favor_step`] reads, as host copies of the frozen factors of the FAVOR+ heads.
pub(crate) struct HostFavor {
    /// Per SineSPE code (one when shared).
    pub codes: Vec<HostSine>,
    /// Per layer, with a gated filter: a (H', D) and xi_b (H', D, R).
    pub gates: Vec<Option<(Vec<f32>, Vec<f32>)>>,
    /// Per layer: the frozen FAVOR+ projection.
    pub features: Vec<HostFeatures>,
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
/// state update): the same math as [`crate::model::spe::spe_filter_with`], [`FavorFeatures::features`] and
/// [`recurrent_step`], in f32, summed in another order. `qkv` is the layer's projection for
/// this position, (B, 3 * H * D) rows; `codes` are this position's (qbar, kbar) of the
/// FAVOR+ heads, each (H', D, R): one per sequence (SPE in musical time) or one for all of
/// them. `write`: the write gates (B, H') of this position, with a write gate. The state
/// s (B, H', M, D) and z (B, H', M) is updated in place
/// (made contiguous first if it is not). Returns the outputs (B, H', D).
#[allow(clippy::too_many_arguments)]
pub(crate) fn host_favor_step(
    qkv: &[f32],
    batch: usize,
    hl: usize,
    h: usize,
    dim: usize,
    host: &HostFavor,
    layer: usize,
    codes: &[(Vec<f32>, Vec<f32>)],
    write: Option<&[f32]>,
    s: &mut Tensor,
    z: &mut Tensor,
) -> Vec<f32> {
    let hf = h - hl;
    let d_model = h * dim;
    assert!(
        codes.len() == 1 || codes.len() == batch,
        "one SPE code per sequence, or one for all"
    );
    assert!(
        write.is_none_or(|g| g.len() == batch * hf),
        "one write gate per sequence and FAVOR+ head"
    );
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
    let r = codes[0].0.len() / (hf * dim);
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
        let code = &codes[if codes.len() == 1 { 0 } else { b }];
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
            if let Some(g) = write {
                pk.iter_mut().for_each(|p| *p *= g[st]);
            }
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

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    #[test]
    fn a_closed_write_gate_leaves_the_token_out_of_every_later_read() {
        tch::manual_seed(3);
        let (b, h, l, dk) = (1, 2, 9, 8);
        let feats = FavorFeatures::draw(16, dk, false, Device::Cpu);
        let heads = FavorHeads {
            chunk: 4,
            features: 16,
        };
        let q = Tensor::randn([b, h, l, dk], (Kind::Float, Device::Cpu));
        let k = Tensor::randn([b, h, l, dk], (Kind::Float, Device::Cpu));
        let v = Tensor::randn([b, h, l, dk], (Kind::Float, Device::Cpu));
        // positions 2 and 5 closed, the others open
        let open: Vec<f32> = (0..l)
            .map(|i| if i == 2 || i == 5 { 0.0 } else { 1.0 })
            .collect();
        let g = Tensor::from_slice(&open)
            .view([1, 1, l])
            .expand([b, h, l], true);
        let gated = heads.forward(&q, &k, &v, Some(&g), FeatureMap::Favor(&feats), None);
        // the same reads over the open positions only, by the definition
        let sc = (dk as f64).powf(-0.25);
        let pq = feats.scaled_features(&q, sc, true);
        let pk = feats.scaled_features(&k, sc, false);
        for i in 0..l {
            let kept: Vec<i64> = (0..=i).filter(|&j| open[j as usize] == 1.0).collect();
            let idx = Tensor::from_slice(&kept);
            let w = pq
                .narrow(2, i, 1)
                .matmul(&pk.index_select(2, &idx).transpose(-1, -2)); // (B, H, 1, n)
            let want = w.matmul(&v.index_select(2, &idx))
                / (w.sum_dim_intlist([-1i64].as_slice(), true, None) + crate::model::favor::EPS);
            let got = gated.narrow(2, i, 1);
            let e = (&got - &want).abs().max().double_value(&[]);
            assert!(e < 1e-4, "position {i}: {e}");
        }
        // and the recurrence agrees, step by step
        let s_m = 16;
        let mut s = Tensor::zeros([b, h, s_m, dk], (Kind::Float, Device::Cpu));
        let mut z = Tensor::zeros([b, h, s_m], (Kind::Float, Device::Cpu));
        for i in 0..l {
            let at = |t: &Tensor| t.narrow(2, i, 1);
            let o = heads.step(
                &at(&q),
                &at(&k),
                &at(&v),
                Some(&at(&g)),
                FeatureMap::Favor(&feats),
                &mut s,
                &mut z,
            );
            let e = (&o - gated.narrow(2, i, 1)).abs().max().double_value(&[]);
            assert!(e < 1e-4, "step {i}: {e}");
        }
    }

    #[test]
    fn the_taylor_map_is_the_second_order_expansion_of_exp() {
        tch::manual_seed(4);
        let f = (Kind::Double, Device::Cpu);
        let (h, dk, n) = (2, 6, 3);
        let (q, k) = (
            Tensor::randn([1, h, 5, dk], f),
            Tensor::randn([1, h, 7, dk], f),
        );
        let (pq, pk) = (Tensor::randn([h, dk, n], f), Tensor::randn([h, dk, n], f));
        let (fq, fk) = (
            taylor_features(&q, &pq, None),
            taylor_features(&k, &pk, None),
        );
        assert_eq!(fq.size(), [1, h, 5, 1 + n + n * n]);
        // s = (q Pq) . (k Pk) / sqrt n, and phi(q) . phi(k) = 1 + s + s^2 / 2
        let s = q
            .matmul(&pq.unsqueeze(0))
            .matmul(&k.matmul(&pk.unsqueeze(0)).transpose(-1, -2))
            / (n as f64).sqrt();
        let want = s.ones_like() + &s + s.square() / 2.0;
        let got = fq.matmul(&fk.transpose(-1, -2)).to_kind(Kind::Double);
        let e = (&got - &want).abs().max().double_value(&[]);
        let scale = want.abs().max().double_value(&[]);
        assert!(e < 1e-5 * scale, "{e} of {scale}");
        // positive everywhere, at least 1/2
        assert!(got.min().double_value(&[]) >= 0.5 - 1e-6);
    }
}
