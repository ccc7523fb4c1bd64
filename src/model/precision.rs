//! The precision of the model's dense matrix products: f32, or bf16 inputs with f32
//! accumulation (`--precision auto|f32|bf16`).
//!
//! What bf16 changes, and what it leaves alone:
//! * **bf16:** the inputs and weights of the dense projections ([`dense`]: attention's qkv
//!   and output projections, the feed-forward layers, the output head), rounded to nearest
//!   even; libtorch accumulates their products in f32 and rounds the result to bf16, which
//!   comes back as f32 (PyTorch's `torch.autocast("cpu", dtype=torch.bfloat16)` does the same
//!   to these products). Where libtorch's bf16 product is slow (a CPU without AMX-BF16 or
//!   AVX512-BF16), the same numbers come from f32 kernels on bf16-rounded values, forward
//!   and backward ([`bf16_linear`]): bf16 then costs a little more than f32 there, and
//!   `auto` does not pick it.
//! * **f32, always:** the master weights and AdamW's moments; embeddings, layer norms,
//!   residual sums, GELU; the softmax, its log-sum-exp and the loss; FAVOR+'s feature maps,
//!   prefix sums and normalizers; the SPE filters and their statistics; RoPE. The fused C++
//!   kernels take f32 only, so they stay f32 with the casts at their edges (the dense
//!   projections before and after them).
//! * **Generation on the host** ([`crate::model::host`]): the weights of the matrix-vector
//!   products are kept as bf16 (half the bytes to read per token) and widened to f32 in the
//!   registers; the activations stay f32.
//!
//! Invariants: with [`Precision::F32`] nothing here changes a single float; [`dense`] is
//! the only place where the model rounds to bf16; the precision in force is per thread and
//! set only for the duration of a call ([`scope`]), so a panic or an early return cannot
//! leave it set.

use std::cell::Cell;

use serde::{Deserialize, Serialize};
use tch::{nn, Device, Kind, Tensor};

/// A precision as asked for (`auto`) or as resolved (`f32`, `bf16`).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// bf16 where the hardware multiplies it faster than f32 (CUDA; a CPU with AMX or
    /// AVX512-BF16), f32 elsewhere.
    #[default]
    Auto,
    /// Every product in f32.
    F32,
    /// The dense projections in bf16 with f32 accumulation (see the module docs).
    Bf16,
}

impl Precision {
    /// The name users type and configs store.
    pub fn name(self) -> &'static str {
        match self {
            Precision::Auto => "auto",
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
        }
    }

    /// `auto` made concrete for `device` (f32 and bf16 are returned as they are), with the
    /// reason in words, for the log and the record.
    pub fn resolve(self, device: Device) -> Resolved {
        let (precision, reason) = match self {
            Precision::F32 => (Precision::F32, "asked for".to_owned()),
            Precision::Bf16 => (Precision::Bf16, "asked for".to_owned()),
            Precision::Auto => auto_for(device, CpuBf16::detect()),
        };
        Resolved { precision, reason }
    }

    /// Whether this (resolved) precision rounds the dense products to bf16.
    pub fn is_bf16(self) -> bool {
        self == Precision::Bf16
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The precision of a config, report or record written before the precision was saved
/// in it: everything ran in f32 then (a serde default).
pub fn f32_before_it_was_recorded() -> Precision {
    Precision::F32
}

/// A precision made concrete ([`Precision::F32`] or [`Precision::Bf16`]) and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resolved {
    pub precision: Precision,
    pub reason: String,
}

impl std::fmt::Display for Resolved {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.precision, self.reason)
    }
}

/// What `auto` picks on `device` given the CPU's bf16 instructions: a pure function, so
/// that every branch is tested on any machine.
pub fn auto_for(device: Device, cpu: CpuBf16) -> (Precision, String) {
    match device {
        Device::Cpu if cpu.amx_bf16 => (Precision::Bf16, "auto: the CPU has AMX-BF16".into()),
        Device::Cpu if cpu.avx512_bf16 => (Precision::Bf16, "auto: the CPU has AVX512-BF16".into()),
        Device::Cpu => (
            Precision::F32,
            "auto: the CPU has neither AMX-BF16 nor AVX512-BF16, where bf16 products \
             are slower than f32"
                .into(),
        ),
        _ => (Precision::Bf16, format!("auto: {device:?}")),
    }
}

/// The bf16 matrix instructions of this CPU (x86-64; none elsewhere), as the processor
/// reports them and the operating system enables them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CpuBf16 {
    /// AMX tiles with bf16 products (CPUID.7.0:EDX bits 22 and 24; XCR0 bits 17-18).
    pub amx_bf16: bool,
    /// AVX-512 bf16 dot products (`vdpbf16ps`).
    pub avx512_bf16: bool,
}

impl CpuBf16 {
    /// Those of this CPU: CPUID and XCR0, read once per process.
    pub fn detect() -> CpuBf16 {
        static CPU: std::sync::OnceLock<CpuBf16> = std::sync::OnceLock::new();
        *CPU.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            {
                CpuBf16 {
                    amx_bf16: amx_bf16(),
                    avx512_bf16: std::arch::is_x86_feature_detected!("avx512bf16"),
                }
            }
            #[cfg(not(target_arch = "x86_64"))]
            {
                CpuBf16::default()
            }
        })
    }
}

/// AMX-BF16 and AMX-TILE reported by the CPU, and the tile state enabled in XCR0 by the
/// operating system (the standard library does not detect AMX on stable Rust).
#[cfg(target_arch = "x86_64")]
fn amx_bf16() -> bool {
    use std::arch::x86_64::{__cpuid, __cpuid_count};
    if __cpuid(0).eax < 7 {
        return false;
    }
    let edx = __cpuid_count(7, 0).edx;
    let (tile, bf16) = (edx & (1 << 24) != 0, edx & (1 << 22) != 0);
    let osxsave = __cpuid(1).ecx & (1 << 27) != 0;
    if !(tile && bf16 && osxsave) {
        return false;
    }
    // SAFETY: CPUID.1:ECX.OSXSAVE (checked above) means XGETBV is available and enabled.
    let xcr0 = unsafe { xcr0() };
    xcr0 & (0b11 << 17) == 0b11 << 17
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "xsave")]
unsafe fn xcr0() -> u64 {
    std::arch::x86_64::_xgetbv(0)
}

thread_local! {
    /// Whether [`dense`] rounds to bf16 on this thread (set only inside [`scope`]).
    static BF16: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` with the dense products of this thread in `precision` (resolved: `auto` counts
/// as f32), restoring the previous precision afterwards, also when `f` panics.
pub fn scope<T>(precision: Precision, f: impl FnOnce() -> T) -> T {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            BF16.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(BF16.with(|c| c.replace(precision.is_bf16())));
    f()
}

/// Whether the dense products of this thread are in bf16 now.
pub fn bf16_active() -> bool {
    BF16.with(|c| c.get())
}

/// `x w^T + b` for (.., in) rows of f32 `x`: in f32, or, inside a bf16 [`scope`], with `x`
/// and `w` rounded to bf16, the product accumulated in f32 and rounded to bf16, and the
/// f32 bias added to it in f32. Returns f32.
pub fn dense(x: &Tensor, l: &nn::Linear) -> Tensor {
    dense_weight(x, &l.ws, l.bs.as_ref())
}

/// [`dense`] for a weight (out, in) and an optional bias (out) given as tensors.
pub fn dense_weight(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Tensor {
    if !bf16_active() || x.kind() != Kind::Float {
        return x.linear(w, b);
    }
    bf16_linear(x, w, b, native_bf16(x.device()))
}

/// Whether libtorch multiplies bf16 natively and fast on `device`: CUDA, or a CPU with
/// AMX-BF16 or AVX512-BF16 (elsewhere its bf16 products are far slower than f32).
pub fn native_bf16(device: Device) -> bool {
    let cpu = CpuBf16::detect();
    device != Device::Cpu || cpu.amx_bf16 || cpu.avx512_bf16
}

/// The bf16 product of [`dense`]: `native`, libtorch's bf16 matrix product (f32
/// accumulation, bf16 result); otherwise the same numbers from f32 kernels: the inputs
/// and the result rounded to bf16 around an f32 product (the product of two bf16 values
/// is exact in f32, so only the order of the f32 sums differs). The gradients match too:
/// the backward of each f32 -> bf16 -> f32 round trip rounds the gradient passing through
/// it to bf16, as the bf16 product's own backward does.
fn bf16_linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>, native: bool) -> Tensor {
    let bf = |t: &Tensor| t.to_kind(Kind::BFloat16);
    let y = if native {
        bf(x).linear::<Tensor>(&bf(w), None).to_kind(Kind::Float)
    } else {
        let round = |t: &Tensor| bf(t).to_kind(Kind::Float);
        round(&round(x).linear::<Tensor>(&round(w), None))
    };
    match b {
        Some(b) => y + b,
        None => y,
    }
}

/// f32 -> bf16 bits, rounded to nearest even (libtorch's cast; a NaN stays a quiet NaN).
pub fn bf16_bits(v: f32) -> u16 {
    let b = v.to_bits();
    if v.is_nan() {
        return ((b >> 16) as u16) | 0x0040;
    }
    let round = 0x7FFF + ((b >> 16) & 1);
    (b.wrapping_add(round) >> 16) as u16
}

/// bf16 bits -> f32 (exact).
#[inline(always)]
pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_picks_bf16_only_where_the_hardware_has_it() {
        let none = CpuBf16::default();
        let amx = CpuBf16 {
            amx_bf16: true,
            avx512_bf16: true,
        };
        let avx = CpuBf16 {
            amx_bf16: false,
            avx512_bf16: true,
        };
        assert_eq!(auto_for(Device::Cpu, none).0, Precision::F32);
        assert_eq!(auto_for(Device::Cpu, amx).0, Precision::Bf16);
        assert!(auto_for(Device::Cpu, amx).1.contains("AMX"));
        assert_eq!(auto_for(Device::Cpu, avx).0, Precision::Bf16);
        assert_eq!(auto_for(Device::Cuda(0), none).0, Precision::Bf16);
        // asked-for precisions are kept whatever the machine
        assert_eq!(
            Precision::F32.resolve(Device::Cuda(0)).precision,
            Precision::F32
        );
        assert_eq!(
            Precision::Bf16.resolve(Device::Cpu).precision,
            Precision::Bf16
        );
        let auto = Precision::Auto.resolve(Device::Cpu).precision;
        assert_ne!(auto, Precision::Auto, "auto resolves to f32 or bf16");
    }

    #[test]
    fn names_round_trip_through_serde() {
        for p in [Precision::Auto, Precision::F32, Precision::Bf16] {
            let s = serde_json::to_string(&p).unwrap();
            assert_eq!(s, format!("\"{}\"", p.name()));
            assert_eq!(serde_json::from_str::<Precision>(&s).unwrap(), p);
        }
        assert!(serde_json::from_str::<Precision>("\"fp16\"").is_err());
    }

    #[test]
    fn bf16_rounding_matches_libtorch_bit_for_bit() {
        let mut vals: Vec<f32> = vec![
            0.0,
            -0.0,
            1.0,
            -1.5,
            f32::MIN_POSITIVE,
            1e-40,
            f32::MAX,
            -f32::MAX,
            f32::INFINITY,
            f32::NEG_INFINITY,
            // exact ties: the even neighbour wins
            f32::from_bits(0x3F80_8000),
            f32::from_bits(0x3F81_8000),
            f32::from_bits(0x3F80_7FFF),
        ];
        let mut s = 0x1234_5678u32;
        for _ in 0..4096 {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            let v = f32::from_bits(s);
            if v.is_finite() {
                vals.push(v);
            }
        }
        let t = Tensor::from_slice(&vals)
            .to_kind(Kind::BFloat16)
            .to_kind(Kind::Float);
        let theirs = Vec::<f32>::try_from(&t).unwrap();
        for (v, w) in vals.iter().zip(&theirs) {
            let ours = bf16_to_f32(bf16_bits(*v));
            assert_eq!(ours.to_bits(), w.to_bits(), "{v:e}: {ours:e} vs {w:e}");
        }
        assert!(bf16_to_f32(bf16_bits(f32::NAN)).is_nan());
    }

    #[test]
    fn scope_is_restored_after_a_panic_and_nests() {
        assert!(!bf16_active());
        scope(Precision::Bf16, || {
            assert!(bf16_active());
            scope(Precision::F32, || assert!(!bf16_active()));
            assert!(bf16_active());
        });
        assert!(!bf16_active());
        let r = std::panic::catch_unwind(|| scope(Precision::Bf16, || panic!("inside")));
        assert!(r.is_err());
        assert!(!bf16_active(), "a panic inside the scope left bf16 set");
        scope(Precision::Auto, || assert!(!bf16_active()));
    }

    #[test]
    fn emulated_bf16_products_are_the_native_ones_forward_and_backward() {
        tch::manual_seed(8);
        let x0 = Tensor::randn([6, 96], (Kind::Float, Device::Cpu));
        let w0 = Tensor::randn([40, 96], (Kind::Float, Device::Cpu)) * 0.1;
        let b0 = Tensor::randn([40], (Kind::Float, Device::Cpu));
        let dy = Tensor::randn([6, 40], (Kind::Float, Device::Cpu));
        let run = |native: bool| {
            let x = x0.copy().set_requires_grad(true);
            let w = w0.copy().set_requires_grad(true);
            let y = bf16_linear(&x, &w, Some(&b0), native);
            (&y * &dy).sum(Kind::Float).backward();
            (y.detach(), x.grad(), w.grad())
        };
        let (yn, gxn, gwn) = run(true);
        let (ye, gxe, gwe) = run(false);
        // both are bf16 values (8 significant bits) of nearly the same f32 sums: equal
        // or one bf16 step (2^-7 relative) apart
        let ulp_apart = |a: &Tensor, b: &Tensor, what: &str| {
            let scale = a.abs().max().double_value(&[]);
            let err = (a - b).abs().max().double_value(&[]);
            assert!(err <= scale * 2f64.powi(-7), "{what}: {err} of {scale}");
        };
        ulp_apart(&(&yn - &b0), &(&ye - &b0), "forward");
        ulp_apart(&gxn, &gxe, "input gradient");
        ulp_apart(&gwn, &gwe, "weight gradient");
        // and the emulated gradients are bf16 values, as the native ones are
        for g in [&gxe, &gwe, &gxn, &gwn] {
            assert_eq!(g.kind(), Kind::Float);
            let r = g.to_kind(Kind::BFloat16).to_kind(Kind::Float);
            assert_eq!(&r, g, "a gradient that is not a bf16 value");
        }
    }

    #[test]
    fn dense_is_exact_in_f32_and_close_in_bf16() {
        tch::manual_seed(3);
        let vs = nn::VarStore::new(Device::Cpu);
        let l = nn::linear(vs.root(), 64, 48, Default::default());
        let x = Tensor::randn([5, 7, 64], (Kind::Float, Device::Cpu));
        let f32_out = dense(&x, &l);
        assert_eq!(f32_out, x.apply(&l), "f32 dense must be libtorch's linear");
        let bf = scope(Precision::Bf16, || dense(&x, &l));
        assert_eq!(bf.kind(), Kind::Float);
        assert_eq!(bf.size(), f32_out.size());
        // the reference: inputs rounded, product in f64, then rounded to bf16, plus bias
        let xr = x.to_kind(Kind::BFloat16).to_kind(Kind::Double);
        let wr = l.ws.to_kind(Kind::BFloat16).to_kind(Kind::Double);
        let want = xr
            .matmul(&wr.tr())
            .to_kind(Kind::BFloat16)
            .to_kind(Kind::Double)
            + l.bs.as_ref().unwrap().to_kind(Kind::Double);
        let err = (bf.to_kind(Kind::Double) - &want)
            .abs()
            .max()
            .double_value(&[]);
        let scale = want.abs().max().double_value(&[]);
        // one bf16 rounding of the result apart at most (2^-8 relative), plus the sum order
        assert!(
            err <= scale * 2f64.powi(-8),
            "bf16 dense off by {err} (scale {scale})"
        );
        let f32_err = (f32_out.to_kind(Kind::Double) - &want)
            .abs()
            .max()
            .double_value(&[]);
        assert!(f32_err > 0.0, "bf16 rounding must be visible against f32");
        // gradients reach the f32 weights through the casts
        let g = scope(Precision::Bf16, || dense(&x.set_requires_grad(true), &l));
        g.sum(Kind::Float).backward();
        let gw = l.ws.grad();
        assert_eq!(gw.kind(), Kind::Float);
        assert!(gw.abs().sum(Kind::Float).double_value(&[]) > 0.0);
    }
}
