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
         - repeat_penalty * (turns that gave an answer the environment had already rejected)
         + progress_bonus * (solved on a turn after a miss)

(AReaL's rule; with a discount <= 1 the max is at the first correct turn, `correct_turn`.) The
progress bonus is SCoRe's (Kumar et al. 2024: a bonus for a later attempt that fixes an earlier
wrong one): here a solve on turn t > 1, whether the missed first call was the policy's own or a
forced one (`train.forced_miss_fraction`). A
turn is correct when the environment graded its answer correct (`info["correct"]`): the reward
never grades again, so the environment's verdict (which ends the episode) and the reward cannot
disagree. Binary by default (discount 1, bonus 0): fractional rewards made equal-reward groups
produce non-zero advantages in one anchor; `common.grpo` also zeroes such groups exactly.

Your own reward: `reward.fn="my_package.my_module:my_reward"` names a function with
`score_episode`'s signature (texts, infos, answer, cfg, choices, env_cfg). It returns an
`EpisodeScore`, or a number: then that number is the reward and correctness (what the accuracy
metrics count) stays the built-in one. `episode_reward(cfg)` gives the function in force.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
from typing import Callable, Sequence

from common.env import REPEATED, SOURCES, EnvConfig


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    source: str = "tool_or_boxed"
    turn_discount: float = 1.0
    format_bonus: float = 0.0
    repeat_penalty: float = 0.0  # per turn whose answer repeats a rejected one (env "repeated")
    progress_bonus: float = 0.0  # added to a solve on a turn after a miss (SCoRe)
    fn: str = ""  # "package.module:function" replaces score_episode; empty: the built-in

    def __post_init__(self):
        if self.source not in SOURCES:
            raise ValueError(f"reward source must be one of {SOURCES}, got {self.source!r}")
        if not 0 < self.turn_discount <= 1:
            raise ValueError(f"turn_discount must be in (0, 1], got {self.turn_discount}")
        if not 0 <= self.repeat_penalty < math.inf:
            raise ValueError(f"repeat_penalty must be finite and >= 0, got {self.repeat_penalty}")
        if not 0 <= self.progress_bonus < math.inf:
            raise ValueError(f"progress_bonus must be finite and >= 0, got {self.progress_bonus}")
        if self.fn:
            load_reward_fn(self.fn)  # a bad name stops the run here, before any rollout


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
    if correct and turn > 1:
        reward += cfg.progress_bonus
    if cfg.format_bonus and any(i.get("tool_score") is not None for i in infos):
        reward += cfg.format_bonus
    reward -= cfg.repeat_penalty * sum(i.get("reason") == REPEATED for i in infos)
    return EpisodeScore(float(reward), correct, turn)


@functools.lru_cache(maxsize=None)
def load_reward_fn(spec: str) -> Callable:
    """The function `spec` ("package.module:function") names, imported once."""
    module, sep, name = spec.partition(":")
    if not sep or not module.strip() or not name.strip():
        raise ValueError(f"reward.fn={spec!r} must read 'package.module:function'")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"reward.fn={spec!r}: cannot import {module!r} ({e}); is its folder on "
                         "PYTHONPATH?") from e
    fn = mod
    for part in name.split("."):
        fn = getattr(fn, part, None)
    if not callable(fn):
        raise ValueError(f"reward.fn={spec!r}: {module!r} has no function {name!r}")
    return fn


def episode_reward(cfg: RewardConfig) -> Callable[..., EpisodeScore]:
    """`score_episode`, or the user's `cfg.fn` wrapped to return an `EpisodeScore`."""
    if not cfg.fn:
        return score_episode
    user = load_reward_fn(cfg.fn)

    def scored(texts, infos, answer, cfg=cfg, choices=None, env_cfg=EnvConfig()):
        out = user(texts, infos, answer, cfg, choices, env_cfg)
        if isinstance(out, EpisodeScore):
            value = out.reward
        elif isinstance(out, (int, float)) and not isinstance(out, bool):
            value = float(out)
            out = dataclasses.replace(score_episode(texts, infos, answer, cfg, choices, env_cfg),
                                      reward=value)
        else:
            raise TypeError(f"reward.fn={cfg.fn!r} returned {type(out).__name__}: it must return "
                            "a number or common.reward.EpisodeScore")
        if not math.isfinite(value):
            raise ValueError(f"reward.fn={cfg.fn!r} returned a non-finite reward {value}")
        return out
    return scored
