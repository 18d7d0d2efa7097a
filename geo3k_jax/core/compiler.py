"""JAX's persistent compilation cache: a later run loads what an earlier one compiled.

    use_compilation_cache("data/jax_cache")   # before the first compile
"""

from __future__ import annotations

import os

import jax


def use_compilation_cache(directory: str) -> None:
    """Keep every compiled executable in JAX's persistent cache in `directory` (by default JAX
    keeps only compiles that took over a second). Call it before the first compile."""
    jax.config.update("jax_compilation_cache_dir", os.path.abspath(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
