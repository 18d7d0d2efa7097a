"""The training entry points' command line: `--config` (locked) and `--workdir`, nothing else.

    if __name__ == "__main__":
        cli.main(train, rank=lambda: ...)          # in geo3k_torch.main and geo3k_jax.train

Flags are defined when `main` runs, not at import, so both entry points can be imported into one
process (the tests do).
"""

from __future__ import annotations

import datetime
import os
from typing import Callable

from absl import app, flags
from ml_collections import config_flags

from common.evaluation.report import markdown, write_report
from common.storage import is_remote
from common.train import summary


def main(train: Callable[[object, str], dict], rank: Callable[[], int],
         suffix: str = "") -> None:
    """Parse the flags and run `train(config, workdir)`; process 0 prints the last evaluation
    beside its baselines (and writes it to <workdir>/eval, `common.evaluation.report`) and the
    summary."""
    config_flags.DEFINE_config_file("config", "configs/cpu.py", "Training config.",
                                    lock_config=True)
    flags.DEFINE_string("workdir", None, "Output folder (default: runs/<time>).")

    def run(argv):
        del argv
        workdir = flags.FLAGS.workdir or os.path.join(
            "runs", datetime.datetime.now().strftime("%Y%m%d-%H%M%S") + suffix)
        if is_remote(workdir):  # pathlib would make a local folder "gs:/..." of it
            raise app.UsageError(f"--workdir={workdir}: the workdir is a local folder (metrics, "
                                 "curve, rollout dumps); checkpoints go to a bucket with "
                                 "--config.checkpoint.dir=gs://...")
        metrics = train(flags.FLAGS.config, workdir)
        if rank() == 0:
            final = {k[len("eval/"):]: v for k, v in metrics.items() if k.startswith("eval/")}
            if final:  # the last step's evaluation, beside the no-skill baselines
                title = "final evaluation (test split)"
                turns = flags.FLAGS.config.env.max_turns
                write_report(final, os.path.join(workdir, "eval"), title, turns)
                print(markdown(final, turns, title))
            print(f"done: {workdir} " + summary(metrics))

    app.run(run)
