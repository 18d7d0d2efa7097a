"""JAX's persistent compilation cache (geo3k_jax.core.compiler): every compile is kept, and a later
process loads it."""

from pathlib import Path

import pytest


@pytest.mark.slow
def test_the_cache_keeps_even_a_fast_compile(tmp_path):
    """A one-add function compiles in milliseconds, far under JAX's default 1 s threshold:
    it is written to the cache all the same, and a second process loads it from there."""
    import subprocess
    import sys
    code = ("import jax, jax.numpy as jnp; "
            "from geo3k_jax.core.compiler import use_compilation_cache; "
            f"use_compilation_cache({str(tmp_path / 'cache')!r}); "
            "print(float(jax.jit(lambda x: x + 1)(jnp.float32(1))))")
    run = lambda: subprocess.run([sys.executable, "-c", code], capture_output=True,  # noqa
                                 text=True, timeout=120, cwd=Path(__file__).parents[1])
    first = run()
    assert first.returncode == 0 and first.stdout.split()[-1] == "2.0", first.stderr
    entries = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert entries  # (with JAX's default threshold the folder stays empty)
    assert run().returncode == 0
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == entries  # loaded, not new
