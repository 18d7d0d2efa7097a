"""The torch learner's CUDA path end to end on the tiny Qwen3-VL (skipped without CUDA): a
process group at world size 1 ("cpu:gloo,cuda:nccl" on an in-memory store), the policy loaded on
the meta device under the bf16 policy (`train.fsdp="always"`) or plainly under bf16 master
weights (the default at world size 1, `geo3k_torch.precision`), a bf16 KL reference, shared-prefix micro-batches through
the varlen kernel, the loop's collectives on the GPU, and the engine's own bf16 copy receiving
the weights. Log-probs are pinned to the CPU fp32 reference within the bf16 tolerance of
tests/test_torch_bf16.py."""

import dataclasses

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs a CUDA device")]


@pytest.mark.parametrize("fsdp", ["always", "auto"])
def test_cuda_learner_step_engine_and_sync(tmp_path, monkeypatch, fsdp):
    import torch.distributed as dist

    from common.batching import pack
    from common.engine import Request, SamplingParams
    from common.grpo import LossConfig
    from configs import base
    from geo3k_torch import attention, distributed
    from geo3k_torch.backend import copy_weights
    from geo3k_torch.engine import LocalEngine
    from geo3k_torch.learner import Learner
    from geo3k_torch.model import load_model
    from geo3k_torch.prepare import load_policy
    from tests.jax_learner_setup import train_config
    from tests.test_shared_prefix import groups
    from tests.test_torch_bf16 import LOGP_TOL
    from tests.tiny_models import IMG, ImageOnlyProcessor, qwen3_vl

    model, patch = qwen3_vl(seed=0)
    model.save_pretrained(tmp_path)
    processor = ImageOnlyProcessor(patch)
    seqs = groups(processor, np.random.default_rng(1))
    batches = pack(seqs, 10_000, image_token_id=IMG)
    n_tokens, n_seqs = float(sum(s.loss_mask.sum() for s in seqs)), float(len(seqs))
    loss = LossConfig(kl_coef=0.1, tis_cap=2.0)
    cpu = Learner(load_model(str(tmp_path)), processor, loss, train_config(), 0.8,
                  ref_model=load_model(str(tmp_path)).eval())
    want = cpu.logprobs(batches)

    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert not dist.is_initialized()
    distributed.init("cuda")
    try:
        device = torch.device("cuda", 0)
        cfg = base.get_config()
        cfg.train.fsdp = fsdp
        policy = load_policy(cfg, str(tmp_path), device, 1)
        ref = load_policy(cfg, str(tmp_path), device, 1, reference=True)
        assert next(ref.parameters()).dtype == torch.bfloat16
        assert next(policy.parameters()).dtype == torch.float32  # master weights
        calls = []
        varlen = attention.varlen_attn  # None before torch 2.13: rows go through packed_sdpa
        if varlen is not None:
            monkeypatch.setattr(attention, "varlen_attn",
                                lambda *a, **k: calls.append(a[0].dtype) or varlen(*a, **k))
        comm = distributed.TorchCollectives(device)
        learner = Learner(policy, processor, loss, train_config(bf16=True), 0.8, device,
                          ref_model=ref, comm=comm)
        assert (learner.master is None) == (fsdp == "always")
        got = learner.logprobs(batches)
        for g, w, b in zip(got, want, batches):
            assert np.abs(g - w)[b.loss_mask > 0].max() <= LOGP_TOL
        if varlen is not None:
            assert calls and set(calls) == {torch.bfloat16}  # one varlen call per layer, bf16
        m = learner.train_step(batches, n_tokens, n_seqs)
        assert np.isfinite(m["loss"]) and m["grad_norm"] > 0 and m["skipped"] == 0.0

        engine_model = load_model(str(tmp_path), torch.bfloat16).to(device).eval()
        copy_weights(learner.model, engine_model)
        full = {k: v.full_tensor() if fsdp == "always" else v
                for k, v in learner.model.state_dict().items()}
        for k, v in engine_model.state_dict().items():
            if k in full:
                assert torch.equal(v, full[k].to(torch.bfloat16)), k
        engine = LocalEngine(engine_model, processor, 0, device=device, kv_budget_gb=1.0)
        assert engine.kv_bytes_per_token() == 2 * 2 * 2 * 16 * 2  # bf16
        prompt = seqs[0].token_ids[:int(np.argmax(seqs[0].loss_mask > 0))]  # images and all
        req = Request(tuple(int(t) for t in prompt), seqs[0].images,
                      SamplingParams(1.0, 1.0, 8), "s")
        out, = engine.generate([req, dataclasses.replace(req, session="t")])[:1]
        assert 1 <= len(out.token_ids) <= 8 and all(np.isfinite(out.logprobs))
    finally:
        distributed.shutdown()
