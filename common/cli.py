"""The training entry points' command line: `--config` (locked) and `--workdir`, nothing else.

    if __name__ == "__main__":                     # at the top, before torch / jax are imported
        from common import cli
        cli.preflight(grpo=True)                   # --help, a bad --config.<key> or value
    ...
    if __name__ == "__main__":
        cli.main(train, rank=lambda: ..., grpo=True,   # in geo3k_torch.main and geo3k_jax.train
                 same_workdir=...)                     # rank 0's default run folder everywhere

Flags are defined when `main` runs, not at import, so both entry points can be imported into one
process (the tests do). `preflight` (`common.config_help`) answers `--help` with every config
field, its value and meaning, and refuses a misspelled `--config.<key>` or a value its field
cannot take in one line, and settings out of their ranges one line each (`common.config_rules`;
exit status 2), in about a second: this module imports nothing heavy until `main` runs. The other
commands (`geo3k_torch.evaluate`, `geo3k_jax.main`, `geo3k_jax.aot`) call `preflight` with their
own flags.
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
              define: Callable[[object], None] | None = None, grpo: bool = False) -> None:
    """Before the entry point imports its framework: `--help` printed with the flags
    `define(flag_values)` defines (default: `--config` and `--workdir`), a bad `--config`
    argument refused in one line and settings out of range one line each (with `grpo`, also
    those the GRPO loop cannot train with: `common.config_rules`), exit status 2; returns
    where there is nothing to say."""
    config_help.preflight(sys.argv if argv is None else argv, default,
                          define or (lambda fv: define_flags(fv, default)), grpo)


def main(train: Callable[[object, str], dict], rank: Callable[[], int],
         suffix: str = "", grpo: bool = False,
         same_workdir: Callable[[object, str], str] | None = None) -> None:
    """Parse the flags and run `train(config, workdir)`; process 0 prints the last evaluation
    beside its baselines (and writes it to <workdir>/eval, `common.evaluation.report`) and the
    summary, or that the run is already finished (`common.train.Finished`: exit 0). A
    `--workdir` URL (`common.storage.mirrored`): `train` gets a local folder that is copied up
    to it, and `checkpoint.dir`, when empty, becomes <workdir>/checkpoints. Without
    `--workdir` the run goes to runs/<time><suffix>, process 0's name on every process:
    `same_workdir(config, name)` hands it over (torchrun: a broadcast); an entry point
    without one refuses to start several processes (WORLD_SIZE > 1) without `--workdir`."""
    preflight(grpo=grpo)
    define_flags()

    def run(argv):
        del argv
        from common.train import Finished, summary
        cfg = flags.FLAGS.config
        workdir = flags.FLAGS.workdir or default_workdir(cfg, suffix, same_workdir)
        try:
            metrics = run_in(workdir, cfg, train, rank() == 0)
        except Finished as e:
            if rank() == 0:
                print(e)
            return
        if rank() == 0:
            line = summary(metrics)
            print(f"done: {workdir}" + (f" {line}" if line else ""))

    app.run(run)


def default_workdir(cfg, suffix: str = "",
                    same_workdir: Callable[[object, str], str] | None = None) -> str:
    """runs/<time><suffix> as process 0 names it (`same_workdir`), the same on every process:
    the processes of a run start at different moments, and a name from each one's own clock
    would split the run (and a sharded checkpoint) over several folders."""
    name = os.path.join("runs", datetime.datetime.now().strftime("%Y%m%d-%H%M%S") + suffix)
    if same_workdir is not None:
        return same_workdir(cfg, name)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        sys.stderr.write(f"error: {world} processes (WORLD_SIZE={world}) need one --workdir "
                         "to share: pass --workdir=<folder every process sees>\n")
        sys.exit(config_help.USAGE_ERROR)
    return name


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
