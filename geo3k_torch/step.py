"""One GRPO iteration on this rank's prompts: rollout -> advantages -> packing -> update.

Shared by the training loop and the learning test, so both run exactly the same math. Every
collective goes through `geo3k_torch.distributed` (no-ops in a single process).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import numpy as np

from common.batching import pack, training_sequences
from common.env import EnvConfig
from common.grpo import episode_advantages
from common.reward import STATS as reward_stats
from common.rollout import ABORTED, RolloutConfig, Trajectory, rollout
from common.scoring import RewardConfig
from geo3k_torch import distributed

# Per-rank learner metrics that are not token means: how to merge them over ranks.
_MAX_KEYS = ("logp_diff_max", "grad_norm", "lr", "skipped")


@dataclasses.dataclass(frozen=True)
class StepConfig:
    rollout: RolloutConfig
    env: EnvConfig
    reward: RewardConfig
    normalize_std: bool = True
    filter_equal_groups: bool = True
    micro_batch_tokens: int = 8192


def grpo_step(prompts, engine, renderer, learner, cfg: StepConfig, group_offset: int,
              train_context=contextlib.nullcontext) -> tuple[list[Trajectory], dict[str, float]]:
    """Roll out `prompts`, train once on the result. Returns this rank's trajectories and the
    step's metrics (learner metrics merged over ranks, batch counts, phase times).

    The engine's weights are NOT synced here: the caller does that (see geo3k_torch.backends).
    `train_context()` wraps the update (a colocated inference server frees its memory there).
    """
    world = learner.world_size
    graded = reward_stats.snapshot()
    t0 = time.perf_counter()
    trajs = rollout(prompts, engine, renderer, cfg.rollout, cfg.env, cfg.reward, group_offset)
    graded = {k: v - graded[k] for k, v in reward_stats.snapshot().items()}
    t1 = time.perf_counter()
    rewards = np.array([t.reward for t in trajs])
    groups = np.array([t.group_id for t in trajs])
    valid = np.array([t.status != ABORTED for t in trajs])
    adv, keep = episode_advantages(rewards, groups, valid, cfg.normalize_std,
                                   cfg.filter_equal_groups)
    seqs = training_sequences(trajs, adv, cfg.rollout.export_style, keep)
    batches = pack(seqs, cfg.micro_batch_tokens)
    counts = distributed.sum_scalars(
        {"tokens": float(sum(s.loss_mask.sum() for s in seqs)), "seqs": float(len(seqs)),
         "micro": float(len(batches)), "packed": float(sum(b.num_tokens for b in batches)),
         "filtered": float(len(set(groups[~keep & valid]))),
         "grader_timeouts": float(graded["timeouts"]), "grader_calls": float(graded["calls"]),
         "generated": float(sum(t.num_generated for t in trajs))}, max_keys=("micro",))
    batches = distributed.even_out(batches, int(counts["micro"]))
    t2 = time.perf_counter()
    metrics: dict[str, float] = {}
    if counts["seqs"] > 0:  # no group with a reward spread on any rank: nothing to learn
        with train_context():
            m = learner.train_step(batches, counts["tokens"], counts["seqs"])
        m = distributed.sum_scalars(m, max_keys=_MAX_KEYS)
        metrics = {k: v if k in _MAX_KEYS + ("loss",) else v / world for k, v in m.items()}
    t3 = time.perf_counter()
    metrics.update({
        "filtered_groups": counts["filtered"], "sequences": counts["seqs"],
        "grader_calls": counts["grader_calls"], "grader_timeouts": counts["grader_timeouts"],
        "micro_batches": counts["micro"],
        "packing_efficiency": counts["packed"] / max(counts["micro"] * world
                                                      * cfg.micro_batch_tokens, 1.0),
        "time_rollout": t1 - t0, "time_batching": t2 - t1, "time_train": t3 - t2,
        "rollout_tokens_per_s": counts["generated"] / max(t1 - t0, 1e-9) / world,
        "train_tokens_per_s": counts["packed"] / max(t3 - t2, 1e-9) / world})
    return trajs, metrics
