// Fused element-wise operators for CPUs: what a decoder layer does between its matmuls, one call each
// instead of 4-9 ATen ops (each its own dispatch, its own pass over memory and, for bf16, its own
// widening and rounding).
//
// Built at first use by fuseserve/kernels/cpu_build.py (g++ with torch's headers, -ffp-contract=off so
// that a product and a sum round apart, as ATen's separate ops do), registered as torch.ops.fuseserve_fused.
// Each operator takes fp32 or bf16 rows (last dimension contiguous) and computes in fp32, rounding to
// the tensor's dtype wherever the unfused ops of services/worker/models/layers.py round:
//   rms_norm      out = w * round(x * rsqrt(mean(x^2) + eps))   (unit_offset: round(x * rsqrt(..) * (1 + w)))
//   add_rms_norm  sum = round(x + residual); out = rms_norm(sum)
//   silu_mul      out = round(round(silu(gate)) * up), gate_up = [gate | up] along the last dimension
//   rotary        in place, the first R dims of each head of q and k (half-split layout):
//                 x1' = round(x1 c1) + round(-x2 s1), x2' = round(x2 c2) + round(x1 s2), c and s the
//                 fp32 tables' rows at the token's position rounded to the dtype.
// The sum of squares runs in fp64 (ATen sums fp32 pairwise: the two rarely differ once rounded to fp32),
// and silu's exp is cpu_vec.h's polynomial (relative error ~2e-7 against ATen's ~1 ulp), so those two
// may differ from the unfused ops by one rounding step; the rest is the same arithmetic in the same order.
// Rows run in parallel (at::parallel_for) once a call has enough elements to pay for the threads.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "cpu_vec.h"

namespace {

using namespace fuseserve_cpu_vec;

constexpr int64_t PARALLEL_ELEMENTS = 32768;  // below this many elements a call stays on one thread

int64_t grain(int64_t row_elements) { return std::max<int64_t>(1, PARALLEL_ELEMENTS / std::max<int64_t>(row_elements, 1)); }

// Calls f(offset, lanes) over a row of n elements in steps of 16 (the last step may be shorter).
template <typename F>
inline void for_each_16(int64_t n, F&& f) {
  for (int64_t j = 0; j < n; j += 16) f(j, std::min<int64_t>(16, n - j));
}

template <typename T>
inline v16 load(const T* p, int64_t lanes) { return lanes == 16 ? load16(p) : load_part(p, lanes); }

template <typename T>
inline void store(T* p, v16 v, int64_t lanes) {
  if (lanes == 16) store16(p, v); else store_part(p, v, lanes);
}

typedef double v8d __attribute__((vector_size(64)));

// The sum of a row's squares in fp64 lanes: rounded to fp32 it is almost always the fp32 that ATen's
// pairwise fp32 sum gives (a 16-lane fp32 sum differed often enough to flip bf16 roundings downstream).
template <typename T>
double sum_squares(const T* src, int64_t n) {
  v8d lo = {}, hi = {};
  for_each_16(n, [&](int64_t j, int64_t m) {
    const v16 v = load(src + j, m);
    const v8d a = __builtin_convertvector(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7), v8d);
    const v8d b = __builtin_convertvector(__builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15), v8d);
    lo += a * a;
    hi += b * b;
  });
  const v8d t = lo + hi;
  double total = 0.0;
  for (int i = 0; i < 8; ++i) total += t[i];
  return total;
}

template <typename T>
void rms_norm_rows(const at::Tensor& out, const at::Tensor* sum, const at::Tensor& x, const at::Tensor* residual,
                   const at::Tensor& weight, double eps, bool unit_offset) {
  const int64_t rows = x.size(0), n = x.size(1);
  T* op = out.data_ptr<T>();
  const T* xp = x.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* sp = sum ? sum->data_ptr<T>() : nullptr;
  const T* rp = residual ? residual->data_ptr<T>() : nullptr;
  const int64_t so = out.stride(0), sx = x.stride(0), ss = sum ? sum->stride(0) : 0, sr = residual ? residual->stride(0) : 0;
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* src = xp + i * sx;
      if (rp) {  // sum = round(x + residual), then normalize the sum as stored
        T* dst = sp + i * ss;
        for_each_16(n, [&](int64_t j, int64_t m) {
          store(dst + j, load(src + j, m) + load(rp + i * sr + j, m), m);
        });
        src = dst;
      }
      const float r = 1.0f / std::sqrt(static_cast<float>(sum_squares(src, n)) / static_cast<float>(n) +
                                       static_cast<float>(eps));
      T* dst = op + i * so;
      for_each_16(n, [&](int64_t j, int64_t m) {
        const v16 y = load(src + j, m) * r;
        const v16 w = load(wp + j, m);
        store(dst + j, unit_offset ? y * (1.0f + w) : w * round_to<T>(y), m);
      });
    }
  });
}

template <typename T>
void silu_mul_rows(const at::Tensor& out, const at::Tensor& gate_up) {
  const int64_t rows = out.size(0), n = out.size(1);
  T* op = out.data_ptr<T>();
  const T* gp = gate_up.data_ptr<T>();
  const int64_t so = out.stride(0), sg = gate_up.stride(0);
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* g = gp + i * sg;
      for_each_16(n, [&](int64_t j, int64_t m) {
        const v16 x = load(g + j, m);
        const v16 e = exp_neg_v(x < 0.0f ? x : -x);  // exp(-|x|): never overflows
        const v16 s = (x < 0.0f ? x * e : x) / (1.0f + e);  // x >= 0: x / (1 + exp(-x)), ATen's form
        store(op + i * so + j, round_to<T>(s) * load(g + n + j, m), m);
      });
    }
  });
}

template <typename T>
void rotate_heads(T* base, int64_t heads, int64_t head_stride, const float* c, const float* s, int64_t half) {
  for (int64_t h = 0; h < heads; ++h) {
    T* x = base + h * head_stride;
    for_each_16(half, [&](int64_t j, int64_t m) {
      const v16 x1 = load(x + j, m), x2 = load(x + half + j, m);
      const v16 c1 = round_to<T>(load(c + j, m)), c2 = round_to<T>(load(c + half + j, m));
      const v16 s1 = round_to<T>(load(s + j, m)), s2 = round_to<T>(load(s + half + j, m));
      store(x + j, round_to<T>(x1 * c1) + round_to<T>(-x2 * s1), m);
      store(x + half + j, round_to<T>(x2 * c2) + round_to<T>(x1 * s2), m);
    });
  }
}

template <typename T>
void rotary_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& positions, const at::Tensor& cos,
                 const at::Tensor& sin) {
  const int64_t tokens = q.size(0), rot = cos.size(1), half = rot / 2;
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  T* qp = q.data_ptr<T>();
  T* kp = k.data_ptr<T>();
  const int64_t work = (q.size(1) + k.size(1)) * rot;
  at::parallel_for(0, tokens, grain(work), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + pos[t] * rot;
      const float* s = sp + pos[t] * rot;
      rotate_heads(qp + t * q.stride(0), q.size(1), q.stride(1), c, s, half);
      rotate_heads(kp + t * k.stride(0), k.size(1), k.stride(1), c, s, half);
    }
  });
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.stride(1) == 1, name, " must be a CPU [rows, n] tensor with a contiguous last dimension");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name, " must be float32 or bfloat16");
}

#define FUSED_DISPATCH(dtype, ...)                       \
  if ((dtype) == at::kFloat) {                           \
    using scalar = float;                                \
    __VA_ARGS__;                                         \
  } else {                                               \
    using scalar = c10::BFloat16;                        \
    __VA_ARGS__;                                         \
  }

void norm_checks(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight) {
  check_rows(out, "out");
  check_rows(x, "x");
  TORCH_CHECK(out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type(), "out must match x");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(), "weight must be [n] in x's dtype");
}

// out [rows, n] = RMSNorm(x [rows, n]) with weight [n].
void rms_norm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps, bool unit_offset) {
  norm_checks(out, x, weight);
  FUSED_DISPATCH(x.scalar_type(), rms_norm_rows<scalar>(out, nullptr, x, nullptr, weight, eps, unit_offset));
}

// sum [rows, n] = x + residual; out [rows, n] = RMSNorm(sum) with weight [n].
void add_rms_norm(const at::Tensor& out, const at::Tensor& sum, const at::Tensor& x, const at::Tensor& residual,
                  const at::Tensor& weight, double eps, bool unit_offset) {
  norm_checks(out, x, weight);
  check_rows(sum, "sum");
  check_rows(residual, "residual");
  TORCH_CHECK(sum.sizes() == x.sizes() && residual.sizes() == x.sizes() && sum.scalar_type() == x.scalar_type() &&
                  residual.scalar_type() == x.scalar_type(), "sum and residual must match x");
  FUSED_DISPATCH(x.scalar_type(), rms_norm_rows<scalar>(out, &sum, x, &residual, weight, eps, unit_offset));
}

template <typename T>
void argmax_rows(const at::Tensor& out, const at::Tensor& x) {
  const int64_t rows = x.size(0), n = x.size(1), sx = x.stride(0);
  const T* xp = x.data_ptr<T>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* row = xp + i * sx;
      // per lane: the largest value seen and the first index holding it; NaN counts as the largest
      // (torch.max propagates it: the first NaN's index)
      v16 best = splat(-std::numeric_limits<float>::infinity());
      v16i at = {}, nan = {};
      v16i idx = lane_ids();
      for_each_16(n, [&](int64_t j, int64_t m) {
        v16 v = load(row + j, m);
        if (m < 16) {
          for (int64_t k = m; k < 16; ++k) v[k] = -std::numeric_limits<float>::infinity();
        }
        nan |= v != v;
        const v16i take = v > best;
        best = take ? v : best;
        at = take ? idx : at;
        idx += 16;
      });
      bool any_nan = false;
      for (int k = 0; k < 16; ++k) any_nan |= nan[k] != 0;
      int64_t pick = -1;
      if (any_nan) {
        for (int64_t j = 0; j < n && pick < 0; ++j) pick = std::isnan(static_cast<float>(row[j])) ? j : -1;
      } else {
        const float m = hmax(best);
        for (int k = 0; k < 16; ++k) {
          if (best[k] == m && (pick < 0 || at[k] < pick)) pick = at[k];
        }
        if (pick < 0) pick = 0;  // every value -inf: the first
      }
      op[i] = pick;
    }
  });
}

// out [rows] int64 = the first index of each row's largest value of x [rows, n] (torch.max(x, -1).indices).
void argmax(const at::Tensor& out, const at::Tensor& x) {
  check_rows(x, "x");
  TORCH_CHECK(out.scalar_type() == at::kLong && out.is_contiguous() && out.dim() == 1 && out.size(0) == x.size(0) &&
                  x.size(1) > 0, "out must be contiguous int64 [rows], x [rows, n > 0]");
  FUSED_DISPATCH(x.scalar_type(), argmax_rows<scalar>(out, x));
}

// out [rows, n] = silu(gate_up[:, :n]) * gate_up[:, n:].
void silu_mul(const at::Tensor& out, const at::Tensor& gate_up) {
  check_rows(out, "out");
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(0) == out.size(0) && gate_up.size(1) == 2 * out.size(1) &&
                  gate_up.scalar_type() == out.scalar_type(), "gate_up must be [rows, 2 n] in out's dtype");
  FUSED_DISPATCH(out.scalar_type(), silu_mul_rows<scalar>(out, gate_up));
}

// q [T, H, D] and k [T, KVH, D] rotated in place by positions [T] (int64) through cos / sin [P, R] (fp32).
void rotary(const at::Tensor& q, const at::Tensor& k, const at::Tensor& positions, const at::Tensor& cos,
            const at::Tensor& sin) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 &&
                  k.stride(2) == 1 && q.size(0) == k.size(0) && q.size(2) == k.size(2),
              "q and k must be CPU [T, heads, D] with a contiguous last dimension");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "q and k must be both float32 or both bfloat16");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(1) % 2 == 0 &&
                  cos.size(1) <= q.size(2), "cos / sin must be contiguous fp32 [P, R], R even and <= D");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.dim() == 1 &&
                  positions.size(0) == q.size(0), "positions must be contiguous int64 [T]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < positions.size(0); ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "position ", pos[t], " is outside the rotary table (", cos.size(0), ")");
  }
  FUSED_DISPATCH(q.scalar_type(), rotary_rows<scalar>(q, k, positions, cos, sin));
}

}  // namespace

TORCH_LIBRARY(fuseserve_fused, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps, bool unit_offset) -> ()");
  m.def("add_rms_norm(Tensor(a!) out, Tensor(b!) sum, Tensor x, Tensor residual, Tensor weight, float eps, "
        "bool unit_offset) -> ()");
  m.def("silu_mul(Tensor(a!) out, Tensor gate_up) -> ()");
  m.def("argmax(Tensor(a!) out, Tensor x) -> ()");
  m.def("rotary(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cos, Tensor sin) -> ()");
}

TORCH_LIBRARY_IMPL(fuseserve_fused, CPU, m) {
  m.impl("rms_norm", rms_norm);
  m.impl("add_rms_norm", add_rms_norm);
  m.impl("silu_mul", silu_mul);
  m.impl("argmax", argmax);
  m.impl("rotary", rotary);
}
