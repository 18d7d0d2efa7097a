"""The in-process rollout engine: batched sampling from the current policy weights.

`LocalEngine` implements `common.engine.Engine` on the learner's own torch model (no copy, no
disk round trip: after an optimizer step the next `generate` samples from the new weights).

One `generate` call decodes its requests in a fixed number of slots of one preallocated KV
cache (`geo3k_torch.decode.Slots`: rows x capacity, capacity = the call's longest prompt plus
its max_new_tokens; with `keep_slots` the slots and their captured steps are kept for the next
calls, and replaced only by a call they are too small for), refilled as rows finish
(continuous batching, as `geo3k_jax.engine.engine`):

    waiting requests ──admit──> prefill (HF forward, new tokens only) ──copy K/V──> free slots
    decode: every slot one token a step (`decode.Decoder`, a CUDA graph on GPUs, sampling
            included; `compile`: torch.compile'd), on device, attending over the whole
            capacity or (`attention_bucket`) the live rows' longest position in whole buckets;
            every SYNC_STEPS steps (or when a row may have reached its max_new_tokens) the host
            reads the done flags: finished rows are retired, their slots refilled
    once nobody waits, the live rows move to the front and the step runs on fewer rows

A prefill takes the admitted requests' new tokens left-padded into one batch (each row behind
its session's KV cache from earlier turns, if any) with their images and explicit 3-D M-RoPE
positions (`common.mrope`); its keys and values are copied into the slots, where a row's tokens
sit in order from index 0. Requests with the same tokens and images and no cache (the samples of
a GRPO group on their first turn) admitted together are prefilled once (`share_prefill`).
The slots (rows x capacity x bytes per token) fit `kv_budget_gb` and are at most `max_batch`;
a request that alone does not fit is refused (`common.engine.FatalEngineError`, naming the
numbers and the settings). A prefill's own cache, and the caches kept between turns (real tokens
only), come on top; kept slots (`keep_slots`) hold their memory while the learner trains.
Each sampled token's log-prob is read from the raw logits at the request's temperature,
log_softmax(logits / T), before any top-p truncation (`generate`'s scores are processed).
Temperature 0 means greedy. A request stops at one of its stop tokens (kept as its last token)
or at its `max_new_tokens`. Draws come from `generator` (seeded) in slot order; a call whose
requests all fit the slots draws as one static batch would until the first compaction, after
which fewer rows draw per step: with one seed the tokens are reproducible, but not those of an
engine that batched differently.

Built with `record_routing` (routing replay, `loss.routing_replay`; a MoE model), the engine
records the experts every sparse layer routed every fed position to: a prefill's from its
forward (`geo3k_torch.router.Routing.recording`), a decode step's into the slots beside the KV
cache, a session's cached positions' from when they were computed (kept with the cache), and
returns them as `Completion.routed_experts` (n_in + n_new - 1 rows: the last new token is never
fed). Off, nothing is recorded.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Sequence

import numpy as np
import torch
from transformers import DynamicCache

from common.engine import LENGTH, STOP, Completion, FatalEngineError, Request
from common.mrope import image_token_counts, mrope_position_ids
from common.processor import image_inputs, image_key
from geo3k_torch.decode import Decoder, Slots
from geo3k_torch.model import upload, vision_inputs
from geo3k_torch.router import Routing

SYNC_STEPS = 8  # decode steps between the host's reads of the done flags, at most
REFILL_SHARE = 8  # refill once 1/8 of the slots are free (or every waiting request fits)
SLOT_ROUND = 256  # kept slots' capacity in whole multiples of this (without attention buckets)
STOP_ROUND = 16  # and their stop tokens a row


def row_counts(rows: int) -> list[int]:
    """The row counts a decode step runs at (each a CUDA graph): 1, 2, 4, ... below `rows`,
    then `rows` itself."""
    out = [1]
    while out[-1] * 2 < rows:
        out.append(out[-1] * 2)
    return out + [rows] if rows > 1 else out


@dataclasses.dataclass
class _Cached:
    """The KV cache of one session: per layer (H, n, D) keys and values of the tokens `ids`,
    and when the engine records routing their (n, L, K) routed experts."""

    ids: list[int]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    routed: torch.Tensor | None = None


class LocalEngine:
    """Samples from `model` (a transformers Qwen-VL) in process. See the module docstring.

    Between turns of a multi-turn episode (same `Request.session`), the KV cache of the tokens
    already seen is kept, so a turn only prefills its new observation tokens. Caches live for the
    sessions of the latest `generate` call (a finished episode is not asked about again) and are
    dropped by `clear_cache`, which the training loop calls after every weight update.
    """

    def __init__(self, model, processor, pad_id: int, seed: int = 0,
                 device: torch.device | str = "cpu", keep_cache: bool = True,
                 share_prefill: bool = True, max_batch: int = 256, kv_budget_gb: float = 24.0,
                 cuda_graphs: bool = True, graph_sampling: bool = False,
                 keep_slots: bool = False, attention_bucket: int = 0, compile: bool = False,
                 compile_backend: str = "inductor", record_routing: bool = False):
        """max_batch, kv_budget_gb, cuda_graphs, graph_sampling, keep_slots, attention_bucket,
        compile, compile_backend: the `engine.local_*` settings of the same names (graphs on
        CUDA only; see configs/base.py). record_routing: return each completion's routed
        experts (a MoE model; `loss.routing_replay`)."""
        if max_batch < 1 or kv_budget_gb <= 0:
            raise ValueError(f"engine.local_max_batch={max_batch} must be >= 1 and "
                             f"engine.local_kv_budget_gb={kv_budget_gb} > 0")
        if attention_bucket < 0:
            raise ValueError(f"engine.local_attention_bucket={attention_bucket} must be >= 0 "
                             "(0: attend over the whole capacity)")
        if compile and not keep_slots:
            raise ValueError("engine.local_compile needs engine.local_keep_slots: new slots "
                             "every call would recompile every call")
        self.model = model
        self.max_batch, self.kv_budget = max_batch, kv_budget_gb * 2**30
        self.processor = processor
        self.pad_id = pad_id
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.keep_cache, self.share_prefill = keep_cache, share_prefill
        self.cuda_graphs, self.graph_sampling = cuda_graphs, graph_sampling
        self.keep_slots, self.bucket = keep_slots, attention_bucket
        self.compile_backend = compile_backend if compile else ""
        self._cache: dict[str, _Cached] = {}
        self._kept: Decoder | None = None  # the slots and steps kept across calls
        self.routing = Routing.of(model) if record_routing else None
        if record_routing and self.routing is None:
            raise ValueError("loss.routing_replay: the engine records a MoE model's routing, "
                             f"and {model.config.model_type} has no experts")
        cfg = model.config
        self.image_token_id = cfg.image_token_id
        self.merge = cfg.vision_config.spatial_merge_size
        placeholders = {cfg.image_token_id, getattr(cfg, "video_token_id", None)} - {None}
        self.banned = torch.tensor(sorted(placeholders), device=self.device)

    def kv_bytes_per_token(self) -> int:
        """Keys and values of one token in every decoder layer, in the model's dtype (and its
        routed experts, int16, when recorded)."""
        text = self.model.config.get_text_config()
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        itemsize = next(self.model.parameters()).dtype.itemsize
        routed = 0 if self.routing is None else 2 * math.prod(self._routing_shape())
        return 2 * text.num_hidden_layers * text.num_key_value_heads * head_dim * itemsize + routed

    def _routing_shape(self) -> tuple[int, int] | None:
        """(L sparse layers, top k) when the engine records routing, else None."""
        return None if self.routing is None else (len(self.routing.routers),
                                                  self.routing.top_k)

    def plan(self, requests: Sequence[Request]) -> tuple[int, int]:
        """(slots, capacity) for these requests: capacity = the longest prompt + max_new_tokens
        of any request, as many slots of it as `max_batch`, the requests and the KV budget
        allow. A request that alone does not fit the budget raises FatalEngineError."""
        per_token, capacity = self.kv_bytes_per_token(), 0
        for r in requests:
            n, new = len(r.input_ids), r.sampling.max_new_tokens
            need = (n + new) * per_token
            if need > self.kv_budget:
                raise FatalEngineError(
                    f"one request needs {need / 2**30:.2f} GiB of KV cache ({n} prompt + {new} "
                    f"new tokens x {per_token} bytes) but engine.local_kv_budget_gb="
                    f"{self.kv_budget / 2**30:g}: raise it, or lower rollout.max_context_tokens")
            capacity = max(capacity, n + new)
        rows = min(self.max_batch, len(requests), int(self.kv_budget // (capacity * per_token)))
        return rows, capacity

    def batches(self, requests: Sequence[Request]) -> list[list[Request]]:
        """`requests` in order, in groups of the slot count (`plan`): the first group fills the
        slots, every later request waits for a slot a finished one frees."""
        rows, _ = self.plan(requests)
        return [list(requests[i:i + rows]) for i in range(0, len(requests), rows)]

    def clear_cache(self) -> None:
        """Forget every session's KV cache (stale once the weights change). Kept slots and their
        steps stay: they read the weights where they are, and a copy into them changes no
        address."""
        self._cache = {}

    def release(self) -> None:
        """Drop the kept slots and their steps (their memory goes back to the allocator)."""
        self._kept = None

    @torch.no_grad()
    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        if not requests:
            return []
        was_training = self.model.training
        self.model.eval()
        try:
            out, kept = self._decode(list(requests))
        finally:
            self.model.train(was_training)
        self._cache = kept  # the sessions of this call (a finished one is not asked again)
        return out

    def _decode(self, requests: list[Request]) -> tuple[list[Completion], dict]:
        """The slot loop of the module docstring: completions in order, and the KV caches to
        keep, by session."""
        decoder = self._decoder(requests)
        slots = decoder.slots
        rows = slots.rows
        counts = row_counts(rows)
        nucleus = any(r.sampling.top_p < 1 for r in requests)
        waiting = collections.deque(range(len(requests)))
        owner = [-1] * rows  # slot -> its request (-1: free)
        left = [0] * rows  # tokens a slot may still sample
        ends = [0] * rows  # the most its `pos` can be (the host's bound, for the span)
        out: list[Completion | None] = [None] * len(requests)
        kept: dict[str, _Cached] = {}
        n = rows  # the slots a step runs over
        while True:
            free = [s for s in range(rows) if owner[s] < 0]
            if waiting and len(free) >= min(len(waiting), max(1, rows // REFILL_SHARE)):
                take = [waiting.popleft() for _ in range(min(len(free), len(waiting)))]
                self._admit(slots, [requests[i] for i in take], free[:len(take)], nucleus)
                for s, i in zip(free, take):
                    owner[s], left[s] = i, requests[i].sampling.max_new_tokens - 1
                    ends[s] = len(requests[i].input_ids)
            busy = [s for s in range(rows) if owner[s] >= 0]
            if not busy:
                break
            if not waiting and min(c for c in counts if c >= len(busy)) < n:
                if busy != list(range(len(busy))):  # live rows to the front
                    slots.move(torch.tensor(busy, device=self.device))
                    slots.done[len(busy):] = True
                    front = lambda xs, fill: [xs[s] for s in busy] + [fill] * (  # noqa: E731
                        rows - len(busy))
                    owner, left, ends = front(owner, -1), front(left, 0), front(ends, 0)
                    busy = list(range(len(busy)))
                n = min(c for c in counts if c >= len(busy))
            steps = min(SYNC_STEPS, min(left[s] for s in busy))
            span = self._span(max(ends[s] for s in busy) + steps, slots.capacity)
            for _ in range(steps):
                decoder.step(n, span, nucleus)
            left = [max(x - steps, 0) for x in left]
            ends = [x + steps if owner[s] >= 0 else x for s, x in enumerate(ends)]
            done = slots.done[:n].tolist()  # the host's one read per SYNC_STEPS steps
            finished = [s for s in busy if done[s]]
            if finished:
                self._retire(slots, finished, [owner[s] for s in finished], requests, out, kept)
                for s in finished:
                    owner[s] = -1
        return out, kept

    def _span(self, need: int, capacity: int) -> int:
        """Cache indices a step attends over when no live slot's `pos` reaches `need`: the
        capacity, or `need` rounded up to whole attention buckets."""
        if not self.bucket:
            return capacity
        return min(capacity, -(-need // self.bucket) * self.bucket)

    def _decoder(self, requests: list[Request]) -> Decoder:
        """A decoder over slots for `requests` (`plan`): the kept one if its slots are large
        enough (all free again), else one over new slots. Kept slots are allocated with room
        for later calls: the capacity in whole attention buckets (SLOT_ROUND without them) if
        the budget allows, a token column per cache index, STOP_ROUND stop tokens a row."""
        rows, capacity = self.plan(requests)
        max_new = max(r.sampling.max_new_tokens for r in requests)
        n_stops = max(1, *(len(r.sampling.stop_token_ids) for r in requests))
        kept = self._kept
        if kept is not None and kept.slots.fits(rows, capacity, max_new, n_stops):
            kept.slots.done[:] = True  # free (a call that raised may have left rows live)
            return kept
        self._kept = None  # the old slots and steps go before new ones are allocated
        if self.keep_slots:
            step = self.bucket or SLOT_ROUND
            wider = -(-capacity // step) * step
            if rows * wider * self.kv_bytes_per_token() <= self.kv_budget:
                capacity = wider
            max_new, n_stops = capacity - 1, -(-n_stops // STOP_ROUND) * STOP_ROUND
        slots = Slots.allocate(self.model.config.get_text_config(), rows, capacity, max_new,
                               n_stops, next(self.model.parameters()).dtype, self.device,
                               self._routing_shape())
        decoder = Decoder(self.model, slots, self.generator, self.banned,
                          cuda_graphs=self.cuda_graphs, graph_sampling=self.graph_sampling,
                          compile_backend=self.compile_backend)
        if self.keep_slots:
            self._kept = decoder
        return decoder

    def _admit(self, slots: Slots, requests: list[Request], at: list[int], nucleus: bool
               ) -> None:
        """Prefill `requests` into the free slots `at` (one each, in order) and sample their
        first tokens."""
        cache, logits, rows, expand, C, N, routed = self._prefill(requests)
        dev, k = self.device, len(requests)
        lengths = [len(ids) for ids, *_ in rows]
        T = max(lengths)
        index = torch.zeros((k, T), dtype=torch.long)  # prefill index of each row's tokens
        for j, (ids, _, _, c, _) in enumerate(rows):
            n = len(ids) - c
            where = torch.cat([torch.arange(C - c, C), torch.arange(C + N - n, C + N)])
            index[j] = torch.cat([where, where[-1:].expand(T - len(where))])
        index, src = index.to(dev), torch.tensor(expand, device=dev)
        slot = torch.tensor(at, device=dev)
        for layer, keys, values in zip(cache.layers, slots.keys, slots.values):
            pick = index[:, None, :, None].expand(k, keys.shape[1], T, keys.shape[3])
            keys[slot, :, :T] = layer.keys[src].gather(2, pick)
            values[slot, :, :T] = layer.values[src].gather(2, pick)
        if routed is not None:  # each row: its cached positions' routing, then the prefill's
            for j, (ids, _, cached, c, _) in enumerate(rows):
                new = routed[expand[j], N - (len(ids) - c):]
                slots.routed[at[j], :len(ids)] = new if cached is None else torch.cat(
                    [cached.routed[:c], new])
        stops = torch.full((k, slots.stops.shape[1]), -1, dtype=torch.long)
        for j, r in enumerate(requests):
            stops[j, :len(r.sampling.stop_token_ids)] = torch.tensor(r.sampling.stop_token_ids,
                                                                     dtype=torch.long)
        host = lambda v, dtype=torch.long: torch.tensor(v, dtype=dtype, device=dev)  # noqa: E731
        slots.pos[slot] = host(lengths)
        slots.mpos[slot] = host([int(pos.max()) + 1 for _, pos, *_ in rows])
        slots.temperature[slot] = host([r.sampling.temperature for r in requests], torch.float)
        slots.top_p[slot] = host([r.sampling.top_p for r in requests], torch.float)
        slots.max_new[slot] = host([r.sampling.max_new_tokens for r in requests])
        slots.stops[slot] = stops.to(dev)
        slots.count[slot] = 0
        slots.done[slot] = False
        slots.record(slot, logits[src], self.generator, self.banned, nucleus)

    def _retire(self, slots: Slots, finished: list[int], owners: list[int],
                requests: list[Request], out: list, kept: dict) -> None:
        """Read the finished slots' tokens back into `out` (at their requests' places, `owners`)
        and keep their sessions' caches (the prompt and every token fed: all but the last)."""
        index = torch.tensor(finished, device=self.device)
        tokens, logprobs, count, pos = (t[index].cpu() for t in (
            slots.tokens, slots.logprobs, slots.count, slots.pos))
        routed = None if slots.routed is None else \
            slots.routed[index, :int(pos.max())].cpu().numpy()  # (k, fed, L, K)
        for j, (s, i) in enumerate(zip(finished, owners)):
            r, c, p = requests[i], int(count[j]), int(pos[j])
            ids = tokens[j, :c].tolist()
            reason = STOP if ids[-1] in r.sampling.stop_token_ids else LENGTH
            out[i] = Completion(ids, logprobs[j, :c].tolist(), reason,
                                None if routed is None else routed[j, :p])
            if self.keep_cache and r.session:
                kept[r.session] = _Cached(list(r.input_ids) + ids[:p - len(r.input_ids)],
                                          [k[s, :, :p].clone() for k in slots.keys],
                                          [v[s, :, :p].clone() for v in slots.values],
                                          None if routed is None else slots.routed[s, :p].clone())

    def _prefill(self, requests: list[Request]):
        """One prefill forward of `requests`' new tokens, left-padded behind their sessions'
        caches (C tokens at most) to N new tokens. Returns (its DynamicCache, per layer (P, H,
        C + N, D); next-token logits (P, V) fp32; per request (ids, M-RoPE positions (3, n),
        cache or None, cached length c, its new images); each request's prefill row (P rows,
        `share_prefill`); C; N; when recording routing the (P, N, L, K) experts of the new
        tokens, else None)."""
        dev = self.device
        images = [im for r in requests for im in r.images]
        keys = [image_key(im) for im in images]
        first_of: dict = {}  # each distinct image (by content) is processed once
        for i, k in enumerate(keys):
            first_of.setdefault(k, i)
        slot = {k: j for j, k in enumerate(first_of)}
        which = [slot[k] for k in keys]  # image -> its distinct image
        imgs = image_inputs(self.processor, [images[i] for i in first_of.values()])
        distinct_grids = imgs.get("image_grid_thw", np.zeros((0, 3), np.int64))
        grids = distinct_grids[which]
        patches = np.concatenate([[0], np.cumsum(distinct_grids.prod(axis=1))])
        tokens_per_image = image_token_counts(grids, self.merge)
        rows, first = [], 0
        for r in requests:
            k = len(r.images)
            ids = np.asarray(r.input_ids, np.int64)
            pos = mrope_position_ids(ids, self.image_token_id, grids[first:first + k], self.merge)
            cached = self._reusable(r, tokens_per_image[first:first + k])
            c = len(cached.ids) if cached else 0
            k_old = int(np.searchsorted(np.cumsum(tokens_per_image[first:first + k]),
                                        int((ids[:c] == self.image_token_id).sum()), "right"))
            rows.append((ids, pos, cached, c, list(range(first + k_old, first + k))))
            first += k
        unique, expand = self._distinct(rows, keys, [len(r.images) for r in requests])
        rows_all, rows = rows, [rows[i] for i in unique]
        B = len(rows)
        C = max(c for _, _, _, c, _ in rows)
        N = max(len(ids) - c for ids, _, _, c, _ in rows)
        input_ids = torch.full((B, N), self.pad_id, dtype=torch.long)
        attn = torch.zeros((B, C + N), dtype=torch.long)
        position_ids = torch.zeros((4, B, N), dtype=torch.long)
        for b, (ids, pos, cached, c, _) in enumerate(rows):
            n = len(ids) - c
            input_ids[b, N - n:] = torch.from_numpy(ids[c:])
            attn[b, C - c:C] = 1
            attn[b, C + N - n:] = 1
            position_ids[0, b, N - n:] = torch.arange(c, len(ids))
            position_ids[1:, b, N - n:] = torch.from_numpy(pos[:, c:])
        inputs = {"input_ids": input_ids.to(dev), "attention_mask": attn.to(dev),
                  "position_ids": position_ids.to(dev)}
        new_images = [i for *_, imgs_b in rows for i in imgs_b]
        if new_images:
            inputs["pixel_values"] = torch.from_numpy(np.concatenate(
                [imgs["pixel_values"][patches[which[i]]:patches[which[i] + 1]]
                 for i in new_images])).to(dev)
            inputs |= upload(vision_inputs(self.model.config, grids[new_images]), dev)
        if C:
            inputs["past_key_values"] = self._stack_caches(rows, C)
        if self.routing is None:
            out, routed = self.model(**inputs, use_cache=True, logits_to_keep=1), None
        else:
            with self.routing.recording(experts=True) as chosen:
                out = self.model(**inputs, use_cache=True, logits_to_keep=1)
            routed = torch.stack(chosen, 1).view(B, N, *self._routing_shape()).to(torch.int16)
        return out.past_key_values, out.logits[:, -1].float(), rows_all, expand, C, N, routed

    def _reusable(self, req: Request, n_image_tokens_per_image: np.ndarray) -> _Cached | None:
        """The session's cache if it holds a strict prefix of the request that ends between
        images (so the new part starts with whole images or text)."""
        entry = self._cache.get(req.session) if self.keep_cache and req.session else None
        ids = list(req.input_ids)
        if entry is None or len(entry.ids) >= len(ids) or ids[:len(entry.ids)] != entry.ids:
            return None
        in_prefix = sum(t == self.image_token_id for t in entry.ids)
        if in_prefix not in np.concatenate([[0], np.cumsum(n_image_tokens_per_image)]):
            return None
        return entry

    def _distinct(self, rows, image_keys: list, n_images: list[int]
                  ) -> tuple[list[int], list[int]]:
        """The requests to prefill (indices) and, for every request, its row among them: with
        `share_prefill`, uncached requests with equal tokens and images (by `image_keys`, all
        requests' in order) share one row."""
        unique, expand, seen = [], [], {}
        bounds = np.concatenate([[0], np.cumsum(n_images)]).astype(int)
        for b, (ids, _, cached, _, _) in enumerate(rows):
            key = (ids.tobytes(), tuple(image_keys[bounds[b]:bounds[b + 1]])) \
                if self.share_prefill and cached is None else b
            if key not in seen:
                seen[key] = len(unique)
                unique.append(b)
            expand.append(seen[key])
        return unique, expand

    def _stack_caches(self, rows, C: int) -> DynamicCache:
        """One left-padded (B, H, C, D) cache per layer from the rows' own caches."""
        some = next(cached for _, _, cached, _, _ in rows if cached)
        cache = DynamicCache()
        for layer in range(len(some.keys)):
            ks, vs = [], []
            for _, _, cached, c, _ in rows:
                k0 = some.keys[layer]
                pad = k0.new_zeros((k0.shape[0], C - c, k0.shape[2]))
                ks.append(torch.cat([pad, cached.keys[layer]], 1) if cached else
                          k0.new_zeros((k0.shape[0], C, k0.shape[2])))
                vs.append(torch.cat([pad, cached.values[layer]], 1) if cached else
                          k0.new_zeros((k0.shape[0], C, k0.shape[2])))
            cache.update(torch.stack(ks), torch.stack(vs), layer)
        return cache

