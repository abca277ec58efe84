"""python -m kvq plan: its numbers by hand, and its errors on bad configs and flags."""

import json
import subprocess
import sys

import pytest
import torch

from kvq.plan import PlanError, main, parse_size
from kvq.pool import KVPool

LLAMA3_8B = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
             "torch_dtype": "bfloat16"}


def run_json(capsys, *argv):
    assert main(list(argv) + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_llama3_8b_16gib_by_hand(capsys):
    out = run_json(capsys, "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--memory", "16GiB",
                   "--context", "8192", "32768")
    rows = {r["dtype"]: r for r in out["rows"]}
    assert list(rows) == ["bf16", "fp16", "q8_0", "fp8_e4m3"]
    # bf16: 2*32*8*128*2 = 131072 B/token; a 16-token page is 2 MiB; 16 GiB / 2 MiB = 8192 pages
    assert rows["bf16"]["bytes_per_token"] == 131072 and rows["bf16"]["tokens"] == 8192 * 16
    assert rows["bf16"]["sequences"] == {"8192": 16, "32768": 4}
    # q8_0: 69632 B/token; a page is 1114112 B; 17179869184 / 1114112 = 15420.2 -> 15420 pages
    for name in ("q8_0", "fp8_e4m3"):
        assert rows[name]["bytes_per_token"] == 69632 and rows[name]["pages"] == 15420
        assert rows[name]["tokens"] == 246720
        assert rows[name]["sequences"] == {"8192": 15420 // 512, "32768": 15420 // 2048}
        assert rows[name]["sequences"] == {"8192": 30, "32768": 7}
        assert rows[name]["ratio_to_bf16"] == pytest.approx(2 / 1.0625)


def test_smollm2_page_size_and_units(capsys):
    # 30 layers, 3 kv heads, d64, q8_0: 2*30*3*64*1.0625 = 12240 B/token; page of 32 tokens = 391680 B
    out = run_json(capsys, "--layers", "30", "--kv-heads", "3", "--head-dim", "64", "--memory", "1GB",
                   "--page-size", "32", "--context", "2048", "100", "--kv-cache-dtype", "int8")
    (row,) = out["rows"]
    assert row["dtype"] == "q8_0" and row["bytes_per_token"] == 12240
    assert row["pages"] == 10**9 // 391680 == 2553 and row["tokens"] == 2553 * 32
    assert row["sequences"] == {"2048": 2553 // 64, "100": 2553 // 4}


def test_plan_matches_the_pool(capsys):
    """The planner's count is what KVPool.from_budget allocates."""
    budget = 3 * 2**20 + 12345
    out = run_json(capsys, "--layers", "4", "--kv-heads", "2", "--head-dim", "256", "--memory", str(budget))
    for row in out["rows"]:
        model = torch.float16 if row["dtype"] == "fp16" else torch.bfloat16  # the model each row is served with
        pool = KVPool.from_budget(budget, 4, 2, 256, kv_cache_dtype=row["dtype"], model_dtype=model)
        assert pool.num_pages * pool.page_size == row["tokens"] and pool.unit_bytes() == row["bytes_per_token"]


def test_table_output(capsys):
    assert main(["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--memory", "16GiB"]) == 0
    text = capsys.readouterr().out
    assert "seqs@8192" in text and "1.88x" in text and "246,720" in text


@pytest.mark.parametrize("text,want", [("16GiB", 16 * 2**30), ("24GB", 24 * 10**9), ("512 MiB", 512 * 2**20),
                                       ("1.5KiB", 1536), ("100", 100), ("7B", 7), ("2kb", 2000)])
def test_parse_size(text, want):
    assert parse_size(text) == want


@pytest.mark.parametrize("text", ["16 parsecs", "GiB", "-1GiB", "0MB"])
def test_parse_size_errors(text):
    with pytest.raises(PlanError, match="--memory"):
        parse_size(text)


def write(tmp_path, cfg):
    p = tmp_path / "config.json"
    p.write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    return str(p)


def test_config_json(tmp_path, capsys):
    out = run_json(capsys, "--config", write(tmp_path, LLAMA3_8B), "--memory", "16GiB")
    assert (out["num_layers"], out["num_kv_heads"], out["head_dim"]) == (32, 8, 128)
    assert out["rows"][2]["tokens"] == 246720
    # explicit head_dim wins over hidden_size / heads (Qwen3: 4096 / 32 would be 128)
    qwen = {"num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 4, "hidden_size": 4096,
            "head_dim": 256}
    out = run_json(capsys, "--config", write(tmp_path, qwen), "--memory", "1GiB")
    assert out["head_dim"] == 256 and out["rows"][2]["bytes_per_token"] == 2 * 36 * 4 * 256 * 1.0625
    # no num_key_value_heads: multi-head attention, one kv head per query head
    mha = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256}
    assert run_json(capsys, "--config", write(tmp_path, mha), "--memory", "1MiB")["num_kv_heads"] == 4
    # multimodal configs keep the language model under text_config
    mm = {"model_type": "gemma3", "text_config": dict(LLAMA3_8B)}
    assert run_json(capsys, "--config", write(tmp_path, mm), "--memory", "1GiB")["num_layers"] == 32


def test_mla_config_is_not_sized_per_head(tmp_path, capsys):
    # An MLA cache holds a compressed latent per token, not num_kv_heads * head_dim: no row may size it so.
    cfg = dict(LLAMA3_8B, kv_lora_rank=int(torch.randint(1, 9, ())) * 128)
    assert main(["--config", write(tmp_path, cfg), "--memory", "1GiB", "--json"]) == 2
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["dtype"] for r in rows] == ["bf16", "fp16", "q8_0", "fp8_e4m3"]
    for r in rows:
        assert "tokens" not in r and "MLA" in r["error"] and "not supported yet" in r["error"]
    assert main(["--config", write(tmp_path, cfg), "--memory", "1GiB"]) == 2
    text = capsys.readouterr().out
    assert "bf16: --kv-cache-dtype bf16" in text and "not supported yet" in text


@pytest.mark.parametrize("cfg,words", [
    ({"num_attention_heads": 32, "hidden_size": 4096}, "no 'num_hidden_layers'"),
    ({"num_hidden_layers": 32, "hidden_size": 4096}, "no 'num_attention_heads'"),
    ({"num_hidden_layers": 32, "num_attention_heads": 32}, "neither 'head_dim' nor 'hidden_size'"),
    ({"num_hidden_layers": "32", "num_attention_heads": 32, "hidden_size": 4096}, "num_hidden_layers is '32'"),
    ({"num_hidden_layers": 32, "num_attention_heads": 3, "hidden_size": 4096}, "not divisible"),
    ("{not json", "is not valid JSON"),
    ("[1, 2]", "not an object"),
])
def test_malformed_config(tmp_path, capsys, cfg, words):
    assert main(["--config", write(tmp_path, cfg), "--memory", "1GiB"]) == 2
    err = capsys.readouterr().err
    assert words in err and "error" in err


def test_flag_errors(tmp_path, capsys):
    assert main(["--config", str(tmp_path / "missing.json"), "--memory", "1GiB"]) == 2
    assert "cannot read --config" in capsys.readouterr().err
    assert main(["--layers", "32", "--memory", "1GiB"]) == 2
    assert "missing --kv-heads, --head-dim" in capsys.readouterr().err
    assert main(["--layers", "32", "--kv-heads", "8", "--head-dim", "128"]) == 2  # no budget
    assert "--memory" in capsys.readouterr().err
    assert main(["--layers", "32", "--kv-heads", "8", "--head-dim", "80", "--memory", "1GiB",
                 "--kv-cache-dtype", "q8_0"]) == 2
    assert "multiple of 32" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")
def test_gpu_fraction_needs_a_gpu(capsys):
    assert main(["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--gpu-fraction", "0.9"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_cli_entry_point():
    r = subprocess.run([sys.executable, "-m", "kvq", "plan", "--layers", "32", "--kv-heads", "8", "--head-dim",
                        "128", "--memory", "16GiB", "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["rows"][2]["tokens"] == 246720
