"""Device memory between a step's phases, for the learner and the JAX engine on the same chips.

    free = frees_engine(cfg)          # jax.free_engine, where the phases take turns
    notes = check_phases(cfg)         # raises on a jax.offload that cannot work
    state = to_memory(state, HOST)    # the learner's state into host memory, and back

With `train.max_staleness = 0` a step's rollouts, learner step and weight copy take turns, so
what one phase holds need not stay in HBM through the others (`geo3k_jax.aot.budget`):
`jax.free_engine` drops the engine's KV cache and bf16 weights for the learner's step
(`geo3k_jax.engine.backend.JaxBackend.train_context`; the weight copy after the step makes new
weights, the first request a new cache of the same shapes: no compile), and `jax.offload` keeps
the learner's optimizer moments ("moments"), or its whole state ("all": the fp32 parameters and
the KL reference too), in the host's pinned memory while the engine samples (JAX memory kinds:
a `device_put` to `sharding.with_memory_kind("pinned_host")` and back to the learner's own
shardings; on a CPU both kinds are the host's memory, so there it is a copy). Parked
multi-turn sessions never span a learner step (every weight copy forgets them), so freeing
loses nothing.
"""

from __future__ import annotations

import jax

HOST = "pinned_host"
OFFLOADS = ("none", "moments", "all")


def frees_engine(cfg) -> bool:
    """Whether a run of `cfg` frees the JAX engine's cache and weights during the learner's
    step: `jax.free_engine`, the in-process engine, rollouts and training taking turns."""
    return (bool(cfg.jax.free_engine) and cfg.engine.backend == "local"
            and cfg.train.max_staleness == 0)


def check_phases(cfg) -> list[str]:
    """Raise on a `jax.offload` that cannot work for `cfg`; the lines to print about the
    settings it leaves without effect (`jax.free_engine` while rollouts overlap training)."""
    if cfg.jax.offload not in OFFLOADS:
        raise ValueError(f"jax.offload must be one of {', '.join(OFFLOADS)}, got "
                         f"{cfg.jax.offload!r}")
    if cfg.jax.offload != "none" and (cfg.train.max_staleness or cfg.engine.backend != "local"):
        raise ValueError(f"jax.offload={cfg.jax.offload!r} keeps the learner's state in host "
                         "memory while the in-process JAX engine samples, and needs the two to "
                         "take turns: engine.backend=local and train.max_staleness=0 (got "
                         f"{cfg.engine.backend!r} and {cfg.train.max_staleness})")
    if cfg.jax.free_engine and cfg.engine.backend == "local" and cfg.train.max_staleness:
        return [f"jax.free_engine is ignored: with train.max_staleness="
                f"{cfg.train.max_staleness} the JAX engine generates while the learner trains, "
                "so its KV cache and weights stay in device memory (the budget's overlapped "
                "phase)"]
    return []


def offloaded_parts(offload: str) -> tuple[str, ...]:
    """The learner's state parts (`geo3k_jax.aot.learner_parts`' keys) `offload` moves."""
    return {"none": (), "moments": ("moments",),
            "all": ("moments", "params", "reference")}[offload]


def to_memory(tree, kind: str):
    """`tree`'s arrays in memory `kind` ("pinned_host", "device") of their own devices, laid
    out as they are (a copy; the old buffers go when nothing else holds them)."""
    return jax.tree.map(lambda a: jax.device_put(a, a.sharding.with_memory_kind(kind)), tree)
