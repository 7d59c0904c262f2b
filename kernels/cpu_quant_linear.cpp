// Weight-only quantized matmul for a few rows (decode) on CPUs: y[M, N] = x[M, K] W^T with
// W[n, k] = q[n, k] * scale[n, k / G] + offset[n, k / G], q unsigned integers of 4 or 8 bits.
//
// Built at first use by fuseserve/kernels/cpu_quant_linear.py (g++ with torch's headers, -O3
// -march=native -fopenmp), registered as torch.ops.fuseserve_cpu_quant.quant_gemv. Layout of the
// integers (the Triton kernel's, kernels/triton_quant_linear.py): 4-bit rows of K / 2 bytes where byte
// j of each 32-value block holds value j (low nibble) and value 16 + j (high nibble); 8-bit rows of K
// bytes. K and G are multiples of 32.
//
// Work split: output features in parallel (at::parallel_for). Per output feature and 32-value block,
// the integers are widened to fp32 once and dotted with every row of x (vectorised over the block);
// per group the dot is scaled and the offset added as offset * sum(x over the group), so the
// weight is read once per call whatever M is: memory traffic is that of the packed weight.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

void quant_gemv(at::Tensor& y, const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                const at::Tensor& offset, int64_t bits, int64_t group) {
  TORCH_CHECK(x.dtype() == at::kFloat && x.is_contiguous() && x.dim() == 2, "x: contiguous float32 [M, K]");
  TORCH_CHECK(w.dtype() == at::kByte && w.is_contiguous(), "w: contiguous uint8");
  TORCH_CHECK(scale.dtype() == at::kFloat && offset.dtype() == at::kFloat, "scale, offset: float32");
  const int64_t M = x.size(0), K = x.size(1), N = scale.size(0), num_groups = scale.size(1);
  TORCH_CHECK(K % 32 == 0 && group % 32 == 0 && num_groups * group == K, "K and group: multiples of 32");
  const int64_t row_bytes = bits <= 4 ? K / 2 : K;
  TORCH_CHECK(w.size(0) == N && w.size(1) == row_bytes, "w: [N, K / 2] (4-bit) or [N, K] (8-bit)");
  const float* X = x.data_ptr<float>();
  const uint8_t* W = w.data_ptr<uint8_t>();
  const float* S = scale.data_ptr<float>();
  const float* O = offset.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  const int64_t blocks_per_group = group / 32;
  std::vector<float> xsum(M * num_groups, 0.f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < num_groups; ++g) {
      float s = 0.f;
      for (int64_t k = g * group; k < (g + 1) * group; ++k) s += X[m * K + k];
      xsum[m * num_groups + g] = s;
    }
  at::parallel_for(0, N, 8, [&](int64_t n0, int64_t n1) {
    std::vector<float> acc(M), dot(M);
    alignas(32) float wv[32];
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* wr = W + n * row_bytes;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t g = 0; g < num_groups; ++g) {
        std::fill(dot.begin(), dot.end(), 0.f);
        for (int64_t b = 0; b < blocks_per_group; ++b) {
          const int64_t blk = g * blocks_per_group + b;
          if (bits <= 4) {
            const uint8_t* p = wr + blk * 16;
            for (int j = 0; j < 16; ++j) {
              wv[j] = static_cast<float>(p[j] & 15);
              wv[16 + j] = static_cast<float>(p[j] >> 4);
            }
          } else {
            const uint8_t* p = wr + blk * 32;
            for (int j = 0; j < 32; ++j) wv[j] = static_cast<float>(p[j]);
          }
          for (int64_t m = 0; m < M; ++m) {
            const float* xr = X + m * K + blk * 32;
            float d = 0.f;
#pragma omp simd reduction(+ : d)
            for (int j = 0; j < 32; ++j) d += xr[j] * wv[j];
            dot[m] += d;
          }
        }
        const float s = S[n * num_groups + g], o = O[n * num_groups + g];
        for (int64_t m = 0; m < M; ++m) acc[m] += dot[m] * s + xsum[m * num_groups + g] * o;
      }
      for (int64_t m = 0; m < M; ++m) Y[m * N + n] = acc[m];
    }
  });
}

}  // namespace

TORCH_LIBRARY(fuseserve_cpu_quant, m) {
  m.def("quant_gemv(Tensor(a!) y, Tensor x, Tensor w, Tensor scale, Tensor offset, int bits, int group) -> ()");
}

TORCH_LIBRARY_IMPL(fuseserve_cpu_quant, CPU, m) { m.impl("quant_gemv", quant_gemv); }
