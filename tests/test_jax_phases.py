"""Device memory between a step's phases (`geo3k_jax.learner.phases`): the JAX engine's cache and
weights freed for the learner's step and made again for the next rollout, and the learner's
state kept in host memory during rollouts, each changing no token, log-prob or parameter and
compiling nothing anew; the settings' checks; the budget's phases with and without them."""

import jax
import numpy as np
import pytest
from jax import monitoring

from common.grpo import LossConfig
from configs import base
from geo3k_jax.aot import budget
from geo3k_jax.learner.phases import HOST, check_phases, frees_engine
from tests.jax_learner_setup import model_and_batch, train_config
from tests.test_jax_engine import episodes

BACKEND_COMPILES = [0]  # every XLA compile in this process, counted from here on
monitoring.register_event_duration_secs_listener(
    lambda event, _secs, **_: BACKEND_COMPILES.__setitem__(
        0, BACKEND_COMPILES[0] + (event == "/jax/core/compile/backend_compile_duration")))


@pytest.fixture(scope="module")
def setup():
    return model_and_batch("qwen3_vl")


def run(setup, free: bool, offload: str, steps: int = 2) -> dict:
    """`steps` rounds of two-turn sessions, each then a learner step inside the backend's
    train_context and the weight copy, as the loop runs them; then a round at the last weights
    and, after one more free-and-copy cycle, the same round again from the RNG state it
    started with. Returns the rounds' tokens and log-probs, the losses, the final parameters
    and what was seen on the way."""
    from geo3k_jax.engine.backend import JaxBackend
    learner = setup.learner(LossConfig(kl_coef=0.1, kl_estimator="k3"), train_config(),
                            ref_params=setup.params)
    backend = JaxBackend(learner, setup.processor, setup.config, seed=11, slots=2,
                         context=512, free=free, offload=offload)
    seen = {"rounds": [], "losses": [], "kinds": set(), "freed": []}
    for step in range(1, steps + 1):
        rng = backend.rng_state()
        turns = episodes(backend.engine, setup.processor, 3 + step, turns=2, max_new=8)
        seen["rounds"].append([(o.token_ids, o.logprobs) for _, outs in turns for o in outs])
        seen["kinds"] |= {a.sharding.memory_kind for a in jax.tree.leaves(learner.opt_state)}
        with backend.train_context():
            seen["freed"].append(backend.params is None and backend.engine._cache is None)
            seen["losses"].append(float(setup.step(learner)["loss"]))
        backend.sync(learner, step)
    rng = backend.rng_state()
    last = episodes(backend.engine, setup.processor, 9, turns=2, max_new=8)
    with backend.train_context():  # freed and made again, the weights unchanged
        pass
    backend.sync(learner, steps)
    backend.set_rng_state(rng)
    compiles, engine_compiles = BACKEND_COMPILES[0], backend.engine.compiles
    again = episodes(backend.engine, setup.processor, 9, turns=2, max_new=8)
    seen["last"], seen["again"] = ([(o.token_ids, o.logprobs) for _, outs in t for o in outs]
                                   for t in (last, again))
    seen["new_compiles"] = (BACKEND_COMPILES[0] - compiles,
                            backend.engine.compiles - engine_compiles)
    seen["params"] = {k: np.asarray(v) for k, v in learner.params.items()}
    seen["frees"] = backend.engine.frees
    return seen


@pytest.fixture(scope="module")
def kept(setup):
    return run(setup, free=False, offload="none")


def same(a, b) -> None:
    for (ta, la), (tb, lb) in zip(a, b, strict=True):
        assert ta == tb
        np.testing.assert_array_equal(np.asarray(la), np.asarray(lb))


@pytest.mark.slow
def test_freeing_the_engine_changes_nothing_and_compiles_nothing(setup, kept):
    """The engine's cache and weights are gone inside train_context and the next rollout
    samples the same tokens with the same log-probs (bit for bit: the same weights, a zero
    cache of the same shapes, the same keys); freed and made again, the engine and the whole
    process compile nothing (a recompile would show as an XLA compile)."""
    freed = run(setup, free=True, offload="none")
    assert freed["freed"] == [True, True] and kept["freed"] == [False, False]
    for a, b in zip(kept["rounds"], freed["rounds"], strict=True):
        same(a, b)
    assert freed["losses"] == kept["losses"]
    assert freed["frees"] == 3
    same(freed["again"], freed["last"])  # the repeat after a free: the same samples
    assert freed["new_compiles"] == (0, 0)
    assert kept["new_compiles"] == (0, 0)


@pytest.mark.slow
@pytest.mark.parametrize("offload", ["moments", "all"])
def test_offloaded_state_changes_nothing(setup, kept, offload):
    """The learner's moments (or its whole state) wait in host memory during rollouts (JAX's
    pinned_host memory kind: on a CPU a copy within the host's memory) and come back to the
    shardings its programs were compiled for: the same losses, parameters and samples, and
    no compile on the way."""
    moved = run(setup, free=True, offload=offload)
    assert HOST in moved["kinds"]
    assert moved["losses"] == kept["losses"]
    for k, v in kept["params"].items():
        np.testing.assert_array_equal(moved["params"][k], v)
    for a, b in zip(kept["rounds"], moved["rounds"], strict=True):
        same(a, b)
    assert moved["new_compiles"] == (0, 0)


def cfg(**jax_kw):
    c = base.get_config()
    c.engine.backend = "local"
    for k, v in jax_kw.items():
        if k == "max_staleness":
            c.train.max_staleness = v
        else:
            c.jax[k] = v
    return c


def test_settings():
    """free_engine is on by default and ignored, with a line saying why, where rollouts
    overlap training; offload is refused there and outside its three values."""
    assert frees_engine(cfg()) and check_phases(cfg()) == []
    assert not frees_engine(cfg(max_staleness=1))
    (note,) = check_phases(cfg(max_staleness=1))
    assert "jax.free_engine is ignored" in note and "max_staleness=1" in note
    assert check_phases(cfg(max_staleness=1, free_engine=False)) == []
    with pytest.raises(ValueError, match="train.max_staleness=0"):
        check_phases(cfg(max_staleness=1, offload="moments", free_engine=False))
    with pytest.raises(ValueError, match="one of none, moments, all"):
        check_phases(cfg(offload="everything"))


def test_budget_phases():
    """The budget's phases from a learner's and an engine's reports (GiB a device): the engine
    freed, the train phase holds the learner's program alone and the weight copy one copy of the
    weights without the cache; offloaded, the rollout holds the learner's state less the
    moments (or less all of it). A broken budget (the engine kept in the train phase, the old
    weights in the copy) gives 33 and 20 instead of 20 and 15."""
    G = 2 ** 30
    learner = {"programs": [{"program": "grad", "peak": 20 * G, "fits": True}],
               "resident": 12 * G, "parts": {"params": 3 * G, "moments": 6 * G,
                                             "reference": 3 * G}}
    engine = {"programs": [{"program": "prefill", "peak": 14 * G, "resident": 0}],
              "weights": 3 * G, "cache": 10 * G, "slots": 10, "data_shards": 1}
    kept = budget(learner, engine, 40 * G, False)
    assert {k: v / G for k, v in kept["phases"].items()} == {
        "rollout": 26, "weight copy": 28, "train": 33}
    assert kept["slots_fit"] == 10 + 7
    freed = budget(learner, engine, 40 * G, False, free=True)
    assert {k: v / G for k, v in freed["phases"].items()} == {
        "rollout": 26, "weight copy": 15, "train": 20}
    assert freed["slots_fit"] == 10 + 14  # only the rollout holds the cache now
    moments = budget(learner, engine, 40 * G, False, free=True, offload="moments")
    assert moments["phases"]["rollout"] / G == 20
    every = budget(learner, engine, 40 * G, False, free=True, offload="all")
    assert every["phases"]["rollout"] / G == 14
    with pytest.raises(ValueError, match="cannot be freed"):
        budget(learner, engine, 40 * G, True, free=True)


@pytest.mark.slow
def test_an_offloaded_learner_lowers_its_programs_for_device_memory(setup):
    """`lower` (what `geo3k_jax.aot` and scripts/tpu_check.py's memory section compile) on a
    learner whose whole state waits in host memory: its programs are lowered for the state in
    device memory, and the state stays offloaded. (Under a mesh, lowering from the host
    arrays' shardings failed in tpu_check's memory section: "memory_space of all inputs passed
    to `gather` must be the same"; that section's --tiny run, tests/test_tpu_check.py, covers
    the mesh; on one device, as here, the programs' shardings hid it.)"""
    from geo3k_jax.aot import abstract_slice

    length = setup.batch["input_ids"].shape[1]
    learner = setup.learner(LossConfig(), train_config(), shape={
        "length": length, "targets": 64, "patches": 64, "window": length, "prefix_window": 0})
    learner.offload("all")
    lowered = learner.lower(abstract_slice(learner, setup.config))
    assert set(lowered) == {"grad", "apply"}
    assert {a.sharding.memory_kind for a in jax.tree.leaves(learner.params)} == {HOST}
