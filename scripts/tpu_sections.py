"""The measurements of `scripts/tpu_check.py`, one function per section, each run in a process
of its own by the check (a section that takes the chips down cannot take the others with it).

    compile   the learner's two programs (gradient, update) and the engine's whole compile set
              (`JaxEngine.warm_up`) compiled with JAX's persistent cache cold, then warm: each
              pass a fresh process over one cache folder (OUT/jax_cache), seconds each
    memory    a GRPO step of the recipe (rollout, update, weight copy), the device's bytes in
              use and its peak so far after each phase (`memory_stats`), beside the budget
              `geo3k_jax.aot` compiles for the same config and devices; once per memory variant
              (`MEMORY_VARIANTS`, config overrides as strings: a variant whose key this branch's
              config lacks is a skipped row with its note), each in a fresh process
    decode    the engine at the recipe's slots, every slot decoding `new_tokens` tokens (no stop
              token): tokens/s; on a chip of two TensorCores (v5p, v4) again with the paged
              attention kernel's `megacore_mode` "kv_head" and "batch", each drawing with the
              same keys (same_tokens: whether it sampled the plain kernel's tokens)
    rollout   the recipe's multi-turn rollouts of `step_prompts` prompts (after one that
              compiles): the engine's prefill and decode seconds and their shares
    learner   the learner's step on `micro_batches` packed rows of GRPO groups: seconds against
              its roofline (`roofline`: model FLOPs / (chips x peak), the compiler's bytes
              accessed / HBM bandwidth, peaks from `CHIPS`)
    numerics  `geo3k_jax.check.numerics` (torch on the host against JAX on the devices, the check of
              `python -m geo3k_jax.main`) under configs/tpu.py:cpu: the tiny checkpoint, bf16
              compute, remat, the TPU's attention

Every section builds the run as `geo3k_jax.train.build` does from configs/tpu.py (`recipe`): on
one host (`jax.distributed` off: a slice of several hosts is measured one host's chips at a
time), the synthetic set, the model of `model.path` (the recipe's Qwen3-VL-2B, from the Hub, or
--model). `Settings.tiny_settings` is configs/tpu.py:cpu's tiny checkpoint and counts, on a CPU (the
decode and numerics sections with the splash and paged attention kernels in Pallas' interpret
mode, the others with the CPU's attention): the same code paths.
Each section yields rows (flat dicts); a row that raises is recorded with its traceback and the
next one still runs.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

GiB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class Chip:
    """A TPU generation's published per-chip figures: bf16 peak, HBM bandwidth, HBM."""

    name: str
    peak_flops: float  # bf16 flop/s
    hbm_bandwidth: float  # bytes/s
    hbm: float  # bytes


# Per chip, from the Cloud TPU data sheets (cloud.google.com/tpu/docs/v4, /v5e, /v5p, /v6e):
# bf16 peak, HBM bandwidth, HBM. Matched against `device_kind` in this order ("TPU v5p" and
# "TPU v5" are v5p, "TPU v5 lite" and "TPU v5e" v5e: jax/_src/pallas/mosaic/tpu_info.py).
# The v5p, v6e and v5e peaks are geo3k_jax.tpu.compiled.CHIPS's too (its HBM is the compiler's).
CHIPS = (
    (("v5 lite", "v5e"), Chip("v5e", 197e12, 819e9, 16 * GiB)),
    (("v6 lite", "v6e"), Chip("v6e", 918e12, 1640e9, 32 * GiB)),
    (("v5p", "v5"), Chip("v5p", 459e12, 2765e9, 95 * GiB)),
    (("v4",), Chip("v4", 275e12, 1200e9, 32 * GiB)),
)
# --tiny's stand-in for a chip, so that the rehearsal computes a roofline too (its numbers say
# nothing about the CPU)
NOMINAL = Chip("nominal (tiny rehearsal)", 1e12, 1e11, 16 * GiB)
MEGACORE = ("v5p", "v4")  # two TensorCores a chip, one JAX device
MEGACORE_MODES = (None, "kv_head", "batch")  # the paged attention kernel's `megacore_mode`
# The memory section's variants: (label, config overrides as --config would take them). The
# engine-freeing settings are being added beside this script: until the config has them, their
# rows are skipped with a note.
MEMORY_VARIANTS = (
    ("recipe", ()),
    ("engine kept", ("jax.free_engine=False",)),
    ("engine freed", ("jax.free_engine=True",)),
    ("moments offloaded", ("jax.offload=moments",)),
    ("all offloaded", ("jax.offload=all",)),
)


def chip_of(device_kind: str) -> Chip | None:
    """The `CHIPS` entry of a JAX device_kind ("TPU v5p", "TPU v6 lite", ...), or None."""
    kind = device_kind.lower()
    return next((chip for names, chip in CHIPS if any(n in kind for n in names)), None)


def roofline(flops: float, bytes_accessed: float, chips: int, chip: Chip) -> dict:
    """The least time a step can take on `chips` chips: its FLOPs (all chips') at the bf16 peak,
    or its bytes accessed (per chip) at the HBM bandwidth, whichever is longer. Seconds."""
    compute = flops / (chips * chip.peak_flops)
    memory = bytes_accessed / chip.hbm_bandwidth
    return {"compute_s": compute, "memory_s": memory, "roofline_s": max(compute, memory),
            "bound": "compute" if compute >= memory else "memory"}


@dataclasses.dataclass(frozen=True)
class Settings:
    """What a check measures. The defaults are a TPU host's; `tiny_settings` the CPU
    rehearsal."""

    out: str
    tiny: bool = False
    model: str = ""  # model.path ("": the recipe's); tiny: the tiny checkpoint
    overrides: tuple[str, ...] = ()  # config overrides for every section ("engine.slots=64")
    new_tokens: int = 512  # decode: each slot's tokens
    samples_per_group: int = 8
    image_px: int = 448
    response_tokens: tuple[int, int] = (256, 1536)  # learner: a sample's response, uniform
    micro_batches: int = 8  # learner: packed rows a step (the recipe: a row a chip a slice)
    timed_steps: int = 2  # learner steps timed after the warm-up one
    step_prompts: int = 16  # memory, rollout: prompts (x rollout.n_samples episodes)

    @classmethod
    def tiny_settings(cls, out: str, overrides: tuple[str, ...] = ()) -> Settings:
        return cls(out, tiny=True, overrides=overrides, new_tokens=8, samples_per_group=2,
                   image_px=64, response_tokens=(16, 48), micro_batches=2, timed_steps=1,
                   step_prompts=2)


# ---- the run ----------------------------------------------------------------------------------
def set_override(cfg, override: str) -> bool:
    """Apply "a.b.c=value" to `cfg` (the value parsed as the key's current type: bool from
    True/False, int, float, str). False when the config has no such key (nothing changed)."""
    key, _, value = override.partition("=")
    *parents, leaf = key.split(".")
    node = cfg
    for p in parents:
        if p not in node:
            return False
        node = node[p]
    if leaf not in node:
        return False
    old = node[leaf]
    if isinstance(old, bool):
        if value not in ("True", "False", "true", "false"):
            raise ValueError(f"{key} is a bool: give True or False, not {value!r}")
        node[leaf] = value in ("True", "true")
    elif old is None or isinstance(old, str):
        node[leaf] = value
    else:
        node[leaf] = type(old)(value)
    return True


def missing(cfg, overrides) -> list[str]:
    """The keys of `overrides` this config lacks."""
    probe = cfg.copy_and_resolve_references()
    return [o.partition("=")[0] for o in overrides if not set_override(probe, o)]


def recipe(s: Settings, overrides=()):
    """configs/tpu.py (`:cpu` with `s.tiny`) for one host, on the synthetic set, the persistent
    compilation cache in OUT/jax_cache, with `s.overrides` then `overrides`."""
    from configs import tpu

    cfg = tpu.get_config("cpu" if s.tiny else None)
    cfg.jax.distributed = False  # one host's chips
    cfg.jax.hbm_check = False  # the memory section compiles the budget itself
    cfg.jax.compilation_cache_dir = str(Path(s.out) / "jax_cache")
    cfg.data.path = ""
    cfg.data.synthetic_dir = str(Path(s.out) / "data")
    cfg.data.synthetic_train_size = cfg.data.synthetic_test_size = max(s.step_prompts, 4)
    cfg.data.synthetic_image_size = str(s.image_px)
    cfg.advantage.filter_equal_groups = False  # an untrained reward spread: train on all
    cfg.train.prompts_per_step = s.step_prompts
    if s.model:
        cfg.model.path = s.model
    if s.tiny:  # an unprimed tiny checkpoint of its own, short turns
        cfg.model.tiny_dir = str(Path(s.out) / "tiny-model")
        cfg.model.tiny_prime_steps = 0
        cfg.rollout.max_response_tokens = 16
    for o in tuple(s.overrides) + tuple(overrides):
        if not set_override(cfg, o):
            raise ValueError(f"the config has no key {o.partition('=')[0]!r}")
    return cfg


def build(s: Settings, cfg, name: str):
    """`geo3k_jax.train.build` of `cfg` in OUT/name."""
    from geo3k_jax import train

    return train.build(cfg, str(Path(s.out) / name))


def _close(run) -> None:
    run.backend.close()
    run.shutdown()


def device_info() -> dict:
    """The first device's kind, the platform, and the counts."""
    import jax

    d = jax.devices()[0]
    return {"platform": d.platform, "device_kind": d.device_kind,
            "devices": jax.device_count(), "hosts": jax.process_count()}


def memory_stats() -> dict:
    """The first device's bytes in use, its peak so far and its limit (GiB), where the runtime
    reports them (a TPU or GPU; not a CPU: "n/a")."""
    import jax

    stats = jax.local_devices()[0].memory_stats() or {}
    get = lambda k: stats[k] / GiB if k in stats else "n/a"  # noqa: E731
    return {"in_use_gib": get("bytes_in_use"), "peak_gib": get("peak_bytes_in_use"),
            "limit_gib": get("bytes_limit")}


def _failed(row: dict) -> dict:
    return {**row, "status": "failed", "error": traceback.format_exc()}


# ---- a pass in a fresh process -----------------------------------------------------------------
def in_child(name: str, s: Settings, overrides=(), timeout: float | None = None) -> dict:
    """Pass `name` (`PASSES`) in a fresh Python process: its row. Only one process at a time may
    hold a TPU's chips, so the caller must not have started JAX's backend."""
    rows = Path(s.out) / "passes"
    rows.mkdir(parents=True, exist_ok=True)
    tag = f"{name}-{len(list(rows.glob(f'{name}-*.json')))}"
    path, log = rows / f"{tag}.json", rows / f"{tag}.log"
    cmd = [sys.executable, __file__, f"--pass={name}", f"--out={s.out}", f"--row={path}",
           f"--model={s.model}"] + ["--tiny"] * s.tiny + [
           f"--override={o}" for o in tuple(s.overrides) + tuple(overrides)]
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
    if rc or not path.exists():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"pass {name} exited with status {rc} ({log}):\n{tail}")
    return json.loads(path.read_text())


def compile_pass(s: Settings) -> dict:
    """Build the run (engine not warmed up), then compile the learner's gradient and update at
    its one slice shape and the engine's whole compile set: seconds each."""
    from geo3k_jax.aot import abstract_slice

    cfg = recipe(s)
    cfg.engine.warm_up = False  # timed below
    start = time.perf_counter()
    run = build(s, cfg, "compile")
    row = {"build_s": time.perf_counter() - start}
    try:
        learner = run.learner
        lowered = learner.lower(abstract_slice(learner, learner.config))
        for program in ("grad", "apply"):
            t0 = time.perf_counter()
            lowered[program].compile()
            row[f"learner_{program}_s"] = time.perf_counter() - t0
        row["engine_programs"], row["engine_s"] = run.backend.engine.warm_up()
    finally:
        _close(run)
    return row


def memory_pass(s: Settings) -> dict:
    """One GRPO step of the recipe as the loop runs it (rollout, update, weight copy), the
    device's memory after each phase, and the budget `geo3k_jax.aot.compile_run` predicts for
    the same config on these devices (GiB per device)."""
    import jax

    from common import train as loop
    from common.prepare import make_renderer
    from common.step import collect, learn
    from geo3k_jax.aot import compile_run
    from geo3k_jax.tpu.compiled import Chip as AotChip

    cfg = recipe(s)
    run = build(s, cfg, "memory")
    try:
        learner, backend = run.learner, run.backend
        measured = {"built": memory_stats()}
        step_cfg = loop.step_config(cfg, run.processor)
        renderer = run.renderer or make_renderer(cfg, run.processor)
        trajs, _ = collect(list(run.train_set)[:s.step_prompts], backend.engine, renderer,
                           step_cfg, 0)
        measured["rollout"] = memory_stats()
        metrics = learn(trajs, learner, step_cfg, run.comm, backend.train_context)
        float(metrics["loss"])  # the update done
        measured["train"] = memory_stats()
        backend.sync(learner, 1)
        jax.block_until_ready(backend.params)
        measured["weight copy"] = memory_stats()
        device = jax.local_devices()[0]
        known = chip_of(device.device_kind)
        limit = measured["built"]["limit_gib"]
        hbm = limit * GiB if limit != "n/a" else (known.hbm if known else 16 * GiB)
        chip = AotChip(device.device_kind, hbm, known.peak_flops if known else math.inf,
                       known.hbm_bandwidth if known else math.inf)
        budget = compile_run(cfg, learner, learner.config, chip)["budget"]
    finally:
        _close(run)
    predicted = {k: v / GiB for k, v in budget.get("phases", {}).items()}
    return {"measured": measured, "predicted": predicted, "fits": budget["fits"],
            "predicted_hbm_gib": budget["hbm"] / GiB, "refused": budget.get("refused", [])}


PASSES = {"compile": compile_pass, "memory": memory_pass}


# ---- the sections -----------------------------------------------------------------------------
def compile(s: Settings):  # noqa: A001  (the section's name)
    """Two passes over one persistent cache folder, emptied first: cold, then warm."""
    shutil.rmtree(Path(s.out) / "jax_cache", ignore_errors=True)
    for cache in ("cold", "warm"):
        try:
            row = in_child("compile", s)
            yield {"cache": cache, **row,
                   "total_s": row["learner_grad_s"] + row["learner_apply_s"] + row["engine_s"],
                   "cache_files": sum(1 for _ in (Path(s.out) / "jax_cache").rglob("*"))}
        except Exception:  # noqa: BLE001  (recorded; the warm pass still runs)
            yield _failed({"cache": cache})


def memory(s: Settings):
    """A row per phase of each variant (`MEMORY_VARIANTS`) that this config can take."""
    base = recipe(s)
    for label, overrides in MEMORY_VARIANTS:
        lacks = missing(base, overrides)
        if lacks:
            yield {"variant": label, "status": "skipped",
                   "note": f"the config has no {', '.join(lacks)} (not on this branch yet)"}
            continue
        try:
            r = in_child("memory", s, overrides)
        except Exception:  # noqa: BLE001
            yield _failed({"variant": label})
            continue
        for phase, m in r["measured"].items():
            yield {"variant": label, "phase": phase, **m,
                   "predicted_gib": r["predicted"].get(phase, "n/a"),
                   "predicted_fits": r["fits"], "hbm_gib": r["predicted_hbm_gib"]}


def _requests(run, s: Settings, slots: int, tag: str):
    """A first turn per slot, groups of `s.samples_per_group` sharing a prompt and image, no
    stop token: every request decodes exactly `s.new_tokens` (`gpu_sections._requests`)."""
    import gpu_sections

    at = dataclasses.replace(gpu_sections.Settings(s.out), episodes=slots, image_px=s.image_px,
                             samples_per_group=s.samples_per_group, new_tokens=s.new_tokens)
    return gpu_sections._requests(run.learner.config, run.processor, at, tag)


def use_megacore(mode: str | None, interpret: bool = False) -> None:
    """The engine's decode through the paged attention kernel with `megacore_mode` (the
    config has no setting for it: the module's kernel function, wrapped), and JAX's traces
    dropped so that the next call compiles with it. interpret: Pallas' TPU interpreter, which
    must simulate two cores for a megacore mode (with one it waits forever)."""
    import jax
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    from geo3k_jax.kernels import ragged

    def kernel(*args, **kwargs):
        if not (mode and interpret):
            return paged_attention(*args, megacore_mode=mode, **kwargs)
        with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams(num_cores_or_threads=2)):
            return paged_attention(*args, megacore_mode=mode, **kwargs)

    ragged.pallas_paged = kernel
    jax.clear_caches()


def decode(s: Settings):
    """Tokens/s of the engine with every slot decoding, per `megacore_mode` this chip takes."""
    import jax

    # the TPU's kernels, interpreted on a CPU (slow: in this section only)
    cfg = recipe(s, ("jax.attention=splash",) if s.tiny else ())
    run = build(s, cfg, "decode")
    engine = run.backend.engine
    chip = chip_of(jax.devices()[0].device_kind)
    plain = None  # the tokens without megacore: a split kernel should draw the same
    try:
        for mode in MEGACORE_MODES:
            row = {"megacore_mode": str(mode), "slots": engine.n_slots,
                   "new_tokens": s.new_tokens, "kernel": "pallas" if engine.kernel else "xla"}
            if mode and not engine.kernel:
                yield {**row, "status": "skipped", "note": "the decode runs in XLA, not the "
                       "Pallas kernel (a head dim that is not a multiple of 128)"}
                continue
            if mode and not s.tiny and (chip is None or chip.name not in MEGACORE):
                yield {**row, "status": "skipped",
                       "note": "one TensorCore a chip: nothing to split"}
                continue
            try:
                use_megacore(mode, engine.attention.interpret)
                times = []
                for version, call in ((2, "first"), (3, "second")):  # the first compiles
                    requests = _requests(run, s, engine.n_slots, call)
                    # a version other than the current one counts requests afresh: each mode's
                    # calls draw with the same keys
                    engine.clear_cache(version)
                    steps = engine.decode_steps
                    t0 = time.perf_counter()
                    done = engine.generate(requests)
                    times.append(time.perf_counter() - t0)
                tokens = [c.token_ids for c in done]
                plain = plain or tokens
                n = sum(map(len, tokens))
                yield {**row, "first_call_s": times[0], "seconds": times[1], "tokens": n,
                       "decode_steps": engine.decode_steps - steps, "tokens_per_s": n / times[1],
                       "same_tokens": tokens == plain}
            except Exception:  # noqa: BLE001
                yield _failed(row)
    finally:
        use_megacore(None)
        _close(run)


def overlap(spans, start: float, end: float) -> float:
    """Seconds of the (start, end) spans that fall inside the window [start, end]."""
    return sum(max(0.0, min(e, end) - max(s, start)) for s, e in spans)


class PhaseClock:
    """When the engine's driver thread is inside `engine.<name>` (each call's start and end,
    waiting for the cache it wrote: the insert runs asynchronously after the prefill returns).
    A call still running counts up to now: the last decode chunk sets the last future before
    it returns, so a rollout can end inside it."""

    def __init__(self, engine, names: tuple[str, ...]):
        self.spans = {n: [] for n in names}
        self.running: dict[str, float] = {}
        for name in names:
            self._wrap(engine, name)

    def _wrap(self, engine, name: str) -> None:
        import jax

        inner = getattr(engine, name)

        def timed(*args, **kwargs):
            self.running[name] = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                jax.block_until_ready(engine._cache)
                self.spans[name].append((self.running.pop(name), time.perf_counter()))
        setattr(engine, name, timed)

    def seconds(self, name: str, start: float, end: float) -> float:
        """Seconds inside `engine.<name>` within [start, end]."""
        now = [(self.running[name], end)] if name in self.running else []
        return overlap(self.spans[name] + now, start, end)


def rollout(s: Settings):
    """The recipe's rollouts of `s.step_prompts` prompts (a first batch compiles, the second is
    timed): prefill and decode seconds, their shares of the rollout."""
    from common import train as loop
    from common.prepare import make_renderer
    from common.step import collect

    cfg = recipe(s)
    run = build(s, cfg, "rollout")
    engine = run.backend.engine
    clock = PhaseClock(engine, ("_prefill_admitted", "_decode_chunk"))
    step_cfg = loop.step_config(cfg, run.processor)
    renderer = run.renderer or make_renderer(cfg, run.processor)
    prompts = list(run.train_set)
    try:
        for call in ("first", "second"):
            engine.clear_cache()  # every episode prefilled afresh
            before = (engine.prefilled, engine.decode_steps)
            t0 = time.perf_counter()
            trajs, _ = collect(prompts[:s.step_prompts], engine, renderer, step_cfg, 0)
            t1 = time.perf_counter()
            prefill = clock.seconds("_prefill_admitted", t0, t1)
            dec = clock.seconds("_decode_chunk", t0, t1)
            yield {"call": call, "episodes": len(trajs),
                   "turns_mean": sum(len(t.turns) for t in trajs) / len(trajs),
                   "generated_tokens": sum(t.num_generated for t in trajs),
                   "prefilled_tokens": engine.prefilled - before[0],
                   "decode_steps": engine.decode_steps - before[1], "rollout_s": t1 - t0,
                   "prefill_s": prefill, "decode_s": dec, "prefill_share": prefill / (t1 - t0),
                   "decode_share": dec / (t1 - t0)}
    finally:
        _close(run)


def learner(s: Settings):
    """The learner's step on `s.micro_batches` rows (after a warm-up step) against its
    roofline: the rows' model FLOPs (`gpu_sections.train_flops`) and the compiled programs'
    bytes accessed per chip (a gradient a slice, then the update)."""
    import jax

    import gpu_sections
    from geo3k_jax.aot import compile_learner
    from geo3k_jax.tpu.compiled import Chip as AotChip

    cfg = recipe(s)
    run = build(s, cfg, "learner")
    lrn, processor, config = run.learner, run.processor, run.learner.config
    try:
        budget = cfg.train.micro_batch_tokens
        batches = gpu_sections.grpo_batches(config, processor, s, budget, s.micro_batches)
        counts = gpu_sections.step_counts(batches)
        t0 = time.perf_counter()
        float(lrn.train_step(batches, *counts)["loss"])
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(s.timed_steps):
            metrics = lrn.train_step(batches, *counts)
        loss = float(metrics["loss"])
        seconds = (time.perf_counter() - t0) / s.timed_steps
        chips = jax.device_count()
        kind = jax.devices()[0].device_kind
        chip = chip_of(kind) or (NOMINAL if s.tiny else None)
        slices = math.ceil(len(batches) / lrn.rows_per_slice)
        flops = gpu_sections.train_flops(config, batches, processor)
        row = {"device_kind": kind, "chips": chips, "rows": len(batches),
               "row_tokens": budget, "slices": slices, "tokens": sum(b.num_tokens
                                                                     for b in batches),
               "loss": loss, "first_step_s": first, "step_s": seconds,
               "model_tflop": flops / 1e12, "chip": chip.name if chip else "unknown"}
        if chip is None:
            yield {**row, "note": f"no published peak for {kind!r}: no roofline"}
            return
        aot = AotChip(kind, chip.hbm, chip.peak_flops, chip.hbm_bandwidth)
        programs = {p["program"]: p for p in compile_learner(lrn, cfg, config, aot)["programs"]}
        accessed = slices * programs["grad"]["bytes_accessed"] + programs["apply"][
            "bytes_accessed"]
        line = roofline(flops, accessed, chips, chip)
        yield {**row, "gb_accessed_per_chip": accessed / 1e9, **line,
               "step_over_roofline": seconds / line["roofline_s"],
               "mfu": flops / (seconds * chips * chip.peak_flops)}
    finally:
        _close(run)


def numerics(s: Settings):
    """`geo3k_jax.check.numerics.run_check` under configs/tpu.py:cpu (the tiny checkpoint, bf16
    compute, remat, the TPU's attention on a TPU, in interpret mode elsewhere): a row per
    quantity, torch (on the host) against JAX (on the devices)."""
    import jax

    from common.processor import load_processor
    from configs import tpu
    from geo3k_jax.check.numerics import run_check
    try:
        from geo3k_torch.prepare import prepare_model_dir
    except ImportError as e:  # the tpu extra brings no torch
        raise RuntimeError("the numerics check compares against torch: install the CPU wheel "
                           "(pip install torch --index-url https://download.pytorch.org/whl/cpu)"
                           ) from e

    cfg = tpu.get_config("cpu")
    cfg.model.tiny_dir = str(Path(s.out) / "tiny-model")
    cfg.model.tiny_prime_steps = 0
    cfg.jax.attention = "auto" if jax.devices()[0].platform == "tpu" else "splash"
    cfg.jax.compilation_cache_dir = ""
    jax.config.update("jax_default_matmul_precision", "highest")  # as geo3k_jax.main
    model_dir = prepare_model_dir(cfg)
    rows, _ = run_check(cfg, model_dir, load_processor(model_dir))
    for r in rows:
        yield {"quantity": r.quantity, "abs_err": r.abs_err, "rel_err": r.rel_err,
               "measure": r.measure, "tol": r.tol, "attention": cfg.jax.attention,
               "check_dtype": cfg.jax.check.dtype, "compute_dtype": cfg.jax.compute_dtype,
               **({} if r.passed else {"status": "failed", "error": f"{r.quantity}: "
                   f"{r.measure} error above {r.tol}"})}


SECTIONS = {f.__name__: f for f in (compile, memory, decode, rollout, learner,  # in this order
                                    numerics)}
NO_BACKEND = ("compile", "memory")  # run their work in child processes: the chips stay free


def main(argv=None) -> int:
    """A pass (`PASSES`) in this process: its row as JSON at --row."""
    import argparse

    p = argparse.ArgumentParser(description="one pass of scripts/tpu_check.py")
    p.add_argument("--pass", dest="name", required=True, choices=sorted(PASSES))
    p.add_argument("--out", required=True)
    p.add_argument("--row", required=True)
    p.add_argument("--model", default="")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--override", action="append", default=[])
    a = p.parse_args(argv)
    make = Settings.tiny_settings if a.tiny else Settings
    s = dataclasses.replace(make(a.out), model=a.model, overrides=tuple(a.override))
    Path(a.row).write_text(json.dumps(PASSES[a.name](s), indent=1))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's packages
    sys.exit(main())
