"""Qwen2.5-VL and Qwen3-VL for conditional generation in Flax NNX, and per-token log-probs.

    QwenVL
      model.visual           vision tower (geo3k_jax.models.vision): one embedding per image token
      model.language_model   decoder (geo3k_jax.models.text)
      lm_head                only when the checkpoint does not tie it to the embedding

The module tree mirrors transformers' `*ForConditionalGeneration`, so parameter paths are the
checkpoint keys. A forward takes a `geo3k_jax.core.batch` dict of arrays (rows of packed sequences,
the images of all rows in one patch list) and is a pure function of it under `jax.jit`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from geo3k_jax.models.layers import Linear, scatter_rows
from geo3k_jax.core.sharding import BATCH_AXES
from geo3k_jax.kernels.splash import Attention
from geo3k_jax.models.text import ARCHS, TextModel
from geo3k_jax.models.vision import build_vision_tower
from geo3k_jax.kernels.windowed import WINDOW_AXES


class VLModel(nnx.Module):
    """transformers' `Qwen*VLModel`: the vision tower and the language model."""

    def __init__(self, config, *, dtype, rngs: nnx.Rngs, attention: Attention):
        self.visual = build_vision_tower(config.vision_config, dtype=dtype, rngs=rngs,
                                         attention=attention)
        self.language_model = TextModel(config.text_config, config.model_type, dtype=dtype,
                                        rngs=rngs, attention=attention)


class QwenVL(nnx.Module):
    """A Qwen-VL model from its transformers config (`AutoConfig.from_pretrained(path)`);
    `attention`: windowed or splash (`geo3k_jax.kernels.splash.resolve_attention`)."""

    def __init__(self, config, *, dtype=jnp.float32, rngs: nnx.Rngs,
                 attention: Attention = Attention()):
        if config.model_type not in ARCHS:
            raise ValueError(f"model_type {config.model_type!r} is not one of {ARCHS}")
        self.model = VLModel(config, dtype=dtype, rngs=rngs, attention=attention)
        self.tied = bool(tie_word_embeddings(config))
        self.lm_head = None if self.tied else Linear(
            config.text_config.hidden_size, config.text_config.vocab_size, bias=False,
            dtype=dtype, rngs=rngs)
        self.image_token_id = int(config.image_token_id)

    def hidden_states(self, batch: dict, remat: bool = False, record: bool = False):
        """Final normed hidden states (B, T, hidden) of a batch (see `geo3k_jax.core.batch`),
        its sparse layers routing each token as batch["routing"] (B, T, L, K) says when the
        batch has one (-1: freely). remat: recompute each decoder layer's and vision block's
        activations in the backward pass. record: returns (hidden states, the routers' own top
        k (L, B, T, K) int32)."""
        lm = self.model.language_model
        embeds = lm.embed_tokens(batch["input_ids"])  # (B, T, hidden)
        deepstack, index = [], None
        if "pixel_values" in batch:
            # each row's images, vmapped over rows: the row axis is the data-parallel one (the
            # tower keeps each row's patches on its devices, the splash kernel's shard_map
            # inside maps it over the mesh's data axes)
            mesh = self.model.visual.attention.mesh
            spmd = BATCH_AXES if mesh is not None else None
            image_embeds, deepstack = jax.vmap(
                lambda p, v: self.model.visual(p, v, remat=remat, row_mesh=mesh),
                spmd_axis_name=spmd)(batch["pixel_values"], batch["vision"])
            index = batch["visual_index"]  # (B, N) positions of the row's image tokens
            embeds = scatter_rows(embeds, index, image_embeds.astype(embeds.dtype), "set")
        windows = {k: batch[k] for k in WINDOW_AXES}
        return lm(embeds, batch["positions"], batch["segments"], windows, index, deepstack,
                  remat=remat, prefix=batch.get("prefix"), routing=batch.get("routing"),
                  record=record)

    def head_weight(self) -> jax.Array:
        """The LM head as (vocab, hidden): lm_head, or the tied embedding table."""
        if self.lm_head is not None:
            return self.lm_head.weight[...]
        return self.model.language_model.embed_tokens.weight[...]

    def logits(self, hidden: jax.Array) -> jax.Array:
        """(..., hidden) -> (..., vocab) in the parameters' dtype."""
        return jnp.einsum("...d,vd->...v", hidden, self.head_weight())


def tie_word_embeddings(config) -> bool:
    """Whether lm_head shares the embedding: transformers reads the top-level flag."""
    return bool(getattr(config, "tie_word_embeddings", False))


def token_logprobs(model: QwenVL, batch: dict, temperature: float = 1.0,
                   with_entropy: bool = False, chunk: int = 0, remat: bool = False):
    """log p(input_ids[b, t] | tokens < t of its sequence), fp32, at the batch's `targets`.

    Only the B x K target rows of logits are computed (not B x T x vocab: the vocabulary is
    152k for real checkpoints), `chunk` rows of a row at a time when a row has more than
    chunk > 0 targets (each chunk's (B, chunk, vocab) logits are recomputed in the backward
    pass, never all stored; fewer targets are one piece, nothing recomputed), the head's
    products accumulated in fp32. Returns (B, T) log-probs, 0 away from the targets; with
    `with_entropy`, also (B, T) entropies of the same next-token distributions (no gradient).
    """
    return head_logprobs(model, model.hidden_states(batch, remat=remat), batch, temperature,
                         with_entropy, chunk)


def head_logprobs(model: QwenVL, hidden: jax.Array, batch: dict, temperature: float = 1.0,
                  with_entropy: bool = False, chunk: int = 0):
    """`token_logprobs` from the final hidden states (B, T, D) of `batch`."""
    targets = batch["targets"]  # (B, K) positions; padding entries are 0
    prev = jnp.take_along_axis(hidden, jnp.maximum(targets - 1, 0)[..., None], axis=1)
    ids = jnp.take_along_axis(batch["input_ids"], targets, axis=1)  # (B, K)
    weight = model.head_weight()

    def head(x, y):  # (B, c, D), (B, c) -> log-probs and entropies (B, c)
        logits = jnp.einsum("bkd,vd->bkv", x, weight,
                            preferred_element_type=jnp.float32) / temperature
        logp_all = jax.nn.log_softmax(logits, axis=-1)
        logp = jnp.take_along_axis(logp_all, y[..., None], axis=-1)[..., 0]
        entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
        return logp, jax.lax.stop_gradient(entropy)

    b, k, d = prev.shape
    size = k if chunk <= 0 or k <= chunk else math.gcd(k, chunk)
    if size == k:
        logp, entropy = head(prev, ids)
    else:  # (B, K) -> (K / size, B, size): one chunk of every row at a time
        split = lambda a: jnp.moveaxis(a.reshape(b, k // size, size, *a.shape[2:]), 1, 0)  # noqa
        logp, entropy = jax.lax.map(jax.checkpoint(lambda xy: head(*xy)),
                                    (split(prev), split(ids)))
        logp, entropy = (jnp.moveaxis(a, 0, 1).reshape(b, k) for a in (logp, entropy))
    rows = jnp.arange(b)[:, None]
    scatter = lambda v: jnp.zeros(batch["input_ids"].shape, jnp.float32).at[  # noqa: E731
        rows, targets].set(v)
    if not with_entropy:
        return scatter(logp)
    return scatter(logp), scatter(entropy)


def split_params(model: nnx.Module):
    """(merge, params): params {checkpoint key: array}, a flat dict that optax, orbax and the
    shardings handle directly; merge(params) rebuilds the model and may be called under jit."""
    graphdef, state = nnx.split(model)
    flat = nnx.to_flat_state(state)
    paths = {".".join(map(str, path)): path for path, _ in flat}
    params = {".".join(map(str, path)): v.get_value() for path, v in flat}
    return functools.partial(_merge, graphdef, paths), params


def with_attention(merge, params: dict, change) -> object:
    """`merge` of the same model whose every attention setting
    (`geo3k_jax.kernels.splash.Attention`, held by the text model and each vision attention) is
    `change(setting)`: e.g. the splash kernel mapped over another mesh. `params` (arrays or
    ShapeDtypeStructs) only give the graph its leaves; nothing is copied."""
    model = merge(params)
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module) and isinstance(getattr(node, "attention", None),
                                                       Attention):
            node.attention = change(node.attention)
    return split_params(model)[0]


def _merge(graphdef, paths: dict, params: dict) -> nnx.Module:
    state = nnx.from_flat_state([(paths[k], nnx.Param(params[k])) for k in paths])
    return nnx.merge(graphdef, state)
