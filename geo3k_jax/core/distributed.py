"""The loop's collectives over JAX processes (multi-host TPU slices; one process: trivial).

    jax.distributed.initialize()           # with `jax.distributed=True`, before anything else
    comm = JaxCollectives()                 # rank = jax.process_index(), world = process_count

Objects are pickled and exchanged as padded byte arrays with `multihost_utils.process_allgather`;
scalars travel as float32 (counts below 2**24 are exact, which is what the loop sums).
"""

from __future__ import annotations

import pickle

import jax
import numpy as np
from jax.experimental import multihost_utils


class JaxCollectives:
    """`common.learner.Collectives` over the JAX processes of this run."""

    def __init__(self):
        self.rank, self.world = jax.process_index(), jax.process_count()

    def gather(self, obj) -> list:
        if self.world == 1:
            return [obj]
        data = np.frombuffer(pickle.dumps(obj), np.uint8)
        sizes = multihost_utils.process_allgather(np.int32(len(data)))
        padded = np.zeros(int(np.max(sizes)), np.uint8)
        padded[:len(data)] = data
        parts = multihost_utils.process_allgather(padded)
        return [pickle.loads(parts[i, :int(n)].tobytes()) for i, n in enumerate(sizes)]

    def sum_scalars(self, values: dict[str, float],
                    max_keys: tuple[str, ...] = ()) -> dict[str, float]:
        if self.world == 1:
            return {k: float(v) for k, v in values.items()}
        keys = sorted(values)
        table = multihost_utils.process_allgather(
            np.array([float(values[k]) for k in keys], np.float32))  # (world, len(keys))
        return {k: float(table[:, i].max() if k in max_keys else table[:, i].sum())
                for i, k in enumerate(keys)}

    def barrier(self) -> None:
        if self.world > 1:
            multihost_utils.sync_global_devices("geo3k_barrier")
