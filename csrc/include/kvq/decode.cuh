// decode_attention: one query token per sequence against its paged (8-bit or bf16/fp16) cache.
//
// Flash-decoding. A CTA owns (sequence b, kv head, split); each of its warps walks its own 32-token chunks
// of the split and keeps its own softmax state (m, l, acc) for every query head of the kv head, so the
// GQA heads share each K/V load. Chunks are copied raw (8-bit values and fp16 scales) into warp-private
// shared memory with 16-byte cp.async, double buffered, and dequantized in registers:
//   QK: lane = token; s[g] = sum_blocks scale_blk * (q[g] . k_blk), q read from shared memory (broadcast)
//   PV: lane = HD/32 consecutive elements; acc[g] += p[g][t] * v[t]
// Each warp writes its partial (m, l, acc) to a workspace sized from shapes only; a merge kernel
// combines the num_splits * warps partials of each query head. No host sync, no data-dependent
// allocation: CUDA-graph capturable. Scores are in log2 units (log2(e) and sm_scale folded into q).
#pragma once

#include <algorithm>

#include "common.cuh"
#include "dispatch.cuh"
#include "paged.cuh"

namespace kvq {

// The most splits of a sequence that the merges combine (the planned counts stop here; so does the split-count knob).
constexpr int kMaxDecodeSplits = 256;

struct DecodeParams {
  const void* query = nullptr;  // [batch, num_q_heads, head_dim]
  int64_t q_stride_batch = 0, q_stride_head = 0;
  void* out = nullptr;  // [batch, num_q_heads, head_dim], query dtype
  int64_t o_stride_batch = 0, o_stride_head = 0;
  const void* k_cache = nullptr;  // [num_pages, page_size, num_kv_heads, head_dim]
  const void* v_cache = nullptr;
  const uint16_t* k_scale = nullptr;  // [num_pages, page_size, num_kv_heads, head_dim / 32] fp16 or null
  const uint16_t* v_scale = nullptr;
  int64_t k_stride_page = 0, v_stride_page = 0;
  int num_pages = 0, page_size = 0, num_kv_heads = 0, head_dim = 0;
  const int32_t* block_table = nullptr;  // [batch, max_pages]
  int64_t block_table_stride = 0;
  int max_pages = 0;
  const int32_t* seq_lens = nullptr;  // [batch]
  int batch = 0, num_q_heads = 0;
  float sm_scale = 1.0f;
  int window_left = -1;
  float logit_softcap = 0.0f;
  Format format = Format::kSame;
  DType dtype = DType::kBF16;  // of query and out
  int num_splits = 1;          // from decode_plan
  int heads_per_cta = 1;       // tensor-core kernel: 1, or its warps per CTA (one kv head per warp)
  int column_warps = 1;        // tensor-core kernel: 1, or 4 warps dividing head_dim 256 (one kv head per CTA)
  int row_heads = 1;           // tensor-core kernel: 1, or 2-3 adjacent kv heads per warp (8-bit, head_dim 64)
  float* workspace = nullptr;  // decode_workspace_floats() floats
  int num_sms = 0;               // of the device: sizes the merge
  bool dependent_merge = false;  // launch the merge as a programmatic dependent of the split kernel (sm_90+)
  bool dependent_split = false;  // launch the split kernel as a programmatic dependent of the kernel before it
};

namespace detail {

// The split kernels' partials: acc [batch, num_q_heads, parts, head_dim] first, so that its rows start
// 16-byte aligned, then (m, l) [batch, num_q_heads, parts, 2].
struct Workspace {
  float* acc;
  float* ml;
};
__device__ __forceinline__ Workspace workspace_of(const DecodeParams& p, int parts) {
  return {p.workspace, p.workspace + static_cast<int64_t>(p.batch) * p.num_q_heads * parts * p.head_dim};
}

constexpr int kChunkTokens = 32;
constexpr int kStages = 2;
constexpr float kLog2e = 1.4426950408889634f;

template <typename S, int HD>
struct DecodeConfig {
  static constexpr int kRowBytes = HD * static_cast<int>(sizeof(S));
  static constexpr int kRowStride = kRowBytes + 16;  // padding: lanes reading different rows hit different banks
  static constexpr int kScaleBytes = StorageTraits<S>::kQuantized ? HD / kBlock * 2 : 0;  // per row
  static constexpr int kWarps = kRowBytes <= 256 ? 4 : 2;
  static constexpr int kStageBytes = 2 * kChunkTokens * (kRowStride + kScaleBytes);
  static constexpr int kE = HD / 32;  // elements per lane in PV
};

template <typename S, int HD, int GMAX>
constexpr int decode_smem_bytes() {
  using C = DecodeConfig<S, HD>;
  return GMAX * HD * 4 + C::kWarps * (GMAX * kChunkTokens * 4 + kStages * C::kStageBytes);
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// 16 bytes global -> shared, bypassing L1; src_bytes == 0 zero-fills (a masked or invalid row).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes));
}
template <int N>
__device__ __forceinline__ void cp_async_small(void* dst, const void* src, int src_bytes) {
  static_assert(N == 4 || N == 8 || N == 16, "cp.async sizes");
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(smem_addr(dst)), "l"(src), "n"(N),
               "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

template <int NB>
__device__ __forceinline__ void load_words(const unsigned char* p, uint32_t* w) {
  if constexpr (NB == 16) {
    *reinterpret_cast<uint4*>(w) = *reinterpret_cast<const uint4*>(p);
  } else if constexpr (NB == 8) {
    *reinterpret_cast<uint2*>(w) = *reinterpret_cast<const uint2*>(p);
  } else if constexpr (NB == 4) {
    w[0] = *reinterpret_cast<const uint32_t*>(p);
  } else {
    static_assert(NB == 2, "row slice sizes");
    w[0] = *reinterpret_cast<const uint16_t*>(p);
  }
}

// The paged layout as the decode kernels see it (values are addressed through byte offsets).
template <typename S, int HD>
__device__ __forceinline__ paged_kv_t<S> decode_cache(const DecodeParams& p) {
  return paged_kv_t<S>(p.num_pages, p.page_size, p.num_kv_heads, HD, p.k_stride_page, p.v_stride_page, p.block_table,
                       p.block_table_stride, p.max_pages, p.seq_lens);
}

// The tokens one warp of a split walks. The split's share of the visible keys [start, L) is a run of whole
// kTileTokens-token tiles; its warps take them round robin: tile c of the warp starts at first + c * step,
// for c < count, and no tile reaches past end.
struct WarpTokens {
  int first, end, step, count;
};
template <int kTileTokens>
__device__ __forceinline__ WarpTokens warp_tokens(const DecodeParams& p, int L, int split, int warp, int warps) {
  const int start = p.window_left >= 0 ? max(0, L - 1 - p.window_left) : 0;
  const int n = L - start;
  const int span = ((n + p.num_splits - 1) / p.num_splits + kTileTokens - 1) / kTileTokens * kTileTokens;
  const int begin = min(L, start + split * span);
  WarpTokens w;
  w.end = min(L, begin + span);
  w.first = begin + warp * kTileTokens;
  w.step = warps * kTileTokens;
  w.count = w.end > w.first ? (w.end - w.first + w.step - 1) / w.step : 0;
  return w;
}

// grid (num_splits, num_kv_heads, batch); block kWarps * 32.
template <typename S, int HD, int GMAX>
__global__ void __launch_bounds__(DecodeConfig<S, HD>::kWarps * 32)
    decode_split_kernel(DecodeParams p) {
  using C = DecodeConfig<S, HD>;
  constexpr bool kQuant = StorageTraits<S>::kQuantized;
  constexpr int kC16 = C::kRowBytes / 16;       // 16-byte pieces per row
  constexpr int kEPC = 16 / sizeof(S);          // elements per piece
  constexpr int kPPB = kBlock / kEPC;           // pieces per 32-element block
  constexpr int kE = C::kE;

  extern __shared__ __align__(16) unsigned char smem[];
  float* q_s = reinterpret_cast<float*>(smem);  // [GMAX][HD]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* p_s = q_s + GMAX * HD + warp * GMAX * kChunkTokens;  // [GMAX][32], this warp's
  unsigned char* stage_base = smem + (GMAX * HD + C::kWarps * GMAX * kChunkTokens) * 4 +
                              warp * kStages * C::kStageBytes;

  launch_dependents();
  wait_for_primary();  // whatever ran before on the stream (see common.cuh)
  const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int G = p.num_q_heads / p.num_kv_heads;

  const paged_kv_t<S> cache = decode_cache<S, HD>(p);

  // Queries of this kv head, scaled so that q . k is the logit in log2 units (or in natural units
  // when a softcap must see it).
  const bool softcap = p.logit_softcap > 0.0f;
  const float qscale = softcap ? p.sm_scale : p.sm_scale * kLog2e;
  for (int i = threadIdx.x; i < GMAX * HD; i += blockDim.x) {
    const int g = i / HD, d = i % HD;
    float x = 0.0f;
    if (g < G) {
      const int64_t o = b * p.q_stride_batch + (kvh * G + g) * p.q_stride_head + d;
      x = p.dtype == DType::kBF16 ? to_float(static_cast<const __nv_bfloat16*>(p.query)[o])
                                  : to_float(static_cast<const __half*>(p.query)[o]);
    }
    q_s[i] = x * qscale;
  }
  __syncthreads();

  const WarpTokens wt = warp_tokens<kChunkTokens>(p, cache.length(b), split, warp, C::kWarps);
  const int end = wt.end, first = wt.first, step = wt.step, num_chunks = wt.count;

  const unsigned char* kbase = static_cast<const unsigned char*>(p.k_cache);
  const unsigned char* vbase = static_cast<const unsigned char*>(p.v_cache);

  // Issue the copies of chunk c (tokens first + c * step + [0, 32)) into stage c % kStages.
  auto issue = [&](int c) {
    unsigned char* st = stage_base + (c % kStages) * C::kStageBytes;
    unsigned char* ks = st;
    unsigned char* vs = st + kChunkTokens * C::kRowStride;
    unsigned char* kss = st + 2 * kChunkTokens * C::kRowStride;
    unsigned char* vss = kss + kChunkTokens * C::kScaleBytes;
    const int t = first + c * step + lane;
    int64_t page = -1, off = 0;
    if (t < end) {
      page = cache.page_of(b, t);
      off = t % p.page_size;
    }
    const bool ok = page >= 0;
    const int64_t kofs = ok ? cache.k_offset(page, off, kvh) * static_cast<int64_t>(sizeof(S)) : 0;
    const int64_t vofs = ok ? cache.v_offset(page, off, kvh) * static_cast<int64_t>(sizeof(S)) : 0;
#pragma unroll
    for (int i = 0; i < kC16; ++i) {
      const int idx = i * 32 + lane;
      const int r = idx / kC16, piece = idx % kC16;
      const int64_t ko = __shfl_sync(0xffffffffu, kofs, r);
      const int64_t vo = __shfl_sync(0xffffffffu, vofs, r);
      const int bytes = __shfl_sync(0xffffffffu, ok ? 16 : 0, r);
      cp_async16(ks + r * C::kRowStride + piece * 16, kbase + ko + piece * 16, bytes);
      cp_async16(vs + r * C::kRowStride + piece * 16, vbase + vo + piece * 16, bytes);
    }
    if constexpr (kQuant) {
      const int64_t so = ok ? cache.scale_offset(page * p.page_size + off, kvh) : 0;
      cp_async_small<C::kScaleBytes>(kss + lane * C::kScaleBytes, p.k_scale + so, ok ? C::kScaleBytes : 0);
      cp_async_small<C::kScaleBytes>(vss + lane * C::kScaleBytes, p.v_scale + so, ok ? C::kScaleBytes : 0);
    }
  };

  float m[GMAX], l[GMAX], acc[GMAX][kE];
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.0f;
#pragma unroll
    for (int e = 0; e < kE; ++e) acc[g][e] = 0.0f;
  }

  if (num_chunks > 0) issue(0);
  cp_async_commit();
  for (int c = 0; c < num_chunks; ++c) {
    if (c + 1 < num_chunks) issue(c + 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncwarp();
    const unsigned char* st = stage_base + (c % kStages) * C::kStageBytes;
    const unsigned char* ks = st;
    const unsigned char* vs = st + kChunkTokens * C::kRowStride;
    const uint16_t* kss = reinterpret_cast<const uint16_t*>(st + 2 * kChunkTokens * C::kRowStride);
    const uint16_t* vss = kss + kChunkTokens * C::kScaleBytes / 2;

    // ---- QK: lane = token
    const int t = first + c * step + lane;
    const bool valid = t < end && cache.page_of(b, t) >= 0;
    float s[GMAX];
#pragma unroll
    for (int g = 0; g < GMAX; ++g) s[g] = 0.0f;
#pragma unroll 1  // a rolled loop over blocks keeps the code (and the build) small; the FMAs dominate
    for (int blk = 0; blk < HD / kBlock; ++blk) {
      float part[GMAX];
#pragma unroll
      for (int g = 0; g < GMAX; ++g) part[g] = 0.0f;
#pragma unroll
      for (int h = 0; h < kPPB; ++h) {
        const int piece = blk * kPPB + h;
        uint32_t w[4];
        load_words<16>(ks + lane * C::kRowStride + piece * 16, w);
        float kf[kEPC];
        unpack_raw<S, kEPC>(w, kf);
#pragma unroll
        for (int g = 0; g < GMAX; ++g) {
          if (g < G) {
            const float4* qv = reinterpret_cast<const float4*>(q_s + g * HD + piece * kEPC);
#pragma unroll
            for (int j = 0; j < kEPC / 4; ++j) {
              const float4 qq = qv[j];
              part[g] = fmaf(qq.x, kf[4 * j], part[g]);
              part[g] = fmaf(qq.y, kf[4 * j + 1], part[g]);
              part[g] = fmaf(qq.z, kf[4 * j + 2], part[g]);
              part[g] = fmaf(qq.w, kf[4 * j + 3], part[g]);
            }
          }
        }
      }
      const float sc = kQuant ? scale_to_float(kss[lane * (HD / kBlock) + blk]) : 1.0f;
#pragma unroll
      for (int g = 0; g < GMAX; ++g) s[g] = fmaf(part[g], sc, s[g]);
    }

    // ---- online softmax (per warp, per query head)
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
      if (g < G) {
        float x = s[g];
        if (softcap) x = p.logit_softcap * tanhf(x / p.logit_softcap) * kLog2e;
        x = valid ? x : -INFINITY;
        float cm = x;
#pragma unroll
        for (int o = 16; o > 0; o /= 2) cm = nanmax(cm, __shfl_xor_sync(0xffffffffu, cm, o));
        const float mn = nanmax(m[g], cm);
        float pr, corr;
        if (mn == -INFINITY) {  // nothing visible yet
          pr = 0.0f;
          corr = 1.0f;
        } else {
          pr = exp2f(x - mn);
          corr = exp2f(m[g] - mn);
        }
        m[g] = mn;
        l[g] = l[g] * corr + pr;
#pragma unroll
        for (int e = 0; e < kE; ++e) acc[g][e] *= corr;
        p_s[g * kChunkTokens + lane] = pr;
      }
    }
    __syncwarp();

    // ---- PV: lane = elements [lane * kE, lane * kE + kE)
    constexpr int kSliceBytes = kE * static_cast<int>(sizeof(S));
#pragma unroll 2
    for (int t4 = 0; t4 < kChunkTokens; t4 += 4) {
      float v[4][kE];
#pragma unroll
      for (int tt = 0; tt < 4; ++tt) {
        uint32_t w[(kSliceBytes + 3) / 4];
        load_words<kSliceBytes>(vs + (t4 + tt) * C::kRowStride + lane * kSliceBytes, w);
        unpack_raw<S, kE>(w, v[tt]);
        if constexpr (kQuant) {
          const float sc = scale_to_float(vss[(t4 + tt) * (HD / kBlock) + lane * kE / kBlock]);
#pragma unroll
          for (int e = 0; e < kE; ++e) v[tt][e] *= sc;
        }
      }
#pragma unroll
      for (int g = 0; g < GMAX; ++g) {
        if (g < G) {
          const float4 pp = *reinterpret_cast<const float4*>(p_s + g * kChunkTokens + t4);
#pragma unroll
          for (int e = 0; e < kE; ++e) {
            acc[g][e] = fmaf(pp.x, v[0][e], acc[g][e]);
            acc[g][e] = fmaf(pp.y, v[1][e], acc[g][e]);
            acc[g][e] = fmaf(pp.z, v[2][e], acc[g][e]);
            acc[g][e] = fmaf(pp.w, v[3][e], acc[g][e]);
          }
        }
      }
    }
    __syncwarp();  // the stage and p_s are rewritten by the next iteration
  }
  cp_async_wait<0>();

  // ---- this warp's partial: [batch, num_q_heads, parts] (m, l) and [batch, num_q_heads, parts, HD] acc
  const int parts = p.num_splits * C::kWarps;
  const int part = split * C::kWarps + warp;
  const Workspace ws = workspace_of(p, parts);
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
    if (g < G) {
      float lsum = l[g];
#pragma unroll
      for (int o = 16; o > 0; o /= 2) lsum += __shfl_xor_sync(0xffffffffu, lsum, o);
      const int64_t row = (static_cast<int64_t>(b) * p.num_q_heads + kvh * G + g) * parts + part;
      if (lane == 0) {
        ws.ml[row * 2] = m[g];
        ws.ml[row * 2 + 1] = lsum;
      }
#pragma unroll
      for (int e = 0; e < kE; ++e) ws.acc[row * HD + lane * kE + e] = acc[g][e];
    }
  }
}

constexpr int kMergeThreads = 256;
constexpr int kMaxParts = kMaxDecodeSplits * 4;  // splits x partials per split (<= 4 warps)

// op over the kMergeThreads values of the block (identity: op's neutral value); every thread gets the result.
template <typename Op>
__device__ __forceinline__ float block_reduce(float x, float identity, Op op, float* scratch) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) x = op(x, __shfl_xor_sync(0xffffffffu, x, o));
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = x;
  __syncthreads();
  float r = identity;
#pragma unroll
  for (int w = 0; w < kMergeThreads / 32; ++w) r = op(r, scratch[w]);
  __syncthreads();
  return r;
}

constexpr int kMergeCols = 64;  // output columns per merge CTA; head_dim is a multiple

// An output element from its combined accumulator o and sum l: 0 where l is 0 (no key was visible: seq_len 0).
// The merge kernels and a single-split tensor-core CTA all end here, so that they agree to the bit.
__device__ __forceinline__ float normalized(float o, float l) { return l == 0.0f ? 0.0f : o / l; }

// The partials of query head h of sequence b: its (m, l) pairs and its accumulator rows.
struct HeadPartials {
  const float* ml;
  const float* acc;
};
__device__ __forceinline__ HeadPartials head_partials(const DecodeParams& p, int parts, int b, int h) {
  const int64_t row = (static_cast<int64_t>(b) * p.num_q_heads + h) * parts;
  const Workspace ws = workspace_of(p, parts);
  return {ws.ml + row * 2, ws.acc + row * p.head_dim};
}

// grid (num_q_heads, batch, head_dim / kCols); block kMergeThreads: combine the partials of one query
// head for kCols of its columns. Each part's weight is computed once per CTA (one thread per part), and the
// columns are summed by kMergeThreads / kCols groups of threads over interleaved parts, so no thread walks the
// whole list of splits and a long split list of few heads still spreads over many CTAs. kPre > 0: a thread
// loads its first kPre accumulator values with the (m, l) pairs, before the reductions, so that up to
// kPre * kMergeThreads / kCols parts cost one global round trip rather than two (for long part lists, whose grids
// are small: the registers it takes would cut the occupancy of the large grids of short lists).
template <typename O, int kPre, int kCols = kMergeCols>
__global__ void __launch_bounds__(kMergeThreads) decode_merge_kernel(DecodeParams p, int parts) {
  constexpr int kGroups = kMergeThreads / kCols;
  __shared__ float w_s[kMaxParts];
  __shared__ float o_s[kMergeThreads];
  __shared__ float scratch[kMergeThreads / 32];
  wait_for_primary();  // the partials are the split kernel's
  const int h = blockIdx.x, b = blockIdx.y, tid = threadIdx.x;
  const int hd = p.head_dim;
  const auto [ml, acc] = head_partials(p, parts, b, h);
  const int g = tid / kCols, d = blockIdx.z * kCols + tid % kCols;
  float pre[kPre > 0 ? kPre : 1];
#pragma unroll
  for (int k = 0; k < kPre; ++k) {
    const int i = g + k * kGroups;
    pre[k] = i < parts ? acc[static_cast<int64_t>(i) * hd + d] : 0.0f;
  }

  float mx = -INFINITY;
  for (int i = tid; i < parts; i += kMergeThreads) mx = nanmax(mx, ml[2 * i]);
  // -inf: no key was visible (seq_len 0), and the output is 0.
  mx = block_reduce(mx, -INFINITY, [](float a, float b) { return nanmax(a, b); }, scratch);
  float lsum = 0.0f;
  for (int i = tid; i < parts; i += kMergeThreads) {
    const float w = part_weight(ml[2 * i], mx);
    w_s[i] = w;
    lsum += ml[2 * i + 1] * w;
  }
  const float L = block_reduce(lsum, 0.0f, [](float a, float b) { return a + b; }, scratch);  // also publishes w_s

  float o = 0.0f;
#pragma unroll
  for (int k = 0; k < kPre; ++k) {
    const int i = g + k * kGroups;
    if (i < parts) o += pre[k] * w_s[i];
  }
#pragma unroll 4
  for (int i = g + kPre * kGroups; i < parts; i += kGroups) o += acc[static_cast<int64_t>(i) * hd + d] * w_s[i];
  o_s[tid] = o;
  __syncthreads();
  if (tid < kCols) {
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < kGroups; ++k) sum += o_s[k * kCols + tid];
    static_cast<O*>(p.out)[b * p.o_stride_batch + h * p.o_stride_head + d] = from_float<O>(normalized(sum, L));
  }
}

// The same combine in one pass, for lists of at most kGroups * kU parts: each thread folds its (up to kU)
// parts after loading them all, and the groups meet once in shared memory: one global round trip and one
// barrier, where the kernel above takes two and five. A fold takes the largest m first and then every weight at
// once, as the kernel above does, rather than a running maximum, whose rescaling chains one exponential after
// another. -inf parts weigh 0; a NaN m makes the result NaN.
template <int N>
__device__ __forceinline__ void fold(const float (&m)[N], const float (&l)[N], const float (&o)[N], float& mf,
                                     float& lf, float& of) {
  mf = -INFINITY;
#pragma unroll
  for (int i = 0; i < N; ++i) mf = nanmax(mf, m[i]);
  lf = 0.0f, of = 0.0f;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const float w = part_weight(m[i], mf);
    lf += l[i] * w;
    of += o[i] * w;
  }
}
constexpr int kShortMergeU = 4;
constexpr int kShortMergeParts = kMergeThreads / kMergeCols * kShortMergeU;
// The narrow grid's shape (launch_decode_merge): 32 columns per CTA, and for this kernel eight parts per thread.
constexpr int kNarrowCols = 32, kNarrowU = 8;
constexpr int kNarrowMergeParts = kMergeThreads / kNarrowCols * kNarrowU;
// kCols columns per CTA, kU parts per thread: the lists of up to kMergeThreads / kCols * kU parts.
template <typename O, int kCols = kMergeCols, int kU = kShortMergeU>
__global__ void __launch_bounds__(kMergeThreads) decode_merge_short_kernel(DecodeParams p, int parts) {
  constexpr int kGroups = kMergeThreads / kCols;
  __shared__ float mlo_s[3][kMergeThreads];
  wait_for_primary();  // the partials are the split kernel's
  const int h = blockIdx.x, b = blockIdx.y, tid = threadIdx.x;
  const int hd = p.head_dim;
  const auto [ml, acc] = head_partials(p, parts, b, h);
  const int g = tid / kCols, c = tid % kCols, d = blockIdx.z * kCols + c;
  float mi[kU], li[kU], ai[kU];
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    const int i = g + u * kGroups;
    const bool ok = i < parts;
    mi[u] = ok ? ml[2 * i] : -INFINITY;
    li[u] = ok ? ml[2 * i + 1] : 0.0f;
    ai[u] = ok ? acc[static_cast<int64_t>(i) * hd + d] : 0.0f;
  }
  float m, l, o;
  fold(mi, li, ai, m, l, o);
  mlo_s[0][tid] = m, mlo_s[1][tid] = l, mlo_s[2][tid] = o;
  __syncthreads();
  if (tid < kCols) {
    float mg[kGroups], lg[kGroups], og[kGroups];
#pragma unroll
    for (int k = 0; k < kGroups; ++k) {
      const int j = k * kCols + c;
      mg[k] = mlo_s[0][j], lg[k] = mlo_s[1][j], og[k] = mlo_s[2][j];
    }
    fold(mg, lg, og, m, l, o);
    static_cast<O*>(p.out)[b * p.o_stride_batch + h * p.o_stride_head + d] = from_float<O>(normalized(o, l));
  }
}

// One warp per (sequence, query head), each lane holding head_dim / 32 adjacent columns of every part, for lists
// of at most P parts. The kernels above give a head 256 threads for each 64 columns, most of them idle with a few
// parts, and meet at barriers (the two-pass kernel also takes two round trips); at batch 64 their grids run in
// several waves. Here a lane loads all its parts at once and folds them as fold() does: one round trip, no barrier,
// a grid of batch x num_q_heads warps. Which merge serves which list: launch_decode_merge.
constexpr int kWarpMergeParts = 16;

template <typename O, int HD, int P>
__global__ void __launch_bounds__(kMergeThreads) decode_merge_warp_kernel(DecodeParams p, int parts) {
  constexpr int kC = HD / 32;  // columns per lane
  static_assert(kC % 2 == 0, "decode_merge_warp_kernel: a lane reads its columns as float2 or float4");
  using Vec = std::conditional_t<kC % 4 == 0, float4, float2>;
  constexpr int kV = kC * 4 / static_cast<int>(sizeof(Vec));  // vectors per lane and part
  wait_for_primary();  // the partials are the split kernel's
  const int64_t pair = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  if (pair >= static_cast<int64_t>(p.batch) * p.num_q_heads) return;
  const int b = static_cast<int>(pair / p.num_q_heads), h = static_cast<int>(pair % p.num_q_heads);
  const int c0 = (threadIdx.x % 32) * kC;
  const auto [ml, acc] = head_partials(p, parts, b, h);
  float m[P], l[P], o[P][kC];
#pragma unroll
  for (int u = 0; u < P; ++u) {
    const bool ok = u < parts;
    m[u] = ok ? ml[2 * u] : -INFINITY;
    l[u] = ok ? ml[2 * u + 1] : 0.0f;
    const Vec* src = reinterpret_cast<const Vec*>(acc + static_cast<int64_t>(u) * HD + c0);
#pragma unroll
    for (int v = 0; v < kV; ++v) {
      const Vec x = ok ? src[v] : Vec{};
      const float* xf = reinterpret_cast<const float*>(&x);
#pragma unroll
      for (int k = 0; k < kC / kV; ++k) o[u][v * (kC / kV) + k] = xf[k];
    }
  }
  float mx = -INFINITY;
#pragma unroll
  for (int u = 0; u < P; ++u) mx = nanmax(mx, m[u]);
  float w[P], L = 0.0f;
#pragma unroll
  for (int u = 0; u < P; ++u) {
    w[u] = part_weight(m[u], mx);
    L += l[u] * w[u];
  }
  O* out = static_cast<O*>(p.out) + b * p.o_stride_batch + h * p.o_stride_head + c0;
#pragma unroll
  for (int c = 0; c < kC; ++c) {
    float s = 0.0f;
#pragma unroll
    for (int u = 0; u < P; ++u) s += o[u][c] * w[u];
    out[c] = from_float<O>(normalized(s, L));
  }
}

}  // namespace detail

// Combine the `parts` partials of every query head into p.out, after a split kernel on the same stream.
inline cudaError_t launch_decode_merge(const DecodeParams& p, int parts, cudaStream_t stream) {
  if (parts > detail::kMaxParts) return cudaErrorInvalidValue;
  return KVQ_DISPATCH_DTYPE(p.dtype, O, {
    const DependentLaunch launch(dim3(p.num_q_heads, p.batch, p.head_dim / detail::kMergeCols),
                                 dim3(detail::kMergeThreads), stream, p.dependent_merge);
    // Up to 4 parts, one warp per query head (decode_merge_warp_kernel), and from 5 to 16 where the one-pass
    // kernel's grid would exceed a wave (eight of its CTAs per SM): on an H200, against the kernels before, in one
    // process (the faster of five alternated rounds; bf16 and q8_0, 9/3 d64, 32/8 d128, 16/2 d256, batch 1-64):
    // 2-4 parts 0.961-1.000x the time (16/2 d256 bf16 at batch 64 with 4k tokens, 2 splits: 143.6 -> 138.1 us;
    // 9/3 d64 q8_0 at batch 64 with 4k, 4 splits: 42.0 -> 40.9; 32/8 d128 at batch 8 with 1k: 0.964-0.970x);
    // 8 parts at batch 64 (16/2 d256 q8_0 with 8k tokens, 4096 one-pass CTAs) 161.3 -> 157.2 us, but 5-16 parts on
    // grids of at most 512 such CTAs (batch 1-8) 0.995-1.13x, as a warp then walks its head's parts alone.
    // One pass for 5 to 16 parts otherwise: on an H200 it took 3-9% less time than the two-pass kernel at batch
    // 1-8 with 1k-2k tokens; over 30-50 parts per thread group 5-8% more. For 17 to 64 parts where its CTAs of 32
    // columns fit one per SM (batch 1), one pass of eight parts per thread: on an H200, against the two-pass kernel
    // (two builds alternated as processes, with a second run of the old build as control, which stayed within
    // 0.2%), 0.937-0.950x the time at 9/3 d64 with 2k-4k tokens (q8_0 at 2k 4.79 -> 4.49 us), 0.974-0.981x with 8k,
    // 0.965-0.987x at 16/2 d256 with 1k-2k, 0.984-1.001x for bf16 at 32/8 d128 with 8k-128k. (Sixteen parts per
    // thread over 64 columns took 0.977-1.027x: longer folds per thread, half the CTAs.)
    // Past 16 parts the first 16 accumulators per thread are loaded early (on an H200, batch 1 with 128k
    // tokens at 32/8 d128: bf16 137.6 -> 135.6 us, q8_0 96.3 -> 94.8, fp8 91.7 -> 90.0). Past 64 parts on a grid of
    // at most one CTA per SM (batch 1), the first 32 (on an H200, batch 1 with 128k tokens: 32/8 d128 q8_0 85.3 ->
    // 85.0 us, 16/2 d256 50.3 -> 49.5, 9/3 d64 26.3 -> 25.8; on the larger grid of 32/8 d128 at batch 8 with 32k, 1.7%
    // more). Where half as many columns per CTA still fit one CTA per SM, that, and 17 early loads per thread (136
    // parts in one round trip): each CTA reads half the partials, and on an H200 the merge took 2.0 instead of
    // 2.5 us after the split kernel (32/8 d128, batch 1 with 128k tokens, 132 parts), the calls 0.9-1.0% less
    // time there, 0.3-0.5% with 256k, 1.5-2.0% at 9/3 d64 and 16/2 d256 with 128k.
    if (parts <= 4 || (parts <= detail::kWarpMergeParts && launch.ctas() > int64_t{8} * p.num_sms)) {
      constexpr int kThreads = 128;
      const int64_t warps = int64_t{p.batch} * p.num_q_heads;
      const DependentLaunch lean(dim3(static_cast<unsigned>((warps * 32 + kThreads - 1) / kThreads)), dim3(kThreads),
                                 stream, p.dependent_merge);
      return KVQ_DISPATCH_HEAD_DIM(p.head_dim, HD, {
        if (parts <= 4) return lean(detail::decode_merge_warp_kernel<O, HD, 4>, p, parts);
        return lean(detail::decode_merge_warp_kernel<O, HD, detail::kWarpMergeParts>, p, parts);
      });
    }
    if (parts <= detail::kShortMergeParts) return launch(detail::decode_merge_short_kernel<O>, p, parts);
    constexpr int kNC = detail::kNarrowCols;
    const DependentLaunch narrow(dim3(p.num_q_heads, p.batch, p.head_dim / kNC), dim3(detail::kMergeThreads), stream,
                                 p.dependent_merge);
    if (narrow.ctas() <= p.num_sms) {
      if (parts <= detail::kNarrowMergeParts)
        return narrow(detail::decode_merge_short_kernel<O, kNC, detail::kNarrowU>, p, parts);
      return narrow(detail::decode_merge_kernel<O, 17, kNC>, p, parts);
    }
    if (parts > detail::kNarrowMergeParts && launch.ctas() <= p.num_sms)
      return launch(detail::decode_merge_kernel<O, 32>, p, parts);
    return launch(detail::decode_merge_kernel<O, 16>, p, parts);
  });
}

// Warps per CTA of the split kernel (its partials per split), from the storage format and head_dim.
inline int decode_warps(Format format, DType dtype, int head_dim) {
  int warps = 0;
  cudaError_t e = KVQ_DISPATCH_STORAGE(format, dtype, S, {
    return KVQ_DISPATCH_HEAD_DIM(head_dim, HD, {
      warps = detail::DecodeConfig<S, HD>::kWarps;
      return cudaSuccess;
    });
  });
  return e == cudaSuccess ? warps : 0;
}

// Splits along the sequence, from shapes only (graph-safe): as many CTAs as the GPU holds at once
// (slots = SMs x CTAs per SM), but no split shorter than min_span tokens of the longest sequence the
// block table can hold.
//
// More (sequence, kv head) pairs than slots: CTAs of equal work run in waves, and a last wave that fills a
// fraction of the slots idles the rest for a whole CTA's time. Then take the fewest splits (up to 8, each
// at least 8 x min_span tokens) whose waves are 90% full, or the fullest. On an H200 (batch 64, 32/8 heads,
// head_dim 128: 512 pairs on 396 slots, 3 splits): bf16 6-9% less time from 8k tokens; 8-bit caches 3-9%
// less at 32k and 128k. With 1k tokens 8-bit caches took 6% more, hence the length floor.
inline int decode_num_splits(int batch, int num_kv_heads, int max_tokens, int min_span, int slots) {
  const int64_t ctas = static_cast<int64_t>(batch) * num_kv_heads;
  if (ctas <= 0 || min_span <= 0 || slots <= 0) return 1;
  const int cap = std::min((max_tokens + min_span - 1) / min_span, kMaxDecodeSplits);
  if (ctas <= slots) return std::max(1, std::min(static_cast<int>(slots / ctas), cap));
  const int most = std::min(8, std::max(1, max_tokens / (8 * min_span)));
  int best = 1;
  double best_fill = 0.0;
  for (int s = 1; s <= most; ++s) {
    const int64_t n = ctas * s, waves = (n + slots - 1) / slots;
    const double fill = static_cast<double>(n) / static_cast<double>(waves * slots);
    if (fill >= 0.9) return s;
    if (fill > best_fill) best = s, best_fill = fill;
  }
  return best;
}

inline int64_t decode_workspace_floats(int batch, int num_q_heads, int head_dim, int num_splits, int warps) {
  return static_cast<int64_t>(batch) * num_q_heads * num_splits * warps * (head_dim + 2);
}

inline cudaError_t decode_attention(const DecodeParams& p, cudaStream_t stream) {
  if (p.batch == 0) return cudaSuccess;
  if (p.num_kv_heads <= 0 || p.num_q_heads % p.num_kv_heads != 0) return cudaErrorInvalidValue;
  const int group = p.num_q_heads / p.num_kv_heads;
  if (p.batch > 65535 || p.num_kv_heads > 65535) return cudaErrorInvalidConfiguration;
  return KVQ_DISPATCH_STORAGE(p.format, p.dtype, S, {
    return KVQ_DISPATCH_HEAD_DIM(p.head_dim, HD, {
      return KVQ_DISPATCH_GROUP(group, GMAX, {
        using C = detail::DecodeConfig<S, HD>;
        constexpr int smem = detail::decode_smem_bytes<S, HD, GMAX>();
        constexpr auto kernel = detail::decode_split_kernel<S, HD, GMAX>;
        cudaError_t e = opt_in_smem<kernel>(smem);
        if (e != cudaSuccess) return e;
        const DependentLaunch split(dim3(p.num_splits, p.num_kv_heads, p.batch), dim3(C::kWarps * 32), stream,
                                    p.dependent_split, smem);
        e = split(kernel, p);
        if (e != cudaSuccess) return e;
        return launch_decode_merge(p, p.num_splits * C::kWarps, stream);
      });
    });
  });
}

}  // namespace kvq
