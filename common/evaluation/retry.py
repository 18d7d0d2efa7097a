"""What a retry after a miss reads: the forced miss and the figure-blind retry lines.

    lines = ForcedMiss.of(split, seed)            # each choice problem's uniformly random wrong
    ids = reply_ids(renderer, call_text("7"))     # choice, as a first turn the env then scores

A recovery after the model's own miss above blind elimination (2/3 with 4 choices and 3 turns)
does not show that the retry reads the figure: with choices listed in a fixed order and
systematic first-try errors, a lookup keyed by the first answer can beat it. Two lines tell:

  * forced miss (`eval.forced_miss`): every choice problem replayed greedy after a first call
    that answers a uniformly random wrong choice, scored by the environment with its own
    feedback (`common.rollout`'s `first_turns`); the model goes on from turn 2. Its recovery
    stands beside the best figure-blind retry policy: per (kind, forced answer) group of the
    evaluated problems, the best order of the other choices' positions (never repeating the
    forced one, trying T-1 of them), scored on that very group (`best_retry_solved`);
  * after the model's own miss: the same best figure-blind retry given (kind, first answer),
    fitted on the missed episodes, and the share of turn-2 answers that equal their group's
    most common one (`lookup_share`: near 1, the retry is a function of the first answer).

Answers are keyed by position among the listed choices (`answer_key`: 0 = A; -1 for an answer
that is none of them, or none at all); for the perception families, whose choices are fixed
and in natural order, position and value are the same thing. A problem without choices, or
whose answer is none of them, gets no forced miss and counts 0 in the blind lines (no finite
set of answers to go through). Every count here is a sum over episodes whose key is fixed by
the split (`count_keys`), so processes exchange only sums.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import math
import zlib
from typing import Mapping, Sequence

import numpy as np

from common.env import REPEATED
from common.evaluation.baselines import (MAX_ORDER_POSITIONS, Problem, after_miss,
                                         answer_position, kind_of, order_hits)
from common.prompts import TOOL_NAMES
from common.rollout import ABORTED, Trajectory

NONE = -1  # the key of an answer that is no listed choice (or no answer)


def stderr(p: float, n: float) -> float:
    """The binomial standard error sqrt(p (1 - p) / n) of a share p of n trials (0 for n = 0)."""
    return math.sqrt(max(p * (1 - p), 0.0) / n) if n else 0.0


def answer_key(answer: str | None, choices: Sequence[str] | None) -> int:
    """The position (0 = A) of `answer` among `choices`, by value then by letter
    (`baselines.answer_position`); NONE for no answer, no choices or no match."""
    if answer is None or not choices:
        return NONE
    q = answer_position(Problem("", "", str(answer), tuple(choices)))
    return NONE if q is None else q


def call_text(answer: str) -> str:
    """A first turn that calls the scoring tool with `answer`, as Qwen writes a call."""
    call = {"name": TOOL_NAMES[0], "arguments": {"answer": answer}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def reply_ids(renderer, text: str) -> list[int]:
    """`text` as an assistant turn's ids, ended by the turn-end token (`common.sft`'s
    encoding: the ids follow the generation prompt as the model's own would)."""
    return list(renderer.tokenizer.encode(text, add_special_tokens=False)) + [
        renderer.turn_end_id]


def forced_position(problem: Problem, seed: int) -> int | None:
    """A uniformly random wrong choice's position for `problem`, drawn from its uid and `seed`
    alone (the same on every process, whatever the sharding); None without a known answer
    position."""
    q = answer_position(problem)
    if q is None or len(problem.choices) < 2:
        return None
    wrong = [p for p in range(len(problem.choices)) if p != q]
    rng = np.random.default_rng([seed, zlib.crc32(problem.uid.encode())])
    return wrong[int(rng.integers(len(wrong)))]


@dataclasses.dataclass(frozen=True)
class Keyed:
    """What the lines read of one problem: kind, answer position q, number of choices n."""

    kind: str
    q: int
    n: int
    choices: tuple[str, ...] | None

    @classmethod
    def of(cls, p: Problem) -> "Keyed":
        q = answer_position(p)
        return cls(kind_of(p), NONE if q is None else q, len(p.choices or ()), p.choices)


def count_keys(split: Sequence[Problem]) -> dict[str, tuple[int, list[int]]]:
    """{kind: (C, choice counts)}: per kind its largest number of choices C and every number
    of choices its problems have; the count keys of `retry_sums` follow from them."""
    out: dict[str, tuple[int, set]] = {}
    for p in split:
        k = Keyed.of(p)
        c, ns = out.get(k.kind, (0, set()))
        out[k.kind] = (max(c, k.n), ns | {k.n})
    return {k: (c, sorted(ns)) for k, (c, ns) in out.items()}


def _zeros(keys: Mapping[str, tuple[int, list[int]]]) -> dict[str, float]:
    out = {}
    for kind, (c, ns) in keys.items():
        for f in range(NONE, c):
            out |= {f"{kind}/first_{f}/at_{q}/of_{n}": 0.0 for q in range(NONE, c) for n in ns}
            out |= {f"{kind}/first_{f}/then_{g}": 0.0 for g in range(NONE, c)}
    return out


def retry_sums(trajs: Sequence[Trajectory], keyed: Mapping[str, Keyed],
               keys: Mapping[str, tuple[int, list[int]]]) -> dict[str, float]:
    """Counts over the episodes not solved on turn 1 (aborted ones included), per kind and
    first answer f (`answer_key` of turn 1's answer): `first_f/at_q/of_n` (answer at q of n
    choices) and, where a turn 2 followed, `first_f/then_g` (turn 2 answered g). Every key of
    the split's kinds is present (0 when no episode has it)."""
    out = _zeros(keys)
    for t in trajs:
        if t.correct_turn == 1 and t.status != ABORTED:
            continue
        k = keyed[t.uid]
        first = t.turns[0].info.get("answer") if t.turns else None
        f = answer_key(first, k.choices)
        out[f"{k.kind}/first_{f}/at_{k.q}/of_{k.n}"] += 1.0
        if len(t.turns) > 1:
            out[f"{k.kind}/first_{f}/then_{answer_key(t.turns[1].info.get('answer'), k.choices)}"
                ] += 1.0
    return out


def best_retry_solved(cells: Mapping[tuple[int, int, int], float], n_positions: int,
                      max_turns: int) -> float:
    """How many of the counted problems the best figure-blind retry solves: per first answer
    f, the order of positions (f first when it is a choice: it was tried; else all of them,
    one turn spent) that solves the most of `cells` {(f, q, n): count} within `max_turns`
    turns (`baselines.order_hits`: a position a problem lacks is skipped), summed over f.
    Every order of `n_positions` <= 6 positions is tried; more, the rest by how often the
    answer sits there. Answers at no position (q = NONE) are never solved."""
    total = 0.0
    for f in sorted({f for f, _, _ in cells}):
        held = [(q, n, c) for (g, q, n), c in cells.items() if g == f and q != NONE and c]
        if not held:
            continue
        q, n, w = (np.array(x) for x in zip(*held))
        rest = [p for p in range(n_positions) if p != f]
        if n_positions - (f != NONE) <= MAX_ORDER_POSITIONS:
            tails = [list(t) for t in itertools.permutations(rest)]
        else:
            hits = np.bincount(q, weights=w, minlength=n_positions)
            tails = [sorted(rest, key=lambda p: -hits[p])]
        head = [f] if f != NONE else []
        orders = np.array([head + t for t in tails])
        _, within = order_hits(q, n, orders, max_turns - (f == NONE))
        total += float(np.max(within.astype(float) @ w))
    return total


def retry_metrics(sums: Mapping[str, float], kinds: Sequence[str],
                  keys: Mapping[str, tuple[int, list[int]]], max_turns: int
                  ) -> dict[str, float]:
    """Over the missed episodes of `kinds` (each fitted on its own: a policy sees its kind),
    from `retry_sums`' summed counts: `recovery_blind_retry_line` (the share the best
    figure-blind retry given kind and first answer solves on turns 2..T) and
    `retry_lookup_share` (of the turn-2 answers, the share equal to their (kind, first answer)
    group's most common one). {} for no missed episodes; no share without a turn 2."""
    missed = solved = retries = common = 0.0
    for kind in kinds:
        c, ns = keys[kind]
        cells = {(f, q, n): sums[f"{kind}/first_{f}/at_{q}/of_{n}"]
                 for f in range(NONE, c) for q in range(NONE, c) for n in ns}
        missed += sum(cells.values())
        solved += best_retry_solved(cells, c, max_turns)
        for f in range(NONE, c):
            then = [sums[f"{kind}/first_{f}/then_{g}"] for g in range(NONE, c)]
            retries, common = retries + sum(then), common + max(then)
    out = {"recovery_blind_retry_line": solved / missed} if missed else {}
    if retries:
        out["retry_lookup_share"] = common / retries
    return out


def turn_sums(trajs: Sequence[Trajectory], keyed: Mapping[str, Keyed], max_turns: int
              ) -> dict[str, float]:
    """Per turn k = 1..T over the turns taken (forced ones left out): `turn_k/turns`,
    `turn_k/calls` (a well-formed tool call, `tool_score` set), `turn_k/valid` (an answer
    that is a listed choice; any answer for a problem without choices) and `turn_k/repeats`
    (the environment's "repeated")."""
    out = {f"turn_{k}/{w}": 0.0 for k in range(1, max_turns + 1)
           for w in ("turns", "calls", "valid", "repeats")}
    for t in trajs:
        choices = keyed[t.uid].choices
        for k, u in enumerate(t.turns, 1):
            if u.forced:
                continue
            given = u.info.get("answer")
            valid = given is not None and (not choices or answer_key(given, choices) != NONE)
            out[f"turn_{k}/turns"] += 1.0
            out[f"turn_{k}/calls"] += float(u.info.get("tool_score") is not None)
            out[f"turn_{k}/valid"] += float(valid)
            out[f"turn_{k}/repeats"] += float(u.info.get("reason") == REPEATED)
    return out


def turn_metrics(sums: Mapping[str, float], max_turns: int) -> dict[str, float]:
    """`turn_<k>_tool_call_rate`, `turn_<k>_valid_answer_rate`, `turn_<k>_repeat_rate` (k >= 2)
    and `turn_<k>_turns` from `turn_sums`; nothing for a turn no episode took."""
    out = {}
    for k in range(1, max_turns + 1):
        n = sums[f"turn_{k}/turns"]
        if not n:
            continue
        out[f"turn_{k}_turns"] = n
        out[f"turn_{k}_tool_call_rate"] = sums[f"turn_{k}/calls"] / n
        out[f"turn_{k}_valid_answer_rate"] = sums[f"turn_{k}/valid"] / n
        if k > 1:
            out[f"turn_{k}_repeat_rate"] = sums[f"turn_{k}/repeats"] / n
    return out


@dataclasses.dataclass(frozen=True)
class ForcedMiss:
    """The forced first answers of a split and their figure-blind lines (exact: the forced
    answers are drawn from each uid, so every process knows all of them)."""

    positions: dict[str, int]  # uid -> forced position, for the problems that get one
    problems: dict[str, Problem]

    @classmethod
    def of(cls, split: Sequence[Problem], seed: int) -> "ForcedMiss":
        pos = {p.uid: f for p in split if (f := forced_position(p, seed)) is not None}
        return cls(pos, {p.uid: p for p in split if p.uid in pos})

    def first_turns(self, prompts: Sequence, renderer) -> list[list[int] | None]:
        """Per prompt, the ids of its forced first call (None: no forced miss for it)."""
        return [reply_ids(renderer, call_text(self.problems[p.uid].choices[
            self.positions[p.uid]])) if p.uid in self.positions else None for p in prompts]

    def lines(self, uids: set[str], max_turns: int) -> dict[str, float]:
        """Over the forced problems among `uids`: `problems`, `blind_retry_line` (the best
        retry given kind and forced answer, fitted per kind on them) and `elimination_line`
        (min(T-1, c-1)/(c-1) on average, `baselines.after_miss`). {} for none."""
        chosen = [self.problems[u] for u in sorted(uids) if u in self.positions]
        if not chosen:
            return {}
        by_kind: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        for p in chosen:
            k = Keyed.of(p)
            by_kind[k.kind][(self.positions[p.uid], k.q, k.n)] += 1.0
        solved = sum(best_retry_solved(cells, max(n for _, _, n in cells), max_turns)
                     for cells in by_kind.values())
        return {"problems": float(len(chosen)), "blind_retry_line": solved / len(chosen),
                "elimination_line": float(after_miss(chosen, max_turns)[0].mean())}


def forced_first_turns(prompts: Sequence, renderer, fraction: float, seed: int, step: int
                       ) -> list[list[int] | None] | None:
    """Training's forced misses (`train.forced_miss_fraction`): per prompt, with probability
    `fraction` (drawn from seed, step and uid: the same on every process), the ids of a first
    call answering a uniformly random wrong choice, which the prompt's whole group then starts
    from; None for the others and for problems without a known answer among their choices.
    The group's retries are then compared with each other after the same miss, one a lookup
    keyed by the first answer cannot win (SCoRe's turn-2 training from given first attempts).
    None when no prompt gets one."""
    if fraction <= 0:
        return None
    chosen = [p for p in prompts if np.random.default_rng(
        [seed, step, zlib.crc32(p.uid.encode())]).random() < fraction]
    forced = ForcedMiss.of([Problem.of(p) for p in chosen], zlib.crc32(f"{seed}/{step}".encode()))
    turns = forced.first_turns(prompts, renderer)
    return turns if any(t is not None for t in turns) else None

