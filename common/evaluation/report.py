"""An evaluation's metrics (`common.evaluation.evaluate.evaluate`) as a markdown table and a bar chart.

    write_report(metrics, out_dir, title, max_turns)  # eval.json, eval.md, eval.png

The chart answers one question at a glance: how much of the accuracy is first-try geometry and
how much is retrying with feedback. One bar group per mode (greedy, sampled); bars from left to
right: first try, solved by turn 2..K, with feedback (final), and sampled pass@k (first try over
k independent samples, the fair comparison for K tries with feedback). A black line over each
bar group is what a policy with no skill gets there (`common.evaluation.baselines`): chance on
the first try, elimination within k turns; the table has it as its last column. A dashed line
over each mode's with-feedback bar is blind elimination after the mode's own first try
(`conditional_line`). Below the first table's accuracies come that line, the recovery after a
first-try miss and its two blind lines (`recovery_*`); with a blank-image run its greedy
accuracies stand in a "blank images" column beside greedy. Then two small tables: the blind
baselines fitted on these problems (constant answer, best and worst fixed order of answer
positions, beside chance and elimination) and the accuracy by answer position (one row per
position A, B, ..., with its number of problems). A split with several kinds of problem
(`<kind>/` keys) gets these tables once per kind and a chart panel each for perception and
geometry. Every accuracy and recovery stands ± its standard error where the metrics have one
(`<key>_se`); with a forced-miss run a table of its recovery per kind beside its figure-blind
lines follows the first table, and with a blank-image or forced-miss run a per-turn table
(tool calls, valid answers, repeats) ends each kind's tables.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from common.evaluation.baselines import position_index
from common.evaluation.evaluate import BLANK, FORCED

MODES = ("greedy", "sampled")
BASELINE = "no skill"  # the column (and chart line) of `common.evaluation.baselines`
BLANK_COLUMN = "blank images"  # the greedy run on blank images (`blank/greedy_<key>`)
CONDITIONAL = "elimination after own first try"  # the row of `<mode>_conditional_line`
BLIND_RETRY = "best figure-blind retry after a miss"  # `<mode>_recovery_blind_retry_line`
LOOKUP = "turn-2 answers equal to their group's most common"  # `<mode>_retry_lookup_share`
FORCED_RUN = f"{FORCED}/greedy"  # the forced-miss run's keys


def _passes(m: dict, prefix: str) -> list[int]:
    return sorted(int(k[len(prefix):]) for k in m if k.startswith(prefix))


def kinds(m: dict) -> list[str]:
    """The problem kinds with their own metrics (`<kind>/greedy_accuracy`), perception first."""
    found = sorted({k.split("/")[0] for k in m if k.endswith("/greedy_accuracy")} - {BLANK, FORCED})
    return sorted(found, key=lambda k: (k != "perception", k == "geometry", k))


def part(m: dict, kind: str) -> dict:
    """One kind's metrics with the `<kind>/` prefix taken off."""
    return {k[len(kind) + 1:]: v for k, v in m.items() if k.startswith(kind + "/")}


def rows(m: dict, max_turns: int) -> list[tuple[str, dict[str, float]]]:
    """(label, {mode: value, BLANK_COLUMN: value, BASELINE: value}) rows of the table and
    chart, in reading order; a row's baseline is there when `m` has it (`baseline_<key>`), its
    blank-image value when `m` has `blank/greedy_<key>`."""
    return [(label, vals) for label, _, vals in keyed_rows(m, max_turns)]


def keyed_rows(m: dict, max_turns: int) -> list[tuple[str, str, dict[str, float]]]:
    """`rows` with each row's metric key: (label, key, values)."""
    out = [("first try (turn 1)", "first_try_accuracy")]
    out += [(f"solved by turn {k}", f"solved_by_turn_{k}") for k in range(2, max_turns)]
    out += [(f"with feedback (≤{max_turns} turns)", "accuracy"),
            (CONDITIONAL, "conditional_line"),
            ("recovery after a first-try miss", "recovery_after_miss"),
            (BLIND_RETRY, "recovery_blind_retry_line"),
            (LOOKUP, "retry_lookup_share"),
            ("elimination after a miss", "recovery_elimination_line"),
            ("uniform re-guess after a miss", "recovery_uniform_line"),
            ("later answers repeating an earlier one", "repeat_after_miss")]
    out += [(f"pass@{k}, first try", f"pass_at_{k}") for k in _passes(m, "sampled_pass_at_")
            if k > 1]  # pass@1 is the sampled first-try accuracy
    out += [("tool-call rate", "tool_call_rate"), ("turns per episode", "turns_mean"),
            ("response tokens", "response_len_mean")]
    baseline = {"first_try_accuracy": "baseline_first_try", "accuracy": "baseline_with_feedback"}
    table = []
    for label, key in out:
        vals = {mode: m[f"{mode}_{key}"] for mode in MODES if f"{mode}_{key}" in m}
        if vals and f"{BLANK}/greedy_{key}" in m:
            vals[BLANK_COLUMN] = m[f"{BLANK}/greedy_{key}"]
        b = baseline.get(key, "baseline_" + key)
        if vals and b in m:
            vals[BASELINE] = m[b]
        if vals:
            table.append((label, key, vals))
    return table


def markdown(m: dict, max_turns: int, title: str = "") -> str:
    """The metrics as markdown tables (all problems, then each kind): one row per quantity, one
    column per mode (and the blank-image run beside greedy), and the no-skill baseline; then
    the blind baselines fitted on these problems and the accuracy by answer position."""
    lines = [f"**{title}**", ""] if title else []
    for kind in ["", *kinds(m)]:
        sub = part(m, kind) if kind else m
        modes = [mode for mode in MODES if f"{mode}_accuracy" in sub]
        if not modes:
            continue
        blank = [BLANK_COLUMN] if f"{BLANK}/greedy_accuracy" in sub else []
        cols = modes[:1] + blank + modes[1:] + ([BASELINE] if "baseline_first_try" in sub else [])
        if kind:
            lines += ["", f"*{kind} problems*", ""]
        lines += ["| | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
        table = keyed_rows(sub, max_turns)
        se = {mode: f"{mode}_" for mode in modes} | {BLANK_COLUMN: f"{BLANK}/greedy_"}
        for label, key, vals in table:
            cells = [_fmt(vals[c], sub.get(f"{se[c]}{key}_se") if c in se else None)
                     if c in vals else "" for c in cols]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        if not kind and any(label == CONDITIONAL for label, _, _ in table):  # said once
            lines += ["", f"{CONDITIONAL}: the run's own first try, then blind elimination of "
                      "the other choices; elimination / uniform re-guess after a miss: what "
                      "blind elimination / uniform guessing would recover of the same missed "
                      "episodes (free-form problems count 0 in these lines)."]
            if any(label == BLIND_RETRY for label, _, _ in table):
                lines += ["", f"{BLIND_RETRY}: per (kind, first answer), the order of the other "
                          "choices that solves the most of those missed episodes, chosen on "
                          "them (an upper bound for a retry that never looks at the figure); "
                          f"{LOOKUP}: near 1, the retry is a lookup keyed by the first answer. ± one binomial standard error, sqrt(p(1-p)/n) "
                          "(sampled episodes of one problem are correlated: theirs is too "
                          "small)."]
        if not kind:
            lines += forced_table(m)
        lines += (blind_table(sub, max_turns, note=not kind) + position_table(sub)
                  + turn_table(sub, max_turns))
    return "\n".join(lines) + "\n"


def forced_table(m: dict) -> list[str]:
    """The markdown lines of the forced-miss table (none without `forced/greedy_*` keys): one
    row for all problems and one per kind, the recovery after the forced wrong first call
    beside the best figure-blind retry and blind elimination on the same problems."""
    groups = [("all problems", m)] + [(kind, part(m, kind)) for kind in kinds(m)]
    found = [(label, sub) for label, sub in groups if f"{FORCED_RUN}_recovery" in sub]
    if not found:
        return []
    lines = ["", "forced miss (greedy, after a first call answering a uniformly random wrong "
             "choice, with the environment's feedback):", "",
             "| | problems | recovery | best figure-blind retry | elimination | later answers "
             "repeating | turn-2 answers equal to their group's most common |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for label, sub in found:
        get = lambda key: sub.get(f"{FORCED_RUN}_{key}")  # noqa: E731
        cells = [f"{int(get('problems'))}", _fmt(get("recovery"), get("recovery_se"))]
        cells += ["" if get(k) is None else _fmt(get(k)) for k in (
            "blind_retry_line", "elimination_line", "repeat_after_miss", "retry_lookup_share")]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines + ["", "best figure-blind retry: per (kind, forced answer), the order of the "
                    "other choices that solves the most of those problems, chosen on them: a "
                    "retry that never looks at the figure recovers at most this."]


TURN_RUNS = (("greedy", "greedy"), (BLANK_COLUMN, f"{BLANK}/greedy"), ("forced miss", FORCED_RUN))
TURN_RATES = (("tool calls", "tool_call_rate"), ("valid answers", "valid_answer_rate"),
              ("repeats", "repeat_rate"))


def turn_table(m: dict, max_turns: int) -> list[str]:
    """The markdown lines of the per-turn table: for each greedy run (with the figure, blank,
    forced miss) the share of the model's turn-k turns with a well-formed tool call, with an
    answer that is a listed choice, and repeating an earlier answer (k >= 2). None when no
    run has a blank-image or forced-miss run beside greedy."""
    runs = [(label, key) for label, key in TURN_RUNS if f"{key}_turn_1_turns" in m
            or f"{key}_turn_2_turns" in m]
    if len(runs) < 2:
        return []
    heads = [f"{label} {what}" for label, _ in runs for what, _ in TURN_RATES]
    lines = ["", "per turn (the model's own turns):", "",
             "| turn | " + " | ".join(heads) + " |", "|---|" + "---:|" * len(heads)]
    for k in range(1, max_turns + 1):
        cells = [_fmt(m[f"{run}_turn_{k}_{key}"]) if f"{run}_turn_{k}_{key}" in m else ""
                 for _, run in runs for _, key in TURN_RATES]
        if any(cells):
            lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return lines


BLIND = (("chance / elimination (no skill)", "baseline_first_try", "baseline_with_feedback"),
         ("constant answer, most common first", "baseline_constant_first_try",
          "baseline_constant_with_feedback"),
         ("best fixed order of answer positions", "baseline_best_order_first_try",
          "baseline_best_order_with_feedback"),
         ("worst fixed order of answer positions", "baseline_worst_order_first_try",
          "baseline_worst_order_with_feedback"))


def blind_table(m: dict, max_turns: int, note: bool = True) -> list[str]:
    """The markdown lines of the "blind baselines on these problems" table (no lines when `m`
    has none of the fitted baselines), with a note on what they are unless not `note`."""
    if "baseline_constant_first_try" not in m:
        return []
    lines = ["", "blind baselines on these problems:", "",
             f"| | first try | with feedback (≤{max_turns} turns) |", "|---|---:|---:|"]
    for label, first, within in BLIND:
        if first in m:
            lines.append(f"| {label} | {_fmt(m[first])} | {_fmt(m[within])} |")
    return lines + (["", "Chosen on these very problems: the constant answer and the best "
                     "order are upper bounds for a policy that never looks at the figure, the "
                     "worst order a lower bound; the orders score the choice problems only."]
                    if note else [])


def position_table(m: dict) -> list[str]:
    """The markdown lines of the accuracy-by-answer-position table: one row per position
    (`count_at_<P>`), its number of problems, and each mode's first-try and with-feedback
    accuracy there (no lines without `count_at_` keys)."""
    labels = sorted((k[len("count_at_"):] for k in m if k.startswith("count_at_")),
                    key=position_index)
    modes = [mode for mode in MODES if f"{mode}_accuracy" in m]
    if not labels or not modes:
        return []
    heads = [f"{mode} {what}" for mode in modes for what in ("first try", "with feedback")]
    lines = ["", "accuracy by answer position:", "",
             "| answer at | problems | " + " | ".join(heads) + " |",
             "|---|---:|" + "---:|" * len(heads)]
    for label in labels:
        cells = [f"{int(m[f'count_at_{label}'])}"]
        for mode in modes:
            for key in (f"{mode}_first_try_accuracy_at_{label}", f"{mode}_accuracy_at_{label}"):
                cells.append(_fmt(m[key], m.get(f"{key}_se")) if key in m else "")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def _fmt(v: float, se: float | None = None) -> str:
    """A value (3 decimals for a share, 1 above 1), ± its standard error when given."""
    text = f"{v:.3f}" if abs(v) <= 1 else f"{v:.1f}"
    return text if se is None else f"{text} ± {se:.3f}"


def bar_chart(m: dict, path: str | os.PathLike, max_turns: int, title: str = "") -> Path:
    """Accuracies (first try .. with feedback, pass@k) as grouped bars, values written on them."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    # all problems, then perception and geometry apart (each family is in the table only)
    panels = [("", m)] + [(k, part(m, k)) for k in kinds(m) if k in ("perception", "geometry")]
    colors = {"greedy": "tab:blue", "sampled": "tab:orange"}
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 3.4 * len(panels)), dpi=90,
                             squeeze=False)
    for ax, (kind, sub) in zip(axes[:, 0], panels):
        bars = [(label, vals) for label, vals in rows(sub, max_turns)
                if label.startswith(("first try", "solved by", "with feedback", "pass@"))]
        modes = [mode for mode in MODES if f"{mode}_accuracy" in sub]
        width = 0.8 / max(len(modes), 1)
        for j, mode in enumerate(modes):
            xs = [i + (j - (len(modes) - 1) / 2) * width for i, (_, v) in enumerate(bars)
                  if mode in v]
            ys = [v[mode] for _, v in bars if mode in v]
            drawn = ax.bar(xs, ys, width, color=colors[mode], label=mode)
            ax.bar_label(drawn, fmt="%.2f", fontsize=8, padding=2)
        base = [(i, v[BASELINE]) for i, (_, v) in enumerate(bars) if BASELINE in v]
        for n, (i, y) in enumerate(base):
            ax.hlines(y, i - 0.45, i + 0.45, colors="black", lw=2,
                      label="no skill (chance / elimination)" if n == 0 else None)
        final = [i for i, (label, _) in enumerate(bars) if label.startswith("with feedback")]
        lines = [(final[0] + (j - (len(modes) - 1) / 2) * width, sub[f"{mode}_conditional_line"])
                 for j, mode in enumerate(modes) if final and f"{mode}_conditional_line" in sub]
        for n, (x, y) in enumerate(lines):
            ax.hlines(y, x - width / 2, x + width / 2, colors="black", lw=1.5,
                      linestyles="dashed", label=CONDITIONAL if n == 0 else None)
        ax.set_xticks(np.arange(len(bars)),
                      [label.replace(", ", "\n").replace(" (", "\n(") for label, _ in bars],
                      fontsize=9)
        ax.set_ylim(0, 1.1)
        ax.set_ylabel("share of test problems")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)  # off the bars' values
        head = title or "first-try vs with-feedback accuracy"
        ax.set_title(f"{head}: {kind} problems" if kind else head, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def write_report(m: dict, out_dir: str | os.PathLike, title: str, max_turns: int) -> Path:
    """eval.json (every metric), eval.md (the table) and eval.png (the chart) in `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval.json").write_text(json.dumps(m, indent=2, sort_keys=True) + "\n")
    (out / "eval.md").write_text(markdown(m, max_turns, title))
    bar_chart(m, out / "eval.png", max_turns, title)
    return out
