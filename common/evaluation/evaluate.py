"""Score a policy on a split, separating geometry from retrying.

    out = evaluate(prompts, engine, renderer, roll_cfg, env_cfg, reward_cfg, n_samples=8)

Two modes: greedy (temperature 0, one episode per prompt) and, with `n_samples` > 0, sampled
(`n_samples` episodes per prompt at the rollout temperature). Every key comes once per mode,
prefixed `greedy_` / `sampled_`:

    first_try_accuracy   solved on turn 1, before any feedback (the model's own geometry)
    accuracy             solved on any turn, with the environment's feedback (the trained task)
    solved_by_turn_k     solved on one of turns 1..k (cumulative; k = 1..max_turns)
    pass_at_k            unbiased pass@k over the sampled episodes, first-try correctness
    final_pass_at_k      the same with correctness on any turn (sampled mode only, both)
    tool_call_rate, response_len_mean, turns_mean, solved_turn_k, ...
                         everything `common.metrics.rollout_metrics` reports

Every accuracy counts an aborted episode as a failure (the denominator is every episode run).
Beside them stand the no-skill baselines of the same prompts (`common.evaluation.baselines`):
`baseline_first_try` (chance) and `baseline_with_feedback` (elimination within max_turns for
choice problems, a constant guesser for free-form ones). When the split mixes kinds of problem
(the synthetic set's perception families and geometry), each kind's outcome metrics and
baselines come again under `<kind>/` (`perception/greedy_first_try_accuracy`, ...).

`accuracy - first_try_accuracy` is what the feedback buys; comparing first-try pass@k with the
with-feedback accuracy tells whether K tries with feedback beat K independent tries. The training
loop's periodic evaluation (`common.train`) logs these keys as `eval/*`; the torch CLI
(`python -m geo3k_torch.evaluate`) writes them for a checkpoint directory.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Sequence

import numpy as np

from common.env import EnvConfig
from common.evaluation.baselines import Problem, baselines, kind_groups
from common.metrics import metrics_of_sums, rollout_sums
from common.rollout import ABORTED, RolloutConfig, Trajectory, rollout
from common.reward import RewardConfig


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k)."""
    if not 0 < k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 < k <= n and 0 <= c <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    # C(n-c, k) / C(n, k) = prod_{i = n-c+1}^{n} (1 - k / i), stable for large n
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def pass_ks(n: int) -> list[int]:
    """The k reported for n samples: 1, 2, 4, ... below n, and n."""
    ks = [1 << i for i in range(n.bit_length()) if (1 << i) < n]
    return ks + [n]


def outcome_sums(trajs: Sequence[Trajectory], max_turns: int, n: int) -> dict[str, float]:
    """The sums behind `outcome_metrics` for episodes run `n` to a prompt: summed over processes
    (each runs whole prompts), `outcome_of_sums` turns them into the metrics of all of them,
    with no trajectory crossing hosts."""
    turn = np.array([t.correct_turn if t.correct and t.status != ABORTED else 0
                     for t in trajs], np.int64)  # 0: never solved
    out = {"episodes": float(len(trajs)), "first_try": float(np.sum(turn == 1)),
           "solved": float(np.sum(turn > 0))}
    for k in range(1, max_turns + 1):
        out[f"solved_by_turn_{k}"] = float(np.sum((turn > 0) & (turn <= k)))
    if n > 1:
        groups = collections.defaultdict(list)
        for t, u in zip(trajs, turn):
            groups[t.uid].append(u)
        whole = [np.asarray(g) for g in groups.values() if len(g) == n]
        out["groups"], out["groups_not_n"] = float(len(whole)), float(len(groups) - len(whole))
        for k in pass_ks(n):
            out[f"pass_at_{k}"] = sum(pass_at_k(n, int(np.sum(g == 1)), k) for g in whole)
            out[f"final_pass_at_{k}"] = sum(pass_at_k(n, int(np.sum(g > 0)), k) for g in whole)
    return out


def outcome_of_sums(sums: dict[str, float], max_turns: int, n: int) -> dict[str, float]:
    """first_try_accuracy, accuracy, solved_by_turn_k over all episodes, plus (when `n` > 1 and
    every prompt ran `n` episodes) pass_at_k / final_pass_at_k for k in `pass_ks(n)`; an aborted
    episode counts as a failure everywhere. {} for no episodes."""
    episodes = sums["episodes"]
    if not episodes:
        return {}
    out = {"first_try_accuracy": sums["first_try"] / episodes,
           "accuracy": sums["solved"] / episodes}
    for k in range(1, max_turns + 1):
        out[f"solved_by_turn_{k}"] = sums[f"solved_by_turn_{k}"] / episodes
    if n > 1 and sums["groups"] and not sums["groups_not_n"]:
        for k in pass_ks(n):
            out[f"pass_at_{k}"] = sums[f"pass_at_{k}"] / sums["groups"]
            out[f"final_pass_at_{k}"] = sums[f"final_pass_at_{k}"] / sums["groups"]
    return out


def outcome_metrics(trajs: Sequence[Trajectory], max_turns: int, n: int) -> dict[str, float]:
    """`outcome_of_sums` of one process's episodes (`n` to a prompt)."""
    return outcome_of_sums(outcome_sums(trajs, max_turns, n), max_turns, n)


def evaluate(prompts: Sequence, engine, renderer, roll_cfg: RolloutConfig,
             env_cfg: EnvConfig = EnvConfig(), reward_cfg: RewardConfig = RewardConfig(),
             n_samples: int = 1, split: Sequence | None = None,
             sum_scalars: Callable[[dict], dict] = lambda sums: sums) -> dict:
    """Greedy and sampled metrics of `prompts` (see the module docstring).

    Data parallel: each process runs its own `prompts` (the prompts of one uid on one process);
    `split` is the whole evaluated split (every process's prompts, or their `Problem`s: the
    baselines and the kinds are read from it; default `prompts`), and `sum_scalars` sums a
    dict of floats over processes (`Collectives.sum_scalars`): only those sums cross processes.
    """
    split = [Problem.of(p) for p in (prompts if split is None else split)]
    out = baselines(split, env_cfg.max_turns, pass_ks(n_samples) if n_samples > 1 else ())
    kinds = {k: {split[i].uid for i in idx} for k, idx in kind_groups(split).items()}
    modes = [("greedy", dataclasses.replace(roll_cfg, n_samples=1, temperature=0.0))]
    if n_samples > 0:
        modes.append(("sampled", dataclasses.replace(roll_cfg, n_samples=n_samples)))
    T = env_cfg.max_turns
    for name, cfg in modes:
        trajs = rollout(prompts, engine, renderer, cfg, env_cfg, reward_cfg) if prompts else []
        sums = {f"rollout/{k}": v for k, v in rollout_sums(trajs, T).items()}
        sums |= {f"outcome/{k}": v for k, v in outcome_sums(trajs, T, cfg.n_samples).items()}
        for kind, uids in kinds.items():
            part = outcome_sums([t for t in trajs if t.uid in uids], T, cfg.n_samples)
            sums |= {f"{kind}/{k}": v for k, v in part.items()}
        sums = sum_scalars(sums)
        metrics = metrics_of_sums(_part(sums, "rollout/"), T)
        metrics.update(outcome_of_sums(_part(sums, "outcome/"), T, cfg.n_samples))
        out.update({f"{name}_{k}": v for k, v in metrics.items()})
        for kind in kinds:
            part = outcome_of_sums(_part(sums, f"{kind}/"), T, cfg.n_samples)
            out.update({f"{kind}/{name}_{k}": v for k, v in part.items()})
    return out


def _part(sums: dict[str, float], prefix: str) -> dict[str, float]:
    return {k[len(prefix):]: v for k, v in sums.items() if k.startswith(prefix)}
