"""Multi-turn GRPO on Geometry3K with the torch learner: the project's main job.

    python -m geo3k_torch.main --config=configs/cpu_perception.py --workdir=runs/demo
    torchrun --nproc_per_node=8 -m geo3k_torch.main --config=configs/h100.py \\
        --config.model.path=Qwen/Qwen3-VL-2B-Instruct --config.data.path=hiyouga/geometry3k

Builds the torch pieces (device, process group, transformers model, FSDP2, learner, rollout
backend) and runs the shared loop `common.train.train`. With no `model.path` a tiny checkpoint is
built, with no `data.path` the synthetic set.
"""

from __future__ import annotations

if __name__ == "__main__":  # --help, a bad --config.<key> or value: answered before torch loads
    from common import cli
    cli.preflight(grpo=True)

import os

import torch

from common import cli, train as loop
from common.backends import make_backend
from common.grpo import LossConfig
from common.processor import load_processor
from common.prepare import check_config, load_data, model_dir_everywhere
from configs import to_dataclass
from geo3k_torch import distributed
from geo3k_torch.learner import Learner
from geo3k_torch.backend import LocalBackend, engine_settings
from geo3k_torch.memory import resolve as resolve_micro_batch
from geo3k_torch.prepare import load_policy, prepare_model_dir, resolve_device, same_workdir
from geo3k_torch.weight_sync import TorchWeights



def build(cfg, workdir: str) -> loop.Run:
    """Device, ranks, data, model, learner and rollout backend for `cfg`."""
    device = resolve_device(cfg)
    distributed.init(device.type, cfg.train.collective_timeout_s)
    comm = distributed.TorchCollectives(device)
    check_config(cfg, comm.world)
    if (cfg.engine.backend == "sglang"
            and cfg.train.collective_timeout_s <= cfg.engine.sglang_startup_timeout_s):
        raise ValueError(f"train.collective_timeout_s={cfg.train.collective_timeout_s} must exceed "
                         f"engine.sglang_startup_timeout_s={cfg.engine.sglang_startup_timeout_s}: "
                         "the other ranks wait in a collective while rank 0 starts SGLang")
    torch.manual_seed(cfg.seed)
    loss_cfg = to_dataclass(LossConfig, cfg.loss)
    train_set, test_set = load_data(cfg, comm)  # first: a bad data.path fails before any model work
    model_dir = model_dir_everywhere(cfg, comm, lambda: prepare_model_dir(cfg))
    processor = load_processor(model_dir)
    on_gpu = device.type == "cuda"
    model = load_policy(cfg, model_dir, device, comm.world)
    ref_model = load_policy(cfg, model_dir, device, comm.world, reference=True) \
        if loss_cfg.kl_coef else None
    learner = Learner(model, processor, loss_cfg, cfg.train, cfg.rollout.temperature, device,
                      ref_model=ref_model, comm=comm, model_dir=model_dir,
                      chunk=cfg.train.logprob_chunk, fused_head=cfg.train.fused_head)
    # "auto": measured now, the model and the learner in memory; the local engine's own copy on
    # a GPU (loaded next) is reserved, SGLang servers release theirs while the learner trains
    engine_copy = (sum(p.numel() for p in model.parameters()) * (2 if cfg.train.bf16 else 4)
                   if on_gpu and cfg.engine.backend == "local" else 0)
    resolve_micro_batch(cfg, learner, comm, reserved=engine_copy)
    backend = make_backend(
        cfg, own_kind="torch", model_dir=model_dir, processor=processor, workdir=workdir,
        comm=comm, free_memory=torch.cuda.empty_cache if on_gpu else lambda: None,
        weights=(TorchWeights(model, model_dir, comm.rank)
                 if cfg.engine.backend == "sglang" else None),
        own=lambda: LocalBackend(processor, model_dir, seed=cfg.seed, device=device, comm=comm,
                                 model=model, own_copy=cfg.train.max_staleness > 0,
                                 bf16=cfg.train.bf16, **engine_settings(cfg)))
    return loop.Run(learner, backend, comm, processor, train_set, test_set,
                    shutdown=distributed.shutdown)


def train(cfg, workdir: str) -> dict:
    """Build the torch run and train it; returns the last step's metrics."""
    loop.check_workdir(cfg, workdir)
    return loop.train(cfg, workdir, build(cfg, workdir))


if __name__ == "__main__":
    cli.main(train, rank=lambda: int(os.environ.get("RANK", "0")), grpo=True,
             same_workdir=same_workdir)
