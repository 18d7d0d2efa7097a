"""XLA compiler options for the learner's compiled functions, per platform.

    jax.jit(fn, compiler_options=compiler_options())

On CPU, XLA (jaxlib 0.10) hands dots and also reductions to YNNPACK library fusions by default,
and those reductions are slow on the learner's shapes: one RMSNorm weight gradient, a (2,048,
128) -> (128,) sum, took 2.4 ms as a YNNPACK fusion. With only dots handed to YNNPACK (XLA's own
loops do the rest) the gradient of a CPU-default row took 62-71 ms instead of 83-89 without the
attention, and a CPU-default run's learner steps a quarter less time (docs/benchmarks.md). The
engine keeps the defaults (its rollouts were within noise either way). Other platforms get
XLA's defaults, as does an XLA that no longer knows the option.

`use_compilation_cache(dir)` keeps every compiled executable in JAX's persistent cache, so a
later run loads what an earlier one compiled.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp

CPU_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"}


def compiler_options(platform: str | None = None) -> dict[str, str]:
    """The options for `platform` (default: JAX's default backend): CPU_OPTIONS on a CPU whose
    XLA takes them, none elsewhere."""
    platform = platform or jax.default_backend()
    return dict(CPU_OPTIONS) if platform == "cpu" and _cpu_takes_options() else {}


@functools.cache
def _cpu_takes_options() -> bool:
    """Whether this XLA compiles with CPU_OPTIONS (one tiny compile, once)."""
    try:
        jax.jit(jnp.negative, compiler_options=CPU_OPTIONS).lower(jnp.zeros(1)).compile()
    except jax.errors.JaxRuntimeError:  # INVALID_ARGUMENT: an option it does not know
        return False
    return True


def use_compilation_cache(directory: str) -> None:
    """JAX's persistent compilation cache in `directory`, for every compile: by default JAX
    keeps only those that took over a second, and the CPU default run's 29 smaller ones (the
    update, the optimizer's init, the engine's helpers) compiled anew in every run (2.1 s,
    against 0.15 s to load them). Call it before the first compile."""
    jax.config.update("jax_compilation_cache_dir", os.path.abspath(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
