// Weight-only quantized matmul on CPUs: y[M, N] = x[M, K] W^T with
// W[n, k] = q[n, k] * scale[n, k / G] + offset[n, k / G], q unsigned integers of 4 or 8 bits.
//
// Built at first use by fuseserve/kernels/cpu_quant_linear.py (g++ with torch's headers, -O3
// -march=native -fopenmp), registered as torch.ops.fuseserve_cpu_quant.quant_gemv (few rows) and
// .dequantize (the whole W, for passes of many rows). Layout of the integers (the Triton kernel's,
// kernels/triton_quant_linear.py): 4-bit rows of K / 2 bytes where byte j of each 32-value block holds
// value j (low nibble) and value 16 + j (high nibble); 8-bit rows of K bytes. K and G are multiples
// of 32.
//
// quant_gemv: output features in parallel (at::parallel_for). Up to 4 rows of x, each weight block
// is dequantized in registers and dotted with every row at once; more rows: each weight row is
// dequantized once, 16 lanes at a time, into an fp32 row buffer (K floats: L1/L2-resident), then
// dotted with the rows of x four at a time (four 16-lane accumulators share each load of the buffer). The weight is read
// once per call whatever M is, so a decode pass moves the packed bytes, not an fp32 copy; the row's
// dequantized values equal the reference's (q * scale + offset in fp32).
//
// bf16_gemv: the same loops over a bfloat16 W (a float weight a quantized checkpoint stored in 16
// bits, kept so): each value is widened to fp32 exactly, so the product is fp32 compute on 2 bytes
// per weight read.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_vec.h"

namespace {

using namespace fuseserve_cpu_vec;  // v16, v16i, load16, store16, hsum

typedef uint8_t v16b __attribute__((vector_size(16)));

// uint8 -> float through uint16 and int32: GCC 12 scalarises a direct uint8 -> float conversion (16
// scalar converts), and uint8 -> int32 too for bytes straight from memory (16 byte inserts); each
// step here is one zero-extension per register (checked in the assembly, both bit widths).
typedef uint16_t v16s __attribute__((vector_size(32)));
inline v16 to_float(v16b b) {
  return __builtin_convertvector(__builtin_convertvector(__builtin_convertvector(b, v16s), v16i), v16);
}

// 16 bytes at p, read as one vector (an unaligned vector type: a memcpy into v16b went through
// general registers byte by byte in the 8-bit path).
typedef uint8_t v16b_unaligned __attribute__((vector_size(16), aligned(1), may_alias));
inline v16b load_bytes(const uint8_t* p) { return *reinterpret_cast<const v16b_unaligned*>(p); }

inline v16 widen(const uint8_t* p) { return to_float(load_bytes(p)); }

// Row n of W (its packed bytes wr, its scales s and offsets o per group), dequantized 32 values at
// a time: each(f) calls f(blk, lo, hi) with block blk's values 32 blk .. 32 blk + 15 (lo) and the next
// 16 (hi), q * scale + offset in fp32.
struct QuantRow {
  const uint8_t* wr;
  const float* s;
  const float* o;
  int64_t K, group, bits;

  template <class F>
  inline void each(F&& f) const {
    const int64_t blocks_per_group = group / 32;
    for (int64_t g = 0; g < K / group; ++g) {
      const v16 sv = v16{} + s[g], ov = v16{} + o[g];
      for (int64_t blk = g * blocks_per_group; blk < (g + 1) * blocks_per_group; ++blk) {
        v16 lo, hi;
        if (bits <= 4) {
          const v16b b = load_bytes(wr + blk * 16);
          lo = to_float(b & 15);
          hi = to_float(b >> 4);
        } else {
          lo = widen(wr + blk * 32);
          hi = widen(wr + blk * 32 + 16);
        }
        f(blk, lo * sv + ov, hi * sv + ov);
      }
    }
  }
};

// bfloat16 -> fp32, 16 lanes: the 16 bits become the float's high half (exact).
typedef uint16_t v16s_unaligned __attribute__((vector_size(32), aligned(1), may_alias));
typedef uint32_t v16u __attribute__((vector_size(64)));
inline v16 widen_bf16(const uint16_t* p) {
  const v16u bits = __builtin_convertvector(*reinterpret_cast<const v16s_unaligned*>(p), v16u) << 16;
  v16 f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Row n of a bfloat16 W (K values at wr), widened 32 values at a time, as QuantRow::each.
struct Bf16Row {
  const uint16_t* wr;
  int64_t K;

  template <class F>
  inline void each(F&& f) const {
    for (int64_t blk = 0; blk < K / 32; ++blk) f(blk, widen_bf16(wr + blk * 32), widen_bf16(wr + blk * 32 + 16));
  }
};

// Row of W into out[K], fp32.
template <class Row>
inline void dequant_row(const Row& row, float* out) {
  row.each([&](int64_t blk, v16 lo, v16 hi) {
    store16(out + blk * 32, lo);
    store16(out + blk * 32 + 16, hi);
  });
}

// y[t * N] = x[t] . W[n] for the T rows of x at X (rows K apart), widening W[n] block by block in
// registers (no row buffer): for passes of at most 4 rows, where the buffer's store and reload cost
// more than widening.
template <int T, class Row>
inline void fused_row(const Row& row, int64_t K, const float* X, float* y, int64_t N) {
  v16 acc[T] = {};
  row.each([&](int64_t blk, v16 lo, v16 hi) {
    for (int t = 0; t < T; ++t) acc[t] += load16(X + t * K + blk * 32) * lo + load16(X + t * K + blk * 32 + 16) * hi;
  });
  for (int t = 0; t < T; ++t) y[t * N] = hsum(acc[t]);
}

// y[m * N] = x[m] . w for the T rows of x starting at X (rows K apart), K a multiple of 16.
template <int T>
inline void dot_rows(const float* w, const float* X, int64_t K, float* y, int64_t N) {
  v16 acc[T] = {};
  for (int64_t k = 0; k < K; k += 16) {
    const v16 wv = load16(w + k);
    for (int t = 0; t < T; ++t) acc[t] += load16(X + t * K + k) * wv;
  }
  for (int t = 0; t < T; ++t) y[t * N] = hsum(acc[t]);
}

// Y[M, N] = X[M, K] W^T, row_at(n) giving W's row n (a QuantRow or a Bf16Row); output features in
// parallel.
template <class RowAt>
void gemv(float* Y, const float* X, int64_t M, int64_t N, int64_t K, RowAt row_at) {
  if (M == 0) return;
  if (M <= 4) {
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) {
        const auto row = row_at(n);
        switch (M) {
          case 4: fused_row<4>(row, K, X, Y + n, N); break;
          case 3: fused_row<3>(row, K, X, Y + n, N); break;
          case 2: fused_row<2>(row, K, X, Y + n, N); break;
          default: fused_row<1>(row, K, X, Y + n, N); break;
        }
      }
    });
    return;
  }
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    std::vector<float> buf(K);
    for (int64_t n = n0; n < n1; ++n) {
      dequant_row(row_at(n), buf.data());
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) dot_rows<4>(buf.data(), X + m * K, K, Y + m * N + n, N);
      switch (M - m) {
        case 3: dot_rows<3>(buf.data(), X + m * K, K, Y + m * N + n, N); break;
        case 2: dot_rows<2>(buf.data(), X + m * K, K, Y + m * N + n, N); break;
        case 1: dot_rows<1>(buf.data(), X + m * K, K, Y + m * N + n, N); break;
        default: break;
      }
    }
  });
}

void check(const at::Tensor& w, const at::Tensor& scale, const at::Tensor& offset, int64_t K,
           int64_t bits, int64_t group) {
  TORCH_CHECK(w.dtype() == at::kByte && w.is_contiguous(), "w: contiguous uint8");
  TORCH_CHECK(scale.dtype() == at::kFloat && offset.dtype() == at::kFloat, "scale, offset: float32");
  TORCH_CHECK(scale.is_contiguous() && offset.is_contiguous(), "scale, offset: contiguous");
  TORCH_CHECK(K % 32 == 0 && group % 32 == 0 && scale.size(1) * group == K, "K and group: multiples of 32");
  TORCH_CHECK(w.size(0) == scale.size(0) && w.size(1) == (bits <= 4 ? K / 2 : K),
              "w: [N, K / 2] (4-bit) or [N, K] (8-bit)");
}

void check_xy(const at::Tensor& y, const at::Tensor& x, int64_t N) {
  TORCH_CHECK(x.dtype() == at::kFloat && x.is_contiguous() && x.dim() == 2, "x: contiguous float32 [M, K]");
  TORCH_CHECK(y.dtype() == at::kFloat && y.is_contiguous() && y.size(0) == x.size(0) && y.size(1) == N,
              "y: contiguous float32 [M, N]");
}

void quant_gemv(at::Tensor& y, const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                const at::Tensor& offset, int64_t bits, int64_t group) {
  const int64_t K = x.size(-1), N = scale.size(0), G = scale.size(1);
  check_xy(y, x, N);
  check(w, scale, offset, K, bits, group);
  const int64_t row_bytes = bits <= 4 ? K / 2 : K;
  const uint8_t* W = w.data_ptr<uint8_t>();
  const float* S = scale.data_ptr<float>();
  const float* O = offset.data_ptr<float>();
  gemv(y.data_ptr<float>(), x.data_ptr<float>(), x.size(0), N, K,
       [&](int64_t n) { return QuantRow{W + n * row_bytes, S + n * G, O + n * G, K, group, bits}; });
}

// y = x W^T with W [N, K] bfloat16, fp32 compute: each weight value is read as its 2 bytes.
void bf16_gemv(at::Tensor& y, const at::Tensor& x, const at::Tensor& w) {
  const int64_t K = x.size(-1), N = w.size(0);
  check_xy(y, x, N);
  TORCH_CHECK(w.dtype() == at::kBFloat16 && w.is_contiguous() && w.dim() == 2 && w.size(1) == K,
              "w: contiguous bfloat16 [N, K]");
  TORCH_CHECK(K % 32 == 0, "K: a multiple of 32");
  const uint16_t* W = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  gemv(y.data_ptr<float>(), x.data_ptr<float>(), x.size(0), N, K, [&](int64_t n) { return Bf16Row{W + n * K, K}; });
}

void dequantize(at::Tensor& out, const at::Tensor& w, const at::Tensor& scale, const at::Tensor& offset,
                int64_t bits, int64_t group) {
  const int64_t N = scale.size(0), G = scale.size(1), K = G * group;
  check(w, scale, offset, K, bits, group);
  TORCH_CHECK(out.dtype() == at::kFloat && out.is_contiguous() && out.size(0) == N && out.size(1) == K,
              "out: contiguous float32 [N, K]");
  const int64_t row_bytes = bits <= 4 ? K / 2 : K;
  const uint8_t* W = w.data_ptr<uint8_t>();
  const float* S = scale.data_ptr<float>();
  const float* O = offset.data_ptr<float>();
  float* out_p = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) dequant_row(QuantRow{W + n * row_bytes, S + n * G, O + n * G, K, group, bits}, out_p + n * K);
  });
}

}  // namespace

TORCH_LIBRARY(fuseserve_cpu_quant, m) {
  m.def("quant_gemv(Tensor(a!) y, Tensor x, Tensor w, Tensor scale, Tensor offset, int bits, int group) -> ()");
  m.def("dequantize(Tensor(a!) out, Tensor w, Tensor scale, Tensor offset, int bits, int group) -> ()");
  m.def("bf16_gemv(Tensor(a!) y, Tensor x, Tensor w) -> ()");
}

TORCH_LIBRARY_IMPL(fuseserve_cpu_quant, CPU, m) {
  m.impl("quant_gemv", quant_gemv);
  m.impl("dequantize", dequantize);
  m.impl("bf16_gemv", bf16_gemv);
}
