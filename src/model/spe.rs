//! Stochastic Positional Encoding (Liutkus et al., 2021): SineSPE, ConvSPE and the gated filter.
//!
//! Layout conventions: a *code* for a window of L positions is a pair (qbar, kbar) of
//! (L, H, D, R) tensors (no batch dimension: noise is shared across the batch). Queries and
//! keys are (B, L, H, D); after the filter they are (B, H, L, R).
//!
//! On the CPU in f32 the filter is a fused autograd function (`spe_filter.cpp`, next to
//! this file): [`fused_filter`] over stored codes, and [`sine_filter`], which forms
//! SineSPE's codes inside and never stores them or their gradient. Invariant: both give
//! what [`spe_filter_libtorch`] gives over [`SineSpe::codes_from`]'s codes, values and
//! gradients, up to the order of float sums (the tests allow 1e-5 and 2e-5 relative).

use std::f64::consts::PI;

use tch::{nn, Device, Kind, Tensor};

use crate::model::config::{FreqInit, SPREAD_MAX_PERIOD, SPREAD_MIN_PERIOD};
use crate::model::ffi::{self, owned_result, unit_last_stride};
use crate::model::{cpu_f32, host_f32, noise};

/// Periodic SPE: learned sines per (head, feature).
#[derive(Debug)]
pub struct SineSpe {
    /// (H, D, K): frequency logits; f = sigmoid(freqs) / 2 cycles per position.
    pub freqs: Tensor,
    /// (H, D, K): phase offsets (query side only).
    pub offsets: Tensor,
    /// (H, D, K): gain logits; amplitude softplus(gains).
    pub gains: Tensor,
    pub heads: i64,
    pub dim: i64,
    pub sines: i64,
    pub realizations: i64,
}

impl SineSpe {
    pub fn new(
        p: &nn::Path,
        heads: i64,
        dim: i64,
        sines: i64,
        realizations: i64,
        init: FreqInit,
    ) -> SineSpe {
        let shape = [heads, dim, sines];
        let freqs = p.var(
            "freqs",
            &shape,
            nn::Init::Randn {
                mean: -4.0,
                stdev: 1.0,
            },
        );
        if init == FreqInit::Spread {
            tch::no_grad(|| {
                let mut f = freqs.shallow_clone();
                f.copy_(&spread_freq_logits(&shape, freqs.kind(), freqs.device()));
            });
        }
        let offsets = p.var(
            "offsets",
            &shape,
            nn::Init::Randn {
                mean: 0.0,
                stdev: 1.0,
            },
        );
        let gains = p.var(
            "gains",
            &shape,
            nn::Init::Randn {
                mean: 0.0,
                stdev: 1.0,
            },
        );
        // gains rescaled by 2 / sqrt(||gains||_2 over K)
        tch::no_grad(|| {
            let norm = gains
                .square()
                .sum_dim_intlist([-1i64].as_slice(), true, None)
                .sqrt();
            let scaled = &gains * 2.0 / norm.sqrt();
            let mut g = gains.shallow_clone();
            g.copy_(&scaled);
        });
        SineSpe {
            freqs,
            offsets,
            gains,
            heads,
            dim,
            sines,
            realizations,
        }
    }

    /// Z ~ N(0,1)/sqrt(2K), shape (H, D, 2K, R), drawn from torch's global RNG.
    pub fn draw_z(&self) -> Tensor {
        let opts = (self.freqs.kind(), self.freqs.device());
        Tensor::randn(
            [self.heads, self.dim, 2 * self.sines, self.realizations],
            opts,
        ) / ((2 * self.sines) as f64).sqrt()
    }

    /// Deterministic Z for (seed, code index).
    pub fn frozen_z(&self, seed: u64, code: u64) -> Tensor {
        let shape = [self.heads, self.dim, 2 * self.sines, self.realizations];
        noise::keyed_randn(
            seed,
            noise::TAG_SINE_Z,
            code,
            0,
            &shape,
            self.freqs.device(),
        )
        .to_kind(self.freqs.kind())
            / ((2 * self.sines) as f64).sqrt()
    }

    /// Frequencies in cycles per position, (H, D, K).
    pub fn frequencies(&self) -> Tensor {
        self.freqs.sigmoid() / 2.0
    }

    /// The implied kernel P_d(delta) for each delta: (n_delta, H, D), in the params' kind.
    pub fn kernel(&self, deltas: &[i64]) -> Tensor {
        let dev = self.freqs.device();
        let f = self.frequencies().to_kind(Kind::Double);
        let th = self.offsets.to_kind(Kind::Double);
        let g2 = self.gains.to_kind(Kind::Double).softplus().square();
        let dl: Vec<f64> = deltas.iter().map(|&d| d as f64).collect();
        let dl = Tensor::from_slice(&dl).to_device(dev).view([-1, 1, 1, 1]);
        let ph = f.unsqueeze(0) * dl * (2.0 * PI) + th.unsqueeze(0);
        (ph.cos() * g2.unsqueeze(0)).sum_dim_intlist([-1i64].as_slice(), false, None)
            / (2 * self.sines) as f64
    }

    /// Codes for positions start..start+len with noise z (H, D, 2K, R): (qbar, kbar), each (L, H, D, R).
    pub fn codes(&self, start: i64, len: i64, z: &Tensor) -> (Tensor, Tensor) {
        self.codes_from(&self.factors(z), start, len)
    }

    /// The parts of the codes that do not depend on the position, for noise z.
    pub fn factors(&self, z: &Tensor) -> SineFactors {
        let (h, d, k, r) = (self.heads, self.dim, self.sines, self.realizations);
        // softplus(gains) duplicated in the interleaved order of z's 2K axis
        let g = self.gains.softplus();
        let g = Tensor::stack(&[&g, &g], -1).reshape([h, d, 2 * k, 1]);
        SineFactors {
            cycles: self.frequencies().to_kind(Kind::Double).unsqueeze(0),
            offsets: self.offsets.unsqueeze(0),
            // The (R D)^-1/4 scale is folded into this small factor rather than
            // applied to the (L, H, D, R) codes: one pass less over them.
            zg: z * g * ((r * d) as f64).powf(-0.25),
        }
    }

    /// [`SineSpe::codes`] from precomputed [`SineSpe::factors`] (of every head, or of the
    /// heads [`SineFactors::heads`] kept: the codes then have as many).
    pub fn codes_from(&self, f: &SineFactors, start: i64, len: i64) -> (Tensor, Tensor) {
        let (qo, ko) = self.omegas(f, start, len);
        Self::codes_of(f, qo, ko, len)
    }

    /// The codes (qbar, kbar), each (N, H, D, R), of any N positions `at` (f64 (N,), on
    /// the parameters' device; SPE in musical time): the same steps as
    /// [`SineSpe::codes_from`], which is this at start..start+len.
    pub fn codes_at(&self, f: &SineFactors, at: &Tensor) -> (Tensor, Tensor) {
        let (qo, ko) = self.omegas_at(f, at);
        Self::codes_of(f, qo, ko, at.size()[0])
    }

    /// Codes from the query's and key's [`SineSpe::omegas`] of `len` positions.
    fn codes_of(f: &SineFactors, qo: Tensor, ko: Tensor, len: i64) -> (Tensor, Tensor) {
        let mk = |o: Tensor| -> Tensor {
            if len == 1 {
                // A generation step: H * D products of (1, 2K) by (2K, R) are too small for a
                // batched matmul (libtorch loops over them one scalar at a time, 4x slower
                // than this broadcast): (1, H, D, 2K, 1) * (H, D, 2K, R), summed over 2K.
                return (o.unsqueeze(-1) * &f.zg).sum_dim_intlist([-2i64].as_slice(), false, None);
            }
            // (H, D, L, 2K) x (H, D, 2K, R) -> (H, D, L, R) -> (L, H, D, R)
            o.permute([1, 2, 0, 3])
                .matmul(&f.zg)
                .permute([2, 0, 1, 3])
                .contiguous()
        };
        (mk(qo), mk(ko))
    }

    /// The interleaved cosines and sines [cos_0, sin_0, cos_1, ...] of the phases of
    /// positions start..start+len, queries' and keys', each (L, H, D, 2K): a code is
    /// these times [`SineFactors`]' zg, summed over 2K.
    pub fn omegas(&self, f: &SineFactors, start: i64, len: i64) -> (Tensor, Tensor) {
        let dev = self.freqs.device();
        self.omegas_at(
            f,
            &Tensor::arange_start(start, start + len, (Kind::Double, dev)),
        )
    }

    /// [`SineSpe::omegas`] of any N positions `at`, f64 (N,) on the parameters' device.
    pub fn omegas_at(&self, f: &SineFactors, at: &Tensor) -> (Tensor, Tensor) {
        let kind = self.freqs.kind();
        let (h, d, k) = (f.zg.size()[0], self.dim, self.sines);
        let len = at.size()[0];
        // f * m in cycles is formed in f64 and reduced mod 1 (frac has unit gradient) before
        // going back to the params' kind: large positions keep their phase precision while the
        // cos/sin tensors saved for backward stay in f32.
        let pos = at.to_kind(Kind::Double).view([-1, 1, 1, 1]);
        let cycles = (&f.cycles * pos).frac().to_kind(kind); // (L, H, D, K)
        let kph = cycles * (2.0 * PI);
        let qph = &kph + &f.offsets;
        let omega =
            |ph: &Tensor| Tensor::stack(&[ph.cos(), ph.sin()], -1).reshape([len, h, d, 2 * k]);
        (omega(&qph), omega(&kph))
    }
}

/// The position-independent parts of SineSPE codes for one noise draw z:
/// computed once per generation (a recurrent step needs the code of one
/// position only) and on every call otherwise.
#[derive(Debug)]
pub struct SineFactors {
    /// (1, H, D, K) f64: frequencies in cycles per position.
    cycles: Tensor,
    /// (1, H, D, K): phase offsets of the query side.
    offsets: Tensor,
    /// (H, D, 2K, R): z times the gains, times (R D)^-1/4.
    zg: Tensor,
}

impl SineFactors {
    /// The factors of heads start..start+n only: their codes cost n / H of all of them.
    pub fn heads(&self, start: i64, n: i64) -> SineFactors {
        SineFactors {
            cycles: self.cycles.narrow(1, start, n),
            offsets: self.offsets.narrow(1, start, n),
            zg: self.zg.narrow(0, start, n),
        }
    }

    /// Another handle on the same tensors.
    pub fn share(&self) -> SineFactors {
        SineFactors {
            cycles: self.cycles.shallow_clone(),
            offsets: self.offsets.shallow_clone(),
            zg: self.zg.shallow_clone(),
        }
    }
}

/// [`SineFactors`] as host copies, for a generation step done on the host
/// ([`SineFactors::host`], [`HostSine::code_at`]).
#[derive(Debug, Clone)]
pub struct HostSine {
    /// (H, D, K) f64: frequencies in cycles per position.
    cycles: Vec<f64>,
    /// (H, D, K): phase offsets of the query side.
    offsets: Vec<f32>,
    /// (H, D, 2K, R): z times the gains, times (R D)^-1/4.
    zg: Vec<f32>,
    sines: usize,
    realizations: usize,
}

impl SineFactors {
    /// Host copies of the factors (CPU f32 parameters).
    pub fn host(&self) -> HostSine {
        HostSine {
            cycles: Vec::<f64>::try_from(&self.cycles.contiguous().view([-1])).expect("f64 cycles"),
            offsets: host_f32(&self.offsets),
            zg: host_f32(&self.zg),
            sines: *self.cycles.size().last().expect("(1, H, D, K)") as usize,
            realizations: *self.zg.size().last().expect("(H, D, 2K, R)") as usize,
        }
    }
}

impl HostSine {
    /// The code of one position, (H, D, R): what [`SineSpe::codes_from`] gives for
    /// `len` = 1, by the same steps (cycles in f64 reduced mod 1, then f32 phases), summed in
    /// another order. `query` adds the offsets (qbar); keys take none (kbar).
    pub fn code_at(&self, position: i64, query: bool) -> Vec<f32> {
        let (k, r) = (self.sines, self.realizations);
        let rows = self.cycles.len() / k; // H * D
        let two_pi = (2.0 * PI) as f32;
        let mut code = vec![0f32; rows * r];
        for (row, out) in code.chunks_exact_mut(r).enumerate() {
            for j in 0..k {
                let cycles = (self.cycles[row * k + j] * position as f64).fract() as f32;
                let mut phase = cycles * two_pi;
                if query {
                    phase += self.offsets[row * k + j];
                }
                let (sin, cos) = phase.sin_cos();
                // z's 2K axis interleaves [cos_0, sin_0, cos_1, sin_1, ...]
                let zc = &self.zg[(row * 2 * k + 2 * j) * r..][..r];
                let zs = &self.zg[(row * 2 * k + 2 * j + 1) * r..][..r];
                for ((o, &c), &s) in out.iter_mut().zip(zc).zip(zs) {
                    *o += cos * c + sin * s;
                }
            }
        }
        code
    }
}

/// Frequency logits whose periods 1/f (f = sigmoid(logit) / 2) are log-uniform between
/// [`SPREAD_MIN_PERIOD`] and [`SPREAD_MAX_PERIOD`] tokens, drawn from torch's RNG.
pub fn spread_freq_logits(shape: &[i64], kind: Kind, device: Device) -> Tensor {
    let (lo, hi) = (SPREAD_MIN_PERIOD.ln(), SPREAD_MAX_PERIOD.ln());
    let period = (Tensor::rand(shape, (Kind::Double, device)) * (hi - lo) + lo).exp();
    let two_f = period.reciprocal() * 2.0; // in (0, 1)
    (&two_f / (-&two_f + 1.0)).log().to_kind(kind)
}

/// Finite-support SPE: two depthwise filters over the same white noise.
#[derive(Debug)]
pub struct ConvSpe {
    /// (H, D, k) query filter.
    pub filter_q: Tensor,
    /// (H, D, k) key filter.
    pub filter_k: Tensor,
    pub heads: i64,
    pub dim: i64,
    pub kernel: i64,
    pub realizations: i64,
}

impl ConvSpe {
    pub fn new(p: &nn::Path, heads: i64, dim: i64, kernel: i64, realizations: i64) -> ConvSpe {
        let up = 1.0 / (kernel as f64 / 2.0).sqrt();
        let shape = [heads, dim, kernel];
        let filter_q = p.var("filter_q", &shape, nn::Init::Uniform { lo: 0.0, up });
        let filter_k = p.var("filter_k", &shape, nn::Init::Uniform { lo: 0.0, up });
        ConvSpe {
            filter_q,
            filter_k,
            heads,
            dim,
            kernel,
            realizations,
        }
    }

    /// Shape of one noise column (one position).
    pub fn column_shape(&self) -> [i64; 3] {
        [self.heads, self.dim, self.realizations]
    }

    /// Training noise for a window of `len` positions: (len + k - 1, H, D, R) from torch's RNG.
    pub fn draw_noise(&self, len: i64) -> Tensor {
        let opts = (self.filter_q.kind(), self.filter_q.device());
        Tensor::randn(
            [
                len + self.kernel - 1,
                self.heads,
                self.dim,
                self.realizations,
            ],
            opts,
        )
    }

    /// Frozen noise for positions start-k+1 .. start+len-1 (len + k - 1 columns).
    pub fn frozen_noise(&self, seed: u64, code: u64, start: i64, len: i64) -> Tensor {
        noise::conv_noise_columns(
            seed,
            code,
            start - self.kernel + 1,
            len + self.kernel - 1,
            &self.column_shape(),
            self.filter_q.device(),
            self.filter_q.kind(),
        )
    }

    /// Implied kernel P_d(delta) = sum_j fq[j] fk[j + delta]: (n_delta, H, D).
    pub fn kernel(&self, deltas: &[i64]) -> Tensor {
        let k = self.kernel;
        let out: Vec<Tensor> =
            deltas
                .iter()
                .map(|&dl| {
                    if dl.abs() >= k {
                        return self.filter_q.select(2, 0).zeros_like();
                    }
                    let n = k - dl.abs();
                    let (qs, ks) = if dl >= 0 { (0, dl) } else { (-dl, 0) };
                    (self.filter_q.narrow(2, qs, n) * self.filter_k.narrow(2, ks, n))
                        .sum_dim_intlist([-1i64].as_slice(), false, None)
                })
                .collect();
        Tensor::stack(&out, 0)
    }

    /// Codes from a noise window (L + k - 1, H, D, R): position m (window index t) is
    /// sum_j f[j] noise[t + j], i.e. noise of positions m-k+1 ..= m. Returns (qbar, kbar), (L, H, D, R).
    pub fn codes_from_noise(&self, noise: &Tensor) -> (Tensor, Tensor) {
        let (h, d, k, r) = (self.heads, self.dim, self.kernel, self.realizations);
        let lw = noise.size()[0];
        let len = lw - k + 1;
        let x = noise.permute([3, 1, 2, 0]).reshape([r, h * d, lw]);
        let scale = ((r * d) as f64).powf(-0.25);
        let mk = |f: &Tensor| -> Tensor {
            let w = f.reshape([h * d, 1, k]);
            x.conv1d::<Tensor>(
                &w,
                None,
                [1i64].as_slice(),
                [0i64].as_slice(),
                [1i64].as_slice(),
                h * d,
            )
            .permute([2, 1, 0])
            .reshape([len, h, d, r])
                * scale
        };
        (mk(&self.filter_q), mk(&self.filter_k))
    }

    /// Code of the single position m from a ring buffer (k, H, D, R) whose slot p mod k holds the
    /// noise column of position p for p in m-k+1 ..= m. Returns (qbar, kbar), each (1, H, D, R).
    pub fn codes_from_ring(&self, ring: &Tensor, m: i64) -> (Tensor, Tensor) {
        let k = self.kernel;
        let shift = (m + 1).rem_euclid(k);
        let rr = ring.permute([1, 2, 0, 3]); // (H, D, k, R)
        let scale = ((self.realizations * self.dim) as f64).powf(-0.25);
        let mk = |f: &Tensor| -> Tensor {
            let fr = f.roll([shift].as_slice(), [2i64].as_slice()).unsqueeze(2); // (H, D, 1, k)
            fr.matmul(&rr).permute([2, 0, 1, 3]) * scale // (1, H, D, R)
        };
        (mk(&self.filter_q), mk(&self.filter_k))
    }
}

/// One positional code generator (shared by all layers or owned by one).
#[derive(Debug)]
pub enum SpeCode {
    Sine(SineSpe),
    Conv(ConvSpe),
}

/// xi ~ N(0,1)/(D R)^(1/4), (H, D, R), from torch's global RNG.
pub fn draw_xi(heads: i64, dim: i64, realizations: i64, kind: Kind, device: Device) -> Tensor {
    Tensor::randn([heads, dim, realizations], (kind, device))
        * ((dim * realizations) as f64).powf(-0.25)
}

/// Deterministic xi for (seed, layer).
pub fn frozen_xi(
    seed: u64,
    layer: u64,
    heads: i64,
    dim: i64,
    realizations: i64,
    device: Device,
) -> Tensor {
    noise::keyed_randn(
        seed,
        noise::TAG_GATE_XI,
        layer,
        0,
        &[heads, dim, realizations],
        device,
    ) * ((dim * realizations) as f64).powf(-0.25)
}

/// The SPE filter: (B, L, H, D) queries or keys -> (B, H, L, R).
/// With a gate (H, D) and its xi (H, D, R): Qf = sqrt(1-g) Qbar + sqrt(g) xi, g = sigmoid(gate);
/// result[b, h, m, r] = sum_d q[b, m, h, d] Qf[m, h, d, r], computed without materializing
/// (B, L, H, D, R): one batched matmul over (L, H) with the shared code and one with xi.
pub fn spe_filter(x: &Tensor, code: &Tensor, gate: Option<(&Tensor, &Tensor)>) -> Tensor {
    let gate = gate.map(|(g, xi)| GateFactors::new(g, xi));
    spe_filter_with(x, code, gate.as_ref())
}

/// [`spe_filter`] with the gate in the form it uses (shared by the queries
/// and keys of a layer, and by all the steps of a generation). On the CPU in
/// f32 it is one fused autograd function ([`fused_filter`]); elsewhere the
/// libtorch form ([`spe_filter_libtorch`]).
pub fn spe_filter_with(x: &Tensor, code: &Tensor, gate: Option<&GateFactors>) -> Tensor {
    let fused =
        cpu_f32(x) && cpu_f32(code) && gate.is_none_or(|g| cpu_f32(&g.a) && cpu_f32(&g.xi_b));
    if fused {
        fused_filter(x, code, gate)
    } else {
        spe_filter_libtorch(x, code, gate)
    }
}

/// [`spe_filter_with`] in libtorch calls: what the GPU and f64 take, and what
/// the tests hold [`fused_filter`] to.
pub fn spe_filter_libtorch(x: &Tensor, code: &Tensor, gate: Option<&GateFactors>) -> Tensor {
    match gate {
        None => x.permute([1, 2, 0, 3]).matmul(code).permute([2, 1, 0, 3]),
        Some(gf) => {
            let t1 = (x * &gf.a)
                .permute([1, 2, 0, 3])
                .matmul(code)
                .permute([2, 1, 0, 3]);
            t1 + gate_noise(x, gf)
        }
    }
}

/// [`spe_filter_with`] with a code per sequence (SPE in musical time, where every
/// sequence has positions of its own): (B, L, H, D) queries or keys and a (B, L, H, D, R)
/// code -> (B, H, L, R), in libtorch calls (products over D as broadcasts and sums:
/// batched matrix products of B L H rows of one would run one small product each).
pub fn spe_filter_each(x: &Tensor, code: &Tensor, gate: Option<&GateFactors>) -> Tensor {
    let by_code = |x: &Tensor| {
        (x.unsqueeze(-1) * code)
            .sum_dim_intlist([-2i64].as_slice(), false, None)
            .permute([0, 2, 1, 3])
    }; // (B, H, L, R)
    match gate {
        None => by_code(x),
        Some(gf) => by_code(&(x * &gf.a)) + gate_noise(x, gf),
    }
}

/// The gated filter's noise term of (B, L, H, D) queries or keys, (B, H, L, R): the same
/// for every position, as (x sqrt(g)) xi = x (sqrt(g) xi).
fn gate_noise(x: &Tensor, gf: &GateFactors) -> Tensor {
    x.permute([0, 2, 1, 3]).matmul(&gf.xi_b)
}

/// The gated SPE filter of [`spe_filter_with`] as one libtorch autograd function
/// (`src/model/spe_filter.cpp`): each (position, head) is one pass over its
/// code block for the whole batch, forward and backward, where libtorch runs
/// L H tiny products with an inner dimension of B in the backward. CPU, f32;
/// returns (B, H, L, R) contiguous.
///
/// # Panics
/// On inputs of another device, kind or shape than the filter's (a caller's
/// bug; [`spe_filter_with`] routes only CPU f32 here).
pub fn fused_filter(x: &Tensor, code: &Tensor, gate: Option<&GateFactors>) -> Tensor {
    let x = unit_last_stride(x);
    let code = code.contiguous();
    let gate = gate.map(FfiGate::new);
    let (a, xi) = FfiGate::ptrs(gate.as_ref());
    // SAFETY: every pointer is a live tensor handle, or null where the C++ side
    // takes an absent gate.
    unsafe {
        owned_result(
            ffi::cadenza_spe_filter(x.as_ptr(), code.as_ptr(), a, xi),
            "fused SPE filter",
        )
    }
}

/// A gate's factors as the C++ filters take them: contiguous a (H, D) and xi_b (H, D, R).
struct FfiGate(Tensor, Tensor);

impl FfiGate {
    fn new(g: &GateFactors) -> FfiGate {
        FfiGate(g.a.contiguous(), g.xi_b.contiguous())
    }

    /// (a, xi_b) handles, both null for an ungated filter.
    fn ptrs(gate: Option<&FfiGate>) -> (*const torch_sys::C_tensor, *const torch_sys::C_tensor) {
        match gate {
            Some(FfiGate(a, xi)) => (a.as_ptr(), xi.as_ptr()),
            None => (std::ptr::null(), std::ptr::null()),
        }
    }
}

/// Whether [`sine_filter`] takes a SineSPE of R realizations on this device and kind.
pub fn sine_filter_applies(device: Device, kind: Kind, realizations: i64) -> bool {
    device == Device::Cpu && kind == Kind::Float && matches!(realizations, 16 | 32 | 64)
}

/// SineSPE's filter with the codes formed inside it and never stored
/// (`src/model/spe_filter.cpp`): the same values as [`spe_filter_with`] over
/// [`SineSpe::codes_from`]'s codes, whose (L, H, D, R) tensors and their
/// gradients were a stream of memory through every layer. `omega` is the
/// query's or the key's half of [`SineSpe::omegas`] for positions start..start+L
/// (taken as a constant: the gradients reach the frequencies, offsets and
/// gains through `f`). CPU, f32, R in 16, 32, 64 ([`sine_filter_applies`]);
/// returns (B, H, L, R) contiguous.
///
/// # Panics
/// On inputs that do not fit (a caller's bug).
pub fn sine_filter(
    x: &Tensor,
    omega: &Tensor,
    f: &SineFactors,
    gate: Option<&GateFactors>,
    query: bool,
    start: i64,
) -> Tensor {
    let x = unit_last_stride(x);
    let omega = omega.detach().contiguous();
    let zg = f.zg.contiguous();
    let cycles = f.cycles.contiguous();
    let offsets = query.then(|| f.offsets.contiguous());
    let offsets = offsets.as_ref().map_or(std::ptr::null(), |t| t.as_ptr());
    let gate = gate.map(FfiGate::new);
    let (a, xi) = FfiGate::ptrs(gate.as_ref());
    // SAFETY: as in fused_filter (offsets is null on the key side).
    unsafe {
        owned_result(
            ffi::cadenza_sine_filter(
                x.as_ptr(),
                omega.as_ptr(),
                zg.as_ptr(),
                a,
                xi,
                cycles.as_ptr(),
                offsets,
                start,
            ),
            "fused SineSPE filter",
        )
    }
}

/// A gate of the gated SPE filter, g = sigmoid(gate logits): a = sqrt(1 - g)
/// (H, D) weighs the code, xi_b = sqrt(g) xi (H, D, R) is the noise term.
#[derive(Debug)]
pub struct GateFactors {
    pub a: Tensor,
    pub xi_b: Tensor,
}

impl GateFactors {
    pub fn new(gate: &Tensor, xi: &Tensor) -> GateFactors {
        let g = gate.sigmoid();
        GateFactors {
            a: (-&g + 1.0).sqrt(),
            xi_b: xi * g.sqrt().unsqueeze(-1),
        }
    }

    /// The factors of heads start..start+n only.
    pub fn heads(&self, start: i64, n: i64) -> GateFactors {
        GateFactors {
            a: self.a.narrow(0, start, n),
            xi_b: self.xi_b.narrow(0, start, n),
        }
    }

    /// Another handle on the same tensors.
    pub fn share(&self) -> GateFactors {
        GateFactors {
            a: self.a.shallow_clone(),
            xi_b: self.xi_b.shallow_clone(),
        }
    }
}

impl GateFactors {
    /// Host copies (a (H, D), xi_b (H, D, R)) for a generation step on the host.
    pub fn host(&self) -> (Vec<f32>, Vec<f32>) {
        (host_f32(&self.a), host_f32(&self.xi_b))
    }
}

/// [`spe_filter_with`] for one query or key x (D) of one head on the host: out (R) =
/// x code (D, R), or with a gate (a (D), xi_b (D, R)): (x a) code + x xi_b.
pub fn host_filter(x: &[f32], code: &[f32], gate: Option<(&[f32], &[f32])>, out: &mut [f32]) {
    let r = out.len();
    out.fill(0.0);
    for (d, &xd) in x.iter().enumerate() {
        let row = &code[d * r..(d + 1) * r];
        match gate {
            None => out.iter_mut().zip(row).for_each(|(o, &c)| *o += xd * c),
            Some((a, xi_b)) => {
                let xa = xd * a[d];
                let xi = &xi_b[d * r..(d + 1) * r];
                for ((o, &c), &n) in out.iter_mut().zip(row).zip(xi) {
                    *o += xa * c + xd * n;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;
    use rand_distr::{Distribution, StandardNormal};

    fn randn64(rng: &mut ChaCha8Rng, shape: &[i64]) -> Tensor {
        let n: i64 = shape.iter().product();
        let v: Vec<f64> = (0..n).map(|_| StandardNormal.sample(rng)).collect();
        Tensor::from_slice(&v).reshape(shape)
    }

    const H: i64 = 2;
    const D: i64 = 4;
    const R: i64 = 8;
    const DRAWS: usize = 3000;
    /// (m, n) pairs, both positions in a window starting at START.
    const START: i64 = 100;
    const PAIRS: [(i64, i64); 8] = [
        (0, 0),
        (3, 1),
        (5, 0),
        (2, 6),
        (7, 7),
        (9, 2),
        (1, 8),
        (6, 4),
    ];

    /// Monte Carlo mean of qhat_m . khat_n for each head and pair vs the identity
    /// sqrt(R/D) sum_d q_d k_d [(1-g_d) P_d(m-n) + g_d]. Returns the relative error.
    fn mc_check(
        mut codes: impl FnMut(&mut ChaCha8Rng) -> (Tensor, Tensor),
        kernel: &Tensor,
        gate: Option<&Tensor>,
        seed: u64,
    ) -> f64 {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let len = 10;
        // positive-leaning q and k so the target has no cancellations
        let q = randn64(&mut rng, &[1, len, H, D]).abs() + 0.5;
        let k = randn64(&mut rng, &[1, len, H, D]).abs() + 0.5;
        let mut acc = Tensor::zeros([PAIRS.len() as i64, H], (Kind::Double, Device::Cpu));
        for _ in 0..DRAWS {
            let (qb, kb) = codes(&mut rng);
            let xi = randn64(&mut rng, &[H, D, R]) * ((D * R) as f64).powf(-0.25);
            let qh = spe_filter(&q, &qb, gate.map(|g| (g, &xi))); // (1, H, L, R)
            let kh = spe_filter(&k, &kb, gate.map(|g| (g, &xi)));
            let dots: Vec<Tensor> = PAIRS
                .iter()
                .map(|&(m, n)| {
                    (qh.select(2, m) * kh.select(2, n))
                        .sum_dim_intlist([-1i64].as_slice(), false, None)
                        .squeeze_dim(0)
                })
                .collect();
            acc += Tensor::stack(&dots, 0);
        }
        let est = acc / DRAWS as f64;
        // theory
        let g = match gate {
            Some(g) => g.sigmoid(),
            None => Tensor::zeros([H, D], (Kind::Double, Device::Cpu)),
        };
        let th: Vec<Tensor> = PAIRS
            .iter()
            .enumerate()
            .map(|(i, &(m, n))| {
                let p = kernel.select(0, i as i64); // (H, D)
                let qk = q.select(1, m).squeeze_dim(0) * k.select(1, n).squeeze_dim(0);
                let w: Tensor = (-&g + 1.0) * p + &g;
                (qk * w).sum_dim_intlist([-1i64].as_slice(), false, None)
                    * ((R as f64) / D as f64).sqrt()
            })
            .collect();
        let th = Tensor::stack(&th, 0);
        let err = (&est - &th).norm().double_value(&[]) / th.norm().double_value(&[]);
        eprintln!("est {est:?}\nth {th:?}\nrel err {err}");
        err
    }

    fn f32_leaf(rng: &mut ChaCha8Rng, shape: &[i64]) -> Tensor {
        randn64(rng, shape)
            .to_kind(Kind::Float)
            .set_requires_grad(true)
    }

    fn zero_grads(leaves: &[&Tensor]) {
        for t in leaves {
            let mut g = t.grad();
            if g.defined() {
                let _ = g.zero_();
            }
        }
    }

    /// The largest of |got - want|_max / |want|_max over pairs of tensors of one shape.
    fn worst_relative(got: &[Tensor], want: &[Tensor]) -> f64 {
        assert_eq!(got.len(), want.len());
        got.iter()
            .zip(want)
            .map(|(g, w)| {
                assert_eq!(g.size(), w.size());
                (g - w).abs().max().double_value(&[]) / (w.abs().max().double_value(&[]) + 1e-12)
            })
            .fold(0.0, f64::max)
    }

    /// Values and gradients (of x, the code, a and xi_b) of `fused_filter` and
    /// `spe_filter_libtorch` for the same inputs and upstream gradient.
    fn fused_against_libtorch(b: i64, l: i64, h: i64, d: i64, r: i64, gated: bool) -> f64 {
        let mut rng = ChaCha8Rng::seed_from_u64((b * 1000 + l * 10 + r) as u64);
        // x as the model has it: a view of wider rows (unit stride over D only)
        let wide = f32_leaf(&mut rng, &[b, l, 3 * h * d]);
        let code = f32_leaf(&mut rng, &[l, h, d, r]);
        let a = f32_leaf(&mut rng, &[h, d]);
        let xi = f32_leaf(&mut rng, &[h, d, r]);
        let up = randn64(&mut rng, &[b, h, l, r]).to_kind(Kind::Float);
        let run = |fused: bool| {
            zero_grads(&[&wide, &code, &a, &xi]);
            let x = wide.narrow(2, h * d, h * d).view([b, l, h, d]);
            let gate = gated.then(|| GateFactors {
                a: a.shallow_clone(),
                xi_b: xi.shallow_clone(),
            });
            let out = if fused {
                fused_filter(&x, &code, gate.as_ref())
            } else {
                spe_filter_libtorch(&x, &code, gate.as_ref())
            };
            (&out * &up).sum(Kind::Float).backward();
            let mut parts = vec![out.detach().copy(), wide.grad().copy(), code.grad().copy()];
            if gated {
                parts.push(a.grad().copy());
                parts.push(xi.grad().copy());
            }
            parts
        };
        worst_relative(&run(true), &run(false))
    }

    #[test]
    fn fused_filter_matches_libtorch_values_and_gradients() {
        // R = 32 and 16 take the compile-time kernels, 8 and 5 the run-time one
        for &(b, l, h, d, r, gated) in &[
            (2, 7, 2, 64, 32, true),
            (3, 5, 2, 16, 32, false),
            (1, 9, 3, 8, 16, true),
            (4, 3, 1, 6, 8, true),
            (2, 1, 2, 4, 5, false),
            (1, 4, 2, 5, 5, true),
            // enough items (position, head) for the threads to split them, each
            // with its own partial sums of the gate's gradients
            (2, 300, 2, 16, 32, true),
        ] {
            let err = fused_against_libtorch(b, l, h, d, r, gated);
            assert!(
                err < 1e-5,
                "B {b} L {l} H {h} D {d} R {r} gated {gated}: relative error {err}"
            );
        }
    }

    /// Values and gradients (of x, the SineSPE's frequencies, offsets and gains, the
    /// gate and xi) of `sine_filter` and of the stored codes through `spe_filter_libtorch`.
    fn sine_against_codes(b: i64, l: i64, d: i64, r: i64, gated: bool, query: bool) -> f64 {
        let h = 2;
        let mut rng = ChaCha8Rng::seed_from_u64((b * 1000 + l * 10 + r) as u64);
        let vs = nn::VarStore::new(Device::Cpu);
        let spe = SineSpe::new(&vs.root(), h, d, 3, r, FreqInit::Spread);
        let z = spe.draw_z();
        let wide = f32_leaf(&mut rng, &[b, l, 3 * h * d]);
        let gate = f32_leaf(&mut rng, &[h, d]);
        let xi = f32_leaf(&mut rng, &[h, d, r]);
        let up = randn64(&mut rng, &[b, h, l, r]).to_kind(Kind::Float);
        let start = 1000;
        let leaves = [&wide, &gate, &xi, &spe.freqs, &spe.offsets, &spe.gains];
        let run = |fused: bool| {
            zero_grads(&leaves);
            let x = wide.narrow(2, h * d, h * d).view([b, l, h, d]);
            let gf = gated.then(|| GateFactors::new(&gate, &xi));
            let f = spe.factors(&z);
            let out = if fused {
                let (qo, ko) = spe.omegas(&f, start, l);
                sine_filter(
                    &x,
                    if query { &qo } else { &ko },
                    &f,
                    gf.as_ref(),
                    query,
                    start,
                )
            } else {
                let (qb, kb) = spe.codes_from(&f, start, l);
                spe_filter_libtorch(&x, if query { &qb } else { &kb }, gf.as_ref())
            };
            (&out * &up).sum(Kind::Float).backward();
            let mut parts = vec![
                out.detach().copy(),
                wide.grad().copy(),
                spe.freqs.grad().copy(),
                spe.gains.grad().copy(),
            ];
            if query {
                parts.push(spe.offsets.grad().copy());
            }
            if gated {
                parts.push(gate.grad().copy());
                parts.push(xi.grad().copy());
            }
            parts
        };
        worst_relative(&run(true), &run(false))
    }

    #[test]
    fn sine_filter_matches_the_stored_codes() {
        // L = 21 and 3: whole blocks of 8 positions and a short last one; 300: the
        // threads split the blocks, each with its own partial sums
        for &(b, l, d, r, gated, query) in &[
            (2, 21, 16, 32, true, true),
            (3, 3, 8, 16, true, false),
            (1, 21, 4, 64, false, true),
            (2, 300, 16, 32, true, true),
            (2, 17, 8, 32, false, false),
        ] {
            let err = sine_against_codes(b, l, d, r, gated, query);
            assert!(
                err < 2e-5,
                "B {b} L {l} D {d} R {r} gated {gated} query {query}: relative error {err}"
            );
        }
    }

    #[test]
    fn codes_at_any_positions_agree_with_the_window_forms() {
        // SPE in musical time: a code per sequence, positions that repeat and jump
        let (b, l, h, d, r) = (2, 6, 2, 4, 8);
        let mut rng = ChaCha8Rng::seed_from_u64(17);
        let vs = nn::VarStore::new(Device::Cpu);
        let spe = SineSpe::new(&vs.root(), h, d, 3, r, FreqInit::Spread);
        let f = spe.factors(&spe.draw_z());
        let rows: [[f64; 6]; 2] = [
            [100.0, 101.0, 102.0, 103.0, 104.0, 105.0],
            [0.0, 0.0, 3.0, 48.0, 48.0, 1_000_003.0],
        ];
        let at = Tensor::from_slice(rows.as_flattened());
        let (qe, ke) = tch::no_grad(|| spe.codes_at(&f, &at));
        let (qe, ke) = (qe.view([b, l, h, d, r]), ke.view([b, l, h, d, r]));
        // a row of consecutive positions is the window's code
        let (qw, kw) = tch::no_grad(|| spe.codes_from(&f, 100, l));
        let rel =
            |x: &Tensor, y: &Tensor| worst_relative(&[x.shallow_clone()], &[y.shallow_clone()]);
        let close = |x: &Tensor, y: &Tensor| rel(x, y) < 1e-6;
        assert!(close(&qe.get(0), &qw) && close(&ke.get(0), &kw));
        // the host code of a position (a generation step) is the same
        let host = f.host();
        for (i, &p) in rows[1].iter().enumerate() {
            let want = Vec::<f32>::try_from(qe.get(1).get(i as i64).reshape([-1])).unwrap();
            let got = host.code_at(p as i64, true);
            let err = want
                .iter()
                .zip(&got)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(err < 1e-5, "position {p}: {err}");
        }
        // the per-sequence filter is the shared one, row by row
        let x = f32_leaf(&mut rng, &[b, l, h, d]);
        let gate = f32_leaf(&mut rng, &[h, d]);
        let xi = f32_leaf(&mut rng, &[h, d, r]);
        for gated in [false, true] {
            let gf = gated.then(|| GateFactors::new(&gate, &xi));
            let each = tch::no_grad(|| spe_filter_each(&x, &ke, gf.as_ref()));
            for row in 0..b {
                let one = tch::no_grad(|| {
                    spe_filter_libtorch(&x.narrow(0, row, 1), &ke.get(row), gf.as_ref())
                });
                assert!(
                    rel(&each.narrow(0, row, 1), &one) < 1e-5,
                    "row {row} gated {gated}"
                );
            }
        }
    }

    #[test]
    fn fused_filter_without_grad_and_at_empty_batch() {
        let x = Tensor::randn([0, 4, 2, 8], (Kind::Float, Device::Cpu));
        let code = Tensor::randn([4, 2, 8, 16], (Kind::Float, Device::Cpu));
        assert_eq!(fused_filter(&x, &code, None).size(), [0, 2, 4, 16]);
        let x = Tensor::randn([2, 4, 2, 8], (Kind::Float, Device::Cpu));
        let got = tch::no_grad(|| fused_filter(&x, &code, None));
        let want = spe_filter_libtorch(&x, &code, None);
        assert!((got - want).abs().max().double_value(&[]) < 1e-5);
    }

    #[test]
    #[should_panic(expected = "does not fit")]
    fn fused_filter_rejects_a_code_of_another_shape() {
        let x = Tensor::zeros([1, 4, 2, 8], (Kind::Float, Device::Cpu));
        let code = Tensor::zeros([5, 2, 8, 16], (Kind::Float, Device::Cpu));
        let _ = fused_filter(&x, &code, None);
    }

    #[test]
    fn spread_init_covers_short_and_long_periods() {
        tch::manual_seed(3);
        let logits = spread_freq_logits(&[4, 64, 5], Kind::Double, Device::Cpu);
        let period = (logits.sigmoid() / 2.0).reciprocal();
        let p = Vec::<f64>::try_from(period.reshape([-1])).unwrap();
        assert!(p
            .iter()
            .all(|&x| (SPREAD_MIN_PERIOD - 1e-9..=SPREAD_MAX_PERIOD + 1e-6).contains(&x)));
        // log-uniform over 2.2..2048: about 22% of periods under 10 tokens,
        // about 22% over 450 (the reference init has under 1% under 12)
        let short = p.iter().filter(|&&x| x < 10.0).count() as f64 / p.len() as f64;
        let long = p.iter().filter(|&&x| x > 450.0).count() as f64 / p.len() as f64;
        assert!((0.17..0.27).contains(&short), "{short}");
        assert!((0.17..0.27).contains(&long), "{long}");
    }

    fn deltas() -> Vec<i64> {
        PAIRS.iter().map(|&(m, n)| m - n).collect()
    }

    fn sine_setup() -> (nn::VarStore, SineSpe) {
        tch::manual_seed(11);
        let mut vs = nn::VarStore::new(Device::Cpu);
        vs.set_kind(Kind::Double);
        let spe = SineSpe::new(&vs.root(), H, D, 3, R, FreqInit::Reference);
        // deterministic parameters (the global RNG is shared by parallel tests), with faster
        // frequencies than the init so the kernel varies over the test lags
        let mut rng = ChaCha8Rng::seed_from_u64(77);
        tch::no_grad(|| {
            spe.freqs
                .shallow_clone()
                .copy_(&(randn64(&mut rng, &[H, D, 3]) * 0.8 - 1.0));
            spe.offsets
                .shallow_clone()
                .copy_(&randn64(&mut rng, &[H, D, 3]));
            spe.gains
                .shallow_clone()
                .copy_(&randn64(&mut rng, &[H, D, 3]));
        });
        (vs, spe)
    }

    fn run_sine(gated: bool) {
        let (_vs, spe) = sine_setup();
        let kernel = spe.kernel(&deltas());
        assert_eq!(kernel.kind(), Kind::Double);
        let gate = gated.then(|| randn64(&mut ChaCha8Rng::seed_from_u64(79), &[H, D]));
        let err = mc_check(
            |rng| {
                let z = randn64(rng, &[H, D, 6, R]) / 6f64.sqrt();
                spe.codes(START, 10, &z)
            },
            &kernel,
            gate.as_ref(),
            1,
        );
        assert!(err < 0.04, "SineSPE MC identity relative error {err}");
    }

    fn run_conv(gated: bool) {
        tch::manual_seed(12);
        let mut vs = nn::VarStore::new(Device::Cpu);
        vs.set_kind(Kind::Double);
        let spe = ConvSpe::new(&vs.root(), H, D, 4, R);
        let mut rng = ChaCha8Rng::seed_from_u64(78);
        tch::no_grad(|| {
            spe.filter_q
                .shallow_clone()
                .copy_(&randn64(&mut rng, &[H, D, 4]).abs());
            spe.filter_k
                .shallow_clone()
                .copy_(&randn64(&mut rng, &[H, D, 4]).abs());
        });
        let kernel = spe.kernel(&deltas());
        // lags >= k have an exactly zero kernel
        assert_eq!(spe.kernel(&[4, -4, 7]).abs().max().double_value(&[]), 0.0);
        let gate = gated.then(|| randn64(&mut ChaCha8Rng::seed_from_u64(79), &[H, D]));
        let err = mc_check(
            |rng| {
                let n = randn64(rng, &[10 + 3, H, D, R]);
                spe.codes_from_noise(&n)
            },
            &kernel,
            gate.as_ref(),
            2,
        );
        assert!(err < 0.04, "ConvSPE MC identity relative error {err}");
    }

    #[test]
    fn spe_sine_mc_identity_ungated() {
        run_sine(false);
    }
    #[test]
    fn spe_sine_mc_identity_gated() {
        run_sine(true);
    }
    #[test]
    fn spe_conv_mc_identity_ungated() {
        run_conv(false);
    }
    #[test]
    fn spe_conv_mc_identity_gated() {
        run_conv(true);
    }

    #[test]
    fn spe_sine_kernel_matches_doc_formula() {
        let (_vs, spe) = sine_setup();
        let p = spe.kernel(&[3]);
        let f = spe.freqs.sigmoid() / 2.0;
        let want = ((&f * (2.0 * PI * 3.0) + &spe.offsets).cos() * spe.gains.softplus().square())
            .mean_dim([-1i64].as_slice(), false, None)
            / 2.0;
        assert!((p.squeeze_dim(0) - want).abs().max().double_value(&[]) < 1e-12);
    }

    #[test]
    fn spe_sine_codes_precise_at_large_positions() {
        // f32 parameters at position ~1e7: the code equals an all-f64 evaluation of the doc's
        // formula with the same (f32) frequencies, i.e. no phase precision is lost.
        let vs = nn::VarStore::new(Device::Cpu);
        let spe = SineSpe::new(&vs.root(), H, D, 3, R, FreqInit::Reference);
        let z = randn64(&mut ChaCha8Rng::seed_from_u64(5), &[H, D, 6, R]);
        let pos = 10_000_003i64;
        let (q32, k32) = spe.codes(pos, 1, &z.to_kind(Kind::Float));
        let f = spe.frequencies().to_kind(Kind::Double);
        let th = spe.offsets.to_kind(Kind::Double);
        let g = spe.gains.to_kind(Kind::Double).softplus();
        let g = Tensor::stack(&[&g, &g], -1).reshape([H, D, 6, 1]);
        let reference = |ph: Tensor| {
            let om = Tensor::stack(&[ph.cos(), ph.sin()], -1).reshape([H, D, 1, 6]);
            om.matmul(&(&z * &g)).squeeze_dim(2) * ((R * D) as f64).powf(-0.25)
        };
        let kref = reference(&f * (2.0 * PI * pos as f64));
        let qref = reference(&f * (2.0 * PI * pos as f64) + &th);
        let e = (k32.squeeze_dim(0).to_kind(Kind::Double) - &kref)
            .abs()
            .max()
            .double_value(&[])
            + (q32.squeeze_dim(0).to_kind(Kind::Double) - &qref)
                .abs()
                .max()
                .double_value(&[]);
        assert!(
            e < 1e-4 * kref.abs().max().double_value(&[]),
            "f32 code error {e}"
        );
    }

    #[test]
    fn spe_conv_ring_matches_window() {
        tch::manual_seed(3);
        let vs = nn::VarStore::new(Device::Cpu);
        let spe = ConvSpe::new(&vs.root(), 2, 3, 5, 4);
        let start = 17;
        let len = 9;
        let noise = spe.frozen_noise(42, 0, start, len);
        let (qw, kw) = spe.codes_from_noise(&noise);
        for t in 0..len {
            let m = start + t;
            // ring for m: slot p mod k holds column p, p in m-4..=m
            let ring = Tensor::zeros([5, 2, 3, 4], (Kind::Float, Device::Cpu));
            for p in (m - 4)..=m {
                let col = noise.select(0, p - (start - 4));
                ring.select(0, p.rem_euclid(5)).copy_(&col);
            }
            let (qr, kr) = spe.codes_from_ring(&ring, m);
            let e = (qr.squeeze_dim(0) - qw.select(0, t))
                .abs()
                .max()
                .double_value(&[])
                + (kr.squeeze_dim(0) - kw.select(0, t))
                    .abs()
                    .max()
                    .double_value(&[]);
            assert!(e < 1e-5, "ring code differs at {m}: {e}");
        }
    }
}
