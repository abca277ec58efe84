"""The benchmark's arithmetic, tables, bars and CLI (no timing: that needs a GPU and is not asserted)."""

import subprocess
import sys

from pathlib import Path

import pytest
import torch

from kvq import KVQuantSpec
from kvq import benchmark as kb


# ------------------------------------------------------------------------------------------- bytes
@pytest.mark.parametrize("fmt", ["bf16", "q8_0", "fp8_e4m3"])
def test_kv_bytes_match_the_format(fmt):
    tokens, hkv, d = 1000, 3, 64
    per_elem = KVQuantSpec.from_name(fmt).bytes_per_element  # 2 or 1.0625 (scales included)
    assert kb.kv_bytes(tokens, hkv, d, fmt) == pytest.approx(2 * tokens * hkv * d * per_elem)


def test_kv_bytes_counts_exact_elements():
    # 10 tokens x 2 heads x 64: 1280 elements per plane, 40 fp16 scales per plane
    assert kb.kv_bytes(10, 2, 64, "bf16") == 2 * 1280 * 2
    assert kb.kv_bytes(10, 2, 64, "q8_0") == 2 * (1280 + 40 * 2)
    assert kb.kv_bytes(10, 2, 64, "fp8") == 2 * 1280  # one scale per tensor: no scale plane


def test_decode_bytes_per_implementation():
    b, ctx, hq, hkv, d = 2, 4096, 32, 8, 128
    bf16 = 2 * b * ctx * hkv * d * 2
    assert kb.decode_bytes("kvq-cuda", "bf16", b, ctx, hq, hkv, d) == bf16
    assert kb.decode_bytes("kvq-triton", "q8_0", b, ctx, hq, hkv, d) == bf16 // 2 * 1.0625
    assert kb.decode_bytes("flashinfer", "fp8", b, ctx, hq, hkv, d) == bf16 // 2
    assert kb.decode_bytes("sdpa-flash", "bf16", b, ctx, hq, hkv, d, "native") == bf16
    assert kb.decode_bytes("sdpa-cudnn", "bf16", b, ctx, hq, hkv, d, "repeat") == bf16 * (hq // hkv)
    # naive: read the 8-bit cache, write bf16, read that bf16 again
    assert kb.decode_bytes("naive", "fp8_e4m3", b, ctx, hq, hkv, d) == bf16 // 2 * 1.0625 + 2 * bf16


def test_store_bytes_and_floor():
    n, hkv, d = 65536, 8, 128
    elems = n * hkv * d
    assert kb.store_bytes(n, hkv, d, "q8_0") == 2 * elems * 2 + 2 * (elems + elems // 32 * 2) + 8 * n
    assert kb.store_bytes(n, hkv, d, "bf16") == 4 * elems * 2 + 8 * n
    assert kb.floor_us(3e9, 3e12) == pytest.approx(1000.0)


def test_rotation_covers_four_l2():
    l2 = 60 << 20
    assert kb.rotation(1 << 20, l2, 512) == 240
    assert kb.rotation(1 << 20, l2, 16) == 16
    assert kb.rotation(10 * l2, l2, 512) == 1
    n = kb.rotation(7_000_001, l2, 512)
    assert n * 7_000_001 >= 4 * l2 > (n - 1) * 7_000_001


@pytest.mark.parametrize("chunk,prefix", [(1, 0), (5, 0), (3, 7), (16, 100)])
def test_extend_flops_counts_causal_pairs(chunk, prefix):
    q = torch.arange(prefix, prefix + chunk)[:, None]
    k = torch.arange(prefix + chunk)[None, :]
    pairs = int((k <= q).sum())
    assert kb.extend_flops(chunk, prefix, 4, 64) == 4 * 4 * 64 * pairs


# ------------------------------------------------------------------------------------------ plan
def test_plans_cover_the_asked_shapes():
    full = kb.make_plan(False)
    assert {s[:3] for s in full.decode} == set(kb.HEADS)
    assert {s[3] for s in full.decode} == {1, 8, 64}
    assert min(s[4] for s in full.decode) == 1024 and max(s[4] for s in full.decode) == 262144
    # The first benchmark's shapes: batch 1 at 4k, 32k and 128k tokens, batch 64 at 4k.
    for h in kb.HEADS[:2]:
        assert {(*h, 1, 4096), (*h, 1, 32768), (*h, 1, 131072), (*h, 64, 4096)} <= set(full.decode)
    assert {s[3] for s in full.extend} == {512, 2048, 8192} and {s[4] for s in full.extend} == {0, 4096, 32768}
    assert all(s[3] >= 65536 for s in full.store)
    quick = kb.make_plan(True)
    assert len(quick.decode) < len(full.decode) / 4 and {s[:3] for s in quick.decode} == {kb.HEADS[0]}
    assert quick.flashinfer_dims == (128,)
    custom = kb.make_plan(False, heads=[(8, 8, 64)], batches=[2], ctxs=[3000])
    assert custom.decode == [(8, 8, 64, 2, 3000)]


# ---------------------------------------------------------------------------------------- tables
def test_markdown_table_aligns_and_marks_missing():
    text = kb.markdown_table(["name", "us"], [["a", "1.5"], ["longer", None]])
    lines = text.splitlines()
    assert lines[0] == "| name   |  us |"
    assert lines[1] == "|--------|----:|"
    assert lines[2] == "| a      | 1.5 |"
    assert lines[3] == "| longer |   - |"
    assert len({len(line) for line in lines}) == 1


def _decode_row(impl, fmt, us, batch=1, ctx=32768, frac=0.9, kind=None):
    kind = kind or kb._kind(impl)
    return dict(op="decode", impl=impl, fmt=fmt, kind=kind, backend=kb._backend(impl) or ("triton" if kind == "naive"
                else None), hq=32, hkv=8, d=128, batch=batch, ctx=ctx, us=us, frac=frac, bytes=1, floor_us=1.0)


def _synthetic(speedup_ok=True):
    rows = []
    for ctx in (2048, 32768, 131072):
        peer = 100.0 * ctx / 2048
        kv8 = peer / (2.0 if speedup_ok else 1.5)
        rows += [_decode_row("sdpa-flash", "bf16", peer, ctx=ctx),
                 _decode_row("sdpa-cudnn", "bf16", peer * 1.2, ctx=ctx),
                 _decode_row("flashinfer", "fp8", peer * 0.4, ctx=ctx, kind="peer-8bit"),
                 _decode_row("kvq-triton", "bf16", peer * 0.98, ctx=ctx),
                 _decode_row("kvq-triton", "q8_0", kv8, ctx=ctx, frac=0.9),
                 _decode_row("kvq-triton", "fp8_e4m3", kv8, ctx=ctx, frac=0.88),
                 _decode_row("naive", "q8_0", kv8 * 25, ctx=ctx)]
    for fmt, us in (("bf16", 100.0), ("q8_0", 104.0), ("fp8_e4m3", 105.0)):
        rows.append(dict(op="extend", impl="kvq-triton", fmt=fmt, hq=32, hkv=8, d=128, chunk=512, prefix=4096, us=us,
                         tflops=300.0))
    rows.append(dict(op="store", impl="kvq-triton", fmt="q8_0", hq=32, hkv=8, d=128, tokens=65536, us=10.0,
                     gbps=3900.0, frac=0.83))
    return rows


def test_speedup_uses_the_fastest_bf16_peer_only():
    rows = _synthetic()
    kb.add_decode_ratios(rows)
    r = next(r for r in rows if r["impl"] == "kvq-triton" and r["fmt"] == "q8_0" and r["ctx"] == 32768)
    # fastest bf16 peer is sdpa-flash; flashinfer fp8 and kvq's own bf16 are not bf16 peers
    assert r["speedup_vs_best_bf16_peer"] == pytest.approx(2.0)
    assert "speedup_vs_best_bf16_peer" not in next(r for r in rows if r["impl"] == "kvq-triton" and r["fmt"] == "bf16")


def test_bars_met_on_good_numbers():
    rows = _synthetic()
    kb.add_decode_ratios(rows)
    bars = kb.evaluate_bars(rows, ["triton"])
    assert len(bars) == 6
    assert [b["met"] for b in bars] == [True] * 6, bars
    assert all("pass; worst" in b["detail"] for b in bars)


def test_bars_not_met_on_bad_numbers():
    rows = _synthetic(speedup_ok=False)
    for r in rows:
        if r["op"] == "decode" and r["fmt"] == "fp8_e4m3":
            r["frac"] = 0.5
        if r["op"] == "decode" and r["impl"] == "naive":
            r["us"] = 10 * next(x["us"] for x in rows if x["op"] == "decode" and x["impl"] == "kvq-triton"
                                and x["fmt"] == "q8_0" and x["ctx"] == r["ctx"])
        if r["op"] == "extend" and r["fmt"] == "q8_0":
            r["us"] = 111.0
        if r["op"] == "store":
            r["frac"] = 0.79
        if r["op"] == "decode" and r["impl"] == "kvq-triton" and r["fmt"] == "bf16" and r["ctx"] == 2048:
            r["us"] = 60.0  # faster than the 8-bit paths at batch 1, 2k
    kb.add_decode_ratios(rows)
    bars = kb.evaluate_bars(rows, ["triton"])
    assert [b["met"] for b in bars] == [False] * 6, bars
    speed = bars[0]
    assert "0/4 pass" in speed["detail"] and "1.50x" in speed["detail"]
    assert "50.0%" in bars[1]["detail"]


def test_bars_not_measured_without_rows():
    bars = kb.evaluate_bars([], ["cuda"])
    assert [b["met"] for b in bars] == [None] * 6
    assert "not measured" in kb.bars_text(bars) and "n/a" in kb.bars_text(bars)


def test_report_tables_render_synthetic_rows(tmp_path):
    rows = _synthetic()
    rows.append(dict(_decode_row("flashinfer", "bf16", None), note="flashinfer skipped: import failed"))
    kb.add_decode_ratios(rows)
    dec = kb.decode_table(rows)
    assert "kvq-triton q8_0" in dec and "(90%, 2.00x)" in dec and "skip" in dec
    assert "TF/s" in kb.extend_table(rows)
    assert "83%" in kb.store_table(rows)
    env = dict(date_utc="2026-01-01 00:00:00", gpu="GPU", sm="sm_90", gpu_memory_gib=1, sms=1, l2_mib=60,
               nvidia_smi=None, torch="t", torch_cuda="c", cudnn=1, triton="x", python="3", kvq_commit=None,
               kvq_backends={"backend": "triton", "unavailable": {}})
    md = kb.report_markdown(env, {"bytes": 4 << 30, "bandwidth": 4e12}, rows, kb.evaluate_bars(rows, ["triton"]),
                            ["a note"], {"x": 12.0}, 30.0, [])
    assert "4000 GB/s" in md and "## Bars" in md and "- a note" in md and "x: 12.0" in md


def test_plots_write_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    rows = _synthetic()
    written = kb.plots(rows, tmp_path, 4e12)
    assert written == ["decode_latency.png", "decode_bandwidth.png"]
    assert all((tmp_path / w).stat().st_size > 1000 for w in written)


# ------------------------------------------------------------------------------------------- CLI
def test_help_works_without_a_gpu():
    r = subprocess.run([sys.executable, "-m", "kvq", "bench", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "--quick" in r.stdout and "--backends" in r.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_bench_without_gpu_exits_with_a_message():
    r = subprocess.run([sys.executable, "-m", "kvq", "bench", "--quick"], capture_output=True, text=True)
    assert r.returncode == 2 and "needs a CUDA GPU" in r.stderr


def test_cli_rejects_unknown_ops():
    assert kb.main(["--ops", "decode,bogus"]) == 2


def test_source_digest_names_the_code_on_disk(tmp_path):
    """The digest a benchmark records: equal for a copy of the sources, different once a kernel file, a Python
    file or a path changes, and blind to what is not source (a build product, bytecode)."""
    import shutil

    from kvq import backends

    repo = Path(backends.__file__).resolve().parents[1]
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.pyc")
    for name in ("kvq", "csrc"):
        shutil.copytree(repo / name, tmp_path / name, ignore=ignore)
    shutil.copy(repo / "setup.py", tmp_path / "setup.py")
    digest = backends.source_digest(tmp_path)
    assert digest == backends.source_digest(repo) == backends.info()["source"] and len(digest) == 12
    (tmp_path / "kvq" / "_C.abi3.so").write_bytes(b"not source")
    assert backends.source_digest(tmp_path) == digest
    kernel = tmp_path / "csrc" / "include" / "kvq" / "decode.cuh"
    kernel.write_bytes(kernel.read_bytes() + b" ")
    assert backends.source_digest(tmp_path) != digest
    kernel.write_bytes(kernel.read_bytes()[:-1])
    assert backends.source_digest(tmp_path) == digest
    (tmp_path / "kvq" / "ops.py").rename(tmp_path / "kvq" / "ops2.py")
    assert backends.source_digest(tmp_path) != digest
