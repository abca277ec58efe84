"""The compiled extension kvq._C: it is built, loads, reports its architectures and registers every op (CPU).

Without the extension these tests skip, unless KVQ_REQUIRE_EXTENSION=1 (CI sets it), when they fail.
"""

import importlib.util
import os
import re
from pathlib import Path

import pytest
import torch

import kvq
from kvq.ops import SCHEMAS

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_ARCHS = "8.9;9.0;12.0"


@pytest.fixture(scope="module")
def ext():
    if importlib.util.find_spec("kvq._C") is None:
        msg = "kvq._C is not built (pip install --no-build-isolation -e . with nvcc and a CUDA build of torch)"
        if os.environ.get("KVQ_REQUIRE_EXTENSION") == "1":
            pytest.fail(msg + "; KVQ_REQUIRE_EXTENSION=1 requires it")
        pytest.skip(msg)
    import kvq._C

    return kvq._C


def _archs(spec: str) -> set[str]:
    return {a.strip().split("+")[0] for a in spec.replace(" ", ";").split(";") if a.strip()}


def test_cuda_archs_match_the_build_list(ext):
    # The build honours TORCH_CUDA_ARCH_LIST and defaults to DEFAULT_ARCHS; run with the same variable.
    got = ext.cuda_archs()
    assert isinstance(got, str) and got
    want = _archs(os.environ.get("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCHS))
    assert want <= _archs(got), f"kvq._C was compiled for {got}, expected at least {sorted(want)}"
    assert kvq.backends.compiled_archs() == got.split(";")


def _cuda_kernel_source(name: str) -> str:
    """The line of the dispatcher's table naming where the CUDA kernel of kvq::<name> was registered."""
    table = torch._C._dispatch_dump(f"kvq::{name}")
    lines = [ln for ln in table.splitlines() if ln.startswith("CUDA")]
    return lines[0] if lines else ""


def test_every_op_has_a_compiled_cuda_kernel(ext):
    has_extend = (ROOT / "csrc" / "torch" / "extend.cu").exists()
    for name in SCHEMAS:
        if name == "extend_attention" and not has_extend:
            continue
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"kvq::{name}", "CUDA"), name
        src = _cuda_kernel_source(name)
        assert "register.cpp" in src, f"kvq::{name}'s CUDA kernel does not come from kvq._C: {src!r}"


@pytest.mark.parametrize("setter, names", [("set_decode_kernel", ("auto", "fma", "tc")),
                                           ("set_decode_heads", ("auto", "cta", "warp", "columns", "rows")),
                                           ("set_decode_pdl", ("auto", "off", "merge")),
                                           ("set_extend_shape", ("auto", "wide", "deep", "tall", "small")),
                                           ("set_extend_splits", ("auto", "1", "2", "3", "4")),
                                           ("set_extend_pdl", ("auto", "off", "merge")),
                                           ("set_store_pdl", ("auto", "off"))])
def test_kernel_choices_round_trip_and_refuse_unknown_names(ext, setter, names):
    """The knobs the tests and benchmarks use to pin a CUDA kernel: each returns the previous choice, and an
    unknown name is refused with the valid ones in the message (the choice is left unchanged)."""
    choose = getattr(ext, setter)
    valid = ", ".join(f"'{n}'" for n in names[:-1]) + f" or '{names[-1]}'"
    first = choose(names[1])
    try:
        assert choose(names[0]) == names[1]
        assert choose(names[-1]) == names[0]
        with pytest.raises(ValueError, match=f"{valid}, got 'bogus'"):
            choose("bogus")
        assert choose(names[1]) == names[-1]
    finally:
        choose(first)
    assert choose(names[0]) == first
    with pytest.raises(TypeError):
        choose(3)


def test_decode_split_count_round_trips_and_refuses_out_of_range(ext):
    """The split-count knob of the CUDA decode (tests pin it to reach every merge): 'auto' or a count from 1 to
    256, the previous one returned; anything else refused with the valid range in the message, unchanged."""
    first = ext.set_decode_splits("7")
    try:
        assert ext.set_decode_splits("auto") == "7"
        assert ext.set_decode_splits("256") == "auto"
        for bad in ("0", "257", "-1", "", "1.5", "bogus", "07", " 7"):
            with pytest.raises(ValueError, match=f"'auto' or a count from '1' to '256', got '{re.escape(bad)}'"):
                ext.set_decode_splits(bad)
        assert ext.set_decode_splits("1") == "256"
    finally:
        ext.set_decode_splits(first)
    assert ext.set_decode_splits("auto") == first
    with pytest.raises(TypeError):
        ext.set_decode_splits(3)


def test_pinned_cuda_kernel_restores_the_previous_choice(ext):
    """The context manager tests and benchmarks pin kernels with: the choice holds inside the block, and the one
    before it comes back after, also when the block raises."""
    from kvq.backends import pinned_cuda_kernel

    first_shape, first_kernel = ext.set_extend_shape("deep"), ext.set_decode_kernel("tc")
    try:
        with pinned_cuda_kernel("set_extend_shape", "wide"):
            assert ext.set_extend_shape("wide") == "wide"
        assert ext.set_extend_shape("deep") == "deep"
        with pytest.raises(RuntimeError, match="inside"):
            with pinned_cuda_kernel("set_decode_kernel", "fma"):
                assert ext.set_decode_kernel("fma") == "fma"
                raise RuntimeError("inside")
        assert ext.set_decode_kernel("tc") == "tc"
    finally:
        ext.set_extend_shape(first_shape)
        ext.set_decode_kernel(first_kernel)
