"""The in-process JAX rollout engine as a `common.engine.Backend` for the JAX learner.

The engine samples from its own copy of the learner's parameters, made in device memory at
every `sync` (no export, no host copy): cast to the learner's compute dtype (bf16 on
accelerators) and laid out for decoding, each weight split over the mesh's tensor axis as the
learner splits it and replicated over the data axes (`engine_shardings`: a decode step reads
every weight, so none is gathered per step as the learner's FSDP layout would need). The
engine's KV cache is its own too (`geo3k_jax.kv_budget`). Every sync drops the parked caches
and gives the engine the step as its weights' version (a part of every request's key).
"""

from __future__ import annotations

import contextlib

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from geo3k_jax.engine import JaxEngine


def engine_shardings(param_sh: dict | None) -> dict | None:
    """The learner's {key: NamedSharding} with only the tensor axis kept (None: one device)."""
    if param_sh is None:
        return None
    keep = lambda a: a if a == "tensor" or a == ("tensor",) else None  # noqa: E731
    return {k: NamedSharding(s.mesh, P(*(keep(a) for a in s.spec)))
            for k, s in param_sh.items()}


class JaxBackend:
    def __init__(self, learner, processor, config, *, seed: int, slots: int = 8,
                 context: int = 1024, memory_fraction: float = 0.9):
        """learner: a `geo3k_jax.learner.Learner` on one process; config: the transformers
        config of its model; slots, context, memory_fraction: `JaxEngine`'s."""
        if learner.comm.world != 1:
            raise ValueError("the in-process JAX engine runs on one process: use "
                             "engine.backend=sglang (or torch) for multi-process runs")
        dtype = learner.compute_dtype
        shardings = engine_shardings(getattr(learner, "param_sh", None))
        self._copy = jax.jit(lambda p: jax.tree.map(
            lambda a: a if dtype is None else a.astype(dtype), p), out_shardings=shardings)
        self.params = self._copy(learner.params)
        self.engine = JaxEngine(learner.merge, lambda: self.params, processor, config,
                                seed=seed, compute_dtype=dtype, slots=slots, context=context,
                                mesh=learner.mesh, memory_fraction=memory_fraction)

    def sync(self, learner, step: int) -> None:
        # a copy in device memory: the learner's next step donates its own buffers, and
        # rollouts may run while it trains (train.max_staleness >= 1)
        self.params = self._copy(learner.params)
        self.engine.clear_cache(step)  # the KV caches were computed with the old weights

    def train_context(self):
        return contextlib.nullcontext()

    def rng_state(self) -> list[int]:
        return self.engine.rng_state()

    def set_rng_state(self, state: list[int]) -> None:
        self.engine.set_rng_state(state)

    def metrics(self) -> dict[str, float]:
        """Counters for the run log: the engine's compilations and evicted sessions so far."""
        return {"engine_compiles": float(self.engine.compiles),
                "engine_evictions": float(self.engine.evictions)}

    def close(self) -> None:
        self.engine.close()
