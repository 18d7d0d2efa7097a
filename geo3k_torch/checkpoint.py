"""The torch learner's files in a checkpoint or weight export (`common.checkpoints` makes them
atomic and adds the loop's state):

    config.json, model.safetensors, tokenizer and processor files   (write_hf: loads in
                                                                     transformers, serves as is)
    torch_state/    weights and optimizer, sharded: each rank writes  (save_state, with
                    and reads its own shards (torch.distributed.       torch.distributed.checkpoint)
                    checkpoint); no rank gathers the full state
    train_state.pt  LR scheduler, torch RNG

The HF export (for engines and users) gathers the full weights to rank 0's CPU; resuming reads
only torch_state/, at any world size (the checkpoint planner reshards).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_state_dict)

STATE_FILE = "train_state.pt"
SHARDED_DIR = "torch_state"
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
    save_published(model, out, state_dict)
    for f in Path(source_dir).iterdir():  # tokenizer, processor, chat template
        if f.is_file() and not _MODEL_FILES.search(f.name):
            shutil.copy2(f, out / f.name)


def save_published(model, out: str | os.PathLike, state_dict: dict | None = None) -> None:
    """`save_pretrained` into `out` (safetensors, no progress bars: one a checkpoint would fill a
    batch job's log), then the weights it wrote in the model's layout rewritten where published
    checkpoints hold them transposed (Qwen3-VL-MoE's experts; `geo3k_torch.model.hub_layout`):
    SGLang loads the folder as it loads the Hub's, and transformers still does (by shape). A
    model whose two layouts share a shape (`layouts_differ_in_shape`: H = 2I, tiny models only)
    keeps its own layout in every file, the one `from_pretrained` then reads right."""
    from safetensors.torch import load_file, save_file

    from geo3k_torch.model import hub_layout, layouts_differ_in_shape

    with quiet_progress():
        model.save_pretrained(out, state_dict=state_dict, safe_serialization=True)
    if not layouts_differ_in_shape(model):
        return
    for f in sorted(Path(out).glob("*.safetensors")):
        tensors = load_file(f)
        published = hub_layout(tensors, model)
        if any(published[k] is not tensors[k] for k in tensors):
            save_file(published, str(f), metadata={"format": "pt"})


@contextlib.contextmanager
def quiet_progress():
    """transformers' progress bars off inside the block, as they were after it."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _single_process_is_meant():
    """Without a process group, torch.distributed.checkpoint warns at every save and load that
    it assumes one process: it is right, and the warning would repeat in the log."""
    with warnings.catch_warnings():
        if not dist.is_initialized():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save_state(directory: str | os.PathLike, model, optimizer, scheduler) -> None:
    """Weights and optimizer state into `directory`/torch_state (every rank writes its shards),
    scheduler and torch RNG into `directory`/train_state.pt (rank 0)."""
    import torch.distributed.checkpoint as dcp

    model_sd, optim_sd = get_state_dict(model, optimizer)
    with _single_process_is_meant():
        dcp.save({"model": model_sd, "optimizer": optim_sd},
                 checkpoint_id=str(Path(directory) / SHARDED_DIR))
    if _rank() == 0:
        torch.save({"scheduler": scheduler.state_dict(), "torch_rng": torch.get_rng_state()},
                   Path(directory) / STATE_FILE)


def load_state(directory: str | os.PathLike, model, optimizer, scheduler) -> None:
    """Restore what `save_state` wrote: each rank reads its own shards of the weights and
    optimizer state, then the scheduler and torch RNG."""
    import torch.distributed.checkpoint as dcp

    path = Path(directory)
    if not (path / STATE_FILE).exists() or not (path / SHARDED_DIR).is_dir():
        raise FileNotFoundError(f"{path} has no {STATE_FILE} and {SHARDED_DIR}/: not a torch "
                                "learner checkpoint")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    with _single_process_is_meant():
        dcp.load(state, checkpoint_id=str(path / SHARDED_DIR))
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
    rest = torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)
    scheduler.load_state_dict(rest["scheduler"])
    torch.set_rng_state(rest["torch_rng"])


def full_state_dict(model) -> dict:
    """The unsharded model state dict on every rank (an FSDP collective: all ranks call it)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                broadcast_from_rank0=False))
