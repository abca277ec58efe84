// torch adapter for extend_attention: check metadata, fill the params, launch on the current stream.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>

#include "kvq/extend.cuh"
#include "ops.h"

using namespace kvq_torch;

namespace {
std::atomic<int> g_extend_shape{0};
std::atomic<int> g_extend_splits{0};
std::atomic<int> g_extend_pdl{0};  // programmatic dependent launches where the device can: 0 the kernel and the
                                   // merge, 1 none, 2 the merge only
}  // namespace

int kvq_set_extend_shape(int choice) { return g_extend_shape.exchange(choice); }
int kvq_set_extend_splits(int choice) { return g_extend_splits.exchange(choice); }
int kvq_set_extend_pdl(int choice) { return g_extend_pdl.exchange(choice); }

void extend_attention_cuda(const at::Tensor& query,    // [total_new_tokens, num_q_heads, head_dim] bf16/fp16
                           const at::Tensor& key,      // [total_new_tokens, num_kv_heads, head_dim] query dtype
                           const at::Tensor& value,    // same
                           const at::Tensor& k_cache,  // [num_pages, page_size, num_kv_heads, head_dim]
                           const at::Tensor& v_cache,  // same
                           const std::optional<at::Tensor>& k_scale,  // [num_pages, page_size, num_kv_heads, head_dim/32]
                           const std::optional<at::Tensor>& v_scale,
                           const at::Tensor& block_table,   // [batch, max_pages] int32
                           const at::Tensor& prefix_lens,   // [batch] int32
                           const at::Tensor& cu_seqlens_q,  // [batch + 1] int32
                           double sm_scale, bool causal, int64_t window_left, double logit_softcap,
                           at::Tensor& out)  // [total_new_tokens, num_q_heads, head_dim], query dtype
{
  const char* op = "extend_attention";
  const CacheInfo c = check_cache(op, k_cache, v_cache, k_scale, v_scale);
  const auto dev = k_cache.device();
  check_tensor(op, "query", query, 3, {at::kBFloat16, at::kHalf}, dev);
  const auto dtype = query.scalar_type();
  const int64_t total = query.size(0), hq = query.size(1), hkv = c.num_kv_heads, d = c.head_dim;
  KVQ_CHECK(op, query.size(2) == d, "query head_dim ", query.size(2), " differs from the cache's ", d);
  KVQ_CHECK(op, d == 64 || d == 128 || d == 256, "the CUDA extend kernel supports head_dim 64, 128 or 256, got ", d);
  KVQ_CHECK(op, hq >= 1 && hq % hkv == 0, "query has ", hq, " heads, not a multiple of the cache's ", hkv,
            " kv heads (GQA needs num_q_heads % num_kv_heads == 0)");
  KVQ_CHECK(op, c.quantized || dtype == k_cache.scalar_type(), "query is ", dtype, " but the unquantized cache is ",
            k_cache.scalar_type(), "; they must match");
  for (const at::Tensor* t : {&query, &key, &value, static_cast<const at::Tensor*>(&out)}) {
    const char* name = t == &query ? "query" : t == &key ? "key" : t == &value ? "value" : "out";
    check_tensor(op, name, *t, 3, {dtype}, dev);
    const int64_t heads = (t == &key || t == &value) ? hkv : hq;
    KVQ_CHECK(op, t->size(0) == total && t->size(1) == heads && t->size(2) == d, name, " has shape ", shape_str(*t),
              "; expected [", total, ", ", heads, ", ", d, "]");
    KVQ_CHECK(op, t->stride(2) == 1, name, " must have a unit stride on head_dim; call .contiguous()");
  }
  check_no_overlap(op, "out", out);
  check_tensor(op, "block_table", block_table, 2, {at::kInt}, dev);
  check_tensor(op, "prefix_lens", prefix_lens, 1, {at::kInt}, dev);
  check_tensor(op, "cu_seqlens_q", cu_seqlens_q, 1, {at::kInt}, dev);
  const int64_t batch = prefix_lens.size(0);
  KVQ_CHECK(op, block_table.size(0) == batch && cu_seqlens_q.size(0) == batch + 1, "block_table ",
            shape_str(block_table), ", prefix_lens ", shape_str(prefix_lens), " and cu_seqlens_q ",
            shape_str(cu_seqlens_q), " must describe the same batch ([B, max_pages], [B], [B + 1])");
  KVQ_CHECK(op, sm_scale > 0 && std::isfinite(sm_scale), "sm_scale must be positive and finite, got ", sm_scale);
  KVQ_CHECK(op, window_left >= -1, "window_left must be -1 (no window) or >= 0, got ", window_left);
  KVQ_CHECK(op, logit_softcap >= 0 && std::isfinite(logit_softcap), "logit_softcap must be 0 (none) or positive "
            "and finite, got ", logit_softcap);
  KVQ_CHECK(op, total * (hq / hkv) < INT32_MAX, "query has ", total, " tokens x ", hq / hkv,
            " query heads per kv head; the CUDA extend kernel's 32-bit row indices take fewer than ", INT32_MAX);
  KVQ_CHECK(op, batch > 0 || total == 0, "query has ", total, " tokens but cu_seqlens_q describes no sequence; "
            "cu_seqlens_q must have batch + 1 entries ending at the token count");
  check_positions(op, block_table, c.page_size, total);
  if (batch == 0 || total == 0) return;

  const c10::cuda::CUDAGuard guard(dev);
  // The kernel reads and writes rows with 16-byte vector accesses.
  const at::Tensor q = aligned_rows(query), k = aligned_rows(key), v = aligned_rows(value);
  at::Tensor o = aligned_rows(out);
  const at::Tensor table = block_table.stride(1) == 1 ? block_table : block_table.contiguous();
  const at::Tensor prefix = prefix_lens.contiguous(), cu = cu_seqlens_q.contiguous();

  kvq::ExtendParams p;
  p.query = q.data_ptr();
  p.key = k.data_ptr();
  p.value = v.data_ptr();
  p.out = o.data_ptr();
  p.q_stride_tok = q.stride(0), p.q_stride_head = q.stride(1);
  p.k_stride_tok = k.stride(0), p.k_stride_head = k.stride(1);
  p.v_stride_tok = v.stride(0), p.v_stride_head = v.stride(1);
  p.o_stride_tok = o.stride(0), p.o_stride_head = o.stride(1);
  set_cache(p, c, k_cache, v_cache, k_scale, v_scale);
  p.block_table = table.data_ptr<int32_t>();
  p.block_table_stride = table.stride(0);
  p.max_pages = static_cast<int>(table.size(1));
  p.prefix_lens = prefix.data_ptr<int32_t>();
  p.cu_seqlens_q = cu.data_ptr<int32_t>();
  p.batch = static_cast<int>(batch);
  p.total_q = static_cast<int>(total);
  p.num_q_heads = static_cast<int>(hq);
  p.sm_scale = static_cast<float>(sm_scale);
  p.causal = causal;
  p.window_left = static_cast<int>(std::min<int64_t>(window_left, INT32_MAX));
  p.logit_softcap = static_cast<float>(logit_softcap);
  p.format = to_format(k_cache.scalar_type());
  p.dtype = to_dtype(dtype);
  p.num_sms = sm_count(dev.index());
  p.max_smem = smem_optin(dev.index());
  p.shape = g_extend_shape.load();
  p.num_splits = g_extend_splits.load();
  // The merge of split key ranges as a programmatic dependent of the split kernel, as decode's (ops.h); and the
  // kernel itself as a dependent of the kernel before it, which it waits for before any global access, so its
  // launch overlaps that kernel's exit. On an H200, calls back to back in a CUDA graph (32/8 heads, d128; two
  // builds alternated in one run): 512 new tokens with no prefix 1-3% less time (bf16 20.3 -> 19.7 us), within
  // 0.5% at 512-2048 tokens over a 4k prefix and for longer calls.
  const DependentLaunches pdl = dependent_launches(g_extend_pdl.load(), dev.index());
  p.dependent_merge = pdl.merge;
  p.dependent_kernel = pdl.first;
  kvq::ExtendPlan plan{};
  cudaError_t e = kvq::extend_plan(p, plan);
  TORCH_CHECK(e == cudaSuccess, "kvq.extend_attention: no kernel for these parameters: ", cudaGetErrorString(e));
  at::Tensor ws;  // the splits' partials, from the caching allocator (so a CUDA graph can capture it)
  if (plan.splits > 1) {
    ws = at::empty({kvq::extend_workspace_floats(p, plan)}, query.options().dtype(at::kFloat));
    p.workspace = ws.data_ptr<float>();
  }

  e = kvq::extend_attention(p, plan, c10::cuda::getCurrentCUDAStream(dev.index()).stream());
  TORCH_CHECK(e == cudaSuccess, "kvq.extend_attention: kernel launch failed: ", cudaGetErrorString(e));
  if (!o.is_same(out)) out.copy_(o);
}
