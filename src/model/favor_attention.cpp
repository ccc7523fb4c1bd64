// FAVOR+'s causal linear attention on the CPU in f32, as one libtorch
// autograd function (`cadenza_favor_attention`). src/model/favor.rs has the
// same math in libtorch calls (`causal_linear_attention_chunked`), which its
// tests hold this one to. For each (batch row b, head h), an item:
//
//   pq  (B, H, L, M)   phi(queries), the feature maps    (unit stride over M)
//   pk  (B, H, L, M)   phi(keys)                         (unit stride over M)
//   v   (B, H, L, Dv)  values                            (unit stride over Dv)
//   s0  (B, H, M, Dv)  z0 (B, H, M): the state before the first position
//   S_i = s0 + sum_{j <= i} pk_j (x) v_j          z_i = z0 + sum_{j <= i} pk_j
//   out_i = (pq_i S_i) / (pq_i . z_i + eps)       (B, H, L, Dv)
//   s_end = S_{L-1}, z_end = z_{L-1}              (not differentiable)
//
// Why: libtorch forms this in chunks of C positions (a masked C x C product
// per chunk plus prefix sums of the chunks' states), some twenty calls whose
// intermediates are each a pass over memory; at L = 512 they took 10 ms of a
// layer's forward and backward where their arithmetic is under 1 ms. Here
// each item is one pass over its positions that carries S (M x Dv floats, in
// L1) from one position to the next: 2 M Dv multiply-adds per position
// forward, 5 M Dv backward, and nothing stored but the output and 1 / (den +
// eps) per position.
//
// Backward, with r_i = 1 / (pq_i . z_i + eps), dn_i = g_i r_i (the gradient of
// the numerator) and dd_i = -r_i (g_i . out_i) (of the denominator):
//   dpq_i = S_i dn_i + dd_i z_i                      (forward pass again)
//   T_j = sum_{i >= j} pq_i (x) dn_i,  y_j = sum_{i >= j} dd_i pq_i
//   dpk_j = T_j v_j + y_j,  dv_j = T_j^T pk_j       (a pass from the end)
//   ds0 = T_0, dz0 = y_0
//
// Sizes: M and Dv are 16, 32, 64 or 128 (favor.rs pads others with zeros,
// which change nothing), fixed at compile time so that rows live in vector
// registers. Threads: items are split between libtorch's OpenMP threads.
// Floats: the sums run in another order than the chunked form's, so results
// differ in the last bits; the tests allow 1e-5 relative.

#include "kernels.h"

#include <type_traits>

namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// favor.rs EPS
constexpr float kEps = 1e-6f;

// One call's sizes, and where each item's rows start.
struct Args {
  int64_t b, h, l, m, dv;
  // strides of pq, pk, v over b, h, l (each has unit stride over its last dim)
  int64_t sq[3], sk[3], sv[3];
  const float *pq, *pk, *v;
  const float *s0, *z0;  // (B, H, M, Dv), (B, H, M) contiguous
  const float* out;      // (B, H, L, Dv) contiguous (the forward's output)
  const float* rden;     // (B, H, L): r_i
  const float* g;        // (B, H, L, Dv) contiguous: the output's gradient

  const float* q_row(int64_t i, int64_t t) const {
    return pq + (i / h) * sq[0] + (i % h) * sq[1] + t * sq[2];
  }
  const float* k_row(int64_t i, int64_t t) const {
    return pk + (i / h) * sk[0] + (i % h) * sk[1] + t * sk[2];
  }
  const float* v_row(int64_t i, int64_t t) const {
    return v + (i / h) * sv[0] + (i % h) * sv[1] + t * sv[2];
  }
};

// Two rows of a state, `stride` floats apart, each plus a multiple of x and
// written back, and each new row times its weight added to its sum:
// s_r += a_r x, acc_r += w_r s_r for r = 0, 1 (two rows per step: twice the
// independent chains of multiply-adds). With DOT, also dot_r += s_r * y
// (lane by lane; the caller sums the lanes).
template <int N, bool DOT = false>
CADENZA_INLINE void update_two_rows(float* s, int64_t stride, float a0, float a1, const vf* x,
                                    float w0, float w1, vf* acc0, vf* acc1,
                                    const vf* y = nullptr, vf* dot0 = nullptr,
                                    vf* dot1 = nullptr) {
#pragma GCC unroll 8
  for (int j = 0; j < N; ++j) {
    const vf t0 = load(s + kLanes * j) + a0 * x[j];
    const vf t1 = load(s + stride + kLanes * j) + a1 * x[j];
    store(s + kLanes * j, t0);
    store(s + stride + kLanes * j, t1);
    acc0[j] += w0 * t0;
    acc1[j] += w1 * t1;
    if (DOT) {
      *dot0 += t0 * y[j];
      *dot1 += t1 * y[j];
    }
  }
}

// The forward of items [begin, end): out and rden rows, and each item's
// final state, in which S and z are carried (s_end, z_end).
template <int NM, int NV>
CADENZA_INLINE void forward_items(const Args& a, float* out, float* rden, float* s_end,
                                  float* z_end, int64_t begin, int64_t end) {
  constexpr int M = NM * kLanes, DV = NV * kLanes;
  for (int64_t i = begin; i < end; ++i) {
    float* S = s_end + i * M * DV;
    float* z = z_end + i * M;
    std::memcpy(S, a.s0 + i * M * DV, M * DV * sizeof(float));
    std::memcpy(z, a.z0 + i * M, M * sizeof(float));
    for (int64_t t = 0; t < a.l; ++t) {
      const float* qr = a.q_row(i, t);
      const float* kr = a.k_row(i, t);
      const float* vr = a.v_row(i, t);
      vf dv = zero();
#pragma GCC unroll 8
      for (int j = 0; j < NM; ++j) {
        const vf zj = load(z + kLanes * j) + load(kr + kLanes * j);
        store(z + kLanes * j, zj);
        dv += load(qr + kLanes * j) * zj;
      }
      vf vv[NV], n0[NV], n1[NV];
#pragma GCC unroll 8
      for (int c = 0; c < NV; ++c) {
        vv[c] = load(vr + kLanes * c);
        n0[c] = n1[c] = zero();
      }
      // S's rows m += pk[m] v, the numerator += pq[m] S's row m
      for (int m = 0; m < M; m += 2)
        update_two_rows<NV>(S + m * DV, DV, kr[m], kr[m + 1], vv, qr[m], qr[m + 1], n0, n1);
      const float r = 1.f / (hsum(dv) + kEps);
      float* o = out + (i * a.l + t) * DV;
#pragma GCC unroll 8
      for (int c = 0; c < NV; ++c) store(o + kLanes * c, (n0[c] + n1[c]) * r);
      rden[i * a.l + t] = r;
    }
  }
}

// Where the backward writes (null: not asked for).
struct Grads {
  float *dpq, *dpk, *dv;  // (B, H, L, M|M|Dv) contiguous
  float *ds0, *dz0;       // (B, H, M, Dv), (B, H, M) contiguous
};

// dn_t (into dn, Dv floats) and dd_t of item i.
template <int NV>
CADENZA_INLINE float output_grads(const Args& a, int64_t i, int64_t t, float* dn) {
  const int64_t row = i * a.l + t;
  const float r = a.rden[row];
  const float* gr = a.g + row * NV * kLanes;
  const float* orow = a.out + row * NV * kLanes;
  vf go = zero();
#pragma GCC unroll 8
  for (int c = 0; c < NV; ++c) {
    const vf gc = load(gr + kLanes * c);
    go += gc * load(orow + kLanes * c);
    store(dn + kLanes * c, gc * r);
  }
  return -r * hsum(go);
}

// The backward of items [begin, end). scratch: 2 M Dv + 2 M + Dv floats.
template <int NM, int NV>
CADENZA_INLINE void backward_items(const Args& a, const Grads& gr, float* scratch,
                                   int64_t begin, int64_t end) {
  constexpr int M = NM * kLanes, DV = NV * kLanes;
  // St (Dv x M): S transposed, so that S dn is a sum of its rows; T likewise
  // transposed (Tt), so that T v is; z; y; dn of one position
  float* St = scratch;
  float* Tt = St + M * DV;
  float* z = Tt + M * DV;
  float* y = z + M;
  float* dn = y + M;
  for (int64_t i = begin; i < end; ++i) {
    // forward again: dpq
    if (gr.dpq) {
      const float* s0 = a.s0 + i * M * DV;
      for (int m = 0; m < M; ++m)
        for (int c = 0; c < DV; ++c) St[c * M + m] = s0[m * DV + c];
      std::memcpy(z, a.z0 + i * M, M * sizeof(float));
      for (int64_t t = 0; t < a.l; ++t) {
        const float* kr = a.k_row(i, t);
        const float* vr = a.v_row(i, t);
        const float dd = output_grads<NV>(a, i, t, dn);
        vf kv[NM], acc0[NM], acc1[NM];
#pragma GCC unroll 8
        for (int j = 0; j < NM; ++j) {
          kv[j] = load(kr + kLanes * j);
          const vf zj = load(z + kLanes * j) + kv[j];
          store(z + kLanes * j, zj);
          acc0[j] = dd * zj;
          acc1[j] = zero();
        }
        // St's rows c += v[c] pk, dpq += dn[c] St's row c
        for (int c = 0; c < DV; c += 2)
          update_two_rows<NM>(St + c * M, M, vr[c], vr[c + 1], kv, dn[c], dn[c + 1], acc0, acc1);
        float* o = gr.dpq + (i * a.l + t) * M;
#pragma GCC unroll 8
        for (int j = 0; j < NM; ++j) store(o + kLanes * j, acc0[j] + acc1[j]);
      }
    }
    // from the end: dpk, dv, ds0, dz0
    if (gr.dpk || gr.dv || gr.ds0 || gr.dz0) {
      std::memset(Tt, 0, M * DV * sizeof(float));
      std::memset(y, 0, M * sizeof(float));
      for (int64_t t = a.l - 1; t >= 0; --t) {
        const float* qr = a.q_row(i, t);
        const float* kr = a.k_row(i, t);
        const float* vr = a.v_row(i, t);
        const float dd = output_grads<NV>(a, i, t, dn);
        vf qv[NM], kv[NM], acc0[NM], acc1[NM];
#pragma GCC unroll 8
        for (int j = 0; j < NM; ++j) {
          qv[j] = load(qr + kLanes * j);
          kv[j] = load(kr + kLanes * j);
          const vf yj = load(y + kLanes * j) + dd * qv[j];
          store(y + kLanes * j, yj);
          acc0[j] = yj;
          acc1[j] = zero();
        }
        float* dvr = gr.dv ? gr.dv + (i * a.l + t) * DV : nullptr;
        // Tt's rows c += dn[c] pq, dpk += v[c] Tt's row c, dv[c] = Tt's row c . pk
        for (int c = 0; c < DV; c += 2) {
          vf p0 = zero(), p1 = zero();
          update_two_rows<NM, true>(Tt + c * M, M, dn[c], dn[c + 1], qv, vr[c], vr[c + 1], acc0,
                                    acc1, kv, &p0, &p1);
          if (dvr) {
            dvr[c] = hsum(p0);
            dvr[c + 1] = hsum(p1);
          }
        }
        if (gr.dpk) {
          float* o = gr.dpk + (i * a.l + t) * M;
#pragma GCC unroll 8
          for (int j = 0; j < NM; ++j) store(o + kLanes * j, acc0[j] + acc1[j]);
        }
      }
      if (gr.ds0) {
        float* d = gr.ds0 + i * M * DV;
        for (int m = 0; m < M; ++m)
          for (int c = 0; c < DV; ++c) d[m * DV + c] = Tt[c * M + m];
      }
      if (gr.dz0) std::memcpy(gr.dz0 + i * M, y, M * sizeof(float));
    }
  }
}

CADENZA_VARIANTS(forward_items, int, NM, int, NV,
                 (const Args& a, float* out, float* rden, float* s_end, float* z_end,
                  int64_t begin, int64_t end),
                 (a, out, rden, s_end, z_end, begin, end))
CADENZA_VARIANTS(backward_items, int, NM, int, NV,
                 (const Args& a, const Grads& gr, float* scratch, int64_t begin, int64_t end),
                 (a, gr, scratch, begin, end))

// f(std::integral_constant<int, n / 16>) for n in 16, 32, 64, 128.
template <typename F>
void with_vectors(int64_t n, F&& f) {
  switch (n) {
    case 16: f(std::integral_constant<int, 1>{}); break;
    case 32: f(std::integral_constant<int, 2>{}); break;
    case 64: f(std::integral_constant<int, 4>{}); break;
    case 128: f(std::integral_constant<int, 8>{}); break;
    default: TORCH_CHECK(false, "FAVOR+ sizes must be 16, 32, 64 or 128, not ", n);
  }
}

Args args_of(const Tensor& pq, const Tensor& pk, const Tensor& v, const Tensor& s0,
             const Tensor& z0) {
  Args a{};
  a.b = pq.size(0);
  a.h = pq.size(1);
  a.l = pq.size(2);
  a.m = pq.size(3);
  a.dv = v.size(3);
  for (int d = 0; d < 3; ++d) {
    a.sq[d] = pq.stride(d);
    a.sk[d] = pk.stride(d);
    a.sv[d] = v.stride(d);
  }
  a.pq = pq.data_ptr<float>();
  a.pk = pk.data_ptr<float>();
  a.v = v.data_ptr<float>();
  a.s0 = s0.data_ptr<float>();
  a.z0 = z0.data_ptr<float>();
  return a;
}

// Items per task: one is already some 10^5 multiply-adds at L = 512.
constexpr int64_t kGrain = 1;

struct FavorAttention : public torch::autograd::Function<FavorAttention> {
  static variable_list forward(AutogradContext* ctx, const Tensor& pq, const Tensor& pk,
                               const Tensor& v, const Tensor& s0, const Tensor& z0) {
    Args a = args_of(pq, pk, v, s0, z0);
    Tensor out = at::empty({a.b, a.h, a.l, a.dv}, v.options());
    Tensor rden = at::empty({a.b, a.h, a.l}, v.options());
    Tensor s_end = at::empty({a.b, a.h, a.m, a.dv}, v.options());
    Tensor z_end = at::empty({a.b, a.h, a.m}, v.options());
    float* po = out.data_ptr<float>();
    float* pr = rden.data_ptr<float>();
    float* ps = s_end.data_ptr<float>();
    float* pz = z_end.data_ptr<float>();
    with_vectors(a.m, [&](auto nm) {
      with_vectors(a.dv, [&](auto nv) {
        constexpr int NM = decltype(nm)::value, NV = decltype(nv)::value;
        at::parallel_for(0, a.b * a.h, kGrain, [&](int64_t begin, int64_t end) {
          forward_items_isa<NM, NV>(a, po, pr, ps, pz, begin, end);
        });
      });
    });
    ctx->save_for_backward({pq, pk, v, s0, z0, out, rden});
    ctx->mark_non_differentiable({s_end, z_end});
    return {out, s_end, z_end};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto sv = ctx->get_saved_variables();
    const Tensor &pq = sv[0], &pk = sv[1], &v = sv[2], &s0 = sv[3], &z0 = sv[4];
    Tensor g = grads[0];
    if (!g.defined()) g = at::zeros_like(sv[5]);
    g = g.contiguous();
    Args a = args_of(pq, pk, v, s0, z0);
    a.out = sv[5].data_ptr<float>();
    a.rden = sv[6].data_ptr<float>();
    a.g = g.data_ptr<float>();
    Tensor dpq, dpk, dv, ds0, dz0;
    const auto opts = v.options();
    if (ctx->needs_input_grad(0)) dpq = at::empty({a.b, a.h, a.l, a.m}, opts);
    if (ctx->needs_input_grad(1)) dpk = at::empty({a.b, a.h, a.l, a.m}, opts);
    if (ctx->needs_input_grad(2)) dv = at::empty({a.b, a.h, a.l, a.dv}, opts);
    if (ctx->needs_input_grad(3)) ds0 = at::empty({a.b, a.h, a.m, a.dv}, opts);
    if (ctx->needs_input_grad(4)) dz0 = at::empty({a.b, a.h, a.m}, opts);
    auto ptr = [](Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; };
    const Grads gr{ptr(dpq), ptr(dpk), ptr(dv), ptr(ds0), ptr(dz0)};
    const int64_t scratch = 2 * a.m * a.dv + 2 * a.m + a.dv;
    with_vectors(a.m, [&](auto nm) {
      with_vectors(a.dv, [&](auto nv) {
        constexpr int NM = decltype(nm)::value, NV = decltype(nv)::value;
        at::parallel_for(0, a.b * a.h, kGrain, [&](int64_t begin, int64_t end) {
          std::vector<float> buf(scratch);
          backward_items_isa<NM, NV>(a, gr, buf.data(), begin, end);
        });
      });
    });
    return {dpq, dpk, dv, ds0, dz0};
  }
};

// FAVOR+'s positive random features of rows x (N, R), given the projection
// P (n, R), a scale c of the rows and whether they are queries:
//   u = c x P^T (N, n),  sq = c^2 |x|^2 / 2,
//   logits = [u - sq] (or [u - sq, -u - sq] with antithetic features, M = 2n),
//   queries: logits - max(logits) over the row (held constant in the backward),
//   phi = exp(logits) / sqrt(M) = exp(logits - ln(M) / 2)        (N, M)
// Backward, with t = dphi * phi (the gradient of the logits) and
// du = t (or t[:, :n] - t[:, n:]):
//   dx = c du P - c^2 (sum_m t) x,   dP = c du^T x.
// One libtorch product each way for u, dx and dP; the rest is one pass over
// the rows, where libtorch's form is some eight calls forward and twelve back.
struct FeatureArgs {
  int64_t n_rows, r, n, m;
  float c;
  bool query;
};

// (The row kernels below take two unused template parameters: the per-ISA
// variants, CADENZA_VARIANTS, are made for two.)

// log phi in place of u (libtorch's vectorized exp follows); rows [begin, end).
template <int, int>
CADENZA_INLINE void features_rows(const FeatureArgs& f, const float* x, float* phi,
                                  int64_t begin, int64_t end) {
  const float log_norm = -0.5f * std::log(static_cast<float>(f.m));
  for (int64_t i = begin; i < end; ++i) {
    const float* xr = x + i * f.r;
    float* o = phi + i * f.m;
    float sq = 0.f;
    for (int64_t k = 0; k < f.r; ++k) sq += xr[k] * xr[k];
    sq *= 0.5f * f.c * f.c;
    if (f.m > f.n)
      for (int64_t j = 0; j < f.n; ++j) o[f.n + j] = -f.c * o[j] - sq;
    for (int64_t j = 0; j < f.n; ++j) o[j] = f.c * o[j] - sq;
    float top = 0.f;
    if (f.query) {
      top = o[0];
      for (int64_t j = 1; j < f.m; ++j) top = std::max(top, o[j]);
    }
    const float shift = log_norm - top;
    for (int64_t j = 0; j < f.m; ++j) o[j] += shift;
  }
}

// t = dphi * phi into dphi, whose first n columns then become du; rs = sum_m t.
template <int, int>
CADENZA_INLINE void feature_grads_rows(const FeatureArgs& f, const float* phi, float* g,
                                       float* rs, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    const float* p = phi + i * f.m;
    float* t = g + i * f.m;
    float sum = 0.f;
    for (int64_t j = 0; j < f.m; ++j) {
      t[j] *= p[j];
      sum += t[j];
    }
    if (f.m > f.n)
      for (int64_t j = 0; j < f.n; ++j) t[j] -= t[f.n + j];
    rs[i] = sum;
  }
}

// dx = c (du P) - c^2 rs x, in place of du P.
template <int, int>
CADENZA_INLINE void feature_dx_rows(const FeatureArgs& f, const float* x, const float* rs,
                                    float* dx, int64_t begin, int64_t end) {
  const float c2 = f.c * f.c;
  for (int64_t i = begin; i < end; ++i) {
    const float* xr = x + i * f.r;
    float* d = dx + i * f.r;
    const float w = c2 * rs[i];
    for (int64_t k = 0; k < f.r; ++k) d[k] = f.c * d[k] - w * xr[k];
  }
}

CADENZA_VARIANTS(features_rows, int, A, int, B,
                 (const FeatureArgs& f, const float* x, float* phi, int64_t begin, int64_t end),
                 (f, x, phi, begin, end))
CADENZA_VARIANTS(feature_grads_rows, int, A, int, B,
                 (const FeatureArgs& f, const float* phi, float* g, float* rs, int64_t begin,
                  int64_t end),
                 (f, phi, g, rs, begin, end))
CADENZA_VARIANTS(feature_dx_rows, int, A, int, B,
                 (const FeatureArgs& f, const float* x, const float* rs, float* dx,
                  int64_t begin, int64_t end),
                 (f, x, rs, dx, begin, end))

// Rows per task: some 2^14 floats of phi.
int64_t feature_grain(const FeatureArgs& f) {
  return std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(1, f.m));
}

// x (..., R) -> phi (..., M); x and proj are contiguous.
struct FavorFeatureMap : public torch::autograd::Function<FavorFeatureMap> {
  static FeatureArgs args_of(const Tensor& x, const Tensor& proj, double c, bool query,
                             bool antithetic) {
    FeatureArgs f{};
    f.r = x.size(-1);
    f.n_rows = f.r > 0 ? x.numel() / f.r : 0;
    f.n = proj.size(0);
    f.m = antithetic ? 2 * f.n : f.n;
    f.c = static_cast<float>(c);
    f.query = query;
    return f;
  }

  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& proj, double c,
                        bool query, bool antithetic) {
    const FeatureArgs f = args_of(x, proj, c, query, antithetic);
    const Tensor x2 = x.reshape({f.n_rows, f.r});
    auto shape = x.sizes().vec();
    shape.back() = f.m;
    // the output itself (a view would refuse in-place use), seen as rows; u in the
    // first n columns of each row
    Tensor out = at::empty(shape, x.options());
    Tensor phi = out.view({f.n_rows, f.m});
    Tensor u = phi.narrow(1, 0, f.n);
    at::mm_out(u, x2, proj.t());
    float* pp = phi.data_ptr<float>();
    const float* px = x2.data_ptr<float>();
    at::parallel_for(0, f.n_rows, feature_grain(f), [&](int64_t begin, int64_t end) {
      features_rows_isa<0, 0>(f, px, pp, begin, end);
    });
    phi.exp_();
    ctx->save_for_backward({x, proj, out});
    ctx->saved_data["c"] = c;
    ctx->saved_data["query"] = query;
    ctx->saved_data["antithetic"] = antithetic;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto sv = ctx->get_saved_variables();
    const Tensor &x = sv[0], &proj = sv[1], &phi = sv[2];
    const FeatureArgs f =
        args_of(x, proj, ctx->saved_data["c"].toDouble(), ctx->saved_data["query"].toBool(),
                ctx->saved_data["antithetic"].toBool());
    const Tensor x2 = x.reshape({f.n_rows, f.r});
    Tensor t = grads[0].reshape({f.n_rows, f.m}).clone(at::MemoryFormat::Contiguous);
    Tensor rs = at::empty({f.n_rows}, x.options());
    float* pt = t.data_ptr<float>();
    float* prs = rs.data_ptr<float>();
    const float* pphi = phi.data_ptr<float>();
    at::parallel_for(0, f.n_rows, feature_grain(f), [&](int64_t begin, int64_t end) {
      feature_grads_rows_isa<0, 0>(f, pphi, pt, prs, begin, end);
    });
    const Tensor du = t.narrow(1, 0, f.n);
    Tensor dx, dproj;
    if (ctx->needs_input_grad(0)) {
      dx = at::mm(du, proj);
      float* pd = dx.data_ptr<float>();
      const float* px = x2.data_ptr<float>();
      at::parallel_for(0, f.n_rows, feature_grain(f), [&](int64_t begin, int64_t end) {
        feature_dx_rows_isa<0, 0>(f, px, prs, pd, begin, end);
      });
      dx = dx.view(x.sizes());
    }
    if (ctx->needs_input_grad(1)) dproj = at::mm(du.t(), x2).mul_(f.c);
    return {dx, dproj, Tensor(), Tensor(), Tensor()};
  }
};

void check_inputs(const Tensor& pq, const Tensor& pk, const Tensor& v, const Tensor& s0,
                  const Tensor& z0) {
  for (const Tensor* t : {&pq, &pk, &v, &s0, &z0})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu(),
                "the fused FAVOR+ attention takes f32 CPU tensors");
  TORCH_CHECK(pq.dim() == 4 && pk.sizes() == pq.sizes() && v.dim() == 4,
              "pq and pk (B, H, L, M), v (B, H, L, Dv)");
  TORCH_CHECK(v.size(0) == pq.size(0) && v.size(1) == pq.size(1) && v.size(2) == pq.size(2),
              "v ", v.sizes(), " does not fit pq ", pq.sizes());
  TORCH_CHECK(pq.stride(3) == 1 && pk.stride(3) == 1 && v.stride(3) == 1,
              "pq, pk and v need a unit stride over their last dimension");
  const int64_t b = pq.size(0), h = pq.size(1), m = pq.size(3), dv = v.size(3);
  TORCH_CHECK(s0.is_contiguous() && z0.is_contiguous(), "the state must be contiguous");
  TORCH_CHECK(s0.dim() == 4 && s0.size(0) == b && s0.size(1) == h && s0.size(2) == m &&
                  s0.size(3) == dv && z0.dim() == 3 && z0.size(0) == b && z0.size(1) == h &&
                  z0.size(2) == m,
              "the state s0 ", s0.sizes(), ", z0 ", z0.sizes(), " does not fit (B, H, M, Dv)");
  for (int64_t n : {m, dv})
    TORCH_CHECK(n == 16 || n == 32 || n == 64 || n == 128,
                "FAVOR+ sizes must be 16, 32, 64 or 128, not ", n);
}

}  // namespace

extern "C" {

// The attention's output, final S and final z as three new tensors the
// caller owns (written to out[0..3]), or false with the reason in
// cadenza_kernel_error().
bool cadenza_favor_attention(const at::Tensor* pq, const at::Tensor* pk, const at::Tensor* v,
                             const at::Tensor* s0, const at::Tensor* z0, at::Tensor** out) {
  try {
    check_inputs(*pq, *pk, *v, *s0, *z0);
    variable_list r = FavorAttention::apply(*pq, *pk, *v, *s0, *z0);
    for (int n = 0; n < 3; ++n) out[n] = new at::Tensor(std::move(r[n]));
    return true;
  } catch (const std::exception& e) {
    cadenza_last_error() = e.what();
    return false;
  }
}

// FAVOR+'s features of x (FavorFeatureMap) as a new tensor, or null with
// the reason in cadenza_kernel_error().
at::Tensor* cadenza_favor_features(const at::Tensor* x, const at::Tensor* proj, double scale,
                                   bool query, bool antithetic) {
  try {
    TORCH_CHECK(x->scalar_type() == at::kFloat && proj->scalar_type() == at::kFloat &&
                    x->device().is_cpu() && proj->device().is_cpu(),
                "the fused FAVOR+ features take f32 CPU tensors");
    TORCH_CHECK(x->is_contiguous() && proj->is_contiguous(), "x and proj must be contiguous");
    TORCH_CHECK(x->dim() >= 1 && proj->dim() == 2 && proj->size(1) == x->size(-1),
                "proj ", proj->sizes(), " does not fit x ", x->sizes());
    TORCH_CHECK(proj->size(0) > 0 && proj->size(1) > 0,
                "the fused FAVOR+ features need at least one feature and one input dimension");
    return new at::Tensor(FavorFeatureMap::apply(*x, *proj, scale, query, antithetic));
  } catch (const std::exception& e) {
    cadenza_last_error() = e.what();
    return nullptr;
  }
}

}  // extern "C"
