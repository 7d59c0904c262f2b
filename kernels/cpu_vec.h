// 16-lane fp32 vectors for fuseserve's C++ CPU operators (cpu_attention.cpp, cpu_fused.cpp,
// cpu_quant_linear.cpp): GCC / Clang vector extensions, no intrinsics (one AVX-512 register, two AVX2
// ones), loads and stores of fp32 and bf16 rows, and a vector exp. Included by the sources;
// kernels/cpu_build.py hashes it with them.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace fuseserve_cpu_vec {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));

inline v16 splat(float x) { return v16{} + x; }

// 16 consecutive elements as fp32 lanes (bf16: the 16 bits become a float's high half).
template <typename T>
inline v16 load16(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    v16 x;
    std::memcpy(&x, p, sizeof(x));
    return x;
  } else {
    static_assert(std::is_same_v<T, c10::BFloat16>);
    v16h h;
    std::memcpy(&h, p, sizeof(h));
    return (v16)(__builtin_convertvector(h, v16u) << 16);
  }
}

// fp32 lanes rounded to T's precision, still as fp32: bf16 rounds to nearest even as c10::BFloat16
// does (NaN stays NaN); fp32 is unchanged. What torch does between two element-wise ops on bf16.
template <typename T>
inline v16 round_to(v16 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    const v16u u = (v16u)v;
    const v16u r = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    return (v16)(v != v ? (v16u)splat(__builtin_nanf("")) : r);
  }
}

// Stores 16 lanes as T (bf16: rounded to nearest even).
template <typename T>
inline void store16(T* p, v16 v) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(p, &v, sizeof(v));
  } else {
    const v16h h = __builtin_convertvector((v16u)round_to<T>(v) >> 16, v16h);
    std::memcpy(p, &h, sizeof(h));
  }
}

// The first n < 16 elements as lanes (the rest 0), and their store: a row's tail.
template <typename T>
inline v16 load_part(const T* p, int64_t n) {
  T buf[16] = {};
  std::memcpy(buf, p, n * sizeof(T));
  return load16(buf);
}

template <typename T>
inline void store_part(T* p, v16 v, int64_t n) {
  T buf[16];
  store16(buf, v);
  std::memcpy(p, buf, n * sizeof(T));
}

// Lane i holds i.
inline v16i lane_ids() {
  v16i lane{};
  for (int i = 0; i < 16; ++i) lane[i] = i;
  return lane;
}

inline float hmax(v16 v) {
  float m = v[0];
  for (int i = 1; i < 16; ++i) m = std::max(m, v[i]);
  return m;
}

inline float hsum(v16 v) {
  float s = 0.0f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}

// exp(x) on 16 lanes for x <= 0: 2^k * p(r) with r = x - k ln2 in [-ln2/2, ln2/2] (k rounded to nearest
// by the 1.5 * 2^23 trick) and a degree-6 polynomial (relative error ~2e-7); x < -87 (and -inf) → 0.
inline v16 exp_neg_v(v16 x) {
  const v16 lim = splat(-87.0f);
  const v16 xc = x < lim ? lim : x;
  const v16 magic = splat(12582912.0f);
  const v16 k = (xc * 1.4426950408889634f + magic) - magic;
  const v16 r = xc - k * 0.693145751953125f - k * 1.428606765330187e-06f;
  v16 p = splat(1.0f / 720.0f);
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const v16i bits = (__builtin_convertvector(k, v16i) + 127) << 23;
  const v16 scale = (v16)bits;
  return x < lim ? splat(0.0f) : p * scale;
}

}  // namespace fuseserve_cpu_vec
