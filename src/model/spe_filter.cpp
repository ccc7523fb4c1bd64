// The gated SPE filter on the CPU in f32, as one libtorch autograd function
// (`tch` has no custom autograd Function, so this is C++; see spe.rs,
// `spe_filter_with`, for the same math in libtorch calls, which the tests hold
// this to, and ../../docs for the model).
//
//   x     (B, L, H, D)  queries or keys (any strides with unit stride over D)
//   code  (L, H, D, R)  the SPE code of each position, shared by the batch
//   a     (H, D)        sqrt(1 - g) of the gate          (absent when ungated)
//   xi    (H, D, R)     sqrt(g) xi, the gate's noise     (absent when ungated)
//   out   (B, H, L, R)  out[b, h, m, :] = sum_d (x a)[b, m, h, d] code[m, h, d, :]
//                                        + sum_d x[b, m, h, d] xi[h, d, :]
//
// Why: libtorch forms this as a batched matmul over (L, H) of (B x D)(D x R)
// products, whose backward runs 2 L H more tiny products with an inner
// dimension of B, and writes the code gradient through layout copies. Here
// each (position, head) is one pass over its code block (D R floats, in L1)
// for every row of the batch, forward and backward; the gradients of a and xi
// are summed in per-thread buffers.
//
// Backward, with u[m, h, d, :] = sum_b x[b, m, h, d] g[b, h, m, :]:
//   dx[b, m, h, d]   = g[b, h, m, :] . (a[h, d] code[m, h, d, :] + xi[h, d, :])
//   dcode[m, h, d, :] = a[h, d] u[m, h, d, :]
//   da[h, d]         = sum_m code[m, h, d, :] . u[m, h, d, :]
//   dxi[h, d, :]     = sum_m u[m, h, d, :]
//
// Floats: the sums run in another order than libtorch's, so results differ
// from the libtorch form in the last bits (the tests allow 1e-5 relative).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace {

using at::Tensor;

// The largest R the kernels take (their per-row buffers live on the stack).
constexpr int64_t kMaxR = 256;

struct Shapes {
  int64_t b, l, h, d, r;
  // strides of x over b, m, h (unit stride over d)
  int64_t sxb, sxm, sxh;
};

#define CADENZA_INLINE inline __attribute__((always_inline))

// 16 floats (GCC's vector extension: one AVX-512 register, two AVX ones, four
// SSE ones on the baseline); loads and stores through it need no alignment.
typedef float vf __attribute__((vector_size(64)));
typedef float vfu __attribute__((vector_size(64), aligned(4)));
typedef int vi __attribute__((vector_size(64)));
constexpr int kLanes = 16;

CADENZA_INLINE vf load(const float* p) { return *reinterpret_cast<const vfu*>(p); }
CADENZA_INLINE void store(float* p, vf v) { *reinterpret_cast<vfu*>(p) = v; }
// (a float times or plus a vf is broadcast by the compiler)
CADENZA_INLINE vf zero() { return vf{} ; }
CADENZA_INLINE float hsum(vf v) {
  v = v + __builtin_shuffle(v, vi{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
  v = v + __builtin_shuffle(v, vi{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
  v = v + __builtin_shuffle(v, vi{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
  v = v + __builtin_shuffle(v, vi{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
  return v[0];
}

// The rows of x of item i (one per batch row, far apart in memory: the
// hardware prefetcher does not follow them) are asked for kAhead items early.
constexpr int64_t kAhead = 2;

CADENZA_INLINE void prefetch_rows(const Shapes& s, const float* x, int64_t i, int64_t end) {
  if (i >= end) return;
  const float* xm = x + (i / s.h) * s.sxm + (i % s.h) * s.sxh;
  for (int64_t b = 0; b < s.b; ++b)
    for (int64_t d = 0; d < s.d; d += 16) __builtin_prefetch(xm + b * s.sxb + d);
}

// out rows of the items (m, h) = (i / H, i % H) for i in [begin, end).
// RR > 0 (a multiple of 16) fixes R at compile time: the rows are then NV
// vectors held in registers. RR = 0 takes any R, one float at a time.
template <int RR, bool GATED>
CADENZA_INLINE void forward_items(const Shapes& s, const float* x, const float* code,
                                  const float* a, const float* xi, float* out,
                                  int64_t begin, int64_t end) {
  const int64_t R = RR > 0 ? RR : s.r;
  const int64_t D = s.d;
  for (int64_t i = begin; i < end; ++i) {
    const int64_t m = i / s.h, h = i % s.h;
    const float* c = code + i * D * R;
    const float* ah = GATED ? a + h * D : nullptr;
    const float* nh = GATED ? xi + h * D * R : nullptr;
    prefetch_rows(s, x, i + kAhead, end);
    for (int64_t b = 0; b < s.b; ++b) {
      const float* xr = x + b * s.sxb + m * s.sxm + h * s.sxh;
      float* o = out + ((b * s.h + h) * s.l + m) * R;
      if constexpr (RR > 0) {
        // separate sums for the code and the noise terms: twice the
        // independent chains of FMAs
        constexpr int NV = RR / kLanes;
        vf acc[NV], accn[NV];
#pragma GCC unroll 8
        for (int j = 0; j < NV; ++j) acc[j] = accn[j] = zero();
        // the next item's code block, a row per row of this one (the batch's
        // first pass), so that it streams in while this one is worked on
        const float* cn = i + 1 < end && b == 0 ? c + D * RR : nullptr;
        for (int64_t d = 0; d < D; ++d) {
          const float xd = xr[d];
          const float* cr = c + d * RR;
          if (cn)
            for (int j = 0; j < RR; j += kLanes) __builtin_prefetch(cn + d * RR + j);
          if (GATED) {
            const float* nr = nh + d * RR;
            const float xa = xd * ah[d];
#pragma GCC unroll 8
            for (int j = 0; j < NV; ++j) {
              acc[j] += xa * load(cr + kLanes * j);
              accn[j] += xd * load(nr + kLanes * j);
            }
          } else {
#pragma GCC unroll 8
            for (int j = 0; j < NV; ++j) acc[j] += xd * load(cr + kLanes * j);
          }
        }
#pragma GCC unroll 8
        for (int j = 0; j < NV; ++j) store(o + kLanes * j, GATED ? acc[j] + accn[j] : acc[j]);
      } else {
        float acc[kMaxR];
        for (int64_t r = 0; r < R; ++r) acc[r] = 0.f;
        for (int64_t d = 0; d < D; ++d) {
          const float xd = xr[d];
          const float* cr = c + d * R;
          if (GATED) {
            const float xa = xd * ah[d];
            const float* nr = nh + d * R;
            for (int64_t r = 0; r < R; ++r) acc[r] += xa * cr[r] + xd * nr[r];
          } else {
            for (int64_t r = 0; r < R; ++r) acc[r] += xd * cr[r];
          }
        }
        for (int64_t r = 0; r < R; ++r) o[r] = acc[r];
      }
    }
  }
}

struct Grads {
  float* dx;     // (B, L, H, D) contiguous, or null
  float* dcode;  // (L, H, D, R) contiguous, or null
  float* da;     // this thread's (H, D) partial sums, or null
  float* dxi;    // this thread's (H, D, R) partial sums, or null
};

// The gradients of the items [begin, end), one feature d at a time: its row
// of the code (and of xi) is read once for the whole batch.
template <int RR, bool GATED>
CADENZA_INLINE void backward_items(const Shapes& s, const float* x, const float* code,
                                   const float* a, const float* xi, const float* g,
                                   const Grads& out, int64_t begin, int64_t end) {
  const int64_t R = RR > 0 ? RR : s.r;
  const int64_t D = s.d;
  for (int64_t i = begin; i < end; ++i) {
    const int64_t m = i / s.h, h = i % s.h;
    const float* c = code + i * D * R;
    const float* ah = GATED ? a + h * D : nullptr;
    const float* nh = GATED ? xi + h * D * R : nullptr;
    prefetch_rows(s, x, i + kAhead, end);
    if (i + kAhead < end) {
      const float* gn = g + ((i + kAhead) % s.h * s.l + (i + kAhead) / s.h) * R;
      for (int64_t b = 0; b < s.b; ++b)
        for (int64_t r = 0; r < R; r += 16) __builtin_prefetch(gn + b * s.h * s.l * R + r);
    }
    const float* xm = x + m * s.sxm + h * s.sxh;         // + b sxb + d
    const float* gm = g + (h * s.l + m) * R;             // + b H L R
    const int64_t gb = s.h * s.l * R;
    float* dxm = out.dx ? out.dx + (m * s.h + h) * D : nullptr;  // + b L H D + d
    const int64_t dxb = s.l * s.h * D;
    for (int64_t d = 0; d < D; ++d) {
      const float* cr = c + d * R;
      const float* nr = GATED ? nh + d * R : nullptr;
      const float ad = GATED ? ah[d] : 1.f;
      if constexpr (RR > 0) {
        constexpr int NV = RR / kLanes;
        vf e[NV], u[NV];
#pragma GCC unroll 8
        for (int j = 0; j < NV; ++j) {
          e[j] = GATED ? ad * load(cr + kLanes * j) + load(nr + kLanes * j) : load(cr + kLanes * j);
          u[j] = zero();
        }
        for (int64_t b = 0; b < s.b; ++b) {
          const float* gr = gm + b * gb;
          const float xd = xm[b * s.sxb + d];
          vf p = zero();
#pragma GCC unroll 8
          for (int j = 0; j < NV; ++j) {
            const vf gj = load(gr + kLanes * j);
            p += gj * e[j];
            u[j] += xd * gj;
          }
          if (dxm) dxm[b * dxb + d] = hsum(p);
        }
        if (out.dcode) {
          float* dc = out.dcode + (i * D + d) * RR;
#pragma GCC unroll 8
          for (int j = 0; j < NV; ++j) store(dc + kLanes * j, ad * u[j]);
        }
        if (GATED && out.da) {
          vf p = zero();
#pragma GCC unroll 8
          for (int j = 0; j < NV; ++j) p += load(cr + kLanes * j) * u[j];
          out.da[h * D + d] += hsum(p);
        }
        if (GATED && out.dxi) {
          float* dn = out.dxi + (h * D + d) * RR;
#pragma GCC unroll 8
          for (int j = 0; j < NV; ++j) store(dn + kLanes * j, load(dn + kLanes * j) + u[j]);
        }
      } else {
        float u[kMaxR];
        for (int64_t r = 0; r < R; ++r) u[r] = 0.f;
        for (int64_t b = 0; b < s.b; ++b) {
          const float* gr = gm + b * gb;
          const float xd = xm[b * s.sxb + d];
          float p = 0.f;
          for (int64_t r = 0; r < R; ++r) {
            p += gr[r] * (GATED ? ad * cr[r] + nr[r] : cr[r]);
            u[r] += xd * gr[r];
          }
          if (dxm) dxm[b * dxb + d] = p;
        }
        if (out.dcode) {
          float* dc = out.dcode + (i * D + d) * R;
          for (int64_t r = 0; r < R; ++r) dc[r] = ad * u[r];
        }
        if (GATED && out.da) {
          float p = 0.f;
          for (int64_t r = 0; r < R; ++r) p += cr[r] * u[r];
          out.da[h * D + d] += p;
        }
        if (GATED && out.dxi) {
          float* dn = out.dxi + (h * D + d) * R;
          for (int64_t r = 0; r < R; ++r) dn[r] += u[r];
        }
      }
    }
  }
}

// One entry per (R, gated) case, compiled for AVX-512, AVX2 + FMA and the
// baseline, picked at run time (the crate is built for baseline x86-64).
enum class Isa { V4, V3, Base };

Isa widest() {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
  static const Isa isa = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("x86-64-v4")) return Isa::V4;
    if (__builtin_cpu_supports("x86-64-v3")) return Isa::V3;
    return Isa::Base;
  }();
  return isa;
#else
  return Isa::Base;
#endif
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CADENZA_TARGET(arch) __attribute__((target(arch)))
#define CADENZA_HAS_CLONES 1
#else
#define CADENZA_TARGET(arch)
#define CADENZA_HAS_CLONES 0
#endif

#define CADENZA_VARIANTS(NAME, ARGS, CALL)                                    \
  template <int RR, bool G>                                                    \
  CADENZA_TARGET("arch=x86-64-v4") void NAME##_v4 ARGS { NAME<RR, G> CALL; } \
  template <int RR, bool G>                                                    \
  CADENZA_TARGET("arch=x86-64-v3") void NAME##_v3 ARGS { NAME<RR, G> CALL; } \
  template <int RR, bool G>                                                    \
  void NAME##_base ARGS { NAME<RR, G> CALL; }

CADENZA_VARIANTS(forward_items,
                 (const Shapes& s, const float* x, const float* code, const float* a,
                  const float* xi, float* out, int64_t begin, int64_t end),
                 (s, x, code, a, xi, out, begin, end))
CADENZA_VARIANTS(backward_items,
                 (const Shapes& s, const float* x, const float* code, const float* a,
                  const float* xi, const float* g, const Grads& out, int64_t begin,
                  int64_t end),
                 (s, x, code, a, xi, g, out, begin, end))

template <int RR, bool G, typename... Args>
void forward_dispatch_isa(Args... args) {
  switch (widest()) {
    case Isa::V4: forward_items_v4<RR, G>(args...); break;
    case Isa::V3: forward_items_v3<RR, G>(args...); break;
    default: forward_items_base<RR, G>(args...); break;
  }
}

template <int RR, bool G, typename... Args>
void backward_dispatch_isa(Args... args) {
  switch (widest()) {
    case Isa::V4: backward_items_v4<RR, G>(args...); break;
    case Isa::V3: backward_items_v3<RR, G>(args...); break;
    default: backward_items_base<RR, G>(args...); break;
  }
}

// R = 32 (every preset) and 16 at compile time; any other R up to kMaxR at run time.
template <bool G, typename... Args>
void forward_dispatch(int64_t r, Args... args) {
  if (r == 32) return forward_dispatch_isa<32, G>(args...);
  if (r == 64) return forward_dispatch_isa<64, G>(args...);
  if (r == 16) return forward_dispatch_isa<16, G>(args...);
  forward_dispatch_isa<0, G>(args...);
}

template <bool G, typename... Args>
void backward_dispatch(int64_t r, Args... args) {
  if (r == 32) return backward_dispatch_isa<32, G>(args...);
  if (r == 64) return backward_dispatch_isa<64, G>(args...);
  if (r == 16) return backward_dispatch_isa<16, G>(args...);
  backward_dispatch_isa<0, G>(args...);
}

// Items (position, head) per task: enough work to amortize a task, small
// enough that 2 threads stay balanced at L = 1.
int64_t grain(const Shapes& s) {
  const int64_t per_item = std::max<int64_t>(1, s.b * s.d * s.r);
  return std::max<int64_t>(1, (1 << 16) / per_item);
}

Shapes shapes_of(const Tensor& x, const Tensor& code) {
  Shapes s;
  s.b = x.size(0);
  s.l = x.size(1);
  s.h = x.size(2);
  s.d = x.size(3);
  s.r = code.size(3);
  s.sxb = x.stride(0);
  s.sxm = x.stride(1);
  s.sxh = x.stride(2);
  return s;
}

Tensor filter_forward(const Tensor& x, const Tensor& code, const Tensor& a, const Tensor& xi) {
  const Shapes s = shapes_of(x, code);
  const bool gated = a.defined();
  Tensor out = at::empty({s.b, s.h, s.l, s.r}, x.options());
  const float* px = x.data_ptr<float>();
  const float* pc = code.data_ptr<float>();
  const float* pa = gated ? a.data_ptr<float>() : nullptr;
  const float* pn = gated ? xi.data_ptr<float>() : nullptr;
  float* po = out.data_ptr<float>();
  at::parallel_for(0, s.l * s.h, grain(s), [&](int64_t begin, int64_t end) {
    if (gated)
      forward_dispatch<true>(s.r, s, px, pc, pa, pn, po, begin, end);
    else
      forward_dispatch<false>(s.r, s, px, pc, pa, pn, po, begin, end);
  });
  return out;
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The gradients of x, code, a and xi (those asked for; undefined otherwise).
variable_list filter_backward(const Tensor& x, const Tensor& code, const Tensor& a,
                              const Tensor& xi, const Tensor& grad, bool want_dx,
                              bool want_dcode, bool want_da, bool want_dxi) {
  const bool gated = a.defined();
  const Tensor g = grad.contiguous();
  const Shapes s = shapes_of(x, code);
  Tensor dx, dcode, da, dxi;
  if (want_dx) dx = at::empty({s.b, s.l, s.h, s.d}, x.options());
  if (want_dcode) dcode = at::empty(code.sizes(), code.options());
  want_da = want_da && gated;
  want_dxi = want_dxi && gated;
  // per-thread partial sums of da and dxi, summed below
  const int64_t threads = at::get_num_threads();
  Tensor da_parts, dxi_parts;
  if (want_da) da_parts = at::zeros({threads, s.h, s.d}, x.options());
  if (want_dxi) dxi_parts = at::zeros({threads, s.h, s.d, s.r}, x.options());

  const float* px = x.data_ptr<float>();
  const float* pc = code.data_ptr<float>();
  const float* pa = gated ? a.data_ptr<float>() : nullptr;
  const float* pn = gated ? xi.data_ptr<float>() : nullptr;
  const float* pg = g.data_ptr<float>();
  float* pdx = want_dx ? dx.data_ptr<float>() : nullptr;
  float* pdc = want_dcode ? dcode.data_ptr<float>() : nullptr;
  float* pda = want_da ? da_parts.data_ptr<float>() : nullptr;
  float* pdn = want_dxi ? dxi_parts.data_ptr<float>() : nullptr;
  at::parallel_for(0, s.l * s.h, grain(s), [&](int64_t begin, int64_t end) {
    const int64_t t = at::get_thread_num();
    Grads out{pdx, pdc, pda ? pda + t * s.h * s.d : nullptr,
              pdn ? pdn + t * s.h * s.d * s.r : nullptr};
    if (gated)
      backward_dispatch<true>(s.r, s, px, pc, pa, pn, pg, out, begin, end);
    else
      backward_dispatch<false>(s.r, s, px, pc, pa, pn, pg, out, begin, end);
  });
  if (want_da) da = da_parts.sum(0);
  if (want_dxi) dxi = dxi_parts.sum(0);
  return {dx, dcode, da, dxi};
}

// Two autograd functions, gated and not: libtorch's custom functions do not
// take undefined tensors as inputs.
struct GatedFilter : public torch::autograd::Function<GatedFilter> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& code,
                        const Tensor& a, const Tensor& xi) {
    ctx->save_for_backward({x, code, a, xi});
    return filter_forward(x, code, a, xi);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto v = ctx->get_saved_variables();
    return filter_backward(v[0], v[1], v[2], v[3], grads[0], ctx->needs_input_grad(0),
                           ctx->needs_input_grad(1), ctx->needs_input_grad(2),
                           ctx->needs_input_grad(3));
  }
};

struct PlainFilter : public torch::autograd::Function<PlainFilter> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& code) {
    ctx->save_for_backward({x, code});
    return filter_forward(x, code, Tensor(), Tensor());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto v = ctx->get_saved_variables();
    auto g = filter_backward(v[0], v[1], Tensor(), Tensor(), grads[0], ctx->needs_input_grad(0),
                             ctx->needs_input_grad(1), false, false);
    return {g[0], g[1]};
  }
};

thread_local std::string last_error;

void check_inputs(const Tensor& x, const Tensor& code, const Tensor& a, const Tensor& xi) {
  TORCH_CHECK(x.dim() == 4 && code.dim() == 4, "x (B, L, H, D) and code (L, H, D, R)");
  TORCH_CHECK(x.scalar_type() == at::kFloat && code.scalar_type() == at::kFloat,
              "the fused SPE filter takes f32");
  TORCH_CHECK(x.device().is_cpu() && code.device().is_cpu(), "the fused SPE filter runs on the CPU");
  TORCH_CHECK(x.stride(3) == 1, "x needs a unit stride over D");
  TORCH_CHECK(code.is_contiguous(), "the code must be contiguous");
  TORCH_CHECK(code.size(0) == x.size(1) && code.size(1) == x.size(2) && code.size(2) == x.size(3),
              "code ", code.sizes(), " does not fit x ", x.sizes());
  TORCH_CHECK(code.size(3) >= 1 && code.size(3) <= kMaxR, "R must be in 1..=", kMaxR);
  TORCH_CHECK(a.defined() == xi.defined(), "a gate needs both a and xi");
  if (a.defined()) {
    TORCH_CHECK(a.scalar_type() == at::kFloat && xi.scalar_type() == at::kFloat, "f32 gate");
    TORCH_CHECK(a.is_contiguous() && xi.is_contiguous(), "a contiguous gate");
    TORCH_CHECK(a.dim() == 2 && a.size(0) == x.size(2) && a.size(1) == x.size(3), "a is (H, D)");
    TORCH_CHECK(xi.dim() == 3 && xi.size(0) == x.size(2) && xi.size(1) == x.size(3) &&
                    xi.size(2) == code.size(3),
                "xi is (H, D, R)");
  }
}

}  // namespace

extern "C" {

// The filter's output as a new tensor the caller owns (tch's C_tensor is an
// at::Tensor*), or null with the reason in cadenza_spe_filter_error(). a and
// xi may be null (ungated).
at::Tensor* cadenza_spe_filter(const at::Tensor* x, const at::Tensor* code, const at::Tensor* a,
                               const at::Tensor* xi) {
  try {
    const Tensor none;
    const Tensor& ta = a ? *a : none;
    const Tensor& tn = xi ? *xi : none;
    check_inputs(*x, *code, ta, tn);
    if (ta.defined()) return new at::Tensor(GatedFilter::apply(*x, *code, ta, tn));
    return new at::Tensor(PlainFilter::apply(*x, *code));
  } catch (const std::exception& e) {
    last_error = e.what();
    return nullptr;
  }
}

const char* cadenza_spe_filter_error() { return last_error.c_str(); }

}  // extern "C"
