"""Decode attention over each slot's own pages (`geo3k_jax.ragged`): the page table, and the
attention checked against the bounded attention the prefill uses and against the reference of
JAX's own ragged paged attention kernel for TPU."""

import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel import (
    ref_ragged_paged_attention)

from geo3k_jax.decode import cached_attention
from geo3k_jax.ragged import PAGE, TABLE_UNIT, page_table, paged_attention

SLOTS, CAP, HKV, H, D = 6, 4 * PAGE, 2, 4, 8


def _case(seed=0):
    """q (S, H, D), keys and values (S, L, Hkv, D) of noise (garbage past every length: read,
    it would change the output), the new tokens' positions (-> CAP: not live)."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(SLOTS, H, D)).astype(np.float32)
    keys = rng.normal(size=(SLOTS, CAP, HKV, D)).astype(np.float32) * 3
    values = rng.normal(size=(SLOTS, CAP, HKV, D)).astype(np.float32)
    at = np.array([0, PAGE - 1, PAGE, 3 * PAGE + 5, CAP, 17], np.int32)  # slot 4 not live
    return q, keys, values, at


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


def test_paged_attention_equals_attention_over_the_whole_cache():
    """Each live slot's output equals the bounded attention's over the whole cache with its
    own causal mask, whatever lies past its length; padding pages and a table reaching past
    the new token change nothing; a slot without pages gets zeros."""
    q, keys, values, at = _case()
    live = at < CAP
    table = page_table(np.minimum(at, CAP - 1), live, reach=40, capacity=CAP)
    padded = np.concatenate([table, -np.ones((1, 5), np.int32)], axis=1)
    scale = D ** -0.5
    mask = (np.arange(CAP)[None, None, :] <= at[:, None, None])  # (S, 1, L)
    want = np.asarray(cached_attention(q[:, None], keys, values, mask, scale))[:, 0]
    for t in (table, padded):
        got = np.asarray(paged_attention(q, keys, values, t[0], at, scale))
        np.testing.assert_allclose(got[live], want[live], rtol=0, atol=2e-6)
        assert (got[~live] == 0).all()


def test_paged_attention_equals_jax_ragged_paged_attention_reference():
    """The same numbers as `ref_ragged_paged_attention` (JAX's reference for its TPU kernel),
    given the cache as that kernel's pages (keys and values interleaved by head) and each
    slot's pages in order: a decode step is a sequence of one query over at + 1 keys."""
    q, keys, values, at = _case(1)
    live = at < CAP
    per_slot = CAP // PAGE
    combined = np.stack([keys, values], axis=3).reshape(SLOTS, CAP, 2 * HKV, D)
    pages = combined.reshape(SLOTS * per_slot, PAGE, 2 * HKV, D)
    n = int(live.sum())
    page_indices = (np.flatnonzero(live)[:, None] * per_slot
                    + np.arange(per_slot)[None, :]).astype(np.int32)
    ref = ref_ragged_paged_attention(
        jnp.asarray(q[live]), jnp.asarray(pages), jnp.asarray(at[live] + 1),
        jnp.asarray(page_indices), jnp.arange(n + 1, dtype=jnp.int32),
        jnp.array([n], jnp.int32), sm_scale=D ** -0.5)
    table = page_table(at, live, reach=1, capacity=CAP)
    got = paged_attention(q, keys, values, table[0], at, D ** -0.5)
    np.testing.assert_allclose(np.asarray(got)[live], np.asarray(ref).reshape(n, H * D),
                               rtol=0, atol=2e-6)
