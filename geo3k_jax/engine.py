"""The in-process JAX rollout engine: batched sampling from the JAX learner's current weights.

`JaxEngine` implements `common.engine.Engine` on the project's Flax Qwen-VL with the semantics of
the torch `geo3k_torch.engine.LocalEngine`: a request's new tokens are prefilled (its images
through the vision tower, DeepStack features, explicit 3-D M-RoPE positions from `common.mrope`),
then decoded token by token over a fixed-size KV cache (`geo3k_jax.decode.extend`: the prefill and
the decode step are the same function). The decode position of a row continues its M-RoPE
positions: max + 1, then + 1 per token. A token's log-prob is log_softmax(logits / T) of the raw
logits (T = 0: greedy, log_softmax(logits)), before top-p; image and video placeholders are never
sampled; a request ends at a stop token (kept as its last token) or at `max_new_tokens`.

Between turns of an episode (same `Request.session`) the session's KV cache is kept, so a turn
prefills only its new tokens (the last generated one and the feedback), as the torch engine does;
caches live for the sessions of the latest `generate` call and `clear_cache` (after every weight
update) drops them. A request whose new part holds an image token is prefilled whole. Requests
with the same tokens and images and no cache (a GRPO group's samples on their first turn) are
prefilled once: their row's cache and last logits are copied to each of them inside the compiled
prefill before the first token is sampled (`share_prefill`).

The cache of the latest call that prefilled whole requests is kept as well, until the next such
call or `clear_cache`: a later request with the same tokens and images as one of them (an
evaluation's sampled episodes after its greedy ones, on the same prompts) continues that row,
prefilling only its last token again (the decode loop writes past a request's tokens, never over
them). This holds a second cache while the later turns run; `keep_cache=False` keeps neither.

Two compiled functions: the prefill with the first sample, and the decode loop, a
`lax.while_loop` that runs on device until every row has met one of its stop tokens or its budget
(no host round trip per token; `common.engine.Decoding` then applies the same rules to what it
sampled). Both take the parameters as an argument, so new weights never recompile, and see
bucketed shapes (rows: powers of two; new tokens and patches per row: `geo3k_jax.buckets.bucket`;
the cache: the longest a request has needed so far, in units of 128 slots), so a run compiles a
handful of times; `compiles` counts the traces. A call with few rows (the last turns of a few
episodes) pads them to a row count compiled before, up to `ROW_SLACK` times its own: the padded
rows cost a little decoding, a new shape a compile (seconds on CPU, minutes for a large model).
The decode loop donates the cache it replaces.
The sampling key is a raw uint32[2] PRNG key (`rng_state`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from common.engine import Completion, Decoding, Request
from common.mrope import mrope_position_ids
from common.processor import image_inputs, image_key
from geo3k_jax.batch import HostRow, pad_patches
from geo3k_jax.buckets import PATCH_UNITS, bucket
from geo3k_jax.decode import SLOT_AXIS, empty_cache, extend
from geo3k_jax.vision_grid import vision_aux

LENGTH_UNIT = 128  # cache lengths are buckets of this
NEW_TOKENS_UNIT = 32  # and the new tokens of a prefill (a whole prompt, or a turn's feedback),
NEW_TOKENS_RUNGS = 4  # 4 lengths an octave (`bucket`): a 410-token prompt runs 448, not 512
DRAW_BLOCK = 128  # `draw` picks a block of this many token ids, then a token in it
ROW_SLACK = 8  # a call's rows: a count used before, at most this many times its own bucket
LENGTH_SLACK = 4  # a prefill's new tokens: a length used before, at most this many times its own


def sample(logits: jax.Array, temperature: jax.Array, top_p: jax.Array, key: jax.Array,
           banned: jax.Array, nucleus: bool = True) -> tuple[jax.Array, jax.Array]:
    """One token per row, as `geo3k_torch.engine.sample`. logits: (B, V) fp32 raw; temperature,
    top_p: (B,); banned: ids never sampled; nucleus: whether some row has top_p < 1 (else the
    sort is skipped). Returns (tokens (B,) int32, log-probs (B,) under log_softmax(logits / T);
    greedy rows (T = 0) report log_softmax(logits))."""
    greedy = temperature <= 0
    t = jnp.where(greedy, 1.0, temperature)[:, None]
    logp = jax.nn.log_softmax(logits / t, axis=-1)
    logits = logits.at[:, banned].set(-jnp.inf)
    scaled = logits / t
    if nucleus:
        probs = jax.nn.softmax(scaled, axis=-1)
        order = jnp.argsort(-probs, axis=-1)  # descending
        sorted_p = jnp.take_along_axis(probs, order, axis=-1)
        before = jnp.cumsum(sorted_p, axis=-1) - sorted_p  # mass strictly above each token
        keep_sorted = (before < top_p[:, None]) | (top_p[:, None] >= 1)
        rows = jnp.arange(logits.shape[0])[:, None]
        keep = jnp.zeros_like(keep_sorted).at[rows, order].set(keep_sorted)
        scaled = jnp.where(keep, scaled, -jnp.inf)
    drawn = draw(key, scaled)
    tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1), drawn).astype(jnp.int32)
    return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]


def draw(key: jax.Array, scaled: jax.Array, block: int = DRAW_BLOCK) -> jax.Array:
    """One token per row from softmax(scaled) (B, V), -inf for tokens never drawn, by inverting
    cumulative sums at one uniform per row and level: first a block of `block` consecutive ids
    by the blocks' masses, then a token of that block by its own. (The same law as
    `jax.random.categorical`, whose Gumbel-max costs V uniforms, two logarithms each and a
    two-operand argmax per row.) Two
    levels keep fp32 exact enough for any vocabulary: one cumulative sum over 152k ids would
    place every boundary to within the rounding of the running total (about 1e-7 of it, as much
    as a rare token's own probability), where here only the block boundaries see that rounding
    and a token's share of its block is resolved within the block. Returns (B,) int32 ids of
    positive probability, however the sums round."""
    rows, vocab = scaled.shape
    block = min(block, vocab)
    blocks = -(-vocab // block)
    p = jnp.exp(scaled - jnp.max(scaled, axis=-1, keepdims=True))
    p = jnp.pad(p, ((0, 0), (0, blocks * block - vocab))).reshape(rows, blocks, block)
    outer, inner = jax.random.split(key)
    b = _invert(outer, jnp.sum(p, axis=-1))  # (B,) a block of positive mass
    t = _invert(inner, jnp.take_along_axis(p, b[:, None, None], axis=1)[:, 0])
    return b * block + t


def _invert(key: jax.Array, weights: jax.Array) -> jax.Array:
    """(B,) index drawn with probability proportional to `weights` (B, N) >= 0, each row with
    some positive weight: the first index whose cumulative weight reaches a uniform in
    (0, total], among the positive ones, or the last positive one when rounding left the
    uniform above them all."""
    rows, n = weights.shape
    mass = jnp.cumsum(weights, axis=-1)
    u = (1.0 - jax.random.uniform(key, (rows, 1), mass.dtype)) * mass[:, -1:]
    ids = jnp.arange(n, dtype=jnp.int32)
    allowed = weights > 0
    first = jnp.min(jnp.where((mass >= u) & allowed, ids, n), axis=-1)
    last = jnp.max(jnp.where(allowed, ids, 0), axis=-1)
    return jnp.where(first < n, first, last)


class JaxEngine:
    """Samples from `merge(params())` in process (see the module docstring).

    merge: `geo3k_jax.model.split_params`'s; params: returns the current parameter dict (the
    learner's: read at every `generate`, so an update is seen at once); config: the transformers
    config; compute_dtype: the parameters are cast to it inside the compiled functions, as the
    learner does; share_prefill: identical requests share one prefill row; keep_cache: a
    session's next turn continues its KV cache (`clear_cache` after every weight update)."""

    def __init__(self, merge: Callable, params: Callable[[], dict], processor, config, *,
                 seed: int = 0, compute_dtype=None, share_prefill: bool = True,
                 keep_cache: bool = True):
        self.merge, self.params, self.processor, self.config = merge, params, processor, config
        self.compute_dtype, self.share_prefill = compute_dtype, share_prefill
        self.keep_cache = keep_cache
        # the key lives on the host between calls: a device array coming back from a call is
        # placed differently from a fresh one, and the prefill would be traced again for it
        self.key = np.asarray(jax.random.PRNGKey(seed))
        self.image_token_id = int(config.image_token_id)
        self.merge_size = config.vision_config.spatial_merge_size
        placeholders = {config.image_token_id, getattr(config, "video_token_id", None)} - {None}
        self.banned = jnp.asarray(sorted(placeholders), jnp.int32)
        self.compiles = 0  # traces of the prefill and decode functions
        self.decode_steps = 0  # tokens the decode loop sampled per row, summed over calls
        self._prefill = jax.jit(self._prefill_fn, static_argnames=("cache_len", "nucleus"))
        self._decode = jax.jit(self._decode_fn, donate_argnums=1, static_argnames="nucleus")
        self._kept: dict[str, _Kept] = {}  # session -> its row of the latest call's cache
        self._prompts: dict[tuple, _Kept] = {}  # (tokens, images) -> a whole request's row
        self._epoch = 0  # bumped by clear_cache: a generate that overlaps it keeps nothing
        self._cache_len = 0  # the longest cache so far: it never shrinks (fewer shapes)
        self._row_counts = {"requests": set(), "work": set()}  # rows of the calls so far
        self._lengths: set[int] = set()  # new tokens per row of the prefills so far

    def clear_cache(self) -> None:
        """Forget every session's KV cache (stale once the weights change)."""
        self._kept, self._prompts = {}, {}
        self._epoch += 1

    # ---- RNG ---------------------------------------------------------------------------
    def rng_state(self) -> list[int]:
        return [int(x) for x in self.key.reshape(-1)]

    def set_rng_state(self, state: Sequence[int]) -> None:
        self.key = np.asarray(state, np.uint32)

    # ---- compiled pieces ---------------------------------------------------------------
    def _model(self, params):
        if self.compute_dtype is not None:
            params = jax.tree.map(lambda a: a.astype(self.compute_dtype), params)
        return self.merge(params)

    def _prefill_fn(self, params, kept, source, lengths, batch, index, sampling, key,
                    cache_len, nucleus):
        """Run the work rows' new tokens over their caches (row r continues row source[r] of
        `kept`, or starts empty: source -1, kept None), then sample each request's first token;
        request b is work row index[b]."""
        self.compiles += 1  # runs while tracing only
        model = self._model(params)
        dtype = model.model.language_model.embed_tokens.weight.dtype
        cache = empty_cache(model, len(source), cache_len, dtype)
        if kept is not None:  # continuing rows start from their kept rows (slots < lengths)
            fresh = (source < 0)[:, None, None, None]
            take = lambda old, new, axis: jnp.where(fresh, new, _resize(  # noqa: E731
                old[jnp.maximum(source, 0)], cache_len, axis))
            cache = tuple(tuple(take(old, new, axis) for old, new, axis in
                                zip(kept_layer, layer, SLOT_AXIS))
                          for kept_layer, layer in zip(kept, cache))
        logits, cache = extend(model, cache, lengths, batch)
        cache = tuple((k[index], v[index]) for k, v in cache)
        key, sub = jax.random.split(key)
        tokens, logp = sample(logits[index], *sampling, sub, self.banned, nucleus)
        return tokens, logp, cache, key

    def _decode_fn(self, params, cache, tok, logp, first_pos, lengths, sampling, key, stops,
                   budgets, limit, nucleus):
        """Decode on device until every row has finished (a stop token among its `stops` (B, S),
        -1 padded, or its `budgets` (B,) tokens), at most `limit` tokens a row. tok, logp: the
        prefill's first tokens (B,). Token i (>= 1) is sampled after feeding token i - 1 at
        M-RoPE position first_pos + i - 1, cache slot lengths + i - 1. Returns (tokens,
        log-probs (B, L) with the first at 0, tokens sampled per row, the cache, the key)."""
        self.compiles += 1  # runs while tracing only
        model = self._model(params)
        rows, slots = tok.shape[0], cache[0][1].shape[SLOT_AXIS[1]]
        ended = lambda t, count: (t[:, None] == stops).any(axis=1) | (count >= budgets)  # noqa
        ones = jnp.ones(rows, jnp.int32)
        tokens = jnp.zeros((rows, slots), jnp.int32).at[:, 0].set(tok)
        logps = jnp.zeros((rows, slots), jnp.float32).at[:, 0].set(logp)

        def body(state):
            i, cache, tok, tokens, logps, done, count, key = state
            batch = {"input_ids": tok[:, None], "count": ones,
                     "positions": jnp.broadcast_to((first_pos + i - 1)[:, None, None],
                                                   (rows, 3, 1))}
            logits, cache = extend(model, cache, lengths + i - 1, batch)
            key, sub = jax.random.split(key)
            tok, lp = sample(logits, *sampling, sub, self.banned, nucleus)
            count = count + (~done).astype(jnp.int32)
            return (i + 1, cache, tok, tokens.at[:, i].set(tok), logps.at[:, i].set(lp),
                    done | ended(tok, count), count, key)

        state = (jnp.int32(1), cache, tok, tokens, logps, ended(tok, ones), ones, key)
        i, cache, _, tokens, logps, _, _, key = jax.lax.while_loop(
            lambda s: (s[0] < limit) & ~s[5].all(), body, state)
        return tokens, logps, i, cache, key

    # ---- generate ----------------------------------------------------------------------
    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        if not requests:
            return []
        requests, epoch = list(requests), self._epoch
        kept = self._kept
        self._kept = {}  # a failed call leaves no stale rows behind
        n = len(requests)
        work, expand = self._plan(requests, kept, self._prompts)
        kept_cache = next((entry.cache for entry, _, _ in work if entry is not None), None)
        batch, source, lengths, first_pos = self._work_arrays(work)
        rows = self._rows(n, "requests")
        index = np.zeros(rows, np.int32)  # padding rows copy row 0
        index[:n] = expand
        need = max(len(r.input_ids) + r.sampling.max_new_tokens for r in requests)
        self._cache_len = cache_len = max(self._cache_len, bucket(need, LENGTH_UNIT))
        pad = rows - n  # padding rows decode greedily, unread
        sampling = (np.r_[[r.sampling.temperature for r in requests], np.zeros(pad)]
                    .astype(np.float32),
                    np.r_[[r.sampling.top_p for r in requests], np.ones(pad)].astype(np.float32))
        params, nucleus = self.params(), bool((sampling[1] < 1).any())
        tok, lp, cache, key = self._prefill(
            params, kept_cache, source, lengths, batch, index,
            sampling, self.key, cache_len=cache_len, nucleus=nucleus)
        first_pos = first_pos[index]
        stops = np.full((rows, power_of_two(max(len(r.sampling.stop_token_ids)
                                                for r in requests), 1)), -1, np.int32)
        for b, r in enumerate(requests):
            stops[b, :len(r.sampling.stop_token_ids)] = r.sampling.stop_token_ids
        budgets = np.ones(rows, np.int32)  # padding rows: done after their first token
        budgets[:n] = [r.sampling.max_new_tokens for r in requests]
        tokens, logps, steps, cache, key = self._decode(
            params, cache, tok, lp, first_pos, (lengths + batch["count"])[index], sampling,
            key, stops, budgets, np.int32(budgets.max()), nucleus=nucleus)
        self.key = np.asarray(key)
        tokens, logps = np.asarray(tokens), np.asarray(logps)
        decoding = Decoding(requests)  # the rules, applied to what the device loop sampled
        self.decode_steps += int(steps) - 1
        for i in range(int(steps)):
            decoding.add(tokens[:, i], logps[:, i])
        done = decoding.completions()
        if self.keep_cache and epoch == self._epoch:
            self._keep(requests, done, first_pos, cache, [work[w] for w in expand])
        return done

    def _rows(self, n: int, role: str) -> int:
        """Rows for `n` requests (role "requests": the decode loop's batch) or work rows ("work":
        the prefill's): the smallest count of that role used before that holds them and is at
        most `ROW_SLACK` times their power of two, else that power of two."""
        need = power_of_two(n, 1)
        seen = self._row_counts[role]
        rows = min((r for r in seen if need <= r <= ROW_SLACK * need), default=need)
        seen.add(rows)
        return rows

    def _length(self, n: int) -> int:
        """New tokens per row for a prefill of at most `n`: the shortest length used before
        that holds them and is at most `LENGTH_SLACK` times their bucket, else that bucket."""
        need = bucket(n, NEW_TOKENS_UNIT, NEW_TOKENS_RUNGS)
        length = min((t for t in self._lengths if need <= t <= LENGTH_SLACK * need),
                     default=need)
        self._lengths.add(length)
        return length

    def _keep(self, requests, done, first_pos, cache, rows) -> None:
        """Each session's row of the final cache: its request and every generated token but the
        last (the one never fed back), the next position after them; and, when some request
        was prefilled whole (`rows`: each request's work row), each such request's row."""
        for b, (r, c) in enumerate(zip(requests, done)):
            if r.session and c.token_ids:
                self._kept[r.session] = _Kept(
                    b, tuple(r.input_ids) + tuple(c.token_ids[:-1]),
                    int(first_pos[b]) + len(c.token_ids) - 1, len(r.images), cache)
        whole = {key: b for b, (entry, _, key) in enumerate(rows) if entry is None}
        if whole:
            self._prompts = {key: _Kept(b, tuple(requests[b].input_ids), int(first_pos[b]),
                                        len(requests[b].images), cache)
                             for key, b in whole.items()}

    def _plan(self, requests: list[Request], kept: dict, prompts: dict | None = None
              ) -> tuple[list, list[int]]:
        """The work rows and each request's row among them. A request whose session's kept
        cache holds a strict prefix of it, with no image token after it, continues that row;
        one equal to a request prefilled whole before (`prompts`: (tokens, images) -> its
        `_Kept` row) continues that one, when no session continues another cache; the others
        are prefilled whole. Requests with equal tokens and images and no session to continue
        share one row (`share_prefill`). A work row: (the `_Kept` entry it continues or None,
        request, (tokens, images) key or None)."""
        def session_of(r):
            entry = kept.get(r.session) if r.session else None
            ids = tuple(r.input_ids)
            if (entry is not None and len(entry.ids) < len(ids)
                    and ids[:len(entry.ids)] == entry.ids and len(r.images) == entry.images
                    and self.image_token_id not in ids[len(entry.ids):]):
                return entry
            return None
        sessions = [session_of(r) for r in requests]
        source = next((entry.cache for entry in sessions if entry is not None), None)
        work, expand, seen = [], [], {}
        for r, entry in zip(requests, sessions):
            if entry is not None:
                expand.append(len(work))
                work.append((entry, r, None))
                continue
            key = (np.asarray(r.input_ids, np.int64).tobytes(),
                   tuple(image_key(im) for im in r.images))
            if not self.share_prefill or key not in seen:
                entry = (prompts or {}).get(key)
                if entry is not None and (source is None or entry.cache is source):
                    source = entry.cache
                else:
                    entry = None
                seen[key] = len(work)
                work.append((entry, r, key))
            expand.append(seen[key])
        return work, expand

    def _work_arrays(self, work: list):
        """(batch of new tokens for `extend`, kept row per work row (-1: none), cached tokens
        per row, the first generated token's M-RoPE position per row), rows and new-token
        length bucketed; rows past the work hold one pad token."""
        fresh = [r for entry, r, _ in work if entry is None]
        prompts = self._prompt_rows(fresh)
        n_rows = self._rows(len(work), "work")
        # a continued row's cached tokens: all of its entry's, or all but the last when the
        # request is no longer (the last is prefilled again, to give its logits)
        cached = [min(len(entry.ids), len(r.input_ids) - 1) if entry else 0
                  for entry, r, _ in work]
        news = [np.asarray(r.input_ids[c:], np.int64) for (_, r, _), c in zip(work, cached)]
        length = self._length(max(map(len, news)))
        batch = {"input_ids": np.zeros((n_rows, length), np.int32),
                 "positions": np.zeros((n_rows, 3, length), np.int32),
                 "count": np.ones(n_rows, np.int32)}
        source, lengths = np.full(n_rows, -1, np.int32), np.zeros(n_rows, np.int32)
        first_pos = np.zeros(n_rows, np.int32)
        image_rows, f = [None] * n_rows, 0
        for b, ((entry, r, _), ids, c) in enumerate(zip(work, news, cached)):
            if entry is None:
                pos, image_rows[b] = prompts[f]
                f += 1
            else:  # text after the cached tokens: M-RoPE positions count on from theirs
                first = entry.next_pos - (len(entry.ids) - c)
                pos = np.broadcast_to(first + np.arange(len(ids)), (3, len(ids)))
                source[b], lengths[b] = entry.row, c
            batch["input_ids"][b, :len(ids)] = ids
            batch["positions"][b, :, :len(ids)] = pos
            batch["count"][b] = len(ids)
            first_pos[b] = int(pos.max()) + 1
        patches = max((len(row.pixel_values) for row in image_rows if row is not None),
                      default=0)
        if patches:
            n_patches = bucket(patches, PATCH_UNITS * self.merge_size ** 2)
            padded = [pad_patches(row, self.config, n_patches, length) for row in image_rows]
            batch["pixel_values"] = np.stack([p["pixel_values"] for p in padded])
            batch["visual_index"] = np.stack([p["visual_index"] for p in padded])
            batch["vision"] = {k: np.stack([p["vision"][k] for p in padded])
                               for k in padded[0]["vision"]}
        return batch, source, lengths, first_pos

    def _prompt_rows(self, requests: list[Request]) -> list[tuple]:
        """(M-RoPE positions (3, t), image row for `pad_patches` or None) of whole requests,
        each distinct image (by content) through the processor once."""
        images = [im for r in requests for im in r.images]
        keys = [image_key(im) for im in images]
        first_of: dict = {}
        for i, k in enumerate(keys):
            first_of.setdefault(k, i)
        slot = {k: j for j, k in enumerate(first_of)}
        imgs = image_inputs(self.processor, [images[i] for i in first_of.values()])
        grids = imgs.get("image_grid_thw", np.zeros((0, 3), np.int64))
        bounds = np.concatenate([[0], np.cumsum(grids.prod(axis=1))]).astype(int)
        out, first = [], 0
        for r in requests:
            which = [slot[k] for k in keys[first:first + len(r.images)]]
            first += len(r.images)
            ids = np.asarray(r.input_ids, np.int64)
            pos = mrope_position_ids(ids, self.image_token_id, grids[which], self.merge_size)
            row = None
            if which:
                row = HostRow(batch=None, positions=None, prefix=None, weights=None,
                              targets=None, pixel_values=np.concatenate(
                                  [imgs["pixel_values"][bounds[j]:bounds[j + 1]]
                                   for j in which]).astype(np.float32),
                              vision=vision_aux(self.config.vision_config, grids[which]),
                              visual_index=np.flatnonzero(ids == self.image_token_id)
                              .astype(np.int32))
            out.append((pos, row))
        return out


@dataclasses.dataclass(frozen=True)
class _Kept:
    """A row of a kept cache: the tokens in it, the next token's position, the request's image
    count, the cache (a tuple over layers, as `_decode` returns it)."""

    row: int
    ids: tuple
    next_pos: int
    images: int
    cache: tuple = dataclasses.field(repr=False, compare=False)


def power_of_two(n: int, unit: int) -> int:
    """The smallest unit x 2^k >= n: the engine's rows (coarser than
    `geo3k_jax.buckets.bucket`: every row count compiles the prefill and the decode step)."""
    return unit * 2 ** max(0, math.ceil(math.log2(max(n, 1) / unit)))


def _resize(cache: jax.Array, length: int, axis: int) -> jax.Array:
    """Cache rows cut or zero-padded to `length` slots along their slot `axis`."""
    if cache.shape[axis] >= length:
        return jax.lax.slice_in_dim(cache, 0, length, axis=axis)
    pad = [(0, 0)] * cache.ndim
    pad[axis] = (0, length - cache.shape[axis])
    return jnp.pad(cache, pad)
