"""Qwen-VL 3-D M-RoPE position ids in numpy, per sequence and for packed micro-batches.

Qwen2.5-VL and Qwen3-VL give every token three rotary positions (temporal, height, width). Text
tokens advance all three together; the tokens of an image with an LLM grid of (t, h, w) merged
patches take (start + i_t, start + i_h, start + i_w), and the text after it resumes at
start + max(h, w) (t is 1 for still images; both models agree on images).

transformers only computes these positions when no position ids are passed, so a packed batch
with plain 0..n positions silently trains with wrong image positions (REFERENCE §5). The learners
therefore compute them here, per sequence, and pass them explicitly: `packed_position_ids` returns
the (4, T) layout whose first row is the plain text position (it restarts at 0 at every sequence,
which is also how attention finds the packed boundaries) followed by the three M-RoPE rows.
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
    pos = np.empty((3, len(ids)), np.int64)
    current, t, k = 0, 0, 0
    while t < len(ids):
        if not is_image[t]:
            end = t
            while end < len(ids) and not is_image[end]:
                end += 1
            pos[:, t:end] = np.arange(current, current + end - t)
            current += end - t
            t = end
            continue
        gt, gh, gw = grid[k, 0], grid[k, 1] // spatial_merge_size, grid[k, 2] // spatial_merge_size
        n = int(counts[k])
        if not is_image[t:t + n].all():
            raise ValueError(f"image {k} needs {n} consecutive image tokens at position {t}")
        it, ih, iw = np.meshgrid(np.arange(gt), np.arange(gh), np.arange(gw), indexing="ij")
        pos[:, t:t + n] = np.stack([it.ravel(), ih.ravel(), iw.ravel()]) + current
        current += int(max(gh, gw))
        t += n
        k += 1
    return pos


def packed_position_ids(input_ids: np.ndarray, cu_seqlens: np.ndarray, image_counts: np.ndarray,
                        image_grid_thw: np.ndarray, image_token_id: int,
                        spatial_merge_size: int) -> np.ndarray:
    """Positions of a packed micro-batch. input_ids: (T,); cu_seqlens: (S+1,); image_counts: (S,)
    images per sequence; image_grid_thw: (sum(image_counts), 3) in sequence order.
    Returns (4, T) int64: row 0 the text position (restarting at every sequence), rows 1-3 M-RoPE.
    """
    grid = np.asarray(image_grid_thw, np.int64).reshape(-1, 3)
    if int(np.sum(image_counts)) != len(grid):
        raise ValueError(f"{int(np.sum(image_counts))} images counted but {len(grid)} grids given")
    out = np.empty((4, len(input_ids)), np.int64)
    first = 0
    for s in range(len(cu_seqlens) - 1):
        lo, hi = int(cu_seqlens[s]), int(cu_seqlens[s + 1])
        n = int(image_counts[s])
        out[0, lo:hi] = np.arange(hi - lo)
        out[1:, lo:hi] = mrope_position_ids(input_ids[lo:hi], image_token_id,
                                            grid[first:first + n], spatial_merge_size)
        first += n
    return out
