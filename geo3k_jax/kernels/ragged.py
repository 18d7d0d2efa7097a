"""Decode attention that reads each slot's own keys: on TPU the Pallas paged attention kernel,
elsewhere a page table and attention over its pages in XLA.

A decode step attends one new token per slot. Attention bounded by the longest row (as the
prefill reads the cache, `geo3k_jax.engine.decode.prefill`) would read every slot up to the longest
live one; with slots refilled as rows finish, one long row makes every slot pay its
length. Here the cache's positions are cut into pages of `PAGE` tokens and a step reads only
the pages a live slot holds, so its cost follows the live tokens. The cache
(`geo3k_jax.engine.kv_budget`: keys and values each (Hkv, layers, S, L, D)) is already the kernel's
page array: (Hkv, layers x S x L / PAGE, PAGE, D), page id `(layer x S + slot) x L / PAGE +
page`, so layer `layer` is an offset into the page ids, never a copy.

    out = kernel_attention(q, keys, values, layer, at, scale)      # TPU (interpret elsewhere)
    table = page_table(lengths, live, reach, capacity, shards)     # XLA: host, (shards, N) ids
    out = paged_attention(q, keys, values, layer, table[k], at, scale)   # one shard's slots

The kernel is JAX's `jax.experimental.pallas.ops.tpu.paged_attention` (one query per
sequence, the decode's shape): it walks each slot's pages up to its length in blocks of
`KERNEL_BLOCK` pages and skips slots of length 0. (JAX's ragged paged attention kernel, which
also takes prefills, wants keys and values interleaved by head; unmodified, it compiles for v5p
and v6e at the project's shapes, but fails both of JAX 0.10's interpreters on a CPU, on an
in-place reshape of a buffer ref and an interpreter bounds bug: docs/tpu_engine.md,
scripts/ragged_kernel_check.py.) The XLA path's page ids are `local slot x
L / PAGE + page`; -1 pads a shard's list to N, a bucket shared by the shards (a compile per
bucket); each page's scores are reduced on their own (max, sum, weighted values) and the pages
of a slot combined by their maxima, the way the kernel does, in fp32.
"""

from __future__ import annotations

import contextlib
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as pallas_paged

from geo3k_jax.core.buckets import bucket
from geo3k_jax.core.dtypes import wide_dtype

PAGE = 32  # cache positions a page
KERNEL_BLOCK = 8  # pages the kernel reads in one block (fewer when a slot's pages are fewer)
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


def pages(cache: jax.Array) -> jax.Array:
    """The cache's keys or values (Hkv, layers, S, L, D) as pages (Hkv, layers x S x L / PAGE,
    PAGE, D): the same memory."""
    g, layers, s, cap, d = cache.shape
    return cache.reshape(g, layers * s * cap // PAGE, PAGE, d)


def kernel_attention(q: jax.Array, keys: jax.Array, values: jax.Array, layer: jax.Array,
                     at: jax.Array, scale: float, interpret: bool = False) -> jax.Array:
    """One new token per slot through the Pallas paged attention kernel. q: (S, H, D); keys and
    values (Hkv, layers, S, L, D), the whole cache (H a multiple of Hkv: head i reads KV head
    i // (H / Hkv)); layer: () int, the layer read; at (S,): slot s's new token sits at position
    at[s] and attends to positions <= at[s] (at >= L: not live, zeros). interpret: Pallas' TPU
    interpret mode (not on TPU: tests). Returns (S, H * D)."""
    g, layers, s, cap, d = keys.shape
    per_slot = cap // PAGE
    block = math.gcd(per_slot, KERNEL_BLOCK)
    ids = (layer * s * per_slot
           + jnp.arange(s * per_slot, dtype=jnp.int32).reshape(s, per_slot))
    lengths = jnp.where(at < cap, at + 1, 0).astype(jnp.int32)
    q = (q.astype(wide_dtype(q.dtype)) * scale).astype(q.dtype)  # the kernel does not scale
    mode = pltpu.force_tpu_interpret_mode() if interpret else contextlib.nullcontext()
    with mode:
        out = pallas_paged(q, pages(keys), pages(values), lengths, ids,
                           pages_per_compute_block=block)
    return out.reshape(s, -1).astype(q.dtype)


def paged_attention(q: jax.Array, keys: jax.Array, values: jax.Array, layer: jax.Array,
                    table: jax.Array, at: jax.Array, scale: float) -> jax.Array:
    """`kernel_attention` in XLA over the pages of `table`. q: (S, H, D); keys and values
    (Hkv, layers, S, L, D); layer: () int; table (N,) page ids of the layer (`page_table`'s row,
    -1 none); at (S,): slot s's new token sits at position at[s] and attends to positions
    <= at[s]. A slot with no page gets zeros. Returns (S, H * D)."""
    g, _, s, cap, d = keys.shape
    h = q.shape[1]
    per_slot = cap // PAGE
    wide = wide_dtype(q.dtype)
    valid = table >= 0
    page = jnp.maximum(table, 0)
    slot, first = page // per_slot, (page % per_slot) * PAGE  # (N,)
    kp = pages(keys)[:, layer * s * per_slot + page]  # (Hkv, N, PAGE, D)
    vp = pages(values)[:, layer * s * per_slot + page]
    qp = q[slot].reshape(-1, g, h // g, d)  # (N, Hkv, H / Hkv, D)
    scores = jnp.einsum("ngrd,gnpd->ngrp", qp, kp, preferred_element_type=wide) * scale
    seen = valid[:, None] & (first[:, None] + jnp.arange(PAGE) <= at[slot][:, None])
    scores = jnp.where(seen[:, None, None, :], scores, -jnp.inf)
    top = jnp.max(scores, axis=-1)  # (N, Hkv, H / Hkv); -inf: a page with nothing seen
    top = jnp.where(jnp.isfinite(top), top, jnp.finfo(wide).min)
    weights = jnp.exp(scores - top[..., None])  # 0 where not seen
    total = weights.sum(axis=-1)
    out = jnp.einsum("ngrp,gnpd->ngrd", weights.astype(values.dtype), vp,
                     preferred_element_type=wide)
    segment = jnp.where(valid, slot, s)  # padding: a segment of its own, dropped
    best = jax.ops.segment_max(top, segment, num_segments=s + 1)
    rescale = jnp.where(valid[:, None, None], jnp.exp(top - best[segment]), 0.0)
    norm = jax.ops.segment_sum(total * rescale, segment, num_segments=s + 1)[:s]
    acc = jax.ops.segment_sum(out * rescale[..., None], segment, num_segments=s + 1)[:s]
    acc = acc / jnp.where(norm > 0, norm, 1.0)[..., None]
    return acc.reshape(s, h * d).astype(q.dtype)
