"""One JAX process of a 2-process CPU training run (gloo) through the shared loop, for
tests/test_jax_train.py and tests/test_tpu_recipe.py: each process reads its share of the data,
samples with its own JAX engine on its own device and trains on an fsdp=2 mesh; process 0
writes the run log. RECIPE: `small` (the tests' small config, fp32) or `tpu` (configs/tpu.py:cpu,
the TPU recipe's structure: bf16 compute, remat, one slice shape, the JAX engine). WORLD 1: the
same run in one process (on 2 devices, given XLA_FLAGS), into OUT_DIR/run1. DTYPE: the `tpu`
recipe's `jax.compute_dtype` (bfloat16 unless given); another than bfloat16 names the run's
folder, OUT_DIR/run-float32 or OUT_DIR/run1-float32.

    python -m tests.jax_loop_worker PROCESS_ID PORT OUT_DIR [RECIPE [WORLD [DTYPE]]]
"""

import sys
from pathlib import Path

import jax


def main(pid: int, port: int, out: str, recipe: str = "small", world: str = "2",
         dtype: str = "bfloat16") -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                               num_processes=int(world), process_id=pid)
    from common import train as loop
    from geo3k_jax.train import build
    from tests.test_jax_train import jax_config

    if recipe == "tpu":
        from tests.test_tpu_recipe import recipe_config
        cfg = recipe_config(Path(out) / "shared")
        cfg.jax.compute_dtype = dtype
    else:
        cfg = jax_config(Path(out) / "shared", 3)
        cfg.jax.mesh = {"data": 1, "fsdp": 2, "tensor": 1}
        cfg.engine.slots = 8
    cfg.eval.max_prompts = 3  # uneven: rows 0 and 2 on process 0, row 1 on process 1
    name = "run" if world == "2" else f"run{world}"
    workdir = str(Path(out) / (name if dtype == "bfloat16" else f"{name}-{dtype}"))
    loop.train(cfg, workdir, build(cfg, workdir))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], *sys.argv[4:])
