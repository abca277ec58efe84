// The CUDA implementations of the kvq ops (schemas in kvq/ops.py) and the checks their adapters share.
//
// Adapters check metadata only (dtype, shape, device, strides, alignment), with messages in the style of
// kvq/_checks.py; index contents (slots, pages, lengths) are checked in Python when allowed, and the
// kernels guard every access either way.
#pragma once

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <climits>
#include <cstdio>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>


void store_kv_cuda(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                   const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                   const at::Tensor& slot_mapping);

void decode_attention_cuda(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                           const at::Tensor& block_table, const at::Tensor& seq_lens, double sm_scale,
                           int64_t window_left, double logit_softcap, at::Tensor& out);

void extend_attention_cuda(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                           const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                           const at::Tensor& block_table, const at::Tensor& prefix_lens,
                           const at::Tensor& cu_seqlens_q, double sm_scale, bool causal, int64_t window_left,
                           double logit_softcap, at::Tensor& out);

at::Tensor dequantize_cuda(const at::Tensor& cache, const std::optional<at::Tensor>& scale,
                           const at::Tensor& slot_mapping, at::ScalarType dtype);

// Which decode kernel serves decode_attention: 0 = by rule (decode.cu's kTensorCoreGroup), 1 = the FMA
// kernel, 2 = the tensor-core kernel. Returns the previous choice; for benchmarks and tests.
int kvq_set_decode_kernel(int choice);
// How the tensor-core decode kernel maps kv heads: 0 = by rule (decode.cu), 1 = one per CTA, 2 = one per warp
// (in CTAs of as many warps as the largest divisor of the kv heads up to its warps). Returns the previous choice;
// for benchmarks and tests.
int kvq_set_decode_heads(int choice);
// How the decode merge is launched: 0 = as a programmatic dependent launch where the device can (compute
// capability 9.0 and newer), 1 = never (plain stream order). Returns the previous choice; for benchmarks and tests.
int kvq_set_decode_pdl(int choice);
// How many splits of the sequence the decode kernels combine in their merge: 0 = by rule (decode.cu), n = n, for
// 1 <= n <= kvq_max_decode_splits. Returns the previous choice; for benchmarks and tests (every merge kernel).
constexpr int kvq_max_decode_splits = 256;
int kvq_set_decode_splits(int splits);
// Which CTA shape serves extend_attention: 0 = by estimated time (extend.cuh's plan_shape), 1 = wide, 2 = deep,
// 3 = tall (8-bit caches where the device's shared memory holds it, else wide).
// Returns the previous choice; for benchmarks and tests.
int kvq_set_extend_shape(int choice);
// How many ranges the keys of each extend row block are split into (merged after): 0 = by estimated time
// (extend.cuh's plan_shape), n = n. Returns the previous choice; for benchmarks and tests.
int kvq_set_extend_splits(int choice);
// How the extend kernels are launched: 0 = the kernel as a programmatic dependent of the kernel before it and the
// merge of split keys as one of the kernel, where the device can (compute capability 9.0 and newer); 1 = plain
// stream order; 2 = the merge only. Returns the previous choice; for benchmarks and tests.
int kvq_set_extend_pdl(int choice);
// How store_kv is launched: 0 = as a programmatic dependent of the kernel before it where the device can (compute
// capability 9.0 and newer), 1 = plain stream order. Returns the previous choice; for benchmarks and tests.
int kvq_set_store_pdl(int choice);

// The architectures this extension was compiled for, e.g. "8.9;9.0;12.0".
const char* kvq_cuda_archs();

// The helpers below need the CUDA headers; register.cpp (plain C++) only needs the declarations above.
#ifdef __CUDACC__
#include "kvq/common.cuh"

namespace kvq_torch {

// Messages are assembled with std::to_string, not by streaming numbers into a std::ostream: streaming an
// integer from inside this extension crashed (in std::num_put) when it was built with another host compiler
// than torch's, so numbers never reach an ostream here.
inline void append(std::string& s, const std::string& x) { s += x; }
inline void append(std::string& s, const char* x) { s += x; }
// dtypes as Python spells them (torch.int8, not c10's "Char"), as kvq/_checks.py's messages do.
inline void append(std::string& s, at::ScalarType x) {
  switch (x) {
    case at::kChar: s += "torch.int8"; return;
    case at::kFloat8_e4m3fn: s += "torch.float8_e4m3fn"; return;
    case at::kBFloat16: s += "torch.bfloat16"; return;
    case at::kHalf: s += "torch.float16"; return;
    case at::kFloat: s += "torch.float32"; return;
    case at::kInt: s += "torch.int32"; return;
    case at::kLong: s += "torch.int64"; return;
    default: s += c10::toString(x);
  }
}
inline void append(std::string& s, const at::Device& x) { s += x.str(); }
template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
inline void append(std::string& s, T x) { s += std::to_string(x); }
inline void append(std::string& s, double x) {  // %g: std::to_string prints -1e-9 as "-0.000000"
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", x);
  s += buf;
}
template <typename... A>
inline std::string cat(const A&... a) {
  std::string s;
  (append(s, a), ...);
  return s;
}

#define KVQ_CHECK(op, cond, ...) TORCH_CHECK_VALUE(cond, ::kvq_torch::cat("kvq.", op, ": ", __VA_ARGS__))

inline std::string shape_str(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + "]";
}

inline bool is_float16ish(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }

inline kvq::DType to_dtype(at::ScalarType t) { return t == at::kBFloat16 ? kvq::DType::kBF16 : kvq::DType::kFP16; }

// The storage format a cache dtype stands for (int8 = q8_0, float8_e4m3fn = fp8_e4m3, bf16/fp16 = itself).
inline kvq::Format to_format(at::ScalarType t) {
  if (t == at::kChar) return kvq::Format::kQ8_0;
  if (t == at::kFloat8_e4m3fn) return kvq::Format::kFp8E4M3;
  return kvq::Format::kSame;
}

// An attribute of a device, cached (`fallback` if the query fails; atomic, as calls may come from several host
// threads).
template <cudaDeviceAttr kAttr>
inline int device_attribute(int device, int fallback) {
  static std::atomic<int> cached[64];
  if (device < 0 || device >= 64) return fallback;
  int n = cached[device].load(std::memory_order_relaxed);
  if (n == 0) {
    if (cudaDeviceGetAttribute(&n, kAttr, device) != cudaSuccess || n <= 0) n = fallback;
    cached[device].store(n, std::memory_order_relaxed);
  }
  return n;
}

// Multiprocessors of a device (132 if the query fails): sizes split counts and CTA shapes.
inline int sm_count(int device) { return device_attribute<cudaDevAttrMultiProcessorCount>(device, 132); }
// Shared memory a CTA may opt in to, bytes (that of sm_89 and sm_120 if the query fails).
inline int smem_optin(int device) {
  return device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(device, 99 * 1024);
}
// The major compute capability (8 if the query fails): programmatic dependent launch needs 9 or more.
inline int compute_major(int device) { return device_attribute<cudaDevAttrComputeCapabilityMajor>(device, 8); }
// Which kernels of an attention op are launched as programmatic dependents, from a set_*_pdl choice (0 the first
// kernel and the merge, 1 none, 2 the merge only): none on a device below compute capability 9.0.
struct DependentLaunches {
  bool first, merge;
};
inline DependentLaunches dependent_launches(int choice, int device) {
  const int c = compute_major(device) >= 9 ? choice : 1;
  return {c == 0, c == 0 || c == 2};
}

// Token positions the attention kernels take (a block table's max_pages x page_size, plus an extend's new
// tokens): 2^30 keeps their 32-bit position arithmetic (split spans rounded up to whole tiles) from overflowing.
constexpr int64_t kMaxPositions = int64_t{1} << 30;
inline void check_positions(const char* op, const at::Tensor& block_table, int64_t page_size, int64_t new_tokens) {
  const int64_t paged = block_table.size(1) * page_size;
  KVQ_CHECK(op, paged + new_tokens <= kMaxPositions, "block_table addresses ", paged, " tokens (max_pages x "
            "page_size)", new_tokens > 0 ? " and the query has " + std::to_string(new_tokens) + " new ones" : "",
            "; the CUDA kernels take at most ", kMaxPositions,
            " positions: pass a block table no wider than the longest sequence needs");
}

inline bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

inline void check_tensor(const char* op, const char* name, const at::Tensor& t, int64_t ndim,
                         std::initializer_list<at::ScalarType> dtypes, const at::Device& device) {
  KVQ_CHECK(op, t.dim() == ndim, name, " must have ", ndim, " dims, got shape ", shape_str(t));
  bool ok = false;
  std::string names;
  for (auto d : dtypes) {
    ok |= t.scalar_type() == d;
    names += (names.empty() ? "" : " or ") + cat(d);
  }
  KVQ_CHECK(op, ok, name, " has dtype ", t.scalar_type(), "; expected ", names);
  KVQ_CHECK(op, t.device() == device, name, " is on ", t.device(), " but the cache is on ", device);
}

struct CacheInfo {
  int64_t num_pages, page_size, num_kv_heads, head_dim;
  bool quantized;
};

// Validates a K/V cache pair and its scale planes (mirrors kvq/_checks.py check_cache). `single`: one cache and
// its scale plane, passed as both (dequantize), so that messages name "cache" and "scale".
inline CacheInfo check_cache(const char* op, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                             bool single = false) {
  const auto dev = k_cache.device();
  const char* k_name = single ? "cache" : "k_cache";
  KVQ_CHECK(op, dev.is_cuda(), k_name, " is on ", dev, "; the CUDA kernels need CUDA tensors");
  for (auto* c : {&k_cache, &v_cache}) {
    check_tensor(op, c == &k_cache ? k_name : "v_cache", *c, 4,
                 {at::kChar, at::kFloat8_e4m3fn, at::kBFloat16, at::kHalf}, dev);
  }
  KVQ_CHECK(op, k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(), "k_cache ",
            shape_str(k_cache), " ", k_cache.scalar_type(), " and v_cache ", shape_str(v_cache), " ",
            v_cache.scalar_type(), " must have the same shape and dtype");
  CacheInfo info{k_cache.size(0), k_cache.size(1), k_cache.size(2), k_cache.size(3), !is_float16ish(k_cache.scalar_type())};
  const int64_t d = info.head_dim, hkv = info.num_kv_heads;
  KVQ_CHECK(op, d % kvq::kBlock == 0, "head_dim ", d, " is not a multiple of ", kvq::kBlock);
  KVQ_CHECK(op, info.page_size >= 1 && hkv >= 1 && info.num_pages >= 1, "cache shape ", shape_str(k_cache),
            " has an empty dimension");
  // The kernels hold page indices, page offsets and slots in 32 bits.
  KVQ_CHECK(op, info.num_pages * info.page_size <= INT32_MAX, "cache shape ", shape_str(k_cache), " has ",
            info.num_pages * info.page_size, " slots (num_pages x page_size); the CUDA kernels address at most ",
            INT32_MAX, ": use several caches (e.g. one per layer)");
  for (auto* c : {&k_cache, &v_cache}) {
    const char* name = c == &k_cache ? k_name : "v_cache";
    KVQ_CHECK(op, c->stride(3) == 1 && c->stride(2) == d && c->stride(1) == hkv * d, name,
              " must be contiguous within a page ([page_size, num_kv_heads, head_dim] dense)");
    KVQ_CHECK(op, aligned16(*c) && (c->stride(0) * c->element_size()) % 16 == 0, name,
              " must start on a 16-byte boundary with 16-byte aligned pages");
    // Pages may be padded apart, never overlap: a store would overwrite other tokens.
    KVQ_CHECK(op, info.num_pages == 1 || c->stride(0) >= info.page_size * hkv * d, name, " has a page stride of ",
              c->stride(0), " elements, less than a page (page_size x num_kv_heads x head_dim = ",
              info.page_size * hkv * d, "): its pages overlap; pass a cache whose pages do not (e.g. kvq.new_cache)");
  }
  for (const auto* s : {&k_scale, &v_scale}) {
    const char* name = single ? "scale" : s == &k_scale ? "k_scale" : "v_scale";
    if (!info.quantized) {
      KVQ_CHECK(op, !s->has_value(), name, " must be None for an unquantized ", k_cache.scalar_type(), " cache");
      continue;
    }
    KVQ_CHECK(op, s->has_value(), name, " is required for a ", k_cache.scalar_type(), " cache");
    const at::Tensor& t = **s;
    check_tensor(op, name, t, 4, {at::kHalf}, dev);
    KVQ_CHECK(op, t.size(0) == info.num_pages && t.size(1) == info.page_size && t.size(2) == hkv &&
                      t.size(3) == d / kvq::kBlock,
              name, " has shape ", shape_str(t), "; for a cache of shape ", shape_str(k_cache), " it must be [",
              info.num_pages, ", ", info.page_size, ", ", hkv, ", ", d / kvq::kBlock, "]");
    KVQ_CHECK(op, t.is_contiguous() && aligned16(t), name, " must be contiguous and 16-byte aligned");
  }
  return info;
}

// The paged-cache fields that the store's, decode's and extend's parameters share, from a pair check_cache passed.
template <typename Params>
inline void set_cache(Params& p, const CacheInfo& c, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
  using ScalePtr = decltype(p.k_scale);  // const for the kernels that only read the scales
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.k_scale = c.quantized ? static_cast<ScalePtr>(k_scale->data_ptr()) : nullptr;
  p.v_scale = c.quantized ? static_cast<ScalePtr>(v_scale->data_ptr()) : nullptr;
  p.k_stride_page = k_cache.stride(0);
  p.v_stride_page = v_cache.stride(0);
  p.num_pages = static_cast<int>(c.num_pages);
  p.page_size = static_cast<int>(c.page_size);
  p.num_kv_heads = static_cast<int>(c.num_kv_heads);
  p.head_dim = static_cast<int>(c.head_dim);
}

// An output the kernels write element by element: one whose elements alias each other (an expand()ed view)
// would receive several rows' results in one place.
inline void check_no_overlap(const char* op, const char* name, const at::Tensor& t) {
  KVQ_CHECK(op, at::has_internal_overlap(t) != at::MemOverlap::Yes, name,
            " has elements that share memory (an expand()ed view?); pass a tensor of its own, e.g. torch.empty_like");
}

// A [rows, heads, head_dim] tensor whose rows the kernels read with 16-byte loads: returns it, or an
// aligned copy when its base or strides are not 16-byte aligned (same values, shapes-only allocation).
inline at::Tensor aligned_rows(const at::Tensor& t) {
  const int64_t es = t.element_size();
  const bool ok = aligned16(t) && (t.stride(0) * es) % 16 == 0 && (t.stride(1) * es) % 16 == 0;
  return ok ? t : t.clone(at::MemoryFormat::Contiguous);
}

}  // namespace kvq_torch
#endif  // __CUDACC__
