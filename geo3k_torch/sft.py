r"""SFT warm start: next-token loss on the assistant's tokens, then GRPO from its checkpoint.

    python -m geo3k_torch.sft --config=configs/sft.py --workdir=runs/sft
    python -m geo3k_torch.main --config=configs/h100_single_turn.py \
        --config.model.path=runs/sft/checkpoints/step_N            # GRPO from the SFT weights

Each training problem becomes its chat messages plus the reply `Answer: \boxed{<answer>}`
(`common.sft`); the loss is the mean negative log-likelihood of the reply tokens over the
global batch (`train.prompts_per_step` problems per step), micro-batches packed by
`common.batching.pack` and run through the GRPO learner's forward (`geo3k_torch.model`: 3-D
M-RoPE, images in place). The workdir is a GRPO run's: metrics.jsonl (`train/loss`, ...,
`eval/*` every `eval.every` steps), TensorBoard, curve.png, checkpoints/step_N (HF directories,
resumable with `train.resume`). `geo3k_torch.prime` uses the same step to teach the tiny
checkpoint the tool-call format.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from common import checkpoints, cli
from common.batching import TrainSequence, pack
from common.grpo import LossConfig
from common.learner import Collectives, SingleProcess
from common.processor import load_processor
from common.report import RunLog
from common.sampler import PromptSampler
from common.setup import check_config, make_renderer, prepare_data
from common.sft import sft_example, sft_messages
from common.train import evaluate_split
from geo3k_torch import distributed
from geo3k_torch.learner import Learner
from geo3k_torch.model import load_model
from geo3k_torch.setup import prepare_model_dir, resolve_device


class SFTLearner(Learner):
    """The torch learner with the supervised loss: -sum(log p(masked tokens)) / global count.
    Optimizer, schedule, clipping, checkpoints and exports are the GRPO learner's."""

    def __init__(self, model, processor, train_cfg, device: torch.device | str = "cpu",
                 comm: Collectives = SingleProcess(), model_dir: str | None = None):
        super().__init__(model, processor, LossConfig(), train_cfg, 1.0, device, comm=comm,
                         model_dir=model_dir)

    def micro_batch_loss(self, batch, n_tokens: float, n_seqs: float) -> tuple:
        targets = torch.from_numpy(np.nonzero(batch.loss_mask)[0]).to(self.device)
        logp, entropy = self._forward(self.model, batch, targets, True)  # (K,), (K,)
        loss = -logp.sum() / n_tokens * self.world_size  # FSDP averages gradients over ranks
        return loss, {"tokens": float(len(targets)), "entropy": float(entropy.sum())}


def sft_step(learner: SFTLearner, seqs: Sequence[TrainSequence], micro_batch_tokens: int,
             comm: Collectives = SingleProcess()) -> dict[str, float]:
    """One optimizer step on this process's sequences. Returns loss (mean NLL per assistant
    token of the global batch), grad_norm, lr, skipped, entropy, tokens."""
    counts = comm.sum_scalars({"tokens": sum(float(s.loss_mask.sum()) for s in seqs),
                               "seqs": float(len(seqs))})
    m = learner.train_step(pack(seqs, micro_batch_tokens), counts["tokens"], counts["seqs"])
    m.pop("logp_diff_max", None)  # no rollout log-probs in SFT
    return {**m, "tokens": counts["tokens"]}


def train(cfg, workdir: str) -> dict:
    """Supervised training on the train split's formatted answers; returns the last metrics."""
    # ---- setup -------------------------------------------------------------------------
    workdir = Path(workdir)
    device = resolve_device(cfg)
    distributed.init(device.type)
    comm = distributed.TorchCollectives()
    check_config(cfg, comm.world)
    torch.manual_seed(cfg.seed)
    model_dir = comm.gather(prepare_model_dir(cfg) if comm.rank == 0 else None)[0]
    train_set, test_set = comm.gather(prepare_data(cfg) if comm.rank == 0 else None)[0]
    processor = load_processor(model_dir)
    renderer = make_renderer(cfg, processor)
    model = load_model(model_dir).to(device)
    if device.type == "cuda" and cfg.train.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if comm.world > 1:
        distributed.parallelize(model, mixed_precision=device.type == "cuda" and cfg.train.bf16)
    learner = SFTLearner(model, processor, cfg.train, device, comm, model_dir)
    backend = None
    if cfg.eval.every:  # the local engine on the policy being trained, for evaluation only
        from geo3k_torch.backend import LocalBackend
        backend = LocalBackend(processor, model_dir, seed=cfg.seed, device=device, comm=comm,
                               model=model)
    sampler = PromptSampler(len(train_set), cfg.seed)
    start = 0
    if cfg.train.resume and (last := checkpoints.latest(workdir / "checkpoints")):
        learner.restore(last)
        state = checkpoints.load_loop_state(last)
        start, sampler = state["step"], PromptSampler.from_state(state["sampler"])
    log = RunLog(workdir, cfg.log.tensorboard, cfg.log.wandb_project,
                 cfg.to_dict()) if comm.rank == 0 else None
    if log and start:
        log.truncate_after(start)

    # ---- the loop ----------------------------------------------------------------------
    examples: dict[int, TrainSequence] = {}  # rendered once per problem
    metrics: dict = {}
    for step in range(start + 1, cfg.train.steps + 1):
        ids = sampler.next_batch(cfg.train.prompts_per_step)[comm.rank::comm.world]
        for i in ids:
            if i not in examples:
                p = train_set[i]
                examples[i] = sft_example(renderer, sft_messages(p), p.images, i)
        metrics = {f"train/{k}": v for k, v in sft_step(
            learner, [examples[i] for i in ids], cfg.train.micro_batch_tokens, comm).items()}
        if backend and (step % cfg.eval.every == 0 or step == cfg.train.steps):
            backend.sync(learner, step)
            metrics.update({f"eval/{k}": v for k, v in evaluate_split(
                cfg, test_set, backend.engine, renderer, comm).items()})
        if log:
            log.log(step, metrics)
            if cfg.log.plot_every and step % cfg.log.plot_every == 0:
                log.plot()
        if step % cfg.checkpoint.every == 0 or step == cfg.train.steps:
            checkpoints.save(workdir / "checkpoints", step, learner, {"sampler": sampler.state()},
                             comm)
            if comm.rank == 0:
                checkpoints.prune(workdir / "checkpoints", cfg.checkpoint.keep)
        if comm.rank == 0:
            print(f"sft step {step}/{cfg.train.steps} loss {metrics['train/loss']:.4f}", flush=True)
    if log:
        log.plot()
        log.close()
    distributed.shutdown()
    return metrics


if __name__ == "__main__":
    cli.main(train, rank=lambda: int(os.environ.get("RANK", "0")), suffix="-sft")
