"""The two learners on the same steps: a run's micro-batches recorded, then replayed through each.

    python scripts/benchmark_learners.py --config=configs/cpu.py                # record, replay
    python scripts/benchmark_learners.py --steps_file=runs/steps.pkl --record=False  # replay only

Recording runs the torch trainer (`geo3k_torch.main.build` and the shared loop
`common.train.train`, evaluation and checkpoints included) with its learner wrapped so that every
`train_step(micro-batches, n_tokens, n_seqs)` is also written to `--steps_file`. The replay then
builds a fresh torch learner and a fresh JAX learner on the same checkpoint, each in the
config's settings, and feeds both the recorded steps in order: the same micro-batches, so the
two differ only in how they compute a step. JAX's persistent compilation cache is not used, so
every compile is paid, as in a first run. Prints the total, the median step and the learner's compiles,
and the first steps' gradient norms side by side (equal until rounding compounds: at lr 3e-4
the tiny model's steps drift apart after about 20). Timing never decides a test.
"""

from __future__ import annotations

import pickle
import statistics
import time
from pathlib import Path

from absl import app, flags
from ml_collections import config_flags
from rich.console import Console
from rich.table import Table

from common import train as loop
from common.grpo import LossConfig
from common.processor import load_processor
from configs import to_dataclass

_CONFIG = config_flags.DEFINE_config_file("config", "configs/cpu.py", "Config.", lock_config=False)
_STEPS_FILE = flags.DEFINE_string("steps_file", "runs/benchmark_learners/steps.pkl",
                                  "Where the recorded steps are written and read.")
_RECORD = flags.DEFINE_boolean("record", True, "Run the torch trainer to record the steps first.")
_SHOWN = flags.DEFINE_integer("shown", 8, "Steps whose gradient norms are printed.")


class Recording:
    """A learner that writes every train_step's arguments to `path`, then runs `learner`'s."""

    def __init__(self, learner, path: Path):
        self.learner, self.path, self.steps = learner, path, []

    def train_step(self, batches, n_tokens, n_seqs):
        self.steps.append((list(batches), n_tokens, n_seqs))
        with open(self.path, "wb") as f:
            pickle.dump(self.steps, f)
        return self.learner.train_step(batches, n_tokens, n_seqs)

    def __getattr__(self, name):
        return getattr(self.learner, name)


def record(cfg, path: Path) -> None:
    from geo3k_torch import main as torch_main

    path.parent.mkdir(parents=True, exist_ok=True)
    run = torch_main.build(cfg, str(path.parent / "run"))
    run.learner = Recording(run.learner, path)
    loop.train(cfg, str(path.parent / "run"), run)


def learners(cfg, model_dir: str) -> dict:
    """A fresh torch and a fresh JAX learner on `model_dir`, in the config's settings."""
    from geo3k_jax.core.buckets import Ladder
    from geo3k_jax.learner.learner import Learner as JaxLearner
    from geo3k_jax.models.model import split_params
    from geo3k_jax.models.weights import load_model as load_jax
    from geo3k_torch.learner import Learner as TorchLearner
    from geo3k_torch.model import load_model as load_torch

    processor = load_processor(model_dir)
    loss_cfg = to_dataclass(LossConfig, cfg.loss)
    model, config = load_jax(model_dir)
    merge, params = split_params(model)
    return {
        "torch": TorchLearner(load_torch(model_dir), processor, loss_cfg, cfg.train,
                              cfg.rollout.temperature, "cpu", model_dir=model_dir,
                              chunk=cfg.train.logprob_chunk),
        "jax": JaxLearner(merge, params, loss_cfg, cfg.train, cfg.rollout.temperature,
                          processor=processor, config=config, chunk=cfg.train.logprob_chunk,
                          ladder=Ladder(cfg.jax.row_rungs, cfg.jax.reuse_slack)),
    }


def main(argv):
    del argv
    cfg = _CONFIG.value
    path = Path(_STEPS_FILE.value)
    if _RECORD.value:
        record(cfg, path)
    if not path.exists():
        raise SystemExit(f"{path} does not exist: record the steps first (--record=True)")
    with open(path, "rb") as f:
        steps = pickle.load(f)
    from geo3k_torch.prepare import prepare_model_dir

    table = Table(title=f"{len(steps)} recorded steps, one learner after the other")
    for col in ("learner", "total s", "median step s", "compiles",
                f"grad norms, first {_SHOWN.value} steps"):
        table.add_column(col)
    for name, learner in learners(cfg, prepare_model_dir(cfg)).items():
        times, norms, metrics = [], [], {}
        start = time.perf_counter()
        for batches, n_tokens, n_seqs in steps:
            t = time.perf_counter()
            # dict() reads every value: a JAX step's metrics wait for the step to finish
            metrics = dict(learner.train_step(batches, n_tokens, n_seqs))
            times.append(time.perf_counter() - t)
            norms.append(metrics["grad_norm"])
        total = time.perf_counter() - start
        table.add_row(name, f"{total:.1f}", f"{statistics.median(times):.3f}",
                      str(int(metrics.get("compiles", 0))) if "compiles" in metrics else "-",
                      " ".join(f"{g:.3f}" for g in norms[:_SHOWN.value]))
    Console().print(table)


if __name__ == "__main__":
    app.run(main)
