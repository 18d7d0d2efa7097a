"""A step's micro-batches as fixed-shape slices: what the JAX learner's compiled functions take.

The step accumulates gradients over S "slices"; a slice is R rows (R = the mesh's data-parallel
size), one packed micro-batch per row (`geo3k_jax.batch`), every row T tokens. A slice's
arrays are the compiled gradient's input, so that a whole run compiles a handful of times every
size that follows the data is rounded up to a bucket (`bucket`: a unit times 1, 2, 3, 4, 6, 8,
12, ...), the same for every slice of the step; how many slices a step has is no shape at all:

    T  tokens per row (at most `row_len`)     K  trained tokens per row
    P  image patches per row
    W  own attention keys per query block     Wp prefix attention keys per query block

A step reuses a shape compiled before when it holds the step's sizes and its rows are at most
twice as long as needed (`reuse`), so the shorter buckets a run meets after a longer one cost
padding, not a compile.

Padding never changes a result (see `geo3k_jax.batch`): padded targets point at a row's first
token (never trained, weight 0), padded patches form an image of their own whose tokens are
dropped, padded rows and slices (a process with fewer micro-batches than another) are all
padding.

    slices = step_slices(rows, config, rows_per_slice=R, row_len=budget)
    slices[i]["input_ids"]  (R, T)   ... every key of `geo3k_jax.batch`, T <= budget
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from geo3k_jax.batch import BLOCK, NO_PREFIX, HostRow, assemble, attention_windows

TARGET_UNIT = 128  # trained tokens per row come in multiples of this times a power of two
ROW_UNIT = 256  # tokens per row: multiples of this (up to the row length)
PATCH_UNITS = 16  # image patches per row: multiples of 16 merge units times a power of two
SHAPE_KEYS = ("length", "targets", "patches", "window", "prefix_window")  # a slice's shape
REUSE_SLACK = 2  # a compiled shape serves steps whose rows are at least 1 / this as long


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
    """The sizes this process's rows need: slices holding rows and, bucketed, length (at most
    `row_len`), targets, patches, window, prefix_window. Several processes take the maximum
    of each (the learner does) before `step_slices`: each then runs as many slices of the
    same shapes."""
    unit = config.vision_config.spatial_merge_size ** 2
    patches = max((len(r.pixel_values) for r in rows if r.pixel_values is not None), default=0)
    length = min(row_len, bucket(max((r.batch.num_tokens for r in rows), default=1), ROW_UNIT))
    segments = np.full((max(len(rows), 1), length), -1, np.int32)
    prefix = np.full_like(segments, NO_PREFIX)
    for i, r in enumerate(rows):
        segments[i, :r.batch.num_tokens] = r.batch.seq_ids
        prefix[i, :r.batch.num_tokens] = r.prefix
    windows = attention_windows(segments, prefix)
    block = math.gcd(length, BLOCK)
    window = lambda key: min(length, bucket(len(windows[key]), block))  # noqa: E731
    return {"slices": -(-len(rows) // rows_per_slice), "length": length,
            "targets": bucket(max((len(r.targets) for r in rows), default=1), TARGET_UNIT),
            "patches": bucket(patches, PATCH_UNITS * unit) if patches else 0,
            "window": window("key_offsets"),
            "prefix_window": window("prefix_offsets") if len(windows["prefix_offsets"]) else 0}


def reuse(sizes: dict[str, int], compiled: Sequence[dict[str, int]],
          slack: float = REUSE_SLACK) -> dict[str, int]:
    """`sizes` (`step_sizes`) grown to the smallest shape in `compiled` that holds them (every
    size at least the needed one, rows at most `slack` times the needed length), or unchanged
    when none does. A compile costs seconds on CPU and minutes for a large model on TPU, a
    padded step only the padding: a run whose long steps come first then compiles once, not once
    for each shorter bucket it meets later."""
    fits = [c for c in compiled if all(c[k] >= sizes[k] for k in SHAPE_KEYS)
            and c["length"] <= slack * sizes["length"]]
    if not fits:
        return dict(sizes)
    best = min(fits, key=lambda c: tuple(c[k] for k in SHAPE_KEYS))
    return dict(sizes, **{k: best[k] for k in SHAPE_KEYS})


def step_slices(rows: Sequence[HostRow], config, *, rows_per_slice: int, row_len: int,
                sizes: dict[str, int] | None = None) -> list[dict]:
    """The slices of a step (module docstring); `sizes` from `step_sizes` (default: this
    process's own)."""
    sizes = sizes or step_sizes(rows, config, rows_per_slice=rows_per_slice, row_len=row_len)
    groups = [rows[i:i + rows_per_slice] for i in range(0, len(rows), rows_per_slice)]
    if len(groups) > sizes["slices"]:
        raise ValueError(f"{len(groups)} slices for a step of {sizes['slices']}")
    groups += [[]] * (sizes["slices"] - len(groups))
    return [assemble(g, config, n_rows=rows_per_slice, length=sizes["length"],
                     n_targets=sizes["targets"], n_patches=sizes["patches"],
                     min_window=sizes["window"], min_prefix_window=sizes["prefix_window"])
            for g in groups]
