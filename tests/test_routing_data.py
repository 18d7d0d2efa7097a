"""Routing replay's data path in common/: the engine's routed experts per completion become each
trajectory's (T, L, K) rows, survive the turn split, the packing (shared prompts included) and
reach the learner's micro-batch; missing or malformed routing is an error, not free routing."""

import dataclasses

import numpy as np
import pytest

from common.batching import TrainSequence, pack, replayed_routing, training_sequences
from common.engine import Completion
from common.rollout import RolloutConfig, rollout, split_turns
from tests.conftest import IMAGE, Reply, ScriptedEngine, make_prompt
from tests.test_rollout import call

L, K, E = 3, 2, 5


def route(t: int) -> np.ndarray:
    """(L, K): the scripted experts of position t (distinct per position and layer)."""
    return np.array([[(t + layer) % E, (t + layer + 1) % E] for layer in range(L)])


class RoutingEngine(ScriptedEngine):
    """The scripted engine, returning routed experts as SGLang does: one row per position fed
    (the request's ids, then every new token but the last). `short` drops one row."""

    def __init__(self, script, short: bool = False):
        super().__init__(script)
        self.short = short

    def generate(self, requests):
        outs = super().generate(requests)
        done = []
        for req, out in zip(requests, outs):
            n = len(req.input_ids) + len(out.token_ids) - 1 - self.short
            done.append(dataclasses.replace(out, routed_experts=np.stack([route(t)
                                                                         for t in range(n)])))
        return done


def test_a_trajectory_holds_the_routing_of_every_position_its_last_call_was_fed(renderer):
    prompt = make_prompt(answer="12")
    engine = RoutingEngine({"0-0": [Reply(call("10")), Reply(call("12"))],
                            "0-1": [Reply(call("12"))]})
    cfg = RolloutConfig(n_samples=2, max_response_tokens=1000, max_context_tokens=2000)
    two, one = rollout([prompt], engine, renderer, cfg)
    assert len(two.turns) == 2 and len(one.turns) == 1
    for traj in (two, one):
        T = len(traj.token_ids)
        assert traj.routed_experts.shape == (T, L, K) and traj.routed_experts.dtype == np.int16
        np.testing.assert_array_equal(traj.routed_experts[:T - 1],
                                      np.stack([route(t) for t in range(T - 1)]))
        assert (traj.routed_experts[T - 1] == -1).all()  # the last token was never fed

    first, second = split_turns(two)
    assert first.routed_experts.shape[0] == len(first.token_ids) == two.turns[0].end
    np.testing.assert_array_equal(second.routed_experts, two.routed_experts)


def test_without_recorded_routing_a_trajectory_has_none(renderer):
    engine = ScriptedEngine({"0-0": [Reply(call("12"))]})
    (traj,) = rollout([make_prompt(answer="12")], engine, renderer,
                      RolloutConfig(n_samples=1, max_response_tokens=100,
                                    max_context_tokens=2000))
    assert traj.routed_experts is None


def test_routing_of_the_wrong_length_or_shape_is_refused(renderer):
    engine = RoutingEngine({"0-0": [Reply(call("12"))]}, short=True)
    with pytest.raises(ValueError, match="rows for the .* positions it was fed"):
        rollout([make_prompt(answer="12")], engine, renderer,
                RolloutConfig(n_samples=1, max_response_tokens=100, max_context_tokens=2000))
    with pytest.raises(ValueError, match=r"\(positions, layers, top_k\)"):
        Completion([1], [0.0], "stop", routed_experts=np.zeros((1, 2)))


def seq(ids, trained_from, routed, images=()):
    n = len(ids)
    mask = (np.arange(n) >= trained_from).astype(np.int8)
    return TrainSequence(np.asarray(ids), mask, np.zeros(n, np.float32), 1.0, list(images), 0,
                         routed_experts=routed)


def test_packing_keeps_each_tokens_routing_and_a_shared_prompt_takes_its_first_samples():
    rng = np.random.default_rng(0)
    prompt = [IMAGE, 7, 8, 9]
    a = seq(prompt + [1, 2, 3], 5, rng.integers(0, E, (7, L, K)).astype(np.int16), ["img"])
    b = seq(prompt + [4, 5], 5, rng.integers(0, E, (6, L, K)).astype(np.int16), ["img"])
    plain = seq([3, 3, 3], 1, None)
    (batch,) = pack([a, b, plain], 64)
    np.testing.assert_array_equal(batch.routed_experts, np.concatenate(
        [a.routed_experts, b.routed_experts, np.full((3, L, K), -1)]))

    (shared,) = pack([a, b], 64, image_token_id=IMAGE)
    n = 4  # the shared prefix: every token before the one that predicts the first trained one
    assert shared.parents is not None and shared.cu_seqlens[1] == n
    np.testing.assert_array_equal(shared.routed_experts, np.concatenate(
        [a.routed_experts[:n], a.routed_experts[n:], b.routed_experts[n:]]))
    assert replayed_routing(shared) is shared.routed_experts


def test_a_trained_batch_without_routing_is_an_error_and_a_filler_routes_freely():
    (batch,) = pack([seq([1, 2, 3], 1, None)], 64)
    with pytest.raises(ValueError, match="--enable-return-routed-experts"):
        replayed_routing(batch)
    (filler,) = pack([seq([1, 2, 3], 3, None)], 64)  # no trained token
    assert replayed_routing(filler) is None
    with pytest.raises(ValueError, match="different"):
        pack([seq([1, 2], 1, np.zeros((2, L, K), np.int16)),
              seq([1, 2], 1, np.zeros((2, L + 1, K), np.int16))], 64)


def test_training_sequences_carry_the_routing(renderer):
    engine = RoutingEngine({"0-0": [Reply(call("10")), Reply(call("12"))]})
    (traj,) = rollout([make_prompt(answer="12")], engine, renderer,
                      RolloutConfig(n_samples=1, max_response_tokens=1000,
                                    max_context_tokens=2000))
    (whole,) = training_sequences([traj], [1.0])
    assert whole.routed_experts is traj.routed_experts
    pieces = training_sequences([traj], [1.0], "individual")
    assert [len(p.routed_experts) for p in pieces] == [len(p) for p in pieces]
