// store_kv: quantize (or copy) new K/V rows into the paged cache; dequantize: gather slots back.
//
// Each thread owns 16 elements of one (token, head) row of K and the same of V: two 16-byte loads per tensor,
// one 16-byte store of 8-bit values (or two of bf16/fp16). Quantizing, they are consecutive, and the two lanes
// holding one 32-element block agree on its scale by one shuffle; copying, they are two 16-byte words half a
// row apart, or at head_dim 128 two words of 32-element blocks eight blocks apart (copy_runs_kernel). K, V and
// both scale planes go in one launch.
#pragma once

#include "common.cuh"
#include "dispatch.cuh"
#include "paged.cuh"

namespace kvq {

// Small CTAs: on an H200 64 threads took 0.2-2.2% less time than 256 at every store shape of the benchmark
// (8-bit and bf16; 128 threads fell in between).
constexpr int kStoreThreads = 64;
constexpr int kChunk = 16;  // elements per thread

struct StoreParams {
  const void* key = nullptr;    // [num_tokens, num_kv_heads, head_dim], 16-byte aligned rows
  const void* value = nullptr;  // same shape
  int64_t key_stride_token = 0, key_stride_head = 0;  // elements
  int64_t value_stride_token = 0, value_stride_head = 0;
  const void* slot_mapping = nullptr;  // [num_tokens] int64 or int32; -1 skips
  bool slot_is_int32 = false;
  int64_t num_tokens = 0;
  void* k_cache = nullptr;  // [num_pages, page_size, num_kv_heads, head_dim]
  void* v_cache = nullptr;
  uint16_t* k_scale = nullptr;  // [num_pages, page_size, num_kv_heads, head_dim / 32] fp16; null unquantized
  uint16_t* v_scale = nullptr;
  int64_t k_stride_page = 0, v_stride_page = 0;
  int num_pages = 0, page_size = 0, num_kv_heads = 0, head_dim = 0;
  Format format = Format::kSame;
  DType dtype = DType::kBF16;  // of key/value
  bool dependent = false;      // launched as a programmatic dependent of the kernel before it (common.cuh)
};

__device__ __forceinline__ int64_t load_slot(const void* p, bool is_int32, int64_t i) {
  return is_int32 ? static_cast<int64_t>(static_cast<const int32_t*>(p)[i]) : static_cast<const int64_t*>(p)[i];
}

// The 16 elements a, b (two 16-byte words of T) quantized to dst, and the block's scale to scale_dst.
template <typename T, typename S>
__device__ __forceinline__ void quantize_chunk(uint4 a, uint4 b, S* dst, uint16_t* scale_dst, bool write,
                                               bool writes_scale) {
  float x[kChunk];
  unpack8<T>(a, x);
  unpack8<T>(b, x + 8);
  const BlockQuant q = block_quant_pair<kChunk>(x, StorageTraits<S>::kMax);  // every lane takes part
  if (!write) return;
  uint2 lo = make_uint2(0u, 0u), hi = make_uint2(0u, 0u);
  if (q.normal) {
    lo = quant8_plain<S>(x, q.inv);
    hi = quant8_plain<S>(x + 8, q.inv);
  } else if (q.finite) {
    lo = quant8<S>(x, q.inv);
    hi = quant8<S>(x + 8, q.inv);
  }
  *reinterpret_cast<uint4*>(dst) = make_uint4(lo.x, lo.y, hi.x, hi.y);
  if (writes_scale) *scale_dst = q.scale;
}

// 16 elements of an unquantized cache: a copy of 16-byte words c and c + chunks of the row, so that the lanes of
// a row cover whole 32-byte sectors at each load and store (words 2c and 2c + 1 would leave every sector half
// written by each of two stores).
template <typename T>
__device__ __forceinline__ void copy_chunk(const T* src_row, T* dst_row, int c, int chunks, bool write) {
  const uint4 a = reinterpret_cast<const uint4*>(src_row)[c];
  const uint4 b = reinterpret_cast<const uint4*>(src_row)[c + chunks];
  if (!write) return;
  reinterpret_cast<uint4*>(dst_row)[c] = a;
  reinterpret_cast<uint4*>(dst_row)[c + chunks] = b;
}

// Divisors of the thread index and the slot, built on the host. Where the thread count and the slot count
// are below 2^31 (any cache that fits a GPU today), the kernel splits them with multiply-shift divisions in
// 32 bits (on an H200 the copy kernel for bf16 then executed 20.3M instructions instead of 26.2M: 8 kv heads,
// d128, 65536 tokens).
struct StoreDivisors {
  FastDivmod chunks, heads, page;
  bool narrow;
  FastDivmod blocks;  // 32-element blocks per token (copy_runs_kernel)
};

// Where a thread's elements of token t, kv head h (from element e of the row) are read and written: the key and
// value rows and their rows in the cache at (page, off). I is the index type each kernel computes in.
template <typename T, typename S>
struct StoreRows {
  const T* key;
  const T* value;
  S* kdst;
  S* vdst;
};
template <typename T, typename S, typename I>
__device__ __forceinline__ StoreRows<T, S> store_rows(const StoreParams& p, const paged_kv_t<S>& cache, I t, int h,
                                                      I page, I off, int e) {
  return {static_cast<const T*>(p.key) + t * p.key_stride_token + h * p.key_stride_head + e,
          static_cast<const T*>(p.value) + t * p.value_stride_token + h * p.value_stride_head + e,
          static_cast<S*>(p.k_cache) + cache.k_offset(page, off, h) + e,
          static_cast<S*>(p.v_cache) + cache.v_offset(page, off, h) + e};
}

// T: key/value dtype; S: storage element (T itself for an unquantized cache).
template <typename T, typename S>
__global__ void __launch_bounds__(kStoreThreads) store_kv_kernel(StoreParams p, const __grid_constant__ StoreDivisors dv) {
  wait_for_primary();  // the kernel before may still be writing the keys and values, or reading the cache
  const int chunks = p.head_dim / kChunk;  // even, so both lanes of a block share a row and a fate
  const int64_t total = p.num_tokens * p.num_kv_heads * chunks;
  int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool in_range = idx < total;
  if (!in_range) idx = total - 1;  // stay in the shuffles, write nothing
  int c, h;
  int64_t t;
  if (dv.narrow) {
    int row, tt;
    dv.chunks.divmod(static_cast<int>(idx), row, c);
    dv.heads.divmod(row, tt, h);
    t = tt;
  } else {
    c = static_cast<int>(idx % chunks);
    const int64_t row = idx / chunks;
    h = static_cast<int>(row % p.num_kv_heads);
    t = row / p.num_kv_heads;
  }

  const paged_kv_t<S> cache(p.num_pages, p.page_size, p.num_kv_heads, p.head_dim, p.k_stride_page, p.v_stride_page);

  const int64_t slot = load_slot(p.slot_mapping, p.slot_is_int32, t);
  const bool write = in_range && cache.valid_slot(slot);  // -1 and out-of-range slots write nothing
  const int64_t s = write ? slot : 0;
  int64_t page, off;
  if (dv.narrow) {
    int pg, o;
    dv.page.divmod(static_cast<int>(s), pg, o);
    page = pg, off = o;
  } else {
    page = s / p.page_size, off = s % p.page_size;
  }
  const bool writes_scale = (c % 2) == 0;
  const int64_t so = cache.scale_offset(s, h) + c / 2;

  // A quantizing thread takes elements [16c, 16c + 16) of its row; a copying one its words c and c + chunks.
  auto [key, value, kdst, vdst] = store_rows<T, S>(p, cache, t, h, page, off, 0);
  if constexpr (StorageTraits<S>::kQuantized) {
    key += c * kChunk, value += c * kChunk, kdst += c * kChunk, vdst += c * kChunk;
    // Both tensors' loads before either store (a load may not be moved above a store that might alias it), so
    // V's round trip overlaps K's quantizer: on an H200 the 8-bit stores took 5.5-8% less time than with V
    // loaded after K's store.
    const uint4 ka = reinterpret_cast<const uint4*>(key)[0], kb = reinterpret_cast<const uint4*>(key)[1];
    const uint4 va = reinterpret_cast<const uint4*>(value)[0], vb = reinterpret_cast<const uint4*>(value)[1];
    quantize_chunk<T, S>(ka, kb, kdst, p.k_scale + so, write, writes_scale);
    quantize_chunk<T, S>(va, vb, vdst, p.v_scale + so, write, writes_scale);
  } else {
    // A plain copy keeps each tensor's loads next to its stores: loading both first took 13-16% more time.
    copy_chunk<T>(key, kdst, c, chunks, write);
    copy_chunk<T>(value, vdst, c, chunks, write);
  }
}

// Unquantized caches at head_dim 128 (where the slot count and the thread count fit 32 bits): each warp copies 16
// consecutive 32-element blocks of the (token, kv head, head_dim) order of K and then of V, lane l the 16-byte word
// l % 4 of blocks l / 4 and l / 4 + 8, so that each of its loads and stores covers 512 contiguous bytes wherever a
// token's rows are adjacent (their blocks may belong to several tokens and slots). store_kv_kernel's rows have each
// instruction of a warp touch every other 128-byte line there (the first halves of four 256-byte rows, then the
// second halves). On an H200, against the rows in two builds alternated as processes (bf16 and fp16), this took
// 0.980-0.988x the time at 4, 8, 16 and 32 kv heads of head_dim 128 (8 heads with 65536 tokens: 139.6 -> 137.3 us, with
// 262144: 548.6 -> 538.2) and 1.004-1.005x at one; at head_dim 64 and 256, alternated with the rows in one process, it
// took 1.004-1.017x, so they keep the rows (bench/results/h200-2026-12-04-store-copy-runs.json).
constexpr int kRunsHeadDim = 128;

template <typename T>
__global__ void __launch_bounds__(kStoreThreads) copy_runs_kernel(StoreParams p, const __grid_constant__ StoreDivisors dv) {
  wait_for_primary();  // the kernel before may still be writing the keys and values, or reading the cache
  constexpr int kNB = kRunsHeadDim / kBlock;
  const int64_t num_blocks = p.num_tokens * p.num_kv_heads * kNB;
  const int lane = threadIdx.x & 31;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const paged_kv_t<T> cache(p.num_pages, p.page_size, p.num_kv_heads, kRunsHeadDim, p.k_stride_page, p.v_stride_page);
  const T* key[2];
  const T* value[2];
  T* kdst[2];
  T* vdst[2];
  bool write[2];
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const int64_t blk = warp * 16 + (lane >> 2) + 8 * u;
    int t = 0, hb = 0;
    if (blk < num_blocks) dv.blocks.divmod(static_cast<int>(blk), t, hb);
    const int h = hb / kNB, e = (hb % kNB) * kBlock + (lane & 3) * 8;  // its head, and the word's first element
    const int64_t slot = blk < num_blocks ? load_slot(p.slot_mapping, p.slot_is_int32, t) : -1;
    write[u] = cache.valid_slot(slot);  // -1 and out-of-range slots write nothing
    int page, off;
    dv.page.divmod(static_cast<int>(write[u] ? slot : 0), page, off);
    const StoreRows<T, T> r = store_rows<T, T>(p, cache, t, h, page, off, e);
    key[u] = r.key, value[u] = r.value, kdst[u] = r.kdst, vdst[u] = r.vdst;
  }
  // Each tensor's two loads, then its two stores, as store_kv_kernel copies: K first, then V.
  const auto copy = [&](const T* const* src, T* const* dst) {
    uint4 w[2];
#pragma unroll
    for (int u = 0; u < 2; ++u)
      if (write[u]) w[u] = *reinterpret_cast<const uint4*>(src[u]);
#pragma unroll
    for (int u = 0; u < 2; ++u)
      if (write[u]) *reinterpret_cast<uint4*>(dst[u]) = w[u];
  };
  copy(key, kdst);
  copy(value, vdst);
}

// The grid of store_kv_kernel and dequantize_kernel: a thread per 16-element chunk of every (token, kv head) row, and
// an error where head_dim is not a multiple of 32 or the grid exceeds 2^31 - 1 blocks.
struct ChunkGrid {
  int64_t total, blocks;
  cudaError_t error;
};
inline ChunkGrid chunk_grid(int64_t num_tokens, int num_kv_heads, int head_dim) {
  if (head_dim % kBlock != 0 || head_dim <= 0) return {0, 0, cudaErrorInvalidValue};
  const int64_t total = num_tokens * num_kv_heads * (head_dim / kChunk);
  const int64_t blocks = (total + kStoreThreads - 1) / kStoreThreads;
  return {total, blocks, blocks > 0x7FFFFFFF ? cudaErrorInvalidConfiguration : cudaSuccess};
}

inline cudaError_t store_kv(const StoreParams& p, cudaStream_t stream) {
  const auto [total, blocks, error] = chunk_grid(p.num_tokens, p.num_kv_heads, p.head_dim);
  if (error != cudaSuccess || total == 0) return error;
  return KVQ_DISPATCH_DTYPE(p.dtype, T, {
    return KVQ_DISPATCH_STORAGE(p.format, p.dtype, S, {
      if constexpr (!StorageTraits<S>::kQuantized && !std::is_same_v<S, T>) {
        return cudaErrorInvalidValue;  // an unquantized cache stores the input dtype
      } else {
        const int64_t slots = static_cast<int64_t>(p.num_pages) * p.page_size;
        const StoreDivisors dv{FastDivmod(p.head_dim / kChunk), FastDivmod(p.num_kv_heads), FastDivmod(p.page_size),
                               total <= 0x7FFFFFFF && slots <= 0x7FFFFFFF,
                               FastDivmod(p.num_kv_heads * (p.head_dim / kBlock))};
        if constexpr (!StorageTraits<S>::kQuantized) {
          if (p.head_dim == kRunsHeadDim && dv.narrow) {
            const int64_t warps = (p.num_tokens * p.num_kv_heads * (kRunsHeadDim / kBlock) + 15) / 16;
            const DependentLaunch launch(dim3(static_cast<unsigned>((warps * 32 + kStoreThreads - 1) / kStoreThreads)),
                                         dim3(kStoreThreads), stream, p.dependent);
            return launch(copy_runs_kernel<T>, p, dv);
          }
        }
        const DependentLaunch launch(dim3(static_cast<unsigned>(blocks)), dim3(kStoreThreads), stream, p.dependent);
        return launch(store_kv_kernel<T, S>, p, dv);
      }
    });
  });
}

// ------------------------------------------------------------------------------------ dequantize
struct DequantParams {
  const void* cache = nullptr;     // [num_pages, page_size, num_kv_heads, head_dim]
  const uint16_t* scale = nullptr; // [num_pages, page_size, num_kv_heads, head_dim / 32]; null unquantized
  int64_t stride_page = 0;
  int num_pages = 0, page_size = 0, num_kv_heads = 0, head_dim = 0;
  const void* slot_mapping = nullptr;  // [num_tokens] int64 or int32; -1 yields zeros
  bool slot_is_int32 = false;
  int64_t num_tokens = 0;
  void* out = nullptr;  // [num_tokens, num_kv_heads, head_dim], contiguous
  Format format = Format::kSame;
  DType cache_dtype = DType::kBF16;  // of an unquantized cache
  DType out_dtype = DType::kBF16;
};

template <typename S, typename O>
__global__ void __launch_bounds__(kStoreThreads) dequantize_kernel(DequantParams p) {
  const int chunks = p.head_dim / kChunk;
  const int64_t total = p.num_tokens * p.num_kv_heads * chunks;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= total) return;
  const int c = static_cast<int>(idx % chunks);
  const int64_t row = idx / chunks;
  const int h = static_cast<int>(row % p.num_kv_heads);
  const int64_t t = row / p.num_kv_heads;

  const paged_kv_t<S> cache(p.num_pages, p.page_size, p.num_kv_heads, p.head_dim, p.stride_page, p.stride_page);

  const int64_t slot = load_slot(p.slot_mapping, p.slot_is_int32, t);
  float x[kChunk];
  if (cache.valid_slot(slot)) {
    const int64_t page = slot / p.page_size, off = slot % p.page_size;
    const S* src = static_cast<const S*>(p.cache) + cache.k_offset(page, off, h) + c * kChunk;
    constexpr int kWords = kChunk * sizeof(S) / 4;
    uint32_t w[kWords];
#pragma unroll
    for (int i = 0; i < kWords; i += 4) *reinterpret_cast<uint4*>(w + i) = reinterpret_cast<const uint4*>(src)[i / 4];
    unpack_raw<S, kChunk>(w, x);
    if constexpr (StorageTraits<S>::kQuantized) {
      const float d = scale_to_float(p.scale[cache.scale_offset(slot, h) + c / 2]);
#pragma unroll
      for (int i = 0; i < kChunk; ++i) x[i] = __fmul_rn(x[i], d);
    }
  } else {
#pragma unroll
    for (int i = 0; i < kChunk; ++i) x[i] = 0.0f;
  }
  uint4* dst = reinterpret_cast<uint4*>(static_cast<O*>(p.out) + row * p.head_dim + c * kChunk);
  dst[0] = pack8<O>(x);
  dst[1] = pack8<O>(x + 8);
}

inline cudaError_t dequantize(const DequantParams& p, cudaStream_t stream) {
  const auto [total, blocks, error] = chunk_grid(p.num_tokens, p.num_kv_heads, p.head_dim);
  if (error != cudaSuccess || total == 0) return error;
  return KVQ_DISPATCH_STORAGE(p.format, p.cache_dtype, S, {
    return KVQ_DISPATCH_DTYPE(p.out_dtype, O, {
      dequantize_kernel<S, O><<<static_cast<unsigned>(blocks), kStoreThreads, 0, stream>>>(p);
      return cudaGetLastError();
    });
  });
}

}  // namespace kvq
