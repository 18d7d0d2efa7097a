"""Independent replicates of the CPU default, and their table (docs/results.md).

Replicate k of a learner runs `configs/cpu_perception.py` with `seed`, `model.tiny_seed` and
`data.synthetic_seed` all equal to its seed: k for torch, k + 100 for JAX (`SEED_BASE`), so no
checkpoint or data is shared between the two learners' replicates. Each builds its own tiny
checkpoint (pretrained on its own figures, primed with its own draws) and its own train and test
splits, deterministically from the seed, into data/rep<seed>/ (seed 0 is `make train` itself, in
the config's default folders).

    python scripts/replicates.py run --learner=torch --replicates 0 1 2 3 4 [--cpu=0]
    python scripts/replicates.py run --learner=jax --replicates 0 1 2 3 4
    python scripts/replicates.py run --learner=torch --replicates 2 3 4 \
        --set reward.progress_bonus=0.25 --workdir runs/progress   # a recipe change, same builds
    python scripts/replicates.py table runs/rep          # the markdown table, from the workdirs
    python scripts/replicates.py figures docs/replicates/torch-0 \
        --curve docs/cpu_perception_curve.png --chart docs/eval_cpu_perception.png

`run` trains one replicate after the other into runs/rep/<learner>-<k> (`--cpu` pins them to
one core with taskset, so two learners can run side by side on a 2-core machine; `--set
key=value` changes the recipe, the same on every replicate, while each keeps its own build).
`table` reads each workdir's metrics.jsonl and config.json: the greedy evaluation at step 0
and at the last evaluated step, judged against the target once the run has reached its
`train.steps`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

MODULES = {"torch": "geo3k_torch.main", "jax": "geo3k_jax.train"}
SEED_BASE = {"torch": 0, "jax": 100}  # replicate k's seed: k + its learner's base
# what makes a replicate itself: `run --set` may not change these
REPLICATE_FIELDS = ("seed", "model.tiny_seed", "data.synthetic_seed", "model.tiny_dir",
                    "data.synthetic_dir")
# (header, metrics key, its standard error's key or None) of each number the table shows
COLUMNS = (
    ("first try", "eval/greedy_first_try_accuracy", "eval/greedy_first_try_accuracy_se"),
    ("with feedback", "eval/greedy_accuracy", "eval/greedy_accuracy_se"),
    ("cond.", "eval/greedy_conditional_line", None),
    ("own-miss recovery", "eval/greedy_recovery_after_miss", "eval/greedy_recovery_after_miss_se"),
    ("own-miss lookup share", "eval/greedy_retry_lookup_share", None),
    ("forced-miss recovery", "eval/forced/greedy_recovery", "eval/forced/greedy_recovery_se"),
    ("blind line", "eval/forced/greedy_blind_retry_line", None),
    ("forced-miss lookup share", "eval/forced/greedy_retry_lookup_share", None),
    ("blank first try", "eval/blank/greedy_first_try_accuracy", "eval/blank/greedy_first_try_accuracy_se"),
    ("blank with feedback", "eval/blank/greedy_accuracy", "eval/blank/greedy_accuracy_se"),
    ("blank turn 2 valid", "eval/blank/greedy_turn_2_valid_answer_rate", None),
    ("blank turn 2 repeats", "eval/blank/greedy_turn_2_repeat_rate", None),
)
TARGET = "first try >= 0.5, forced-miss recovery >= blind line + 2 SE"


def seed(learner: str, k: int) -> int:
    return SEED_BASE[learner] + k


def command(learner: str, k: int, workdir: Path, overrides: Sequence[str] = ()) -> list[str]:
    """The command line of replicate k of `learner` (its own seed, checkpoint and data), with
    `overrides` ("key=value", e.g. "reward.progress_bonus=0.25") as its config flags."""
    s = seed(learner, k)
    cmd = [sys.executable, "-m", MODULES[learner], "--config=configs/cpu_perception.py",
           f"--config.seed={s}", f"--config.model.tiny_seed={s}", f"--config.data.synthetic_seed={s}"]
    if s:
        cmd += [f"--config.model.tiny_dir=data/rep{s}/tiny",
                f"--config.data.synthetic_dir=data/rep{s}/synthetic"]
    return cmd + config_flags(overrides) + [f"--workdir={workdir / f'{learner}-{k}'}"]


def config_flags(overrides: Sequence[str]) -> list[str]:
    """`--config.key=value` for each "key=value" of `run --set`. Raises ValueError on an item
    without a key or naming a field that makes a replicate itself (`REPLICATE_FIELDS`)."""
    for item in overrides:
        key, sep, _ = item.partition("=")
        if not sep or not key or key.startswith("-") or key in REPLICATE_FIELDS:
            raise ValueError(f"--set takes key=value of a config field other than the "
                             f"replicate's seeds and folders, got {item!r}")
    return [f"--config.{item}" for item in overrides]


def run(learner: str, replicates: list[int], workdir: Path, cpu: str | None,
        overrides: Sequence[str] = ()) -> None:
    for k in replicates:
        cmd = command(learner, k, workdir, overrides)
        if cpu is not None:
            if not shutil.which("taskset"):
                sys.exit("--cpu needs taskset (util-linux)")
            cmd = ["taskset", "-c", cpu] + cmd
        print(" ".join(cmd), flush=True)
        start = time.time()
        rc = subprocess.call(cmd)
        print(f"{learner} replicate {k}: exit {rc} after {(time.time() - start) / 60:.1f} min", flush=True)
        if rc:
            sys.exit(rc)


def evaluations(metrics: Path) -> dict[int, dict]:
    """{step: the metrics row} of every step that has a greedy evaluation."""
    out = {}
    for line in metrics.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            if "eval/greedy_first_try_accuracy" in row:
                out[int(row["step"])] = row
    return out


def run_config(workdir: Path) -> dict:
    """The config its run wrote to config.json ({} when there is none)."""
    path = workdir / "config.json"
    return json.loads(path.read_text())["config"] if path.exists() else {}


def meets_target(row: dict) -> bool | None:
    """First try >= 0.5 and forced-miss recovery above its figure-blind line by at least two
    standard errors; None when the row has no forced-miss evaluation to judge."""
    need = ("eval/forced/greedy_recovery", "eval/forced/greedy_recovery_se",
            "eval/forced/greedy_blind_retry_line")
    if not all(k in row for k in need):
        return None
    return (row["eval/greedy_first_try_accuracy"] >= 0.5
            and row[need[0]] >= row[need[2]] + 2 * row[need[1]])


def _cells(row: dict) -> list[str]:
    out = []
    for _, key, se in COLUMNS:
        cell = f"{row[key]:.3f}" if key in row else "-"
        if key in row and se in row:
            cell += f" ± {row[se]:.3f}"
        out.append(cell)
    return out


def table(root: Path) -> str:
    """The markdown table of every <learner>-<k> workdir under `root` (its seeds from its
    config.json), and a line per learner with how many finished replicates meet the target.
    Raises FileNotFoundError when none has an evaluation."""
    header = ["learner", "k", "seeds (run, tiny, data)", "step"] + [c[0] for c in COLUMNS] + ["target"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    met: dict[str, list[bool]] = {}
    builds: dict[tuple, list[str]] = {}  # (tiny, data) seeds -> the workdirs built from them
    dirs = sorted(root.glob("*-*"), key=lambda d: (d.name.rsplit("-", 1)[0], _index(d.name)))
    for d in dirs:
        learner, k = d.name.rsplit("-", 1)
        if learner not in MODULES or not (d / "metrics.jsonl").exists():
            continue
        evals = evaluations(d / "metrics.jsonl")
        if not evals:
            continue
        cfg = run_config(d)
        seeds = (", ".join(str(x) for x in (cfg["seed"], cfg["model"]["tiny_seed"],
                                            cfg["data"]["synthetic_seed"]))
                 if cfg.get("model") and cfg.get("data") else "-")
        if seeds != "-":
            builds.setdefault((cfg["model"]["tiny_seed"], cfg["data"]["synthetic_seed"]),
                              []).append(d.name)
        last, steps = max(evals), cfg.get("train", {}).get("steps", 0)
        for step in sorted({min(evals), last}):
            row = evals[step]
            target = ""
            if step == last and step and step < steps:
                target = f"(running: {steps} steps)"
            elif step == last and step:
                ok = meets_target(row)
                if ok is None:
                    target = "no forced-miss row"
                else:
                    met.setdefault(learner, []).append(ok)
                    target = "yes" if ok else "**no**"
            lines.append("| " + " | ".join([learner, k, seeds, str(step)] + _cells(row) + [target])
                         + " |")
    if len(lines) == 2:
        raise FileNotFoundError(f"no <learner>-<k> workdir with an evaluation under {root}")
    lines.append("")
    for learner, oks in met.items():
        lines.append(f"{learner}: {sum(oks)} of {len(oks)} replicates meet the target ({TARGET})")
    for (tiny, data), names in builds.items():
        if len(names) > 1:
            lines.append(f"{' and '.join(names)} share their build seeds (tiny {tiny}, data "
                         f"{data}): the same data and checkpoint recipe, not independent replicates")
    return "\n".join(lines) + "\n"


def figures(workdir: Path, curve: Path, chart: Path) -> str:
    """One run's pictures from its rows alone (the README's, from a committed workdir): `curve`,
    the training curve `common.runlog` draws from metrics.jsonl, and `chart`, the bar chart of
    its last evaluation. Returns that evaluation's table as the run printed it. Raises
    FileNotFoundError when the workdir has no evaluation."""
    from common.evaluation.report import bar_chart, markdown
    from common.runlog import RunLog
    evals = evaluations(workdir / "metrics.jsonl")
    if not evals:
        raise FileNotFoundError(f"no evaluation in {workdir / 'metrics.jsonl'}")
    turns = json.loads((workdir / "config.json").read_text())["config"]["env"]["max_turns"]
    final = {k[len("eval/"):]: v for k, v in evals[max(evals)].items() if k.startswith("eval/")}
    with tempfile.TemporaryDirectory() as tmp:  # RunLog draws into its own folder
        shutil.copy(workdir / "metrics.jsonl", tmp)
        curve.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(RunLog(tmp, tensorboard=False).plot(), curve)
    title = "final evaluation (test split)"
    bar_chart(final, chart, turns, title)
    return markdown(final, turns, title)


def _index(name: str) -> int:
    tail = name.rsplit("-", 1)[1]
    return int(tail) if tail.isdigit() else -1


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    r = sub.add_parser("run", help="train replicates one after the other")
    r.add_argument("--learner", choices=sorted(MODULES), required=True)
    r.add_argument("--replicates", type=int, nargs="+", required=True)
    r.add_argument("--workdir", type=Path, default=Path("runs/rep"))
    r.add_argument("--cpu", help="taskset's cpu list, e.g. 0")
    r.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a config field for every replicate (repeatable), e.g. "
                        "reward.progress_bonus=0.25")
    t = sub.add_parser("table", help="the markdown table of the replicates under a folder")
    t.add_argument("root", type=Path, nargs="?", default=Path("runs/rep"))
    f = sub.add_parser("figures", help="one run's curve and final-evaluation chart, from its rows")
    f.add_argument("workdir", type=Path)
    f.add_argument("--curve", type=Path, required=True)
    f.add_argument("--chart", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.what == "run":
        if any(k < 0 for k in args.replicates):
            parser.error("replicate indices are >= 0")
        try:
            config_flags(args.overrides)  # a bad --set stops here, before any run
        except ValueError as e:
            parser.error(str(e))
        run(args.learner, args.replicates, args.workdir, args.cpu, args.overrides)
    else:
        try:
            print(table(args.root) if args.what == "table"
                  else figures(args.workdir, args.curve, args.chart), end="")
        except FileNotFoundError as e:
            sys.exit(str(e))


if __name__ == "__main__":
    main()
