"""Run by tests/test_jax_moe.py with 4 fake CPU devices: the sparse block with its rows mapped
over a (data 2, fsdp 2) mesh against the same block on one device's view. Prints one JSON line.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m tests.jax_moe_worker
"""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from geo3k_jax.core.sharding import BATCH_AXES, make_mesh
from geo3k_jax.kernels.splash import Attention
from tests.test_jax_moe import blocks, text_config


def main() -> None:
    jax.config.update("jax_default_matmul_precision", "highest")
    mesh = make_mesh({"data": 2, "fsdp": 2})
    _, plain = blocks(text_config())
    graphdef, state = nnx.split(plain)
    mapped = nnx.merge(graphdef, state)
    mapped.attention = Attention("splash", mesh, interpret=True)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((4, 64, 48)), jnp.float32)

    def loss(block, x):  # (value, (x's gradient, the weights' gradients))
        def f(state, x):
            y, _ = nnx.merge(nnx.split(block)[0], state)(x)
            return (y * y).sum()
        return jax.value_and_grad(f, argnums=(0, 1))(nnx.state(block), x)
    plain_out = jax.jit(lambda x: loss(plain, x))(x)
    rows = NamedSharding(mesh, P(BATCH_AXES))
    mapped_out = jax.jit(lambda x: loss(mapped, x))(jax.device_put(x, rows))
    found = lambda f: sorted({int(n) for n in re.findall(  # noqa: E731 the (n, hidden) arrays
        r"f32\[(\d+),48\]", jax.jit(f).lower(jax.device_put(x, rows)).compile().as_text())})
    diffs = [float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(a)).max())
             for a, b in zip(jax.tree.leaves(plain_out), jax.tree.leaves(mapped_out))]
    print(json.dumps({"rel": max(diffs), "leaves": len(diffs),
                      "rows": found(lambda x: loss(mapped, x)),
                      "plain_rows": found(lambda x: loss(plain, x))}))


if __name__ == "__main__":
    main()
