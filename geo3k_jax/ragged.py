"""Decode attention that reads each slot's own keys: a page table, and attention over its pages.

A decode step attends one new token per slot. Attention bounded by the longest row
(`geo3k_jax.decode.extend`'s `bound`, as the prefill uses it) would read every slot up to the
longest live one; with slots refilled as rows finish, one long row makes every slot pay its
length. Here the cache's positions are cut into pages of `PAGE` tokens
and the step reads only the pages a live slot holds, so its cost follows the live tokens:

    table = page_table(lengths, live, reach, capacity, shards)   # host: (shards, N) page ids
    out = paged_attention(q, keys, values, table[k], at, scale)    # one shard's slots

A page id is `local slot x pages per slot + page`; -1 pads a shard's list to N, a bucket shared
by the shards (a compile per bucket). The cache keeps its layout ((S, L, Hkv, D) keys and
values: a slot's pages are its rows' consecutive positions), so the prefill and the insert are
unchanged. Each page's scores are reduced on their own (max, sum, weighted values) and the pages
of a slot combined by their maxima, the way a paged attention kernel does, in fp32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from geo3k_jax.buckets import bucket
from geo3k_jax.layers import wide_dtype

PAGE = 32  # cache positions a page
TABLE_UNIT = 8  # a table's pages per shard come in buckets of this (2 sizes an octave: each
# is a compile of the decode call, a minute or more at a real model's size)


def page_table(lengths: np.ndarray, live: np.ndarray, reach: int, capacity: int,
               shards: int = 1) -> np.ndarray:
    """The pages a decode call reads, per shard of the slots. lengths (S,): tokens each slot
    holds; live (S,) bool: slots that decode; reach: tokens a slot may add in the call (it
    attends to positions < lengths + reach); capacity: positions a slot holds (a multiple of
    PAGE); shards: the slots split in this many consecutive groups (the mesh's data-parallel
    size). Returns (shards, N) int32: shard k's page ids (local slot x capacity / PAGE + page),
    -1 padded; N >= 1 is bucketed."""
    lengths, live = np.asarray(lengths), np.asarray(live, bool)
    if capacity % PAGE or len(lengths) % shards:
        raise ValueError(f"capacity {capacity} must be a multiple of {PAGE} and the "
                         f"{len(lengths)} slots a multiple of the {shards} shards")
    per_slot, local = capacity // PAGE, len(lengths) // shards
    ends = np.minimum(capacity, lengths + reach)
    counts = np.where(live, -(-ends // PAGE), 0)
    ids = [np.concatenate([(s % local) * per_slot + np.arange(counts[s])
                           for s in range(k * local, (k + 1) * local)] or [np.zeros(0, int)])
           for k in range(shards)]
    n = bucket(max(1, max(map(len, ids))), TABLE_UNIT)
    table = np.full((shards, n), -1, np.int32)
    for k, row in enumerate(ids):
        table[k, :len(row)] = row
    return table


def paged_attention(q: jax.Array, keys: jax.Array, values: jax.Array, table: jax.Array,
                    at: jax.Array, scale: float) -> jax.Array:
    """One new token per slot over the pages of `table`. q: (S, H, D); keys and values
    (S, L, Hkv, D) (H a multiple of Hkv: head i reads KV head i // (H / Hkv)); table (N,) page
    ids (`page_table`'s row, -1 none); at (S,): slot s's new token sits at position at[s] and
    attends to positions <= at[s]. A slot with no page gets zeros. Returns (S, H * D)."""
    s, cap, g, d = keys.shape
    h = q.shape[1]
    per_slot = cap // PAGE
    wide = wide_dtype(q.dtype)
    valid = table >= 0
    page = jnp.maximum(table, 0)
    slot, first = page // per_slot, (page % per_slot) * PAGE  # (N,)
    kp = keys.reshape(s * per_slot, PAGE, g, d)[page]  # (N, PAGE, Hkv, D)
    vp = values.reshape(s * per_slot, PAGE, g, d)[page]
    qp = q[slot].reshape(-1, g, h // g, d)  # (N, Hkv, H / Hkv, D)
    scores = jnp.einsum("ngrd,npgd->ngrp", qp, kp, preferred_element_type=wide) * scale
    seen = valid[:, None] & (first[:, None] + jnp.arange(PAGE) <= at[slot][:, None])
    scores = jnp.where(seen[:, None, None, :], scores, -jnp.inf)
    top = jnp.max(scores, axis=-1)  # (N, Hkv, H / Hkv); -inf: a page with nothing seen
    top = jnp.where(jnp.isfinite(top), top, jnp.finfo(wide).min)
    weights = jnp.exp(scores - top[..., None])  # 0 where not seen
    total = weights.sum(axis=-1)
    out = jnp.einsum("ngrp,npgd->ngrd", weights.astype(values.dtype), vp,
                     preferred_element_type=wide)
    segment = jnp.where(valid, slot, s)  # padding: a segment of its own, dropped
    best = jax.ops.segment_max(top, segment, num_segments=s + 1)
    rescale = jnp.where(valid[:, None, None], jnp.exp(top - best[segment]), 0.0)
    norm = jax.ops.segment_sum(total * rescale, segment, num_segments=s + 1)[:s]
    acc = jax.ops.segment_sum(out * rescale[..., None], segment, num_segments=s + 1)[:s]
    acc = acc / jnp.where(norm > 0, norm, 1.0)[..., None]
    return acc.reshape(s, h * d).astype(q.dtype)
