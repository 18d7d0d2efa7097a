"""The engines' side of routing replay (`loss.routing_replay`): the local torch engine records
the experts of every position it feeds, and returns what transformers' forward of the same
tokens routes them to, through refilled and compacted slots, the compiled decode step and a
second turn on a session's kept cache; an engine not asked records nothing, and a dense model
cannot record. The SGLang client asks its servers for theirs (launched with the flag) and
decodes them, refuses an answer without them, and the rollout makes them the trajectory's.
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
from tests.fake_sglang import FakeSGLang
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
    merge = model.config.vision_config.spatial_merge_size
    pos = mrope_position_ids(np.asarray(ids), IMG, grid, merge)
    pos = np.concatenate([np.arange(len(ids))[None], pos])[:, None]  # (4, 1, T)
    with torch.no_grad(), Routing.of(model).recording(experts=True) as chosen:
        model(input_ids=torch.tensor(np.asarray(ids, np.int64))[None],
              position_ids=torch.from_numpy(pos),
              pixel_values=torch.from_numpy(imgs["pixel_values"]),
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


@pytest.mark.parametrize("fast", ["plain", pytest.param("compiled", marks=pytest.mark.slow)])
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


# ------------------------------------------------------------------------------------ SGLang

def fake_routing(positions: int, layers: int = 2, k: int = 2, experts: int = 4) -> np.ndarray:
    """(positions, L, K) what the fake server routes positions 0.. to (`routed_row`)."""
    from tests.fake_sglang import routed_row

    return np.array([[routed_row(t, i, k, experts) for i in range(layers)]
                     for t in range(positions)], np.int32)


def test_sglang_routing_is_asked_for_and_decoded():
    """With routing: every request asks `return_routed_experts`, and each completion carries
    the server's (prompt_tokens + completion_tokens - 1, L, K) rows, decoded from base64 int32
    in the server's order; the prompt counted as the learner's ids (image pads expanded).
    Without: nothing is asked, nothing returned."""
    from tests.conftest import IMAGE, IMAGE_TOKENS
    from tests.test_sglang_engine import make_engine, request

    with FakeSGLang(image_token_id=IMAGE, tokens_per_image=IMAGE_TOKENS,
                    routed_experts=(2, 2, 4)) as fake:
        reqs = [request("abc", n_images=1), request("x", n_images=0)]
        with make_engine([fake.url], routing=(2, 2)) as engine:
            outs = engine.generate(reqs)
        for r, c in zip(reqs, outs):
            fed = len(r.input_ids) + len(c.token_ids) - 1
            assert c.routed_experts.shape == (fed, 2, 2)
            np.testing.assert_array_equal(c.routed_experts, fake_routing(fed))
        assert all(b["return_routed_experts"] is True for b in fake.bodies())
        with make_engine([fake.url]) as engine:
            (out,) = engine.generate(reqs[:1])
        assert out.routed_experts is None and "return_routed_experts" not in fake.bodies()[-1]


def test_a_server_without_the_flag_is_a_clear_error():
    """SGLang launched without --enable-return-routed-experts answers without the key and
    without a word: the engine stops the rollout (a fatal error naming the flag) rather than
    train on nothing; rows of another count are refused too."""
    from common.engine import FatalEngineError
    from common.sglang.wire import RoutingNotReturned, parse_generate_response
    from tests.conftest import IMAGE
    from tests.test_sglang_engine import SAMPLING, make_engine, request

    with FakeSGLang(image_token_id=IMAGE) as fake, \
            make_engine([fake.url], routing=(2, 2)) as engine:
        with pytest.raises(RoutingNotReturned, match="--enable-return-routed-experts"):
            engine.generate([request("hi", n_images=0)])
    assert issubclass(RoutingNotReturned, FatalEngineError)
    import base64
    answer = {"meta_info": {
        "finish_reason": {"type": "length", "length": 2}, "prompt_tokens": 3,
        "completion_tokens": 2, "output_token_logprobs": [[-0.1, 7, None], [-0.2, 8, None]],
        "routed_experts": base64.b64encode(fake_routing(3).tobytes()).decode()}}
    with pytest.raises(RoutingNotReturned, match="12 routed expert ids, 4 fed positions"):
        parse_generate_response(answer, SAMPLING, 3, (2, 2))
    answer["meta_info"]["routed_experts"] = base64.b64encode(fake_routing(4).tobytes()).decode()
    assert parse_generate_response(answer, SAMPLING, 3, (2, 2)).routed_experts.shape == (4, 2, 2)


def test_sglang_rollout_carries_the_last_turns_routing(renderer):
    """A two-turn episode through the fake server: the trajectory's rows are the last answer's
    (every position of both turns but the last token, int16), the unfed last token -1."""
    from common.rollout import RolloutConfig, rollout
    from tests.conftest import IMAGE, IMAGE_TOKENS, make_prompt
    from tests.test_sglang_engine import codes, make_engine

    answer = '<tool_call>{"name": "calc_score", "arguments": {"answer": "%s"}}</tool_call>'

    def responder(body):  # wrong first, right after the feedback
        from tests.fake_sglang import Action
        return Action(codes(answer % ("12" if ord("T") in body["input_ids"] else "10")))

    from PIL import Image
    prompt = dataclasses.replace(make_prompt(answer="12"), images=[Image.new("RGB", (8, 8))])
    with FakeSGLang(image_token_id=IMAGE, tokens_per_image=IMAGE_TOKENS, responder=responder,
                    routed_experts=(2, 2, 4)) as fake, \
            make_engine([fake.url], routing=(2, 2)) as engine:
        (traj,) = rollout([prompt], engine, renderer, RolloutConfig(n_samples=1))
    assert len(traj.turns) == 2
    n = len(traj.token_ids)
    assert traj.routed_experts.dtype == np.int16 and traj.routed_experts.shape == (n, 2, 2)
    np.testing.assert_array_equal(traj.routed_experts[:-1], fake_routing(n - 1))
    assert (traj.routed_experts[-1] == -1).all()


def test_the_sglang_backend_launches_with_the_flag_and_asks(tmp_path, monkeypatch):
    """loss.routing_replay: the servers launched here get --enable-return-routed-experts, the
    engine asks for (num_hidden_layers, num_experts_per_tok) rows of the model's config.json,
    and the command line carries the flag; a dense model is refused."""
    from common.sglang import server
    from common.sglang.server import server_argv
    from tests.test_sglang_placement import engine_cfg, make_backends

    launched = []

    def fake_launch(model_path, n=1, gpus_per_server=1, **kw):
        launched.append(kw)
        servers = [FakeSGLang(port=kw["port_base"] + i, health_delay_s=0,
                              routed_experts=(2, 2, 4) if kw["routed_experts"] else None)
                   for i in range(n)]

        class Group:
            urls = [f.url for f in servers]

            def shutdown(self):
                for f in servers:
                    f.close()
        return Group()

    monkeypatch.setattr(server, "launch_servers", fake_launch)
    cfg = engine_cfg(False)
    cfg.loss.routing_replay = True
    moe = {"image_token_id": 2000, "text_config": {
        "num_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2,
        "decoder_sparse_step": 1, "mlp_only_layers": []}}
    (backend,) = make_backends(cfg, 1, tmp_path, config=moe)
    try:
        assert launched[0]["routed_experts"] is True and backend.engine.routing == (2, 2)
    finally:
        backend.close()
    assert "--enable-return-routed-experts" in server_argv("/m", "h", 1, 1, 0, 0.5, None, False,
                                                           [], routed_experts=True)
    assert "--enable-return-routed-experts" not in server_argv("/m", "h", 1, 1, 0, 0.5, None,
                                                               False, [])
    with pytest.raises(ValueError, match="routing_replay needs a MoE model"):
        make_backends(cfg, 1, tmp_path)
