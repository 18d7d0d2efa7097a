"""Rollout backends for the training loop: the in-process engine or SGLang servers.

A backend owns the engine the rollout talks to and what must happen when the policy changes:
    engine            a `common.engine.Engine`
    sync(model)       after each optimizer step: the engine samples from the new weights next
    train_context()   around the update (colocated SGLang releases its GPU memory there)
    close()           stop what the backend started

local  : `LocalEngine` on the policy itself (one process) or on an unsharded copy that receives
         the full state dict after every step (FSDP); KV caches are dropped on sync.
sglang : `SGLangEngine` over servers given by URL or launched here (rank 0); on sync the weights
         are written as an HF directory and loaded with /update_weights_from_disk, then the
         radix cache is flushed.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch.distributed as dist

from geo3k_torch import checkpoint, distributed
from geo3k_torch.engine import LocalEngine
from geo3k_torch.model import load_model


class LocalBackend:
    def __init__(self, cfg, model, model_dir: str, processor, device, rank: int, world: int):
        self.model = model
        self.copy = None
        if world > 1:  # generation runs unsharded on each rank's own prompts
            self.copy = load_model(model_dir).to(device).eval().requires_grad_(False)
        pad = processor.tokenizer.pad_token_id
        self.engine = LocalEngine(self.copy or model, processor, pad if pad is not None else 0,
                                  seed=cfg.seed + rank, device=device)

    def sync(self, model) -> None:
        if self.copy is not None:
            self.copy.load_state_dict(checkpoint.full_state_dict(model))
        self.engine.clear_cache()  # the KV caches were computed with the old weights

    def train_context(self):
        return contextlib.nullcontext()

    def rng_state(self):
        return self.engine.generator.get_state()

    def set_rng_state(self, state) -> None:
        self.engine.generator.set_state(state)

    def close(self) -> None:
        pass


class SGLangBackend:
    def __init__(self, cfg, model, model_dir: str, processor, workdir: Path, rank: int):
        from common.sglang_engine import SGLangEngine
        from common.sglang_server import launch_servers

        e = cfg.engine
        self.rank, self.model_dir, self.workdir = rank, model_dir, Path(workdir)
        self.colocated, self.group = e.sglang_colocated, None
        urls = [u.strip() for u in e.sglang_urls.split(",") if u.strip()]
        if not urls and rank == 0:
            self.group = launch_servers(
                model_dir, n=e.sglang_servers, gpus_per_server=e.sglang_gpus_per_server,
                mem_fraction=e.sglang_mem_fraction,
                attention_backend=e.sglang_attention_backend or None,
                port_base=e.sglang_port_base, memory_saver=e.sglang_colocated,
                log_dir=str(self.workdir / "sglang_logs"))
            urls = self.group.urls
        urls = distributed.gather(urls)[0]
        self.engine = SGLangEngine(urls, image_token_id=model.config.image_token_id,
                                   processor=processor, timeout_s=e.sglang_timeout_s,
                                   max_retries=e.sglang_max_retries,
                                   max_concurrency=e.sglang_max_concurrency)

    def sync(self, model) -> None:
        path = checkpoint.export_hf(self.workdir / "weights_for_sglang", model, self.model_dir)
        if self.rank == 0:
            self.engine.update_weights_from_disk(str(path.resolve()))
            self.engine.flush_cache()
        if dist.is_initialized():
            dist.barrier()

    @contextlib.contextmanager
    def train_context(self):
        if self.colocated and self.rank == 0:
            self.engine.release_memory()
        if dist.is_initialized():
            dist.barrier()
        try:
            yield
        finally:
            if self.colocated and self.rank == 0:
                self.engine.resume_memory()
            if dist.is_initialized():
                dist.barrier()

    def rng_state(self):
        return None  # SGLang's sampling RNG lives in the servers

    def set_rng_state(self, state) -> None:
        pass

    def close(self) -> None:
        self.engine.close()
        if self.group is not None:
            self.group.shutdown()


def build_backend(cfg, model, model_dir: str, processor, device, rank: int, world: int,
                  workdir: Path):
    """The backend `cfg.engine.backend` names."""
    if cfg.engine.backend == "local":
        return LocalBackend(cfg, model, model_dir, processor, device, rank, world)
    if cfg.engine.backend == "sglang":
        return SGLangBackend(cfg, model, model_dir, processor, workdir, rank)
    raise ValueError(f"engine.backend must be local or sglang, got {cfg.engine.backend!r}")
