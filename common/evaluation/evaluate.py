"""Score a policy on a split, separating geometry from retrying.

    out = evaluate(prompts, engine, renderer, roll_cfg, env_cfg, reward_cfg, n_samples=8,
                   blank_images=True)

Two modes: greedy (temperature 0, one episode per prompt) and, with `n_samples` > 0, sampled
(`n_samples` episodes per prompt at the rollout temperature). Every key comes once per mode,
prefixed `greedy_` / `sampled_`; T is `max_turns`:

    first_try_accuracy   solved on turn 1, before any feedback (the model's own geometry)
    accuracy             solved on any turn, with the environment's feedback (the trained task)
    solved_by_turn_k     solved on one of turns 1..k (cumulative; k = 1..max_turns)
    pass_at_k            unbiased pass@k over the sampled episodes, first-try correctness
    final_pass_at_k      the same with correctness on any turn (sampled mode only, both)
    recovery_after_miss  of the episodes not solved on turn 1, the share solved on turns 2..T
                         (accuracy - first_try_accuracy) / (1 - first_try_accuracy); absent
                         when every episode was solved on turn 1
    recovery_elimination_line, recovery_uniform_line
                         what a blind policy would recover on those same missed episodes: the
                         mean over them of min(T-1, c-1)/(c-1) (non-repeating elimination) and
                         of 1 - (1 - 1/c)^(T-1) (uniform re-guessing), c the problem's number
                         of choices; a free-form problem counts 0 (`baselines.after_miss`).
                         Absent with recovery_after_miss
    repeat_after_miss    of the answers given after a wrong one (turns 2..T), the share that
                         repeat an answer the episode already gave (the environment's
                         "repeated"): 0 for blind non-repeating elimination, 1/c on turn 2 for a
                         uniform re-guess. Absent when no episode reached turn 2
    conditional_line     blind elimination after the run's own first try: the mean over all
                         episodes of [solved on turn 1] + [not] * min(T-1, c-1)/(c-1) (0 for a
                         free-form problem) = first_try_accuracy + (1 - first_try_accuracy) *
                         recovery_elimination_line. With-feedback accuracy above it is
                         feedback used better than blind elimination would use it
    recovery_blind_retry_line, retry_lookup_share
                         of those missed episodes, the share the best figure-blind retry given
                         (kind, first answer) solves, fitted on them, and the share of turn-2
                         answers equal to their (kind, first answer) group's most common one
                         (`common.evaluation.retry`: near 1, the retry is a lookup)
    <key>_se             the binomial standard error sqrt(p(1-p)/n) of every accuracy and
                         recovery (n: the episodes it is a share of; sampled episodes of one
                         prompt are correlated, so theirs is too small)
    turn_<k>_tool_call_rate, turn_<k>_valid_answer_rate, turn_<k>_repeat_rate, turn_<k>_turns
                         of the model's turn-k turns: a well-formed call, an answer that is a
                         listed choice, a repeat of an earlier answer (k >= 2)
    first_try_accuracy_at_<P>, accuracy_at_<P>
                         first-try and with-feedback accuracy of the episodes of choice
                         problems whose correct answer is choice P (A, B, ...: the position as
                         listed, `baselines.answer_position`); absent for a position no problem
                         has (`count_at_<P>`, from the baselines, counts the problems)
    tool_call_rate, response_len_mean, turns_mean, solved_turn_k, ...
                         everything `common.metrics.rollout_metrics` reports

Every accuracy counts an aborted episode as a failure (the denominator is every episode run; an
aborted episode is also a first-try miss that was not recovered).
Beside them stand the no-skill baselines of the same prompts (`common.evaluation.baselines`):
`baseline_first_try` (chance) and `baseline_with_feedback` (elimination within max_turns for
choice problems, a constant guesser for free-form ones), the constant-answer and fixed-order
blind baselines fitted on these problems (`baseline_constant_*`, `baseline_best_order_*`,
`baseline_worst_order_*`) and `count_at_<P>`. When the split mixes kinds of problem (the
synthetic set's perception families and geometry), each kind's outcome metrics and baselines
come again under `<kind>/` (`perception/greedy_first_try_accuracy`, ...).

With `blank_images`, the same prompts run once more, greedy, with every image replaced by a
blank one (`blank_prompts`: white, same size and mode): `blank/greedy_first_try_accuracy` and
`blank/greedy_accuracy` (per kind `<kind>/blank/greedy_...`) tell how much of the accuracy needs
the figure at all (with their standard errors and per-turn rates). The originals are not
touched.

With `forced_miss`, every choice problem runs greedy once more after a first call answering a
uniformly random wrong choice (`common.evaluation.retry`; the environment scores it and gives its
own feedback, the model goes on from turn 2): `forced/greedy_recovery` (± `_se`) beside
`forced/greedy_blind_retry_line` (the best figure-blind retry given kind and forced answer,
exact on these problems) and `forced/greedy_elimination_line`, with `problems`,
`repeat_after_miss`, `retry_lookup_share` and the per-turn rates (per kind `<kind>/forced/...`).
With `episodes`, every episode of the evaluation goes to a JSONL file
(`common.evaluation.episodes`).

`accuracy - first_try_accuracy` is what the feedback buys; comparing first-try pass@k with the
with-feedback accuracy tells whether K tries with feedback beat K independent tries. The training
loop's periodic evaluation (`common.train`) logs these keys as `eval/*`; the torch CLI
(`python -m geo3k_torch.evaluate`) writes them for a checkpoint directory.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import os
from typing import Callable, Mapping, Sequence

import numpy as np
from PIL import Image

from common.env import REPEATED, EnvConfig
from common.evaluation.baselines import (Problem, after_miss, answer_position, baselines,
                                         kind_groups, position_label)
from common.evaluation.episodes import write_episodes
from common.evaluation.retry import (ForcedMiss, Keyed, count_keys, retry_metrics, retry_sums,
                                     stderr, turn_metrics, turn_sums)
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


def outcome_sums(trajs: Sequence[Trajectory], max_turns: int, n: int,
                 rest: Mapping[str, tuple[float, float]] | None = None) -> dict[str, float]:
    """The sums behind `outcome_metrics` for episodes run `n` to a prompt: summed over processes
    (each runs whole prompts), `outcome_of_sums` turns them into the metrics of all of them,
    with no trajectory crossing hosts. With `rest` ({uid: (elimination, uniform)},
    `baselines.after_miss`), also those summed over the episodes not solved on turn 1
    (`missed_elimination`, `missed_uniform`: the recovery lines)."""
    turn = np.array([t.correct_turn if t.correct and t.status != ABORTED else 0
                     for t in trajs], np.int64)  # 0: never solved
    out = {"episodes": float(len(trajs)), "first_try": float(np.sum(turn == 1)),
           "solved": float(np.sum(turn > 0)),
           "later_turns": float(sum(max(0, len(t.turns) - 1) for t in trajs)),
           "repeats": float(sum(u.info.get("reason") == REPEATED for t in trajs
                                for u in t.turns[1:]))}
    for k in range(1, max_turns + 1):
        out[f"solved_by_turn_{k}"] = float(np.sum((turn > 0) & (turn <= k)))
    if rest is not None:
        missed = [rest[t.uid] for t, u in zip(trajs, turn) if u != 1]
        out["missed_elimination"] = float(sum(e for e, _ in missed))
        out["missed_uniform"] = float(sum(u for _, u in missed))
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
    every prompt ran `n` episodes) pass_at_k / final_pass_at_k for k in `pass_ks(n)`, and (when
    the sums have them) conditional_line, and recovery_after_miss with its two lines where an
    episode missed its first try (the module docstring); an aborted episode counts as a failure
    everywhere. {} for no episodes."""
    episodes = sums["episodes"]
    if not episodes:
        return {}
    out = {"first_try_accuracy": sums["first_try"] / episodes,
           "accuracy": sums["solved"] / episodes}
    for k in range(1, max_turns + 1):
        out[f"solved_by_turn_{k}"] = sums[f"solved_by_turn_{k}"] / episodes
    out |= {f"{k}_se": stderr(v, episodes) for k, v in list(out.items())}
    if sums.get("later_turns"):
        out["repeat_after_miss"] = sums["repeats"] / sums["later_turns"]
    if "missed_elimination" in sums:
        out["conditional_line"] = (sums["first_try"] + sums["missed_elimination"]) / episodes
        missed = episodes - sums["first_try"]
        if missed:
            out["recovery_after_miss"] = (sums["solved"] - sums["first_try"]) / missed
            out["recovery_after_miss_se"] = stderr(out["recovery_after_miss"], missed)
            out["recovery_elimination_line"] = sums["missed_elimination"] / missed
            out["recovery_uniform_line"] = sums["missed_uniform"] / missed
    if n > 1 and sums["groups"] and not sums["groups_not_n"]:
        for k in pass_ks(n):
            out[f"pass_at_{k}"] = sums[f"pass_at_{k}"] / sums["groups"]
            out[f"final_pass_at_{k}"] = sums[f"final_pass_at_{k}"] / sums["groups"]
    return out


def outcome_metrics(trajs: Sequence[Trajectory], max_turns: int, n: int) -> dict[str, float]:
    """`outcome_of_sums` of one process's episodes (`n` to a prompt)."""
    return outcome_of_sums(outcome_sums(trajs, max_turns, n), max_turns, n)


def position_sums(trajs: Sequence[Trajectory], max_turns: int,
                  positions: Mapping[str, int | None], n_positions: int) -> dict[str, float]:
    """`outcome_sums` of the episodes whose problem has its correct answer at choice position
    q (`positions`: {uid: q or None}, `baselines.answer_position`), for q < `n_positions`,
    under `at_<P>/` (P = `position_label(q)`)."""
    out = {}
    for q in range(n_positions):
        part = outcome_sums([t for t in trajs if positions[t.uid] == q], max_turns, 1)
        out |= {f"at_{position_label(q)}/{k}": v for k, v in part.items()}
    return out


def position_metrics(sums: dict[str, float], max_turns: int, n_positions: int
                     ) -> dict[str, float]:
    """first_try_accuracy_at_<P> and accuracy_at_<P> from `position_sums`' sums; a position
    without episodes has none."""
    out = {}
    for q in range(n_positions):
        label = position_label(q)
        part = outcome_of_sums(_part(sums, f"at_{label}/"), max_turns, 1)
        for key in ("first_try_accuracy", "accuracy") if part else ():
            out[f"{key}_at_{label}"] = part[key]
            out[f"{key}_at_{label}_se"] = part[f"{key}_se"]
    return out


BLANK = "blank"  # the blank-image run's keys: blank/greedy_<key>, <kind>/blank/greedy_<key>
FORCED = "forced"  # the forced-miss run's keys: forced/greedy_<key>, <kind>/forced/greedy_<key>
BLANK_KEYS = ("first_try_accuracy", "accuracy")  # what the blank-image run reports


def blank_image(image):
    """A white image of `image`'s size and mode (a PIL image; a new one, `image` untouched)."""
    if not isinstance(image, Image.Image):
        raise TypeError(f"blank images need PIL images, got {type(image).__name__}")
    return Image.new("RGB", image.size, "white").convert(image.mode)


def blank_prompts(prompts: Sequence) -> list:
    """Shallow copies of `prompts` whose `images` are `blank_image`s of theirs; the prompts
    themselves (and their image lists) are left as they were."""
    out = []
    for p in prompts:
        images = [blank_image(im) for im in p.images]
        if dataclasses.is_dataclass(p):
            out.append(dataclasses.replace(p, images=images))
        else:
            q = copy.copy(p)
            q.images = images
            out.append(q)
    return out


def evaluate(prompts: Sequence, engine, renderer, roll_cfg: RolloutConfig,
             env_cfg: EnvConfig = EnvConfig(), reward_cfg: RewardConfig = RewardConfig(),
             n_samples: int = 1, split: Sequence | None = None,
             sum_scalars: Callable[[dict], dict] = lambda sums: sums,
             blank_images: bool = False, forced_miss: bool = False, seed: int = 0,
             episodes: str | os.PathLike | None = None) -> dict:
    """Greedy and sampled metrics of `prompts` (see the module docstring), with
    `blank_images` the greedy run with blank images (`blank/`), with `forced_miss` the greedy
    run after a forced wrong first call drawn from `seed` (`forced/`); with `episodes`, every
    episode of this process written there (`common.evaluation.episodes`).

    Data parallel: each process runs its own `prompts` (the prompts of one uid on one process);
    `split` is the whole evaluated split (every process's prompts, or their `Problem`s: the
    baselines, the kinds, the answer positions and the recovery lines are read from it; default
    `prompts`), and `sum_scalars` sums a dict of floats over processes
    (`Collectives.sum_scalars`): only those sums cross processes.
    """
    split = [Problem.of(p) for p in (prompts if split is None else split)]
    T = env_cfg.max_turns
    out = baselines(split, T, pass_ks(n_samples) if n_samples > 1 else ())
    kinds = {k: {split[i].uid for i in idx} for k, idx in kind_groups(split).items()}
    elimination, uniform = after_miss(split, T)
    rest = {p.uid: (e, u) for p, e, u in zip(split, elimination, uniform)}
    positions = {p.uid: answer_position(p) for p in split}
    n_positions = max((len(p.choices) for p in split if positions[p.uid] is not None),
                      default=0)
    keyed = {p.uid: Keyed.of(p) for p in split}
    keys = count_keys(split)  # the retry counts' keys, fixed by the split
    fine = {"": sorted(keys)} | {kind: sorted({keyed[u].kind for u in uids})
                                 for kind, uids in kinds.items()}  # each fitted per kind
    greedy = dataclasses.replace(roll_cfg, n_samples=1, temperature=0.0)
    runs = [("greedy", greedy, prompts, None)]
    if n_samples > 0:
        runs.append(("sampled", dataclasses.replace(roll_cfg, n_samples=n_samples), prompts,
                     None))
    if blank_images:
        runs.append((f"{BLANK}/greedy", greedy, blank_prompts(prompts), None))
    if forced_miss:
        forced = ForcedMiss.of(split, seed)
        mine = [p for p in prompts if p.uid in forced.positions]
        runs.append((f"{FORCED}/greedy", greedy, mine, forced.first_turns(mine, renderer)))

    def outcomes(trajs, n):  # the sums of one group of episodes
        return (outcome_sums(trajs, T, n, rest)
                | position_sums(trajs, T, positions, n_positions)
                | {f"turns/{k}": v for k, v in turn_sums(trajs, keyed, T).items()})

    def metrics_of(sums, n, retries, group):
        return (outcome_of_sums(sums, T, n) | position_metrics(sums, T, n_positions)
                | turn_metrics(_part(sums, "turns/"), T)
                | retry_metrics(retries, fine[group], keys, T))

    written = []
    for name, cfg, run_prompts, first_turns in runs:
        trajs = rollout(run_prompts, engine, renderer, cfg, env_cfg, reward_cfg,
                        first_turns=first_turns) if run_prompts else []
        written.append((name.split("/")[0], trajs))
        sums = {f"rollout/{k}": v for k, v in rollout_sums(trajs, T).items()}
        sums |= {f"outcome/{k}": v for k, v in outcomes(trajs, cfg.n_samples).items()}
        for kind, uids in kinds.items():
            part = outcomes([t for t in trajs if t.uid in uids], cfg.n_samples)
            sums |= {f"{kind}/{k}": v for k, v in part.items()}
        sums |= {f"retry/{k}": v for k, v in retry_sums(trajs, keyed, keys).items()}
        sums = sum_scalars(sums)
        retries = _part(sums, "retry/")
        metrics = metrics_of_sums(_part(sums, "rollout/"), T)
        metrics.update(metrics_of(_part(sums, "outcome/"), cfg.n_samples, retries, ""))
        parts = {kind: metrics_of(_part(sums, f"{kind}/"), cfg.n_samples, retries, kind)
                 for kind in kinds}
        if name.startswith(BLANK):
            metrics, parts = _blank(metrics), {kind: _blank(m) for kind, m in parts.items()}
        elif name.startswith(FORCED):
            metrics = _forced(metrics, forced.lines(set(keyed), T))
            parts = {kind: _forced(m, forced.lines(kinds[kind], T))
                     for kind, m in parts.items()}
        out.update({f"{name}_{k}": v for k, v in metrics.items()})
        for kind, part in parts.items():
            out.update({f"{kind}/{name}_{k}": v for k, v in part.items()})
    if episodes is not None:
        write_episodes(episodes, written, keyed)
    return out


def _blank(m: dict[str, float]) -> dict[str, float]:
    """What the blank-image run reports of its metrics: `BLANK_KEYS`, their standard errors
    and the per-turn rates."""
    return {k: v for k, v in m.items()
            if k.removesuffix("_se") in BLANK_KEYS or k.startswith("turn_")}


def _forced(m: dict[str, float], lines: dict[str, float]) -> dict[str, float]:
    """What the forced-miss run reports: `recovery` (its with-feedback accuracy: turn 1 is
    always wrong) with `recovery_se`, `repeat_after_miss`, `retry_lookup_share`, the per-turn
    rates (the model's turns only) and the figure-blind lines (`ForcedMiss.lines`); {} for a
    group without forced problems."""
    if "accuracy" not in m or not lines:
        return {}
    out = {"recovery": m["accuracy"], "recovery_se": m["accuracy_se"]} | lines
    keep = ("repeat_after_miss", "retry_lookup_share")
    return out | {k: v for k, v in m.items() if k in keep or k.startswith("turn_")}


def _part(sums: dict[str, float], prefix: str) -> dict[str, float]:
    return {k[len(prefix):]: v for k, v in sums.items() if k.startswith(prefix)}
