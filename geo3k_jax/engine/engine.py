"""The in-process JAX rollout engine: a fixed number of decode slots, refilled as rows finish.

`JaxEngine` implements `common.engine.AsyncEngine` on the project's Flax Qwen-VL with the
semantics of the torch `geo3k_torch.engine.LocalEngine`: a request's new tokens are prefilled
(its images through the vision tower, DeepStack features, explicit 3-D M-RoPE positions from
`common.mrope`), then decoded token by token over its slot of the KV cache
(`geo3k_jax.engine.decode`: the prefill and the decode step are the same function). The decode
position continues the request's M-RoPE positions: max + 1, then + 1 per token. A token's log-prob
is log_softmax(logits / T) of the raw logits (T = 0: greedy, log_softmax(logits)), before top-p;
image and video placeholders are never sampled; a request ends at a stop token (kept as its last
token) or at `max_new_tokens`.

Slots (continuous batching, as MaxText's prefill/insert/generate and tunix's sampler):

    waiting requests ──admit──> prefill (new tokens only) ──insert──> slot s of the cache
    decode: every live slot one token a step, on device, until some row finishes ──> its future
    a finished slot is parked: it keeps its tokens' keys and values for the session's next turn

The cache has `slots` rows of `context` tokens (sharded by slot over the mesh's data axes and by
KV head over its tensor axis, `cache_specs`). A request is admitted to a non-decoding slot: its
session's own parked slot when that holds a prefix of it with no image token after it (only the
new tokens are prefilled), else a parked slot holding at least half of it (the same prompt: an
evaluation's sampled episodes after its greedy ones), else an empty slot, else the least recently
used parked one (that session's next turn is prefilled whole again: evicted). A request that
came by `submit` (per-episode scheduling: the episode's next turn follows its answer within
milliseconds) has its slot held `RESERVE_STEPS` decode steps after it while other slots decode,
and the next turn goes on in it ahead of new sessions waiting: prefilling it whole again costs
far more than a slot idle for a chunk. `generate`'s requests (lock-step: no next turn before
the whole list is back) hold nothing.
Requests with the same tokens and images admitted together (a GRPO group's first turn) share
one prefill row.
`submit` queues a request and returns a future (`rollout.schedule=episode`: each episode sends its
next turn as soon as its own is back); `generate` submits a list and waits (lock-step). A driver
thread runs the loop while there is work.

Every request samples from its own key, fold_in(fold_in(engine key, crc of (weights' version,
session, length, occurrence)), token index): its tokens do not depend on which slot, batch,
schedule or device layout served it. `clear_cache` (after every weight update) forgets the parked
slots; given the new weights' version (the learner's step), it starts counting occurrences
afresh. `rng_state` holds the key, the version and the counts, so a resumed run that syncs the
weights it saved with samples what the uninterrupted run sampled after them. A decode step
reads only the cache pages its live slots hold (`geo3k_jax.kernels.ragged`): its cost follows each
slot's own length, not the longest row's nor the capacity.

Three compiled functions take the parameters as an argument (new weights never recompile):
the prefill (the admitted requests' work rows: their new tokens' keys and values, read over
the cache, and each request's first token), the insert (the new keys and values into their
slots; donates the cache) and the decode chunk (a `lax.while_loop` of at most `DECODE_CHUNK`
steps that stops when a row finishes; donates the cache). Their shapes come from the config
alone (`compile_set`): a prefill's new tokens are a rung of `token_rungs` and its rows one or
`prefill_rows` (`prefill_ladder`), its images as many patches as its image tokens could be;
how far it reads the cache (the longest row's cached tokens), whether a request samples from a
nucleus and how many requests it serves are values, not shapes. So a run compiles a bounded
set, `warm_up` all of it at start (`engine.warm_up`); `compiles` counts the traces.

Built to record its routing (`record_routing`, a mixture-of-experts model: routing replay),
the prefill and the decode also return the experts each fed token was routed to in every
sparse layer, and each completion carries them (`common.engine.Completion.routed_experts`):
the rows of the tokens a request kept in its slot's cache are those recorded when they were
computed (a parked slot keeps them with its keys), then the prefill's, then one a decode step.
Built without, the compiled programs are the ones they always were.
"""

from __future__ import annotations

import collections
import concurrent.futures
import time
import dataclasses
import math
import threading
import zlib
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from common.engine import STOP, LENGTH, Completion, FatalEngineError, Request
from common.mrope import mrope_position_ids
from common.processor import image_inputs, image_key
from geo3k_jax.core.batch import HostRow, pad_patches
from geo3k_jax.core.buckets import bucket
from geo3k_jax.engine.decode import decode, prefill
from geo3k_jax.engine.kv_budget import (CacheShape, allocator, cache_shardings, cache_specs,
                                 check_kv_budget)
from geo3k_jax.kernels.ragged import (PAGE, TABLE_UNIT, kernel_attention, page_table,
                              paged_attention)
from geo3k_jax.core.sharding import make_mesh
from geo3k_jax.core.vision_grid import vision_aux
from geo3k_jax.models.moe import routing_shape

LENGTH_UNIT = 128  # the cache's capacity is a multiple of this
NEW_TOKENS_UNIT = 32  # a prefill's new tokens (a whole prompt, or a turn's feedback) are this
# times a power of two (or the whole context): one compile each, all of them at start
CACHE_BLOCK = 512  # a prefill reads the cached tokens in blocks of this many (or fewer)
DRAW_BLOCK = 128  # `draw` picks a block of this many token ids, then a token in it
DECODE_CHUNK = 32  # decode steps per device call at most (fewer when a row finishes)
RESERVE_STEPS = DECODE_CHUNK  # decode steps a parked session's slot waits for its next turn
MAX_STOPS = 32  # stop tokens a request may have


def sample(logits: jax.Array, temperature: jax.Array, top_p: jax.Array, key: jax.Array,
           banned: jax.Array, nucleus=True) -> tuple[jax.Array, jax.Array]:
    """One token per row, as `geo3k_torch.engine.sample`. logits: (B, V) fp32 raw; temperature,
    top_p: (B,); banned: ids never sampled; nucleus: () bool, whether some row has top_p < 1
    (else the sort is skipped at run time: one program either way). Returns (tokens (B,)
    int32, log-probs (B,) under log_softmax(logits / T); greedy rows (T = 0) report
    log_softmax(logits))."""
    greedy = temperature <= 0
    t = jnp.where(greedy, 1.0, temperature)[:, None]
    logp = jax.nn.log_softmax(logits / t, axis=-1)
    logits = logits.at[:, banned].set(-jnp.inf)

    def in_nucleus(scaled):
        probs = jax.nn.softmax(scaled, axis=-1)
        order = jnp.argsort(-probs, axis=-1)  # descending
        sorted_p = jnp.take_along_axis(probs, order, axis=-1)
        before = jnp.cumsum(sorted_p, axis=-1) - sorted_p  # mass strictly above each token
        keep_sorted = (before < top_p[:, None]) | (top_p[:, None] >= 1)
        rows = jnp.arange(logits.shape[0])[:, None]
        keep = jnp.zeros_like(keep_sorted).at[rows, order].set(keep_sorted)
        return jnp.where(keep, scaled, -jnp.inf)
    drawn = draw(key, jax.lax.cond(nucleus, in_nucleus, lambda s: s, logits / t))
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


def sample_rows(logits: jax.Array, temperature: jax.Array, top_p: jax.Array, keys: jax.Array,
                banned: jax.Array, nucleus) -> tuple[jax.Array, jax.Array]:
    """`sample` with a key per row: keys (B, 2) uint32. Returns (tokens (B,), log-probs (B,))."""
    one = lambda lg, t, p, k: sample(lg[None], t[None], p[None], k, banned, nucleus)  # noqa
    tokens, logp = jax.vmap(one)(logits, temperature, top_p, keys)
    return tokens[:, 0], logp[:, 0]


def row_keys(key: jax.Array, seeds: jax.Array, index: jax.Array) -> jax.Array:
    """(B, 2) keys: token `index` (B,) of the request seeded `seeds` (B,) uint32."""
    return jax.vmap(lambda s, i: jax.random.fold_in(jax.random.fold_in(key, s), i))(
        seeds, index)


@dataclasses.dataclass
class _Job:
    """A request in flight: its future, seed, and what it sampled so far."""

    request: Request
    future: concurrent.futures.Future
    seed: int
    first_pos: int = 0  # the M-RoPE position of its first generated token
    hold: bool = False  # submitted alone: its session's next turn may follow at once
    tokens: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    routing: list = dataclasses.field(default_factory=list)  # (n, L, K) pieces, fed positions


@dataclasses.dataclass
class _Slot:
    """One row of the cache: the tokens it holds (a parked session: its request and all its
    generated tokens but the last), the position after them, its images, whose it is."""

    ids: tuple = ()
    next_pos: int = 0
    images: tuple = ()
    session: str = ""
    used: int = 0  # when it last finished a request (least recently used is evicted first)
    held_until: int = 0  # the engine's decode steps until which it waits for a next turn
    epoch: int = 0  # the `clear_cache` epoch its keys were computed in
    job: _Job | None = None  # the request decoding in it
    routing: np.ndarray | None = None  # (len(ids), L, K): the experts of its tokens, recorded


class JaxEngine:
    """Samples from `merge(params())` in process (see the module docstring).

    merge: `geo3k_jax.models.model.split_params`'s; params: returns the current parameter dict (read
    at every device call; weights change only between rollouts); config: the transformers config;
    compute_dtype: the parameters are cast to it inside the compiled functions, and the cache
    holds it; slots: requests decoding at once (cache rows); context: the most tokens (request
    and new ones) a slot holds; mesh: the cache's devices (None: the default device);
    share_prefill: identical requests admitted together share one prefill row; keep_cache: a
    session's next turn continues its parked slot (off: every request is prefilled whole);
    memory_fraction: of a device's `memory` (None: as the device reports it) the cache and
    weights may use (`check_kv_budget`); prefill_rows, prefill_tokens: the largest prefill
    (`prefill_ladder`; 0: the slots, the context): at most `prefill_rows` work rows of at most
    `prefill_tokens` new tokens each, and a request with more new tokens (a long prompt, a
    session evicted from its slot and prefilled whole) goes in a prefill of its own; a
    prefill of several rows runs `prefill_rows` of them (padding: one shape); record_routing:
    each completion carries its routed experts (module docstring; a mixture-of-experts
    model)."""

    def __init__(self, merge: Callable, params: Callable[[], dict], processor, config, *,
                 seed: int = 0, compute_dtype=None, slots: int = 8, context: int = 1024,
                 mesh=None, share_prefill: bool = True, keep_cache: bool = True,
                 memory_fraction: float = 0.9, memory: int | None = None,
                 prefill_rows: int = 0, prefill_tokens: int = 0, record_routing: bool = False):
        if record_routing and routing_shape(config) is None:
            raise ValueError("record_routing: the model has no sparse (mixture-of-experts) "
                             "layer to record the routing of")
        self.record = record_routing
        self.merge, self.params, self.processor, self.config = merge, params, processor, config
        self.compute_dtype, self.share_prefill = compute_dtype, share_prefill
        if prefill_rows < 0 or prefill_tokens < 0:
            raise ValueError(f"engine.prefill_rows ({prefill_rows}) and engine.prefill_tokens "
                             f"({prefill_tokens}) must be >= 0 (0: the slots, the context)")
        # without a mesh, a one-device one: the cache keeps one sharding from call to call
        # (one the programs' outputs would otherwise pick anew: traced again)
        self.keep_cache = keep_cache
        self.mesh = mesh or make_mesh({"data": 1, "fsdp": 1, "tensor": 1},
                                      jax.local_devices()[:1])
        if slots < 1 or context < 2:
            raise ValueError(f"engine.slots ({slots}) must be >= 1 and the context ({context}) "
                             ">= 2 tokens")
        self.n_slots, self.capacity = slots, -(-context // LENGTH_UNIT) * LENGTH_UNIT
        self.prefill_rows = min(prefill_rows or slots, slots)
        self.prefill_tokens = min(prefill_tokens or self.capacity, self.capacity)
        self.block = math.gcd(self.capacity, CACHE_BLOCK)
        self.shape = CacheShape.of(config)
        some = params()
        self.dtype = compute_dtype or next(iter(some.values())).dtype
        # with the splash attention (`geo3k_jax.kernels.splash`) the decode attends through the
        # Pallas paged attention kernel (interpret mode off TPU) where its TPU lowering takes the
        # head dim (a multiple of 128, the Qwen-VL models' 128), else in XLA (`_paged`)
        self.attention = merge(some).model.language_model.attention
        self.kernel = self.attention.splash and (self.attention.interpret
                                                 or self.shape.head_dim % 128 == 0)
        weight_bytes = sum(a.size for a in some.values()) * np.dtype(self.dtype).itemsize
        self.cache_bytes = check_kv_budget(self.shape, slots, self.capacity, self.dtype, self.mesh,
                                           weight_bytes, memory, memory_fraction)
        # the key lives on the host between calls (a device array coming back from a call is
        # placed differently from a fresh one, and would trace the programs again)
        self.key = np.asarray(jax.random.PRNGKey(seed))
        self.image_token_id = int(config.image_token_id)
        self.merge_size = config.vision_config.spatial_merge_size
        placeholders = {config.image_token_id, getattr(config, "video_token_id", None)} - {None}
        self.banned = jnp.asarray(sorted(placeholders), jnp.int32)
        self.compiles = 0  # traces of the prefill, insert and decode functions
        self._traces = threading.Lock()  # `warm_up` traces in several threads
        self.decode_steps = 0  # decode steps run, summed over calls
        self.prefilled = 0  # tokens prefilled (real ones, not padding)
        self.prefill_steps = 0  # a prefill call's longest row's new tokens, summed over calls
        self.evictions = 0  # parked sessions whose slot another request took
        self._shardings = cache_shardings(self.mesh, self.shape, slots)
        self._prefill = jax.jit(self._prefill_fn)
        self._insert = jax.jit(self._insert_fn, donate_argnums=0,
                               out_shardings=self._shardings)
        self._decode = jax.jit(self._decode_fn, donate_argnums=1)
        spec = cache_specs(self.mesh, self.shape, slots)
        self._data_shards = math.prod(self.mesh.shape[a] for a in spec[2])
        self._cache = None  # allocated at the first request (and again after `free`)
        self._allocate = allocator(self.shape, slots, self.capacity, self.dtype, self.mesh)
        self.frees = 0  # times `free` released the cache
        self._slots = [_Slot() for _ in range(slots)]
        self._state = self._empty_state()
        self._waiting: collections.deque[_Job] = collections.deque()
        self.version = 0  # of the weights: enters every request's key
        self._seen: collections.Counter = collections.Counter()  # (session, length) this version
        self._epoch, self._tick = 0, 0
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def _empty_state(self) -> dict:
        """Per-slot decode state on the host: the token to feed, its M-RoPE position and cache
        slot, whether the row decodes, tokens sampled, budget, stops, sampling, seed."""
        n = self.n_slots
        return {"tok": np.zeros(n, np.int32), "pos": np.zeros(n, np.int32),
                "length": np.zeros(n, np.int32), "live": np.zeros(n, bool),
                "count": np.zeros(n, np.int32), "budget": np.ones(n, np.int32),
                "stops": np.full((n, MAX_STOPS), -1, np.int32),
                "temperature": np.zeros(n, np.float32), "top_p": np.ones(n, np.float32),
                "seed": np.zeros(n, np.uint32)}

    # ---- the protocol ------------------------------------------------------------------
    def submit(self, request: Request) -> concurrent.futures.Future:
        """A future of the request's `Completion`; the driver thread serves it. Its slot is
        then held for the session's next turn (`RESERVE_STEPS`)."""
        return self._submit([request], hold=True)[0]

    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        """All requests queued at once (admitted in order, as slots allow), then awaited."""
        return [f.result() for f in self._submit(list(requests))]

    def _submit(self, requests: list[Request],
                hold: bool = False) -> list[concurrent.futures.Future]:
        jobs = []
        for r in requests:
            future, s = concurrent.futures.Future(), r.sampling
            jobs.append(_Job(r, future, 0, hold=hold))
            if len(r.input_ids) + s.max_new_tokens > self.capacity:
                future.set_exception(FatalEngineError(
                    f"a request of {len(r.input_ids)} tokens + max_new_tokens="
                    f"{s.max_new_tokens} exceeds the JAX engine's context of {self.capacity} "
                    "tokens (rollout.max_context_tokens)"))
            elif len(s.stop_token_ids) > MAX_STOPS:
                future.set_exception(FatalEngineError(
                    f"{len(s.stop_token_ids)} stop tokens; the JAX engine takes {MAX_STOPS}"))
        with self._lock:
            for job in jobs:
                if job.future.done():
                    continue
                r = job.request
                ident = (r.session, len(r.input_ids))  # the n-th such request this version
                job.seed = zlib.crc32(
                    f"{self.version}|{r.session}|{ident[1]}|{self._seen[ident]}".encode())
                self._seen[ident] += 1
                self._waiting.append(job)
            if self._thread is None and self._waiting:
                self._thread = threading.Thread(target=self._drive, daemon=True,
                                                name="jax-engine")
                self._thread.start()
        return [job.future for job in jobs]

    def clear_cache(self, version: int | None = None) -> None:
        """Forget every parked slot (stale once the weights change). version: the new weights'
        (None: unchanged); a new one starts counting requests afresh, the current one (a
        resumed run syncing the weights its `rng_state` was saved with) goes on counting."""
        with self._lock:
            self._epoch += 1
            if version is not None and version != self.version:
                self.version = version
                self._seen.clear()
            for slot in self._slots:
                if slot.job is None:
                    slot.ids, slot.session = (), ""

    def free(self) -> None:
        """Release the KV cache's device memory now (between rollouts: `JaxBackend`'s
        `jax.free_engine`, around the learner's step); the next request allocates it again,
        same shapes and shardings, so nothing is compiled anew. Every parked slot is forgotten
        (its keys go with the cache). Raises while a request is in flight or waiting."""
        with self._lock:
            if self._waiting or self._state["live"].any():
                raise RuntimeError("JaxEngine.free with requests in flight: the cache is "
                                   "freed only between rollouts (train.max_staleness = 0)")
        self.close()  # the idle driver thread's last look at the queue
        with self._lock:
            self._epoch += 1
            for slot in self._slots:
                slot.ids, slot.session = (), ""
            if self._cache is not None:
                for a in self._cache:
                    a.delete()
                self._cache = None
                self.frees += 1

    def close(self) -> None:
        """Stop the driver thread (it exits by itself when idle too)."""
        thread = self._thread
        if thread is not None:
            thread.join()

    # ---- RNG ---------------------------------------------------------------------------
    def rng_state(self) -> dict:
        """{"key": the raw uint32[2] key, "version", "seen": [[session, length, count], ...]}
        (JSON)."""
        with self._lock:
            return {"key": [int(x) for x in self.key.reshape(-1)], "version": self.version,
                    "seen": [[s, n, c] for (s, n), c in sorted(self._seen.items())]}

    def set_rng_state(self, state: dict) -> None:
        """Restore what `rng_state` returned."""
        with self._lock:
            self.key = np.asarray(state["key"], np.uint32)
            self.version = int(state["version"])
            self._seen = collections.Counter({(s, n): c for s, n, c in state["seen"]})

    # ---- the driver --------------------------------------------------------------------
    def _drive(self) -> None:
        """Admit, prefill, decode a chunk, hand finished rows back; exit when nothing is left."""
        while True:
            with self._lock:
                if not self._waiting and not self._state["live"].any():
                    self._thread = None
                    return
            try:
                while self._admit():
                    pass
                if self._state["live"].any():
                    self._decode_chunk()
            except BaseException as e:  # noqa: BLE001 - every waiting caller gets it
                self._fail(e)

    def _fail(self, error: BaseException) -> None:
        """Fail every request in flight or waiting; start over with an empty cache."""
        with self._lock:
            jobs = [s.job for s in self._slots if s.job] + list(self._waiting)
            self._waiting.clear()
            self._slots = [_Slot() for _ in range(self.n_slots)]
            self._state, self._cache = self._empty_state(), None
        for job in jobs:
            if not job.future.done():
                job.future.set_exception(error)

    # ---- admission ---------------------------------------------------------------------
    def _continues(self, slot: _Slot, r: Request, images: tuple) -> int:
        """How many of the slot's tokens `r` may keep (0: none): a common prefix, at most all of
        r but its last token (prefilled again for its logits), holding every image token of the
        slot, with none in r's new part."""
        if not self.keep_cache or not slot.ids or slot.images != images \
                or slot.epoch != self._epoch:
            return 0
        ids = tuple(r.input_ids)
        n = min(len(slot.ids), len(ids) - 1)
        a, b = np.asarray(slot.ids[:n]), np.asarray(ids[:n])
        diff = np.flatnonzero(a != b)
        c = int(diff[0]) if len(diff) else n
        if self.image_token_id in slot.ids[c:] or self.image_token_id in ids[c:]:
            return 0
        return c

    def _own_slot(self, r: Request, taken: set) -> int | None:
        """The non-decoding slot not `taken` that r's session parked, if any."""
        return next((i for i, s in enumerate(self._slots) if s.job is None and i not in taken
                     and r.session and s.session == r.session), None)

    def _pick(self, r: Request, images: tuple, taken: set) -> tuple[int, int] | None:
        """(slot, tokens it keeps) for r among the non-decoding slots not `taken`, or None."""
        own = self._own_slot(r, taken)
        if own is not None:
            return own, self._continues(self._slots[own], r, images)
        free = [i for i, s in enumerate(self._slots) if s.job is None and i not in taken]
        if not free:
            return None
        best = max(free, key=lambda i: self._continues(self._slots[i], r, images))
        kept = self._continues(self._slots[best], r, images)
        if kept * 2 >= len(r.input_ids):
            return best, kept
        empty = [i for i in free if not self._slots[i].ids]
        if empty:
            return empty[0], 0
        # another session's parked slot: held for its next turn while others decode
        idle = not self._state["live"].any()
        ready = [i for i in free if idle or self.decode_steps >= self._slots[i].held_until]
        if not ready:
            return None
        return min(ready, key=lambda i: self._slots[i].used), 0

    def _admit(self) -> bool:
        """Move waiting requests into slots, prefill them and insert their rows: in order
        while slots are left, and after that any request whose session's parked slot is free
        (a next turn goes on in its own slot ahead of new sessions); a prefill's rows and new
        tokens within `prefill_ladder`. Returns whether the prefill was full (more may be
        admitted at once)."""
        admitted, taken, kept, blocked, full = [], set(), collections.deque(), False, False
        keys, rows = [], set()  # each admitted request's work row (`_row_key`); the distinct
        with self._lock:
            while self._waiting and not full:
                job = self._waiting.popleft()
                r = job.request
                choice = None
                if not blocked or self._own_slot(r, taken) is not None:
                    images = tuple(image_key(im) for im in r.images)
                    choice = self._pick(r, images, taken)
                if choice is not None:
                    key = self._row_key(r, images, choice[1], len(admitted))
                    long = len(r.input_ids) - choice[1] > self.prefill_tokens
                    if (long and admitted) or (key not in rows and len(rows) == self.prefill_rows):
                        choice, full = None, True  # in the next prefill, in its turn
                    else:
                        full = long  # a long row goes alone
                if choice is None:
                    blocked = True
                    kept.append(job)
                    continue
                keys.append(key)
                rows.add(key)
                taken.add(choice[0])
                admitted.append((job, images) + choice)
                self._slots[choice[0]].job = job  # in flight: `_fail` finds it
            kept.extend(self._waiting)
            self._waiting = kept
            epoch = self._epoch
        if not admitted:
            return False
        for job, _, s, kept in admitted:  # a parked session whose keys are overwritten
            slot = self._slots[s]
            self.evictions += bool(slot.ids) and (slot.session != job.request.session
                                                  or kept == 0)
        self._prefill_admitted(admitted, keys, epoch)
        return full

    def _row_key(self, r: Request, images: tuple, kept: int, n: int):
        """The work row a request admitted `n`-th with `kept` cached tokens prefills in: equal
        fresh requests share one (`share_prefill`), any other has its own."""
        if kept == 0 and self.share_prefill:
            return (np.asarray(r.input_ids, np.int64).tobytes(), images)
        return n

    # ---- the compile set ---------------------------------------------------------------
    def prefill_ladder(self) -> list[tuple[int, int]]:
        """(work rows, new tokens) of every prefill the engine runs: new tokens
        NEW_TOKENS_UNIT x 2^k (or the whole context), in one row or, up to `prefill_tokens`'
        rung, in `prefill_rows` rows; fewer rows or tokens are padding. The attention's reach
        over the cached tokens is no shape (`geo3k_jax.engine.decode.prefill`)."""
        top, out = self._rung(self.prefill_tokens), []
        for tokens in token_rungs(self.capacity):
            if self.prefill_rows > 1 and tokens <= top:
                out.append((self.prefill_rows, tokens))
            out.append((1, tokens))
        return out

    def compile_set(self) -> list[tuple]:
        """Every program the engine runs, one compile each: ("prefill", rows, tokens, with
        images) and ("insert", rows, tokens) for each `prefill_ladder` shape, ("decode", pages)
        for each page-table size of the XLA decode (`geo3k_jax.kernels.ragged.page_table`'s buckets;
        pages 0: the Pallas kernel's one program, which takes no table)."""
        out = []
        for rows, tokens in self.prefill_ladder():
            out += [("prefill", rows, tokens, False), ("prefill", rows, tokens, True),
                    ("insert", rows, tokens)]
        per_shard = self.n_slots // self._data_shards * self.capacity // PAGE
        return out + [("decode", n) for n in ([0] if self.kernel else table_rungs(per_shard))]

    def prefill_shapes(self) -> list[tuple[int, int]]:
        """(work rows, new tokens) of the largest prefills (`geo3k_jax.tpu.engine_aot` compiles
        them): `prefill_rows` rows at `prefill_tokens`' rung, one row of the whole context."""
        ladder = self.prefill_ladder()
        return sorted({max(ladder), (1, max(t for _, t in ladder))}, reverse=True)

    def warm_up(self, workers: int = 8) -> tuple[int, float]:
        """Compile every program of `compile_set` for the arguments a request gives it, in
        `workers` threads (XLA compiles without the GIL), running none: after this no request
        waits for a compile. Returns (programs compiled, seconds)."""
        t0, before = time.perf_counter(), self.compiles
        if self._cache is None:
            self._cache = self._allocate()
        params, cache = self.params(), self._cache
        dest = np.full(self.n_slots, self.n_slots, np.int32)  # every request: nowhere

        def prefills(rows: int, tokens: int):  # both prefills, then the insert of their rows
            for images in (False, True):
                work = self._dummy_work(rows, tokens, images)
                compiled = self._prefill.lower(params, cache, *self._prefill_args(
                    work, [], [], [])).compile()
            rows_out = compiled.output_shardings[2]
            abstract = jax.tree.map(lambda o, sh: jax.ShapeDtypeStruct(o.shape, o.dtype,
                                                                       sharding=sh),
                                    compiled.out_info[2], rows_out)
            self._insert.lower(cache, abstract, dest, np.zeros(self.n_slots, np.int32),
                               work[2]).compile()

        def decodes(pages: int):
            table = None if pages == 0 else np.full((self._data_shards, pages), -1, np.int32)
            self._decode.lower(params, cache, self._decode_arrays(), table, self.key).compile()

        jobs = [(prefills, shape) for shape in self.prefill_ladder()]
        jobs += [(decodes, (p[1],)) for p in self.compile_set() if p[0] == "decode"]
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            for f in [pool.submit(fn, *args) for fn, args in jobs]:
                f.result()
        return self.compiles - before, time.perf_counter() - t0

    def _traced(self) -> None:
        """Count a trace of a compiled function (each one compile)."""
        with self._traces:
            self.compiles += 1

    def _rung(self, tokens: int) -> int:
        """The prefill ladder's new tokens for `tokens` new tokens."""
        return min(power_of_two(tokens, NEW_TOKENS_UNIT), self.capacity)

    # ---- prefill and insert --------------------------------------------------------------
    def _prefill_args(self, work: tuple, expand, jobs: list, seeds: list) -> tuple:
        """The prefill's arguments after (params, cache): the work rows' arrays (`_work_arrays`)
        and, for each of `n_slots` requests (the first len(jobs) real), its work row, its
        sampling and its seed."""
        batch, source, lengths = work[:3]
        pad = self.n_slots - len(jobs)
        index = np.r_[expand, np.zeros(pad, int)].astype(np.int32)
        sampling = (np.r_[[j.request.sampling.temperature for j in jobs], np.zeros(pad)]
                    .astype(np.float32),
                    np.r_[[j.request.sampling.top_p for j in jobs], np.ones(pad)]
                    .astype(np.float32))
        return (source, lengths, batch, index, sampling,
                np.r_[seeds, np.zeros(pad)].astype(np.uint32), self.key)

    def _prefill_admitted(self, admitted: list, keys: list, epoch: int) -> None:
        """Prefill the admitted requests' new tokens (work rows shared by equal requests: the
        same `keys`), sample their first tokens, insert the rows into their slots."""
        work, expand, seen = [], [], {}
        for (job, _, s, kept), key in zip(admitted, keys):
            r = job.request
            if key in seen:
                expand.append(seen[key])
                continue
            seen[key] = len(work)
            expand.append(len(work))
            work.append((r, s, kept))
        arrays = self._work_arrays(work)
        batch, source, lengths, first_pos, real = arrays
        jobs = [a[0] for a in admitted]
        dest = np.r_[[a[2] for a in admitted],
                     np.full(self.n_slots - len(jobs), self.n_slots)].astype(np.int32)
        if self._cache is None:
            self._cache = self._allocate()
        args = self._prefill_args(arrays, expand, jobs, [j.seed for j in jobs])
        tok, lp, rows, tops = self._prefill(self.params(), self._cache, *args)
        self._cache = self._insert(self._cache, rows, dest, args[3], lengths)
        tok, lp = np.asarray(tok), np.asarray(lp)
        tops = None if tops is None else np.asarray(tops)  # (W, T, L, K) the new tokens
        self.prefilled += real
        self.prefill_steps += int(batch["count"].max())
        st = self._state
        for b, (job, images, s, kept) in enumerate(admitted):
            r, w = job.request, expand[b]
            job.first_pos = int(first_pos[w])
            slot = self._slots[s]
            if tops is not None:  # the kept tokens' rows (recorded then), the new tokens'
                job.routing = ([slot.routing[:kept]] if kept else []) + [
                    tops[w, :batch["count"][w]]]
            slot.ids, slot.images, slot.session = tuple(r.input_ids), images, r.session
            slot.epoch = epoch
            st["tok"][s], st["pos"][s] = tok[b], first_pos[w]
            st["length"][s] = lengths[w] + batch["count"][w]
            st["count"][s], st["budget"][s] = 0, r.sampling.max_new_tokens
            st["stops"][s] = -1
            st["stops"][s, :len(r.sampling.stop_token_ids)] = r.sampling.stop_token_ids
            st["temperature"][s], st["top_p"][s] = r.sampling.temperature, r.sampling.top_p
            st["seed"][s] = job.seed
            st["live"][s] = True
            self._take(s, tok[b], lp[b])

    def _take(self, s: int, token: int, logprob: float) -> None:
        """Slot s sampled `token`: record it; finish the request at a stop or its budget."""
        st, job = self._state, self._slots[s].job
        job.tokens.append(int(token))
        job.logprobs.append(float(logprob))
        st["count"][s] += 1
        r = job.request
        reason = STOP if int(token) in r.sampling.stop_token_ids else \
            LENGTH if len(job.tokens) >= r.sampling.max_new_tokens else None
        if reason is None:
            return
        st["live"][s] = False
        slot = self._slots[s]
        with self._lock:
            self._tick += 1
            slot.job, slot.used = None, self._tick
            slot.held_until = self.decode_steps + RESERVE_STEPS * job.hold
            routed = np.concatenate(job.routing) if self.record else None  # fed positions
            if slot.epoch == self._epoch and self.keep_cache:
                slot.ids = tuple(r.input_ids) + tuple(job.tokens[:-1])
                slot.next_pos = job.first_pos + len(job.tokens) - 1
                slot.routing = routed
            else:
                slot.ids, slot.session, slot.routing = (), "", None
        job.future.set_result(Completion(job.tokens, job.logprobs, reason,
                                         routed_experts=routed))

    # ---- decoding ----------------------------------------------------------------------
    def _decode_chunk(self) -> None:
        """Decode every live slot until one finishes (or `DECODE_CHUNK` steps), reading each
        slot's own pages of the cache (`geo3k_jax.kernels.ragged`)."""
        st = self._state
        table = None if self.kernel else page_table(
            st["length"], st["live"], DECODE_CHUNK, self.capacity, self._data_shards)
        tokens, logps, steps, self._cache, routes = self._decode(
            self.params(), self._cache, self._decode_arrays(st), table, self.key)
        tokens, logps, steps = np.asarray(tokens), np.asarray(logps), int(steps)
        routes = None if routes is None else np.asarray(routes)  # (S, DECODE_CHUNK, L, K)
        self.decode_steps += steps
        for s in np.flatnonzero(st["live"]):
            for i in range(steps):
                if routes is not None:  # the token fed at step i, before the one it sampled
                    self._slots[s].job.routing.append(routes[s, i:i + 1])
                st["pos"][s] += 1
                st["length"][s] += 1
                st["tok"][s] = tokens[s, i]
                self._take(s, tokens[s, i], logps[s, i])
                if not st["live"][s]:
                    break

    def _decode_arrays(self, state: dict | None = None) -> dict:
        """The decode's per-slot arrays of `state` (None: every slot idle)."""
        st = self._empty_state() if state is None else state
        return {k: st[k] for k in ("tok", "pos", "length", "live", "count", "budget", "stops",
                                   "temperature", "top_p", "seed")}

    # ---- compiled pieces ---------------------------------------------------------------
    def _model(self, params):
        if self.compute_dtype is not None:
            params = jax.tree.map(lambda a: a.astype(self.compute_dtype), params)
        return self.merge(params)

    def _prefill_fn(self, params, cache, source, lengths, batch, index, sampling, seeds, key):
        """Work row w continues slot source[w]'s first lengths[w] tokens (or starts empty:
        lengths 0) with its new tokens; request b (work row index[b]) samples its first token.
        Returns (tokens (N,), log-probs (N,), the work rows' new keys and values, each
        (Hkv, layers, W, T, D), and their experts (W, T, L, K) int16 when recording, else
        None)."""
        self._traced()
        model = self._model(params)
        lengths, batch = self._by_slot((lengths, batch))
        blocks = -(-jnp.max(lengths) // self.block)  # the longest row's cached blocks
        logits, rows, *tops = prefill(model, self._reader(cache, source), lengths, blocks,
                                      batch, record=self.record)
        rows = self._by_slot(rows, axis=2)
        keys = row_keys(key, seeds, jnp.zeros_like(seeds))
        tokens, logp = sample_rows(logits[index], *sampling, keys, self.banned,
                                   jnp.any(sampling[1] < 1))
        return tokens, logp, rows, tops[0].astype(jnp.int16) if tops else None

    def _reader(self, cache, source):
        """`geo3k_jax.engine.decode.prefill`'s read(layer, j): block j of every work row's slot
        source[w] (-1: none, zeros). Each device reads its own slots (the cache's layout,
        `cache_specs`), zeros for rows whose slot is elsewhere, summed over the data axes: a
        block of the rows crosses devices, never the cache."""
        spec = cache_specs(self.mesh, self.shape, self.n_slots)
        local, size = self.n_slots // self._data_shards, self.block

        def read(k, v, source, layer, j):
            first = jax.lax.axis_index(spec[2]) * local if spec[2] else 0
            mine = (source >= first) & (source < first + local)
            at = jnp.clip(source - first, 0, local - 1)

            def one(a):  # (Hkv, layers, local, L, D) -> (Hkv, W, size, D): one gather
                # the KV head an index, not a window: with (Hkv, D) windows the TPU compiler
                # lays the cache out with Hkv innermost and copies it whole (as the decode's
                # write did, `geo3k_jax.engine.decode.decode`)
                heads = jnp.arange(a.shape[0])[:, None, None]
                rows = a[heads, layer, at[None, :, None],
                         j * size + jnp.arange(size)[None, None, :]]
                rows = jnp.where(mine[None, :, None, None], rows, 0)
                return jax.lax.psum(rows, spec[2]) if spec[2] else rows
            return one(k), one(v)

        def read_block(layer, j):
            return jax.shard_map(read, mesh=self.mesh, out_specs=(P(spec[0]), P(spec[0])),
                                 in_specs=(spec, spec, P(), P(), P()))(*cache, source, layer, j)
        return read_block

    def _insert_fn(self, cache, rows, dest, index, lengths):
        """Slot dest[b] (past the slots: none; the real requests first) takes work row
        index[b]'s new keys and values at positions lengths[index[b]] on (past the capacity:
        dropped); the rest of the cache is unchanged."""
        self._traced()
        spec = cache_specs(self.mesh, self.shape, self.n_slots)
        local = self.n_slots // self._data_shards
        new = rows[0].shape[3]

        def put(k, v, rk, rv, dest, index, lengths):  # one device: its own slots, every row
            first = jax.lax.axis_index(spec[2]) * local if spec[2] else 0

            def one(b, kv):  # request b's row into its slot, in place, if the slot is here
                slot = jnp.where((dest[b] >= first) & (dest[b] < first + local),
                                 dest[b] - first, local)  # elsewhere: dropped
                at = lengths[index[b]] + jnp.arange(new)

                def write(a, r):  # the KV head and the layer indices, as the decode's write
                    row = jax.lax.dynamic_index_in_dim(r, index[b], 2, keepdims=False)
                    heads = jnp.arange(a.shape[0])[:, None, None]
                    layers = jnp.arange(a.shape[1])[None, :, None]
                    return a.at[heads, layers, slot, at[None, None]].set(row.astype(a.dtype),
                                                                         mode="drop")
                return write(kv[0], rk), write(kv[1], rv)
            return jax.lax.fori_loop(0, jnp.sum(dest < self.n_slots), one, (k, v))
        # a scatter of the requests' rows into slots split over the devices, left to the
        # compiler, gathered the whole cache on every device: each writes its own slots here
        return jax.shard_map(put, mesh=self.mesh, out_specs=(spec, spec),
                             in_specs=(spec, spec, P(spec[0]), P(spec[0]), P(), P(), P()))(
            *cache, *rows, dest, index, lengths)

    def _decode_fn(self, params, cache, st, table, key):
        """Decode the live slots one token a step until a row finishes (a stop token among its
        `stops`, -1 padded, or its `budget`), DECODE_CHUNK steps, or a live row is full. Slot s
        feeds `tok` at M-RoPE position `pos`, cache position `length`; rows not live write
        nothing; attention reads each live slot's pages: through the Pallas kernel, or
        `table`'s ((shards, N), `geo3k_jax.kernels.ragged.page_table`, covering DECODE_CHUNK more
        tokens a live slot; None with the kernel). Returns (tokens, log-probs
        (S, DECODE_CHUNK), steps run, the cache, the fed tokens' experts (S, DECODE_CHUNK, L,
        K) int16 when recording, else None)."""
        self._traced()
        model = self._model(params)
        st = self._by_slot(st)  # each device decodes its own slots
        n = st["tok"].shape[0]
        sampling = (st["temperature"], st["top_p"])
        nucleus = jnp.any(st["live"] & (st["top_p"] < 1))
        attend = self._paged(table)

        def go(s):
            i, _, _, pos, length, live, _, finished, _, _, _ = s
            return ((i < DECODE_CHUNK) & live.any() & ~finished.any()
                    & jnp.all(~live | (length < self.capacity)))

        def body(s):
            i, cache, tok, pos, length, live, count, finished, toks, lps, routes = s
            batch = {"input_ids": tok[:, None],
                     "positions": jnp.broadcast_to(pos[:, None, None], (n, 3, 1))}
            at = jnp.where(live, length, self.capacity)  # past the cache: dropped
            logits, cache, *tops = decode(model, cache, at, batch, attend, record=self.record)
            if tops:
                routes = routes.at[:, i].set(tops[0].astype(routes.dtype))
            new, lp = sample_rows(logits, *sampling, row_keys(key, st["seed"], count),
                                  self.banned, nucleus)
            step = live.astype(jnp.int32)
            count = count + step
            stop = (new[:, None] == st["stops"]).any(axis=1) | (count >= st["budget"])
            return (i + 1, cache, jnp.where(live, new, tok), pos + step, length + step,
                    live & ~stop, count, finished | (live & stop), toks.at[:, i].set(new),
                    lps.at[:, i].set(lp), routes)

        routes = None
        if self.record:
            routes = jnp.full((n, DECODE_CHUNK) + routing_shape(self.config), -1, jnp.int16)
        state = (jnp.int32(0), cache, st["tok"], st["pos"], st["length"], st["live"],
                 st["count"], jnp.zeros(n, bool), jnp.zeros((n, DECODE_CHUNK), jnp.int32),
                 jnp.zeros((n, DECODE_CHUNK), jnp.float32), routes)
        i, cache, *_, toks, lps, routes = jax.lax.while_loop(go, body, state)
        return toks, lps, i, jax.lax.with_sharding_constraint(cache, self._shardings), routes

    def _paged(self, table):
        """The decode step's attention (`geo3k_jax.engine.decode.decode`'s `attend`): each device
        over its own slots and KV heads (the cache's layout, `cache_specs`), through the Pallas
        kernel (`table` None) or over its own row of `table`'s pages."""
        spec = cache_specs(self.mesh, self.shape, self.n_slots)
        by_head, by_slot = P(spec[2], spec[0]), P(spec[2])  # (S, H, D) queries; (S,)
        interpret = self.attention.interpret

        def attend(q, keys, values, layer, at, scale):
            if table is None:
                def local(q, k, v, i, a):
                    return kernel_attention(q, k, v, i, a, scale, interpret)
                extra = ()
            else:
                def local(q, k, v, i, a, t):
                    return paged_attention(q, k, v, i, t[0], a, scale)
                extra = (table,)
            # (the Pallas kernel's output states no varying mesh axes: unchecked)
            return jax.shard_map(local, mesh=self.mesh, out_specs=by_head,
                                 in_specs=(by_head, spec, spec, P(), by_slot)
                                 + (by_slot,) * len(extra),
                                 check_vma=bool(extra))(q, keys, values, layer, at, *extra)
        return attend

    def _by_slot(self, tree, axis: int = 0):
        """Arrays of rows (slots, or a prefill's work rows) along `axis` split over the mesh's
        data axes like the cache, where their count allows; with `axis` 2, caches of rows
        (Hkv, layers, rows, L, D) laid out as the cache is (KV heads over tensor too; rows that
        do not split, on every device of the data axes: one layout a shape, which the insert
        compiled for)."""
        spec = cache_specs(self.mesh, self.shape, self.n_slots)
        spec = P(spec[2]) if axis == 0 else spec

        def place(a):
            if a.ndim == 0 or a.shape[axis] % self._data_shards:
                if axis == 0:
                    return a
                return jax.lax.with_sharding_constraint(a, NamedSharding(self.mesh,
                                                                         P(spec[0])))
            return jax.lax.with_sharding_constraint(a, NamedSharding(self.mesh, spec))
        return jax.tree.map(place, tree)

    # ---- host-side arrays --------------------------------------------------------------
    def _work_arrays(self, work: list):
        """(batch of new tokens for `geo3k_jax.engine.decode.prefill`, slot per work row (-1: none),
        cached tokens per row, the first generated token's M-RoPE position per row, real new
        tokens) at a `prefill_ladder` shape: one row or `prefill_rows`, the new tokens' rung;
        rows past the work hold one pad token."""
        fresh = [r for r, _, kept in work if kept == 0]
        prompts = self._prompt_rows(fresh)
        news = [np.asarray(r.input_ids[kept:], np.int64) for r, _, kept in work]
        n_rows = 1 if len(work) == 1 else self.prefill_rows
        batch, source, lengths, first_pos = self._empty_work(
            n_rows, self._rung(max(map(len, news))))
        image_rows, f = [None] * n_rows, 0
        for b, ((r, s, kept), ids) in enumerate(zip(work, news)):
            if kept == 0:
                pos, image_rows[b] = prompts[f]
                f += 1
            else:  # text after the kept tokens: M-RoPE positions count on from theirs
                slot = self._slots[s]
                first = slot.next_pos - (len(slot.ids) - kept)
                pos = np.broadcast_to(first + np.arange(len(ids)), (3, len(ids)))
                source[b], lengths[b] = s, kept
            batch["input_ids"][b, :len(ids)] = ids
            batch["positions"][b, :, :len(ids)] = pos
            batch["count"][b] = len(ids)
            first_pos[b] = int(pos.max()) + 1
        if any(row is not None for row in image_rows):
            self._add_images(batch, image_rows)
        return batch, source, lengths, first_pos, sum(map(len, news))

    def _empty_work(self, rows: int, tokens: int) -> tuple:
        """(batch, source, lengths, first positions) of `rows` work rows of `tokens` new
        tokens, each one pad token over no cached one."""
        batch = {"input_ids": np.zeros((rows, tokens), np.int32),
                 "positions": np.zeros((rows, 3, tokens), np.int32),
                 "count": np.ones(rows, np.int32)}
        return batch, np.full(rows, -1, np.int32), np.zeros(rows, np.int32), \
            np.zeros(rows, np.int32)

    def _add_images(self, batch: dict, image_rows: list) -> None:
        """The rows' images (`HostRow`s, None: none) into `batch`, every row padded to the
        patches of as many image tokens as it has new tokens: the patch count follows the
        prefill's shape, never the images."""
        tokens = batch["input_ids"].shape[1]
        padded = [pad_patches(row, self.config, tokens * self.merge_size ** 2, tokens)
                  for row in image_rows]
        batch["pixel_values"] = np.stack([p["pixel_values"] for p in padded])
        batch["visual_index"] = np.stack([p["visual_index"] for p in padded])
        batch["vision"] = {k: np.stack([p["vision"][k] for p in padded])
                           for k in padded[0]["vision"]}

    def _dummy_work(self, rows: int, tokens: int, images: bool) -> tuple:
        """`_work_arrays`' arrays of a prefill shape with nothing in it (`warm_up`)."""
        batch, source, lengths, first_pos = self._empty_work(rows, tokens)
        if images:
            self._add_images(batch, [None] * rows)
        return batch, source, lengths, first_pos, 0

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



def power_of_two(n: int, unit: int) -> int:
    """The smallest unit x 2^k >= n."""
    return unit * 2 ** max(0, math.ceil(math.log2(max(n, 1) / unit)))


def token_rungs(capacity: int) -> list[int]:
    """A prefill's new tokens: NEW_TOKENS_UNIT x 2^k below `capacity`, then `capacity`."""
    out = [NEW_TOKENS_UNIT]
    while out[-1] < capacity:
        out.append(min(2 * out[-1], capacity))
    return out


def table_rungs(pages: int) -> list[int]:
    """Every size `geo3k_jax.kernels.ragged.page_table` gives a shard's table of at most `pages`
    pages."""
    out = [bucket(1, TABLE_UNIT)]
    while out[-1] < pages:
        out.append(bucket(out[-1] + 1, TABLE_UNIT))
    return out
