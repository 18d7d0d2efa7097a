"""Torch learner numerics (CPU, fp32): packed = unpacked log-probs, engine = learner log-probs,
torch loss = the numpy reference for every option."""

import dataclasses

import numpy as np
import pytest
import torch

from common.batching import TrainSequence, pack
from common.engine import Request, SamplingParams
from common.grpo import LossConfig, per_token_terms, policy_loss, token_weights
import geo3k_torch.engine as engine_module
from geo3k_torch.engine import LocalEngine
from geo3k_torch.model import packed_inputs, token_logprobs
from tests.tiny_models import (IMG, ImageOnlyProcessor, image, prompt_ids, qwen2_5_vl, qwen3_vl,
                               qwen3_vl_moe)

ARCHS = {"qwen3_vl": qwen3_vl, "qwen2_5_vl": qwen2_5_vl, "qwen3_vl_moe": qwen3_vl_moe}


@pytest.fixture(scope="module", params=sorted(ARCHS))
def tiny(request):
    model, patch = ARCHS[request.param]()
    return model, ImageOnlyProcessor(patch)


def sequences(processor, rng, n=3):
    """n sequences with 1-3 images of different sizes each, a random response after them."""
    out = []
    for i in range(n):
        imgs = [image(int(rng.integers(40, 130)), int(rng.integers(40, 130)), 10 * i + k)
                for k in range(1 + i % 3)]
        p = prompt_ids(processor, imgs, rng)
        resp = rng.integers(1, 200, 6 + 3 * i)
        ids = np.concatenate([p, resp])
        mask = np.r_[np.zeros(len(p), np.int8), np.ones(len(resp), np.int8)]
        out.append(TrainSequence(ids, mask, np.zeros(len(ids), np.float32), 1.0, imgs, i))
    return out


def unpacked_logprobs(model, processor, seq):
    """Reference: one sequence alone, transformers computing its own M-RoPE positions."""
    ids = torch.from_numpy(seq.token_ids)[None]
    enc = processor.image_processor(images=seq.images, return_tensors="np")
    out = model(input_ids=ids, mm_token_type_ids=(ids == IMG).int(),
                pixel_values=torch.from_numpy(enc["pixel_values"]),
                image_grid_thw=torch.from_numpy(enc["image_grid_thw"]))
    logp = torch.log_softmax(out.logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
    return logp[np.nonzero(seq.loss_mask[1:])[0]]


def test_packed_equals_unpacked(tiny):
    model, processor = tiny
    seqs = sequences(processor, np.random.default_rng(0))
    batch, = pack(seqs, 10_000)
    assert len(batch.seq_index) == 3 and batch.image_counts.tolist() == [1, 2, 3]
    targets = torch.from_numpy(np.nonzero(batch.loss_mask)[0])
    with torch.no_grad():
        packed = token_logprobs(model, packed_inputs(batch, processor, model.config), targets)
        ref = torch.cat([unpacked_logprobs(model, processor, seqs[i]) for i in batch.seq_index])
    assert packed.shape == ref.shape
    assert (packed - ref).abs().max().item() <= 1e-5


def test_plain_positions_would_be_wrong(tiny):
    """The anchor's defect: 1-D 0..n positions give different log-probs on image sequences."""
    model, processor = tiny
    seqs = sequences(processor, np.random.default_rng(1), n=1)
    batch, = pack(seqs, 10_000)
    inputs = packed_inputs(batch, processor, model.config)
    wrong = dict(inputs, position_ids=inputs["position_ids"][:1])  # text positions only
    targets = torch.from_numpy(np.nonzero(batch.loss_mask)[0])
    with torch.no_grad():
        diff = (token_logprobs(model, inputs, targets) - token_logprobs(model, wrong, targets))
    assert diff.abs().max().item() > 1e-4


def engine_learner_gap(model, processor, requests, completions) -> float:
    """Max |engine log-prob - learner log-prob| over the completions' tokens, the learner
    reading each request + completion as one packed sequence."""
    seqs = []
    for i, (r, o) in enumerate(zip(requests, completions)):
        ids = np.r_[np.asarray(r.input_ids), o.token_ids]
        mask = np.r_[np.zeros(len(r.input_ids), np.int8), np.ones(len(o.token_ids), np.int8)]
        seqs.append(TrainSequence(ids, mask, np.r_[np.zeros(len(r.input_ids)), o.logprobs]
                                  .astype(np.float32), 0.0, list(r.images), i))
    batch, = pack(seqs, 10_000)
    targets = torch.from_numpy(np.nonzero(batch.loss_mask)[0])
    with torch.no_grad():
        learner = token_logprobs(model, packed_inputs(batch, processor, model.config), targets)
    rollout = torch.from_numpy(batch.rollout_logprobs[targets.numpy()])
    return float((learner - rollout).abs().max())


def test_engine_logprobs_equal_learner(tiny):
    model, processor = tiny
    rng = np.random.default_rng(2)
    engine = LocalEngine(model, processor, pad_id=0, seed=3)
    reqs = []
    for i in range(3):
        imgs = [image(int(rng.integers(40, 120)), 60, 100 + 10 * i + k) for k in range(1 + i)]
        reqs.append(Request(tuple(prompt_ids(processor, imgs, rng, (3 + 4 * i, 2))), imgs,
                            SamplingParams(1.0, 1.0, 12, (7,)), f"s{i}"))
    outs = engine.generate(reqs)
    for r, o in zip(reqs, outs):
        assert 1 <= len(o.token_ids) <= 12
        assert o.finish_reason == ("stop" if o.token_ids[-1] == 7 else "length")
    assert engine_learner_gap(model, processor, reqs, outs) <= 1e-5


def test_engine_is_seeded_and_greedy_is_deterministic(tiny):
    model, processor = tiny
    rng = np.random.default_rng(4)
    imgs = [image(64, 64, 1)]
    req = Request(tuple(prompt_ids(processor, imgs, rng)), imgs, SamplingParams(1.0, 0.9, 10), "a")
    a = LocalEngine(model, processor, 0, seed=5).generate([req])[0]
    b = LocalEngine(model, processor, 0, seed=5).generate([req])[0]
    assert a == b
    greedy = dataclasses.replace(req, sampling=SamplingParams(0.0, 1.0, 10))
    g1 = LocalEngine(model, processor, 0, seed=1).generate([greedy])[0]
    g2 = LocalEngine(model, processor, 0, seed=2).generate([greedy])[0]
    assert g1.token_ids == g2.token_ids and len(g1.token_ids) == 10


LOSS_OPTIONS = [LossConfig(), LossConfig(agg="seq-mean-token-mean"), LossConfig(dual_clip=3.0),
                LossConfig(kl_coef=0.1, kl_estimator="k1"), LossConfig(kl_coef=0.1,
                                                                       kl_estimator="k2"),
                LossConfig(kl_coef=0.05, kl_estimator="k3"), LossConfig(tis_cap=2.0),
                LossConfig(clip_low=0.1, clip_high=0.5, dual_clip=2.0, tis_cap=1.5,
                           kl_coef=0.2, agg="seq-mean-token-mean")]


@pytest.mark.parametrize("cfg", LOSS_OPTIONS)
def test_torch_loss_equals_numpy_reference(cfg):
    rng = np.random.default_rng(5)
    T = 64
    lp, old, ref, ro = (rng.normal(-1.5, 0.6, T) for _ in range(4))
    adv = np.repeat(rng.normal(0, 1, 4), T // 4)
    mask = (rng.random(T) > 0.25).astype(np.float64)
    seq_ids = np.repeat(np.arange(4), T // 4)
    expected, _ = policy_loss(lp, old, adv, mask, cfg, ref_logp=ref, rollout_logp=ro,
                              seq_ids=seq_ids)
    t = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    logp = t(lp).requires_grad_()
    terms = per_token_terms(logp, t(old), t(adv), cfg, ref_logp=t(ref), rollout_logp=t(ro),
                            xp=torch)
    w = token_weights(mask, cfg.agg, seq_ids=seq_ids)
    loss = (terms["loss"] * t(w)).sum()
    assert loss.item() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    loss.backward()
    assert torch.isfinite(logp.grad).all() and logp.grad[mask == 0].abs().max() == 0


def two_turns(engine, processor, seed):
    """Two sessions, two turns each: turn 2 continues turn 1 with random observation tokens."""
    rng = np.random.default_rng(seed)
    reqs = []
    for i in range(2):
        imgs = [image(int(rng.integers(40, 120)), 64, 200 + 10 * i + k) for k in range(1 + i)]
        reqs.append(Request(tuple(prompt_ids(processor, imgs, rng)), imgs,
                            SamplingParams(1.0, 1.0, 6 + 4 * i, (7,)), f"s{i}"))
    first = engine.generate(reqs)
    follow = [dataclasses.replace(r, input_ids=tuple(r.input_ids) + tuple(o.token_ids) + tuple(
        int(x) for x in rng.integers(1, 200, 5 + i))) for i, (r, o) in enumerate(zip(reqs, first))]
    return follow, first, engine.generate(follow)


def test_kv_cache_across_turns_changes_nothing(tiny):
    model, processor = tiny
    cached = LocalEngine(model, processor, 0, seed=9, keep_cache=True)
    fresh = LocalEngine(model, processor, 0, seed=9, keep_cache=False)
    reqs_a, first_a, second_a = two_turns(cached, processor, 7)
    assert set(cached._cache) == {"s0", "s1"}
    assert all(len(e.ids) > 0 for e in cached._cache.values())
    reqs_b, first_b, second_b = two_turns(fresh, processor, 7)
    for a, b in zip(first_a + second_a, first_b + second_b):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    # and the cached engine's second-turn log-probs equal the learner's on the whole episode
    assert engine_learner_gap(model, processor, reqs_a, second_a) <= 1e-5
    cached.clear_cache()
    assert cached._cache == {}


def test_engine_never_samples_image_placeholders():
    model, patch = qwen3_vl(seed=1)
    processor = ImageOnlyProcessor(patch)
    with torch.no_grad():  # make the image placeholder by far the likeliest next token
        model.lm_head.weight[IMG] = model.lm_head.weight[IMG].sign() * 50.0
    rng = np.random.default_rng(0)
    imgs = [image(64, 64, 0)]
    req = Request(tuple(prompt_ids(processor, imgs, rng)), imgs, SamplingParams(1.0, 1.0, 8), "x")
    out = LocalEngine(model, processor, 0, seed=0).generate([req])[0]
    assert IMG not in out.token_ids and len(out.token_ids) == 8


def test_non_finite_step_is_skipped_and_lr_schedules():
    from configs import base
    from common.schedule import lr_factor
    from geo3k_torch.learner import Learner
    model, patch = qwen3_vl(seed=2)
    model.train()
    processor = ImageOnlyProcessor(patch)
    seqs = sequences(processor, np.random.default_rng(3), n=2)
    seqs[0].advantage = float("nan")
    learner = Learner(model, processor, LossConfig(), base.get_config().train, 1.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    m = learner.train_step(pack(seqs, 10_000), 20.0, 2.0)
    assert m["skipped"] == 1.0 and not np.isfinite(m["grad_norm"])
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    seqs[0].advantage = 1.0
    m = learner.train_step(pack(seqs, 10_000), 20.0, 2.0)
    assert m["skipped"] == 0.0 and np.isfinite(m["grad_norm"])
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    # warmup then decay: linear and cosine reach min_ratio at the last step
    assert [lr_factor(s, "constant", 2, 10) for s in (0, 1, 2, 9)] == [0.5, 1.0, 1.0, 1.0]
    assert lr_factor(10, "linear", 0, 10, 0.1) == pytest.approx(0.1)
    assert lr_factor(5, "cosine", 0, 10) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        lr_factor(0, "step", 0, 10)


def test_shared_group_prefill_equals_separate_prefills(tiny, monkeypatch):
    """A group's identical first-turn requests are prefilled once (one row in the prefill
    forward, its images processed once) and give the tokens and log-probs of separate
    prefills, greedy and sampled, and the same kept caches for the next turn."""
    model, processor = tiny
    rng = np.random.default_rng(6)
    imgs = [image(90, 50, 1), image(40, 70, 2)]
    ids = tuple(prompt_ids(processor, imgs, rng))
    other = [image(64, 64, 3)]
    group = [Request(ids, [im.copy() for im in imgs], SamplingParams(t, 1.0, 8), f"g{i}")
             for i, t in enumerate([1.0, 1.0, 0.0, 1.0])]
    reqs = group[:2] + [Request(tuple(prompt_ids(processor, other, rng)), other,
                                SamplingParams(1.0, 0.9, 8), "o")] + group[2:]
    prefill_rows, processed = [], []
    forward, process = model.forward, engine_module.image_inputs

    def spy(*a, **kw):
        if kw.get("past_key_values") is None:
            prefill_rows.append(kw["input_ids"].shape[0])
        return forward(*a, **kw)

    monkeypatch.setattr(model, "forward", spy)
    monkeypatch.setattr(engine_module, "image_inputs",
                        lambda p, ims: processed.append(len(ims)) or process(p, ims))
    shared_engine = LocalEngine(model, processor, 0, seed=11)
    shared = shared_engine.generate(reqs)
    assert prefill_rows == [2] and processed == [3]
    separate_engine = LocalEngine(model, processor, 0, seed=11, share_prefill=False)
    separate = separate_engine.generate(reqs)
    assert prefill_rows[1:] == [5] and processed[1:] == [3]
    for a, b in zip(shared, separate):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
    assert len({tuple(o.token_ids) for o in shared[:2] + shared[3:]}) > 1  # samples differ
    for s in shared_engine._cache:  # the next turn continues from equal caches
        for k_a, k_b in zip(shared_engine._cache[s].keys, separate_engine._cache[s].keys):
            assert torch.allclose(k_a, k_b, rtol=0, atol=1e-5)
