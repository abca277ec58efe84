// Registers the CUDA kernels for the ops defined in kvq/ops.py, and the minimal Python module kvq._C.
#include <Python.h>
#include <torch/library.h>

#include <string>

#include "ops.h"

TORCH_LIBRARY_IMPL(kvq, CUDA, m) {
  m.impl("store_kv", &store_kv_cuda);
  m.impl("decode_attention", &decode_attention_cuda);
#ifdef KVQ_HAS_EXTEND
  m.impl("extend_attention", &extend_attention_cuda);
#endif
  m.impl("dequantize", &dequantize_cuda);
}

static PyObject* cuda_archs(PyObject*, PyObject*) { return PyUnicode_FromString(kvq_cuda_archs()); }

// A choice by name, passed to `set` by index; returns the name of the previous choice.
template <int N>
static PyObject* choose(PyObject* arg, const char* const (&names)[N], int (*set)(int), const char* what) {
  const char* want = PyUnicode_AsUTF8(arg);
  if (want == nullptr) return nullptr;
  std::string valid;
  for (int i = 0; i < N; ++i) {
    if (std::string(want) == names[i]) return PyUnicode_FromString(names[set(i)]);
    valid += std::string(i == 0 ? "'" : i == N - 1 ? " or '" : ", '") + names[i] + "'";
  }
  PyErr_Format(PyExc_ValueError, "%s must be %s, got '%s'", what, valid.c_str(), want);
  return nullptr;
}

static PyObject* set_decode_kernel(PyObject*, PyObject* arg) {
  static const char* const names[] = {"auto", "fma", "tc"};
  return choose(arg, names, kvq_set_decode_kernel, "decode kernel");
}

static PyObject* set_decode_heads(PyObject*, PyObject* arg) {
  static const char* const names[] = {"auto", "cta", "warp", "columns", "rows"};
  return choose(arg, names, kvq_set_decode_heads, "decode kv-head mapping");
}

// The set_*_pdl choices of both attention ops, in the order ops.h's dependent_launches() decodes them.
static const char* const kPdlNames[] = {"auto", "off", "merge"};

static PyObject* set_decode_pdl(PyObject*, PyObject* arg) {
  return choose(arg, kPdlNames, kvq_set_decode_pdl, "decode programmatic launch");
}

// 'auto' or a split count, as a string like the other choices; returns the previous.
static PyObject* set_decode_splits(PyObject*, PyObject* arg) {
  const char* want = PyUnicode_AsUTF8(arg);
  if (want == nullptr) return nullptr;
  const std::string w(want);
  int n = -1;
  if (w == "auto") {
    n = 0;
  } else if (!w.empty() && w.size() <= 3 && w[0] != '0' && w.find_first_not_of("0123456789") == std::string::npos) {
    n = std::stoi(w);
    if (n < 1 || n > kvq_max_decode_splits) n = -1;
  }
  if (n < 0) {
    PyErr_Format(PyExc_ValueError, "decode splits must be 'auto' or a count from '1' to '%d', got '%s'",
                 kvq_max_decode_splits, want);
    return nullptr;
  }
  const int prev = kvq_set_decode_splits(n);
  return PyUnicode_FromString(prev == 0 ? "auto" : std::to_string(prev).c_str());
}

static PyObject* set_store_pdl(PyObject*, PyObject* arg) {
  static const char* const names[] = {"auto", "off"};
  return choose(arg, names, kvq_set_store_pdl, "store programmatic launch");
}

#ifdef KVQ_HAS_EXTEND
static PyObject* set_extend_shape(PyObject*, PyObject* arg) {
  static const char* const names[] = {"auto", "wide", "deep", "tall", "small"};
  return choose(arg, names, kvq_set_extend_shape, "extend CTA shape");
}

static PyObject* set_extend_pdl(PyObject*, PyObject* arg) {
  return choose(arg, kPdlNames, kvq_set_extend_pdl, "extend programmatic launch");
}

static PyObject* set_extend_splits(PyObject*, PyObject* arg) {
  static const char* const names[] = {"auto", "1", "2", "3", "4"};
  return choose(arg, names, kvq_set_extend_splits, "extend key splits");
}
#endif

static PyMethodDef kMethods[] = {
    {"set_decode_kernel", set_decode_kernel, METH_O,
     "Choose the CUDA decode kernel: 'auto' (by GQA group size), 'fma' or 'tc' (tensor cores); returns the previous."},
    {"set_decode_heads", set_decode_heads, METH_O,
     "Map kv heads of the tensor-core decode kernel: 'auto' (by format and split length), 'cta' (one per CTA), "
     "'warp' (one per warp, in CTAs of as many warps as the largest divisor of the kv heads up to its warps) or "
     "'columns' (at head_dim 256, one per CTA whose four warps divide the columns; elsewhere as 'auto') or 'rows' "
     "(8-bit caches at head_dim 64 with up to 8 query heads per kv head: two or three adjacent kv heads per warp, "
     "where the kv heads divide so; elsewhere as 'auto'); returns the previous."},
    {"set_decode_pdl", set_decode_pdl, METH_O,
     "Programmatic dependent launches of the decode kernels (on devices of compute capability 9.0 and newer): "
     "'auto' (the split kernel after the kernel before it, the merge after the split), 'merge' (the merge only) "
     "or 'off'; returns the previous."},
    {"set_decode_splits", set_decode_splits, METH_O,
     "Split each sequence of the CUDA decode into this many ranges, combined by the merge: 'auto' (by shapes) or "
     "'1' to '256'; returns the previous."},
    {"set_store_pdl", set_store_pdl, METH_O,
     "Programmatic dependent launch of store_kv (on devices of compute capability 9.0 and newer): 'auto' (after the "
     "kernel before it) or 'off'; returns the previous."},
#ifdef KVQ_HAS_EXTEND
    {"set_extend_shape", set_extend_shape, METH_O,
     "Choose the CTA shape of the CUDA extend kernel: 'auto' (by estimated time), 'wide', 'deep' (at head_dim 256 "
     "where the device's shared memory holds it, else wide), 'tall' (8-bit caches up to head_dim 128 where the "
     "device's shared memory holds it, else wide) or 'small' (deep's warps halved; wide at head_dim 256); returns "
     "the previous."},
    {"set_extend_splits", set_extend_splits, METH_O,
     "Split the keys of each CUDA extend row block over CTAs and merge: 'auto' (by estimated time) or '1' to '4'; "
     "returns the previous."},
    {"set_extend_pdl", set_extend_pdl, METH_O,
     "Programmatic dependent launches of the extend kernels (on devices of compute capability 9.0 and newer): "
     "'auto' (the kernel after the kernel before it, the merge of split keys after the kernel), 'merge' (the merge "
     "only) or 'off'; returns the previous."},
#endif
    {"cuda_archs", cuda_archs, METH_NOARGS, "The CUDA architectures compiled in, e.g. '8.9;9.0;12.0'."},
    {nullptr, nullptr, 0, nullptr},
};

static PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_C",
                              "kvq CUDA kernels (importing registers them with torch.ops.kvq).", -1, kMethods};

PyMODINIT_FUNC PyInit__C() { return PyModule_Create(&kModule); }
