"""The torch engine's fast decode paths against their plain twins, fp32 on CPU: attention over
the longest position in buckets (`attention_bucket`), slots and steps kept across calls
(`keep_slots`), the step torch.compile'd (`compile`; aot_eager here, inductor in one slow test).

Each gives the plain engine's tokens and log-probs, greedy and seeded sampling alike, over
refilled and compacted slots and second turns: a span one index short, a key written at the
wrong place or a kept slot's stale state would change them. Kept slots are reused by a call
that fits them with no new step built and nothing recompiled (on a GPU: no new capture), and
replaced by one that does not fit. A step's warm-up (run before each CUDA-graph capture, which
needs a GPU: tests/test_torch_engine_fast.py's gpu test and scripts/gpu_sections.py's
engine_torch cover the capture) leaves nothing the step itself would not.

    python -m pytest -q tests/test_torch_decode_paths.py  # about a minute on two CPU cores
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import weakref

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

from common.engine import Request, SamplingParams
from geo3k_torch.decode import Decoder, Slots
from geo3k_torch.engine import LocalEngine
from tests.test_torch_engine_fast import ARCHS, STOPS, make_requests
from tests.tiny_models import ImageOnlyProcessor, image, prompt_ids, qwen3_vl

BUCKET = 16  # the tiny prompts are 20-70 tokens: several buckets per call
FAST = {"bucket": dict(attention_bucket=BUCKET), "keep": dict(keep_slots=True),
        "compiled": dict(keep_slots=True, attention_bucket=BUCKET, compile=True,
                         compile_backend="aot_eager")}


@pytest.fixture(scope="module", params=sorted(ARCHS))
def tiny(request):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models gain nothing from a second thread
    model, patch = ARCHS[request.param]()
    yield model, ImageOnlyProcessor(patch)
    torch.set_num_threads(threads)


def sampled(reqs, temperature=1.0):
    """`reqs` at this temperature, top-p 0.8 on every other one (nucleus steps)."""
    return [dataclasses.replace(r, sampling=dataclasses.replace(
        r.sampling, temperature=temperature, top_p=0.8 if i % 2 else 1.0))
        for i, r in enumerate(reqs)]


def second_turns(reqs, outs):
    """Each session's next turn: its first turn, the answer and three new tokens."""
    return [dataclasses.replace(r, input_ids=tuple(r.input_ids) + tuple(o.token_ids) + (5, 6, 7))
            for r, o in zip(reqs, outs)]


def assert_same(got, want):
    """Same tokens and finish reasons; log-probs to fp32 summation order (the span's and the
    capacity's softmax add the same terms, plus zeros, in another order)."""
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fast", sorted(FAST))
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_fast_paths_give_the_plain_tokens_and_logprobs(tiny, fast, temperature):
    """Seven requests in three refilled slots, then their second turns on the kept caches: the
    fast engine answers both calls as the plain one does, draw for draw."""
    model, processor = tiny
    reqs = sampled(make_requests(processor, 4, n=7), temperature)
    plain, other = (LocalEngine(model, processor, 0, seed=3, max_batch=3, **kw)
                    for kw in ({}, FAST[fast]))
    first = plain.generate(reqs)
    assert_same(other.generate(reqs), first)
    follow = second_turns(reqs, first)
    assert_same(other.generate(follow), plain.generate(follow))
    if fast != "bucket":  # the same slots served both calls
        assert other._kept.slots.rows == 3 and other._kept.builds > 0


def test_kept_slots_are_reused_without_new_steps_or_compilations(tiny):
    """A call that fits the kept slots reuses them, their steps and their compilations, and
    answers as the first call did; one whose requests need more room gets new slots and still
    the plain engine's answers."""
    model, processor = tiny
    reqs = make_requests(processor, 5, n=6)  # greedy
    engine = LocalEngine(model, processor, 0, max_batch=4, **FAST["compiled"])
    first = engine.generate(reqs)
    kept, compiled = engine._kept, counters["stats"]["unique_graphs"]
    builds, address = kept.builds, kept.slots.keys[0].data_ptr()
    assert builds >= 3 and compiled >= 2  # several row counts and spans
    engine.clear_cache()  # as after a weight update: the slots stay
    again = engine.generate([dataclasses.replace(r, session=r.session + "-again") for r in reqs])
    assert again == first
    assert engine._kept is kept and kept.slots.keys[0].data_ptr() == address
    assert kept.builds == builds and counters["stats"]["unique_graphs"] == compiled
    longer = [dataclasses.replace(r, sampling=dataclasses.replace(
        r.sampling, max_new_tokens=kept.slots.capacity)) for r in reqs[:2]]
    got = engine.generate(longer)
    assert engine._kept is not kept and engine._kept.slots.capacity > kept.slots.capacity
    assert_same(got, LocalEngine(model, processor, 0, max_batch=4).generate(longer))


@pytest.mark.parametrize("fast", ["plain", "compiled"])
def test_a_dropped_decoder_frees_its_slots_at_once(tiny, fast):
    """A call's decoder (plain: every call's; kept: once released) is gone when its last
    reference goes, with the garbage collector off: a reference cycle would hold the slots'
    memory (GBs on a GPU) past the next call's allocation."""
    model, processor = tiny
    engine = LocalEngine(model, processor, 0, **FAST.get(fast, {}))
    made, build = [], engine._decoder

    def track(reqs):
        decoder = build(reqs)
        made.append(weakref.ref(decoder))
        return decoder
    engine._decoder = track
    gc.disable()
    try:
        engine.generate(make_requests(processor, 8, n=2))
        engine.release()
        assert made and made[-1]() is None
    finally:
        gc.enable()


def test_warm_up_changes_nothing_the_step_would_not(tiny):
    """Warm-up then step leaves the slots and the generator as the step alone does (but the
    spare token column, which only finished rows write): the draw a capture takes is the one
    the eager step takes."""
    model, processor = tiny
    engine = LocalEngine(model, processor, 0)
    reqs = sampled(make_requests(processor, 6, n=3))
    slots = Slots.allocate(model.config.get_text_config(), 4, 120, 8, len(STOPS), torch.float32,
                           torch.device("cpu"))
    with torch.no_grad():
        engine._admit(slots, reqs, [0, 1, 3], nucleus=True)  # slot 2 stays free (done)
        runs = []
        for warm in (True, False):
            gen = torch.Generator().manual_seed(9)
            decoder = Decoder(model, copy.deepcopy(slots), gen, engine.banned)
            if warm:
                decoder.warm_up(4, 64, nucleus=True)
            for _ in range(3):
                decoder.step(4, 64, nucleus=True)
            runs.append((decoder.slots, gen.get_state()))
    (a, state_a), (b, state_b) = runs
    assert torch.equal(state_a, state_b)
    for field in dataclasses.fields(Slots):
        x, y = getattr(a, field.name), getattr(b, field.name)
        if x is None:  # routed experts, not recorded here
            assert y is None
            continue
        if field.name in ("tokens", "logprobs"):
            x, y = x[:, :-1], y[:, :-1]
        for u, v in zip(x, y) if isinstance(x, list) else [(x, y)]:
            assert torch.equal(u, v), field.name
    assert a.count.max() == 4 and a.count[2] == 0  # the first token and three steps' ones


@pytest.mark.slow
def test_inductor_step_gives_the_plain_tokens():
    """The step compiled by inductor samples the plain step's tokens at one seed, log-probs to
    1e-4 (fused kernels sum in their own order). Two compilations for one row count and three
    spans: the span's length is dynamic, but the whole capacity is a contiguous slice."""
    torch.manual_seed(0)
    model, patch = qwen3_vl(seed=2)
    processor = ImageOnlyProcessor(patch)
    rng = np.random.default_rng(1)
    reqs = []
    for i in range(4):
        imgs = [image(64, 48, 70 + i)]
        reqs.append(Request(tuple(int(t) for t in prompt_ids(processor, imgs, rng)), imgs,
                            SamplingParams(1.0, 1.0, 40), f"i{i}"))  # no stop: 40 tokens each
    before = counters["stats"]["unique_graphs"]
    engine = LocalEngine(model, processor, 0, seed=1, keep_slots=True, attention_bucket=BUCKET,
                         compile=True)
    got = engine.generate(reqs)
    assert engine._kept.builds == 3  # 4 rows at spans 32, 48 and 64 (14 + 40 tokens)
    assert counters["stats"]["unique_graphs"] - before == 2
    want = LocalEngine(model, processor, 0, seed=1).generate(reqs)
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
