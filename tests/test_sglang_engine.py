"""The SGLang engine client and launcher against a fake SGLang server (tests/fake_sglang.py).

Everything runs on CPU over 127.0.0.1. The fake behaves like SGLang 0.5.23 where it hurts (503
while loading, 1 s per health check, 400 on a busy /flush_cache, death on a busy release, weight
versions). Outcomes never depend on timing: the fake's scripted answers decide them (waits only
bound how long a broken client takes to fail).
"""

import base64
import dataclasses
import http.client
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from common.engine import ABORT, LENGTH, STOP, Completion, Request, SamplingParams
from common.env import FEEDBACK
from common.rollout import RolloutConfig, rollout
from common.sglang.engine import SGLangEngine, http_call
from common.sglang.wire import (ImageTokenMismatch, SGLangError, SGLangVersionError,
                                StaleWeightsError, collapse_image_pads, learner_image,
                                parse_generate_response, parse_version)
from common.sglang.server import ServerLaunchError, launch_servers, server_env
from tests.conftest import EOS, IMAGE, IMAGE_TOKENS, TURN_END, make_prompt
from tests.fake_sglang import Action, FakeSGLang, logprob

FAKE = str(Path(__file__).with_name("fake_sglang.py"))
SAMPLING = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=50,
                          stop_token_ids=(TURN_END, EOS))


def codes(text):
    return [ord(c) for c in text]


def request(text="hi", n_images=1, session="", sampling=SAMPLING, images=None):
    """Expanded ids (IMAGE_TOKENS pads per image, one run each) and PIL images."""
    ids = []
    for _ in range(n_images):
        ids += [ord("<")] + [IMAGE] * IMAGE_TOKENS + [ord(">")]
    if images is None:
        images = [Image.new("RGB", (20 + i, 10), (i, 0, 0)) for i in range(n_images)]
    return Request(tuple(ids + codes(text)), images, sampling, session)


def make_engine(urls, **kw):
    args = dict(image_token_id=IMAGE, timeout_s=5.0, max_retries=2, backoff_s=0.0,
                max_concurrency=8, idle_poll_s=0.05)
    return SGLangEngine(urls, **{**args, **kw})


@pytest.fixture
def fake():
    with FakeSGLang(image_token_id=IMAGE, tokens_per_image=IMAGE_TOKENS) as f:
        yield f


@pytest.fixture
def two_fakes():
    with FakeSGLang(image_token_id=IMAGE) as a, FakeSGLang(image_token_id=IMAGE) as b:
        yield a, b


# ------------------------------------------------------------------------------- request encoding

def test_collapse_image_pads():
    ids, runs = collapse_image_pads([1, IMAGE, IMAGE, IMAGE, 2, IMAGE, IMAGE, 3], IMAGE)
    assert ids == [1, IMAGE, 2, IMAGE, 3] and runs == [3, 2]
    assert collapse_image_pads([5, 6], IMAGE) == ([5, 6], [])


def test_request_encoding(fake):
    req = request("ab", n_images=2)
    with make_engine([fake.url]) as engine:
        (out,) = engine.generate([req])
    assert out.finish_reason == STOP
    (body,) = fake.bodies()
    # one pad per image: SGLang expands it (the learner's ids hold 3 per image)
    assert body["input_ids"] == [ord("<"), IMAGE, ord(">")] * 2 + codes("ab")
    assert [im[:22] for im in body["image_data"]] == ["data:image/png;base64,"] * 2
    assert fake.images == [("RGB", (20, 10), (0, 0, 0)), ("RGB", (21, 10), (1, 0, 0))]
    assert body["sampling_params"] == {
        "temperature": 0.7, "top_p": 0.9, "top_k": -1, "min_p": 0.0, "max_new_tokens": 50,
        "stop_token_ids": [TURN_END, EOS], "repetition_penalty": 1.0, "frequency_penalty": 0.0,
        "presence_penalty": 0.0, "skip_special_tokens": False,
        "spaces_between_special_tokens": False, "no_stop_trim": True}
    assert body["return_logprob"] is True and body["logprob_start_len"] == -1
    assert body["stream"] is False


def test_image_items_and_text_only(fake):
    with make_engine([fake.url]) as engine:
        engine.generate([request(n_images=1, images=["data:image/png;base64,AAAA"]),
                         request(n_images=1, images=[b"\x89PNG"]), request(n_images=0)])
    by_text = sorted(fake.bodies(), key=lambda b: str(b.get("image_data")))
    assert [b.get("image_data") for b in by_text] == [
        None, ["data:image/png;base64,AAAA"], ["data:image/png;base64,iVBORw=="]]


def test_images_are_sent_as_the_learner_sees_them(fake):
    """RGB with transparency on white (as HF processors convert), not SGLang's alpha drop."""
    clear, grey = Image.new("RGBA", (4, 4), (0, 0, 0, 0)), Image.new("L", (4, 4), 7)
    with make_engine([fake.url]) as engine:
        engine.generate([request(n_images=1, images=[clear])])
        engine.generate([request(n_images=1, images=[grey])])
    assert fake.images == [("RGB", (4, 4), (255, 255, 255)), ("RGB", (4, 4), (7, 7, 7))]


def test_expanded_ids_are_what_sglang_refuses(fake):
    """The fake, like SGLang, refuses a prompt whose pads outnumber its images (the engine
    never sends one: see test_request_encoding)."""
    req = request()
    body = {"input_ids": list(req.input_ids), "image_data": ["x"],
            "sampling_params": {"max_new_tokens": 4, "stop_token_ids": [TURN_END]}}
    status, raw = http_call(fake.url, "POST", "/generate", body)
    assert status == 400 and b"3 image placeholder token(s) but 1 image(s)" in raw


def test_prompt_length_mismatch_raises():
    """SGLang expanding an image to another count than the learner's is an error: the length
    check on every answer, the exact check (first request) naming the first difference."""
    with FakeSGLang(image_token_id=IMAGE, tokens_per_image=IMAGE_TOKENS + 1) as fake:
        with make_engine([fake.url], check_prompt_ids="off") as engine, \
                pytest.raises(ImageTokenMismatch, match="learner's"):
            engine.generate([request()])
        with make_engine([fake.url]) as engine, \
                pytest.raises(ImageTokenMismatch, match="to 8 ids, the learner has 7; first "
                                                         "difference at position 4") as err:
            engine.generate([request()])
    assert fake.url in str(err.value)


def test_exact_prompt_check_first_request_and_on_demand(fake):
    """Only the first request of a run (and one after `check_prompt_ids_next`) asks for the
    expanded ids; a server that changes one id at the same length is caught exactly."""
    with make_engine([fake.url], max_concurrency=1) as engine:
        engine.generate([request("a"), request("b")])
        engine.generate([request("c")])
        engine.check_prompt_ids_next()
        engine.generate([request("d"), request("e")])
        asked = [b.get("return_prompt_token_ids", False) for b in fake.bodies()]
        assert asked == [True, False, False, True, False]  # one thread: sent in order
        fake.rewrite_prompt = lambda ids: ids[:-1] + [ids[-1] + 1]  # same length, one id off
        engine.generate([request("f")])  # not checked: only the length, which agrees
        engine.check_prompt_ids_next()
        with pytest.raises(ImageTokenMismatch, match="first difference at position 5"):
            engine.generate([request("g")])
    with make_engine([fake.url], check_prompt_ids="every") as engine:
        fake.rewrite_prompt = None
        engine.generate([request("h"), request("i")])
    assert [b.get("return_prompt_token_ids") for b in fake.bodies()[-2:]] == [True, True]
    with pytest.raises(ValueError, match="check_prompt_ids"):
        make_engine([fake.url], check_prompt_ids="always")


def test_one_run_per_image_required(fake):
    req = request(n_images=1, images=[Image.new("RGB", (4, 4))] * 2)
    with make_engine([fake.url]) as engine, pytest.raises(ValueError, match="1 runs"):
        engine.generate([req])


# ----------------------------------------------------------------------------- response parsing

def test_finish_reasons_and_logprobs(fake):
    fake.script.extend([Action(codes("abc")), Action(codes("abcdef"), finish="length"),
                        Action(codes("a" * 49)), Action(finish="abort")])
    with make_engine([fake.url], max_concurrency=1) as engine:
        stop, length, last, abort = engine.generate([request()] * 4)
    assert stop == Completion(codes("abc") + [TURN_END], [logprob(i) for i in range(4)], STOP)
    assert length == Completion(codes("abcdef"), [logprob(i) for i in range(6)], LENGTH)
    # a stop token as the last allowed token: "stop" (SGLang 0.5.23 tests stop tokens first)
    assert last.finish_reason == STOP and list(last.token_ids[-1:]) == [TURN_END]
    assert len(last.token_ids) == SAMPLING.max_new_tokens
    assert abort == Completion([], [], ABORT)


@pytest.mark.parametrize("stop_first,raw", [(True, "stop"), (False, "length")],
                         ids=["0.5.23", "0.5.15"])
def test_stop_token_at_the_length_cap(stop_first, raw):
    """0.5.23 says "stop", 0.5.15 said "length" for a stop token sampled last; both are STOP."""
    with FakeSGLang(image_token_id=IMAGE, tokens_per_image=IMAGE_TOKENS,
                    stop_beats_length=stop_first) as fake, make_engine([fake.url]) as engine:
        fake.script.extend([Action(codes("a" * 49))] * 2)
        (out,) = engine.generate([request(n_images=0)])
        status, answer = http_call(fake.url, "POST", "/generate", fake.bodies()[0])
    assert out.finish_reason == STOP and len(out.token_ids) == 50
    assert status == 200 and json.loads(answer)["meta_info"]["finish_reason"]["type"] == raw


def test_parse_sglang_answer():
    body = {"text": "hi", "output_ids": [7, 8, TURN_END],
            "meta_info": {"finish_reason": {"type": "stop", "matched": TURN_END},
                          "prompt_tokens": 12, "completion_tokens": 3,
                          "output_token_logprobs": [[-0.5, 7, None], [-1.25, 8, None],
                                                    [-0.125, TURN_END, None]]}}
    out = parse_generate_response(body, SAMPLING, prompt_tokens=12)
    assert out == Completion([7, 8, TURN_END], [-0.5, -1.25, -0.125], STOP)
    with pytest.raises(ImageTokenMismatch):
        parse_generate_response(body, SAMPLING, prompt_tokens=11)
    bad = dataclasses.replace(SAMPLING, max_new_tokens=2)
    with pytest.raises(SGLangError, match="max_new_tokens=2"):
        parse_generate_response(body, bad)
    with pytest.raises(SGLangError, match="disagree"):
        parse_generate_response({**body, "output_ids": [7, 9, TURN_END]}, SAMPLING)


# ---------------------------------------------------------------------------------------- retries

def test_retries_after_500_and_dropped_connection(fake):
    fake.script.extend([Action(fail="500"), Action(fail="drop"), Action(codes("ok"))])
    with make_engine([fake.url], max_retries=2) as engine:
        (out,) = engine.generate([request()])
    assert out.token_ids == codes("ok") + [TURN_END] and len(fake.bodies()) == 3


def test_retries_exhausted_and_4xx_give_abort(fake):
    fake.script.extend([Action(fail="500")] * 3 + [Action(fail="400")])
    with make_engine([fake.url], max_retries=2, max_concurrency=1) as engine:
        assert engine.generate([request()])[0].finish_reason == ABORT
        assert len(fake.bodies()) == 3
        assert engine.generate([request()])[0].finish_reason == ABORT  # 400: not retried
        assert len(fake.bodies()) == 4


def test_timeout_is_retried_then_aborts(fake):
    fake.script.extend([Action(fail="hang"), Action(codes("late"))])
    with make_engine([fake.url], timeout_s=0.3, max_retries=1) as engine:
        (out,) = engine.generate([request()])
        assert out.token_ids == codes("late") + [TURN_END]
        fake.script.extend([Action(fail="hang"), Action(fail="hang")])
        (out,) = engine.generate([request()])
    assert out.finish_reason == ABORT and len(fake.bodies()) == 4


# ------------------------------------------------------------------- balancing and concurrency

def in_background(fn, *args):
    """Run fn(*args) in a thread; returns (thread, list that receives its result)."""
    result = []
    thread = threading.Thread(target=lambda: result.append(fn(*args)))
    thread.start()
    return thread, result


def sent_texts(fake):
    """The text part of every /generate prompt the fake received (after `request`'s image)."""
    return ["".join(map(chr, b["input_ids"][3:])) for b in fake.bodies()]


def test_least_outstanding_balancing_and_session_affinity(two_fakes):
    a, b = two_fakes
    with make_engine([a.url, b.url]) as engine:
        a.gate.clear(), b.gate.clear()
        thread, result = in_background(engine.generate, [request(str(i)) for i in range(4)])
        assert a.wait_inflight(2) and b.wait_inflight(2)  # 2 + 2 before any answer
        a.gate.set(), b.gate.set()
        thread.join()
        assert all(o.finish_reason == STOP for o in result[0])
        for i in range(4):  # one at a time: every server is idle, ties go in turn
            engine.generate([request(f"s{i}")])
        assert len(a.bodies()) == len(b.bodies()) == 4
        first = engine.generate([request("x", session="ep-x"), request("y", session="ep-y")])
        again = engine.generate([request("x2", session="ep-x"), request("y2", session="ep-y")])
    assert all(o.finish_reason == STOP for o in first + again)
    x_home, y_home = (a, b) if "x" in sent_texts(a) else (b, a)
    assert {"x", "x2"} <= set(sent_texts(x_home)) and {"y", "y2"} <= set(sent_texts(y_home))


def test_a_group_goes_to_one_server(two_fakes):
    """The samples of a group (their own sessions, one group) go where the group went first,
    so the server's radix cache prefills the prompt once; the next group goes elsewhere."""
    a, b = two_fakes
    with make_engine([a.url, b.url]) as engine:
        reqs = [dataclasses.replace(request(f"g{g}s{k}", session=f"{g}-{k}"), group=str(g))
                for g in range(2) for k in range(4)]
        out = engine.generate(reqs)
    assert all(o.finish_reason == STOP for o in out)
    homes = [{t[1] for t in sent_texts(server)} for server in (a, b)]
    assert sorted(homes) == [{"0"}, {"1"}], homes


def test_failed_server_is_avoided_on_retry(two_fakes):
    a, b = two_fakes
    a.script.append(Action(fail="500"))
    with make_engine([a.url, b.url], max_retries=1) as engine:
        (out,) = engine.generate([request(session="ep")])  # first pick: a (ties in turn)
        assert out.finish_reason == STOP
        engine.generate([request("more", session="ep")])
    assert len(a.bodies()) == 1 and len(b.bodies()) == 2  # the session moved to b


def test_concurrency_limit(fake):
    fake.gate.clear()
    with make_engine([fake.url], max_concurrency=2) as engine:
        thread, result = in_background(engine.generate, [request()] * 6)
        assert fake.wait_inflight(2)
        fake.gate.set()
        thread.join()
    (outs,) = result
    assert len(outs) == 6 and all(o.finish_reason == STOP for o in outs)
    assert fake.max_inflight == 2


# ------------------------------------------------------------------------ weight sync / control

def test_control_calls_reach_every_server(two_fakes):
    a, b = two_fakes
    with make_engine([a.url, b.url]) as engine:
        assert engine.update_weights_from_disk("/ckpt/step_3", 3) == "3"
        engine.flush_cache()
        engine.release_memory(["kv_cache", "weights"])
        engine.resume_memory(["kv_cache", "weights"])  # all would resume cuda_graph too: 500
        engine.health()  # takes the fake's 1 s, as SGLang's does
        assert engine.check_server_versions() == {a.url: "0.5.23", b.url: "0.5.23"}
    for f in (a, b):
        assert f.requests == [
            ("POST", "/update_weights_from_disk", {"model_path": "/ckpt/step_3",
                                                   "weight_version": "3"}),
            ("GET", "/model_info", None),
            ("POST", "/flush_cache", None),
            ("POST", "/abort_request", {"abort_all": True}),  # release: idle first
            ("POST", "/flush_cache", None),
            ("POST", "/release_memory_occupation", {"tags": ["kv_cache", "weights"]}),
            ("POST", "/resume_memory_occupation", {"tags": ["kv_cache", "weights"]}),
            ("GET", "/health_generate", None),
            ("GET", "/server_info", None)]


def test_control_failures_name_the_server(two_fakes):
    a, b = two_fakes
    b.fail_control = True
    with make_engine([a.url, b.url]) as engine:
        with pytest.raises(SGLangError, match="scripted weight-load failure") as err:
            engine.update_weights_from_disk("/ckpt")
        assert b.url in str(err.value) and a.url not in str(err.value)
        with pytest.raises(SGLangError, match="1 of 2 servers failed"):
            engine.flush_cache()
        b.healthy = False
        with pytest.raises(SGLangError, match="HTTP 503") as err:
            engine.health()
        assert b.url in str(err.value)
    a.close()
    with make_engine([a.url]) as engine, pytest.raises(SGLangError, match=a.url):
        engine.health(timeout_s=2)


def test_version_floor():
    assert [parse_version(v) for v in ("0.5.23", "0.5.15.post1", "0.5.6rc0", "0.6.0.dev3+g1")] \
        == [(0, 5, 23), (0, 5, 15), (0, 5, 6), (0, 6, 0)]
    with FakeSGLang(version="0.5.14") as old, FakeSGLang(version="0.5.15.post2") as ok, \
            make_engine([old.url, ok.url]) as engine:
        with pytest.raises(SGLangVersionError, match="1 of 2 servers failed") as err:
            engine.check_server_versions()
    msg = str(err.value)
    assert old.url in msg and ok.url not in msg and "sglang 0.5.14" in msg and ">= 0.5.15" in msg


# ---------------------------------------------------------------------------- weight versions

def test_weight_version_is_sent_and_checked(fake):
    with make_engine([fake.url]) as engine:
        engine.generate([request()])  # before any update: "default", not checked
        assert engine.update_weights_from_disk("/ckpt/step_3", 3) == "3"
        (out,) = engine.generate([request()])
        assert out.finish_reason == STOP
        assert engine.update_weights_from_disk("/ckpt/next") == "4"  # None: the previous + 1
        engine.check_version(4)
    assert [b["weight_version"] for b in fake.bodies("/update_weights_from_disk")] == ["3", "4"]
    assert fake.weight_version == "4"


def test_stale_weight_update_is_an_error_naming_server_and_versions(two_fakes):
    """A server that answers success but keeps serving the old weights (/model_info), and one
    that answers from another version later (restarted): both are errors, not a stale policy."""
    a, b = two_fakes
    with make_engine([a.url, b.url]) as engine:
        engine.update_weights_from_disk("/ckpt/step_1", 1)
        b.stale = True
        with pytest.raises(StaleWeightsError, match="serves weight version '1', expected '2'") \
                as err:
            engine.update_weights_from_disk("/ckpt/step_2", 2)
        assert b.url in str(err.value) and a.url not in str(err.value)
        b.stale = False
        engine.update_weights_from_disk("/ckpt/step_3", 3)
        a.weight_version = "default"  # a server restarted behind our back
        with pytest.raises(StaleWeightsError, match="weight version 'default', expected '3'") \
                as err:
            engine.generate([request(session=f"s{i}") for i in range(4)])
        assert a.url in str(err.value)


def test_failed_weight_update_names_the_server_and_version(two_fakes):
    a, b = two_fakes
    b.fail_control = True
    with make_engine([a.url, b.url]) as engine:
        with pytest.raises(SGLangError, match="scripted weight-load failure") as err:
            engine.update_weights_from_disk("/ckpt/step_7", 7)
        assert b.url in str(err.value) and a.url not in str(err.value)
        b.fail_control = False
        # b still serves "default": its answers are errors until an update succeeds there
        with pytest.raises(StaleWeightsError, match="'default', expected '7'") as err:
            engine.generate([request(session=f"s{i}") for i in range(4)])
        assert b.url in str(err.value)


# ----------------------------------------------------------------------------- colocated release

def test_busy_release_kills_the_fake_as_it_kills_sglang(fake):
    """The fake is no kinder than SGLang: a release with a request running takes it down."""
    fake.gate.clear()
    with make_engine([fake.url]) as engine:
        thread, result = in_background(engine.generate, [request()])
        assert fake.wait_inflight(1)
        with pytest.raises((OSError, http.client.HTTPException)):
            http_call(fake.url, "POST", "/release_memory_occupation", {}, timeout=5)
        thread.join()
    assert fake.dead and result[0][0].finish_reason == ABORT
    fake.thread.join(5)  # the dead fake closes its socket: every later call is refused
    assert refused(fake.url)


def test_release_while_a_request_runs_leaves_the_server_alive(two_fakes):
    """release_memory aborts the straggler, polls /flush_cache past its 400s, then releases."""
    a, b = two_fakes
    a.gate.clear()
    with make_engine([a.url, b.url]) as engine:
        thread, result = in_background(engine.generate, [request(session="slow")])
        assert a.wait_inflight(1)
        engine.release_memory()
        thread.join()
        assert not a.dead and a.released and b.released
        assert result[0][0].finish_reason == ABORT  # the rollout retries or counts it
        engine.resume_memory()
        a.gate.set()
        (out,) = engine.generate([request()])
    assert out.finish_reason == STOP
    paths = a.paths()[1:]  # after the straggler's /generate
    flushes = paths[1:paths.index("/release_memory_occupation")]
    assert paths[0] == "/abort_request" and len(flushes) >= 2  # a 400 while aborting, a 200
    assert set(flushes) == {"/flush_cache"}


def test_release_gives_up_on_a_server_that_stays_busy():
    with FakeSGLang(image_token_id=IMAGE, abort_linger_s=1.0) as fake, \
            make_engine([fake.url], idle_timeout_s=0.3) as engine:
        fake.gate.clear()
        thread, _ = in_background(engine.generate, [request()])
        assert fake.wait_inflight(1)
        with pytest.raises(SGLangError, match="still busy 0.3 s after /abort_request") as err:
            engine.release_memory()
        thread.join()
    assert fake.url in str(err.value) and "Flush cache failed" in str(err.value)
    assert "/release_memory_occupation" not in fake.paths() and not fake.dead


# --------------------------------------------------------------------------- in-memory weights

def payloads(*names):
    return [base64.b64encode(n.encode()).decode() for n in names]


def test_in_memory_update_runs_inside_one_session(two_fakes):
    """begin, every bucket in order (the version and the cache flush on the last only), end,
    then /model_info: each server loads the same buckets and reports the new version."""
    a, b = two_fakes
    for f in (a, b):
        f.tensor_loader = lambda raw: [(raw.decode(), len(raw))]
    buckets = [(payloads("w0"), False), (payloads("w1"), False), (payloads("w2"), True)]
    with make_engine([a.url, b.url]) as engine:
        assert engine.update_weights_from_tensors(iter(buckets), version=5) == "5"
        (out,) = engine.generate([request()])
    assert out.finish_reason == STOP
    for f in (a, b):
        assert f.paths()[:6] == ["/begin_weight_update"] + ["/update_weights_from_tensor"] * 3 \
            + ["/end_weight_update", "/model_info"]
        sent = f.bodies("/update_weights_from_tensor")
        assert [(x.get("weight_version"), x["flush_cache"]) for x in sent] == [
            (None, False), (None, False), ("5", True)]
        assert f.tensors == {"w0": 2, "w1": 2, "w2": 2} and f.weight_version == "5"
        assert f.session is None


def test_in_memory_update_refused_closes_the_session_and_names_the_server(two_fakes):
    """A server that refuses a bucket (here: a request still running when the last bucket
    flushes the cache, SGLang's own refusal) fails the update, naming that server; every
    session is closed."""
    a, b = two_fakes
    a.gate.clear()
    b.gate.clear()
    with make_engine([a.url, b.url]) as engine:
        thread, result = in_background(engine.generate, [request(session="s1")])
        assert a.wait_inflight(1) or b.wait_inflight(1)
        busy = a if a.inflight else b
        with pytest.raises(SGLangError, match="cache was not flushed") as err:
            engine.update_weights_from_tensors([(payloads("w"), True)], version=2)
        assert busy.url in str(err.value)
        assert a.session is None and b.session is None
        a.gate.set()
        b.gate.set()
        thread.join()
    assert a.paths().count("/end_weight_update") == 1 == b.paths().count("/end_weight_update")


def test_in_memory_update_outside_a_session_is_refused(fake):
    status, raw = http_call(fake.url, "POST", "/update_weights_from_tensor",
                            {"serialized_named_tensors": payloads("w")}, timeout=5)
    assert status == 400 and "must run between begin_weight_update()" in raw.decode()


def test_the_fake_sees_generation_on_weights_not_in_place(fake):
    """Released weights come back as garbage (SGLang keeps no copy): the fake answers, as SGLang
    does, but says so in `garbage` until the weights are loaded again."""
    with make_engine([fake.url]) as engine:
        engine.release_memory()
        engine.generate([request()])
        engine.resume_memory(["weights"])
        engine.generate([request()])
        engine.resume_memory(["kv_cache", "cuda_graph"])
        engine.generate([request()])
        assert fake.garbage == ["weights released", "kv_cache released", "kv_cache released",
                                "weights wiped by a release", "weights wiped by a release"]
        engine.update_weights_from_disk("/ckpt/step_1", 1)
        engine.generate([request()])
    assert len(fake.garbage) == 5 and not fake.wiped and not fake.released


# ------------------------------------------------------------------------------------- launcher

def free_port_base(n):
    """A port p with p .. p+n-1 free on 127.0.0.1 right now."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        try:
            for i in range(n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", base + i))
        except OSError:
            continue
        return base
    raise RuntimeError("no free ports")


def refused(url):
    try:
        http_call(url, "GET", "/health", timeout=2)
    except ConnectionRefusedError:
        return True
    except (OSError, http.client.HTTPException):
        return False
    return False


def launch(tmp_path, n=1, extra_args=(), command=(sys.executable, FAKE), **kw):
    args = dict(startup_timeout_s=30, poll_s=0.05, grace_s=5, log_dir=tmp_path)
    return launch_servers("/models/tiny", n=n, gpus_per_server=2, mem_fraction=0.5,
                          attention_backend="fa3", port_base=free_port_base(n),
                          extra_args=extra_args, command=command, **{**args, **kw})


@pytest.mark.slow
def test_launch_serve_and_shutdown(tmp_path):
    with launch(tmp_path, n=2, extra_args=["--disable-cuda-graph"]) as group:
        port = int(group.urls[1].rsplit(":", 1)[1])
        assert group.servers[1].argv == [
            sys.executable, FAKE, "--model-path", "/models/tiny", "--host", "127.0.0.1",
            "--port", str(port), "--tp-size", "2", "--base-gpu-id", "2",
            "--mem-fraction-static", "0.5", "--attention-backend", "fa3",
            "--disable-cuda-graph"]
        with SGLangEngine(group.urls, image_token_id=IMAGE, backoff_s=0) as engine:
            outs = engine.generate([request(n_images=0), request(n_images=0)])
            engine.health()
        assert [o.finish_reason for o in outs] == [STOP, STOP]
        processes = [s.process for s in group.servers]
    assert all(p.returncode is not None for p in processes)
    assert all(refused(url) for url in group.urls)


def test_launch_fails_clearly_when_the_server_exits(tmp_path):
    crash = (sys.executable, "-c", "import sys; print('unknown flag --frobnicate'); sys.exit(3)")
    with pytest.raises(ServerLaunchError, match="exited with code 3") as err:
        launch(tmp_path, command=crash)
    assert "unknown flag --frobnicate" in str(err.value)


def test_launch_fails_clearly_when_never_healthy(tmp_path):
    with pytest.raises(ServerLaunchError, match=r"not ready in time \(last answers: http") as err:
        launch(tmp_path, extra_args=["--unhealthy"], startup_timeout_s=1)
    url = str(err.value).split("answers: ")[1].split(": HTTP 503")[0]
    assert "fake sglang serving" in str(err.value) and refused(url)  # and it was shut down


@pytest.mark.slow
def test_launch_waits_through_loading_and_slow_health_checks(tmp_path):
    """503 for 3 s, then 1.5 s per health call (SGLang sleeps 1 s and generates): ready in
    seconds, where a 1 s probe timeout would never see it ready."""
    start = time.monotonic()
    with launch(tmp_path, extra_args=["--loading-s", "3", "--health-delay-s", "1.5"],
                startup_timeout_s=60, poll_s=0.2) as group:
        waited = time.monotonic() - start
        (out,) = make_engine(group.urls).generate([request(n_images=0)])
    assert out.finish_reason == STOP
    assert 3 < waited < 30


def test_launch_fails_fast_when_the_server_dies_while_loading(tmp_path):
    start = time.monotonic()
    with pytest.raises(ServerLaunchError, match="exited with code 3 before it was ready") as err:
        launch(tmp_path, extra_args=["--loading-s", "600", "--exit-after-s", "1"],
               startup_timeout_s=300)
    assert time.monotonic() - start < 20  # not the 300 s start-up budget
    assert "scripted crash while loading the model" in str(err.value)


def test_launch_refuses_an_old_sglang(tmp_path):
    with pytest.raises(ServerLaunchError, match=r"sglang 0\.5\.6; geo3k-rl needs >= 0\.5\.15"):
        launch(tmp_path, extra_args=["--version", "0.5.6", "--health-delay-s", "0"])
    port = int((tmp_path / "server_0.log").read_text().split("127.0.0.1:")[1].split()[0])
    assert refused(f"http://127.0.0.1:{port}")  # shut down


def test_server_env_is_clean(tmp_path, monkeypatch):
    """No torchrun variables reach the servers (they would join the trainer's process group)."""
    for k, v in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h",
                 "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x", "OMP_NUM_THREADS": "1",
                 "GROUP_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    env = server_env(os.environ, {"EXTRA": "1"})
    assert not {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
                "TORCHELASTIC_RUN_ID", "OMP_NUM_THREADS"} & set(env)
    assert env["SGLANG_MM_AVOID_RETOKENIZE"] == "1" and env["EXTRA"] == "1"
    assert server_env({"OMP_NUM_THREADS": "8"})["OMP_NUM_THREADS"] == "8"  # the user's own
    with launch(tmp_path, extra_args=["--health-delay-s", "0"]):
        log = (tmp_path / "server_0.log").read_text()
    assert ("env: {'RANK': None, 'WORLD_SIZE': None, 'LOCAL_RANK': None, 'MASTER_ADDR': None, "
            "'MASTER_PORT': None, 'OMP_NUM_THREADS': None}") in log


def test_shutdown_kills_a_server_that_ignores_sigterm(tmp_path):
    group = launch(tmp_path, extra_args=["--ignore-sigterm"], grace_s=0.5)
    group.shutdown()
    assert group.servers[0].process.returncode == -9 and refused(group.urls[0])
    group.shutdown()  # idempotent


def test_launch_refuses_a_busy_port(fake, tmp_path):
    port = int(fake.url.rsplit(":", 1)[1])
    with pytest.raises(ServerLaunchError, match=f"port {port}"):
        launch_servers("/m", port_base=port, command=(sys.executable, FAKE), log_dir=tmp_path)


# ---------------------------------------------------------------------------------- end to end

def test_rollout_end_to_end(renderer):
    """`rollout` with SGLangEngine: the trajectories hold the learner's expanded ids, the server
    saw one pad per image, and the log-probs are the server's."""
    answer = '<tool_call>{"name": "calc_score", "arguments": {"answer": "%s"}}</tool_call>'

    def responder(body):  # wrong first, right after the feedback
        return Action(codes(answer % ("12" if ord("T") in body["input_ids"] else "10")))

    prompt = dataclasses.replace(make_prompt(answer="12"), images=[Image.new("RGB", (8, 8))])
    with FakeSGLang(image_token_id=IMAGE, tokens_per_image=IMAGE_TOKENS,
                    responder=responder) as fake, make_engine([fake.url]) as engine:
        trajs = rollout([prompt], engine, renderer, RolloutConfig(n_samples=2))
    p = [IMAGE] * IMAGE_TOKENS + codes("U:Find x.|A:")
    g1, g2 = codes(answer % "10") + [TURN_END], codes(answer % "12") + [TURN_END]
    obs = codes(f"|T:{FEEDBACK['wrong'].format(answer='10')}|A:")
    for t in trajs:
        assert t.token_ids.tolist() == p + g1 + obs + g2
        assert t.status == "completed" and t.reward == 1.0 and t.correct_turn == 2
        lp = t.rollout_logprobs[len(p):len(p) + len(g1)]
        np.testing.assert_allclose(lp, [logprob(i) for i in range(len(g1))], rtol=1e-6)
    seen = fake.bodies()
    assert len(seen) == 4 and all(b["input_ids"].count(IMAGE) == 1 for b in seen)
    assert sorted(len(b["input_ids"]) for b in seen) == sorted(
        [len(p) - IMAGE_TOKENS + 1] * 2 + [len(p + g1 + obs) - IMAGE_TOKENS + 1] * 2)


# ---------------------------------------------------------------------------- learner's images

@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_vl", "qwen2_5_vl"])
def test_learner_image_matches_the_processor(tmp_path, arch):
    """Images sent pre-resized to the learner's size give the learner's grid and pixels."""
    from common.processor import load_processor
    from geo3k_torch.tiny import build_tiny_checkpoint
    proc = load_processor(build_tiny_checkpoint(tmp_path, arch=arch, hidden_size=64))
    rng = np.random.default_rng(0)
    for w, h in [(37, 100), (333, 50), (64, 64), (500, 31)]:
        img = Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))
        small = learner_image(img, proc)
        ip = proc.image_processor
        grid = ip(images=[img], return_tensors="np")["image_grid_thw"][0]
        assert (small.height, small.width) == tuple(grid[1:] * ip.patch_size)
        want, got = (ip(images=[x], return_tensors="np") for x in (img, small))
        np.testing.assert_array_equal(got["image_grid_thw"], want["image_grid_thw"])
        np.testing.assert_allclose(got["pixel_values"], want["pixel_values"], atol=1e-5)


def test_image_token_mismatch_stops_the_rollout_instead_of_aborting_samples(renderer):
    with FakeSGLang(image_token_id=IMAGE, tokens_per_image=IMAGE_TOKENS + 1) as fake, \
            make_engine([fake.url]) as engine:
        with pytest.raises(ImageTokenMismatch):
            rollout([make_prompt()], engine, renderer, RolloutConfig(n_samples=2,
                                                                     max_retries=3))
        assert 1 <= len(fake.bodies("/generate")) <= 2  # at most the one call, no retry
