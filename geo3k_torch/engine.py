"""The in-process rollout engine: batched sampling from the current policy weights.

`LocalEngine` implements `common.engine.Engine` on the learner's own torch model (no copy, no
disk round trip: after an optimizer step the next `generate` samples from the new weights).

One `generate` call: the requests are left-padded into one batch, prefilled once with their
images and explicit 3-D M-RoPE positions (`common.mrope`), then decoded token by token with a KV
cache. Each sampled token's log-prob is read from the raw logits at the request's temperature,
log_softmax(logits / T), before any top-p truncation (REFERENCE §7: `generate`'s scores are
processed). Temperature 0 means greedy. A request stops at one of its stop tokens (kept as its
last token) or at its `max_new_tokens`.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from common.engine import LENGTH, STOP, Completion, Request
from common.mrope import mrope_position_ids
from geo3k_torch.model import image_inputs


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
           generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row. logits: (B, V) fp32 raw; temperature, top_p: (B,).

    Returns (tokens (B,), log-probs (B,) under log_softmax(logits / T); T = 0 rows are greedy and
    report log_softmax(logits)).
    """
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature)
    logp = torch.log_softmax(logits / t[:, None], dim=-1)
    probs = logp.exp()
    if bool((top_p < 1).any()):
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass strictly above each token
        sorted_p = torch.where(before < top_p[:, None], sorted_p, torch.zeros_like(sorted_p))
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    drawn = torch.multinomial(probs, 1, generator=generator)[:, 0]
    tokens = torch.where(greedy, logits.argmax(-1), drawn)
    return tokens, logp.gather(-1, tokens[:, None])[:, 0]


class LocalEngine:
    """Samples from `model` (a transformers Qwen-VL) in process. See the module docstring."""

    def __init__(self, model, processor, pad_id: int, seed: int = 0,
                 device: torch.device | str = "cpu"):
        self.model = model
        self.processor = processor
        self.pad_id = pad_id
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        cfg = model.config
        self.image_token_id = cfg.image_token_id
        self.merge = cfg.vision_config.spatial_merge_size

    def _positions(self, req: Request, grid: np.ndarray) -> np.ndarray:
        ids = np.asarray(req.input_ids, np.int64)
        return mrope_position_ids(ids, self.image_token_id, grid, self.merge)

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

    def _generate(self, requests: list[Request]) -> list[Completion]:
        dev, B = self.device, len(requests)
        imgs = image_inputs(self.processor, [im for r in requests for im in r.images])
        grids = imgs.get("image_grid_thw", np.zeros((0, 3), np.int64))
        lens = [len(r.input_ids) for r in requests]
        L = max(lens)
        ids = torch.full((B, L), self.pad_id, dtype=torch.long)
        attn = torch.zeros((B, L), dtype=torch.long)
        pos = torch.zeros((4, B, L), dtype=torch.long)
        next_pos = torch.zeros((2, B), dtype=torch.long)  # text position, M-RoPE position
        first = 0
        for b, r in enumerate(requests):
            n, k = lens[b], len(r.images)
            ids[b, L - n:] = torch.tensor(list(r.input_ids), dtype=torch.long)
            attn[b, L - n:] = 1
            m = torch.from_numpy(self._positions(r, grids[first:first + k]))
            pos[0, b, L - n:] = torch.arange(n)
            pos[1:, b, L - n:] = m
            next_pos[:, b] = torch.tensor([n, int(m.max()) + 1])
            first += k
        inputs = {"input_ids": ids.to(dev), "attention_mask": attn.to(dev),
                  "position_ids": pos.to(dev)}
        if imgs:
            inputs["pixel_values"] = torch.from_numpy(imgs["pixel_values"]).to(dev)
            inputs["image_grid_thw"] = torch.from_numpy(grids).to(dev)
        temperature = torch.tensor([r.sampling.temperature for r in requests], device=dev)
        top_p = torch.tensor([r.sampling.top_p for r in requests], device=dev)
        budget = [r.sampling.max_new_tokens for r in requests]
        stops = [set(r.sampling.stop_token_ids) for r in requests]
        tokens: list[list[int]] = [[] for _ in requests]
        logps: list[list[float]] = [[] for _ in requests]
        finish: list[str | None] = [None] * B
        out = self.model(**inputs, use_cache=True, logits_to_keep=1)
        cache, attn, next_pos = out.past_key_values, attn.to(dev), next_pos.to(dev)
        logits = out.logits[:, -1].float()
        while True:
            tok, lp = sample(logits, temperature, top_p, self.generator)
            for b in range(B):
                if finish[b] is not None:
                    continue
                t = int(tok[b])
                tokens[b].append(t)
                logps[b].append(float(lp[b]))
                if t in stops[b]:
                    finish[b] = STOP
                elif len(tokens[b]) >= budget[b]:
                    finish[b] = LENGTH
            if all(f is not None for f in finish):
                break
            step_pos = torch.cat([next_pos[:1], next_pos[1:].expand(3, -1)])[:, :, None]
            attn = torch.cat([attn, attn.new_ones((B, 1))], dim=1)
            out = self.model(input_ids=tok[:, None], attention_mask=attn, position_ids=step_pos,
                             past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache, next_pos = out.past_key_values, next_pos + 1
            logits = out.logits[:, -1].float()
        return [Completion(tokens[b], logps[b], finish[b]) for b in range(B)]
