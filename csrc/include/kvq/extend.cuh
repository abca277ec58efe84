// Extend (prefill) attention over a paged, optionally 8-bit KV cache: FlashAttention-2 style with
// mma.sync.m16n8k16 (bf16/fp16 in, fp32 accumulate), ldmatrix and cp.async — instructions that sm_89,
// sm_90 and sm_120 share. Framework-free: the launcher takes raw pointers and returns cudaError_t.
//
// Semantics (oracle: kvq/reference.py::extend_attention). Token i of sequence b sits at position
// prefix_lens[b] + i and attends to the cached prefix (positions 0 .. prefix_lens[b]-1, read from the
// pages) and to the new keys of its own sequence (exact, query dtype); causal keeps keys at positions
// <= its own, a window keeps keys at positions >= p - window_left, softcap maps s to cap * tanh(s / cap).
//
// Work split. One CTA = 4 warps = BLOCK_M rows, where a "row" is one (token, q head) pair of one kv
// head: the G = Hq / Hkv q heads of a token are packed next to each other, so every K/V tile read (and
// dequantized) once serves all G heads. A warp owns 32 rows (two m16 tiles; 16 at head_dim 256, where O
// would not fit in registers twice), so each K/V fragment it loads from shared memory feeds two mmas:
// with one m-tile per warp the ldmatrix traffic, not the tensor cores, bounds the kernel. Sequence b owns the row blocks starting at
// (cu_seqlens_q[b] * G) / BLOCK_M + b; the grid (cdiv(total * G, BLOCK_M) + B, Hkv) depends on shapes
// only, and each CTA finds its sequence by binary search, so the launch is CUDA-graph capturable.
//
// Pipeline per K/V tile (BLOCK_N keys): K(j) in smem -> issue V(j) loads -> S = Q K^T -> online softmax
// -> V(j) in smem -> issue K(j+1) loads -> O += P V. Unquantized rows travel by cp.async; 8-bit rows
// are loaded into registers when issued and dequantized into smem when committed, so the global load
// latency hides behind the tensor-core work and the mma loop is the same for every format.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "common.cuh"
#include "dispatch.cuh"
#include "paged.cuh"
#include "tc.cuh"

namespace kvq {

struct ExtendParams {
  const void* query = nullptr;  // [total, num_q_heads, head_dim]
  const void* key = nullptr;    // [total, num_kv_heads, head_dim]
  const void* value = nullptr;  // [total, num_kv_heads, head_dim]
  void* out = nullptr;          // [total, num_q_heads, head_dim]; all four in the query dtype
  int64_t q_stride_tok = 0, q_stride_head = 0;  // elements; head_dim has unit stride, rows 16-byte aligned
  int64_t k_stride_tok = 0, k_stride_head = 0;
  int64_t v_stride_tok = 0, v_stride_head = 0;
  int64_t o_stride_tok = 0, o_stride_head = 0;
  const void* k_cache = nullptr;  // [num_pages, page_size, num_kv_heads, head_dim], dense within a page
  const void* v_cache = nullptr;
  const uint16_t* k_scale = nullptr;  // [num_pages, page_size, num_kv_heads, head_dim / 32] fp16, or null
  const uint16_t* v_scale = nullptr;
  int64_t k_stride_page = 0, v_stride_page = 0;  // elements
  int num_pages = 0, page_size = 0, num_kv_heads = 0, head_dim = 0;
  const int32_t* block_table = nullptr;  // [batch, max_pages]
  int64_t block_table_stride = 0;        // unit stride along pages
  int max_pages = 0;
  const int32_t* prefix_lens = nullptr;   // [batch], tokens already in the cache
  const int32_t* cu_seqlens_q = nullptr;  // [batch + 1], new tokens of sequence b: [cu[b], cu[b + 1])
  int batch = 0, total_q = 0, num_q_heads = 0;
  float sm_scale = 1.0f;
  bool causal = true;
  int window_left = -1;      // -1: none
  float logit_softcap = 0.0f;  // 0: none
  Format format = Format::kSame;
  DType dtype = DType::kBF16;  // of query, key, value and out
};

namespace extend_detail {

constexpr float kLog2e = 1.4426950408889634f;

// A CTA of kWarps warps owns kBlockM = kWarps * 16 * kMTiles rows and walks the keys in tiles of kBlockN.
template <int D, int BN, int MT, int W>
struct Cfg {
  static constexpr int kD = D, kBlockN = BN, kMTiles = MT, kWarps = W;
  static constexpr int kThreads = W * 32;
  static constexpr int kBlockM = W * 16 * MT;
};
// d256 keeps one m-tile and 32-key tiles, so that O (128 fp32 per thread) and S stay in registers.
template <int D>
using DefaultCfg = Cfg<D, D <= 128 ? 64 : 32, D <= 128 ? 2 : 1, 4>;

// Q, K and V tiles in T, then the 8-bit staging area.
template <typename S, typename C>
constexpr size_t kSmemBytes = size_t(C::kBlockM + 2 * C::kBlockN) * C::kD * 2 +
                              (StorageTraits<S>::kQuantized ? C::kBlockN * C::kD : 0);

// q / d and q % d for 0 <= q < 2^31 with a multiply (page_size is runtime and not a power of two).
struct FastDivmod {
  uint32_t divisor, multiplier, shift;
  explicit FastDivmod(int d) : divisor(uint32_t(d)), multiplier(0), shift(0) {
    if (d != 1) {
      uint32_t l = 0;
      while ((1u << l) < uint32_t(d)) ++l;  // ceil(log2 d)
      uint32_t p = 31 + l;
      multiplier = uint32_t(((uint64_t(1) << p) + uint64_t(d) - 1) / uint64_t(d));
      shift = p - 32;
    }
  }
  __device__ __forceinline__ void divmod(int n, int& q, int& r) const {
    q = divisor == 1 ? n : int(__umulhi(uint32_t(n), multiplier) >> shift);
    r = n - q * int(divisor);
  }
};

using namespace ::kvq::tc;

// Byte offset of 16-byte chunk `c` of row `r` in a [rows, D] tile of T. The XOR swizzle spreads the 8
// rows an ldmatrix reads over all 32 banks.
template <int D>
__device__ __forceinline__ uint32_t swz(int r, int c) {
  return uint32_t((r * (D / 8) + (c ^ (r & 7))) * 16);
}

// ldmatrix addresses of one thread for k-steps ks = 0, 1, ... along a swizzled row: the row's low 3
// bits are the lane's, so chunk (2 ks + c) ^ (row & 7) only takes 4 values per thread. Keeping those 4
// offsets (instead of one address per unrolled k-step and tile) saves ~60 registers.
template <int D>
struct LdmAddr {
  uint32_t a[4];
  // row: the thread's row in the tile (its low 3 bits are lane & 7); hi: the chunk's odd bit.
  __device__ __forceinline__ LdmAddr(uint32_t tile, int row, int hi) {
    const uint32_t base = tile + uint32_t(row * D * 2);
#pragma unroll
    for (int t = 0; t < 4; ++t) a[t] = base + uint32_t(((2 * t + hi) ^ (row & 7)) * 16);
  }
  // Address at k-step ks, `rows` rows further down (both compile-time after unrolling).
  __device__ __forceinline__ uint32_t at(int ks, int rows) const {
    return a[ks & 3] + uint32_t((ks >> 2) * 128 + rows * D * 2);
  }
};

// ------------------------------------------------------------------------------------ K/V tile loads
// One thread's share of an 8-bit tile between issue and commit: its 16-byte chunks travel by cp.async
// into a staging area (BLOCK_N * D bytes, chunk `it` of thread `tid` at (it * kThreads + tid) * 16, read
// back by the same thread), their block scales in registers. Staging in registers instead would cost 16
// more registers per thread, which at two m-tiles per warp spill.
template <typename C, bool kQuant>
struct Staged {
  static constexpr int kCpr = C::kD / 16;           // 16-element chunks per row
  static constexpr int kRpp = C::kThreads / kCpr;  // rows per pass
  static constexpr int kIters = C::kBlockN / kRpp;
  uint32_t stage;  // shared-memory address of the staging area
  uint16_t scale[kQuant ? kIters : 1];
};

struct SeqInfo {
  int b, prefix, n_new, q_start, kv_len, h_kv;
};

// Issue the loads of keys [n0, n0 + BLOCK_N) of one tensor (K or V) into `tile`: rows in the query dtype
// (cache of the same dtype, or new keys) by cp.async, 8-bit rows into `st`'s staging area. Rows at or past kv_len and
// rows whose page lies outside [0, num_pages) become zeros.
template <typename T, typename S, typename C>
__device__ __forceinline__ void issue_tile(const paged_kv_t<S>& cache, const SeqInfo& s, const FastDivmod& pdm,
                                           int n0, const S* values, int64_t page_stride, const uint16_t* scales,
                                           const T* fresh, int64_t f_stride_tok, int64_t f_stride_head,
                                           uint32_t tile, Staged<C, StorageTraits<S>::kQuantized>& st) {
  constexpr int D = C::kD, BN = C::kBlockN, kThreads = C::kThreads;
  constexpr bool kQuant = StorageTraits<S>::kQuantized;
  const int tid = threadIdx.x;
  const int32_t* table = cache.block_table + s.b * cache.block_table_stride;

  // Key position kpos < prefix -> (element offset of its row in `values`, its slot), or -1.
  auto cache_row = [&](int kpos, int64_t& slot) -> int64_t {
    int idx, off;
    pdm.divmod(kpos, idx, off);
    const int page = idx < cache.max_pages ? __ldg(table + idx) : -1;
    if (!cache.valid_page(page)) return -1;
    slot = int64_t(page) * cache.page_size + off;
    return int64_t(page) * page_stride + (int64_t(off) * cache.num_kv_heads + s.h_kv) * D;
  };
  auto fresh_row = [&](int kpos) {
    return fresh + int64_t(s.q_start + kpos - s.prefix) * f_stride_tok + s.h_kv * f_stride_head;
  };

  if constexpr (!kQuant) {
    constexpr int kCpr = D / 8, kRpp = kThreads / kCpr;
    const int c = tid % kCpr;
#pragma unroll
    for (int it = 0; it < BN / kRpp; ++it) {
      const int r = tid / kCpr + it * kRpp;
      const int kpos = n0 + r;
      const T* src = fresh;
      int bytes = 0;
      if (kpos < s.prefix) {
        int64_t slot;
        const int64_t e = cache_row(kpos, slot);
        if (e >= 0) src = reinterpret_cast<const T*>(values) + e + c * 8, bytes = 16;
      } else if (kpos < s.kv_len) {
        src = fresh_row(kpos) + c * 8, bytes = 16;
      }
      cp_async16(tile + swz<D>(r, c), src, bytes);
    }
  } else {
    if (n0 < s.prefix) {  // 8-bit rows: into the staging area, dequantized at commit
      using St = Staged<C, true>;
      const int c = tid % St::kCpr;
#pragma unroll
      for (int it = 0; it < St::kIters; ++it) {
        const int kpos = n0 + tid / St::kCpr + it * St::kRpp;
        const void* src = values;
        int bytes = 0;
        st.scale[it] = 0;
        if (kpos < s.prefix) {
          int64_t slot;
          const int64_t e = cache_row(kpos, slot);
          if (e >= 0) {
            src = reinterpret_cast<const uint8_t*>(values) + e + c * 16, bytes = 16;
            st.scale[it] = __ldg(scales + cache.scale_offset(slot, s.h_kv) + c / 2);
          }
        }
        cp_async16(st.stage + uint32_t((it * kThreads + tid) * 16), src, bytes);
      }
    }
    if (n0 + BN > s.prefix) {  // new rows (exact, query dtype) and the zero tail
      constexpr int kCpr = D / 8, kRpp = kThreads / kCpr;
      const int c = tid % kCpr;
#pragma unroll
      for (int it = 0; it < BN / kRpp; ++it) {
        const int r = tid / kCpr + it * kRpp;
        const int kpos = n0 + r;
        if (kpos < s.prefix) continue;
        const bool ok = kpos < s.kv_len;
        cp_async16(tile + swz<D>(r, c), ok ? fresh_row(kpos) + c * 8 : fresh, ok ? 16 : 0);
      }
    }
  }
  cp_async_commit();
}

// Finish the loads of issue_tile: wait for the async copies and dequantize the staged 8-bit rows into
// `tile` (x' = float(q) * scale, rounded once to T). The caller synchronizes the CTA afterwards.
template <typename T, typename S, typename C>
__device__ __forceinline__ void commit_tile(const SeqInfo& s, int n0, uint32_t tile,
                                            const Staged<C, StorageTraits<S>::kQuantized>& st) {
  constexpr int D = C::kD, kThreads = C::kThreads;
  cp_async_wait_all();
  if constexpr (StorageTraits<S>::kQuantized) {
    if (n0 < s.prefix) {
      using St = Staged<C, true>;
      const int tid = threadIdx.x;
      const int c = tid % St::kCpr;
#pragma unroll
      for (int it = 0; it < St::kIters; ++it) {
        const int r = tid / St::kCpr + it * St::kRpp;
        if (n0 + r >= s.prefix) continue;
        uint4 raw;
        asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(raw.x), "=r"(raw.y), "=r"(raw.z), "=r"(raw.w)
                     : "r"(st.stage + uint32_t((it * kThreads + tid) * 16)));
        uint32_t w[8];
        dequant16<T, S>(raw, st.scale[it], w);
        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(tile + swz<D>(r, 2 * c)), "r"(w[0]),
                     "r"(w[1]), "r"(w[2]), "r"(w[3]));
        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(tile + swz<D>(r, 2 * c + 1)), "r"(w[4]),
                     "r"(w[5]), "r"(w[6]), "r"(w[7]));
      }
    }
  }
}

// ------------------------------------------------------------------------------------ the kernel
template <typename T, typename S, typename C>
__device__ __forceinline__ void extend_body(const ExtendParams& p, const FastDivmod& pdm) {
  constexpr int D = C::kD, BN = C::kBlockN, BM = C::kBlockM, MT = C::kMTiles, kThreads = C::kThreads;
  extern __shared__ __align__(128) uint8_t smem[];
  const uint32_t sQ = smem_addr(smem);
  const uint32_t sK = sQ + BM * D * 2;
  const uint32_t sV = sK + BN * D * 2;
  Staged<C, StorageTraits<S>::kQuantized> st;
  st.stage = sV + BN * D * 2;

  const paged_kv_t<S> cache(p.num_pages, p.page_size, p.num_kv_heads, D, p.k_stride_page, p.v_stride_page,
                            p.block_table, p.block_table_stride, p.max_pages, p.prefix_lens);

  const int G = p.num_q_heads / p.num_kv_heads;
  // Largest b with start(b) = cu[b] * G / BM + b <= blk; late row blocks (more keys when causal) are
  // scheduled first.
  const int blk = int(gridDim.x) - 1 - int(blockIdx.x);
  int lo = 0, hi = p.batch - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    const int64_t start = int64_t(__ldg(p.cu_seqlens_q + mid)) * G / BM + mid;
    if (start <= blk) lo = mid; else hi = mid - 1;
  }
  SeqInfo s;
  s.b = lo;
  // Clamped so that a malformed cu_seqlens_q can never move a row outside [0, total_q).
  s.q_start = min(max(__ldg(p.cu_seqlens_q + lo), 0), p.total_q);
  s.n_new = min(max(__ldg(p.cu_seqlens_q + lo + 1), s.q_start), p.total_q) - s.q_start;
  s.prefix = cache.length(lo);  // clamped to what the block table row can address
  s.kv_len = s.prefix + s.n_new;
  s.h_kv = blockIdx.y;
  const int m_blk = blk - int(int64_t(s.q_start) * G / BM + lo);
  const int row0 = m_blk * BM;  // first packed row (token * G + g) of this CTA
  if (s.n_new <= 0 || row0 >= s.n_new * G) return;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int wrow = warp * 16 * MT;  // the warp's first row in the tile
  const T* q_ptr = static_cast<const T*>(p.query);

  // Q tile: packed row r -> token (row0 + r) / G, q head h_kv * G + (row0 + r) % G; rows past the
  // sequence are zero-filled and never stored.
  {
    constexpr int kCpr = D / 8, kRpp = kThreads / kCpr;
    const int c = tid % kCpr;
#pragma unroll
    for (int it = 0; it < BM / kRpp; ++it) {
      const int r = tid / kCpr + it * kRpp;
      const int pr = row0 + r;
      const int tok = pr / G, g = pr - tok * G;
      const bool ok = tok < s.n_new;
      const T* src = ok ? q_ptr + int64_t(s.q_start + tok) * p.q_stride_tok +
                              int64_t(s.h_kv * G + g) * p.q_stride_head + c * 8
                        : q_ptr;
      cp_async16(sQ + swz<D>(r, c), src, ok ? 16 : 0);
    }
  }

  // Positions of the rows this thread accumulates (g and g + 8 of each of its warp's m-tiles); rows
  // past the sequence take the last token's position so that their (discarded) softmax stays finite.
  const int last_tok = s.n_new - 1;
  int qpos[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < 2; ++i) qpos[mt][i] = s.prefix + min((row0 + wrow + mt * 16 + lane / 4 + i * 8) / G, last_tok);
  const int qmin = s.prefix + row0 / G;
  const int qmax = s.prefix + min((row0 + BM - 1) / G, last_tok);
  // Key tiles that hold a visible key for some row; tiles entirely outside the window are skipped.
  const int kv_end = p.causal ? min(s.kv_len, qmax + 1) : s.kv_len;
  const int kv_begin = p.window_left >= 0 ? max(0, qmin - p.window_left) : 0;
  const int j_begin = kv_begin / BN, j_end = (kv_end + BN - 1) / BN;

  // ldmatrix sources, so that the four matrices land in fragment order: Q (A of Q K^T) and V (B of P V,
  // transposed) as (rows 0-7, chunk lo), (rows 8-15, lo), (rows 0-7, hi), (rows 8-15, hi); K (B of Q K^T)
  // as (rows 0-7, lo), (rows 0-7, hi), (rows 8-15, lo), (rows 8-15, hi). Q shares V's offsets (plus one
  // register), which keeps two m-tiles per warp within 255 registers. (Loading in another order and
  // renaming costs a register move per fragment word at every mma.)
  const int mi = lane >> 3;
  const LdmAddr<D> qv_addr(sV, (lane & 7) + (mi & 1) * 8, mi >> 1);
  const LdmAddr<D> k_addr(sK, (lane & 7) + (mi >> 1) * 8, mi & 1);
  const uint32_t q_off = sQ + uint32_t(wrow * D * 2) - sV;

  const S* k_values = static_cast<const S*>(p.k_cache);
  const S* v_values = static_cast<const S*>(p.v_cache);
  const T* k_new = static_cast<const T*>(p.key);
  const T* v_new = static_cast<const T*>(p.value);

  float o[MT][D / 8][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < D / 8; ++i) o[mt][i][0] = o[mt][i][1] = o[mt][i][2] = o[mt][i][3] = 0.f;
  float m_run[MT][2], l_run[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) m_run[mt][0] = m_run[mt][1] = -INFINITY, l_run[mt][0] = l_run[mt][1] = 0.f;
  const bool softcap = p.logit_softcap > 0.f;
  const float s_mul = softcap ? p.sm_scale / p.logit_softcap : p.sm_scale * kLog2e;
  const float cap_log2 = p.logit_softcap * kLog2e;

  if (j_begin < j_end)
    issue_tile<T, S, C>(cache, s, pdm, j_begin * BN, k_values, p.k_stride_page, p.k_scale, k_new, p.k_stride_tok,
                        p.k_stride_head, sK, st);
  else
    cp_async_commit();

  for (int j = j_begin; j < j_end; ++j) {
    const int n0 = j * BN;
    commit_tile<T, S, C>(s, n0, sK, st);
    __syncthreads();  // K(j) visible; every warp is past O += P V(j - 1), so V's buffer is free
    issue_tile<T, S, C>(cache, s, pdm, n0, v_values, p.v_stride_page, p.v_scale, v_new, p.v_stride_tok,
                        p.v_stride_head, sV, st);

    // S = Q K^T for this warp's 16 * MT rows x BN keys; each K fragment serves every m-tile.
    float sc[MT][BN / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int i = 0; i < BN / 8; ++i) sc[mt][i][0] = sc[mt][i][1] = sc[mt][i][2] = sc[mt][i][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) ldmatrix_x4(qv_addr.at(kk, mt * 16) + q_off, a[mt][0], a[mt][1], a[mt][2], a[mt][3]);
#pragma unroll
      for (int nb = 0; nb < BN / 16; ++nb) {
        uint32_t b0, b1, b2, b3;
        ldmatrix_x4(k_addr.at(kk, nb * 16), b0, b1, b2, b3);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma16816<T>(sc[mt][2 * nb], a[mt], b0, b1);
          mma16816<T>(sc[mt][2 * nb + 1], a[mt], b2, b3);
        }
      }
    }

    // Scores in log2 units; only tiles crossing the diagonal, the window edge or kv_len are masked. The
    // soft-cap and mask tests are taken once per tile, outside the element loops: a branch per element
    // cuts the loop into one basic block per score and serializes the exp2 / tanh latencies.
    const bool need_mask = n0 + BN > s.kv_len || (p.causal && n0 + BN - 1 > qmin) ||
                           (p.window_left >= 0 && n0 < qmax - p.window_left);
    auto scores = [&](auto kCap, auto kMask) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int nb = 0; nb < BN / 8; ++nb) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float x = sc[mt][nb][e] * s_mul;
            if constexpr (decltype(kCap)::value) x = cap_log2 * tanhf(x);
            if constexpr (decltype(kMask)::value) {
              const int kpos = n0 + nb * 8 + (lane & 3) * 2 + (e & 1);
              const int qp = qpos[mt][e >> 1];
              const bool vis = kpos < s.kv_len && (!p.causal || kpos <= qp) &&
                               (p.window_left < 0 || kpos >= qp - p.window_left);
              x = vis ? x : -INFINITY;
            }
            sc[mt][nb][e] = x;
          }
        }
      }
    };
    using Yes = std::true_type;
    using No = std::false_type;
    if (softcap) {
      if (need_mask) scores(Yes{}, Yes{}); else scores(Yes{}, No{});
    } else {
      if (need_mask) scores(No{}, Yes{}); else scores(No{}, No{});
    }

    // Online softmax; a row lives in the 4 threads of a quad.
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        float mx = -INFINITY;
#pragma unroll
        for (int nb = 0; nb < BN / 8; ++nb) mx = fmaxf(mx, fmaxf(sc[mt][nb][2 * i], sc[mt][nb][2 * i + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m_run[mt][i], mx);
        const float m_use = m_new == -INFINITY ? 0.f : m_new;  // nothing visible yet: keep exp2 finite
        const float alpha = fast_exp2(m_run[mt][i] - m_use);
        m_run[mt][i] = m_new;
        float sum = 0.f;
#pragma unroll
        for (int nb = 0; nb < BN / 8; ++nb) {
          sc[mt][nb][2 * i] = fast_exp2(sc[mt][nb][2 * i] - m_use);
          sc[mt][nb][2 * i + 1] = fast_exp2(sc[mt][nb][2 * i + 1] - m_use);
          sum += sc[mt][nb][2 * i] + sc[mt][nb][2 * i + 1];
        }
        l_run[mt][i] = l_run[mt][i] * alpha + sum;
#pragma unroll
        for (int db = 0; db < D / 8; ++db) o[mt][db][2 * i] *= alpha, o[mt][db][2 * i + 1] *= alpha;
      }
    }

    commit_tile<T, S, C>(s, n0, sV, st);
    __syncthreads();  // V(j) visible; every warp is past S = Q K(j)^T, so K's buffer is free
    if (j + 1 < j_end)
      issue_tile<T, S, C>(cache, s, pdm, n0 + BN, k_values, p.k_stride_page, p.k_scale, k_new, p.k_stride_tok,
                          p.k_stride_head, sK, st);

    // O += P V, with P rounded to T as the A operand (as a same-precision PyTorch P @ V would); each V
    // fragment serves every m-tile.
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        a[mt][0] = pack2<T>(sc[mt][2 * kk][0], sc[mt][2 * kk][1]);
        a[mt][1] = pack2<T>(sc[mt][2 * kk][2], sc[mt][2 * kk][3]);
        a[mt][2] = pack2<T>(sc[mt][2 * kk + 1][0], sc[mt][2 * kk + 1][1]);
        a[mt][3] = pack2<T>(sc[mt][2 * kk + 1][2], sc[mt][2 * kk + 1][3]);
      }
#pragma unroll
      for (int db = 0; db < D / 16; ++db) {
        uint32_t b0, b1, b2, b3;
        ldmatrix_x4_trans(qv_addr.at(db, kk * 16), b0, b1, b2, b3);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma16816<T>(o[mt][2 * db], a[mt], b0, b1);
          mma16816<T>(o[mt][2 * db + 1], a[mt], b2, b3);
        }
      }
    }
  }
  cp_async_wait_all();  // the Q copy, had there been no tile

  // Epilogue: normalize, stage this warp's rows in its own rows of sQ (only this warp ever read them),
  // then store whole 16-byte chunks.
  __syncwarp();
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float l = l_run[mt][i];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const float inv = l > 0.f ? 1.f / l : 0.f;  // a row that sees no key gets 0, as the reference
      const int r = wrow + mt * 16 + lane / 4 + i * 8;
#pragma unroll
      for (int db = 0; db < D / 8; ++db) {
        const uint32_t v = pack2<T>(o[mt][db][2 * i] * inv, o[mt][db][2 * i + 1] * inv);
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sQ + swz<D>(r, db) + (lane & 3) * 4), "r"(v));
      }
    }
  }
  __syncwarp();
  T* out = static_cast<T*>(p.out);
  constexpr int kCpr = D / 8;
#pragma unroll
  for (int it = 0; it < 16 * MT * kCpr / 32; ++it) {
    const int idx = it * 32 + lane;
    const int r = wrow + idx / kCpr, c = idx % kCpr;
    const int pr = row0 + r;
    const int tok = pr / G, g = pr - tok * G;
    if (tok >= s.n_new) continue;
    uint4 v;
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(sQ + swz<D>(r, c)));
    *reinterpret_cast<uint4*>(out + int64_t(s.q_start + tok) * p.o_stride_tok +
                              int64_t(s.h_kv * G + g) * p.o_stride_head + c * 8) = v;
  }
}

template <typename T, typename S, typename C>
__global__ void __launch_bounds__(C::kThreads) extend_kernel(const __grid_constant__ ExtendParams p,
                                                             const __grid_constant__ FastDivmod pdm) {
  extend_body<T, S, C>(p, pdm);
}

template <typename T, typename S, typename C>
cudaError_t launch(const ExtendParams& p, cudaStream_t stream) {
  const int G = p.num_q_heads / p.num_kv_heads;
  constexpr int BM = C::kBlockM;
  const int64_t blocks = (int64_t(p.total_q) * G + BM - 1) / BM + p.batch;
  if (blocks > 0x7fffffff || p.num_kv_heads > 65535) return cudaErrorInvalidConfiguration;
  constexpr size_t smem = kSmemBytes<S, C>;
  cudaError_t err =
      cudaFuncSetAttribute(extend_kernel<T, S, C>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (err != cudaSuccess) return err;
  extend_kernel<T, S, C><<<dim3(unsigned(blocks), unsigned(p.num_kv_heads)), C::kThreads, smem, stream>>>(
      p, FastDivmod(p.page_size));
  return cudaGetLastError();
}

template <typename T, typename S>
cudaError_t launch_head_dim(const ExtendParams& p, cudaStream_t stream) {
  return KVQ_DISPATCH_HEAD_DIM(p.head_dim, HD, return launch<T, S, DefaultCfg<HD>>(p, stream););
}

}  // namespace extend_detail

// Launch extend attention on `stream`. Instantiations: head_dim {64, 128, 256} x storage {query dtype,
// q8_0, fp8_e4m3} x query {bf16, fp16}. Returns the launch error; nothing synchronizes with the host.
inline cudaError_t extend_attention(const ExtendParams& p, cudaStream_t stream) {
  if (p.total_q == 0 || p.batch == 0) return cudaSuccess;
  if (p.num_kv_heads <= 0 || p.num_q_heads <= 0 || p.num_q_heads % p.num_kv_heads != 0 || p.page_size <= 0)
    return cudaErrorInvalidValue;
  return KVQ_DISPATCH_DTYPE(p.dtype, T, {
    switch (p.format) {
      case Format::kSame: return extend_detail::launch_head_dim<T, T>(p, stream);
      case Format::kQ8_0: return extend_detail::launch_head_dim<T, int8_t>(p, stream);
      case Format::kFp8E4M3: return extend_detail::launch_head_dim<T, __nv_fp8_e4m3>(p, stream);
    }
    return cudaErrorInvalidValue;
  });
}

}  // namespace kvq
