"""The Flax Qwen-VL over a fixed-size KV cache: new tokens in, last-token logits out.

Rollouts need what training does not: keys and values kept between forwards. `extend` walks the
same modules as `geo3k_jax.model.QwenVL.hidden_states` (same parameters, same vision tower, same
M-RoPE and DeepStack) with plain causal attention over one sequence per row. It is the whole
engine's model: a first-turn prefill (empty cache, images), a later turn's feedback (the cache
of the earlier turns) and a decode step (one token) are the same call with different shapes.

    cache        (keys, values), each (Hkv, layers, B, L, D); row b holds its sequence's first
                 `lengths[b]` tokens at slots 0.. and garbage after them. One array over the
                 layers: the layers are one `jax.lax.scan` (`geo3k_jax.text.DecoderStack`)
                 that writes its layer's new keys in place, and a KV head's slots and positions
                 are consecutive, the pages of the Pallas paged attention kernel
                 (`geo3k_jax.ragged`). (Keys stored (B, Hkv, D, L) once made the TPU compiler
                 copy every layer's cache in and out of the decode loop, docs/tpu_engine.md:
                 `python -m geo3k_jax.aot` reports the decode program's temporaries.)

Logits are the head's products accumulated in fp32, as `geo3k_jax.model.token_logprobs` does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from geo3k_jax.layers import apply_rotary, scatter_rows, wide_dtype
from geo3k_jax.model import QwenVL
from geo3k_jax.text import deepstack_after


def cached_attention(q: jax.Array, keys: jax.Array, values: jax.Array, mask: jax.Array,
                     scale: float) -> jax.Array:
    """`geo3k_jax.layers.attention` over one layer of a cache, batched. q: (B, T, H, D); keys
    and values (Hkv, B, L, D) as the cache holds a layer (H a multiple of Hkv: head i reads kv
    head i // (H / Hkv)); mask: (B, T, L) bool, True = attend. Scores and softmax in (at least)
    fp32. Returns (B, T, H * D)."""
    b, t, h, d = q.shape
    g = keys.shape[0]
    qg = q.reshape(b, t, g, h // g, d).transpose(0, 2, 1, 3, 4)  # (B, Hkv, T, H / Hkv, D)
    wide = wide_dtype(q.dtype)
    scores = jnp.einsum("bgtrd,gbsd->bgtrs", qg, keys, preferred_element_type=wide) * scale
    scores = jnp.where(mask[:, None, :, None, :], scores, jnp.finfo(wide).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(values.dtype)
    out = jnp.einsum("bgtrs,gbsd->bgtrd", probs, values)
    return out.transpose(0, 2, 1, 3, 4).reshape(b, t, h * d)


def _qkv(attn, x, cos, sin):
    """One row's rotated q (T, H, D), k and v (T, Hkv, D) from normed x (T, hidden)."""
    t = x.shape[0]
    q = attn.q_proj(x).reshape(t, attn.heads, attn.head_dim)
    k = attn.k_proj(x).reshape(t, attn.kv_heads, attn.head_dim)
    v = attn.v_proj(x).reshape(t, attn.kv_heads, attn.head_dim)
    if attn.qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v


def extend(model: QwenVL, cache: tuple, lengths: jax.Array, batch: dict,
           bound: int | None = None, attend=None):
    """Run each row's new tokens over its cache.

    cache: (keys, values) of (Hkv, layers, B, L, D) (module docstring) holding lengths (B,)
    tokens a row; batch: input_ids (B, T) new tokens, right-padded, positions (B, 3, T) their
    M-RoPE positions, count (B,) real new tokens per row (>= 1), and the image arrays of
    `geo3k_jax.batch` (pixel_values, vision, visual_index: positions among the new tokens) when
    a new token is an image token. Row b's token i is written at slot lengths[b] + i (slots past
    L are dropped: padding) and attends to slots <= lengths[b] + i; attention reads only the
    first `bound` slots (None: all L), so its cost follows the live tokens (every row's lengths
    + count <= bound), not the cache's capacity. attend: a decode step's attention instead (one
    new token a row), attend(q (B, H, D), keys, values, layer, at (B,) the new token's position,
    scale) -> (B, H * D) over the whole cache (`geo3k_jax.ragged`: each row's own pages).
    Returns (logits (B, V) fp32 of each row's last real new token, the cache, rows holding
    lengths + count tokens)."""
    lm = model.model.language_model
    ids, count = batch["input_ids"], batch["count"]
    b, t = ids.shape
    x = lm.embed_tokens(ids)  # (B, T, hidden)
    after = None
    if "pixel_values" in batch:
        image_embeds, deepstack = jax.vmap(model.model.visual)(batch["pixel_values"],
                                                               batch["vision"])
        index = batch["visual_index"]  # (B, N); padding entries are T (dropped)
        x = scatter_rows(x, index, image_embeds.astype(x.dtype), "set")
        deep = deepstack_after(deepstack, index, x.dtype)
        if deep is not None:  # on the hidden states of the (x, keys, values) carry
            after = (deep[0], lambda i, c: (deep[1](i, c[0]),) + c[1:])
    cos, sin = lm.rope(batch["positions"])  # (B, T, D)
    slots = lengths[:, None] + jnp.arange(t)[None, :]  # (B, T) where each new token goes
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
    bound = cache[0].shape[3] if bound is None else bound
    mask = jnp.arange(bound)[None, None, :] <= slots[:, :, None]  # (B, T, bound)

    def write(c, i, new):  # row b's new (T, Hkv, D) at its slots of layer i; past L: dropped
        # the KV head an index of the scatter, not part of its window: with (Hkv, D) windows
        # the TPU compiler lays the whole cache out with Hkv innermost and copies it back into
        # pages for every layer of every decode step (tests/test_jax_aot.py)
        heads = jnp.arange(c.shape[0])[:, None, None]
        return c.at[heads, i, rows[None], slots[None]].set(
            new.transpose(2, 0, 1, 3).astype(c.dtype), mode="drop")

    def step(layer, i, carry):
        x, keys, values = carry
        attn = layer.self_attn
        q, k, v = jax.vmap(lambda h, c, s: _qkv(attn, h, c, s))(
            layer.input_layernorm(x), cos, sin)
        keys, values = write(keys, i, k), write(values, i, v)
        if attend is None:
            ck, cv = (jax.lax.dynamic_index_in_dim(a, i, 1, keepdims=False)[:, :, :bound]
                      for a in (keys, values))
            out = cached_attention(q, ck, cv, mask, attn.head_dim ** -0.5)
        else:
            out = attend(q[:, 0], keys, values, i, slots[:, 0], attn.head_dim ** -0.5)[:, None]
        x = x + attn.o_proj(out)
        return x + layer.mlp(layer.post_attention_layernorm(x)), keys, values

    x, keys, values = lm.layers.scan(step, (x,) + tuple(cache), after=after)
    last = jnp.take_along_axis(x, (count - 1)[:, None, None], axis=1)[:, 0]  # (B, hidden)
    logits = jnp.einsum("bd,vd->bv", lm.norm(last), model.head_weight(),
                        preferred_element_type=jnp.float32)
    return logits, (keys, values)
