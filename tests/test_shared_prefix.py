"""Shared-prefix groups: a group's prompt goes into a micro-batch once and every sample's rest
attends to it; log-probs, loss and gradients equal those of the separate sequences."""

import numpy as np
import pytest
import torch

from common.batching import TrainSequence, pack, shared_prefix_len
from common.grpo import LossConfig
from common.mrope import packed_position_ids
from tests.jax_learner_setup import train_config
from tests.tiny_models import IMG, ImageOnlyProcessor, image, prompt_ids, qwen2_5_vl, qwen3_vl


def sample(prompt, images, rng, index, turns=2):
    """A multi-turn sample after `prompt`: response (trained), observation (not), response..."""
    spans = [rng.integers(1, 200, int(rng.integers(3, 9))) for _ in range(2 * turns - 1)]
    ids = np.concatenate([prompt, *spans])
    mask = np.concatenate([np.zeros(len(prompt))] + [np.full(len(s), (k + 1) % 2)
                                                     for k, s in enumerate(spans)])
    mask = mask.astype(np.int8)
    logp = (rng.uniform(-3, 0, len(ids)) * mask).astype(np.float32)
    return TrainSequence(ids, mask, logp, float(rng.normal()), images, index)


def groups(processor, rng, n_groups=2, n_samples=3):
    """Groups of samples sharing a prompt with two images of different sizes (each sample with
    its own copies of the images: sharing goes by content), plus a sequence with the same prompt
    tokens but another image (never shared with them) and one with no image at all."""
    seqs = []
    for g in range(n_groups):
        sizes = [(int(rng.integers(30, 150)), int(rng.integers(30, 150))) for _ in range(2)]
        imgs = [image(w, h, 100 * g + k) for k, (w, h) in enumerate(sizes)]
        prompt = prompt_ids(processor, imgs, rng)
        for _ in range(n_samples):
            copies = [image(w, h, 100 * g + k) for k, (w, h) in enumerate(sizes)]
            seqs.append(sample(prompt, copies, rng, len(seqs), turns=1 + len(seqs) % 3))
    other = [image(*sizes[0], 999), image(*sizes[1], 998)]
    seqs.append(sample(prompt, other, rng, len(seqs)))
    seqs.append(sample(rng.integers(1, 200, 9), [], rng, len(seqs)))
    return seqs


@pytest.fixture(scope="module")
def data():
    processor = ImageOnlyProcessor(14)
    return processor, groups(processor, np.random.default_rng(0))


def test_each_prompt_once_and_every_sequence_rebuilt(data):
    processor, seqs = data
    batch, = pack(seqs, 10_000, image_token_id=IMG)
    plain, = pack(seqs, 10_000)
    parents, cu = batch.parent_of(), batch.cu_seqlens
    prefixes = np.flatnonzero(batch.seq_index < 0)
    assert len(prefixes) == 2 and (parents[prefixes] == -1).all()
    assert batch.num_tokens == plain.num_tokens - 2 * 2 * (shared_prefix_len(seqs[0], IMG))
    assert batch.image_counts[prefixes].tolist() == [2, 2] and batch.image_counts.sum() == 6
    for s, i in enumerate(batch.seq_index):
        if i < 0:
            assert not batch.loss_mask[cu[s]:cu[s + 1]].any()
            continue
        p = parents[s]
        head = np.arange(cu[p], cu[p + 1]) if p >= 0 else np.arange(0)
        rows = np.concatenate([head, np.arange(cu[s], cu[s + 1])])
        assert batch.input_ids[rows].tolist() == seqs[i].token_ids.tolist()
        assert batch.loss_mask[rows].tolist() == seqs[i].loss_mask.tolist()
        assert np.array_equal(batch.rollout_logprobs[rows], seqs[i].rollout_logprobs)
    # the same prompt tokens with another image, and the image-less one, stand alone
    assert (parents[np.isin(batch.seq_index, [6, 7])] == -1).all()
    assert sorted(batch.seq_index[batch.seq_index >= 0].tolist()) == list(range(8))


def test_per_token_advantages_follow_their_tokens(data):
    """Advantages given per token (`advantage.turn_baseline`) land on the same tokens whether a
    group's prompt is shared or not, padded or packed."""
    import dataclasses
    from common.batching import pad
    processor, seqs = data
    rng = np.random.default_rng(1)
    seqs = [dataclasses.replace(s, advantage=rng.normal(size=len(s)).astype(np.float32))
            for s in seqs]
    batch, = pack(seqs, 10_000, image_token_id=IMG)
    parents, cu = batch.parent_of(), batch.cu_seqlens
    for s, i in enumerate(batch.seq_index):
        if i >= 0:
            p = parents[s]
            head = np.arange(cu[p], cu[p + 1]) if p >= 0 else np.arange(0)
            rows = np.concatenate([head, np.arange(cu[s], cu[s + 1])])
            want = seqs[i].advantage * seqs[i].loss_mask
            assert np.array_equal(batch.advantages[rows][seqs[i].loss_mask > 0],
                                  want[seqs[i].loss_mask > 0])
    padded = pad(seqs, pad_id=0)
    for b, s in enumerate(seqs):
        assert np.array_equal(padded.advantages[b, :len(s)], s.advantage * s.loss_mask)


def test_positions_are_those_of_the_separate_sequences(data):
    processor, seqs = data
    batch, = pack(seqs, 10_000, image_token_id=IMG)
    grid = processor.image_processor(images=batch.images, return_tensors="np")["image_grid_thw"]
    pos = packed_position_ids(batch.input_ids, batch.cu_seqlens, batch.image_counts, grid, IMG,
                              2, batch.parent_of())
    cu, parents = batch.cu_seqlens, batch.parent_of()
    for s, i in enumerate(batch.seq_index):
        if i < 0:
            continue
        alone, = pack([seqs[i]], 10_000)
        g = processor.image_processor(images=seqs[i].images, return_tensors="np")[
            "image_grid_thw"] if seqs[i].images else np.zeros((0, 3))
        ref = packed_position_ids(alone.input_ids, alone.cu_seqlens, alone.image_counts, g, IMG, 2)
        skip = cu[parents[s] + 1] - cu[parents[s]] if parents[s] >= 0 else 0
        assert np.array_equal(pos[:, cu[s]:cu[s + 1]], ref[:, skip:])


def test_groups_too_big_for_the_budget_are_split(data):
    _, seqs = data
    n = shared_prefix_len(seqs[0], IMG)
    whole = n + sum(len(s) - n for s in seqs[:3])  # the first group's prompt and samples
    budget = max(max(map(len, seqs)), whole - 1)
    batches = pack(seqs, budget, image_token_id=IMG)
    assert all(b.num_tokens <= budget for b in batches)
    children = [b.seq_index[b.parent_of() == p].tolist() for b in batches
                for p in np.flatnonzero(b.seq_index < 0)]
    first = [c for c in children if set(c) & {0, 1, 2}]
    assert first and all(len(c) < 3 for c in first)  # the first group went into parts
    assert all(len(c) >= 2 for c in children)  # a part of one is a plain sequence
    assert sorted(i for b in batches for i in b.seq_index if i >= 0) == list(range(8))


def test_what_cannot_be_shared_is_not():
    processor = ImageOnlyProcessor(14)
    rng = np.random.default_rng(3)
    img = image(60, 40, 1)
    prompt = prompt_ids(processor, [img], rng)
    a, b = sample(prompt, [img], rng, 0), sample(prompt, [img], rng, 1)
    late = TrainSequence(np.concatenate([b.token_ids, [IMG]]), np.concatenate([b.loss_mask, [0]]),
                         np.concatenate([b.rollout_logprobs, [0]]), 1.0, [img], 2)
    assert shared_prefix_len(late, IMG) == 0  # an image token after the prompt
    nothing = TrainSequence(a.token_ids, np.zeros_like(a.loss_mask), a.rollout_logprobs, 0.0,
                            [img], 3)
    assert shared_prefix_len(nothing, IMG) == 0
    batches = pack([a, late, nothing], 10_000, image_token_id=IMG)
    assert all((b.parent_of() == -1).all() for b in batches)


LOSS = LossConfig(agg="seq-mean-token-mean", tis_cap=2.0)


@pytest.mark.parametrize("build", [qwen3_vl, qwen2_5_vl], ids=lambda b: b.__name__)
@pytest.mark.parametrize("budget", [10_000, 300])
def test_torch_learner_shared_equals_separate(build, budget):
    """Log-probs (<= 1e-5), loss and gradients (<= 1e-5 relative) of shared-prefix micro-batches
    equal those of the same sequences packed separately, with two images per prompt and
    multi-turn samples; also when groups are split over micro-batches."""
    from geo3k_torch import attention
    from geo3k_torch.learner import Learner

    model, patch = build(seed=0)
    model.set_attn_implementation(attention.NAME)
    processor = ImageOnlyProcessor(patch)
    seqs = groups(processor, np.random.default_rng(1))
    n_tokens, n_seqs = float(sum(s.loss_mask.sum() for s in seqs)), float(len(seqs))
    budget = max(budget, max(map(len, seqs)))
    learner = Learner(model, processor, LOSS, train_config(), 0.8)
    results = []
    for image_token_id in (None, IMG):
        batches = pack(seqs, budget, image_token_id=image_token_id)
        assert any((b.parent_of() >= 0).any() for b in batches) == (image_token_id is not None)
        logp = {int(i): full[b.cu_seqlens[s]:b.cu_seqlens[s + 1]][
                    b.loss_mask[b.cu_seqlens[s]:b.cu_seqlens[s + 1]] > 0]
                for b, full in zip(batches, learner.logprobs(batches))
                for s, i in enumerate(b.seq_index) if i >= 0}
        model.zero_grad()
        loss = float(learner.accumulate(batches, n_tokens, n_seqs)["loss"])
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        results.append((logp, loss, grads))
    (lp_a, loss_a, g_a), (lp_b, loss_b, g_b) = results
    assert sorted(lp_a) == sorted(lp_b) == list(range(len(seqs)))
    for i in lp_a:
        np.testing.assert_allclose(lp_b[i], lp_a[i], rtol=0, atol=1e-5)
    assert abs(loss_b - loss_a) <= 1e-5 * abs(loss_a)
    assert g_a.keys() == g_b.keys() and len(g_a) == len(list(model.parameters()))
    for k, g in g_a.items():
        assert torch.linalg.norm(g_b[k] - g) <= 1e-5 * max(torch.linalg.norm(g), 1e-8), k


def test_sdpa_refuses_shared_prefixes(data):
    from geo3k_torch.model import packed_inputs

    processor, seqs = data
    model, _ = qwen3_vl(seed=0)
    model.set_attn_implementation("sdpa")
    batch, = pack(seqs, 10_000, image_token_id=IMG)
    with pytest.raises(ValueError, match="packed_sdpa"):
        packed_inputs(batch, processor, model.config)


@pytest.mark.slow
def test_jax_model_shared_equals_separate(arch="qwen3_vl"):
    """The JAX model on shared-prefix rows: the same log-probs (<= 1e-5) and policy-gradient
    loss and gradients (<= 1e-5 relative) as on the separate sequences, with a group split over
    two rows and the windows reaching back to each prompt. On Qwen3-VL, whose DeepStack
    features go into the prompt's rows once; both architectures' positions after a shared
    prompt are transformers' (tests/test_jax_main.py), and the torch test above runs both."""
    import jax
    import jax.numpy as jnp

    from geo3k_jax.core.batch import device_batch
    from geo3k_jax.models.model import token_logprobs
    from tests.test_jax_model import BUILDERS, jax_copy, randomize

    jax.config.update("jax_default_matmul_precision", "highest")
    torch.manual_seed(0)
    hf, patch = BUILDERS[arch]()
    merge, params = jax_copy(randomize(hf, 1))
    processor = ImageOnlyProcessor(patch)
    seqs = groups(processor, np.random.default_rng(2))
    n_tokens, n_seqs = float(sum(s.loss_mask.sum() for s in seqs)), float(len(seqs))
    n = shared_prefix_len(seqs[0], IMG)
    budget = max(max(map(len, seqs)), n + sum(len(s) - n for s in seqs[:3]) - 1)

    def run(batches):
        batch = device_batch(batches, processor, hf.config, agg=LOSS.agg, n_tokens=n_tokens,
                             n_seqs=n_seqs, pad_to=64)
        coef = jnp.asarray(batch["weights"] * batch["advantages"])

        def loss(p):
            return -jnp.sum(token_logprobs(merge(p), batch, 0.8) * coef)

        logp = np.asarray(jax.jit(lambda p: token_logprobs(merge(p), batch, 0.8))(params))
        value, grads = jax.jit(jax.value_and_grad(loss))(params)
        per_seq = {int(i): logp[r, b.cu_seqlens[s]:b.cu_seqlens[s + 1]][
                       b.loss_mask[b.cu_seqlens[s]:b.cu_seqlens[s + 1]] > 0]
                   for r, b in enumerate(batches) for s, i in enumerate(b.seq_index) if i >= 0}
        return per_seq, float(value), grads, batch

    sep_lp, sep_loss, sep_g, _ = run(pack(seqs, budget))
    shared = pack(seqs, budget, image_token_id=IMG)
    assert sum(int((b.parent_of() >= 0).sum()) for b in shared) >= 4
    sh_lp, sh_loss, sh_g, batch = run(shared)
    assert (batch["prefix"] >= 0).any()
    assert sorted(sh_lp) == sorted(sep_lp) == list(range(len(seqs)))
    for i in sep_lp:
        np.testing.assert_allclose(sh_lp[i], sep_lp[i], rtol=0, atol=1e-5)
    assert abs(sh_loss - sep_loss) <= 1e-5 * abs(sep_loss)
    for k, g in sep_g.items():
        g, h = np.asarray(g), np.asarray(sh_g[k])
        assert np.linalg.norm(h - g) <= 1e-5 * max(np.linalg.norm(g), 1e-8), k
