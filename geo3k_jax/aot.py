"""Compile a run's learner and engine for a TPU slice on a host without one, from shapes alone,
and hold what they take together against each chip's HBM.

    python -m geo3k_jax.aot --config=configs/tpu.py --topology=v5p-8 --shapes=qwen3_vl_2b

The TPU compiler (libtpu, a test requirement: `pip install libtpu==0.0.42`) builds the step's
two programs for the chips of `--topology` — one slice's gradient added into the accumulator,
and the update — with the parameters built abstractly from a model's published config
(`configs/models`, or a checkpoint directory's config.json: no weights), the mesh and partition
rules of `--config`, and one slice of its one shape (`config.jax.slice`, one row per
data-parallel device); with `engine.backend=local` also the JAX engine's programs on the same
chips at their largest shapes (`geo3k_jax.tpu.engine_aot`). It prints, per device, the bytes of each
program's arguments, outputs, temporaries and code, the compiler's flops and bytes accessed and
a roofline bound on the program's time (max of flops / peak and bytes / bandwidth), then the
run's budget (`budget`): each phase of a step — rollout, weight copy, training, and both at once
when rollouts overlap training — as the peak of the program running plus what the other side
keeps resident (nothing of the engine's during training with `jax.free_engine`, less the
learner's moments during rollouts with `jax.offload`: `geo3k_jax.learner.phases`), the largest
against the chip's HBM, and the engine slots that would fit. The engine's programs carry the model's
FLOPs and bytes (`geo3k_jax.tpu.engine_aot.model_costs`) in their roofline: a decode step reads
every weight and its slots' keys for little arithmetic, so it is bound by the HBM's bandwidth. Exits 1
when it does not fit; a run with `jax.hbm_check` refuses to start on the same numbers
(`check_run`). Nothing runs on a TPU: a compile that fits is no proof of speed.

This is MaxText's `train_compile` pattern. The figures in docs/tpu.md come from this command.
"""

from __future__ import annotations

import os

DEFAULT_CONFIG = "configs/tpu.py"
PROGRAMS_HELP = "the engine's programs to compile"


def define_flags(flag_values, programs_help: str = PROGRAMS_HELP) -> None:
    """This command's flags (and `geo3k_jax.tpu.engine_aot`'s) on `flag_values`; imports no jax
    (--help lists them before it loads)."""
    from absl import flags
    from ml_collections import config_flags

    from geo3k_jax.tpu.topology import TOPOLOGIES
    fv = flag_values
    config_flags.DEFINE_config_file("config", DEFAULT_CONFIG, "a geo3k-rl config file",
                                    flag_values=fv)
    flags.DEFINE_string("topology", "v5p-8", f"one of {', '.join(TOPOLOGIES)} or a libtpu "
                        "topology (v5p:2x2x1)", flag_values=fv)
    flags.DEFINE_string("shapes", "qwen3_vl_2b", "configs/models name or a checkpoint directory",
                        flag_values=fv)
    flags.DEFINE_string("json", "", "also write the report here", flag_values=fv)
    flags.DEFINE_list("programs", [], programs_help + " (empty: all)", flag_values=fv)
    flags.DEFINE_bool("engine_only", False, "compile the JAX engine's programs alone, not the "
                      "learner's (no budget: the engine's own table)", flag_values=fv)


if __name__ == "__main__":  # the command, not a run that imports the budget
    from common import cli
    cli.preflight(DEFAULT_CONFIG, define=define_flags)  # --help, a bad --config: before jax
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # this host's devices: never probe for a TPU
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # libtpu locks /tmp otherwise

import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from common.flops import row_flops  # noqa: E402
from geo3k_jax.tpu.compiled import CHIPS, GiB, Chip, report  # noqa: E402,F401 (re-exported)
from geo3k_jax.models.layers import remat_of  # noqa: E402
from geo3k_jax.learner.phases import frees_engine, offloaded_parts  # noqa: E402
from geo3k_jax.kernels.splash import resolve_attention  # noqa: E402
from geo3k_jax.tpu.topology import TOPOLOGIES, topology_devices  # noqa: E402,F401 (re-exported)


def model_config(shapes: str):
    """The transformers config of `shapes`: a name in configs/models or a directory with a
    config.json."""
    from transformers import AutoConfig

    from configs.models import NAMES, write_config_dir
    if shapes in NAMES:
        with tempfile.TemporaryDirectory() as d:
            return AutoConfig.from_pretrained(str(write_config_dir(shapes, d)))
    if not (Path(shapes) / "config.json").is_file():
        raise SystemExit(f"--shapes={shapes!r}: name one of {', '.join(NAMES)} or a directory "
                         "holding a config.json")
    return AutoConfig.from_pretrained(shapes)


def abstract_learner(cfg, config, devices):
    """A `geo3k_jax.learner.learner.Learner` of shapes alone (no weights) on a mesh of `devices`."""
    from common.grpo import LossConfig
    from configs import to_dataclass
    from geo3k_jax.core.buckets import one_shape
    from geo3k_jax.learner.learner import Learner
    from geo3k_jax.models.model import QwenVL, split_params
    from geo3k_jax.core.sharding import make_mesh
    from geo3k_jax.learner.learner import DTYPES

    mesh = make_mesh(dict(cfg.jax.mesh), devices)
    attention = resolve_attention(cfg.jax.attention, devices[0].platform, mesh)
    merge, params = split_params(nnx.eval_shape(
        lambda: QwenVL(config, dtype=jnp.float32, rngs=nnx.Rngs(0), attention=attention)))
    loss_cfg = to_dataclass(LossConfig, cfg.loss)
    shape = one_shape(cfg.jax.slice, cfg.train.micro_batch_tokens)
    if shape is None:
        raise SystemExit("the AOT compile needs the run's one slice shape: set "
                         "jax.slice.targets (and patches, window, prefix_window) as "
                         "configs/tpu.py does")
    return Learner(merge, params, loss_cfg, cfg.train, cfg.rollout.temperature, config=config,
                   mesh=mesh, rules=cfg.jax.rules, compute_dtype=DTYPES[cfg.jax.compute_dtype],
                   ref_params=params if loss_cfg.kl_coef else None,
                   chunk=cfg.train.logprob_chunk, remat=remat_of(cfg.jax), shape=shape)


def abstract_slice(learner, config) -> dict:
    """One global slice of the learner's shape: all padding, one row per data-parallel device."""
    from geo3k_jax.core.batch import assemble
    s = learner.shape
    return assemble([], config, n_rows=learner.rows_per_slice, length=s["length"],
                    n_targets=s["targets"], n_patches=s["patches"], min_window=s["window"],
                    min_prefix_window=s["prefix_window"], routing=learner.routing)


def device_bytes(tree) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(tree))


def tpu_chip(devices) -> Chip:
    """The `Chip` of a TPU slice's devices."""
    chip = CHIPS.get(devices[0].device_kind)
    if chip is None:
        raise SystemExit(f"unknown chip {devices[0].device_kind!r}: add it to aot.CHIPS")
    return chip


def compile_step(cfg, topology: str, config) -> dict:
    """Compile the learner's gradient and update for `topology`; their `report`s and the
    run's figures (chips, slice shape, parameter count)."""
    devices = topology_devices(topology)
    chip = tpu_chip(devices)
    return compile_learner(abstract_learner(cfg, config, devices), cfg, config, chip,
                           topology)


def learner_resident(learner) -> int:
    """Bytes one device keeps of the learner's state for the whole run: parameters, optimizer
    state and the KL reference."""
    return sum(device_bytes(t) for t in (learner.params, learner.opt_state, learner.ref_params)
               if t is not None)


def learner_parts(learner) -> dict[str, int]:
    """`learner_resident` by part, bytes per device: "params", "moments" (the optimizer
    state), "reference" (the KL reference; 0 without one)."""
    ref = learner.ref_params
    return {"params": device_bytes(learner.params), "moments": device_bytes(learner.opt_state),
            "reference": device_bytes(ref) if ref is not None else 0}


def offloaded(parts: dict, offload: str) -> int:
    """Bytes per device of the learner's `parts` that `jax.offload` keeps in host memory
    during rollouts (`geo3k_jax.learner.phases.offloaded_parts`)."""
    return sum(parts[k] for k in offloaded_parts(offload))


def compile_offload(learner, offload: str) -> dict:
    """The move of the learner's state that `jax.offload` keeps in host memory during rollouts
    (`geo3k_jax.learner.phases.offloaded_parts`), compiled for its devices: per device, the bytes
    the compiler puts in device memory and in host memory at the move's end (its outputs) and the
    bytes the move takes off the device (its device arguments)."""
    from geo3k_jax.learner.phases import HOST
    parts = offloaded_parts(offload)
    trees = [t for name, t in (("moments", learner.opt_state), ("params", learner.params),
                               ("reference", learner.ref_params))
             if name in parts and t is not None]
    host = jax.tree.map(lambda a: a.sharding.with_memory_kind(HOST), trees)
    t0 = time.perf_counter()
    mem = jax.jit(lambda t: t, out_shardings=host).lower(trees).compile().memory_analysis()
    return {"offload": offload, "device_out": mem.output_size_in_bytes,
            "host_out": mem.host_output_size_in_bytes, "moved": mem.argument_size_in_bytes,
            "compile_s": time.perf_counter() - t0}


def compile_learner(learner, cfg, config, chip: Chip, topology: str = "") -> dict:
    """`learner`'s gradient and update compiled for its mesh (of abstract or real devices):
    their `report`s and the run's figures."""
    devices = list(learner.mesh.devices.flat)
    lowered = learner.lower(abstract_slice(learner, config))
    ref = device_bytes(learner.ref_params) if learner.ref_params is not None else 0
    # what waits in HBM without being the program's argument: the Adam moments during the
    # gradient, the KL reference during the update
    resident = {"grad": device_bytes(learner.opt_state), "apply": ref}
    shape = learner.shape  # one row per data-parallel device; the mesh's devices share the work
    model_flops = {"grad": learner.rows_per_slice * row_flops(
        config, shape["length"], shape["targets"], shape["patches"], shape["window"])
        / len(devices), "apply": 0.0}
    # a MoE's FLOPs are its active weights' (`common.flops`); the compiler counts its ragged
    # dots' weight gradients over every expert (`geo3k_jax.tpu.compiled.report`)
    moe = bool(getattr(config.text_config, "num_experts", 0))
    programs = []
    for name in ("grad", "apply"):
        t0 = time.perf_counter()
        try:
            compiled = lowered[name].compile()
        except jax.errors.JaxRuntimeError as e:  # the compiler's own "exceeds available HBM"
            programs.append({"program": name, "refused": str(e).splitlines()[0], "fits": False,
                             "compile_s": time.perf_counter() - t0})
            continue
        programs.append(report(name, compiled, chip, resident[name], time.perf_counter() - t0,
                               model_flops[name], model_flops_only=moe))
    return {"topology": topology, "chip": chip.name, "devices": len(devices),
            "parts": learner_parts(learner),
            "attention": resolve_attention(cfg.jax.attention, devices[0].platform).kind,
            "params": sum(math.prod(v.shape) for v in learner.params.values()),
            "slice": dict(learner.shape, rows=learner.rows_per_slice), "programs": programs,
            "resident": learner_resident(learner), "fits": all(p["fits"] for p in programs)}


def program_peak(p: dict) -> int:
    """A program's peak bytes per device, without what `report` added as resident."""
    return p["peak"] - p["resident"]


def budget(learner: dict, engine: dict | None, hbm: float, overlap: bool, free: bool = False,
           offload: str = "none") -> dict:
    """One device's bytes in each phase of a step, learner and engine on the same chips.
    learner: `compile_learner`'s report; engine: `geo3k_jax.tpu.engine_aot.compile_engine`'s
    (None: rollouts elsewhere); overlap: rollouts run while the learner trains
    (train.max_staleness >= 1); free: the engine's cache and weights are freed during the
    learner's step (`jax.free_engine`, never with overlap); offload: the learner's state kept
    in host memory during rollouts (`jax.offload`, `offloaded`).

    rollout: the learner's state (parameters, optimizer state, reference; less what is
    offloaded) + the engine's costliest program (its weights and cache are arguments of each);
    weight copy: the learner's state + the new weights, and without `free` the cache and the
    old weights too (the new copy is made before the old one goes); train: the learner's
    costliest program (its optimizer state included), and without `free` the engine's weights
    and cache beside it; overlapped: both costliest programs. Slots that fit: the engine's
    slots scaled by what the phases holding the cache leave over it per slot (the cache grows
    linearly in slots; the decode's gathered pages, a layer's share, come out of what the
    rounding leaves)."""
    refused = [p["program"] for p in learner["programs"] + (engine or {}).get("programs", [])
               if "refused" in p]
    if refused:
        return {"phases": {}, "refused": refused, "hbm": hbm, "fits": False}
    if free and overlap:
        raise ValueError("the engine's memory cannot be freed while it generates during the "
                         "learner's step (train.max_staleness >= 1)")
    lpeak = max(p["peak"] for p in learner["programs"])
    phases, cached = {}, set()  # cached: the phases that hold the engine's cache
    if engine is None:
        phases["train"] = lpeak
    else:
        epeak = max(program_peak(p) for p in engine["programs"])
        state = learner["resident"]
        phases["rollout"] = state - offloaded(learner.get("parts", {}), offload) + epeak
        cached.add("rollout")
        if free:
            phases["weight copy"] = state + engine["weights"]
            phases["train"] = lpeak
        else:
            phases["weight copy"] = state + engine["cache"] + 2 * engine["weights"]
            phases["train"] = lpeak + engine["weights"] + engine["cache"]
            cached |= {"weight copy", "train"}
        if overlap:
            phases["overlapped"] = lpeak + epeak
            cached.add("overlapped")
    worst = max(phases, key=phases.get)
    out = {"phases": phases, "worst": worst, "peak": phases[worst], "hbm": hbm,
           "fits": phases[worst] <= hbm and all(p["fits"] for p in learner["programs"]),
           "free": free, "offload": offload}
    if engine is not None:
        per_slot = engine["cache"] / engine["slots"]
        unit = engine["data_shards"]  # each device holds as many slots
        more = math.floor(min((hbm - phases[k]) / per_slot for k in cached))
        room = all(v <= hbm for k, v in phases.items() if k not in cached)
        out["slots_fit"] = max(0, (engine["slots"] + more) // unit * unit) if room else 0
    return out


def format_budget(b: dict, slots: int | None = None) -> str:
    """The budget as lines, GiB per device."""
    if b.get("refused"):
        return f"the compiler refused {', '.join(b['refused'])}: DOES NOT FIT"
    lines = ["phase          GiB per device"]
    for name, v in b["phases"].items():
        lines.append(f"{name:14s} {v / GiB:8.2f}{'  <- peak' if name == b['worst'] else ''}")
    verdict = "fits" if b["fits"] else "DOES NOT FIT"
    lines.append(f"peak {b['peak'] / GiB:.2f} of {b['hbm'] / GiB:.2f} GiB per device: {verdict}")
    if b.get("free"):
        lines.append("the engine's cache and weights freed during the learner's step "
                     "(jax.free_engine)")
    if b.get("offload", "none") != "none":
        lines.append(f"the learner's {b['offload']} state in host memory during rollouts "
                     "(jax.offload)")
    if "slots_fit" in b:
        lines.append(f"engine slots: {slots} asked, about {b['slots_fit']} fit "
                     "(engine.slots; the cache grows linearly in them)")
    return "\n".join(lines)


def format_programs(programs: list[dict]) -> str:
    """Programs' `report`s as a table, bytes in GiB per device."""
    g = lambda b: f"{b / GiB:7.2f}"  # noqa: E731
    lines = ["program       argument  output   alias    temp    code  +state    peak /  HBM GiB"
             "   fits  TFLOP (model)  GB accessed  roofline ms (f: flop-, m: memory-bound)"
             "  compile s"]
    for p in programs:
        if "refused" in p:
            lines.append(f"{p['program']:12s} refused by the compiler after {p['compile_s']:.0f} "
                         f"s: {p['refused']}")
            continue
        lines.append(f"{p['program']:12s} {g(p['argument'])} {g(p['output'])} {g(p['alias'])} "
                     f"{g(p['temp'])} {g(p['code'])} {g(p['resident'])} {g(p['peak'])} / "
                     f"{p['hbm'] / GiB:6.2f}  {'yes' if p['fits'] else 'NO ':>5s} "
                     f"{p['flops'] / 1e12:6.1f} ({p['model_flops'] / 1e12:6.1f})  "
                     f"{p['bytes_accessed'] / 1e9:11.1f}  "
                     f"{p['roofline_s'] * 1e3:11.1f}{p.get('bound', '?')[0]} "
                     f"{p['compile_s']:9.0f}")
    return "\n".join(lines)


def format_report(r: dict) -> str:
    """The report as tables, bytes in GiB per device: the learner's programs, the engine's,
    the budget."""
    lines = [f"{r['topology']} ({r['devices']} x {r['chip']}), {r['params'] / 1e9:.2f}B "
             f"parameters, {r['attention']} attention, slice {r['slice']}",
             format_programs(r["programs"])]
    e = r.get("engine")
    if e is not None:
        lines += [f"engine on {e['devices']} devices a host: {e['slots']} slots of "
                  f"{e['context']} tokens (cache {e['cache'] / GiB:.2f} GiB, bf16 weights "
                  f"{e['weights'] / GiB:.2f} GiB per device), largest prefills (rows, new "
                  f"tokens) {e['prefill_shapes']}, {e['compile_set']} programs in all", format_programs(e["programs"])]
    o = r.get("offload")
    if o is not None:
        lines.append(f"jax.offload={o['offload']}: the move to host memory, compiled, leaves "
                     f"{o['device_out'] / GiB:.3f} GiB per device in device memory and puts "
                     f"{o['host_out'] / GiB:.2f} GiB in host memory (of {o['moved'] / GiB:.2f} "
                     "GiB moved)")
    if "budget" in r:
        lines.append(format_budget(r["budget"], e["slots"] if e else None))
    else:
        lines.append("fits" if r["fits"] else "DOES NOT FIT")
    return "\n".join(lines)


def setup(argv, programs_help: str):
    """The command line of this module and `geo3k_jax.tpu.engine_aot` (its flags in their own
    FlagValues, so a process that has defined another `--config` can call it): (flags, config,
    chip, abstract learner, model config)."""
    from absl import flags

    fv = flags.FlagValues()
    define_flags(fv, programs_help)
    try:
        fv(argv)
    except flags.Error as e:
        raise SystemExit(f"{e}\n{fv.main_module_help()}") from None
    devices = topology_devices(fv.topology)
    config = model_config(fv.shapes)
    return fv, fv.config, tpu_chip(devices), abstract_learner(fv.config, config, devices), config


def compile_run(cfg, learner, config, chip: Chip, topology: str = "",
                engine_programs: list | None = None) -> dict:
    """The learner's report (`compile_learner`), with the engine's on the same chips
    (`engine.backend=local`) and the `budget` of both."""
    from geo3k_jax.tpu.engine_aot import compile_engine
    r = compile_learner(learner, cfg, config, chip, topology)
    if cfg.jax.offload != "none":
        r["offload"] = compile_offload(learner, cfg.jax.offload)
    engine = None
    if cfg.engine.backend == "local":
        engine = r["engine"] = compile_engine(cfg, learner, config, chip, engine_programs,
                                                topology)
    overlap = cfg.train.max_staleness >= 1
    r["budget"] = budget(r, engine, chip.hbm, overlap, free=frees_engine(cfg),
                         offload=cfg.jax.offload)
    r["fits"] = r["budget"]["fits"]
    return r


def check_run(cfg, learner, config, memory: int) -> dict:
    """At a run's start (`jax.hbm_check`): compile its learner and engine on its own devices and
    refuse, with the budget's numbers, when they do not fit `memory` bytes a device (the
    device's own, or `jax.hbm_gib`). Returns the report."""
    devices = list(learner.mesh.devices.flat)
    kind = devices[0].device_kind
    known = CHIPS.get(kind)
    chip = Chip(kind, float(memory), known.peak_flops if known else math.inf,
                known.hbm_bandwidth if known else math.inf)
    r = compile_run(cfg, learner, config, chip)
    if not r["fits"]:
        raise SystemExit("the run's learner and JAX engine do not fit its devices together "
                         "(jax.hbm_check; python -m geo3k_jax.aot compiles the same for a TPU "
                         "slice):\n" + format_report(dict(r, topology=kind)) + "\nlower "
                         "engine.slots, engine.prefill_rows or engine.prefill_tokens, or "
                         "train.micro_batch_tokens, or use more chips")
    return r


def main(argv) -> None:
    fv, cfg, chip, learner, config = setup(argv, PROGRAMS_HELP)
    if fv.engine_only:
        from geo3k_jax.tpu.engine_aot import compile_engine
        r = dict(compile_engine(cfg, learner, config, chip, fv.programs or None, fv.topology),
                 shapes=fv.shapes, topology=fv.topology)
        print(f"{fv.topology}: the JAX engine's programs alone, {r['slots']} slots of "
              f"{r['context']} tokens, largest prefills (rows, new tokens) "
              f"{r['prefill_shapes']}, {r['compile_set']} programs in all\n"
              + format_programs(r["programs"]))
    else:
        r = dict(compile_run(cfg, learner, config, chip, fv.topology, fv.programs or None),
                 shapes=fv.shapes)
        print(format_report(r))
    if fv.json:
        Path(fv.json).write_text(json.dumps(r, indent=1))
    fits = all(p["fits"] for p in r["programs"]) if fv.engine_only else r["fits"]
    sys.exit(0 if fits else 1)


if __name__ == "__main__":
    main(sys.argv)
