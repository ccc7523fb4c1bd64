//! The dense parts of a generation step on the host: a CPU f32 model's linear layers,
//! layer norms and GELU for a handful of rows, in plain loops (libtorch's matrix product
//! from [`LIBTORCH_FROM_BATCH`] rows).
//!
//! At batch 1 a step's matrix products are matrix-vector products whose cost is reading
//! the weights once; libtorch adds a dispatch, an allocation and a tensor per operation,
//! and with some fifteen operations per layer those came to more than the arithmetic.
//! These kernels are written for that case: [`linear`] reads each weight row once for all
//! the rows of the batch, with the vector width the CPU offers (chosen at run time, see
//! [`dot`]).
//!
//! A bf16 model's host copies keep their weights as bf16 ([`Bf16`], half the bytes), which
//! the same kernels widen to f32 as they read them: the activations and sums stay f32.
//!
//! Invariants: every function here computes what its libtorch counterpart does (`linear`,
//! `layer_norm`, `gelu("none")`) up to the order of f32 sums; the tests check each one
//! against libtorch.

use crate::model::precision::{bf16_bits, bf16_to_f32, CpuBf16};

/// The widest vector instructions this CPU has, of those the kernels are compiled for
/// (the crate itself is built for the baseline x86-64, SSE2).
#[derive(Clone, Copy)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
enum Isa {
    Avx512,
    Avx2,
    Baseline,
}

/// [`Isa`] of this CPU (the standard library caches the detection).
fn widest() -> Isa {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return Isa::Avx512;
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            return Isa::Avx2;
        }
    }
    Isa::Baseline
}

/// Dot product of two equal-length slices, in 16 lanes, with the widest vector
/// instructions this CPU has.
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    match widest() {
        // SAFETY: `widest` found the CPU to have these instructions.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { dot_avx512(a, b) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { dot_avx2(a, b) },
        _ => dot_lanes(a, b),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn dot_avx512(a: &[f32], b: &[f32]) -> f32 {
    dot_lanes(a, b)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    dot_lanes(a, b)
}

/// 16 independent sums, which the compiler turns into vector instructions of the
/// enclosing function's width (a single running f32 sum must keep its order and stays
/// scalar).
#[inline(always)]
fn dot_lanes(a: &[f32], b: &[f32]) -> f32 {
    const W: usize = 16;
    let mut acc = [0f32; W];
    let (ca, cb) = (a.chunks_exact(W), b.chunks_exact(W));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..W {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// A weight element the kernels read: f32, or bf16 bits widened to f32 in the registers.
pub(crate) trait Weight: Copy {
    fn f32(self) -> f32;
}

impl Weight for f32 {
    #[inline(always)]
    fn f32(self) -> f32 {
        self
    }
}

/// bf16 bits (the top half of an f32), as the host copies of a bf16 model keep them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(transparent)]
pub(crate) struct Bf16(pub u16);

impl Weight for Bf16 {
    #[inline(always)]
    fn f32(self) -> f32 {
        bf16_to_f32(self.0)
    }
}

/// `out = x w^T + bias` for `batch` rows: w (N, K) row-major (a `nn::Linear` weight), in
/// f32 or bf16, x (batch, K) f32, out (batch, N) f32, summed in f32. Each weight row is
/// read once for every row of x.
pub(crate) fn linear<W: Weight>(
    w: &[W],
    bias: Option<&[f32]>,
    x: &[f32],
    batch: usize,
    out: &mut [f32],
) {
    if batch == 0 {
        assert!(x.is_empty() && out.is_empty(), "linear: rows for batch 0");
        return;
    }
    let n = out.len() / batch;
    let k = x.len() / batch;
    assert!(
        w.len() == n * k && out.len() == batch * n && x.len() == batch * k,
        "linear: weight {} for ({batch}, {k}) -> ({batch}, {n})",
        w.len()
    );
    assert!(
        bias.is_none_or(|b| b.len() == n),
        "linear: bias of another size"
    );
    match widest() {
        // SAFETY: `widest` found the CPU to have these instructions.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { linear_avx512(w, bias, x, batch, out) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { linear_avx2(w, bias, x, batch, out) },
        _ => linear_rows(w, bias, x, batch, out),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn linear_avx512<W: Weight>(
    w: &[W],
    bias: Option<&[f32]>,
    x: &[f32],
    batch: usize,
    out: &mut [f32],
) {
    linear_rows(w, bias, x, batch, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn linear_avx2<W: Weight>(
    w: &[W],
    bias: Option<&[f32]>,
    x: &[f32],
    batch: usize,
    out: &mut [f32],
) {
    linear_rows(w, bias, x, batch, out)
}

/// Four weight rows at a time against each row of x: four independent sums per x row
/// (one running sum would wait on its own latency at every step), x read once for the
/// four, the four weight rows kept in L1 across the rows of x. The blocks of four are
/// taken in pairs from the two halves of w, so that the weights come in two streams
/// (2-4% faster at batch 1 than one stream, on the Xeon of docs/benchmarks.md).
#[inline(always)]
fn linear_rows<W: Weight>(w: &[W], bias: Option<&[f32]>, x: &[f32], batch: usize, out: &mut [f32]) {
    // (batch > 0: see `linear`)
    let n = out.len() / batch;
    let k = x.len() / batch;
    let bias_of = |o: usize| bias.map_or(0.0, |b| b[o]);
    let block = |blk: usize| &w[blk * 4 * k..(blk + 1) * 4 * k];
    let mut store = |blk: usize, r: usize, d: [f32; 4]| {
        for (j, v) in d.into_iter().enumerate() {
            out[r * n + blk * 4 + j] = v + bias_of(blk * 4 + j);
        }
    };
    let blocks = n / 4;
    let half = blocks / 2;
    for blk in 0..half {
        for (r, xr) in x.chunks_exact(k).enumerate() {
            store(blk, r, dot4(block(blk), xr));
            store(blk + half, r, dot4(block(blk + half), xr));
        }
    }
    for blk in 2 * half..blocks {
        for (r, xr) in x.chunks_exact(k).enumerate() {
            store(blk, r, dot4(block(blk), xr));
        }
    }
    for o in blocks * 4..n {
        let row = &w[o * k..(o + 1) * k];
        for (r, xr) in x.chunks_exact(k).enumerate() {
            out[r * n + o] = dot_weights(row, xr) + bias_of(o);
        }
    }
}

/// [`dot_lanes`] with the first operand in any [`Weight`] type.
#[inline(always)]
fn dot_weights<W: Weight>(a: &[W], b: &[f32]) -> f32 {
    const W: usize = 16;
    let mut acc = [0f32; W];
    let (ca, cb) = (a.chunks_exact(W), b.chunks_exact(W));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x.f32() * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..W {
            acc[i] += x[i].f32() * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// The dot products of four consecutive rows of length x.len() (rows: 4 * x.len()) with x.
#[inline(always)]
fn dot4<W: Weight>(rows: &[W], x: &[f32]) -> [f32; 4] {
    const L: usize = 16;
    let k = x.len();
    let r: [&[W]; 4] = [
        &rows[..k],
        &rows[k..2 * k],
        &rows[2 * k..3 * k],
        &rows[3 * k..4 * k],
    ];
    let mut acc = [[0f32; L]; 4];
    let full = k / L * L;
    for c in (0..full).step_by(L) {
        let xc: [f32; L] = x[c..c + L].try_into().expect("L lanes");
        let w: [[W; L]; 4] = [0, 1, 2, 3].map(|j| r[j][c..c + L].try_into().expect("L lanes"));
        for j in 0..4 {
            for i in 0..L {
                acc[j][i] += w[j][i].f32() * xc[i];
            }
        }
    }
    let mut out = [0f32; 4];
    for j in 0..4 {
        let tail: f32 = r[j][full..]
            .iter()
            .zip(&x[full..])
            .map(|(a, b)| a.f32() * b)
            .sum();
        out[j] = acc[j].iter().sum::<f32>() + tail;
    }
    out
}

/// Layer norm of each `weight.len()`-long row of `x` into `out`, as libtorch's (biased
/// variance, `eps` inside the square root), with the mean and variance summed in f64.
pub(crate) fn layer_norm(x: &[f32], weight: &[f32], bias: &[f32], eps: f64, out: &mut [f32]) {
    let d = weight.len();
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let mean = xr.iter().map(|&v| v as f64).sum::<f64>() / d as f64;
        let var = xr.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / d as f64;
        let inv = 1.0 / (var + eps).sqrt();
        for (((o, &v), &g), &b) in or.iter_mut().zip(xr).zip(weight).zip(bias) {
            *o = ((v as f64 - mean) * inv) as f32 * g + b;
        }
    }
}

/// GELU with the exact erf (libtorch's `gelu("none")`), in place.
pub(crate) fn gelu(x: &mut [f32]) {
    for v in x.iter_mut() {
        let a = *v as f64;
        *v = (0.5 * a * (1.0 + libm::erf(a * std::f64::consts::FRAC_1_SQRT_2))) as f32;
    }
}

/// Batches from which [`HostLinear::apply`] hands its product to libtorch: MKL's matrix
/// product blocks registers over several rows of x, which [`linear`] does not, and
/// from 4 rows its speed outweighs the cost of a call (measured on the shipped model:
/// at batch 8 the host kernel made generation 13% slower).
const LIBTORCH_FROM_BATCH: usize = 4;

/// The weights of a [`HostLinear`], in the precision of the model's dense products.
#[derive(Debug)]
enum Weights {
    F32(Vec<f32>),
    Bf16(Vec<Bf16>),
}

/// A `nn::Linear` as host copies: weight (N, K) row-major, f32 or bf16, and bias (N), f32.
#[derive(Debug)]
pub(crate) struct HostLinear {
    w: Weights,
    b: Option<Vec<f32>>,
    /// N, the output width.
    pub n: usize,
}

/// Whether libtorch's bf16 matrix product runs on AMX here (it is then the fastest for
/// several rows); without AMX it is far slower than the host kernel (on an AVX2 CPU,
/// libtorch 2.13 multiplies bf16 at about 1/70 of its f32 speed).
fn libtorch_bf16_is_fast() -> bool {
    CpuBf16::detect().amx_bf16
}

impl HostLinear {
    /// The host copy of `l`, its weight kept as bf16 when `bf16`.
    pub fn of(l: &tch::nn::Linear, bf16: bool) -> HostLinear {
        HostLinear::new(&l.ws, l.bs.as_ref(), bf16)
    }

    /// From a weight (N, K) and an optional bias (N); the weight kept as bf16 (rounded to
    /// nearest even) when `bf16`.
    pub fn new(w: &tch::Tensor, b: Option<&tch::Tensor>, bf16: bool) -> HostLinear {
        let n = w.size()[0] as usize;
        let host = super::host_f32(w);
        let w = if bf16 {
            Weights::Bf16(host.iter().map(|&v| Bf16(bf16_bits(v))).collect())
        } else {
            Weights::F32(host)
        };
        HostLinear {
            n,
            w,
            b: b.map(super::host_f32),
        }
    }

    /// K, the input width.
    fn k(&self) -> usize {
        let len = match &self.w {
            Weights::F32(w) => w.len(),
            Weights::Bf16(w) => w.len(),
        };
        len / self.n.max(1)
    }

    /// Appends row `i` of the weight (K values) to `out`, in f32.
    pub fn push_row(&self, i: usize, out: &mut Vec<f32>) {
        let k = self.k();
        match &self.w {
            Weights::F32(w) => out.extend_from_slice(&w[i * k..(i + 1) * k]),
            Weights::Bf16(w) => out.extend(w[i * k..(i + 1) * k].iter().map(|v| v.f32())),
        }
    }

    /// `x w^T + b` for `batch` rows of x.
    pub fn apply(&self, x: &[f32], batch: usize) -> Vec<f32> {
        let libtorch_fast = match self.w {
            Weights::F32(_) => true,
            Weights::Bf16(_) => libtorch_bf16_is_fast(),
        };
        if batch >= LIBTORCH_FROM_BATCH && libtorch_fast {
            return self.apply_libtorch(x, batch);
        }
        let mut out = vec![0f32; batch * self.n];
        match &self.w {
            Weights::F32(w) => linear(w, self.b.as_deref(), x, batch, &mut out),
            Weights::Bf16(w) => linear(w, self.b.as_deref(), x, batch, &mut out),
        }
        out
    }

    /// [`HostLinear::apply`] through libtorch, on tensors that view the host copies (a
    /// bf16 weight multiplies x rounded to bf16, as the model's bf16 products do).
    fn apply_libtorch(&self, x: &[f32], batch: usize) -> Vec<f32> {
        let (n, k) = (self.n as i64, self.k() as i64);
        assert_eq!(
            x.len() as i64,
            batch as i64 * k,
            "linear: x of another size"
        );
        /// SAFETY (of every call): `ptr` holds exactly the elements of `size` (contiguous,
        /// of `kind`), and outlives the tensor: every tensor made here is dropped before
        /// this function returns (the result is copied out), and none is written to.
        unsafe fn view(ptr: *const u8, size: &[i64], kind: tch::Kind) -> tch::Tensor {
            let strides: Vec<i64> = match size {
                [_, k] => vec![*k, 1],
                _ => vec![1],
            };
            tch::Tensor::from_blob(ptr, size, &strides, kind, tch::Device::Cpu)
        }
        let xt = unsafe {
            view(
                x.as_ptr() as *const u8,
                &[batch as i64, k],
                tch::Kind::Float,
            )
        };
        let b = self
            .b
            .as_deref()
            .map(|b| unsafe { view(b.as_ptr() as *const u8, &[n], tch::Kind::Float) });
        let y = tch::no_grad(|| match &self.w {
            Weights::F32(w) => {
                let w = unsafe { view(w.as_ptr() as *const u8, &[n, k], tch::Kind::Float) };
                xt.linear(&w, b.as_ref())
            }
            Weights::Bf16(w) => {
                let w = unsafe { view(w.as_ptr() as *const u8, &[n, k], tch::Kind::BFloat16) };
                let y = xt
                    .to_kind(tch::Kind::BFloat16)
                    .linear::<tch::Tensor>(&w, None)
                    .to_kind(tch::Kind::Float);
                match &b {
                    Some(b) => y + b,
                    None => y,
                }
            }
        });
        super::host_f32(&y)
    }
}

/// A `nn::LayerNorm` over the last dimension as host copies.
#[derive(Debug)]
pub(crate) struct HostNorm {
    w: Vec<f32>,
    b: Vec<f32>,
    eps: f64,
}

impl HostNorm {
    /// `eps` must be the one the norm was built with (tch keeps it private).
    pub fn of(n: &tch::nn::LayerNorm, eps: f64) -> HostNorm {
        let (w, b) = (n.ws.as_ref(), n.bs.as_ref());
        HostNorm {
            w: super::host_f32(w.expect("a layer norm with a weight")),
            b: super::host_f32(b.expect("a layer norm with a bias")),
            eps,
        }
    }

    pub fn apply(&self, x: &[f32]) -> Vec<f32> {
        let mut out = vec![0f32; x.len()];
        layer_norm(x, &self.w, &self.b, self.eps, &mut out);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind, Tensor};

    fn host(t: &Tensor) -> Vec<f32> {
        Vec::<f32>::try_from(&t.contiguous().view([-1])).unwrap()
    }

    fn max_diff(a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max)
    }

    #[test]
    fn linear_matches_libtorch_for_every_batch_and_odd_sizes() {
        tch::manual_seed(3);
        // 37 columns: two full 16-lane blocks and a tail of 5
        for (batch, n, k) in [(1, 768, 256), (3, 45, 37), (8, 1024, 256), (2, 7, 5)] {
            let w = Tensor::randn([n, k], (Kind::Float, Device::Cpu));
            let b = Tensor::randn([n], (Kind::Float, Device::Cpu));
            let x = Tensor::randn([batch, k], (Kind::Float, Device::Cpu));
            let want = host(&x.linear(&w, Some(&b)));
            let mut got = vec![0f32; (batch * n) as usize];
            linear(
                &host(&w),
                Some(&host(&b)),
                &host(&x),
                batch as usize,
                &mut got,
            );
            assert!(max_diff(&got, &want) < 1e-4, "({batch}, {k}) -> {n}");
            let want = host(&x.linear::<Tensor>(&w, None));
            linear(&host(&w), None, &host(&x), batch as usize, &mut got);
            assert!(
                max_diff(&got, &want) < 1e-4,
                "no bias ({batch}, {k}) -> {n}"
            );
        }
    }

    #[test]
    fn host_linear_gives_the_same_rows_on_either_side_of_the_libtorch_threshold() {
        tch::manual_seed(5);
        let l = tch::nn::linear(
            tch::nn::VarStore::new(Device::Cpu).root(),
            37,
            45,
            Default::default(),
        );
        let hl = HostLinear::of(&l, false);
        let x = Tensor::randn(
            [LIBTORCH_FROM_BATCH as i64 + 1, 37],
            (Kind::Float, Device::Cpu),
        );
        let want = host(&tch::no_grad(|| x.apply(&l)));
        for batch in [1, LIBTORCH_FROM_BATCH - 1, LIBTORCH_FROM_BATCH + 1] {
            let got = hl.apply(&host(&x.narrow(0, 0, batch as i64)), batch);
            assert_eq!(got.len(), batch * 45);
            assert!(max_diff(&got, &want[..batch * 45]) < 1e-5, "batch {batch}");
        }
    }

    #[test]
    fn bf16_weights_give_the_product_of_the_rounded_weights() {
        tch::manual_seed(6);
        for (batch, n, k) in [
            (1, 768, 256),
            (3, 45, 37),
            (LIBTORCH_FROM_BATCH + 4, 64, 48),
        ] {
            let w = Tensor::randn([n, k], (Kind::Float, Device::Cpu));
            let b = Tensor::randn([n], (Kind::Float, Device::Cpu));
            let x = Tensor::randn([batch as i64, k], (Kind::Float, Device::Cpu));
            let hl = HostLinear::new(&w, Some(&b), true);
            let got = hl.apply(&host(&x), batch);
            // the reference: the weights rounded to bf16, everything else exact (f64)
            let wr = w.to_kind(Kind::BFloat16).to_kind(Kind::Double);
            let exact = x.to_kind(Kind::Double).matmul(&wr.tr()) + b.to_kind(Kind::Double);
            let exact = Vec::<f64>::try_from(&exact.view([-1])).unwrap();
            let err = got
                .iter()
                .zip(&exact)
                .map(|(g, e)| (*g as f64 - e).abs())
                .fold(0.0, f64::max);
            // f32 sums of k products: a few f32 ulps of the row's magnitude, unless x was
            // rounded to bf16 too (libtorch's bf16 product under AMX), 2^-8 relative
            let bound = if batch >= LIBTORCH_FROM_BATCH && libtorch_bf16_is_fast() {
                0.02 * (k as f64).sqrt()
            } else {
                1e-4
            };
            assert!(err < bound, "({batch}, {k}) -> {n}: {err}");
            // and away from the f32 product: the rounding is real
            let f32_out = host(&x.linear(&w, Some(&b)));
            assert!(max_diff(&got, &f32_out) > 1e-4, "({batch}, {k}) -> {n}");
            let mut row = Vec::new();
            hl.push_row(2, &mut row);
            let want_row = Vec::<f32>::try_from(&wr.get(2).to_kind(Kind::Float)).unwrap();
            assert_eq!(row, want_row);
        }
    }

    #[test]
    fn dot_matches_the_plain_sum() {
        let a: Vec<f32> = (0..53).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..53).map(|i| (i as f32 * 0.11).cos()).collect();
        let want: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
        assert!((dot(&a, &b) as f64 - want).abs() < 1e-5);
        assert_eq!(dot(&[], &[]), 0.0);
    }

    #[test]
    fn layer_norm_and_gelu_match_libtorch() {
        tch::manual_seed(4);
        let d = 256;
        let x = Tensor::randn([3, d], (Kind::Float, Device::Cpu)) * 3.0 + 1.5;
        let w = Tensor::randn([d], (Kind::Float, Device::Cpu));
        let b = Tensor::randn([d], (Kind::Float, Device::Cpu));
        let want = host(&x.layer_norm([d], Some(&w), Some(&b), 1e-5, false));
        let mut got = vec![0f32; 3 * d as usize];
        layer_norm(&host(&x), &host(&w), &host(&b), 1e-5, &mut got);
        assert!(max_diff(&got, &want) < 1e-5);

        let mut g = host(&x);
        gelu(&mut g);
        assert!(max_diff(&g, &host(&x.gelu("none"))) < 1e-6);
        // the exact form, not the tanh approximation (they differ by about 1e-3 near 1.5)
        assert!(max_diff(&g, &host(&x.gelu("tanh"))) > 1e-5);
    }
}
