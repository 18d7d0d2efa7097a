"""The training entry points' command line: `--config` (locked) and `--workdir`, nothing else.

    if __name__ == "__main__":                     # at the top, before torch / jax are imported
        from common import cli
        cli.preflight()                            # --help, or a bad --config.<key>: answered
    ...
    if __name__ == "__main__":
        cli.main(train, rank=lambda: ...)          # in geo3k_torch.main and geo3k_jax.train

Flags are defined when `main` runs, not at import, so both entry points can be imported into one
process (the tests do). `preflight` (`common.config_help`) answers `--help` with every config
field, its value and meaning, and refuses a misspelled `--config.<key>` or a value its field
cannot take in one line (exit status 2), in about a second: this module imports nothing heavy
until `main` runs.
"""

from __future__ import annotations

import datetime
import os
import sys
from typing import Callable

from absl import app, flags
from ml_collections import config_flags

from common import config_help

DEFAULT_CONFIG = "configs/cpu_perception.py"


def define_flags(flag_values=flags.FLAGS, default: str = DEFAULT_CONFIG) -> None:
    """`--config` and `--workdir`, on `flag_values`."""
    config_flags.DEFINE_config_file("config", default, "Training config.", lock_config=True,
                                    flag_values=flag_values)
    flags.DEFINE_string("workdir", None, "Output folder (default: runs/<time>); a URL "
                        "(gs://bucket/run) is written through a local folder copied up as it "
                        "grows, with the checkpoints (checkpoint.dir, when empty) under it.",
                        flag_values=flag_values)


def preflight(default: str = DEFAULT_CONFIG, argv: list[str] | None = None,
              with_help: bool = True) -> None:
    """Before the entry point imports its framework: `--help` printed (with `with_help`; an
    entry point that defines flags of its own passes False: absl prints its help), a bad
    `--config` argument refused in one line (exit 2); returns where there is nothing to say."""
    config_help.preflight(sys.argv if argv is None else argv, default,
                          (lambda fv: define_flags(fv, default)) if with_help else None)


def main(train: Callable[[object, str], dict], rank: Callable[[], int],
         suffix: str = "") -> None:
    """Parse the flags and run `train(config, workdir)`; process 0 prints the last evaluation
    beside its baselines (and writes it to <workdir>/eval, `common.evaluation.report`) and the
    summary. A `--workdir` URL (`common.storage.mirrored`): `train` gets a local folder that is
    copied up to it, and `checkpoint.dir`, when empty, becomes <workdir>/checkpoints."""
    preflight()
    define_flags()

    def run(argv):
        del argv
        from common.train import summary
        workdir = flags.FLAGS.workdir or os.path.join(
            "runs", datetime.datetime.now().strftime("%Y%m%d-%H%M%S") + suffix)
        metrics = run_in(workdir, flags.FLAGS.config, train, rank() == 0)
        if rank() == 0:
            print(f"done: {workdir} " + summary(metrics))

    app.run(run)


def run_in(workdir: str, cfg, train: Callable[[object, str], dict], report: bool) -> dict:
    """`train(cfg, local folder)` for `workdir`, local or a URL (`common.storage.mirrored`: the
    run's files written locally and copied up; `checkpoint.dir`, when empty, becomes
    <workdir>/checkpoints, written in place by the learner). With `report`, the last
    evaluation is printed beside its baselines and written to <workdir>/eval. Returns the
    last step's metrics."""
    from common.evaluation.report import markdown, write_report
    from common.storage import is_remote, mirrored
    if is_remote(workdir) and not cfg.checkpoint.dir:
        with cfg.unlocked():
            cfg.checkpoint.dir = workdir.rstrip("/") + "/checkpoints"
    with mirrored(workdir) as local:
        metrics = train(cfg, str(local))
        final = {k[len("eval/"):]: v for k, v in metrics.items() if k.startswith("eval/")}
        if report and final:  # the last step's evaluation, beside the no-skill baselines
            title, turns = "final evaluation (test split)", cfg.env.max_turns
            write_report(final, os.path.join(local, "eval"), title, turns)
            print(markdown(final, turns, title))
    return metrics
