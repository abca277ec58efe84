// torch adapter for decode_attention: check metadata, size the split workspace from shapes, launch.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <atomic>
#include <cmath>

#include "kvq/decode_tc.cuh"
#include "ops.h"

using namespace kvq_torch;

namespace {
std::atomic<int> g_decode_kernel{0};
std::atomic<int> g_decode_heads{0};  // 0: by the rule below, 1: one kv head per CTA, 2: one per warp where they divide
// GQA groups from this size up use the tensor-core kernel. On an H200 it beat the FMA kernel at every
// group size measured, MHA included (bench/decode_kernels.py), so the FMA kernel serves only when asked.
constexpr int kTensorCoreGroup = 1;

}  // namespace

int kvq_set_decode_kernel(int choice) { return g_decode_kernel.exchange(choice); }
int kvq_set_decode_heads(int choice) { return g_decode_heads.exchange(choice); }

void decode_attention_cuda(const at::Tensor& query,   // [batch, num_q_heads, head_dim] bf16/fp16
                           const at::Tensor& k_cache, // [num_pages, page_size, num_kv_heads, head_dim]
                           const at::Tensor& v_cache, // same
                           const std::optional<at::Tensor>& k_scale,  // [num_pages, page_size, num_kv_heads, head_dim/32]
                           const std::optional<at::Tensor>& v_scale,
                           const at::Tensor& block_table,  // [batch, max_pages] int32
                           const at::Tensor& seq_lens,     // [batch] int32
                           double sm_scale, int64_t window_left, double logit_softcap,
                           at::Tensor& out)                // [batch, num_q_heads, head_dim], query dtype
{
  const char* op = "decode_attention";
  const CacheInfo c = check_cache(op, k_cache, v_cache, k_scale, v_scale);
  const auto dev = k_cache.device();
  check_tensor(op, "query", query, 3, {at::kBFloat16, at::kHalf}, dev);
  const int64_t batch = query.size(0), hq = query.size(1);
  KVQ_CHECK(op, query.size(2) == c.head_dim, "query head_dim ", query.size(2), " differs from the cache's ", c.head_dim);
  KVQ_CHECK(op, c.head_dim == 64 || c.head_dim == 128 || c.head_dim == 256, "the CUDA decode kernel supports head_dim "
            "64, 128 or 256, got ", c.head_dim);
  KVQ_CHECK(op, query.stride(2) == 1, "query must have a unit stride on head_dim; call .contiguous()");
  KVQ_CHECK(op, hq % c.num_kv_heads == 0, "query has ", hq, " heads, not a multiple of the cache's ", c.num_kv_heads,
            " kv heads (GQA needs num_q_heads % num_kv_heads == 0)");
  KVQ_CHECK(op, hq / c.num_kv_heads <= 16, "the CUDA decode kernel supports up to 16 query heads per kv head, got ",
            hq / c.num_kv_heads);
  check_tensor(op, "out", out, 3, {query.scalar_type()}, dev);
  KVQ_CHECK(op, out.sizes() == query.sizes(), "out has shape ", shape_str(out), "; it must match query ", shape_str(query));
  KVQ_CHECK(op, out.stride(2) == 1, "out must have a unit stride on head_dim");
  KVQ_CHECK(op, sm_scale > 0 && std::isfinite(sm_scale), "sm_scale must be positive and finite, got ", sm_scale);
  KVQ_CHECK(op, window_left >= -1, "window_left must be -1 (no window) or >= 0, got ", window_left);
  KVQ_CHECK(op, logit_softcap >= 0 && std::isfinite(logit_softcap), "logit_softcap must be 0 (none) or positive "
            "and finite, got ", logit_softcap);
  KVQ_CHECK(op, c.quantized || query.scalar_type() == k_cache.scalar_type(), "query is ", query.scalar_type(),
            " but the unquantized cache is ", k_cache.scalar_type(), "; they must match");
  check_tensor(op, "block_table", block_table, 2, {at::kInt}, dev);
  check_tensor(op, "seq_lens", seq_lens, 1, {at::kInt}, dev);
  KVQ_CHECK(op, block_table.size(0) == batch && seq_lens.size(0) == batch, "block_table ", shape_str(block_table),
            " and seq_lens ", shape_str(seq_lens), " must have one row per sequence (", batch, ")");
  KVQ_CHECK(op, block_table.stride(1) == 1 || block_table.size(1) <= 1, "block_table must have a unit stride on its last dim");
  KVQ_CHECK(op, batch <= 65535 && c.num_kv_heads <= 65535, "batch and num_kv_heads must be at most 65535");
  if (batch == 0) return;

  const c10::cuda::CUDAGuard guard(dev);
  const at::Tensor lens = seq_lens.contiguous();
  // The tensor-core kernel reads query rows in 16-byte pieces: a view whose rows are not 16-byte aligned
  // (rare: an odd offset into a larger tensor) is copied first.
  const at::Tensor q = aligned_rows(query);
  kvq::DecodeParams p;
  p.query = q.data_ptr();
  p.q_stride_batch = q.stride(0);
  p.q_stride_head = q.stride(1);
  p.out = out.data_ptr();
  p.o_stride_batch = out.stride(0);
  p.o_stride_head = out.stride(1);
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.k_scale = c.quantized ? static_cast<const uint16_t*>(k_scale->data_ptr()) : nullptr;
  p.v_scale = c.quantized ? static_cast<const uint16_t*>(v_scale->data_ptr()) : nullptr;
  p.k_stride_page = k_cache.stride(0);
  p.v_stride_page = v_cache.stride(0);
  p.num_pages = static_cast<int>(c.num_pages);
  p.page_size = static_cast<int>(c.page_size);
  p.num_kv_heads = static_cast<int>(c.num_kv_heads);
  p.head_dim = static_cast<int>(c.head_dim);
  p.block_table = block_table.data_ptr<int32_t>();
  p.block_table_stride = block_table.stride(0);
  p.max_pages = static_cast<int>(block_table.size(1));
  p.seq_lens = lens.data_ptr<int32_t>();
  p.batch = static_cast<int>(batch);
  p.num_q_heads = static_cast<int>(hq);
  p.sm_scale = static_cast<float>(sm_scale);
  p.window_left = static_cast<int>(std::min<int64_t>(window_left, INT32_MAX));
  p.logit_softcap = static_cast<float>(logit_softcap);
  p.format = to_format(k_cache.scalar_type());
  p.dtype = to_dtype(query.scalar_type());

  const int choice = g_decode_kernel.load();
  const bool tc = choice == 2 || (choice == 0 && hq / c.num_kv_heads >= kTensorCoreGroup);
  // Partials per split: the tensor-core kernel combines its warps in the CTA, the FMA kernel in the merge.
  const int warps = tc ? 1 : kvq::decode_warps(p.format, p.dtype, p.head_dim);
  const int max_tokens = static_cast<int>(std::min<int64_t>(block_table.size(1) * c.page_size, INT32_MAX));
  const int sms = sm_count(dev.index());
  const kvq::TcShape tc_shape = tc ? kvq::decode_tc_shape(p) : kvq::TcShape{};
  // FMA: splits of at least two chunks per warp, over two CTAs per SM.
  p.num_splits = tc ? kvq::decode_tc_num_splits(p.batch, p.num_kv_heads, max_tokens, tc_shape, sms)
                    : kvq::decode_num_splits(p.batch, p.num_kv_heads, max_tokens,
                                             2 * warps * kvq::detail::kChunkTokens, 2 * sms);
  // One kv head per warp instead of per CTA, where the kv heads divide into the warps. A token's scales of all kv
  // heads are one short row, so warps that walk the same tokens for different heads read the same scale lines and
  // L1 serves all but the first; a CTA per head pays an L2 request per two tokens' scales (32/8 heads, d128: 16
  // per 32 requests of rows). On an H200 (8-bit caches, batch 8-64, 32k-128k tokens) that took 4-10% off 32/8
  // heads d128 and 12-17% off 32/8 d64. It needs four times the splits for as many CTAs, though, and where that
  // leaves a warp under 64 tiles the larger merge costs more than it saves (7% more at batch 1 with 128k tokens,
  // 32/8 d128; up to 30% at 1k tokens). There, if the per-CTA mapping splits the sequences anyway, half the CTAs
  // per SM give each warp twice the tiles and the merge twice the per-CTA mapping's parts, not four times; where
  // a warp then walks at least 12 tiles, that took 4-7% off 32/8 heads d128 at batch 1 with 128k tokens and
  // batch 8 with 4k-32k, and 5-14% off d64 (batch 1 with 32k-128k, batch 8 with 4k-32k). Where the per-CTA
  // mapping needs no merge (batch 64, 1k tokens) it cost 7-16%, and on bf16 caches (d64) up to 12%: so only
  // 8-bit caches, only where the per-CTA mapping splits, and only for the shapes measured, those that fit four
  // CTAs per SM (head_dim <= 128, up to 8 query heads per kv head).
  const int heads_choice = g_decode_heads.load();
  if (tc && heads_choice != 1 && tc_shape.warps > 1 && c.num_kv_heads % tc_shape.warps == 0) {
    const int groups = static_cast<int>(c.num_kv_heads) / tc_shape.warps;
    auto per_warp_splits = [&](int ctas_per_sm) {
      return kvq::decode_tc_num_splits(p.batch, groups, max_tokens, kvq::TcShape{1, ctas_per_sm}, sms);
    };
    constexpr int kTile = kvq::decode_tc::kTile;
    int splits = per_warp_splits(tc_shape.ctas_per_sm);
    bool per_warp = heads_choice == 2 || (c.quantized && max_tokens / splits >= 64 * kTile);
    if (!per_warp && heads_choice == 0 && c.quantized && p.num_splits > 1 && tc_shape.ctas_per_sm >= 4) {
      const int half = per_warp_splits(tc_shape.ctas_per_sm / 2);
      if (max_tokens / half >= 12 * kTile) splits = half, per_warp = true;
    }
    if (per_warp) {
      p.heads_per_cta = tc_shape.warps;
      p.num_splits = splits;
    }
  }
  at::Tensor ws = at::empty({kvq::decode_workspace_floats(p.batch, p.num_q_heads, p.head_dim, p.num_splits, warps)},
                            query.options().dtype(at::kFloat));
  p.workspace = ws.data_ptr<float>();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(dev.index()).stream();
  const cudaError_t e = tc ? kvq::decode_attention_tc(p, stream) : kvq::decode_attention(p, stream);
  TORCH_CHECK(e == cudaSuccess, "kvq.decode_attention: kernel launch failed: ", cudaGetErrorString(e));
}
