"""Host-side bookkeeping of the Qwen-VL vision towers: everything that depends on the image grids.

`vision_aux(cfg, grid_thw)` computes, in numpy, the index arrays the towers of
`geo3k_jax.models.vision` need (rotary positions, frame and window segments, the window permutation
and its inverse, the position-table interpolation taps), so the towers take arrays only and compile
once per patch count. Each helper reproduces the corresponding transformers code exactly
(`tests/test_jax_vision.py` compares them).

The patches arrive in the order of the Qwen-VL image processor: per image and frame, spatial
merge blocks in raster order, the merge_size x merge_size patches of a block in raster order.
"""

from __future__ import annotations

import numpy as np

QWEN25 = "qwen2_5_vl_vision"
QWEN3 = "qwen3_vl_vision"
# vision config model_type -> its tower (Qwen3-VL-MoE's is Qwen3-VL's)
TOWERS = {QWEN25: QWEN25, QWEN3: QWEN3, "qwen3_vl_moe_vision": QWEN3}


def tower(cfg) -> str:
    """QWEN25 or QWEN3: the tower of vision config `cfg`; an error for another."""
    kind = getattr(cfg, "model_type", None)
    if kind not in TOWERS:
        raise ValueError(f"unsupported vision config model_type {kind!r}; known: "
                         f"{sorted(TOWERS)}")
    return TOWERS[kind]


def _patch_rows_cols(h: int, w: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, column) of each patch of an h x w frame, in processor (merge-block) order.

    Returns two (h*w,) int arrays."""
    block_row, block_col, in_row, in_col = np.indices((h // merge, w // merge, merge, merge))
    return ((block_row * merge + in_row).reshape(-1), (block_col * merge + in_col).reshape(-1))


def rope_positions(grid_thw: np.ndarray, merge: int) -> np.ndarray:
    """(P, 2) int32 (row, column) of every patch, all frames of all images concatenated."""
    out = []
    for t, h, w in grid_thw:
        rows, cols = _patch_rows_cols(h, w, merge)
        out.append(np.tile(np.stack([rows, cols], axis=-1), (t, 1)))
    return np.concatenate(out).astype(np.int32)


def frame_segments(grid_thw: np.ndarray) -> np.ndarray:
    """(P,) int32 id of the frame (of an image) each patch belongs to: full attention's segments."""
    per_frame = np.repeat(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0])
    return np.repeat(np.arange(len(per_frame)), per_frame).astype(np.int32)


def _bilinear_taps(pos: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Align-corners linear taps of `pos` (of `size` positions) into `side` table rows, in fp32
    as transformers computes them. Returns (n, 2) int taps (floor, floor + 1) and (n, 2) weights."""
    src = pos.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
    floor = np.floor(src)
    offsets = np.arange(2, dtype=np.float32)
    taps = np.clip((floor[:, None] + offsets).astype(np.int64), 0, side - 1)
    weights = np.maximum(np.float32(1) - np.abs(src[:, None] - floor[:, None] - offsets), 0)
    return taps, weights


def pos_embed_taps(grid_thw: np.ndarray, merge: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear (align_corners) resampling of a side x side position table to each image's grid.

    Returns (P, 4) int32 row indices into the flattened table and (P, 4) float32 weights, the
    taps ordered (top-left, top-right, bottom-left, bottom-right), patches in processor order."""
    indices, weights = [], []
    for t, h, w in grid_thw:
        rows, cols = _patch_rows_cols(h, w, merge)
        row_taps, row_w = _bilinear_taps(rows, h, side)
        col_taps, col_w = _bilinear_taps(cols, w, side)
        idx = (row_taps[:, :, None] * side + col_taps[:, None, :]).reshape(-1, 4)
        wgt = (row_w[:, :, None] * col_w[:, None, :]).reshape(-1, 4)
        indices.append(np.tile(idx, (t, 1)))
        weights.append(np.tile(wgt, (t, 1)))
    return np.concatenate(indices).astype(np.int32), np.concatenate(weights)


def window_order(grid_thw: np.ndarray, merge: int, units_per_window: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Regrouping of merge units (merge x merge patch blocks) window by window.

    A window is units_per_window x units_per_window units of one frame (smaller at the bottom and
    right edges); windows follow each other in raster order, units inside a window too.
    Returns `window_index` (U,) int: the i-th unit in window order is unit window_index[i] of
    the input (transformers' `get_window_index`), and (U,) int the window id of each unit in
    window order."""
    index, window_ids = [], []
    unit_offset = window_offset = 0
    for t, h, w in grid_thw:
        frame, row, col = np.indices((t, h // merge, w // merge)).reshape(3, -1)
        windows_h = -(-(h // merge) // units_per_window)
        windows_w = -(-(w // merge) // units_per_window)
        window = ((frame * windows_h + row // units_per_window) * windows_w
                  + col // units_per_window)
        order = np.argsort(window, kind="stable")  # raster order is kept inside each window
        index.append(order + unit_offset)
        window_ids.append(window[order] + window_offset)
        unit_offset += len(order)
        window_offset += t * windows_h * windows_w
    return np.concatenate(index), np.concatenate(window_ids)


def _units_to_patches(unit_index: np.ndarray, unit: int) -> np.ndarray:
    """Expand an index over merge units to an index over their `unit` patches each."""
    return (unit_index[:, None] * unit + np.arange(unit)).reshape(-1)


def vision_aux(cfg, grid_thw: np.ndarray) -> dict[str, np.ndarray]:
    """Grid-dependent inputs of the tower built from vision config `cfg`, computed in numpy.

    grid_thw: (N, 3) int (frames, patch rows, patch columns) per image, as the processor returns.
    With P = the total number of patches and M = P / spatial_merge_size**2:

    both architectures
      rope_pos        (P, 2) int32   (row, column) of each patch, in the order the blocks see
                                     the patches (window order for Qwen2.5)
      segments        (P,) int32     frame id of each patch in that order: full attention
    Qwen2.5-VL only
      window_perm     (P,) int32     patch i in window order is input patch window_perm[i]
      window_segments (P,) int32     window id of each patch in window order: windowed attention
      merge_unperm    (M,) int32     output token j is merged token merge_unperm[j] in window
                                     order (the inverse of the window regrouping)
    Qwen3-VL only
      pos_indices     (P, 4) int32   rows of the flattened position table to interpolate
      pos_weights     (P, 4) float32 their bilinear weights
    """
    grid_thw = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
    merge = cfg.spatial_merge_size
    rope_pos, segments = rope_positions(grid_thw, merge), frame_segments(grid_thw)
    if tower(cfg) == QWEN3:
        side = int(cfg.num_position_embeddings ** 0.5)
        indices, weights = pos_embed_taps(grid_thw, merge, side)
        return dict(rope_pos=rope_pos, segments=segments, pos_indices=indices, pos_weights=weights)
    unit = merge * merge
    index, window_ids = window_order(grid_thw, merge,
                                     cfg.window_size // merge // cfg.patch_size)
    perm = _units_to_patches(index, unit)
    return dict(rope_pos=rope_pos[perm], segments=segments[perm],
                window_perm=perm.astype(np.int32),
                window_segments=np.repeat(window_ids, unit).astype(np.int32),
                merge_unperm=np.argsort(index).astype(np.int32))
