// decode_attention on tensor cores (mma.sync.m16n8k16), the query heads of one kv head sharing every K/V load.
//
// Same flash-decoding plan as decode.cuh (a CTA owns (sequence, kv head, split); each warp walks its own
// 16-token tiles with its own softmax state; the warps are combined in shared memory and a merge kernel
// combines the splits), but the dot products run on tensor cores. For long 8-bit splits a CTA may own one kv
// head per warp instead, so that its warps read the same tokens' scale lines (heads_per_cta; decode.cu). For short
// splits at head_dim 256 its four warps may divide each tile's columns instead (column warps, Cfg's COLS). Over
// 8-bit caches at head_dim 64 each warp may own two or three adjacent kv heads, read as one slice (Cfg's NH).
// Per tile and warp, with the operands placed so that no half of an mma is spent on padding rows:
//   scores: S^T[16 tokens x 8] = K Q^T, the tokens as the m rows and up to 8 heads as the n columns, then
//           transposed in registers (movmatrix) into rows of heads for the softmax; groups of 9 to 16 heads
//           take S[16 x 16 tokens] = Q K^T, the heads as the m rows (2 n-tiles of 8 tokens).
//   output: O^T[HD x 8] += V^T P^T, head_dim as the m rows (HD / 16 m-tiles), the 16 tokens as the k of one mma,
//           each 8 heads one n-tile: P's rows of heads are already the B fragment.
// 8-bit keys enter fp16 mmas raw (int8 and e4m3 values are exact in fp16), one 32-element block per two
// k-steps, and the key's block scale multiplies that block's dot product in fp32; query rows are multiplied
// by a power of two first, so bf16 queries are exact in fp16. Values are dequantized in registers to
// fp16(q * scale), one rounding of the exact product, and P V runs in fp16 as well, bf16 queries included at
// head_dim 128 and 256: fp16 keeps 3 more bits than bf16, and its packed multiply takes about half the
// instructions of bf16's route through fp32 (on an H200 up to 6% less time at 16/2 heads d256; at head_dim 64,
// with half the values per tile, 1-2% more at 9/3 heads, so there bf16 queries keep T(q * scale) in bf16).
// Where a tile holds a value scale whose products could pass fp16's largest finite value (2^9 and up for q8_0,
// 2^7 for e4m3, or not finite), that tile runs P V on bf16(q * scale) instead, so bf16 values of any
// magnitude are read as the reference reads them. P enters fp16 mmas times 2^15 (and the row sums with it),
// so that no probability above 2^-40 falls below fp16's range. Neither operand needs a transposing copy: the
// order of head_dim in Q K^T is free, so Q's fragments are laid out to match how each thread reads its key rows;
// for V^T P^T each thread reads one 8-byte word of four token rows and interleaves their bytes with PRMT (the
// output rows it holds are permuted the same way, and written back to their true positions).
//
// Raw rows and scales travel by cp.async into a warp-private ring of kStages tiles (no block barrier in the
// loop). Rows keep each 128-byte line of the cache in one aligned 128-byte span of the ring, their bytes XOR-
// permuted inside it so that the fragment loads of a warp are free of bank conflicts (Cfg::k_at, v_at): a cp.async
// whose line straddles two spans of shared memory is split, and each part requests its sectors from L2 anew.
// (Rows padded by 16 or 32 bytes in stages of 16 bytes past a multiple of 128 had taken 1.5x the L2 sectors of
// the data: on an H200 Nsight Compute counted 10.5 shared-memory wavefronts and L2 requests per bf16 cp.async
// instruction, where 4 suffice.) Slices of 192 bytes (three kv heads at head_dim 64) keep padded rows.
#pragma once

#include "decode.cuh"
#include "tc.cuh"

namespace kvq {
namespace decode_tc {

using namespace ::kvq::tc;

constexpr int kTile = 16;  // tokens per warp iteration
constexpr float kLog2e = 1.4426950408889634f;

// COLS > 1: the CTA's COLS warps divide each row's head_dim, HD columns each (the cache's head_dim is HD * COLS),
// and walk the same tiles, summing their partial scores in shared memory (split_kernel).
// NH > 1: each warp owns NH adjacent kv heads (8-bit, head_dim 64), whose rows of a token are one NH * 64-byte
// slice of the page: a head's 8-bit row there is half an L2 line, and a warp that copies only its own head's
// halves spends two L2 requests per line that one request of a wider slice fills.
template <typename S, int HD, int GMAX, int COLS = 1, int NH = 1>
struct Cfg {
  static constexpr bool kQuant = StorageTraits<S>::kQuantized;
  static constexpr int kRowBytes = HD * static_cast<int>(sizeof(S));  // one head's row
  static constexpr int kSpan = NH * kRowBytes;                        // the warp's slice of a token row
  static constexpr int kNC = kSpan / 16;  // 16-byte chunks per slice
  static constexpr int kCE = 16 / static_cast<int>(sizeof(S));  // elements per chunk
  static constexpr int kKPC = kCE / 4;  // QK k-steps fed by one chunk
  // Unquantized key rows are read in 16-byte chunks; 8-bit key rows in 8-byte words, one 32-element block per 4
  // threads; value rows in 8-byte words. kLines: the slice is whole 128-byte lines (or half of one), kept whole in
  // the ring and XOR-permuted inside (k_at, v_at); otherwise (192 bytes) 8-bit key rows padded by 32 bytes and value
  // rows by 16, which keeps those loads free of bank conflicts too.
  static constexpr bool kLines = kSpan % 128 == 0 || kSpan == 64;
  static constexpr int kKStride = kQuant && !kLines ? kSpan + 32 : kSpan;
  static_assert(kQuant || kLines, "decode_tc: unquantized rows are whole 128-byte lines");
  // L2 prefetch hint of the row copies (cp_async16), measured on an H200 against none or the other size:
  // unquantized rows 128 bytes (1.5-3% less time for bf16 from 4k tokens at 32/8 d128, 16/2 d256, 9/3 d64, batch
  // 1-64; 256 bytes up to 5% more); 8-bit rows at head_dim 128 256 bytes (0.8-2.5% less at 32/8 heads, batch 8 with
  // 128k tokens and batch 64 with 4k-32k, within 0.5% at batch 1 and batch 8 with 32k; 128 bytes had been mixed:
  // up to 8% more at batch 8-64 with 128k). At head_dim 64 256 bytes ranged from 12% less (9/3 heads, batch 64
  // with 4k) to 14% more (batch 1 with 128k), and at 256 it stayed within 1.3%, so those copy without one.
  static constexpr int kPrefetch = !kQuant ? 128 : (HD == 128 ? 256 : 0);
  static constexpr int kVStride = kLines ? kSpan : kSpan + 16;
  static constexpr int kNB = HD / kBlock;
  static constexpr int kScaleBytes = kQuant ? NH * kNB * 2 : 0;  // per row
  static constexpr int kKOff = 0;
  static constexpr int kVOff = kTile * kKStride;
  static constexpr int kKSOff = kVOff + kTile * kVStride;
  static constexpr int kVSOff = kKSOff + kTile * kScaleBytes;
  static constexpr int kMaskOff = kVSOff + kTile * kScaleBytes;
  static constexpr int kStageBytes = (kMaskOff + 16 + 127) / 128 * 128;  // stages start on 128-byte lines
  // Four warps of at least two stages each in 72 KB, so that three CTAs share an H100/H200 SM. Where they need more
  // but fit 110 KB (8-bit rows at head_dim 256 before their rows lost the pads: since then they would fit three CTAs,
  // whose 168 registers spill, so they stay at two, in 99 KB), four warps and two CTAs per SM: on an H200 that took up
  // to 17% less time than two warps in three CTAs (16/2 heads, batch 1-64, 1k-256k tokens; at most 1% more anywhere).
  // Otherwise (bf16 at head_dim 256) two warps in 72 KB. Two CTAs of four warps with deeper rings everywhere were
  // slower for head_dim 64 and 128 (up to 11%). 8-bit rows up to head_dim 128 with at most 8 query rows fit 128
  // registers: four CTAs in 56 KB each (at d128 two stages: kDepth below). On an H200 that
  // took 3-6% less time at batch 1 with 128k tokens, 14-23% at batch 64 with 1k-4k tokens (32/8 d128); it lost only on
  // fp8 at batch 64 with 128k tokens (6-7% more).
  // Every choice fits the 99 KB that one CTA may have on sm_89 and sm_120.
  // Column warps (COLS > 1) take the CTA counts above, and after their rings two buffers of every warp's partial
  // scores (split_kernel).
  // Warps of kv-head pairs or threes take three CTAs of four warps per SM, four stages for pairs (three while the rows
  // were padded, as in the measurements below) and two for threes (three times the bytes per tile); the launch bound
  // holds them to 168 registers (pairs use 123-154, threes 168; no spills, sm_90). On an H200, against two CTAs per
  // SM: threes (9/3 heads, q8_0 and fp8_e4m3, batch 1-64 with 4k-256k tokens, each with its fastest split count, two
  // alternated processes) 1-4% less time than two CTAs of three stages (186-197 registers) at every shape that runs
  // them (batch 64 with 32k tokens: q8_0 258.9 -> 249.9 us), where CTAs of three warps, four per SM, led at some
  // shapes (0.93x) and lost up to 16% at others (batch 1 with 256k tokens); pairs (32/8 and 16/4 heads, q8_0 and
  // fp8_e4m3, batch 1-64 with 1k-256k tokens where the plan runs them, same split counts, three alternated processes)
  // 0.93-1.00x the time of two CTAs of four stages (16/4 heads at batch 1 with 128k tokens fp8_e4m3 29.9 -> 27.8 us,
  // 32/8 at batch 8 with 8k q8_0 28.9 -> 27.5). On sm_89 and sm_120 (one CTA per SM either way) pairs had three stages
  // instead of four while their rows were padded (not measured), four again since.
  static constexpr bool kFour = kQuant && HD <= 128 && GMAX <= 8 && NH == 1;
  static constexpr int kWarps = COLS > 1 ? COLS : 4 * 2 * kStageBytes <= 110 * 1024 ? 4 : 2;
  static constexpr int kCtasPerSm =
      kFour ? 4 : NH > 1 ? 3 : (kWarps == 4 && (kQuant && HD == 256 || 4 * 2 * kStageBytes > 72 * 1024) ? 2 : 3);
  static constexpr int kXchBytes = COLS > 1 ? 2 * COLS * 32 * (GMAX > 8 ? 8 : 4) * 4 : 0;
  static constexpr int kSmemPerCta = (kCtasPerSm == 4 ? 56 : kCtasPerSm == 3 ? (COLS > 1 ? 74 : 72) : 99) * 1024;
  // 8-bit head_dim 128 rows keep the ring as deep as it was while they were padded (two stages in four CTAs per SM,
  // three in three): on an H200 the stage more that their unpadded rows fit took 9-13% more time wherever the cache
  // outgrew L2 by far (32/8 heads, batch 8 with 128k tokens, batch 64 with 8k-128k), 0-3% at its other shapes.
  static constexpr int kDepth = kQuant && HD == 128 ? (kFour ? 2 : 3) : 4;
  static constexpr int kStages = std::min(kDepth, (kSmemPerCta - kXchBytes) / (kWarps * kStageBytes));
  static constexpr int kRing = kWarps * kStages * kStageBytes;
  static constexpr int kXchOff = kRing;
  // The ring is reused at the end to combine the warps' partials ([warps][16][HD] + [warps][16][2] floats).
  static constexpr int kSmem = COLS > 1 ? kRing + kXchBytes : std::max(kRing, kWarps * NH * 16 * (HD + 2) * 4);
  static_assert(COLS == 1 || kCtasPerSm >= 3, "decode_tc: column warps are sized for three or four CTAs per SM");
  static_assert(NH == 1 || (kQuant && HD == 64 && GMAX <= 8 && COLS == 1), "decode_tc: NH > 1 is for 8-bit d64 rows");
  static_assert(kSmem % kWarps == 0, "decode_tc: a CTA of fewer warps takes kSmem / kWarps per warp");
  static constexpr int kRW = kRowBytes / 64;                   // 8-byte words per lane and value row
  static constexpr int kEPW = 8 / static_cast<int>(sizeof(S));  // elements per 8-byte word
  static_assert(kStages >= 2, "decode_tc: a tile does not fit twice");
  // Offsets in a stage of byte o of key (value) row r. Bits 5-6 are XORed with the row (bit 6 for unquantized keys),
  // which never moves a byte out of its 128-byte span: rows 0-3 (keys) or rows 2 tig (values), read together by
  // a half warp, land in different banks.
  static __device__ __forceinline__ int k_at(int r, int o) {
    const int x = !kQuant ? (r & 1) << 6 : kLines ? (r & 3) << 5 : 0;
    return kKOff + ((r * kKStride + o) ^ x);
  }
  static __device__ __forceinline__ int v_at(int r, int o) {
    const int x = kLines ? ((r >> 1) & 3) << 5 : 0;
    return kVOff + ((r * kVStride + o) ^ x);
  }
  // Byte o of row r of the warp's kv head h (h bytes into the slice) in stage st.
  static __device__ __forceinline__ const unsigned char* k_row(const unsigned char* st, int h, int r, int o) {
    if constexpr (kLines) return st + k_at(r, h + o);
    else return st + h + kKOff + r * kKStride + o;  // padded rows: in this order ptxas keeps them unspilled
  }
  static __device__ __forceinline__ const unsigned char* v_row(const unsigned char* st, int h, int r, int o) {
    if constexpr (kLines) return st + v_at(r, h + o);
    else return st + h + kVOff + r * kVStride + o;
  }
  static_assert(kSmem <= 99 * 1024, "decode_tc: a CTA must fit sm_89 and sm_120");
};

// Element j of two value rows' 8-byte words (tokens a and b), times each token's scale, as T pairs (a, b).
template <typename T, typename S>
__device__ __forceinline__ void value_pairs(uint2 wa, uint2 wb, uint16_t sa, uint16_t sb,
                                            uint32_t (&out)[8 / sizeof(S)]) {
  const uint32_t a[2] = {wa.x, wa.y}, b[2] = {wb.x, wb.y};
  if constexpr (!StorageTraits<S>::kQuantized) {
#pragma unroll
    for (int x = 0; x < 2; ++x) {
      out[2 * x] = __byte_perm(a[x], b[x], 0x5410);
      out[2 * x + 1] = __byte_perm(a[x], b[x], 0x7632);
    }
  } else if constexpr (std::is_same_v<T, __half>) {
    const uint32_t s2bits = uint32_t(sa) | (uint32_t(sb) << 16);
    const __half2 s2 = *reinterpret_cast<const __half2*>(&s2bits);
#pragma unroll
    for (int x = 0; x < 2; ++x) {
      __half2 h[4];
      if constexpr (std::is_same_v<S, int8_t>) {
        const uint32_t ua = a[x] ^ 0x80808080u, ub = b[x] ^ 0x80808080u;
        const uint32_t t01 = __byte_perm(ua, ub, 0x5140), t23 = __byte_perm(ua, ub, 0x7362);
        h[0] = int8x2_to_half2(t01, 0x4140u);
        h[1] = int8x2_to_half2(t01, 0x4342u);
        h[2] = int8x2_to_half2(t23, 0x4140u);
        h[3] = int8x2_to_half2(t23, 0x4342u);
      } else {
        const uint32_t t01 = __byte_perm(a[x], b[x], 0x5140), t23 = __byte_perm(a[x], b[x], 0x7362);
        h[0] = e4m3x2_to_half2(uint16_t(t01 & 0xFFFFu));
        h[1] = e4m3x2_to_half2(uint16_t(t01 >> 16));
        h[2] = e4m3x2_to_half2(uint16_t(t23 & 0xFFFFu));
        h[3] = e4m3x2_to_half2(uint16_t(t23 >> 16));
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const __half2 v = __hmul2(h[j], s2);  // exact product, one rounding: fp16(q * scale)
        out[4 * x + j] = *reinterpret_cast<const uint32_t*>(&v);
      }
    }
  } else {
    const float fsa = scale_to_float(sa), fsb = scale_to_float(sb);
#pragma unroll
    for (int x = 0; x < 2; ++x) {
      float fa[4], fb[4];
      unpack_raw<S, 4>(&a[x], fa);
      unpack_raw<S, 4>(&b[x], fb);
#pragma unroll
      for (int j = 0; j < 4; ++j) out[4 * x + j] = pack2<T>(fa[j] * fsa, fb[j] * fsb);  // exact product, one rounding
    }
  }
}

// 2^k for -126 <= k <= 127, exactly.
__device__ __forceinline__ float pow2(int k) { return __int_as_float((127 + k) << 23); }

// Eight 8-bit values (one 8-byte word) to their exact values (no scale) as four fp16 pairs, in order.
template <typename S>
__device__ __forceinline__ void raw8_to_half(uint2 raw, uint32_t (&h)[4]) {
  const uint32_t w[2] = {raw.x, raw.y};
#pragma unroll
  for (int x = 0; x < 2; ++x) {
    __half2 lo, hi;
    if constexpr (std::is_same_v<S, int8_t>) {
      const uint32_t u = w[x] ^ 0x80808080u;
      lo = int8x2_to_half2(u, 0x7170u);
      hi = int8x2_to_half2(u, 0x7372u);
    } else {
      lo = e4m3x2_to_half2(uint16_t(w[x] & 0xFFFFu));
      hi = e4m3x2_to_half2(uint16_t(w[x] >> 16));
    }
    h[2 * x] = *reinterpret_cast<const uint32_t*>(&lo);
    h[2 * x + 1] = *reinterpret_cast<const uint32_t*>(&hi);
  }
}

// Launch bounds of Cfg::kCtasPerSm CTAs per SM. An H100/H200 SM holds that many by shared memory, and the
// bound caps the registers so that its register file does too. An sm_89 or sm_120 SM holds one or two four-warp
// CTAs, so there the bound is dropped for those (it only forced spills). The two-warp CTAs (bf16, head_dim 256)
// keep three everywhere: it caps nothing for them (3 x 64 threads x 255 registers fit), but ptxas (nvcc 13.0)
// spills less with it on sm_89.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900
#define KVQ_DECODE_TC_MIN_BLOCKS(warps, ctas) (ctas)
#else
#define KVQ_DECODE_TC_MIN_BLOCKS(warps, ctas) ((warps) == 2 ? 3 : 1)
#endif

// grid (num_splits, num_kv_heads, batch); block kWarps * 32. T: the query dtype (and the mma operand type).
// COLS > 1: warp w takes columns [w HD, (w + 1) HD) of the cache's head_dim HD * COLS (Cfg).
// NH > 1: the warp owns kv heads [NH y, NH y + NH) for blockIdx.y = y, and keeps a softmax state for each.
template <typename S, typename T, int HD, int GMAX, int COLS = 1, int NH = 1>
__global__ void __launch_bounds__(Cfg<S, HD, GMAX, COLS, NH>::kWarps * 32,
                                  KVQ_DECODE_TC_MIN_BLOCKS((Cfg<S, HD, GMAX, COLS, NH>::kWarps),
                                                           (Cfg<S, HD, GMAX, COLS, NH>::kCtasPerSm)))
    split_kernel(const __grid_constant__ DecodeParams p, const __grid_constant__ FastDivmod pdm) {
  using C = Cfg<S, HD, GMAX, COLS, NH>;
  constexpr int kHead = HD * COLS;  // the cache's head_dim
  constexpr bool kQuant = C::kQuant;
  constexpr bool kRows2 = GMAX > 8;  // rows 8..15 hold query heads
  constexpr int kRows = kRows2 ? 2 : 1;
  constexpr int KS = HD / 16;        // k-steps of Q K^T
  // P V in fp16 (see the top): for fp16 queries, and for 8-bit caches at head_dim 128 and 256 with bf16 queries tile
  // by tile (kGuarded); at head_dim 64 too for warps of two kv heads. On an H200 (q8_0, bf16 queries, the time of two
  // kv heads per warp over that of one kv head per warp in the same process, against the same ratio with bf16 P V)
  // that took 3-10% off 32/8 heads at batch 1 with 128k tokens, batch 8 with 32k-128k and batch 64 with 4k-32k; warps
  // of three kv heads (9/3 heads), whose instance then carries both P V routes for each of its heads, took 5-11% more
  // (bench/results/h200-2026-12-01-decode-rows-ab.json against -decode-rows-fp16-pv.json).
  constexpr bool kGuarded = kQuant && !std::is_same_v<T, __half> && (kHead >= 128 || NH == 2);
  constexpr bool kP16 = kGuarded || std::is_same_v<T, __half>;
  constexpr float kPExp = kP16 ? 15.0f : 0.0f;

  // The merge may be scheduled (see common.cuh). Without one, the kernel after this one waits for its exit: a next
  // call's split scheduled now would hold CTA slots this grid's later waves need (on an H200, batch 64 with 1k
  // tokens: up to 26% more time).
  if (p.num_splits > 1) launch_dependents();
  wait_for_primary();  // whatever ran before on the stream
  extern __shared__ __align__(128) unsigned char smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int gid = lane / 4, tig = lane % 4;
  unsigned char* ring = smem + warp * C::kStages * C::kStageBytes;

  // One kv head per CTA, its warps taking the split's tiles round robin, or one per warp (a CTA of
  // heads_per_cta warps, at most kWarps), each warp walking the whole split of its head.
  const bool warp_heads = COLS == 1 && NH == 1 && p.heads_per_cta > 1;
  const int split = blockIdx.x, kvh = warp_heads ? blockIdx.y * p.heads_per_cta + warp : blockIdx.y * NH;
  const int b = blockIdx.z;
  const int col0 = COLS > 1 ? warp * HD : 0;  // this warp's first column
  const int G = p.num_q_heads / p.num_kv_heads;
  const paged_kv_t<S> cache = detail::decode_cache<S, kHead>(p);

  // Q fragments, head_dim permuted as the keys are read (see the QK loop). For 8-bit keys the scores are
  // sum over blocks of scale_block * (q . raw_block) on fp16 tensor cores: each row of q is multiplied by a
  // power of two that brings its largest element into [2^14, 2^15) (exact for bf16 and fp16 queries), and
  // the score is multiplied back in fp32.
  // Unquantized caches read the query after the first tiles are in flight, so that at short contexts the
  // two global round trips overlap (on an H200, bf16, 1k-8k tokens: 1-5% less time at head_dim 128; at 256
  // the 16-row kernel was 4-9% slower than the 8-row one without it and 7-17% faster with it). 8-bit caches
  // issue the query loads before their first tiles and scale the rows after them, so the load, the tiles'
  // copies and the per-row maximum overlap (on an H200: 1-8% less time than loading and scaling before the
  // tiles, most at short contexts; one shape, 9/3 heads, d64, batch 64, 32k, q8_0, 6-10% more). Doing all
  // of it after the tiles cost 3-9% at 1k-8k tokens, and all of it at the top of the kernel made ptxas
  // (sm_90) spill a register inside the tile loop of the head_dim 128, 8-row instance (6-13% more time at
  // batch 64).
  using QT = std::conditional_t<kQuant, __half, T>;
  uint32_t qa_all[NH][KS][kRows2 ? 4 : 2];  // [kv head of the warp]
  float qs_all[NH][kRows];  // per row: sm_scale (* log2 e) / the row's power of two
  const bool softcap = p.logit_softcap > 0.0f;
  const float qscale = softcap ? p.sm_scale : p.sm_scale * kLog2e;
  // k-steps 2j and 2j + 1 of this thread take elements [8 c, 8 c + 8) of its rows, c = 4 j + tig (k = 2 tig,
  // 2 tig + 1 from words 0 and 2, k = 2 tig + 8, 2 tig + 9 from words 1 and 3): one 16-byte load per row and
  // pair of k-steps (the adapter passes a 16-byte aligned query).
  constexpr int kQC = HD / 32;
  uint4 raw_all[NH][kRows][kQC];
  auto fetch_query = [&]() {
#pragma unroll
    for (int hh = 0; hh < NH; ++hh) {
      auto& raw = raw_all[hh];
      const T* q = static_cast<const T*>(p.query) + b * p.q_stride_batch + (kvh + hh) * G * p.q_stride_head + col0 +
                   8 * tig;
#pragma unroll
      for (int h = 0; h < kRows; ++h) {
        const int row = gid + 8 * h;
#pragma unroll
        for (int j = 0; j < kQC; ++j)
          raw[h][j] = row < G ? __ldg(reinterpret_cast<const uint4*>(q + row * p.q_stride_head + 32 * j))
                              : make_uint4(0u, 0u, 0u, 0u);
      }
    }
  };
  auto query_fragments = [&]() {  // raw -> qs, qa
#pragma unroll
    for (int hh = 0; hh < NH; ++hh) {
      auto& raw = raw_all[hh];
      auto& qs = qs_all[hh];
      auto& qa = qa_all[hh];
#pragma unroll
      for (int h = 0; h < kRows; ++h) {
        qs[h] = qscale;
        if constexpr (kQuant) {
          float f[kQC][8];
          float amax = 0.0f;
#pragma unroll
          for (int j = 0; j < kQC; ++j) {
            unpack8<T>(raw[h][j], f[j]);
#pragma unroll
            for (int e = 0; e < 8; ++e) amax = fmaxf(amax, fabsf(f[j][e]));
          }
          amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
          amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
          // amax in [2^(ex-1), 2^ex) (a subnormal amax reads as ex = -126, which the clamp below treats alike)
          const int ex = amax > 0.0f && amax <= 3.4e38f ? ((__float_as_int(amax) >> 23) & 0xFF) - 126 : 0;
          const int shift = min(max(15 - ex, -120), 100);
          qs[h] = qscale * pow2(-shift);
          const float mul = pow2(shift);  // as ldexpf: exact unless the result is subnormal
#pragma unroll
          for (int j = 0; j < kQC; ++j) {
            uint32_t* w = reinterpret_cast<uint32_t*>(&raw[h][j]);
#pragma unroll
            for (int x = 0; x < 4; ++x) w[x] = pack2<__half>(f[j][2 * x] * mul, f[j][2 * x + 1] * mul);
          }
        }
      }
#pragma unroll
      for (int j = 0; j < kQC; ++j)
#pragma unroll
        for (int s = 0; s < 2; ++s) {
          const uint32_t* w0 = reinterpret_cast<const uint32_t*>(&raw[0][j]);
          const uint32_t* w1 = reinterpret_cast<const uint32_t*>(&raw[kRows - 1][j]);
          if constexpr (kRows2) {
            qa[2 * j + s][0] = w0[2 * s];
            qa[2 * j + s][1] = w1[2 * s];
            qa[2 * j + s][2] = w0[2 * s + 1];
            qa[2 * j + s][3] = w1[2 * s + 1];
          } else {
            qa[2 * j + s][0] = w0[2 * s];
            qa[2 * j + s][1] = w0[2 * s + 1];
          }
        }
    }
  };
  const detail::WarpTokens wt = warp_heads || COLS > 1
                                    ? detail::warp_tokens<kTile>(p, cache.length(b), split, 0, 1)
                                    : detail::warp_tokens<kTile>(p, cache.length(b), split, warp, C::kWarps);
  const int end = wt.end, first = wt.first, step = wt.step, num_tiles = wt.count;

  const unsigned char* kbase = static_cast<const unsigned char*>(p.k_cache);
  const unsigned char* vbase = static_cast<const unsigned char*>(p.v_cache);

  // Copies of tile c (tokens first + c * step + [0, 16)) into stage c % kStages, and its validity mask. Row copies
  // carry the L2 prefetch hint of Cfg::kPrefetch. Lane copies 16-byte piece lane % kNC of rows i * kRPI + lane /
  // kNC, and the scales of row lane % 16 (keys in lanes 0-15, values in 16-31). A tile inside one page (the common
  // case: page sizes that are multiples of 16) reads one block-table entry and finds its rows by addition from
  // pointers fixed before the loop, one 64-bit multiply per tensor; a tile that straddles pages looks up each row's
  // page. (Per-tile 64-bit offsets from the page and row had been about 145 of the 462 instructions of a q8_0 tile
  // at head_dim 64; with this, a partial-tile mask test and a one-instruction NaN-propagating max: 401. On an H200
  // that took a median of 1-3% off 8-bit decode, 1% off bf16; the d64 8-bit kernel is not issue-bound, see README.)
  constexpr int kRPI = 32 / C::kNC, kIters = kTile / kRPI;
  const int r_lane = lane / C::kNC, piece = lane % C::kNC;
  const int r0 = lane % kTile;
  const int row_bytes = p.num_kv_heads * kHead * static_cast<int>(sizeof(S));  // one token of a page
  const int col_bytes = col0 * static_cast<int>(sizeof(S));
  const int lane_bytes = (kvh * kHead) * static_cast<int>(sizeof(S)) + col_bytes + r_lane * row_bytes + piece * 16;
  const unsigned char* k_lane = kbase + lane_bytes;  // row r_lane, offset 0 of page 0
  const unsigned char* v_lane = vbase + lane_bytes;
  const int64_t k_page_bytes = p.k_stride_page * static_cast<int64_t>(sizeof(S));
  const int64_t v_page_bytes = p.v_stride_page * static_cast<int64_t>(sizeof(S));
  const bool scale_of_k = lane < kTile;
  // The scales of row r0 of page 0 (fp16 elements), and the elements one token and one page apart.
  const uint16_t* s_lane = (scale_of_k ? p.k_scale : p.v_scale) + (r0 * p.num_kv_heads + kvh) * C::kNB * COLS +
                          col0 / kBlock;
  const int s_token = p.num_kv_heads * C::kNB * COLS;
  const int64_t s_page = static_cast<int64_t>(p.page_size) * s_token;
  // Block-table entries of the warp's tiles, 32 at a time (lane l holds tile 32 k + l's page, or -1), read
  // a block ahead: a lookup in the loop would put a global round trip before every tile's copies.
  auto table_block = [&](int k) -> int {
    const int c = 32 * k + lane;
    if (c >= num_tiles) return -1;
    int idx, off;
    pdm.divmod(first + c * step, idx, off);
    return static_cast<int>(cache.page_at(b, idx));
  };
  int pages_cur = table_block(0), pages_next = table_block(1);
  auto issue = [&](int c) {
    if (c % 32 == 0 && c > 0) pages_cur = pages_next, pages_next = table_block(c / 32 + 1);
    const int tile_page = __shfl_sync(0xffffffffu, pages_cur, c % 32);
    unsigned char* st = ring + (c % C::kStages) * C::kStageBytes;
    const uint32_t st_addr = smem_addr(st);
    const int t0 = first + c * step;
    int idx0, off0;
    pdm.divmod(t0, idx0, off0);
    // Piece pc of row r, from ksrc / vsrc (16 bytes, or zeros when !ok).
    auto copy = [&](int r, int pc, const unsigned char* ksrc, const unsigned char* vsrc, bool ok) {
      cp_async16<C::kPrefetch>(st_addr + C::k_at(r, pc * 16), ksrc, ok ? 16 : 0);
      cp_async16<C::kPrefetch>(st_addr + C::v_at(r, pc * 16), vsrc, ok ? 16 : 0);
    };
    // Row r's page (-1 past the end or outside the cache) and offset in it, for tiles that straddle pages.
    auto locate = [&](int r, int64_t& page, int& off) {
      int idx;
      pdm.divmod(t0 + r, idx, off);
      page = t0 + r < end ? cache.page_at(b, idx) : -1;
    };
    uint32_t valid;  // bit r: row r of the tile is a visible token
    if constexpr (NH > 1) {
      // The warp's slices of the tile's rows as kTile * kNC pieces in order, 32 per step, and the rows' scales as
      // 4-byte words in order (keys, then values), so that a step of a tile inside one page covers whole lines.
      constexpr int kPieceSteps = kTile * C::kNC / 32, kSW = C::kScaleBytes / 4;  // scale words per row
      static_assert(kTile * C::kNC % 32 == 0, "decode_tc: a tile's slices are whole steps of the warp");
      // Scale word j of the tile (row r, word x of its slice) from the scales of the warp's first head of `slot`.
      auto copy_scale = [&](int r, int x, bool of_k, int64_t slot, bool ok) {
        const uint16_t* src = (of_k ? p.k_scale : p.v_scale) + (slot * p.num_kv_heads + kvh) * C::kNB + 2 * x;
        cp_async_small<4>(st_addr + (of_k ? C::kKSOff : C::kVSOff) + r * C::kScaleBytes + 4 * x, ok ? src : p.k_scale,
                          ok ? 4 : 0);
      };
      const int head_bytes = kvh * kHead * static_cast<int>(sizeof(S));
      if (off0 + kTile <= p.page_size) {
        const int n = tile_page >= 0 ? min(kTile, end - t0) : 0;  // rows [0, n) are valid
        const int64_t pg = tile_page >= 0 ? tile_page : 0;
        const unsigned char* kb = kbase + head_bytes + pg * k_page_bytes + off0 * row_bytes;
        const unsigned char* vb = vbase + head_bytes + pg * v_page_bytes + off0 * row_bytes;
#pragma unroll
        for (int i = 0; i < kPieceSteps; ++i) {
          const int idx = 32 * i + lane, r = idx / C::kNC, pc = idx % C::kNC;
          copy(r, pc, kb + r * row_bytes + pc * 16, vb + r * row_bytes + pc * 16, r < n);
        }
        valid = n >= kTile ? 0xFFFFu : (1u << n) - 1u;
        const int64_t slot0 = pg * p.page_size + off0;
#pragma unroll
        for (int j = 0; j < kSW; ++j) {
          const int w = 32 * j + lane;
          const bool of_k = w < kTile * kSW;
          const int q = of_k ? w : w - kTile * kSW, r = q / kSW;
          copy_scale(r, q % kSW, of_k, slot0 + r, r < n);
        }
      } else {
#pragma unroll
        for (int i = 0; i < kPieceSteps; ++i) {
          const int idx = 32 * i + lane, r = idx / C::kNC, pc = idx % C::kNC;
          int64_t page;
          int off;
          locate(r, page, off);
          const bool ok = page >= 0;
          const int64_t ko = ok ? cache.k_offset(page, off, kvh) * static_cast<int64_t>(sizeof(S)) : 0;
          const int64_t vo = ok ? cache.v_offset(page, off, kvh) * static_cast<int64_t>(sizeof(S)) : 0;
          copy(r, pc, kbase + ko + pc * 16, vbase + vo + pc * 16, ok);
        }
        int64_t page;
        int off;
        locate(r0, page, off);
        valid = __ballot_sync(0xffffffffu, page >= 0) & 0xFFFFu;
#pragma unroll
        for (int j = 0; j < kSW; ++j) {
          const int w = 32 * j + lane;
          const bool of_k = w < kTile * kSW;
          const int q = of_k ? w : w - kTile * kSW, r = q / kSW;
          locate(r, page, off);
          copy_scale(r, q % kSW, of_k, page * p.page_size + off, page >= 0);
        }
      }
    } else if (off0 + kTile <= p.page_size) {
      // All 16 rows of the tile are in page `pg` (rows past the sequence's end too: their copies read nothing,
      // but their addresses stay inside the cache).
      const int n = tile_page >= 0 ? min(kTile, end - t0) : 0;  // rows [0, n) are valid
      const int64_t pg = tile_page >= 0 ? tile_page : 0;
      // 32-bit row offset: the adapter refuses pages of 2 GiB or more. (In 64 bits, on an H200, 16/2 heads d256
      // q8_0 at batch 1 with 128k tokens took 3.5% more time.)
      const unsigned char* kb = k_lane + pg * k_page_bytes + off0 * row_bytes;
      const unsigned char* vb = v_lane + pg * v_page_bytes + off0 * row_bytes;
#pragma unroll
      for (int i = 0; i < kIters; ++i)
        copy(i * kRPI + r_lane, piece, kb + i * kRPI * row_bytes, vb + i * kRPI * row_bytes, i * kRPI + r_lane < n);
      valid = n >= kTile ? 0xFFFFu : (1u << n) - 1u;
      if constexpr (kQuant) {
        cp_async_small<C::kScaleBytes>(st_addr + (scale_of_k ? C::kKSOff : C::kVSOff) + r0 * C::kScaleBytes,
                                       s_lane + pg * s_page + off0 * s_token, r0 < n ? C::kScaleBytes : 0);
      }
    } else {
#pragma unroll
      for (int i = 0; i < kIters; ++i) {
        int64_t page;
        int off;
        locate(i * kRPI + r_lane, page, off);
        const bool ok = page >= 0;
        const int64_t ko = ok ? cache.k_offset(page, off, kvh) * static_cast<int64_t>(sizeof(S)) : 0;
        const int64_t vo = ok ? cache.v_offset(page, off, kvh) * static_cast<int64_t>(sizeof(S)) : 0;
        copy(i * kRPI + r_lane, piece, kbase + ko + col_bytes + piece * 16, vbase + vo + col_bytes + piece * 16, ok);
      }
      int64_t page;
      int off;
      locate(r0, page, off);
      const bool ok0 = page >= 0;
      valid = __ballot_sync(0xffffffffu, ok0) & 0xFFFFu;
      if constexpr (kQuant) {
        const int64_t so = ok0 ? cache.scale_offset(page * p.page_size + off, kvh) + col0 / kBlock : 0;
        cp_async_small<C::kScaleBytes>(st_addr + (scale_of_k ? C::kKSOff : C::kVSOff) + r0 * C::kScaleBytes,
                                       (scale_of_k ? p.k_scale : p.v_scale) + so, ok0 ? C::kScaleBytes : 0);
      }
    }
    if (lane == 0) *reinterpret_cast<uint32_t*>(st + C::kMaskOff) = valid;
  };

  // o[mt][h]: the m-tile mt of O^T (rows: 16 value columns, see the P V step) for query heads 8 h + 2 tig and
  // 8 h + 2 tig + 1 (columns), as the mma's C fragment; one such state per kv head of the warp.
  float m_all[NH][kRows], l_all[NH][kRows], o_all[NH][HD / 16][kRows][4];
#pragma unroll
  for (int hh = 0; hh < NH; ++hh) {
#pragma unroll
    for (int h = 0; h < kRows; ++h) m_all[hh][h] = -INFINITY, l_all[hh][h] = 0.0f;
#pragma unroll
    for (int mt = 0; mt < HD / 16; ++mt)
#pragma unroll
      for (int h = 0; h < kRows; ++h)
#pragma unroll
        for (int e = 0; e < 4; ++e) o_all[hh][mt][h][e] = 0.0f;
  }

  if constexpr (kQuant) fetch_query();
#pragma unroll
  for (int s = 0; s < C::kStages - 1; ++s) {
    if (s < num_tiles) issue(s);
    cp_async_commit();
  }
  if constexpr (!kQuant) fetch_query();
  query_fragments();
  for (int c = 0; c < num_tiles; ++c) {
    if (c + C::kStages - 1 < num_tiles) issue(c + C::kStages - 1);
    cp_async_commit();
    cp_async_wait<C::kStages - 1>();
    __syncwarp();
    const unsigned char* st = ring + (c % C::kStages) * C::kStageBytes;
    const uint32_t valid = *reinterpret_cast<const uint32_t*>(st + C::kMaskOff);
    const uint16_t* kss_tile = reinterpret_cast<const uint16_t*>(st + C::kKSOff);
    const uint16_t* vss_tile = reinterpret_cast<const uint16_t*>(st + C::kVSOff);
    // bf16 queries over an 8-bit cache: P V in fp16 where every value scale of the tile is below kScaleMax
    // (fp16 bits, sign cleared), tested two at a time: a half at or above it sets its top bit when added to
    // 0x8000 - kScaleMax. Rows past the end hold zero scales.
    bool pv16 = false;
    if constexpr (kGuarded) {
      constexpr uint32_t kScaleMax = std::is_same_v<S, int8_t> ? 0x6000u : 0x5800u;  // 2^9, 2^7
      constexpr int kWords = kTile * C::kScaleBytes / 4;
      const uint32_t* sw = reinterpret_cast<const uint32_t*>(vss_tile);
      uint32_t over = 0;
#pragma unroll
      for (int j = 0; j < (kWords + 31) / 32; ++j)
        over |= ((sw[(lane + 32 * j) % kWords] & 0x7FFF7FFFu) + (0x8000u - kScaleMax) * 0x10001u) & 0x80008000u;
      pv16 = __all_sync(0xffffffffu, over == 0);
    }

#pragma unroll
    for (int hh = 0; hh < NH; ++hh) {  // each kv head of the warp: its columns of the rows, its scales, its state
      auto& qa = qa_all[hh];
      auto& qs = qs_all[hh];
      auto& m = m_all[hh];
      auto& l = l_all[hh];
      auto& o = o_all[hh];
      const int hoff = hh * C::kRowBytes;  // the kv head's bytes in the warp's slice
      const uint16_t* kss = kss_tile + hh * C::kNB;  // row t's block scales at t * kSR
      const uint16_t* vss = vss_tile + hh * C::kNB;
      constexpr int kSR = NH * C::kNB;
      // ---- Scores s[nt][e] = S[head gid + 8 h][token nt*8 + 2 tig + e % 2] (h = e / 2), in fp32.
      // Unquantized keys: thread (gid, tig) reads 16-byte chunks 4 ic + tig of its key rows. 8-bit: bytes
      // [32 blk + 8 tig, +8) of the rows for every block; the block's two k-steps give q . raw_block, which is
      // scaled by the key's block scale in fp32.
      float s[2][4];
      if constexpr (kRows2) {
        // 16 query rows: S = Q K^T with the keys as the n-tiles (tokens nt*8 + gid read, nt*8 + 2 tig + {0,1} held).
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const int row = nt * 8 + gid;
          float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
          if constexpr (kQuant) {
            const int t0 = nt * 8 + 2 * tig;
            uint16_t sc0[C::kNB], sc1[C::kNB];
#pragma unroll
            for (int blk = 0; blk < C::kNB; ++blk)
              sc0[blk] = kss[t0 * kSR + blk], sc1[blk] = kss[(t0 + 1) * kSR + blk];
#pragma unroll
            for (int blk = 0; blk < C::kNB; ++blk) {
              uint32_t h[4];
              raw8_to_half<S>(*reinterpret_cast<const uint2*>(C::k_row(st, hoff, row, 32 * blk + 8 * tig)), h);
              float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
              mma16816<QT>(part, qa[2 * blk], h[0], h[1]);
              mma16816<QT>(part, qa[2 * blk + 1], h[2], h[3]);
              const float k0 = scale_to_float(sc0[blk]), k1 = scale_to_float(sc1[blk]);
              acc[0] = fmaf(part[0], k0, acc[0]);
              acc[1] = fmaf(part[1], k1, acc[1]);
              acc[2] = fmaf(part[2], k0, acc[2]);
              acc[3] = fmaf(part[3], k1, acc[3]);
            }
          } else {
#pragma unroll
            for (int ic = 0; ic < C::kNC / 4; ++ic) {
              const int chunk = 4 * ic + tig;
              const uint4 raw = *reinterpret_cast<const uint4*>(C::k_row(st, hoff, row, chunk * 16));
              const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
              for (int i = 0; i < C::kKPC; ++i) mma16816<QT>(acc, qa[ic * C::kKPC + i], w[2 * i], w[2 * i + 1]);
            }
          }
#pragma unroll
          for (int e = 0; e < 4; ++e) s[nt][e] = acc[e];
        }
      } else {
        // At most 8 query rows: S^T = K Q^T, the 16 tokens as the m rows (gid and gid + 8 read and held) and the
        // heads as the n columns (2 tig, 2 tig + 1 held), so that no half of an mma is padding; an in-register
        // transpose then gives the thread the layout above. The query fragments serve as B unchanged.
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // tokens gid (0, 1) and gid + 8 (2, 3) x heads 2 tig + {0, 1}
        if constexpr (kQuant) {
          uint16_t sc0[C::kNB], sc8[C::kNB];
#pragma unroll
          for (int blk = 0; blk < C::kNB; ++blk)
            sc0[blk] = kss[gid * kSR + blk], sc8[blk] = kss[(gid + 8) * kSR + blk];
#pragma unroll
          for (int blk = 0; blk < C::kNB; ++blk) {
            uint32_t h0[4], h8[4];
            raw8_to_half<S>(*reinterpret_cast<const uint2*>(C::k_row(st, hoff, gid, 32 * blk + 8 * tig)), h0);
            raw8_to_half<S>(*reinterpret_cast<const uint2*>(C::k_row(st, hoff, gid + 8, 32 * blk + 8 * tig)), h8);
            float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            const uint32_t a0[4] = {h0[0], h8[0], h0[1], h8[1]}, a1[4] = {h0[2], h8[2], h0[3], h8[3]};
            mma16816<QT>(part, a0, qa[2 * blk][0], qa[2 * blk][1]);
            mma16816<QT>(part, a1, qa[2 * blk + 1][0], qa[2 * blk + 1][1]);
            const float g0 = scale_to_float(sc0[blk]), g8 = scale_to_float(sc8[blk]);
            acc[0] = fmaf(part[0], g0, acc[0]);
            acc[1] = fmaf(part[1], g0, acc[1]);
            acc[2] = fmaf(part[2], g8, acc[2]);
            acc[3] = fmaf(part[3], g8, acc[3]);
          }
        } else {
#pragma unroll
          for (int ic = 0; ic < C::kNC / 4; ++ic) {
            const int chunk = 4 * ic + tig;
            const uint4 r0 = *reinterpret_cast<const uint4*>(C::k_row(st, hoff, gid, chunk * 16));
            const uint4 r8 = *reinterpret_cast<const uint4*>(C::k_row(st, hoff, gid + 8, chunk * 16));
            const uint32_t w0[4] = {r0.x, r0.y, r0.z, r0.w}, w8[4] = {r8.x, r8.y, r8.z, r8.w};
#pragma unroll
            for (int i = 0; i < C::kKPC; ++i) {
              const uint32_t a[4] = {w0[2 * i], w8[2 * i], w0[2 * i + 1], w8[2 * i + 1]};
              mma16816<QT>(acc, a, qa[ic * C::kKPC + i][0], qa[ic * C::kKPC + i][1]);
            }
          }
        }
        transpose8x8(acc[0], acc[1]);  // tokens 0..7
        transpose8x8(acc[2], acc[3]);  // tokens 8..15
        s[0][0] = acc[0], s[0][1] = acc[1], s[1][0] = acc[2], s[1][1] = acc[3];
        s[0][2] = s[0][3] = s[1][2] = s[1][3] = 0.0f;  // no rows 8..15
      }
      // ---- online softmax; thread holds rows gid (e = 0, 1) and gid + 8 (e = 2, 3), tokens nt*8 + 2 tig + e%2.
      // The soft-cap test is taken once per tile, not per score, so the four scores of a row stay one block.
      float x[kRows][2][2];
#pragma unroll
      for (int h = 0; h < kRows; ++h)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) x[h][nt][e] = s[nt][2 * h + e] * qs[h];
      if constexpr (COLS > 1) {
        // The scores over all columns: every warp adds the COLS partials (each with its own query scale: for 8-bit
        // caches each warp scales its columns of the query by its own power of two) in the same order, so all of
        // them hold the same scores, softmax state and P. Two buffers by tile parity: a warp writes this one again
        // only after the next tile's barrier, which every warp reaches after its reads here.
        float4* xch = reinterpret_cast<float4*>(smem + C::kXchOff) + (c & 1) * (COLS * 32 * kRows);
#pragma unroll
        for (int h = 0; h < kRows; ++h)
          xch[(warp * 32 + lane) * kRows + h] = make_float4(x[h][0][0], x[h][0][1], x[h][1][0], x[h][1][1]);
        __syncthreads();
#pragma unroll
        for (int h = 0; h < kRows; ++h) {
          float4 sum = xch[lane * kRows + h];
#pragma unroll
          for (int w = 1; w < COLS; ++w) {
            const float4 a = xch[(w * 32 + lane) * kRows + h];
            sum.x += a.x, sum.y += a.y, sum.z += a.z, sum.w += a.w;
          }
          x[h][0][0] = sum.x, x[h][0][1] = sum.y, x[h][1][0] = sum.z, x[h][1][1] = sum.w;
        }
      }
      if (softcap) {
#pragma unroll
        for (int h = 0; h < kRows; ++h)
#pragma unroll
          for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) x[h][nt][e] = p.logit_softcap * tanhf(x[h][nt][e] / p.logit_softcap) * kLog2e;
      }
      if (valid != 0xFFFFu) {  // a tile with rows past the end or outside the cache (all but a few are full)
#pragma unroll
        for (int h = 0; h < kRows; ++h)
#pragma unroll
          for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) x[h][nt][e] = (valid >> (nt * 8 + 2 * tig + e)) & 1 ? x[h][nt][e] : -INFINITY;
      }
      float mn[kRows], corr[kRows];
      bool grew = false;
#pragma unroll
      for (int h = 0; h < kRows; ++h) {
        float mx = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) mx = nanmax(mx, x[h][nt][e]);
        mx = nanmax(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = nanmax(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        mn[h] = nanmax(m[h], mx);
        corr[h] = mn[h] == -INFINITY ? 1.0f : fast_exp2(m[h] - mn[h]);
        grew |= corr[h] != 1.0f;
      }
      // The running max settles early in a long sequence: rescale the accumulators only in the tiles that
      // move it (skipping a multiply by exactly 1 changes nothing).
      if (__any_sync(0xffffffffu, grew)) {
#pragma unroll
        for (int h = 0; h < kRows; ++h) {
          // corr[h] belongs to head gid + 8 h; this thread's accumulators hold heads 8 h + 2 tig + {0, 1}.
          const float c0 = __shfl_sync(0xffffffffu, corr[h], 8 * tig);
          const float c1 = __shfl_sync(0xffffffffu, corr[h], 8 * tig + 4);
#pragma unroll
          for (int mt = 0; mt < HD / 16; ++mt) {
            o[mt][h][0] *= c0, o[mt][h][1] *= c1;
            o[mt][h][2] *= c0, o[mt][h][3] *= c1;
          }
        }
      }
      float pr[kRows][2][2];  // P, times 2^kPExp
#pragma unroll
      for (int h = 0; h < kRows; ++h) {
        const float mp = mn[h] - kPExp;
        float sum = 0.0f;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            pr[h][nt][e] = mn[h] == -INFINITY ? 0.0f : fast_exp2(x[h][nt][e] - mp);
            sum += pr[h][nt][e];
          }
        m[h] = mn[h];
        l[h] = l[h] * corr[h] + sum;
      }

      // ---- O^T += V^T P^T, the value columns as the m rows and the heads as the n columns (so that no half of an
      // mma is padding): thread reads 8-byte word gid + 8 r of value rows 2 tig, 2 tig + 1, 2 tig + 8, 2 tig + 9;
      // elements 2 jj and 2 jj + 1 of the word are rows gid and gid + 8 of m-tile r * EPW / 2 + jj. In fp16 or T.
      auto pv = [&](auto half) {
        using M = std::conditional_t<decltype(half)::value, __half, T>;
        uint32_t pa[4];
#pragma unroll
        for (int h = 0; h < kRows; ++h) {
          pa[h] = pack2<M>(pr[h][0][0], pr[h][0][1]);      // P^T as B: tokens 2 tig, 2 tig + 1 of head gid + 8 h
          pa[2 + h] = pack2<M>(pr[h][1][0], pr[h][1][1]);  // and tokens 2 tig + 8, 2 tig + 9
        }
#pragma unroll
        for (int r = 0; r < C::kRW; ++r) {
          const int wo = (gid + 8 * r) * 8;
          const uint2 wa = *reinterpret_cast<const uint2*>(C::v_row(st, hoff, 2 * tig, wo));
          const uint2 wb = *reinterpret_cast<const uint2*>(C::v_row(st, hoff, 2 * tig + 1, wo));
          const uint2 wc = *reinterpret_cast<const uint2*>(C::v_row(st, hoff, 2 * tig + 8, wo));
          const uint2 wd = *reinterpret_cast<const uint2*>(C::v_row(st, hoff, 2 * tig + 9, wo));
          uint16_t sa = 0, sb = 0, sc = 0, sd = 0;
          if constexpr (kQuant) {
            const int blk = wo / kBlock;  // bytes == elements for 8-bit rows
            const int t0 = 2 * tig;
            sa = vss[t0 * kSR + blk], sb = vss[(t0 + 1) * kSR + blk];
            sc = vss[(t0 + 8) * kSR + blk], sd = vss[(t0 + 9) * kSR + blk];
          }
          uint32_t b0[C::kEPW], b1[C::kEPW];
          value_pairs<M, S>(wa, wb, sa, sb, b0);
          value_pairs<M, S>(wc, wd, sc, sd, b1);
#pragma unroll
          for (int jj = 0; jj < C::kEPW / 2; ++jj) {
            const uint32_t a[4] = {b0[2 * jj], b0[2 * jj + 1], b1[2 * jj], b1[2 * jj + 1]};
#pragma unroll
            for (int h = 0; h < kRows; ++h) mma16816<M>(o[r * C::kEPW / 2 + jj][h], a, pa[h], pa[2 + h]);
          }
        }
      };
      if constexpr (kGuarded) {
        if (pv16) {
          pv(std::true_type{});
        } else {
          pv(std::false_type{});
        }
      } else {
        pv(std::bool_constant<kP16>{});
      }
    }  // kv heads of the warp
    __syncwarp();  // the stage is refilled by the next iteration
  }
  cp_async_wait<0>();

  // Value columns (gid + 8 r) * EPW + [0, EPW) of accumulator column e of row block h: row gid (gid + 8) of m-tile
  // r * EPW / 2 + jj is value column (gid + 8 r) * EPW + 2 jj (+ 1).
  // (Of the warp's kv head hh.)
  auto value_columns = [&](int hh, int r, int h, int e, float (&v)[C::kEPW]) {
#pragma unroll
    for (int jj = 0; jj < C::kEPW / 2; ++jj) {
      v[2 * jj] = o_all[hh][r * C::kEPW / 2 + jj][h][e];
      v[2 * jj + 1] = o_all[hh][r * C::kEPW / 2 + jj][h][2 + e];
    }
  };
  constexpr bool kWarpWrites = HD == 128 && COLS == 1;
  if constexpr (kWarpWrites || COLS > 1) {
    if (warp_heads || COLS > 1) {
      // One kv head per warp at head_dim 128: its partial goes from registers to the workspace (or, with one
      // split, the output), with no block barrier, so a warp that ends early does not wait for the CTA's last. On
      // an H200 (32/8 heads, 8-bit) the split kernel's last stores came 1.1 us sooner after its loop at batch 1 with
      // 128k tokens (0.55 against 1.66 us), and the calls took 1.2-1.6% less time there and with 256k tokens, 0.8%
      // less at batch 8 with 32k; the outputs were equal to the bit. Other head_dims keep the shared-memory combine
      // below for both mappings: with it at every head_dim, 9/3 heads d64 took 1.7-3.1% more time (q8_0, batch 8 with
      // 32k tokens and batch 1 with 256k), whose tile loop compiled to the same instructions, for a reason not found;
      // at d256 (8-bit only: the 16-row bf16 instances spilled with it) 16/2 heads took the same time at batch 1 with
      // 128k-256k tokens, 1-1.5% less with 32k and at batch 8 with 128k, and at batch 64 with 4k 94.8-99.7 against
      // 89.0-97.4 us (three alternated processes each). Column warps write their columns of the partial the same
      // way, the (m, l) pairs, equal in all of them, from the first.
      const int64_t head0 = static_cast<int64_t>(b) * p.num_q_heads + kvh * G;
      const detail::Workspace ws = detail::workspace_of(p, p.num_splits);
#pragma unroll
      for (int h = 0; h < kRows; ++h) {
        float lsum = l_all[0][h];
        lsum += __shfl_xor_sync(0xffffffffu, lsum, 1);
        lsum += __shfl_xor_sync(0xffffffffu, lsum, 2);
        const int g = gid + 8 * h;  // the head of this thread's softmax row
        if (p.num_splits > 1 && tig == 0 && g < G && col0 == 0) {
          const int64_t row = (head0 + g) * p.num_splits + split;
          ws.ml[row * 2] = m_all[0][h];
          ws.ml[row * 2 + 1] = lsum;
        }
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int head = 8 * h + 2 * tig + e;  // the head of this thread's accumulator columns
          const float lh = __shfl_sync(0xffffffffu, lsum, 8 * tig + 4 * e);  // its row sum, from the row's thread
          if (head >= G) continue;
#pragma unroll
          for (int r = 0; r < C::kRW; ++r) {
            float v[C::kEPW];
            value_columns(0, r, h, e, v);
            const int d0 = col0 + (gid + 8 * r) * C::kEPW;
            if (p.num_splits == 1) {
              T* out = static_cast<T*>(p.out) + b * p.o_stride_batch + (kvh * G + head) * p.o_stride_head + d0;
#pragma unroll
              for (int j = 0; j < C::kEPW; ++j) out[j] = from_float<T>(detail::normalized(v[j], lh));
            } else {
              float* dst = ws.acc + ((head0 + head) * p.num_splits + split) * kHead + d0;
#pragma unroll
              for (int j = 0; j < C::kEPW; j += 4)
                *reinterpret_cast<float4*>(dst + j) = make_float4(v[j], v[j + 1], v[j + 2], v[j + 3]);
            }
          }
        }
      }
      return;
    }
  }

  // ---- combine the warps in shared memory (the ring is free now), then write one partial per split
  // (layout of decode.cuh, parts = num_splits), or with a single split the output itself, normalized as the
  // merge would (no merge kernel then: on an H200 it took 10.8 of 89 us at batch 64, 32/8 heads, 1k tokens).
  __syncthreads();
  // [slots][GMAX][HD], then [slots][GMAX][2], a slot per warp and kv head of the warp (warp * NH + hh), for the warps
  // this CTA runs: a CTA of fewer warps than kWarps (one kv head per warp) has the shared memory of as many (kSmem /
  // kWarps per warp). At head_dim 128 only CTAs of one kv head come here, with kWarps warps.
  const int cta_warps = kWarpWrites ? C::kWarps : blockDim.x / 32;
  float* red_o = reinterpret_cast<float*>(smem);
  float* red_ml = red_o + cta_warps * NH * GMAX * HD;
#pragma unroll
  for (int hh = 0; hh < NH; ++hh) {
    const int slot = warp * NH + hh;
#pragma unroll
    for (int h = 0; h < kRows; ++h) {
      float lsum = l_all[hh][h];
      lsum += __shfl_xor_sync(0xffffffffu, lsum, 1);
      lsum += __shfl_xor_sync(0xffffffffu, lsum, 2);
      const int g = gid + 8 * h;
      if (tig == 0) {
        red_ml[(slot * GMAX + g) * 2] = m_all[hh][h];
        red_ml[(slot * GMAX + g) * 2 + 1] = lsum;
      }
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float* dst = red_o + (slot * GMAX + 8 * h + 2 * tig + e) * HD;
#pragma unroll
        for (int r = 0; r < C::kRW; ++r) {
          float v[C::kEPW];
          value_columns(hh, r, h, e, v);
          float* d0 = dst + (gid + 8 * r) * C::kEPW;
#pragma unroll
          for (int j = 0; j < C::kEPW; j += 4)
            *reinterpret_cast<float4*>(d0 + j) = make_float4(v[j], v[j + 1], v[j + 2], v[j + 3]);
        }
      }
    }
  }
  __syncthreads();
  const detail::Workspace ws = detail::workspace_of(p, p.num_splits);
  // Each kv head of the CTA from the partials of its kW warps (slots w * NH + hh for warps of NH kv heads, hh * kW + w
  // otherwise). Four columns per thread and step: 16-byte shared-memory reads and global stores.
  auto combine = [&](auto warps_per_head) {
    constexpr int kW = decltype(warps_per_head)::value;
    const int heads = kWarpWrites ? 1 : NH > 1 ? NH : blockDim.x / (32 * kW);
    for (int hh = 0; hh < heads; ++hh) {
      const int head = kWarpWrites ? kvh : blockIdx.y * heads + hh;
      const auto slot = [&](int w) { return NH > 1 ? w * NH + hh : hh * kW + w; };
      for (int i = threadIdx.x; i < G * HD / 4; i += blockDim.x) {
        const int g = 4 * i / HD, d = 4 * i % HD;
        float mx = -INFINITY;
#pragma unroll
        for (int w = 0; w < kW; ++w) mx = nanmax(mx, red_ml[(slot(w) * GMAX + g) * 2]);
        float lsum = 0.0f;
        float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (mx != -INFINITY) {
#pragma unroll
          for (int w = 0; w < kW; ++w) {
            const float mw = red_ml[(slot(w) * GMAX + g) * 2];
            const float sc = mw == -INFINITY ? 0.0f : fast_exp2(mw - mx);
            lsum += red_ml[(slot(w) * GMAX + g) * 2 + 1] * sc;
            const float4 v = *reinterpret_cast<const float4*>(red_o + (slot(w) * GMAX + g) * HD + d);
            acc.x += v.x * sc, acc.y += v.y * sc, acc.z += v.z * sc, acc.w += v.w * sc;
          }
        }
        if (p.num_splits == 1) {
          T* out = static_cast<T*>(p.out) + b * p.o_stride_batch + (head * G + g) * p.o_stride_head + d;
          const float v[4] = {acc.x, acc.y, acc.z, acc.w};
#pragma unroll
          for (int j = 0; j < 4; ++j) out[j] = from_float<T>(detail::normalized(v[j], lsum));
          continue;
        }
        const int64_t row = (static_cast<int64_t>(b) * p.num_q_heads + head * G + g) * p.num_splits + split;
        *reinterpret_cast<float4*>(ws.acc + row * HD + d) = acc;
        if (d == 0) {
          ws.ml[row * 2] = mx;
          ws.ml[row * 2 + 1] = lsum;
        }
      }
    }
  };
  if constexpr (!kWarpWrites) {
    if (warp_heads) {
      combine(std::integral_constant<int, 1>{});
      return;
    }
  }
  combine(std::integral_constant<int, C::kWarps>{});
}

// Calls f(kernel, smem_bytes, warps) with one instance of the split kernel, its shared-memory opt-in done.
template <typename S, typename T, int HD, int GMAX, int COLS, int NH = 1, typename F>
cudaError_t with_split_kernel(F&& f) {
  using C = Cfg<S, HD, GMAX, COLS, NH>;
  constexpr auto kernel = split_kernel<S, T, HD, GMAX, COLS, NH>;
  const cudaError_t e = opt_in_smem<kernel>(C::kSmem);
  if (e != cudaSuccess) return e;
  return f(kernel, C::kSmem, C::kWarps);
}

}  // namespace decode_tc

// GQA group bucket of the tensor-core kernel: up to 8 or up to 16 query heads per kv head.
#define KVQ_DISPATCH_TC_GROUP(group, GMAX, ...)                              \
  [&]() -> cudaError_t {                                                   \
    if (group >= 1 && group <= 8) { constexpr int GMAX = 8; __VA_ARGS__ }   \
    if (group >= 1 && group <= 16) { constexpr int GMAX = 16; __VA_ARGS__ } \
    return cudaErrorInvalidValue;                                          \
  }()

// Shared memory of a CTA of n of a split kernel's `own` warps, whose instance takes `smem` (linear in the warps).
inline int decode_tc_smem(int smem, int own, int n) { return smem / own * n; }

// Calls f(kernel, smem_bytes, warps) with the split kernel instantiated for p (shared memory
// opt-in done once per kernel and device).
template <typename F>
cudaError_t decode_tc_dispatch(const DecodeParams& p, F&& f) {
  if (p.num_kv_heads <= 0 || p.num_q_heads % p.num_kv_heads != 0) return cudaErrorInvalidValue;
  const int group = p.num_q_heads / p.num_kv_heads;
  return KVQ_DISPATCH_DTYPE(p.dtype, T, {
    return KVQ_DISPATCH_STORAGE(p.format, p.dtype, S, {
      if constexpr (!StorageTraits<S>::kQuantized && !std::is_same_v<S, T>) {
        return cudaErrorInvalidValue;  // an unquantized cache holds the query dtype
      } else {
        return KVQ_DISPATCH_HEAD_DIM(p.head_dim, HD, {
          return KVQ_DISPATCH_TC_GROUP(group, GMAX, {
            if (HD == 256 && p.column_warps == 4)  // column warps: 64 columns each
              return decode_tc::with_split_kernel<S, T, 64, GMAX, 4>(f);
            if (p.column_warps != 1) return cudaErrorInvalidValue;
            if (p.row_heads != 1) {  // kv heads per warp: 8-bit rows at head_dim 64, up to 8 query heads per kv head
              if constexpr (StorageTraits<S>::kQuantized && HD == 64 && GMAX == 8) {
                if (group <= 8 && p.row_heads == 2) return decode_tc::with_split_kernel<S, T, HD, GMAX, 1, 2>(f);
                if (group <= 8 && p.row_heads == 3) return decode_tc::with_split_kernel<S, T, HD, GMAX, 1, 3>(f);
              }
              return cudaErrorInvalidValue;
            }
            return decode_tc::with_split_kernel<S, T, HD, GMAX, 1>(f);
          });
        });
      }
    });
  });
}

// The split kernel's launch shape for p: its warps per CTA and the CTAs one SM holds at once (the occupancy,
// from which the split count is sized); with `warps` (2 up to its own), that of a CTA of so many warps, as one
// kv head per warp launches where fewer kv heads than its warps divide the cache's. Cached per device,
// instantiation and warp count, so a call costs no dispatch after the first; atomically, as calls may come from
// several host threads.
struct TcShape {
  int warps = 4, ctas_per_sm = 1;
};
inline TcShape decode_tc_shape(const DecodeParams& p, int warps = 0) {
  // warps | ctas_per_sm << 8, 0 until known; by device, format, dtype, head_dim, group bucket, warps (own, 2-4),
  // column warps (0, 1) or kv heads per warp (2: two, 3: three)
  static std::atomic<int> cached[64][3][2][3][2][4][4];
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return TcShape{};
  const int hd = p.head_dim == 64 ? 0 : (p.head_dim == 128 ? 1 : 2);
  const int g = p.num_kv_heads > 0 && p.num_q_heads / p.num_kv_heads > 8 ? 1 : 0;
  const int wi = warps >= 2 && warps <= 4 ? warps - 1 : 0;
  const bool cacheable = dev >= 0 && dev < 64;
  const int f = int(p.format) % 3, t = int(p.dtype) % 2;
  const int cw = p.column_warps > 1 ? 1 : (p.row_heads == 2 || p.row_heads == 3 ? p.row_heads : 0);
  if (cacheable) {
    const int known = cached[dev][f][t][hd][g][wi][cw].load(std::memory_order_relaxed);
    if (known != 0) return TcShape{known & 0xff, known >> 8};
  }
  TcShape shape;
  const cudaError_t e = decode_tc_dispatch(p, [&](auto kernel, int smem, int own) {
    shape.warps = wi > 0 ? std::min(warps, own) : own;
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(&shape.ctas_per_sm, kernel, shape.warps * 32,
                                                         decode_tc_smem(smem, own, shape.warps));
  });
  if (e != cudaSuccess || shape.ctas_per_sm <= 0) shape.ctas_per_sm = 1;
  if (cacheable) cached[dev][f][t][hd][g][wi][cw].store(shape.warps | shape.ctas_per_sm << 8, std::memory_order_relaxed);
  return shape;
}

// Splits of the tensor-core kernel (decode_num_splits): at least two 16-token tiles for each warp of a CTA over one
// wave of SMs x shape.ctas_per_sm, which the caller picks (on an H200 two tiles beat four by up to 25% at 1k-4k
// tokens and lost 10% only at 16/2 heads d256 with 32k). Short sequences: where one-tile-per-warp splits of every
// sequence fit one CTA per SM, those (on an H200, batch 1 with 1k tokens: 5-9% faster). Not beyond: one-tile splits
// filling every slot were up to 20% slower at 4k-8k tokens, and uneven splits in between up to 12% slower.
inline int decode_tc_num_splits(int batch, int num_kv_heads, int max_tokens, TcShape shape, int sms) {
  const int one_tile = decode_tc::kTile * shape.warps;
  const int64_t one_tile_ctas = static_cast<int64_t>(batch) * num_kv_heads *
                                ((static_cast<int64_t>(max_tokens) + one_tile - 1) / one_tile);
  if (one_tile_ctas <= sms) return decode_num_splits(batch, num_kv_heads, max_tokens, one_tile, sms);
  return decode_num_splits(batch, num_kv_heads, max_tokens, 2 * one_tile, sms * shape.ctas_per_sm);
}

inline cudaError_t decode_attention_tc(const DecodeParams& p, cudaStream_t stream) {
  if (p.batch == 0) return cudaSuccess;
  if (p.batch > 65535 || p.num_kv_heads > 65535) return cudaErrorInvalidConfiguration;
  return decode_tc_dispatch(p, [&](auto kernel, int smem, int warps) {
    const int hpc = p.heads_per_cta, rh = p.row_heads;
    if (hpc < 1 || hpc > warps || p.num_kv_heads % hpc != 0 || (hpc > 1 && p.column_warps > 1) || rh < 1 ||
        p.num_kv_heads % rh != 0 || (rh > 1 && hpc > 1))
      return cudaErrorInvalidValue;
    // One kv head per warp: a CTA of hpc warps, and the shared memory of as many. rh kv heads per warp: rh per CTA.
    const int cta_warps = hpc > 1 ? hpc : warps;
    const DependentLaunch split(dim3(p.num_splits, p.num_kv_heads / (hpc * rh), p.batch), dim3(cta_warps * 32), stream,
                                p.dependent_split, decode_tc_smem(smem, warps, cta_warps));
    cudaError_t e = split(kernel, p, FastDivmod(p.page_size));
    if (e != cudaSuccess || p.num_splits == 1) return e;  // one split wrote the output itself
    return launch_decode_merge(p, p.num_splits, stream);
  });
}

}  // namespace kvq
