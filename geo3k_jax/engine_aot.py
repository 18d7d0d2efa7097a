"""Compile the JAX engine's prefill, insert and decode for a TPU slice from shapes alone.

    python -m geo3k_jax.engine_aot --topology=v5p:2x2x1 --shapes=qwen3_vl_2b --slots=128 \
        --context=8192

The TPU compiler (libtpu) builds the engine's three programs for the chips of `--topology`,
with the parameters built abstractly (bf16, the engine's layout: `geo3k_jax.backend`) from a
published model config (`configs/models`), the cache sharded as the engine shards it
(`geo3k_jax.kv_budget`), and the shapes of the recipe's rollout: `--slots` decode slots of
`--context` tokens (decode reading every page of every slot: its costliest page table), a
prefill of `--rows` work rows of `--new-tokens` tokens with one image of `--patches` patches
each, inserted into `--rows` x 8 slots (a group's 8 episodes share a prompt row). Prints one JSON line per program:
per-device bytes of arguments, outputs, temporaries, the cache's share, against the chip's HBM.
Nothing runs on a TPU: a compile that fits is no proof of speed.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # this host's devices: never probe for a TPU
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import json  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

_TOPOLOGY = flags.DEFINE_string("topology", "v5p:2x2x1", "libtpu topology (v5p-8: v5p:2x2x1)")
_SHAPES = flags.DEFINE_string("shapes", "qwen3_vl_2b", "A configs/models name.")
_SLOTS = flags.DEFINE_integer("slots", 128, "Decode slots.")
_CONTEXT = flags.DEFINE_integer("context", 8192, "Tokens a slot holds.")
_ROWS = flags.DEFINE_integer("rows", 32, "Prefill work rows.")
_NEW = flags.DEFINE_integer("new_tokens", 512, "Prefill new tokens per row.")
_PATCHES = flags.DEFINE_integer("patches", 1024, "Image patches per row.")
_PROGRAMS = flags.DEFINE_list("programs", ["prefill", "insert", "decode"],
                              "Which programs to compile (the prefill takes the longest).")

GiB = 2 ** 30
HBM = {"TPU v5": 95.74 * GiB}  # v5p: what the compiler lets a program use


def abstract(tree, sharding):
    """ShapeDtypeStructs of numpy arrays (or structs), all with `sharding`."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
                        tree)


def compile_engine(config, devices, slots, context, rows, new_tokens, patches,
                   names=("prefill", "insert", "decode")) -> list[dict]:
    """The engine's programs `names` (of prefill, insert, decode) compiled for `devices`; one
    report per program."""
    from configs.base import JAX_RULES
    from geo3k_jax.backend import engine_shardings
    from geo3k_jax.batch import pad_patches
    from geo3k_jax.engine import DECODE_CHUNK, MAX_STOPS, JaxEngine
    from geo3k_jax.model import QwenVL, split_params
    from geo3k_jax.ragged import PAGE
    from geo3k_jax.sharding import make_mesh, param_shardings

    mesh = make_mesh({"data": 1, "fsdp": -1, "tensor": 1}, devices)
    merge, shapes = split_params(nnx.eval_shape(
        lambda: QwenVL(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))))
    sh = engine_shardings(param_shardings(shapes, mesh, JAX_RULES))
    params = {k: jax.ShapeDtypeStruct(v.shape, jnp.bfloat16, sharding=sh[k])
              for k, v in shapes.items()}
    hbm = HBM.get(devices[0].device_kind, 16 * GiB)
    engine = JaxEngine(merge, lambda: params, None, config, compute_dtype=jnp.bfloat16,
                       slots=slots, context=context, mesh=mesh, memory=int(hbm))
    rep = NamedSharding(mesh, P())
    cache = jax.tree.map(lambda s, x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16, sharding=s),
                         engine._shardings, jax.eval_shape(lambda: _zeros(engine)))
    requests = min(slots, rows * 8)
    one = pad_patches(None, config, patches, new_tokens)
    batch = {"input_ids": np.zeros((rows, new_tokens), np.int32),
             "positions": np.zeros((rows, 3, new_tokens), np.int32),
             "count": np.ones(rows, np.int32),
             "pixel_values": np.zeros((rows,) + one["pixel_values"].shape, np.float32),
             "visual_index": np.zeros((rows,) + one["visual_index"].shape, np.int32),
             "vision": {k: np.zeros((rows,) + v.shape, v.dtype)
                        for k, v in one["vision"].items()}}
    vec = lambda n, dt: np.zeros(n, dt)  # noqa: E731
    sampling = (vec(requests, np.float32), vec(requests, np.float32))
    prefill_args = abstract((vec(rows, np.int32), vec(rows, np.int32), batch,
                             vec(requests, np.int32), sampling, vec(requests, np.uint32),
                             vec(2, np.uint32)), rep)
    bound = min(engine.capacity, new_tokens)
    work = jax.eval_shape(lambda c: tuple((k[:rows, :bound], v[:rows, :bound])
                                          for k, v in c), cache)
    work = abstract(work, rep)
    state = {k: vec(slots, dt) for k, dt in (
        ("tok", np.int32), ("pos", np.int32), ("length", np.int32), ("live", bool),
        ("count", np.int32), ("budget", np.int32), ("temperature", np.float32),
        ("top_p", np.float32), ("seed", np.uint32))}
    state["stops"] = np.zeros((slots, MAX_STOPS), np.int32)
    shards = engine._data_shards
    full_table = np.zeros((shards, slots // shards * engine.capacity // PAGE), np.int32)
    programs = {
        "prefill": lambda: engine._prefill.lower(params, cache, *prefill_args, bound=bound,
                                                 nucleus=False),
        "insert": lambda: engine._insert.lower(cache, work, *abstract(
            (vec(requests, np.int32), vec(requests, np.int32)), rep)),
        "decode": lambda: engine._decode.lower(params, cache, abstract(state, rep),
                                               abstract(full_table, rep),
                                               abstract(vec(2, np.uint32), rep),
                                               nucleus=False)}
    cache_bytes = engine.cache_bytes
    weight_bytes = sum(np.prod(p.sharding.shard_shape(p.shape)) * 2 for p in params.values())
    out = []
    unknown = set(names) - set(programs)
    if unknown:
        raise ValueError(f"no engine program {sorted(unknown)}: the programs are "
                         f"{', '.join(programs)}")
    for name in names:
        lower = programs[name]
        t0 = time.perf_counter()
        try:
            mem = lower().compile().memory_analysis()
        except jax.errors.JaxRuntimeError as e:  # the TPU compiler's own refusal or failure
            out.append({"program": name, "failed": str(e).splitlines()[0][:300],
                        "compile_s": round(time.perf_counter() - t0, 1)})
            continue
        peak = (mem.argument_size_in_bytes + mem.output_size_in_bytes
                - mem.alias_size_in_bytes + mem.temp_size_in_bytes)
        out.append({"program": name, "devices": len(devices), "slots": slots,
                    "context": engine.capacity, "rows": rows, "decode_chunk": DECODE_CHUNK,
                    "cache_gib_per_device": round(cache_bytes / GiB, 2),
                    "weights_gib_per_device": round(float(weight_bytes) / GiB, 2),
                    "argument_gib": round(mem.argument_size_in_bytes / GiB, 2),
                    "output_gib": round(mem.output_size_in_bytes / GiB, 2),
                    "alias_gib": round(mem.alias_size_in_bytes / GiB, 2),
                    "temp_gib": round(mem.temp_size_in_bytes / GiB, 2),
                    "peak_gib": round(peak / GiB, 2), "hbm_gib": round(hbm / GiB, 2),
                    "fits": bool(peak <= hbm),
                    "compile_s": round(time.perf_counter() - t0, 1)})
    return out


def _zeros(engine):
    from geo3k_jax.kv_budget import allocate
    return allocate(engine.shape, engine.n_slots, engine.capacity, jnp.bfloat16)


def main(_):
    from jax.experimental import topologies
    from transformers import AutoConfig

    from configs.models import write_config_dir
    devices = list(topologies.get_topology_desc(platform="tpu",
                                                topology_name=_TOPOLOGY.value).devices)
    with tempfile.TemporaryDirectory() as d:
        config = AutoConfig.from_pretrained(str(write_config_dir(_SHAPES.value, d)))
    for report in compile_engine(config, devices, _SLOTS.value, _CONTEXT.value, _ROWS.value,
                                 _NEW.value, _PATCHES.value, _PROGRAMS.value):
        print(json.dumps(report), flush=True)


if __name__ == "__main__":
    app.run(main)
