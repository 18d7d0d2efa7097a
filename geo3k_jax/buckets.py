"""A step's micro-batches as fixed-shape arrays: what the JAX learner's compiled step takes.

The step accumulates gradients over S "slices"; a slice is R rows (R = the mesh's data-parallel
size), one packed micro-batch per row (`geo3k_jax.batch`), every row `row_len` tokens. So that a
whole run compiles a handful of times, every size that follows the data is rounded up to a
bucket (`bucket`: a unit times 1, 2, 3, 4, 6, 8, 12, ...), the same for every slice of the step:

    S  slices (the compiled loop runs only the real ones)   K  trained tokens per row
    W  attention keys per query block                       P  image patches per row

Padding never changes a result (see `geo3k_jax.batch`): padded targets point at a row's first
token (never trained, weight 0), padded patches form an image of their own whose tokens are
dropped, padded rows and slices are all padding.

    step = step_arrays(rows, config, rows_per_slice=R, row_len=T)
    step["input_ids"]  (S, R, T)   ... every key of `geo3k_jax.batch` with a leading S axis
    step["n_slices"]   () int32    how many slices hold micro-batches
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from geo3k_jax.batch import BLOCK, HostRow, assemble, attention_windows, reach_of

TARGET_UNIT = 128  # trained tokens per row come in multiples of this times a power of two
PATCH_UNITS = 16  # image patches per row: multiples of 16 merge units times a power of two


def bucket(n: int, unit: int) -> int:
    """The smallest rung >= n of the ladder unit x (1, 2, 3, 4, 6, 8, 12, 16, 24, ...): rungs at
    most 1.5x apart, so padding wastes at most a third of the work while a run meets only a
    logarithmic number of shapes."""
    rung = 1
    while unit * rung < n:
        rung = rung * 4 // 3 if rung % 3 == 0 else rung * 3 // 2 if rung > 1 else 2
    return unit * rung


def step_sizes(rows: Sequence[HostRow], config, *, rows_per_slice: int, row_len: int
               ) -> dict[str, int]:
    """The sizes this process's rows need: slices holding rows (used) and, bucketed, slices,
    targets, patches, window. Several processes take the maximum of each (the learner does)
    before `step_arrays`: the compiled loop then runs as many slices everywhere."""
    unit = config.vision_config.spatial_merge_size ** 2
    patches = max((len(r.pixel_values) for r in rows if r.pixel_values is not None), default=0)
    segments = np.full((max(len(rows), 1), row_len), -1, np.int32)
    for i, r in enumerate(rows):
        segments[i, :r.batch.num_tokens] = r.batch.seq_ids
    reach = reach_of(rows, len(segments), row_len)
    window = len(attention_windows(segments, reach=reach)[1])
    used = -(-len(rows) // rows_per_slice)
    return {"used": used, "slices": bucket(used, 1),
            "targets": bucket(max((len(r.targets) for r in rows), default=1), TARGET_UNIT),
            "patches": bucket(patches, PATCH_UNITS * unit) if patches else 0,
            "window": min(row_len, bucket(window, math.gcd(row_len, BLOCK)))}


def step_arrays(rows: Sequence[HostRow], config, *, rows_per_slice: int, row_len: int,
                sizes: dict[str, int] | None = None) -> dict:
    """The stacked arrays of a step (module docstring); `sizes` from `step_sizes` (default:
    this process's own)."""
    sizes = sizes or step_sizes(rows, config, rows_per_slice=rows_per_slice, row_len=row_len)
    groups = [rows[i:i + rows_per_slice] for i in range(0, len(rows), rows_per_slice)]
    if len(groups) > sizes["slices"]:
        raise ValueError(f"{len(groups)} slices for a step of {sizes['slices']}")
    groups += [[]] * (sizes["slices"] - len(groups))
    slices = [assemble(g, config, n_rows=rows_per_slice, length=row_len,
                       n_targets=sizes["targets"], n_patches=sizes["patches"],
                       min_window=sizes["window"]) for g in groups]
    out = {k: np.stack([s[k] for s in slices]) for k in slices[0] if k != "vision"}
    if "vision" in slices[0]:
        out["vision"] = {k: np.stack([s["vision"][k] for s in slices])
                         for k in slices[0]["vision"]}
    out["key_offsets"] = slices[0]["key_offsets"]  # the same W for every slice
    out["n_slices"] = np.int32(sizes["used"])
    return out
