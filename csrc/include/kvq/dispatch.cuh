// The one place where runtime values become compile-time constants, for a short fixed list:
// head_dim {64, 128, 256}, storage format {model dtype, q8_0, fp8_e4m3}, dtype {bf16, fp16}, and the GQA
// group bucket {4, 8, 16} of the decode kernel. Anything else returns cudaErrorInvalidValue (the torch
// adapters reject it with a clear message first).
#pragma once

#include "common.cuh"

#define KVQ_DISPATCH_HEAD_DIM(head_dim, HD, ...)        \
  [&]() -> cudaError_t {                                \
    switch (head_dim) {                                 \
      case 64: { constexpr int HD = 64; __VA_ARGS__ }   \
      case 128: { constexpr int HD = 128; __VA_ARGS__ } \
      case 256: { constexpr int HD = 256; __VA_ARGS__ } \
      default: return cudaErrorInvalidValue;            \
    }                                                   \
  }()

// dtype (kvq::DType) -> T in {__nv_bfloat16, __half}
#define KVQ_DISPATCH_DTYPE(dtype, T, ...)                                      \
  [&]() -> cudaError_t {                                                       \
    switch (dtype) {                                                           \
      case ::kvq::DType::kBF16: { using T = __nv_bfloat16; __VA_ARGS__ }        \
      case ::kvq::DType::kFP16: { using T = __half; __VA_ARGS__ }               \
      default: return cudaErrorInvalidValue;                                   \
    }                                                                          \
  }()

// (format, model dtype) -> storage element S in {int8_t, __nv_fp8_e4m3, __nv_bfloat16, __half}
#define KVQ_DISPATCH_STORAGE(format, dtype, S, ...)                                       \
  [&]() -> cudaError_t {                                                                 \
    switch (format) {                                                                    \
      case ::kvq::Format::kQ8_0: { using S = int8_t; __VA_ARGS__ }                         \
      case ::kvq::Format::kFp8E4M3: { using S = __nv_fp8_e4m3; __VA_ARGS__ }               \
      case ::kvq::Format::kSame: return KVQ_DISPATCH_DTYPE(dtype, S, __VA_ARGS__);         \
      default: return cudaErrorInvalidValue;                                             \
    }                                                                                    \
  }()

// GQA group size (query heads per kv head, 1..16) -> the register bucket GMAX >= group.
#define KVQ_DISPATCH_GROUP(group, GMAX, ...)                          \
  [&]() -> cudaError_t {                                              \
    if (group >= 1 && group <= 4) { constexpr int GMAX = 4; __VA_ARGS__ }  \
    if (group > 4 && group <= 8) { constexpr int GMAX = 8; __VA_ARGS__ }   \
    if (group > 8 && group <= 16) { constexpr int GMAX = 16; __VA_ARGS__ } \
    return cudaErrorInvalidValue;                                     \
  }()
