"""Qwen-VL models in torch: loading, model inputs for packed micro-batches, per-token log-probs.

A packed micro-batch (`common.batching.PackedBatch`) is one row of T tokens holding S sequences.
Its position ids are computed per sequence by `common.mrope` (3-D M-RoPE for image tokens) and
passed in transformers' (4, 1, T) layout (row 0 the text position); its segments go to the
attention (`geo3k_torch.attention`) as `packed_segments`, so no attention crosses a sequence
boundary and a sample that continues its group's shared prompt attends to it. Log-probs are read
only where they are needed (the masked tokens), in fp32 from `logits / temperature`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from common.batching import PackedBatch
from common.mrope import packed_position_ids
from common.processor import image_inputs
from geo3k_torch import attention


def load_model(path: str, dtype: torch.dtype = torch.float32, attn: str = attention.NAME):
    """A Qwen2.5-VL or Qwen3-VL checkpoint directory as a transformers model, in train mode.
    attn: "packed_sdpa" (`geo3k_torch.attention`: packed rows attend per sequence) or any
    transformers attention implementation."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype, attn_implementation=attn)
    _check_kind(model.config, path)
    return model


def load_sharded(path: str, device: torch.device | str, bf16: bool,
                 dtype: torch.dtype = torch.float32, attn: str = attention.NAME,
                 gradient_checkpointing: bool = False):
    """The checkpoint at `path` as an FSDP2 model (`geo3k_torch.distributed.parallelize`; every
    rank of the process group calls this), without a full copy on any device: the model is
    built on the meta device, sharded, given storage on `device` for its own shards only, then
    rank 0 reads the safetensors (on CPU, in the checkpoint's dtype) and each tensor is
    broadcast and scattered to its shards. dtype: the stored parameters' (fp32 master weights
    for training, bf16 for the KL reference); bf16: compute under the bf16 policy;
    gradient_checkpointing: recompute each layer in the backward pass (set before sharding)."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from transformers import AutoConfig, AutoModelForImageTextToText
    import torch.distributed as dist

    from geo3k_torch import distributed

    config = AutoConfig.from_pretrained(path)
    _check_kind(config, path)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config, dtype=dtype,
                                                        attn_implementation=attn)
    if gradient_checkpointing:  # (its name before transformers 5.2x: gradient_checkpointing_*)
        getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    distributed.parallelize(model, bf16)
    model.to_empty(device=device)
    for module in model.modules():  # the rotary tables: buffers outside the checkpoint
        if module._non_persistent_buffers_set:
            model._init_weights(module)
    full = {}
    if dist.get_rank() == 0:
        for f in sorted(Path(path).glob("*.safetensors")):
            full.update({k: v.to(dtype) for k, v in load_file(f).items()})
        missing = set(model.state_dict()) - set(full) - _tied(model)
        if missing:
            raise ValueError(f"{path}: the checkpoint lacks {sorted(missing)[:5]}")
    set_model_state_dict(model, full, options=StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=True, strict=False))
    model.train()
    return model


def _tied(model) -> set[str]:
    """Parameter names that share a tensor with an earlier one (a tied LM head is saved once)."""
    first, tied = set(), set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            tied.add(name)
        first.add(id(p))
    return tied


def _check_kind(config, path: str) -> None:
    if config.model_type not in ("qwen2_5_vl", "qwen3_vl"):
        raise ValueError(f"{path}: model_type {config.model_type!r} is not Qwen2.5-VL or Qwen3-VL")


def packed_inputs(batch: PackedBatch, processor, config, device: torch.device | str = "cpu"
                  ) -> dict:
    """Keyword arguments for the model's forward on a packed micro-batch (batch dim 1),
    `packed_segments` (for `geo3k_torch.attention`) included."""
    parents = batch.parent_of()
    if (parents >= 0).any() and config._attn_implementation != attention.NAME:
        raise ValueError(f"a micro-batch with shared prefixes needs the {attention.NAME!r} "
                         f"attention, the model runs {config._attn_implementation!r}")
    imgs = image_inputs(processor, batch.images)
    grid = imgs.get("image_grid_thw", np.zeros((0, 3), np.int64))
    pos = packed_position_ids(batch.input_ids, batch.cu_seqlens, batch.image_counts, grid,
                              config.image_token_id, config.vision_config.spatial_merge_size,
                              parents)
    segments = (np.diff(batch.cu_seqlens).tolist(), parents.tolist())
    out = {"input_ids": torch.from_numpy(batch.input_ids).to(device)[None],
           "position_ids": torch.from_numpy(pos).to(device)[:, None, :],
           "packed_segments": segments}
    if imgs:
        out["pixel_values"] = torch.from_numpy(imgs["pixel_values"]).to(device)
        out["image_grid_thw"] = torch.from_numpy(grid).to(device)
    return out


def token_logprobs(model, inputs: dict[str, torch.Tensor], targets: torch.Tensor,
                   temperature: float = 1.0, with_entropy: bool = False, chunk: int = 0):
    """log p(token t | tokens < t) at the positions `targets` (K,) of the packed row.

    Every target must have a predecessor in its own sequence (its loss mask is 1, so it is never
    the first token of a sequence). Only the K needed logits rows are computed (the root forward
    with `logits_to_keep`, so FSDP's hooks run), `chunk` rows at a time when 0 < chunk < K (each
    chunk's (chunk, vocab) logits are recomputed in the backward pass: the K x vocab logits never
    exist at once). Returns (K,) fp32 log-probs and, with `with_entropy`, (K,) detached
    entropies of the same distributions.
    """
    ids = inputs["input_ids"][0, targets]
    if 0 < chunk < len(targets):
        head = model.lm_head
        model.lm_head = _ChunkedHead(head, ids, temperature, chunk)
        try:
            out = model(**inputs, use_cache=False, logits_to_keep=targets - 1).logits[0]
        finally:
            model.lm_head = head
        return (out[:, 0], out[:, 1]) if with_entropy else out[:, 0]
    out = model(**inputs, use_cache=False, logits_to_keep=targets - 1)
    return _logprobs(out.logits[0], ids, temperature, with_entropy)


def _logprobs(logits: torch.Tensor, ids: torch.Tensor, temperature: float, with_entropy: bool):
    """(K, V) logits, (K,) token ids -> (K,) fp32 log-probs [and (K,) detached entropies]."""
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    logp = logp_all.gather(-1, ids[:, None])[:, 0]
    if not with_entropy:
        return logp
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


class _ChunkedHead(torch.nn.Module):
    """Stands in for the LM head during one forward: (1, K, hidden) -> (1, K, 2) log-probs of
    `ids` and entropies, `chunk` rows at a time, each chunk checkpointed."""

    def __init__(self, head: torch.nn.Module, ids: torch.Tensor, temperature: float, chunk: int):
        super().__init__()
        self.head, self.ids, self.temperature, self.chunk = head, ids, temperature, chunk

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        parts = [checkpoint(self._part, hidden[0, a:a + self.chunk], self.ids[a:a + self.chunk],
                            use_reentrant=False) for a in range(0, hidden.shape[1], self.chunk)]
        return torch.cat(parts)[None]

    def _part(self, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        logp, entropy = _logprobs(self.head(hidden), ids, self.temperature, True)
        return torch.stack([logp, entropy], dim=-1)
