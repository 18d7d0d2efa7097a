"""Decode attention over each slot's own pages (`geo3k_jax.kernels.ragged`): the page table, the XLA
path checked against plain attention in float64, and JAX's Pallas paged attention
kernel for TPU (in interpret mode here) against the XLA path, over a layer of the cache in its
one layout (Hkv, layers, S, L, D)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from geo3k_jax.kernels.ragged import (PAGE, TABLE_UNIT, kernel_attention, page_table, pages,
                              paged_attention)

SLOTS, CAP, HKV, H, D, LAYERS = 6, 4 * PAGE, 2, 4, 8, 3


def _case(seed=0, d=D):
    """q (S, H, D), keys and values (Hkv, layers, S, L, D) of noise (garbage past every length
    and in the other layers: read, it would change the output), the new tokens' positions
    (-> CAP: not live)."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(SLOTS, H, d)).astype(np.float32)
    keys = rng.normal(size=(HKV, LAYERS, SLOTS, CAP, d)).astype(np.float32) * 3
    values = rng.normal(size=(HKV, LAYERS, SLOTS, CAP, d)).astype(np.float32)
    at = np.array([0, PAGE - 1, PAGE, 3 * PAGE + 5, CAP, 17], np.int32)  # slot 4 not live
    return q, keys, values, at


def _whole(q, keys, values, layer, at, scale):
    """Plain softmax attention of each slot's query over layer `layer`'s positions <= at[s],
    in float64: the reference."""
    k = np.asarray(keys[:, layer], np.float64)  # (Hkv, S, L, D)
    v = np.asarray(values[:, layer], np.float64)
    s_, h, d = q.shape
    group = h // k.shape[0]
    out = np.zeros((s_, h, d))
    for s in range(s_):
        for i in range(h):
            scores = k[i // group, s] @ np.asarray(q[s, i], np.float64) * scale
            scores[np.arange(CAP) > at[s]] = -np.inf
            if np.isfinite(scores).any():
                w = np.exp(scores - scores.max())
                out[s, i] = w @ v[i // group, s] / w.sum()
    return out.reshape(s_, h * d).astype(np.float32)


def test_page_table_lists_each_live_slots_pages():
    lengths = np.array([0, 31, 32, 100, 7, 200], np.int32)
    live = np.array([True, True, True, True, False, True])
    table = page_table(lengths, live, reach=1, capacity=CAP)
    per_slot = CAP // PAGE
    want = [0, per_slot, 2 * per_slot, 2 * per_slot + 1,  # reach 1: position 32 is page 1
            3 * per_slot + 0, 3 * per_slot + 1, 3 * per_slot + 2, 3 * per_slot + 3,
            5 * per_slot + 0, 5 * per_slot + 1, 5 * per_slot + 2, 5 * per_slot + 3]  # capped
    assert table.shape == (1, 2 * TABLE_UNIT) and table.dtype == np.int32  # 12 pages, bucketed
    assert table[0].tolist() == want + [-1] * (2 * TABLE_UNIT - 12)
    two = page_table(lengths, live, reach=1, capacity=CAP, shards=2)
    assert two.shape == (2, 8)  # 4 and 8 pages, bucketed to a common 8
    assert two[0].tolist() == [0, per_slot, 2 * per_slot, 2 * per_slot + 1, -1, -1, -1, -1]
    assert two[1].tolist() == [0, 1, 2, 3, 2 * per_slot + 0, 2 * per_slot + 1,
                               2 * per_slot + 2, 2 * per_slot + 3]  # local slots 0 and 2
    idle = page_table(lengths, np.zeros(SLOTS, bool), reach=4, capacity=CAP, shards=3)
    assert idle.shape == (3, TABLE_UNIT) and (idle == -1).all()
    with pytest.raises(ValueError, match="multiple"):
        page_table(lengths, live, reach=1, capacity=CAP + 1)
    with pytest.raises(ValueError, match="multiple"):
        page_table(lengths, live, reach=1, capacity=CAP, shards=4)


def test_pages_are_the_cache_itself():
    """Page `(layer x S + slot) x L / PAGE + p` of a KV head is that layer's slot's positions
    p x PAGE ... (p + 1) x PAGE - 1: the kernel's page ids address the cache as it lies."""
    _, keys, _, _ = _case()
    paged = np.asarray(pages(jnp.asarray(keys)))
    per_slot = CAP // PAGE
    assert paged.shape == (HKV, LAYERS * SLOTS * per_slot, PAGE, D)
    layer, slot, p = 2, 3, 1
    np.testing.assert_array_equal(paged[:, (layer * SLOTS + slot) * per_slot + p],
                                  keys[:, layer, slot, p * PAGE:(p + 1) * PAGE])


@pytest.mark.parametrize("layer", [0, 2])
def test_paged_attention_equals_attention_over_the_whole_cache(layer):
    """Each live slot's output equals plain attention over the whole layer with its
    own causal mask, whatever lies past its length or in other layers; padding pages and a
    table reaching past the new token change nothing; a slot without pages gets zeros."""
    q, keys, values, at = _case()
    live = at < CAP
    table = page_table(np.minimum(at, CAP - 1), live, reach=40, capacity=CAP)
    padded = np.concatenate([table, -np.ones((1, 5), np.int32)], axis=1)
    scale = D ** -0.5
    want = _whole(q, keys, values, layer, at, scale)
    for t in (table, padded):
        got = np.asarray(paged_attention(q, keys, values, layer, t[0], at, scale))
        np.testing.assert_allclose(got[live], want[live], rtol=0, atol=2e-6)
        assert (got[~live] == 0).all()


@pytest.mark.slow  # Pallas' TPU interpret mode: seconds a call
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_the_pallas_kernel_equals_the_xla_path(dtype):
    """JAX's Pallas paged attention kernel, in TPU interpret mode, reading layer 1 of the cache
    as its pages: the XLA path's numbers for every live slot (within the kernel's matmul
    precision: the TPU's default rounds fp32 operands to bf16, as the interpreter does), zeros
    for a slot not live; jitted with the layer a traced index, as the decode's scan calls it.
    Head dim 128, the Qwen-VL models'."""
    q, keys, values, at = _case(1, d=128)
    live = at < CAP
    q, keys, values = (jnp.asarray(a, dtype) for a in (q, keys, values))
    scale = 128 ** -0.5
    table = page_table(np.minimum(at, CAP - 1), live, reach=1, capacity=CAP)
    want = np.asarray(paged_attention(q, keys, values, 1, table[0], at, scale), np.float32)
    got = jax.jit(lambda q, k, v, i, a: kernel_attention(q, k, v, i, a, scale, True))(
        q, keys, values, jnp.int32(1), at)
    got = np.asarray(got, np.float32)
    assert got.shape == (SLOTS, H * 128)
    np.testing.assert_allclose(got[live], want[live], rtol=0, atol=3e-2)
    assert np.abs(got[live] - want[live]).mean() < 5e-3
    assert (got[~live] == 0).all()
    other = np.asarray(paged_attention(q, keys, values, 2, table[0], at, scale), np.float32)
    assert np.abs(got[live] - other[live]).max() > 0.1  # another layer's numbers are far


def test_prefix_attention_reads_each_rows_cached_tokens_and_its_new_ones():
    """The prefill's attention (`geo3k_jax.engine.decode.prefix_attention`), block by block with a
    running softmax, equals plain attention in float64 over each row's own cached tokens and
    its new tokens causally: rows with nothing cached, a length on a block boundary and one
    inside a block, garbage past every length and in the other slots, blocks read past the
    longest row (they change nothing), the new tokens' queries whole or in blocks."""
    from geo3k_jax.engine.decode import prefix_attention
    rng = np.random.default_rng(3)
    r, t, block, cap = 3, 6, 4, 16
    q = rng.normal(size=(r, t, H, D)).astype(np.float32)
    k, v = (rng.normal(size=(r, t, HKV, D)).astype(np.float32) for _ in range(2))
    cache_k, cache_v = (rng.normal(size=(HKV, SLOTS, cap, D)).astype(np.float32) * 3
                        for _ in range(2))
    source, lengths = np.array([4, 0, 2]), np.array([0, 8, 11], np.int32)

    def read(j):  # block j of each row's slot: (Hkv, R, block, D)
        return tuple(jax.lax.dynamic_slice_in_dim(jnp.asarray(c[:, source]), j * block,
                                                  block, axis=2) for c in (cache_k, cache_v))

    scale = D ** -0.5
    for blocks, query_block in ((3, 6), (4, 6), (3, 3), (3, 2)):
        got = np.asarray(prefix_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), read,
                                          jnp.asarray(lengths), blocks, scale, query_block))
        group = H // HKV
        for b in range(r):
            for i in range(t):
                for h in range(H):
                    g = h // group
                    keys = np.r_[cache_k[g, source[b], :lengths[b]], k[b, :i + 1, g]]
                    values = np.r_[cache_v[g, source[b], :lengths[b]], v[b, :i + 1, g]]
                    scores = keys.astype(np.float64) @ q[b, i, h] * scale
                    w = np.exp(scores - scores.max())
                    want = w @ values / w.sum()
                    # fp32 against float64: 2e-6, and 1e-6 of the value (outputs up to ~5
                    # differ by 2.3e-6 on an AMD EPYC, whose summation order differs)
                    np.testing.assert_allclose(got[b, i, h * D:(h + 1) * D], want, rtol=1e-6,
                                               atol=2e-6)
