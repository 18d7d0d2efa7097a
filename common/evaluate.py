"""Score a policy on a split: greedy and sampled accuracy, accuracy by turn, turns, tool use.

Backend-agnostic: it needs an `Engine` and a `Renderer`, like the rollout. The torch CLI
(`python -m geo3k_torch.evaluate`) wraps it for a checkpoint directory.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from common.env import EnvConfig
from common.metrics import rollout_metrics
from common.rollout import RolloutConfig, rollout
from common.scoring import RewardConfig


def evaluate(prompts: Sequence, engine, renderer, roll_cfg: RolloutConfig,
             env_cfg: EnvConfig = EnvConfig(), reward_cfg: RewardConfig = RewardConfig(),
             n_samples: int = 1, gather: Callable[[object], list] = lambda x: [x]) -> dict:
    """Greedy (temperature 0, one episode per prompt) and, if `n_samples` > 0, sampled episodes
    at the rollout temperature. `gather` collects every rank's trajectories (data parallel).

    Returns greedy_* and sampled_* versions of `common.metrics.rollout_metrics`'s keys.
    """
    out = {}
    modes = [("greedy", dataclasses.replace(roll_cfg, n_samples=1, temperature=0.0))]
    if n_samples > 0:
        modes.append(("sampled", dataclasses.replace(roll_cfg, n_samples=n_samples)))
    for name, cfg in modes:
        trajs = rollout(prompts, engine, renderer, cfg, env_cfg, reward_cfg) if prompts else []
        merged = [t for part in gather(trajs) for t in part]
        out.update({f"{name}_{k}": v for k, v in rollout_metrics(merged,
                                                                  env_cfg.max_turns).items()})
    return out
