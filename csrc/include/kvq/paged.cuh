// The paged KV layout, described once (as flashinfer's paged_kv_t).
//
//   k, v:               [num_pages, page_size, num_kv_heads, head_dim]  (dense within a page)
//   k_scale, v_scale:   [num_pages, page_size, num_kv_heads, head_dim / 32] fp16, contiguous; null when
//                       the cache stores the model dtype
//   block_table:        [batch, max_pages] int32; lengths: [batch] int32 (tokens of each sequence)
// A token's slot is page * page_size + offset. Every accessor that takes an index from a tensor is
// guarded: out-of-range slots and pages are reported invalid and never dereferenced.
#pragma once

#include <cstdint>

#include "common.cuh"

namespace kvq {

// q / d and q % d for 0 <= q < 2^31 with a multiply: a token's page index and offset without an integer
// division (page_size is a runtime value and need not be a power of two). Built on the host, passed by value.
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

template <typename S>
struct paged_kv_t {
  S* k = nullptr;
  S* v = nullptr;
  uint16_t* k_scale = nullptr;  // fp16 bits
  uint16_t* v_scale = nullptr;
  int64_t k_stride_page = 0;  // elements; within a page the layout is dense
  int64_t v_stride_page = 0;
  int num_pages = 0;
  int page_size = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  const int32_t* block_table = nullptr;
  int64_t block_table_stride = 0;
  int max_pages = 0;  // columns of block_table
  const int32_t* lengths = nullptr;

  paged_kv_t() = default;
  // A cache's geometry (page strides in elements) and, where sequences are read through it, the block table
  // and the sequence lengths.
  __host__ __device__ paged_kv_t(int num_pages_, int page_size_, int num_kv_heads_, int head_dim_,
                                 int64_t k_stride_page_, int64_t v_stride_page_,
                                 const int32_t* block_table_ = nullptr, int64_t block_table_stride_ = 0,
                                 int max_pages_ = 0, const int32_t* lengths_ = nullptr)
      : k_stride_page(k_stride_page_), v_stride_page(v_stride_page_), num_pages(num_pages_),
        page_size(page_size_), num_kv_heads(num_kv_heads_), head_dim(head_dim_), block_table(block_table_),
        block_table_stride(block_table_stride_), max_pages(max_pages_), lengths(lengths_) {}

  __host__ __device__ int64_t num_slots() const { return static_cast<int64_t>(num_pages) * page_size; }
  __device__ bool valid_slot(int64_t slot) const { return slot >= 0 && slot < num_slots(); }
  __device__ bool valid_page(int64_t page) const { return page >= 0 && page < num_pages; }

  // Element offsets of one (page, offset, head) row in k / v, and of its scales.
  __device__ int64_t k_offset(int64_t page, int64_t off, int head) const {
    return page * k_stride_page + (off * num_kv_heads + head) * static_cast<int64_t>(head_dim);
  }
  __device__ int64_t v_offset(int64_t page, int64_t off, int head) const {
    return page * v_stride_page + (off * num_kv_heads + head) * static_cast<int64_t>(head_dim);
  }
  __device__ int64_t scale_offset(int64_t slot, int head) const {
    return (slot * num_kv_heads + head) * static_cast<int64_t>(head_dim / kBlock);
  }

  // Tokens of sequence b, clamped to what its block_table row can hold.
  __device__ int length(int b) const {
    const int n = lengths[b];
    const int64_t cap = static_cast<int64_t>(max_pages) * page_size;
    return n < 0 ? 0 : (n > cap ? static_cast<int>(cap) : n);
  }
  // The page holding token t of sequence b (t < length(b)), or -1 when the table points outside the cache.
  __device__ int64_t page_of(int b, int t) const { return page_at(b, t / page_size); }
  // Entry idx of sequence b's block-table row (idx < max_pages), or -1 when it points outside the cache.
  __device__ int64_t page_at(int b, int idx) const {
    const int64_t p = block_table[b * block_table_stride + idx];
    return valid_page(p) ? p : -1;
  }
};

}  // namespace kvq
