"""The measurements of `scripts/gpu_check.py`, one function per section, each run in a process
of its own (a CUDA error or an out-of-memory cannot take the other sections down).

    e2e_torch / e2e_jax       the quick CPU run (configs/cpu.py) trained end to end on the machine's
                              accelerator through each entry point's own `build` and the shared
                              loop: reward, tool-call rate, seconds per phase (from metrics.jsonl)
    learner_torch / learner_jax  learner steps of a random-initialised model with a published
                              model's shapes (configs/models) on packed micro-batches of 8k and
                              16k tokens (GRPO groups sharing their prompt and image): tokens/s,
                              MFU, peak memory; torch once per attention kernel
    engine_torch / engine_jax  the in-process engines sampling 64 episodes x 512 tokens from the
                              same model: tokens/s and peak memory

The learners and engines are the ones `geo3k_torch.main.build` / `geo3k_jax.train.build` make
(device, process group, loading, sharding, dtype policy, backend) from a checkpoint directory
written here: the published config, random bf16 weights, and the Qwen tokenizer and processor
files of `geo3k_torch.tiny` (no download). The recipe's settings are configs/base.py's, with
`jax.compute_dtype=bfloat16` and `jax.remat=True`.

Each section yields rows (flat dicts of numbers and strings) as it measures them; a measurement
that raises becomes a row with status "failed" and its traceback, and the next one still runs.
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

# The torch learner's kernels for packed rows. "varlen" (one torch.nn.attention.varlen call per
# layer) is chosen by `geo3k_torch.attention.uses_varlen` where that switch exists; "packed_sdpa"
# is its per-segment sdpa path. `use_kernel` is the one place that selects them.
TORCH_KERNELS = ("varlen", "packed_sdpa")
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
    e2e_steps: int = 10
    micro_batch_tokens: tuple[int, ...] = (8192, 16384)
    micro_batches_per_step: int = 2
    timed_steps: int = 3
    samples_per_group: int = 8
    response_tokens: tuple[int, int] = (256, 1536)  # uniform range of a sample's response
    image_px: int = 448
    episodes: int = 64
    new_tokens: int = 512

    @classmethod
    def tiny_settings(cls, out: str, peak_tflops: float | None) -> Settings:
        return cls(out, tiny=True, device="cpu", peak_tflops=peak_tflops, e2e_steps=2,
                   micro_batch_tokens=(256,), timed_steps=1, samples_per_group=4,
                   response_tokens=(32, 96), image_px=64, episodes=8, new_tokens=8)


# ---- the checkpoint ---------------------------------------------------------------------------
def shapes_checkpoint(s: Settings) -> str:
    """A checkpoint directory of `s.shapes` with random bf16 weights (built once per --out);
    with `s.tiny`, `geo3k_torch.tiny`'s own small checkpoint of the same architecture."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from geo3k_torch.tiny import build_tiny_checkpoint

    d = Path(s.out) / "checkpoints" / (s.shapes + ("-tiny" if s.tiny else ""))
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
        config = AutoConfig.from_pretrained(write_config_dir(s.shapes, tmp))
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(tmp)
    tmp.rename(d)
    return str(d)


def _build(framework: str, s: Settings, name: str, budget: int):
    """`geo3k_torch.main.build` or `geo3k_jax.train.build` on the shapes checkpoint."""
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


def grpo_batches(config, processor, s: Settings, budget: int, seed: int = 0):
    """`s.micro_batches_per_step` packed micro-batches of at most `budget` tokens, the fullest
    `common.batching.pack` makes of GRPO groups (`s.samples_per_group` samples sharing a prompt
    with one image, responses of `s.response_tokens` tokens). Returns (batches, masked tokens,
    sequences) of the step."""
    rng = np.random.default_rng(seed)
    seqs, total, group = [], 0, 0
    need = budget * (s.micro_batches_per_step + 1)
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
    batches = sorted(batches, key=lambda b: -b.num_tokens)[:s.micro_batches_per_step]
    n_tokens = float(sum(b.loss_mask.sum() for b in batches))
    n_seqs = float(sum((b.seq_index >= 0).sum() for b in batches))
    return batches, n_tokens, n_seqs


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


def _e2e_row(framework: str, workdir: Path, seconds: float) -> dict:
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    mean = lambda k: float(np.mean([r[k] for r in rows if k in r]))  # noqa: E731
    out = {"framework": framework, "steps": len(rows), "wall_s": seconds,
           "reward_mean": mean("train/reward_mean"), "reward_last": rows[-1]["train/reward_mean"],
           "tool_call_rate": mean("train/tool_call_rate")}
    for k in sorted({k for r in rows for k in r if k.startswith("train/time_")}):
        out[k.removeprefix("train/")] = mean(k)
    if "eval/greedy_accuracy" in rows[-1]:
        out["eval_greedy_accuracy"] = rows[-1]["eval/greedy_accuracy"]
    return out


def e2e_torch(s: Settings):
    from geo3k_torch import main

    workdir = Path(s.out) / "e2e_torch"
    start = time.perf_counter()
    main.train(_e2e_config(s), str(workdir))
    yield _e2e_row("torch", workdir, time.perf_counter() - start)


def e2e_jax(s: Settings):
    from geo3k_jax import train

    workdir = Path(s.out) / "e2e_jax"
    start = time.perf_counter()
    train.train(_e2e_config(s), str(workdir))
    yield _e2e_row("jax", workdir, time.perf_counter() - start)


# ---- learner steps ---------------------------------------------------------------------------
def _failed(row: dict) -> dict:
    return {**row, "status": "failed", "error": traceback.format_exc()}


def _timed_steps(learner, batches, n_tokens: float, n_seqs: float, steps: int):
    """(first step's seconds, mean seconds of `steps` more, the last metrics). A step's
    metrics are read (`dict`), so the time includes the work (a JAX step returns at once)."""
    start = time.perf_counter()
    dict(learner.train_step(batches, n_tokens, n_seqs))  # kernels, compiles, optimizer state
    first = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(steps):
        metrics = dict(learner.train_step(batches, n_tokens, n_seqs))
    return first, (time.perf_counter() - start) / steps, metrics


def _learner_row(row: dict, config, processor, batches, first: float, seconds: float,
                 metrics: dict, peak_gb: float, s: Settings) -> dict:
    row.update(micro_batches=len(batches), loss=float(metrics["loss"]),
               grad_norm=float(metrics["grad_norm"]), first_step_s=first, peak_memory_gb=peak_gb)
    return _throughput(row, float(sum(b.num_tokens for b in batches)), seconds,
                       train_flops(config, batches, processor), s.peak_tflops)


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


def learner_torch(s: Settings):
    import torch

    run = _build("torch", s, "learner_torch", max(s.micro_batch_tokens))
    learner, processor = run.learner, run.processor
    config, device = learner.model.config, learner.device
    on_gpu = device.type == "cuda"
    try:
        for kernel in TORCH_KERNELS:
            why = use_kernel(kernel, device)
            if why:
                yield {"framework": "torch", "kernel": kernel, "status": "skipped", "note": why}
                continue
            for budget in s.micro_batch_tokens:
                row = {"framework": "torch", "kernel": kernel, "micro_batch_tokens": budget}
                try:
                    batches, n_tokens, n_seqs = grpo_batches(config, processor, s, budget)
                    if on_gpu:
                        torch.cuda.empty_cache()
                        torch.cuda.reset_peak_memory_stats(device)
                    first, seconds, metrics = _timed_steps(learner, batches, n_tokens, n_seqs,
                                                           s.timed_steps)
                    peak = (torch.cuda.max_memory_allocated(device) / 2 ** 30 if on_gpu
                            else host_peak_gb())
                    row = _learner_row(row, config, processor, batches, first, seconds,
                                       metrics, peak, s)
                except Exception:  # noqa: BLE001  (reported; the next measurement still runs)
                    row = _failed(row)
                yield row
    finally:
        _close(run)


def learner_jax(s: Settings):
    import jax

    run = _build("jax", s, "learner_jax", max(s.micro_batch_tokens))
    learner, processor = run.learner, run.processor
    try:
        for budget in s.micro_batch_tokens:
            row = {"framework": "jax", "kernel": "windowed", "micro_batch_tokens": budget}
            try:
                learner.row_len = budget  # the learner's rows: this micro-batch size
                batches, n_tokens, n_seqs = grpo_batches(learner.config, processor, s, budget)
                first, seconds, metrics = _timed_steps(learner, batches, n_tokens, n_seqs,
                                                       s.timed_steps)
                row = _learner_row(row, learner.config, processor, batches, first, seconds,
                                   metrics, _jax_peak_gb(jax), s)
            except Exception:  # noqa: BLE001  (reported; the next measurement still runs)
                row = _failed(row)
            yield row
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


def _engine_row(framework: str, engine, config, processor, s: Settings, peak) -> dict:
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
    return _throughput({"framework": framework, "episodes": len(done),
                        "new_tokens": s.new_tokens, "first_call_s": times[0],
                        "peak_memory_gb": peak()}, tokens, times[1], None, None)


def engine_torch(s: Settings):
    import torch

    run = _build("torch", s, "engine_torch", max(s.micro_batch_tokens))
    device = run.learner.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        peak = lambda: torch.cuda.max_memory_allocated(device) / 2 ** 30  # noqa: E731
    else:
        peak = host_peak_gb
    try:
        yield _engine_row("torch", run.backend.engine, run.learner.model.config, run.processor,
                          s, peak)
    finally:
        _close(run)


def engine_jax(s: Settings):
    import jax

    run = _build("jax", s, "engine_jax", max(s.micro_batch_tokens))
    try:
        yield _engine_row("jax", run.backend.engine, run.learner.config, run.processor, s,
                          lambda: _jax_peak_gb(jax))
    finally:
        _close(run)


SECTIONS = {f.__name__: f for f in (e2e_torch, learner_torch, engine_torch,  # run in this order
                                    e2e_jax, learner_jax, engine_jax)}
JAX_SECTIONS = ("e2e_jax", "learner_jax", "engine_jax")
