"""Deterministic, resumable prompt order: a fresh seeded permutation every epoch, the same
whatever the number of processes.

The state is two integers (epoch, position), saved in checkpoints so that a resumed run draws
exactly the prompts the uninterrupted run would have drawn. With several processes every one
walks the same order and takes its own part of each global batch: together they draw what one
process drawing the whole batch would, so a run's data order does not depend on how many
processes run it.
"""

from __future__ import annotations

import numpy as np


class PromptSampler:
    """Yields batches of dataset indices; epoch e is permutation(seed, e) of range(n). Process
    `rank` of `world` gets part `rank` of each batch of `world` parts (`next_batch`)."""

    def __init__(self, n: int, seed: int, epoch: int = 0, position: int = 0, rank: int = 0,
                 world: int = 1):
        if n < 1:
            raise ValueError("cannot sample from an empty dataset")
        if not 0 <= rank < world:
            raise ValueError(f"process {rank} of {world}: the rank must be in [0, world)")
        self.n, self.seed, self.epoch, self.position = n, seed, epoch, position
        self.rank, self.world = rank, world
        self._order = self._permutation(epoch)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.n)

    def next_batch(self, size: int) -> list[int]:
        """This process's `size` indices: part `rank` of the next `size * world` of the order
        (an epoch boundary inside a batch continues with the next epoch)."""
        out = []
        while len(out) < size * self.world:
            if self.position == self.n:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            take = min(size * self.world - len(out), self.n - self.position)
            out.extend(int(i) for i in self._order[self.position:self.position + take])
            self.position += take
        return out[self.rank * size:(self.rank + 1) * size]

    def state(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "n": self.n, "seed": self.seed,
                "rank": self.rank, "world": self.world}

    @classmethod
    def from_state(cls, state: dict) -> "PromptSampler":
        return cls(state["n"], state["seed"], state["epoch"], state["position"],
                   state.get("rank", 0), state.get("world", 1))

    @classmethod
    def of_process(cls, saved: list | dict, rank: int, world: int = 1,
                   n: int | None = None) -> "PromptSampler":
        """Process `rank`'s sampler (of `world`) from a checkpoint's states (one per process; a
        single state, as one-process checkpoints of before the states were listed hold, is
        process 0's). Raises ValueError for another number of processes, for a training split
        of another size than `n` (given), and for the states of a multi-process run from
        before the shared order (each process had a stream of its own over its own rows: that
        order cannot be continued)."""
        states = [saved] if isinstance(saved, dict) else saved
        if len(states) != world:
            raise ValueError(f"the checkpoint holds {len(states)} processes' prompt samplers; "
                             f"this run has {world}")
        if world > 1 and "world" not in states[rank]:
            raise ValueError("the checkpoint's prompt samplers are per-process streams over each "
                             "process's own rows (written before every process shared one order): "
                             "resume it with the code that wrote it, or start a fresh run")
        if n is not None and states[rank]["n"] != n:
            raise ValueError(f"the checkpoint's prompt order is over {states[rank]['n']} training "
                             f"problems; this run's training split has {n}")
        return cls.from_state(states[rank])
