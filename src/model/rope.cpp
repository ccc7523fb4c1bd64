// RoPE on the CPU in f32 as one libtorch autograd function
// (`cadenza_rope`); src/model/transformer.rs has the same math in libtorch
// calls (`apply_rope_libtorch`), which its tests hold this one to.
//
//   x    (B, h, L, D)  queries or keys (any strides with unit stride over D)
//   cos  (L, D)        [cos, cos] of each position's D/2 angles
//   sin  (L, D)        [-sin, sin]
//   out  (B, h, L, D)  out[j] = x[j] cos[j] + x[j'] sin[j], j' = (j + D/2) mod D
//                      (the pair (x1, x2) turned: x1 cos - x2 sin, x1 sin + x2 cos)
//   dx[j] = g[j] cos[j] + g[j'] sin[j']     (j -> j' is its own inverse)
//
// Why: libtorch forms this as two products, a roll (a copy) and a sum, and
// their backward as as many calls again; here each way is one pass over the
// rows. The tables are constants (no gradient).

#include "kernels.h"

namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct RopeArgs {
  int64_t h, l, d;
  int64_t sb, sh, sl;  // strides of the input over b, h, l
};

// out (contiguous rows) from in (rows at the given strides), turned forward
// (G = false: the forward) or back (G = true: the gradient), rows [begin, end).
template <int, bool G>
CADENZA_INLINE void rope_rows(const RopeArgs& a, const float* in, const float* cos,
                              const float* sin, float* out, int64_t begin, int64_t end) {
  const int64_t half = a.d / 2;
  for (int64_t i = begin; i < end; ++i) {
    const int64_t t = i % a.l, bh = i / a.l;
    const float* x = in + (bh / a.h) * a.sb + (bh % a.h) * a.sh + t * a.sl;
    const float* c = cos + t * a.d;
    const float* s = sin + t * a.d;
    float* o = out + i * a.d;
    if (G) {
      for (int64_t j = 0; j < half; ++j) o[j] = x[j] * c[j] + x[j + half] * s[j + half];
      for (int64_t j = half; j < a.d; ++j) o[j] = x[j] * c[j] + x[j - half] * s[j - half];
    } else {
      for (int64_t j = 0; j < half; ++j) o[j] = x[j] * c[j] + x[j + half] * s[j];
      for (int64_t j = half; j < a.d; ++j) o[j] = x[j] * c[j] + x[j - half] * s[j];
    }
  }
}

CADENZA_VARIANTS(rope_rows, int, A, bool, G,
                 (const RopeArgs& a, const float* in, const float* cos, const float* sin,
                  float* out, int64_t begin, int64_t end),
                 (a, in, cos, sin, out, begin, end))

// x (B, h, L, D) turned forward or back into a new contiguous tensor.
Tensor turn(const Tensor& x, const Tensor& cos, const Tensor& sin, bool back) {
  RopeArgs a{x.size(1), x.size(2), x.size(3), x.stride(0), x.stride(1), x.stride(2)};
  Tensor out = at::empty(x.sizes(), x.options());
  const float* px = x.data_ptr<float>();
  const float* pc = cos.data_ptr<float>();
  const float* ps = sin.data_ptr<float>();
  float* po = out.data_ptr<float>();
  const int64_t rows = x.size(0) * a.h * a.l;
  const int64_t grain = std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(1, a.d));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    if (back)
      rope_rows_isa<0, true>(a, px, pc, ps, po, begin, end);
    else
      rope_rows_isa<0, false>(a, px, pc, ps, po, begin, end);
  });
  return out;
}

struct Rope : public torch::autograd::Function<Rope> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& cos,
                        const Tensor& sin) {
    ctx->save_for_backward({cos, sin});
    return turn(x, cos, sin, false);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto sv = ctx->get_saved_variables();
    Tensor g = grads[0];
    if (g.stride(3) != 1) g = g.contiguous();
    return {turn(g, sv[0], sv[1], true), Tensor(), Tensor()};
  }
};

}  // namespace

extern "C" {

// RoPE of x (Rope) as a new tensor, or null with the reason in
// cadenza_kernel_error().
at::Tensor* cadenza_rope(const at::Tensor* x, const at::Tensor* cos, const at::Tensor* sin) {
  try {
    for (const at::Tensor* t : {x, cos, sin})
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu(),
                  "the fused RoPE takes f32 CPU tensors");
    TORCH_CHECK(x->dim() == 4 && x->stride(3) == 1, "x is (B, h, L, D) with unit stride over D");
    TORCH_CHECK(x->size(3) % 2 == 0, "RoPE needs an even width, not ", x->size(3));
    TORCH_CHECK(cos->is_contiguous() && sin->is_contiguous() && cos->dim() == 2 &&
                    cos->sizes() == sin->sizes() && cos->size(0) == x->size(2) &&
                    cos->size(1) == x->size(3),
                "the tables ", cos->sizes(), " do not fit x ", x->sizes());
    return new at::Tensor(Rope::apply(*x, *cos, *sin));
  } catch (const std::exception& e) {
    cadenza_last_error() = e.what();
    return nullptr;
  }
}

}  // extern "C"
