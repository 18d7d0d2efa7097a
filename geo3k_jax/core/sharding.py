"""Device mesh and partition rules, both config data (`config.jax` in configs/base.py).

    mesh = make_mesh({"data": 1, "fsdp": -1, "expert": 1, "tensor": 1})   # -1: the rest
    shardings = param_shardings(params, mesh, rules)        # {checkpoint key: NamedSharding}

A rule is (regex, spec): the first regex that `re.search`es a parameter's checkpoint key gives
its PartitionSpec, one mesh axis name (or None) per array dimension; no match = replicated. A
dimension whose size the axis does not divide is left replicated rather than failing, so one rule
set serves every checkpoint shape (the tensor axis on a 2-head vision tower, an odd vocabulary).
Batch rows are split over the data-parallel axes (`BATCH_AXES`): a row carries its own trained
positions and image patches, so each device computes only its rows' log-probs and images. The
`expert` axis shards a mixture of experts' stacked experts (`geo3k_jax.models.moe`) and is a
data-parallel axis for everything else, as in GShard's expert parallelism.

The mesh uses `AxisType.Auto`: the model's code carries no sharding annotations and XLA
propagates the parameter and batch shardings through it (jax.make_mesh's default is Explicit,
which would require an out_sharding on every ambiguous op).
"""

from __future__ import annotations

import math
import re
from typing import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from geo3k_jax.core.batch import REPLICATED_KEYS
from geo3k_jax.core.stacking import is_stacked, layer_key

AXES = ("data", "fsdp", "expert", "tensor")  # tensor last: a tensor group is adjacent devices
BATCH_AXES = ("data", "fsdp", "expert")


def make_mesh(shape: Mapping[str, int], devices: Sequence | None = None) -> jax.sharding.Mesh:
    """A mesh over `devices` (default: all) with axes `AXES` sized by `shape`; one size may be
    -1 (the rest of the devices). Errors if the sizes do not multiply to the device count.
    Over several processes with a tensor axis, each tensor group is devices of one process, in
    process then id order (each host's JAX engine samples on its own devices,
    `geo3k_jax.engine.backend.host_mesh`); `jax.make_mesh` lays the axes along the slice's physical
    links instead, and on a v6e-16 gave a 4-chip tensor group two hosts."""
    devices = list(jax.devices() if devices is None else devices)
    unknown = set(shape) - set(AXES)
    if unknown:
        raise ValueError(f"unknown mesh axes {sorted(unknown)}; axes are {AXES}")
    sizes = [int(shape.get(a, 1)) for a in AXES]
    if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
        raise ValueError(f"mesh sizes must be positive with at most one -1, got {dict(shape)}")
    if -1 in sizes:
        rest = math.prod(s for s in sizes if s != -1)
        if len(devices) % rest:
            raise ValueError(f"{len(devices)} devices do not divide into the mesh {dict(shape)}")
        sizes[sizes.index(-1)] = len(devices) // rest
    if math.prod(sizes) != len(devices):
        raise ValueError(f"mesh {dict(zip(AXES, sizes))} needs {math.prod(sizes)} devices, "
                         f"{len(devices)} are available")
    auto = (AxisType.Auto,) * len(AXES)
    per_process = len(devices) // len({d.process_index for d in devices})
    if sizes[-1] > 1 and per_process < len(devices):
        if per_process % sizes[-1]:
            raise ValueError(f"jax.mesh.tensor={sizes[-1]} does not divide a process's "
                             f"{per_process} devices: keep a tensor group within a host")
        ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
        return jax.sharding.Mesh(np.array(ordered, dtype=object).reshape(sizes), AXES,
                                 axis_types=auto)
    return jax.make_mesh(tuple(sizes), AXES, axis_types=auto, devices=devices)


def spec_for(name: str, shape: tuple[int, ...], mesh, rules: Sequence) -> P:
    """The PartitionSpec of parameter `name` (a checkpoint key) with `shape` under `rules`; a
    stacked decoder key (`geo3k_jax.core.stacking`) as its layers' key, its layer axis unsharded."""
    if is_stacked(name):
        return P(None, *spec_for(layer_key(name, 0), tuple(shape[1:]), mesh, rules))
    for pattern, spec in rules:
        if re.search(pattern, name):
            spec = tuple(spec)
            if len(spec) > len(shape):
                raise ValueError(f"rule {pattern!r} gives {len(spec)} axes for {name!r} of "
                                 f"shape {shape}")
            spec += (None,) * (len(shape) - len(spec))
            return P(*(a if a is None or dim % _axis_size(mesh, a) == 0 else None
                       for a, dim in zip(spec, shape)))
    return P()


def _axis_size(mesh, axes) -> int:
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    return math.prod(mesh.shape[a] for a in names)


def param_shardings(params: Mapping[str, object], mesh, rules: Sequence
                    ) -> dict[str, NamedSharding]:
    """{checkpoint key: NamedSharding} for {checkpoint key: array or ShapeDtypeStruct}."""
    return {name: NamedSharding(mesh, spec_for(name, tuple(v.shape), mesh, rules))
            for name, v in params.items()}


def batch_shardings(mesh, batch: Mapping[str, object],
                    replicated: Sequence[str] = REPLICATED_KEYS, processes: int = 1) -> dict:
    """Shardings of a batch (`geo3k_jax.core.batch`, or a slice of `geo3k_jax.core.buckets`): every
    array's row axis (the first) is split over the data-parallel axes (the row count, times
    `processes` when `batch` is one process's share, must divide), the `replicated` keys are
    copied to every device."""
    n = _axis_size(mesh, BATCH_AXES)
    spec = P(BATCH_AXES if n > 1 else None)

    def one(key, a):
        if key in replicated:
            return NamedSharding(mesh, P())
        if a.shape[0] * processes % n:
            raise ValueError(f"batch {key!r} has {a.shape[0] * processes} rows; the "
                             f"mesh's data axes {BATCH_AXES} need a multiple of {n}")
        return NamedSharding(mesh, spec)
    return {k: jax.tree.map(lambda a, k=k: one(k, a), v) for k, v in batch.items()}
