"""A step's micro-batches as fixed-shape slices: what the JAX learner's compiled functions take.

The step accumulates gradients over S "slices"; a slice is R rows (R = the mesh's data-parallel
size), one packed micro-batch per row (`geo3k_jax.core.batch`), every row of a slice T tokens. A
slice's arrays are the compiled gradient's input, so that a whole run compiles a handful of times
every size that follows the data is rounded up to a bucket (`bucket`: a unit times 1, 2, 3, 4, 6,
8, 12, ...; row lengths and the prefix window, a prompt, on a finer ladder, 1, 2, ..., 8, 10,
12, 14, 16, 20, ...), each slice to its own: a step's half-empty micro-batch (one group of
samples where the next did not fit) does not pay for its full neighbour's length. How many
slices a step has is no shape at all:

    T  tokens per row (at most `row_len`)     K  trained tokens per row
    P  image patches per row
    W  own attention keys per query block     Wp prefix attention keys per query block

A slice reuses a shape compiled before when it holds the slice's sizes and its rows are at most
1.5 times as long as needed (`reuse`), so the shorter buckets a run meets after a longer one
mostly cost padding, not a compile.

Padding never changes a result (see `geo3k_jax.core.batch`): padded targets point at a row's first
token (never trained, weight 0), padded patches form an image of their own whose tokens are
dropped, padded rows and slices (a process with fewer micro-batches than another) are all
padding.

    sizes = slice_sizes(rows, config, rows_per_slice=R, row_len=budget)   # one dict a slice
    slices = step_slices(rows, config, rows_per_slice=R, sizes=sizes)
    slices[i]["input_ids"]  (R, sizes[i]["length"])   ... every key of `geo3k_jax.core.batch`
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from geo3k_jax.core.batch import (BLOCK, NO_PREFIX, PREFIX_UNIT, HostRow, assemble,
                             attention_windows)

TARGET_UNIT = 128  # trained tokens per row come in multiples of this times a power of two
ROW_UNIT = 256  # tokens per row: multiples of this (up to the row length)
PATCH_UNITS = 16  # image patches per row: multiples of 16 merge units times a power of two
PREFIX_RUNGS = 4  # prefix windows (prompts): 4 lengths an octave of PREFIX_UNIT's ladder
SHAPE_KEYS = ("length", "targets", "patches", "window", "prefix_window")  # a slice's shape


@dataclasses.dataclass(frozen=True)
class Ladder:
    """How finely row lengths follow the data: `row_rungs` lengths an octave (`bucket`'s
    per_octave, a power of two), and a compiled shape serves slices whose rows need at least
    1 / `reuse_slack` of its length. Finer and tighter pad less and compile more; where a
    compile takes minutes (a large model on TPU), 2 and 2 compile least."""

    row_rungs: int = 4
    reuse_slack: float = 1.5

    def __post_init__(self):
        bucket(1, 1, self.row_rungs)  # a power of two, or a clear error
        if not self.reuse_slack >= 1:
            raise ValueError(f"reuse_slack must be >= 1, got {self.reuse_slack}")


def bucket(n: int, unit: int, per_octave: int = 2) -> int:
    """The smallest rung >= n of the ladder unit x (1, 2, ..., per_octave, then `per_octave`
    evenly spaced rungs an octave): with 2, unit x (1, 2, 3, 4, 6, 8, 12, 16, 24, ...), rungs at
    most 1.5x apart, so padding wastes at most a third of the work while a run meets only a
    logarithmic number of shapes; with 4, (1, 2, ..., 8, 10, 12, 14, 16, 20, ...), at most 1.25x.
    per_octave: a power of two."""
    if per_octave < 1 or per_octave & (per_octave - 1):
        raise ValueError(f"per_octave must be a power of two, got {per_octave}")
    m = max(1, -(-n // unit))
    if m <= per_octave:
        return unit * m
    step = (1 << (m.bit_length() - 1)) // per_octave
    return unit * step * -(-m // step)


def row_sizes(rows: Sequence[HostRow], config, *, row_len: int,
              row_rungs: int = Ladder.row_rungs) -> dict[str, int]:
    """The sizes one slice of `rows` needs, bucketed: length (at most `row_len`, `row_rungs`
    lengths an octave), targets, patches, window, prefix_window."""
    unit = config.vision_config.spatial_merge_size ** 2
    patches = max((len(r.pixel_values) for r in rows if r.pixel_values is not None), default=0)
    length = min(row_len, bucket(max((r.batch.num_tokens for r in rows), default=1), ROW_UNIT,
                                 row_rungs))
    segments = np.full((max(len(rows), 1), length), -1, np.int32)
    prefix = np.full_like(segments, NO_PREFIX)
    for i, r in enumerate(rows):
        segments[i, :r.batch.num_tokens] = r.batch.seq_ids
        prefix[i, :r.batch.num_tokens] = r.prefix
    windows = attention_windows(segments, prefix)
    window = min(length, bucket(len(windows["key_offsets"]), math.gcd(length, BLOCK)))
    prefix_window = len(windows["prefix_offsets"])
    return {"length": length,
            "targets": bucket(max((len(r.targets) for r in rows), default=1), TARGET_UNIT),
            "patches": bucket(patches, PATCH_UNITS * unit) if patches else 0,
            "window": window,
            "prefix_window": min(length, bucket(prefix_window, PREFIX_UNIT, PREFIX_RUNGS))
            if prefix_window else 0}


def one_shape(slice_cfg, row_len: int) -> dict[str, int] | None:
    """The one slice shape of a run from `config.jax.slice` (targets, patches, window,
    prefix_window; rows `row_len` tokens, a window of 0 = the whole row), or None when
    slice_cfg.targets is 0 (shapes follow the data)."""
    if not slice_cfg.targets:
        return None
    shape = {"length": row_len, "targets": slice_cfg.targets, "patches": slice_cfg.patches,
             "window": slice_cfg.window or row_len, "prefix_window": slice_cfg.prefix_window}
    unit = math.gcd(row_len, BLOCK)
    if shape["window"] > row_len or shape["window"] % unit:
        raise ValueError(f"jax.slice.window={shape['window']} must be a multiple of {unit} and "
                         f"at most the row length {row_len} (train.micro_batch_tokens)")
    return shape


def fit(need: dict[str, int], shape: dict[str, int]) -> dict[str, int]:
    """`shape`, checked to hold a slice that needs `need` (`row_sizes`): a bigger slice is an
    error naming the setting to raise."""
    over = [k for k in SHAPE_KEYS if need[k] > shape[k]]
    if over:
        name = {"length": "train.micro_batch_tokens"}
        raise ValueError("a slice needs " + ", ".join(
            f"{k}={need[k]} > {shape[k]} (raise {name.get(k, 'jax.slice.' + k)})" for k in over))
    return dict(shape)


def slice_sizes(rows: Sequence[HostRow], config, *, rows_per_slice: int, row_len: int,
                row_rungs: int = Ladder.row_rungs) -> list[dict[str, int]]:
    """The sizes (`row_sizes`) of each slice of this process's rows, `rows_per_slice` rows a
    slice in order. Several processes take the maximum of each slice's sizes (the learner
    does, `agree`) before `step_slices`: each then runs as many slices of the same shapes."""
    return [row_sizes(rows[i:i + rows_per_slice], config, row_len=row_len, row_rungs=row_rungs)
            for i in range(0, len(rows), rows_per_slice)]


def agree(sizes: list[dict[str, int]], comm) -> list[dict[str, int]]:
    """Every process's `slice_sizes` made one: as many slices as the process with most, each
    slice's sizes the maximum over processes (a process short of slices pads with empty ones).
    comm: `common.learner.Collectives`."""
    n = int(comm.sum_scalars({"slices": len(sizes)}, max_keys=("slices",))["slices"])
    flat = {f"{i}/{k}": (sizes[i][k] if i < len(sizes) else 0)
            for i in range(n) for k in SHAPE_KEYS}
    flat = comm.sum_scalars(flat, max_keys=tuple(flat))
    return [{k: int(flat[f"{i}/{k}"]) for k in SHAPE_KEYS} for i in range(n)]


def reuse(sizes: dict[str, int], compiled: Sequence[dict[str, int]],
          slack: float = Ladder.reuse_slack) -> dict[str, int]:
    """A slice's `sizes` grown to the smallest shape in `compiled` that holds them (every size
    at least the needed one, rows at most `slack` times the needed length), or unchanged when
    none does. A compile costs seconds on CPU and minutes for a large model on TPU, a padded
    slice only the padding: a run whose long steps come first then compiles once, not once for
    each shorter bucket it meets later."""
    fits = [c for c in compiled if all(c[k] >= sizes[k] for k in SHAPE_KEYS)
            and c["length"] <= slack * sizes["length"]]
    if not fits:
        return dict(sizes)
    best = min(fits, key=lambda c: tuple(c[k] for k in SHAPE_KEYS))
    return dict(sizes, **{k: best[k] for k in SHAPE_KEYS})


def step_slices(rows: Sequence[HostRow], config, *, rows_per_slice: int,
                sizes: Sequence[dict[str, int]], routing: tuple[int, int] | None = None
                ) -> list[dict]:
    """The slices of a step (module docstring), slice i of shape `sizes[i]` (`slice_sizes`, or
    `agree`d: slices past this process's rows are all padding); routing: (L, K) of a learner
    that replays routing (`geo3k_jax.core.batch.assemble`)."""
    groups = [rows[i:i + rows_per_slice] for i in range(0, len(rows), rows_per_slice)]
    if len(groups) > len(sizes):
        raise ValueError(f"{len(groups)} slices for a step of {len(sizes)}")
    groups += [[]] * (len(sizes) - len(groups))
    return [assemble(g, config, n_rows=rows_per_slice, length=s["length"],
                     n_targets=s["targets"], n_patches=s["patches"], min_window=s["window"],
                     min_prefix_window=s["prefix_window"], routing=routing)
            for g, s in zip(groups, sizes)]
