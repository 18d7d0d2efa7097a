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
    done = [t for t in trajs if t.status != ABORTED]
    out: dict[str, float] = {"trajectories": float(len(trajs)),
                             "aborted": float(len(trajs) - len(done)),
                             "truncated": float(sum(t.status == TRUNCATED for t in done))}
    for reason in ABORT_REASONS:
        out[f"aborted_{reason}"] = float(sum(t.abort_reason == reason for t in trajs))
    if not done:
        return out
    rewards = np.array([t.reward for t in done])
    turns = [len(t.turns) for t in done]
    calls = sum(ti.info.get("tool_score") is not None for t in done for ti in t.turns)
    out.update({
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()),
        "accuracy": float(np.mean([t.correct for t in done])),
        "tool_call_rate": calls / max(sum(turns), 1),
        "turns_mean": float(np.mean(turns)),
        "response_len_mean": float(np.mean([t.response_len for t in done])),
        "generated_len_mean": float(np.mean([t.num_generated for t in done])),
    })
    for k in range(1, max_turns + 1):
        out[f"solved_turn_{k}"] = float(np.mean([t.correct_turn == k for t in done]))
    return out
