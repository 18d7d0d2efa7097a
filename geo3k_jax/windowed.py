"""Windowed attention over packed rows: each block of queries reads two windows of keys.

`geo3k_jax.batch.attention_windows` chooses, for every block of `block` queries of a row, a
prefix window (the shared prompt its samples continue, Wp keys) and an own window (its own
segments, W keys), so that a row costs T x (Wp + W) scores instead of T x T; `window_mask`
says which keys of the two windows each query sees.

`windowed_attention` is a loop over the query blocks with a hand-written backward pass, in the
manner of flash attention: the forward keeps only the output and each query's log-sum-exp, the
backward recomputes one block's probabilities at a time and adds its key and value gradients
into place. Left to autodiff, the same computation stores every block's (Wp + W)-wide
probabilities and walks them several times more in memory; this way a block's scores stay
in cache (on a CPU-default row of 2,048 tokens, forward 40 -> 10 ms and forward + backward
56-70 -> 30 ms a layer, docs/benchmarks.md).

Scores, exponentials and the log-sum-exp are in (at least) fp32; masked scores are -inf, so
that their exponentials are 0 without a second mask. The forward multiplies V by the
unnormalized exponentials (cast to v's dtype) and divides the D-wide output by their sum, one
pass fewer over the (Wp + W)-wide block than normalizing first (the gradient of a CPU-default
row, both layers: 131-147 -> 127-132 ms, docs/benchmarks.md). A query that sees no key
(padding) gets a zero output and passes no gradient.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from geo3k_jax.layers import wide_dtype

WINDOW_AXES = {"attn_starts": 0, "prefix_starts": 0, "window_prefix": 0, "key_offsets": None,
               "prefix_offsets": None}  # a batch's window arrays: per row, or shared
NO_PREFIX = -2  # `prefix` of a segment that continues none (never a segment id, nor padding's)


def window_mask(segments: jax.Array, windows: dict, prefix: jax.Array | None = None
                ) -> jax.Array:
    """Mask of each query block against its keys, the prefix window's then the own window's
    (`geo3k_jax.batch.attention_windows`): causal inside a segment, and every key of the
    query's shared prefix segment (`common.batching`), each key admitted once: the keys of
    the block's window_prefix segment only from the prefix window.

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
    return jnp.concatenate([pre, own], axis=-1)


def windowed_attention(q: jax.Array, k: jax.Array, v: jax.Array, windows: dict,
                       mask: jax.Array, scale: float) -> jax.Array:
    """Attention of each block of queries to its two windows of keys.

    q: (T, H, D); k, v: (T, Hkv, D) with H a multiple of Hkv (query head i uses key head
    i // (H / Hkv)); windows: as `window_mask`'s, which gives mask (nb, block, Wp + W).
    Returns (T, H * D)."""
    t, h, d = q.shape
    hkv = k.shape[1]
    nb, block, _ = mask.shape
    sizes = (block, windows["prefix_offsets"].shape[0], windows["key_offsets"].shape[0])
    # head-major layouts: a block's queries of one key head are one (R * block, D) matrix
    qh = q.reshape(nb, block, hkv, h // hkv, d).transpose(2, 0, 3, 1, 4)  # (G, nb, R, blk, D)
    kh, vh = k.transpose(1, 0, 2), v.transpose(1, 0, 2)  # (G, T, D)
    out = _attend(sizes, float(scale), qh, kh, vh, windows["prefix_starts"],
                  windows["attn_starts"], mask)  # (G, nb, R, blk, D)
    return out.transpose(1, 3, 0, 2, 4).reshape(t, h * d)


def _keys(x: jax.Array, prefix_start, start, sizes) -> jax.Array:
    """(G, T, D) -> the block's (G, Wp + W, D) window keys (or values)."""
    _, wp, w = sizes
    return jnp.concatenate([jax.lax.dynamic_slice_in_dim(x, prefix_start, wp, axis=1),
                            jax.lax.dynamic_slice_in_dim(x, start, w, axis=1)], axis=1)


def _scores(qb, kb, m, scale):
    """Scaled scores (G, R, blk, Wp + W) of a block in the wide dtype, -inf where masked."""
    s = jnp.einsum("grtd,gsd->grts", qb, kb, preferred_element_type=wide_dtype(qb.dtype))
    return jnp.where(m[None, None], s * scale, -jnp.inf)


def _forward(sizes, scale, qh, kh, vh, prefix_starts, starts, mask):
    """(out (G, nb, R, blk, D), lse (G, nb, R, blk)), one block at a time."""
    def one(args):
        i, prefix_start, start, m = args
        qb = jax.lax.dynamic_index_in_dim(qh, i, axis=1, keepdims=False)  # (G, R, blk, D)
        s = _scores(qb, _keys(kh, prefix_start, start, sizes), m, scale)
        top = jnp.max(s, axis=-1, keepdims=True)
        top = jnp.where(top > -jnp.inf, top, 0.0)  # a query that sees nothing: all e are 0
        e = jnp.exp(s - top)
        total = jnp.sum(e, axis=-1, keepdims=True)
        seen = total > 0
        vb = _keys(vh, prefix_start, start, sizes)
        pv = jnp.einsum("grts,gsd->grtd", e.astype(vh.dtype), vb)  # (G, R, blk, D)
        out = pv.astype(e.dtype) / jnp.where(seen, total, 1.0)
        lse = jnp.where(seen, top + jnp.log(jnp.where(seen, total, 1.0)), 0.0)[..., 0]
        return out.astype(vh.dtype), lse

    out, lse = jax.lax.map(one, (jnp.arange(mask.shape[0]), prefix_starts, starts, mask))
    return jnp.moveaxis(out, 0, 1), jnp.moveaxis(lse, 0, 1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attend(sizes, scale, qh, kh, vh, prefix_starts, starts, mask):
    return _forward(sizes, scale, qh, kh, vh, prefix_starts, starts, mask)[0]


def _attend_fwd(sizes, scale, qh, kh, vh, prefix_starts, starts, mask):
    out, lse = _forward(sizes, scale, qh, kh, vh, prefix_starts, starts, mask)
    return out, (qh, kh, vh, prefix_starts, starts, mask, out, lse)


def _attend_bwd(sizes, scale, res, d_out):
    """Per block, with scores transposed (keys first: the products take their operands as
    stored, but for dQ's, which transposes the small K): dV += P^T dO, dS = P * (dO V^T - rowsum(dO * O)), dQ = dS K,
    dK += dS^T Q (times the scale), key and value gradients added into place, in the wide
    dtype."""
    qh, kh, vh, prefix_starts, starts, mask, out, lse = res
    _, wp, _ = sizes
    wide = wide_dtype(qh.dtype)
    delta = jnp.sum(d_out.astype(wide) * out.astype(wide), axis=-1)  # (G, nb, R, blk)

    def add(acc, grad, prefix_start, start):
        for lo, hi, at in ((0, wp, prefix_start), (wp, grad.shape[1], start)):
            part = jax.lax.dynamic_slice_in_dim(acc, at, hi - lo, axis=1) + grad[:, lo:hi]
            acc = jax.lax.dynamic_update_slice_in_dim(acc, part, at, axis=1)
        return acc

    def one(carry, args):
        dk, dv = carry
        i, prefix_start, start, m = args
        take = lambda a: jax.lax.dynamic_index_in_dim(a, i, axis=1, keepdims=False)  # noqa
        qb, do, lse_b, delta_b = take(qh), take(d_out), take(lse), take(delta)
        kb, vb = _keys(kh, prefix_start, start, sizes), _keys(vh, prefix_start, start, sizes)
        s_t = jnp.einsum("gsd,grtd->gsrt", kb, qb, preferred_element_type=wide)
        s_t = jnp.where(m.T[None, :, None], s_t * scale, -jnp.inf)  # (G, S, R, blk)
        p_t = jnp.exp(s_t - lse_b[:, None])  # masked keys: 0
        dv_b = jnp.einsum("gsrt,grtd->gsd", p_t.astype(vh.dtype), do,
                          preferred_element_type=wide)
        dp_t = jnp.einsum("gsd,grtd->gsrt", vb, do, preferred_element_type=wide)
        ds_t = (p_t * (dp_t - delta_b[:, None]) * scale).astype(qh.dtype)
        dk_b = jnp.einsum("gsrt,grtd->gsd", ds_t, qb, preferred_element_type=wide)
        # dQ^T = K^T dS^T: the small K is transposed, not the (S, R * blk) dS (the barrier
        # keeps XLA from folding the transposes back into dS^T^T K); in q's dtype, which
        # each block's dQ is final in (XLA:CPU has no bf16 x bf16 -> f32 product here)
        dq_t = jax.lax.optimization_barrier(jnp.einsum(
            "gds,gsrt->gdrt", jnp.swapaxes(kb, 1, 2), ds_t))
        dq_b = jnp.moveaxis(dq_t, 1, 3)
        return (add(dk, dk_b, prefix_start, start), add(dv, dv_b, prefix_start, start)), dq_b

    zeros = jnp.zeros(kh.shape, wide)
    (dk, dv), dq = jax.lax.scan(one, (zeros, zeros),
                                (jnp.arange(mask.shape[0]), prefix_starts, starts, mask))
    dq = jnp.moveaxis(dq, 0, 1).astype(qh.dtype)
    return dq, dk.astype(kh.dtype), dv.astype(vh.dtype), None, None, None


_attend.defvjp(_attend_fwd, _attend_bwd)
