"""The cross-backend numerics check: JAX against torch (transformers) on one checkpoint.

    python -m geo3k_jax.main                                        # the CPU tiny Qwen3-VL
    python -m geo3k_jax.main --config.model.tiny_arch=qwen2_5_vl \\
        --config.model.tiny_dir=data/tiny-qwen2_5_vl-small           # the tiny Qwen2.5-VL
    python -m geo3k_jax.main --config.model.path=/models/Qwen2.5-VL-3B-Instruct
    python -m geo3k_jax.main --config.jax.check.dtype=bfloat16
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m geo3k_jax.main \\
        --config.jax.mesh.data=2 --config.jax.mesh.tensor=2         # sharded on 8 CPU devices

With `model.path` empty the tiny checkpoint of `model.tiny_dir` is used, built first if missing
(as `geo3k_torch.main` does). Prints the table of `geo3k_jax.check.numerics` and exits 1 if any
quantity is outside its tolerance.
"""

from __future__ import annotations

DEFAULT_CONFIG = "configs/cpu.py"


def define_flags(flag_values=None) -> None:
    """`--config`, on `flag_values` (absl's global flags by default)."""
    from absl import flags
    from ml_collections import config_flags
    fv = flags.FLAGS if flag_values is None else flag_values
    config_flags.DEFINE_config_file("config", DEFAULT_CONFIG, "Config file.", lock_config=True,
                                    flag_values=fv)


if __name__ == "__main__":  # --help, a bad --config.<key> or value: answered before jax loads
    from common import cli
    cli.preflight(DEFAULT_CONFIG, define=define_flags)

import sys

import jax
from absl import app, flags

from common.processor import load_processor
from geo3k_jax.check.numerics import print_table, run_check


def main(argv):
    del argv
    from geo3k_torch.prepare import prepare_model_dir

    cfg = flags.FLAGS.config
    # fp32 matmuls must be fp32: XLA on CPU/TPU may otherwise use lower-precision passes.
    jax.config.update("jax_default_matmul_precision", "highest")
    model_dir = prepare_model_dir(cfg)
    rows, info = run_check(cfg, model_dir, load_processor(model_dir))
    mesh = ", ".join(f"{k}={v}" for k, v in cfg.jax.mesh.items())
    print_table(rows, info, f"torch vs JAX, {cfg.jax.check.dtype}: {model_dir} "
                            f"({len(jax.devices())} {jax.devices()[0].platform} devices; {mesh})")
    failed = [r.quantity for r in rows if not r.passed]
    if failed:
        print(f"FAILED: {', '.join(failed)}")
        sys.exit(1)
    print("all checks passed")


if __name__ == "__main__":
    define_flags()
    app.run(main)
