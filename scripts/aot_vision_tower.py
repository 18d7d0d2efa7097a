"""Compile a vision tower's forward + backward for one TPU chip on a CPU host (libtpu, no TPU):
what scanning its blocks changes, measured by the compiler (docs/tpu.md).

    python scripts/aot_vision_tower.py --shapes=qwen3_vl_2b --topology=v5p-8 --patches=2048

`--shapes`: a name in configs/models or a directory with a config.json. Parameters are abstract
bf16 on one chip of `--topology`; one image of `--patches` patches (a square-ish grid); splash
attention and remat as `configs/tpu.py` runs them. Prints compile seconds, TFLOPs, bytes
accessed, temporaries, outputs (the
gradients) and code bytes.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from geo3k_jax.aot import model_config, topology_devices  # noqa: E402
from geo3k_jax.kernels.splash import Attention  # noqa: E402
from geo3k_jax.models.vision import build_vision_tower  # noqa: E402
from geo3k_jax.core.vision_grid import vision_aux  # noqa: E402
from geo3k_jax.models.model import split_params  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen3_vl_2b")
    ap.add_argument("--topology", default="v5p-8")
    ap.add_argument("--patches", type=int, default=2048)
    args = ap.parse_args()
    vcfg = model_config(args.shapes).vision_config
    mesh = Mesh(np.array(topology_devices(args.topology)[:1]), ("x",))
    one = NamedSharding(mesh, P())
    tower = nnx.eval_shape(lambda: build_vision_tower(
        vcfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), attention=Attention("splash", mesh)))
    merge, params = split_params(tower)
    params = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=one) for k, v in params.items()}
    unit = 2 * vcfg.spatial_merge_size  # rows and columns in whole merge groups
    rows = unit * max(1, round((args.patches ** 0.5) / unit))
    grid = np.array([[1, rows, args.patches // rows // unit * unit]])
    aux = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=one)
           for k, v in vision_aux(vcfg, grid).items()}
    width = vcfg.in_channels * vcfg.temporal_patch_size * vcfg.patch_size ** 2
    pixels = jax.ShapeDtypeStruct((int(grid.prod()), width), jnp.float32, sharding=one)

    def loss(p, x, a):
        embeds, deepstack = merge(p)(x, a, remat=True)
        return sum(jnp.sum(f.astype(jnp.float32)) for f in [embeds, *deepstack])

    start = time.perf_counter()
    compiled = jax.jit(jax.grad(loss)).lower(params, pixels, aux).compile()
    seconds = time.perf_counter() - start
    cost, mem = compiled.cost_analysis(), compiled.memory_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    print(f"{args.shapes} vision tower, {int(grid.prod())} patches, {args.topology} one chip: "
          f"compile {seconds:.1f} s, {cost.get('flops', 0) / 1e12:.3f} TFLOP, "
          f"{cost.get('bytes accessed', 0) / 1e9:.2f} GB accessed, temporaries "
          f"{mem.temp_size_in_bytes / 2**30:.3f} GiB, outputs "
          f"{mem.output_size_in_bytes / 2**30:.3f} GiB, code "
          f"{mem.generated_code_size_in_bytes / 2**20:.2f} MiB", flush=True)


if __name__ == "__main__":
    main()
