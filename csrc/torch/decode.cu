// torch adapter for decode_attention: check metadata, size the split workspace from shapes, launch.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <atomic>
#include <cmath>

#include "kvq/decode_tc.cuh"
#include "ops.h"

using namespace kvq_torch;

static_assert(kvq_max_decode_splits == kvq::kMaxDecodeSplits, "the split-count knob's bound is the merges' cap");

namespace {
std::atomic<int> g_decode_kernel{0};
std::atomic<int> g_decode_heads{0};  // 0: by the rule below, 1: one kv head per CTA, 2: one per warp wherever it can,
                                     // 3: column warps at head_dim 256, 4: kv heads per warp wherever it can
std::atomic<int> g_decode_pdl{0};    // programmatic dependent launches where the device can: 0 split and merge,
                                     // 1 none, 2 the merge only
std::atomic<int> g_decode_splits{0}; // 0: by the rules below, n: n splits (1..kvq_max_decode_splits)
// GQA groups from this size up use the tensor-core kernel. On an H200 it beat the FMA kernel at every
// group size measured, MHA included (bench/decode_kernels.py), so the FMA kernel serves only when asked.
constexpr int kTensorCoreGroup = 1;

// Column warps at head_dim 256 (p.column_warps; the split kernel in decode_tc.cuh): a CTA of four warps on one kv
// head, each warp reading and multiplying 64 of the 256 columns of every tile, their partial scores summed in shared
// memory once per tile. Against CTAs whose warps each read whole 16-token tiles (two warps for bf16, four for 8-bit),
// a short split lands its first tiles sooner, but the block barrier of every tile costs bandwidth on long walks. So
// only for few short sequences: at most 16 (sequence, kv head) pairs, and pairs x tokens up to 128k for bf16/fp16
// caches, 16k for 8-bit ones (whose four whole-tile warps per CTA stream better than bf16's two). On an H200 (bf16
// queries, page size 16, 16/2, 32/2, 32/4 and 8/8 heads; the rule before against column warps pinned, two
// alternated rounds in one process, the faster of each): inside those bounds bf16 took 0.61-1.00x the time
// (16/2 heads at batch 1 with 4k tokens 9.43 -> 8.49 us; with 32k 0.95x), 8-bit 0.63-1.00x (q8_0 there 8.43 -> 7.13
// us); outside them column warps cost 1-6% for bf16 (15% at batch 64 with 1k tokens, where the rule runs one split
// of two-warp CTAs) and 14-73% for 8-bit.
bool column_warps_pay(const kvq::DecodeParams& p, bool quantized, int max_tokens) {
  const int64_t pairs = static_cast<int64_t>(p.batch) * p.num_kv_heads;
  return pairs <= 16 && pairs * max_tokens <= (quantized ? 16384 : 131072);
}

// Adjacent kv heads per warp (p.row_heads; decode_tc.cuh's NH) for 8-bit caches at head_dim 64 with up to 8 query heads
// per kv head: two where the kv heads pair up (a pair's rows are one 128-byte line), three where they come in threes
// (9/3 heads: a token's 192-byte row); else 1.
int row_heads_for(const kvq::DecodeParams& p, bool quantized) {
  if (!quantized || p.head_dim != 64 || p.num_q_heads > 8 * p.num_kv_heads) return 1;
  return p.num_kv_heads % 2 == 0 ? 2 : (p.num_kv_heads % 3 == 0 ? 3 : 1);
}

// Kv heads per warp pay where each warp of their plan (plan_tc_splits) walks at least 16 tiles, 6 for pairs. On an H200
// (q8_0, 32/8 and 9/3 heads at d64, batch 1-64 with 1k-256k tokens; the rule before against 'rows' pinned, the faster
// of two alternated rounds in one process): there 0.82-0.96x the time (32/8 heads at batch 64 with 4k tokens 113.9 ->
// 93.7 us, batch 8 with 128k 396.5 -> 361.2; 9/3 heads at batch 64 with 8k 80.1 -> 73.0, batch 8 with 128k 146.5 ->
// 136.6), except 9/3 heads at batch 1 with 256k (16 tiles: 43.4 against 43.0 us); below it 0.99-1.60x (shorter walks
// do not pay for the larger merge and the longer first tiles of three heads' rows: 9/3 heads at batch 1 with 1k
// tokens 4.33 -> 6.92 us). Data: bench/results/h200-2026-12-01-decode-rows-ab.json. Pairs in three CTAs per SM
// (decode_tc.cuh's Cfg) pay from shorter walks: with 7-15 tiles 0.88-0.97x the time of the mapping without them
// (32/8 heads at batch 1 with 32k tokens, batch 8 with 4k; 16/4 heads at batch 1 with 128k, batch 8 with 8k; q8_0
// and fp8_e4m3), with 2-4 tiles 1.02-1.16x (bench/results/h200-2026-12-02-d64-pair-ctas.json).
bool rows_pay(const kvq::DecodeParams& p, int max_tokens) {
  constexpr int kTile = kvq::decode_tc::kTile;
  const int min_tiles = p.row_heads == 2 ? 6 : 16;
  return max_tokens / (int64_t{p.num_splits} * kTile * kvq::decode_tc_shape(p).warps) >= min_tiles;
}

// The tensor-core kernel's split count and kv-head mapping (p.num_splits, p.heads_per_cta), from shapes only.
// Measured on an H200: 120 shapes (6 head layouts, batch 1-64, 1k-128k tokens, bf16 and q8_0), each against every
// split count sized for one to four CTAs per SM, with both mappings; then checked against the previous rule (one
// wave at full occupancy) in one run: those shapes 3.4% less time (geometric mean), 143 others 2.0% less, and
// 86 of many long sequences 0.5% less.
//
// - Splits are sized for two CTAs per SM, not for the full occupancy (three or four CTAs of four warps): more,
//   shorter splits bought no bandwidth and cost a larger merge (8-bit, batch 1 with 8k-32k tokens: 3-16% more
//   time). Where the (sequence, kv head) pairs alone exceed two CTAs per SM, whole waves at full occupancy.
// - head_dim 256: one CTA per SM where two would leave a warp under 12 tiles, or where one needs no split and
//   a warp walks at most 64 tiles (batch 1 with 32k tokens: 5-6% less time; batch 64 with 1k: 13-23% less).
// - head_dim 64: rows are half a cache line, so a CTA keeps few bytes in flight; where the pairs leave under two
//   CTAs per SM and the sequences are long (>= 32 tiles per warp in each half), two splits (batch 64, 9/3 heads,
//   4k tokens: 11% less time than one).
// - One kv head per warp instead of per CTA, where the kv heads divide into the warps: a token's scales of all kv
//   heads are one short row, so warps walking the same tokens for different heads share the scale lines in L1
//   (a CTA per head pays an L2 request per two tokens' scales at 32/8 heads, d128). It needs as many times the
//   splits as the CTA has warps, so for 8-bit caches it pays only where each warp walks long enough: >= 128 tiles
//   where the per-CTA mapping would need no merge at all (batch 1 with 128k tokens, batch 8 with 32k: up to 7%
//   less time at d64); where it splits too, >= 24 tiles over several groups of kv heads (40/8, 64/8 and 32/8 d64
//   heads with 31-47 tiles, batch 1-8: 0.939-1.022x the time, 0.973x geometric mean over 24 shapes) and >= 48
//   over one (28/4, 32/4 heads with 31 tiles: 1.013-1.020x), and from 4k tokens any walk at head_dim 128 with up
//   to 4 query heads per kv head (32/8 and 16/8 heads, batch 1-4 with 4k-32k tokens: 0.919-1.017x, 0.970x over
//   17 shapes; at 1k-2k tokens the larger merge cost 6-11%). Its splits are sized for the full occupancy where
//   a warp still walks >= 128 tiles (batch 8 with 128k tokens: about 8% less time than at two CTAs per SM, in
//   separate runs), for two CTAs per SM otherwise. bf16 caches have no scales, but where the pairs exceed two
//   CTAs per SM and one CTA per (sequence, group of kv heads) fits a wave, that mapping without splits took
//   1-21% off batch 16-128 at d128 and d256 (5-21% at 32/8, 64/8, 28/4 and 64/4 heads, d128), 0-3% more at d64.
// - Where the warps do not divide the kv heads (9/3, 16/2 heads), one kv head per warp in a CTA of fewer warps
//   (the largest divisor of the kv heads below the warps), for 8-bit caches in CTAs of three warps, or of two at
//   head_dim 256, with splits sized for four such CTAs per SM that fill them (at batch 1 the split cap holds them
//   back: 6-32% more time) where a warp walks >= 48 tiles (128 where the per-CTA mapping needs no merge). Against
//   one kv head per CTA, on an H200: 9/3 d64 1-9% less time at batch 8 with 128k tokens and batch 64 with 8k-32k
//   (q8_0 at batch 64 with 32k: 315.7 -> 286.8 us), 16/2 d256 1-3% less at batch 8 with 128k and batch 64 with
//   32k. Shorter walks cost 2-13% (9/3 d64, batch 8 with 8k-32k tokens), five CTAs per SM (the occupancy of three
//   warps at d64) 6-11% more than four, and two-warp CTAs at d64 and d128 (14/2, 12/2 heads) gained nothing (1%
//   more time at batch 64 with 8k tokens, 3-28% more at batch 1 and 8).
// Known costs against the previous rule (same run): 8-bit caches at 32/8 and 40/8 heads with 2-8 sequences of
// 64k-256k tokens, where a warp would walk 124 tiles at full occupancy, q8_0 2-7% more time (fp8_e4m3 2-4% less);
// 16 query heads per kv head (64/4), 8-bit, batch 2-32: 4-7% more.
void plan_tc_splits(kvq::DecodeParams& p, kvq::TcShape shape, bool quantized, int max_tokens, int sms,
                    int heads_choice) {
  constexpr int kTile = kvq::decode_tc::kTile;
  const int64_t pairs = static_cast<int64_t>(p.batch) * p.num_kv_heads;
  const int w = shape.warps;
  auto splits_for = [&](int kv_heads, int warps, int ctas_per_sm) {
    return kvq::decode_tc_num_splits(p.batch, kv_heads, max_tokens, kvq::TcShape{warps, ctas_per_sm}, sms);
  };
  auto tiles_per_warp = [&](int splits, int warps) { return max_tokens / (int64_t{splits} * kTile * warps); };
  p.heads_per_cta = 1;
  if (p.row_heads > 1) {  // kv heads per warp: the CTAs of (sequence, group of row_heads kv heads), as per CTA below
    // Splits for two CTAs per SM; for threes of kv heads sized for the full occupancy (three CTAs per SM) also where
    // a warp still walks >= 32 tiles with them. On an H200 (9/3 heads, d64) against splits for two CTAs per SM: batch
    // 64 with 32k tokens (85 tiles) 0.93-0.96x the time (q8_0 259.1 -> 249.9 us), batch 8 with 128k (41) 0.98-1.00x;
    // batch 64 with 8k (21) 0.98x for q8_0 but 1.03x for fp8_e4m3; with 10-11 tiles (batch 64 with 4k, batch 8 with
    // 32k) 1.02-1.07x. For pairs (32/8 heads) the same took 1.02-1.06x at batch 1 with 256k tokens and batch 8 with
    // 32k, and 0.92-1.01x at batch 8 with 128k, whose rounds spread by up to 8% (h200-2026-12-02-d64-pair-ctas.json).
    // Full occupancy too where the CTAs of one split outnumber the SMs: sized for two per SM they would leave one
    // split, most SMs holding one CTA and a few two. There two splits (three CTAs per SM) took 0.66-0.83x the time
    // of one (q8_0 and fp8_e4m3; 32/8 heads at batch 36-48, 16/4 at 72-96, 9/3 at 144; 4k and 32k tokens: 32/8 at
    // batch 36 with 32k 636.2 -> 425.3 us); h200-2026-12-02-d64-row-band.json.
    const int groups = p.num_kv_heads / p.row_heads;
    const int full = splits_for(groups, w, shape.ctas_per_sm);
    p.num_splits = int64_t{p.batch} * groups > sms || (p.row_heads == 3 && tiles_per_warp(full, w) >= 32)
                       ? full
                       : splits_for(groups, w, std::min(shape.ctas_per_sm, 2));
    return;
  }
  if (p.column_warps > 1) {
    // The CTA's warps walk each tile together: the token math of one warp. Splits for two CTAs per SM: inside the
    // bounds of column_warps_pay, one per SM took 0.93-1.25x that time and three per SM 0.97-1.14x (H200, same runs).
    p.num_splits = splits_for(p.num_kv_heads, 1, std::min(shape.ctas_per_sm, 2));
    return;
  }
  int c = std::min(shape.ctas_per_sm, 2);
  if (pairs > int64_t{sms} * c) c = shape.ctas_per_sm;
  int splits = splits_for(p.num_kv_heads, w, c);
  // bf16/fp16 caches at head_dim 128: where two CTAs per SM would leave a warp at most two tiles and one CTA per SM
  // still fills 31/32 of the SMs, splits for one CTA per SM (half the prologues, half the merge's parts). On an H200
  // (bf16, 14 head layouts at batch 1-8 with 1k-8k tokens; two runs, each of two builds alternated three times), where
  // the choice changed: 0.86-1.02x the time, geometric means 0.94x and 0.96x (32/8 heads at batch 1 with 4k tokens
  // 10.07 -> 9.48 us, 64/4 at batch 2 with 4k 12.67 -> 10.95). With a fill of 95% (42/7 heads: 126 CTAs for 132 SMs)
  // 0.97-1.02x: the idle SMs cost what the shorter prologues save. For 8-bit caches the same change took 0.91-1.05x
  // (bench/results/h200-2026-12-04-bf16-short-splits-ab.json, h200-2026-12-04-short-split-rule-ab.json).
  if (!quantized && p.head_dim == 128 && c == 2 && tiles_per_warp(splits, w) <= 2) {
    const int one = splits_for(p.num_kv_heads, w, 1);
    if (pairs * one * 32 >= int64_t{sms} * 31) splits = one;
  }
  if (p.head_dim == 256 && c > 1) {
    const int one_per_sm = splits_for(p.num_kv_heads, w, 1);
    if ((one_per_sm == 1 && tiles_per_warp(1, w) <= 64) || tiles_per_warp(splits, w) < 12) splits = one_per_sm;
  }
  if (p.head_dim == 64 && splits == 1 && pairs < int64_t{sms} * c && tiles_per_warp(2, w) >= 32 &&
      splits_for(p.num_kv_heads, w, shape.ctas_per_sm) > 1)
    splits = 2;
  p.num_splits = splits;
  if (heads_choice == 1 || w < 2) return;
  // kv heads per CTA for one per warp: the warps, or where they do not divide the kv heads the largest divisor of
  // the kv heads below them, in a CTA of that many warps.
  int hpc = 0;
  for (int d = w; d >= 2 && hpc == 0; --d)
    if (p.num_kv_heads % d == 0) hpc = d;
  if (hpc == 0) return;
  const int groups = p.num_kv_heads / hpc;
  // An 8-bit warp walking its head's whole split must walk long enough to pay for the larger merge.
  const auto walks_long = [&](int s) { return tiles_per_warp(s, 1) >= (splits > 1 ? 48 : 128); };
  // The per-warp CTAs of s splits fill at least 90% of `ctas` per SM (not held back by the split cap).
  const auto fills = [&](int s, int ctas) { return int64_t{p.batch} * groups * s * 10 >= int64_t{sms} * ctas * 9; };
  int per_warp = 0;
  if (hpc < w) {
    if (heads_choice == 2 || (quantized && (hpc >= 3 || p.head_dim == 256))) {
      const int c_h = std::min(kvq::decode_tc_shape(p, hpc).ctas_per_sm, 4);
      const int s = splits_for(groups, 1, c_h);
      if (heads_choice == 2 || (fills(s, c_h) && walks_long(s))) per_warp = s;
    }
  } else if (heads_choice == 2) {
    per_warp = splits_for(groups, 1, c);
  } else if (quantized) {
    const int full = splits_for(groups, 1, shape.ctas_per_sm);
    int s = tiles_per_warp(full, 1) >= 128 ? full : splits_for(groups, 1, c);
    // Where the per-CTA mapping runs one split over more than two CTAs per SM and the full occupancy would leave
    // each warp under 128 tiles, splits sized for two CTAs per SM instead, if those fill at least 90% of them (so
    // that each warp walks 128 tiles or more, below). On an H200 with the warp merge (q8_0 and fp8_e4m3; 32/8, 16/4,
    // 8/8, 40/8, 64/8 and 32/4 heads at d128, batch 16-256 with 1k-16k tokens; against the rule before, alternated in
    // one process): batch 64 with 4k tokens 0.946-0.972x the time (32/8 q8_0 160.2 -> 154.9 us, fp8 159.2 -> 150.7),
    // batch 128 with 2k-4k 0.945-0.992x (40/8 heads with 2k: 1.12x); at batch 48 (192 CTAs for 264 slots) 1.12-1.19x,
    // hence the fill test. The per-warp mapping moves more between processes: in a second one three of the 14 shapes
    // this changes took 1.05-1.09x (geometric mean 0.995x), which a third timed at 0.96-0.97x; 32/8 at batch 64 with
    // 4k tokens took 0.946-0.967x in all (bench/results/h200-2026-12-02-warp-splits-ab.json).
    if (splits == 1 && c > 2 && tiles_per_warp(s, 1) < 128) {
      const int two = splits_for(groups, 1, 2);
      if (fills(two, 2)) s = two;
    }
    const bool several = groups > 1 && splits > 1;
    const bool narrow = p.head_dim == 128 && p.num_q_heads <= 4 * p.num_kv_heads && max_tokens >= 4096;
    if (several ? narrow || tiles_per_warp(s, 1) >= 24 : walks_long(s)) per_warp = s;
  } else if (pairs > int64_t{sms} * std::min(shape.ctas_per_sm, 2) &&
             int64_t{p.batch} * groups <= int64_t{sms} * shape.ctas_per_sm) {
    per_warp = splits_for(groups, 1, 1);
  }
  if (per_warp > 0) p.num_splits = per_warp, p.heads_per_cta = hpc;
}

}  // namespace

int kvq_set_decode_kernel(int choice) { return g_decode_kernel.exchange(choice); }
int kvq_set_decode_heads(int choice) { return g_decode_heads.exchange(choice); }
int kvq_set_decode_pdl(int choice) { return g_decode_pdl.exchange(choice); }
int kvq_set_decode_splits(int splits) { return g_decode_splits.exchange(splits); }

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
  KVQ_CHECK(op, hq >= 1 && hq % c.num_kv_heads == 0, "query has ", hq, " heads, not a multiple of the cache's ", c.num_kv_heads,
            " kv heads (GQA needs num_q_heads % num_kv_heads == 0)");
  KVQ_CHECK(op, hq / c.num_kv_heads <= 16, "the CUDA decode kernel supports up to 16 query heads per kv head, got ",
            hq / c.num_kv_heads);
  check_tensor(op, "out", out, 3, {query.scalar_type()}, dev);
  KVQ_CHECK(op, out.sizes() == query.sizes(), "out has shape ", shape_str(out), "; it must match query ", shape_str(query));
  KVQ_CHECK(op, out.stride(2) == 1, "out must have a unit stride on head_dim");
  check_no_overlap(op, "out", out);
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
  const int64_t page_bytes = c.page_size * c.num_kv_heads * c.head_dim * k_cache.element_size();
  KVQ_CHECK(op, page_bytes <= INT32_MAX, "a page of k_cache holds ", page_bytes, " bytes (page_size x num_kv_heads "
            "x head_dim x ", k_cache.element_size(), "); the CUDA decode kernel takes pages under 2 GiB: use a "
            "smaller page_size");
  check_positions(op, block_table, c.page_size, 0);
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
  set_cache(p, c, k_cache, v_cache, k_scale, v_scale);
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
  if (tc) {
    const int heads_choice = g_decode_heads.load();
    if (p.head_dim == 256 && (heads_choice == 3 || (heads_choice == 0 && column_warps_pay(p, c.quantized, max_tokens))))
      p.column_warps = 4;
    else if (heads_choice == 0 || heads_choice == 4)
      p.row_heads = row_heads_for(p, c.quantized);
    plan_tc_splits(p, kvq::decode_tc_shape(p), c.quantized, max_tokens, sms, heads_choice);
    if (heads_choice == 0 && p.row_heads > 1 && !rows_pay(p, max_tokens)) {
      p.row_heads = 1;
      plan_tc_splits(p, kvq::decode_tc_shape(p), c.quantized, max_tokens, sms, heads_choice);
    }
  } else {  // FMA: splits of at least two chunks per warp, over two CTAs per SM
    p.num_splits = kvq::decode_num_splits(p.batch, p.num_kv_heads, max_tokens,
                                          2 * warps * kvq::detail::kChunkTokens, 2 * sms);
  }
  if (const int pinned = g_decode_splits.load(); pinned > 0) p.num_splits = pinned;
  at::Tensor ws = at::empty({kvq::decode_workspace_floats(p.batch, p.num_q_heads, p.head_dim, p.num_splits, warps)},
                            query.options().dtype(at::kFloat));
  p.workspace = ws.data_ptr<float>();
  // The merge as a programmatic dependent of the split kernel (compute capability 9.0 and newer; common.cuh). On an
  // H200, against plain stream order in one build (32/8 d128, 16/2 d256, 9/3 d64; q8_0 and bf16): 6-11% less time
  // at batch 1 with 1k-4k tokens, 1-4% with 32k-128k; at batch 8 with 1k 1-10% less (bf16 at 32/8 heads 0.8%
  // more); batch 8 with 32k and batch 64 within 0.3%. Outputs equal to the bit.
  const DependentLaunches pdl = dependent_launches(g_decode_pdl.load(), dev.index());
  p.dependent_merge = pdl.merge;
  // The split kernel as a programmatic dependent of the kernel before it, which it waits for before any global
  // access: it is scheduled as that kernel's last CTAs exit, not after the kernel completes. On an H200, calls
  // back to back in a CUDA graph, against the merge alone launched so (42 shapes: 32/8 d128, 16/2 d256, 9/3 d64;
  // bf16, q8_0, fp8; batch 1-64, 1k-128k tokens; alternated three times in one process): at batch 1 1.8% less
  // time (geometric mean; 0.935-1.008x; 2.4% over 6 shapes of a second run, up to 1.021x), at batch 8-64 0.6-1.1%
  // less (0.953-1.004x); outputs equal to the bit. A merge that let it be scheduled at its own start
  // (launch_dependents) cost up to 32% instead (32/8 d128, batch 1 with 32k tokens): the split's one-wave grid
  // then lands unevenly on SMs still running merge CTAs.
  p.dependent_split = pdl.first;
  p.num_sms = sms;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(dev.index()).stream();
  const cudaError_t e = tc ? kvq::decode_attention_tc(p, stream) : kvq::decode_attention(p, stream);
  TORCH_CHECK(e == cudaSuccess, "kvq.decode_attention: kernel launch failed: ", cudaGetErrorString(e));
}
