"""bf16 compute over fp32 master weights without FSDP: what one GPU trains with (`train.fsdp`).

FSDP2 at world size 1 shards nothing, yet under its bf16 policy it casts and copies every
parameter in every micro-batch's forward, again in the recomputation of a checkpointed layer,
and again in the backward (2.1 B parameters for Qwen3-VL-2B). `MasterWeights` does the same
arithmetic with one copy per optimizer step:

    outside the learner's forwards     the Parameters hold their fp32 master values: the optimizer,
                                       DCP checkpoints, HF exports and engine weight copies see
                                       fp32, as they see FSDP's fp32 shards
    with master.compute():             every Parameter's .data is its persistent bf16 copy
        loss.backward()                each bf16 gradient, once accumulated, is added into its
                                       fp32 accumulator and freed (a post-accumulate-grad hook)
    master.grads_to_params()           the fp32 sums become the Parameters' .grad
    optimizer.step(); master.refresh() the bf16 copies := the new fp32 weights (one fused copy)

FSDP2's policy (`geo3k_torch.distributed.mixed_precision`) computes each block with bf16
parameters and bf16 floating inputs (`cast_forward_inputs`), reduces the bf16 gradients in fp32
and accumulates micro-batches in fp32; the same casts happen here (a forward pre-hook on the blocks
FSDP wraps), so both give the same losses and gradients (tests/test_precision.py).
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._pytree import tree_map_only

DTYPE = torch.bfloat16


def blocks(model) -> list[torch.nn.Module]:
    """The modules FSDP2 wraps one by one (`geo3k_torch.distributed.parallelize`): the vision
    blocks and the text decoder layers."""
    inner = model.model
    return list(inner.visual.blocks) + list(inner.language_model.layers)


class MasterWeights:
    """bf16 compute copies of a plain (not FSDP-wrapped) fp32 model's parameters and fp32
    gradient accumulators; see the module docstring. Build it after freezing parameters
    (`requires_grad`): only trainable ones get accumulators."""

    def __init__(self, model, dtype: torch.dtype = DTYPE):
        self.params = list(model.parameters())  # a tied weight once
        if any(p.dtype != torch.float32 for p in self.params):
            raise ValueError("master weights need an fp32 model, got "
                             f"{sorted({str(p.dtype) for p in self.params})}")
        self.dtype = dtype
        with torch.no_grad():
            self.copies = [torch.empty_like(p, dtype=dtype) for p in self.params]
        self.refresh()
        self.sums: dict[torch.nn.Parameter, torch.Tensor] = {}
        for p in self.params:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._accumulate)
        cast = lambda t: t.to(dtype) if t.is_floating_point() else t  # noqa: E731
        for block in blocks(model):  # FSDP2's cast_forward_inputs
            block.register_forward_pre_hook(
                lambda _, args, kwargs: tree_map_only(torch.Tensor, cast, (args, kwargs)),
                with_kwargs=True)
        self.active = False

    @torch.no_grad()
    def refresh(self) -> None:
        """bf16 copies := the Parameters' fp32 values (after an optimizer step or a restore)."""
        torch._foreach_copy_(self.copies, [p.data for p in self.params])

    @contextlib.contextmanager
    def compute(self):
        """The Parameters hold their bf16 copies inside the block, their fp32 values after it."""
        if self.active:  # nested (logprobs inside a step): already swapped
            yield
            return
        master = [p.data for p in self.params]
        for p, c in zip(self.params, self.copies):
            p.data = c
        self.active = True
        try:
            yield
        finally:
            for p, m in zip(self.params, master):
                p.data = m
            self.active = False

    @torch.no_grad()
    def _accumulate(self, p: torch.nn.Parameter) -> None:
        """p's bf16 gradient of one backward, added into its fp32 sum and freed."""
        total = self.sums.get(p)
        if total is None:
            self.sums[p] = p.grad.to(torch.float32)
        else:
            total.add_(p.grad)
        p.grad = None

    def grads_to_params(self) -> None:
        """Each Parameter (fp32 again) takes its fp32 gradient sum as .grad; the sums are handed
        over (the next step starts new ones)."""
        if self.active:
            raise RuntimeError("grads_to_params inside compute(): the Parameters hold bf16")
        for p, total in self.sums.items():
            p.grad = total if p.grad is None else p.grad.add_(total)
        self.sums = {}

    def discard(self) -> None:
        """Drop the gradient sums (a probe's, or a skipped step's)."""
        self.sums = {}

    def pending_bytes(self) -> int:
        """Bytes the next step allocates that do not exist yet: the fp32 gradient sums."""
        return sum(p.numel() * 4 for p in self.params if p.requires_grad and p not in self.sums)
