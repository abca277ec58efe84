"""bench/throughput.py on the CPU reference path with tiny shapes (the GPU run is the real one)."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench" / "throughput.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("kvq_throughput_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cpu_quick_run(tmp_path):
    bench = load_bench()
    threads = torch.get_num_threads()
    try:
        assert bench.main(["--device", "cpu", "--quick", "--json", str(tmp_path / "t.json")]) == 0
    finally:
        torch.set_num_threads(threads)
    res = json.loads((tmp_path / "t.json").read_text())
    (m,) = res["models"]
    d = m["dtypes"]
    budget = m["budget_bytes"]
    for name, r in d.items():
        assert r["pool_bytes"] <= budget
        assert r["max_batch"]["tokens_per_s"] > 0 and r["single_stream"]["tokens_per_s"] > 0
        assert r["max_batch"]["batch"] == r["sequences_fit"]
    # 8-bit KV: 1.0625 bytes per element against 2, so ~1.88x the sequences in the same budget.
    assert d["q8_0"]["unit_bytes"] * 32 == d["bf16"]["unit_bytes"] * 17
    assert d["q8_0"]["sequences_fit"] >= 1.8 * d["bf16"]["sequences_fit"]
    assert d["q8_0"]["same_batch"]["batch"] == d["bf16"]["sequences_fit"]


def test_unknown_shape_is_an_error():
    with pytest.raises(SystemExit):
        load_bench().main(["--device", "cpu", "--models", "nope"])
