"""The in-process JAX rollout engine: batched sampling from the JAX learner's current weights.

`JaxEngine` implements `common.engine.Engine` on the project's Flax Qwen-VL with the semantics of
the torch `geo3k_torch.engine.LocalEngine`: each request is prefilled whole (its images through
the vision tower, DeepStack features, explicit 3-D M-RoPE positions from `common.mrope`), then
decoded token by token over a fixed-size KV cache (`geo3k_jax.decode`). The decode position of a
row continues its M-RoPE positions: max + 1, then + 1 per token. A token's log-prob is
log_softmax(logits / T) of the raw logits (T = 0: greedy, log_softmax(logits)), before top-p;
image and video placeholders are never sampled; a request ends at a stop token (kept as its last
token) or at `max_new_tokens`.

Both compiled functions (prefill + first sample, decode step + sample) take the parameters as an
argument, so new weights never recompile, and see bucketed shapes (`geo3k_jax.buckets.bucket`:
rows, prompt length, patches per row, cache length), so a run compiles a handful of times;
`compiles` counts the traces. The decode step donates the cache it replaces.

Every turn is prefilled again from the whole conversation (`Request.input_ids`): no KV cache is
kept between `generate` calls. Requests with the same tokens and images (a GRPO group's samples
on their first turn) are prefilled once: their row's cache and last logits are copied to each of
them inside the compiled prefill before the first token is sampled (`share_prefill`). The sampling key is a raw uint32[2] PRNG key (`rng_state`).
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from common.engine import Completion, Decoding, Request
from common.mrope import mrope_position_ids
from common.processor import image_inputs, image_key
from geo3k_jax.batch import HostRow, pad_patches
from geo3k_jax.buckets import PATCH_UNITS, bucket
from geo3k_jax.decode import decode_step, prefill
from geo3k_jax.vision_grid import vision_aux

LENGTH_UNIT = 128  # prompt and cache lengths are buckets of this


def sample(logits: jax.Array, temperature: jax.Array, top_p: jax.Array, key: jax.Array,
           banned: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One token per row, as `geo3k_torch.engine.sample`. logits: (B, V) fp32 raw; temperature,
    top_p: (B,); banned: ids never sampled. Returns (tokens (B,) int32, log-probs (B,) under
    log_softmax(logits / T); greedy rows (T = 0) report log_softmax(logits))."""
    greedy = temperature <= 0
    t = jnp.where(greedy, 1.0, temperature)[:, None]
    logp = jax.nn.log_softmax(logits / t, axis=-1)
    logits = logits.at[:, banned].set(-jnp.inf)
    scaled = logits / t
    probs = jax.nn.softmax(scaled, axis=-1)
    order = jnp.argsort(-probs, axis=-1)  # descending
    sorted_p = jnp.take_along_axis(probs, order, axis=-1)
    before = jnp.cumsum(sorted_p, axis=-1) - sorted_p  # mass strictly above each token
    keep_sorted = (before < top_p[:, None]) | (top_p[:, None] >= 1)
    rows = jnp.arange(logits.shape[0])[:, None]
    keep = jnp.zeros_like(keep_sorted).at[rows, order].set(keep_sorted)
    drawn = jax.random.categorical(key, jnp.where(keep, scaled, -jnp.inf), axis=-1)
    tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1), drawn).astype(jnp.int32)
    return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]


class JaxEngine:
    """Samples from `merge(params())` in process (see the module docstring).

    merge: `geo3k_jax.model.split_params`'s; params: returns the current parameter dict (the
    learner's: read at every `generate`, so an update is seen at once); config: the transformers
    config; compute_dtype: the parameters are cast to it inside the compiled functions, as the
    learner does; share_prefill: identical requests share one prefill row."""

    def __init__(self, merge: Callable, params: Callable[[], dict], processor, config, *,
                 seed: int = 0, compute_dtype=None, share_prefill: bool = True):
        self.merge, self.params, self.processor, self.config = merge, params, processor, config
        self.compute_dtype, self.share_prefill = compute_dtype, share_prefill
        self.key = jax.random.PRNGKey(seed)
        self.image_token_id = int(config.image_token_id)
        self.merge_size = config.vision_config.spatial_merge_size
        placeholders = {config.image_token_id, getattr(config, "video_token_id", None)} - {None}
        self.banned = jnp.asarray(sorted(placeholders), jnp.int32)
        self.compiles = 0  # traces of the prefill and decode functions
        self._prefill = jax.jit(self._prefill_fn, static_argnames="cache_len")
        self._step = jax.jit(self._step_fn, donate_argnums=1)

    # ---- RNG ---------------------------------------------------------------------------
    def rng_state(self) -> list[int]:
        return [int(x) for x in np.asarray(jax.random.key_data(self.key)).reshape(-1)]

    def set_rng_state(self, state: Sequence[int]) -> None:
        self.key = jnp.asarray(np.asarray(state, np.uint32))

    # ---- compiled pieces ---------------------------------------------------------------
    def _model(self, params):
        if self.compute_dtype is not None:
            params = jax.tree.map(lambda a: a.astype(self.compute_dtype), params)
        return self.merge(params)

    def _prefill_fn(self, params, batch, index, sampling, key, cache_len):
        """Prefill the distinct rows of `batch`; row b of the result is distinct row index[b]."""
        self.compiles += 1  # runs while tracing only
        logits, cache = prefill(self._model(params), batch, cache_len)
        logits = logits[index]
        cache = tuple((k[index], v[index]) for k, v in cache)
        key, sub = jax.random.split(key)
        tokens, logp = sample(logits, *sampling, sub, self.banned)
        return tokens, logp, cache, key

    def _step_fn(self, params, cache, tokens, positions, lengths, sampling, key):
        self.compiles += 1
        logits, cache = decode_step(self._model(params), cache, tokens, positions, lengths)
        key, sub = jax.random.split(key)
        tokens, logp = sample(logits, *sampling, sub, self.banned)
        return tokens, logp, cache, key

    # ---- generate ----------------------------------------------------------------------
    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        if not requests:
            return []
        requests = list(requests)
        n = len(requests)
        unique, expand = self._distinct(requests)
        batch, next_pos, lengths = self._prompt_arrays([requests[i] for i in unique])
        rows = bucket(n, 1)
        index = np.zeros(rows, np.int32)  # padding rows copy row 0
        index[:n] = expand
        next_pos, lengths = next_pos[index], lengths[index]
        budget = [r.sampling.max_new_tokens for r in requests]
        cache_len = bucket(batch["input_ids"].shape[1] + max(budget), LENGTH_UNIT)
        pad = rows - n  # padding rows decode greedily, unread
        sampling = (np.r_[[r.sampling.temperature for r in requests], np.zeros(pad)]
                    .astype(np.float32),
                    np.r_[[r.sampling.top_p for r in requests], np.ones(pad)].astype(np.float32))
        params = self.params()
        tok, lp, cache, self.key = self._prefill(params, batch, index, sampling, self.key,
                                                 cache_len=cache_len)
        decoding = Decoding(requests)
        while True:
            if decoding.add(np.asarray(tok).tolist(), np.asarray(lp).tolist()):
                break
            positions = np.repeat(next_pos[:, None], 3, axis=1)  # (B, 3): text after the prompt
            tok, lp, cache, self.key = self._step(params, cache, tok, positions, lengths,
                                                  sampling, self.key)
            next_pos, lengths = next_pos + 1, lengths + 1
        return decoding.completions()

    def _distinct(self, requests: list[Request]) -> tuple[list[int], list[int]]:
        """The requests to prefill (indices) and each request's row among them: with
        `share_prefill`, requests with equal tokens and images share one."""
        if not self.share_prefill:
            return list(range(len(requests))), list(range(len(requests)))
        unique, expand, seen = [], [], {}
        for b, r in enumerate(requests):
            key = (np.asarray(r.input_ids, np.int64).tobytes(),
                   tuple(image_key(im) for im in r.images))
            if key not in seen:
                seen[key] = len(unique)
                unique.append(b)
            expand.append(seen[key])
        return unique, expand

    def _prompt_arrays(self, requests: list[Request]):
        """(prefill batch, next M-RoPE position (B,), lengths (B,)), B and T bucketed; rows past
        the requests hold one pad token."""
        images = [im for r in requests for im in r.images]
        keys = [image_key(im) for im in images]
        first_of: dict = {}  # each distinct image (by content) goes through the processor once
        for i, k in enumerate(keys):
            first_of.setdefault(k, i)
        slot = {k: j for j, k in enumerate(first_of)}
        imgs = image_inputs(self.processor, [images[i] for i in first_of.values()])
        grids = imgs.get("image_grid_thw", np.zeros((0, 3), np.int64))
        bounds = np.concatenate([[0], np.cumsum(grids.prod(axis=1))]).astype(int)
        rows, first = [], 0
        for r in requests:
            which = [slot[k] for k in keys[first:first + len(r.images)]]
            first += len(r.images)
            ids = np.asarray(r.input_ids, np.int64)
            pos = mrope_position_ids(ids, self.image_token_id, grids[which], self.merge_size)
            pixels = [imgs["pixel_values"][bounds[j]:bounds[j + 1]] for j in which]
            rows.append((ids, pos, grids[which], pixels))
        n_rows = bucket(len(rows), 1)
        length = bucket(max(len(ids) for ids, *_ in rows), LENGTH_UNIT)
        batch = {"input_ids": np.zeros((n_rows, length), np.int32),
                 "positions": np.zeros((n_rows, 3, length), np.int32),
                 "lengths": np.ones(n_rows, np.int32)}
        next_pos = np.zeros(n_rows, np.int32)
        for b, (ids, pos, _, _) in enumerate(rows):
            batch["input_ids"][b, :len(ids)] = ids
            batch["positions"][b, :, :len(ids)] = pos
            batch["lengths"][b] = len(ids)
            next_pos[b] = int(pos.max()) + 1
        patches = max(sum(len(p) for p in pixels) for *_, pixels in rows)
        if patches:
            n_patches = bucket(patches, PATCH_UNITS * self.merge_size ** 2)
            padded = [pad_patches(self._image_row(*rows[b]) if b < len(rows) else None,
                                  self.config, n_patches, length) for b in range(n_rows)]
            batch["pixel_values"] = np.stack([p["pixel_values"] for p in padded])
            batch["visual_index"] = np.stack([p["visual_index"] for p in padded])
            batch["vision"] = {k: np.stack([p["vision"][k] for p in padded])
                               for k in padded[0]["vision"]}
        return batch, next_pos, batch["lengths"].copy()

    def _image_row(self, ids, pos, grid, pixels) -> HostRow | None:
        """What `geo3k_jax.batch.pad_patches` reads of a row: its patches, grids, image slots."""
        if not pixels:
            return None
        return HostRow(batch=None, positions=None, prefix=None, reach=None, weights=None,
                       targets=None, pixel_values=np.concatenate(pixels).astype(np.float32),
                       vision=vision_aux(self.config.vision_config, grid),
                       visual_index=np.flatnonzero(ids == self.image_token_id).astype(np.int32))
