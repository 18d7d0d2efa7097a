"""Qwen2.5-VL and Qwen3-VL for conditional generation in Flax NNX, and per-token log-probs.

    QwenVL
      model.visual           vision tower (geo3k_jax.vision): one embedding per image token
      model.language_model   decoder (geo3k_jax.text)
      lm_head                only when the checkpoint does not tie it to the embedding

The module tree mirrors transformers' `*ForConditionalGeneration`, so parameter paths are the
checkpoint keys. A forward takes a `geo3k_jax.batch` dict of arrays (rows of packed sequences,
the images of all rows in one patch list) and is a pure function of it under `jax.jit`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from geo3k_jax.layers import Linear
from geo3k_jax.text import ARCHS, TextModel
from geo3k_jax.vision import build_vision_tower


class VLModel(nnx.Module):
    """transformers' `Qwen*VLModel`: the vision tower and the language model."""

    def __init__(self, config, *, dtype, rngs: nnx.Rngs):
        self.visual = build_vision_tower(config.vision_config, dtype=dtype, rngs=rngs)
        self.language_model = TextModel(config.text_config, config.model_type, dtype=dtype,
                                        rngs=rngs)


class QwenVL(nnx.Module):
    """A Qwen-VL model from its transformers config (`AutoConfig.from_pretrained(path)`)."""

    def __init__(self, config, *, dtype=jnp.float32, rngs: nnx.Rngs):
        if config.model_type not in ARCHS:
            raise ValueError(f"model_type {config.model_type!r} is not one of {ARCHS}")
        self.model = VLModel(config, dtype=dtype, rngs=rngs)
        self.tied = bool(tie_word_embeddings(config))
        self.lm_head = None if self.tied else Linear(
            config.text_config.hidden_size, config.text_config.vocab_size, bias=False,
            dtype=dtype, rngs=rngs)
        self.image_token_id = int(config.image_token_id)

    def hidden_states(self, batch: dict) -> jax.Array:
        """Final normed hidden states (B, T, hidden) of a batch (see `geo3k_jax.batch`)."""
        ids = batch["input_ids"]  # (B, T)
        b, t = ids.shape
        lm = self.model.language_model
        embeds = lm.embed_tokens(ids)
        deepstack, index = [], None
        if "pixel_values" in batch:
            image_embeds, deepstack = self.model.visual(batch["pixel_values"], batch["vision"])
            index = batch["visual_index"]  # (N,) flat token indices of the image placeholders
            embeds = embeds.reshape(b * t, -1).at[index].set(
                image_embeds.astype(embeds.dtype), mode="drop").reshape(b, t, -1)
        return lm(embeds, batch["positions"], batch["segments"], batch["attn_starts"],
                  batch["key_offsets"], index, deepstack)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """(..., hidden) -> (..., vocab) in the parameters' dtype."""
        if self.lm_head is not None:
            return self.lm_head(hidden)
        table = self.model.language_model.embed_tokens.weight[...]
        return jnp.einsum("...d,vd->...v", hidden, table)


def tie_word_embeddings(config) -> bool:
    """Whether lm_head shares the embedding: transformers reads the top-level flag."""
    return bool(getattr(config, "tie_word_embeddings", False))


def token_logprobs(model: QwenVL, batch: dict, temperature: float = 1.0,
                   with_entropy: bool = False):
    """log p(input_ids[b, t] | tokens < t of its sequence), fp32, at the batch's `targets`.

    Only the K target rows of logits are computed (K x vocab, not B x T x vocab: the vocabulary
    is 152k for real checkpoints). Returns (B, T) log-probs, 0 away from the targets; with
    `with_entropy`, also (B, T) entropies of the same next-token distributions (no gradient).
    """
    hidden = model.hidden_states(batch)
    b, t, d = hidden.shape
    targets = batch["targets"]  # (K,) flat indices into B * T; padding entries are 0
    prev = hidden.reshape(b * t, d)[jnp.maximum(targets - 1, 0)]  # the predicting positions
    logits = model.logits(prev).astype(jnp.float32) / temperature  # (K, V)
    logp_all = jax.nn.log_softmax(logits, axis=-1)
    ids = batch["input_ids"].reshape(-1)[targets]
    scatter = lambda v: jnp.zeros(b * t, jnp.float32).at[targets].set(v).reshape(b, t)  # noqa
    logp = scatter(jnp.take_along_axis(logp_all, ids[:, None], axis=-1)[:, 0])
    if not with_entropy:
        return logp
    entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    return logp, jax.lax.stop_gradient(scatter(entropy))


def split_params(model: nnx.Module):
    """(merge, params): params {checkpoint key: array}, a flat dict that optax, orbax and the
    shardings handle directly; merge(params) rebuilds the model and may be called under jit."""
    graphdef, state = nnx.split(model)
    flat = nnx.to_flat_state(state)
    paths = {".".join(map(str, path)): path for path, _ in flat}
    params = {".".join(map(str, path)): v.get_value() for path, v in flat}
    return functools.partial(_merge, graphdef, paths), params


def _merge(graphdef, paths: dict, params: dict) -> nnx.Module:
    state = nnx.from_flat_state([(paths[k], nnx.Param(params[k])) for k in paths])
    return nnx.merge(graphdef, state)
