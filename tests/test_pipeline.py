"""`common.pipeline`: the next step's prompts drawn and rendered ahead (k = 0)."""

import pytest

from common.pipeline import rollout_source
from common.sampler import PromptSampler


def _source(render, k=0, steps=3):
    sampler = PromptSampler(10, seed=0)
    seen = []  # (prompts, offset, rendered) of every collect

    def draw(step):
        ids = sampler.next_batch(2)
        return ids, (step - 1) * 2, sampler.state()

    def collect(prompts, offset, rendered):
        seen.append((prompts, offset, rendered))
        return [], {"time_rollout": 0.0}

    return rollout_source(k, draw, collect, 1, steps, render), seen


def test_prepared_prompts_are_the_ones_next_would_draw():
    plain, plain_seen = _source(None)
    ahead, ahead_seen = _source(lambda prompts: [f"ids of {p}" for p in prompts])
    states = {}
    for step in (1, 2, 3):
        for name, source in (("plain", plain), ("ahead", ahead)):
            _, _, states[(name, step)] = source.next(step)
            if step < 3:  # as the loop does after update `step`
                source.prepare(step + 1)
    for (p, o, r), (q, u, s) in zip(plain_seen, ahead_seen):
        assert (p, o) == (q, u)
        assert r is None
    assert ahead_seen[0][2] is None  # the first step: nothing was prepared
    assert ahead_seen[1][2] == [f"ids of {p}" for p in ahead_seen[1][0]]
    # the sampler state a checkpoint of step s stores is the one after s's own draw
    assert all(states[("plain", s)] == states[("ahead", s)] for s in (1, 2, 3))


def test_a_render_failure_is_raised_by_the_step_that_needs_it():
    def render(prompts):
        raise ValueError("a prompt the template cannot render")

    source, seen = _source(render)
    source.next(1)
    source.prepare(2)  # does not raise: step 1 still logs its metrics and checkpoint
    with pytest.raises(ValueError, match="cannot render"):
        source.next(2)
    assert len(seen) == 1


def test_prepared_for_another_step_is_refused():
    source, _ = _source(lambda prompts: prompts)
    source.next(1)
    source.prepare(2)
    with pytest.raises(RuntimeError, match="prepared for step 3"):
        source.next(3)


def test_rollouts_ahead_render_their_own_prompts():
    source, seen = _source(lambda prompts: pytest.fail("rendered ahead with k >= 1"), k=1)
    try:
        source.next(1)
        source.prepare(2)
        source.landed(1)
        source.next(2)
    finally:
        source.close()
    assert [r for _, _, r in seen[:2]] == [None, None]


def test_processes_share_one_order_and_resume_each_from_its_own_state():
    """One process keeps the order it always had; two processes drawing 3 each take the two
    halves of what one process drawing 6 takes, across epochs (the data order does not depend
    on the number of processes); a checkpoint holds one state per process and each resumes
    exactly from its own; a checkpoint of another process count, another split size or the
    old per-process streams is refused."""
    import numpy as np

    one = PromptSampler(5, seed=3)
    assert one.next_batch(5) == np.random.default_rng([3, 0]).permutation(5).tolist()
    one = PromptSampler(5, seed=3)
    two = [PromptSampler(5, seed=3, rank=r, world=2) for r in range(2)]
    for _ in range(4):  # 24 indices: through epochs 0-4, boundaries inside batches
        whole = one.next_batch(6)
        assert two[0].next_batch(3) + two[1].next_batch(3) == whole
    saved = [s.state() for s in two]  # what loop_state.json holds
    for r, s in enumerate(two):
        resumed = PromptSampler.of_process(saved, r, 2, n=5)
        assert resumed.next_batch(4) == s.next_batch(4)
    single = PromptSampler(5, seed=3)
    single.next_batch(2)
    assert PromptSampler.of_process(single.state(), 0).next_batch(4) == single.next_batch(4)
    with pytest.raises(ValueError, match="holds 2 processes' prompt samplers; this run has 3"):
        PromptSampler.of_process(saved, 2, 3)
    with pytest.raises(ValueError, match="over 5 training problems; this run's .* has 6"):
        PromptSampler.of_process(saved, 1, 2, n=6)
    streams = [{"epoch": 0, "position": 2, "n": 5, "seed": 3, "stream": r} for r in range(2)]
    with pytest.raises(ValueError, match="per-process streams"):
        PromptSampler.of_process(streams, 1, 2)
    with pytest.raises(ValueError, match="rank must be in"):
        PromptSampler(5, seed=3, rank=2, world=2)
