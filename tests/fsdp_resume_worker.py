"""Sharded loading and sharded checkpoints under FSDP2; run by tests/test_fsdp.py.

    python -m torch.distributed.run --nproc_per_node=2 tests/fsdp_resume_worker.py OUT.json DIR
1. Rank 0 saves a tiny Qwen3-VL with a tied LM head to DIR/model; every rank builds it on the
   meta device and loads it (`load_sharded`: rank 0 reads, the shards are broadcast). Rank 0
   reports how far the gathered weights are from the plain load's, and each rank how many
   parameter elements it holds.
2. A learner trains step 1, saves sharded (DIR/ckpt), trains step 2; a fresh learner on a fresh
   sharded model restores DIR/ckpt and trains step 2. Rank 0 reports both step-2 metrics and
   weight checksums, and the checkpoint's files.
3. The engine's unsharded copy receives the trained sharded weights (`copy_weights`, a tensor
   gathered at a time); rank 0 reports its distance to the gathered state dict.
"""

import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import Qwen3VLForConditionalGeneration

from common.batching import pack
from common.grpo import LossConfig
from common.step import even_out
from geo3k_torch import checkpoint, distributed
from geo3k_torch.backend import copy_weights
from geo3k_torch.learner import Learner
from geo3k_torch.model import load_model, load_sharded
from tests.fsdp_worker import global_batch
from tests.jax_learner_setup import train_config
from tests.tiny_models import ImageOnlyProcessor, qwen3_vl


def checksum(model) -> float:
    return float(sum(v.double().abs().sum() for v in checkpoint.full_state_dict(model).values()))


def main(out, workdir):
    rank, world = distributed.init("cpu")
    model_dir, ckpt = Path(workdir) / "model", Path(workdir) / "ckpt"
    if rank == 0:
        config = qwen3_vl(seed=0)[0].config
        config.tie_word_embeddings = True
        torch.manual_seed(0)
        Qwen3VLForConditionalGeneration(config).float().save_pretrained(model_dir)
        ckpt.mkdir()
    dist.barrier()
    report = {}

    # 1. meta build, rank 0 reads, shards broadcast
    sharded = load_sharded(str(model_dir), "cpu", bf16=False)
    full = checkpoint.full_state_dict(sharded)
    held = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel()
               for p in sharded.parameters())
    report["held"] = distributed.TorchCollectives().gather(held)
    if rank == 0:
        plain = load_model(str(model_dir)).state_dict()
        report["load_keys_equal"] = sorted(full) == sorted(plain)
        report["load_max_diff"] = max(float((full[k] - plain[k]).abs().max()) for k in plain)
        report["total"] = sum(p.numel() for p in load_model(str(model_dir)).parameters())
        report["tied"] = bool(sharded.lm_head.weight is
                              sharded.model.language_model.embed_tokens.weight)
    del full

    # 2. sharded save, then resume
    processor = ImageOnlyProcessor(16)
    seqs = global_batch(processor)
    n_tokens, n_seqs = float(sum(s.loss_mask.sum() for s in seqs)), float(len(seqs))
    comm = distributed.TorchCollectives()
    budget = max(len(s) for s in seqs)
    batches = pack(seqs[rank::world], budget)
    n_micro = comm.sum_scalars({"n": len(batches)}, max_keys=("n",))["n"]
    batches = even_out(batches, int(n_micro), seqs[0])
    cfg = train_config(lr=1e-2)

    def learner(model):
        return Learner(model, processor, LossConfig(tis_cap=2.0), cfg, 1.0, comm=comm)

    a = learner(sharded)
    a.train_step(batches, n_tokens, n_seqs)
    a.save(ckpt)
    dist.barrier()
    m_a = a.train_step(batches, n_tokens, n_seqs)
    sum_a = checksum(a.model)
    engine_model = load_model(str(model_dir)).eval()  # 3. the engine's copy, synced
    copy_weights(a.model, engine_model)
    trained = checkpoint.full_state_dict(a.model)
    report["copy_max_diff"] = max(float((v - trained[k]).abs().max())
                                  for k, v in engine_model.state_dict().items() if k in trained)
    report["copy_changed"] = float((engine_model.lm_head.weight -
                                    load_model(str(model_dir)).lm_head.weight).abs().max())
    b = learner(load_sharded(str(model_dir), "cpu", bf16=False))
    b.restore(ckpt)
    m_b = b.train_step(batches, n_tokens, n_seqs)
    sum_b = checksum(b.model)
    if rank == 0:
        report.update(uninterrupted=m_a, resumed=m_b, checksum_a=sum_a, checksum_b=sum_b,
                      files=sorted(p.name for p in (ckpt / checkpoint.SHARDED_DIR).iterdir()))
        json.dump(report, open(out, "w"))
    dist.barrier()
    distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
    sys.stdout.flush()  # see tests/fsdp_worker.py: no interpreter teardown of gloo threads
    sys.stderr.flush()
    os._exit(0)
