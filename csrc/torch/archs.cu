// The architectures nvcc compiled this extension for, from __CUDA_ARCH_LIST__ (e.g. 890,900,1200), which
// follows TORCH_CUDA_ARCH_LIST / CMAKE_CUDA_ARCHITECTURES whichever build system ran.
#include <string>

#include "ops.h"

namespace {
std::string format_archs() {
#ifdef __CUDA_ARCH_LIST__
  const int archs[] = {__CUDA_ARCH_LIST__};
  std::string s;
  for (int a : archs) s += (s.empty() ? "" : ";") + std::to_string(a / 100) + "." + std::to_string((a / 10) % 10);
  return s;
#else
  return "";
#endif
}
}  // namespace

const char* kvq_cuda_archs() {
  static const std::string archs = format_archs();
  return archs.c_str();
}
