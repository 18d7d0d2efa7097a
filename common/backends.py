"""The one place a run's `engine.backend` becomes a rollout backend, for both learners.

    backend = make_backend(cfg, own=lambda: MyBackend(...), own_kind="jax", model_dir=model_dir,
                           processor=processor, workdir=workdir, comm=comm)

`local` is the learner's own in-process engine (`own`, built by the learner's entry point: the
torch engine on the torch model, the JAX engine on the JAX learner's parameters); `torch` is the
in-process torch engine (the learner's own for `own_kind="torch"`, else a CPU engine loaded from
each step's export); `sglang` is SGLang servers (`common.sglang.backend`). A backend's framework
is imported only when it is named, so `common/` itself never imports torch or jax.
"""

from __future__ import annotations

from typing import Callable

from common.learner import Collectives

ENGINE_BACKENDS = ("local", "torch", "sglang")


def make_backend(cfg, *, own: Callable[[], object], own_kind: str, model_dir: str, processor,
                 workdir: str, comm: Collectives, free_memory: Callable[[], None] = lambda: None,
                 weights=None):
    """The `common.engine.Backend` that `cfg.engine.backend` names. free_memory: the learner's
    hook that hands cached accelerator memory back before SGLang servers take theirs. weights:
    the learner's `common.sglang.backend.TensorWeights` (None: SGLang loads its HF export)."""
    name = cfg.engine.backend
    if name == "local" or name == own_kind:
        return own()
    if name == "torch":
        from geo3k_torch.backend import LocalBackend, engine_settings
        return LocalBackend(processor, model_dir, seed=cfg.seed, device="cpu", comm=comm,
                            workdir=workdir, **engine_settings(cfg))
    if name == "sglang":
        from common.sglang.backend import SGLangBackend
        return SGLangBackend(cfg, model_dir, processor, workdir, comm, free_memory=free_memory,
                             weights=weights)
    raise ValueError(f"engine.backend must be one of {ENGINE_BACKENDS}, got {name!r}")
