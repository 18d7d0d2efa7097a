"""Independent replicates of the CPU default, and their table (docs/results.md).

Replicate k runs `configs/cpu_perception.py` with `seed`, `model.tiny_seed` and
`data.synthetic_seed` all k: its own tiny checkpoint (pretrained on its own figures, primed with
its own draws) and its own train and test splits, each built deterministically from k into
data/rep<k>/ (replicate 0 is `make train` itself, in the config's default folders).

    python scripts/replicates.py run --learner=torch --replicates 0 1 2 3 4 [--cpu=0]
    python scripts/replicates.py run --learner=jax --replicates 0 1 2 3 4
    python scripts/replicates.py table runs/rep          # the markdown table, from the workdirs
    python scripts/replicates.py figures docs/replicates/torch-0 \
        --curve docs/cpu_perception_curve.png --chart docs/eval_cpu_perception.png

`run` trains one replicate after the other into runs/rep/<learner>-<k> (`--cpu` pins them to
one core with taskset, so two learners can run side by side on a 2-core machine); a replicate's
checkpoint and data are built by whichever learner reaches it first, so start the two learners'
first new replicate one after the other. `table` reads each workdir's metrics.jsonl: the
greedy evaluation at step 0 and at the last evaluated step, judged against the target once
the run has reached its `train.steps` (config.json).
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

MODULES = {"torch": "geo3k_torch.main", "jax": "geo3k_jax.train"}
# (header, metrics key) of each number the table shows for an evaluation
COLUMNS = (
    ("first try", "eval/greedy_first_try_accuracy"),
    ("with feedback", "eval/greedy_accuracy"),
    ("cond.", "eval/greedy_conditional_line"),
    ("recovery", "eval/greedy_recovery_after_miss"),
    ("blank first try", "eval/blank/greedy_first_try_accuracy"),
    ("blank with feedback", "eval/blank/greedy_accuracy"),
)
ELIMINATION_RECOVERY = 2 / 3  # blind non-repeating elimination after a miss: 4 choices, 3 turns


def command(learner: str, k: int, workdir: Path) -> list[str]:
    """The command line of replicate k (the same for both learners but the module)."""
    cmd = [sys.executable, "-m", MODULES[learner], "--config=configs/cpu_perception.py",
           f"--config.seed={k}", f"--config.model.tiny_seed={k}", f"--config.data.synthetic_seed={k}"]
    if k:
        cmd += [f"--config.model.tiny_dir=data/rep{k}/tiny",
                f"--config.data.synthetic_dir=data/rep{k}/synthetic"]
    return cmd + [f"--workdir={workdir / f'{learner}-{k}'}"]


def run(learner: str, replicates: list[int], workdir: Path, cpu: str | None) -> None:
    for k in replicates:
        cmd = command(learner, k, workdir)
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


def planned_steps(workdir: Path) -> int:
    """The run's `train.steps`, from the config.json its run wrote (0 when there is none: the
    last evaluation is taken as final)."""
    path = workdir / "config.json"
    return int(json.loads(path.read_text())["config"]["train"]["steps"]) if path.exists() else 0


def meets_target(row: dict) -> bool:
    """Issue 48's target: first try >= 0.5, with feedback above the conditional line and recovery
    after a miss above blind elimination's 2/3."""
    return (row["eval/greedy_first_try_accuracy"] >= 0.5
            and row["eval/greedy_accuracy"] > row["eval/greedy_conditional_line"]
            and row["eval/greedy_recovery_after_miss"] > ELIMINATION_RECOVERY)


def _cells(row: dict) -> list[str]:
    return [f"{row[key]:.3f}" if key in row else "-" for _, key in COLUMNS]


def table(root: Path) -> str:
    """The markdown table of every <learner>-<k> workdir under `root`, and a line per learner
    with how many replicates meet the target. Raises FileNotFoundError when none has an
    evaluation."""
    header = ["learner", "k", "step"] + [name for name, _ in COLUMNS] + ["target"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    met: dict[str, list[bool]] = {}
    dirs = sorted(root.glob("*-*"), key=lambda d: (d.name.rsplit("-", 1)[0], _index(d.name)))
    for d in dirs:
        learner, k = d.name.rsplit("-", 1)
        if learner not in MODULES or not (d / "metrics.jsonl").exists():
            continue
        evals = evaluations(d / "metrics.jsonl")
        if not evals:
            continue
        last, steps = max(evals), planned_steps(d)
        for step in sorted({min(evals), last}):
            row = evals[step]
            target = ""
            if step == last and step and step < steps:
                target = f"(running: {steps} steps)"
            elif step == last and step:
                ok = meets_target(row)
                met.setdefault(learner, []).append(ok)
                target = "yes" if ok else "**no**"
            lines.append("| " + " | ".join([learner, k, str(step)] + _cells(row) + [target]) + " |")
    if not met and len(lines) == 2:
        raise FileNotFoundError(f"no <learner>-<k> workdir with an evaluation under {root}")
    lines.append("")
    for learner, oks in met.items():
        lines.append(f"{learner}: {sum(oks)} of {len(oks)} replicates meet the target "
                     "(first try >= 0.5, with feedback > cond., recovery > 2/3)")
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
        run(args.learner, args.replicates, args.workdir, args.cpu)
    else:
        try:
            print(table(args.root) if args.what == "table"
                  else figures(args.workdir, args.curve, args.chart), end="")
        except FileNotFoundError as e:
            sys.exit(str(e))


if __name__ == "__main__":
    main()
