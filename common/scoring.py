"""The episode reward: one number per multi-turn episode, read from the model's own turns only.

Where correctness comes from (`RewardConfig.source`):
  * `tool`: the first tool call the environment scored correct;
  * `boxed`: the last `\\boxed{}` of the model's turns (the default math reward model, applied to
    the assistant text alone: the environment's feedback is never read);
  * `tool_or_boxed` (default): `tool`, else `boxed`. With `end_on_correct` the episode stops at a
    correct call, before any box, so the tool result must count.

reward = correct * turn_discount ** (turn of the first correct answer - 1)
         + format_bonus * (at least one well-formed tool call)

Binary by default (discount 1, bonus 0): fractional rewards made equal-reward groups produce
non-zero advantages in one anchor; `common.grpo` also zeroes such groups exactly.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from common.env import resolve_choice
from common.reward import extract_last_boxed, grade_answer

SOURCES = ("tool", "boxed", "tool_or_boxed")


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    source: str = "tool_or_boxed"
    turn_discount: float = 1.0
    format_bonus: float = 0.0
    rel_tol: float = 0.0
    timeout_s: float = 5.0

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


def _boxed_turn(texts: Sequence[str], answer: str, cfg: RewardConfig,
                choices: Sequence[str] | None) -> int | None:
    """1-based turn holding the last box of the model's turns, if that box is correct."""
    for turn in range(len(texts), 0, -1):
        boxed = extract_last_boxed(texts[turn - 1])
        if boxed is not None:
            ok = grade_answer(resolve_choice(boxed, choices), answer, rel_tol=cfg.rel_tol,
                              timeout_s=cfg.timeout_s)
            return turn if ok else None
    return None


def score_episode(texts: Sequence[str], infos: Sequence[dict], answer: str,
                  cfg: RewardConfig = RewardConfig(),
                  choices: Sequence[str] | None = None) -> EpisodeScore:
    """Score an episode from its assistant texts and the environment's per-turn infos.
    With `choices`, a boxed choice letter stands for that choice."""
    turn = None
    if cfg.source in ("tool", "tool_or_boxed"):
        turn = next((i["turn"] for i in infos if i.get("tool_score") == 1.0), None)
    if turn is None and cfg.source in ("boxed", "tool_or_boxed"):
        turn = _boxed_turn(texts, answer, cfg, choices)
    correct = turn is not None
    reward = cfg.turn_discount ** (turn - 1) if correct else 0.0
    if cfg.format_bonus and any(i.get("tool_score") is not None for i in infos):
        reward += cfg.format_bonus
    return EpisodeScore(float(reward), correct, turn)
