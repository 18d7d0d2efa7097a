"""The engines' side of routing replay (`loss.routing_replay`): the local torch engine records
the experts of every position it feeds, and returns what transformers' forward of the same
tokens routes them to, through refilled and compacted slots, the compiled decode step and a
second turn on a session's kept cache; the rollout turns its rows into the trajectory's; an
engine not asked records nothing, and a dense model cannot record.
"""

import dataclasses

import numpy as np
import pytest
import torch

from common.mrope import mrope_position_ids
from common.processor import image_inputs
from geo3k_torch.engine import LocalEngine
from geo3k_torch.router import Routing
from tests.test_torch_decode_paths import FAST, second_turns
from tests.test_torch_engine_fast import make_requests
from tests.tiny_models import IMG, ImageOnlyProcessor, qwen3_vl, qwen3_vl_moe


@pytest.fixture(scope="module")
def tiny():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models gain nothing from a second thread
    model, patch = qwen3_vl_moe()
    yield model, ImageOnlyProcessor(patch)
    torch.set_num_threads(threads)


def forward_routing(model, processor, ids, images) -> np.ndarray:
    """(T, L, K) the experts transformers' forward over the whole sequence `ids` (no cache)
    routes each position to, sorted within each row."""
    imgs = image_inputs(processor, list(images))
    grid = imgs["image_grid_thw"]
    pos = mrope_position_ids(np.asarray(ids), IMG, grid, model.config.vision_config.spatial_merge_size)
    pos = np.concatenate([np.arange(len(ids))[None], pos])[:, None]  # (4, 1, T)
    with torch.no_grad(), Routing.of(model).recording(experts=True) as chosen:
        model(input_ids=torch.tensor(np.asarray(ids, np.int64))[None],
              position_ids=torch.from_numpy(pos), pixel_values=torch.from_numpy(imgs["pixel_values"]),
              image_grid_thw=torch.from_numpy(grid), use_cache=False)
    return torch.stack(chosen, 1).sort(-1).values.numpy()


def check_routing(model, processor, requests, completions) -> None:
    """Each completion's rows: one per fed position (prompt and every new token but the last),
    the experts of transformers' forward over them (as sets)."""
    for r, c in zip(requests, completions):
        fed = list(r.input_ids) + list(c.token_ids[:-1])
        assert c.routed_experts.shape == (len(fed), 2, 2)
        assert c.routed_experts.dtype == np.int16
        want = forward_routing(model, processor, fed, r.images)
        np.testing.assert_array_equal(np.sort(c.routed_experts, -1), want)


@pytest.mark.parametrize("fast", ["plain", "compiled"])
def test_the_engine_records_the_routing_a_forward_computes(tiny, fast):
    """Seven requests in three refilled, compacted slots (plain, and the compiled decode step
    over kept slots), then their second turns on the kept caches: every row is the forward's,
    the cached positions' rows those the first turn recorded, and the tokens those of an engine
    that records nothing."""
    model, processor = tiny
    reqs = make_requests(processor, 4, n=7)
    engine = LocalEngine(model, processor, 0, max_batch=3, record_routing=True,
                         **FAST.get(fast, {}))
    first = engine.generate(reqs)
    check_routing(model, processor, reqs, first)
    follow = second_turns(reqs, first)
    again = engine.generate(follow)
    check_routing(model, processor, follow, again)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(b.routed_experts[:len(a.routed_experts)], a.routed_experts)
    plain = LocalEngine(model, processor, 0, max_batch=3)
    assert [c.token_ids for c in plain.generate(reqs)] == [c.token_ids for c in first]
    assert all(c.routed_experts is None for c in plain.generate(follow))


def test_a_dense_model_cannot_record_routing():
    model, patch = qwen3_vl()
    with pytest.raises(ValueError, match="no experts"):
        LocalEngine(model, ImageOnlyProcessor(patch), 0, record_routing=True)
