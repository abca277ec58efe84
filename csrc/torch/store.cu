// torch adapter for store_kv: check metadata, fill kvq::StoreParams, launch on the current stream.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <atomic>

#include "kvq/store.cuh"
#include "ops.h"

using namespace kvq_torch;

namespace {
// The store as a programmatic dependent of the kernel before it (compute capability 9.0 and newer), which it waits
// for before its first global access: its CTAs are scheduled as that kernel's last ones exit, not after it completes.
std::atomic<int> g_store_pdl{0};  // 0: where the device can, 1: never
}  // namespace

int kvq_set_store_pdl(int choice) { return g_store_pdl.exchange(choice); }

void store_kv_cuda(const at::Tensor& key,           // [num_tokens, num_kv_heads, head_dim] bf16/fp16
                   const at::Tensor& value,         // [num_tokens, num_kv_heads, head_dim] like key
                   at::Tensor& k_cache,             // [num_pages, page_size, num_kv_heads, head_dim]
                   at::Tensor& v_cache,             // same
                   const std::optional<at::Tensor>& k_scale,  // [num_pages, page_size, num_kv_heads, head_dim/32]
                   const std::optional<at::Tensor>& v_scale,
                   const at::Tensor& slot_mapping)  // [num_tokens] int64/int32, -1 skips
{
  const char* op = "store_kv";
  const CacheInfo c = check_cache(op, k_cache, v_cache, k_scale, v_scale);
  // K and V (and their scales) go to separate planes: one plane passed as both would lose the keys.
  KVQ_CHECK(op, k_cache.data_ptr() != v_cache.data_ptr(), "k_cache and v_cache are the same memory, so the values "
            "would overwrite the keys; pass separate tensors (e.g. two kvq.new_cache calls)");
  KVQ_CHECK(op, !c.quantized || k_scale->data_ptr() != v_scale->data_ptr(), "k_scale and v_scale are the same "
            "memory, so the values' scales would overwrite the keys'; pass separate tensors");
  const auto dev = k_cache.device();
  for (auto* t : {&key, &value}) {
    const char* name = t == &key ? "key" : "value";
    if (c.quantized) {
      check_tensor(op, name, *t, 3, {at::kBFloat16, at::kHalf}, dev);
    } else {
      check_tensor(op, name, *t, 3, {k_cache.scalar_type()}, dev);
    }
    KVQ_CHECK(op, t->size(1) == c.num_kv_heads && t->size(2) == c.head_dim, name, " has shape ", shape_str(*t),
              "; expected [num_tokens, ", c.num_kv_heads, ", ", c.head_dim, "]");
    KVQ_CHECK(op, t->stride(2) == 1, name, " must have a unit stride on head_dim; call .contiguous()");
  }
  KVQ_CHECK(op, value.scalar_type() == key.scalar_type() && value.size(0) == key.size(0), "value ",
            shape_str(value), " ", value.scalar_type(), " must match key ", shape_str(key), " ", key.scalar_type());
  check_tensor(op, "slot_mapping", slot_mapping, 1, {at::kLong, at::kInt}, dev);
  KVQ_CHECK(op, slot_mapping.size(0) == key.size(0), "slot_mapping has ", slot_mapping.size(0),
            " entries but key has ", key.size(0), " tokens");
  if (key.size(0) == 0) return;

  const c10::cuda::CUDAGuard guard(dev);
  const at::Tensor k = aligned_rows(key), v = aligned_rows(value);
  const at::Tensor slots = slot_mapping.contiguous();
  kvq::StoreParams p;
  p.key = k.data_ptr();
  p.value = v.data_ptr();
  p.key_stride_token = k.stride(0);
  p.key_stride_head = k.stride(1);
  p.value_stride_token = v.stride(0);
  p.value_stride_head = v.stride(1);
  p.slot_mapping = slots.data_ptr();
  p.slot_is_int32 = slots.scalar_type() == at::kInt;
  p.num_tokens = key.size(0);
  set_cache(p, c, k_cache, v_cache, k_scale, v_scale);
  p.format = to_format(k_cache.scalar_type());
  p.dtype = to_dtype(key.scalar_type());
  p.dependent = dependent_launches(g_store_pdl.load(), dev.index()).first;
  const cudaError_t e = kvq::store_kv(p, c10::cuda::getCurrentCUDAStream(dev.index()).stream());
  TORCH_CHECK(e == cudaSuccess, "kvq.store_kv: kernel launch failed: ", cudaGetErrorString(e));
}
