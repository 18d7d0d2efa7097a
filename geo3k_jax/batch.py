"""Packed micro-batches (`common.batching.PackedBatch`) as the arrays the JAX learner consumes.

The JAX learner trains on the PACKED layout, the same micro-batches the torch learner trains on:
each PackedBatch becomes one row; rows are right-padded to a common length `T` (a multiple of
`pad_to`, so a few bucket lengths cover a run and `jit` compiles once per bucket) and stacked.
Packing rather than padding each sequence wastes no compute on pad tokens, keeps every sequence's
M-RoPE positions exact (`common.mrope`, per sequence) and makes the two backends' inputs
identical, which is what the cross-backend check compares.

    input_ids    (B, T) int32     pad tokens are 0 in segment -1
    positions    (B, 3, T) int32  M-RoPE rows (temporal, height, width), per sequence
    segments     (B, T) int32     sequence index within the row, -1 on padding
    loss_mask    (B, T) float32   1 on the model's own tokens
    advantages   (B, T) float32   the sequence's advantage on its masked tokens
    rollout_logprobs (B, T) float32
    weights      (B, T) float32   loss weights (`common.grpo.token_weights`) for the global batch
    pixel_values (P, C*t*p*p)     the patches of every image of every row, row by row
    vision       dict             grid-dependent index arrays (`geo3k_jax.vision.vision_aux`)
    visual_index (N,) int32       flat index into B * T of each image placeholder token, in order
    attn_starts  (B, T / block) int32  first key of each query block's attention window
    key_offsets  (W,) int32       arange(W): the window length W (a multiple of the block, at
                                  most T) covers every block's sequences (`attention_windows`)
    targets      (K,) int32       flat index into B * T of each trained token (loss mask 1), padded
                                  to a multiple of `pad_to` with 0 (a sequence start, never trained)

Images exist only when some row has one; then all three image keys are present.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from common.batching import PackedBatch
from common.grpo import token_weights
from common.mrope import image_token_counts, packed_position_ids
from common.processor import image_inputs
from geo3k_jax.vision_grid import vision_aux

ROW_KEYS = ("input_ids", "positions", "segments", "loss_mask", "advantages",
            "rollout_logprobs", "weights", "attn_starts")
BLOCK = 128  # query block of the text attention (the largest divisor of T up to this)


def device_batch(batches: Sequence[PackedBatch], processor, config, *, agg: str,
                 n_tokens: float, n_seqs: float, pad_to: int = 128,
                 rows_multiple: int = 1) -> dict:
    """The arrays of `batches` (see the module docstring). n_tokens / n_seqs: masked tokens /
    sequences of the global batch (for the loss weights); rows_multiple: empty rows are added
    until the row count divides by it (the mesh's data-parallel size)."""
    if not batches:
        raise ValueError("no micro-batches")
    n_rows = -(-len(batches) // rows_multiple) * rows_multiple
    length = -(-max(b.num_tokens for b in batches) // pad_to) * pad_to
    merge = config.vision_config.spatial_merge_size
    out = {"input_ids": np.zeros((n_rows, length), np.int32),
           "positions": np.zeros((n_rows, 3, length), np.int32),
           "segments": np.full((n_rows, length), -1, np.int32)}
    for key in ROW_KEYS[3:7]:
        out[key] = np.zeros((n_rows, length), np.float32)
    images, grids = [], []
    for r, b in enumerate(batches):
        t = b.num_tokens
        imgs = image_inputs(processor, b.images)
        grid = imgs.get("image_grid_thw", np.zeros((0, 3), np.int64))
        pos = packed_position_ids(b.input_ids, b.cu_seqlens, b.image_counts, grid,
                                  config.image_token_id, merge)
        out["input_ids"][r, :t] = b.input_ids
        out["positions"][r, :, :t] = pos[1:]
        out["segments"][r, :t] = b.seq_ids
        out["loss_mask"][r, :t] = b.loss_mask
        out["advantages"][r, :t] = b.advantages
        out["rollout_logprobs"][r, :t] = b.rollout_logprobs
        out["weights"][r, :t] = token_weights(b.loss_mask, agg, seq_ids=b.seq_ids,
                                              n_tokens=n_tokens, n_seqs=n_seqs)
        if imgs:
            images.append(imgs["pixel_values"])
            grids.append(grid)
    starts = [r * length + int(c) for r, b in enumerate(batches) for c in b.cu_seqlens[:-1]]
    if (out["loss_mask"].reshape(-1)[starts] > 0).any():
        raise ValueError("a sequence's first token is in the loss mask: it has no predecessor "
                         "to predict it")
    out["attn_starts"], out["key_offsets"] = attention_windows(out["segments"])
    targets = np.flatnonzero(out["loss_mask"].reshape(-1) > 0)
    out["targets"] = np.zeros(-(-max(len(targets), 1) // pad_to) * pad_to, np.int32)
    out["targets"][:len(targets)] = targets
    if images:
        grid = np.concatenate(grids)
        index = np.flatnonzero(out["input_ids"] == config.image_token_id).astype(np.int32)
        if len(index) != image_token_counts(grid, merge).sum():
            raise ValueError(f"{len(index)} image tokens in the batch, its images need "
                             f"{image_token_counts(grid, merge).sum()}")
        out["pixel_values"] = np.concatenate(images).astype(np.float32)
        out["vision"] = vision_aux(config.vision_config, grid)
        out["visual_index"] = index
    return out


def attention_windows(segments: np.ndarray, block: int = BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """Key windows for `layers.windowed_attention` over rows of contiguous segments.

    segments: (B, T) int, -1 on padding. Query block i of a row (block = gcd(T, `block`)) reads
    keys [start_i, start_i + W): from the start of the sequence its first token belongs to
    (padding blocks: from the block itself) to the block's end, with one W for the batch, a
    multiple of the block. Returns starts (B, T / block) int32 and key_offsets (W,) int32."""
    rows, length = segments.shape
    block = math.gcd(length, block)
    first = np.zeros_like(segments)  # index of the first token of each token's segment
    for r in range(rows):
        change = np.flatnonzero(np.diff(segments[r]) != 0) + 1
        bounds = np.concatenate([[0], change])
        first[r] = bounds[np.searchsorted(bounds, np.arange(length), side="right") - 1]
    block_start = np.arange(0, length, block)
    seq_start = np.where(segments[:, block_start] >= 0, first[:, block_start], block_start)
    need = int((block_start + block - seq_start).max())
    window = min(length, -(-need // block) * block)
    starts = np.minimum(seq_start, length - window).astype(np.int32)
    return starts, np.arange(window, dtype=np.int32)
