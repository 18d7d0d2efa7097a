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


def test_processes_exchange_only_sums_and_equal_one_process(renderer):
    """Two processes (threads here), each with its own prompts and engine, summing a dict of
    floats over both: every metric equals the one-process run, and nothing but float sums
    crosses (`sum_scalars` is the only channel)."""
    import threading

    prompts = [make_prompt(uid=f"p{i}") for i in range(3)]
    one = evaluate(prompts, ScriptedEngine(script()), renderer,
                   RolloutConfig(n_samples=8, temperature=0.7), EnvConfig(max_turns=3),
                   n_samples=4)
    full = script()

    def renamed(order):  # session "i-k" of a process: its i-th prompt's k-th episode
        return {f"{j}-{k}": full[f"{i}-{k}"] for j, i in enumerate(order) for k in range(4)}

    shares = {0: [0, 2], 1: [1]}  # prompt indices per process, uneven
    barrier, posted, out = threading.Barrier(2), {}, {}

    def sum_scalars(rank, sums):
        assert all(isinstance(v, float) for v in sums.values())
        posted[rank] = sums
        barrier.wait()
        total = {k: posted[0][k] + posted[1][k] for k in posted[0]}
        assert posted[0].keys() == posted[1].keys()
        barrier.wait()
        return total

    def process(rank):
        out[rank] = evaluate([prompts[i] for i in shares[rank]],
                             ScriptedEngine(renamed(shares[rank])), renderer,
                             RolloutConfig(n_samples=8, temperature=0.7), EnvConfig(max_turns=3),
                             n_samples=4, split=prompts,
                             sum_scalars=lambda s, rank=rank: sum_scalars(rank, s))

    threads = [threading.Thread(target=process, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out[0] == out[1]
    assert out[0].keys() == one.keys() and "sampled_pass_at_2" in one
    assert out[0] == pytest.approx(one)


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
    assert labels[:11] == ["first try (turn 1)", "solved by turn 2", "with feedback (≤3 turns)",
                           "elimination after own first try", "recovery after a first-try miss",
                           "best figure-blind retry after a miss",
                           "turn-2 answers equal to their group's most common",
                           "elimination after a miss", "uniform re-guess after a miss",
                           "later answers repeating an earlier one", "pass@2, first try"]
    table = markdown(m, 3, "demo")
    # ± the binomial standard error: sqrt(1/3 * 2/3 / 3) = 0.272, sqrt(1/6 * 5/6 / 12) = 0.108
    assert "| first try (turn 1) | 0.333 ± 0.272 | 0.167 ± 0.108 |" in table
    assert "| with feedback (≤3 turns) | 0.667 ± 0.272 | 0.500 ± 0.144 |" in table
    assert "| pass@4, first try |  | 0.667 |" in table
    out = write_report(m, tmp_path, "demo", 3)
    assert json.loads((out / "eval.json").read_text()) == pytest.approx(m)
    assert (out / "eval.md").read_text() == table
    png = (out / "eval.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


A = Reply(fail="abort")  # three of them (max_retries=2): the episode is aborted
PERCEPTION_TEXT = "<image>How many sides does the polygon have?"


def mixed_prompts():
    """p0 a perception problem, p1 a geometry one (4 choices each, label 12 = choice A), p2 a
    free-form one (label 12)."""
    import types
    choices = ["12", "7", "3", "5"]
    make = lambda uid, problem, ch: types.SimpleNamespace(  # noqa: E731
        uid=uid, answer="12", messages=make_prompt(uid=uid).messages, images=["img0"],
        choices=ch, problem=problem)
    return [make("p0", PERCEPTION_TEXT, choices), make("p1", "<image>Find x.", choices),
            make("p2", "<image>Find y.", None)]


def test_aborted_episodes_are_failures_and_baselines_stand_beside(renderer, tmp_path):
    """Aborted episodes count as failures in every accuracy (before, first try and with
    feedback left them out while pass@k counted them: 1/2 and 2/5 here, and pass@1 != first
    try); the no-skill baselines come with the metrics, per kind too."""
    script = {"0-0": [A, A, A, R], "0-1": [W, R], "1-0": [R, W, W, W], "1-1": [W, W, W],
              "2-0": [W, W, W, A, A, A], "2-1": [R]}
    m = evaluate(mixed_prompts(), ScriptedEngine(script), renderer,
                 RolloutConfig(n_samples=8), EnvConfig(max_turns=3), n_samples=2)
    assert m["greedy_first_try_accuracy"] == pytest.approx(1 / 3)  # p0 aborted, p1 R, p2 W W W
    assert m["greedy_accuracy"] == pytest.approx(1 / 3)
    assert m["sampled_first_try_accuracy"] == pytest.approx(2 / 6)  # one of six aborted
    assert m["sampled_pass_at_1"] == pytest.approx(m["sampled_first_try_accuracy"])
    assert m["sampled_accuracy"] == pytest.approx(3 / 6)
    # chance 1/4 and elimination 3/4 for the choice problems, 1 for the free-form one (its
    # answer is the split's only free-form answer: a constant guesser gets it)
    assert m["baseline_first_try"] == pytest.approx((0.25 + 0.25 + 1) / 3)
    assert m["baseline_with_feedback"] == pytest.approx((0.75 + 0.75 + 1) / 3)
    assert m["baseline_solved_by_turn_2"] == pytest.approx((0.5 + 0.5 + 1) / 3)
    assert m["baseline_pass_at_2"] == pytest.approx((2 * (1 - 0.75 ** 2) + 1) / 3)
    assert m["polygon_sides/baseline_first_try"] == m["perception/baseline_first_try"] == 0.25
    assert m["perception/greedy_first_try_accuracy"] == 0.0  # p0's greedy episode aborted
    assert m["perception/sampled_first_try_accuracy"] == 0.5
    assert m["geometry/greedy_first_try_accuracy"] == 0.5  # p1 yes, p2 no
    assert m["geometry/baseline_with_feedback"] == pytest.approx((0.75 + 1) / 2)
    table = markdown(m, 3, "mixed")
    assert "| | greedy | sampled | no skill |" in table
    assert "| first try (turn 1) | 0.333 ± 0.272 | 0.333 ± 0.192 | 0.500 |" in table
    assert "| with feedback (≤3 turns) | 0.333 ± 0.272 | 0.500 ± 0.204 | 0.833 |" in table
    assert "*perception problems*" in table and "*geometry problems*" in table
    write_report(m, tmp_path / "mixed", "mixed", 3)


def test_a_report_of_only_aborted_episodes(renderer, tmp_path):
    """Every episode aborted: accuracies 0 (not missing), and the report is written (it
    divided by zero)."""
    m = evaluate([make_prompt(uid="p0")], ScriptedEngine({"0-0": [A] * 6}), renderer,
                 RolloutConfig(), EnvConfig(max_turns=3), n_samples=0)
    assert m["greedy_first_try_accuracy"] == 0.0 and m["greedy_accuracy"] == 0.0
    out = write_report(m, tmp_path, "aborted", 3)
    assert "| first try (turn 1) | 0.000 ± 0.000 |" in (out / "eval.md").read_text()
