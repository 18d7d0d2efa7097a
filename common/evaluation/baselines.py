"""What a policy with no skill scores on a split: the line every accuracy is read against.

    baselines(prompts, max_turns) -> {"baseline_first_try": 0.25, "baseline_with_feedback": 0.75,
                                      "baseline_constant_first_try": ..., "count_at_A": 31, ...}

Per problem, then averaged over the split (`per_prompt`):
  * a choice problem with c choices: chance on the first try is 1/c; within k turns, a policy
    that never repeats a rejected choice (it only has to read the feedback) solves min(k, c)/c
    (the elimination baseline);
  * a free-form problem: a constant guesser answering the split's most common free-form answer
    gets it on the first try when that is its answer; within k turns it tries the k most common
    answers. (An upper bound for constant guessers: the answers are counted on this very split.)

Blind policies fitted to the evaluated problems themselves (upper bounds for a policy that never
looks at the figure, since each is chosen on the split it is scored on), T = max_turns:
  * `baseline_constant_first_try` / `baseline_constant_with_feedback` (`constant_per_prompt`):
    per kind (`kind_of`), the kind's most common answer value (answers compared as values,
    `normalise`d strings; choice problems too) is guessed first, then the next most common, up
    to T guesses; the guesser never reads the choices (a guess that is not one of them is just
    wrong). Averaged over every problem;
  * `baseline_best_order_first_try`, `baseline_best_order_with_feedback`,
    `baseline_worst_order_first_try`, `baseline_worst_order_with_feedback` (`order_per_prompt`):
    a policy that answers the choices by position in a fixed order (say C, A, D, B: the letters
    as the choices are listed), a position a problem lacks skipped. Per kind, the best (worst)
    such order for the first try and, separately, for solving within T turns, over every order
    of the kind's C positions (C = its largest number of choices; all C! orders for C <= 6,
    else just the two orders that sort the positions by how often the answer sits there, most
    often first and last: exact when all the kind's problems have C choices). Averaged over the
    choice problems whose answer is one of their choices (`answer_position`); absent when none;
  * `count_at_<P>` (P = A, B, ...: `position_label`): how many problems have their answer at
    choice position P, for every position up to the split's largest number of choices.

For a first try that missed (`after_miss`; `common.evaluation.evaluate` reads it per episode):
a blind policy's chance to solve the problem in the remaining T - 1 turns, by non-repeating
elimination min(T-1, c-1)/(c-1) (the missed try ruled one of the c choices out) or by uniform
re-guessing 1 - (1 - 1/c)^(T-1); 0 for a free-form problem (no finite set of answers to go
through: a blind policy has no line to recover by there).

`kind_of(prompt)` names a problem's kind: the synthetic set's perception families
(`common.synthetic.PERCEPTION`), else "geometry"; `evaluate` reports each kind apart, every
key above again under `<kind>/`.
"""

from __future__ import annotations

import collections
import itertools
from typing import NamedTuple, Sequence

import numpy as np

from common.env import resolve_choice
from common.synthetic import PERCEPTION, problem_kind

FIRST, FEEDBACK = "baseline_first_try", "baseline_with_feedback"
MAX_ORDER_POSITIONS = 6  # every order of up to this many positions is tried (6! = 720)


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


def normalise(answer: str) -> str:
    """An answer as the constant guesser compares it: whitespace dropped, lower case
    ("5 \\sqrt{2}" -> "5\\sqrt{2}", "B" -> "b")."""
    return "".join(str(answer).split()).lower()


def position_label(q: int) -> str:
    """The letter of choice position q (0 -> "A", 25 -> "Z"; "#27" and on past Z)."""
    return chr(ord("A") + q) if q < 26 else f"#{q + 1}"


def position_index(label: str) -> int:
    """The inverse of `position_label`."""
    return int(label[1:]) - 1 if label.startswith("#") else ord(label) - ord("A")


def answer_position(prompt) -> int | None:
    """Where the correct answer sits among `prompt.choices` (0 = A): the first choice equal to
    the answer as a value (`normalise`), else the one the answer names by letter ("B", "(b)":
    `common.env.resolve_choice`); None for a free-form problem or an answer that is no choice."""
    if not prompt.choices:
        return None
    listed = [normalise(c) for c in prompt.choices]
    for answer in (str(prompt.answer), resolve_choice(str(prompt.answer), prompt.choices)):
        if normalise(answer) in listed:
            return listed.index(normalise(answer))
    return None


def _top(values: Sequence[str], k: int) -> np.ndarray:
    """(N,) float: 1 where the value is among the k most common of `values` (counted on
    `values` itself; ties at the k-th place go to the value seen first, which changes no sum
    over `values`)."""
    ranked = {a for a, _ in collections.Counter(values).most_common(k)}
    return np.array([float(v in ranked) for v in values])


def per_prompt(prompts: Sequence, max_turns: int) -> tuple[np.ndarray, np.ndarray]:
    """(first-try, within `max_turns`) success probability of the no-skill policy, one per
    prompt: (N,) float arrays (see the module docstring)."""
    free = [i for i, p in enumerate(prompts) if not p.choices]
    answers = [str(prompts[i].answer) for i in free]
    first, within = np.zeros(len(prompts)), np.zeros(len(prompts))
    first[free], within[free] = _top(answers, 1), _top(answers, max_turns)
    for i, p in enumerate(prompts):
        if p.choices:
            c = len(p.choices)
            first[i], within[i] = 1 / c, min(max_turns, c) / c
    return first, within


def _by_kind(prompts: Sequence) -> dict[str, list[int]]:
    """{kind_of: prompt indices}: the blind policies below are fitted per kind."""
    groups: dict[str, list[int]] = collections.defaultdict(list)
    for i, p in enumerate(prompts):
        groups[kind_of(p)].append(i)
    return groups


def constant_per_prompt(prompts: Sequence, max_turns: int) -> tuple[np.ndarray, np.ndarray]:
    """(first-try, within `max_turns`) success of the per-kind constant guesser (the module
    docstring), one per prompt: (N,) float arrays of 0 and 1."""
    first, within = np.zeros(len(prompts)), np.zeros(len(prompts))
    for idx in _by_kind(prompts).values():
        values = [normalise(prompts[i].answer) for i in idx]
        first[idx], within[idx] = _top(values, 1), _top(values, max_turns)
    return first, within


def order_hits(positions: np.ndarray, n_choices: np.ndarray, orders: np.ndarray,
               max_turns: int) -> tuple[np.ndarray, np.ndarray]:
    """(first-try, within `max_turns`) hits, (O, M) bool each, of the blind policy answering
    positions in each order of `orders` (O, C) (a permutation of 0..C-1 per row) on M problems
    whose answer sits at `positions` (M,) among their `n_choices` (M,) <= C choices; an order
    skips the positions a problem lacks."""
    where = np.argsort(orders, axis=1)  # (O, C): the turn (0-based) each position comes on
    answer_at = where[:, positions]  # (O, M)
    lacks = np.arange(orders.shape[1])[None, :] >= n_choices[:, None]  # (M, C)
    earlier = (where[:, None, :] < answer_at[:, :, None]) & ~lacks[None]  # (O, M, C)
    tries_before = earlier.sum(-1)  # (O, M): wrong tries before the answer
    return tries_before == 0, tries_before < max_turns


def order_per_prompt(prompts: Sequence, max_turns: int) -> dict[str, np.ndarray]:
    """{"best_first", "best_within", "worst_first", "worst_within"}: (N,) float arrays, each
    prompt's hit (0 or 1) under its kind's best / worst fixed order of positions for the first
    try / within `max_turns` (the module docstring); NaN where `answer_position` is None."""
    out = {k: np.full(len(prompts), np.nan)
           for k in ("best_first", "best_within", "worst_first", "worst_within")}
    for idx in _by_kind(prompts).values():
        idx = [i for i in idx if answer_position(prompts[i]) is not None]
        if not idx:
            continue
        pos = np.array([answer_position(prompts[i]) for i in idx])
        n = np.array([len(prompts[i].choices) for i in idx])
        C = int(n.max())
        if C <= MAX_ORDER_POSITIONS:
            orders = np.array(list(itertools.permutations(range(C))))
        else:
            by_count = np.argsort(-np.bincount(pos, minlength=C), kind="stable")
            orders = np.stack([by_count, by_count[::-1]])
        for name, hits in zip(("first", "within"), order_hits(pos, n, orders, max_turns)):
            total = hits.sum(1)
            out[f"best_{name}"][idx] = hits[int(np.argmax(total))]
            out[f"worst_{name}"][idx] = hits[int(np.argmin(total))]
    return out


def after_miss(prompts: Sequence, max_turns: int) -> tuple[np.ndarray, np.ndarray]:
    """(elimination, uniform): (N,) float arrays, a blind policy's chance to solve each prompt
    on turns 2..`max_turns` after a missed first try (the module docstring): min(T-1, c-1)/(c-1)
    and 1 - (1 - 1/c)^(T-1) for c choices (a one-choice problem: 1 when T > 1), 0 free-form."""
    elim, uniform = np.zeros(len(prompts)), np.zeros(len(prompts))
    rest = max_turns - 1
    for i, p in enumerate(prompts):
        if p.choices:
            c = len(p.choices)
            elim[i] = min(rest, c - 1) / (c - 1) if c > 1 else float(rest > 0)
            uniform[i] = 1 - (1 - 1 / c) ** rest
    return elim, uniform


def _summarise(prompts: Sequence, max_turns: int, pass_k: Sequence[int]) -> dict[str, float]:
    first, _ = per_prompt(prompts, 1)
    out = {FIRST: float(first.mean())}
    for k in range(2, max_turns + 1):
        out[f"baseline_solved_by_turn_{k}"] = float(per_prompt(prompts, k)[1].mean())
    out[FEEDBACK] = float(per_prompt(prompts, max_turns)[1].mean())
    for k in pass_k:  # k independent first tries: uniform guesses, or the constant guess
        out[f"baseline_pass_at_{k}"] = float(np.mean(1 - (1 - first) ** k))
    constant = constant_per_prompt(prompts, max_turns)
    out["baseline_constant_first_try"] = float(constant[0].mean())
    out["baseline_constant_with_feedback"] = float(constant[1].mean())
    orders = order_per_prompt(prompts, max_turns)
    for which in ("best", "worst"):
        for name, key in (("first", "first_try"), ("within", "with_feedback")):
            hits = orders[f"{which}_{name}"]
            if not np.isnan(hits).all():
                out[f"baseline_{which}_order_{key}"] = float(np.nanmean(hits))
    positions = [q for q in map(answer_position, prompts) if q is not None]
    if positions:
        n = max(len(p.choices) for p in prompts if answer_position(p) is not None)
        counts = np.bincount(positions, minlength=n)
        out |= {f"count_at_{position_label(q)}": float(c) for q, c in enumerate(counts)}
    return out


def baselines(prompts: Sequence, max_turns: int, pass_k: Sequence[int] = ()
              ) -> dict[str, float]:
    """baseline_first_try, baseline_solved_by_turn_k (k = 2..max_turns),
    baseline_with_feedback, baseline_pass_at_k (k in `pass_k`), the constant and fixed-order
    baselines and count_at_<P> over `prompts` (the module docstring), and the same under
    `<kind>/` for each kind when there are several (`kind_groups`); {} for no prompts."""
    if not prompts:
        return {}
    out = _summarise(prompts, max_turns, pass_k)
    for kind, idx in kind_groups(prompts).items():
        part = _summarise([prompts[i] for i in idx], max_turns, pass_k)
        out.update({f"{kind}/{k}": v for k, v in part.items()})
    return out
