"""bf16 compute over fp32 master weights without FSDP (`geo3k_torch.precision.MasterWeights`,
what one GPU trains with) against FSDP2's bf16 policy at world size 1 (a one-process gloo group
on CPU): the same micro-batches give the same losses, the same fp32 gradients and the same
weights after an optimizer step, bit for bit, frozen vision and a tied LM head included. The
bf16 casts of the blocks' inputs matter: without them (FSDP's cast_forward_inputs) the tiny
model's log-probs differ by 2.5e-3 and the weights after a step by 2e-3."""

import numpy as np
import pytest
import torch

from common.batching import pack
from common.grpo import LossConfig
from tests.jax_learner_setup import train_config
from tests.test_shared_prefix import groups
from tests.tiny_models import IMG, ImageOnlyProcessor, qwen3_vl, qwen3_vl_moe
from tests.torch_group import one_process_group

LOSS = LossConfig(agg="seq-mean-token-mean", tis_cap=2.0)


@pytest.fixture(scope="module")
def data():
    processor = ImageOnlyProcessor(16)
    seqs = groups(processor, np.random.default_rng(1))
    batches = pack(seqs, 200, image_token_id=IMG)  # several micro-batches, shared prefixes
    assert len(batches) >= 2 and any((b.parent_of() >= 0).any() for b in batches)
    n_tokens = float(sum(s.loss_mask.sum() for s in seqs))
    return processor, batches, n_tokens, float(len(seqs))


def model(tied: bool, build=qwen3_vl):
    from geo3k_torch import attention

    m, _ = build(seed=0)
    if tied:
        m.config.tie_word_embeddings = True  # transformers ties lm_head to embed_tokens
        m.config.get_text_config().tie_word_embeddings = True
        m.tie_weights()
        assert m.lm_head.weight is m.model.language_model.embed_tokens.weight
    m.set_attn_implementation(attention.NAME)
    return m.train()


def grads(learner) -> dict[str, torch.Tensor]:
    """Every trained parameter's gradient, fp32, whole (a DTensor's gathered)."""
    out = {}
    for name, p in learner.model.named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            assert g.dtype == torch.float32, name
            out[name] = g.detach().clone()
    return out


def weights(learner) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in learner.model.named_parameters()}


# the MoE model with its load-balancing loss: the routers' bf16 logits under both
@pytest.mark.parametrize("tied,freeze,build,loss", [
    (False, False, qwen3_vl, LOSS), (True, True, qwen3_vl, LOSS),
    (False, False, qwen3_vl_moe, LossConfig(**{**LOSS.__dict__, "router_aux_coef": 0.1}))],
    ids=["untied", "tied-frozen-vision", "moe"])
def test_master_weights_are_fsdp_at_world_size_one(data, tied, freeze, build, loss):
    from geo3k_torch.distributed import parallelize
    from geo3k_torch.learner import Learner

    processor, batches, n_tokens, n_seqs = data
    cfg = train_config(freeze_vision=freeze)
    with one_process_group():
        fsdp = Learner(parallelize(model(tied, build), bf16=True), processor, loss, cfg, 0.8)
        plain = Learner(model(tied, build), processor, loss, cfg, 0.8, master_weights=True)
        assert plain.master is not None and fsdp.master is None
        fp32 = Learner(model(tied, build), processor, loss, cfg, 0.8)
        logp = [x.logprobs(batches) for x in (fsdp, plain, fp32)]
        for a, b, c in zip(*logp):
            np.testing.assert_array_equal(a, b)
            assert np.abs(a - c).max() > 1e-4  # and both really computed in bf16
        runs = []
        for x in (fsdp, plain):
            x.optimizer.zero_grad(set_to_none=True)
            loss = float(x.accumulate(batches, n_tokens, n_seqs)["loss"])
            runs.append((loss, grads(x)))
            x.optimizer.zero_grad(set_to_none=True)
        (loss_a, ga), (loss_b, gb) = runs
        assert loss_b == loss_a
        assert sorted(ga) == sorted(gb) and ga
        assert all(torch.equal(ga[k], gb[k]) for k in ga), max(
            float((ga[k] - gb[k]).abs().max()) for k in ga)
        if freeze:
            assert not any(k.startswith("model.visual") for k in gb)
        before = weights(plain)
        ma, mb = (x.train_step(batches, n_tokens, n_seqs) for x in (fsdp, plain))
        assert (mb["loss"], mb["grad_norm"]) == (ma["loss"], ma["grad_norm"])
        wa, wb = weights(fsdp), weights(plain)
        assert all(p.dtype == torch.float32 for p in plain.model.parameters())  # masters
        assert all(torch.equal(wa[k], wb[k]) for k in wa)
        moved = [k for k in wb if not torch.equal(wb[k], before[k])]
        assert moved and (not freeze or not any(k.startswith("model.visual") for k in moved))
        # the bf16 copies follow the step: the next forward is FSDP's again
        for a, b in zip(*(x.logprobs(batches) for x in (fsdp, plain))):
            np.testing.assert_array_equal(a, b)


def test_a_restored_learner_computes_with_the_restored_weights(data, tmp_path):
    """The bf16 copies follow a checkpoint's fp32 weights (DCP sees fp32 masters, no group)."""
    from geo3k_torch.learner import Learner

    processor, batches, n_tokens, n_seqs = data
    a = Learner(model(False), processor, LOSS, train_config(), 0.8, master_weights=True)
    a.train_step(batches, n_tokens, n_seqs)
    a.save(tmp_path)
    b = Learner(model(False), processor, LOSS, train_config(), 0.8, master_weights=True)
    b.restore(tmp_path)
    for x, y in zip(a.logprobs(batches), b.logprobs(batches)):
        np.testing.assert_array_equal(x, y)
    ma, mb = (x.train_step(batches, n_tokens, n_seqs) for x in (a, b))
    assert mb["loss"] == ma["loss"] and mb["grad_norm"] == ma["grad_norm"]
