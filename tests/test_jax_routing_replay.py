"""Routing replay (R3, `loss.routing_replay`) on the JAX side, tiny Qwen3-VL-MoE in fp32 on CPU:
the engine records the experts transformers routes the same tokens to, across turns and kept
caches; with replay the learner's log-probs are the engine's where free routing differs; the
routing follows the learner's packed rows; a dense model is refused. (The sparse block's own
replay: tests/test_jax_moe.py.)"""

import dataclasses

import jax
import numpy as np
import pytest
import torch

from common.batching import TrainSequence, pack
from common.grpo import LossConfig
from geo3k_jax.core.batch import assemble, host_row
from geo3k_jax.engine.engine import JaxEngine
from geo3k_jax.learner.learner import Learner
from tests.jax_learner_setup import train_config
from tests.test_jax_engine import Tiny
from tests.tiny_models import ImageOnlyProcessor, qwen3_vl_moe

jax.config.update("jax_default_matmul_precision", "highest")
ROUTER = "model.language_model.layers.mlp.gate.weight"  # (layers, experts, hidden), stacked


def routed(n, layers=2, k=2, seed=0):
    return np.random.default_rng(seed).integers(0, 4, (n, layers, k)).astype(np.int16)


def test_routing_follows_the_packed_rows_with_shared_prompts_and_fillers():
    """Two samples sharing a 6-token prompt packed as prefix + continuations, then a filler:
    row 0's routing is the prompt's (its first sample's), then each continuation's own rows,
    -1 on padding; the filler's row is -1 throughout; a trained batch without routing is an
    error (the engine did not record it)."""
    from tests.jax_learner_setup import config
    cfg, patch = config("qwen3_vl_moe")
    processor = ImageOnlyProcessor(patch)
    ids = np.r_[np.arange(1, 7), [20, 21, 22]].astype(np.int64)
    mask = np.r_[np.zeros(6), np.ones(3)].astype(np.int8)
    seqs = [TrainSequence(ids + np.r_[[0] * 7, i, i], mask, np.zeros(9, np.float32), 1.0, [], i,
                          routed_experts=routed(9, seed=i)) for i in range(2)]
    (b,) = pack(seqs, 64, image_token_id=int(cfg.image_token_id))
    n = int(b.cu_seqlens[1])  # the shared prefix: the prompt but its last token
    assert n == 5 and b.num_tokens == n + 2 * (9 - n) and b.parent_of()[1:].tolist() == [0, 0]
    filler = dataclasses.replace(b, loss_mask=np.zeros_like(b.loss_mask), routed_experts=None)
    rows = [host_row(x, processor, cfg, agg="token-mean", n_tokens=6.0, n_seqs=2.0,
                     routing=(2, 2)) for x in (b, filler)]
    out = assemble(rows, cfg, n_rows=3, length=16, n_targets=8, n_patches=0, routing=(2, 2))
    r = out["routing"]
    assert r.shape == (3, 16, 2, 2) and r.dtype == np.int16
    want = np.concatenate([seqs[0].routed_experts[:n], seqs[0].routed_experts[n:],
                           seqs[1].routed_experts[n:]])
    assert np.array_equal(r[0, :13], want) and (r[0, 13:] == -1).all()
    assert (r[1:] == -1).all()
    with pytest.raises(ValueError, match="carry no routed experts"):
        host_row(dataclasses.replace(b, routed_experts=None), processor, cfg, agg="token-mean",
                 n_tokens=6.0, n_seqs=2.0, routing=(2, 2))
    with pytest.raises(ValueError, match=r"over \(layers, top_k\) = \(3, 2\)"):
        host_row(b, processor, cfg, agg="token-mean", n_tokens=6.0, n_seqs=2.0, routing=(3, 2))


def test_a_dense_model_refuses_routing_replay():
    from tests.jax_learner_setup import config
    cfg, _ = config("qwen3_vl")
    with pytest.raises(ValueError, match="no sparse layer: set loss.routing_replay=False"):
        Learner(None, {}, LossConfig(routing_replay=True), train_config(), 1.0, config=cfg)
    with pytest.raises(ValueError, match="record_routing: the model has no sparse"):
        JaxEngine(None, lambda: {}, None, cfg, record_routing=True)


# ---- the engine and the learner (each compiles the engine: slow) -----------------------------

@pytest.fixture(scope="module")
def tiny():
    from tests.test_jax_model import jax_copy
    hf, patch = qwen3_vl_moe()
    merge, params = jax_copy(hf)
    processor = ImageOnlyProcessor(patch)
    return Tiny(hf, processor, merge, params, JaxEngine(
        merge, lambda: params, processor, hf.config, slots=2, record_routing=True))


def transformers_routing(hf, processor, ids: np.ndarray, images) -> np.ndarray:
    """(T, layers, K): the experts transformers' forward routes each of the tokens `ids` to,
    from every decoder layer's router (its top-k indices)."""
    from geo3k_torch.model import packed_inputs
    (b,) = pack([TrainSequence(ids, np.zeros(len(ids), np.int8), np.zeros(len(ids), np.float32),
                               0.0, list(images), 0)], len(ids))
    got = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, o: got.append(o[2]))
             for layer in hf.model.language_model.layers]
    try:
        with torch.no_grad():
            hf(**packed_inputs(b, processor, hf.config), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return np.stack([g.reshape(len(ids), -1).numpy() for g in got], axis=1)


@pytest.mark.slow
def test_engine_records_the_experts_transformers_routes_to(tiny):
    """Two turns of 3 sessions with 1-3 images on 2 slots (kept caches and evicted ones): every
    completion's routed_experts has a row per position fed (request + new tokens - 1), and
    each row's expert set is the one transformers' Qwen3-VL-MoE routes that token to in each
    layer, the rows of cached positions included. A row off by one, or the cached rows of the
    wrong turn, would differ on most positions (4 experts, 2 a token: 6 sets)."""
    from tests.test_jax_engine import episodes
    engine = tiny.engine(4)
    evicted, prefilled = engine.evictions, engine.prefilled
    turns = episodes(engine, tiny.processor, 2, turns=2, temperature=0.7)
    whole = sum(len(r.input_ids) for reqs, _ in turns for r in reqs)
    assert engine.evictions > evicted and engine.prefilled - prefilled < whole
    positions = differ = 0
    for reqs, outs in turns:
        for r, o in zip(reqs, outs):
            fed = np.r_[np.asarray(r.input_ids), o.token_ids[:-1]].astype(np.int64)
            assert o.routed_experts.shape == (len(fed), 2, 2) and o.routed_experts.min() >= 0
            want = transformers_routing(tiny.hf, tiny.processor, fed, r.images)
            differ += int((np.sort(o.routed_experts, -1) != np.sort(want, -1)).any(-1).sum())
            positions += len(fed)
    assert positions > 200 and differ == 0, (differ, positions)


def tie_expert(params: dict, eps: float, seed: int = 0) -> dict:
    """`params` whose router scores expert 3 as expert 2 in every layer, plus eps x a random
    direction: eps = 0 ties them exactly (top_k keeps the lower index, 2), any eps > 0 moves
    expert 3 ahead of 2 for about half the tokens."""
    w = np.asarray(params[ROUTER]).copy()
    noise = np.random.default_rng(seed).standard_normal(w[:, 2].shape).astype(np.float32)
    w[:, 3] = w[:, 2] + eps * noise * np.abs(w[:, 2]).mean()
    return dict(params, **{ROUTER: jax.numpy.asarray(w)})


def episode_sequences(turns) -> list[TrainSequence]:
    """Each session's whole episode as one training sequence (tests/test_jax_engine's), with the
    last turn's routed experts, -1 for its last token (never fed)."""
    from tests.test_jax_engine import trajectories
    seqs = trajectories(turns)
    for s, o in zip(seqs, turns[-1][1]):
        rows = np.full((len(s.token_ids), 2, 2), -1, np.int16)
        rows[:len(o.routed_experts)] = o.routed_experts
        s.routed_experts = rows
    return seqs


def episodes_of(tiny, params: dict, temperature: float):
    """tests/test_jax_engine's two-turn episodes of 3 sessions, sampled from `params`."""
    from tests.test_jax_engine import episodes
    return episodes(tiny.engine(4, params), tiny.processor, 2, turns=2, temperature=temperature)


@pytest.mark.slow
def test_replayed_learner_logprobs_are_the_engines_where_free_routing_differs(tiny, capsys):
    """The engine samples with experts 2 and 3 tied in every router (the tie goes to 2); the
    learner's router puts expert 3 a hair (1e-4 of a weight) ahead of 2 on about half the
    tokens. Routing freely, the learner sends those tokens to expert 3, other weights than
    the engine's: its log-probs move by about 1e-2. Replaying the engine's routing it computes
    the engine's experts with the engine's weights (a replayed weight reads only the replayed
    experts' probabilities: expert 3's score matters only where the engine chose both),
    the engine's log-probs to 1e-5. Replaying the learner's own free routing changes
    nothing, bit for bit; the step's metrics report both mismatches and the share of flips."""
    temperature = 0.7
    turns = episodes_of(tiny, tie_expert(tiny.params, 0.0), temperature)
    batches = pack(episode_sequences(turns), 1024)
    assert len(batches) == 1
    learned = tie_expert(tiny.params, 1e-4)
    kw = dict(processor=tiny.processor, config=tiny.hf.config, row_len=1024)
    replay = Learner(tiny.merge, learned, LossConfig(routing_replay=True), train_config(),
                     temperature, **kw)
    free = Learner(tiny.merge, learned, LossConfig(), train_config(), temperature, **kw)
    (b,) = batches
    mask = b.loss_mask > 0
    gap = {name: float(np.abs(learner.logprobs(batches)[0][mask] - b.rollout_logprobs[mask])
                       .max()) for name, learner in (("replay", replay), ("free", free))}
    # the learner's own free routing of the batch, and how often it differs from the engine's
    sl = free._slices(batches, 1.0, 1.0)[0]
    _, tops = jax.jit(lambda p, s: free.merge(p).hidden_states(s, record=True))(learned, sl)
    own = np.moveaxis(np.asarray(tops)[:, 0, :b.num_tokens], 0, 1)  # (T, L, K)
    recorded = (b.routed_experts >= 0).all(-1)
    differs = (np.sort(own, -1) != np.sort(b.routed_experts, -1)).any(-1) & recorded
    flips = int(differs.sum())
    trained = recorded & mask[:, None]  # the metric counts the trained tokens' routings
    itself = replay.logprobs([dataclasses.replace(b, routed_experts=own.astype(np.int16))])[0]
    metrics = replay.train_step(batches, float(mask.sum()), float(len(b.cu_seqlens) - 1))
    with capsys.disabled():
        print(f"\nrouting replay: {flips} of {int(recorded.sum())} (token, layer) routings "
              f"flipped; max |learner - engine| log-prob {gap['replay']:.2e} replayed, "
              f"{gap['free']:.2e} free")
    assert flips >= 10 and mask.sum() > 30
    assert gap["replay"] <= 1e-5 and gap["free"] >= 1e-3
    assert np.array_equal(itself, free.logprobs(batches)[0])
    assert metrics["logp_diff_max"] == pytest.approx(gap["replay"], abs=1e-6)
    assert metrics["logp_diff_max_free"] == pytest.approx(gap["free"], rel=1e-4)
    assert (differs & trained).any()
    assert metrics["routing_replay_mismatch"] == pytest.approx((differs & trained).sum()
                                                               / trained.sum())
