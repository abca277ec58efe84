"""transformers integration (kvq.hf) and the eval's pieces, on a tiny random Llama on CPU."""

import copy
import math

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="kvq.hf needs transformers (scripts/setup-eval.sh)")

from kvq import hf  # noqa: E402
from kvq.eval import Runner, perplexity_windows  # noqa: E402
from kvq.pool import KVPoolFullError  # noqa: E402

VOCAB = 512


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # The CPU path runs many small ops; intra-op threads only add barrier waits (badly so on a busy machine).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_model(dtype, attn="kvq", seed=0):
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                   max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # sharper next-token distributions than the default init, so KL means something
        model.lm_head.weight.mul_(8)
    model = model.to(dtype).eval()
    model.set_attn_implementation(attn if attn != "kvq" else hf.register())
    return model


def run_kvq(model, ids, dtype_name, chunks):
    """Logits ``[T, V]`` (fp32) feeding ``ids`` in the given chunk sizes (1 = a decode step)."""
    cache = hf.KVQCache(model.config, dtype_name, max_tokens=ids.numel() + 16, model_dtype=model.dtype)
    kw = {hf.cache_kwarg(model): cache, "use_cache": True}
    out, pos = [], 0
    with torch.no_grad():
        for n in chunks:
            out.append(model(input_ids=ids[pos:pos + n].view(1, -1), **kw).logits[0].float())
            pos += n
    assert cache.get_seq_length() == pos
    return torch.cat(out)


def eager_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids.view(1, -1), use_cache=False).logits[0].float()


@pytest.fixture(scope="module")
def models():
    kvq16 = tiny_model(torch.float16)
    eager16 = copy.deepcopy(kvq16)
    eager16.set_attn_implementation("eager")
    eager32 = copy.deepcopy(kvq16).float()
    eager32.set_attn_implementation("eager")
    return kvq16, eager16, eager32


CHUNKS = [20, 7, 1, 1, 1, 1, 1]  # prefill, chunked prefill (prefix 20), five decode steps


def test_unquantized_cache_matches_eager(models):
    kvq16, eager16, eager32 = models
    ids = torch.randint(0, VOCAB, (sum(CHUNKS),), generator=torch.Generator().manual_seed(1))
    got = run_kvq(kvq16, ids, "fp16", CHUNKS)
    want = eager_logits(eager32, ids)
    same_precision = (eager_logits(eager16, ids) - want).abs().max().item()
    err = (got - want).abs().max().item()
    # kvq attends in fp32, eager in fp16: kvq may be closer, and must be no worse than 2x plus rounding slack.
    assert err <= 2 * same_precision + 1e-3 * want.abs().max().item(), (err, same_precision)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_bf16_cache_matches_eager():
    model = tiny_model(torch.bfloat16)
    ref = copy.deepcopy(model).float()
    ref.set_attn_implementation("eager")
    ids = torch.randint(0, VOCAB, (sum(CHUNKS),), generator=torch.Generator().manual_seed(2))
    got, want = run_kvq(model, ids, "auto", CHUNKS), eager_logits(ref, ids)
    bf16_eager = copy.deepcopy(model)
    bf16_eager.set_attn_implementation("eager")
    same_precision = (eager_logits(bf16_eager, ids) - want).abs().max().item()
    assert (got - want).abs().max().item() <= 2 * same_precision + 1e-3 * want.abs().max().item()


@pytest.mark.parametrize("fmt", ["q8_0", "fp8_e4m3"])
def test_quantized_cache_stays_close(models, fmt):
    kvq16, _, _ = models
    ids = torch.randint(0, VOCAB, (sum(CHUNKS),), generator=torch.Generator().manual_seed(3))
    ref = torch.log_softmax(run_kvq(kvq16, ids, "fp16", CHUNKS), -1)
    got = torch.log_softmax(run_kvq(kvq16, ids, fmt, CHUNKS), -1)
    assert not torch.equal(ref, got), "the 8-bit cache changed nothing: is it really being read?"
    kl = (ref.exp() * (ref - got)).sum(-1)
    bound = {"q8_0": 2e-3, "fp8_e4m3": 2e-2}[fmt]  # fp8 keeps 3 mantissa bits, q8_0 about 7
    assert kl.max().item() < bound, kl
    # Positions after the first prefill chunk read quantized K/V; the first chunk attends to exact K/V only.
    assert torch.allclose(ref[:20], got[:20], atol=1e-2)


def test_generate_with_kvq_cache(models):
    kvq16, eager16, _ = models
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = eager16.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)
        for fmt in ("fp16", "q8_0"):
            cache = hf.KVQCache(kvq16.config, fmt, max_tokens=32, model_dtype=torch.float16)
            got = kvq16.generate(ids, past_key_values=cache, max_new_tokens=8, do_sample=False, min_new_tokens=8)
            assert got.shape == want.shape
            assert cache.get_seq_length() == want.shape[1] - 1  # the last token is never fed back
            if fmt == "fp16":
                assert torch.equal(got, want)


def test_attention_without_kvq_cache_is_an_error(models):
    kvq16, _, _ = models
    with torch.no_grad(), pytest.raises(ValueError, match="KVQCache"):
        kvq16(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)


def test_cache_shape_mismatch_is_an_error(models):
    from kvq.pool import KVPool

    pool = KVPool(3, 2, 64, 8, kv_cache_dtype="q8_0", model_dtype=torch.float16)
    with pytest.raises(ValueError, match="layers"):
        hf.KVQCache(models[0].config, pool=pool)


def test_chunked_perplexity_equals_plain_forward(models):
    """With an unquantized cache, the eval's chunked-prefill + decode perplexity is a plain forward's."""
    kvq16, _, eager32 = models
    tokens = torch.randint(0, VOCAB, (200,), generator=torch.Generator().manual_seed(5))
    context, decode, chunk = 40, 10, 16

    class Bar:
        def update(self, n):
            pass

    res = perplexity_windows(Runner(kvq16, "cpu"), tokens, ["fp16", "q8_0"], "fp16", 2, context, decode, chunk,
                             Bar())
    span = context + decode + 1
    stride = (tokens.numel() - span) // 1
    nll_dec = nll_pre = 0.0
    for w in range(2):
        win = tokens[w * stride: w * stride + span]
        lp = torch.log_softmax(eager_logits(eager32, win), -1)
        nll = -lp[:-1].gather(1, win[1:].view(-1, 1)).squeeze(1)  # nll[p] scores token p + 1
        nll_dec += nll[context: context + decode].sum().item()
        nll_pre += nll[chunk: context].sum().item()
    ppl_dec, ppl_pre = math.exp(nll_dec / (2 * decode)), math.exp(nll_pre / (2 * (context - chunk)))
    assert res["fp16"]["tokens_decode"] == 2 * decode and res["fp16"]["tokens_prefill"] == 2 * (context - chunk)
    assert res["fp16"]["ppl_decode"] == pytest.approx(ppl_dec, rel=2e-3)
    assert res["fp16"]["ppl_prefill"] == pytest.approx(ppl_pre, rel=2e-3)
    assert 0 < res["q8_0"]["kl_decode"] < 2e-3 and res["q8_0"]["top1_decode"] >= 0.9
    assert res["q8_0"]["ppl_decode_delta_se_pct"] > 0


def test_batch_rows_are_independent_sequences(models):
    kvq16, _, _ = models
    ids = torch.randint(0, VOCAB, (2, 14), generator=torch.Generator().manual_seed(6))
    cache = hf.KVQCache(kvq16.config, "q8_0", max_tokens=64, batch_size=2, model_dtype=torch.float16)
    kw = {hf.cache_kwarg(kvq16): cache, "use_cache": True}
    with torch.no_grad():
        batched = torch.cat([kvq16(input_ids=ids[:, :12], **kw).logits,
                             kvq16(input_ids=ids[:, 12:13], **kw).logits,
                             kvq16(input_ids=ids[:, 13:14], **kw).logits], 1).float()
    assert len(cache.seqs) == 2 and cache.pool.seq_lens(cache.seqs).tolist() == [14, 14]
    for row in range(2):
        single = run_kvq(kvq16, ids[row], "q8_0", [12, 1, 1])
        torch.testing.assert_close(batched[row], single, atol=2e-3, rtol=2e-3)


def test_cache_refuses_a_model_whose_attention_is_not_kvq(models):
    kvq16, eager16, _ = models
    for impl in ("sdpa", "eager"):
        cfg = copy.deepcopy(kvq16.config)
        cfg._attn_implementation = impl
        with pytest.raises(ValueError, match=f"selects attention '{impl}'.*attn_implementation"):
            hf.KVQCache(cfg, "fp16", max_tokens=64, model_dtype=torch.float16)
    # A cache made from a config that names no attention is caught at the first layer the other attention ran.
    cfg = transformers.LlamaConfig(**{k: v for k, v in kvq16.config.to_dict().items() if k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim")})
    cache = hf.KVQCache(cfg, "fp16", max_tokens=64, model_dtype=torch.float16)
    ids = torch.randint(0, VOCAB, (1, int(torch.randint(2, 20, ()))))
    with torch.no_grad(), pytest.raises(ValueError, match="layer 0's K/V went to an attention other than kvq's"):
        eager16(input_ids=ids, **{hf.cache_kwarg(eager16): cache, "use_cache": True})


def test_padded_attention_mask_is_refused(models):
    kvq16, _, _ = models
    n = int(torch.randint(4, 12, ()))
    ids = torch.randint(0, VOCAB, (2, n))
    kw = lambda: {hf.cache_kwarg(kvq16): hf.KVQCache(kvq16.config, "fp16", max_tokens=64, batch_size=2,
                                                     model_dtype=torch.float16), "use_cache": True}
    with torch.no_grad():
        plain = kvq16(input_ids=ids, **kw()).logits
        ones = kvq16(input_ids=ids, attention_mask=torch.ones(2, n, dtype=torch.long), **kw()).logits
        assert torch.equal(plain, ones)  # a mask that hides nothing changes nothing
        mask = torch.ones(2, n, dtype=torch.long)
        row = int(torch.randint(0, 2, ()))
        mask[row, : int(torch.randint(1, n, ()))] = 0  # left padding
        with pytest.raises(ValueError, match=rf"rows \[{row}\].*Padded batches are not supported"):
            kvq16(input_ids=ids, attention_mask=mask, **kw())
        # A 4D mask reaches the attention as it is: causal passes, one that hides a key more does not.
        causal = torch.ones(n, n, dtype=torch.bool).tril()[None, None].expand(2, 1, n, n)
        assert torch.equal(plain, kvq16(input_ids=ids, attention_mask=causal, **kw()).logits)
        hidden = causal.clone()
        hidden[row, 0, -1, int(torch.randint(0, n, ()))] = False
        with pytest.raises(ValueError, match="4D attention_mask.*Padded batches are not supported"):
            kvq16(input_ids=ids, attention_mask=hidden, **kw())


def test_a_call_that_does_not_fit_reserves_nothing(models):
    kvq16, _, _ = models
    page = 16
    n = int(torch.randint(page // 2, page + 1, ()))  # each row fills most of one page, the pool one page more
    cache = hf.KVQCache(kvq16.config, "q8_0", num_pages=3, batch_size=2, page_size=page, model_dtype=torch.float16)
    kw = {hf.cache_kwarg(kvq16): cache, "use_cache": True}
    ids = torch.randint(0, VOCAB, (2, 2 * page))
    with torch.no_grad():
        kvq16(input_ids=ids[:, :n], **kw)
        pool, free = cache.pool, cache.pool.free_pages()
        assert free == 1
        with pytest.raises(KVPoolFullError, match="need 2 more page.*nothing was stored"):
            kvq16(input_ids=ids[:, n:page + 1], **kw)  # both rows cross into a second page
        assert pool.seq_lens(cache.seqs).tolist() == [n, n] and pool.free_pages() == free
        assert cache.get_seq_length() == n
        got = kvq16(input_ids=ids[:, n:page], **kw).logits if n < page else None  # what still fits works
    if got is not None:
        assert pool.seq_lens(cache.seqs).tolist() == [page, page] and torch.isfinite(got).all()


def test_unquantized_cache_must_be_the_model_dtype(models):
    kvq16, _, _ = models
    with pytest.raises(ValueError, match="stores K/V in torch.bfloat16 but the model computes in torch.float16"):
        hf.KVQCache(kvq16.config, ["bf16", "bfloat16"][int(torch.randint(0, 2, ()))], max_tokens=64,
                    model_dtype=torch.float16)
    assert hf.KVQCache(kvq16.config, "auto", max_tokens=64, model_dtype=torch.float16).pool.cache_dtype \
        == torch.float16
