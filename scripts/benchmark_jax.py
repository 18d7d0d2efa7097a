"""JAX learner step time next to the torch one, on the same packed batch and the same weights.

    python scripts/benchmark_jax.py --config=configs/cpu.py [--steps=5]
    python scripts/benchmark_jax.py --config.model.path=/models/Qwen3-VL-2B-Instruct

The batch is the cross-backend check's (`geo3k_jax.check.check_batch`: scripted multi-turn episodes
on synthetic problems, `config.jax.check.*`). One step = forward + backward over every micro-batch,
clipping and AdamW: `geo3k_torch.learner.Learner.train_step` (gradient accumulation over the
micro-batches) and `geo3k_jax.learner.learner.Learner.train_step` (the same accumulation inside one
compiled step, rows padded to the longest micro-batch). Both include turning the micro-batches
into model inputs (images through the processor, M-RoPE positions). The first
JAX call compiles; its excess over the median step is reported as compile time. Prints the median
of `--steps` timed steps after one warm-up step each. Timing never decides a test.
"""

from __future__ import annotations

import statistics
import time

import jax
import numpy as np
import torch
from absl import app, flags
from ml_collections import config_flags
from rich.console import Console
from rich.table import Table

from common.grpo import LossConfig
from common.processor import load_processor
from configs import to_dataclass
from geo3k_jax.core.buckets import Ladder
from geo3k_jax.check.check_batch import batches_from_config
from geo3k_jax.models.layers import remat_of
from geo3k_jax.learner.learner import Learner as JaxLearner
from geo3k_jax.models.model import split_params
from geo3k_jax.models.weights import load_model as load_jax_model
from geo3k_torch.learner import Learner as TorchLearner
from geo3k_torch.model import load_model as load_torch_model
from geo3k_torch.prepare import prepare_model_dir

_CONFIG = config_flags.DEFINE_config_file("config", "configs/cpu.py", "Config.", lock_config=True)
_STEPS = flags.DEFINE_integer("steps", 5, "Timed steps per backend (after one warm-up step).")


def _timed(step, n: int) -> tuple[float, float]:
    """(first call seconds, median of the next n calls)."""
    start = time.perf_counter()
    step()
    first = time.perf_counter() - start
    times = []
    for _ in range(n):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return first, statistics.median(times)


def main(argv):
    del argv
    cfg = _CONFIG.value
    jax.config.update("jax_default_matmul_precision", "highest")
    model_dir = prepare_model_dir(cfg)
    processor = load_processor(model_dir)
    chk = cfg.jax.check
    batches, n_tokens, n_seqs = batches_from_config(processor, chk, cfg.train.share_prefix)
    loss_cfg = to_dataclass(LossConfig, cfg.loss)
    temp = cfg.rollout.temperature

    torch.manual_seed(cfg.seed)
    t_learner = TorchLearner(load_torch_model(model_dir), processor, loss_cfg, cfg.train, temp)
    t_first, t_step = _timed(lambda: t_learner.train_step(batches, n_tokens, n_seqs),
                             _STEPS.value)

    model, config = load_jax_model(model_dir)
    merge, params = split_params(model)
    row_len = -(-max(b.num_tokens for b in batches) // cfg.jax.pad_to) * cfg.jax.pad_to
    j_learner = JaxLearner(merge, params, loss_cfg, cfg.train, temp, processor=processor,
                           config=config, row_len=row_len, chunk=cfg.train.logprob_chunk,
                           remat=remat_of(cfg.jax),
                           ladder=Ladder(cfg.jax.row_rungs, cfg.jax.reuse_slack))
    j_first, j_step = _timed(lambda: j_learner.train_step(batches, n_tokens, n_seqs),
                             _STEPS.value)

    tokens = int(sum(b.num_tokens for b in batches))
    table = Table(title=f"one GRPO step, {model_dir}, {jax.devices()[0].platform}, "
                        f"torch {torch.get_num_threads()} threads")
    for col in ("quantity", "torch", "jax"):
        table.add_column(col, justify="left" if col == "quantity" else "right")
    table.add_row("step seconds (median)", f"{t_step:.3f}", f"{j_step:.3f}")
    table.add_row("packed tokens / s", f"{tokens / t_step:,.0f}", f"{tokens / j_step:,.0f}")
    table.add_row("first step seconds", f"{t_first:.3f}", f"{j_first:.3f}")
    table.add_row("compile seconds (first - median)", "-", f"{j_first - j_step:.2f}")
    table.add_row("jax / torch step time", "", f"{j_step / t_step:.2f}")
    console = Console()
    console.print(table)
    console.print(f"{len(batches)} micro-batches / rows, {tokens} tokens (JAX rows padded to "
                  f"{row_len}, {j_learner.compiles} compile), {int(n_tokens)} trained tokens, "
                  f"{int(sum(len(b.images) for b in batches))} images, "
                  f"{int(np.sum([len(b.seq_index) for b in batches]))} sequences")


if __name__ == "__main__":
    app.run(main)
