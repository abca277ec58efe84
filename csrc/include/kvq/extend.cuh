// Extend (prefill) attention over a paged, optionally 8-bit KV cache: FlashAttention-2 style with
// mma.sync.m16n8k16 (bf16/fp16 in, fp32 accumulate), ldmatrix and cp.async — instructions that sm_89,
// sm_90 and sm_120 share. Framework-free: the launcher takes raw pointers and returns cudaError_t.
//
// Semantics (oracle: kvq/reference.py::extend_attention). Token i of sequence b sits at position
// prefix_lens[b] + i and attends to the cached prefix (positions 0 .. prefix_lens[b]-1, read from the
// pages) and to the new keys of its own sequence (exact, query dtype); causal keeps keys at positions
// <= its own, a window keeps keys at positions >= p - window_left, softcap maps s to cap * tanh(s / cap).
//
// Work split. A CTA owns BLOCK_M = 128 rows (64 for "small" and for "wide" at head_dim 256, 256 for "tall"), where
// a "row" is one (token, q head) pair of one kv head: the G = Hq / Hkv q heads of a token are packed next to each
// other, so every K/V tile read (and dequantized) once serves all G heads. Four CTA shapes: "wide", 4 warps of 32
// rows (two m16 tiles, so each K/V fragment loaded from shared memory feeds two mmas; one at head_dim 256), "deep",
// 8 warps of 16 rows (more warps to hide latency when there are too few CTAs for two per SM; at head_dim 256, on
// sm_90, twice wide's rows per K/V tile), "small", 4 warps of 16 rows (a short plain prefill in one wave) and, for
// 8-bit caches, "tall", 8 warps of 32 rows (each dequantized tile serves 256 rows); plan_shape picks by estimated
// time and rules for causal chunks over short prefixes and for grids that would not fill the SMs. Sequence b
// owns the row blocks starting at (cu_seqlens_q[b] * G) / BLOCK_M + b; the grid (Hkv, cdiv(total * G, BLOCK_M)
// + B, key splits) depends on shapes only, and each CTA finds its sequence by binary search, so the launch is
// CUDA-graph capturable.
//
// Pipeline: two stages of K/V tiles (BLOCK_N keys) in shared memory, one barrier per tile. While tile j
// is computed (S = Q K^T, online softmax, O += P V) the copies of tile j + 1 are in flight: rows in the
// query dtype (an unquantized cache, or the new keys) by cp.async straight into the tile; 8-bit rows and
// their scale words by cp.async into a staging area, dequantized by the thread that copied them once its
// copies land (the deep CTA at head_dim 256 loads them into registers instead, after the tile's Q K^T: see
// RawRegs). The block-table entries of tile j + 2 are read meanwhile, so no copy waits on the table.
#pragma once

#include <algorithm>
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
  int num_sms = 1;                // of the device: picks the CTA shape
  int max_smem = 99 * 1024;       // opt-in shared memory per CTA of the device, bytes: may rule out "tall", and "deep" at head_dim 256
  int shape = 0;                  // CTA shape: 0 by extend_plan, 1 wide, 2 deep, 3 tall (8-bit only, else wide),
                                  // 4 small; tall and small need head_dim <= 128, and deep at head_dim 256
                                  // sm_90's shared memory, else wide
  int num_splits = 0;             // key ranges per row block: 0 by extend_plan; > 1 needs the workspace
  float* workspace = nullptr;     // extend_workspace_floats() floats: the splits' partials, combined by a merge
  bool dependent_merge = false;   // launch the merge as a programmatic dependent of the split kernel (sm_90+)
  bool dependent_kernel = false;  // launch the kernel as a programmatic dependent of the kernel before it (sm_90+)
  float sm_scale = 1.0f;
  bool causal = true;
  int window_left = -1;      // -1: none
  float logit_softcap = 0.0f;  // 0: none
  Format format = Format::kSame;
  DType dtype = DType::kBF16;  // of query, key, value and out
};

struct ExtendPlan {
  int shape, splits;  // as ExtendParams::shape (1 wide, 2 deep, 3 tall, 4 small) and ::num_splits, both resolved
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
// The "wide" CTA: 4 warps of two m-tiles (one at d256, so that O, 128 fp32 per thread, and S stay in
// registers). Key tiles of 64 at d64, and at d128 over a bf16/fp16 cache: there they spill 64 bytes of
// registers (sm_90), yet halve the Q fragment loads, barriers and row reductions per key, and took 3-6% less
// time than 32-key tiles on an H200 (32/8 heads: 2048 new tokens with no prefix 135.3 -> 131.1 us, 8192 1907
// -> 1810, 2048 over a 32k prefix 4449 -> 4214). 32 for an 8-bit d128 cache, whose raw rows and scales would
// take two stages past the 99 KB of shared memory of sm_89 and sm_120, where wide serves it; 16 for an 8-bit
// d256 cache, for the same reason.
template <typename S, int D>
using WideCfg = Cfg<D, D == 64 || (D == 128 && !StorageTraits<S>::kQuantized) ? 64
                       : (D == 256 && StorageTraits<S>::kQuantized ? 16 : 32),
                    D <= 128 ? 2 : 1, 4>;
// The "tall" CTA (head_dim <= 128): 8 warps of two m-tiles, 256 rows, so a dequantized 8-bit tile serves twice
// the rows of the others, with 64-key tiles. Its Q tile takes 64 KB at d128, and an 8-bit cache then needs 148 KB
// (105 KB with 32-key tiles), more than sm_89 and sm_120 have (16-key tiles fit, but cost 30% over bf16 on an
// H200), so there it is not used. At d128 the 64-key tiles spill 64 bytes of registers (sm_90), yet took 4-10%
// less time than 32-key ones on an H200 (32/8 heads, q8_0: 8192 new tokens with no prefix 1900 -> 1719 us, 2048
// over a 32k prefix 4523 -> 4300, 8192 over 32k 19314 -> 18093; fp8_e4m3 alike).
template <int D>
using TallCfg = Cfg<D, 64, 2, 8>;
// One m-tile per warp with Q in registers and 64-key tiles (head_dim <= 128): the "deep" CTA of 8 warps (128 rows)
// and the "small" one of 4 warps (64 rows), whose row blocks split a short causal chunk's work finer.
template <int D, int W>
using DeepCfg = Cfg<D, 64, 1, W>;
// The deep CTA at head_dim 256: 8 warps of one m-tile (128 rows) with Q in shared memory, as FlashAttention-2
// runs head_dim 256, so that every K/V tile copied (and dequantized) serves twice wide's 64 rows. 64-key tiles
// (192 KB of shared memory): sm_90 only, as sm_89 and sm_120 have 99 KB, where wide serves it. An 8-bit tile's
// raw rows wait in registers (RawRegs, 40 per thread), not in shared memory: 255 registers with 32 bytes of spill
// stores and 44 of loads on sm_90. Against 48-key tiles (30 registers of raw rows, 16 bytes of spills) they took
// 0.968-0.984x the time over a prefix on an H200 (16/2 heads, 512-8192 new tokens over 4k and 32k, two alternated
// rounds: q8_0 2048 over 32k 5152 -> 4993 us, 8192 over 32k 21867 -> 21244), plain prefills 0.97-1.00x. Wide's
// 8-bit d128 tiles at 48 (95 KB, within sm_89's) took 1.01-1.05x their 32 (84 bytes of spills on sm_90), so they
// stay at 32.
template <typename S>
using Deep256Cfg = Cfg<256, 64, 1, 8>;

// Shared memory: Q; two stages of K and V tiles in T; for an 8-bit cache (but in the deep CTA at head_dim 256)
// one stage of raw rows and scale words, each written and read back by the same thread; two tiles' worth of
// page numbers. A CTA of one
// m-tile per warp ("deep") keeps its Q fragments in registers, so Q passes through the K/V stage that the
// first tile leaves free and has no space of its own: that keeps 64-key tiles of an 8-bit cache within the
// 99 KB of sm_89 and sm_120 (with Q in shared memory they took 116 KB, so it had 32-key tiles). On an H200,
// 512 new tokens over a 32k prefix (32/8 heads, d128): q8_0 1698 -> 1498 us, bf16 1264 -> 1192 us.
template <typename S, typename C>
struct Smem {
  static constexpr bool kQuant = StorageTraits<S>::kQuantized;
  static constexpr bool kQInRegs = C::kMTiles == 1 && C::kD <= 128;  // deep and small (wide at d256 has one too)
  // The deep CTA at head_dim 256 holds an 8-bit tile's raw rows and scale words in registers (RawRegs), not here.
  static constexpr bool kRawInRegs = kQuant && std::is_same_v<C, Deep256Cfg<S>>;
  static constexpr int kTile = C::kBlockN * C::kD * 2;        // a K or V tile in T
  static constexpr int kStage = 2 * kTile;
  static constexpr int kRaw = kQuant && !kRawInRegs ? C::kBlockN * C::kD : 0;  // K or V raw rows
  static constexpr int kScales = kQuant && !kRawInRegs ? C::kBlockN * C::kD / 16 * 4 : 0;  // one word per 16-byte chunk
  static constexpr int kQBytes = C::kBlockM * C::kD * 2;
  static_assert(!kQInRegs || kQBytes <= kStage, "Q must fit one K/V stage");
  static constexpr int kQOff = 0;  // unless kQInRegs
  static constexpr int kKVOff = kQInRegs ? 0 : kQBytes;  // stage s: K at kKVOff + s * kStage, then V
  static constexpr int kRawOff = kKVOff + 2 * kStage;     // K raw, V raw, K scale words, V scale words
  static constexpr int kPages = kRawOff + 2 * kRaw + 2 * kScales;
  static constexpr int kBytes = kPages + 2 * C::kBlockN * 4;
  static constexpr bool kFits = kBytes <= 99 * 1024;  // the shared memory of a CTA on sm_89 and sm_120
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
struct SeqInfo {
  int b, prefix, n_new, q_start, kv_len, h_kv;
};

// Page of cached key kpos (< prefix) from the block table, or -1 when the table holds none or a page outside
// [0, num_pages). Looked up one tile ahead of the loads that need it, so a load never waits on the table.
template <typename S>
__device__ __forceinline__ int lookup_page(const paged_kv_t<S>& cache, const SeqInfo& s, const FastDivmod& pdm,
                                           int kpos) {
  if (kpos >= s.prefix) return -1;
  int idx, off;
  pdm.divmod(kpos, idx, off);
  const int page = idx < cache.max_pages ? __ldg(cache.block_table + s.b * cache.block_table_stride + idx) : -1;
  return cache.valid_page(page) ? page : -1;
}

// Issue the copies of keys [n0, n0 + BLOCK_N) of K and V into one stage: rows in the query dtype (cache of
// the same dtype, or new keys) straight into the T tiles, 8-bit rows and their scales into the raw area.
// `pages` holds the page of each row (from lookup_page). Rows at or past kv_len and rows of an invalid
// page become zeros.
template <typename T, typename S, typename C>
__device__ __forceinline__ void issue_tile(const ExtendParams& p, const paged_kv_t<S>& cache, const SeqInfo& s,
                                           const FastDivmod& pdm, int n0, uint32_t stage, uint32_t raw,
                                           const int* pages) {
  using L = Smem<S, C>;
  constexpr int D = C::kD, BN = C::kBlockN, kThreads = C::kThreads;
  constexpr bool kQuant = StorageTraits<S>::kQuantized;
  const int tid = threadIdx.x;
  const T* k_new = static_cast<const T*>(p.key);
  const T* v_new = static_cast<const T*>(p.value);
  auto fresh = [&](const T* base, int64_t st_tok, int64_t st_head, int kpos) {
    return base + int64_t(s.q_start + kpos - s.prefix) * st_tok + s.h_kv * st_head;
  };
  auto offset_in_page = [&](int kpos) {
    int idx, off;
    pdm.divmod(kpos, idx, off);
    return off;
  };

  // Rows in T: 16-byte chunks, kCpr per row.
  {
    constexpr int kCpr = D / 8, kRpp = kThreads / kCpr;
    static_assert(BN % kRpp == 0 && BN % (kThreads / (D / 16)) == 0, "every thread copies whole rows of a tile");
    const int c = tid % kCpr;
#pragma unroll
    for (int it = 0; it < BN / kRpp; ++it) {
      const int r = tid / kCpr + it * kRpp;
      const int kpos = n0 + r;
      if (kQuant && kpos < s.prefix) continue;  // 8-bit: below
      const T *ksrc = k_new, *vsrc = v_new;
      int bytes = 0;
      if (kpos < s.prefix) {
        const int page = pages[r];
        if (page >= 0) {
          const int off = offset_in_page(kpos);
          ksrc = static_cast<const T*>(p.k_cache) + cache.k_offset(page, off, s.h_kv) + c * 8;
          vsrc = static_cast<const T*>(p.v_cache) + cache.v_offset(page, off, s.h_kv) + c * 8;
          bytes = 16;
        }
      } else if (kpos < s.kv_len) {
        ksrc = fresh(k_new, p.k_stride_tok, p.k_stride_head, kpos) + c * 8;
        vsrc = fresh(v_new, p.v_stride_tok, p.v_stride_head, kpos) + c * 8;
        bytes = 16;
      }
      cp_async16(stage + swz<D>(r, c), ksrc, bytes);
      cp_async16(stage + L::kTile + swz<D>(r, c), vsrc, bytes);
    }
  }
  if constexpr (kQuant && !L::kRawInRegs) {
    if (n0 < s.prefix) {  // 8-bit rows: 16-byte chunks of 16 elements, each with the scale word it needs
      constexpr int kCpr = D / 16, kRpp = kThreads / kCpr;
      const int c = tid % kCpr;
      const uint32_t scl = raw + 2 * L::kRaw;
#pragma unroll
      for (int it = 0; it < BN / kRpp; ++it) {
        const int r = tid / kCpr + it * kRpp;
        const int kpos = n0 + r;
        if (kpos >= s.prefix) continue;
        const int page = pages[r];
        const uint8_t* kb = static_cast<const uint8_t*>(p.k_cache);
        const uint8_t* vb = static_cast<const uint8_t*>(p.v_cache);
        int64_t ke = 0, ve = 0, so = 0;
        const int bytes = page >= 0 ? 16 : 0;
        if (page >= 0) {
          const int off = offset_in_page(kpos);
          ke = cache.k_offset(page, off, s.h_kv), ve = cache.v_offset(page, off, s.h_kv);
          so = cache.scale_offset(int64_t(page) * cache.page_size + off, s.h_kv);
        }
        // Chunk it of this thread at (it * kThreads + tid) * 16; its scale (block c / 2) in the 4-byte word
        // holding blocks 2 (c / 4) and 2 (c / 4) + 1 (a row's scales start 4-byte aligned: D / 32 is even).
        const uint32_t slot = uint32_t(it * kThreads + tid);
        cp_async16(raw + slot * 16, kb + ke + c * 16, bytes);
        cp_async16(raw + L::kRaw + slot * 16, vb + ve + c * 16, bytes);
        cp_async_small<4>(scl + slot * 4, p.k_scale + so + 2 * (c / 4), page >= 0 ? 4 : 0);
        cp_async_small<4>(scl + L::kScales + slot * 4, p.v_scale + so + 2 * (c / 4), page >= 0 ? 4 : 0);
      }
    }
  }
}

// 8-bit chunk c (16 elements) of row r into a T tile at `tile`; `word` holds the scales of blocks 2 (c / 4) and
// 2 (c / 4) + 1 (a row's scales start 4-byte aligned: D / 32 is even).
template <typename T, typename S, int D>
__device__ __forceinline__ void dequant_chunk(const uint4& q, uint32_t word, int r, int c, uint32_t tile) {
  const uint16_t sc = uint16_t((c / 2) % 2 ? word >> 16 : word & 0xFFFFu);
  uint32_t w[8];
  dequant16<T, S>(q, sc, w);
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(tile + swz<D>(r, 2 * c)), "r"(w[0]), "r"(w[1]),
               "r"(w[2]), "r"(w[3]));
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(tile + swz<D>(r, 2 * c + 1)), "r"(w[4]), "r"(w[5]),
               "r"(w[6]), "r"(w[7]));
}

// Dequantize this thread's 8-bit chunks of the tile issued last into the T tiles of `stage` (x' = float(q) *
// scale, rounded once to T). Only the thread's own copies are read, so its wait for them is enough; the
// caller synchronizes the CTA before the tile is used.
template <typename T, typename S, typename C>
__device__ __forceinline__ void dequant_tile(const SeqInfo& s, int n0, uint32_t stage, uint32_t raw) {
  using L = Smem<S, C>;
  constexpr int D = C::kD, BN = C::kBlockN, kThreads = C::kThreads;
  if (n0 >= s.prefix) return;
  constexpr int kCpr = D / 16, kRpp = kThreads / kCpr;
  const int tid = threadIdx.x, c = tid % kCpr;
  const uint32_t scl = raw + 2 * L::kRaw;
#pragma unroll
  for (int it = 0; it < BN / kRpp; ++it) {
    const int r = tid / kCpr + it * kRpp;
    if (n0 + r >= s.prefix) continue;
    const uint32_t slot = uint32_t(it * kThreads + tid);
#pragma unroll
    for (int kv = 0; kv < 2; ++kv) {
      uint4 q;
      uint32_t word;
      asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(q.x), "=r"(q.y), "=r"(q.z), "=r"(q.w)
                   : "r"(raw + kv * L::kRaw + slot * 16));
      asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(word) : "r"(scl + kv * L::kScales + slot * 4));
      dequant_chunk<T, S, D>(q, word, r, c, stage + kv * L::kTile);
    }
  }
}

// The deep CTA at head_dim 256 over an 8-bit cache holds its share of the next tile's raw rows and scale words in
// registers instead of a shared-memory staging area: loaded from global memory after the current tile's Q K^T,
// dequantized into the T tiles after its P V. The same chunks per thread and the same arithmetic as issue_tile +
// dequant_tile, without the staging area's writes and read-backs (60 KB per 48-key tile of K and V, raw rows and
// scale words), about a ninth of the CTA's shared-memory traffic, which bounds it: its eight warps each read every
// K/V tile and their Q rows by ldmatrix (448 KB per tile). On an H200 (48-key tiles, 16/2 heads, 512-8192 new tokens
// over 4k and 32k prefixes, q8_0 and fp8_e4m3, two alternated rounds) 0.89-0.95x the time, and an 8-bit prefix
// 1.02-1.08x the time of a bf16 one (1.10-1.20x with the staging area). Loaded at the top of the tile instead,
// before Q K^T, they took 0.92-0.97x (28-44 bytes of spills against 16). Rows past the prefix or of an invalid page
// are zeros, as cp.async's zero fill makes them. Written with paged_kv_t::k_offset and rows past the prefix skipped
// (left unassigned, as store_raw skips them), the same loads with 64-key tiles took 1.09-1.27x the time of 48-key
// tiles over a prefix on an H200 (16/2 heads, 512-8192 new tokens over 4k and 32k, q8_0 and fp8_e4m3), where this
// form had taken 0.97-0.98x (same register count and spills), so it stays spelled out.
template <typename C>
struct RawRegs {
  static constexpr int kIt = C::kBlockN / (C::kThreads / (C::kD / 16));
  uint4 q[2][kIt];
  uint32_t w[2][kIt];
};

__device__ __forceinline__ void ld_nc16(uint4& v, const void* src) {
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(src));
}
__device__ __forceinline__ void ld_nc4(uint32_t& v, const void* src) {
  asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];\n" : "=r"(v) : "l"(src));
}

template <typename S, typename C>
__device__ __forceinline__ void load_raw(const ExtendParams& p, const paged_kv_t<S>& cache, const SeqInfo& s,
                                         const FastDivmod& pdm, int n0, const int* pages, RawRegs<C>& rr) {
  constexpr int D = C::kD, kCpr = D / 16, kRpp = C::kThreads / kCpr;
  if (n0 >= s.prefix) return;
  const int tid = threadIdx.x, c = tid % kCpr;
  const uint8_t* kb = static_cast<const uint8_t*>(p.k_cache);
  const uint8_t* vb = static_cast<const uint8_t*>(p.v_cache);
#pragma unroll
  for (int it = 0; it < RawRegs<C>::kIt; ++it) {
    const int r = tid / kCpr + it * kRpp;
    const int kpos = n0 + r;
    const int page = kpos < s.prefix ? pages[r] : -1;
    if (page >= 0) {
      int idx, off;
      pdm.divmod(kpos, idx, off);
      const int64_t row = (int64_t(off) * cache.num_kv_heads + s.h_kv) * D + c * 16;
      const int64_t so = cache.scale_offset(int64_t(page) * cache.page_size + off, s.h_kv) + 2 * (c / 4);
      ld_nc16(rr.q[0][it], kb + int64_t(page) * p.k_stride_page + row);
      ld_nc16(rr.q[1][it], vb + int64_t(page) * p.v_stride_page + row);
      ld_nc4(rr.w[0][it], p.k_scale + so);
      ld_nc4(rr.w[1][it], p.v_scale + so);
    } else {
      rr.q[0][it] = rr.q[1][it] = make_uint4(0u, 0u, 0u, 0u);
      rr.w[0][it] = rr.w[1][it] = 0u;
    }
  }
}

template <typename T, typename S, typename C>
__device__ __forceinline__ void store_raw(const SeqInfo& s, int n0, uint32_t stage, const RawRegs<C>& rr) {
  using L = Smem<S, C>;
  constexpr int D = C::kD, kCpr = D / 16, kRpp = C::kThreads / kCpr;
  if (n0 >= s.prefix) return;
  const int tid = threadIdx.x, c = tid % kCpr;
#pragma unroll
  for (int it = 0; it < RawRegs<C>::kIt; ++it) {
    const int r = tid / kCpr + it * kRpp;
    if (n0 + r >= s.prefix) continue;
#pragma unroll
    for (int kv = 0; kv < 2; ++kv) dequant_chunk<T, S, D>(rr.q[kv][it], rr.w[kv][it], r, c, stage + kv * L::kTile);
  }
}

// ------------------------------------------------------------------------------------ the kernel
// A row's softmax sum from the partial sums of the 4 threads (a quad) that hold its columns.
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// The CTA's key split (blockIdx.z), read where it is used: a value kept from before the key loop to the
// epilogue costs a register that the two-m-tile CTAs, at 255, spill for.
__device__ __forceinline__ int split_index() {
  int z;
  asm volatile("mov.u32 %0, %%ctaid.z;" : "=r"(z));
  return z;
}

template <typename T, typename S, typename C>
__device__ __forceinline__ void extend_body(const ExtendParams& p, const FastDivmod& pdm, int blk_hi) {
  constexpr int D = C::kD, BN = C::kBlockN, BM = C::kBlockM, MT = C::kMTiles, kThreads = C::kThreads;
  using L = Smem<S, C>;
  extern __shared__ __align__(128) uint8_t smem[];
  const uint32_t sK = smem_addr(smem) + L::kKVOff;  // stage st: K at sK + st * kStage, V kTile further
  const uint32_t sV = sK + L::kTile;
  int* pages = reinterpret_cast<int*>(smem + L::kPages);  // [2][BN]: page of each row of the next two tiles

  const paged_kv_t<S> cache(p.num_pages, p.page_size, p.num_kv_heads, D, p.k_stride_page, p.v_stride_page,
                            p.block_table, p.block_table_stride, p.max_pages, p.prefix_lens);

  const int G = p.num_q_heads / p.num_kv_heads;
  // Grid (kv head, row block, split), row blocks from blk_hi down: the hardware dispatches x fastest, so the late
  // row blocks (more keys when causal) of every head go first. (With the heads in y, each head's blocks ran in
  // turn and the last head's longest ones started near the end.)
  const int blk = blk_hi - int(blockIdx.y);
  // Largest b with start(b) = cu[b] * G / BM + b <= blk.
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
  s.h_kv = blockIdx.x;
  const int m_blk = blk - int(int64_t(s.q_start) * G / BM + lo);
  const int row0 = m_blk * BM;  // first packed row (token * G + g) of this CTA
  if (s.n_new <= 0 || row0 >= s.n_new * G) return;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int wrow = warp * 16 * MT;  // the warp's first row in the tile
  const T* q_ptr = static_cast<const T*>(p.query);

  // Q tile: packed row r -> token (row0 + r) / G, q head h_kv * G + (row0 + r) % G; rows past the
  // sequence are zero-filled and never stored. Issued here for the wide CTA; with kQInRegs it goes to the
  // stage of tile j_begin + 1, so it is issued once j_begin is known.
  auto load_q = [&](uint32_t dst) {
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
      cp_async16(dst + swz<D>(r, c), src, ok ? 16 : 0);
    }
  };
  if constexpr (!L::kQInRegs) load_q(smem_addr(smem) + L::kQOff);

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
  int j_begin = kv_begin / BN, j_end = (kv_end + BN - 1) / BN;
  if (p.num_splits > 1) {  // this CTA's share of the row block's key tiles (32-bit math: a 64-bit division is a call)
    const int per = (j_end - j_begin + p.num_splits - 1) / p.num_splits, sp = split_index();
    j_begin = min(j_begin + sp * per, j_end);
    j_end = min(j_begin + per, j_end);
  }

  const uint32_t sQ = L::kQInRegs ? sK + ((j_begin + 1) & 1) * L::kStage : smem_addr(smem) + L::kQOff;
  if constexpr (L::kQInRegs) load_q(sQ);

  // ldmatrix sources, so that the four matrices land in fragment order: Q (A of Q K^T) and V (B of P V,
  // transposed) as (rows 0-7, chunk lo), (rows 8-15, lo), (rows 0-7, hi), (rows 8-15, hi); K (B of Q K^T)
  // as (rows 0-7, lo), (rows 0-7, hi), (rows 8-15, lo), (rows 8-15, hi). Q shares V's offsets (plus one
  // register), which keeps two m-tiles per warp within 255 registers. (Loading in another order and
  // renaming costs a register move per fragment word at every mma.)
  const int mi = lane >> 3;
  const LdmAddr<D> qv_addr(sV, (lane & 7) + (mi & 1) * 8, mi >> 1);
  const LdmAddr<D> k_addr(sK, (lane & 7) + (mi >> 1) * 8, mi & 1);
  const uint32_t q_off = sQ + uint32_t(wrow * D * 2) - sV;

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
  const float fmul = softcap ? 1.f : s_mul;  // the scale the exponent applies (below)

  // Two-stage pipeline with one barrier per tile: tile j + 1 is in flight while tile j is computed; after
  // its mmas each thread waits for its own copies of tile j + 1 and dequantizes its own 8-bit chunks of it
  // (overlapping the warps still computing), and the barrier at the top of the next iteration publishes
  // the tile. The pages of tile j + 2 are looked up meanwhile, so no copy waits on the block table.
  const uint32_t sRaw = smem_addr(smem) + L::kRawOff;
  if (tid < BN) {
    pages[(j_begin & 1) * BN + tid] = lookup_page(cache, s, pdm, j_begin * BN + tid);
    pages[((j_begin + 1) & 1) * BN + tid] = lookup_page(cache, s, pdm, (j_begin + 1) * BN + tid);
  }
  __syncthreads();
  RawRegs<C> rr;
  if (j_begin < j_end) {
    issue_tile<T, S, C>(p, cache, s, pdm, j_begin * BN, sK + (j_begin & 1) * L::kStage, sRaw,
                        pages + (j_begin & 1) * BN);
    if constexpr (L::kRawInRegs) load_raw<S, C>(p, cache, s, pdm, j_begin * BN, pages + (j_begin & 1) * BN, rr);
  }
  cp_async_commit();  // with the Q tile
  cp_async_wait_all();
  uint32_t qa[L::kQInRegs ? D / 16 : 1][4];  // Q fragments (A of Q K^T) of this warp's one m-tile
  if constexpr (L::kQInRegs) {
    __syncthreads();  // Q complete; the loop's first barrier orders these reads before tile j_begin + 1's copies
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      ldmatrix_x4(qv_addr.at(kk, 0) + q_off, qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3]);
  }
  if constexpr (L::kRawInRegs) {
    if (j_begin < j_end) store_raw<T, S, C>(s, j_begin * BN, sK + (j_begin & 1) * L::kStage, rr);
  } else if constexpr (L::kQuant) {
    if (j_begin < j_end) dequant_tile<T, S, C>(s, j_begin * BN, sK + (j_begin & 1) * L::kStage, sRaw);
  }

  for (int j = j_begin; j < j_end; ++j) {
    const int n0 = j * BN;
    const uint32_t kv_off = (j & 1) * L::kStage;
    __syncthreads();  // tile j complete for every thread; every warp is past tile j - 1, so its stage is free
    if (j + 1 < j_end)
      issue_tile<T, S, C>(p, cache, s, pdm, n0 + BN, sK + ((j + 1) & 1) * L::kStage, sRaw,
                          pages + ((j + 1) & 1) * BN);
    cp_async_commit();
    const int next_page = tid < BN ? lookup_page(cache, s, pdm, n0 + 2 * BN + tid) : -1;

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
      for (int mt = 0; mt < MT; ++mt) {
        if constexpr (L::kQInRegs) {
          a[mt][0] = qa[kk][0], a[mt][1] = qa[kk][1], a[mt][2] = qa[kk][2], a[mt][3] = qa[kk][3];
        } else {
          ldmatrix_x4(qv_addr.at(kk, mt * 16) + q_off, a[mt][0], a[mt][1], a[mt][2], a[mt][3]);
        }
      }
#pragma unroll
      for (int nb = 0; nb < BN / 16; ++nb) {
        uint32_t b0, b1, b2, b3;
        ldmatrix_x4(k_addr.at(kk, nb * 16) + kv_off, b0, b1, b2, b3);
        mma_m_tiles<T>(sc, nb, a, b0, b1, b2, b3);
      }
    }

    if constexpr (L::kRawInRegs) {  // here rather than with issue_tile: fewer registers live (RawRegs)
      if (j + 1 < j_end) load_raw<S, C>(p, cache, s, pdm, n0 + BN, pages + ((j + 1) & 1) * BN, rr);
    }

    // Scores in log2 units; only tiles crossing the diagonal, the window edge or kv_len are masked. The
    // soft-cap and mask tests are taken once per tile, outside the element loops: a branch per element
    // cuts the loop into one basic block per score and serializes the exp2 / tanh latencies. Without a
    // soft-cap the scale is not applied here but folded into the exponent below, exp2(s * scale - m), one FFMA
    // per score instead of a multiply and a subtraction (the running maxima are the same floats: the scale is
    // positive and rounding is monotonic). On an H200 that took up to 3% less time at every shape measured (32/8
    // heads, d128: bf16 8192 new tokens with no prefix 1812 -> 1789 us, q8_0 2048 over a 32k prefix 4642 -> 4522).
    const bool need_mask = n0 + BN > s.kv_len || (p.causal && n0 + BN - 1 > qmin) ||
                           (p.window_left >= 0 && n0 < qmax - p.window_left);
    auto scores = [&](auto kCap, auto kMask) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int nb = 0; nb < BN / 8; ++nb) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float x = sc[mt][nb][e];
            if constexpr (decltype(kCap)::value) x = cap_log2 * tanhf(x * s_mul);
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
    } else if (need_mask) {
      scores(No{}, Yes{});
    }

    // Online softmax; a row lives in the 4 threads of a quad. The wide CTA rescales O only when some row of
    // the warp has a new maximum (alpha != 1; x * 1 == x, so skipping it changes no bit): on an H200, 2048
    // new tokens over a 32k prefix took 1.5% (bf16) to 6% (fp8) less time. The deep CTA rescales always: with
    // the vote and branch its bf16 instance ran 7% slower and its 8-bit ones gained nothing beyond noise.
    constexpr bool kSkipRescale = !L::kQInRegs;
    float alphas[MT][2];  // kSkipRescale: kept for after the vote
    auto rescale = [&](int mt, int i, float alpha) {
#pragma unroll
      for (int db = 0; db < D / 8; ++db) o[mt][db][2 * i] *= alpha, o[mt][db][2 * i + 1] *= alpha;
    };
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        float mx = -INFINITY;
#pragma unroll
        for (int nb = 0; nb < BN / 8; ++nb) mx = fmaxf(mx, fmaxf(sc[mt][nb][2 * i], sc[mt][nb][2 * i + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m_run[mt][i], mx * fmul);
        const float m_use = m_new == -INFINITY ? 0.f : m_new;  // nothing visible yet: keep exp2 finite
        const float alpha = fast_exp2(m_run[mt][i] - m_use);
        alphas[mt][i] = alpha;
        m_run[mt][i] = m_new;
        float sum = 0.f;
#pragma unroll
        for (int nb = 0; nb < BN / 8; ++nb) {
          sc[mt][nb][2 * i] = fast_exp2(fmaf(sc[mt][nb][2 * i], fmul, -m_use));
          sc[mt][nb][2 * i + 1] = fast_exp2(fmaf(sc[mt][nb][2 * i + 1], fmul, -m_use));
          sum += sc[mt][nb][2 * i] + sc[mt][nb][2 * i + 1];
        }
        l_run[mt][i] = l_run[mt][i] * alpha + sum;
        if constexpr (!kSkipRescale) rescale(mt, i, alpha);
      }
    }
    if constexpr (kSkipRescale) {
      bool grew = false;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) grew |= alphas[mt][0] != 1.f || alphas[mt][1] != 1.f;
      if (__any_sync(0xffffffffu, grew)) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) rescale(mt, 0, alphas[mt][0]), rescale(mt, 1, alphas[mt][1]);
      }
    }

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
        ldmatrix_x4_trans(qv_addr.at(db, kk * 16) + kv_off, b0, b1, b2, b3);
        mma_m_tiles<T>(o, db, a, b0, b1, b2, b3);
      }
    }
    if (tid < BN) pages[(j & 1) * BN + tid] = next_page;  // tile j + 2's stage; read after the next barrier
    cp_async_wait_all();
    if constexpr (L::kRawInRegs) {
      if (j + 1 < j_end) store_raw<T, S, C>(s, n0 + BN, sK + ((j + 1) & 1) * L::kStage, rr);
    } else if constexpr (L::kQuant) {
      if (j + 1 < j_end) dequant_tile<T, S, C>(s, n0 + BN, sK + ((j + 1) & 1) * L::kStage, sRaw);
    }
  }

  if (p.num_splits > 1) {  // a split's partial (acc, m, l) per row, for extend_merge_kernel
    const int64_t parts = int64_t(p.total_q) * p.num_q_heads * p.num_splits;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float l = quad_sum(l_run[mt][i]);
        const int pr = row0 + wrow + mt * 16 + lane / 4 + i * 8;
        const int tok = pr / G, g = pr - tok * G;
        if (tok >= s.n_new) continue;
        const int64_t part = (int64_t(s.q_start + tok) * p.num_q_heads + s.h_kv * G + g) * p.num_splits + split_index();
        float* acc = p.workspace + part * D + (lane & 3) * 2;
#pragma unroll
        for (int db = 0; db < D / 8; ++db)
          *reinterpret_cast<float2*>(acc + db * 8) = make_float2(o[mt][db][2 * i], o[mt][db][2 * i + 1]);
        if ((lane & 3) == 0)
          *reinterpret_cast<float2*>(p.workspace + parts * D + part * 2) = make_float2(m_run[mt][i], l);
      }
    }
    return;
  }

  // Epilogue: normalize, stage this warp's rows in its own rows of sQ (only this warp ever read them),
  // then store whole 16-byte chunks. With kQInRegs, in the stage of tile j_end: every warp finished with it
  // (tile j_end - 2, or Q) before the last iteration's barrier, and no copy targets it since.
  const uint32_t sO = L::kQInRegs ? sK + (j_end & 1) * L::kStage : sQ;
  __syncwarp();
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float l = quad_sum(l_run[mt][i]);
      const float inv = l > 0.f ? 1.f / l : 0.f;  // a row that sees no key gets 0, as the reference
      const int r = wrow + mt * 16 + lane / 4 + i * 8;
#pragma unroll
      for (int db = 0; db < D / 8; ++db) {
        const uint32_t v = pack2<T>(o[mt][db][2 * i] * inv, o[mt][db][2 * i + 1] * inv);
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sO + swz<D>(r, db) + (lane & 3) * 4), "r"(v));
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
                 : "r"(sO + swz<D>(r, c)));
    *reinterpret_cast<uint4*>(out + int64_t(s.q_start + tok) * p.o_stride_tok +
                              int64_t(s.h_kv * G + g) * p.o_stride_head + c * 8) = v;
  }
}

template <typename T, typename S, typename C>
__global__ void __launch_bounds__(C::kThreads) extend_kernel(const __grid_constant__ ExtendParams p,
                                                             const __grid_constant__ FastDivmod pdm, int blk_hi) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 890 || __CUDA_ARCH__ >= 1200)
  if constexpr (!Smem<S, C>::kFits) {  // never launched there (plan_shape checks max_smem); no code for it
    __trap();
  } else
#endif
  {
    wait_for_primary();  // whatever ran before on the stream (a dependent launch; common.cuh)
    extend_body<T, S, C>(p, pdm, blk_hi);
  }
}

// grid cdiv(total_q * num_q_heads, 8), 256 threads: a warp combines the splits of one (token, q head) row, each
// lane D / 32 adjacent columns, and normalizes as the unsplit epilogue does.
template <typename T, int D>
__global__ void __launch_bounds__(256) extend_merge_kernel(const __grid_constant__ ExtendParams p) {
  constexpr int kCols = D / 32;
  wait_for_primary();  // the partials are the split kernel's
  const int64_t rows = int64_t(p.total_q) * p.num_q_heads, row = int64_t(blockIdx.x) * 8 + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x % 32, n = p.num_splits;
  const float* acc = p.workspace + row * n * D + lane * kCols;
  const float* ml = p.workspace + rows * n * D + row * n * 2;
  float mx = -INFINITY;
  for (int i = 0; i < n; ++i) mx = nanmax(mx, ml[2 * i]);
  float l = 0.f, o[kCols] = {};
  for (int i = 0; i < n; ++i) {
    const float w = part_weight(ml[2 * i], mx);
    l += ml[2 * i + 1] * w;
#pragma unroll
    for (int c = 0; c < kCols; c += 2) {
      const float2 a = *reinterpret_cast<const float2*>(acc + int64_t(i) * D + c);
      o[c] += a.x * w, o[c + 1] += a.y * w;
    }
  }
  const float inv = l > 0.f ? 1.f / l : 0.f;
  const int64_t tok = row / p.num_q_heads, h = row % p.num_q_heads;
  T* out = static_cast<T*>(p.out) + tok * p.o_stride_tok + h * p.o_stride_head + lane * kCols;
#pragma unroll
  for (int c = 0; c < kCols; c += 2) *reinterpret_cast<uint32_t*>(out + c) = pack2<T>(o[c] * inv, o[c + 1] * inv);
}

template <typename T, typename S, typename C>
cudaError_t launch(const ExtendParams& p, cudaStream_t stream) {
  const int G = p.num_q_heads / p.num_kv_heads;
  constexpr int BM = C::kBlockM;
  const int64_t blocks = (int64_t(p.total_q) * G + BM - 1) / BM + p.batch;
  const int splits = p.num_splits > 1 ? p.num_splits : 1;
  const int64_t merge_ctas = (int64_t(p.total_q) * p.num_q_heads + 7) / 8;
  if (blocks > 0x7fffffff || splits > 65535 || (splits > 1 && merge_ctas > 0x7fffffff))
    return cudaErrorInvalidConfiguration;
  if (splits > 1 && p.workspace == nullptr) return cudaErrorInvalidValue;
  static_assert(Smem<S, C>::kBytes <= 227 * 1024, "extend: a CTA must fit the shared memory of sm_90");
  constexpr size_t smem = Smem<S, C>::kBytes;
  cudaError_t err = opt_in_smem<extend_kernel<T, S, C>>(int(smem));
  if (err != cudaSuccess) return err;
  for (int64_t y0 = 0; y0 < blocks; y0 += 65535) {  // grid y holds at most 65535 row blocks per launch
    const unsigned rows = unsigned(std::min<int64_t>(blocks - y0, 65535));
    const DependentLaunch run(dim3(unsigned(p.num_kv_heads), rows, unsigned(splits)), dim3(C::kThreads), stream,
                              p.dependent_kernel, smem);
    if ((err = run(extend_kernel<T, S, C>, p, FastDivmod(p.page_size), int(blocks - 1 - y0))) != cudaSuccess)
      return err;
  }
  if (splits == 1) return cudaSuccess;
  const DependentLaunch merge(dim3(unsigned(merge_ctas)), dim3(256), stream, p.dependent_merge);
  return merge(extend_merge_kernel<T, C::kD>, p);
}

// CTAs of one instance resident on an SM of the current device (occupancy API, once per device; atomic, as
// calls may come from several host threads).
template <typename T, typename S, typename C>
int resident_ctas() {
  static std::atomic<int> cached[64];
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 1;
  int known = cached[dev].load(std::memory_order_relaxed);
  if (known == 0) {
    constexpr int smem = int(Smem<S, C>::kBytes);
    int n = 0;
    constexpr auto kernel = extend_kernel<T, S, C>;
    if (opt_in_smem<kernel>(smem) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, C::kThreads, smem) != cudaSuccess || n <= 0)
      n = 1;
    cached[dev].store(known = n, std::memory_order_relaxed);
  }
  return known;
}

// Shapes of CTA for head_dim <= 128: "wide" (4 warps of two m-tiles, 128 rows: fewer shared memory reads per mma
// than deep, two CTAs per H200 SM), "deep" (8 warps of one m-tile, 128 rows, Q in registers, 64-key tiles), "small"
// (deep's warps halved, only by the rule for plain prefills below) and, for 8-bit caches, "tall" (8 warps of two
// m-tiles, 256 rows, one CTA per SM), which dequantizes each tile once per 256 rows instead of 128. The launcher
// takes the shape of least estimated time: waves of CTAs (CTAs with rows to do, over resident CTAs x SMs, rounded
// up) x the rows an SM holds in a wave x a cost per row of the shape. The costs are times per row with every SM
// full, measured on an H200 at 1024 new tokens over a 32k prefix (32/8 heads), where tall and wide take one wave
// and deep two: at d128 8-bit tall 2161 us, wide 2572, deep 2949, bf16 wide 2059, deep 2289 (with 64-key tall
// tiles at d128, and 64-key wide ones for bf16/fp16); at d64 8-bit tall 1249, wide 1435, deep 1955, bf16 wide
// 1304, deep 1580 (before the scale was folded into the exponent). Rounding waves up is what the rule is for: at 1536 new
// tokens (d128) deep's three waves beat two of wide (bf16 3535 against 4461 us) or of tall (q8_0 4383 against
// 4589). Tall does not serve bf16/fp16 caches: without a dequantization to share it won 2-5% over a long prefix but
// lost up to 11% in a plain prefill (2048 tokens), and the launcher cannot see that a prefix is empty.
struct ShapeCosts {
  double wide, deep;  // per row, relative to tall (8-bit) or wide (bf16/fp16)
};
template <bool kQuant, int D>
constexpr ShapeCosts kShapeCosts = kQuant ? (D == 64 ? ShapeCosts{1435.0 / 1249, 1955.0 / 1249}
                                                     : ShapeCosts{2572.0 / 2161, 2949.0 / 2161})
                                          : (D == 64 ? ShapeCosts{1.0, 1580.0 / 1304} : ShapeCosts{1.0, 2289.0 / 2059});

// Splitting the keys of each row block over more CTAs (flash-decoding) fills an SM wave that too few row blocks
// leave short: a chunk of 512 new tokens at 32/8 heads makes 64 tall CTAs for 132 SMs. The estimate divides each
// CTA's time by the splits (its keys) and counts the waves of all their CTAs. Only an upper bound of a row's
// keys is known on the host (the prefix the block table can address, plus the new tokens), and each split must
// cover at least kMinSplitKeys of it, so that the merge and the partials' traffic stay small beside the keys.
// 1024 rather than 2048 (on an H200, 32/8 d128 unless noted): 64 new tokens over an 8k prefix 88.1 -> 52.6 us
// bf16, 108.1 -> 62.7 q8_0; 256 over 4k at 16/2 d256 184.2 -> 125.0 bf16; 768 over 4k q8_0 321.7 -> 287.8, but
// bf16 262.6 -> 277.6 and 256 over 4k bf16 90.4 -> 93.3; the bench shapes within 0.3%. 512 gained 256 tokens over
// a 1k prefix a third more, and lost 13.5% at 512 over 1k (bf16).
// A split must also beat the unsplit estimate by kSplitGain: over many waves, rounding gains a few percent that
// the splits' fixed costs take back (on an H200, 8192 new tokens over a 4k prefix split 5 ways for an estimated
// 2.5% took 8-11% more time: bf16 4191 -> 4514 us, q8_0 4168 -> 4635).
// Cost per row of the deep CTA at head_dim 256 in the estimate: the medians of its time per row over wide's at
// eight chunks of 256-8192 new tokens over 1k-32k prefixes on an H200 (16/2 heads; q8_0 0.71-0.81, bf16 0.75-0.86;
// e.g. 2048 over 32k q8_0 8540 -> 6176 us, bf16 6420 -> 4815; plain prefills gained less, 0.83-0.90 from 2048
// tokens). The estimate sets them against wide's cost there, kShapeCosts<kQuant, 256>.wide: 1.0 for bf16/fp16, but
// for 8-bit caches the head_dim 128 ratio to tall, 2572/2161, so 8-bit deep counts 0.62x wide, not the measured
// 0.74x (both measured with 32-key tiles over 8-bit caches; its 64-key tiles with raw rows in registers take about
// 0.78-0.88x that time over a prefix, the product of three A/B runs, so deep counts dear for them). With the rule
// below, the benchmark's nine shapes, timed after it, each took the faster of the two (wide only in the 512-token
// prefill, where the rule refuses deep), as the estimate says the sweep's others would.
template <bool kQuant>
constexpr double kDeep256Cost = kQuant ? 0.74 : 0.79;

constexpr int kMaxSplits = 8;
constexpr int64_t kMinSplitKeys = 1024;
constexpr double kSplitGain = 0.9;

template <typename T, typename S, int D>
ExtendPlan plan_shape(const ExtendParams& p) {
  using Wide = WideCfg<S, D>;
  constexpr bool kQuant = StorageTraits<S>::kQuantized;
  const int64_t G = p.num_q_heads / p.num_kv_heads;
  const int64_t table_keys = int64_t(p.max_pages) * p.page_size, chunk = (int64_t(p.total_q) + p.batch - 1) / p.batch;
  const int64_t keys = table_keys + chunk;
  auto ctas_of = [&](int rows) { return ((int64_t(p.total_q) * G + rows - 1) / rows + p.batch - 1) * p.num_kv_heads; };
  // Least estimated time of a shape over its splits (the pinned number where p.num_splits > 0).
  auto best = [&](int rows, int resident, double per_row, int& splits) {
    const int64_t ctas = ctas_of(rows);
    const int64_t slots = int64_t(resident) * p.num_sms;
    const int lo = p.num_splits > 0 ? p.num_splits : 1, hi = p.num_splits > 0 ? p.num_splits : kMaxSplits;
    auto estimate = [&](int n) {
      return double((ctas * n + slots - 1) / slots) * double(resident * rows) * per_row / n;
    };
    double least = estimate(lo);
    splits = lo;
    for (int n = lo + 1; n <= hi && keys >= n * kMinSplitKeys; ++n) {
      const double t = estimate(n);
      if (t < least && t < kSplitGain * estimate(lo)) least = t, splits = n;
    }
    return least;
  };
  int s_wide = 1;
  const double wide = best(Wide::kBlockM, resident_ctas<T, S, Wide>(), kShapeCosts<kQuant, D>.wide, s_wide);
  if constexpr (D <= 128) {
    using Deep = DeepCfg<D, 8>;
    using Small = DeepCfg<D, 4>;
    using Tall = TallCfg<D>;
    static_assert(Deep::kBlockM == Wide::kBlockM, "the same rows per CTA");
    int s_deep = 1;
    const double deep = best(Deep::kBlockM, resident_ctas<T, S, Deep>(), kShapeCosts<kQuant, D>.deep, s_deep);
    if (p.shape == 2) return {2, s_deep};
    // The estimate counts waves of equal CTAs. Under a causal mask, rows whose keys are mostly their own chunk's
    // (the block table addresses fewer keys than twice a sequence's new tokens: a prefill, or a prefix shorter
    // than the chunk) make unequal ones: the late row blocks, dispatched first, see all the keys and the early
    // ones few. Where wide's CTAs are at most two per SM, two of them then share an SM with unequal work, or one
    // has an SM to itself, which four warps use poorly; deep CTAs, one per SM, let the light ones follow the
    // heavy ones. On an H200 (32/8 heads, no prefix): d128 1024 new tokens bf16 deep 46.6 us, wide 65.2; q8_0
    // deep 49.4, the estimate's pick 74.3; 768 tokens q8_0 35.2 against 58.1; 1024 over a 1024 prefix q8_0
    // 141.5 against 148.5; d64 768 tokens bf16 23.2 against 30.7. Past that (d128 1536 tokens) wide and tall
    // are faster again.
    // Where the table addresses at most a quarter of the chunk's keys (a plain prefill) and small CTAs, half
    // deep's rows, all fit one wave, those: the heavy row blocks end sooner, with the light ones beside them. On
    // an H200 (no prefix, bf16 / q8_0, deep against small): 32/8 d128 256 new tokens 13.0 / 13.6 -> 11.4 / 11.7
    // us, 512 21.3 / 22.2 -> 20.8 / 21.7; 32/8 d64 512 14.6 / 16.7 -> 13.3 / 15.4; 9/3 d64 1024 24.2 / 28.4 ->
    // 19.7 / 23.9. Not beyond one wave (32/8 d128 768 tokens 29.1 -> 31.0, 1024 42.5 -> 47.6), nor over a prefix
    // as long as the chunk (512 over 512 40.0 -> 44.1), where every block reads all of it twice as often.
    const bool triangle = p.causal && p.window_left < 0 && table_keys < 2 * chunk;
    if (p.shape == 4 || (p.shape == 0 && triangle && 4 * table_keys <= chunk)) {
      const int small_resident = resident_ctas<T, S, Small>();
      if (p.shape == 4 || ctas_of(Small::kBlockM) <= int64_t(small_resident) * p.num_sms) {
        int s_small = 1;
        best(Small::kBlockM, small_resident, kShapeCosts<kQuant, D>.deep, s_small);
        return {4, s_small};
      }
    }
    if (p.shape == 0 && triangle && ctas_of(Wide::kBlockM) <= 2 * int64_t(p.num_sms)) return {2, s_deep};
    if constexpr (kQuant) {  // no tall instance for bf16/fp16 caches
      if (p.shape != 1 && Smem<S, Tall>::kBytes <= size_t(p.max_smem)) {
        int s_tall = 1;
        const double tall = best(Tall::kBlockM, resident_ctas<T, S, Tall>(), 1.0, s_tall);
        if (p.shape == 3 || (tall <= wide && tall <= deep)) return {3, s_tall};
      }
    }
    if (p.shape == 0 && deep < wide) return {2, s_deep};
  } else {
    using Deep = Deep256Cfg<S>;
    if ((p.shape == 0 || p.shape == 2) && Smem<S, Deep>::kBytes <= size_t(p.max_smem)) {
      int s_deep = 1;
      const double deep = best(Deep::kBlockM, resident_ctas<T, S, Deep>(), kDeep256Cost<kQuant>, s_deep);
      // Not where wide's CTAs, twice as many for the same rows, would each have an SM to itself, unless the block
      // table addresses twice the chunk's keys (with no window): 512 new tokens with no prefix (64 deep CTAs at
      // 16/2 heads, too few keys to split) took 40.1 us deep against 35.4 wide (bf16; q8_0 43.8 against 42.9),
      // where 512 over a 4k prefix, 128 deep CTAs of two splits, took 183 against 231 (q8_0 233 against 310), and
      // over a 1k prefix, 66 deep CTAs: q8_0 131.9 against 151.8 us, 256 new tokens 115.7 against 135.8 (fp8_e4m3
      // alike, bf16 0.98-1.00x; `bench/results/h200-2026-12-02-extend-d256-shape-sweep.json`).
      const bool long_prefix = p.window_left < 0 && table_keys >= 2 * chunk;
      if (p.shape == 2 || (deep < wide && (long_prefix || 2 * ctas_of(Deep::kBlockM) * s_deep > p.num_sms)))
        return {2, s_deep};
    }
  }
  return {1, s_wide};
}

template <typename T, typename S, int D>
cudaError_t launch_shape(const ExtendParams& p, cudaStream_t stream) {
  if constexpr (D <= 128) {
    if constexpr (StorageTraits<S>::kQuantized) {
      if (p.shape == 3) return launch<T, S, TallCfg<D>>(p, stream);
    }
    if (p.shape == 2) return launch<T, S, DeepCfg<D, 8>>(p, stream);
    if (p.shape == 4) return launch<T, S, DeepCfg<D, 4>>(p, stream);
  } else {
    if (p.shape == 2) return launch<T, S, Deep256Cfg<S>>(p, stream);
  }
  return launch<T, S, WideCfg<S, D>>(p, stream);
}

template <typename X>
struct Type {
  using type = X;
};
// fn(Type<T>, Type<S>, integral_constant<int, D>) for the query dtype, storage format and head_dim of p.
// Instantiations: head_dim {64, 128, 256} x storage {query dtype, q8_0, fp8_e4m3} x query {bf16, fp16}.
template <typename F>
cudaError_t dispatch(const ExtendParams& p, F&& fn) {
  return KVQ_DISPATCH_DTYPE(p.dtype, T, {
    return KVQ_DISPATCH_HEAD_DIM(p.head_dim, HD, {
      constexpr std::integral_constant<int, HD> d;
      switch (p.format) {
        case Format::kSame: return fn(Type<T>{}, Type<T>{}, d);
        case Format::kQ8_0: return fn(Type<T>{}, Type<int8_t>{}, d);
        case Format::kFp8E4M3: return fn(Type<T>{}, Type<__nv_fp8_e4m3>{}, d);
      }
      return cudaErrorInvalidValue;
    });
  });
}

inline bool valid(const ExtendParams& p) {
  return p.num_kv_heads > 0 && p.num_q_heads > 0 && p.num_q_heads % p.num_kv_heads == 0 && p.page_size > 0 &&
         p.num_sms > 0 && p.num_splits >= 0 && p.num_splits <= 65535;
}

}  // namespace extend_detail

// The CTA shape and splits extend_attention will launch for p (p.shape and p.num_splits: 0 to choose, else
// pinned). Splits > 1 need extend_workspace_floats() floats at p.workspace.
inline cudaError_t extend_plan(const ExtendParams& p, ExtendPlan& plan) {
  if (!extend_detail::valid(p)) return cudaErrorInvalidValue;
  return extend_detail::dispatch(p, [&](auto t, auto s, auto d) {
    plan = extend_detail::plan_shape<typename decltype(t)::type, typename decltype(s)::type, decltype(d)::value>(p);
    return cudaSuccess;
  });
}

inline int64_t extend_workspace_floats(const ExtendParams& p, const ExtendPlan& plan) {
  return plan.splits > 1 ? int64_t(p.total_q) * p.num_q_heads * plan.splits * (p.head_dim + 2) : 0;
}

// Launch extend attention on `stream` in `plan`, which extend_plan(p) resolved (so the host plans once per call;
// splits > 1 need the workspace at p.workspace). Returns the launch error; nothing synchronizes with the host.
inline cudaError_t extend_attention(const ExtendParams& p, const ExtendPlan& plan, cudaStream_t stream) {
  if (p.total_q == 0 || p.batch == 0) return cudaSuccess;
  if (!extend_detail::valid(p) || plan.shape < 1 || plan.shape > 4 || plan.splits < 1) return cudaErrorInvalidValue;
  return extend_detail::dispatch(p, [&](auto t, auto s, auto d) {
    ExtendParams q = p;
    q.shape = plan.shape, q.num_splits = plan.splits;
    return extend_detail::launch_shape<typename decltype(t)::type, typename decltype(s)::type, decltype(d)::value>(
        q, stream);
  });
}

}  // namespace kvq
