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
// once from the cache and widened to fp32, serves all of them. Keys go in chunks of 16, held as one
// 16-lane vector of scores per query row (GCC vector extensions: one AVX-512 register or two AVX2
// ones), head_dim zero-padded to a multiple of 16. Work items run in parallel, the costliest first,
// each thread taking the next from a shared counter.
//  - A prefill tile (many rows): per chunk, scores S = Q K^T with K transposed once and 4 rows x 16
//    keys accumulated in registers, an online softmax (flash-attention's running max and sum) and
//    acc += P V.
//  - Few rows (decode tokens x the GQA group), fp32 / bf16 caches with head_dim a multiple of 16:
//    two passes over the keys, no running rescale. First every visible key's score into a per-row
//    buffer: each key's 16-lane partial products, and 16 keys' partials folded into one vector of 16
//    scores by a butterfly of two-source shuffles (15 shuffle-pairs and adds per 16 keys instead of a
//    horizontal sum per key); then one max, exp and sum per row; then acc += P V. With at least 4
//    such items per thread, the item of KV head 0 does every head of its tokens, reading whole cache
//    rows in order (one head's elements at the token stride read at a third of the bandwidth), and
//    K / V blocks are prefetched two blocks ahead (in a decode pass the cache comes from memory: a
//    SmolLM2 bf16 pass of 16 decodes at context ~230, 25.2-25.7 -> 24.4-24.8 ms; benchmarks/README.md).
//    bf16 queries and caches on a CPU with AVX512_BF16 (head_dim 32 to 128 in steps of 32) take
//    attend_few_rows_dp instead: the same passes with Q.K and P.V as bf16 dot products (vdpbf16ps),
//    no widening of K and V, P rounded to bf16 for P.V as PyTorch's CPU flash attention does (that
//    pass 23.5-24.2 -> 22.4-23.0 ms, 64 decodes 54.2-54.5 -> 49.6-51.7 ms).
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
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "cpu_vec.h"

namespace {

using namespace fuseserve_cpu_vec;

constexpr int64_t TILE_Q = 16;  // query tokens per work item (prefill); rows = TILE_Q * group
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

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

constexpr int64_t KC = 16;           // keys per chunk: one v16 of scores per query row
constexpr int64_t PREFETCH_BLOCKS = 2;  // the few-rows path prefetches K / V this many blocks ahead
constexpr int64_t TRANSPOSE_ROWS = 8;  // from this many rows on, scores use K transposed (see below)

// Prefetch the cache line at p into L1 (TO_L1) or L2. x86: an asm statement, as GCC 12 dropped
// __builtin_prefetch from the loops below (their only effect, to it).
template <bool TO_L1>
inline void prefetch_line(const char* p) {
#if defined(__x86_64__)
  if constexpr (TO_L1) {
    asm volatile("prefetcht0 %0" : : "m"(*p));
  } else {
    asm volatile("prefetcht1 %0" : : "m"(*p));
  }
#else
  __builtin_prefetch(p, 0, TO_L1 ? 3 : 2);
#endif
}

// Block b of a sequence's table: its K rows of `bytes` per token (the heads read) to L1, its V rows to L2
// (read in a later pass). No-op past the last block the reads reach.
inline void prefetch_block(const char* k_cache, const char* v_cache, const int32_t* table, int64_t b, int64_t last,
                           int64_t block_bytes, int64_t block_size, int64_t tok_bytes, int64_t bytes) {
  if (b > last) return;
  const char* k = k_cache + table[b] * block_bytes;
  const char* v = v_cache + table[b] * block_bytes;
  for (int64_t r = 0; r < block_size; ++r) {
    for (int64_t o = 0; o < bytes; o += 64) {
      prefetch_line<true>(k + r * tok_bytes + o);
      prefetch_line<false>(v + r * tok_bytes + o);
    }
  }
}

// Caches whose rows load 16 elements at a time as fp32 (the few-rows path); fp16 and fp8 go element by element.
template <typename KT>
constexpr bool kVectorLoad = std::is_same_v<KT, float> || std::is_same_v<KT, c10::BFloat16>;

// One butterfly stage over two vectors of partial sums: lanes with bit W clear get x[i] + x[i ^ W],
// lanes with bit W set get y[i] + y[i ^ W] (indices 16.. of __builtin_shufflevector name y's lanes).
constexpr int fold_first(int w, int i) { return (i & w) ? 16 + (i ^ w) : i; }  // x[i] or y[i ^ W]
constexpr int fold_second(int w, int i) { return (i & w) ? 16 + i : (i ^ w); }  // x[i ^ W] or y[i]
#define FOLD_LANES(f, w) f(w, 0), f(w, 1), f(w, 2), f(w, 3), f(w, 4), f(w, 5), f(w, 6), f(w, 7), f(w, 8), \
    f(w, 9), f(w, 10), f(w, 11), f(w, 12), f(w, 13), f(w, 14), f(w, 15)
template <int W>
inline v16 fold(v16 x, v16 y) {
  return __builtin_shufflevector(x, y, FOLD_LANES(fold_first, W)) +
         __builtin_shufflevector(x, y, FOLD_LANES(fold_second, W));
}
#undef FOLD_LANES

// t[j]: key j's 16 partial products; returns the 16 keys' sums, lane j = key j.
inline v16 fold16(v16* t) {
  for (int k = 0; k < 8; ++k) t[k] = fold<8>(t[k], t[k + 8]);
  for (int k = 0; k < 4; ++k) t[k] = fold<4>(t[k], t[k + 4]);
  for (int k = 0; k < 2; ++k) t[k] = fold<2>(t[k], t[k + 2]);
  return fold<1>(t[0], t[1]);
}

// Walk keys [first_block * block_size, hi] block by block in chunks of up to KC keys that stay inside
// one block: f(b, c0, j0, n) for block b, offset c0 in it, first key j0 and n keys.
template <typename F>
inline void for_each_chunk(int64_t first_block, int64_t hi, int64_t block_size, F&& f) {
  for (int64_t b = first_block; b * block_size <= hi; ++b) {
    const int64_t n_block = std::min<int64_t>(block_size, hi + 1 - b * block_size);
    for (int64_t c0 = 0; c0 < n_block; c0 += KC) f(b, c0, b * block_size + c0, std::min<int64_t>(KC, n_block - c0));
  }
}

// One row's scores of the chunk of keys j0 + lane: soft-capped when soft_cap > 0, -inf where the key is
// past the chunk's n, after the row's position p, or outside its sliding window.
inline v16 capped_visible(v16 sr, float soft_cap, int64_t j0, int64_t n, int64_t p, int64_t window) {
  if (soft_cap > 0.0f) {
    for (int j = 0; j < KC; ++j) sr[j] = soft_cap * std::tanh(sr[j] / soft_cap);
  }
  const v16i lane = lane_ids(), keys = lane + static_cast<int32_t>(j0);
  v16i visible = (lane < static_cast<int32_t>(n)) & (keys <= static_cast<int32_t>(p));
  if (window > 0) visible &= keys > static_cast<int32_t>(p - window);
  return visible ? sr : splat(NEG_INF);
}

struct Item {
  int64_t seq;
  int64_t first;  // index of the tile's first query token in the pass
  int64_t count;  // tokens in the tile
};

// Scores of every row against one chunk of keys: s[r] = Q[r] . K[j] for j < KC (lanes past the chunk
// hold 0). q: rows x nv vectors (head_dim zero-padded to nv * 16), kw: KC x nv, kt: nv * 16 x KC.
// Few rows (decode: one token x the GQA group) take one dot product per (row, key); many rows
// (a prefill tile) transpose K once and accumulate 4 rows x 16 keys per step in registers.
inline void chunk_scores(const v16* q, int64_t rows, int64_t nv, const v16* kw, v16* kt, v16* s) {
  if (rows < TRANSPOSE_ROWS) {
    for (int64_t r = 0; r < rows; ++r) {
      const v16* qr = q + r * nv;
      v16 sr = splat(0.0f);
      for (int64_t j = 0; j < KC; ++j) {
        const v16* kj = kw + j * nv;
        v16 t = qr[0] * kj[0];
        for (int64_t v = 1; v < nv; ++v) t += qr[v] * kj[v];
        sr[j] = hsum(t);
      }
      s[r] = sr;
    }
    return;
  }
  const float* kf = reinterpret_cast<const float*>(kw);
  float* ktf = reinterpret_cast<float*>(kt);
  const int64_t dp = nv * 16;
  for (int64_t j = 0; j < KC; ++j) {
    for (int64_t d = 0; d < dp; ++d) ktf[d * KC + j] = kf[j * dp + d];
  }
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) {
    const float* q0 = reinterpret_cast<const float*>(q + r * nv);
    const float *q1 = q0 + dp, *q2 = q1 + dp, *q3 = q2 + dp;
    v16 s0 = splat(0.0f), s1 = s0, s2 = s0, s3 = s0;
    for (int64_t d = 0; d < dp; ++d) {
      const v16 kd = kt[d];
      s0 += kd * q0[d];
      s1 += kd * q1[d];
      s2 += kd * q2[d];
      s3 += kd * q3[d];
    }
    s[r] = s0;
    s[r + 1] = s1;
    s[r + 2] = s2;
    s[r + 3] = s3;
  }
  for (; r < rows; ++r) {
    const float* qr = reinterpret_cast<const float*>(q + r * nv);
    v16 sr = splat(0.0f);
    for (int64_t d = 0; d < dp; ++d) sr += kt[d] * qr[d];
    s[r] = sr;
  }
}

// acc = acc * alpha + sum_j p[j] * V[j] over the chunk's n keys (V: KC x nv vectors). head_dim 64
// and 128 keep the row's accumulator in registers; other sizes go through memory.
template <int64_t NV>
inline void accumulate_pv_fixed(v16* acc, float alpha, v16 p, const v16* vw, int64_t n) {
  v16 a[NV];
  for (int64_t v = 0; v < NV; ++v) a[v] = acc[v] * alpha;
  for (int64_t j = 0; j < n; ++j) {
    const float pj = p[j];
    const v16* vj = vw + j * NV;
    for (int64_t v = 0; v < NV; ++v) a[v] += vj[v] * pj;
  }
  for (int64_t v = 0; v < NV; ++v) acc[v] = a[v];
}

inline void accumulate_pv(v16* acc, int64_t nv, float alpha, v16 p, const v16* vw, int64_t n) {
  if (nv == 4) return accumulate_pv_fixed<4>(acc, alpha, p, vw, n);
  if (nv == 8) return accumulate_pv_fixed<8>(acc, alpha, p, vw, n);
  for (int64_t v = 0; v < nv; ++v) acc[v] *= alpha;
  for (int64_t j = 0; j < n; ++j) {
    const float pj = p[j];
    const v16* vj = vw + j * nv;
    for (int64_t v = 0; v < nv; ++v) acc[v] += vj[v] * pj;
  }
}

// One chunk of up to KC keys (cache rows src[j * stride], head_dim d) widened to fp32 into dst
// (KC x nv vectors); rows past n and lanes past d are zero.
template <typename KT>
inline void widen_chunk(const KT* src, int64_t stride, int64_t n, int64_t d, int64_t nv, const float* fp8, v16* dst) {
  if constexpr (kVectorLoad<KT>) {
    if (d % 16 == 0) {  // nv == d / 16: no padding lanes
      for (int64_t j = 0; j < KC; ++j) {
        for (int64_t v = 0; v < nv; ++v) dst[j * nv + v] = j < n ? load16(src + j * stride + v * 16) : splat(0.0f);
      }
      return;
    }
  }
  float* out = reinterpret_cast<float*>(dst);
  const int64_t dp = nv * 16;
  for (int64_t j = 0; j < KC; ++j) {
    float* row = out + j * dp;
    if (j < n) {
      const KT* in = src + j * stride;
      for (int64_t e = 0; e < d; ++e) row[e] = widen(in[e], fp8);
      for (int64_t e = d; e < dp; ++e) row[e] = 0.0f;
    } else {
      for (int64_t e = 0; e < dp; ++e) row[e] = 0.0f;
    }
  }
}

// A score row of len keys: -inf from len up to padded (a multiple of 16), then the row's max.
inline float padded_row_max(float* row, int64_t len, int64_t padded) {
  for (int64_t j = len; j < padded; ++j) row[j] = NEG_INF;
  v16 mx = splat(NEG_INF);
  for (int64_t i = 0; i < (len + 15) / 16; ++i) {
    v16 x;
    std::memcpy(&x, row + i * 16, sizeof(x));
    mx = x > mx ? x : mx;
  }
  return hmax(mx);
}

// Keys [lo, hi] of `heads` consecutive KV heads for few rows each (decode): fills acc (heads x rows x nv,
// unnormalised) and l (heads x rows: the softmax sums). q: heads x rows x nv, pre-scaled; kb / vb: the
// first head's first element in cache row 0 of block 0. Reading every head of a cache row together
// keeps the reads sequential (one head's d elements at the token stride ran at a third of the memory
// bandwidth). sbuf: scratch, resized here. Every row sees at least its own key (pos[r] in [lo, hi]).
template <typename KT>
void attend_few_rows(const v16* q, int64_t rows, int64_t heads, int64_t nv, const int64_t* pos, int64_t lo,
                     int64_t hi, int64_t window, float soft_cap, const int32_t* table, int64_t block_size,
                     const KT* kb, const KT* vb, int64_t block_stride, int64_t tok_stride, int64_t head_dim,
                     std::vector<float>& sbuf, v16* kw, v16* acc, float* l) {
  const int64_t base = lo / block_size * block_size;  // key of sbuf column 0
  const int64_t len = hi + 1 - base, width = (len + 15) / 16 * 16 + KC, all = heads * rows;
  sbuf.resize(all * width);
  float* sb = sbuf.data();
  v16 t[KC];
  // one chunk of up to KC cache rows, every head, widened: kw[(hh * KC + j) * nv + v]
  auto load_chunk = [&](const KT* src, int64_t n) {
    for (int64_t j = 0; j < n; ++j) {
      const KT* row = src + j * tok_stride;
      for (int64_t hh = 0; hh < heads; ++hh) {
        for (int64_t v = 0; v < nv; ++v) kw[(hh * KC + j) * nv + v] = load16(row + hh * head_dim + v * 16);
      }
    }
  };
  // Software prefetch, PREFETCH_BLOCKS blocks ahead of pass 1 (K for it, V for pass 3): a sequence's
  // blocks lie anywhere in the cache, so the hardware's streams stop at each block.
  const int64_t first_block = base / block_size, last_block = hi / block_size;
  auto prefetch = [&](int64_t b) {
    prefetch_block(reinterpret_cast<const char*>(kb), reinterpret_cast<const char*>(vb), table, b, last_block,
                   block_stride * sizeof(KT), block_size, tok_stride * sizeof(KT), heads * head_dim * sizeof(KT));
  };
  for (int64_t b = first_block; b < first_block + PREFETCH_BLOCKS; ++b) prefetch(b);
  // pass 1: scores of every key up to hi (those a row may not see are -inf)
  for_each_chunk(base / block_size, hi, block_size, [&](int64_t b, int64_t c0, int64_t j0, int64_t n) {
    if (c0 == 0) prefetch(b + PREFETCH_BLOCKS);
    load_chunk(kb + table[b] * block_stride + c0 * tok_stride, n);
    for (int64_t rr = 0; rr < all; ++rr) {
      const v16* qr = q + rr * nv;
      const v16* kh = kw + (rr / rows) * KC * nv;
      for (int64_t j = 0; j < n; ++j) {
        const v16* kj = kh + j * nv;
        v16 a = qr[0] * kj[0];
        for (int64_t v = 1; v < nv; ++v) a += qr[v] * kj[v];
        t[j] = a;
      }
      for (int64_t j = n; j < KC; ++j) t[j] = splat(0.0f);
      const v16 sr = capped_visible(fold16(t), soft_cap, j0, n, pos[rr % rows], window);
      std::memcpy(sb + rr * width + (j0 - base), &sr, sizeof(sr));  // lanes past n: the next chunk's
    }
  });
  // pass 2: per row, p = exp(s - max) in place and l = sum p
  const int64_t nvec = (len + 15) / 16;
  for (int64_t rr = 0; rr < all; ++rr) {
    float* row = sb + rr * width;
    const float m = padded_row_max(row, len, nvec * 16);
    v16 sum = splat(0.0f);
    for (int64_t i = 0; i < nvec; ++i) {
      v16 x;
      std::memcpy(&x, row + i * 16, sizeof(x));
      x = exp_neg_v(x - m);
      sum += x;
      std::memcpy(row + i * 16, &x, sizeof(x));
    }
    l[rr] = hsum(sum);
  }
  // pass 3: acc = P V
  std::fill(acc, acc + all * nv, splat(0.0f));
  for_each_chunk(base / block_size, hi, block_size, [&](int64_t b, int64_t c0, int64_t j0, int64_t n) {
    load_chunk(vb + table[b] * block_stride + c0 * tok_stride, n);
    for (int64_t rr = 0; rr < all; ++rr) {
      v16 pr;
      std::memcpy(&pr, sb + rr * width + (j0 - base), sizeof(pr));
      accumulate_pv(acc + rr * nv, nv, 1.0f, pr, kw + (rr / rows) * KC * nv, n);
    }
  });
}

#if defined(__AVX512BF16__)
// attend_few_rows for bf16 queries and caches on CPUs with AVX512_BF16, head_dim = 32 H (H <= 4):
// Q.K and P.V as bf16 dot products (vdpbf16ps: two bf16 products summed into each fp32 lane, the
// products exact), read straight from the cache without widening each key and value to fp32. q: the
// rows' unscaled bf16 queries, heads x rows x head_dim; scores are q.k * scale. P goes to bf16 for
// P.V (as flash-attention kernels do; l sums the fp32 weights). Fills acc (fp32, head_dim in
// order, 2 H vectors a row) and l as attend_few_rows does. pbuf, vbuf: scratch, resized here.
constexpr bool kBf16Dot = true;
constexpr int64_t kMaxDotHalves = 4;  // head_dim up to 128

template <int H>
void attend_few_rows_dp(const c10::BFloat16* q, float scale, int64_t rows, int64_t heads, const int64_t* pos,
                        int64_t lo, int64_t hi, int64_t window, float soft_cap, const int32_t* table,
                        int64_t block_size, const c10::BFloat16* kb, const c10::BFloat16* vb, int64_t block_stride,
                        int64_t tok_stride, std::vector<float>& sbuf, std::vector<c10::BFloat16>& pbuf,
                        std::vector<v16i>& vbuf, v16* acc, float* l) {
  constexpr int64_t D = 32 * H;
  const int64_t base = lo / block_size * block_size;  // key of sbuf column 0 (a multiple of 16)
  const int64_t len = hi + 1 - base, width = (len + 31) / 32 * 32 + KC, all = heads * rows;
  sbuf.resize(all * width);
  pbuf.resize(all * width);
  float* sb = sbuf.data();
  v16 t[KC];
  const int64_t first_block = base / block_size, last_block = hi / block_size;
  auto prefetch = [&](int64_t b) {  // as attend_few_rows does
    prefetch_block(reinterpret_cast<const char*>(kb), reinterpret_cast<const char*>(vb), table, b, last_block,
                   block_stride * 2, block_size, tok_stride * 2, heads * D * 2);
  };
  for (int64_t b = first_block; b < first_block + PREFETCH_BLOCKS; ++b) prefetch(b);
  // pass 1: scores of every key up to hi (those a row may not see are -inf)
  for_each_chunk(first_block, hi, block_size, [&](int64_t b, int64_t c0, int64_t j0, int64_t n) {
    if (c0 == 0) prefetch(b + PREFETCH_BLOCKS);
    const c10::BFloat16* chunk = kb + table[b] * block_stride + c0 * tok_stride;
    for (int64_t rr = 0; rr < all; ++rr) {
      __m512bh qr[H];
      for (int h = 0; h < H; ++h) qr[h] = (__m512bh)_mm512_loadu_si512(q + rr * D + 32 * h);
      const c10::BFloat16* kh = chunk + (rr / rows) * D;
      for (int64_t j = 0; j < n; ++j) {
        __m512 a = _mm512_setzero_ps();
        for (int h = 0; h < H; ++h) a = _mm512_dpbf16_ps(a, qr[h], (__m512bh)_mm512_loadu_si512(kh + j * tok_stride + 32 * h));
        t[j] = (v16)a;
      }
      for (int64_t j = n; j < KC; ++j) t[j] = splat(0.0f);
      const v16 sr = capped_visible(fold16(t) * scale, soft_cap, j0, n, pos[rr % rows], window);
      std::memcpy(sb + rr * width + (j0 - base), &sr, sizeof(sr));  // lanes past n: the next chunk's
    }
  });
  // pass 2: per row, p = exp(s - max), l = sum p, and p rounded to bf16 (zero past len, so key pairs
  // read zeros): PyTorch's CPU flash attention also sums the fp32 weights and multiplies V by bf16 ones
  const int64_t npad = (len + 31) / 32 * 2;
  for (int64_t rr = 0; rr < all; ++rr) {
    float* row = sb + rr * width;
    const float m = padded_row_max(row, len, npad * 16);
    v16 sum = splat(0.0f);
    c10::BFloat16* prow = pbuf.data() + rr * width;
    for (int64_t i = 0; i < npad; i += 2) {
      v16 x0, x1;
      std::memcpy(&x0, row + i * 16, sizeof(x0));
      std::memcpy(&x1, row + i * 16 + 16, sizeof(x1));
      const v16 p0 = exp_neg_v(x0 - m), p1 = exp_neg_v(x1 - m);
      _mm512_storeu_si512(prow + i * 16, (__m512i)_mm512_cvtne2ps_pbh((__m512)p1, (__m512)p0));
      sum += p0 + p1;
    }
    l[rr] = hsum(sum);
  }
  // pass 3: acc = P V over key pairs. vbuf holds, per head, each pair's two value rows with their
  // elements interleaved (unpacklo / unpackhi of 16-bit words, per 128-bit lane), so one vdpbf16ps adds
  // p[j] v[j][d] + p[j+1] v[j+1][d] into lane d; the lanes' dims come out permuted (lo: 8L + i, hi:
  // 8L + 4 + i for 128-bit lane L, i < 4) and are put in order at the end. Two accumulator sets (even
  // and odd pairs) halve the chain of dependent vdpbf16ps.
  constexpr int R = 2 * H;  // registers a row: lo and hi per half
  std::vector<v16> accp(all * R, splat(0.0f));  // (vectors of the GCC extension: no attribute warnings)
  vbuf.resize(heads * (KC / 2) * R);
  for_each_chunk(base / block_size, hi, block_size, [&](int64_t b, int64_t c0, int64_t j0, int64_t n) {
    const c10::BFloat16* chunk = vb + table[b] * block_stride + c0 * tok_stride;
    const int64_t pairs = (n + 1) / 2;
    for (int64_t hh = 0; hh < heads; ++hh) {
      for (int64_t pr = 0; pr < pairs; ++pr) {
        const c10::BFloat16* v0 = chunk + 2 * pr * tok_stride + hh * D;
        v16i* dst = vbuf.data() + (hh * (KC / 2) + pr) * R;
        for (int h = 0; h < H; ++h) {
          const __m512i x = _mm512_loadu_si512(v0 + 32 * h);
          const __m512i y = 2 * pr + 1 < n ? _mm512_loadu_si512(v0 + tok_stride + 32 * h) : _mm512_setzero_si512();
          dst[2 * h] = (v16i)_mm512_unpacklo_epi16(x, y);
          dst[2 * h + 1] = (v16i)_mm512_unpackhi_epi16(x, y);
        }
      }
    }
    for (int64_t rr = 0; rr < all; ++rr) {
      const c10::BFloat16* prow = pbuf.data() + rr * width + (j0 - base);
      const v16i* vh = vbuf.data() + (rr / rows) * (KC / 2) * R;
      __m512 a0[R], a1[R];
      for (int g = 0; g < R; ++g) {
        a0[g] = (__m512)accp[rr * R + g];
        a1[g] = _mm512_setzero_ps();
      }
      auto pair = [&](int64_t pr, __m512* a) {
        uint32_t pp;
        std::memcpy(&pp, prow + 2 * pr, sizeof(pp));
        const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pp));
        for (int g = 0; g < R; ++g) a[g] = _mm512_dpbf16_ps(a[g], p, (__m512bh)vh[pr * R + g]);
      };
      int64_t pr = 0;
      for (; pr + 2 <= pairs; pr += 2) {
        pair(pr, a0);
        pair(pr + 1, a1);
      }
      if (pr < pairs) pair(pr, a0);
      for (int g = 0; g < R; ++g) accp[rr * R + g] = (v16)_mm512_add_ps(a0[g], a1[g]);
    }
  });
  for (int64_t rr = 0; rr < all; ++rr) {
    float* out = reinterpret_cast<float*>(acc + rr * (D / 16));
    for (int h = 0; h < H; ++h) {
      alignas(64) float lo_v[16], hi_v[16];
      _mm512_store_ps(lo_v, (__m512)accp[rr * R + 2 * h]);
      _mm512_store_ps(hi_v, (__m512)accp[rr * R + 2 * h + 1]);
      for (int k = 0; k < 16; ++k) {
        out[32 * h + 8 * (k / 4) + k % 4] = lo_v[k];
        out[32 * h + 8 * (k / 4) + 4 + k % 4] = hi_v[k];
      }
    }
  }
}
#else
constexpr bool kBf16Dot = false;
constexpr int64_t kMaxDotHalves = 0;
#endif

template <typename T, typename KT>
void attend(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens,
            double scale_d, int64_t window, double soft_cap_d) {
  const int64_t num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t num_seqs = seq_lens.size(0), max_blocks = block_tables.size(1);
  const int64_t nv = (head_dim + 15) / 16, dp = nv * 16;
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

  // Few-row items read every KV head of their rows at once (work item (tile, head 0) does them all)
  // when there are enough of them to keep the threads busy; otherwise one head per item.
  const bool few_rows_path = kVectorLoad<KT> && head_dim % 16 == 0;
  const bool all_heads = static_cast<int64_t>(items.size()) >= 4 * at::get_num_threads();
  // bf16 queries and caches where the CPU has AVX512_BF16: the few-rows path as bf16 dot products
  constexpr bool kDotTypes = kBf16Dot && std::is_same_v<T, c10::BFloat16> && std::is_same_v<KT, c10::BFloat16>;
  const bool dot_path = kDotTypes && head_dim % 32 == 0 && head_dim <= 32 * kMaxDotHalves;

  // Work units go to the threads from one shared counter, the costliest first (cost: rows x keys
  // visible): a static split by index put a prefill chunk's tiles, which come after the decodes of the
  // same pass, all on the last thread while the other ran out of decodes and waited.
  std::vector<std::pair<int64_t, int64_t>> order;  // (cost, unit)
  order.reserve(num_work);
  for (int64_t w = 0; w < num_work; ++w) {
    const Item& it = items[w / num_kv_heads];
    const int64_t rows = it.count * group;
    const bool few = few_rows_path && rows < TRANSPOSE_ROWS;
    if (few && all_heads && w % num_kv_heads > 0) continue;  // head 0's unit does this one
    const int64_t last = lens[it.seq] - (cu[it.seq + 1] - it.first) + it.count - 1;  // its last key
    const int64_t keys = window > 0 ? std::min<int64_t>(last + 1, window + it.count) : last + 1;
    order.emplace_back(rows * keys * (few && all_heads ? num_kv_heads : 1), w);
  }
  std::stable_sort(order.begin(), order.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::atomic<int64_t> next{0};
  const int64_t num_units = static_cast<int64_t>(order.size());

  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_units), 1, [&](int64_t, int64_t) {
    const int64_t max_rows = std::max(TILE_Q * group, num_kv_heads * (TRANSPOSE_ROWS - 1));
    std::vector<v16> qf(max_rows * nv), acc(max_rows * nv), s(max_rows);
    std::vector<v16> kw(KC * nv * num_kv_heads), vw(KC * nv), kt(dp);
    std::vector<float> m(max_rows), l(max_rows);
    std::vector<int64_t> pos(max_rows);
    std::vector<float> sbuf;  // the few-rows path's scores
    std::vector<c10::BFloat16> qb(dot_path ? max_rows * head_dim : 0), pbuf;  // its bf16 queries, weights
#if defined(__AVX512BF16__)
    std::vector<v16i> vbuf;  // its interleaved value pairs
#endif
    float* qff = reinterpret_cast<float*>(qf.data());
    auto write_rows = [&](const Item& it, int64_t h, int64_t rows, int64_t heads) {  // out = acc / l
      for (int64_t rr = 0; rr < heads * rows; ++rr) {
        const int64_t r = rr % rows, i = r / group, g = r % group;
        T* dst = op + (it.first + i) * o_stride + ((h + rr / rows) * group + g) * o_head_stride;
        const float inv = 1.0f / l[rr];
        const float* ar = reinterpret_cast<const float*>(acc.data() + rr * nv);
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<T>(ar[d] * inv);
      }
    };
    for (int64_t u = next.fetch_add(1); u < num_units; u = next.fetch_add(1)) {
      const int64_t w = order[u].second;
      const Item& it = items[w / num_kv_heads];
      const int64_t h = w % num_kv_heads;
      const int64_t ctx = lens[it.seq], q_len = cu[it.seq + 1] - cu[it.seq];
      const int64_t rows = it.count * group;
      const bool few = few_rows_path && rows < TRANSPOSE_ROWS;
      const int64_t heads = few && all_heads ? num_kv_heads : 1;
      const bool dot = dot_path && few;
      for (int64_t i = 0; i < it.count; ++i) {
        const int64_t p = ctx - q_len + (it.first - cu[it.seq]) + i;
        for (int64_t g = 0; g < group; ++g) pos[i * group + g] = p;
        for (int64_t hh = 0; hh < heads; ++hh) {
          for (int64_t g = 0; g < group; ++g) {
            const T* src = qp + (it.first + i) * q_stride + ((h + hh) * group + g) * q_head_stride;
            if (dot) {  // the bf16 rows as they are
              std::memcpy(qb.data() + (hh * rows + i * group + g) * head_dim, src, head_dim * sizeof(T));
              continue;
            }
            float* dst = qff + (hh * rows + i * group + g) * dp;
            for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<float>(src[d]) * scale;
            for (int64_t d = head_dim; d < dp; ++d) dst[d] = 0.0f;
          }
        }
      }
      const int64_t hi = pos[rows - 1];  // last key any row may see
      const int64_t lo = window > 0 ? std::max<int64_t>(0, pos[0] - window + 1) : 0;
      const int32_t* table = tables + it.seq * max_blocks;
#if defined(__AVX512BF16__)
      if constexpr (kDotTypes) {
        if (dot) {
          const auto dot_rows = [&](auto halves) {
            attend_few_rows_dp<decltype(halves)::value>(qb.data(), scale, rows, heads, pos.data(), lo, hi, window,
                                                        soft_cap, table, block_size, kp + h * head_dim,
                                                        vp + h * head_dim, kv_block_stride, kv_tok_stride, sbuf,
                                                        pbuf, vbuf, acc.data(), l.data());
          };
          switch (head_dim / 32) {
            case 1: dot_rows(std::integral_constant<int, 1>{}); break;
            case 2: dot_rows(std::integral_constant<int, 2>{}); break;
            case 3: dot_rows(std::integral_constant<int, 3>{}); break;
            default: dot_rows(std::integral_constant<int, 4>{}); break;
          }
          write_rows(it, h, rows, heads);
          continue;
        }
      }
#endif
      if constexpr (kVectorLoad<KT>) {
        if (few) {
          attend_few_rows(qf.data(), rows, heads, nv, pos.data(), lo, hi, window, soft_cap, table, block_size,
                          kp + h * head_dim, vp + h * head_dim, kv_block_stride, kv_tok_stride, head_dim, sbuf,
                          kw.data(), acc.data(), l.data());
          write_rows(it, h, rows, heads);
          continue;
        }
      }
      std::fill(acc.begin(), acc.begin() + rows * nv, splat(0.0f));
      std::fill(m.begin(), m.begin() + rows, NEG_INF);
      std::fill(l.begin(), l.begin() + rows, 0.0f);
      for_each_chunk(lo / block_size, hi, block_size, [&](int64_t b, int64_t c0, int64_t j0, int64_t n) {
        const int64_t base = table[b] * kv_block_stride + c0 * kv_tok_stride + h * head_dim;
        widen_chunk(kp + base, kv_tok_stride, n, head_dim, nv, fp8, kw.data());
        widen_chunk(vp + base, kv_tok_stride, n, head_dim, nv, fp8, vw.data());
        chunk_scores(qf.data(), rows, nv, kw.data(), kt.data(), s.data());
        for (int64_t r = 0; r < rows; ++r) {
          const v16 sr = capped_visible(s[r], soft_cap, j0, n, pos[r], window);
          const float block_max = hmax(sr);
          if (block_max == NEG_INF) continue;  // nothing visible to this row in this chunk
          const float m_new = std::max(m[r], block_max);
          const float alpha = exp_neg_v(splat(m[r] - m_new))[0];  // m[r] = -inf → 0
          const v16 pr = exp_neg_v(sr - m_new);                    // invisible lanes: exp(-inf) = 0
          l[r] = l[r] * alpha + hsum(pr);
          m[r] = m_new;
          accumulate_pv(acc.data() + r * nv, nv, alpha, pr, vw.data(), n);
        }
      });
      write_rows(it, h, rows, 1);
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
