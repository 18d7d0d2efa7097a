"""The seams between the shared training loop and a learner: `Learner` and `Collectives`.

The loop (`common.train`) and the GRPO step (`common.step`) see a learner only through these
protocols, so the torch learner (`geo3k_torch.learner`) and the JAX learner
(`geo3k_jax.learner.learner`) are interchangeable. Every process of a run calls every method, in the
same order: collectives may happen inside.

A learner whose step runs in the background (JAX dispatches a step and returns at once) returns
its metrics as a `Deferred`: reading a value waits for the step, and until then the caller's
own work (the loop's rollout dumps and curve) runs beside it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence

from common.batching import PackedBatch

VISION_PREFIX = "model.visual."  # the vision tower's parameters, its merger included


def is_vision(name: str) -> bool:
    """Whether parameter `name` (as transformers names it) belongs to the vision tower: what
    `train.freeze_vision` leaves untrained in both learners."""
    return name.startswith(VISION_PREFIX)


class Learner(Protocol):
    """One policy under training: its weights, optimizer and schedule."""

    # Whether `export_hf`, `save` and `restore` take an object-store URL (`common.storage`)
    # as well as a local directory.
    remote_checkpoints: bool = False

    def train_step(self, batches: Sequence[PackedBatch], n_tokens: float,
                   n_seqs: float) -> dict[str, float]:
        """One optimizer step on this process's micro-batches (gradient accumulation over
        them); n_tokens / n_seqs count the masked tokens / sequences of the GLOBAL batch. The
        ratio's "old" log-probs are a batch's `old_logprobs`, else the current weights' own.
        Returns the step's metrics over every process: loss, grad_norm, lr, skipped, and the
        token means entropy, clip_frac, approx_kl, logp_diff_mean (kl, tis_mean when on),
        plus logp_diff_max; as a `Deferred` when the step may still be running."""

    def logprobs(self, batches: Sequence[PackedBatch]) -> list:
        """Log-probs of each micro-batch's tokens under the current weights, no gradient:
        one (T,) float32 array per micro-batch, 0 where the loss mask is 0."""

    def export_hf(self, out_dir: Path) -> None:
        """Current weights as a Hugging Face model directory in `out_dir` (every process calls
        it; the torch learner's process 0 writes, the JAX learner's processes a shard each;
        transformers and SGLang load it as it is)."""

    def save(self, directory: Path) -> None:
        """Write the learner's own state (weights, optimizer, schedule) into `directory`,
        which already holds `export_hf`'s files: the state at the call, though the writing
        may go on in the background after it returns (`wait_saved`)."""

    def wait_saved(self) -> None:
        """Return once everything `save` started is on disk."""

    def restore(self, directory: Path) -> None:
        """Continue from what `save` wrote into `directory`."""


class Deferred(Mapping[str, float]):
    """Metrics that may still be computing: scalars `float()` waits for (a JAX step's device
    scalars), from any number of mappings (a `Deferred` among them is not waited for here). The
    first read of a value waits for all of them (`settle`), then `then(floats, waited_s)` may
    add derived values; `waited` is how long that wait took, in seconds."""

    def __init__(self, *parts: Mapping[str, Any],
                 then: Callable[[dict[str, float], float], None] | None = None):
        self._pending: dict[str, Any] = {}
        for part in parts:
            self._pending.update(part.pending() if isinstance(part, Deferred) else part)
        self._floats: dict[str, float] | None = None
        self._then, self.waited = then, 0.0

    def pending(self) -> dict[str, Any]:
        """The values as they are: floats once settled, else what `float()` will wait for."""
        return dict(self._pending if self._floats is None else self._floats)

    def settle(self) -> dict[str, float]:
        """Every value as a float (waiting for them the first time)."""
        if self._floats is None:
            start = time.perf_counter()
            floats = {k: float(v) for k, v in self._pending.items()}
            self.waited = time.perf_counter() - start
            if self._then is not None:
                self._then(floats, self.waited)
            self._floats, self._pending = floats, {}
        return dict(self._floats)

    def __getitem__(self, key: str) -> float:
        return self.settle()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.settle())

    def __len__(self) -> int:
        return len(self.settle())

    def __or__(self, other: Mapping[str, float]) -> dict[str, float]:  # as a dict merges
        return self.settle() | dict(other)

    def __ror__(self, other: Mapping[str, float]) -> dict[str, float]:
        return dict(other) | self.settle()


class Collectives(Protocol):
    """The cross-process operations of the loop: no-ops in a single process."""

    rank: int
    world: int

    def gather(self, obj: Any) -> list:
        """Every process's `obj` (picklable), in rank order, on every process."""

    def sum_scalars(self, values: dict[str, float],
                    max_keys: tuple[str, ...] = ()) -> dict[str, float]:
        """Each value summed over processes (maximum for `max_keys`)."""

    def barrier(self) -> None:
        """Wait until every process gets here."""


class SingleProcess:
    """`Collectives` of a one-process run."""

    rank, world = 0, 1

    def gather(self, obj: Any) -> list:
        return [obj]

    def sum_scalars(self, values: dict[str, float],
                    max_keys: tuple[str, ...] = ()) -> dict[str, float]:
        return {k: float(v) for k, v in values.items()}

    def barrier(self) -> None:
        pass
