"""Deterministic, resumable prompt order: a fresh seeded permutation every epoch.

The state is two integers (epoch, position), saved in checkpoints so that a resumed run draws
exactly the prompts the uninterrupted run would have drawn. Several processes each sample their
own share of the data with their own `stream` (the process index).
"""

from __future__ import annotations

import numpy as np


class PromptSampler:
    """Yields batches of dataset indices; epoch e is permutation(seed, e) of range(n) (stream
    s > 0: permutation(seed, e, s))."""

    def __init__(self, n: int, seed: int, epoch: int = 0, position: int = 0, stream: int = 0):
        if n < 1:
            raise ValueError("cannot sample from an empty dataset")
        self.n, self.seed, self.epoch, self.position = n, seed, epoch, position
        self.stream = stream
        self._order = self._permutation(epoch)

    def _permutation(self, epoch: int) -> np.ndarray:
        key = [self.seed, epoch] + ([self.stream] if self.stream else [])
        return np.random.default_rng(key).permutation(self.n)

    def next_batch(self, size: int) -> list[int]:
        """`size` indices; an epoch boundary inside a batch continues with the next epoch."""
        out = []
        while len(out) < size:
            if self.position == self.n:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            take = min(size - len(out), self.n - self.position)
            out.extend(int(i) for i in self._order[self.position:self.position + take])
            self.position += take
        return out

    def state(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "n": self.n, "seed": self.seed,
                "stream": self.stream}

    @classmethod
    def from_state(cls, state: dict) -> "PromptSampler":
        return cls(state["n"], state["seed"], state["epoch"], state["position"],
                   state.get("stream", 0))

    @classmethod
    def of_process(cls, saved: list | dict, rank: int) -> "PromptSampler":
        """Process `rank`'s sampler from a checkpoint's states (one per process; a single
        state, as checkpoints written before the data was sharded hold, is process 0's)."""
        states = [saved] if isinstance(saved, dict) else saved
        if not 0 <= rank < len(states):
            raise ValueError(f"the checkpoint holds {len(states)} processes' prompt samplers; "
                             f"this is process {rank}")
        return cls.from_state(states[rank])
