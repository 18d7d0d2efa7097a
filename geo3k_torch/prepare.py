"""What a torch run needs before it starts: its device, a model directory, its models.

With `model.path` empty a tiny checkpoint is built into `model.tiny_dir` once, from
`model.tiny_seed` (never the run's `seed`: runs of every seed, in any order, start from the same
checkpoint), and the JAX entry point uses it too. The folder records the settings it was built
from (`tiny_build.json`); a checkpoint of other settings is never reused, and never overwritten.
Real runs point `model.path` at a checkpoint folder or a Hub model name (`common.hub`). The data splits are prepared by
`common.prepare.prepare_data`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import torch

from common.env import EnvConfig
from common.hub import checkpoint_dir
from common.prepare import build_lock, data_keys, data_spec, prepare_data, read_record
from common.prompts import prompt_style
from common.synthetic import parse_image_size
from configs import to_dataclass
from geo3k_torch.model import checkpoint_layers, compile_layers, load_model, load_sharded

PRETRAIN_SEED = 20_000  # + tiny_seed: the vision pretraining's figures (the splits: 0 and 10,000)
BUILD_RECORD = "tiny_build.json"


def tiny_build_spec(cfg) -> dict:
    """The settings a tiny checkpoint of `cfg` is built from: only those its build reads (the
    pretraining's when it pretrains, the priming's, with its data and environment, when it
    primes)."""
    m = cfg.model
    spec = {"arch": m.tiny_arch, "vocab": m.tiny_vocab, "seed": m.tiny_seed}
    if m.tiny_see_steps or m.tiny_caption_steps:  # its figures differ from the data's
        spec.update(see_steps=m.tiny_see_steps, caption_steps=m.tiny_caption_steps,
                    image_size=list(parse_image_size(cfg.data.synthetic_image_size)),
                    distinct_from=data_spec(cfg))
    if m.tiny_prime_steps or m.tiny_prime_later_steps:
        data = data_spec(cfg, cfg.data.train_split)
        spec.update(prime_steps=m.tiny_prime_steps, prime_vision=m.tiny_prime_vision,
                    prime_answer=m.tiny_prime_answer, prime_retry=m.tiny_prime_retry,
                    prompt_style=cfg.data.prompt_style, data=data,
                    env=dataclasses.asdict(to_dataclass(EnvConfig, cfg.env)))
        if m.tiny_prime_later_steps:  # absent at 0: records of earlier builds still match
            spec.update(prime_later_steps=m.tiny_prime_later_steps)
    return json.loads(json.dumps(spec))  # as it reads back from the record


def _check_built(out: Path, cfg) -> None:
    """Raise unless the checkpoint in `out` was built from `tiny_build_spec(cfg)`."""
    kind = json.loads((out / "config.json").read_text()).get("model_type")
    if kind != cfg.model.tiny_arch:
        raise ValueError(f"model.tiny_dir={str(out)!r} holds a {kind} checkpoint but "
                         f"model.tiny_arch={cfg.model.tiny_arch!r}: point tiny_dir at "
                         "another folder (it is built there)")
    have = read_record(out / BUILD_RECORD, ValueError)
    want = tiny_build_spec(cfg)
    if have == want:
        return
    if have is None:
        made = f"with no record of its settings ({BUILD_RECORD})"
    else:
        made = "with " + ", ".join(f"{k}={have.get(k)!r} where this config asks for {want.get(k)!r}"
                                   for k in sorted(set(have) | set(want))
                                   if have.get(k) != want.get(k))
    raise ValueError(f"model.tiny_dir={str(out)!r} holds a tiny checkpoint built {made}: point "
                     "model.tiny_dir at another folder (it is built there), remove this one, or "
                     f"train it as it is with model.path={str(out)!r}")


def prepare_model_dir(cfg) -> str:
    """The checkpoint directory to train: `model.path` (a local folder, or a Hub model name
    downloaded into the Hugging Face cache: `common.hub`), or the tiny one (built if
    missing)."""
    if cfg.model.path:
        return checkpoint_dir(cfg.model.path)
    out = Path(cfg.model.tiny_dir)
    with build_lock(out):
        if (out / "config.json").exists():
            _check_built(out, cfg)
        else:
            _build(out, cfg)
    return str(out)


def _build(out: Path, cfg) -> None:
    """Build the tiny checkpoint of `cfg` into `out` (through `out.tmp`, renamed when done)."""
    from geo3k_torch.pretrain import pretrain_vision
    from geo3k_torch.prime import check_settings, prime_format
    from geo3k_torch.tiny import build_tiny_checkpoint
    check_settings(cfg.model.tiny_prime_answer, cfg.model.tiny_prime_retry)  # before minutes
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"model.tiny_dir={str(out)!r} exists but holds no checkpoint "
                              "(no config.json): remove it or point tiny_dir elsewhere")
    seed = cfg.model.tiny_seed
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    build_tiny_checkpoint(tmp, arch=cfg.model.tiny_arch, vocab=cfg.model.tiny_vocab, seed=seed)
    if cfg.model.tiny_see_steps or cfg.model.tiny_caption_steps:
        seen = pretrain_vision(str(tmp), cfg.model.tiny_see_steps, cfg.model.tiny_caption_steps,
                               PRETRAIN_SEED + seed, image_size=cfg.data.synthetic_image_size,
                               exclude=data_keys(cfg))
        print("vision pretraining, held-out accuracy (chance 0.25): tower "
              f"{seen['tower_accuracy']:.2f}, captions {seen['caption_accuracy']:.2f}")
    if cfg.model.tiny_prime_steps or cfg.model.tiny_prime_later_steps:
        train_set, _ = prepare_data(cfg)
        prime_format(str(tmp), train_set.prompts, cfg.model.tiny_prime_steps, seed,
                     train_vision=cfg.model.tiny_prime_vision,
                     tools=prompt_style(cfg.data.prompt_style)[1],
                     env_config=to_dataclass(EnvConfig, cfg.env),
                     answer=cfg.model.tiny_prime_answer, retry=cfg.model.tiny_prime_retry,
                     later_steps=cfg.model.tiny_prime_later_steps)
    (tmp / BUILD_RECORD).write_text(json.dumps(tiny_build_spec(cfg), indent=1, sort_keys=True)
                                    + "\n")
    shutil.rmtree(out, ignore_errors=True)  # an empty folder at most
    tmp.rename(out)  # a half-built checkpoint is never taken for a finished one


def same_workdir(cfg, name: str) -> str:
    """Rank 0's `name` for the run folder on every rank (`common.cli.main`'s default workdir):
    under torchrun the process group is joined here, before the run is built, and the name
    broadcast; one process keeps its own."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return name
    from geo3k_torch import distributed
    distributed.init(resolve_device(cfg).type, cfg.train.collective_timeout_s)
    box = [name]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def resolve_device(cfg) -> torch.device:
    """cpu / cuda from `train.device`; asking for CUDA without one stops at once."""
    want = cfg.train.device
    if want not in ("auto", "cpu", "cuda"):
        raise ValueError(f"train.device must be auto, cpu or cuda, got {want!r}")
    if want == "cuda" and not torch.cuda.is_available():
        raise SystemExit("this config needs a CUDA GPU (train.device=cuda) and none is visible; "
                         "use --config=configs/cpu.py on a CPU machine")
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


FSDP_MODES = ("auto", "always")


def uses_fsdp(cfg, device: torch.device, world: int) -> bool:
    """Whether the policy is FSDP2-sharded: with several processes; on CUDA alone too under
    `train.fsdp="always"` (with "auto" one GPU trains a plain model over fp32 master weights,
    `geo3k_torch.precision`: the same arithmetic without FSDP's per-micro-batch casts)."""
    if cfg.train.fsdp not in FSDP_MODES:
        raise ValueError(f"train.fsdp must be one of {FSDP_MODES}, got {cfg.train.fsdp!r}")
    return world > 1 or (device.type == "cuda" and cfg.train.fsdp == "always")


def load_policy(cfg, model_dir: str, device: torch.device, world: int, reference: bool = False):
    """The model to train, or with `reference` the frozen KL reference, under the run's one
    dtype policy. With several processes (`uses_fsdp`), it is FSDP2-sharded
    (`geo3k_torch.model.load_sharded`: no rank holds a full copy), with `train.bf16` computing in
    bf16 over fp32 master weights on CUDA; one GPU loads it plainly in fp32 and the learner
    computes in bf16 over it (`geo3k_torch.precision.MasterWeights`). The reference is stored
    in bf16 under `train.bf16` on CUDA: it is never trained. One CPU process trains plainly in
    fp32 (the CPU demo). Activation checkpointing (`train.activation_checkpointing`) on CUDA
    only. `train.compile`: each of its blocks compiled (`geo3k_torch.model.compile_layers`, by
    `train.compile_backend`, the checkpointing inside); the policy's only once
    `train.micro_batch_tokens="auto"` has chosen its checkpointing (`geo3k_torch.memory`).
    `train.expert_parallel`: the policy's experts split over that many ranks (the reference keeps
    plain FSDP: it is never trained)."""
    bf16 = device.type == "cuda" and cfg.train.bf16
    dtype = torch.bfloat16 if reference and bf16 else torch.float32
    mode = cfg.train.activation_checkpointing if device.type == "cuda" and not reference \
        else "none"
    backend = cfg.train.compile_backend if cfg.train.compile and (
        reference or cfg.train.micro_batch_tokens != "auto") else None
    if uses_fsdp(cfg, device, world):
        model = load_sharded(model_dir, device, bf16, dtype, activation_checkpointing=mode,
                             checkpoint_vision=cfg.train.checkpoint_vision,
                             compile_backend=backend,
                             expert_parallel=1 if reference else cfg.train.expert_parallel)
    else:
        model = load_model(model_dir, dtype, device=device)
        if backend:
            compile_layers(model, mode, cfg.train.checkpoint_vision, backend)
        elif device.type == "cuda":
            checkpoint_layers(model, mode, cfg.train.checkpoint_vision)
    return model.eval().requires_grad_(False) if reference else model
