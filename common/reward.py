"""The episode reward: one answer per turn, read from the model's own turns only.

A turn's answer (`turn_answer`) is the argument of its valid tool call; a turn without one
answers with its last `\\boxed{}` (the environment's feedback is never read). A box written in
the same turn as a valid call is not a second guess: hedging (box one choice, call the tool with
another) earns nothing a single answer would not. `RewardConfig.source` narrows that:
  * `tool`: only tool-call answers count;
  * `boxed`: only boxes count (a turn's last box; the default math reward of single-turn runs);
  * `tool_or_boxed` (default): the rule above.

reward = max over turns t of correct(answer_t) * turn_discount ** (t - 1)
         + format_bonus * (at least one well-formed tool call)

(AReaL's rule; with a discount <= 1 the max is at the first correct turn, `correct_turn`.) A
tool answer is correct when the environment scored it 1.0; a boxed one is graded with the
environment's own setting (`EnvConfig.rel_tol`, `grade_timeout_s`), so the environment's verdict
and the reward can never disagree. Binary by default (discount 1, bonus 0): fractional rewards
made equal-reward groups produce non-zero advantages in one anchor; `common.grpo` also zeroes
such groups exactly.

Your own reward: `reward.fn="my_package.my_module:my_reward"` names a function with
`score_episode`'s signature (texts, infos, answer, cfg, choices, env_cfg). It returns an
`EpisodeScore`, or a number: then that number is the reward and correctness (what the accuracy
metrics count) stays the built-in grader's. `episode_reward(cfg)` gives the function in force.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
from typing import Callable, Sequence

from common.env import EnvConfig, resolve_choice
from common.grader import extract_last_boxed, grade_answer

SOURCES = ("tool", "boxed", "tool_or_boxed")


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    source: str = "tool_or_boxed"
    turn_discount: float = 1.0
    format_bonus: float = 0.0
    fn: str = ""  # "package.module:function" replaces score_episode; empty: the built-in

    def __post_init__(self):
        if self.source not in SOURCES:
            raise ValueError(f"reward source must be one of {SOURCES}, got {self.source!r}")
        if not 0 < self.turn_discount <= 1:
            raise ValueError(f"turn_discount must be in (0, 1], got {self.turn_discount}")
        if self.fn:
            load_reward_fn(self.fn)  # a bad name stops the run here, before any rollout


@dataclasses.dataclass(frozen=True)
class EpisodeScore:
    reward: float
    correct: bool
    correct_turn: int | None  # 1-based turn of the first correct answer


def turn_answer(text: str, info: dict, source: str) -> tuple[str, str] | None:
    """("tool" | "boxed", answer) of one turn under `source`, or None if it gave no answer."""
    if source != "boxed" and info.get("tool_score") is not None:
        return "tool", str(info["parsed_answer"])
    if source != "tool":
        boxed = extract_last_boxed(text)
        if boxed is not None:
            return "boxed", boxed
    return None


def score_episode(texts: Sequence[str], infos: Sequence[dict], answer: str,
                  cfg: RewardConfig = RewardConfig(), choices: Sequence[str] | None = None,
                  env_cfg: EnvConfig = EnvConfig()) -> EpisodeScore:
    """Score an episode from its assistant texts and the environment's per-turn infos. With
    `choices`, a boxed choice letter stands for that choice (as the environment reads calls)."""
    if len(texts) != len(infos):
        raise ValueError(f"{len(texts)} turn texts but {len(infos)} turn infos")
    turn = None
    for t, (text, info) in enumerate(zip(texts, infos), start=1):
        given = turn_answer(text, info, cfg.source)
        if given is None:
            continue
        kind, value = given
        if kind == "tool":
            ok = info["tool_score"] == 1.0
        else:
            ok = grade_answer(resolve_choice(value, choices), answer, rel_tol=env_cfg.rel_tol,
                              timeout_s=env_cfg.grade_timeout_s)
        if ok:
            turn = t
            break
    correct = turn is not None
    reward = cfg.turn_discount ** (turn - 1) if correct else 0.0
    if cfg.format_bonus and any(i.get("tool_score") is not None for i in infos):
        reward += cfg.format_bonus
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
