// What the C++ kernels of the crate share (src/model/spe_filter.cpp and
// src/model/favor_attention.cpp, compiled by build.rs): libtorch's headers,
// a 16-float vector type, the run-time pick of the widest instruction set,
// and the reason the last call of this thread failed.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

// Why the last call of this thread into the kernels returned null (one
// string for the whole library: an inline function's static is shared by
// every file that includes this one).
inline std::string& cadenza_last_error() {
  static thread_local std::string why;
  return why;
}

namespace {

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
// The sum of the 16 lanes, as a tree of shuffles (4 shuffles and 4 adds).
#if defined(__clang__)
#define CADENZA_SHUFFLE(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#else
#define CADENZA_SHUFFLE(v, ...) __builtin_shuffle(v, vi{__VA_ARGS__})
#endif
CADENZA_INLINE float hsum(vf v) {
  v = v + CADENZA_SHUFFLE(v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v = v + CADENZA_SHUFFLE(v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v = v + CADENZA_SHUFFLE(v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v = v + CADENZA_SHUFFLE(v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return v[0];
}

// Kernels are compiled for AVX-512, AVX2 + FMA and the baseline, and the
// widest this CPU has is picked at run time (the crate is built for baseline
// x86-64).
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

// NAME<A, B>, a kernel with two template parameters (of types TA and TB),
// compiled for each instruction set, and NAME##_isa<A, B>, which calls the
// widest one this CPU has.
#define CADENZA_VARIANTS(NAME, TA, A, TB, B, ARGS, CALL)                      \
  template <TA A, TB B>                                                        \
  CADENZA_TARGET("arch=x86-64-v4") void NAME##_v4 ARGS { NAME<A, B> CALL; }   \
  template <TA A, TB B>                                                        \
  CADENZA_TARGET("arch=x86-64-v3") void NAME##_v3 ARGS { NAME<A, B> CALL; }   \
  template <TA A, TB B>                                                        \
  void NAME##_base ARGS { NAME<A, B> CALL; }                                   \
  template <TA A, TB B>                                                        \
  void NAME##_isa ARGS {                                                       \
    switch (widest()) {                                                        \
      case Isa::V4: NAME##_v4<A, B> CALL; break;                               \
      case Isa::V3: NAME##_v3<A, B> CALL; break;                               \
      default: NAME##_base<A, B> CALL; break;                                  \
    }                                                                          \
  }

}  // namespace
