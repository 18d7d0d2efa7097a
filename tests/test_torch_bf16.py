"""The torch learner's one dtype policy, bf16 compute over fp32 master weights (FSDP2's
MixedPrecisionPolicy, `geo3k_torch.distributed.parallelize(model, bf16=True)`, as CUDA runs it at
any world size), run on CPU on a one-process gloo group through every learner path: shared
prefixes, the KL term against a bf16 reference, several updates per rollout, SFT. Each is pinned
to the same path in fp32: log-probs within LOGP_TOL nats, losses and KL within LOSS_RTOL.

Why not autocast: under bf16 autocast with fp32 weights Qwen3-VL's q and k leave their fp32 q/k
RMSNorm in fp32 while v is bf16, and the shared-prefix attention fails (first test).
"""

import dataclasses

import numpy as np
import pytest
import torch

from common.batching import pack
from common.grpo import LossConfig
from common.step import update
from tests.jax_learner_setup import train_config
from tests.test_shared_prefix import groups
from tests.tiny_models import IMG, ImageOnlyProcessor, qwen3_vl
from tests.torch_group import one_process_group

# bf16 keeps 8 significant bits (relative rounding 2^-9); through the tiny model's 2 layers,
# vision tower and LM head the log-probs (about -5.7 here) move by at most ~0.01 nats.
LOGP_TOL = 0.05
LOSS_RTOL = 0.05
LOSS = LossConfig(agg="seq-mean-token-mean", tis_cap=2.0)


@pytest.fixture(scope="module")
def data():
    processor = ImageOnlyProcessor(16)
    seqs = groups(processor, np.random.default_rng(1))
    batches = pack(seqs, 10_000, image_token_id=IMG)  # shared prefixes
    assert any((b.parent_of() >= 0).any() for b in batches)
    n_tokens = float(sum(s.loss_mask.sum() for s in seqs))
    return processor, seqs, batches, n_tokens, float(len(seqs))


@pytest.fixture(scope="module")
def group():
    with one_process_group():
        yield


def policy(bf16: bool, dtype=torch.float32):
    """The tiny Qwen3-VL (same weights every call), FSDP2-wrapped under the bf16 policy or
    plain fp32; `dtype`: its stored parameters' (bf16 for the KL reference)."""
    from geo3k_torch import attention
    from geo3k_torch.distributed import parallelize

    model, _ = qwen3_vl(seed=0)
    model.set_attn_implementation(attention.NAME)
    model = model.to(dtype).train()
    return parallelize(model, bf16=True) if bf16 else model


def learners(data, loss=LOSS, **train):
    """(fp32 learner, bf16 learner) on the same weights; KL references stored like main's."""
    from geo3k_torch.learner import Learner

    processor = data[0]
    out = []
    for bf16 in (False, True):
        ref = None
        if loss.kl_coef:
            ref = policy(bf16, torch.bfloat16 if bf16 else torch.float32).eval()
            ref.requires_grad_(False)
        out.append(Learner(policy(bf16), processor, loss, train_config(**train), 0.8,
                           ref_model=ref))
    return out


def assert_logprobs_close(a, b, batches):
    diffs = [np.abs(x - y)[bt.loss_mask > 0].max() for x, y, bt in zip(a, b, batches)]
    assert max(diffs) <= LOGP_TOL, diffs
    assert max(diffs) > 1e-4  # and the bf16 side really computed in bf16


def test_autocast_over_fp32_weights_fails_in_shared_prefix_attention(data):
    from geo3k_torch.model import packed_inputs, token_logprobs

    processor, _, batches, _, _ = data
    model = policy(False)
    inputs = packed_inputs(batches[0], processor, model.config)
    targets = torch.from_numpy(np.flatnonzero(batches[0].loss_mask))
    with pytest.raises(ValueError, match="same dtype"), \
            torch.autocast("cpu", dtype=torch.bfloat16):
        token_logprobs(model, inputs, targets)


def test_shared_prefix_step_in_bf16_is_the_fp32_step(data, group):
    _, _, batches, n_tokens, n_seqs = data
    fp32, bf16 = learners(data)
    assert_logprobs_close(bf16.logprobs(batches), fp32.logprobs(batches), batches)
    a, b = (x.train_step(batches, n_tokens, n_seqs) for x in (fp32, bf16))
    assert b["loss"] == pytest.approx(a["loss"], rel=LOSS_RTOL)
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=LOSS_RTOL)
    for p in bf16.model.parameters():  # master weights and their optimizer state stay fp32
        assert p.dtype == torch.float32
        assert all(v.dtype == torch.float32 for v in bf16.optimizer.state[p].values()
                   if v.dim())


@pytest.mark.slow
def test_kl_against_a_bf16_reference_is_the_fp32_kl(data, group):
    _, _, batches, n_tokens, n_seqs = data
    fp32, bf16 = learners(data, dataclasses.replace(LOSS, kl_coef=0.1), lr=0.05,
                           lr_schedule="constant", warmup_steps=0)
    for _ in range(2):  # the second step's policy has left the reference: KL > 0
        a, b = (x.train_step(batches, n_tokens, n_seqs) for x in (fp32, bf16))
    assert a["kl"] > 1e-4
    assert b["kl"] == pytest.approx(a["kl"], rel=0.2)  # a small difference of two near values
    assert b["loss"] == pytest.approx(a["loss"], rel=LOSS_RTOL)


@pytest.mark.slow
def test_several_updates_per_rollout_in_bf16(data, group):
    _, _, batches, n_tokens, n_seqs = data
    # lr 0.01: the first update moves the policy off the rollout's (clip_frac > 0 below), yet
    # not so far that bf16's rounding, amplified through a second step, decides the loss: at
    # 0.05 (an Adam step of 2.5x the weights' init scale) the two differed by 7% on one CPU.
    fp32, bf16 = learners(data, lr=0.01, lr_schedule="constant", warmup_steps=0)
    split = pack(data[1], 150, image_token_id=IMG)  # several micro-batches to share out
    assert len(split) >= 2
    # the behaviour log-probs that both updates are measured against
    assert_logprobs_close(bf16.logprobs(split), fp32.logprobs(split), split)
    minis = [split[:len(split) // 2], split[len(split) // 2:]]  # two optimizer steps
    a, b = (update(x, minis) for x in (fp32, bf16))
    assert b["loss"] == pytest.approx(a["loss"], rel=LOSS_RTOL)
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=LOSS_RTOL)
    assert a["clip_frac"] > 0 and b["clip_frac"] > 0  # the second update is off-policy


def test_sft_step_in_bf16(data, group):
    from geo3k_torch.learner import SFTLearner, sft_step

    processor, seqs, _, _, _ = data
    a, b = (sft_step(SFTLearner(policy(bf16), processor, train_config()), seqs, 10_000)
            for bf16 in (False, True))
    assert b["loss"] == pytest.approx(a["loss"], rel=LOSS_RTOL)
    assert b["entropy"] == pytest.approx(a["entropy"], rel=LOSS_RTOL)
