// torch adapter for dequantize: gather cache slots back to bf16/fp16.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kvq/store.cuh"
#include "ops.h"

using namespace kvq_torch;

at::Tensor dequantize_cuda(const at::Tensor& cache,                 // [num_pages, page_size, num_kv_heads, head_dim]
                           const std::optional<at::Tensor>& scale,  // [num_pages, page_size, num_kv_heads, head_dim/32]
                           const at::Tensor& slot_mapping,          // [num_tokens] int64/int32, -1 yields zeros
                           at::ScalarType dtype)                    // of the result [num_tokens, num_kv_heads, head_dim]
{
  const char* op = "dequantize";
  const CacheInfo c = check_cache(op, cache, cache, scale, scale, /*single=*/true);
  KVQ_CHECK(op, is_float16ish(dtype), "dtype must be torch.bfloat16 or torch.float16, got ", dtype);
  check_tensor(op, "slot_mapping", slot_mapping, 1, {at::kLong, at::kInt}, cache.device());
  at::Tensor out = at::empty({slot_mapping.size(0), c.num_kv_heads, c.head_dim}, cache.options().dtype(dtype));
  if (slot_mapping.size(0) == 0) return out;

  const c10::cuda::CUDAGuard guard(cache.device());
  const at::Tensor slots = slot_mapping.contiguous();
  kvq::DequantParams p;
  p.cache = cache.data_ptr();
  p.scale = c.quantized ? static_cast<const uint16_t*>(scale->data_ptr()) : nullptr;
  p.stride_page = cache.stride(0);
  p.num_pages = static_cast<int>(c.num_pages);
  p.page_size = static_cast<int>(c.page_size);
  p.num_kv_heads = static_cast<int>(c.num_kv_heads);
  p.head_dim = static_cast<int>(c.head_dim);
  p.slot_mapping = slots.data_ptr();
  p.slot_is_int32 = slots.scalar_type() == at::kInt;
  p.num_tokens = slot_mapping.size(0);
  p.out = out.data_ptr();
  p.format = to_format(cache.scalar_type());
  p.cache_dtype = c.quantized ? kvq::DType::kBF16 : to_dtype(cache.scalar_type());
  p.out_dtype = to_dtype(dtype);
  const cudaError_t e = kvq::dequantize(p, c10::cuda::getCurrentCUDAStream(cache.device().index()).stream());
  TORCH_CHECK(e == cudaSuccess, "kvq.dequantize: kernel launch failed: ", cudaGetErrorString(e));
  return out;
}
