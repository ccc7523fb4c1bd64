//! FAVOR+ (Performer) positive orthogonal random features and causal linear attention
//! (parallel forms, fused on the CPU and chunked elsewhere, and the recurrent form).
//! Everything here runs in f32.

// `a = a + b` is deliberate: tch's `+=` is an in-place add, which would write into
// tensors that autograd or a caller still holds.
#![allow(clippy::assign_op_pattern)]

use tch::{Device, Kind, Tensor};

use crate::model::ffi::unit_last_stride;
use crate::model::{cpu_f32, noise};

/// Denominator epsilon.
pub const EPS: f64 = 1e-6;

/// Random projection of a FAVOR+ layer.
#[derive(Debug)]
pub struct FavorFeatures {
    /// (n_dirs, dim) f32: orthogonal blocks with chi-distributed row norms.
    pub proj: Tensor,
    pub antithetic: bool,
}

impl FavorFeatures {
    /// Total number of features M.
    pub fn num_features(&self) -> i64 {
        let n = self.proj.size()[0];
        if self.antithetic {
            2 * n
        } else {
            n
        }
    }

    /// Projection directions for `features` M features (M/2 directions when antithetic).
    fn dirs(features: i64, antithetic: bool) -> i64 {
        if antithetic {
            features / 2
        } else {
            features
        }
    }

    /// Draws with torch's global RNG (training).
    pub fn draw(features: i64, dim: i64, antithetic: bool, device: Device) -> FavorFeatures {
        let n = Self::dirs(features, antithetic);
        let blocks = (n + dim - 1) / dim;
        let g = Tensor::randn([blocks, dim, dim], (Kind::Double, device));
        let chi = Tensor::randn([n, dim], (Kind::Double, device));
        FavorFeatures {
            proj: orthogonal_rows(&g, &chi, n),
            antithetic,
        }
    }

    /// Deterministic draw from (seed, layer).
    pub fn seeded(
        seed: u64,
        layer: u64,
        features: i64,
        dim: i64,
        antithetic: bool,
        device: Device,
    ) -> FavorFeatures {
        let n = Self::dirs(features, antithetic);
        let blocks = (n + dim - 1) / dim;
        let g = noise::keyed_randn(
            seed,
            noise::TAG_FAVOR,
            layer,
            0,
            &[blocks, dim, dim],
            Device::Cpu,
        )
        .to_kind(Kind::Double);
        let chi = noise::keyed_randn(seed, noise::TAG_FAVOR, layer, 1, &[n, dim], Device::Cpu)
            .to_kind(Kind::Double);
        FavorFeatures {
            proj: orthogonal_rows(&g, &chi, n).to_device(device),
            antithetic,
        }
    }

    /// phi(x) for x (..., dim) (already scaled by dim^(-1/4)); returns (..., M) f32.
    /// `query`: subtract the per-token max over features (exact: cancels in the ratio).
    /// Keys are not stabilized (a max over the sequence would leak the future).
    pub fn features(&self, x: &Tensor, query: bool) -> Tensor {
        self.scaled_features(x, 1.0, query)
    }

    /// [`FavorFeatures::features`] of `scale` x. On the CPU in f32 this is one C++
    /// autograd function (`src/model/favor_attention.cpp`: a product and a pass over
    /// the rows each way, where the libtorch form is some eight calls forward and
    /// twelve back); elsewhere [`FavorFeatures::features_libtorch`].
    pub fn scaled_features(&self, x: &Tensor, scale: f64, query: bool) -> Tensor {
        let sizes = self.proj.numel() > 0 && x.size().last().is_some_and(|&r| r > 0);
        if !(cpu_f32(x) && cpu_f32(&self.proj) && sizes) {
            return self.features_libtorch(&(x * scale), query);
        }
        let x = x.contiguous();
        let proj = self.proj.contiguous();
        // SAFETY: both are live tensor handles; the result is a new tensor or null.
        unsafe {
            crate::model::ffi::owned_result(
                crate::model::ffi::cadenza_favor_features(
                    x.as_ptr(),
                    proj.as_ptr(),
                    scale,
                    query,
                    self.antithetic,
                ),
                "fused FAVOR+ features",
            )
        }
    }

    /// [`FavorFeatures::features`] in libtorch calls (any device and kind).
    pub fn features_libtorch(&self, x: &Tensor, query: bool) -> Tensor {
        let x = crate::model::as_kind(x, Kind::Float);
        let u = x.matmul(&self.proj.tr());
        let sq = x.square().sum_dim_intlist([-1i64].as_slice(), true, None) / 2.0;
        let mut logits = if self.antithetic {
            Tensor::cat(&[&u - &sq, -&u - &sq], -1)
        } else {
            u - sq
        };
        if query {
            logits = &logits - logits.amax([-1i64].as_slice(), true).detach();
        }
        logits.exp() / (self.num_features() as f64).sqrt()
    }
}

/// [`FavorFeatures`] as a host copy, for a generation step on the host.
#[derive(Debug, Clone)]
pub struct HostFeatures {
    /// (n_dirs, dim) row-major.
    proj: Vec<f32>,
    dim: usize,
    /// M, as [`FavorFeatures::num_features`] counts them.
    features: usize,
    antithetic: bool,
}

impl FavorFeatures {
    /// A host copy of the projection (f32).
    pub fn host(&self) -> HostFeatures {
        HostFeatures {
            proj: crate::model::host_f32(&self.proj),
            dim: self.proj.size()[1] as usize,
            features: self.num_features() as usize,
            antithetic: self.antithetic,
        }
    }
}

impl HostFeatures {
    /// Total number of features M.
    pub fn num_features(&self) -> usize {
        self.features
    }

    /// [`FavorFeatures::features`] of one x (dim, already scaled) into out (M), by the same
    /// steps: u = proj x, logits u - |x|^2 / 2 (and -u - |x|^2 / 2 when antithetic), less
    /// their max for a query, exp, divided by sqrt(M).
    pub fn phi(&self, x: &[f32], query: bool, out: &mut [f32]) {
        let n = self.proj.len() / self.dim;
        let sq = x.iter().map(|v| v * v).sum::<f32>() / 2.0;
        for (j, row) in self.proj.chunks_exact(self.dim).enumerate() {
            let u = crate::model::host::dot(x, row);
            out[j] = u - sq;
            if self.antithetic {
                out[n + j] = -u - sq;
            }
        }
        if query {
            let max = out.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            out.iter_mut().for_each(|v| *v -= max);
        }
        let norm = (self.num_features() as f64).sqrt() as f32;
        out.iter_mut().for_each(|v| *v = v.exp() / norm);
    }
}

/// [`recurrent_step`] for one head of one sequence on the host, in place: s (M, Dv) +=
/// phi_k v^T, z (M) += phi_k, then out (Dv) = phi_q^T s / (phi_q . z + EPS).
pub fn host_recurrent_step(
    phi_q: &[f32],
    phi_k: &[f32],
    v: &[f32],
    s: &mut [f32],
    z: &mut [f32],
    out: &mut [f32],
) {
    let dv = v.len();
    out.fill(0.0);
    let mut den = 0f32;
    for (m, row) in s.chunks_exact_mut(dv).enumerate() {
        let (pk, pq) = (phi_k[m], phi_q[m]);
        z[m] += pk;
        den += pq * z[m];
        for ((sv, &vv), o) in row.iter_mut().zip(v).zip(out.iter_mut()) {
            *sv += pk * vv;
            *o += pq * *sv;
        }
    }
    let den = den + EPS as f32;
    out.iter_mut().for_each(|o| *o /= den);
}

/// Rows of orthogonal blocks (QR of Gaussian blocks), rescaled by chi norms (row norms of `chi`).
fn orthogonal_rows(g: &Tensor, chi: &Tensor, n: i64) -> Tensor {
    let (q, r) = Tensor::linalg_qr(g, "reduced"); // (blocks, dim, dim), orthonormal columns
                                                  // Fix the signs so that diag(R) > 0: then Q is Haar-distributed and each row is a uniform
                                                  // direction (LAPACK's Householder signs would otherwise bias the directions).
    let sign = r.diagonal(0, -2, -1).sign();
    let sign = sign.where_self(&sign.ne(0.0), &sign.ones_like());
    let q = q * sign.unsqueeze(-2);
    let dim = g.size()[1];
    let rows = q.transpose(-1, -2).reshape([-1, dim]).narrow(0, 0, n);
    let norms = chi
        .square()
        .sum_dim_intlist([-1i64].as_slice(), true, None)
        .sqrt();
    (rows * norms).to_kind(Kind::Float)
}

/// Causal linear attention: phi_q, phi_k (B, H, L, M) f32; v (B, H, L, Dv) f32;
/// optional carried state s0 (B, H, M, Dv), z0 (B, H, M). Returns (out (B, H, L,
/// Dv), s_end, z_end), out_i = phi_q_i S_i / (phi_q_i . z_i + EPS) with S_i = s0 +
/// sum_{j <= i} phi_k_j (x) v_j and z_i = z0 + sum_{j <= i} phi_k_j.
///
/// On the CPU ([`fused_applies`]) this is [`fused_causal_linear_attention`], one
/// C++ pass per (row, head) with its own backward; elsewhere (CUDA, f64, sizes
/// over 128) [`causal_linear_attention_chunked`] in chunks of `chunk` positions.
/// The two agree to float rounding (tests below). s_end and z_end carry no
/// gradient from the fused form.
pub fn causal_linear_attention(
    phi_q: &Tensor,
    phi_k: &Tensor,
    v: &Tensor,
    chunk: i64,
    state: Option<(&Tensor, &Tensor)>,
) -> (Tensor, Tensor, Tensor) {
    let state_fits = state.is_none_or(|(s, z)| cpu_f32(s) && cpu_f32(z));
    if cpu_f32(phi_q)
        && cpu_f32(phi_k)
        && cpu_f32(v)
        && state_fits
        && fused_applies(phi_q.size()[3], v.size()[3])
    {
        fused_causal_linear_attention(phi_q, phi_k, v, state)
    } else {
        causal_linear_attention_chunked(phi_q, phi_k, v, chunk, state)
    }
}

/// The sizes the fused kernel takes once padded: 16, 32, 64 or 128 features and
/// value widths ([`padded_size`]).
pub fn fused_applies(features: i64, dv: i64) -> bool {
    padded_size(features).is_some() && padded_size(dv).is_some()
}

/// The kernel's size for `n` features or value columns: the smallest of 16, 32,
/// 64 and 128 that holds them (the extra ones zero, which adds nothing to any
/// sum), or None over 128.
fn padded_size(n: i64) -> Option<i64> {
    [16, 32, 64, 128].into_iter().find(|&p| n <= p)
}

/// `t` with its last dimension zero-padded to `to` and a unit stride there, as
/// the fused kernel takes it (itself when it already is).
fn pad_last(t: &Tensor, to: i64) -> Tensor {
    let n = *t.size().last().expect("a tensor with dimensions");
    if n < to {
        t.constant_pad_nd([0, to - n])
    } else {
        unit_last_stride(t)
    }
}

/// [`causal_linear_attention`] as one libtorch autograd function
/// (`src/model/favor_attention.cpp`): each (row, head) is one pass over its
/// positions that carries the M x Dv state from one to the next, where the
/// chunked form is some twenty libtorch calls, each a pass over memory. M and
/// Dv are zero-padded to the kernel's sizes ([`padded_size`]) and the results
/// cut back. Gradients reach phi_q, phi_k, v and the initial state.
///
/// # Panics
/// On inputs that are not CPU f32 or whose sizes do not fit one another (a
/// caller's bug; [`causal_linear_attention`] routes only what fits here).
pub fn fused_causal_linear_attention(
    phi_q: &Tensor,
    phi_k: &Tensor,
    v: &Tensor,
    state: Option<(&Tensor, &Tensor)>,
) -> (Tensor, Tensor, Tensor) {
    let s = phi_q.size();
    assert!(
        s.len() == 4 && phi_k.size() == s && v.dim() == 4 && v.size()[..3] == s[..3],
        "fused FAVOR+ attention: phi_q {s:?}, phi_k {:?} and v {:?} do not fit",
        phi_k.size(),
        v.size()
    );
    let (b, h, m, dv) = (s[0], s[1], s[3], v.size()[3]);
    let (pm, pdv) = match (padded_size(m), padded_size(dv)) {
        (Some(pm), Some(pdv)) => (pm, pdv),
        _ => panic!("fused FAVOR+ attention: M = {m} and Dv = {dv} must be at most 128"),
    };
    let (pq, pk, pv) = (pad_last(phi_q, pm), pad_last(phi_k, pm), pad_last(v, pdv));
    let (s0, z0) = match state {
        // (a state that broadcasts over the batch or heads is expanded first; one of
        // another shape is refused before padding could hide it)
        Some((s0, z0)) => {
            let s0 = s0.f_expand([b, h, m, dv], false).unwrap_or_else(|_| {
                panic!("fused FAVOR+ attention: s0 {:?} does not fit", s0.size())
            });
            let z0 = z0.f_expand([b, h, m], false).unwrap_or_else(|_| {
                panic!("fused FAVOR+ attention: z0 {:?} does not fit", z0.size())
            });
            let s0 = if m < pm {
                pad_last(&pad_last(&s0, pdv).transpose(-1, -2), pm).transpose(-1, -2)
            } else {
                pad_last(&s0, pdv)
            };
            (s0.contiguous(), pad_last(&z0, pm).contiguous())
        }
        None => (
            Tensor::zeros([b, h, pm, pdv], (Kind::Float, Device::Cpu)),
            Tensor::zeros([b, h, pm], (Kind::Float, Device::Cpu)),
        ),
    };
    let mut out = [std::ptr::null_mut(); 3];
    // SAFETY: every pointer is a live tensor handle; on success the kernel writes three
    // new tensors to `out`, which owned_result takes over.
    let [o, s_end, z_end] = unsafe {
        let ok = crate::model::ffi::cadenza_favor_attention(
            pq.as_ptr(),
            pk.as_ptr(),
            pv.as_ptr(),
            s0.as_ptr(),
            z0.as_ptr(),
            out.as_mut_ptr(),
        );
        if !ok {
            panic!(
                "fused FAVOR+ attention: {}",
                crate::model::ffi::kernel_error()
            );
        }
        out.map(|t| crate::model::ffi::owned_result(t, "fused FAVOR+ attention"))
    };
    let cut = |t: Tensor, dim: i64, n: i64, padded: i64| {
        if n < padded {
            t.narrow(dim, 0, n)
        } else {
            t
        }
    };
    (
        cut(o, 3, dv, pdv),
        cut(cut(s_end, 3, dv, pdv), 2, m, pm),
        cut(z_end, 2, m, pm),
    )
}

/// Causal linear attention, chunked parallel form (the libtorch form of
/// [`causal_linear_attention`], which runs it off the CPU).
/// Inside a chunk: masked (phi_q phi_k^T) v; across chunks: exclusive prefix sums of the
/// per-chunk phi_k^T v (B, H, n_chunks, M, Dv). Never builds (B, H, L, M, Dv).
pub fn causal_linear_attention_chunked(
    phi_q: &Tensor,
    phi_k: &Tensor,
    v: &Tensor,
    chunk: i64,
    state: Option<(&Tensor, &Tensor)>,
) -> (Tensor, Tensor, Tensor) {
    let s = phi_q.size();
    let (b, h, l, m) = (s[0], s[1], s[2], s[3]);
    let dv = v.size()[3];
    let dev = phi_q.device();
    let c = chunk.min(l).max(1);
    let n = (l + c - 1) / c;
    let pad = n * c - l;
    let padf = |t: &Tensor| {
        if pad > 0 {
            t.constant_pad_nd([0, 0, 0, pad])
        } else {
            t.shallow_clone()
        }
    };
    let q = padf(phi_q).reshape([b, h, n, c, m]);
    let k = padf(phi_k).reshape([b, h, n, c, m]);
    let vv = padf(v).reshape([b, h, n, c, dv]);
    let mask = Tensor::ones([c, c], (Kind::Float, dev)).tril(0);
    let a = q.matmul(&k.transpose(-1, -2)) * mask; // (B, H, n, C, C)
    let mut num = a.matmul(&vv);
    let mut den = a.sum_dim_intlist([-1i64].as_slice(), true, None);
    let kv = k.transpose(-1, -2).matmul(&vv); // (B, H, n, M, Dv)
    let ks = k.sum_dim_intlist([-2i64].as_slice(), false, None); // (B, H, n, M)
    let kv_cum = kv.cumsum(2, None);
    let ks_cum = ks.cumsum(2, None);
    // The sums before each chunk: the inclusive ones shifted by a chunk, a zero
    // chunk in front and the last dropped, as one pad whose backward is one
    // crop (a narrow and a cat would zero-fill the whole of kv_cum's gradient).
    let mut s_prev = kv_cum.constant_pad_nd([0, 0, 0, 0, 1, -1]);
    let mut z_prev = ks_cum.constant_pad_nd([0, 0, 1, -1]);
    let mut s_end = kv_cum.select(2, n - 1);
    let mut z_end = ks_cum.select(2, n - 1);
    if let Some((s0, z0)) = state {
        s_prev = s_prev + s0.unsqueeze(2);
        z_prev = z_prev + z0.unsqueeze(2);
        s_end = s_end + s0;
        z_end = z_end + z0;
    }
    num = num + q.matmul(&s_prev);
    den = den + q.matmul(&z_prev.unsqueeze(-1));
    let out = (num / (den + EPS))
        .reshape([b, h, n * c, dv])
        .narrow(2, 0, l);
    (out, s_end, z_end)
}

/// One recurrent step: phi_q, phi_k (B, H, M), v (B, H, Dv); updates s (B, H, M, Dv), z (B, H, M)
/// in place-free fashion and returns (out (B, H, Dv), s', z').
pub fn recurrent_step(
    phi_q: &Tensor,
    phi_k: &Tensor,
    v: &Tensor,
    s: &Tensor,
    z: &Tensor,
) -> (Tensor, Tensor, Tensor) {
    let s = s + phi_k.unsqueeze(-1) * v.unsqueeze(-2);
    let z = z + phi_k;
    let num = phi_q.unsqueeze(-2).matmul(&s).squeeze_dim(-2);
    let den = (phi_q * &z).sum_dim_intlist([-1i64].as_slice(), true, None);
    (num / (den + EPS), s, z)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rel(a: &Tensor, b: &Tensor) -> f64 {
        (a - b).abs().max().double_value(&[]) / b.abs().max().double_value(&[]).max(1e-30)
    }

    #[test]
    fn favor_orthogonal_blocks() {
        let f = FavorFeatures::seeded(1, 0, 20, 8, false, Device::Cpu);
        let p = f.proj.to_kind(Kind::Double);
        assert_eq!(p.size(), [20, 8]);
        // rows within a block are orthogonal
        let b = p.narrow(0, 0, 8);
        let gram = b.matmul(&b.tr());
        let off = &gram - gram.diagonal(0, 0, 1).diag_embed(0, -2, -1);
        assert!(off.abs().max().double_value(&[]) < 1e-4, "not orthogonal");
        // same seed, same features; other seed differs
        let f2 = FavorFeatures::seeded(1, 0, 20, 8, false, Device::Cpu);
        assert_eq!(f.proj, f2.proj);
        assert_ne!(
            f.proj,
            FavorFeatures::seeded(2, 0, 20, 8, false, Device::Cpu).proj
        );
    }

    #[test]
    fn favor_kernel_estimate_is_unbiased() {
        // mean over redraws of phi(q).phi(k) (no query stabilizer) ~ exp(q.k)
        let dim = 8;
        let x = noise::keyed_randn(100, 0, 0, 0, &[6, dim], Device::Cpu) * 0.3;
        let y = noise::keyed_randn(100, 0, 0, 1, &[6, dim], Device::Cpu) * 0.3;
        let exact = (&x * &y)
            .sum_dim_intlist([-1i64].as_slice(), false, None)
            .exp();
        for anti in [false, true] {
            let mut acc = exact.zeros_like();
            let draws = 400;
            for i in 0..draws {
                let f = FavorFeatures::seeded(9, i, 64, dim, anti, Device::Cpu);
                acc += (f.features(&x, false) * f.features(&y, false)).sum_dim_intlist(
                    [-1i64].as_slice(),
                    false,
                    None,
                );
            }
            let est = acc / draws as f64;
            let e = rel(&est, &exact);
            assert!(e < 0.03, "antithetic={anti}: relative error {e}");
        }
    }

    #[test]
    fn favor_attention_approximates_softmax() {
        tch::manual_seed(6);
        let (b, h, l, d) = (1, 2, 24, 16);
        let q = Tensor::randn([b, h, l, d], (Kind::Float, Device::Cpu)) * 0.5;
        let k = Tensor::randn([b, h, l, d], (Kind::Float, Device::Cpu)) * 0.5;
        let v = Tensor::randn([b, h, l, d], (Kind::Float, Device::Cpu));
        let scores = q.matmul(&k.transpose(-1, -2)) / (d as f64).sqrt();
        let mask = Tensor::ones([l, l], (Kind::Bool, Device::Cpu)).triu(1);
        let exact = scores
            .masked_fill(&mask, f64::NEG_INFINITY)
            .softmax(-1, None)
            .matmul(&v);
        let f = FavorFeatures::seeded(3, 0, 4096, d, true, Device::Cpu);
        let sc = (d as f64).powf(-0.25);
        let (out, _, _) = causal_linear_attention(
            &f.features(&(&q * sc), true),
            &f.features(&(&k * sc), false),
            &v,
            8,
            None,
        );
        let e = (&out - &exact).norm().double_value(&[]) / exact.norm().double_value(&[]);
        assert!(e < 0.05, "FAVOR+ vs softmax relative error {e}");
    }

    #[test]
    fn favor_stabilizer_does_not_leak_future() {
        // Future keys aligned with a projection row give huge feature values; a key-side max over
        // the sequence would rescale (and with eps, change) the past outputs.
        tch::manual_seed(7);
        let (b, h, l, d, t) = (1, 1, 32, 64, 20);
        let f = FavorFeatures::seeded(4, 0, 64, d, false, Device::Cpu);
        let q = Tensor::randn([b, h, l, d], (Kind::Float, Device::Cpu)) * 0.3;
        let k = Tensor::randn([b, h, l, d], (Kind::Float, Device::Cpu)) * 0.3;
        let v = Tensor::randn([b, h, l, d], (Kind::Float, Device::Cpu));
        let (o1, _, _) =
            causal_linear_attention(&f.features(&q, true), &f.features(&k, false), &v, 8, None);
        let k2 = k.copy();
        let big = f
            .proj
            .get(0)
            .view([1, 1, 1, d])
            .expand([b, h, l - t, d], false);
        k2.narrow(2, t, l - t).copy_(&big);
        let v2 = v.copy();
        let _ = v2.narrow(2, t, l - t).fill_(100.0);
        let (o2, _, _) =
            causal_linear_attention(&f.features(&q, true), &f.features(&k2, false), &v2, 8, None);
        let e = rel(&o2.narrow(2, 0, t), &o1.narrow(2, 0, t));
        assert!(e < 1e-6, "past outputs changed: {e}");
        assert!(rel(&o2, &o1) > 1e-2, "the test perturbation had no effect");
    }

    #[test]
    fn favor_chunked_equals_recurrent_and_chunk_invariant() {
        tch::manual_seed(8);
        let (b, h, l, m, dv) = (2, 3, 37, 16, 5);
        let pq = Tensor::rand([b, h, l, m], (Kind::Float, Device::Cpu));
        let pk = Tensor::rand([b, h, l, m], (Kind::Float, Device::Cpu));
        let v = Tensor::randn([b, h, l, dv], (Kind::Float, Device::Cpu));
        let (o_ref, s_ref, z_ref) = causal_linear_attention_chunked(&pq, &pk, &v, 64, None);
        for c in [1, 5, 8, 37] {
            let (o, s, z) = causal_linear_attention_chunked(&pq, &pk, &v, c, None);
            assert!(
                rel(&o, &o_ref) < 1e-5 && rel(&s, &s_ref) < 1e-5 && rel(&z, &z_ref) < 1e-5,
                "chunk {c}"
            );
        }
        let mut s = Tensor::zeros([b, h, m, dv], (Kind::Float, Device::Cpu));
        let mut z = Tensor::zeros([b, h, m], (Kind::Float, Device::Cpu));
        for i in 0..l {
            let (o, s2, z2) =
                recurrent_step(&pq.select(2, i), &pk.select(2, i), &v.select(2, i), &s, &z);
            assert!(rel(&o, &o_ref.select(2, i)) < 1e-5, "step {i}");
            s = s2;
            z = z2;
        }
        // split into a carried prefix and a suffix
        let (_, s1, z1) = causal_linear_attention_chunked(
            &pq.narrow(2, 0, 10),
            &pk.narrow(2, 0, 10),
            &v.narrow(2, 0, 10),
            4,
            None,
        );
        let (o2, _, _) = causal_linear_attention_chunked(
            &pq.narrow(2, 10, l - 10),
            &pk.narrow(2, 10, l - 10),
            &v.narrow(2, 10, l - 10),
            4,
            Some((&s1, &z1)),
        );
        assert!(rel(&o2, &o_ref.narrow(2, 10, l - 10)) < 1e-5);
    }

    /// The chunked form's gradients are those of the definition,
    /// out_i = sum_{j<=i} (q_i . k_j) v_j / (sum_{j<=i} q_i . k_j + EPS), for chunks that do
    /// and do not divide L (and one chunk, where no sums are carried).
    #[test]
    fn favor_chunked_gradients_match_the_definition() {
        tch::manual_seed(9);
        let (b, h, l, m, dv) = (2, 2, 13, 6, 3);
        let leaf = |s: &[i64], pos: bool| {
            let t = if pos {
                Tensor::rand(s, (Kind::Double, Device::Cpu)) + 0.1
            } else {
                Tensor::randn(s, (Kind::Double, Device::Cpu))
            };
            t.set_requires_grad(true)
        };
        let (pq, pk, v) = (
            leaf(&[b, h, l, m], true),
            leaf(&[b, h, l, m], true),
            leaf(&[b, h, l, dv], false),
        );
        let w = Tensor::randn([b, h, l, dv], (Kind::Double, Device::Cpu));
        let grads = |out: Tensor| {
            for t in [&pq, &pk, &v] {
                let mut g = t.grad();
                if g.defined() {
                    let _ = g.zero_();
                }
            }
            (out * &w).sum(Kind::Double).backward();
            [pq.grad().copy(), pk.grad().copy(), v.grad().copy()]
        };
        let mask = Tensor::ones([l, l], (Kind::Double, Device::Cpu)).tril(0);
        let a = pq.matmul(&pk.transpose(-1, -2)) * mask;
        let want = grads(a.matmul(&v) / (a.sum_dim_intlist([-1i64].as_slice(), true, None) + EPS));
        for c in [1, 4, 5, 13] {
            let got = grads(causal_linear_attention(&pq, &pk, &v, c, None).0);
            for (g, w) in got.iter().zip(&want) {
                assert!(rel(g, w) < 1e-9, "chunk {c}: {}", rel(g, w));
            }
        }
    }

    /// The fused kernel against the chunked form in f64: outputs, final states and the
    /// gradients of all five inputs, with sizes it pads and sizes it takes as they are,
    /// values with strides (as the model's are, cut from its projections), a carried
    /// state and a prefix/suffix split.
    #[test]
    fn fused_attention_matches_the_chunked_form() {
        tch::manual_seed(10);
        let (b, h, l) = (2, 3, 37);
        for (m, dv) in [(16, 5), (64, 64), (20, 40), (100, 32)] {
            let f32 = (Kind::Float, Device::Cpu);
            let leaf = |t: Tensor| t.set_requires_grad(true);
            let pq = leaf(Tensor::rand([b, h, l, m], f32));
            let pk = leaf(Tensor::rand([b, h, l, m], f32));
            let v = leaf(Tensor::randn([b, l, h, dv], f32));
            let s0 = leaf(Tensor::rand([b, h, m, dv], f32));
            let z0 = leaf(Tensor::rand([b, h, m], f32) + 1.0);
            let w = Tensor::randn([b, h, l, dv], f32);
            let inputs = [&pq, &pk, &v, &s0, &z0];
            let run = |fused: bool| {
                for t in inputs {
                    let mut g = t.grad();
                    if g.defined() {
                        let _ = g.zero_();
                    }
                }
                let vh = v.permute([0, 2, 1, 3]);
                let (o, s, z) = if fused {
                    fused_causal_linear_attention(&pq, &pk, &vh, Some((&s0, &z0)))
                } else {
                    let d = |t: &Tensor| t.to_kind(Kind::Double);
                    let (o, s, z) = causal_linear_attention_chunked(
                        &d(&pq),
                        &d(&pk),
                        &d(&vh),
                        8,
                        Some((&d(&s0), &d(&z0))),
                    );
                    (o, s.detach(), z.detach())
                };
                (&o * &w).sum(Kind::Double).backward();
                let mut got = vec![o.detach(), s, z];
                got.extend(inputs.iter().map(|t| t.grad().copy()));
                got
            };
            let (got, want) = (run(true), run(false));
            // a prefix, then the rest from its final state, is the whole
            let (vh, cut) = (v.permute([0, 2, 1, 3]).detach(), 10);
            let part = |t: &Tensor, from: i64, n: i64| t.detach().narrow(2, from, n);
            let (_, s1, z1) = fused_causal_linear_attention(
                &part(&pq, 0, cut),
                &part(&pk, 0, cut),
                &part(&vh, 0, cut),
                Some((&s0.detach(), &z0.detach())),
            );
            let (rest, _, _) = fused_causal_linear_attention(
                &part(&pq, cut, l - cut),
                &part(&pk, cut, l - cut),
                &part(&vh, cut, l - cut),
                Some((&s1, &z1)),
            );
            let e = rel(&rest, &got[0].narrow(2, cut, l - cut));
            assert!(e < 1e-5, "M {m}, Dv {dv}: split off by {e}");
            let names = ["out", "s_end", "z_end", "dpq", "dpk", "dv", "ds0", "dz0"];
            for ((g, w), name) in got.iter().zip(&want).zip(names) {
                assert_eq!(g.size(), w.size(), "M {m}, Dv {dv}: {name}");
                let e = rel(&g.to_kind(Kind::Double), w);
                assert!(e < 1e-5, "M {m}, Dv {dv}: {name} off by {e}");
            }
        }
    }

    /// Features of queries and keys, uniform in [0, 1).
    fn rand_features(shape: &[i64]) -> (Tensor, Tensor) {
        let f32 = (Kind::Float, Device::Cpu);
        (Tensor::rand(shape, f32), Tensor::rand(shape, f32))
    }

    /// Without a state it starts from zeros; an empty call returns the state it was given.
    #[test]
    fn fused_attention_from_zero_and_over_no_positions() {
        tch::manual_seed(11);
        let f32 = (Kind::Float, Device::Cpu);
        let (pq, pk) = rand_features(&[1, 2, 9, 32]);
        let v = Tensor::randn([1, 2, 9, 16], f32);
        let (o, s, z) = fused_causal_linear_attention(&pq, &pk, &v, None);
        let (o2, s2, z2) = causal_linear_attention_chunked(&pq, &pk, &v, 4, None);
        assert!(rel(&o, &o2) < 1e-5 && rel(&s, &s2) < 1e-5 && rel(&z, &z2) < 1e-5);
        let none = |t: &Tensor| t.narrow(2, 0, 0);
        let (o3, s3, z3) =
            fused_causal_linear_attention(&none(&pq), &none(&pk), &none(&v), Some((&s, &z)));
        assert_eq!(o3.size(), [1, 2, 0, 16]);
        assert!(rel(&s3, &s) == 0.0 && rel(&z3, &z) == 0.0);
    }

    /// Keys with fewer features than the queries are refused, not padded to fit.
    #[test]
    #[should_panic(expected = "do not fit")]
    fn fused_attention_rejects_keys_of_another_width() {
        let f32 = (Kind::Float, Device::Cpu);
        let v = Tensor::rand([1, 2, 4, 16], f32);
        let _ = fused_causal_linear_attention(
            &Tensor::rand([1, 2, 4, 20], f32),
            &Tensor::rand([1, 2, 4, 18], f32),
            &v,
            None,
        );
    }

    /// A state that broadcasts over the batch, as the chunked form takes it.
    #[test]
    fn fused_attention_takes_a_broadcast_state() {
        tch::manual_seed(13);
        let f32 = (Kind::Float, Device::Cpu);
        let (pq, pk) = rand_features(&[3, 2, 6, 16]);
        let v = Tensor::randn([3, 2, 6, 16], f32);
        let (s0, z0) = (
            Tensor::rand([1, 2, 16, 16], f32),
            Tensor::rand([1, 2, 16], f32),
        );
        let got = fused_causal_linear_attention(&pq, &pk, &v, Some((&s0, &z0))).0;
        let want = causal_linear_attention_chunked(&pq, &pk, &v, 4, Some((&s0, &z0))).0;
        assert!(rel(&got, &want) < 1e-5);
    }

    #[test]
    #[should_panic(expected = "does not fit")]
    fn fused_attention_rejects_a_state_of_another_shape() {
        let f32 = (Kind::Float, Device::Cpu);
        let p = Tensor::rand([1, 2, 4, 16], f32);
        let v = Tensor::rand([1, 2, 4, 16], f32);
        let (s0, z0) = (
            Tensor::zeros([1, 3, 16, 16], f32),
            Tensor::zeros([1, 3, 16], f32),
        );
        let _ = fused_causal_linear_attention(&p, &p, &v, Some((&s0, &z0)));
    }

    /// The fused features against their libtorch form: values and the gradients of x
    /// and of the projection, for queries and keys, plain and antithetic.
    #[test]
    fn fused_features_match_the_libtorch_form() {
        tch::manual_seed(12);
        for antithetic in [false, true] {
            for query in [false, true] {
                let f = FavorFeatures::seeded(4, 0, 48, 20, antithetic, Device::Cpu);
                let proj = f.proj.copy().set_requires_grad(true);
                let f = FavorFeatures { proj, antithetic };
                let x = (Tensor::randn([2, 3, 11, 20], (Kind::Float, Device::Cpu)) * 0.7)
                    .set_requires_grad(true);
                let w = Tensor::randn([2, 3, 11, 48], (Kind::Float, Device::Cpu));
                let sc = 20f64.powf(-0.25);
                let run = |fused: bool| {
                    for t in [&x, &f.proj] {
                        let mut g = t.grad();
                        if g.defined() {
                            let _ = g.zero_();
                        }
                    }
                    let phi = if fused {
                        f.scaled_features(&x, sc, query)
                    } else {
                        f.features_libtorch(&(&x * sc), query)
                    };
                    (&phi * &w).sum(Kind::Float).backward();
                    [phi.detach(), x.grad().copy(), f.proj.grad().copy()]
                };
                let (got, want) = (run(true), run(false));
                for (g, w, name) in [
                    (&got[0], &want[0], "phi"),
                    (&got[1], &want[1], "dx"),
                    (&got[2], &want[2], "dproj"),
                ] {
                    assert_eq!(g.size(), w.size());
                    let e = rel(g, w);
                    assert!(
                        e < 1e-5,
                        "antithetic {antithetic}, query {query}: {name} off by {e}"
                    );
                }
            }
        }
    }
}
