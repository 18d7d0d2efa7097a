"""The in-process JAX rollout engine as a `common.engine.Backend` for the JAX learner.

The engine samples from the learner's own parameter arrays (`geo3k_jax.learner.Learner.params`,
in the learner's shardings): `sync` only points the engine at the arrays the last optimizer step
produced, no export and no copy. The learner's step donates its parameter buffers, so rollouts
that run while it trains (`train.max_staleness` >= 1) need weights of their own: with
`own_copy`, `sync` copies the parameters (on device) instead. Either way the engine's kept KV
caches are dropped.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

from geo3k_jax.engine import JaxEngine


class JaxBackend:
    def __init__(self, learner, processor, config, *, seed: int, own_copy: bool = False):
        """learner: a `geo3k_jax.learner.Learner` on one process; config: the transformers
        config of its model."""
        if learner.comm.world != 1:
            raise ValueError("the in-process JAX engine runs on one process: use "
                             "engine.backend=sglang (or torch) for multi-process runs")
        self.own_copy = own_copy
        self.params = None
        self.engine = JaxEngine(learner.merge, lambda: self.params, processor, config,
                                seed=seed, compute_dtype=learner.compute_dtype)
        self.sync(learner, 0)

    def sync(self, learner, step: int) -> None:
        self.params = jax.tree.map(jnp.copy, learner.params) if self.own_copy else \
            learner.params
        self.engine.clear_cache()  # the KV caches were computed with the old weights

    def train_context(self):
        return contextlib.nullcontext()

    def rng_state(self) -> list[int]:
        return self.engine.rng_state()

    def set_rng_state(self, state: list[int]) -> None:
        self.engine.set_rng_state(state)

    def metrics(self) -> dict[str, float]:
        """Counters for the run log: the engine's compilations so far."""
        return {"engine_compiles": float(self.engine.compiles)}

    def close(self) -> None:
        pass
