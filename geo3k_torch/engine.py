"""The in-process rollout engine: batched sampling from the current policy weights.

`LocalEngine` implements `common.engine.Engine` on the learner's own torch model (no copy, no
disk round trip: after an optimizer step the next `generate` samples from the new weights).

One `generate` call: the requests' new tokens are left-padded into one batch (each row behind
its own left-padded KV cache from earlier turns, if any), prefilled once with their images and
explicit 3-D M-RoPE positions (`common.mrope`), then decoded token by token with the KV cache.
Requests with the same tokens and images and no cache (the samples of a GRPO group on their
first turn) are prefilled once: their row's KV cache and first logits are copied to each of them
(`share_prefill`).
Each sampled token's log-prob is read from the raw logits at the request's temperature,
log_softmax(logits / T), before any top-p truncation (`generate`'s scores are
processed). Temperature 0 means greedy. A request stops at one of its stop tokens (kept as its
last token) or at its `max_new_tokens`.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
import torch
from transformers import DynamicCache

from common.engine import Completion, Decoding, Request
from common.mrope import image_token_counts, mrope_position_ids
from common.processor import image_inputs, image_key


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
           generator: torch.Generator, banned: torch.Tensor | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row. logits: (B, V) fp32 raw; temperature, top_p: (B,); banned:
    token ids never sampled (image placeholders: a generated one would break the sequence).

    Returns (tokens (B,), log-probs (B,) under log_softmax(logits / T) of the raw logits; T = 0
    rows are greedy and report log_softmax(logits)).
    """
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature)
    logp = torch.log_softmax(logits / t[:, None], dim=-1)
    if banned is not None:
        logits = logits.index_fill(-1, banned, float("-inf"))
    probs = torch.softmax(logits / t[:, None], dim=-1)
    if bool((top_p < 1).any()):
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass strictly above each token
        sorted_p = torch.where(before < top_p[:, None], sorted_p, torch.zeros_like(sorted_p))
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    drawn = torch.multinomial(probs, 1, generator=generator)[:, 0]
    tokens = torch.where(greedy, logits.argmax(-1), drawn)
    return tokens, logp.gather(-1, tokens[:, None])[:, 0]


@dataclasses.dataclass
class _Cached:
    """The KV cache of one session: per layer (H, n, D) keys and values of the tokens `ids`."""

    ids: list[int]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


class LocalEngine:
    """Samples from `model` (a transformers Qwen-VL) in process. See the module docstring.

    Between turns of a multi-turn episode (same `Request.session`), the KV cache of the tokens
    already seen is kept, so a turn only prefills its new observation tokens. Caches live for the
    sessions of the latest `generate` call (a finished episode is not asked about again) and are
    dropped by `clear_cache`, which the training loop calls after every weight update.
    """

    def __init__(self, model, processor, pad_id: int, seed: int = 0,
                 device: torch.device | str = "cpu", keep_cache: bool = True,
                 share_prefill: bool = True):
        self.model = model
        self.processor = processor
        self.pad_id = pad_id
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.keep_cache, self.share_prefill = keep_cache, share_prefill
        self._cache: dict[str, _Cached] = {}
        cfg = model.config
        self.image_token_id = cfg.image_token_id
        self.merge = cfg.vision_config.spatial_merge_size
        placeholders = {cfg.image_token_id, getattr(cfg, "video_token_id", None)} - {None}
        self.banned = torch.tensor(sorted(placeholders), device=self.device)

    def clear_cache(self) -> None:
        """Forget every session's KV cache (stale once the weights change)."""
        self._cache = {}

    @torch.no_grad()
    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        if not requests:
            return []
        was_training = self.model.training
        self.model.eval()
        try:
            return self._generate(list(requests))
        finally:
            self.model.train(was_training)

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

    def _generate(self, requests: list[Request]) -> list[Completion]:
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
        next_pos = torch.zeros((2, B), dtype=torch.long)  # text position, M-RoPE position
        for b, (ids, pos, cached, c, _) in enumerate(rows):
            n = len(ids) - c
            input_ids[b, N - n:] = torch.from_numpy(ids[c:])
            attn[b, C - c:C] = 1
            attn[b, C + N - n:] = 1
            position_ids[0, b, N - n:] = torch.arange(c, len(ids))
            position_ids[1:, b, N - n:] = torch.from_numpy(pos[:, c:])
            next_pos[:, b] = torch.tensor([len(ids), int(pos.max()) + 1])
        inputs = {"input_ids": input_ids.to(dev), "attention_mask": attn.to(dev),
                  "position_ids": position_ids.to(dev)}
        new_images = [i for *_, imgs_b in rows for i in imgs_b]
        if new_images:
            inputs["pixel_values"] = torch.from_numpy(np.concatenate(
                [imgs["pixel_values"][patches[which[i]]:patches[which[i] + 1]]
                 for i in new_images])).to(dev)
            inputs["image_grid_thw"] = torch.from_numpy(grids[new_images]).to(dev)
        if C:
            inputs["past_key_values"] = self._stack_caches(rows, C)
        out = self.model(**inputs, use_cache=True, logits_to_keep=1)
        cache, logits, B = out.past_key_values, out.logits[:, -1].float(), len(requests)
        if len(unique) < B:  # each request gets its row of the shared prefill
            index = torch.tensor(expand, device=dev)
            cache.reorder_cache(index)
            logits, attn, next_pos = logits[index], attn[expand], next_pos[:, expand]
        temperature = torch.tensor([r.sampling.temperature for r in requests], device=dev)
        top_p = torch.tensor([r.sampling.top_p for r in requests], device=dev)
        decoding = Decoding(requests)
        attn, next_pos, fed = attn.to(dev), next_pos.to(dev), 0
        while True:
            tok, lp = sample(logits, temperature, top_p, self.generator, self.banned)
            if decoding.add(tok.tolist(), lp.tolist()):
                break
            step_pos = torch.cat([next_pos[:1], next_pos[1:].expand(3, -1)])[:, :, None]
            attn = torch.cat([attn, attn.new_ones((B, 1))], dim=1)
            out = self.model(input_ids=tok[:, None], attention_mask=attn, position_ids=step_pos,
                             past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache, next_pos, fed = out.past_key_values, next_pos + 1, fed + 1
            logits = out.logits[:, -1].float()
        if self.keep_cache:
            self._keep(requests, rows_all, decoding.tokens, cache, C, N, fed)
        return decoding.completions()

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

    def _keep(self, requests, rows, tokens, cache, C: int, N: int, fed: int) -> None:
        """Keep, per session of this call, the cache of its real tokens (pads and the tokens
        sampled after it stopped are cut out)."""
        kept = {}
        for b, (r, (ids, _, _, c, _)) in enumerate(zip(requests, rows)):
            if not r.session:
                continue
            n, f = len(ids) - c, min(len(tokens[b]), fed)
            idx = torch.cat([torch.arange(C - c, C), torch.arange(C + N - n, C + N + f)])
            idx = idx.to(self.device)
            kept[r.session] = _Cached(
                ids.tolist() + tokens[b][:f],
                [layer.keys[b].index_select(1, idx) for layer in cache.layers],
                [layer.values[b].index_select(1, idx) for layer in cache.layers])
        self._cache = kept
