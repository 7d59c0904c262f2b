// Prefill-chunk attention for bf16 on CPUs with AMX: every long prompt chunk of a SplitFuse pass in one
// call, its matmuls as oneDNN batch-reduce GEMMs on AMX tiles (ATen's cpublas::brgemm, bf16 x bf16 ->
// fp32), read from the paged cache. Registered as torch.ops.fuseserve_prefill.prefill_attention, built
// at first use by fuseserve/kernels/cpu_attention.py (cpu_build); it replaced one PyTorch flash SDPA call
// per chunk and layer over K/V gathered out of the cache (benchmarks/README.md has the measurements).
//
// Semantics are kernels/reference.py's prefill_attention: chunk c holds the pass's query rows
// start..end, attending to context_len keys held in its blocks; query row i sits at position
// p = context_len - (end - start) + i and sees keys j <= p (and j > p - window when window > 0);
// scores scale * q.k, softmax in fp32, P V with P as the sum of two bf16 terms (its high and low halves:
// PyTorch's CPU flash attention keeps one, a bf16 P), fp32 accumulation, the output scaled by the row's
// reciprocal sum and rounded to bf16 once. Against fp32 attention its error matched the fp32 operator's
// (cpu_attention.cpp) within 0.1% over a SmolLM2 bf16 run; with one bf16 P it was SDPA's.
//
// Two parallel loops, items taken from a shared counter:
//  1. pack: each (chunk, KV head, block of KEYS keys) copies its keys out of the cache, K transposed to
//     [D, KEYS], V as [KEYS, D], zero past the context, and packs both into the VNNI layout brgemm reads
//     (cpublas::pack). Every query tile of the chunk reuses them.
//  2. attend: each (chunk, KV head, tile of up to MQ query rows) stacks the tile's rows of the G query
//     heads sharing that KV head (GQA) into one [G x MQ, D] matrix A, so one GEMM serves the whole
//     group: S = A K^T over the key blocks the tile sees (one brgemm per block), a two-pass softmax per
//     row over its visible keys (no running rescale: the whole row's scores are held), then
//     O = P_hi V + P_lo V as brgemms per key block (and 64 columns of V), accumulated.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "cpu_vec.h"

namespace {

using fuseserve_cpu_vec::exp_neg_v;
using fuseserve_cpu_vec::hmax;
using fuseserve_cpu_vec::hsum;
using fuseserve_cpu_vec::lane_ids;
using fuseserve_cpu_vec::load16;
using fuseserve_cpu_vec::load_part;
using fuseserve_cpu_vec::round_to;
using fuseserve_cpu_vec::splat;
using fuseserve_cpu_vec::store16;
using fuseserve_cpu_vec::store_part;
using fuseserve_cpu_vec::v16;
using fuseserve_cpu_vec::v16i;
using bf16 = c10::BFloat16;

constexpr int64_t KEYS = 64;  // keys per packed block: the N of S = A K^T and the K of P V
constexpr int64_t COLS = 64;  // head_dim columns per packed block of V: the N of P V

// head_dim as the packed operands hold it: zero columns up to a multiple of 32 (oneDNN packs no other).
int64_t padded_dim(int64_t d) { return (d + 31) / 32 * 32; }

// Query rows per tile: the stacked matrix has G x MQ rows; about 128 of them, 16 to 64 tokens.
int64_t tile_rows(int64_t group) { return std::clamp<int64_t>(128 / group / 16 * 16, 16, 64); }

struct Chunk {
  int64_t start, end, context, key_blocks;
  const int64_t* blocks;  // the cache block of each block_size keys, in key order
  bf16* packed;           // per KV head: key_blocks x (K^T block, V block), KEYS x padded_dim(D) each
};

// (start, end, context) triples and each chunk's block ids (int64 copies kept alive by the caller),
// checked against the pass's rows and the cache's blocks before anything is read.
std::vector<Chunk> chunks_of(at::IntArrayRef ints, const std::vector<at::Tensor>& blocks, int64_t rows,
                             int64_t num_blocks, int64_t block_size) {
  std::vector<Chunk> out;
  for (size_t c = 0; c < blocks.size(); ++c) {
    const int64_t* b = ints.data() + 3 * c;
    const int64_t* ids = blocks[c].data_ptr<int64_t>();
    const int64_t needed = (b[2] + block_size - 1) / block_size;
    TORCH_CHECK(0 <= b[0] && b[0] < b[1] && b[1] <= rows && b[1] - b[0] <= b[2] && blocks[c].numel() >= needed,
                "prefill_attention: chunk ", c, " (rows ", b[0], "-", b[1], ", context ", b[2], ", ",
                blocks[c].numel(), " blocks) does not fit a pass of ", rows, " rows");
    for (int64_t i = 0; i < needed; ++i)
      TORCH_CHECK(0 <= ids[i] && ids[i] < num_blocks, "prefill_attention: block id ", ids[i], " out of range");
    out.push_back({b[0], b[1], b[2], (b[2] + KEYS - 1) / KEYS, ids, nullptr});
  }
  return out;
}

// Pack keys [kb * KEYS, +KEYS) of KV head h of chunk c: K^T [D, KEYS] and V [KEYS, D], VNNI.
void pack_block(const Chunk& c, int64_t h, int64_t kb, const at::Tensor& k_cache, const at::Tensor& v_cache,
                bf16* kt_out, bf16* v_out, std::vector<bf16>& kt, std::vector<bf16>& vr, bool vnni) {
  const int64_t bs = k_cache.size(1), D = k_cache.size(3), DP = padded_dim(D);
  const int64_t s0 = k_cache.stride(0), s1 = k_cache.stride(1), s2 = k_cache.stride(2);
  const bf16* kc = k_cache.data_ptr<bf16>();
  const bf16* vc = v_cache.data_ptr<bf16>();
  const int64_t n = std::min(KEYS, c.context - kb * KEYS);
  kt.resize(DP * KEYS);
  vr.resize(KEYS * DP);
  if (n < KEYS || DP != D) {  // keys past the context, columns past D: zero (no NaN from stale memory)
    std::fill(kt.begin(), kt.end(), bf16(0.0f));
    std::fill(vr.begin(), vr.end(), bf16(0.0f));
  }
  for (int64_t j = 0; j < n; ++j) {
    const int64_t key = kb * KEYS + j;
    const int64_t off = c.blocks[key / bs] * s0 + (key % bs) * s1 + h * s2;
    for (int64_t d = 0; d < D; ++d) kt[d * KEYS + j] = kc[off + d];
    std::memcpy(vr.data() + j * DP, vc + off, D * sizeof(bf16));
  }
  // V by column blocks of up to COLS (oneDNN packs at most 64 columns at a time): block c0 at KEYS x c0
  for (int64_t c0 = 0; c0 < DP; c0 += COLS) {
    const int64_t nb = std::min(COLS, DP - c0);
    if (vnni) {
      at::native::cpublas::pack(KEYS, nb, DP, nb, at::kBFloat16, at::kBFloat16, vr.data() + c0, v_out + KEYS * c0);
    } else {  // no oneDNN brgemm for bf16 here: plain row-major operands (cpublas's fallback GEMM)
      for (int64_t j = 0; j < KEYS; ++j)
        std::memcpy(v_out + KEYS * c0 + j * nb, vr.data() + j * DP + c0, nb * sizeof(bf16));
    }
  }
  if (vnni) at::native::cpublas::pack(DP, KEYS, KEYS, KEYS, at::kBFloat16, at::kBFloat16, kt.data(), kt_out);
  else std::memcpy(kt_out, kt.data(), DP * KEYS * sizeof(bf16));
}

// x (16 lanes) as hi = bf16(x) and lo = bf16(x - hi), rounded to nearest even: hi + lo holds ~16 bits.
inline void store_split(bf16* hi, bf16* lo, v16 x) {
#if defined(__AVX512BF16__)
  const __m512 v = reinterpret_cast<__m512>(x);
  const __m256bh h = _mm512_cvtneps_pbh(v);
  const __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(h)), 16));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi), reinterpret_cast<__m256i>(h));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v - back)));
#else
  const v16 h = round_to<bf16>(x);
  store16(hi, h);
  store16(lo, x - h);
#endif
}

struct Scratch {
  std::vector<bf16> a, p, kt, vr;  // p: P's high bf16 halves, then its low halves (M x width each)
  std::vector<float> s, o;
};

// One tile: rows i0..i0+mq of chunk c, KV head h (query heads h*G .. h*G+G-1).
void attend_tile(const Chunk& c, int64_t h, int64_t i0, int64_t mq, const at::Tensor& q, const at::Tensor& out,
                 int64_t group, double scale_d, int64_t window, bool vnni, Scratch& w) {
  const int64_t D = q.size(2), DP = padded_dim(D), M = group * mq, q_len = c.end - c.start;
  const int64_t first_pos = c.context - q_len + i0, last_pos = first_pos + mq - 1;
  const int64_t lo = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
  const int64_t kb0 = lo / KEYS, kb1 = last_pos / KEYS + 1, width = (kb1 - kb0) * KEYS;
  const float scale = static_cast<float>(scale_d);
  w.a.resize(M * DP);
  if (DP != D) std::fill(w.a.begin(), w.a.end(), bf16(0.0f));
  w.s.resize(M * width);
  w.p.resize(2 * M * width);
  bf16* const p_lo = w.p.data() + M * width;
  w.o.resize(M * DP);
  const bf16* qp = q.data_ptr<bf16>();
  for (int64_t g = 0; g < group; ++g)
    for (int64_t i = 0; i < mq; ++i)
      std::memcpy(w.a.data() + (g * mq + i) * DP, qp + (c.start + i0 + i) * q.stride(0) + (h * group + g) * q.stride(1),
                  D * sizeof(bf16));
  const bf16* packed = c.packed + h * c.key_blocks * 2 * KEYS * DP;
  for (int64_t kb = kb0; kb < kb1; ++kb)
    at::native::cpublas::brgemm(M, KEYS, DP, DP, KEYS, width, false, w.a.data(), packed + kb * 2 * KEYS * DP,
                                w.s.data() + (kb - kb0) * KEYS, vnni);
  const v16i lanes = lane_ids();
  for (int64_t r = 0; r < M; ++r) {
    const int64_t p = first_pos + r % mq;
    const int64_t first = (window > 0 ? std::max<int64_t>(0, p - window + 1) : 0) - kb0 * KEYS, last = p - kb0 * KEYS;
    float* s = w.s.data() + r * width;
    bf16* pr = w.p.data() + r * width;
    bf16* pl = p_lo + r * width;
    auto visible = [&](int64_t j) {
      const v16i key = lanes + static_cast<int32_t>(j);
      return (key >= static_cast<int32_t>(first)) & (key <= static_cast<int32_t>(last));
    };
    // only the 16-key vectors that hold a visible key are read; P is zero elsewhere
    const int64_t j0 = std::max<int64_t>(0, first) / 16 * 16, j1 = (last + 16) / 16 * 16;
    for (bf16* row : {pr, pl}) {
      std::memset(row, 0, j0 * sizeof(bf16));
      std::memset(row + j1, 0, (width - j1) * sizeof(bf16));
    }
    v16 mx = splat(-INFINITY);
    for (int64_t j = j0; j < j1; j += 16) {
      const v16 x = load16(s + j) * scale;
      mx = visible(j) ? (x > mx ? x : mx) : mx;
    }
    const float m = hmax(mx);
    v16 sum = splat(0.0f);
    for (int64_t j = j0; j < j1; j += 16) {
      const v16 e = visible(j) ? exp_neg_v(load16(s + j) * scale - m) : splat(0.0f);
      sum += e;
      store_split(pr + j, pl + j, e);
    }
    w.s[r * width] = 1.0f / hsum(sum);  // the row's reciprocal sum, kept in its first score
  }
  // O = P V with P as two bf16 terms (high + low halves: ~16 bits of P, where one bf16 P kept 8; the
  // logits of a bf16 SmolLM2 drifted from fp32 by up to 2.4 with one, 1.0 with two or fp32's operator)
  for (const bf16* pp : {static_cast<const bf16*>(w.p.data()), static_cast<const bf16*>(p_lo)})
    for (int64_t kb = kb0; kb < kb1; ++kb)
      for (int64_t c0 = 0; c0 < DP; c0 += COLS)
        at::native::cpublas::brgemm(M, std::min(COLS, DP - c0), KEYS, width, std::min(COLS, DP - c0), DP,
                                    pp != w.p.data() || kb != kb0, pp + (kb - kb0) * KEYS,
                                    packed + (kb * 2 + 1) * KEYS * DP + KEYS * c0, w.o.data() + c0, vnni);
  bf16* op = out.data_ptr<bf16>();
  for (int64_t g = 0; g < group; ++g)
    for (int64_t i = 0; i < mq; ++i) {
      const int64_t r = g * mq + i;
      const float inv = w.s[r * width];
      bf16* dst = op + (c.start + i0 + i) * out.stride(0) + (h * group + g) * out.stride(1);
      int64_t d = 0;
      for (; d + 16 <= D; d += 16) store16(dst + d, load16(w.o.data() + r * DP + d) * inv);
      if (d < D) store_part(dst + d, load_part(w.o.data() + r * DP + d, D - d) * inv, D - d);
    }
}

// out [T, H, D] (rows of the chunks written), q [T, H, D] bf16 (head_dim contiguous); caches
// [num_blocks, block_size, KVH, D] bf16; chunk_ints (start, end, context_len) per chunk, blocks[c] its
// block ids (int32 or int64, in key order).
void prefill_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                       const at::Tensor& v_cache, at::IntArrayRef chunk_ints, at::TensorList blocks, double scale,
                       int64_t window) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
                  v_cache.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16,
              "prefill_attention: bf16 queries and caches");
  const int64_t H = q.size(1), D = q.size(2), KVH = k_cache.size(2);
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && q.stride(2) == 1 && out.stride(2) == 1 &&
                  out.sizes() == q.sizes() && H % KVH == 0 && k_cache.size(3) == D &&
                  v_cache.sizes() == k_cache.sizes() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  chunk_ints.size() == 3 * blocks.size(),
              "prefill_attention: q/out [T, H, D] (D contiguous), contiguous caches, 3 ints per chunk");
  const bool vnni = at::native::cpublas::could_pack(at::kBFloat16);  // oneDNN's brgemm (AMX) takes bf16 here
  std::vector<at::Tensor> ids;
  for (const at::Tensor& b : blocks) ids.push_back(b.to(at::kLong).contiguous());
  std::vector<Chunk> chunks = chunks_of(chunk_ints, ids, q.size(0), k_cache.size(0), k_cache.size(1));
  int64_t total = 0;
  const int64_t DP = padded_dim(D);
  for (const Chunk& c : chunks) total += KVH * c.key_blocks * 2 * KEYS * DP;
  std::vector<bf16> packed(total);
  total = 0;
  std::vector<std::array<int64_t, 3>> packs, tiles;  // (chunk, head, key block) / (chunk, head, first row)
  const int64_t group = H / KVH, mq = tile_rows(group);
  for (size_t ci = 0; ci < chunks.size(); ++ci) {
    Chunk& c = chunks[ci];
    c.packed = packed.data() + total;
    total += KVH * c.key_blocks * 2 * KEYS * DP;
    for (int64_t h = 0; h < KVH; ++h) {
      for (int64_t kb = 0; kb < c.key_blocks; ++kb) packs.push_back({static_cast<int64_t>(ci), h, kb});
      for (int64_t i0 = c.end - c.start - mq; i0 > -mq; i0 -= mq)  // the first tile may start before row 0
        tiles.push_back({static_cast<int64_t>(ci), h, i0});
    }
  }
  auto position = [&](const std::array<int64_t, 3>& t) {  // of a tile's first row: what its keys cost
    const Chunk& c = chunks[t[0]];
    return c.context - (c.end - c.start) + t[2];
  };
  std::sort(tiles.begin(), tiles.end(), [&](const auto& a, const auto& b) { return position(a) > position(b); });
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(tiles.size()));
  std::atomic<int64_t> next_pack{0}, next_tile{0};
  auto pack = [&](Scratch& w) {
    for (int64_t i; (i = next_pack.fetch_add(1)) < static_cast<int64_t>(packs.size());) {
      const Chunk& c = chunks[packs[i][0]];
      bf16* dst = c.packed + (packs[i][1] * c.key_blocks + packs[i][2]) * 2 * KEYS * DP;
      pack_block(c, packs[i][1], packs[i][2], k_cache, v_cache, dst, dst + KEYS * DP, w.kt, w.vr, vnni);
    }
  };
  auto attend = [&](Scratch& w) {
    for (int64_t i; (i = next_tile.fetch_add(1)) < static_cast<int64_t>(tiles.size());) {
      const Chunk& c = chunks[tiles[i][0]];
      const int64_t i0 = std::max<int64_t>(0, tiles[i][2]), rows = tiles[i][2] + mq - i0;
      attend_tile(c, tiles[i][1], i0, rows, q, out, group, scale, window, vnni, w);
    }
    at::native::cpublas::brgemm_release(vnni);
  };
  auto on_threads = [&](const auto& phase) {  // phase once on each thread, with scratch buffers of its own
    at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
      Scratch w;
      for (int64_t t = t0; t < t1; ++t) phase(w);
    });
  };
  on_threads(pack);  // every block packed before any tile reads one
  on_threads(attend);
}

}  // namespace

TORCH_LIBRARY(fuseserve_prefill, m) {
  m.def("prefill_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, int[] chunk_ints, "
        "Tensor[] blocks, float scale, int window) -> ()");
}

TORCH_LIBRARY_IMPL(fuseserve_prefill, CPU, m) { m.impl("prefill_attention", prefill_attention); }
