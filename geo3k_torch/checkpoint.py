"""Atomic, resumable checkpoints: an HF model directory plus the training state.

    checkpoints/step_<N>/
        config.json, model.safetensors, tokenizer and processor files   (loads in transformers,
                                                                         serves in SGLang as is)
        train_state.pt     optimizer, LR scheduler, prompt sampler, RNG states, step

A checkpoint is written into `step_<N>.tmp` and renamed into place when complete, so a crash
mid-write never leaves a directory that looks complete; `latest` ignores `.tmp` leftovers.
Under FSDP the full (unsharded) model and optimizer state dicts are gathered and rank 0 writes.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict)

_STEP = re.compile(r"^step_(\d+)$")
# Files of a source checkpoint that the training run rewrites itself.
_MODEL_FILES = re.compile(r"(\.safetensors|\.bin|\.pt|^model\.safetensors\.index\.json|"
                          r"^config\.json|^generation_config\.json)$")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def latest(root: str | os.PathLike) -> Path | None:
    """The complete checkpoint with the highest step under `root`, or None."""
    root = Path(root)
    if not root.is_dir():
        return None
    steps = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _STEP.match(p.name)) and (p / "train_state.pt").exists()]
    return max(steps)[1] if steps else None


def save(root: str | os.PathLike, step: int, model, optimizer, scheduler, source_dir: str,
         extra: dict) -> Path:
    """Write checkpoint `step` (all ranks call this). Returns its final path."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = get_model_state_dict(model, options=opts)
    optim_sd = get_optimizer_state_dict(model, optimizer, options=opts)
    final = Path(root) / f"step_{step}"
    if _rank() == 0:
        tmp = Path(root) / f"step_{step}.tmp"
        _write_hf(tmp, model, model_sd, source_dir)
        torch.save({"step": step, "optimizer": optim_sd, "scheduler": scheduler.state_dict(),
                    "torch_rng": torch.get_rng_state(), **extra}, tmp / "train_state.pt")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    _barrier()
    return final


def _write_hf(out: Path, model, state_dict: dict, source_dir: str) -> None:
    """An HF model directory: weights and config from `model`, the rest copied from source."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    model.save_pretrained(out, state_dict=state_dict, safe_serialization=True)
    for f in Path(source_dir).iterdir():  # tokenizer, processor, chat template
        if f.is_file() and not _MODEL_FILES.search(f.name):
            shutil.copy2(f, out / f.name)


def export_hf(out: str | os.PathLike, model, source_dir: str) -> Path:
    """Write the current weights as an HF model directory (all ranks call this; rank 0 writes,
    into `out.tmp`, renamed into place). Used to hand the weights to an inference server."""
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                              cpu_offload=True))
    out = Path(out)
    if _rank() == 0:
        tmp = out.with_name(out.name + ".tmp")
        _write_hf(tmp, model, sd, source_dir)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    _barrier()
    return out


def load(path: str | os.PathLike, model, optimizer, scheduler) -> dict:
    """Restore model, optimizer, scheduler and torch RNG from `path` (all ranks call this).
    Returns the saved dict for the caller's own state (step, sampler, engine RNG...)."""
    from safetensors.torch import load_file

    path = Path(path)
    state = torch.load(path / "train_state.pt", map_location="cpu", weights_only=False)
    model_sd = {}
    for f in sorted(path.glob("*.safetensors")):
        model_sd.update(load_file(f))
    opts = StateDictOptions(full_state_dict=True)
    missing = set(get_model_state_dict(model, options=opts)) - set(model_sd)
    # Tied embeddings are saved once; the model re-ties them on load.
    tied = {k for k in missing if k.endswith("lm_head.weight")}
    if missing - tied:
        raise ValueError(f"{path}: checkpoint lacks {sorted(missing - tied)[:5]}")
    set_model_state_dict(model, model_sd, options=StateDictOptions(full_state_dict=True,
                                                                   strict=False))
    set_optimizer_state_dict(model, optimizer, state["optimizer"], options=opts)
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])
    return state


def full_state_dict(model) -> dict:
    """The unsharded model state dict on every rank (an FSDP collective: all ranks call it)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                broadcast_from_rank0=False))


def prune(root: str | os.PathLike, keep: int) -> None:
    """Delete all but the newest `keep` complete checkpoints (and stale .tmp leftovers)."""
    root = Path(root)
    steps = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP.match(p.name)))
    for _, p in steps[:-keep] if keep > 0 else []:
        shutil.rmtree(p, ignore_errors=True)
    for p in root.glob("step_*.tmp"):
        shutil.rmtree(p, ignore_errors=True)
