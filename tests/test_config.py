"""--kv-cache-dtype: every name resolves once, or fails naming the problem and the fix."""

import argparse

import pytest
import torch

import kvq
from kvq.config import add_kv_cache_dtype_argument, resolve_kv_cache_dtype


def resolve(name, **kw):
    kw.setdefault("head_dim", 128)
    return resolve_kv_cache_dtype(name, **kw)


@pytest.mark.parametrize("name,want,cache", [
    ("bf16", "bf16", torch.bfloat16), ("bfloat16", "bf16", torch.bfloat16), ("q8_0", "q8_0", torch.int8),
    ("int8", "q8_0", torch.int8), ("Q8_0", "q8_0", torch.int8), ("fp8_e4m3", "fp8_e4m3", torch.float8_e4m3fn),
    ("fp8", "fp8_e4m3", torch.float8_e4m3fn), ("auto", "bf16", torch.bfloat16),
])
def test_valid_names(name, want, cache):
    spec = resolve(name)
    assert spec.name == want and spec.cache_dtype(torch.bfloat16) == cache


def test_auto_is_the_model_dtype():
    assert resolve("auto", model_dtype=torch.float16).name == "fp16"
    assert resolve("fp16", model_dtype=torch.float16).storage_dtype == torch.float16
    assert resolve("auto", model_dtype=torch.float32, attention_backend="sdpa").cache_dtype(torch.float32) \
        == torch.float32


@pytest.mark.parametrize("backend", ["kvq", "cuda", "triton", "reference", "KVQ"])
@pytest.mark.parametrize("name", ["q8_0", "fp8_e4m3"])
def test_quantized_with_kvq_backends(backend, name):
    assert resolve(name, attention_backend=backend, head_dim=64).quantized


def test_unknown_name_lists_the_valid_ones():
    with pytest.raises(ValueError) as e:
        resolve("q4_k")
    msg = str(e.value)
    assert "'q4_k'" in msg and "not a known" in msg
    for valid in ("auto", "bf16", "fp16", "q8_0", "fp8_e4m3"):
        assert valid in msg


@pytest.mark.parametrize("backend", ["sdpa", "eager", "flash_attention_2"])
def test_quantized_needs_a_backend_that_reads_it(backend):
    with pytest.raises(ValueError) as e:
        resolve("fp8_e4m3", attention_backend=backend)
    msg = str(e.value)
    assert "--kv-cache-dtype fp8_e4m3" in msg and "reads quantized KV" in msg and repr(backend) in msg
    assert "Pass --attention-backend kvq" in msg and "drop --kv-cache-dtype" in msg
    assert resolve("auto", attention_backend=backend).name == "bf16"  # unquantized works with any backend


@pytest.mark.parametrize("head_dim", [80, 96 + 8, 0])
def test_head_dim_not_a_multiple_of_32(head_dim):
    with pytest.raises(ValueError) as e:
        resolve("q8_0", head_dim=head_dim)
    msg = str(e.value)
    assert f"head_dim is {head_dim}" in msg and "multiple of 32" in msg and "use --kv-cache-dtype auto" in msg
    with pytest.raises(ValueError, match="multiple of 32.*--attention-backend"):
        resolve("auto", head_dim=80)  # kvq's attention cannot read it even unquantized
    if head_dim:
        assert resolve("auto", head_dim=head_dim, attention_backend="sdpa").name == "bf16"


@pytest.mark.parametrize("family,words", [("mla", "MLA"), ("sparse_index", "sparse-attention index")])
@pytest.mark.parametrize("name", ["q8_0", "fp8_e4m3", "auto", "bf16"])
def test_unsupported_pool_families(family, words, name):
    # kvq's attention reads per-head pages, whatever their dtype; the model's own attention reads its own cache.
    backend = ["kvq", "cuda", "triton", "reference"][int(torch.randint(0, 4, ()))]
    with pytest.raises(ValueError) as e:
        resolve(name, pool_family=family, attention_backend=backend)
    msg = str(e.value)
    assert words in msg and "is not supported yet" in msg and "use --kv-cache-dtype auto" in msg
    assert "--attention-backend sdpa" in msg
    if name in ("auto", "bf16"):
        assert resolve(name, pool_family=family, attention_backend="sdpa").name == "bf16"


def test_unknown_pool_family():
    with pytest.raises(ValueError, match="unknown KV pool family 'hybrid'.*mha.*mla"):
        resolve("q8_0", pool_family="hybrid")


def test_unquantized_dtype_must_match_the_model():
    with pytest.raises(ValueError) as e:
        resolve("bf16", model_dtype=torch.float16)
    msg = str(e.value)
    assert "torch.bfloat16" in msg and "torch.float16" in msg and "--kv-cache-dtype auto" in msg


def test_quantized_needs_a_half_precision_model():
    with pytest.raises(ValueError, match="float32.*bfloat16 or float16.*--kv-cache-dtype auto"):
        resolve("fp8_e4m3", model_dtype=torch.float32)
    with pytest.raises(ValueError, match="float32.*load the model in bfloat16 or float16"):
        resolve("auto", model_dtype=torch.float32)


def test_argument_helper(capsys):
    p = argparse.ArgumentParser(prog="tool")
    add_kv_cache_dtype_argument(p)
    assert p.parse_args([]).kv_cache_dtype == "auto"
    assert p.parse_args(["--kv-cache-dtype", "int8"]).kv_cache_dtype == "q8_0"
    assert p.parse_args(["--kv-cache-dtype", "FP8"]).kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(SystemExit):
        p.parse_args(["--kv-cache-dtype", "q4"])
    err = capsys.readouterr().err
    assert "unknown KV cache dtype 'q4'" in err and "q8_0" in err and "fp8_e4m3" in err
    p.print_help()
    assert "{auto,bf16,fp16,q8_0,fp8_e4m3}" in capsys.readouterr().out


def test_exported():
    assert kvq.resolve_kv_cache_dtype is resolve_kv_cache_dtype
    assert kvq.KVPool.__module__ == "kvq.pool"
