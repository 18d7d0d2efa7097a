"""Real multi-turn trajectories for the cross-backend check, with no model in the loop.

Synthetic Geometry3K problems (`common.synthetic`), each with one or more diagrams resized to
different sizes, go through the real rollout (`common.rollout`), chat template and environment;
only the engine is scripted: episode k of a problem answers wrong first (the environment's
feedback becomes observation tokens) and then right, or right at once, with random rollout
log-probs. The trajectories are exported and packed exactly as training does them
(`common.batching`), with random advantages, so the check sees prompts, several images per
sequence, observation tokens, loss masks and several sequences per packed row.
"""

from __future__ import annotations

import io
import json
from typing import Sequence

import numpy as np
from PIL import Image

from common.batching import PackedBatch, pack, training_sequences
from common.chat import ChatRenderer
from common.data import row_to_prompt
from common.engine import LENGTH, STOP, Completion, Request
from common.prompts import TOOL_NAMES
from common.rollout import RolloutConfig, rollout
from common.synthetic import make_problem


def tool_call(answer: str) -> str:
    return ('<tool_call>{"name": "' + TOOL_NAMES[0] + '", "arguments": {"answer": '
            + json.dumps(answer) + '}}</tool_call>')


class ScriptEngine:
    """Replies from a fixed script per episode (session "i-k": episode k of prompt i -> texts),
    with log-probs drawn at random."""

    def __init__(self, renderer: ChatRenderer, scripts: dict[str, list[str]], seed: int):
        self.renderer, self.scripts = renderer, {k: list(v) for k, v in scripts.items()}
        self.rng = np.random.default_rng(seed)

    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        out = []
        for req in requests:
            ids = self.renderer.tokenizer.encode(self.scripts[req.session].pop(0),
                                                 add_special_tokens=False)
            ids = ids[:req.sampling.max_new_tokens]
            finish = LENGTH if len(ids) == req.sampling.max_new_tokens else STOP
            if finish == STOP:
                ids.append(self.renderer.turn_end_id)
            out.append(Completion(ids, self.rng.uniform(-3.0, 0.0, len(ids)).tolist(), finish))
        return out


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def check_prompts(n: int, images_per_prompt: Sequence[int], size_range: tuple[int, int],
                  seed: int) -> list:
    """`n` prompts; prompt i has images_per_prompt[i % len] diagrams of random sizes."""
    rng = np.random.default_rng(seed)
    prompts = []
    for i in range(n):
        k = images_per_prompt[i % len(images_per_prompt)]
        rows = [make_problem(seed, n * j + i, image_size=size_range) for j in range(k)]
        row = dict(rows[0])
        row["problem"] += "".join(f"\nDiagram {j + 1}: <image>" for j in range(1, k))
        imgs = [Image.open(io.BytesIO(r["images"][0]["bytes"])).convert("RGB") for r in rows]
        sizes = rng.integers(size_range[0], size_range[1] + 1, (k, 2))
        row["images"] = [{"bytes": _png(im.resize((int(w), int(h)))), "path": None}
                         for im, (w, h) in zip(imgs, sizes)]
        prompts.append(row_to_prompt(row, f"check-{i}"))
    return prompts


def check_batches(processor, *, prompts: int, samples: int, images: Sequence[int],
                  image_sizes: tuple[int, int], micro_batch_tokens: int, seed: int,
                  share_prefix: bool = True) -> tuple[list[PackedBatch], float, float]:
    """(packed micro-batches, masked tokens, sequences) of scripted multi-turn episodes.
    micro_batch_tokens 0 = half the tokens of all sequences (so there are several rows);
    share_prefix: a problem's samples share its prompt (`common.batching.pack`)."""
    renderer = ChatRenderer(processor)
    ps = check_prompts(prompts, images, image_sizes, seed)
    scripts = {}
    for i, p in enumerate(ps):
        for k in range(samples):
            right = "So the answer is " + tool_call(p.answer)
            scripts[f"{i}-{k}"] = (["I think " + tool_call("-12345"), right] if k % 2 == 0
                                       else [right])
    cfg = RolloutConfig(n_samples=samples, max_response_tokens=256, max_context_tokens=8192)
    trajs = rollout(ps, ScriptEngine(renderer, scripts, seed), renderer, cfg)
    adv = np.random.default_rng(seed + 1).normal(size=len(trajs))
    seqs = training_sequences(trajs, adv)
    if not any(len(t.turns) > 1 for t in trajs):
        raise RuntimeError("the scripted rollout produced no multi-turn episode")
    budget = micro_batch_tokens or max(max(len(s) for s in seqs),
                                       sum(len(s) for s in seqs) // 2)
    n_tokens = float(sum(s.loss_mask.sum() for s in seqs))
    image_token_id = processor.image_token_id if share_prefix else None
    return pack(seqs, budget, image_token_id), n_tokens, float(len(seqs))



def batches_from_config(processor, chk, share_prefix: bool = True
                        ) -> tuple[list[PackedBatch], float, float]:
    """`check_batches` with the settings of config section `jax.check` (images "1,2": images
    per problem, cycled; image_sizes "40-200": pixel range of widths and heights)."""
    try:
        images = [int(x) for x in str(chk.images).split(",")]
        lo, _, hi = str(chk.image_sizes).partition("-")
        sizes = (int(lo), int(hi or lo))
    except ValueError:
        raise ValueError(f"jax.check.images must look like '1,2' and jax.check.image_sizes like "
                         f"'40-200', got {chk.images!r} and {chk.image_sizes!r}") from None
    if min(images) < 1 or not 8 <= sizes[0] <= sizes[1]:
        raise ValueError(f"jax.check needs >= 1 image per problem and 8 <= min size <= max "
                         f"size, got images={chk.images!r}, image_sizes={chk.image_sizes!r}")
    if chk.prompts < 1 or chk.samples < 1:
        raise ValueError("jax.check.prompts and jax.check.samples must be >= 1")
    return check_batches(processor, prompts=chk.prompts, samples=chk.samples, images=images,
                         image_sizes=sizes, micro_batch_tokens=chk.micro_batch_tokens,
                         seed=chk.seed, share_prefix=share_prefix)
