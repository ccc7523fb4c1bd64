//! The crate's C++ kernels (libtorch autograd functions that `tch` cannot
//! define in Rust), compiled by `build.rs`: `spe_filter.cpp` (SPE's filter),
//! `favor_attention.cpp` (FAVOR+'s features and causal linear attention) and
//! `rope.cpp` (RoPE), with what they share in `kernels.h`. Each returns new tensors that the caller owns, or a
//! failure whose reason [`cadenza_kernel_error`] holds.

use std::ffi::c_char;

use tch::Tensor;
use torch_sys::C_tensor;

extern "C" {
    pub fn cadenza_spe_filter(
        x: *const C_tensor,
        code: *const C_tensor,
        a: *const C_tensor,
        xi: *const C_tensor,
    ) -> *mut C_tensor;
    pub fn cadenza_sine_filter(
        x: *const C_tensor,
        omega: *const C_tensor,
        zg: *const C_tensor,
        a: *const C_tensor,
        xi: *const C_tensor,
        cycles: *const C_tensor,
        offsets: *const C_tensor,
        start: i64,
    ) -> *mut C_tensor;
    /// Writes (out, s_end, z_end) to `out` and returns true, or returns false.
    pub fn cadenza_favor_attention(
        pq: *const C_tensor,
        pk: *const C_tensor,
        v: *const C_tensor,
        s0: *const C_tensor,
        z0: *const C_tensor,
        out: *mut *mut C_tensor,
    ) -> bool;
    pub fn cadenza_favor_features(
        x: *const C_tensor,
        proj: *const C_tensor,
        scale: f64,
        query: bool,
        antithetic: bool,
    ) -> *mut C_tensor;
    pub fn cadenza_rope(
        x: *const C_tensor,
        cos: *const C_tensor,
        sin: *const C_tensor,
    ) -> *mut C_tensor;
    /// Why the last failed call of this thread failed.
    pub fn cadenza_kernel_error() -> *const c_char;
}

/// `t` itself where its last dimension has a unit stride (as the kernels take their
/// rows), a contiguous copy otherwise.
pub fn unit_last_stride(t: &Tensor) -> Tensor {
    if t.stride().last() == Some(&1) {
        t.shallow_clone()
    } else {
        t.contiguous()
    }
}

/// The reason of this thread's last failed kernel call.
pub fn kernel_error() -> String {
    // SAFETY: the C++ side returns a live NUL-terminated string of this thread.
    unsafe { std::ffi::CStr::from_ptr(cadenza_kernel_error()) }
        .to_string_lossy()
        .into_owned()
}

/// The tensor a C++ kernel returned, which the result owns and frees.
///
/// # Safety
/// `out` is null or a new tensor of a kernel, owned by nobody else.
///
/// # Panics
/// On null: the C++ side rejected its inputs (a caller's bug), with its reason.
pub unsafe fn owned_result(out: *mut C_tensor, what: &str) -> Tensor {
    if out.is_null() {
        panic!("{what}: {}", kernel_error());
    }
    Tensor::from_ptr(out)
}
