"""Expert parallelism on the tiny Qwen3-VL-MoE; run by tests/test_expert_parallel.py.

    python -m torch.distributed.run --nproc_per_node=N tests/ep_worker.py OUT.pt DIR EP [MODE]

With N > 1, first layer 0's experts split over EP ranks against an unsharded copy, on each
rank's own tokens (`block`). Then rank 0 saves the tiny model to DIR/model as exports are
written; every rank loads it (N = 1: `load_model`; else `load_sharded`: built on the meta
device, FSDP2 with the experts split over EP ranks, rank 0's read scattered, activation
checkpointing MODE: none, full or selective); one learner step
on the fixed global batch of tests/fsdp_worker.py (rank r trains sequences r, r + N, ...), a
sharded save into DIR/ckpt, a second step, and a fresh learner that restores DIR/ckpt and takes
that second step again. Rank 0 writes to OUT.pt (torch.save): each rank's slab of layer 0's
gate_up_proj, the steps' metrics, the first
step's gradients and weights gathered in full, the weights exported as an HF directory and read
back, whether every rank's weight-sync buckets hold exactly the trained weights in bf16 and
whether every rank's engine copy (`copy_weights`) holds them exactly in fp32, and
the weights after both second steps.
"""

import base64
import copy
import os
import pickle
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import Qwen3VLMoeForConditionalGeneration

from common.batching import pack
from common.grpo import LossConfig
from common.learner import SingleProcess
from common.step import even_out
from configs import base
from geo3k_torch import checkpoint, distributed
from geo3k_torch.backend import copy_weights
from geo3k_torch.expert_parallel import shard_experts
from geo3k_torch.learner import Learner
from geo3k_torch.experts import use_grouped_experts
from geo3k_torch.model import load_model, load_sharded
from geo3k_torch.weight_sync import TorchWeights
from tests.fsdp_worker import global_batch
from tests.tiny_models import ImageOnlyProcessor, qwen3_vl_moe


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference of a and b relative to b's largest magnitude."""
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def weights_now(model) -> dict[str, torch.Tensor]:
    """The gathered state dict, copied (a plain model's would be its live tensors)."""
    return {k: v.clone() for k, v in checkpoint.full_state_dict(model).items()}


def make_learner(model, source: Path, comm=SingleProcess()) -> Learner:
    """The learner of every run here (its model saved in `source`, fp32 on CPU)."""
    cfg = base.get_config().train
    with cfg.unlocked():
        cfg.lr = 1e-3
    return Learner(model, ImageOnlyProcessor(16),
                   LossConfig(agg="token-mean", tis_cap=2.0, router_aux_coef=0.01), cfg, 1.0,
                   comm=comm, chunk=8, model_dir=str(source))


def this_share(comm=SingleProcess()) -> tuple[list, float, float]:
    """This rank's micro-batches of the global batch (as many on every rank), its trained
    tokens and sequences (global)."""
    seqs = global_batch(ImageOnlyProcessor(16))
    n_tokens, n_seqs = float(sum(s.loss_mask.sum() for s in seqs)), float(len(seqs))
    batches = pack(seqs[comm.rank::comm.world], max(len(s) for s in seqs))  # several
    n_micro = comm.sum_scalars({"n": len(batches)}, max_keys=("n",))["n"]
    return even_out(batches, int(n_micro), seqs[0]), n_tokens, n_seqs


def main(out, workdir, ep, mode="none"):
    rank, world = distributed.init("cpu")
    ep, workdir = int(ep), Path(workdir)
    report = {"block": block(ep)} if world > 1 else {}
    source = workdir / "model"
    if rank == 0:
        checkpoint.save_published(qwen3_vl_moe(seed=0)[0], source)
    if world > 1:
        dist.barrier()

    def build():
        if world == 1:
            return load_model(str(source)).train()
        return load_sharded(str(source), "cpu", bf16=False, expert_parallel=ep,
                            activation_checkpointing=mode)

    comm = distributed.TorchCollectives()
    batches, n_tokens, n_seqs = this_share(comm)
    a = make_learner(build(), source, comm)
    weights = TorchWeights(a.model, ".", rank)
    slab = a.model.model.language_model.layers[0].mlp.experts.gate_up_proj  # (E, 2I, H) in full
    slab = slab.to_local() if isinstance(slab, DTensor) else slab
    report["slabs"] = comm.gather(tuple(slab.shape))  # what each rank holds
    report |= {"step1": a.train_step(batches, n_tokens, n_seqs), "micro_batches": len(batches)}
    report["grads"] = {n: full(p.grad) for n, p in a.model.named_parameters()}  # clipped
    report["weights"] = weights_now(a.model)
    synced = {}
    for payload, _ in weights.tensor_buckets(1 << 15):  # several buckets
        synced.update(pickle.loads(base64.b64decode(payload)))  # this process's shared memory
    want = weights._revert({k: v.to(torch.bfloat16) for k, v in report["weights"].items()
                            if k in dict(weights.entries)})
    same = sorted(synced) == sorted(want) and all(torch.equal(synced[k], want[k]) for k in want)
    report["sync_exact"] = all(comm.gather(same))
    engine = load_model(str(source)).eval()  # the local engine's own copy, synced in place
    copy_weights(a.model, engine)
    copied = engine.state_dict()
    report["copy_exact"] = all(comm.gather(all(torch.equal(copied[k], v)
                                               for k, v in report["weights"].items())))
    a.export_hf(workdir / "hf")
    if rank == 0:
        report["exported"] = Qwen3VLMoeForConditionalGeneration.from_pretrained(
            workdir / "hf").state_dict()
    a.save(workdir / "ckpt")
    comm.barrier()
    report["step2"] = a.train_step(batches, n_tokens, n_seqs)
    report["after"] = weights_now(a.model)
    b = make_learner(build(), source, comm)
    b.restore(workdir / "ckpt")
    report["resumed"] = b.train_step(batches, n_tokens, n_seqs)
    report["after_resumed"] = weights_now(b.model)
    if rank == 0:
        torch.save(report, out)
    if world > 1:  # no rank tears gloo down while another still works
        dist.barrier()
    distributed.shutdown()


def block(ep: int) -> dict[str, dict[str, float]]:
    """Rank r routes its own 5 + 4r tokens (hidden size 64, top 2) through layer 0's experts, split
    over `ep` ranks (their own FSDP unit, nothing else sharded), and through an unsharded copy in
    transformers' grouped_mm arithmetic, twice: random routing, then every token to the first
    rank's experts (the others receive no rows). Returns per case the largest differences over
    ranks (`relative`) of the output, the gradients of the hidden states and router weights,
    and the experts' gradients (the sharded ones gathered; the copy's averaged over ranks, as FSDP
    averages)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, _ = qwen3_vl_moe(seed=0)
    use_grouped_experts(model, "cpu")
    ref = copy.deepcopy(model.model.language_model.layers[0].mlp.experts)
    shard_experts(model, ep)
    experts = model.model.language_model.layers[0].mlp.experts
    n, k = ref.num_experts, 2
    g = torch.Generator().manual_seed(rank)
    T = 5 + 4 * rank
    report = {}
    for case, choices in (("random", n), ("one_sided", n // ep)):
        hidden = torch.randn(T, 64, generator=g)
        index = torch.stack([torch.randperm(choices, generator=g)[:k] for _ in range(T)])
        weights = torch.rand(T, k, generator=g)
        probe = torch.randn(T, 64, generator=g)  # the backward's upstream gradient
        got = {}
        for name, module in (("ep", experts), ("ref", ref)):
            h, w = hidden.clone().requires_grad_(), weights.clone().requires_grad_()
            y = module(h, index, w)
            (y * probe).sum().backward()
            got[name] = {"out": y.detach(), "d_hidden": h.grad, "d_weights": w.grad}
        got["ep"] |= {p: full(getattr(experts, p).grad) for p in ("gate_up_proj", "down_proj")}
        for p in ("gate_up_proj", "down_proj"):
            dist.all_reduce(getattr(ref, p).grad)
            got["ref"][p] = getattr(ref, p).grad / world
        diffs = {key: relative(got["ep"][key], got["ref"][key]) for key in got["ep"]}
        for p in ("gate_up_proj", "down_proj"):
            getattr(experts, p).grad = getattr(ref, p).grad = None
        every = distributed.TorchCollectives().gather(diffs)
        report[case] = {key: max(d[key] for d in every) for key in diffs}
    return report


if __name__ == "__main__":
    main(*sys.argv[1:])
    sys.stdout.flush()  # see tests/fsdp_worker.py: no interpreter teardown of gloo threads
    sys.stderr.flush()
    os._exit(0)
