"""The simulated multi-turn mix both rollout benchmarks draw from (`benchmark_rollout.py`'s
simulated server, `benchmark_jax_engine.py`'s real engine): slime's multi-turn Geometry3K shape.

    n, right = draw_turn(rng, left)   # a turn's new tokens (at most `left`), whether it is right

A turn is log-normal (median MEDIAN_LEN tokens, sigma SIGMA, at least 8), right with
probability P_RIGHT (else the episode takes another turn, up to TURNS); an episode's turns share
BUDGET new tokens; the prompt is PROMPT_TOKENS tokens, each feedback FEEDBACK_TOKENS. The
latency model of an accelerator: PREFILL_MS a prefilled token, DECODE_MS a new token of a
request (a decode step advances every running request by one).
"""

from __future__ import annotations

import numpy as np

PREFILL_MS, DECODE_MS = 0.002, 0.05  # milliseconds per token
MEDIAN_LEN, SIGMA, P_RIGHT = 400, 0.9, 0.45
PROMPT_TOKENS, FEEDBACK_TOKENS, BUDGET, TURNS = 400, 60, 4096, 3


def draw_turn(rng: np.random.Generator, left: int) -> tuple[int, bool]:
    """(new tokens, right) of one turn with `left` new tokens left in its episode."""
    n = int(min(max(8, rng.lognormal(np.log(MEDIAN_LEN), SIGMA)), left))
    return n, bool(rng.random() < P_RIGHT)
