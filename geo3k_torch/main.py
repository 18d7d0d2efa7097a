"""Multi-turn GRPO on Geometry3K with the torch learner: the project's main job.

    python -m geo3k_torch.main --config=configs/cpu.py --workdir=runs/demo
    torchrun --nproc_per_node=4 -m geo3k_torch.main --config=configs/h100.py \
        --config.model.path=/models/Qwen3-VL-2B-Instruct --config.data.path=/data/geo3k

Every step: sample prompts -> multi-turn rollouts in groups (common.rollout) -> rewards ->
advantages and the dynamic-sampling filter (common.grpo) -> packed micro-batches
(common.batching) -> one optimizer step (geo3k_torch.learner) -> weights to the engine ->
metrics, curve, rollout dump -> checkpoint -> periodic evaluation. The workdir layout is in the
README. With no `model.path` a tiny checkpoint is built, with no `data.path` the synthetic set.
"""

from __future__ import annotations

import datetime
import os
import time
from pathlib import Path

import torch
from absl import app, flags, logging
from ml_collections import config_flags

from common.chat import ChatRenderer
from common.env import EnvConfig
from common.evaluate import evaluate
from common.grpo import LossConfig
from common.metrics import rollout_metrics
from common.report import RunLog, dump_rollouts
from common.rollout import RolloutConfig
from common.sampler import PromptSampler
from common.scoring import RewardConfig
from configs import to_dataclass
from geo3k_torch import checkpoint, distributed
from geo3k_torch.backends import build_backend
from geo3k_torch.learner import Learner
from geo3k_torch.model import load_model
from geo3k_torch.setup import prepare_data, prepare_model_dir, resolve_device
from geo3k_torch.step import StepConfig, grpo_step

_CONFIG = config_flags.DEFINE_config_file("config", "configs/cpu.py", "Training config.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output folder (default: runs/<time>).")


def train(cfg, workdir: str) -> dict:
    """Run the configured training; returns the last step's metrics."""
    # ---- setup: devices, ranks, data, model, engine, learner ------------------------------
    device = resolve_device(cfg)
    rank, world = distributed.init(device.type)
    torch.manual_seed(cfg.seed)
    workdir = Path(workdir)
    env_cfg = to_dataclass(EnvConfig, cfg.env)
    reward_cfg = to_dataclass(RewardConfig, cfg.reward)
    roll_cfg = to_dataclass(RolloutConfig, cfg.rollout)
    loss_cfg = to_dataclass(LossConfig, cfg.loss)
    if cfg.train.micro_batch_tokens < roll_cfg.max_context_tokens:
        raise ValueError(f"train.micro_batch_tokens={cfg.train.micro_batch_tokens} must hold one "
                         f"whole episode: at least rollout.max_context_tokens="
                         f"{roll_cfg.max_context_tokens}")
    if cfg.train.prompts_per_step % world:
        raise ValueError(f"train.prompts_per_step={cfg.train.prompts_per_step} must be a "
                         f"multiple of the {world} ranks")
    model_dir = prepare_model_dir(cfg) if rank == 0 else None
    model_dir = distributed.gather(model_dir)[0]
    train_set, test_set = prepare_data(cfg) if rank == 0 else (None, None)
    train_set, test_set = distributed.gather((train_set, test_set))[0]
    from common.processor import load_processor
    processor = load_processor(model_dir)
    renderer = ChatRenderer(processor)
    on_gpu = device.type == "cuda"
    model = load_model(model_dir).to(device)
    if on_gpu and cfg.train.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    ref_model = None
    if loss_cfg.kl_coef:
        ref_model = load_model(model_dir).to(device).eval().requires_grad_(False)
    if world > 1:
        distributed.parallelize(model, mixed_precision=on_gpu and cfg.train.bf16)
    backend = build_backend(cfg, model, model_dir, processor, device, rank, world, workdir)
    learner = Learner(model, processor, loss_cfg, cfg.train, roll_cfg.temperature, device,
                      ref_model=ref_model, world_size=world)
    step_cfg = StepConfig(roll_cfg, env_cfg, reward_cfg, cfg.advantage.normalize_std,
                          cfg.advantage.filter_equal_groups, cfg.train.micro_batch_tokens)
    sampler = PromptSampler(len(train_set), cfg.seed)
    log = RunLog(workdir, cfg.log.tensorboard, cfg.log.wandb_project,
                 cfg.to_dict()) if rank == 0 else None
    start = 0
    if cfg.train.resume and (last := checkpoint.latest(workdir / "checkpoints")):
        state = checkpoint.load(last, model, learner.optimizer, learner.scheduler)
        start = state["step"]
        sampler = PromptSampler.from_state(state["sampler"])
        backend.set_rng_state(state["engine_rng"][rank])
        backend.sync(model)
        if log:
            log.truncate_after(start)
        logging.info("resumed from %s at step %d", last, start)

    # ---- the loop --------------------------------------------------------------------------
    progress = _progress(rank == 0)
    task = progress.add_task("train", total=cfg.train.steps, completed=start, info="")
    metrics: dict = {}
    with progress:
        for step in range(start + 1, cfg.train.steps + 1):
            # rollout and update: every rank draws the same prompt ids and takes its slice
            ids = sampler.next_batch(cfg.train.prompts_per_step)[rank::world]
            offset = (step - 1) * cfg.train.prompts_per_step + rank * len(ids)
            trajs, train_m = grpo_step([train_set[i] for i in ids], backend.engine, renderer,
                                       learner, step_cfg, offset, backend.train_context)
            t0 = time.perf_counter()
            backend.sync(model)  # the next rollout samples from the new weights
            train_m["time_weight_sync"] = time.perf_counter() - t0
            # metrics, dump, curve (rank 0 sees every rank's trajectories)
            all_trajs = [t for part in distributed.gather(trajs) for t in part]
            metrics = {f"train/{k}": v for k, v in rollout_metrics(all_trajs,
                                                                   env_cfg.max_turns).items()}
            metrics.update({f"train/{k}": v for k, v in train_m.items()})
            if cfg.eval.every and (step % cfg.eval.every == 0 or step == cfg.train.steps):
                metrics.update(_evaluate(cfg, test_set, backend.engine, renderer, env_cfg,
                                         reward_cfg, roll_cfg, rank, world))
            if log:
                log.log(step, metrics)
                if cfg.log.dump_rollouts:
                    dump_rollouts(workdir / "rollouts" / f"step_{step}.jsonl", all_trajs,
                                  renderer.decode)
                if cfg.log.plot_every and step % cfg.log.plot_every == 0:
                    log.plot()
            if step % cfg.checkpoint.every == 0 or step == cfg.train.steps:
                rng = distributed.gather(backend.rng_state())
                checkpoint.save(workdir / "checkpoints", step, model, learner.optimizer,
                                learner.scheduler, model_dir,
                                {"sampler": sampler.state(), "engine_rng": rng})
                if rank == 0:
                    checkpoint.prune(workdir / "checkpoints", cfg.checkpoint.keep)
            progress.update(task, advance=1, info=_summary(metrics))
    backend.close()
    if log:
        log.plot()
        log.close()
    distributed.shutdown()
    return metrics


def _evaluate(cfg, test_set, engine, renderer, env_cfg, reward_cfg, roll_cfg, rank, world):
    n = len(test_set) if not cfg.eval.max_prompts else min(cfg.eval.max_prompts, len(test_set))
    prompts = [test_set[i] for i in range(n)][rank::world]
    out = evaluate(prompts, engine, renderer, roll_cfg, env_cfg, reward_cfg,
                   n_samples=cfg.eval.n_samples, gather=distributed.gather)
    return {f"eval/{k}": v for k, v in out.items()}


def _progress(enabled: bool):
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn, TimeRemainingColumn)
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[info]}"),
                    disable=not enabled)


def _summary(m: dict) -> str:
    keys = (("train/reward_mean", "reward"), ("train/accuracy", "acc"),
            ("train/turns_mean", "turns"), ("train/grad_norm", "gnorm"),
            ("eval/greedy_accuracy", "eval"))
    return " ".join(f"{name} {m[k]:.3f}" for k, name in keys if k in m)


def main(argv):
    del argv
    workdir = _WORKDIR.value or os.path.join(
        "runs", datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
    metrics = train(_CONFIG.value, workdir)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"done: {workdir} " + _summary(metrics))


if __name__ == "__main__":
    app.run(main)
