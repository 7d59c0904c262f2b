// The decoder layers of a LLaMA-shaped model in one call: the operator sequence of
// services/worker/models/llama.py's DecoderLayer.forward (with layers.py's Attention, GatedMLP and
// RMSNorm on their CPU paths), run from C++ so no Python runs between the ~35 operators of a layer.
//
// Built at first use by fuseserve/kernels/cpu_stack.py and registered as
// torch.ops.fuseserve_stack.decoder_layers. It calls the same operators as the Python layers, in the
// same order, through the dispatcher: mkldnn::_linear_pointwise on the packed weights
// (services/worker/prepacked_linear.py; fuseserve_linear::linear from cpu_linear.cpp for decode-size
// passes where a weight has its copy), fuseserve_fused::{rms_norm, add_rms_norm, rotary, silu_mul}
// (cpu_fused.cpp), the KV write (kernels/reference.py's write_kv, here one memcpy a row),
// fuseserve_cpu::paged_attention (cpu_attention.cpp) and, for a pass's long bf16 prefill chunks on AMX
// CPUs, fuseserve_prefill::prefill_attention (cpu_prefill.cpp); so its output equals the Python layers'
// bit for bit (tests/unit/test_layer_stack.py). Those libraries must be loaded first (cpu_stack.py
// does it).
//
// Per layer l, weights[14 l ..]: input norm, then qkv (packed), its bias and its small copy, o (the same
// three), post-attention norm, gate_up (three), down (three); an empty bias or copy means none.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#ifdef __linux__
#include <sched.h>
#endif

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

namespace {

constexpr int64_t PER_LAYER = 14;

c10::OperatorHandle op(const char* name) { return c10::Dispatcher::singleton().findSchemaOrThrow(name, ""); }

c10::IValue optional_bias(const at::Tensor& b) { return b.numel() > 0 ? c10::IValue(b) : c10::IValue(); }

// x [T, in] times a packed weight (+ bias) -> [T, out]: one oneDNN call with its own threading.
at::Tensor linear_call(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  static const c10::OperatorHandle h = op("mkldnn::_linear_pointwise");
  torch::jit::Stack st{x, w, optional_bias(b), std::string("none"), c10::List<std::optional<c10::Scalar>>(),
                       std::string("")};
  h.callBoxed(st);
  return st[0].toTensor();
}

constexpr int64_t ROW_SPLIT_MIN = 192;
// bf16 linears of passes with at least ROW_SPLIT_MIN rows per thread run as one row chunk per thread,
// each a single-threaded oneDNN call. Measured on an AMX CPU with two threads (SmolLM2, benchmarks/
// README.md): oneDNN's own split of a 512-row bf16 product with 576 outputs (o, down) ran no faster on
// two threads than on one; row chunks made a 512-token pass 125 -> 109 ms and a 384-token one 95 -> 86
// ms, while at 128 rows per thread they cost 5-10% and fp32 gained nothing.

// How many row chunks a T-row pass's linears run as (1: one oneDNN call that splits the work itself).
int64_t row_chunks(const at::Tensor& x) {
  const int64_t n = at::get_num_threads();
  return (n > 1 && x.scalar_type() == at::kBFloat16 && x.size(0) >= ROW_SPLIT_MIN * n && !at::in_parallel_region())
             ? n
             : 1;
}

// f(first, count) for each of n row chunks of T rows, one per thread, under the caller's thread-local
// state (its inference mode) on the pool's threads.
template <typename F>
void for_each_row_chunk(int64_t T, int64_t n, const F& f) {
  const at::ThreadLocalState tls;
  at::parallel_for(0, n, 1, [&](int64_t c0, int64_t c1) {
    const at::ThreadLocalStateGuard guard(tls);
    for (int64_t c = c0; c < c1; ++c) f(T * c / n, T * (c + 1) / n - T * c / n);
  });
}

// The rows a bf16 pass of T tokens runs its linears at: T rounded up to a multiple of 16 (up to 256
// rows), 32 (512), 64 (1024), 128 (beyond); passes of at most 16 rows, and fp32 ones, as they are.
// oneDNN builds (JITs) a bf16 matmul for every new row count: measured on an AMX CPU (SmolLM2 shapes),
// a new count cost 4-7 ms per projection at ~1000 rows against 0.3-3 ms warm, ~2 ms at 200 rows, and
// a 1007-token pass 276 ms cold against 168 ms warm. A server sees a new count in nearly every prefill
// pass, and the primitive cache (1024 entries) cannot hold every count of every projection; with
// buckets the counts are few (prepacked_linear.warm_up builds them at load), for at most 1/8 more rows.
int64_t padded_rows(int64_t T, at::ScalarType dtype) {
  if (dtype != at::kBFloat16 || T <= 16) return T;
  const int64_t step = T <= 256 ? 16 : T <= 512 ? 32 : T <= 1024 ? 64 : 128;
  return (T + step - 1) / step * step;
}

// x [T, ...] with zero rows appended up to `rows`.
at::Tensor pad_rows(const at::Tensor& x, int64_t rows) {
  if (rows == x.size(0)) return x;
  std::vector<int64_t> shape = x.sizes().vec();
  shape[0] = rows;
  at::Tensor out = at::zeros(shape, x.options());
  out.narrow(0, 0, x.size(0)).copy_(x);
  return out;
}

constexpr int64_t SMALL_ROWS = 32;
// Passes of at most SMALL_ROWS rows read the weights more than they multiply: where a weight has a copy
// in cpu_linear.cpp's blocks (`small`, empty when none), they multiply by it. Measured on an AMX CPU
// (SmolLM2, 16 rows, weights out of cache): the 30 layers' linears 13.0-13.8 ms with oneDNN, 10.2-11.0
// with the blocks; at 256 and more rows oneDNN's matmul was the faster (benchmarks/README.md).
bool small_pass(const at::Tensor& x, const at::Tensor& small) { return small.numel() > 0 && x.size(0) <= SMALL_ROWS; }

// One call for the product: by the small copy where small_pass says, else oneDNN's (linear_call).
at::Tensor product(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, const at::Tensor& small) {
  if (!small_pass(x, small)) return linear_call(x, w, b);
  static const c10::OperatorHandle h = op("fuseserve_linear::linear");
  torch::jit::Stack st{x, small, optional_bias(b)};
  h.callBoxed(st);
  return st[0].toTensor();
}

// x [T, in] times a packed weight (+ bias) -> [T, out], as prepacked_linear._matmul calls it: at
// padded_rows(T) rows (the surplus rows computed and dropped), in row chunks where row_chunks says (never
// a pass small_pass takes), else as one product.
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, const at::Tensor& small) {
  const int64_t T = x.size(0), padded = padded_rows(T, x.scalar_type());
  if (padded != T) return linear(pad_rows(x, padded), w, b, small).narrow(0, 0, T);
  const int64_t n = row_chunks(x);
  if (n == 1) return product(x, w, b, small);
  at::Tensor out = at::empty({T, w.size(0)}, x.options());
  for_each_row_chunk(T, n, [&](int64_t r0, int64_t rows) {
    out.narrow(0, r0, rows).copy_(linear_call(x.narrow(0, r0, rows), w, b));
  });
  return out;
}

at::Tensor linear_op(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b,
                     const std::optional<at::Tensor>& small) {
  const at::Tensor none = at::empty({0}, x.options());
  return linear(x.contiguous(), w, b.has_value() ? *b : none, small.has_value() ? *small : none);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  static const c10::OperatorHandle h = op("fuseserve_fused::rms_norm");
  at::Tensor out = at::empty_like(x);
  torch::jit::Stack st{out, x, w, eps, false};
  h.callBoxed(st);
  return out;
}

// (norm(x + residual), x + residual)
std::pair<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& w,
                                               double eps) {
  static const c10::OperatorHandle h = op("fuseserve_fused::add_rms_norm");
  at::Tensor out = at::empty_like(x), sum = at::empty_like(x);
  torch::jit::Stack st{out, sum, x, residual, w, eps, false};
  h.callBoxed(st);
  return {out, sum};
}

// The first `tokens` rows of x [T, KVH, D] (rows of heads contiguous) into cache [num_blocks, block_size,
// KVH, D] at the flat slots slot_mapping [tokens] (int64): what index_copy_ along the slots does
// (reference.write_kv), as one memcpy a row: in a profiled 16-decode pass index_copy_ took ~16 us a call
// (60 calls, 2.9% of the pass; benchmarks/README.md). Raises on a slot past the cache.
void write_kv(const at::Tensor& cache, const at::Tensor& x, const at::Tensor& slot_mapping, int64_t tokens) {
  TORCH_CHECK(cache.is_contiguous() && cache.scalar_type() == x.scalar_type() && x.stride(2) == 1 &&
                  x.stride(1) == x.size(2) && slot_mapping.scalar_type() == at::kLong &&
                  slot_mapping.numel() == tokens && cache.size(2) * cache.size(3) == x.size(1) * x.size(2),
              "write_kv: cache and rows of one dtype and head layout, int64 slots, one per token");
  const int64_t row = x.size(1) * x.size(2) * x.element_size(), slots = cache.numel() / (x.size(1) * x.size(2));
  const int64_t* slots_at = slot_mapping.data_ptr<int64_t>();
  const int64_t slot_stride = slot_mapping.numel() > 0 ? slot_mapping.stride(0) : 1;
  char* dst = static_cast<char*>(cache.data_ptr());
  const char* src = static_cast<const char*>(x.data_ptr());
  const int64_t src_stride = x.stride(0) * x.element_size();
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t slot = slots_at[t * slot_stride];
    TORCH_CHECK(slot >= 0 && slot < slots, "write_kv: slot ", slot, " outside the cache's ", slots);
    std::memcpy(dst + slot * row, src + t * src_stride, row);
  }
}

// One layer's attention over the cache, written into attn [T, H, D]: the whole pass through the paged
// operator, or, with a split (cpu_attention.PrefillSplit, as its write_and_attend takes it), the short
// rows through the operator and the long prefill chunks through fuseserve_prefill::prefill_attention
// (cpu_prefill.cpp), one call for all of them.
// split_ints: [0] or [1, rest (0 none, 1 the pass's first tokens, 2 gathered), chunks, then per chunk
// start, end, context_len]; split_tensors: rest's block_tables, cu_seqlens_q, seq_lens, token_idx
// (when rest), then each chunk's blocks.
void attend(const at::Tensor& attn, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens,
            at::IntArrayRef split_ints, at::TensorList split_tensors, int64_t window, double scale) {
  static const c10::OperatorHandle paged = op("fuseserve_cpu::paged_attention");
  auto operator_rows = [&](const at::Tensor& out, const at::Tensor& rows, const at::Tensor& tables,
                           const at::Tensor& cu, const at::Tensor& lens) {
    torch::jit::Stack st{out, rows, k_cache, v_cache, tables, cu, lens, scale, window, 0.0};
    paged.callBoxed(st);
  };
  // the split is for bf16 (as write_and_attend): an fp32 pass runs every row through the operator
  if (split_ints[0] == 0 || q.scalar_type() != at::kBFloat16 || k_cache.scalar_type() != q.scalar_type())
    return operator_rows(attn, q, block_tables, cu_seqlens_q, seq_lens);
  const int64_t rest = split_ints[1], chunks = split_ints[2];
  int64_t t = 0;
  if (rest != 0) {
    const at::Tensor& idx = split_tensors[3];
    const at::Tensor rows = rest == 1 ? q.narrow(0, 0, idx.size(0)) : q.index_select(0, idx);
    at::Tensor part = at::empty(rows.sizes(), rows.options());
    operator_rows(part, rows, split_tensors[0], split_tensors[1], split_tensors[2]);
    if (rest == 1) attn.narrow(0, 0, idx.size(0)).copy_(part);
    else attn.index_copy_(0, idx, part);
    t = 4;
  }
  if (chunks == 0) return;
  static const c10::OperatorHandle prefill = op("fuseserve_prefill::prefill_attention");
  const std::vector<int64_t> ints(split_ints.begin() + 3, split_ints.begin() + 3 + 3 * chunks);
  const std::vector<at::Tensor> blocks(split_tensors.begin() + t, split_tensors.begin() + t + chunks);
  torch::jit::Stack st{attn, q, k_cache, v_cache, ints, blocks, scale, window};
  prefill.callBoxed(st);
}

// x [T, hidden] (the embeddings) -> the last layer's output [T, hidden] (before the final norm).
at::Tensor decoder_layers(const at::Tensor& x_in, const at::Tensor& positions, const at::Tensor& cos,
                          const at::Tensor& sin, at::TensorList weights, at::TensorList k_caches,
                          at::TensorList v_caches, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                          const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens, at::IntArrayRef split_ints,
                          at::TensorList split_tensors, at::IntArrayRef windows,
                          int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale) {
  static const c10::OperatorHandle rotary = op("fuseserve_fused::rotary");
  static const c10::OperatorHandle silu_mul = op("fuseserve_fused::silu_mul");
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == PER_LAYER * layers && v_caches.size() == k_caches.size() &&
                  static_cast<int64_t>(windows.size()) == layers,
              "decoder_layers: ", PER_LAYER, " weights, one K and one V cache and one window per layer");
  TORCH_CHECK(x_in.dim() == 2 && positions.scalar_type() == at::kLong, "x [T, hidden], positions int64 [T]");
  // the whole pass at padded_rows(tokens) rows, so every linear sees a bucketed row count without a copy:
  // the surplus rows start at zero, stay out of the KV write and attention, and are dropped at the end
  const int64_t tokens = x_in.size(0), T = padded_rows(tokens, x_in.scalar_type());
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  at::Tensor x = pad_rows(x_in, T);
  const at::Tensor pos = pad_rows(positions, T);
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = weights.data() + l * PER_LAYER;
    // attention: norm, stacked q/k/v projection, rotary in place, KV write, paged attention, o projection
    const at::Tensor qkv = linear(rms_norm(x, w[0], eps), w[1], w[2], w[3]);
    const at::Tensor q = qkv.narrow(1, 0, q_size).view({T, num_heads, head_dim});
    const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({T, num_kv_heads, head_dim});
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, num_kv_heads, head_dim});
    torch::jit::Stack rot{q, k, pos, cos, sin};
    rotary.callBoxed(rot);
    write_kv(k_caches[l], k, slot_mapping, tokens);
    write_kv(v_caches[l], v, slot_mapping, tokens);
    const at::Tensor attn = at::empty({T, num_heads, head_dim}, q.options());
    if (T > tokens) attn.narrow(0, tokens, T - tokens).zero_();
    attend(attn.narrow(0, 0, tokens), q.narrow(0, 0, tokens), k_caches[l], v_caches[l], block_tables, cu_seqlens_q,
           seq_lens, split_ints, split_tensors, windows[l], scale);
    // o projection; MLP: residual add + norm, gate_up projection, silu(gate) * up, down projection,
    // residual add. Every step is row-wise, so with row chunks each thread runs them all on its rows.
    const at::Tensor attn2 = attn.view({T, q_size});
    auto tail = [&](const at::Tensor& a, const at::Tensor& res) {
      const at::Tensor o = product(a, w[4], w[5], w[6]);  // the pass is padded already
      auto [normed, h] = add_rms_norm(o, res, w[7], eps);
      const at::Tensor gate_up = product(normed, w[8], w[9], w[10]);
      at::Tensor act = at::empty({a.size(0), gate_up.size(1) / 2}, gate_up.options());
      torch::jit::Stack sm{act, gate_up};
      silu_mul.callBoxed(sm);
      return std::make_pair(h, product(act, w[11], w[12], w[13]));
    };
    const int64_t n = row_chunks(x);
    if (n == 1) {
      auto [h, down] = tail(attn2, x);
      x = h + down;
    } else {
      at::Tensor next = at::empty_like(x);
      for_each_row_chunk(T, n, [&](int64_t r0, int64_t rows) {
        auto [h, down] = tail(attn2.narrow(0, r0, rows), x.narrow(0, r0, rows));
        at::Tensor out = next.narrow(0, r0, rows);
        at::add_out(out, h, down);
      });
      x = next;
    }
  }
  return x.narrow(0, 0, tokens);
}

// Binds the calling thread's intra-op (OpenMP) threads one to a CPU: thread i to cpus[i], the calling
// thread (thread 0 of its team) included; returns the CPU each thread runs on afterwards (-1 where the
// binding failed, and everywhere but on Linux). Threads the pool starts later (a larger
// set_num_threads) are not bound.
std::vector<int64_t> bind_threads(at::IntArrayRef cpus) {
  const int64_t n = at::get_num_threads();
  TORCH_CHECK(static_cast<int64_t>(cpus.size()) >= n, "bind_threads: ", n, " threads need as many CPUs, got ",
              cpus.size());
  std::vector<int64_t> got(n, -1);
  auto bind = [&](int64_t i) {
#ifdef __linux__
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(static_cast<int>(cpus[i]), &set);
    if (sched_setaffinity(0, sizeof(set), &set) == 0) got[i] = sched_getcpu();
#endif
  };
  if (n == 1) {
    bind(0);
    return got;
  }
  // one index per thread: at::parallel_for gives a team of n threads one element each
  at::parallel_for(0, n, 1, [&](int64_t, int64_t) { bind(at::get_thread_num()); });
  return got;
}

}  // namespace

TORCH_LIBRARY(fuseserve_stack, m) {
  m.def("bind_threads(int[] cpus) -> int[]");
  m.def("linear(Tensor x, Tensor w, Tensor? b, Tensor? small=None) -> Tensor");
  m.def("padded_rows(int rows, ScalarType dtype) -> int");
  m.def("decoder_layers(Tensor x, Tensor positions, Tensor cos, Tensor sin, Tensor[] weights, Tensor(a!)[] k_caches, "
        "Tensor(b!)[] v_caches, Tensor slot_mapping, Tensor block_tables, Tensor cu_seqlens_q, Tensor seq_lens, "
        "int[] split_ints, Tensor[] split_tensors, int[] windows, int num_heads, int num_kv_heads, int head_dim, "
        "float eps, float scale) -> Tensor");
}

// CatchAll: the packed weights are oneDNN (MkldnnCPU) tensors, the rest plain CPU ones.
TORCH_LIBRARY_IMPL(fuseserve_stack, CatchAll, m) {
  m.impl("decoder_layers", decoder_layers);
  m.impl("linear", linear_op);
}

TORCH_LIBRARY_IMPL(fuseserve_stack, CompositeExplicitAutograd, m) {
  m.impl("padded_rows", padded_rows);
  m.impl("bind_threads", bind_threads);
}
