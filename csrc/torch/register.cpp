// Registers the CUDA kernels for the ops defined in kvq/ops.py, and the minimal Python module kvq._C.
#include <Python.h>
#include <torch/library.h>

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

static PyMethodDef kMethods[] = {
    {"cuda_archs", cuda_archs, METH_NOARGS, "The CUDA architectures compiled in, e.g. '8.9;9.0;12.0'."},
    {nullptr, nullptr, 0, nullptr},
};

static PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_C",
                              "kvq CUDA kernels (importing registers them with torch.ops.kvq).", -1, kMethods};

PyMODINIT_FUNC PyInit__C() { return PyModule_Create(&kModule); }
