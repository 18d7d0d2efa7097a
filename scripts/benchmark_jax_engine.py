"""The JAX engine's slots against static batches, on `scripts/benchmark_rollout.py`'s simulated
multi-turn mix, served by the real engine (the tiny test checkpoint, this machine's devices).

    PYTHONPATH=. python scripts/benchmark_jax_engine.py [--prompts=16 --samples=8 --slots=64 \
        --scale=0.25]

The episodes are benchmark_rollout's (`scripts/simulated_mix.py`): `--prompts` x `--samples`
episodes of up to 3 turns, a turn log-normal (median 400 tokens, sigma 0.9, at least 8, at most
what is left of the episode's 4,096), right with probability 0.45 (else the episode takes
another turn); the prompt is 400 tokens and one image, the feedback 60 tokens. Every token
count is multiplied by `--scale` (this CPU's tiny model is slow at 400-token turns). The engine
decodes exactly a turn's length (no stop token), so both ways below serve the same tokens:

  * static, lock-step: the engine as it was before slots. Every turn of the active episodes at
    once, in batches of `--slots` requests (a batch waits for its longest row, the next turn
    for the whole turn);
  * slots, per-episode: an episode submits its next turn as soon as its own is back
    (`rollout.schedule=episode`), into `--slots` slots refilled as rows finish.

Both are timed after warm-up passes of the same episodes (until one compiles nothing). Reported
for each: wall seconds here, decode steps, prefilled tokens, and the seconds of
benchmark_rollout's latency model (`timed`) for an accelerator whose step costs the same however
many of its rows are live: the server whose per-episode speed-up benchmark_rollout reports.
Prints one JSON line.
"""

from __future__ import annotations

import concurrent.futures
import json
import time
import zlib

import jax
import numpy as np
from absl import app, flags

from common.engine import Request, SamplingParams
from geo3k_jax.engine.engine import JaxEngine
from simulated_mix import (BUDGET, DECODE_MS, FEEDBACK_TOKENS, PREFILL_MS, PROMPT_TOKENS,
                           TURNS, draw_turn)
from tests.test_jax_model import jax_copy
from tests.tiny_models import END, IMG, START, ImageOnlyProcessor, image, qwen3_vl

_PROMPTS = flags.DEFINE_integer("prompts", 16, "Prompts.")
_SAMPLES = flags.DEFINE_integer("samples", 8, "Episodes per prompt.")
_SLOTS = flags.DEFINE_integer("slots", 64, "Decode slots (= the static batch size).")
_SCALE = flags.DEFINE_float("scale", 0.25, "Multiplies every token count.")

TEXT_IDS = (1, 200)  # the tiny vocabulary's plain tokens (its special ids are above)


def plan(n_episodes: int, scale: float, seed: int = 0) -> list[list[int]]:
    """Each episode's turn lengths: benchmark_rollout's draws, token counts x scale."""
    out = []
    for e in range(n_episodes):
        rng = np.random.default_rng([seed, zlib.crc32(f"e{e}".encode())])
        left, turns = BUDGET, []
        while left > 0 and len(turns) < TURNS:
            n, right = draw_turn(rng, left)
            turns.append(max(1, int(n * scale)))
            left -= n
            if right:
                break
        out.append(turns)
    return out


class Episodes:
    """The plan's episodes as requests: turn t continues turn t - 1's ids and tokens with the
    feedback; prompt p's episodes share its prompt and image."""

    def __init__(self, processor, turns: list[list[int]], samples: int, scale: float):
        rng = np.random.default_rng(1)
        self.turns, self.scale = turns, scale
        self.images = [image(56, 56, p) for p in range(len(turns) // samples)]
        grid = processor.image_processor(images=self.images[:1],
                                         return_tensors="np")["image_grid_thw"][0]
        n_image = int(grid.prod()) // 4  # merged 2 x 2
        self.prompts = [[START] + [IMG] * n_image + [END]
                        + rng.integers(*TEXT_IDS, int(PROMPT_TOKENS * scale)).tolist()
                        for _ in self.images]
        self.feedback = rng.integers(*TEXT_IDS, max(1, int(FEEDBACK_TOKENS * scale))).tolist()
        self.samples = samples

    def first(self, e: int) -> Request:
        return self._request(e, 0, self.prompts[e // self.samples])

    def next(self, e: int, t: int, previous: Request, tokens: list[int]) -> Request | None:
        """Turn t + 1 of episode e after turn t's request and tokens (None: the episode ended)."""
        if t + 1 >= len(self.turns[e]):
            return None
        return self._request(e, t + 1, list(previous.input_ids) + tokens + self.feedback)

    def _request(self, e: int, t: int, ids: list[int]) -> Request:
        return Request(tuple(ids), [self.images[e // self.samples]],
                       SamplingParams(1.0, 1.0, self.turns[e][t]), f"e{e}")


def lockstep_static(engine: JaxEngine, eps: Episodes, slots: int) -> None:
    """Every turn of the active episodes at once, `slots` requests a batch."""
    active, t = {e: eps.first(e) for e in range(len(eps.turns))}, 0
    while active:
        order = sorted(active)
        done = []
        for i in range(0, len(order), slots):
            done += engine.generate([active[e] for e in order[i:i + slots]])
        nxt = {e: eps.next(e, t, active[e], c.token_ids) for e, c in zip(order, done)}
        active, t = {e: r for e, r in nxt.items() if r is not None}, t + 1


def per_episode_slots(engine: JaxEngine, eps: Episodes) -> None:
    """Each episode submits its next turn as soon as its own is back."""
    pending = {}
    for e in range(len(eps.turns)):
        r = eps.first(e)
        pending[engine.submit(r)] = (e, 0, r)
    while pending:
        finished, _ = concurrent.futures.wait(pending, return_when="FIRST_COMPLETED")
        for f in finished:
            e, t, r = pending.pop(f)
            nxt = eps.next(e, t, r, f.result().token_ids)
            if nxt is not None:
                pending[engine.submit(nxt)] = (e, t + 1, nxt)


def timed(engine: JaxEngine, run) -> dict:
    """One pass: wall seconds, the engine's counters, compiles (0 once warm) and the latency
    model's seconds: DECODE_MS a decode step plus PREFILL_MS a prefill position (a call's rows
    in parallel, as the simulated server runs its requests' prefills), and, harsher, with
    every prefilled token charged one after another (`model_serial_s`)."""
    engine.clear_cache()
    before = (engine.decode_steps, engine.prefilled, engine.prefill_steps, engine.compiles)
    start = time.perf_counter()
    run()
    wall = time.perf_counter() - start
    steps, prefilled, positions, compiles = (a - b for a, b in zip(
        (engine.decode_steps, engine.prefilled, engine.prefill_steps, engine.compiles), before))
    return {"s": round(wall, 3), "compiles": compiles, "decode_steps": steps,
            "prefilled": prefilled, "prefill_steps": positions,
            "model_s": round((DECODE_MS * steps + PREFILL_MS * positions) / 1000, 4),
            "model_serial_s": round((DECODE_MS * steps + PREFILL_MS * prefilled) / 1000, 4)}


def warm(engine: JaxEngine, run, passes: int = 4) -> None:
    """Run until a pass compiles nothing (per-episode admission follows thread timing, so a
    second pass may meet shapes the first did not)."""
    for _ in range(passes):
        if timed(engine, run)["compiles"] == 0:
            return


def main(_):
    hf, patch = qwen3_vl()
    merge, params = jax_copy(hf)
    processor = ImageOnlyProcessor(patch)
    scale, slots = _SCALE.value, _SLOTS.value
    turns = plan(_PROMPTS.value * _SAMPLES.value, scale)
    eps = Episodes(processor, turns, _SAMPLES.value, scale)
    context = len(eps.prompts[0]) + int(BUDGET * scale) + TURNS * len(eps.feedback)
    engine = JaxEngine(merge, lambda: params, processor, hf.config, slots=slots,
                       context=context)
    tokens = sum(map(sum, turns))
    result = {"episodes": len(turns), "turns": round(float(np.mean(list(map(len, turns)))), 2),
              "tokens": tokens, "slots": slots, "scale": scale,
              "device": jax.devices()[0].platform}
    for name, run in (("static_lockstep", lambda: lockstep_static(engine, eps, slots)),
                      ("slots_per_episode", lambda: per_episode_slots(engine, eps))):
        warm(engine, run)
        result[name] = timed(engine, run)
        result[name]["tokens_per_s"] = round(tokens / result[name]["s"], 1)
    a, b = result["static_lockstep"], result["slots_per_episode"]
    result["speedup"] = round(a["s"] / b["s"], 2)
    result["speedup_model"] = round(a["model_s"] / b["model_s"], 2)
    result["speedup_model_serial"] = round(a["model_serial_s"] / b["model_serial_s"], 2)
    result["decode_steps_saved"] = round(a["decode_steps"] / b["decode_steps"], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    app.run(main)
