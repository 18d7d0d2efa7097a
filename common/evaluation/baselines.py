"""What a policy with no skill scores on a split: the line every accuracy is read against.

    baselines(prompts, max_turns) -> {"baseline_first_try": 0.25, "baseline_with_feedback": 0.75}

Per problem, then averaged over the split:
  * a choice problem with c choices: chance on the first try is 1/c; within k turns, a policy
    that never repeats a rejected choice (it only has to read the feedback) solves min(k, c)/c
    (the elimination baseline);
  * a free-form problem: a constant guesser answering the split's most common free-form answer
    gets it on the first try when that is its answer; within k turns it tries the k most common
    answers. (An upper bound for constant guessers: the answers are counted on this very split.)

`kind_of(prompt)` names a problem's kind: the synthetic set's perception families
(`common.synthetic.PERCEPTION`), else "geometry"; `evaluate` reports each kind apart.
"""

from __future__ import annotations

import collections
from typing import NamedTuple, Sequence

import numpy as np

from common.synthetic import PERCEPTION, problem_kind

FIRST, FEEDBACK = "baseline_first_try", "baseline_with_feedback"


class Problem(NamedTuple):
    """What the baselines read of a prompt (small enough to gather from every process)."""

    uid: str
    problem: str
    answer: str
    choices: tuple[str, ...] | None

    @classmethod
    def of(cls, prompt) -> "Problem":
        choices = getattr(prompt, "choices", None)
        return cls(prompt.uid, getattr(prompt, "problem", ""), str(prompt.answer),
                   tuple(choices) if choices else None)


def kind_of(prompt) -> str:
    """"geometry" or a perception family (`common.synthetic.QUESTIONS`), from the problem text."""
    return problem_kind(getattr(prompt, "problem", ""))


def kind_groups(prompts: Sequence) -> dict[str, list[int]]:
    """{kind: prompt indices}: every kind present, plus "perception" (all perception families
    together), only when the split holds more than one kind."""
    groups: dict[str, list[int]] = collections.defaultdict(list)
    for i, p in enumerate(prompts):
        groups[kind_of(p)].append(i)
    if len(groups) < 2:
        return {}
    seen = [i for f in PERCEPTION for i in groups.get(f, [])]
    if seen:
        groups["perception"] = sorted(seen)
    return dict(groups)


def per_prompt(prompts: Sequence, max_turns: int) -> tuple[np.ndarray, np.ndarray]:
    """(first-try, within `max_turns`) success probability of the no-skill policy, one per
    prompt: (N,) float arrays (see the module docstring)."""
    free = [str(p.answer) for p in prompts if not p.choices]
    ranked = [a for a, _ in collections.Counter(free).most_common()]
    first, within = np.zeros(len(prompts)), np.zeros(len(prompts))
    for i, p in enumerate(prompts):
        if p.choices:
            c = len(p.choices)
            first[i], within[i] = 1 / c, min(max_turns, c) / c
        else:
            first[i] = float(str(p.answer) == ranked[0])
            within[i] = float(str(p.answer) in ranked[:max_turns])
    return first, within


def _summarise(prompts: Sequence, max_turns: int, pass_k: Sequence[int]) -> dict[str, float]:
    first, _ = per_prompt(prompts, 1)
    out = {FIRST: float(first.mean())}
    for k in range(2, max_turns + 1):
        out[f"baseline_solved_by_turn_{k}"] = float(per_prompt(prompts, k)[1].mean())
    out[FEEDBACK] = float(per_prompt(prompts, max_turns)[1].mean())
    for k in pass_k:  # k independent first tries: uniform guesses, or the constant guess
        out[f"baseline_pass_at_{k}"] = float(np.mean(1 - (1 - first) ** k))
    return out


def baselines(prompts: Sequence, max_turns: int, pass_k: Sequence[int] = ()
              ) -> dict[str, float]:
    """baseline_first_try, baseline_solved_by_turn_k (k = 2..max_turns),
    baseline_with_feedback and baseline_pass_at_k (k in `pass_k`) over `prompts`, and the same
    under `<kind>/` for each kind when there are several (`kind_groups`); {} for no prompts."""
    if not prompts:
        return {}
    out = _summarise(prompts, max_turns, pass_k)
    for kind, idx in kind_groups(prompts).items():
        part = _summarise([prompts[i] for i in idx], max_turns, pass_k)
        out.update({f"{kind}/{k}": v for k, v in part.items()})
    return out
