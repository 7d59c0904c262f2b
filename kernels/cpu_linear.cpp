// bf16 linear layers on AMX CPUs: x [T, K] times a weight packed once at load -> [T, N], as oneDNN
// batch-reduce GEMMs (ATen's cpublas::brgemm, the entry point cpu_prefill.cpp uses) over 64-column
// blocks of the weight, the blocks handed to the threads from a shared counter.
//
// Beside oneDNN's packed matmul (mkldnn::_linear_pointwise), for decode-size passes: a pass of a few rows
// multiplies them by every weight, so it is a read of the weights, and oneDNN's own two-thread split of
// SmolLM2's products read them at 11-18 GB/s with ~20 us of set-up per call; these blocks read them at
// 18-23 GB/s (16 rows, weights out of cache, the 30 layers' linears 13.0-13.8 -> 10.2-11.0 ms, the LM head
// 2.5-2.7 -> 2.3-2.5 ms; benchmarks/README.md). From 256 rows on oneDNN's matmul was the faster (up to
// 20%), so the weight keeps its oneDNN copy and this one is a second copy used up to 32 rows
// (kernels/cpu_stack.cpp's small_pass). A thread taken off its core mid-product delays only the block
// it holds: its partner takes the rest. The same output bits as oneDNN up to 16 rows (both accumulate
// the bf16 products in fp32 on AMX, add the bias and round once); beyond, within a bf16 step.
//
// Layout of a packed weight (pack): a bf16 tensor shaped [N, K] whose memory holds, per block of 64
// output columns (the last one narrower), the block's [K, cols] slice of W^T in the VNNI order
// cpublas::pack writes; K a multiple of 32 and N of 16 (packable says). Built by
// fuseserve/kernels/cpu_linear.py; services/worker/prepacked_linear.py makes the copies, and
// kernels/cpu_stack.cpp's linear (the one entry point of packed linears) calls this one for them.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "cpu_vec.h"

namespace {

using namespace fuseserve_cpu_vec;
using bf16 = c10::BFloat16;

constexpr int64_t COLS = 64;           // output columns per block (oneDNN packs at most 64)
constexpr int64_t TILE_BYTES = 1 << 20;  // rows per brgemm call: an [M, K] bf16 slice of x of about 1 MiB

bool usable() { return at::native::cpublas::could_pack(at::kBFloat16); }

bool packable(int64_t n, int64_t k) { return usable() && n > 0 && k > 0 && n % 16 == 0 && k % 32 == 0; }

// w [N, K] bf16 -> the packed weight (layout above). Raises on a shape packable refuses.
at::Tensor pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "cpu_linear.pack: a bf16 [N, K] weight");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(packable(N, K), "cpu_linear.pack: needs oneDNN's bf16 brgemm (AMX), N % 16 == 0 and K % 32 == 0; got [",
              N, ", ", K, "]");
  const at::Tensor wt = w.t().contiguous();  // [K, N]: the B operand, row-major
  at::Tensor out = at::empty({N, K}, w.options());
  for (int64_t c0 = 0; c0 < N; c0 += COLS)
    at::native::cpublas::pack(K, std::min(COLS, N - c0), N, std::min(COLS, N - c0), at::kBFloat16, at::kBFloat16,
                              wt.data_ptr<bf16>() + c0, out.data_ptr<bf16>() + K * c0);
  return out;
}

// x [T, K] bf16 times packed [N, K] (+ bias [N] bf16, none when empty) -> [T, N] bf16. Work items are
// (64-column block, row tile) pairs, claimed from a shared counter by every thread; inside a parallel
// region (kernels/cpu_stack.cpp's row chunks) the calling thread runs them all.
at::Tensor linear(const at::Tensor& x_in, const at::Tensor& packed, const std::optional<at::Tensor>& bias_in) {
  const at::Tensor x = x_in.contiguous();
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16 &&
                  packed.dim() == 2 && packed.is_contiguous() && x.size(1) == packed.size(1),
              "cpu_linear.linear: x [T, K] and a packed weight [N, K], both bf16; got ", x.sizes(), " and ",
              packed.sizes());
  const int64_t T = x.size(0), K = x.size(1), N = packed.size(0);
  TORCH_CHECK(packable(N, K), "cpu_linear.linear: a weight cpu_linear.pack packed; got [", N, ", ", K, "]");
  const bf16* bias = nullptr;
  if (bias_in.has_value() && bias_in->numel() > 0) {
    TORCH_CHECK(bias_in->scalar_type() == at::kBFloat16 && bias_in->numel() == N && bias_in->is_contiguous(),
                "cpu_linear.linear: bias bf16 [", N, "]");
    bias = bias_in->data_ptr<bf16>();
  }
  at::Tensor out = at::empty({T, N}, x.options());
  if (T == 0) return out;
  const int64_t rows = std::clamp<int64_t>(TILE_BYTES / (2 * K) / 16 * 16, 16, 256);
  const int64_t tiles = (T + rows - 1) / rows, blocks = (N + COLS - 1) / COLS, items = blocks * tiles;
  const bf16* xp = x.data_ptr<bf16>();
  const bf16* wp = packed.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  std::atomic<int64_t> next{0};
  auto work = [&]() {
    std::vector<float> c(std::min(rows, T) * COLS);
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < items;) {
      const int64_t b = i / tiles, r0 = i % tiles * rows, m = std::min(rows, T - r0);
      const int64_t c0 = b * COLS, cols = std::min(COLS, N - c0);
      at::native::cpublas::brgemm(m, cols, K, K, cols, cols, false, xp + r0 * K, wp + K * c0, c.data(), true);
      for (int64_t r = 0; r < m; ++r)
        for (int64_t j = 0; j < cols; j += 16) {
          const v16 y = load16(c.data() + r * cols + j);
          store16(op + (r0 + r) * N + c0 + j, bias != nullptr ? y + load16(bias + c0 + j) : y);
        }
    }
    at::native::cpublas::brgemm_release(true);
  };
  if (at::in_parallel_region() || at::get_num_threads() == 1 || items == 1) {
    work();
  } else {
    at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) { work(); });
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(fuseserve_linear, m) {
  m.def("usable() -> bool");
  m.def("packable(int n, int k) -> bool");
  m.def("pack(Tensor w) -> Tensor");
  m.def("linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(fuseserve_linear, CompositeExplicitAutograd, m) {
  m.impl("usable", usable);
  m.impl("packable", packable);
}

TORCH_LIBRARY_IMPL(fuseserve_linear, CPU, m) {
  m.impl("pack", pack);
  m.impl("linear", linear);
}
