"""The in-process torch engine's bounded batches: a call's requests run in batches of at most
`max_batch` rows whose padded KV cache fits `kv_budget_gb`, with the results of one unbounded
batch; a request that cannot fit alone is refused with the numbers and the setting."""

import dataclasses

import numpy as np
import pytest

from common.engine import FatalEngineError, Request, SamplingParams
from geo3k_torch.engine import LocalEngine
from tests.tiny_models import ImageOnlyProcessor, image, prompt_ids, qwen3_vl

# the tiny Qwen3-VL: 2 layers x 2 KV heads x head_dim 16 x (K and V) x 4 bytes (fp32)
PER_TOKEN = 2 * 2 * 16 * 2 * 4


@pytest.fixture(scope="module")
def tiny():
    model, patch = qwen3_vl(seed=0)
    return model, ImageOnlyProcessor(patch)


def requests(processor, n=5, new=6):
    rng = np.random.default_rng(3)
    out = []
    for i in range(n):
        imgs = [image(int(rng.integers(40, 100)), 56, 300 + i)]
        out.append(Request(tuple(prompt_ids(processor, imgs, rng)), imgs,
                           SamplingParams(0.0, 1.0, new), f"s{i}"))  # greedy
    return out


def test_bounded_batches_give_the_unbounded_results(tiny):
    model, processor = tiny
    reqs = requests(processor)
    longest = max(len(r.input_ids) for r in reqs)
    budget_gb = 2 * (longest + 6) * PER_TOKEN / 2**30  # two padded rows at most
    bounded = LocalEngine(model, processor, 0, max_batch=256, kv_budget_gb=budget_gb)
    assert bounded.kv_bytes_per_token() == PER_TOKEN
    sizes = [len(b) for b in bounded.batches(reqs)]
    assert sum(sizes) == len(reqs) and max(sizes) == 2 and len(sizes) >= 3
    assert [len(b) for b in LocalEngine(model, processor, 0, max_batch=2).batches(reqs)] == \
        [2, 2, 1]
    free = LocalEngine(model, processor, 0)
    assert [len(b) for b in free.batches(reqs)] == [5]
    a, b = bounded.generate(reqs), free.generate(reqs)
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)
    # every session's cache is kept, whichever batch it ran in: turn 2 reuses it
    assert sorted(bounded._cache) == sorted(free._cache) == [f"s{i}" for i in range(5)]
    follow = [dataclasses.replace(r, input_ids=r.input_ids + tuple(o.token_ids) + (5, 6, 7))
              for r, o in zip(reqs, a)]
    for x, y in zip(bounded.generate(follow), free.generate(follow)):
        assert x.token_ids == y.token_ids


def test_a_request_too_big_for_the_budget_is_refused(tiny):
    model, processor = tiny
    req = requests(processor, n=1, new=100)[0]
    need = (len(req.input_ids) + 100) * PER_TOKEN
    engine = LocalEngine(model, processor, 0, kv_budget_gb=0.9 * need / 2**30)
    with pytest.raises(FatalEngineError, match="engine.local_kv_budget_gb") as e:
        engine.generate([req])
    assert f"{len(req.input_ids)} prompt + 100 new tokens x {PER_TOKEN} bytes" in str(e.value)
    with pytest.raises(ValueError, match="engine.local_max_batch=0"):
        LocalEngine(model, processor, 0, max_batch=0)
