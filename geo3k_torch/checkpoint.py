"""The torch learner's files in a checkpoint or weight export (`common.checkpoints` makes them
atomic and adds the loop's state):

    config.json, model.safetensors, tokenizer and processor files   (write_hf: loads in
                                                                     transformers, serves as is)
    train_state.pt     optimizer, LR scheduler, torch RNG            (save_state)

Under FSDP the full (unsharded) model and optimizer state dicts are gathered (every rank calls
these functions) and rank 0 writes.
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

STATE_FILE = "train_state.pt"
# Files of a source checkpoint that the training run rewrites itself.
_MODEL_FILES = re.compile(r"(\.safetensors|\.bin|\.pt|^model\.safetensors\.index\.json|"
                          r"^config\.json|^generation_config\.json)$")
_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def write_hf(out: str | os.PathLike, model, source_dir: str | None) -> None:
    """The model's weights and config as an HF directory in `out` (created if missing), the
    tokenizer, processor and chat template files copied from `source_dir`."""
    if source_dir is None:
        raise ValueError("exporting a Hugging Face directory needs the source checkpoint "
                         "directory (its tokenizer and processor files): pass model_dir")
    state_dict = get_model_state_dict(model, options=_FULL)
    if _rank() != 0:
        return
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, state_dict=state_dict, safe_serialization=True)
    for f in Path(source_dir).iterdir():  # tokenizer, processor, chat template
        if f.is_file() and not _MODEL_FILES.search(f.name):
            shutil.copy2(f, out / f.name)


def save_state(directory: str | os.PathLike, model, optimizer, scheduler) -> None:
    """Optimizer, scheduler and torch RNG into `directory`/train_state.pt."""
    optim_sd = get_optimizer_state_dict(model, optimizer, options=_FULL)
    if _rank() == 0:
        torch.save({"optimizer": optim_sd, "scheduler": scheduler.state_dict(),
                    "torch_rng": torch.get_rng_state()}, Path(directory) / STATE_FILE)


def load_state(directory: str | os.PathLike, model, optimizer, scheduler) -> None:
    """Restore the weights (the directory's safetensors), optimizer, scheduler and torch RNG."""
    from safetensors.torch import load_file

    path = Path(directory)
    if not (path / STATE_FILE).exists():
        raise FileNotFoundError(f"{path} has no {STATE_FILE}: not a torch learner checkpoint")
    state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)
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


def full_state_dict(model) -> dict:
    """The unsharded model state dict on every rank (an FSDP collective: all ranks call it)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                broadcast_from_rank0=False))
