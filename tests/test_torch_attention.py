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


def test_a_single_sequence_or_a_cached_call_is_plain_sdpa(monkeypatch):
    called = []
    monkeypatch.setattr(attention, "sdpa_attention_forward",
                        lambda *a, **k: called.append(1) or ("sdpa", None))
    q = torch.zeros(1, 4, 6, 8)
    kv = torch.zeros(1, 2, 6, 8)

    class Module:
        is_causal = True

    one = torch.arange(6)[None]
    assert attention.packed_sdpa(Module(), q, kv, kv, None, position_ids=one)[0] == "sdpa"
    longer = torch.zeros(1, 2, 9, 8)  # a KV cache: keys past the queries
    pos = torch.tensor([[0, 1, 2, 0, 1, 2]])
    assert attention.packed_sdpa(Module(), q, longer, longer, None, position_ids=pos)[0] == "sdpa"
    assert called == [1, 1]
    out, _ = attention.packed_sdpa(Module(), q, kv, kv, None, position_ids=pos)
    assert out.shape == (1, 6, 4, 8)
