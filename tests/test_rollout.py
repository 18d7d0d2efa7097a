"""The multi-turn rollout against a scripted engine: exact tokens, masks, log-probs, statuses."""

import dataclasses
import json

import numpy as np
import pytest

from common.engine import LENGTH, STOP, Completion
from common.env import EnvConfig, FEEDBACK
from common.rollout import (ABORT_REASONS, RolloutConfig, generate_with_retries, rollout,
                            split_turns)
from common.reward import RewardConfig
from tests.conftest import (IMAGE, IMAGE_TOKENS, TURN_END, Reply, ScriptedEngine, logprob,
                            make_prompt)


def call(answer):
    return ('<tool_call>{"name": "calc_score", "arguments": {"answer": ' + json.dumps(answer)
            + '}}</tool_call>')


def codes(text):
    return [ord(c) for c in text]


def generated(text, stop=True):
    ids = codes(text) + ([TURN_END] if stop else [])
    return ids, [logprob(i) for i in range(len(ids))]


def test_two_turn_episode_exact_tokens(renderer):
    prompt = make_prompt(answer="12", text="Find x.")
    r1, r2 = "x is 10 " + call("10"), "then 12 " + call("12")
    engine = ScriptedEngine({"0-0": [Reply(r1), Reply(r2)], "0-1": [Reply("\\boxed{12}")]})
    cfg = RolloutConfig(n_samples=2, max_response_tokens=1000, max_context_tokens=2000)
    t0, t1 = rollout([prompt], engine, renderer, cfg)

    feedback = FEEDBACK["wrong"].format(answer="10") + ""
    obs = codes(f"|T:{feedback}|A:")
    p = [IMAGE] * IMAGE_TOKENS + codes("U:Find x.|A:")
    g1, l1 = generated(r1)
    g2, l2 = generated(r2)
    assert t0.token_ids.tolist() == p + g1 + obs + g2
    assert t0.loss_mask.tolist() == [0] * len(p) + [1] * len(g1) + [0] * len(obs) + [1] * len(g2)
    np.testing.assert_allclose(t0.rollout_logprobs, [0] * len(p) + l1 + [0] * len(obs) + l2,
                               rtol=1e-6)
    assert t0.prompt_len == len(p) and t0.status == "completed"
    assert [t.info["reason"] for t in t0.turns] == ["wrong", "correct"]
    assert t0.turns[0].observation == feedback and t0.turns[1].observation is None
    assert (t0.turns[0].start, t0.turns[0].end) == (len(p), len(p) + len(g1))
    assert t0.reward == 1.0 and t0.correct and t0.correct_turn == 2
    assert t0.turns[0].text == r1  # the stop token is not part of the text

    # sample 1 answered without the tool: its box is the turn's answer, correct: the episode
    # ends there, and the reward reads the environment's verdict
    assert t1.token_ids.tolist() == p + generated("\\boxed{12}")[0]
    assert t1.turns[0].info["reason"] == "correct"
    assert t1.turns[0].info["answer_kind"] == "boxed"
    assert t1.reward == 1.0 and t1.correct_turn == 1
    assert (t0.group_id, t0.sample_idx, t1.sample_idx) == (0, 0, 1)

    # what the engine saw: the episode so far, its images, stop ids, the remaining budget
    second = [r for r in engine.requests if r.session == "0-0"][1]
    assert list(second.input_ids) == p + g1 + obs
    assert second.images == prompt.images
    assert second.sampling.stop_token_ids == renderer.stop_token_ids
    assert second.sampling.max_new_tokens == 1000 - len(g1) - len(obs)
    assert engine.calls == 2  # all active episodes of a turn go in one call


def test_turn_discount_and_wrong_rewards(renderer):
    prompt = make_prompt(answer="12")
    engine = ScriptedEngine({"0-0": [Reply(call("1")), Reply(call("12"))],
                             "0-1": [Reply(call("1")), Reply(call("2")), Reply(call("3"))]})
    cfg = RolloutConfig(n_samples=2)
    t0, t1 = rollout([prompt], engine, renderer, cfg, EnvConfig(max_turns=3),
                     RewardConfig(turn_discount=0.5))
    assert t0.reward == 0.5 and t0.correct_turn == 2
    assert t1.reward == 0.0 and not t1.correct and len(t1.turns) == 3
    assert t1.status == "completed"


def test_budget_truncates_a_long_turn(renderer):
    prompt = make_prompt()
    engine = ScriptedEngine({"0-0": [Reply("a" * 50)]})
    t, = rollout([prompt], engine, renderer, RolloutConfig(n_samples=1, max_response_tokens=30))
    assert t.status == "truncated" and t.response_len == 30
    assert t.loss_mask[t.prompt_len:].tolist() == [1] * 30
    assert t.turns[0].finish_reason == LENGTH and t.reward == 0.0


def test_budget_shared_across_turns_and_observations(renderer):
    prompt = make_prompt()
    r1 = call("1")
    obs_len = len(f"|T:{FEEDBACK['wrong'].format(answer='1')}|A:")
    budget = len(r1) + 1 + obs_len + 5  # room for 5 tokens in the second turn
    engine = ScriptedEngine({"0-0": [Reply(r1), Reply("b" * 40)]})
    t, = rollout([prompt], engine, renderer, RolloutConfig(n_samples=1,
                                                           max_response_tokens=budget))
    assert t.status == "truncated" and t.response_len == budget
    assert engine.requests[1].sampling.max_new_tokens == 5


def test_observation_that_does_not_fit_truncates(renderer):
    prompt = make_prompt()
    r1 = call("1")
    engine = ScriptedEngine({"0-0": [Reply(r1)]})
    t, = rollout([prompt], engine, renderer,
                 RolloutConfig(n_samples=1, max_response_tokens=len(r1) + 10))
    assert t.status == "truncated"
    assert t.token_ids.tolist()[-1] == TURN_END  # no partial feedback appended
    assert t.turns[0].observation is None and len(engine.requests) == 1


def test_context_limit(renderer):
    prompt = make_prompt(text="Find x.")
    plen = IMAGE_TOKENS + len("U:Find x.|A:")
    engine = ScriptedEngine({"0-0": [Reply("c" * 100)]})
    t, = rollout([prompt], engine, renderer,
                 RolloutConfig(n_samples=1, max_response_tokens=500, max_context_tokens=plen + 7))
    assert t.status == "truncated" and len(t.token_ids) == plen + 7


def test_failing_request_is_retried_then_succeeds(renderer):
    prompt = make_prompt()
    engine = ScriptedEngine({"0-0": [Reply(fail="raise"), Reply(fail="abort"), Reply(call("12"))],
                             "0-1": [Reply(call("12"))]})
    t0, t1 = rollout([prompt], engine, renderer, RolloutConfig(n_samples=2, max_retries=2))
    assert t0.status == t1.status == "completed" and t0.reward == t1.reward == 1.0


def test_request_failing_too_often_is_aborted_others_go_on(renderer):
    prompt = make_prompt()
    engine = ScriptedEngine({"0-0": [Reply(fail="raise"), Reply(fail="abort")],
                             "0-1": [Reply(call("5")), Reply(call("12"))]})
    t0, t1 = rollout([prompt], engine, renderer, RolloutConfig(n_samples=2, max_retries=1))
    assert t0.status == "aborted" and t0.reward == 0.0 and not t0.correct
    assert t0.abort_reason == "engine"
    assert t0.response_len == 0
    assert t1.status == "completed" and t1.reward == 1.0 and len(t1.turns) == 2


def test_generate_with_retries_counts_attempts(renderer):
    engine = ScriptedEngine({"s": [Reply(fail="abort")] * 3})
    from common.engine import Request, SamplingParams
    req = Request((1, 2), (), SamplingParams(), "s")
    assert generate_with_retries(engine, [req], max_retries=2) == [None]
    assert engine.calls == 3


def test_groups_and_offsets(renderer):
    prompts = [make_prompt("a", "1"), make_prompt("b", "2")]
    script = {f"{g}-{k}": [Reply(call(str(g - 6)))] for g in (7, 8) for k in range(3)}
    trajs = rollout(prompts, ScriptedEngine(script), renderer, RolloutConfig(n_samples=3),
                    group_offset=7)
    assert [(t.uid, t.group_id, t.sample_idx) for t in trajs] == [
        ("a", 7, 0), ("a", 7, 1), ("a", 7, 2), ("b", 8, 0), ("b", 8, 1), ("b", 8, 2)]
    assert all(t.reward == 1.0 for t in trajs)


def test_individual_export_splits_turns(renderer):
    prompt = make_prompt()
    engine = ScriptedEngine({"0-0": [Reply(call("1")), Reply(call("12"))]})
    t, = rollout([prompt], engine, renderer, RolloutConfig(n_samples=1))
    a, b = split_turns(t)
    assert a.token_ids.tolist() == t.token_ids[:t.turns[0].end].tolist()
    assert a.loss_mask.sum() == t.turns[0].end - t.turns[0].start
    assert b.token_ids.tolist() == t.token_ids.tolist()
    assert b.loss_mask[:t.turns[1].start].sum() == 0  # turn 1 is prompt for piece 2
    assert b.loss_mask.sum() == t.turns[1].end - t.turns[1].start
    assert b.rollout_logprobs[:t.turns[1].start].sum() == 0
    assert a.reward == b.reward == t.reward


def test_engine_returning_too_many_tokens_is_an_error(renderer):
    class Greedy:
        def generate(self, requests):
            from common.engine import Completion
            n = requests[0].sampling.max_new_tokens + 1
            return [Completion([65] * n, [0.0] * n, STOP)]

    with pytest.raises(ValueError, match="max_new_tokens"):
        rollout([make_prompt()], Greedy(), renderer, RolloutConfig(n_samples=1))


@pytest.mark.parametrize("kw", [dict(n_samples=0), dict(max_retries=-1),
                                dict(export_style="both")])
def test_bad_rollout_config(kw):
    with pytest.raises(ValueError):
        RolloutConfig(**kw)


def test_fatal_engine_error_is_raised_not_retried(renderer):
    from common.engine import FatalEngineError

    class Broken:
        calls = 0

        def generate(self, requests):
            Broken.calls += 1
            raise FatalEngineError("image tokens disagree")

    with pytest.raises(FatalEngineError, match="image tokens"):
        rollout([make_prompt()], Broken(), renderer, RolloutConfig(n_samples=2, max_retries=3))
    assert Broken.calls == 1


def test_a_sampled_placeholder_aborts_that_episode_only(renderer):
    """An engine that does not ban image placeholders (SGLang) samples one: that episode is
    aborted with its own reason and counted; the group's other episodes go on."""
    from common.metrics import rollout_metrics
    prompt = make_prompt(answer="12")
    engine = ScriptedEngine({"0-0": [Reply("look " + chr(IMAGE) + " " + call("12"))],
                             "0-1": [Reply(call("7")), Reply(call("12"))]})
    cfg = RolloutConfig(n_samples=2, max_response_tokens=1000, max_context_tokens=2000)
    bad, good = rollout([prompt], engine, renderer, cfg)
    assert (bad.status, bad.abort_reason, bad.reward, bad.correct) == ("aborted", "placeholder",
                                                                       0.0, False)
    assert (good.status, good.abort_reason, good.reward) == ("completed", None, 1.0)
    m = rollout_metrics([bad, good], max_turns=3)
    assert (m["aborted"], m["aborted_placeholder"], m["aborted_engine"]) == (1.0, 1.0, 0.0)


def test_metrics_of_several_processes_are_those_of_all_their_trajectories(renderer):
    """Each process sums its own trajectories (`rollout_sums`) and only the sums cross
    processes: the metrics are those of the trajectories gathered in one place."""
    from common.metrics import metrics_of_sums, rollout_metrics, rollout_sums
    prompt = make_prompt(answer="12")
    engine = ScriptedEngine({"0-0": [Reply("look " + chr(IMAGE) + " " + call("12"))],
                             "0-1": [Reply(call("7")), Reply(call("12"))],
                             "0-2": [Reply("no call"), Reply(call("3")), Reply(call("4"))],
                             "0-3": [Reply(call("12"))]})
    cfg = RolloutConfig(n_samples=4, max_response_tokens=1000, max_context_tokens=2000)
    trajs = rollout([prompt], engine, renderer, cfg)
    whole = rollout_metrics(trajs, max_turns=3)
    parts = [rollout_sums(trajs[:1], 3), rollout_sums(trajs[1:], 3)]
    merged = metrics_of_sums({k: parts[0][k] + parts[1][k] for k in parts[0]}, 3)
    assert merged.keys() == whole.keys() and merged == pytest.approx(whole, abs=1e-12)
    done = [t for t in trajs if t.status != "aborted"]
    assert whole["reward_std"] == pytest.approx(np.std([t.reward for t in done]))
    assert whole["solved_turn_2"] == pytest.approx(1 / 3) and whole["aborted"] == 1.0
    assert whole["accuracy"] == pytest.approx(2 / 3)
    assert whole["turns_mean"] == pytest.approx(np.mean([len(t.turns) for t in done]))
    assert metrics_of_sums(rollout_sums(trajs[:1], 3), 3).keys() == {
        "trajectories", "aborted", "truncated", *(f"aborted_{r}" for r in ABORT_REASONS)}


class RequestFunctionEngine:
    """A deterministic engine: each answer is a function of the request (its session, its
    length) and of how often that request was tried, whatever the order or batching. It takes
    requests in batches (`generate`) and one at a time (`submit`, answered after a random
    delay on a thread pool), so the two schedules can be compared exactly."""

    def __init__(self, answer):
        import concurrent.futures
        import threading
        self.answer, self.tries, self.lock = answer, {}, threading.Lock()
        self.pool = concurrent.futures.ThreadPoolExecutor(8)
        self.rng = np.random.default_rng(0)

    def _one(self, req):
        key = (req.session, len(req.input_ids))
        with self.lock:
            self.tries[key] = self.tries.get(key, 0) + 1
            attempt = self.tries[key]
        text, finish = self.answer(req.session, len(req.input_ids), attempt)
        if finish == "abort":
            return Completion([], [], "abort")
        ids = codes(text)[:req.sampling.max_new_tokens]
        if finish == STOP and len(ids) < req.sampling.max_new_tokens:
            ids.append(TURN_END)
        else:
            finish = LENGTH
        return Completion(ids, [logprob(i) for i in range(len(ids))], finish)

    def generate(self, requests):
        return [self._one(r) for r in requests]

    def submit(self, request):
        import time
        delay = float(self.rng.uniform(0, 0.01))
        return self.pool.submit(lambda: (time.sleep(delay), self._one(request))[1])


def mixed_answers(session, length, attempt):
    """Episodes of 1 to 3 turns, short and long turns, aborts that a retry fixes and one that
    never heals."""
    g, k = map(int, session.split("-"))
    if (g, k) == (1, 2):
        return "", "abort"  # every attempt fails: aborted after the retries
    if k == 1 and attempt == 1:
        return "", "abort"  # the first try fails, the retry answers
    turn = length // 97 % 3
    wrong = call(str(length % 7 + 20)) + " " + "x" * (5 + 40 * (k % 3))
    text = wrong if (g + k + turn) % 3 else call("12")
    return text, STOP


def test_per_episode_schedule_gives_the_lock_step_trajectories(renderer):
    from common.engine import AsyncEngine
    prompts = [make_prompt(uid=f"p{i}", answer="12") for i in range(3)]
    cfg = RolloutConfig(n_samples=4, max_response_tokens=700, max_context_tokens=4000,
                        max_retries=2)
    engine = RequestFunctionEngine(mixed_answers)
    assert isinstance(engine, AsyncEngine)
    per_episode = rollout(prompts, engine, renderer, cfg)
    lock_step = rollout(prompts, RequestFunctionEngine(mixed_answers), renderer,
                        dataclasses.replace(cfg, schedule="lockstep"))
    assert {t.status for t in lock_step} == {"completed", "truncated", "aborted"}
    assert {len(t.turns) for t in lock_step} == {0, 1, 2, 3}  # episodes of every length
    for a, b in zip(per_episode, lock_step):
        assert (a.group_id, a.sample_idx, a.status, a.abort_reason, a.reward, a.correct_turn) \
            == (b.group_id, b.sample_idx, b.status, b.abort_reason, b.reward, b.correct_turn)
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
        np.testing.assert_array_equal(a.loss_mask, b.loss_mask)
        np.testing.assert_array_equal(a.rollout_logprobs, b.rollout_logprobs)
        assert [t.text for t in a.turns] == [t.text for t in b.turns]
