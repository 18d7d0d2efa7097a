"""Qwen-VL 3-D M-RoPE position ids in numpy, per sequence and for packed micro-batches.

Qwen2.5-VL and Qwen3-VL give every token three rotary positions (temporal, height, width). Text
tokens advance all three together; the tokens of an image with an LLM grid of (t, h, w) merged
patches take (start + i_t, start + i_h, start + i_w), and the text after it resumes at
start + max(h, w) (t is 1 for still images; both models agree on images).

transformers only computes these positions when no position ids are passed, so a packed batch
with plain 0..n positions silently trains with wrong image positions. The learners
therefore compute them here, per sequence, and pass them explicitly: `packed_position_ids` returns
the (4, T) layout whose first row is the plain text position (restarting at 0 at every sequence)
followed by the three M-RoPE rows. A segment that continues a shared prefix
(`common.batching`) takes the positions it has after that prefix.
"""

from __future__ import annotations

import numpy as np


def image_token_counts(image_grid_thw: np.ndarray, spatial_merge_size: int) -> np.ndarray:
    """Placeholder tokens per image: t * h * w / merge^2. grid: (N, 3) patches. Returns (N,)."""
    grid = np.asarray(image_grid_thw, np.int64).reshape(-1, 3)
    return grid.prod(axis=1) // (spatial_merge_size ** 2)


def mrope_position_ids(input_ids: np.ndarray, image_token_id: int, image_grid_thw: np.ndarray,
                       spatial_merge_size: int) -> np.ndarray:
    """M-RoPE positions of one sequence. input_ids: (T,); image_grid_thw: (N, 3) for its N images
    in order (patch grid before merging). Returns (3, T) int64.

    Image tokens are assigned to images in order by count, so two images with no text between
    them are still told apart.
    """
    ids = np.asarray(input_ids).reshape(-1)
    grid = np.asarray(image_grid_thw, np.int64).reshape(-1, 3)
    counts = image_token_counts(grid, spatial_merge_size)
    is_image = ids == image_token_id
    if is_image.sum() != counts.sum():
        raise ValueError(f"sequence has {int(is_image.sum())} image tokens but its {len(grid)} "
                         f"images need {int(counts.sum())}")
    n_img = counts.astype(np.int64)
    if (n_img < 1).any():
        raise ValueError(f"image {int(np.argmin(n_img))} of grid {grid[np.argmin(n_img)]} has no "
                         f"tokens after a {spatial_merge_size}x{spatial_merge_size} merge")
    at = np.flatnonzero(is_image)
    first = np.concatenate([[0], np.cumsum(n_img)]).astype(np.int64)[:-1]  # among `at`
    starts = at[first]
    broken = np.flatnonzero(at[first + n_img - 1] - starts != n_img - 1)
    if len(broken):
        k = int(broken[0])
        raise ValueError(f"image {k} needs {int(n_img[k])} consecutive image tokens at position "
                         f"{int(starts[k])}")
    h = grid[:, 1] // spatial_merge_size
    w = grid[:, 2] // spatial_merge_size
    # A token's position is its index, shifted by every image before it: an image of n tokens
    # advances the positions by max(h, w), not n.
    shift = np.zeros(len(ids) + 1, np.int64)
    np.add.at(shift, starts + n_img, np.maximum(h, w) - n_img)
    shift = np.cumsum(shift)[:-1]
    pos = np.broadcast_to(np.arange(len(ids)) + shift, (3, len(ids))).copy()
    for k, t in enumerate(starts):  # each image's tokens: its (t, h, w) grid from its start
        gt, n = int(grid[k, 0]), int(n_img[k])
        it, ih, iw = np.meshgrid(np.arange(gt), np.arange(h[k]), np.arange(w[k]), indexing="ij")
        pos[:, t:t + n] = np.stack([it.ravel(), ih.ravel(), iw.ravel()]) + pos[0, t]
    return pos


def packed_position_ids(input_ids: np.ndarray, cu_seqlens: np.ndarray, image_counts: np.ndarray,
                        image_grid_thw: np.ndarray, image_token_id: int,
                        spatial_merge_size: int, parents: np.ndarray | None = None
                        ) -> np.ndarray:
    """Positions of a packed micro-batch. input_ids: (T,); cu_seqlens: (S+1,); image_counts: (S,)
    images per segment; image_grid_thw: (sum(image_counts), 3) in segment order; parents: (S,)
    the segment a segment continues (a shared prefix, earlier in the row), -1 for none.
    Returns (4, T) int64: row 0 the text position, rows 1-3 M-RoPE. A segment with no parent
    starts at 0; one that continues a prefix takes the positions it has after that prefix.
    """
    grid = np.asarray(image_grid_thw, np.int64).reshape(-1, 3)
    if int(np.sum(image_counts)) != len(grid):
        raise ValueError(f"{int(np.sum(image_counts))} images counted but {len(grid)} grids given")
    n_seg = len(cu_seqlens) - 1
    parents = np.full(n_seg, -1) if parents is None else np.asarray(parents)
    first = np.concatenate([[0], np.cumsum(image_counts)]).astype(np.int64)
    out = np.empty((4, len(input_ids)), np.int64)
    for s in range(n_seg):
        lo, hi = int(cu_seqlens[s]), int(cu_seqlens[s + 1])
        p = int(parents[s])
        if not -1 <= p < s or (p >= 0 and parents[p] != -1):
            raise ValueError(f"segment {s} continues segment {p}: a parent must be an earlier "
                             "segment that continues nothing")
        spans = [(s, lo, hi)] if p < 0 else [(p, int(cu_seqlens[p]), int(cu_seqlens[p + 1])),
                                             (s, lo, hi)]
        ids = np.concatenate([input_ids[a:b] for _, a, b in spans])
        grids = np.concatenate([grid[first[k]:first[k + 1]] for k, _, _ in spans])
        skip = len(ids) - (hi - lo)
        out[0, lo:hi] = np.arange(skip, len(ids))
        pos = mrope_position_ids(ids, image_token_id, grids, spatial_merge_size)
        out[1:, lo:hi] = pos[:, skip:]
    return out
