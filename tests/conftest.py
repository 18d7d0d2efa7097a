"""Shared test fixtures: a character-level renderer and a scripted engine for rollout tests."""

from __future__ import annotations

import atexit
import dataclasses
import os
import shutil
import tempfile
from typing import Sequence

import pytest

from common.engine import ABORT, LENGTH, STOP, Completion, Request

# The tests run on the CPU. Where libtpu is installed (jax[tpu]), JAX's first call would otherwise
# probe for a TPU, log an error and take a host-wide lock that a second test process then fails
# to take. JAX_PLATFORMS=cuda (or tpu) runs them there.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Two test workers may each load libtpu (a test requirement: the TPU compiler of tests/test_jax_aot.py).
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# Under pytest-xdist the workers share the machine's cores: each computes on its share of them
# (torch would otherwise start a thread per core in every worker, and the workers' threads would
# preempt each other's spin-waits). Subprocesses of a test inherit the setting.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))

# The tests check numbers, never XLA's optimised code: JAX compiles with most optimisations off
# (about a third less compile time, which is most of the JAX tests' time; results agree within
# the tests' tolerances). Subprocesses inherit it. tests/test_jax_aot.py turns it back on: its
# figures are the optimised program's.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# For the same reason XLA's CPU backend emits fusions with its older loop emitters and calls no
# XNNPACK kernels: a tiny model's first step compiles in 5.8 s instead of 10.5 s.
_CPU_FLAGS = "--xla_cpu_use_fusion_emitters=false --xla_cpu_use_xnnpack=false"
if _CPU_FLAGS not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_CPU_FLAGS}".strip()

# JAX's persistent compilation cache (geo3k_jax.core.compiler, as a run uses it), in one folder for
# the whole session that starts empty: a program that several tests build again (a fresh learner or
# engine on the same model and shapes), in any test worker, compiles once. The first process
# (pytest itself) makes the folder and removes it at exit; its workers inherit the variable.
if "GEO3K_TEST_JAX_CACHE" not in os.environ:
    os.environ["GEO3K_TEST_JAX_CACHE"] = tempfile.mkdtemp(prefix="geo3k-test-jax-cache-")
    atexit.register(shutil.rmtree, os.environ["GEO3K_TEST_JAX_CACHE"], ignore_errors=True)
from geo3k_jax.core.compiler import use_compilation_cache  # noqa: E402

use_compilation_cache(os.environ["GEO3K_TEST_JAX_CACHE"])

TURN_END, EOS, IMAGE = 1000, 1001, 2000
IMAGE_TOKENS = 3  # placeholder ids per image


class CharRenderer:
    """A renderer whose ids are character codes: easy to predict exactly in tests."""

    stop_token_ids = (TURN_END, EOS)
    placeholder_ids = (IMAGE,)

    def prompt_ids(self, messages, images):
        text = "".join(p.get("text", "") for m in messages[1:] for p in m["content"])
        return [IMAGE] * IMAGE_TOKENS * len(images) + [ord(c) for c in "U:" + text + "|A:"]

    def observation_ids(self, message, last_token):
        head = [] if last_token == TURN_END else [TURN_END]
        return head + [ord(c) for c in f"|T:{message['content']}|A:"]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(chr(i) if i < 1000 else "" for i in ids)


@dataclasses.dataclass
class Reply:
    """One scripted engine answer: text, how it ends, or a failure ('raise' / 'abort')."""

    text: str = ""
    finish: str = STOP
    fail: str | None = None


def logprob(i: int) -> float:
    """The scripted log-prob of the i-th generated token of a reply."""
    return -0.01 * (i + 1)


class ScriptedEngine:
    """Answers each session (episode) from its own list of `Reply`s, one per call.

    `script[session]` is consumed in order; a failing reply is consumed too, so a retry gets the
    next entry. Records every request for inspection.
    """

    def __init__(self, script: dict[str, list[Reply]]):
        self.script = {k: list(v) for k, v in script.items()}
        self.requests: list[Request] = []
        self.calls = 0

    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        self.calls += 1
        outs = []
        for req in requests:
            self.requests.append(req)
            reply = self.script[req.session].pop(0)
            if reply.fail == "raise":
                raise RuntimeError(f"scripted failure for {req.session}")
            if reply.fail == "abort":
                outs.append(Completion([], [], ABORT))
                continue
            ids = [ord(c) for c in reply.text][: req.sampling.max_new_tokens]
            finish = reply.finish
            if len(ids) == req.sampling.max_new_tokens and finish == STOP:
                finish = LENGTH
            if finish == STOP:
                ids.append(TURN_END)
            outs.append(Completion(ids, [logprob(i) for i in range(len(ids))], finish))
        return outs


@dataclasses.dataclass
class FakePrompt:
    uid: str
    answer: str
    messages: list
    images: list


def make_prompt(uid="p0", answer="12", text="Find x.", n_images=1):
    msgs = [{"role": "system", "content": "sys"},
            {"role": "user", "content": [{"type": "image"}] * n_images + [{"type": "text",
                                                                             "text": text}]}]
    return FakePrompt(uid, answer, msgs, [f"img{i}" for i in range(n_images)])


@pytest.fixture
def renderer():
    return CharRenderer()
