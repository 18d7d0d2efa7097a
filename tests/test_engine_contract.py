"""The rollout's rules, checked against every real in-process engine: the torch `LocalEngine`
and the `JaxEngine`, both on one tiny random checkpoint (`tests.tiny_models`), fp32 on CPU.

`tests/test_rollout.py` pins the rollout's bookkeeping against a scripted engine; here the same
rules meet real sampling: stop tokens end turns and the feedback follows, one response budget
covers every turn and its feedback, the context limit holds, image placeholders are never
sampled even when the model prefers them, failed requests are retried and then abort only their
own episode, the trained tokens and log-probs are the engine's, and greedy rollouts are the
same, token for token, whichever engine runs them.

`TinyRenderer` speaks the tiny models' 300-token vocabulary: words of the feedback hash to text
ids, every image takes as many placeholder ids as the processor gives it merged patches, and
ids 100-149 decode to a calc_score tool call (answer = id - 100). About one text id in ten
stops a turn. A turn without a tool call gets a reminder (`end_on_no_tool_call=False`), so
every episode goes on until its third turn, a correct answer or a limit.

    python -m pytest -q tests/test_engine_contract.py  # about a minute on two CPU cores

Each test runs per engine kind and per architecture (qwen3_vl, qwen2_5_vl), the retries' JAX
run on Qwen2.5-VL only; the JAX engine compiles once per shape for the whole module, so every
test here is `slow` (the first of each architecture pays for the checkpoint and compiles).
"""

from __future__ import annotations

import contextlib
import dataclasses
import zlib

import numpy as np
import pytest
import torch

from common.engine import ABORT, LENGTH, STOP, Completion, FatalEngineError
from common.env import EnvConfig, Geo3kEnv
from common.mrope import image_token_counts, mrope_position_ids
from common.processor import image_inputs
from common.rollout import RolloutConfig, rollout
from geo3k_torch.engine import LocalEngine
from tests.conftest import FakePrompt
# `tiny` is test_jax_engine's module-scoped fixture: one checkpoint (transformers and JAX
# weights) and one compiled JaxEngine per architecture.
from tests.test_jax_engine import Tiny, tiny  # noqa: F401
from tests.tiny_models import END, IMG, START, image

pytestmark = pytest.mark.slow

TURN_END, TOOL, ASSISTANT = 254, 255, 256  # the chat template's markers (not placeholders)
STOPS = (TURN_END,) + tuple(range(9, 250, 9))  # 28 text ids stop a turn too
CALLS = range(100, 150)  # decoded as a tool call with answer id - 100
ANSWER = "12"  # every prompt's label: id 112 answers correctly
ENV = EnvConfig(end_on_no_tool_call=False)  # a turn without a call gets a reminder: 3 turns


class TinyRenderer:
    """The rollout's `Renderer` in the tiny vocabulary (see the module docstring)."""

    stop_token_ids = STOPS

    def __init__(self, processor, config):
        self.processor = processor
        self.merge = config.vision_config.spatial_merge_size
        self.placeholder_ids = (config.image_token_id, config.video_token_id)

    def prompt_ids(self, messages, images):
        grids = image_inputs(self.processor, list(images)).get("image_grid_thw", np.zeros((0, 3)))
        counts = iter(image_token_counts(grids, self.merge).tolist())
        ids = []
        for m in messages:
            parts = m["content"] if isinstance(m["content"], list) else [
                {"type": "text", "text": m["content"]}]
            for p in parts:
                if p["type"] == "image":
                    ids += [START] + [IMG] * next(counts) + [END]
                else:
                    ids += words(p["text"])
        assert next(counts, None) is None, "more images than image parts"
        return ids + [ASSISTANT]

    def observation_ids(self, message, last_token):
        head = [] if last_token == TURN_END else [TURN_END]  # close a turn another stop ended
        return head + [TOOL] + words(message["content"]) + [ASSISTANT]

    def decode(self, ids):
        return "".join(call(i - CALLS[0]) if i in CALLS else f" w{i}" for i in ids)


def words(text: str) -> list[int]:
    """One text id (0-249) per word, a hash of it."""
    return [zlib.crc32(w.encode()) % IMG for w in text.split()]


def call(answer) -> str:
    return ('<tool_call>{"name": "calc_score", "arguments": {"answer": "' + str(answer)
            + '"}}</tool_call>')


def prompts(n=3, seed=0) -> list[FakePrompt]:
    """n problems with 1, 2, 3, ... images of different sizes, all answered by ANSWER."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        imgs = [image(int(rng.integers(40, 130)), int(rng.integers(40, 130)), 10 * i + k)
                for k in range(1 + i % 3)]
        msgs = [{"role": "system", "content": "You solve geometry problems."},
                {"role": "user", "content": [{"type": "image"}] * len(imgs)
                 + [{"type": "text", "text": f"Problem {i}: find x in the diagram."}]}]
        out.append(FakePrompt(f"p{i}", ANSWER, msgs, imgs))
    return out


def forward(hf, processor, ids, images, **kw):
    """The transformers model over one whole sequence (positions from `common.mrope`)."""
    imgs = image_inputs(processor, list(images))
    grid = imgs["image_grid_thw"]
    pos = mrope_position_ids(ids, IMG, grid, hf.config.vision_config.spatial_merge_size)
    pos = np.concatenate([np.arange(len(ids))[None], pos])[:, None]  # (4, 1, T)
    with torch.no_grad():
        return hf(input_ids=torch.from_numpy(np.asarray(ids, np.int64))[None],
                  position_ids=torch.from_numpy(pos),
                  pixel_values=torch.from_numpy(imgs["pixel_values"]),
                  image_grid_thw=torch.from_numpy(grid), use_cache=False, **kw)


def model_logprobs(hf, processor, traj, temperature=1.0) -> np.ndarray:
    """(T - 1, V) log_softmax(logits / T) over a whole trajectory in one forward, row t
    predicting token t + 1: what the engine's log-prob of every sampled token should be."""
    logits = forward(hf, processor, traj.token_ids, traj.images).logits[0, :-1].float()
    return torch.log_softmax(logits / (temperature or 1.0), -1).numpy()


# ---- engines and wrappers ----------------------------------------------------------------
KINDS = ("torch", "jax")


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """torch on one thread: models this small gain nothing from a second, and on a busy machine
    OpenMP's barriers between two threads made every forward about 100x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def renderer(tiny) -> TinyRenderer:
    return TinyRenderer(tiny.processor, tiny.hf.config)


def fresh(kind: str, tiny: Tiny, seed: int = 0):
    """An engine of `kind` on the checkpoint as a new one would be: seeded, no kept caches (the
    JAX one is the module's, compiled once)."""
    if kind == "torch":
        return LocalEngine(tiny.hf, tiny.processor, pad_id=0, seed=seed)
    return tiny.engine(seed)


class Recorder:
    """Passes calls through, keeping every (request, completion)."""

    def __init__(self, engine):
        self.engine, self.log = engine, []

    def generate(self, requests):
        outs = self.engine.generate(requests)
        self.log += zip(requests, outs)
        return outs

    def of(self, session: str) -> list:
        return [(r, c) for r, c in self.log if r.session == session]


class Flaky:
    """The engine with chosen requests failing. `plan[(session, turn, attempt)]` (turn from 1,
    attempt from 0) is what that request meets: "raise" (its whole call raises), "abort" (it
    comes back ABORT, the others answered) or "fatal" (the call raises FatalEngineError)."""

    def __init__(self, engine, plan: dict):
        self.engine, self.plan, self.calls, self.met = engine, plan, 0, set()
        self.turns: dict[str, tuple[int, int, int]] = {}  # session -> (input length, turn, try)

    def generate(self, requests):
        self.calls += 1
        keys = [(r.session, *self._turn(r)) for r in requests]
        fates = [self.plan.get(k) for k in keys]
        self.met |= {k for k in keys if k in self.plan}
        if "fatal" in fates:
            raise FatalEngineError("the engine and the learner disagree")
        if "raise" in fates:
            raise RuntimeError("connection reset")
        outs = self.engine.generate(requests)
        return [Completion([], [], ABORT) if f == "abort" else o for f, o in zip(fates, outs)]

    def _turn(self, r) -> tuple[int, int]:
        n, turn, attempt = self.turns.get(r.session, (-1, 0, 0))
        turn, attempt = (turn, attempt + 1) if n == len(r.input_ids) else (turn + 1, 0)
        self.turns[r.session] = (len(r.input_ids), turn, attempt)
        return turn, attempt


@contextlib.contextmanager
def preferring(tiny: Tiny, token: int, scale: float = 50.0):
    """The checkpoint changed, in both engines' weights, so that `token` is by far the likeliest
    next token: its LM-head row points along the mean final hidden state of the prompts (which
    every hidden state leans towards). Restored on exit."""
    renderer = TinyRenderer(tiny.processor, tiny.hf.config)
    hidden = torch.cat([forward(tiny.hf, tiny.processor, renderer.prompt_ids(p.messages, p.images),
                                p.images, output_hidden_states=True).hidden_states[-1][0]
                        for p in prompts()])
    direction = hidden.mean(0) / hidden.mean(0).norm() * scale
    head = tiny.hf.lm_head.weight  # the embedding itself where the two are tied
    key = "lm_head.weight" if "lm_head.weight" in tiny.params else \
        "model.language_model.embed_tokens.weight"
    saved_row, saved_params = head[token].clone(), tiny.params
    with torch.no_grad():
        head[token] = direction
    tiny.params = dict(saved_params, **{key: saved_params[key].at[token].set(direction.numpy())})
    try:
        yield
    finally:
        with torch.no_grad():
            head[token] = saved_row
        tiny.params = saved_params


# ---- checks shared by the tests ----------------------------------------------------------
def feedback_after(traj, renderer, env_config=ENV) -> list[int] | None:
    """The observation ids that would follow the trajectory's last turn (None: the environment
    ended the episode there)."""
    env = Geo3kEnv(traj.answer, env_config)
    for turn in traj.turns:
        obs, done, _ = env.step(turn.text)
    if done:
        return None
    return renderer.observation_ids(env.format_observation(obs), int(traj.token_ids[-1]))


def check_turns(traj, renderer):
    """Every turn is generated tokens (mask 1) that stop at a stop token, only the last, or at
    the budget without one; the feedback's ids follow a turn that has one, mask 0."""
    ids, mask = traj.token_ids.tolist(), traj.loss_mask.tolist()
    assert traj.turns[0].start == traj.prompt_len and not any(mask[:traj.prompt_len])
    for k, turn in enumerate(traj.turns):
        gen = ids[turn.start:turn.end]
        assert gen and mask[turn.start:turn.end] == [1] * len(gen)
        assert not set(STOPS) & set(gen[:-1])  # nothing generated after a stop token
        assert (gen[-1] in STOPS) == (turn.finish_reason == STOP)
        assert turn.text == renderer.decode(gen[:-1] if gen[-1] in STOPS else gen)
        end = traj.turns[k + 1].start if k + 1 < len(traj.turns) else len(ids)
        if turn.observation is None:
            assert end == turn.end
            continue
        obs = renderer.observation_ids({"role": "tool", "content": turn.observation}, gen[-1])
        assert ids[turn.end:end] == obs and mask[turn.end:end] == [0] * len(obs)


def rollout_of(kind, tiny, renderer, cfg, n_prompts=3, engine=None):
    """The rollout of `n_prompts` problems on a fresh engine of `kind` (or on `engine`)."""
    return rollout(prompts(n_prompts), engine or fresh(kind, tiny), renderer, cfg, ENV)


# ---- the rules ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_stop_tokens_end_turns_and_the_feedback_follows(kind, tiny, renderer):
    """With room to spare, every turn ends at its first stop token (kept as its last token,
    finish 'stop', nothing sampled after it) and the next turn starts after exactly the
    feedback's ids; episodes end when the environment says so."""
    cfg = RolloutConfig(n_samples=4, max_response_tokens=400, max_context_tokens=1000)
    trajs = rollout_of(kind, tiny, renderer, cfg)
    for t in trajs:
        check_turns(t, renderer)
        assert t.status == "completed" and feedback_after(t, renderer) is None
        assert all(turn.finish_reason == STOP for turn in t.turns)
    assert max(len(t.turns) for t in trajs) == 3  # feedback was answered, twice
    assert sum(turn.observation is not None for t in trajs for turn in t.turns) >= 4


@pytest.mark.parametrize("kind", KINDS)
def test_response_budget_is_shared_by_turns_and_feedback(kind, tiny, renderer):
    """One budget for the whole response: every request may use what the earlier turns and
    their feedback left; no trajectory exceeds it; one cut off by it mid-turn, or whose next
    feedback would not fit, ends 'truncated'. The feedback's tokens count: some episodes reach
    the budget having generated less than half of it."""
    budget = 80  # about two turns and their feedback
    cfg = RolloutConfig(n_samples=4, max_response_tokens=budget, max_context_tokens=1000)
    engine = Recorder(fresh(kind, tiny, seed=1))
    trajs = rollout_of(kind, tiny, renderer, cfg, engine=engine)
    for t in trajs:
        check_turns(t, renderer)
        assert t.response_len <= budget
        for req, out in engine.of(f"{t.group_id}-{t.sample_idx}"):
            assert req.sampling.max_new_tokens == budget - (len(req.input_ids) - t.prompt_len)
            assert len(out.token_ids) <= req.sampling.max_new_tokens
        feedback = feedback_after(t, renderer)
        if t.status == "completed":
            assert feedback is None
        else:
            assert t.status == "truncated"
            full = t.response_len == budget and t.turns[-1].finish_reason == LENGTH
            assert full or t.response_len + len(feedback) >= budget
    full = [t for t in trajs if t.response_len == budget]
    assert any(len(t.turns) >= 2 and t.num_generated < budget // 2 for t in full)
    assert any(t.status == "truncated" and t.response_len < budget for t in trajs)  # no room
    assert any(t.status == "completed" for t in trajs)


@pytest.mark.parametrize("kind", KINDS)
def test_context_limit_holds(kind, tiny, renderer):
    """Prompt + response never exceed max_context_tokens (the prompts differ in length: the
    room left differs), with the budget far away; reaching it truncates."""
    limit = 64
    cfg = RolloutConfig(n_samples=4, max_response_tokens=1000, max_context_tokens=limit)
    engine = Recorder(fresh(kind, tiny, seed=2))
    trajs = rollout_of(kind, tiny, renderer, cfg, engine=engine)
    assert len({t.prompt_len for t in trajs}) == 3
    for t in trajs:
        check_turns(t, renderer)
        assert len(t.token_ids) <= limit
        for req, _ in engine.of(f"{t.group_id}-{t.sample_idx}"):
            assert req.sampling.max_new_tokens == limit - len(req.input_ids)
        if t.status == "truncated":
            feedback = feedback_after(t, renderer)
            assert len(t.token_ids) == limit or len(t.token_ids) + len(feedback) >= limit
    assert any(len(t.token_ids) == limit and t.status == "truncated" for t in trajs)


@pytest.mark.parametrize("kind", KINDS)
def test_placeholders_are_never_sampled(kind, tiny, renderer):
    """With the image placeholder by far the likeliest token (p > 0.99 where each episode
    starts) the engine never samples it, sampled or greedy, so no episode is aborted for a
    placeholder."""
    with preferring(tiny, IMG):
        for temperature in (1.0, 0.0):
            cfg = RolloutConfig(n_samples=2, max_response_tokens=64, max_context_tokens=1000,
                                temperature=temperature)
            trajs = rollout_of(kind, tiny, renderer, cfg)
            for t in trajs:
                assert t.status != "aborted", t.abort_reason
                assert not set(renderer.placeholder_ids) & set(t.token_ids[t.prompt_len:])
                p_img = np.exp(model_logprobs(tiny.hf, tiny.processor, t)[t.prompt_len - 1, IMG])
                assert p_img > 0.99


# The retries are the rollout's; the JAX engine meets them (a request sent again while it
# keeps that session's cache) on one architecture: the other takes 15 s more for nothing new.
@pytest.mark.parametrize("tiny,kind", [("qwen3_vl", "torch"), ("qwen2_5_vl", "torch"),
                                       ("qwen2_5_vl", "jax")], indirect=["tiny"])
def test_failed_requests_are_retried_then_abort_only_their_episode(kind, tiny, renderer):
    """Greedy, max_retries=2: the whole first call raises; one request then aborts once more
    (two failures: retried, it goes on); one fails three times in its first turn and one in
    its second (aborted for 'engine', keeping what it had). Every other episode is the one a
    run without failures gives."""
    cfg = RolloutConfig(n_samples=2, max_response_tokens=200, max_context_tokens=1000,
                        temperature=0.0, max_retries=2)
    ref = rollout_of(kind, tiny, renderer, cfg)
    later = next(s for t in ref if len(t.turns) >= 2
                 and (s := f"{t.group_id}-{t.sample_idx}") not in ("1-1", "2-0"))
    plan = {("0-0", 1, 0): "raise", ("1-1", 1, 1): "abort", ("2-0", 1, 1): "abort",
            ("2-0", 1, 2): "abort"} | {(later, 2, a): "abort" for a in range(3)}
    engine = Flaky(fresh(kind, tiny), plan)
    trajs = rollout_of(kind, tiny, renderer, cfg, engine=engine)
    assert engine.met == set(plan)  # every planned failure happened
    for t, r in zip(trajs, ref):
        session = f"{t.group_id}-{t.sample_idx}"
        if session == "2-0":
            assert (t.status, t.abort_reason, t.response_len, t.reward) == ("aborted", "engine",
                                                                            0, 0.0)
        elif session == later:
            assert (t.status, t.abort_reason, len(t.turns)) == ("aborted", "engine", 1)
            n = r.turns[1].start  # its first turn and the feedback
            np.testing.assert_array_equal(t.token_ids, r.token_ids[:n])
        else:
            assert_same(t, r, atol=1e-5)

    engine = Flaky(fresh(kind, tiny), {(later, 2, 0): "fatal"})
    with pytest.raises(FatalEngineError, match="disagree"):
        rollout_of(kind, tiny, renderer, cfg, engine=engine)
    assert engine.calls == 2  # not retried


@pytest.mark.parametrize("kind", KINDS)
def test_trained_tokens_and_logprobs_are_the_engines(kind, tiny, renderer, temperature=0.7):
    """Loss mask 1 exactly on the tokens the engine returned, in order, with its log-probs
    (0 elsewhere); those are the model's log_softmax(logits / T) of each token given the whole
    trajectory before it (images, earlier turns, feedback), from one transformers forward."""
    cfg = RolloutConfig(n_samples=2, max_response_tokens=120, max_context_tokens=1000,
                        temperature=temperature)
    engine = Recorder(fresh(kind, tiny, seed=3))
    trajs = rollout_of(kind, tiny, renderer, cfg, engine=engine)
    for t in trajs:
        outs = [c for _, c in engine.of(f"{t.group_id}-{t.sample_idx}")]
        gen = np.flatnonzero(t.loss_mask)
        assert t.token_ids[gen].tolist() == [i for c in outs for i in c.token_ids]
        np.testing.assert_array_equal(t.rollout_logprobs[gen],
                                      np.float32([x for c in outs for x in c.logprobs]))
        assert not t.rollout_logprobs[t.loss_mask == 0].any()
        ref = model_logprobs(tiny.hf, tiny.processor, t, temperature)[gen - 1, t.token_ids[gen]]
        np.testing.assert_allclose(t.rollout_logprobs[gen], ref, rtol=0, atol=1e-4)
    assert sum(len(t.turns) for t in trajs) > len(trajs)


def test_greedy_rollouts_are_the_same_on_both_engines(tiny, renderer):
    """Greedy, five problems with 1-3 images of different sizes, up to three turns: the torch
    and the JAX engine give the same trajectories (tokens, masks, turns, statuses; log-probs
    within 1e-4)."""
    cfg = RolloutConfig(n_samples=2, max_response_tokens=200, max_context_tokens=1000,
                        temperature=0.0)
    torch_trajs, jax_trajs = (rollout_of(kind, tiny, renderer, cfg, n_prompts=5)
                              for kind in KINDS)
    for a, b in zip(torch_trajs, jax_trajs):
        assert_same(a, b, atol=1e-4)
    assert sum(len(t.turns) for t in jax_trajs) >= 2 * len(jax_trajs)


def test_jax_engine_serves_episodes_as_they_come(tiny, renderer):
    """The JAX engine is an `AsyncEngine`: with `schedule=episode` each episode sends its next
    turn when its own comes back, into whichever of the 2 slots is free (sessions evicted and
    rebuilt); sampled at temperature 1, the trajectories are lock-step's (every request
    samples from its own key, whatever batch or slot serves it)."""
    from common.engine import AsyncEngine
    assert isinstance(tiny.engine(), AsyncEngine)
    runs = []
    for schedule in ("episode", "lockstep"):
        cfg = RolloutConfig(n_samples=3, max_response_tokens=120, max_context_tokens=1000,
                            temperature=1.0, schedule=schedule)
        engine = fresh("jax", tiny, seed=3)
        evicted = engine.evictions
        runs.append(rollout_of("jax", tiny, renderer, cfg, engine=engine))
        assert engine.evictions > evicted
    for a, b in zip(*runs):
        assert_same(a, b, atol=1e-5)
    assert sum(len(t.turns) for t in runs[0]) > len(runs[0])


def assert_same(a, b, atol):
    """Two trajectories are the same episode (log-probs within `atol`)."""
    assert (a.uid, a.sample_idx, a.status, a.abort_reason, a.reward) == \
        (b.uid, b.sample_idx, b.status, b.abort_reason, b.reward)
    np.testing.assert_array_equal(a.token_ids, b.token_ids)
    np.testing.assert_array_equal(a.loss_mask, b.loss_mask)
    assert [dataclasses.astuple(t) for t in a.turns] == [dataclasses.astuple(t) for t in b.turns]
    np.testing.assert_allclose(a.rollout_logprobs, b.rollout_logprobs, rtol=0, atol=atol)
