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

from common.train import summary


def main(train: Callable[[object, str], dict], rank: Callable[[], int],
         suffix: str = "") -> None:
    """Parse the flags and run `train(config, workdir)`; process 0 prints the summary."""
    config_flags.DEFINE_config_file("config", "configs/cpu.py", "Training config.",
                                    lock_config=True)
    flags.DEFINE_string("workdir", None, "Output folder (default: runs/<time>).")

    def run(argv):
        del argv
        workdir = flags.FLAGS.workdir or os.path.join(
            "runs", datetime.datetime.now().strftime("%Y%m%d-%H%M%S") + suffix)
        metrics = train(flags.FLAGS.config, workdir)
        if rank() == 0:
            print(f"done: {workdir} " + summary(metrics))

    app.run(run)
