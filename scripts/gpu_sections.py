"""The measurements of `scripts/gpu_check.py`, one function per section, each run in a process
of its own (a CUDA error or an out-of-memory cannot take the other sections down).

    e2e_torch / e2e_jax       the quick CPU run (configs/cpu.py) trained end to end on the machine's
                              accelerator through each entry point's own `build` and the shared
                              loop: reward, tool-call rate, seconds per phase (from metrics.jsonl)
    learner_torch / learner_jax  learner steps of a random-initialised model with a published
                              model's shapes (configs/models) on 2 and 4 packed micro-batches
                              (GRPO groups sharing their prompt and image): tokens/s, MFU, peak
                              memory; torch per configuration of `LEARNER_PLAN` at 32k tokens
                              a micro-batch (the recipe, the fused head, compiled), JAX at 16k
                              and 32k
    learner_moe               the recipe's torch learner steps of a MoE model, Qwen3-VL-30B-A3B's
                              shapes with 3 of its decoder layers (`MOE_SHAPES`), experts through
                              grouped_mm: tokens/s, MFU on the weights a token meets
    engine_torch / engine_jax  the in-process engines sampling 64 episodes x 512 tokens from the
                              same model (torch again at 256): tokens/s and peak memory; torch
                              also with its decode fast paths on (`FAST_ENGINE`, fast_*)
    profile_torch             the learner's unprofiled step by phase (`gpu_profile.step_phases`),
                              torch.profiler over a learner step and an engine call of that
                              model: top kernels (ops on a CPU), GPU idle share of the
                              unprofiled step, host syncs per learner step, the top ops by shape
                              (`gpu_profile`); also OUT/profile_torch.json and .md
    whole_step                whole GRPO steps of that model (the shared step's `grpo_step` and
                              the backend's weight sync) with its local engine on the same device:
                              seconds of rollout, update and sync, tokens per GPU-second as the
                              learner computed them and as EasyR1 counts them (`step_tokens`)

The learners and engines are the ones `geo3k_torch.main.build` / `geo3k_jax.train.build` make
(device, process group, loading, sharding, dtype policy, backend) from a checkpoint directory
written here: the published config, random bf16 weights, and the Qwen tokenizer and processor
files of `geo3k_torch.tiny` (no download). The recipe's settings are configs/base.py's, with
`jax.compute_dtype=bfloat16` and `jax.remat=True`.

Each section yields rows (flat dicts of numbers and strings) as it measures them; a measurement
that raises becomes a row with status "failed" and its traceback, and the next one still runs.
Every torch row names its attention kernel (`kernel`: the learner's, `learner_kernel`;
`engine_kernel`: the engine's, transformers' sdpa).
`Settings.tiny_settings` shrinks the shapes and counts so that every section runs on a CPU: the
same code paths.
"""

from __future__ import annotations

import dataclasses
import json
import math
import resource
import time
import traceback
from pathlib import Path

import numpy as np
from PIL import Image

from common.batching import TrainSequence, pack
from common.engine import Request, SamplingParams
from common.flops import image_flops, text_flops
from configs import base, cpu
from configs.models import model_shapes, write_config_dir

import gpu_profile  # a sibling script module (scripts/ is on the path of gpu_check and the tests)

# The torch learner's kernels for packed rows. "varlen" (one torch.nn.attention.varlen call per
# layer) is chosen by `geo3k_torch.attention.uses_varlen` where that switch exists; "packed_sdpa"
# is its per-segment sdpa path. `use_kernel` is the one place that selects them.
TORCH_KERNELS = ("varlen", "packed_sdpa")
ENGINE_KERNEL = "sdpa"  # the engine's batched, cached generation: transformers' own sdpa
IMAGE_MAX_PIXELS = 1024 * 1024  # the checkpoint's image processor (a 448-px diagram is kept)


@dataclasses.dataclass(frozen=True)
class Settings:
    """What a check measures. The defaults are the GPU check; `tiny_settings` the CPU
    rehearsal (tiny shapes, one micro-batch size, a few short episodes)."""

    out: str
    tiny: bool = False
    device: str = "cuda"
    peak_tflops: float | None = None  # the accelerator's dense bf16 peak (None: no MFU)
    shapes: str = "qwen3_vl_2b"
    text_layers: int | None = None  # the shapes checkpoint's decoder layers (None: the published)
    e2e_steps: int = 3
    # The learner's step is host-bound, with a fixed cost per micro-batch (docs/gpu_check.md):
    # 16k (the recipe's) and 32k. 8k ran on 2026-11-27 and -28.
    micro_batch_tokens: tuple[int, ...] = (16384, 32768)
    micro_batches_per_step: tuple[int, ...] = (2, 4)  # a learner row per count and size
    # learner_torch also under the other checkpointing modes and the other attention kernel
    # (measured on 2026-11-28: selective slower than full, packed_sdpa below varlen)
    all_modes: bool = False
    timed_steps: int = 2  # learner steps per row, profiled steps and engine calls, whole steps
    samples_per_group: int = 8
    response_tokens: tuple[int, int] = (256, 1536)  # uniform range of a sample's response
    image_px: int = 448
    episodes: int = 64  # the engine's episodes; whole_step: episodes / samples_per_group prompts
    # engine_torch also at as many episodes as its slots hold (engine.local_max_batch 256 and
    # the 24 GiB KV budget: about 210 rows of 2B at 512 new tokens): its rate where memory,
    # not the batch, is the limit
    more_episodes: int = 256
    new_tokens: int = 512  # each episode's (whole_step: each turn's most) new tokens
    profile_new_tokens: int = 32  # each episode's new tokens in a profiled engine call
    step_micro_batch_tokens: int = 16384  # whole_step's micro-batches (room for its prompts)

    @classmethod
    def tiny_settings(cls, out: str, peak_tflops: float | None) -> Settings:
        return cls(out, tiny=True, device="cpu", peak_tflops=peak_tflops, e2e_steps=2,
                   all_modes=True,
                   micro_batch_tokens=(256,), timed_steps=1, samples_per_group=4,
                   response_tokens=(32, 96), image_px=64, episodes=8, more_episodes=16,
                   new_tokens=8,
                   profile_new_tokens=4, step_micro_batch_tokens=2048)


# ---- the checkpoint ---------------------------------------------------------------------------
def shapes_config(s: Settings, directory):
    """`s.shapes`' published config as transformers reads it (written to `directory`), with
    `s.text_layers` decoder layers if set."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(write_config_dir(s.shapes, directory))
    if s.text_layers:
        config.text_config.num_hidden_layers = s.text_layers
    return config


def shapes_checkpoint(s: Settings) -> str:
    """A checkpoint directory of `s.shapes` with random bf16 weights (built once per --out),
    `s.text_layers` decoder layers if set; with `s.tiny`, `geo3k_torch.tiny`'s own small
    checkpoint of the same architecture (its own layers)."""
    import shutil

    import torch
    from transformers import AutoModelForImageTextToText

    from geo3k_torch.tiny import build_tiny_checkpoint

    layers = f"-{s.text_layers}-layers" if s.text_layers and not s.tiny else ""
    d = Path(s.out) / "checkpoints" / (s.shapes + layers + ("-tiny" if s.tiny else ""))
    if (d / "config.json").exists():
        return str(d)
    shapes = model_shapes(s.shapes)
    tmp = d.with_name(d.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    build_tiny_checkpoint(tmp, arch=shapes["model_type"], vocab="small" if s.tiny else "qwen",
                          max_pixels=IMAGE_MAX_PIXELS)
    if not s.tiny:  # the published config and random weights in place of the tiny ones
        tiny = json.loads((tmp / "config.json").read_text())
        ids = [k for k in tiny if k.endswith("_token_id") and k in shapes]
        if any(tiny[k] != shapes[k] for k in ids):
            raise ValueError(f"the Qwen tokenizer's ids {[tiny[k] for k in ids]} differ from "
                             f"{s.shapes}'s {[shapes[k] for k in ids]} ({ids})")
        (tmp / "model.safetensors").unlink()
        config = shapes_config(s, tmp)
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(tmp)
    tmp.rename(d)
    return str(d)


def _config(s: Settings, budget: int):
    """The recipe (configs/base.py) on the shapes checkpoint, micro-batches of `budget` tokens."""
    cfg = base.get_config()
    cfg.model.path = shapes_checkpoint(s)
    cfg.train.device = s.device
    cfg.train.micro_batch_tokens = budget
    cfg.data.synthetic_dir = str(Path(s.out) / "data")  # not the quick CPU run's set of other sizes
    cfg.data.synthetic_train_size = cfg.data.synthetic_test_size = 4
    cfg.jax.compute_dtype, cfg.jax.remat = "bfloat16", True
    if s.tiny:  # episodes that fit the tiny micro-batches
        cfg.jax.compilation_cache_dir = ""
        cfg.rollout.max_context_tokens, cfg.rollout.max_response_tokens = budget, budget // 4
    return cfg


def _build(framework: str, s: Settings, name: str, cfg):
    """`geo3k_torch.main.build` or `geo3k_jax.train.build` of `cfg` (`_config`) in OUT/name."""
    workdir = str(Path(s.out) / name)
    if framework == "torch":
        from geo3k_torch import main
        return main.build(cfg, workdir)
    from geo3k_jax import train
    return train.build(cfg, workdir)


def _close(run) -> None:
    run.backend.close()
    run.shutdown()


def _image(px: int, rng: np.random.Generator) -> Image.Image:
    return Image.fromarray(rng.integers(0, 255, (px, px, 3), dtype=np.uint8))


def text_ids(processor) -> int:
    """Random text is drawn below this id: below every special token of the tokenizer."""
    return min(processor.tokenizer.all_special_ids)


def _prompt(config, processor, px: int, rng: np.random.Generator) -> tuple[list[int], Image.Image]:
    """Random text around one image (its placeholders expanded): (token ids, the image)."""
    image = _image(px, rng)
    grid = processor.image_processor(images=[image], return_tensors="np")["image_grid_thw"][0]
    n_image = int(np.prod(grid)) // config.vision_config.spatial_merge_size ** 2
    text = lambda n: rng.integers(0, text_ids(processor), n).tolist()  # noqa: E731
    ids = (text(48) + [config.vision_start_token_id] + [config.image_token_id] * n_image
           + [config.vision_end_token_id] + text(80))
    return ids, image


def grpo_batches(config, processor, s: Settings, budget: int, micro_batches: int,
                 seed: int = 0) -> list:
    """`micro_batches` packed micro-batches of at most `budget` tokens, the fullest
    `common.batching.pack` makes of GRPO groups (`s.samples_per_group` samples sharing a prompt
    with one image, responses of `s.response_tokens` tokens), fullest first."""
    rng = np.random.default_rng(seed)
    seqs, total, group = [], 0, 0
    need = budget * (micro_batches + 1)
    while total < need:
        prompt, image = _prompt(config, processor, s.image_px, rng)
        room = budget - len(prompt)
        for _ in range(s.samples_per_group):
            n = int(min(rng.integers(*s.response_tokens, endpoint=True), room))
            ids = np.array(prompt + rng.integers(0, text_ids(processor), n).tolist(),
                           np.int64)
            mask = np.r_[np.zeros(len(prompt)), np.ones(n)].astype(np.float32)
            seqs.append(TrainSequence(ids, mask, -rng.uniform(0.0, 3.0, len(ids)) * mask,
                                      float(rng.normal()), [image], group))
            total += n
        total += len(prompt)
        group += 1
    batches = pack(seqs, budget, config.image_token_id)
    return sorted(batches, key=lambda b: -b.num_tokens)[:micro_batches]


def step_counts(batches) -> tuple[float, float]:
    """(masked tokens, sequences) of a step on `batches`: `train_step`'s n_tokens, n_seqs."""
    return (float(sum(b.loss_mask.sum() for b in batches)),
            float(sum((b.seq_index >= 0).sum() for b in batches)))


# ---- FLOPs, memory ---------------------------------------------------------------------------
def train_flops(config, batches, processor) -> float:
    """Model FLOPs of one training step (forward + backward = 3 forwards) on `batches`: every
    matmul of the decoder over the row's tokens, the LM head over the trained tokens only (the
    learner computes no other logits), causal attention per segment (a sample continuing its
    group's prompt also attends to the prompt), and the vision tower per image
    (`common.flops.image_flops`). Recomputation under gradient checkpointing is not counted (MFU,
    not hardware FLOPs utilisation)."""
    fwd = 0.0
    for b in batches:
        lens, parents = np.diff(b.cu_seqlens), b.parent_of()
        pairs = sum(n * (n + 1) / 2 + (n * lens[p] if p >= 0 else 0)
                    for n, p in zip(lens, parents))  # (query, key) pairs attended
        fwd += text_flops(config, b.num_tokens, float(b.loss_mask.sum()), pairs)
        if b.images:
            grid = processor.image_processor(images=list(b.images),
                                             return_tensors="np")["image_grid_thw"]
            fwd += sum(image_flops(config, int(np.prod(g))) for g in grid)
    return 3 * fwd


def host_peak_gb() -> float:
    """The process's peak resident memory (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


def _throughput(row: dict, tokens: float, seconds: float, flops: float | None,
                peak_tflops: float | None) -> dict:
    row.update(tokens=tokens, seconds=seconds, tokens_per_s=tokens / seconds)
    if flops is not None:
        row["tflops_per_s"] = float(flops) / seconds / 1e12
        if peak_tflops:
            row["mfu"] = row["tflops_per_s"] / peak_tflops
    return row


# ---- end to end ------------------------------------------------------------------------------
def _e2e_config(s: Settings):
    cfg = cpu.get_config()
    cfg.train.steps = s.e2e_steps
    cfg.train.device = s.device
    if s.tiny:  # a fresh unprimed tiny model (its rewards are all 0: train on equal groups
        # too, so the update runs), a few short episodes, no evaluation
        cfg.model.tiny_dir = str(Path(s.out) / "tiny-model")
        cfg.model.tiny_prime_steps = 0
        cfg.advantage.filter_equal_groups = False
        cfg.train.prompts_per_step, cfg.rollout.n_samples = 2, 3
        cfg.rollout.max_response_tokens = 16
        cfg.eval.every = 0
        cfg.jax.compilation_cache_dir = ""
    return cfg


def _e2e_row(framework: str, workdir: Path, seconds: float, **kernels: str) -> dict:
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["step"] > 0]  # step 0 is the evaluation before training
    mean = lambda k: float(np.mean([r[k] for r in rows if k in r]))  # noqa: E731
    out = {"framework": framework, **kernels, "steps": len(rows), "wall_s": seconds,
           "reward_mean": mean("train/reward_mean"), "reward_last": rows[-1]["train/reward_mean"],
           "tool_call_rate": mean("train/tool_call_rate")}
    for k in sorted({k for r in rows for k in r if k.startswith("train/time_")}):
        out[k.removeprefix("train/")] = mean(k)
    if "eval/greedy_accuracy" in rows[-1]:
        out["eval_greedy_accuracy"] = rows[-1]["eval/greedy_accuracy"]
    return out


def e2e_torch(s: Settings):
    import torch

    from geo3k_torch import main

    workdir = Path(s.out) / "e2e_torch"
    start = time.perf_counter()
    main.train(_e2e_config(s), str(workdir))
    yield _e2e_row("torch", workdir, time.perf_counter() - start,
                   kernel=learner_kernel(torch.device(s.device)), engine_kernel=ENGINE_KERNEL)


def e2e_jax(s: Settings):
    from geo3k_jax import train

    workdir = Path(s.out) / "e2e_jax"
    start = time.perf_counter()
    train.train(_e2e_config(s), str(workdir))
    yield _e2e_row("jax", workdir, time.perf_counter() - start)


# ---- learner steps ---------------------------------------------------------------------------
def _failed(row: dict) -> dict:
    return {**row, "status": "failed", "error": traceback.format_exc()}


def _timed_steps(learner, batches, steps: int) -> tuple[float, dict[str, float]]:
    """(mean seconds of `steps` steps on `batches`, the last step's metrics). Every metric is
    read as a float, so the time includes the step's work (a JAX step, or a torch step whose
    metrics stay on the device, returns before its work is done)."""
    n_tokens, n_seqs = step_counts(batches)
    start = time.perf_counter()
    for _ in range(steps):
        metrics = {k: float(v) for k, v in learner.train_step(batches, n_tokens, n_seqs).items()}
    return (time.perf_counter() - start) / steps, metrics


def _learner_rows(learner, config, processor, s: Settings, budget: int, row: dict, reset,
                  peak_gb):
    """A row per count of `s.micro_batches_per_step` at micro-batches of `budget` tokens: one
    warm-up step on the fewest of them (kernels, compiles, optimizer state: first_step_s), then
    `s.timed_steps` steps on each count's first (fullest) micro-batches. reset(): before the
    warm-up; peak_gb(): the peak memory since. A failure becomes its row, with its traceback."""
    try:
        batches = grpo_batches(config, processor, s, budget, max(s.micro_batches_per_step))
        reset()
        first, _ = _timed_steps(learner, batches[:min(s.micro_batches_per_step)], 1)
    except Exception:  # noqa: BLE001  (reported; the next measurement still runs)
        yield _failed(row)
        return
    for k in s.micro_batches_per_step:
        try:
            seconds, metrics = _timed_steps(learner, batches[:k], s.timed_steps)
            yield _learner_row(dict(row), config, processor, batches[:k], first, seconds,
                               metrics, peak_gb(), s)
        except Exception:  # noqa: BLE001
            yield _failed({**row, "micro_batches": k})


def _learner_row(row: dict, config, processor, batches, first: float, seconds: float,
                 metrics: dict, peak_gb: float, s: Settings) -> dict:
    row.update(micro_batches=len(batches), loss=metrics["loss"], grad_norm=metrics["grad_norm"],
               first_step_s=first, peak_memory_gb=peak_gb)
    return _throughput(row, float(sum(b.num_tokens for b in batches)), seconds,
                       train_flops(config, batches, processor), s.peak_tflops)


def learner_kernel(device) -> str:
    """The attention kernel of the torch learner's packed rows on `device` (a torch.device):
    "varlen" where `geo3k_torch.attention.uses_varlen` takes a bf16 query there (CUDA under the
    bf16 policy, a torch with varlen), else "packed_sdpa"."""
    import torch

    from geo3k_torch import attention

    query = torch.empty(1, 1, 1, 8, dtype=torch.bfloat16, device=device)
    return "varlen" if device.type == "cuda" and attention.uses_varlen(query) else "packed_sdpa"


def use_kernel(kernel: str, device) -> str | None:
    """Route the torch learner's packed rows to `kernel` (TORCH_KERNELS); returns why this
    branch or machine cannot, or None."""
    import torch

    from geo3k_torch import attention

    switch = getattr(attention, "uses_varlen", None)
    original = getattr(attention, "_uses_varlen_original", switch)
    if switch is not None:
        attention._uses_varlen_original = original
        attention.uses_varlen = original if kernel == "varlen" else (lambda query: False)
    if kernel == "packed_sdpa":
        return None
    if switch is None:
        return "this branch has no varlen path (geo3k_torch.attention.uses_varlen)"
    if not original(torch.empty(1, 1, 1, 8, dtype=torch.bfloat16, device=device)):
        return "varlen needs CUDA, bf16 and torch.nn.attention.varlen"
    return None


def _torch_memory(device):
    """(reset, peak GB since) of the device's memory: the CUDA allocator's, or the host's peak
    resident memory (which cannot be reset)."""
    import torch

    if device.type != "cuda":
        return (lambda: None), host_peak_gb

    def reset():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)

    return reset, lambda: torch.cuda.max_memory_allocated(device) / 2 ** 30


# learner_torch's configurations, most telling first (a section stopped at its cap keeps the rows
# before; the report names those left out): a label and the cfg.train settings it changes from
# the recipe (configs/base.py), each measured at the largest micro-batch. Compiling cannot be
# undone: compiled rows come last, but for a configuration built anew. Another configuration is
# one more line: `_switch` sets what it can on the built learner, and any other setting (not in
# `IN_PLACE`) builds it again.
LEARNER_PLAN = (
    ("recipe", {}),
    ("fused_head", {"fused_head": True}),
    ("compiled", {"fused_head": True, "compile": True}),
    # the learner as the earlier checks measured it: FSDP2 at world size 1 (a new build)
    ("fsdp", {"fsdp": "always"}),
)
# The cfg.train settings that `_switch` sets on a built learner (compile only from off to on).
IN_PLACE = ("activation_checkpointing", "checkpoint_vision", "compile", "compile_backend",
            "fused_head", "micro_batch_tokens")
RECORDED = ("activation_checkpointing", "checkpoint_vision", "fused_head", "compile",
            "fsdp")  # per row


def learner_plan(s: Settings) -> list[tuple[str, dict]]:
    """`LEARNER_PLAN` at micro-batches of the largest `s.micro_batch_tokens`; on a CPU (the
    rehearsal) without checkpointing, as the CPU learner loads, and with `s.all_modes` the other
    checkpointing modes and the other attention kernel ("kernel", `TORCH_KERNELS`) before the
    compiled rows."""
    recipe = {"micro_batch_tokens": max(s.micro_batch_tokens)}
    mode = base.get_config().train.activation_checkpointing
    if s.device != "cuda":
        recipe["activation_checkpointing"] = mode = "none"
    plan = [(label, recipe | o) for label, o in LEARNER_PLAN]
    if s.all_modes:
        from geo3k_torch.model import CHECKPOINTING
        at = next((i for i, (_, o) in enumerate(plan) if o.get("compile")), len(plan))
        kernel = "varlen" if s.device == "cuda" else "packed_sdpa"
        plan[at:at] = ([(m, recipe | {"activation_checkpointing": m}) for m in CHECKPOINTING
                        if m != mode]
                       + [(k, recipe | {"kernel": k}) for k in TORCH_KERNELS if k != kernel])
    return plan


def _switch(learner, train, state: dict) -> None:
    """The built `learner` as `train` (a cfg.train) sets `IN_PLACE`: checkpointing and compiled
    blocks (`geo3k_torch.model`), the fused head. `state` holds what the model has now (the
    keys of `_model_state`), updated; the model is compiled or switched only on a change."""
    from geo3k_torch.model import checkpoint_layers, compile_layers

    want = _model_state(train)
    if want != state:
        if want["compile"]:
            compile_layers(learner.model, want["activation_checkpointing"],
                           want["checkpoint_vision"], want["compile_backend"])
        else:
            checkpoint_layers(learner.model, want["activation_checkpointing"],
                              want["checkpoint_vision"])
        state.clear()
        state.update(want)
    learner.fused_head = train.fused_head


def _model_state(train) -> dict:
    return {k: train[k] for k in ("compile", "activation_checkpointing", "checkpoint_vision",
                                  "compile_backend")}


def learner_torch(s: Settings):
    """Rows of `learner_plan`, in order: per configuration its `s.micro_batches_per_step` rows
    (`_learner_rows`), each naming its configuration (`config`), attention kernel and the
    settings of `RECORDED` and of the plan's own overrides."""
    import torch

    device = torch.device(s.device)
    plan = learner_plan(s)
    recorded = list(dict.fromkeys(list(RECORDED) + [k for _, o in plan for k in o
                                                    if k not in ("kernel", "micro_batch_tokens")]))
    run, built, state = None, None, {}
    try:
        for label, overrides in plan:
            kernel = overrides.get("kernel", learner_kernel(device))
            row = {"framework": "torch", "config": label, "kernel": kernel}
            why = use_kernel(kernel, device)
            if why:
                yield {**row, "status": "skipped", "note": why}
                continue
            cfg = _config(s, max(s.micro_batch_tokens))
            cfg.train.update({k: v for k, v in overrides.items() if k != "kernel"})
            rebuild = {k: v for k, v in cfg.train.items() if k not in IN_PLACE}
            if run is None or rebuild != built or (state["compile"] and not cfg.train.compile):
                if run is not None:
                    _close(run)
                run, built = _build("torch", s, "learner_torch", cfg), rebuild
                mode = cfg.train.activation_checkpointing if device.type == "cuda" else "none"
                state = _model_state(cfg.train) | {"activation_checkpointing": mode}
            _switch(run.learner, cfg.train, state)
            budget = cfg.train.micro_batch_tokens
            row |= {k: cfg.train[k] for k in recorded} | {"micro_batch_tokens": budget}
            reset, peak = _torch_memory(device)
            yield from _learner_rows(run.learner, run.learner.model.config, run.processor, s,
                                     budget, row, reset, peak)
    finally:
        if run is not None:
            _close(run)


# learner_moe's model: Qwen3-VL-30B-A3B's shapes (every decoder layer a sparse block of 128 experts
# of 768, top 8; 32 query and 4 KV heads of 128; the published vision tower, 27 blocks of 1152) with
# 3 of its 48 decoder layers, so that one 80 GB H100 trains it. The recipe's one-GPU learner holds
# per parameter (`geo3k_torch.precision.MasterWeights`) the fp32 master 4 B, its bf16 copy 2, the
# fp32 gradient accumulator 4 and AdamW's two moments 8, and the local engine its bf16 copy 2: 20 B.
# A decoder layer has 623,120,640 parameters (experts 603,979,776, attention 18,874,368, router
# 262,144; counted on the meta device): 11.6 GiB; the rest (vision tower 538.6 M, embedding and LM
# head 311.2 M each) 1.161 B: 21.6 GiB. Of the card's ~78 GiB, about 20 are kept for activations and
# workspaces at 32k-token micro-batches under full checkpointing (an estimate: the 2B's measured
# 41.4 GiB peak at 16k, less its 35.7 GiB of weights and optimizer state under FSDP2's 18 B a
# parameter, leaves 5.7; a MoE layer recomputed at 32k tokens routes 262k (token, expert) pairs,
# about 1 GiB a bf16 tensor of the hidden size): (78 - 21.6 - 20) / 11.6 = 3.1, so 3 layers (56.5
# GiB before activations; 4 would leave 10 GiB). The tower's three DeepStack features still each
# reach a layer (they feed layers 0-2). MFU counts the weights a token meets (`train_flops` via
# `common.flops`: attention, the router and the top 8 experts): 56.9 M a layer, 171 M for the 3,
# beside the LM head's 311 M per trained token, so the layers are under half of the row's model
# FLOPs and its MFU is not the 48-layer model's.
MOE_SHAPES = ("qwen3_vl_30b_a3b", 3)
MOE_LABEL = "moe, MFU on active weights"


def learner_moe(s: Settings):
    """Learner steps of a MoE model: `MOE_SHAPES` (on a CPU, the tiny MoE of
    `geo3k_torch.tiny`), trained as the recipe trains (`learner_plan`'s first configuration),
    with its experts as `geo3k_torch.experts.experts_implementation` runs them (grouped_mm where
    torch's grouped matmul runs: `experts_kernel`). Its `s.micro_batches_per_step` rows
    (`_learner_rows`) give tokens/s and MFU on the weights a token meets, not on all experts
    (`train_flops`), and name the shapes, decoder layers, experts and top k."""
    shapes, layers = MOE_SHAPES
    moe = dataclasses.replace(s, shapes=shapes, text_layers=layers)
    _, recipe = learner_plan(moe)[0]
    budget = recipe["micro_batch_tokens"]
    cfg = _config(moe, budget)
    cfg.train.update(recipe)
    run = _build("torch", moe, "learner_moe", cfg)
    try:
        learner = run.learner
        config = learner.model.config
        text = config.text_config
        row = {"framework": "torch", "config": MOE_LABEL, "kernel": learner_kernel(learner.device),
               "shapes": shapes + (" (tiny)" if s.tiny else ""),
               "layers": text.num_hidden_layers, "experts": text.num_experts,
               "top_k": text.num_experts_per_tok, "experts_kernel": text._experts_implementation,
               **{k: cfg.train[k] for k in RECORDED}, "micro_batch_tokens": budget}
        reset, peak = _torch_memory(learner.device)
        yield from _learner_rows(learner, config, run.processor, moe, budget, row, reset, peak)
    finally:
        _close(run)


def learner_jax(s: Settings):
    import jax

    run = _build("jax", s, "learner_jax", _config(s, max(s.micro_batch_tokens)))
    learner, processor = run.learner, run.processor
    try:
        for budget in s.micro_batch_tokens:
            learner.row_len = budget  # the learner's rows: this micro-batch size
            row = {"framework": "jax", "kernel": "windowed", "micro_batch_tokens": budget}
            yield from _learner_rows(learner, learner.config, processor, s, budget, row,
                                     lambda: None, lambda: _jax_peak_gb(jax))
    finally:
        _close(run)


def _jax_peak_gb(jax) -> float:
    """The device's peak bytes in use so far (JAX cannot reset it: a later row includes the
    earlier ones'), or the host's peak on a CPU."""
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return stats["peak_bytes_in_use"] / 2 ** 30
    return host_peak_gb()


# ---- engines ---------------------------------------------------------------------------------
def _requests(config, processor, s: Settings, tag: str) -> list[Request]:
    """`s.episodes` first turns: groups of `s.samples_per_group` sharing a prompt and image,
    no stop token (every episode samples exactly `s.new_tokens`)."""
    rng = np.random.default_rng(0)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=s.new_tokens)
    out = []
    for g in range(math.ceil(s.episodes / s.samples_per_group)):
        ids, image = _prompt(config, processor, s.image_px, rng)
        out += [Request(ids, [image], sampling, session=f"{tag}-{g}-{k}", group=f"{tag}-{g}")
                for k in range(s.samples_per_group)]
    return out[:s.episodes]


def _engine_row(row: dict, engine, config, processor, s: Settings, peak) -> dict:
    """Two calls on the same episodes (fresh caches): the first warms up (JAX compiles), the
    second is timed."""
    times = []
    for call in ("first", "second"):
        requests = _requests(config, processor, s, call)
        engine.clear_cache()
        start = time.perf_counter()
        done = engine.generate(requests)
        times.append(time.perf_counter() - start)
    tokens = float(sum(len(c.token_ids) for c in done))
    return _throughput({**row, "episodes": len(done), "new_tokens": s.new_tokens,
                        "first_call_s": times[0], "peak_memory_gb": peak()},
                       tokens, times[1], None, None)


# The torch engine's decode fast paths (configs/base.py's engine.local_*, off in the recipe until
# measured), timed in each engine_torch row beside the recipe's engine as fast_*: slots and CUDA
# graphs kept across calls (its first call captures and compiles, the timed second one reuses
# them), attention over the longest position in buckets of 256, the step compiled by inductor,
# the sampling inside the graph.
FAST_ENGINE = dict(keep_slots=True, attention_bucket=256, compile=True, graph_sampling=True)


def engine_torch(s: Settings):
    from geo3k_torch.engine import LocalEngine

    run = _build("torch", s, "engine_torch", _config(s, max(s.micro_batch_tokens)))
    reset, peak = _torch_memory(run.learner.device)
    plain, config = run.backend.engine, run.learner.model.config
    fast = LocalEngine(plain.model, plain.processor, plain.pad_id, device=plain.device,
                       max_batch=plain.max_batch, kv_budget_gb=plain.kv_budget / 2 ** 30,
                       cuda_graphs=plain.cuda_graphs, **FAST_ENGINE)
    try:
        for episodes in (s.episodes, s.more_episodes):
            at = dataclasses.replace(s, episodes=episodes)
            reset()
            row = _engine_row({"framework": "torch", "kernel": ENGINE_KERNEL}, plain, config,
                              run.processor, at, peak)
            reset()
            quick = _engine_row({}, fast, config, run.processor, at, peak)
            fast.release()  # its slots and graphs, before the next row's plain engine
            row |= {f"fast_{k}": quick[k] for k in ("first_call_s", "tokens_per_s",
                                                    "peak_memory_gb")}
            yield row | {"fast_speedup": quick["tokens_per_s"] / row["tokens_per_s"]}
    finally:
        _close(run)


def engine_jax(s: Settings):
    import jax

    run = _build("jax", s, "engine_jax", _config(s, max(s.micro_batch_tokens)))
    try:
        yield _engine_row({"framework": "jax"}, run.backend.engine, run.learner.config,
                          run.processor, s, lambda: _jax_peak_gb(jax))
    finally:
        _close(run)


# ---- where the time goes ---------------------------------------------------------------------
PROFILE_ROWS = 10  # top kernels (and ops by shape) per phase in the check's report (files: 25)
SYNC_SITES = 15  # the learner's sync sites in OUT/profile_torch.json and .md


def _profiled(work, cuda: bool, shapes: bool = False):
    """(the finished torch.profiler profile, wall ms) of `work()`: CPU and, on a GPU, CUDA
    activities; input shapes recorded only with `shapes` (it slows the host's dispatch)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=shapes) as prof:
        start = time.perf_counter()
        work()
        if cuda:
            torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - start) * 1e3
    return prof, wall_ms


def _kernel_profile(work, steps: int, cuda: bool) -> dict:
    """A profile without shapes of `work()`, which runs `steps` steps: profiled_step_ms (its
    wall time a step: slower than unprofiled), kernel_ms_per_step (the time the GPU's kernels
    cover, `gpu_profile.busy_time`; a CPU: the ops' self time), kernels_per_step (a CPU: ops),
    host_wait_ms_per_step (`gpu_profile.host_wait_ms`; "n/a" on a CPU) and the top 25 kernels or
    ops by time (`gpu_profile.top_ops`)."""
    prof, wall_ms = _profiled(work, cuda)
    timed, intervals = gpu_profile.profile_events(prof, cuda)
    busy_ms = gpu_profile.busy_time(intervals) / 1e3 if cuda else sum(ms for _, ms in timed)
    return {"profiled_step_ms": wall_ms / steps, "kernel_ms_per_step": busy_ms / steps,
            "kernels_per_step": len(timed) / steps,
            "host_wait_ms_per_step": gpu_profile.host_wait_ms(prof) / steps if cuda else "n/a",
            "top": gpu_profile.top_ops(timed, wall_ms, steps)}


def _shape_table(work, steps: int, cuda: bool) -> list[dict]:
    """The top 25 ops by name and input shapes (`gpu_profile.shaped_ops`) of a profile with
    shapes recorded of `work()` (`steps` steps); shares are of that profile's wall time."""
    prof, wall_ms = _profiled(work, cuda, shapes=True)
    return gpu_profile.top_ops(gpu_profile.shaped_ops(prof, cuda), wall_ms, steps)


def _phase_steps(learner, batches, steps: int, cuda: bool) -> dict:
    """`steps` unprofiled learner steps on `batches` timed by phase (`gpu_profile.step_phases`):
    step_ms, from the call to the end of its work (a GPU: CUDA events on the device's timeline;
    a CPU: perf_counter), and the mean ms of each phase, <phase>_ms (`gpu_profile.PHASES`,
    summing to step_ms)."""
    n_tokens, n_seqs = step_counts(batches)
    with gpu_profile.step_phases(learner, cuda) as clock:
        for _ in range(steps):
            clock.mark("step")
            learner.train_step(batches, n_tokens, n_seqs)  # (its metrics are host floats)
            clock.mark("end")
    marks = clock.read()
    each = [gpu_profile.phase_ms(m) for m in marks]
    return {"steps": steps, "step_ms": float(np.mean([m[-1][1] - m[0][1] for m in marks])),
            **{f"{k}_ms": float(np.mean([e[k] for e in each])) for k in gpu_profile.PHASES}}


def _wall_ms(work, cuda: bool) -> float:
    import torch

    start = time.perf_counter()
    work()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def profile_torch(s: Settings):
    """Where the learner's and the engine's time goes, the recipe as configured, on the fewest of
    `s.micro_batches_per_step` micro-batches of the largest size (after a warm-up step), and on
    engine calls of `s.episodes` x `s.profile_new_tokens` tokens (after a warm-up call):

        step_ms            `s.timed_steps` unprofiled steps (calls); the learner's by phase,
                           <phase>_ms (`_phase_steps`)
        kernel_ms_per_step ...  one step (call) profiled without shapes (`_kernel_profile`)
        gpu_idle           1 - kernel_ms_per_step / step_ms (`gpu_profile.idle_share`)
        host_syncs_per_step  the learner's, one more step (`gpu_profile.host_syncs`)
        ops by shape       the learner's, one step profiled with shapes (`_shape_table`)

    Rows: per phase (learner, engine) its summary and its top `PROFILE_ROWS` kernels (table
    "kernels"; a CPU: "ops"), the learner's then its top ops by shape (table "ops by shape");
    the top 25 of each also in OUT/profile_torch.json and OUT/profile_torch.md, with the
    learner's top `SYNC_SITES` sync sites."""
    budget = max(s.micro_batch_tokens)
    run = _build("torch", s, "profile_torch", _config(s, budget))
    learner, processor, engine = run.learner, run.processor, run.backend.engine
    config, device = learner.model.config, learner.device
    cuda = device.type == "cuda"
    kernels = {"learner": learner_kernel(device), "engine": ENGINE_KERNEL}
    phases: dict[str, dict] = {}
    try:
        try:
            batches = grpo_batches(config, processor, s, budget, min(s.micro_batches_per_step))
            step = lambda: _timed_steps(learner, batches, 1)  # noqa: E731
            step()  # kernels, allocator, optimizer state
            timing = _phase_steps(learner, batches, s.timed_steps, cuda)
            profiled = _kernel_profile(step, 1, cuda)
            syncs = _step_syncs(learner, batches, cuda)
            sites = [{"site": k, "count": n} for k, n in syncs.sites.most_common(SYNC_SITES)]
            unsited = syncs.n - sum(syncs.sites.values())
            if cuda and unsited > 0:  # waits no aten op made (streams, events)
                sites.append({"site": "(no aten op: a stream or event wait)", "count": unsited})
            phases["learner"] = _summary(timing, profiled, cuda) | {
                "host_syncs_per_step": syncs.n, "sync_sites": sites}
            yield from _profile_rows("learner", kernels["learner"], phases["learner"], cuda)
            phases["learner"]["top_shapes"] = _shape_table(step, 1, cuda)
            yield from _profile_rows("learner", kernels["learner"], phases["learner"], cuda,
                                     shapes=True)
        except Exception:  # noqa: BLE001  (reported; the engine is still profiled)
            yield _failed({"framework": "torch", "kernel": kernels["learner"], "phase": "learner"})
        try:
            few = dataclasses.replace(s, new_tokens=s.profile_new_tokens)
            calls = [_requests(config, processor, few, f"call{k}")
                     for k in range(s.timed_steps + 2)]

            def generate(requests):
                engine.clear_cache()  # every call prefills
                engine.generate(requests)

            generate(calls[0])  # warm-up
            wall = _wall_ms(lambda: [generate(r) for r in calls[1:-1]], cuda)
            timing = {"steps": s.timed_steps, "step_ms": wall / s.timed_steps}
            phases["engine"] = _summary(timing, _kernel_profile(
                lambda: generate(calls[-1]), 1, cuda), cuda)
            yield from _profile_rows("engine", kernels["engine"], phases["engine"], cuda)
        except Exception:  # noqa: BLE001
            yield _failed({"framework": "torch", "kernel": kernels["engine"], "phase": "engine"})
    finally:
        _close(run)
        _write_profile(Path(s.out), s, kernels, phases)


def _summary(timing: dict, profiled: dict, cuda: bool) -> dict:
    """An unprofiled timing and a profile (`_kernel_profile`) with the idle share of the two."""
    idle = (gpu_profile.idle_share(profiled["kernel_ms_per_step"], timing["step_ms"])
            if cuda else "n/a")
    return {**timing, **profiled, "gpu_idle": idle}


def _step_syncs(learner, batches, cuda: bool):
    """One learner step's host syncs (`gpu_profile.host_syncs`) with their sites; its metrics
    are read after the count, as the loop does. Should the sites' dispatch mode break the step
    on a GPU, a second step is counted without sites."""
    try:
        with gpu_profile.host_syncs(cuda) as syncs:
            metrics = learner.train_step(batches, *step_counts(batches))
    except Exception:  # noqa: BLE001  (the count alone, then)
        if not cuda:
            raise
        traceback.print_exc()
        with gpu_profile.host_syncs(cuda, sites=False) as syncs:
            metrics = learner.train_step(batches, *step_counts(batches))
    float(metrics["loss"])  # waits for the step
    return syncs


LISTS = ("top", "top_shapes", "sync_sites")  # a phase's tables, not its summary


def _profile_rows(phase: str, kernel: str, profiled: dict, cuda: bool, shapes: bool = False):
    """The summary row and the top `PROFILE_ROWS` kernels' rows of a phase; with `shapes`, its
    top ops by shape instead."""
    base = {"framework": "torch", "kernel": kernel, "phase": phase}
    if shapes:
        for op in profiled["top_shapes"][:PROFILE_ROWS]:
            yield {**base, "table": "ops by shape", **op}
        return
    yield {**base, **{k: v for k, v in profiled.items() if k not in LISTS}}
    for op in profiled["top"][:PROFILE_ROWS]:
        yield {**base, "table": "kernels" if cuda else "ops", **op}


def _write_profile(out: Path, s: Settings, kernels: dict, phases: dict) -> None:
    """OUT/profile_torch.json (the phases as measured) and OUT/profile_torch.md (tables)."""
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    (out / "profile_torch.json").write_text(json.dumps(
        {"device": device, "torch": torch.__version__, "kernels": kernels, "phases": phases},
        indent=1))
    lines = [f"# torch profile: {device}", "",
             f"torch {torch.__version__}; {s.shapes}{' (tiny)' if s.tiny else ''}; attention: "
             f"learner {kernels['learner']}, engine {kernels['engine']}. Step times are of "
             "unprofiled steps; kernel time is the GPU kernels' (on a CPU: the ops' self time) "
             "in a step profiled without shapes; GPU idle is 1 - kernel time / step time; "
             "shares are of the profiled step's wall time.", ""]
    for phase, p in phases.items():
        idle = p["gpu_idle"] if isinstance(p["gpu_idle"], str) else f"{p['gpu_idle']:.1%}"
        syncs = (f", {p['host_syncs_per_step']} host syncs a step"
                 if "host_syncs_per_step" in p else "")
        wait = ("" if isinstance(p["host_wait_ms_per_step"], str) else
                f", the host waiting for the device {p['host_wait_ms_per_step']:.1f} ms of it")
        lines += [f"## {phase}: {p['step_ms']:.1f} ms a step (over {p['steps']}; profiled "
                  f"{p['profiled_step_ms']:.1f} ms), GPU idle {idle}{syncs}, "
                  f"{p['kernels_per_step']:,.0f} kernels a step{wait}", ""]
        split = {k.removesuffix("_ms"): p[k] for k in p if k.removesuffix("_ms")
                 in gpu_profile.PHASES}
        if split:
            lines += ["Milliseconds a step by phase (unprofiled): " + ", ".join(
                f"{k} {v:.1f}" for k, v in split.items()) + ".", ""]
        lines += gpu_profile.table(p["top"]) + [""]
        if p.get("top_shapes"):
            lines += [f"The {phase}'s ops by input shapes (one step profiled with shapes; on a "
                      "GPU the time of the kernels each op launched itself):", ""]
            lines += gpu_profile.table(p["top_shapes"]) + [""]
        if p.get("sync_sites"):
            lines += [f"Where the {phase}'s host syncs of one step come from (the innermost "
                      "frame outside torch, and on a GPU the aten op):", ""] + gpu_profile.table(p["sync_sites"]) + [""]
    (out / "profile_torch.md").write_text("\n".join(lines))


def step_tokens(episodes, batches) -> dict[str, float]:
    """A GRPO step's tokens counted two ways. computed_tokens: those of the learner's packed
    micro-batches `batches` (what its forward and backward ran over; with `train.share_prefix`
    a group's prompt once). easyr1_tokens: EasyR1's count, every episode's prompt and response
    tokens (`episodes`, each with its token_ids), so the prompt counts once per episode: a group
    of n episodes counts its shared prompt n times."""
    return {"computed_tokens": float(sum(b.num_tokens for b in batches)),
            "easyr1_tokens": float(sum(len(e.token_ids) for e in episodes))}


def whole_step(s: Settings):
    """`s.timed_steps` GRPO steps after a warm-up one, as the loop runs them (`common.step`'s
    `grpo_step`: rollout, advantages, packing, update; then the backend's weight sync), of
    `s.episodes / s.samples_per_group` prompts of the synthetic set with `s.samples_per_group`
    episodes each (turns of at most `s.new_tokens` tokens, env.max_turns as the recipe), the
    torch learner and its local engine on one device. One row: seconds per step of each phase,
    tokens per step as the learner computed them and as EasyR1 counts them (`step_tokens`:
    every episode's prompt with its image tokens and all its turns), each per GPU-second of the
    whole step. With random weights, episodes rarely call the tool: most end after their first
    turn (turns_mean says)."""
    from common import train as loop
    from common.prepare import make_renderer
    from common.step import grpo_step
    from common.timing import timed

    prompts = s.episodes // s.samples_per_group
    cfg = _config(s, s.step_micro_batch_tokens)
    cfg.data.synthetic_dir = str(Path(s.out) / "whole_step_data")  # its own size of set
    cfg.data.synthetic_train_size = cfg.train.prompts_per_step = prompts
    cfg.data.synthetic_image_size = str(s.image_px)
    cfg.rollout.n_samples, cfg.rollout.max_response_tokens = s.samples_per_group, s.new_tokens
    cfg.advantage.filter_equal_groups = False  # random weights reward no group: train on all
    run = _build("torch", s, "whole_step", cfg)
    learner, backend = run.learner, run.backend
    step_cfg = loop.step_config(cfg, run.processor)
    renderer = run.renderer or make_renderer(cfg, run.processor)
    reset, peak = _torch_memory(learner.device)
    reset()
    trained, train_step = [], learner.train_step

    def counted(batches, *args, **kwargs):  # the micro-batches the learner is given
        trained.extend(batches)
        return train_step(batches, *args, **kwargs)

    learner.train_step = counted
    steps = []
    try:
        for step in range(s.timed_steps + 1):  # step 0 warms up
            trained.clear()
            start = time.perf_counter()
            trajs, m = grpo_step(list(run.train_set), backend.engine, renderer, learner, step_cfg,
                                 step * prompts, run.comm, backend.train_context)
            with timed(m, "weight_sync"):
                backend.sync(learner, step + 1)
            steps.append({**m, "step_s": time.perf_counter() - start,
                          **step_tokens(trajs, trained),
                          "generated": float(sum(t.num_generated for t in trajs)),
                          "turns": float(sum(len(t.turns) for t in trajs)),
                          "episodes": float(len(trajs))})
        mean = lambda k: float(np.mean([m[k] for m in steps[1:]]))  # noqa: E731
        per_gpu_s = mean("step_s") * run.comm.world  # GPU-seconds of a step
        yield {"framework": "torch", "kernel": learner_kernel(learner.device),
               "engine_kernel": ENGINE_KERNEL, "share_prefix": cfg.train.share_prefix,
               "prompts": prompts, "episodes": mean("episodes"),
               "turns_mean": mean("turns") / mean("episodes"), "steps": len(steps) - 1,
               "first_step_s": steps[0]["step_s"], "step_s": mean("step_s"),
               "rollout_s": mean("time_rollout"), "train_s": mean("time_train"),
               "sync_s": mean("time_weight_sync"), "computed_tokens": mean("computed_tokens"),
               "easyr1_tokens": mean("easyr1_tokens"), "generated_tokens": mean("generated"),
               "computed_tokens_per_gpu_s": mean("computed_tokens") / per_gpu_s,
               "easyr1_tokens_per_gpu_s": mean("easyr1_tokens") / per_gpu_s,
               "rollout_tokens_per_s": mean("generated") / mean("time_rollout"),
               "peak_memory_gb": peak()}
    finally:
        del learner.train_step
        _close(run)


SECTIONS = {f.__name__: f for f in (e2e_torch, learner_torch, engine_torch,  # run in this order
                                    profile_torch, whole_step, learner_moe, learner_jax, e2e_jax,
                                    engine_jax)}
JAX_SECTIONS = ("e2e_jax", "learner_jax", "engine_jax")
PLANS = {"learner_torch": learner_plan}  # a section's planned configurations (labels first)
