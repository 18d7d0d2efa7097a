"""Lower the JAX engine's programs at the largest shapes a run gives them, from shapes alone:
the engine's half of `python -m geo3k_jax.aot`'s budget.

The engine is the one a run of `--config` builds beside its learner (`abstract_engine`): bf16
weights in the engine's layout (`geo3k_jax.engine.backend`), the run's attention, on one host's
chips of the slice (each host runs its own engine for `engine.slots` slots of
`rollout.max_context_tokens` tokens). Its programs (`engine_programs`): the prefill at each of the
engine's largest prefill shapes (`JaxEngine.prefill_shapes`: `engine.prefill_rows` rows of
`engine.prefill_tokens`' rung of new tokens, and one row of the whole context), every row
with images (the patches of as many image tokens as it has new tokens) and every slot asking
for a first token; the insert of those rows; the decode reading every page of every slot (its
costliest page table). Every other program of the engine's compile set
(`JaxEngine.compile_set`) has fewer rows, new tokens or pages, so no more memory; how far a
prefill reads the cache is no shape. Nothing runs on a TPU: a compile that fits is no proof of
speed.
"""

from __future__ import annotations

import math
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P


def abstract(tree, sharding):
    """ShapeDtypeStructs of numpy arrays (or structs), all with `sharding`."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
                        tree)


def abstract_engine(cfg, learner, config, memory: int, topology: str = ""):
    """(the `geo3k_jax.engine.engine.JaxEngine` a run of `cfg` builds beside `learner` — an abstract
    `geo3k_jax.aot.abstract_learner` — on one host's chips, its abstract bf16 parameters).
    topology: the slice's (`geo3k_jax.tpu.topology.TOPOLOGIES`); on a slice of several hosts the
    engine is laid on a topology of one host (`geo3k_jax.tpu.topology.one_host`)."""
    from geo3k_jax.engine.backend import engine_mesh, engine_shardings, host_mesh
    from geo3k_jax.engine.engine import JaxEngine
    from geo3k_jax.tpu.topology import one_host

    several = len({d.process_index for d in learner.mesh.devices.flat}) > 1
    host = one_host(host_mesh(learner.mesh), topology) if several and topology else None
    merge, mesh = engine_mesh(learner.merge, learner.params, learner.mesh, several, host)
    sh = engine_shardings(learner.param_sh)
    params = {k: jax.ShapeDtypeStruct(v.shape, jnp.bfloat16,
                                      sharding=NamedSharding(mesh, sh[k].spec))
              for k, v in learner.params.items()}
    engine = JaxEngine(merge, lambda: params, None, config, compute_dtype=jnp.bfloat16,
                       slots=cfg.engine.slots, context=cfg.rollout.max_context_tokens,
                       mesh=mesh, memory=memory, memory_fraction=1.0,
                       prefill_rows=cfg.engine.prefill_rows,
                       prefill_tokens=cfg.engine.prefill_tokens,
                       record_routing=learner.routing is not None)
    return engine, params


def engine_programs(engine, params: dict) -> dict[str, Callable]:
    """{name: a thunk lowering the program}: "prefill" (and "prefill_long", a row of the whole
    context) at `engine.prefill_shapes()` with images (as many patches as image tokens fit);
    "insert" of the largest prefill's rows; "decode" over every page of every slot."""
    from geo3k_jax.engine.kv_budget import allocate
    from geo3k_jax.kernels.ragged import PAGE

    rep = NamedSharding(engine.mesh, P())
    cache = jax.tree.map(
        lambda s, x: jax.ShapeDtypeStruct(x.shape, engine.dtype, sharding=s), engine._shardings,
        jax.eval_shape(lambda: allocate(engine.shape, engine.n_slots, engine.capacity,
                                        engine.dtype)))
    vec = lambda n, dt: np.zeros(n, dt)  # noqa: E731

    def prefill_args(rows, new_tokens):
        work = engine._dummy_work(rows, new_tokens, images=True)
        return abstract(engine._prefill_args(work, [], [], []), rep)

    def prefill(rows, new_tokens):
        return lambda: engine._prefill.lower(params, cache, *prefill_args(rows, new_tokens))

    shapes = engine.prefill_shapes()
    programs = {"prefill": prefill(*shapes[0])}
    if len(shapes) > 1:
        programs["prefill_long"] = prefill(*shapes[1])
    rows, tokens = shapes[0]
    work = jax.eval_shape(lambda *a: engine._prefill_fn(*a)[2], params, cache,
                          *prefill_args(rows, tokens))
    programs["insert"] = lambda: engine._insert.lower(cache, abstract(work, rep), *abstract(
        (vec(engine.n_slots, np.int32), vec(engine.n_slots, np.int32), vec(rows, np.int32)),
        rep))
    shards = engine._data_shards
    table = None if engine.kernel else abstract(  # the Pallas kernel needs none
        np.zeros((shards, engine.n_slots // shards * engine.capacity // PAGE), np.int32), rep)
    programs["decode"] = lambda: engine._decode.lower(
        params, cache, abstract(engine._decode_arrays(), rep), table,
        abstract(vec(2, np.uint32), rep))
    return programs


def model_costs(engine, config, weights: int) -> dict[str, tuple[float, float]]:
    """{program: (model FLOPs, model bytes) per device} at `engine_programs`' shapes: what the
    model's matrix products (`common.flops`) and its reads of the weights (`weights` bytes a
    device) and of the KV cache cost at least, each program's rows split over the devices.
    A prefill's rows attend over a whole context each (the cached prefix and their own new
    tokens, causally), its images counted as one merged token's patches each (their
    attention left out: a lower bound, whatever the images); the decode is per call, its
    `DECODE_CHUNK` steps each reading the weights and every slot's whole context (a slot's
    own pages at most: the decode's costliest page table)."""
    from common.flops import image_flops, text_flops
    from geo3k_jax.engine.engine import DECODE_CHUNK

    devices = engine.mesh.devices.size
    kv_token = engine.shape.bytes(1, 1, engine.dtype)  # keys and values of a token, all layers
    m2 = engine.merge_size ** 2
    n = engine.capacity

    def prefill(rows, new):
        flops = (text_flops(config, rows * new, rows, rows * new * (n - new + (new + 1) / 2))
                 + rows * new * image_flops(config, m2))
        return flops / devices, weights + rows * n * kv_token / devices

    shapes = engine.prefill_shapes()
    out = {"prefill": prefill(*shapes[0]), "insert": (0.0, 0.0)}
    if len(shapes) > 1:
        out["prefill_long"] = prefill(*shapes[1])
    slots = engine.n_slots
    step = text_flops(config, slots, slots, slots * n) / devices
    out["decode"] = (DECODE_CHUNK * step, DECODE_CHUNK * (weights + engine.cache_bytes))
    return out


def weight_bytes(params: dict) -> int:
    """Bytes one device holds of the engine's abstract weights."""
    return int(sum(math.prod(p.sharding.shard_shape(p.shape)) * np.dtype(p.dtype).itemsize
                   for p in params.values()))


def compile_engine(cfg, learner, config, chip, names=None, topology: str = "") -> dict:
    """The engine's programs (`names`, default all) compiled for the learner's chips (a host's
    of `topology`, `abstract_engine`): their `geo3k_jax.aot.report`s (the cache and weights are
    arguments of each) and what stays resident between them (weights, cache), per device;
    each with its model FLOPs and bytes (`model_costs`) in its roofline. The decode's figures
    are per call: `decode_steps` steps."""
    from geo3k_jax.tpu.compiled import report
    from geo3k_jax.engine.engine import DECODE_CHUNK

    engine, params = abstract_engine(cfg, learner, config, memory=2 ** 62, topology=topology)
    programs = engine_programs(engine, params)
    unknown = set(names or ()) - set(programs)
    if unknown:
        raise SystemExit(f"no engine program {sorted(unknown)}: the programs are "
                         f"{', '.join(programs)}")
    costs = model_costs(engine, config, weight_bytes(params))
    out = []
    for name in names or programs:
        t0 = time.perf_counter()
        try:
            compiled = programs[name]().compile()
        except jax.errors.JaxRuntimeError as e:  # the TPU compiler's own refusal or failure
            out.append({"program": name, "refused": str(e).splitlines()[0][:300], "fits": False,
                        "compile_s": time.perf_counter() - t0})
            continue
        out.append(report(name, compiled, chip, 0, time.perf_counter() - t0, *costs[name]))
    return {"slots": engine.n_slots, "context": engine.capacity, "data_shards": engine._data_shards,
            "devices": engine.mesh.devices.size, "prefill_shapes": engine.prefill_shapes(),
            "compile_set": len(engine.compile_set()), "decode_steps": DECODE_CHUNK,
            "weights": weight_bytes(params), "cache": int(engine.cache_bytes), "programs": out}
