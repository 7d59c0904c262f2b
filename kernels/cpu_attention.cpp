// Paged ragged attention for CPUs: one call serves a whole SplitFuse pass (prefill chunks and decode
// tokens), reading K/V from the cache blocks where they lie (no gather copy).
//
// Built at first use by fuseserve/kernels/cpu_attention.py (g++ with torch's headers), registered as
// torch.ops.fuseserve_cpu.paged_attention. Semantics are those of kernels/reference.py:
//   query token t of sequence s sits at position p = seq_lens[s] - q_len(s) + i and attends to keys
//   at positions j <= p (and j > p - sliding_window when the window is > 0); scores are
//   scale * q.k, capped as soft_cap * tanh(s / soft_cap) when soft_cap > 0, softmax in fp32.
//
// Work split: one item = (sequence, KV head, tile of up to TILE_Q consecutive query tokens). The
// item's rows are its tokens x the query heads sharing that KV head (GQA), so each key block, read
// once from the cache and widened to fp32, serves all of them. Per key block the item computes
// scores S = Q K^T (vectorised over the block's keys), an online softmax (flash-attention's running
// max and sum) and acc += P V (vectorised over head_dim). Items run in parallel (at::parallel_for).
//
// The caches hold the query's dtype, or float8 e4m3 (an fp8 KV cache, kernels/kv_quant.py): each
// byte is widened to fp32 through a 256-entry table as its block is read; the per-tensor scales are
// folded into the softmax scale (K) and the output (V) by the caller, so the stored values are used
// as they are here.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t TILE_Q = 16;  // query tokens per work item (prefill); rows = TILE_Q * group
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// exp(x) for x <= 0 (arguments here are score - running max), vectorisable: 2^k * p(r) with
// r = x - k ln2 in [-ln2/2, ln2/2] and a degree-6 polynomial (relative error ~2e-7); x < -87 → 0.
inline float exp_neg(float x) {
  const float xc = x < -87.0f ? -87.0f : x;
  const float k = std::floor(xc * 1.4426950408889634f + 0.5f);
  const float r = xc - k * 0.693145751953125f - k * 1.428606765330187e-06f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.0f ? 0.0f : p * scale;
}

// e4m3fn byte -> fp32, all 256 values (NaN patterns included), built once.
const std::array<float, 256>& fp8_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) t[i] = c10::detail::fp8e4m3fn_to_fp32_value(static_cast<uint8_t>(i));
    return t;
  }();
  return table;
}

// One cached K/V element as fp32: a plain conversion, or the table for fp8.
template <typename KT>
inline float widen(KT x, const float* fp8) {
  if constexpr (std::is_same_v<KT, c10::Float8_e4m3fn>) {
    return fp8[x.x];
  } else {
    return static_cast<float>(x);
  }
}

struct Item {
  int64_t seq;
  int64_t first;  // index of the tile's first query token in the pass
  int64_t count;  // tokens in the tile
};

template <typename T, typename KT>
void attend(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens,
            double scale_d, int64_t window, double soft_cap_d) {
  const int64_t num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t num_seqs = seq_lens.size(0), max_blocks = block_tables.size(1);
  const int32_t* cu = cu_seqlens_q.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const T* qp = q.data_ptr<T>();
  const KT* kp = k_cache.data_ptr<KT>();
  const KT* vp = v_cache.data_ptr<KT>();
  const float* fp8 = fp8_table().data();
  T* op = out.data_ptr<T>();
  const int64_t q_stride = q.stride(0), q_head_stride = q.stride(1);
  const int64_t o_stride = out.stride(0), o_head_stride = out.stride(1);
  const int64_t kv_block_stride = k_cache.stride(0), kv_tok_stride = k_cache.stride(1);
  const float scale = static_cast<float>(scale_d), soft_cap = static_cast<float>(soft_cap_d);

  std::vector<Item> items;
  for (int64_t s = 0; s < num_seqs; ++s) {
    for (int64_t t = cu[s]; t < cu[s + 1]; t += TILE_Q) items.push_back({s, t, std::min<int64_t>(TILE_Q, cu[s + 1] - t)});
  }
  const int64_t num_work = static_cast<int64_t>(items.size()) * num_kv_heads;

  at::parallel_for(0, num_work, 1, [&](int64_t begin, int64_t end) {
    const int64_t max_rows = TILE_Q * group;
    std::vector<float> qf(max_rows * head_dim), acc(max_rows * head_dim), scores(max_rows * block_size);
    std::vector<float> kt(head_dim * block_size), vf(block_size * head_dim), m(max_rows), l(max_rows);
    std::vector<int64_t> pos(max_rows);
    for (int64_t w = begin; w < end; ++w) {
      const Item& it = items[w / num_kv_heads];
      const int64_t h = w % num_kv_heads;
      const int64_t ctx = lens[it.seq], q_len = cu[it.seq + 1] - cu[it.seq];
      const int64_t rows = it.count * group;
      for (int64_t i = 0; i < it.count; ++i) {
        const int64_t p = ctx - q_len + (it.first - cu[it.seq]) + i;
        for (int64_t g = 0; g < group; ++g) {
          const int64_t r = i * group + g;
          pos[r] = p;
          const T* src = qp + (it.first + i) * q_stride + (h * group + g) * q_head_stride;
          float* dst = qf.data() + r * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<float>(src[d]) * scale;
        }
      }
      std::fill(acc.begin(), acc.begin() + rows * head_dim, 0.0f);
      std::fill(m.begin(), m.begin() + rows, NEG_INF);
      std::fill(l.begin(), l.begin() + rows, 0.0f);
      const int64_t hi = pos[rows - 1];  // last key any row may see
      const int64_t lo = window > 0 ? std::max<int64_t>(0, pos[0] - window + 1) : 0;
      const int32_t* table = tables + it.seq * max_blocks;
      for (int64_t b = lo / block_size; b * block_size <= hi; ++b) {
        const int64_t j0 = b * block_size;
        const int64_t n = std::min<int64_t>(block_size, hi + 1 - j0);
        const KT* kb = kp + table[b] * kv_block_stride + h * head_dim;
        const KT* vb = vp + table[b] * kv_block_stride + h * head_dim;
        for (int64_t j = 0; j < n; ++j) {  // K transposed [D, n] and V [n, D], widened to fp32
          for (int64_t d = 0; d < head_dim; ++d) kt[d * block_size + j] = widen(kb[j * kv_tok_stride + d], fp8);
          if constexpr (!std::is_same_v<KT, float>) {
            for (int64_t d = 0; d < head_dim; ++d) vf[j * head_dim + d] = widen(vb[j * kv_tok_stride + d], fp8);
          }
        }
        for (int64_t r = 0; r < rows; ++r) {
          float* sr = scores.data() + r * block_size;
          const float* qr = qf.data() + r * head_dim;
          for (int64_t j = 0; j < n; ++j) sr[j] = 0.0f;
          for (int64_t d = 0; d < head_dim; ++d) {
            const float qd = qr[d];
            const float* kd = kt.data() + d * block_size;
#pragma omp simd
            for (int64_t j = 0; j < n; ++j) sr[j] += qd * kd[j];
          }
          if (soft_cap > 0.0f) {
            for (int64_t j = 0; j < n; ++j) sr[j] = soft_cap * std::tanh(sr[j] / soft_cap);
          }
          const int64_t p = pos[r];
          float block_max = NEG_INF;
          for (int64_t j = 0; j < n; ++j) {
            const int64_t key = j0 + j;
            const bool visible = key <= p && (window <= 0 || key > p - window);
            sr[j] = visible ? sr[j] : NEG_INF;
            block_max = std::max(block_max, sr[j]);
          }
          if (block_max == NEG_INF) continue;  // nothing visible to this row in this block
          const float m_new = std::max(m[r], block_max);
          const float alpha = exp_neg(m[r] - m_new);  // m[r] = -inf → 0
          float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
          for (int64_t j = 0; j < n; ++j) {
            sr[j] = exp_neg(sr[j] - m_new);
            sum += sr[j];
          }
          l[r] = l[r] * alpha + sum;
          m[r] = m_new;
          float* ar = acc.data() + r * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) ar[d] *= alpha;
          for (int64_t j = 0; j < n; ++j) {
            const float pj = sr[j];
            const float* vj;  // fp32 V is read in place; other dtypes from the widened copy
            if constexpr (std::is_same_v<KT, float>) {
              vj = vb + j * kv_tok_stride;
            } else {
              vj = vf.data() + j * head_dim;
            }
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) ar[d] += pj * vj[d];
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = r / group, g = r % group;
        T* dst = op + (it.first + i) * o_stride + (h * group + g) * o_head_stride;
        const float inv = 1.0f / l[r];
        const float* ar = acc.data() + r * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<T>(ar[d] * inv);
      }
    }
  });
}

// out [T, H, D] (written), q [T, H, D], caches [num_blocks, block_size, KVH, D] (contiguous; q's dtype or fp8),
// block_tables [S, max_blocks] int32, cu_seqlens_q [S+1] int32, seq_lens [S] int32.
// sliding_window <= 0 and soft_cap <= 0 mean none.
void paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens,
                     double scale, int64_t sliding_window, double soft_cap) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q and out must be [T, H, D]");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "q and out need a contiguous last dimension");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes(), "caches must be contiguous [blocks, block_size, KVH, D]");
  TORCH_CHECK(k_cache.size(3) == q.size(2) && q.size(1) % k_cache.size(2) == 0, "head_dim / GQA mismatch");
  const bool fp8_cache = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK((fp8_cache || q.scalar_type() == k_cache.scalar_type()) && out.scalar_type() == q.scalar_type() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "q and out must share one dtype, the caches that dtype or float8_e4m3fn");
  for (const at::Tensor* t : {&block_tables, &cu_seqlens_q, &seq_lens}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(), "index tensors must be contiguous int32");
  }
  TORCH_CHECK(cu_seqlens_q.size(0) == seq_lens.size(0) + 1 && block_tables.size(0) == seq_lens.size(0),
              "cu_seqlens_q [S+1], seq_lens [S], block_tables [S, max_blocks] disagree");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "fuseserve_cpu_paged_attention", [&] {
    if (fp8_cache) {
      attend<scalar_t, c10::Float8_e4m3fn>(out, q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                                           sliding_window, soft_cap);
    } else {
      attend<scalar_t, scalar_t>(out, q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                                 sliding_window, soft_cap);
    }
  });
}

}  // namespace

TORCH_LIBRARY(fuseserve_cpu, m) {
  m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor cu_seqlens_q, Tensor seq_lens, float scale, int sliding_window, float soft_cap) -> ()");
}

TORCH_LIBRARY_IMPL(fuseserve_cpu, CPU, m) { m.impl("paged_attention", paged_attention); }
