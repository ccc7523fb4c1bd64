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
//! Invariants: every function here computes what its libtorch counterpart does (`linear`,
//! `layer_norm`, `gelu("none")`) up to the order of f32 sums; the tests check each one
//! against libtorch.

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

/// `out = x w^T + bias` for `batch` rows: w (N, K) row-major (a `nn::Linear` weight),
/// x (batch, K), out (batch, N). Each weight row is read once for every row of x.
pub(crate) fn linear(w: &[f32], bias: Option<&[f32]>, x: &[f32], batch: usize, out: &mut [f32]) {
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
unsafe fn linear_avx512(w: &[f32], bias: Option<&[f32]>, x: &[f32], batch: usize, out: &mut [f32]) {
    linear_rows(w, bias, x, batch, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn linear_avx2(w: &[f32], bias: Option<&[f32]>, x: &[f32], batch: usize, out: &mut [f32]) {
    linear_rows(w, bias, x, batch, out)
}

/// Four weight rows at a time against each row of x: four independent sums per x row
/// (one running sum would wait on its own latency at every step), x read once for the
/// four, the four weight rows kept in L1 across the rows of x. The blocks of four are
/// taken in pairs from the two halves of w, so that the weights come in two streams
/// (2-4% faster at batch 1 than one stream, on the Xeon of docs/benchmarks.md).
#[inline(always)]
fn linear_rows(w: &[f32], bias: Option<&[f32]>, x: &[f32], batch: usize, out: &mut [f32]) {
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
            out[r * n + o] = dot_lanes(row, xr) + bias_of(o);
        }
    }
}

/// The dot products of four consecutive rows of length x.len() (rows: 4 * x.len()) with x.
#[inline(always)]
fn dot4(rows: &[f32], x: &[f32]) -> [f32; 4] {
    const W: usize = 16;
    let k = x.len();
    let r: [&[f32]; 4] = [
        &rows[..k],
        &rows[k..2 * k],
        &rows[2 * k..3 * k],
        &rows[3 * k..4 * k],
    ];
    let mut acc = [[0f32; W]; 4];
    let lanes = |s: &[f32], c: usize| -> [f32; W] { s[c..c + W].try_into().expect("W lanes") };
    let full = k / W * W;
    for c in (0..full).step_by(W) {
        let xc = lanes(x, c);
        let w = [
            lanes(r[0], c),
            lanes(r[1], c),
            lanes(r[2], c),
            lanes(r[3], c),
        ];
        for j in 0..4 {
            for i in 0..W {
                acc[j][i] += w[j][i] * xc[i];
            }
        }
    }
    let mut out = [0f32; 4];
    for j in 0..4 {
        let tail: f32 = r[j][full..]
            .iter()
            .zip(&x[full..])
            .map(|(a, b)| a * b)
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

/// A `nn::Linear` as host copies: weight (N, K) row-major and bias (N).
#[derive(Debug)]
pub(crate) struct HostLinear {
    w: Vec<f32>,
    b: Option<Vec<f32>>,
    /// N, the output width.
    pub n: usize,
}

impl HostLinear {
    pub fn of(l: &tch::nn::Linear) -> HostLinear {
        HostLinear::new(&l.ws, l.bs.as_ref())
    }

    /// From a weight (N, K) and an optional bias (N).
    pub fn new(w: &tch::Tensor, b: Option<&tch::Tensor>) -> HostLinear {
        HostLinear {
            n: w.size()[0] as usize,
            w: super::host_f32(w),
            b: b.map(super::host_f32),
        }
    }

    /// Row `i` of the weight (K).
    pub fn row(&self, i: usize) -> &[f32] {
        let k = self.w.len() / self.n.max(1);
        &self.w[i * k..(i + 1) * k]
    }

    /// `x w^T + b` for `batch` rows of x.
    pub fn apply(&self, x: &[f32], batch: usize) -> Vec<f32> {
        if batch >= LIBTORCH_FROM_BATCH {
            return self.apply_libtorch(x, batch);
        }
        let mut out = vec![0f32; batch * self.n];
        linear(&self.w, self.b.as_deref(), x, batch, &mut out);
        out
    }

    /// [`HostLinear::apply`] through libtorch, on tensors that view the host copies.
    fn apply_libtorch(&self, x: &[f32], batch: usize) -> Vec<f32> {
        let (n, k) = (self.n as i64, (self.w.len() / self.n.max(1)) as i64);
        assert_eq!(
            x.len() as i64,
            batch as i64 * k,
            "linear: x of another size"
        );
        let view = |v: &[f32], size: &[i64], strides: &[i64]| {
            // SAFETY: `v` holds exactly the elements of `size` with `strides` (contiguous
            // f32), and outlives the tensor: every tensor made here is dropped before this
            // function returns (the result is copied out), and none is written to.
            unsafe {
                tch::Tensor::from_blob(
                    v.as_ptr() as *const u8,
                    size,
                    strides,
                    tch::Kind::Float,
                    tch::Device::Cpu,
                )
            }
        };
        let w = view(&self.w, &[n, k], &[k, 1]);
        let b = self.b.as_deref().map(|b| view(b, &[n], &[1]));
        let xt = view(x, &[batch as i64, k], &[k, 1]);
        super::host_f32(&tch::no_grad(|| xt.linear(&w, b.as_ref())))
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
        let hl = HostLinear::of(&l);
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
