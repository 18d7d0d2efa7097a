"""The in-process torch rollout engine as a `common.engine.Backend` for the training loop.

Three ways to keep the engine on the current policy, chosen by what it is given:
    shared  : the torch learner's own model, one process (nothing to copy; KV caches dropped)
    copy    : an unsharded copy per rank (bf16 on CUDA) that receives the learner's weights
              after every step, one tensor gathered at a time (the torch learner under FSDP,
              on CUDA, or generating ahead while it trains)
    reload  : any learner (the JAX one): its weights are exported as an HF directory
              (`common.checkpoints.export_weights`, the path SGLang takes) and loaded into the
              engine's model
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from common.checkpoints import export_weights
from common.learner import Collectives
from geo3k_torch.engine import LocalEngine
from geo3k_torch.model import load_model


def engine_settings(cfg) -> dict:
    """`LocalEngine`'s keyword arguments from the config's `engine.local_*` settings, and
    whether it records its routing (`loss.routing_replay`)."""
    e = cfg.engine
    return {"max_batch": e.local_max_batch, "kv_budget_gb": e.local_kv_budget_gb,
            "cuda_graphs": e.local_cuda_graphs, "graph_sampling": e.local_graph_sampling,
            "keep_slots": e.local_keep_slots, "attention_bucket": e.local_attention_bucket,
            "compile": e.local_compile, "compile_backend": e.local_compile_backend,
            "record_routing": cfg.loss.routing_replay}


class LocalBackend:
    def __init__(self, processor, model_dir: str, *, seed: int, device, comm: Collectives,
                 model=None, workdir: str | Path | None = None, own_copy: bool = False,
                 bf16: bool = True, **engine):
        """model: the torch learner's (shared in one CPU process unless `own_copy`: rollouts
        generated while it trains need weights of their own); None: reload exported weights
        into a model of the engine's own, under `workdir`. On CUDA the engine has its own copy
        in bf16 (`bf16`, `train.bf16`). engine: `LocalEngine`'s settings (`engine_settings`:
        its decode slots' bounds, CUDA graphs and the decode step's fast paths)."""
        self.comm, device = comm, torch.device(device)
        cuda = device.type == "cuda"
        self.shared = model if comm.world == 1 and not own_copy and not cuda else None
        if model is None and workdir is None:
            raise ValueError("a reloading backend needs a workdir for the exported weights")
        self.reload_dir = None if model is not None else Path(workdir) / "weights_for_engine"
        dtype = torch.bfloat16 if cuda and bf16 else torch.float32
        self.model = self.shared or load_model(model_dir, dtype, device=device).eval() \
            .requires_grad_(False)
        pad = processor.tokenizer.pad_token_id
        self.engine = LocalEngine(self.model, processor, pad if pad is not None else 0,
                                  seed=seed + comm.rank, device=device, **engine)

    def sync(self, learner, step: int) -> None:
        if self.reload_dir is not None:
            from safetensors.torch import load_file

            path = export_weights(self.reload_dir, learner.export_hf, self.comm)
            state = {}
            for f in sorted(path.glob("*.safetensors")):
                state.update(load_file(f))
            missing, unexpected = self.model.load_state_dict(state, strict=False)
            if unexpected or [k for k in missing if not k.endswith("lm_head.weight")]:
                raise ValueError(f"{path}: exported weights do not fit the engine's model "
                                 f"(missing {missing[:5]}, unexpected {unexpected[:5]})")
            if missing:  # a tied head is exported once
                self.model.tie_weights()
        elif self.shared is None:
            copy_weights(learner.model, self.model)
        self.engine.clear_cache()  # the KV caches were computed with the old weights

    def train_context(self):
        return contextlib.nullcontext()

    def rng_state(self) -> list[int]:
        return self.engine.generator.get_state().tolist()

    def set_rng_state(self, state: list[int]) -> None:
        self.engine.generator.set_state(torch.tensor(state, dtype=torch.uint8))

    def close(self) -> None:
        pass


@torch.no_grad()
def copy_weights(source, target) -> None:
    """`target`'s parameters := `source`'s (same architecture; every rank calls this when
    `source` is FSDP-sharded: each parameter is gathered alone, so no full copy of the model
    exists beside `target`), cast to `target`'s dtype."""
    from torch.distributed.tensor import DTensor

    params = dict(target.named_parameters())
    names = [n for n, _ in source.named_parameters()]
    if sorted(names) != sorted(params):
        raise ValueError(f"the engine's model does not match the learner's: "
                         f"{sorted(set(names) ^ set(params))[:5]}")
    for name, p in source.named_parameters():
        params[name].copy_(p.full_tensor() if isinstance(p, DTensor) else p)
