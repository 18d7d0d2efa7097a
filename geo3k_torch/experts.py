"""How a MoE model's experts run: transformers' grouped-matmul implementation where torch's
grouped matmul runs on the device, its batched one elsewhere, never a Python loop over the
experts. Below both `geo3k_torch.model` (which loads models) and `geo3k_torch.expert_parallel`
(which splits the experts over ranks)."""

from __future__ import annotations

import functools

import torch


def experts_implementation(device: torch.device | str) -> str:
    """How transformers runs a MoE block's experts on `device` (`use_experts_implementation`):
    "grouped_mm", every expert's tokens in one grouped matmul (`torch.nn.functional.grouped_mm`:
    CPU from torch 2.9, CUDA from sm80, fp32 and bf16), where that kernel runs; else
    "batched_mm" (each routed token's expert weights gathered, one batched matmul). Never
    "eager", a Python loop over the experts. transformers' grouped_mm itself falls back to
    such a loop (an opaque custom op) under torch.compile in a dtype other than bf16: the
    compiled fp32 layers of the CPU tests, not the bf16 training on GPUs."""
    return "grouped_mm" if _grouped_mm_runs(torch.device(device).type) else "batched_mm"


@functools.cache
def _grouped_mm_runs(device_type: str) -> bool:
    """Whether torch's grouped matmul runs (forward and backward) on this kind of device in
    fp32 and bf16."""
    grouped = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm",
                                                                         None)
    if grouped is None:
        return False
    try:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.ones(4, 8, dtype=dtype, device=device_type, requires_grad=True)
            w = torch.ones(2, 8, 8, dtype=dtype, device=device_type, requires_grad=True)
            offs = torch.tensor([1, 4], dtype=torch.int32, device=device_type)
            grouped(x, w, offs=offs).backward(torch.ones(4, 8, dtype=dtype, device=device_type))
    except (RuntimeError, NotImplementedError):
        return False
    return True


def use_grouped_experts(model, device: torch.device | str) -> None:
    """A MoE model (Qwen3-VL-MoE) runs its experts by `experts_implementation(device)`; a dense
    one has none, and is left as it is."""
    if getattr(model.config.get_text_config(), "num_experts", 0):
        model.set_experts_implementation(experts_implementation(device))
