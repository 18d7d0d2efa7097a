"""What the compiler says about a program, per device: its bytes against a chip's HBM, its flops
and bytes accessed, a roofline bound on its time (`geo3k_jax.aot` for the learner,
`geo3k_jax.tpu.engine_aot` for the engine)."""

from __future__ import annotations

import dataclasses

GiB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class Chip:
    """One TPU chip: the HBM the compiler lets a program use (its own figure, read from its
    "exceeds available HBM" error) and the published peak bf16 flop/s and HBM bandwidth
    (cloud.google.com/tpu/docs/v5p, /v6e, /v5e)."""

    name: str
    hbm: float  # bytes
    peak_flops: float  # bf16 flop/s
    hbm_bandwidth: float  # bytes/s


CHIPS = {  # by the device_kind libtpu reports
    "TPU v5": Chip("v5p", 95.74 * GiB, 459e12, 2765e9),
    "TPU v6 lite": Chip("v6e", 31.25 * GiB, 918e12, 1638e9),
    "TPU v5 lite": Chip("v5e", 15.75 * GiB, 197e12, 819e9),
}


def report(name: str, compiled, chip: Chip, resident: int, seconds: float,
           model_flops: float = 0.0, model_bytes: float = 0.0, model_flops_only: bool = False
           ) -> dict:
    """One program's per-device figures. resident: bytes of the learner's state that stay in
    HBM while it runs without being its arguments (the optimizer state, during a gradient).
    model_flops: the program's model FLOPs per device (`common.flops`): the compiler's own count
    sees one pass of a scanned layer and nothing inside a Pallas kernel, so the roofline takes
    the larger of the two (its bytes accessed are undercounted the same way: the roofline stays
    a lower bound). model_bytes: the bytes the program must read and write per device by the
    model's count (the engine's weights and the KV it reads), taken where larger than the
    compiler's bytes accessed. model_flops_only: the roofline takes the model's FLOPs alone (a
    MoE's gradient: the TPU compiler counts a ragged dot's weight gradient as every group over
    every row, E times its work — 16x on a 16-group ragged dot — where `common.flops` counts the
    active experts)."""
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    out = {"program": name, "argument": mem.argument_size_in_bytes,
           "output": mem.output_size_in_bytes, "alias": mem.alias_size_in_bytes,
           "temp": mem.temp_size_in_bytes, "code": mem.generated_code_size_in_bytes,
           "resident": resident, "flops": float(cost.get("flops", 0.0)),
           "bytes_accessed": float(cost.get("bytes accessed", 0.0)), "compile_s": seconds,
           "model_flops": model_flops, "model_bytes": model_bytes}
    out["peak"] = (out["argument"] + out["output"] - out["alias"] + out["temp"] + out["code"]
                   + resident)
    out["hbm"] = chip.hbm
    out["fits"] = out["peak"] <= chip.hbm
    flops = model_flops if model_flops_only else max(out["flops"], model_flops)
    out["roofline_s"] = max(flops / chip.peak_flops,
                            max(out["bytes_accessed"], model_bytes) / chip.hbm_bandwidth)
    out["bound"] = ("flops" if flops / chip.peak_flops
                    >= max(out["bytes_accessed"], model_bytes) / chip.hbm_bandwidth
                    else "memory")
    return out
