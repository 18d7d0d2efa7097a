"""The Flax Qwen-VL with a fixed-size KV cache: a prefill forward and a one-token decode step.

Rollouts need what training does not: keys and values kept between forwards. These functions
walk the same modules as `geo3k_jax.model.QwenVL.hidden_states` (same parameters, same vision
tower, same M-RoPE and DeepStack), with plain causal attention over one sequence per row:

    cache        tuple over layers of (keys, values), each (B, L, Hkv, D); row b holds its
                 sequence's first `lengths[b]` tokens at slots 0.. and garbage after them
    prefill      rows of right-padded prompts (B, T) -> last-token logits (B, V) and the cache
    decode_step  one token per row (B,), written at slot lengths[b] -> logits (B, V), cache

Logits are the head's products accumulated in fp32, as `geo3k_jax.model.token_logprobs` does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from geo3k_jax.layers import apply_rotary, attention, scatter_rows
from geo3k_jax.model import QwenVL


def _qkv(attn, x, cos, sin):
    """One row's rotated q (T, H, D), k and v (T, Hkv, D) from normed x (T, hidden)."""
    t = x.shape[0]
    q = attn.q_proj(x).reshape(t, attn.heads, attn.head_dim)
    k = attn.k_proj(x).reshape(t, attn.kv_heads, attn.head_dim)
    v = attn.v_proj(x).reshape(t, attn.kv_heads, attn.head_dim)
    if attn.qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v


def _head(model: QwenVL, hidden: jax.Array) -> jax.Array:
    """(B, hidden) -> (B, vocab) fp32 logits."""
    return jnp.einsum("bd,vd->bv", hidden, model.head_weight(),
                      preferred_element_type=jnp.float32)


def prefill(model: QwenVL, batch: dict, cache_len: int):
    """batch: input_ids (B, T), positions (B, 3, T), lengths (B,) real tokens per row (the rest
    is padding, never attended to), and the image arrays of `geo3k_jax.batch` (pixel_values,
    vision, visual_index) when a row has an image. Returns (logits (B, V) fp32 of each row's
    last real token, cache of `cache_len` >= T slots)."""
    lm = model.model.language_model
    ids, lengths = batch["input_ids"], batch["lengths"]
    b, t = ids.shape
    x = lm.embed_tokens(ids)  # (B, T, hidden)
    deepstack, index = [], None
    if "pixel_values" in batch:
        image_embeds, deepstack = jax.vmap(model.model.visual)(batch["pixel_values"],
                                                               batch["vision"])
        index = batch["visual_index"]  # (B, N); padding entries are T (dropped)
        x = scatter_rows(x, index, image_embeds.astype(x.dtype), "set")
    cos, sin = lm.rope(batch["positions"])  # (B, T, D)
    keys = jnp.arange(t)
    mask = (keys[None, :, None] >= keys[None, None, :]) & (keys[None, None, :] < lengths[:, None,
                                                                                          None])
    cache = []
    for i, layer in enumerate(lm.layers):
        attn = layer.self_attn
        q, k, v = jax.vmap(lambda h, c, s, a=attn: _qkv(a, h, c, s))(
            layer.input_layernorm(x), cos, sin)
        out = jax.vmap(lambda q_, k_, v_, m: attention(q_, k_, v_, m, attn.head_dim ** -0.5))(
            q, k, v, mask)
        x = x + attn.o_proj(out)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        if i < len(deepstack):
            x = scatter_rows(x, index, deepstack[i].astype(x.dtype), "add")
        pad = ((0, 0), (0, cache_len - t), (0, 0), (0, 0))
        cache.append((jnp.pad(k, pad), jnp.pad(v, pad)))
    last = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)[:, 0]  # (B, hidden)
    return _head(model, lm.norm(last)), tuple(cache)


def decode_step(model: QwenVL, cache: tuple, tokens: jax.Array, positions: jax.Array,
                lengths: jax.Array):
    """tokens (B,) at M-RoPE positions (B, 3), written at cache slot lengths (B,) (each row then
    attends to its slots 0..lengths[b]). Returns (logits (B, V) fp32, the updated cache)."""
    lm = model.model.language_model
    x = lm.embed_tokens(tokens[:, None])  # (B, 1, hidden)
    cos, sin = lm.rope(positions[:, :, None])  # (B, 1, D)
    slots = jnp.arange(cache[0][0].shape[1])
    mask = (slots[None, :] <= lengths[:, None])[:, None, :]  # (B, 1, L)
    write = jax.vmap(lambda c, new, at: jax.lax.dynamic_update_slice_in_dim(c, new, at, 0))
    new_cache = []
    for layer, (ck, cv) in zip(lm.layers, cache):
        attn = layer.self_attn
        q, k, v = jax.vmap(lambda h, c, s, a=attn: _qkv(a, h, c, s))(
            layer.input_layernorm(x), cos, sin)
        ck, cv = write(ck, k, lengths), write(cv, v, lengths)
        out = jax.vmap(lambda q_, k_, v_, m: attention(q_, k_, v_, m, attn.head_dim ** -0.5))(
            q, ck, cv, mask)
        x = x + attn.o_proj(out)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        new_cache.append((ck, cv))
    return _head(model, lm.norm(x[:, 0])), tuple(new_cache)
