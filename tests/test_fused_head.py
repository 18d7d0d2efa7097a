"""The fused LM head (`geo3k_torch.head`, `train.fused_head`) against the plain one: the same
loss, metrics and gradients, with the loss's every term on, chunked or not, in fp32 and bf16."""

import dataclasses

import numpy as np
import pytest
import torch

import geo3k_torch.attention as attention
from common.batching import pack
from common.grpo import LossConfig
from geo3k_torch.learner import Learner
from geo3k_torch.model import use_deepstack_add
from tests.jax_learner_setup import train_config
from tests.test_shared_prefix import groups
from tests.tiny_models import IMG, ImageOnlyProcessor, qwen2_5_vl, qwen3_vl, qwen3_vl_moe

LOSS = LossConfig(kl_coef=0.05, tis_cap=2.0, dual_clip=3.0)
# the MoE model with its load-balancing loss: a term beside the head's
MOE_LOSS = dataclasses.replace(LOSS, router_aux_coef=0.1)


def _model(build, seed, dtype):
    model, patch = build(seed=seed)
    model.set_attn_implementation(attention.NAME)
    use_deepstack_add(model)
    return model.to(dtype), patch


def _step(build, fused: bool, chunk: int, dtype=torch.float32, old: bool = False,
          fsdp: bool = False):
    """One accumulation (several micro-batches, shared prompts, images) with the KL, TIS and
    dual-clip terms on: the metric sums and every parameter's gradient. fsdp: both models
    FSDP2-wrapped under the bf16 policy (a process group must exist), the reference stored in
    bf16, as CUDA runs them."""
    model, patch = _model(build, 0, dtype)
    ref = _model(build, 1, torch.bfloat16 if fsdp else dtype)[0].eval()
    if fsdp:
        from geo3k_torch.distributed import parallelize
        model, ref = parallelize(model, bf16=True), parallelize(ref, bf16=True)
    processor = ImageOnlyProcessor(patch)
    learner = Learner(model.train(), processor, MOE_LOSS if build is qwen3_vl_moe else LOSS,
                      train_config(), 0.8, ref_model=ref, chunk=chunk, fused_head=fused)
    rng = np.random.default_rng(1)
    seqs = groups(processor, rng)
    for s in seqs:  # advantages of both signs, rollout log-probs away from the policy's
        s.advantages = rng.normal(size=len(s)).astype(np.float32) * s.loss_mask
        s.rollout_logprobs = (rng.normal(size=len(s)) * 0.3 - 2.0).astype(np.float32)
    batches = pack(seqs, max(map(len, seqs)) + 40, image_token_id=IMG)
    if old:  # the behaviour policy's log-probs given (several updates per rollout)
        for b, logp in zip(batches, learner.logprobs(batches)):
            b.old_logprobs = logp + np.float32(0.2) * rng.normal(size=len(logp)).astype(np.float32)
    n_tokens, n_seqs = float(sum(s.loss_mask.sum() for s in seqs)), float(len(seqs))
    sums = learner.accumulate(batches, n_tokens, n_seqs)
    full = lambda g: g.full_tensor() if hasattr(g, "full_tensor") else g  # noqa: E731
    return ({k: v.flatten().tolist() if v.ndim else float(v)  # MoE: router_counts (L, E)
             for k, v in sums.items()},
            {k: full(p.grad).float().clone() for k, p in model.named_parameters()})


@pytest.mark.parametrize("build", [qwen3_vl, qwen2_5_vl, qwen3_vl_moe], ids=lambda b: b.__name__)
@pytest.mark.parametrize("old", [False, True], ids=["one update", "old log-probs"])
def test_fused_head_equals_the_plain_head_in_fp32(build, old):
    """fp32: the loss and every metric to 1e-6, every gradient to 1e-5 of its norm, fused in
    chunks of 7 against the plain head unchunked and chunked. A fused head that dropped a term
    (the KL's gradient, the TIS weight) or scaled a chunk twice would be off by far more."""
    plain, plain_grads = _step(build, False, 0, old=old)
    for chunk in (7, 0):
        sums, grads = _step(build, True, chunk, old=old)
        assert sums.keys() == plain.keys()
        for k, v in plain.items():
            assert sums[k] == pytest.approx(v, rel=1e-6, abs=1e-7), (chunk, k)
        for k, g in plain_grads.items():
            assert torch.linalg.norm(grads[k] - g) <= 1e-5 * max(torch.linalg.norm(g), 1e-8), k
    chunked, chunked_grads = _step(build, False, 7, old=old)
    assert chunked["loss"] == pytest.approx(plain["loss"], rel=1e-6)


def test_fused_head_in_bf16_within_rounding():
    """bf16 (on CPU): the loss within 1e-4 of the plain head's and every gradient within 1e-2 of
    its norm (the fused head sums its chunks' head gradients in fp32, the plain one in bf16;
    measured 1.3e-7 and 2.1e-3 here, against 0 and 5e-8 in fp32)."""
    plain, plain_grads = _step(qwen3_vl, False, 7, torch.bfloat16)
    sums, grads = _step(qwen3_vl, True, 7, torch.bfloat16)
    assert sums["loss"] == pytest.approx(plain["loss"], rel=1e-4, abs=1e-6)
    for k, g in plain_grads.items():
        assert torch.linalg.norm(grads[k] - g) <= 1e-2 * max(torch.linalg.norm(g), 1e-8), k


def test_fused_head_under_fsdp2s_bf16_policy():
    """FSDP2 (one process, gloo) with the bf16 policy, as one GPU trains: the head's weight is
    gathered and its fused gradient reduced as the plain head's (loss within 1e-4, gradients
    within 1e-2 of their norms; measured 1.3e-7 and 1.9e-3, as in bf16 without FSDP)."""
    from tests.torch_group import one_process_group

    with one_process_group():
        plain, plain_grads = _step(qwen3_vl, False, 7, fsdp=True)
        sums, grads = _step(qwen3_vl, True, 7, fsdp=True)
    assert sums["loss"] == pytest.approx(plain["loss"], rel=1e-4, abs=1e-6)
    assert plain_grads.keys() == grads.keys()
    for k, g in plain_grads.items():
        assert torch.linalg.norm(grads[k] - g) <= 1e-2 * max(torch.linalg.norm(g), 1e-8), k


def test_a_head_with_a_bias_is_refused():
    from geo3k_torch.head import FusedHead
    with pytest.raises(ValueError, match="without a bias"):
        FusedHead(torch.nn.Linear(4, 6), torch.zeros(2, dtype=torch.long), 1.0, 2,
                  lambda logp, a, b: (logp.sum(), {}))
