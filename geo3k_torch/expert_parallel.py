"""Expert parallelism for Qwen3-VL-MoE in the torch learner (`train.expert_parallel` = ep > 1).

The world's ranks form a (world / ep, ep) device mesh, dims ("expert_fsdp", "expert"). Along
"expert" each rank holds E / ep experts' slabs of every sparse layer (gate_up_proj (E/ep, 2I, H),
down_proj (E/ep, H, I): DTensors sharded on dim 0); along "expert_fsdp" FSDP2 shards those slabs
again (nothing to shard when ep = world). Everything else (attention, router, norms, dense MLPs,
embeddings, the vision tower) stays under FSDP2 over the whole world, as without EP
(`geo3k_torch.distributed.parallelize`). A sparse block's forward on a rank's T tokens:

    router (T, E) -> top-k experts and weights (T, k)             (transformers' own router)
    the T*k (token, expert) pairs sorted by expert; their counts exchanged (all-to-all, E ints)
    hidden states of the pairs -> all-to-all -> the ranks holding their experts   (N, H) here
    regrouped by local expert; gate_up, SwiGLU, down as two grouped matmuls       (N, H)
    all-to-all back -> unsorted -> x their router weights -> summed over k        (T, H)

the ops of transformers' grouped_mm experts (the grouped matmuls see other row groups, which
round differently: 2.4e-7 of the output in tests/test_expert_parallel.py). The all-to-alls
carry autograd (their backward is the reverse exchange), so an expert's gradient sums the
contributions of every token that chose it, on whatever rank it came from (each rank's loss is
scaled by the world size, since FSDP averages the other gradients over the world): it is divided
by ep in the backward pass and FSDP's mean over "expert_fsdp" divides by the rest of the world.
(torchtitan sets FSDP's gradient divide factor to the world size instead: torch 2.13's FSDP
then reduces by a pre-scaled sum, which gloo lacks.) The split sizes of the all-to-alls are
host integers: EP reads the counts back once per sparse layer and pass (forward, and a
checkpointed layer's recomputation).

What follows from the DTensors: the gathered state dict (HF export, engine copies, weight sync)
holds the full experts; DCP checkpoints hold each rank's shards and reshard on load (one process
resumes what two with ep = 2 saved, tested); the grad norm sums each shard once
(`clip_grad_norm`, one norm per mesh).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

DIMS = ("expert_fsdp", "expert")


def sparse_blocks(model) -> list[torch.nn.Module]:
    """The `mlp.experts` modules of `model`'s sparse decoder layers (none for a dense model)."""
    return [layer.mlp.experts for layer in model.model.language_model.layers
            if hasattr(layer.mlp, "experts")]


def check(model, world: int, ep: int) -> None:
    """Refuse an expert-parallel degree `ep` that does not fit `model` on `world` ranks."""
    text = model.config.get_text_config()
    experts = getattr(text, "num_experts", 0)
    if not experts or not sparse_blocks(model):
        raise ValueError(f"train.expert_parallel={ep} needs a MoE model (qwen3_vl_moe), got "
                         f"{model.config.model_type}")
    if world % ep:
        raise ValueError(f"train.expert_parallel={ep} must divide the {world} processes")
    if experts % ep:
        raise ValueError(f"train.expert_parallel={ep} must divide the model's {experts} experts")


def mesh(device_type: str, world: int, ep: int):
    """The (world / ep, ep) device mesh, dims `DIMS`: ranks [0, ep), [ep, 2 ep), ... each split
    the experts among them (consecutive ranks: one node's fast links carry the all-to-alls)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (world // ep, ep), mesh_dim_names=DIMS)


def shard_experts(model, ep: int, **fsdp_kw) -> None:
    """Shard every sparse layer's experts in place: E / ep slabs per rank along the mesh's
    "expert" dim (DTensors), FSDP2 over "expert_fsdp" with `fsdp_kw` (its mixed-precision
    policy), the token dispatch of the module docstring as their forward. Call before the
    decoder layers are `fully_shard`ed (they then leave these parameters to this FSDP unit);
    works on the meta device (a sharded load)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard

    from geo3k_torch.experts import experts_implementation

    world = dist.get_world_size()
    check(model, world, ep)
    device_type = "cuda" if "nccl" in dist.get_backend() else "cpu"
    if experts_implementation(device_type) != "grouped_mm":
        raise ValueError(f"train.expert_parallel={ep} runs the experts as grouped matmuls, which "
                         f"torch cannot run on this {device_type} (CUDA needs sm80 or newer)")
    grid = mesh(device_type, world, ep)
    experts_mesh = grid["expert"]
    rank = experts_mesh.get_local_rank()
    for experts in sparse_blocks(model):
        for name in ("gate_up_proj", "down_proj"):
            full = getattr(experts, name)  # (E, ., .)
            mine = full.detach().chunk(ep)[rank].clone()  # (E/ep, ., .)
            setattr(experts, name, torch.nn.Parameter(
                DTensor.from_local(mine, experts_mesh, [Shard(0)], run_check=False),
                requires_grad=full.requires_grad))
        experts.forward = functools.partial(dispatch, experts, experts_mesh.get_group())
        fully_shard(experts, mesh=grid["expert_fsdp"], **fsdp_kw)


def dispatch(experts, group, hidden: torch.Tensor, top_k_index: torch.Tensor,
             top_k_weights: torch.Tensor) -> torch.Tensor:
    """An expert-parallel `Qwen3VLMoeTextExperts.forward`: hidden (T, H), top_k_index (T, k)
    int64 expert ids in [0, E), top_k_weights (T, k) the router's weights -> (T, H), the sum
    over k of weight x expert(hidden), each expert run on the rank that holds it (module
    docstring). Every rank of `group` calls it once per sparse layer in the same order."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    ep, n_experts = dist.get_world_size(group), experts.num_experts
    local = n_experts // ep
    T, k = top_k_index.shape
    flat = top_k_index.reshape(-1)  # (T*k,) pair p = (token p // k, its p % k-th expert)
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, so by rank
    counts = torch.bincount(flat, minlength=n_experts)  # (E,) pairs per expert, this rank
    theirs = torch.empty_like(counts)  # (ep * E/ep,) [source rank, local expert] pairs
    dist.all_to_all_single(theirs, counts, group=group)
    theirs = theirs.view(ep, local)
    sizes = torch.cat([counts.view(ep, local).sum(1), theirs.sum(1)]).tolist()  # one host sync
    send, recv = sizes[:ep], sizes[ep:]
    x = all_to_all_single_autograd(hidden[order // k], recv, send, group)  # (N, H) by source
    # rows arrive by (source rank, local expert): regrouped by local expert for the grouped mm
    ids = torch.arange(local, device=flat.device).repeat(ep).repeat_interleave(theirs.flatten())
    regroup = torch.argsort(ids, stable=True)  # (N,)
    per_expert = theirs.sum(0)  # (E/ep,)
    y = _local_experts(experts, x[regroup], per_expert, ep)  # (N, H)
    back = torch.empty_like(regroup)
    back[regroup] = torch.arange(len(regroup), device=regroup.device)
    y = all_to_all_single_autograd(y[back], send, recv, group)  # (T*k, H) in `order`
    unsort = torch.empty_like(order)
    unsort[order] = torch.arange(len(order), device=order.device)
    out = y[unsort] * top_k_weights.reshape(-1, 1)  # (T*k, H), pairs in token order
    return out.view(T, k, -1).sum(1).to(hidden.dtype)


def _grad_divided(t: torch.Tensor, n: int) -> torch.Tensor:
    """t itself, its gradient divided by n in the backward pass."""
    if t.requires_grad:
        t.register_hook(lambda g: g / n)
    return t


def _local_experts(experts, x: torch.Tensor, per_expert: torch.Tensor, ep: int) -> torch.Tensor:
    """x (N, H) grouped by this rank's experts, per_expert (E/ep,) their row counts -> (N, H):
    SwiGLU experts as two grouped matmuls over the local slabs, transformers' grouped_mm
    arithmetic; the slabs' gradients divided by ep (module docstring). No rows (no token chose
    these experts): one zero row appended, through the last expert, and dropped (CPU's grouped
    matmul has no backward for zero rows); its gradients are zeros, and the empty x stays in the
    graph: its all-to-all's backward runs on every rank."""
    gate_up, down = (_grad_divided(p.to_local(), ep)
                     for p in (experts.gate_up_proj, experts.down_proj))  # (E/ep, ., .)
    empty = len(x) == 0
    if empty:
        x = torch.cat([x, x.new_zeros(1, x.shape[1])])
        per_expert = per_expert.clone()
        per_expert[-1] = 1
    offs = torch.cumsum(per_expert, 0, dtype=torch.int32)
    grouped = torch.nn.functional.grouped_mm
    h = grouped(x.to(gate_up.dtype), gate_up.transpose(-2, -1), offs=offs)  # (N, 2I)
    gate, up = h.chunk(2, dim=-1)
    y = grouped(experts.act_fn(gate) * up, down.transpose(-2, -1), offs=offs)  # (N, H)
    return y[:0] if empty else y


def clip_grad_norm(params, max_norm: float) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` for parameters on several device meshes (FSDP's world
    and EP's (expert_fsdp, expert)): each mesh's gradients' 2-norm gathered once (a DTensor
    norm sums every shard once), the total their norm; gradients scaled in place by
    min(1, max_norm / total). Returns the total, a plain 0-d tensor."""
    from torch.distributed.tensor import DTensor

    groups: dict = {}
    for p in params:
        if p.grad is not None:
            key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            groups.setdefault(key, []).append(p)
    if len(groups) <= 1:  # no EP: torch's own, as before
        return torch.nn.utils.clip_grad_norm_([p for g in groups.values() for p in g],
                                              max_norm)
    norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group])
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack(norms))
    for group in groups.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total
