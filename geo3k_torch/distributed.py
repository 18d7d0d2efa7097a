"""torch.distributed plumbing: process group, FSDP2 sharding, the loop's collectives.

Launched with `torchrun`, every rank runs the same loop on its share of the prompts. On CUDA the
process group serves both device types ("cpu:gloo,cuda:nccl": NCCL alone refuses CPU tensors,
and the state-dict and checkpoint helpers move some through the group), and the loop's own
collectives (`TorchCollectives`) hand it tensors on the learner's device only. A CUDA run has a
process group at world size 1 too (a store in memory): FSDP2 runs on it under
`train.fsdp="always"` (by default one GPU trains without FSDP, `geo3k_torch.precision`, in the
same dtype arithmetic as eight), and the checkpoint and collective helpers use it either way.
CPU runs use gloo, and none at world size 1.

FSDP2 (`fully_shard`) wraps each language-model decoder layer and each vision block, then the
root (torchtitan's order), with one `MixedPrecisionPolicy` when `bf16`: bf16 parameters for
compute, fp32 master weights, fp32 gradient reduction. With `train.expert_parallel` > 1 a MoE
model's experts are first split over ranks and sharded on a mesh of their own
(`geo3k_torch.expert_parallel`); the layers' FSDP units then leave them out.
"""

from __future__ import annotations

import atexit
import datetime
import os

import torch
import torch.distributed as dist


def init(device_type: str, timeout_s: float = 1800.0) -> tuple[int, int]:
    """Join the process group (torchrun's environment; on CUDA also alone, for FSDP2 at world
    size 1). timeout_s: how long a collective waits for the other ranks (`train.
    collective_timeout_s`; they wait while rank 0 starts SGLang). Returns (rank, world_size).
    The group is destroyed at exit if nothing did so before (`shutdown`): a gloo group left to
    the interpreter's finalization can abort the process (SIGABRT) as its worker threads free
    tensors after Python is gone, failing a run that had finished."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = device_type == "cuda"
    if world == 1 and not cuda:
        return 0, 1
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        else:  # one process, not launched by torchrun
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=timeout)
        atexit.register(shutdown)
    return dist.get_rank(), dist.get_world_size()


def shutdown() -> None:
    """Leave the process group (nothing when none was joined, or it was left already)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def mixed_precision(cast_forward_inputs: bool = True):
    """The one dtype policy of bf16 training: bf16 compute, fp32 master weights and reduce."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                cast_forward_inputs=cast_forward_inputs)


def parallelize(model, bf16: bool = False, expert_parallel: int = 1):
    """Shard a transformers Qwen-VL model in place with FSDP2 (a process group must exist; at
    world size 1 nothing is split, the policy still applies); returns it. bf16: under
    `mixed_precision()`, else the parameters' own dtype throughout. expert_parallel > 1: a MoE
    model's experts split over that many ranks first (`geo3k_torch.expert_parallel`), FSDP over
    the world for the rest."""
    from torch.distributed.fsdp import fully_shard

    kw = {"mp_policy": mixed_precision()} if bf16 else {}
    if expert_parallel > 1:
        from geo3k_torch.expert_parallel import shard_experts

        shard_experts(model, expert_parallel, **kw)
    inner = model.model
    for block in inner.visual.blocks:
        fully_shard(block, **kw)
    for layer in inner.language_model.layers:
        fully_shard(layer, **kw)
    if bf16:  # the root's float inputs keep their dtype: the vision tower's precomputed position
        # interpolation weights (`model.vision_inputs`) stay fp32, as when it computes them
        # itself; it casts the pixels to its own dtype
        kw = {"mp_policy": mixed_precision(cast_forward_inputs=False)}
    fully_shard(model, **kw)
    return model


class TorchCollectives:
    """`common.learner.Collectives` over the torch process group (one process without one).
    device: the learner's; every tensor a collective here is handed lives there (NCCL takes
    nothing else)."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1

    def sum_scalars(self, values: dict[str, float], max_keys: tuple[str, ...] = ()
                    ) -> dict[str, float]:
        """Sum (or max, for `max_keys`) each scalar over ranks; identity without a group."""
        if not dist.is_initialized():
            return {k: float(v) for k, v in values.items()}
        keys = sorted(values)
        mine = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64,
                            device=self.device)  # (K,)
        every = mine.new_empty(self.world * len(keys))  # one collective (gloo wants it flat)
        dist.all_gather_into_tensor(every, mine)
        every = every.view(self.world, len(keys))  # (world, K)
        sums, maxes = every.sum(0).tolist(), every.max(0).values.tolist()
        return {k: maxes[i] if k in max_keys else sums[i] for i, k in enumerate(keys)}

    def gather(self, obj) -> list:
        """Every rank's `obj`, in rank order (all ranks receive the list; an object collective:
        the group picks its CPU backend)."""
        if not dist.is_initialized():
            return [obj]
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier(device_ids=[self.device.index] if self.device.type == "cuda" else None)
