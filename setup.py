"""Build kvq: the pure-Python package, plus the CUDA extension kvq._C when torch has CUDA and nvcc is found.

TORCH_CUDA_ARCH_LIST picks the architectures (default "8.9;9.0;12.0"). KVQ_PTXAS_VERBOSE=1 prints ptxas'
register and spill report for every kernel. The extension is never built with fast math: the quantize
path must match the reference bit for bit.
"""

import glob
import os
import shutil
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_ARCHS = "8.9;9.0;12.0"


def _find_cuda_home():
    """A CUDA toolkit root holding both bin/nvcc and the runtime library, when CUDA_HOME is not set: nvcc on
    PATH may be a wrapper script outside the toolkit (e.g. /usr/local/bin/nvcc), which torch would take
    for the root."""
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    nvcc = shutil.which("nvcc")
    candidates = [os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))] if nvcc else []
    candidates.append("/usr/local/cuda")
    for root in candidates:
        libs = glob.glob(os.path.join(root, "lib64", "libcudart.so*")) + glob.glob(
            os.path.join(root, "lib", "libcudart.so*")) + glob.glob(os.path.join(root, "targets", "*", "lib", "libcudart.so*"))
        if os.path.exists(os.path.join(root, "bin", "nvcc")) and libs:
            os.environ["CUDA_HOME"] = root
            return


def cuda_extension():
    """([extension], cmdclass) when the CUDA extension can be built here, else ([], {}) and a printed reason."""
    _find_cuda_home()
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError as e:
        return [], {}, f"torch is not importable ({e}); install torch first and use --no-build-isolation"
    if torch.version.cuda is None:
        return [], {}, f"torch {torch.__version__} is a CPU-only build"
    if CUDA_HOME is None or not os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc")):
        return [], {}, "nvcc was not found (set CUDA_HOME to a CUDA toolkit)"
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCHS)
    csrc = os.path.join("csrc", "torch")
    sources = sorted(glob.glob(os.path.join(csrc, "*.cu"))) + [os.path.join(csrc, "register.cpp")]
    defines = []
    if os.path.exists(os.path.join(ROOT, csrc, "extend.cu")):
        defines.append("-DKVQ_HAS_EXTEND")
    nvcc = ["-O3", "--expt-relaxed-constexpr", "-lineinfo"] + defines
    if os.environ.get("KVQ_PTXAS_VERBOSE") == "1":
        nvcc += ["-Xptxas", "-v"]
    ext = CUDAExtension(
        name="kvq._C",
        sources=sources,
        include_dirs=[os.path.join(ROOT, "csrc", "include"), os.path.join(ROOT, csrc)],
        extra_compile_args={"cxx": ["-O3"] + defines, "nvcc": nvcc},
    )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}, None


if os.environ.get("KVQ_NO_EXTENSION") == "1":
    ext_modules, cmdclass, why = [], {}, "KVQ_NO_EXTENSION=1"
else:
    ext_modules, cmdclass, why = cuda_extension()
if why:
    print(f"kvq: building without the CUDA extension kvq._C: {why}; the Triton/reference backends will be used",
          file=sys.stderr)
else:
    print(f"kvq: building kvq._C for TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']}", file=sys.stderr)

setup(
    name="kvq",
    version="0.1.0",
    description="8-bit paged KV cache (q8_0, fp8_e4m3) with attention kernels that read it directly",
    packages=find_packages(include=["kvq*"]),
    python_requires=">=3.11",
    install_requires=["torch>=2.11", "triton>=3.6; sys_platform == 'linux'"],
    extras_require={
        "test": ["pytest", "hypothesis", "matplotlib"],  # matplotlib: the benchmark's plots
        "eval": ["transformers", "gguf", "tqdm"],
        "bench": ["matplotlib", "tqdm"],
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
