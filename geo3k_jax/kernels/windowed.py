"""Windowed attention over packed rows: each block of queries reads two windows of keys.

`geo3k_jax.core.batch.attention_windows` chooses, for every block of `block` queries of a row, a
prefix window (the shared prompt its samples continue, Wp keys) and an own window (its own
segments, W keys), so that a row costs T x (Wp + W) scores instead of T x T; `window_mask`
says which keys of the two windows each query sees.

`windowed_attention` is a loop over the query blocks (of all rows at once) with a hand-written
backward pass, in the manner of flash attention: a block runs with only the windows it reads
(`block_classes`: none for padding, the prefix window alone for a prompt's blocks); the
forward keeps only the output and each query's log-sum-exp, the backward recomputes one
block's probabilities at a time and adds its key and value gradients into place. Left to
autodiff, the same computation stores every block's (Wp + W)-wide probabilities and walks them
several times more in memory; this way a block's scores are used while they are at hand.

Scores, exponentials and the log-sum-exp are in (at least) fp32; masked scores are -inf, so
that their exponentials are 0 without a second mask. The forward multiplies V by the
unnormalized exponentials (cast to v's dtype) and divides the D-wide output by their sum, one
pass fewer over the (Wp + W)-wide block than normalizing first. A query that sees no key
(padding) gets a zero output and passes no gradient.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from geo3k_jax.core.batch import NO_PREFIX
from geo3k_jax.core.dtypes import wide_dtype

WINDOW_AXES = {"attn_starts": 0, "prefix_starts": 0, "window_prefix": 0, "key_offsets": None,
               "prefix_offsets": None}  # a batch's window arrays: per row, or shared


def window_mask(segments: jax.Array, windows: dict, prefix: jax.Array | None = None
                ) -> jax.Array:
    """Mask of each query block against its keys, the prefix window's then the own window's
    (`geo3k_jax.core.batch.attention_windows`): causal inside a segment, and every key of the
    query's shared prefix segment (`common.batching`), each key admitted once: the keys of
    the block's window_prefix segment only from the prefix window. Padding (segment -1) sees
    nothing (a block of it runs with no keys, `block_classes`).

    segments: (T,) with T = nb * block; windows: attn_starts, prefix_starts, window_prefix
    (nb,), key_offsets (W,), prefix_offsets (Wp,); prefix: (T,) the prefix segment of each
    query's segment, NO_PREFIX (None: everywhere) for none. Returns (nb, block, Wp + W) bool."""
    nb = windows["attn_starts"].shape[0]
    block = segments.shape[0] // nb
    queries = jnp.arange(segments.shape[0]).reshape(nb, block)[:, :, None]
    q_seg = segments.reshape(nb, block)[:, :, None]
    q_pre = (jnp.full_like(q_seg, NO_PREFIX) if prefix is None
             else prefix.reshape(nb, block)[:, :, None])
    shared = windows["window_prefix"][:, None, None]  # (nb, 1, 1)

    def keys_of(starts, offsets):  # (nb, 1, W) positions and segments
        keys = (starts[:, None] + offsets[None, :])[:, None, :]
        return keys, segments[keys]

    keys, k_seg = keys_of(windows["attn_starts"], windows["key_offsets"])
    own = (((q_seg == k_seg) & (queries >= keys)) | (q_pre == k_seg)) & (k_seg != shared)
    keys, k_seg = keys_of(windows["prefix_starts"], windows["prefix_offsets"])
    pre = (k_seg == shared) & ((q_pre == shared) | ((q_seg == shared) & (queries >= keys)))
    return jnp.concatenate([pre, own], axis=-1) & (q_seg >= 0)


def window_classes(prefix_window: int, window: int) -> tuple[tuple[int, int], ...]:
    """The (prefix keys, own keys) a query block can run with, cheapest first: none (a block of
    padding), the prefix window alone (a block of a shared prompt, whose keys are all in it),
    both windows (any other block)."""
    pairs = {(0, 0), (prefix_window, 0), (prefix_window, window)}
    return tuple(sorted(pairs, key=lambda pair: (sum(pair), pair)))


def block_classes(mask: jax.Array, prefix_window: int, classes) -> jax.Array:
    """(nb,) int32: for each query block, the first of `classes` (`window_classes`) holding
    every key the block reads, in any row: of each window, up to its last key that some query
    sees. mask: (B, nb, block, Wp + W) as `window_mask` gives it per row."""
    seen = mask.any(axis=(0, 2))  # (nb, Wp + W)
    upto = jnp.arange(1, seen.shape[1] + 1)
    prefix_need = jnp.max(jnp.where(seen[:, :prefix_window], upto[:prefix_window], 0), axis=1,
                          initial=0)
    own_need = jnp.max(jnp.where(seen[:, prefix_window:], upto[:seen.shape[1] - prefix_window],
                                 0), axis=1, initial=0)
    sizes = np.asarray(classes, np.int32)  # (C, 2)
    holds = ((sizes[None, :, 0] >= prefix_need[:, None])
             & (sizes[None, :, 1] >= own_need[:, None]))  # the whole windows always do
    return jnp.argmax(holds, axis=1).astype(jnp.int32)


def windowed_attention(q: jax.Array, k: jax.Array, v: jax.Array, windows: dict,
                       mask: jax.Array, scale: float) -> jax.Array:
    """Attention of each block of queries to its two windows of keys, over a batch of rows.

    q: (B, T, H, D); k, v: (B, T, Hkv, D) with H a multiple of Hkv (query head i uses key head
    i // (H / Hkv)); windows: as `window_mask`'s with a leading row axis on the per-block
    arrays, mask: (B, nb, block, Wp + W) (`window_mask` of each row). Returns (B, T, H * D).

    Query block i of every row runs with class `block_classes(mask)[i]` (`lax.switch`: only
    that branch runs): a prompt's blocks skip the own window, padding blocks everything. The
    rows of a batch share a block's class, so that the switch runs once per block, not once
    per row (under `jax.vmap` it would run every branch)."""
    b, t, h, d = q.shape
    hkv = k.shape[2]
    _, nb, block, _ = mask.shape
    sizes = (block, windows["prefix_offsets"].shape[0], windows["key_offsets"].shape[0])
    # head-major layouts: a block's queries of one key head are one (R * block, D) matrix
    qh = q.reshape(b, nb, block, hkv, h // hkv, d).transpose(0, 3, 1, 4, 2, 5)
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # (B, G, T, D)
    out = _attend(sizes, float(scale), qh, kh, vh, windows["prefix_starts"],
                  windows["attn_starts"], mask)  # (B, G, nb, R, blk, D)
    return out.transpose(0, 2, 4, 1, 3, 5).reshape(b, t, h * d)


def _window(x: jax.Array, prefix_start, start, wp: int, w: int) -> jax.Array:
    """One row's (G, T, D) -> the block's (G, wp + w, D) window keys (or values): the first
    wp of the prefix window's, then the first w of the own window's."""
    parts = [jax.lax.dynamic_slice_in_dim(x, at, n, axis=1)
             for at, n in ((prefix_start, wp), (start, w)) if n]
    return jnp.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]


def _cut(m: jax.Array, full_wp: int, wp: int, w: int) -> jax.Array:
    """A block's mask (..., Wp + W) cut to a class's windows (..., wp + w)."""
    return jnp.concatenate([m[..., :wp], m[..., full_wp:full_wp + w]], axis=-1)


def _blocks(i, *arrays):
    """Block i of each (B, G, nb, ...) array: (B, G, ...)."""
    return [jax.lax.dynamic_index_in_dim(a, i, axis=2, keepdims=False) for a in arrays]


def _rows(fn, *args):
    """fn over the leading (row) axis of every argument: vmapped, or called on the one row."""
    if args[0].shape[0] == 1:
        return jax.tree.map(lambda a: a[None], fn(*(a[0] for a in args)))
    return jax.vmap(fn)(*args)


def _forward(sizes, scale, qh, kh, vh, prefix_starts, starts, mask):
    """(out (B, G, nb, R, blk, D), lse (B, G, nb, R, blk)), one block at a time."""
    _, full_wp, full_w = sizes
    classes = window_classes(full_wp, full_w)
    wide = wide_dtype(qh.dtype)

    def branch(wp, w):
        def row(qb, k_row, v_row, prefix_start, start, m):  # one row's block
            s = jnp.einsum("grtd,gsd->grts", qb, _window(k_row, prefix_start, start, wp, w),
                           preferred_element_type=wide)
            s = jnp.where(_cut(m, full_wp, wp, w)[None, None], s * scale, -jnp.inf)
            top = jnp.max(s, axis=-1, keepdims=True)
            top = jnp.where(top > -jnp.inf, top, 0.0)  # a query that sees nothing: all e are 0
            e = jnp.exp(s - top)
            total = jnp.sum(e, axis=-1, keepdims=True)
            seen = total > 0
            vb = _window(v_row, prefix_start, start, wp, w)
            pv = jnp.einsum("grts,gsd->grtd", e.astype(v_row.dtype), vb)  # (G, R, blk, D)
            out = pv.astype(e.dtype) / jnp.where(seen, total, 1.0)
            lse = jnp.where(seen, top + jnp.log(jnp.where(seen, total, 1.0)), 0.0)[..., 0]
            return out.astype(v_row.dtype), lse

        def run(qb, prefix_start, start, m):
            if wp + w == 0:  # a block of padding
                return jnp.zeros(qb.shape, vh.dtype), jnp.zeros(qb.shape[:-1], wide)
            return _rows(row, qb, kh, vh, prefix_start, start, m)
        return run

    def one(args):
        i, cls, prefix_start, start, m = args
        qb, = _blocks(i, qh)
        return jax.lax.switch(cls, [branch(*c) for c in classes], qb, prefix_start, start, m)

    nb = mask.shape[1]
    out, lse = jax.lax.map(one, (jnp.arange(nb), block_classes(mask, full_wp, classes),
                                 prefix_starts.T, starts.T, jnp.moveaxis(mask, 1, 0)))
    return jnp.moveaxis(out, 0, 2), jnp.moveaxis(lse, 0, 2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attend(sizes, scale, qh, kh, vh, prefix_starts, starts, mask):
    return _forward(sizes, scale, qh, kh, vh, prefix_starts, starts, mask)[0]


def _attend_fwd(sizes, scale, qh, kh, vh, prefix_starts, starts, mask):
    out, lse = _forward(sizes, scale, qh, kh, vh, prefix_starts, starts, mask)
    return out, (qh, kh, vh, prefix_starts, starts, mask, out, lse)


def _attend_bwd(sizes, scale, res, d_out):
    """Per block, with scores transposed (keys first: the products take their operands as
    stored, but for dQ's, which transposes the small K): dV += P^T dO, dS = P * (dO V^T -
    rowsum(dO * O)), dQ = dS K, dK += dS^T Q (times the scale), in the block's class; its key
    and value gradients, zero-padded to the whole windows, added into place in the wide
    dtype (a branch that wrote into the running sums would copy them)."""
    qh, kh, vh, prefix_starts, starts, mask, out, lse = res
    _, full_wp, full_w = sizes
    classes = window_classes(full_wp, full_w)
    wide = wide_dtype(qh.dtype)
    delta = jnp.sum(d_out.astype(wide) * out.astype(wide), axis=-1)  # (B, G, nb, R, blk)

    def whole(grad, wp, w):  # (G, wp + w, D) -> (G, Wp + W, D), zeros past the class's
        return jnp.pad(jnp.concatenate([jnp.pad(grad[:, :wp], ((0, 0), (0, full_wp - wp), (0, 0))),
                                        grad[:, wp:]], axis=1),
                       ((0, 0), (0, full_w - w), (0, 0)))

    def branch(wp, w):
        def row(qb, do, lse_b, delta_b, k_row, v_row, prefix_start, start, m):
            kb = _window(k_row, prefix_start, start, wp, w)
            vb = _window(v_row, prefix_start, start, wp, w)
            s_t = jnp.einsum("gsd,grtd->gsrt", kb, qb, preferred_element_type=wide)
            s_t = jnp.where(_cut(m, full_wp, wp, w).T[None, :, None], s_t * scale, -jnp.inf)
            p_t = jnp.exp(s_t - lse_b[:, None])  # (G, S, R, blk); masked keys: 0
            dv_b = jnp.einsum("gsrt,grtd->gsd", p_t.astype(v_row.dtype), do,
                              preferred_element_type=wide)
            dp_t = jnp.einsum("gsd,grtd->gsrt", vb, do, preferred_element_type=wide)
            ds_t = (p_t * (dp_t - delta_b[:, None]) * scale).astype(qb.dtype)
            dk_b = jnp.einsum("gsrt,grtd->gsd", ds_t, qb, preferred_element_type=wide)
            # dQ^T = K^T dS^T: the small K is transposed, not the (S, R * blk) dS (the barrier
            # keeps XLA from folding the transposes back into dS^T^T K); in q's dtype, which
            # each block's dQ is final in (XLA:CPU has no bf16 x bf16 -> f32 product here)
            dq_t = jax.lax.optimization_barrier(jnp.einsum(
                "gds,gsrt->gdrt", jnp.swapaxes(kb, 1, 2), ds_t))
            return whole(dk_b, wp, w), whole(dv_b, wp, w), jnp.moveaxis(dq_t, 1, 3)

        def run(qb, do, lse_b, delta_b, prefix_start, start, m):
            if wp + w == 0:
                grad = jnp.zeros(kh.shape[:2] + (full_wp + full_w,) + kh.shape[3:], wide)
                return grad, grad, jnp.zeros(qb.shape, qb.dtype)
            return _rows(row, qb, do, lse_b, delta_b, kh, vh, prefix_start, start, m)
        return run

    def add(acc, grad, prefix_start, start):  # one row's (G, T, D) += its (G, Wp + W, D)
        for lo, hi, at in ((0, full_wp, prefix_start), (full_wp, grad.shape[1], start)):
            part = jax.lax.dynamic_slice_in_dim(acc, at, hi - lo, axis=1) + grad[:, lo:hi]
            acc = jax.lax.dynamic_update_slice_in_dim(acc, part, at, axis=1)
        return acc

    def one(carry, args):
        dk, dv = carry
        i, cls, prefix_start, start, m = args
        dk_b, dv_b, dq_b = jax.lax.switch(cls, [branch(*c) for c in classes],
                                          *_blocks(i, qh, d_out, lse, delta), prefix_start,
                                          start, m)
        return (_rows(add, dk, dk_b, prefix_start, start),
                _rows(add, dv, dv_b, prefix_start, start)), dq_b

    zeros = jnp.zeros(kh.shape, wide)
    nb = mask.shape[1]
    (dk, dv), dq = jax.lax.scan(one, (zeros, zeros),
                                (jnp.arange(nb), block_classes(mask, full_wp, classes),
                                 prefix_starts.T, starts.T, jnp.moveaxis(mask, 1, 0)))
    dq = jnp.moveaxis(dq, 0, 2).astype(qh.dtype)
    return dq, dk.astype(kh.dtype), dv.astype(vh.dtype), None, None, None


_attend.defvjp(_attend_fwd, _attend_bwd)
