"""Rollout metrics: what a batch of trajectories says about the policy, for training and eval.

Both learners log these names; `evaluate` reports the same keys on a test split.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from common.rollout import ABORT_REASONS, ABORTED, TRUNCATED, Trajectory


def rollout_metrics(trajs: Sequence[Trajectory], max_turns: int) -> dict[str, float]:
    """Means over trajectories (aborted ones count only in `aborted`).

    trajectories, aborted (and aborted_<reason> for each `ABORT_REASONS`), truncated;
    reward_mean/std, accuracy, tool_call_rate (share of turns with a well-formed tool call),
    turns_mean, response_len_mean (tokens after the prompt), generated_len_mean (tokens the
    model sampled), truncated / aborted (counts), solved_turn_k (share solved first on turn k).
    """
    return metrics_of_sums(rollout_sums(trajs, max_turns), max_turns)


def rollout_sums(trajs: Sequence[Trajectory], max_turns: int) -> dict[str, float]:
    """The sums behind `rollout_metrics`: summed over processes (`Collectives.sum_scalars`),
    `metrics_of_sums` turns them into the metrics of all the processes' trajectories, with
    no trajectory crossing hosts."""
    done = [t for t in trajs if t.status != ABORTED]
    rewards = np.array([t.reward for t in done], np.float64)
    out = {"trajectories": float(len(trajs)), "aborted": float(len(trajs) - len(done)),
           "truncated": float(sum(t.status == TRUNCATED for t in done)),
           "done": float(len(done)), "reward_sum": float(rewards.sum()),
           "reward_sq_sum": float((rewards ** 2).sum()),
           "correct": float(sum(bool(t.correct) for t in done)),
           "calls": float(sum(ti.info.get("tool_score") is not None
                              for t in done for ti in t.turns)),
           "turns": float(sum(len(t.turns) for t in done)),
           "response_len": float(sum(t.response_len for t in done)),
           "generated_len": float(sum(t.num_generated for t in done))}
    for reason in ABORT_REASONS:
        out[f"aborted_{reason}"] = float(sum(t.abort_reason == reason for t in trajs))
    for k in range(1, max_turns + 1):
        out[f"solved_turn_{k}"] = float(sum(t.correct_turn == k for t in done))
    return out


def metrics_of_sums(sums: dict[str, float], max_turns: int) -> dict[str, float]:
    """`rollout_metrics` from `rollout_sums` (of one process, or summed over processes)."""
    out = {k: sums[k] for k in ("trajectories", "aborted", "truncated")}
    out |= {f"aborted_{r}": sums[f"aborted_{r}"] for r in ABORT_REASONS}
    n = sums["done"]
    if not n:
        return out
    mean = sums["reward_sum"] / n
    out.update({
        "reward_mean": mean,
        "reward_std": float(np.sqrt(max(sums["reward_sq_sum"] / n - mean ** 2, 0.0))),
        "accuracy": sums["correct"] / n,
        "tool_call_rate": sums["calls"] / max(sums["turns"], 1.0),
        "turns_mean": sums["turns"] / n,
        "response_len_mean": sums["response_len"] / n,
        "generated_len_mean": sums["generated_len"] / n,
    })
    for k in range(1, max_turns + 1):
        out[f"solved_turn_{k}"] = sums[f"solved_turn_{k}"] / n
    return out
