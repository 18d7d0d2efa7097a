"""Packed micro-batches (`common.batching.PackedBatch`) as the arrays the JAX model consumes.

The JAX learner trains on the PACKED layout, the same micro-batches the torch learner trains on:
each PackedBatch becomes one row of T tokens, with everything that belongs to it (its trained
positions, its images' patches) on the same row, so that every array splits over the
data-parallel mesh axes along its row axis and each device computes only its rows' log-probs
and images. Packing rather than padding each sequence wastes no compute on pad tokens, keeps
every sequence's M-RoPE positions exact (`common.mrope`, per sequence) and makes the two
backends' inputs identical, which is what the cross-backend check compares.

    input_ids    (B, T) int32     pad tokens are 0 in segment -1
    positions    (B, 3, T) int32  M-RoPE rows (temporal, height, width), per sequence
    segments     (B, T) int32     segment index within the row, -1 on padding
    prefix       (B, T) int32     the shared prefix segment (`common.batching`) the token's
                                  segment continues, NO_PREFIX for none: its queries also see
                                  every key of that segment
    loss_mask    (B, T) float32   1 on the model's own tokens
    advantages   (B, T) float32   each masked token's advantage (its sequence's, or its turn's)
    rollout_logprobs (B, T) float32
    weights      (B, T) float32   loss weights (`common.grpo.token_weights`) for the global batch
    old_logprobs (B, T) float32   the behaviour policy's log-probs, only when the micro-batches
                                  carry them (several updates on one rollout)
    attn_starts  (B, T / block) int32  first key of each query block's own key window
    prefix_starts (B, T / block) int32 first key of each query block's prefix window
    routing      (B, T, L, K) int16  only with routing replay (`loss.routing_replay`): the K
                                  experts each of the L sparse layers routes the token to, as
                                  the engine did (`common.batching.replayed_routing`); -1 on
                                  padding, fillers and unrecorded tokens: routed freely
    targets      (B, K) int32     positions of the row's trained tokens (loss mask 1), padded
                                  with 0 (a sequence start, never trained)
    key_offsets  (W,) int32       arange(W) and arange(Wp): the own and prefix windows' lengths
    prefix_offsets (Wp,) int32    (W a multiple of the block, Wp of PREFIX_UNIT, at most T)
                                  cover every block's keys (`attention_windows`)
  only when some row has an image:
    pixel_values (B, P, C*t*p*p)  the row's image patches, padded with zero patches
    vision       dict             per-row grid index arrays (`vision_aux`), each (B, P, ...)
                                  (merge_unperm: (B, P / m^2)); padding patches form a segment
                                  of their own
    visual_index (B, P / m^2) int32  position of each image token in the row, in order; padding
                                  entries are T (out of range: their embeddings are dropped)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from common.batching import PackedBatch, replayed_routing
from common.grpo import token_weights
from common.mrope import image_token_counts, packed_position_ids
from common.processor import image_inputs
from geo3k_jax.core.vision_grid import QWEN3, tower, vision_aux

BLOCK = 128  # query block of the text attention (the largest divisor of T up to this)
PREFIX_UNIT = 32  # the prefix window's length: a multiple of this (a prompt, not a block)
REPLICATED_KEYS = ("key_offsets", "prefix_offsets")  # every other array: the row axis first
NO_PREFIX = -2  # `prefix` of a segment that continues none (never a segment id, nor padding's)


@dataclasses.dataclass
class HostRow:
    """One micro-batch's arrays before padding (t tokens, p patches, k trained tokens)."""

    batch: PackedBatch
    positions: np.ndarray  # (3, t)
    prefix: np.ndarray  # (t,) the prefix segment of each token's segment, NO_PREFIX for none
    weights: np.ndarray  # (t,)
    targets: np.ndarray  # (k,)
    pixel_values: np.ndarray | None  # (p, width)
    vision: dict  # vision_aux arrays of the row's images
    visual_index: np.ndarray  # (p / m^2,)
    routing: np.ndarray | None = None  # (t, L, K) int16 the replayed experts (-1: free)


def host_row(b: PackedBatch, processor, config, *, agg: str, n_tokens: float,
             n_seqs: float, routing: tuple[int, int] | None = None) -> HostRow:
    """The arrays of one micro-batch (images through the processor, M-RoPE, loss weights).
    routing: (L, K) of a learner that replays the engine's routing (`assemble`)."""
    merge = config.vision_config.spatial_merge_size
    imgs = image_inputs(processor, b.images)
    grid = imgs.get("image_grid_thw", np.zeros((0, 3), np.int64))
    parents = b.parent_of()
    pos = packed_position_ids(b.input_ids, b.cu_seqlens, b.image_counts, grid,
                              config.image_token_id, merge, parents)
    prefix = np.repeat(np.where(parents >= 0, parents, NO_PREFIX),
                       np.diff(b.cu_seqlens)).astype(np.int32)
    if (b.loss_mask[b.cu_seqlens[:-1]] > 0).any():
        raise ValueError("a sequence's first token is in the loss mask: it has no predecessor "
                         "to predict it")
    index = np.flatnonzero(b.input_ids == config.image_token_id).astype(np.int32)
    if len(index) != image_token_counts(grid, merge).sum():
        raise ValueError(f"{len(index)} image tokens in a micro-batch, its images need "
                         f"{image_token_counts(grid, merge).sum()}")
    weights = token_weights(b.loss_mask, agg, seq_ids=b.seq_ids, n_tokens=n_tokens,
                            n_seqs=n_seqs, mean_over=b.mean_over)
    return HostRow(b, pos[1:], prefix, weights,
                   np.flatnonzero(b.loss_mask > 0).astype(np.int32),
                   imgs["pixel_values"].astype(np.float32) if imgs else None,
                   vision_aux(config.vision_config, grid) if imgs else {}, index,
                   None if routing is None else _replayed(b, routing))


def _replayed(b: PackedBatch, shape: tuple[int, int]) -> np.ndarray:
    """(t, L, K) int16: the micro-batch's routing to replay, all -1 for a filler."""
    routed = replayed_routing(b)
    if routed is None:
        return np.full((b.num_tokens,) + tuple(shape), -1, np.int16)
    if routed.shape != (b.num_tokens,) + tuple(shape):
        raise ValueError(f"the micro-batch's routed experts are {routed.shape}; the model "
                         f"routes its {b.num_tokens} tokens over (layers, top_k) = {shape}")
    return routed


def assemble(rows: Sequence[HostRow], config, *, n_rows: int, length: int, n_targets: int,
             n_patches: int, min_window: int = 0, min_prefix_window: int = 0,
             routing: tuple[int, int] | None = None) -> dict:
    """The padded (B = n_rows, T = length) arrays of `rows` (module docstring); rows past
    len(rows) are all padding. n_patches = 0: no image arrays (no row may have an image).
    routing: (L, K), the `routing` array of a learner that replays routing (rows made by
    `host_row` with it), even when every row is padding: one set of keys per run."""
    if len(rows) > n_rows:
        raise ValueError(f"{len(rows)} micro-batches for {n_rows} rows")
    out = {"input_ids": np.zeros((n_rows, length), np.int32),
           "positions": np.zeros((n_rows, 3, length), np.int32),
           "segments": np.full((n_rows, length), -1, np.int32),
           "prefix": np.full((n_rows, length), NO_PREFIX, np.int32),
           "targets": np.zeros((n_rows, n_targets), np.int32)}
    keys = ["loss_mask", "advantages", "rollout_logprobs", "weights"]
    behaviour = [row.batch.old_logprobs is not None for row in rows]
    if any(behaviour):
        if not all(behaviour):
            raise ValueError("some micro-batches carry old_logprobs and others do not")
        keys.append("old_logprobs")
    for key in keys:
        out[key] = np.zeros((n_rows, length), np.float32)
    if routing is not None:
        out["routing"] = np.full((n_rows, length) + tuple(routing), -1, np.int16)
    for r, row in enumerate(rows):
        b, t = row.batch, row.batch.num_tokens
        if t > length or len(row.targets) > n_targets:
            raise ValueError(f"a micro-batch of {t} tokens ({len(row.targets)} trained) does "
                             f"not fit rows of {length} ({n_targets} trained)")
        out["input_ids"][r, :t] = b.input_ids
        out["positions"][r, :, :t] = row.positions
        out["segments"][r, :t] = b.seq_ids
        out["prefix"][r, :t] = row.prefix
        out["loss_mask"][r, :t] = b.loss_mask
        out["advantages"][r, :t] = b.advantages
        out["rollout_logprobs"][r, :t] = b.rollout_logprobs
        out["weights"][r, :t] = row.weights
        if "old_logprobs" in out:
            out["old_logprobs"][r, :t] = b.old_logprobs
        out["targets"][r, :len(row.targets)] = row.targets
        if routing is not None:
            if row.routing is None:
                raise ValueError("a replaying learner's row was made without its routing "
                                 "(host_row's routing)")
            out["routing"][r, :t] = row.routing
    out.update(attention_windows(out["segments"], out["prefix"], min_window=min_window,
                                 min_prefix_window=min_prefix_window))
    if n_patches:
        padded = [pad_patches(rows[r] if r < len(rows) else None, config, n_patches, length)
                  for r in range(n_rows)]
        out["pixel_values"] = np.stack([p["pixel_values"] for p in padded])
        out["visual_index"] = np.stack([p["visual_index"] for p in padded])
        out["vision"] = {k: np.stack([p["vision"][k] for p in padded])
                         for k in padded[0]["vision"]}
    elif any(row.pixel_values is not None for row in rows):
        raise ValueError("rows with images need n_patches > 0")
    return out


def pad_patches(row: HostRow | None, config, n_patches: int, length: int) -> dict:
    """A row's pixel values, vision aux arrays and image-token positions padded to `n_patches`
    patches: the padding patches are zeros in a segment (and window) of their own, their image
    tokens point past the row (T) and are dropped."""
    vc = config.vision_config
    unit = vc.spatial_merge_size ** 2
    if n_patches % unit:
        raise ValueError(f"n_patches={n_patches} is not a multiple of {unit}")
    width = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
    have = 0 if row is None or row.pixel_values is None else len(row.pixel_values)
    if have > n_patches:
        raise ValueError(f"a micro-batch has {have} image patches, rows hold {n_patches}")
    extra = n_patches - have
    pixels = np.zeros((n_patches, width), np.float32)
    index = np.full(n_patches // unit, length, np.int32)
    aux = row.vision if have else {}
    if have:
        pixels[:have] = row.pixel_values
        index[:len(row.visual_index)] = row.visual_index
    fresh = lambda key: int(aux[key].max()) + 1 if have else 0  # noqa: E731
    new = {"rope_pos": np.zeros((extra, 2), np.int32),
           "segments": np.full(extra, fresh("segments"), np.int32)}
    if tower(vc) == QWEN3:
        new.update(pos_indices=np.zeros((extra, 4), np.int32),
                   pos_weights=np.zeros((extra, 4), np.float32))
    else:
        new.update(window_perm=np.arange(have, n_patches, dtype=np.int32),
                   window_segments=np.full(extra, fresh("window_segments"), np.int32),
                   merge_unperm=np.arange(have // unit, n_patches // unit, dtype=np.int32))
    aux = {k: np.concatenate([aux[k], new[k]]).astype(new[k].dtype) for k in new} if have \
        else new
    return {"pixel_values": pixels, "vision": aux, "visual_index": index}


def device_batch(batches: Sequence[PackedBatch], processor, config, *, agg: str,
                 n_tokens: float, n_seqs: float, pad_to: int = 128,
                 rows_multiple: int = 1, routing: tuple[int, int] | None = None) -> dict:
    """The arrays of `batches` with sizes that follow the data: T the longest micro-batch and K
    the most trained tokens of a row, both rounded up to `pad_to`; P the most patches of a row.
    n_tokens / n_seqs: masked tokens / sequences of the global batch (for the loss weights);
    rows_multiple: empty rows are added until the row count divides by it; routing: (L, K) to
    replay the batches' routing (`assemble`)."""
    if not batches:
        raise ValueError("no micro-batches")
    rows = [host_row(b, processor, config, agg=agg, n_tokens=n_tokens, n_seqs=n_seqs,
                     routing=routing) for b in batches]
    up = lambda n: max(-(-n // pad_to) * pad_to, pad_to)  # noqa: E731
    return assemble(rows, config, n_rows=-(-len(rows) // rows_multiple) * rows_multiple,
                    length=up(max(b.num_tokens for b in batches)),
                    n_targets=up(max(len(r.targets) for r in rows)),
                    n_patches=max((len(r.pixel_values) for r in rows
                                   if r.pixel_values is not None), default=0),
                    routing=routing)


def attention_windows(segments: np.ndarray, prefix: np.ndarray | None = None,
                      block: int = BLOCK, min_window: int = 0, min_prefix_window: int = 0
                      ) -> dict[str, np.ndarray]:
    """Key windows for `geo3k_jax.kernels.windowed.windowed_attention` over rows of contiguous
    segments.

    segments: (B, T) int, -1 on padding; prefix: (B, T) the shared prefix segment each token's
    segment continues (`common.batching`), NO_PREFIX for none (None: no token continues one).
    Query block i of a row (block = gcd(T, `block`)) reads two windows of keys:

      prefix window  [prefix_starts_i, + Wp): the keys of one shared prefix, window_prefix_i
                     (NO_PREFIX: none), up to the block's end: the one its first token
                     continues, or its first token's own segment when that is a prefix
      own window     [attn_starts_i, + W): from the first other key any of its queries sees
                     to the block's end (its segments, any other prefix)

    so a row of shared groups costs T x (prompt + longest continuation) scores, not T x group.
    One W and one Wp for the batch, at least `min_window` / `min_prefix_window` (buckets:
    fewer shapes), at most T (Wp = 0 when no block needs one): W a multiple of the block, Wp
    of PREFIX_UNIT (a prompt is no multiple of the block: rounding its 401 keys up to 512
    would cost a sixth more scores than 416 or 448 on the quick CPU run).
    Returns {attn_starts, prefix_starts, window_prefix: (B, T / block), key_offsets: (W,),
    prefix_offsets: (Wp,)} int32, the offsets arange(W) and arange(Wp)."""
    rows, length = segments.shape
    block = math.gcd(length, block)
    prefix = np.full_like(segments, NO_PREFIX) if prefix is None else np.asarray(prefix)
    block_start = np.arange(0, length, block)
    need = np.zeros((rows, len(block_start)), np.int64)  # first own-window key of each block
    p_start = np.zeros_like(need)
    p_need = np.zeros_like(need)  # keys of the prefix window each block reads
    p_seg = np.full_like(need, NO_PREFIX)
    for r in range(rows):
        seg, pre = segments[r], prefix[r]
        ids, first, count = np.unique(seg, return_index=True, return_counts=True)
        at = lambda s: np.minimum(np.searchsorted(ids, s), len(ids) - 1)  # noqa: E731
        start_of = lambda s: first[at(s)]  # noqa: E731  (segments are contiguous)
        pre_ok = pre >= 0
        if pre_ok.any() and not np.isin(pre[pre_ok], ids[ids >= 0]).all():
            raise ValueError(f"row {r}: a prefix segment that is not in the row")
        head_seg, head_pre = seg[block_start], pre[block_start]
        p_seg[r] = np.where(head_pre >= 0, head_pre,
                            np.where(np.isin(head_seg, pre[pre_ok]), head_seg, NO_PREFIX))
        window_seg = np.repeat(p_seg[r], block)
        own = np.where(seg == window_seg, length, start_of(seg))  # own keys: prefix window's
        other = pre_ok & (pre != window_seg)  # a prefix read from the own window
        seen = np.where(other, np.minimum(own, start_of(np.maximum(pre, 0))), own)
        seen = np.where(seg >= 0, seen, length)  # padding queries need nothing
        need[r] = np.minimum(seen.reshape(-1, block).min(axis=1), block_start)
        has = p_seg[r] >= 0
        p_start[r] = np.where(has, start_of(np.maximum(p_seg[r], 0)), 0)
        ends = p_start[r] + count[at(np.maximum(p_seg[r], 0))]
        p_need[r] = np.where(has, np.minimum(ends, block_start + block) - p_start[r], 0)
    up = lambda n: min(length, -(-n // block) * block)  # noqa: E731
    window = up(max(int((block_start + block - need).max()), min_window))
    prefix_window = min(length, -(-max(int(p_need.max()), min_prefix_window) // PREFIX_UNIT)
                        * PREFIX_UNIT)
    return {"attn_starts": np.minimum(need, length - window).astype(np.int32),
            "key_offsets": np.arange(window, dtype=np.int32),
            "prefix_starts": np.minimum(p_start, length - prefix_window).astype(np.int32),
            "window_prefix": p_seg.astype(np.int32),
            "prefix_offsets": np.arange(prefix_window, dtype=np.int32)}
