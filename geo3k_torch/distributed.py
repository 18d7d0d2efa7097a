"""torch.distributed plumbing: process group, FSDP2 sharding, the loop's collectives.

Launched with `torchrun`, every rank runs the same loop on its share of the prompts. FSDP2
(`fully_shard`) wraps each language-model decoder layer and each vision block, then the root
(torchtitan's order). CPU runs use the gloo backend, CUDA runs NCCL.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def init(device_type: str) -> tuple[int, int]:
    """Join the process group when launched by torchrun. Returns (rank, world_size)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return dist.get_rank(), dist.get_world_size()


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def parallelize(model, mixed_precision: bool = False):
    """Shard a transformers Qwen-VL model in place with FSDP2; returns it."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw = {}
    if mixed_precision:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32)
    inner = model.model
    for block in inner.visual.blocks:
        fully_shard(block, **kw)
    for layer in inner.language_model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def sum_scalars(values: dict[str, float], max_keys: tuple[str, ...] = ()) -> dict[str, float]:
    """Sum (or max, for `max_keys`) each scalar over ranks; identity without a process group."""
    if not dist.is_initialized():
        return dict(values)
    keys = sorted(values)
    sums = torch.tensor([0.0 if k in max_keys else float(values[k]) for k in keys],
                        dtype=torch.float64)
    maxes = torch.tensor([float(values[k]) if k in max_keys else 0.0 for k in keys],
                         dtype=torch.float64)
    dist.all_reduce(sums)
    dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
    return {k: float(maxes[i] if k in max_keys else sums[i]) for i, k in enumerate(keys)}


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def gather(obj) -> list:
    """Every rank's `obj`, in rank order (all ranks receive the list)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


class TorchCollectives:
    """`common.learner.Collectives` over the torch process group (one process without one)."""

    def __init__(self):
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1

    gather = staticmethod(gather)
    sum_scalars = staticmethod(sum_scalars)
    barrier = staticmethod(barrier)
