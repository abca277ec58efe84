// Tensor-core building blocks shared by the extend and decode kernels: cp.async, ldmatrix, movmatrix,
// mma.sync m16n8k16 (bf16/fp16 in, fp32 accumulate) and the exact dequantization of 8-bit values into bf16/fp16.
// Only instructions that sm_89, sm_90 and sm_120 share.
#pragma once

#include <cstdint>
#include <type_traits>

#include "common.cuh"

namespace kvq {
namespace tc {

// ------------------------------------------------------------------------------------ PTX wrappers
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy; src_bytes == 0 writes zeros and reads nothing. kPrefetch 128 or 256 adds the hint that
// L2 fetch the whole 128- or 256-byte block around the 16 bytes (.L2::128B, .L2::256B).
template <int kPrefetch = 0>
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {
  static_assert(kPrefetch == 0 || kPrefetch == 128 || kPrefetch == 256, "cp.async L2 prefetch sizes");
  if constexpr (kPrefetch == 256) {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
  } else if constexpr (kPrefetch == 128) {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
  } else {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
  }
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }
// Wait until at most N committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
// 4, 8 or 16 bytes (cached in L1: scale rows are small); src_bytes == 0 writes zeros and reads nothing.
template <int N>
__device__ __forceinline__ void cp_async_small(uint32_t dst, const void* src, int src_bytes) {
  static_assert(N == 4 || N == 8 || N == 16, "cp.async sizes");
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(dst), "l"(src), "n"(N), "r"(src_bytes));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                            uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                                  uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

template <typename T>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma16816<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma16816<__half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// One 16-wide step of MT m-tiles that share a B fragment: acc[mt][2n] and acc[mt][2n + 1] take a[mt] times the two
// 8-column halves, (b0, b1) and (b2, b3), of one ldmatrix_x4.
template <typename T, int MT, int N>
__device__ __forceinline__ void mma_m_tiles(float (&acc)[MT][N][4], int n, const uint32_t (&a)[MT][4], uint32_t b0,
                                            uint32_t b1, uint32_t b2, uint32_t b3) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    mma16816<T>(acc[mt][2 * n], a[mt], b0, b1);
    mma16816<T>(acc[mt][2 * n + 1], a[mt], b2, b3);
  }
}

// Transposes an 8 x 8 matrix of fp32 held as mma fragments (thread lane holds row lane / 4, columns
// 2 (lane % 4) + {0, 1} in x0, x1) in registers: afterwards x0, x1 hold those elements of the transpose. Exact:
// the two 16-bit halves of every value travel through movmatrix separately.
__device__ __forceinline__ void transpose8x8(float& x0, float& x1) {
  const uint32_t u0 = __float_as_uint(x0), u1 = __float_as_uint(x1);
  uint32_t lo = __byte_perm(u0, u1, 0x5410), hi = __byte_perm(u0, u1, 0x7632);
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %0;\n" : "+r"(lo));
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %0;\n" : "+r"(hi));
  x0 = __uint_as_float(__byte_perm(lo, hi, 0x5410));
  x1 = __uint_as_float(__byte_perm(lo, hi, 0x7632));
}

__device__ __forceinline__ float fast_exp2(float x) {  // ex2(-inf) = 0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// ------------------------------------------------------------------------------------ dequantization
// x' = float(q) * float(scale), rounded once to T. For fp16 the product of an 8-bit value (<= 8
// significant bits) and an fp16 scale is exact in fp32, so one fp16 multiply rounds it identically.

// 2 int8 in the low/high byte pair selected by `sel` -> half2 holding exact q values (1024 + q + 128 - 1152).
__device__ __forceinline__ __half2 int8x2_to_half2(uint32_t u_xored, uint32_t sel) {
  const uint32_t h = __byte_perm(u_xored, 0x64646464u, sel);
  return __hsub2(*reinterpret_cast<const __half2*>(&h), __half2half2(__ushort_as_half(0x6480)));
}

__device__ __forceinline__ __half2 e4m3x2_to_half2(uint16_t two) {
  __half2_raw r = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two), __NV_E4M3);
  return *reinterpret_cast<__half2*>(&r);
}

// 16 8-bit values (4 words) with one fp16 scale -> 8 words of T (16 elements), in order.
template <typename T, typename S>
__device__ __forceinline__ void dequant16(const uint4& raw, uint16_t scale_bits, uint32_t (&out)[8]) {
  const __half scale = __ushort_as_half(scale_bits);
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
  if constexpr (std::is_same_v<T, __half>) {
    const __half2 s2 = __half2half2(scale);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      __half2 lo, hi;
      if constexpr (std::is_same_v<S, int8_t>) {
        const uint32_t u = w[i] ^ 0x80808080u;
        lo = int8x2_to_half2(u, 0x7170u);  // bytes 0, 1 under 0x64
        hi = int8x2_to_half2(u, 0x7372u);  // bytes 2, 3
      } else {
        lo = e4m3x2_to_half2(uint16_t(w[i] & 0xFFFFu));
        hi = e4m3x2_to_half2(uint16_t(w[i] >> 16));
      }
      lo = __hmul2(lo, s2);
      hi = __hmul2(hi, s2);
      out[2 * i] = *reinterpret_cast<uint32_t*>(&lo);
      out[2 * i + 1] = *reinterpret_cast<uint32_t*>(&hi);
    }
  } else {
    const float s = __half2float(scale);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float f[4];
      if constexpr (std::is_same_v<S, int8_t>) {
        int8x4_to_float(w[i], f);
      } else {
        const float2 a = __half22float2(e4m3x2_to_half2(uint16_t(w[i] & 0xFFFFu)));
        const float2 b = __half22float2(e4m3x2_to_half2(uint16_t(w[i] >> 16)));
        f[0] = a.x, f[1] = a.y, f[2] = b.x, f[3] = b.y;
      }
      out[2 * i] = pack2<T>(f[0] * s, f[1] * s);
      out[2 * i + 1] = pack2<T>(f[2] * s, f[3] * s);
    }
  }
}

}  // namespace tc
}  // namespace kvq
