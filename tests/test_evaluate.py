"""The evaluation's numbers, pinned with a scripted engine whose first-try and with-feedback
outcomes are known; the unbiased pass@k estimator; the table and the chart."""

import json
from math import comb

import pytest

from common.env import EnvConfig
from common.evaluation.report import markdown, rows, write_report
from common.evaluation.evaluate import evaluate, pass_at_k, pass_ks
from common.rollout import RolloutConfig
from tests.conftest import Reply, ScriptedEngine, make_prompt


def call(answer):
    return ('<tool_call>{"name": "calc_score", "arguments": {"answer": ' + json.dumps(answer)
            + '}}</tool_call>')


R, W = Reply(call("12")), Reply(call("7"))  # right, wrong (every answer is 12)
GIVE_UP = Reply("no idea")  # no tool call, no box: the episode ends unsolved


def script():
    """Session "g-k": greedy episodes take the first replies of "g-0", sampled ones follow.

    greedy:  p0 solved on turn 1, p1 on turn 2, p2 gives up        (turns 1, 2, 1; 3 calls)
    sampled: p0 solved on turns 1, 2, -, 3   p1: 2, 2, -, -   p2: 1, -, -, -
    """
    return {
        "0-0": [R, R], "0-1": [W, R], "0-2": [W, W, W], "0-3": [W, W, R],
        "1-0": [W, R, W, R], "1-1": [W, R], "1-2": [W, W, W], "1-3": [W, W, W],
        "2-0": [GIVE_UP, R], "2-1": [W, W, W], "2-2": [W, W, W], "2-3": [W, W, W],
    }


def test_first_try_feedback_by_turn_and_pass_at_k(renderer):
    prompts = [make_prompt(uid=f"p{i}") for i in range(3)]
    engine = ScriptedEngine(script())
    m = evaluate(prompts, engine, renderer, RolloutConfig(n_samples=8, temperature=0.7),
                 EnvConfig(max_turns=3), n_samples=4)
    assert all(not v for v in engine.script.values())  # every scripted reply was used
    # greedy: 1 of 3 before feedback, 2 of 3 with it. A first-try accuracy read from `correct`
    # would give 2/3, a non-cumulative solved_by_turn_3 would give 0.
    assert m["greedy_first_try_accuracy"] == pytest.approx(1 / 3)
    assert m["greedy_accuracy"] == pytest.approx(2 / 3)
    assert [m[f"greedy_solved_by_turn_{k}"] for k in (1, 2, 3)] == pytest.approx(
        [1 / 3, 2 / 3, 2 / 3])
    assert m["greedy_tool_call_rate"] == pytest.approx(3 / 4)  # 3 calls in 4 turns
    assert m["greedy_turns_mean"] == pytest.approx(4 / 3)
    assert "greedy_pass_at_1" not in m  # one episode per prompt: no pass@k
    # sampled, 12 episodes: solved on turn 1 twice, by turn 2 five times, by turn 3 six times
    assert m["sampled_first_try_accuracy"] == pytest.approx(2 / 12)
    assert m["sampled_accuracy"] == pytest.approx(6 / 12)
    assert [m[f"sampled_solved_by_turn_{k}"] for k in (1, 2, 3)] == pytest.approx(
        [2 / 12, 5 / 12, 6 / 12])
    # first-try successes per prompt c = (1, 0, 1) of n = 4: pass@2 = (1 - C(3,2)/C(4,2)) * 2/3;
    # a biased "any of the first k" estimate would depend on the episodes' order instead
    assert [m[f"sampled_pass_at_{k}"] for k in (1, 2, 4)] == pytest.approx([1 / 6, 1 / 3, 2 / 3])
    # with feedback c = (3, 2, 1): pass@2 = (1 + 5/6 + 1/2) / 3
    assert [m[f"sampled_final_pass_at_{k}"] for k in (1, 2, 4)] == pytest.approx(
        [1 / 2, 7 / 9, 1.0])
    # the temperature of the sampled episodes is the rollout's, greedy ones use 0
    temps = sorted({r.sampling.temperature for r in engine.requests})
    assert temps == [0.0, 0.7]


def test_pass_at_k_is_the_unbiased_estimator():
    for n, c, k in ((5, 2, 3), (10, 3, 1), (8, 0, 4), (8, 8, 8), (20, 5, 7)):
        assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k))
    assert pass_at_k(5, 2, 3) == pytest.approx(0.9)
    assert pass_ks(4) == [1, 2, 4] and pass_ks(6) == [1, 2, 4, 6] and pass_ks(1) == [1]
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_table_and_chart(renderer, tmp_path):
    prompts = [make_prompt(uid=f"p{i}") for i in range(3)]
    m = evaluate(prompts, ScriptedEngine(script()), renderer, RolloutConfig(),
                 EnvConfig(max_turns=3), n_samples=4)
    labels = [label for label, _ in rows(m, 3)]
    assert labels[:4] == ["first try (turn 1)", "solved by turn 2", "with feedback (≤3 turns)",
                          "pass@2, first try"]
    table = markdown(m, 3, "demo")
    assert "| first try (turn 1) | 0.333 | 0.167 |" in table
    assert "| with feedback (≤3 turns) | 0.667 | 0.500 |" in table
    assert "| pass@4, first try |  | 0.667 |" in table
    out = write_report(m, tmp_path, "demo", 3)
    assert json.loads((out / "eval.json").read_text()) == pytest.approx(m)
    assert (out / "eval.md").read_text() == table
    png = (out / "eval.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
