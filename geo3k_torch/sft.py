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

if __name__ == "__main__":  # --help, a bad --config.<key>: answered before torch loads
    from common import cli
    cli.preflight()

import os
from pathlib import Path

import torch

from common import checkpoints, cli
from common.batching import TrainSequence
from common.processor import load_processor
from common.prepare import check_config, load_data, make_renderer, model_dir_everywhere
from common.runlog import RunLog
from common.sampler import PromptSampler
from common.sft import sft_example, sft_messages
from common.train import eval_episodes, evaluate_split
from geo3k_torch import distributed
from geo3k_torch.learner import SFTLearner, sft_step
from geo3k_torch.memory import resolve as resolve_micro_batch
from geo3k_torch.prepare import load_policy, prepare_model_dir, resolve_device, same_workdir


def train(cfg, workdir: str) -> dict:
    """Supervised training on the train split's formatted answers; returns the last metrics."""
    # ---- setup -------------------------------------------------------------------------
    workdir = Path(workdir)
    device = resolve_device(cfg)
    distributed.init(device.type, cfg.train.collective_timeout_s)
    comm = distributed.TorchCollectives(device)
    check_config(cfg, comm.world)
    torch.manual_seed(cfg.seed)
    train_set, test_set = load_data(cfg, comm)  # first: a bad data.path fails before any model work
    model_dir = model_dir_everywhere(cfg, comm, lambda: prepare_model_dir(cfg))
    processor = load_processor(model_dir)
    renderer = make_renderer(cfg, processor)
    model = load_policy(cfg, model_dir, device, comm.world)
    learner = SFTLearner(model, processor, cfg.train, device, comm, model_dir)
    backend = None
    if cfg.eval.every:  # the local engine on the policy being trained, for evaluation only
        from geo3k_torch.backend import LocalBackend, engine_settings
        backend = LocalBackend(processor, model_dir, seed=cfg.seed, device=device, comm=comm,
                               model=model, bf16=cfg.train.bf16, **engine_settings(cfg))
    resolve_micro_batch(cfg, learner, comm)  # "auto": measured with the engine's copy in memory
    sampler = PromptSampler(len(train_set), cfg.seed, rank=comm.rank, world=comm.world)
    start = 0
    ckpt_root = checkpoints.root(cfg, workdir, learner)
    if cfg.train.resume and (last := checkpoints.latest(ckpt_root)):
        learner.restore(last)
        state = checkpoints.load_loop_state(last)
        start, sampler = state["step"], PromptSampler.of_process(state["sampler"], comm.rank,
                                                                  comm.world, len(train_set))
    log = RunLog(workdir, cfg.log.tensorboard, cfg.log.wandb_project,
                 cfg.to_dict()) if comm.rank == 0 else None
    if log and start:
        log.truncate_after(start)

    # ---- the loop ----------------------------------------------------------------------
    examples: dict[int, TrainSequence] = {}  # rendered once per problem
    metrics: dict = {}
    for step in range(start + 1, cfg.train.steps + 1):
        ids = sampler.next_batch(cfg.train.prompts_per_step // comm.world)
        for i in ids:
            if i not in examples:
                p = train_set[i]
                examples[i] = sft_example(renderer, sft_messages(p), p.images, i)
        metrics = {f"train/{k}": v for k, v in sft_step(
            learner, [examples[i] for i in ids], cfg.train.micro_batch_tokens, comm).items()}
        if backend and (step % cfg.eval.every == 0 or step == cfg.train.steps):
            backend.sync(learner, step)
            metrics.update({f"eval/{k}": v for k, v in evaluate_split(
                cfg, test_set, backend.engine, renderer, comm,
                eval_episodes(workdir, step)).items()})
        if log:
            log.log(step, metrics)
            if cfg.log.plot_every and step % cfg.log.plot_every == 0:
                log.plot()
        if step % cfg.checkpoint.every == 0 or step == cfg.train.steps:
            checkpoints.save(ckpt_root, step, learner,
                             {"sampler": comm.gather(sampler.state())}, comm)
            if comm.rank == 0:
                checkpoints.prune(ckpt_root, cfg.checkpoint.keep)
        if comm.rank == 0:
            print(f"sft step {step}/{cfg.train.steps} loss {metrics['train/loss']:.4f}", flush=True)
    if log:
        log.plot()
        log.close()
    distributed.shutdown()
    return metrics


if __name__ == "__main__":
    cli.main(train, rank=lambda: int(os.environ.get("RANK", "0")), suffix="-sft",
             same_workdir=same_workdir)
