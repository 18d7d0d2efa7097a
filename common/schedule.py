"""The learning-rate schedule both learners use: warmup, then constant, linear or cosine decay.

Plain Python: the torch learner calls `lr_factor` from a `LambdaLR`; the JAX learner tabulates it
(`lr_table`) so the jitted optimizer reads the very same numbers. Both count optimizer steps,
which `horizon` converts the config's rollout counts to.
"""

from __future__ import annotations

import math

import numpy as np

SCHEDULES = ("constant", "linear", "cosine")


def lr_factor(step: int, schedule: str, warmup_steps: int, total_steps: int,
              min_ratio: float = 0.0) -> float:
    """Multiplier of the base LR at optimizer step `step` (0-based): linear warmup over
    `warmup_steps`, then constant, linear decay or cosine decay to `min_ratio` at `total_steps`."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    frac = min(max(step - warmup_steps, 0) / max(total_steps - warmup_steps, 1), 1.0)
    if schedule == "linear":
        return 1.0 - (1.0 - min_ratio) * frac
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * frac))


def horizon(train_cfg) -> tuple[int, int]:
    """(warmup, total) in optimizer steps. `train.warmup_steps` and `train.steps` count rollouts,
    and each rollout takes `train.updates_per_rollout` optimizer steps (`common.step.update`)."""
    u = train_cfg.updates_per_rollout
    if u < 1:
        raise ValueError(f"train.updates_per_rollout must be >= 1, got {u}")
    return train_cfg.warmup_steps * u, train_cfg.steps * u


def lr_table(lr: float, schedule: str, warmup_steps: int, total_steps: int,
             min_ratio: float = 0.0) -> np.ndarray:
    """(total_steps + 1,) float32 learning rates, lr * lr_factor(step), for steps 0..total;
    steps past the end keep the last value."""
    return np.array([lr * lr_factor(s, schedule, warmup_steps, total_steps, min_ratio)
                     for s in range(max(total_steps, 0) + 1)], np.float32)
