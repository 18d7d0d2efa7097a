"""Packed attention (`geo3k_torch.attention`): a packed row attended sequence by sequence gives
transformers' block-diagonal sdpa result, and really runs per sequence."""

import numpy as np
import pytest
import torch

import geo3k_torch.attention as attention
from common.batching import pack
from geo3k_torch.model import packed_inputs
from tests.test_jax_model import sequences
from tests.tiny_models import ImageOnlyProcessor, qwen2_5_vl, qwen3_vl


@pytest.mark.parametrize("build", [qwen3_vl, qwen2_5_vl], ids=lambda b: b.__name__)
def test_packed_row_equals_dense_block_diagonal_sdpa(build, monkeypatch):
    model, patch = build(seed=0)
    processor = ImageOnlyProcessor(patch)
    seqs = sequences(processor, np.random.default_rng(0), 6)
    row, = pack(seqs, sum(map(len, seqs)))
    inputs = packed_inputs(row, processor, model.config)
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        dense = model(**inputs, use_cache=False).logits
    calls = []
    sdpa = attention.F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        calls.append((q.shape[2], kw.get("is_causal")))
        return sdpa(q, k, v, **kw)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    model.set_attn_implementation(attention.NAME)
    with torch.no_grad():
        packed = model(**inputs, use_cache=False).logits
    assert (packed - dense).abs().max() <= 1e-5 * dense.abs().max()
    # every text layer attended each sequence on its own, causally: no T x T scores
    lengths = [len(s) for s in seqs]
    layers = model.config.text_config.num_hidden_layers
    causal = [n for n, is_causal in calls if is_causal]  # (the vision tower's are not)
    assert sorted(causal) == sorted(n for n in lengths for _ in range(layers))


def test_calls_without_segments_are_plain_sdpa(monkeypatch):
    called = []
    monkeypatch.setattr(attention, "sdpa_attention_forward",
                        lambda *a, **k: called.append(1) or ("sdpa", None))
    q = torch.zeros(1, 4, 6, 8)
    kv = torch.zeros(1, 2, 6, 8)

    class Module:
        is_causal = True

    segments = ([3, 3], [-1, -1])
    assert attention.packed_sdpa(Module(), q, kv, kv, None)[0] == "sdpa"
    longer = torch.zeros(1, 2, 9, 8)  # a KV cache: keys past the queries
    assert attention.packed_sdpa(Module(), q, longer, longer, None,
                                 packed_segments=segments)[0] == "sdpa"
    Module.is_causal = False  # the vision tower
    assert attention.packed_sdpa(Module(), q, kv, kv, None, packed_segments=segments)[0] == "sdpa"
    assert called == [1, 1, 1]
    Module.is_causal = True
    out, _ = attention.packed_sdpa(Module(), q, kv, kv, None, packed_segments=segments)
    assert out.shape == (1, 6, 4, 8)


@pytest.mark.parametrize("gqa", [1, 2])
def test_segments_with_a_prefix_equal_the_dense_masked_reference(gqa):
    """Segments attend causally to themselves and fully to their prefix, nothing else: the
    dense T x T sdpa with that mask gives the same output."""
    g = torch.Generator().manual_seed(0)
    T, H, D = 23, 4, 8
    q = torch.randn(1, H, T, D, generator=g)
    k, v = (torch.randn(1, H // gqa, T, D, generator=g) for _ in range(2))
    # a prefix [0, 7) with two continuations, a plain sequence, another prefix with one
    lengths, parents = [7, 4, 3, 4, 2, 3], [-1, 0, 0, -1, -1, 4]
    bounds = np.cumsum([0] + lengths)
    mask = torch.zeros(T, T, dtype=torch.bool)
    for s, p in enumerate(parents):
        lo, hi = bounds[s], bounds[s + 1]
        mask[lo:hi, lo:hi] = torch.ones(hi - lo, hi - lo, dtype=torch.bool).tril()
        if p >= 0:
            mask[lo:hi, bounds[p]:bounds[p + 1]] = True

    class Module:
        is_causal = True

    out, _ = attention.packed_sdpa(Module(), q, k, v, None, scaling=0.3,
                                   packed_segments=(lengths, parents))
    ref = attention.F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3,
                                                   enable_gqa=gqa > 1).transpose(1, 2)
    assert torch.allclose(out, ref, rtol=0, atol=1e-6)


def test_chunked_logprobs_equal_unchunked():
    """The LM head a few rows at a time (checkpointed) gives the same log-probs, entropies and
    gradients as all K rows at once."""
    from geo3k_torch.model import token_logprobs

    model, patch = qwen3_vl(seed=0)
    processor = ImageOnlyProcessor(patch)
    seqs = sequences(processor, np.random.default_rng(1), 4)
    row, = pack(seqs, sum(map(len, seqs)))
    inputs = packed_inputs(row, processor, model.config)
    targets = torch.from_numpy(np.flatnonzero(row.loss_mask))
    assert len(targets) > 3 * 7
    results = []
    for chunk in (0, 7):
        model.zero_grad()
        logp, entropy = token_logprobs(model, inputs, targets, 0.7, True, chunk=chunk)
        (logp * torch.linspace(-1, 1, len(logp))).sum().backward()
        results.append((logp.detach(), entropy, {k: p.grad.clone()
                                                 for k, p in model.named_parameters()}))
    (a, ea, ga), (b, eb, gb) = results
    assert torch.allclose(a, b, rtol=0, atol=1e-6) and torch.allclose(ea, eb, rtol=0, atol=1e-5)
    for k, g in ga.items():
        assert torch.linalg.norm(gb[k] - g) <= 1e-6 * max(torch.linalg.norm(g), 1e-12), k
    assert isinstance(model.lm_head, torch.nn.Linear)  # the stand-in is gone after the call
