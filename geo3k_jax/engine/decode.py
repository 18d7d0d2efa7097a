"""The Flax Qwen-VL over a fixed-size KV cache: the engine's prefill and its decode step.

Rollouts need what training does not: keys and values kept between forwards. Both functions walk
the same modules as `geo3k_jax.models.model.QwenVL.hidden_states` (same parameters, same vision
tower, same M-RoPE and DeepStack), the layers as one `jax.lax.scan`
(`geo3k_jax.models.text.DecoderStack`):

    prefill   work rows of new tokens (a first turn's prompt with its images, a later turn's
              feedback over the cache of the earlier turns): their keys and values, their last
              token's logits. The cache is read, never written (the engine's insert writes the
              new keys into the slots), a block of `block` positions at a time for as many
              blocks as the longest cached row needs: no program depends on how long a row is.
    decode    one token a slot, written into the cache in place, attention over each slot's
              own pages (`geo3k_jax.kernels.ragged`).

    cache     (keys, values), each (Hkv, layers, S, L, D); slot s holds its sequence's first
              tokens at positions 0.. and garbage after them. A KV head's slots and positions
              are consecutive: the pages of the Pallas paged attention kernel. (Keys stored
              (B, Hkv, D, L) once made the TPU compiler copy every layer's cache in and out of
              the decode loop, docs/tpu_engine.md.)

Logits are the head's products accumulated in fp32, as `geo3k_jax.models.model.token_logprobs` does.
With `record` (routing replay, a mixture-of-experts model) both also return the experts every
fed token was routed to in each sparse layer, the routers' top k (`geo3k_jax.models.moe`).
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp

from geo3k_jax.core.dtypes import wide_dtype
from geo3k_jax.models.layers import apply_rotary, scatter_rows
from geo3k_jax.models.model import QwenVL
from geo3k_jax.models.text import deepstack_after


def _qkv(attn, x, cos, sin):
    """One row's rotated q (T, H, D), k and v (T, Hkv, D) from normed x (T, hidden)."""
    t = x.shape[0]
    q = attn.q_proj(x).reshape(t, attn.heads, attn.head_dim)
    k = attn.k_proj(x).reshape(t, attn.kv_heads, attn.head_dim)
    v = attn.v_proj(x).reshape(t, attn.kv_heads, attn.head_dim)
    if attn.qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v


def _inputs(model: QwenVL, batch: dict):
    """(x (B, T, hidden) the new tokens' embeddings with the images' features set in, the
    DeepStack `after` of `LayerStack.scan` on the hidden states (None without), cos and sin
    (B, T, D) of their M-RoPE positions)."""
    lm = model.model.language_model
    x = lm.embed_tokens(batch["input_ids"])
    after = None
    if "pixel_values" in batch:
        image_embeds, deepstack = jax.vmap(model.model.visual)(batch["pixel_values"],
                                                               batch["vision"])
        index = batch["visual_index"]  # (B, N); padding entries are T (dropped)
        x = scatter_rows(x, index, image_embeds.astype(x.dtype), "set")
        after = deepstack_after(deepstack, index, x.dtype)
    cos, sin = lm.rope(batch["positions"])
    return x, after, cos, sin


def _last_logits(model: QwenVL, x: jax.Array, count: jax.Array) -> jax.Array:
    """(B, V) fp32 logits of each row's token count - 1 of hidden states x (B, T, hidden)."""
    lm = model.model.language_model
    last = jnp.take_along_axis(x, (count - 1)[:, None, None], axis=1)[:, 0]
    return jnp.einsum("bd,vd->bv", lm.norm(last), model.head_weight(),
                      preferred_element_type=jnp.float32)


def _project(layer, x, cos, sin):
    """A decoder layer's rotated q (B, T, H, D), k and v (B, T, Hkv, D) of x (B, T, hidden)."""
    attn = layer.self_attn
    return jax.vmap(lambda h, c, s: _qkv(attn, h, c, s))(layer.input_layernorm(x), cos, sin)


def _finish(layer, x, out):
    """The rest of a decoder layer after its attention's output out (B, T, H * D): (x, the
    router's top k (B, T, K), None for a dense layer)."""
    return layer.residual_mlp(x + layer.self_attn.o_proj(out))


QUERY_BLOCK = 512  # a prefill's new tokens attend this many at a time (or fewer)


def prefix_attention(q: jax.Array, k: jax.Array, v: jax.Array, read: Callable,
                     lengths: jax.Array, blocks: jax.Array, scale: float,
                     query_block: int = QUERY_BLOCK) -> jax.Array:
    """Attention of new tokens over their row's cached tokens and each other, flash-style:
    `query_block` new tokens at a time (one after the other), each over blocks of keys with a
    running softmax (fp32 or wider), so the scores held are a block's, never (T, T). q (R, T,
    H, D); k, v (R, T, Hkv, D) the new tokens' (H a multiple of Hkv: head i reads KV head
    i // (H / Hkv)); read(j) -> (keys, values) each (Hkv, R, K, D): cached positions
    [j K, (j + 1) K) of every row; lengths (R,) cached tokens a row; blocks () int, how many
    blocks are read (at least the longest row's ceil(lengths / K)). New token i of row r
    attends to the cached positions < lengths[r] and to the new tokens <= i. Returns (R, T,
    H * D)."""
    r, t, h, d = q.shape
    g = k.shape[2]
    wide = wide_dtype(q.dtype)
    size = math.gcd(t, query_block)
    qg = q.reshape(r, t // size, size, g, h // g, d)
    kb, vb = (a.reshape(r, t // size, size, g, d) for a in (k, v))

    def attend(i):  # query block i: (R, size, H * D)
        qi = qg[:, i]

        def merge(state, keys, values, seen):  # keys, values (R, S, Hkv, D); seen (R, size, S)
            top, total, acc = state
            s = jnp.einsum("btgrd,bsgd->bgtrs", qi, keys, preferred_element_type=wide) * scale
            s = jnp.where(seen[:, None, :, None, :], s, -jnp.inf)
            new_top = jnp.maximum(top, jnp.max(s, axis=-1))
            base = jnp.where(jnp.isfinite(new_top), new_top, 0.0)
            p = jnp.exp(s - base[..., None])  # 0 where not seen
            old = jnp.exp(top - base)  # 0 before anything was seen
            out = jnp.einsum("bgtrs,bsgd->bgtrd", p.astype(values.dtype), values,
                             preferred_element_type=wide)
            return new_top, total * old + p.sum(axis=-1), acc * old[..., None] + out

        def cached(j, state):
            keys, values = read(j)
            n = keys.shape[2]
            seen = j * n + jnp.arange(n)[None, :] < lengths[:, None]  # (R, K)
            return merge(state, keys.transpose(1, 2, 0, 3), values.transpose(1, 2, 0, 3),
                         jnp.broadcast_to(seen[:, None, :], (r, size, n)))

        def new(j, state):  # the new tokens of block j <= i, causally
            causal = j * size + jnp.arange(size)[None, :] <= i * size + jnp.arange(size)[:, None]
            return merge(state, kb[:, j], vb[:, j], jnp.broadcast_to(causal, (r, size, size)))

        shape = (r, g, size, h // g)
        state = (jnp.full(shape, -jnp.inf, wide), jnp.zeros(shape, wide),
                 jnp.zeros(shape + (d,), wide))
        state = jax.lax.fori_loop(0, blocks, cached, state)
        _, total, acc = jax.lax.fori_loop(0, i + 1, new, state)
        out = acc / total[..., None]  # every token sees itself: total > 0
        return out.transpose(0, 2, 1, 3, 4).reshape(r, size, h * d).astype(q.dtype)

    out = jax.lax.map(attend, jnp.arange(t // size))  # (T / size, R, size, H * D)
    return out.transpose(1, 0, 2, 3).reshape(r, t, h * d)


def prefill(model: QwenVL, read: Callable, lengths: jax.Array, blocks: jax.Array,
            batch: dict, record: bool = False):
    """Run work rows of new tokens over their cached tokens.

    read(layer, j) -> (keys, values) each (Hkv, R, K, D): layer `layer`'s cached positions
    [j K, (j + 1) K) of every row (`prefix_attention`); lengths (R,): cached tokens a row;
    blocks: () int, blocks of K positions to read (covering the longest row); batch:
    input_ids (R, T) new tokens, right-padded, positions (R, 3, T) their M-RoPE positions,
    count (R,) real new tokens a row (>= 1), and the image arrays of `geo3k_jax.core.batch`
    (pixel_values, vision, visual_index: positions among the new tokens) when a new token is
    an image token. Returns (logits (R, V) fp32 of each row's last real new token, (keys,
    values) each (Hkv, layers, R, T, D) of the new tokens, to go at positions lengths[r]..),
    with `record` and the new tokens' experts (R, T, layers, K) int32."""
    lm = model.model.language_model
    x, after, cos, sin = _inputs(model, batch)

    def step(layer, i, x):
        q, k, v = _project(layer, x, cos, sin)
        out = prefix_attention(q, k, v, lambda j: read(i, j), lengths, blocks,
                               layer.self_attn.head_dim ** -0.5)
        x, top = _finish(layer, x, out)
        return x, (k, v, top if record else None)

    x, (keys, values, tops) = lm.layers.scan(step, x, after=after, outputs=True)
    rows = tuple(a.transpose(3, 0, 1, 2, 4) for a in (keys, values))  # (layers, R, T, Hkv, D)
    logits = _last_logits(model, x, batch["count"])
    return (logits, rows, tops.transpose(1, 2, 0, 3)) if record else (logits, rows)


def decode(model: QwenVL, cache: tuple, at: jax.Array, batch: dict, attend: Callable,
           record: bool = False):
    """One new token a slot over the cache, written at its position.

    cache: (keys, values) each (Hkv, layers, S, L, D); at (S,): where slot s's token goes
    (past L: nowhere, a slot not decoding); batch: input_ids (S, 1), positions (S, 3, 1) its
    M-RoPE position; attend(q (S, H, D), keys, values, layer, at, scale) -> (S, H * D): the
    attention of each slot's token to its positions <= at (`geo3k_jax.kernels.ragged`), over the
    cache with this layer's new keys written. Returns (logits (S, V) fp32, the cache), with
    `record` and the tokens' experts (S, layers, K) int32."""
    lm = model.model.language_model
    x, _, cos, sin = _inputs(model, batch)
    slots = jnp.arange(at.shape[0])

    def write(c, i, new):  # slot s's new (1, Hkv, D) at position at[s] of layer i
        # the KV head an index of the scatter, not part of its window: with (Hkv, D) windows
        # the TPU compiler lays the whole cache out with Hkv innermost and copies it back into
        # pages for every layer of every decode step (tests/test_jax_aot.py)
        heads = jnp.arange(c.shape[0])[:, None]
        return c.at[heads, i, slots[None], at[None]].set(
            new[:, 0].transpose(1, 0, 2).astype(c.dtype), mode="drop")

    def step(layer, i, carry):
        x, keys, values = carry
        q, k, v = _project(layer, x, cos, sin)
        keys, values = write(keys, i, k), write(values, i, v)
        out = attend(q[:, 0], keys, values, i, at, layer.self_attn.head_dim ** -0.5)
        x, top = _finish(layer, x, out[:, None])
        return ((x, keys, values), top[:, 0]) if record else (x, keys, values)

    out = lm.layers.scan(step, (x,) + tuple(cache), outputs=record)
    (x, keys, values), tops = out if record else (out, None)
    logits = _last_logits(model, x, jnp.ones_like(at))
    return (logits, (keys, values), tops.transpose(1, 0, 2)) if record else (logits,
                                                                              (keys, values))
