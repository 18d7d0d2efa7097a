"""Packed attention (`geo3k_torch.attention`): a packed row attended sequence by sequence gives
transformers' block-diagonal sdpa result, and really runs per sequence."""

import numpy as np
import pytest
import torch
from torch.nn.attention.bias import causal_lower_right

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
    model.set_attn_implementation("sdpa")  # transformers' own packed mask, from the positions
    with torch.no_grad():
        dense = model(**{k: v for k, v in inputs.items() if k != "attention_mask"},
                      use_cache=False).logits
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


# a prefix [0, 7) with two continuations, a plain sequence, another prefix with one
SEGMENTS = ([7, 4, 3, 4, 2, 3], [-1, 0, 0, -1, -1, 4])


def reference_mask(lengths, parents) -> torch.Tensor:
    """(T, T) bool: a segment sees itself causally and all of its parent, nothing else."""
    bounds = np.cumsum([0] + list(lengths))
    mask = torch.zeros(bounds[-1], bounds[-1], dtype=torch.bool)
    for s, p in enumerate(parents):
        lo, hi = bounds[s], bounds[s + 1]
        mask[lo:hi, lo:hi] = torch.ones(hi - lo, hi - lo, dtype=torch.bool).tril()
        if p >= 0:
            mask[lo:hi, bounds[p]:bounds[p + 1]] = True
    return mask


@pytest.mark.parametrize("segments", [SEGMENTS, ([5, 1, 6], [-1, -1, -1]), ([1, 1], [-1, 0])])
def test_varlen_layout_is_the_reference_mask(segments):
    """The varlen call's index math (no GPU needed): query i of sequence s sees the keys
    kv_index[cu_k[s] : cu_k[s] + (k_len - q_len) + i + 1] (flash's causal rule, aligned at the
    end); over the row that is exactly the mask packed_sdpa attends with."""
    lengths, parents = segments
    cu_q, kv_index, cu_k, max_q, max_k = attention.varlen_layout(lengths, parents)
    T = sum(lengths)
    kv_index = np.arange(T) if kv_index is None else kv_index
    assert cu_q.dtype == cu_k.dtype == np.int32 and cu_q[-1] == T and cu_k[-1] == len(kv_index)
    mask = torch.zeros(T, T, dtype=torch.bool)
    for s in range(len(lengths)):
        q_len, k_len = cu_q[s + 1] - cu_q[s], cu_k[s + 1] - cu_k[s]
        for i in range(q_len):
            mask[cu_q[s] + i, kv_index[cu_k[s]:cu_k[s] + k_len - q_len + i + 1]] = True
    assert torch.equal(mask, reference_mask(lengths, parents))
    assert max_q == max(lengths) and max_k == max(np.diff(cu_k))


def test_varlen_layout_emulated_equals_segments_sdpa():
    """The varlen layout run through per-sequence sdpa with a bottom-right causal mask (what
    the flash kernel computes) gives segments_sdpa's output, GQA included."""
    g = torch.Generator().manual_seed(0)
    lengths, parents = SEGMENTS
    T, H, D = sum(lengths), 4, 8
    q = torch.randn(1, H, T, D, generator=g)
    k, v = (torch.randn(1, H // 2, T, D, generator=g) for _ in range(2))
    cu_q, kv_index, cu_k, _, _ = attention.varlen_layout(lengths, parents)
    idx = torch.from_numpy(kv_index)
    kg, vg = k[:, :, idx], v[:, :, idx]
    parts = []
    for s in range(len(lengths)):
        qs = q[:, :, cu_q[s]:cu_q[s + 1]]
        ks, vs = kg[:, :, cu_k[s]:cu_k[s + 1]], vg[:, :, cu_k[s]:cu_k[s + 1]]
        parts.append(attention.F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=causal_lower_right(qs.shape[2], ks.shape[2]),
            scale=0.3, enable_gqa=True))
    emulated = torch.cat(parts, dim=2).transpose(1, 2)
    ref = attention.segments_sdpa(q, k, v, lengths, parents, scaling=0.3)
    assert torch.allclose(emulated, ref, rtol=0, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or attention.varlen_attn is None,
                    reason="varlen_attn runs on CUDA only")
@pytest.mark.parametrize("gqa", [1, 2])
def test_varlen_equals_segments_sdpa_on_cuda(gqa):
    """The CUDA kernel against the reference, bf16: outputs and the gradients of q, k, v within
    bf16 rounding (both accumulate in fp32; 2e-2 of the largest value), with shared prefixes."""
    g = torch.Generator(device="cuda").manual_seed(0)
    lengths, parents = [300, 128, 77, 513, 64, 200, 31], [-1, 0, 0, -1, -1, 4, 4]
    T, H, D = sum(lengths), 8, 128
    leaves = [torch.randn(1, h, T, D, generator=g, device="cuda", dtype=torch.bfloat16)
              for h in (H, H // gqa, H // gqa)]
    grad_out = torch.randn(1, T, H, D, generator=g, device="cuda", dtype=torch.bfloat16)
    assert attention.uses_varlen(leaves[0])
    results = []
    for fn in (attention.segments_varlen, attention.segments_sdpa):
        q, k, v = (x.clone().requires_grad_() for x in leaves)
        out = (fn(q, k, v, attention.Segments(lengths, parents).layout("cuda"), 0.125)
               if fn is attention.segments_varlen else fn(q, k, v, lengths, parents, 0.125))
        out.backward(grad_out)
        results.append([out.float(), q.grad.float(), k.grad.float(), v.grad.float()])
    for name, a, b in zip(("out", "dq", "dk", "dv"), *results):
        assert (a - b).abs().max() <= 2e-2 * b.abs().max(), name
