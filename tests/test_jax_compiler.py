"""The XLA compiler options (geo3k_jax.compiler): taken on CPU, absent elsewhere, dropped when
the XLA refuses them, and results unchanged."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from geo3k_jax import compiler


@pytest.fixture
def fresh_check():
    compiler._cpu_takes_options.cache_clear()
    yield
    compiler._cpu_takes_options.cache_clear()


def test_cpu_gets_the_options_and_other_platforms_none(fresh_check):
    assert compiler.compiler_options("cpu") == compiler.CPU_OPTIONS
    assert compiler.compiler_options() == compiler.CPU_OPTIONS  # the tests run on CPU
    assert compiler.compiler_options("tpu") == {} and compiler.compiler_options("gpu") == {}
    compiler.compiler_options("cpu")["extra"] = "x"  # a caller's copy, not the module's
    assert "extra" not in compiler.compiler_options("cpu")


def test_an_xla_that_refuses_the_option_gets_its_defaults(fresh_check, monkeypatch):
    monkeypatch.setattr(compiler, "CPU_OPTIONS",
                        {"xla_cpu_experimental_ynn_fusion_type": "NOT_A_FUSION_TYPE"})
    assert compiler.compiler_options("cpu") == {}


def test_the_options_change_no_result(fresh_check):
    """RMS statistics and their gradient (the reductions the option takes from YNNPACK) agree
    with the default compile to float rounding."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2048, 128)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(1).standard_normal((128, 96)), jnp.float32)

    def loss(x, w):
        h = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
        return jnp.mean(jax.nn.log_softmax(h @ w, axis=-1) ** 2)

    f = jax.value_and_grad(loss, argnums=(0, 1))
    want = jax.jit(f)(x, w)
    got = jax.jit(f, compiler_options=compiler.compiler_options("cpu"))(x, w)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        b = np.asarray(b)
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-5 * np.abs(b).max())


def test_the_cache_keeps_even_a_fast_compile(tmp_path):
    """A one-add function compiles in milliseconds, far under JAX's default 1 s threshold:
    it is written to the cache all the same, and a second process loads it from there."""
    import subprocess
    import sys
    code = ("import jax, jax.numpy as jnp; from geo3k_jax.compiler import use_compilation_cache; "
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
