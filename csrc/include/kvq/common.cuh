// Formats, the quantize numerics shared by every kernel, and the dequant helpers.
//
// The quantize path must produce the bytes of kvq/reference.py on every architecture, so it uses
// explicitly rounded intrinsics (__fdiv_rn, __fmul_rn) that nvcc can neither contract into FMAs nor
// replace with approximations; the extension is never built with --use_fast_math.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <type_traits>
#include <utility>

namespace kvq {

constexpr int kBlock = 32;  // elements of head_dim that share one fp16 scale
constexpr unsigned short kCanonicalNanF16 = 0x7E00;

// The storage format of a cache. kSame stores the model dtype (bf16/fp16) without scales.
enum class Format : int { kSame = 0, kQ8_0 = 1, kFp8E4M3 = 2 };
// The dtype of queries, new keys/values and outputs.
enum class DType : int { kBF16 = 0, kFP16 = 1 };

template <typename S>
struct StorageTraits;  // S: the element type stored in the cache
template <>
struct StorageTraits<int8_t> {
  static constexpr bool kQuantized = true;
  static constexpr float kMax = 127.0f;
};
template <>
struct StorageTraits<__nv_fp8_e4m3> {
  static constexpr bool kQuantized = true;
  static constexpr float kMax = 448.0f;
};
template <>
struct StorageTraits<__nv_bfloat16> {
  static constexpr bool kQuantized = false;
};
template <>
struct StorageTraits<__half> {
  static constexpr bool kQuantized = false;
};

// ------------------------------------------------------------------------------------ conversions
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(int8_t x) { return static_cast<float>(x); }
__device__ __forceinline__ float to_float(__nv_fp8_e4m3 x) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(x.__x, __NV_E4M3)));  // exact
}

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }

// Eight 16-bit floats packed in 16 bytes, to fp32.
template <typename T>
__device__ __forceinline__ void unpack8(const uint4& u, float* f) {
  const T* h = reinterpret_cast<const T*>(&u);
#pragma unroll
  for (int i = 0; i < 8; ++i) f[i] = to_float(h[i]);
}

template <typename T>
__device__ __forceinline__ uint4 pack8(const float* f) {
  uint4 u;
  T* h = reinterpret_cast<T*>(&u);
#pragma unroll
  for (int i = 0; i < 8; ++i) h[i] = from_float<T>(f[i]);
  return u;
}

// Four int8 in one word to exact fp32: the biased byte goes into the mantissa of 2^23 and the bias comes
// off with one exact subtraction (cheaper than four I2F conversions).
__device__ __forceinline__ void int8x4_to_float(uint32_t w, float* f) {
  const uint32_t x = w ^ 0x80808080u;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[i] = __int_as_float(__byte_perm(x, 0x4B000000u, 0x7540 + i)) - 8388736.0f;  // 2^23 + 128
  }
}

// Two e4m3 in 16 bits to exact fp32 (hardware cvt to f16x2 on sm_89+).
__device__ __forceinline__ void fp8x2_to_float(uint16_t w, float* f) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w), __NV_E4M3);
  const float2 v = __half22float2(__half2(h));
  f[0] = v.x;
  f[1] = v.y;
}

// N consecutive stored elements (raw bytes in registers) to fp32, without the block scale.
template <typename S, int N>
__device__ __forceinline__ void unpack_raw(const uint32_t* w, float* f) {
  if constexpr (sizeof(S) == 1) {
    static_assert(N % 2 == 0, "8-bit elements are unpacked in pairs");
    if constexpr (std::is_same_v<S, int8_t>) {
      if constexpr (N == 2) {
        f[0] = static_cast<float>(static_cast<int8_t>(w[0] & 0xFF));
        f[1] = static_cast<float>(static_cast<int8_t>((w[0] >> 8) & 0xFF));
      } else {
#pragma unroll
        for (int i = 0; i < N / 4; ++i) int8x4_to_float(w[i], f + 4 * i);
      }
    } else {
#pragma unroll
      for (int i = 0; i < N / 2; ++i) fp8x2_to_float(static_cast<uint16_t>(w[i / 2] >> (16 * (i % 2))), f + 2 * i);
    }
  } else {
    const S* h = reinterpret_cast<const S*>(w);
#pragma unroll
    for (int i = 0; i < N; ++i) f[i] = to_float(h[i]);
  }
}

// max that propagates NaN (an attention score that is NaN must reach the output, never be dropped by fmaxf;
// a block to quantize that holds a NaN must be seen to). One instruction, max.NaN (sm_80 and later), where a
// test and a select took three.
__device__ __forceinline__ float nanmax(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// The weight of a partial (of a split along the keys) whose maximum is m in a combine whose maximum is mx: 0 for
// a part that saw no key (m = -inf) and where no part did (mx = -inf); a NaN m stays NaN. Maxima in log2 units.
__device__ __forceinline__ float part_weight(float m, float mx) {
  return (mx == -INFINITY || m == -INFINITY) ? 0.0f : exp2f(m - mx);
}

// Programmatic dependent launch, for a kernel pair on one stream (a split kernel and its merge). The first
// lets the second be scheduled once all of its own CTAs run; the second waits, before it reads anything the
// first wrote, until the first has finished and its writes are visible. The merge's launch and start-up then
// overlap the split kernel's last CTAs instead of following them. The decode split kernel and the extend kernel
// are launched the same way after whatever kernel precedes them, so they are scheduled as that kernel's CTAs
// exit: they wait before their first global load or store, since the kernel before may still be writing their
// inputs or reading memory they will write (a workspace the allocator handed on). sm_90 and newer have the
// instructions; the host asks for such a launch only on those devices, and without that request both are
// no-ops, so the sm_89 build (which compiles them out) behaves the same.
__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_for_primary() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// The host side: a launch configuration that asks for the second kernel of such a pair to be launched as a
// programmatic dependent of the kernel before it on `stream` (when `dependent`), else in plain stream order.
class DependentLaunch {
 public:
  DependentLaunch(dim3 grid, dim3 block, cudaStream_t stream, bool dependent, size_t smem = 0) {
    attr_.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr_.val.programmaticStreamSerializationAllowed = 1;
    cfg_.gridDim = grid, cfg_.blockDim = block, cfg_.dynamicSmemBytes = smem, cfg_.stream = stream;
    cfg_.attrs = &attr_, cfg_.numAttrs = dependent ? 1 : 0;
  }
  DependentLaunch(const DependentLaunch&) = delete;  // cfg_ points at attr_
  DependentLaunch& operator=(const DependentLaunch&) = delete;
  int64_t ctas() const { return int64_t{cfg_.gridDim.x} * cfg_.gridDim.y * cfg_.gridDim.z; }
  template <typename... Params, typename... Args>
  cudaError_t operator()(void (*kernel)(Params...), Args&&... args) const {
    return cudaLaunchKernelEx(&cfg_, kernel, std::forward<Args>(args)...);
  }

 private:
  cudaLaunchAttribute attr_{};
  cudaLaunchConfig_t cfg_{};
};

// Lets `kKernel` use `smem` bytes of dynamic shared memory (beyond the default 48 KB) on the current device; the
// attribute is set once per kernel and device, so that later calls (and CUDA-graph captures) skip it. Atomic, as
// calls may come from several host threads.
template <auto kKernel>
cudaError_t opt_in_smem(int smem) {
  static std::atomic<bool> opted_in[64];
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  const bool cacheable = dev >= 0 && dev < 64;
  if (cacheable && opted_in[dev].load(std::memory_order_relaxed)) return cudaSuccess;
  e = cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e == cudaSuccess && cacheable) opted_in[dev].store(true, std::memory_order_relaxed);
  return e;
}

// ------------------------------------------------------------------------------------ quantize
// One 32-element block is held by a pair of adjacent lanes (16 elements each). The pair agrees on
// amax, taken with max.NaN: a NaN anywhere makes it NaN and an inf makes it inf, so one instruction per
// element gives both the maximum and the block's finiteness.
struct BlockQuant {
  float inv;          // 1/d, 0 when d == 0
  uint16_t scale;     // fp16 bits of d, or the canonical NaN for a non-finite block
  bool finite;
  bool normal;        // finite and d a normal float: see quant8_plain
};

template <int N>
__device__ __forceinline__ BlockQuant block_quant_pair(const float* x, float max_magnitude) {
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < N; ++i) amax = nanmax(amax, fabsf(x[i]));
  amax = nanmax(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
  BlockQuant q;
  q.finite = amax <= 3.402823466e38f;  // false for inf and NaN
  const float d = __fdiv_rn(amax, max_magnitude);
  q.inv = d == 0.0f ? 0.0f : __fdiv_rn(1.0f, d);
  q.normal = q.finite && d >= 1.17549435e-38f;
  q.scale = q.finite ? __half_as_ushort(__float2half_rn(d)) : kCanonicalNanF16;
  return q;
}

// y = x * (1/d) without contraction; NaN (0 * inf) becomes 0, its true value.
__device__ __forceinline__ float scaled(float x, float inv) {
  const float y = __fmul_rn(x, inv);
  return y != y ? 0.0f : y;
}

// Eight fp32 to eight q8_0 bytes (round half away from zero, clamp +-127), in two words.
__device__ __forceinline__ uint2 quant8_q8_0(const float* x, float inv) {
  uint32_t w[2] = {0u, 0u};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float y = fminf(fmaxf(scaled(x[i], inv), -127.0f), 127.0f);
    const uint32_t b = static_cast<uint32_t>(static_cast<uint8_t>(static_cast<int8_t>(roundf(y))));
    w[i / 4] |= b << (8 * (i % 4));
  }
  return make_uint2(w[0], w[1]);
}

// Eight fp32 to eight e4m3 bytes: clamp +-448, then one round-to-nearest-even from fp32.
__device__ __forceinline__ uint2 quant8_fp8(const float* x, float inv) {
  uint32_t w[2] = {0u, 0u};
#pragma unroll
  for (int i = 0; i < 8; i += 2) {
    const float a = fminf(fmaxf(scaled(x[i], inv), -448.0f), 448.0f);
    const float b = fminf(fmaxf(scaled(x[i + 1], inv), -448.0f), 448.0f);
    const uint32_t p = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
    w[i / 4] |= p << (16 * ((i / 2) % 2));
  }
  return make_uint2(w[0], w[1]);
}

// The same bytes for a block whose d is a normal float (every block but those of amax below ~1e-36), in half
// the instructions. Then 1/d is finite, so x * (1/d) is never NaN, and |x| <= amax bounds |y| by
// M (1 + 2^-24)^2 / (1 - 2^-24) < M + 0.0001 (three roundings: d, 1/d, y), so neither clamp can act:
// q8_0's rounding of y stays within +-127, and e4m3's satfinite conversion does the clamp's work. Round half
// away from zero is trunc(y + copysign(0.5, y)) with the add rounded toward zero (exact for |y| < 2^22: the
// add never reaches the next integer unless the exact sum does).
template <typename S>
__device__ __forceinline__ uint2 quant8_plain(const float* x, float inv) {
  uint32_t w[2];
  if constexpr (std::is_same_v<S, int8_t>) {
    int r[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float y = __fmul_rn(x[i], inv);
      r[i] = __float2int_rz(__fadd_rz(y, copysignf(0.5f, y)));
    }
#pragma unroll
    for (int k = 0; k < 2; ++k)
      w[k] = __byte_perm(__byte_perm(r[4 * k], r[4 * k + 1], 0x0040), __byte_perm(r[4 * k + 2], r[4 * k + 3], 0x0040),
                         0x5410);
  } else {
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const uint32_t lo = __nv_cvt_float2_to_fp8x2(
          make_float2(__fmul_rn(x[4 * k], inv), __fmul_rn(x[4 * k + 1], inv)), __NV_SATFINITE, __NV_E4M3);
      const uint32_t hi = __nv_cvt_float2_to_fp8x2(
          make_float2(__fmul_rn(x[4 * k + 2], inv), __fmul_rn(x[4 * k + 3], inv)), __NV_SATFINITE, __NV_E4M3);
      w[k] = lo | (hi << 16);
    }
  }
  return make_uint2(w[0], w[1]);
}

template <typename S>
__device__ __forceinline__ uint2 quant8(const float* x, float inv) {
  if constexpr (std::is_same_v<S, int8_t>) {
    return quant8_q8_0(x, inv);
  } else {
    return quant8_fp8(x, inv);
  }
}

__device__ __forceinline__ float scale_to_float(uint16_t bits) { return __half2float(__ushort_as_half(bits)); }

}  // namespace kvq
