// The gated SPE filter on the CPU in f32, as libtorch autograd functions
// (`tch` has no way to define one in Rust, so this is C++). Two of them:
//
// - the filter over stored codes (`cadenza_spe_filter`; ConvSPE, and the
//   codes of a generation step), below;
// - SineSPE's filter, which forms its codes inside and never stores them
//   (`cadenza_sine_filter`; training and scoring), further down.
//
// src/model/spe.rs has the same math in libtorch calls (`spe_filter_libtorch`,
// `SineSpe::codes_from`), which its tests hold these to.
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
// Threads: at::parallel_for, libtorch's own OpenMP threads (build.rs compiles
// this file with -fopenmp: the loop is a header template). Instruction sets:
// each kernel is compiled for AVX-512, AVX2 + FMA and baseline x86-64 and
// picked at run time.
//
// Floats: the sums run in another order than libtorch's (and build.rs lets
// the compiler reassociate them), so results differ from the libtorch form
// in the last bits; the tests allow 1e-5 relative (2e-5 for SineSPE, whose
// reference goes through f64 phases).

#include "kernels.h"

namespace {

using at::Tensor;

// The largest R the kernels take (their per-row buffers live on the stack).
constexpr int64_t kMaxR = 256;

struct Shapes {
  int64_t b, l, h, d, r;
  // strides of x over b, m, h (unit stride over d)
  int64_t sxb, sxm, sxh;
};

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
        for (int64_t d = 0; d < D; ++d) {
          const float xd = xr[d];
          const float* cr = c + d * RR;
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

// ---------------------------------------------------------------------------
// SineSPE: the filter with the code formed inside it, never stored.
//
// A SineSPE code is code[m, h, d, :] = sum_k omega[m, h, d, k] zg[h, d, k, :]
// (omega: the interleaved cos and sin of the phases, 2K of them; zg: the
// noise times the gains, (H, D, 2K, R)). Stored, the codes of a window are
// (L, H, D, R): 16 KB per position at the shipped shape, read by every
// layer's filter and written back as gradients, which made the filter a
// stream of memory. Formed here, a code block costs D 2K R multiply-adds
// over omega (D 2K floats per position) and zg (read from cache, shared by
// a block of P positions of one head).
//
// The backward gives the gradients of x, zg, the gate and, rather than one of
// omega (as big as the codes), those of the phases' parameters directly: with
// dc[m] = a u[m] the code's gradient (see the header) and
// dphase[m, k'] = -sin[m, k'] (dc[m] . zg[2k']) + cos[m, k'] (dc[m] . zg[2k' + 1]),
//   d offsets[k'] = sum_m dphase[m, k'] = -zg[2k'] . dzg[2k' + 1] + zg[2k' + 1] . dzg[2k']
//   d cycles[k']  = 2 pi sum_m pos_m dphase[m, k']   (the same with w for dzg)
// where dzg[k] = sum_m omega[m, k] dc[m] and w[k] = sum_m pos_m omega[m, k] dc[m]
// (phase = 2 pi frac(cycles pos) + offset; frac has a unit gradient).

struct SineArgs {
  Shapes s;
  int64_t k2;     // 2K
  int64_t start;  // the position of m = 0
  int64_t nblk;   // blocks of positions per head
  const float* x;
  const float* omega;  // (L, H, D, 2K)
  const float* zg;     // (H, D, 2K, R)
  const float* a;      // (H, D) when gated
  const float* xi;     // (H, D, R) when gated
  float* out;          // forward: (B, H, L, R)
  const float* g;      // backward: (B, H, L, R), contiguous
  float* dx;           // (B, L, H, D), or null
  float* da;           // this thread's (H, D), or null
  float* dxi;          // this thread's (H, D, R), or null
  float* dzg;          // this thread's (H, D, 2K, R), or null
  float* w;            // this thread's (H, D, 2K, R), or null
};

// Positions per block: the code rows of a block stay in registers.
constexpr int64_t kBlock = 8;

// c[p] = the code rows (feature d) of positions m0 .. m0 + P of head h.
template <int RR, int P>
CADENZA_INLINE void sine_code_rows(const SineArgs& q, int64_t h, int64_t m0, int64_t d,
                                   vf (&c)[P][RR / kLanes]) {
  constexpr int NV = RR / kLanes;
  const int64_t D = q.s.d, K2 = q.k2, step = q.s.h * D * K2;
  const float* zd = q.zg + (h * D + d) * K2 * RR;
  const float* od = q.omega + ((m0 * q.s.h + h) * D + d) * K2;
#pragma GCC unroll 16
  for (int p = 0; p < P; ++p)
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) c[p][j] = zero();
  for (int64_t k = 0; k < K2; ++k) {
    vf z[NV];
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) z[j] = load(zd + k * RR + kLanes * j);
#pragma GCC unroll 16
    for (int p = 0; p < P; ++p) {
      const float o = od[p * step + k];
#pragma GCC unroll 8
      for (int j = 0; j < NV; ++j) c[p][j] += o * z[j];
    }
  }
}

// The outputs of positions m0 .. m0 + P of head h; acc: P B R floats of scratch.
template <int RR, bool G, int P>
CADENZA_INLINE void sine_forward_block(const SineArgs& q, int64_t h, int64_t m0, float* acc) {
  constexpr int NV = RR / kLanes;
  const Shapes& s = q.s;
  const int64_t D = s.d;
  for (int64_t i = 0; i < P * s.b * RR; ++i) acc[i] = 0.f;
  for (int64_t d = 0; d < D; ++d) {
    vf c[P][NV];
    sine_code_rows<RR, P>(q, h, m0, d, c);
    vf n[NV];
    const float ad = G ? q.a[h * D + d] : 1.f;
    if (G) {
#pragma GCC unroll 8
      for (int j = 0; j < NV; ++j) n[j] = load(q.xi + (h * D + d) * RR + kLanes * j);
    }
#pragma GCC unroll 16
    for (int p = 0; p < P; ++p) {
      const float* xp = q.x + (m0 + p) * s.sxm + h * s.sxh + d;
      for (int64_t b = 0; b < s.b; ++b) {
        const float xd = xp[b * s.sxb];
        float* ar = acc + (p * s.b + b) * RR;
        if (G) {
          const float xa = xd * ad;
#pragma GCC unroll 8
          for (int j = 0; j < NV; ++j)
            store(ar + kLanes * j, load(ar + kLanes * j) + xa * c[p][j] + xd * n[j]);
        } else {
#pragma GCC unroll 8
          for (int j = 0; j < NV; ++j) store(ar + kLanes * j, load(ar + kLanes * j) + xd * c[p][j]);
        }
      }
    }
  }
  for (int p = 0; p < P; ++p)
    for (int64_t b = 0; b < s.b; ++b)
      std::memcpy(q.out + ((b * s.h + h) * s.l + m0 + p) * RR, acc + (p * s.b + b) * RR,
                  RR * sizeof(float));
}

// The sums over the block's P positions of each cosine or sine (k < K2) times
// the code gradient, added to the K2 rows r (RR floats each): zg's gradient,
// or with BY_POSITION each term also times its position (first, first + 1, ...),
// from which the frequencies' gradient follows.
template <int RR, int P, bool BY_POSITION>
CADENZA_INLINE void add_phase_moments(float* r, const float* od, int64_t step, int64_t K2,
                                      const vf (&dc)[P][RR / kLanes], int64_t first) {
  constexpr int NV = RR / kLanes;
  for (int64_t k = 0; k < K2; ++k, r += RR) {
    vf t[NV];
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) t[j] = load(r + kLanes * j);
#pragma GCC unroll 16
    for (int p = 0; p < P; ++p) {
      float o = od[p * step + k];
      if (BY_POSITION) o *= static_cast<float>(first + p);
#pragma GCC unroll 8
      for (int j = 0; j < NV; ++j) t[j] += o * dc[p][j];
    }
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) store(r + kLanes * j, t[j]);
  }
}

template <int RR, bool G, int P>
CADENZA_INLINE void sine_backward_block(const SineArgs& q, int64_t h, int64_t m0) {
  constexpr int NV = RR / kLanes;
  const Shapes& s = q.s;
  const int64_t D = s.d, K2 = q.k2, step = s.h * D * K2;
  for (int64_t d = 0; d < D; ++d) {
    vf c[P][NV];
    sine_code_rows<RR, P>(q, h, m0, d, c);
    const float ad = G ? q.a[h * D + d] : 1.f;
    vf n[NV], dn[NV];
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) {
      n[j] = G ? load(q.xi + (h * D + d) * RR + kLanes * j) : zero();
      dn[j] = zero();
    }
    float da = 0.f;
    vf dc[P][NV];
#pragma GCC unroll 16
    for (int p = 0; p < P; ++p) {
      vf e[NV], u[NV];
#pragma GCC unroll 8
      for (int j = 0; j < NV; ++j) {
        e[j] = G ? ad * c[p][j] + n[j] : c[p][j];
        u[j] = zero();
      }
      const float* xp = q.x + (m0 + p) * s.sxm + h * s.sxh + d;
      const float* gp = q.g + (h * s.l + m0 + p) * RR;
      float* dxp = q.dx ? q.dx + ((m0 + p) * s.h + h) * D + d : nullptr;
      for (int64_t b = 0; b < s.b; ++b) {
        const float* gr = gp + b * s.h * s.l * RR;
        const float xd = xp[b * s.sxb];
        vf pr = zero();
#pragma GCC unroll 8
        for (int j = 0; j < NV; ++j) {
          const vf gj = load(gr + kLanes * j);
          pr += gj * e[j];
          u[j] += xd * gj;
        }
        if (dxp) dxp[b * s.l * s.h * D] = hsum(pr);
      }
      if (G && q.da) {
        vf pr = zero();
#pragma GCC unroll 8
        for (int j = 0; j < NV; ++j) pr += c[p][j] * u[j];
        da += hsum(pr);
      }
#pragma GCC unroll 8
      for (int j = 0; j < NV; ++j) {
        dn[j] += u[j];
        dc[p][j] = ad * u[j];
      }
    }
    if (G && q.da) q.da[h * D + d] += da;
    if (G && q.dxi) {
      float* r = q.dxi + (h * D + d) * RR;
#pragma GCC unroll 8
      for (int j = 0; j < NV; ++j) store(r + kLanes * j, load(r + kLanes * j) + dn[j]);
    }
    const float* od = q.omega + ((m0 * s.h + h) * D + d) * K2;
    const int64_t rows = (h * D + d) * K2 * RR;
    if (q.dzg) add_phase_moments<RR, P, false>(q.dzg + rows, od, step, K2, dc, 0);
    if (q.w) add_phase_moments<RR, P, true>(q.w + rows, od, step, K2, dc, q.start + m0);
  }
}

// Items are (head, block of kBlock positions), head-major, so that a thread
// keeps to one head's zg; the last block of a head may be short, and takes
// its positions one at a time.
CADENZA_INLINE void block_of(const SineArgs& q, int64_t i, int64_t& h, int64_t& m0, int64_t& np) {
  h = i / q.nblk;
  m0 = (i % q.nblk) * kBlock;
  np = std::min(kBlock, q.s.l - m0);
}

template <int RR, bool G>
CADENZA_INLINE void sine_forward_items(const SineArgs& q, float* acc, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    int64_t h, m0, np;
    block_of(q, i, h, m0, np);
    if (np == kBlock) {
      sine_forward_block<RR, G, kBlock>(q, h, m0, acc);
    } else {
      for (int64_t p = 0; p < np; ++p) sine_forward_block<RR, G, 1>(q, h, m0 + p, acc);
    }
  }
}

template <int RR, bool G>
CADENZA_INLINE void sine_backward_items(const SineArgs& q, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    int64_t h, m0, np;
    block_of(q, i, h, m0, np);
    if (np == kBlock) {
      sine_backward_block<RR, G, kBlock>(q, h, m0);
    } else {
      for (int64_t p = 0; p < np; ++p) sine_backward_block<RR, G, 1>(q, h, m0 + p);
    }
  }
}

// NAME##_by_r<G>(r, args...): the kernel with R = 32, 64 or 16 fixed at
// compile time, else the one for FALLBACK (0: any R, at run time).
#define CADENZA_BY_R(NAME, FALLBACK)                \
  template <bool G, typename... Args>                \
  void NAME##_by_r(int64_t r, Args... args) {        \
    if (r == 32) return NAME##_isa<32, G>(args...);  \
    if (r == 64) return NAME##_isa<64, G>(args...);  \
    if (r == 16) return NAME##_isa<16, G>(args...);  \
    NAME##_isa<FALLBACK, G>(args...);                \
  }

CADENZA_VARIANTS(forward_items, int, RR, bool, G,
                 (const Shapes& s, const float* x, const float* code, const float* a,
                  const float* xi, float* out, int64_t begin, int64_t end),
                 (s, x, code, a, xi, out, begin, end))
CADENZA_VARIANTS(backward_items, int, RR, bool, G,
                 (const Shapes& s, const float* x, const float* code, const float* a,
                  const float* xi, const float* g, const Grads& out, int64_t begin,
                  int64_t end),
                 (s, x, code, a, xi, g, out, begin, end))

CADENZA_VARIANTS(sine_forward_items, int, RR, bool, G, (const SineArgs& q, float* acc, int64_t begin, int64_t end),
                 (q, acc, begin, end))
CADENZA_VARIANTS(sine_backward_items, int, RR, bool, G, (const SineArgs& q, int64_t begin, int64_t end),
                 (q, begin, end))

CADENZA_BY_R(forward_items, 0)
CADENZA_BY_R(backward_items, 0)
// (SineFilter takes R = 16, 32 or 64 only: checked before)
CADENZA_BY_R(sine_forward_items, 16)
CADENZA_BY_R(sine_backward_items, 16)

// Items (position, head) per task: enough work to amortize a task, small
// enough that 2 threads stay balanced at L = 1.
int64_t grain(const Shapes& s) {
  const int64_t per_item = std::max<int64_t>(1, s.b * s.d * s.r);
  return std::max<int64_t>(1, (1 << 16) / per_item);
}

// The sizes and strides of x (B, L, H, D), with R realizations.
Shapes shapes_of(const Tensor& x, int64_t r) {
  Shapes s;
  s.b = x.size(0);
  s.l = x.size(1);
  s.h = x.size(2);
  s.d = x.size(3);
  s.r = r;
  s.sxb = x.stride(0);
  s.sxm = x.stride(1);
  s.sxh = x.stride(2);
  return s;
}

Tensor filter_forward(const Tensor& x, const Tensor& code, const Tensor& a, const Tensor& xi) {
  const Shapes s = shapes_of(x, code.size(3));
  const bool gated = a.defined();
  Tensor out = at::empty({s.b, s.h, s.l, s.r}, x.options());
  const float* px = x.data_ptr<float>();
  const float* pc = code.data_ptr<float>();
  const float* pa = gated ? a.data_ptr<float>() : nullptr;
  const float* pn = gated ? xi.data_ptr<float>() : nullptr;
  float* po = out.data_ptr<float>();
  at::parallel_for(0, s.l * s.h, grain(s), [&](int64_t begin, int64_t end) {
    if (gated)
      forward_items_by_r<true>(s.r, s, px, pc, pa, pn, po, begin, end);
    else
      forward_items_by_r<false>(s.r, s, px, pc, pa, pn, po, begin, end);
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
  const Shapes s = shapes_of(x, code.size(3));
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
      backward_items_by_r<true>(s.r, s, px, pc, pa, pn, pg, out, begin, end);
    else
      backward_items_by_r<false>(s.r, s, px, pc, pa, pn, pg, out, begin, end);
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

// SineSPE's filter with the codes formed inside (see the kernels above).
// a and xi are empty when ungated; offsets is empty on the key side (no
// offsets there). Returns the gradients of x, zg, a, xi, cycles and offsets.
struct SineFilter : public torch::autograd::Function<SineFilter> {
  static SineArgs args_of(const Tensor& x, const Tensor& omega, const Tensor& zg, const Tensor& a,
                          const Tensor& xi, int64_t start) {
    SineArgs q{};
    q.s = shapes_of(x, zg.size(3));
    q.k2 = zg.size(2);
    q.start = start;
    q.nblk = (q.s.l + kBlock - 1) / kBlock;
    q.x = x.data_ptr<float>();
    q.omega = omega.data_ptr<float>();
    q.zg = zg.data_ptr<float>();
    q.a = a.numel() > 0 ? a.data_ptr<float>() : nullptr;
    q.xi = xi.numel() > 0 ? xi.data_ptr<float>() : nullptr;
    return q;
  }

  // Blocks per task: about 2^17 multiply-adds of code forming each.
  static int64_t grain_of(const SineArgs& q) {
    return std::max<int64_t>(1, (1 << 17) / std::max<int64_t>(1, kBlock * q.s.d * q.k2 * q.s.r));
  }

  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& omega,
                        const Tensor& zg, const Tensor& a, const Tensor& xi, const Tensor& cycles,
                        const Tensor& offsets, int64_t start) {
    ctx->save_for_backward({x, omega, zg, a, xi});
    ctx->saved_data["start"] = start;
    ctx->saved_data["query"] = offsets.numel() > 0;
    SineArgs q = args_of(x, omega, zg, a, xi, start);
    const bool gated = q.a != nullptr;
    Tensor out = at::empty({q.s.b, q.s.h, q.s.l, q.s.r}, x.options());
    q.out = out.data_ptr<float>();
    at::parallel_for(0, q.s.h * q.nblk, grain_of(q), [&](int64_t begin, int64_t end) {
      std::vector<float> acc(kBlock * q.s.b * q.s.r);
      if (gated)
        sine_forward_items_by_r<true>(q.s.r, q, acc.data(), begin, end);
      else
        sine_forward_items_by_r<false>(q.s.r, q, acc.data(), begin, end);
    });
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto v = ctx->get_saved_variables();
    const Tensor &x = v[0], &omega = v[1], &zg = v[2], &a = v[3], &xi = v[4];
    const int64_t start = ctx->saved_data["start"].toInt();
    const bool query = ctx->saved_data["query"].toBool();
    const Tensor g = grads[0].contiguous();
    SineArgs q = args_of(x, omega, zg, a, xi, start);
    q.g = g.data_ptr<float>();
    const bool gated = q.a != nullptr;
    const Shapes& s = q.s;
    const bool want_dx = ctx->needs_input_grad(0);
    const bool want_dzg = ctx->needs_input_grad(2);
    const bool want_da = gated && ctx->needs_input_grad(3);
    const bool want_dxi = gated && ctx->needs_input_grad(4);
    const bool want_cycles = ctx->needs_input_grad(5);
    const bool want_offsets = query && ctx->needs_input_grad(6);
    const bool need_dzg = want_dzg || want_cycles || want_offsets;

    Tensor dx;
    if (want_dx) dx = at::empty({s.b, s.l, s.h, s.d}, x.options());
    q.dx = want_dx ? dx.data_ptr<float>() : nullptr;
    // per-thread partial sums, summed below
    const int64_t threads = at::get_num_threads();
    auto parts = [&](bool want, at::IntArrayRef shape) {
      std::vector<int64_t> full{threads};
      full.insert(full.end(), shape.begin(), shape.end());
      return want ? at::zeros(full, x.options()) : Tensor();
    };
    const Tensor da_parts = parts(want_da, {s.h, s.d});
    const Tensor dxi_parts = parts(want_dxi, {s.h, s.d, s.r});
    const Tensor dzg_parts = parts(need_dzg, {s.h, s.d, q.k2, s.r});
    const Tensor w_parts = parts(want_cycles, {s.h, s.d, q.k2, s.r});
    auto ptr = [](const Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; };
    float* pda = ptr(da_parts);
    float* pdxi = ptr(dxi_parts);
    float* pdzg = ptr(dzg_parts);
    float* pw = ptr(w_parts);
    at::parallel_for(0, s.h * q.nblk, grain_of(q), [&](int64_t begin, int64_t end) {
      const int64_t t = at::get_thread_num();
      SineArgs mine = q;
      mine.da = pda ? pda + t * s.h * s.d : nullptr;
      mine.dxi = pdxi ? pdxi + t * s.h * s.d * s.r : nullptr;
      mine.dzg = pdzg ? pdzg + t * s.h * s.d * q.k2 * s.r : nullptr;
      mine.w = pw ? pw + t * s.h * s.d * q.k2 * s.r : nullptr;
      if (gated)
        sine_backward_items_by_r<true>(s.r, mine, begin, end);
      else
        sine_backward_items_by_r<false>(s.r, mine, begin, end);
    });

    Tensor dzg, da, dxi, dcycles, doffsets;
    if (want_da) da = da_parts.sum(0);
    if (want_dxi) dxi = dxi_parts.sum(0);
    if (need_dzg) {
      const Tensor total = dzg_parts.sum(0);  // (H, D, 2K, R)
      // the cos and sin rows of zg and of its gradient, (H, D, K, R) each
      const Tensor zc = zg.slice(2, 0, q.k2, 2), zs = zg.slice(2, 1, q.k2, 2);
      auto dphase = [&](const Tensor& t) {
        return (zs * t.slice(2, 0, q.k2, 2) - zc * t.slice(2, 1, q.k2, 2)).sum(-1);  // (H, D, K)
      };
      if (want_offsets) doffsets = dphase(total).unsqueeze(0);
      if (want_cycles)
        dcycles = (dphase(w_parts.sum(0)).to(at::kDouble) * (2.0 * M_PI)).unsqueeze(0);
      if (want_dzg) dzg = total;
    }
    return {dx, Tensor(), dzg, da, dxi, dcycles, doffsets, Tensor()};
  }
};

// A gate of h heads, d features and r realizations: f32 a (H, D) and xi (H, D, R).
void check_gate(const Tensor& a, const Tensor& xi, int64_t h, int64_t d, int64_t r) {
  TORCH_CHECK(a.scalar_type() == at::kFloat && xi.scalar_type() == at::kFloat, "f32 gate");
  TORCH_CHECK(a.is_contiguous() && xi.is_contiguous(), "a contiguous gate");
  TORCH_CHECK(a.dim() == 2 && a.size(0) == h && a.size(1) == d, "a is (H, D)");
  TORCH_CHECK(xi.dim() == 3 && xi.size(0) == h && xi.size(1) == d && xi.size(2) == r,
              "xi is (H, D, R)");
}

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
  if (a.defined()) check_gate(a, xi, x.size(2), x.size(3), code.size(3));
}

void check_sine_inputs(const Tensor& x, const Tensor& omega, const Tensor& zg, const Tensor& a,
                       const Tensor& xi, const Tensor& cycles, const Tensor& offsets) {
  TORCH_CHECK(x.dim() == 4 && omega.dim() == 4 && zg.dim() == 4,
              "x (B, L, H, D), omega (L, H, D, 2K) and zg (H, D, 2K, R)");
  for (const Tensor* t : {&x, &omega, &zg})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu(),
                "the fused SineSPE filter takes f32 CPU tensors");
  TORCH_CHECK(x.stride(3) == 1, "x needs a unit stride over D");
  TORCH_CHECK(omega.is_contiguous() && zg.is_contiguous(), "omega and zg must be contiguous");
  const int64_t l = x.size(1), h = x.size(2), d = x.size(3), k2 = zg.size(2), r = zg.size(3);
  TORCH_CHECK(omega.size(0) == l && omega.size(1) == h && omega.size(2) == d &&
                  omega.size(3) == k2 && zg.size(0) == h && zg.size(1) == d && k2 % 2 == 0,
              "omega ", omega.sizes(), " and zg ", zg.sizes(), " do not fit x ", x.sizes());
  TORCH_CHECK(r == 16 || r == 32 || r == 64, "R must be 16, 32 or 64");
  TORCH_CHECK(cycles.dim() == 4 && cycles.size(1) == h && cycles.size(2) == d &&
                  cycles.size(3) == k2 / 2 && cycles.scalar_type() == at::kDouble,
              "cycles is (1, H, D, K) f64");
  TORCH_CHECK(offsets.numel() == 0 || offsets.sizes() == cycles.sizes(),
              "offsets is (1, H, D, K)");
  TORCH_CHECK(a.numel() > 0 == xi.numel() > 0, "a gate needs both a and xi");
  if (a.numel() > 0) check_gate(a, xi, h, d, r);
}

}  // namespace

extern "C" {

// The filter's output as a new tensor the caller owns (tch's C_tensor is an
// at::Tensor*), or null with the reason in cadenza_kernel_error(). a and
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
    cadenza_last_error() = e.what();
    return nullptr;
  }
}

// SineSPE's filter (SineFilter) as a new tensor, or null with the reason in
// cadenza_kernel_error(). a and xi are null when ungated, offsets on the
// key side.
at::Tensor* cadenza_sine_filter(const at::Tensor* x, const at::Tensor* omega,
                                const at::Tensor* zg, const at::Tensor* a, const at::Tensor* xi,
                                const at::Tensor* cycles, const at::Tensor* offsets,
                                int64_t start) {
  try {
    const Tensor empty = at::empty({0}, x->options());
    const Tensor& ta = a ? *a : empty;
    const Tensor& tn = xi ? *xi : empty;
    const Tensor& to = offsets ? *offsets : empty;
    check_sine_inputs(*x, *omega, *zg, ta, tn, *cycles, to);
    return new at::Tensor(SineFilter::apply(*x, *omega, *zg, ta, tn, *cycles, to, start));
  } catch (const std::exception& e) {
    cadenza_last_error() = e.what();
    return nullptr;
  }
}

const char* cadenza_kernel_error() { return cadenza_last_error().c_str(); }

}  // extern "C"
