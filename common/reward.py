"""The episode reward: one answer per turn, read from the model's own turns only.

A turn's answer is what the environment took it to be (`common.env.turn_answer`, one function
for both): the argument of its valid tool call; a turn without one answers with its last
`\\boxed{}` (the environment's feedback is never read). A box written in the same turn as a
valid call is not a second guess: hedging (box one choice, call the tool with another) earns
nothing a single answer would not. `RewardConfig.source` narrows that (the rollout gives the
environment the same source):
  * `tool`: only tool-call answers count;
  * `boxed`: only boxes count (a turn's last box; the default math reward of single-turn runs);
  * `tool_or_boxed` (default): the rule above.

reward = max over turns t of correct(answer_t) * turn_discount ** (t - 1)
         + format_bonus * (at least one well-formed tool call)

(AReaL's rule; with a discount <= 1 the max is at the first correct turn, `correct_turn`.) A
turn is correct when the environment graded its answer correct (`info["correct"]`): the reward
never grades again, so the environment's verdict (which ends the episode) and the reward cannot
disagree. Binary by default (discount 1, bonus 0): fractional rewards made equal-reward groups
produce non-zero advantages in one anchor; `common.grpo` also zeroes such groups exactly.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from common.env import SOURCES, EnvConfig


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    source: str = "tool_or_boxed"
    turn_discount: float = 1.0
    format_bonus: float = 0.0

    def __post_init__(self):
        if self.source not in SOURCES:
            raise ValueError(f"reward source must be one of {SOURCES}, got {self.source!r}")
        if not 0 < self.turn_discount <= 1:
            raise ValueError(f"turn_discount must be in (0, 1], got {self.turn_discount}")


@dataclasses.dataclass(frozen=True)
class EpisodeScore:
    reward: float
    correct: bool
    correct_turn: int | None  # 1-based turn of the first correct answer


def score_episode(texts: Sequence[str], infos: Sequence[dict], answer: str,
                  cfg: RewardConfig = RewardConfig(), choices: Sequence[str] | None = None,
                  env_cfg: EnvConfig = EnvConfig()) -> EpisodeScore:
    """Score an episode from its assistant texts and the environment's per-turn infos (each
    turn's answer and verdict, `common.env.Geo3kEnv.step`). `answer`, `choices` and `env_cfg`
    are what the environment graded against (kept for reward functions that grade again)."""
    if len(texts) != len(infos):
        raise ValueError(f"{len(texts)} turn texts but {len(infos)} turn infos")
    turn = None
    for t, info in enumerate(infos, start=1):
        if info.get("source") != cfg.source:
            raise ValueError(f"turn {t} was answered from source {info.get('source')!r} but "
                             f"reward.source={cfg.source!r}: build the environment with the "
                             "reward's source (common.env.Geo3kEnv(source=...))")
        if info["correct"]:
            turn = t
            break
    correct = turn is not None
    reward = cfg.turn_discount ** (turn - 1) if correct else 0.0
    if cfg.format_bonus and any(i.get("tool_score") is not None for i in infos):
        reward += cfg.format_bonus
    return EpisodeScore(float(reward), correct, turn)
