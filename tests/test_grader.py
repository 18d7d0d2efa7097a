r"""Tests for common/grader.py: answer equivalence on Geometry3K shapes, box extraction, hard
timeouts from worker threads, concurrency, no code execution, input-size guard, stats.

Run: .venv/bin/python -m pytest -q tests/test_grader.py   (one worker pool is reused throughout)
"""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from common import grader
from common.grader import (STATS, Verdict, extract_last_boxed, grade_answer, math_reward,
                           normalize_answer, verify_answer)

TOWER = r"9^{9^{9^{9}}}"


@pytest.fixture(scope="module", autouse=True)
def warm_pool():
    grader.warmup()
    yield


EQUAL = [
    ("10", "10.0"),
    ("10.0", "10"),
    (r"\frac{5}{2}", "2.5"),
    ("2.5", r"\frac{5}{2}"),
    ("5/2", r"\frac{5}{2}"),
    ("5/2", "2.5"),
    (r"\dfrac{5}{2}", "2.5"),
    (r"\tfrac{5}{2}", "5/2"),
    ("6.5", r"\frac{13}{2}"),
    (r"8\sqrt{3}", r"8 \sqrt 3"),
    (r"8\sqrt3", r"8\sqrt{3}"),
    (r"\sqrt{192}", r"8\sqrt{3}"),
    (r"\frac{24}{\sqrt{3}}", r"8\sqrt{3}"),
    (r"2\sqrt{3}", r"\sqrt{12}"),
    (r"\frac{\sqrt{3}}{2}", r"\frac{1}{2}\sqrt{3}"),
    (r"4\pi", r"4 \pi"),
    (r"60^\circ", "60"),
    ("60", r"60^{\circ}"),
    ("60°", "60"),
    (r"60 ^ {\circ}", r"60^\circ"),
    ("x = 5", "5"),
    ("x=5", "x = 5"),
    (r"m\angle ABC = 60^\circ", "60"),
    (r"m \angle 1 = 120", "120"),
    ("y_1 = 4", "4"),
    ("AB = 2 + 3 = 5", "5"),
    ("3 + 2 = 5", "5"),
    (r"x \approx 13.86", "13.86"),
    ("$12$", "12"),
    (r"\(12\)", "12"),
    (r"12 \text{ cm}", "12"),
    ("12 cm", "12"),
    ("12cm", "12"),
    (r"5\text{ units}^2", "5"),
    (r"12 \mathrm{cm}^{2}", "12"),
    (r"12\text{\textbf{ cm}}", "12"),
    ("\u22123", "-3"),
    ("12 square units", "12"),
    (r"\text{12}", "12"),
    (r"60 \text{ degrees}", "60"),
    ("1,000", "1000"),
    ("-12,345.5", "-12345.5"),
    ("-3", "-3"),
    (r"-\frac{1}{2}", "-0.5"),
    (".5", "0.5"),
    ("5.", "5"),
    (r"\boxed{7}", "7"),
    (r"\displaystyle \left( 3 \right)", "3"),
    (12, "12"),
    (2.5, r"\frac{5}{2}"),
    ("270", "270"),
]

DIFFERENT = [
    (r"2\sqrt{3}", r"3\sqrt{2}"),
    ("10", "100"),
    ("100", "10"),
    ("1.2", "12"),
    ("12", "13"),
    ("-5", "5"),
    (r"\frac{5}{2}", r"\frac{2}{5}"),
    (r"60^\circ", "120"),
    ("", "5"),
    ("   ", "5"),
    (r"\text{}", "5"),
    (r"\text{ }", "5"),
    ("$$", "5"),
    ("5", ""),
    (None, "5"),
    (True, "1"),
    ("(1,2)", "12"),
    ("1,2", "12"),
    ("(1,2)", "(12)"),
    (r"4\pi", "12.566"),
    (r"\sqrt{192}", "13.8564"),
    (r"\frac{1}{3}", "0.333333"),
    ("5x", "5"),
    ("x", "5"),
    ("A", "12"),
    ("5 = 10", "5"),
    (r"8\sqrt{3} \approx 13.86", "13.86"),
    (r"\boxed{5", "5"),
    ("0", "0.001"),
    (r"\frac{1}{0}", "5"),
]


@pytest.mark.parametrize("answer,label", EQUAL)
def test_equal_answers(answer, label):
    assert grade_answer(answer, label) is True


@pytest.mark.parametrize("answer,label", DIFFERENT)
def test_different_answers(answer, label):
    assert grade_answer(answer, label) is False


TOLERANCE = [  # (answer, label, correct at rel_tol 0, correct at rel_tol 0.05)
    (r"4\pi", "12.566", False, True),
    (r"\sqrt{192}", "13.8564", False, True),
    ("13.86", r"8\sqrt{3}", False, True),
    (r"x = 12.6", r"4\pi", False, True),
    ("6.4", "6.5", False, True),
    ("7", "6.5", False, False),
    ("0.01", "0", False, False),
    (r"2\sqrt{3}", r"3\sqrt{2}", False, False),
    ("6.5", r"\frac{13}{2}", True, True),
]


@pytest.mark.parametrize("answer,label,exact,loose", TOLERANCE)
def test_relative_tolerance(answer, label, exact, loose):
    assert grade_answer(answer, label) is exact
    assert grade_answer(answer, label, rel_tol=0.05) is loose


def test_bad_arguments_raise():
    with pytest.raises(ValueError):
        grade_answer("1", "1", rel_tol=-0.1)
    for bad in (0, -1, float("inf"), float("nan")):
        with pytest.raises(ValueError):
            grade_answer("1", "1", timeout_s=bad)


@pytest.mark.parametrize("text,boxed", [
    (r"The answer is \boxed{5}.", "5"),
    (r"\boxed{\frac{5}{2}}", r"\frac{5}{2}"),
    (r"\boxed{a^{2}+b^{2}}", r"a^{2}+b^{2}"),
    (r"first \boxed{1}, then \boxed{2}", "2"),
    (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),
    (r"\fbox{7}", "7"),
    (r"\boxed {  8 }", "8"),
    (r"\boxed 5 is it", "5"),
    (r"\boxed{}", ""),
    (r"\boxed{3} and \boxed{4", None),
    (r"\boxed{\frac{5}{2}", None),
    ("no box here: 5", None),
    (r"\boxedx{3}", None),
    ("ends with \\boxed", None),
])
def test_extract_last_boxed(text, boxed):
    assert extract_last_boxed(text) == boxed


@pytest.mark.parametrize("response,label,expected", [
    (r"so x is \boxed{\frac{5}{2}}", "2.5", 1.0),
    (r"\boxed{3} ... on reflection \boxed{4}", "4", 1.0),
    (r"\boxed{3} ... on reflection \boxed{4}", "3", 0.0),
    (r"\boxed{12 \text{ cm}}", "12", 1.0),
    (r"\boxed{\sqrt{192}}", r"8\sqrt{3}", 1.0),
    ("the answer is 5", "5", 0.0),
    (r"\boxed{}", "5", 0.0),
    (r"\boxed{\text{}}", "5", 0.0),
])
def test_math_reward_is_binary(response, label, expected):
    r = math_reward(response, label)
    assert type(r) is float and r == expected


def test_normalize_answer():
    assert normalize_answer(r"$m\angle ABC = 60^{\circ}$") == "60"
    assert normalize_answer(r"5\text{ units}^2") == "5"
    assert normalize_answer(r"\dfrac 5 2") == r"\frac{5}{2}"
    assert normalize_answer("(1,2)") == "(1,2)"
    assert normalize_answer("1,000") == "1000"


def test_fast_path_needs_no_process():
    v = verify_answer("10", "10.0")
    assert v == Verdict(True, "fast")
    assert verify_answer(r"\frac{5}{2}", "2.6").path == "fast"
    assert verify_answer(r"\sqrt{4}", "2") == Verdict(True, "slow")


@pytest.mark.slow
def test_exponent_tower_times_out_from_worker_threads():
    before = STATS.snapshot()
    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=2) as pool:
        boxed = pool.submit(math_reward, rf"\boxed{{{TOWER}}}", "5", timeout_s=2.0)
        bare = pool.submit(verify_answer, TOWER, "5", timeout_s=2.0)
        assert boxed.result() == 0.0
        verdict = bare.result()
    elapsed = time.monotonic() - start
    assert verdict.correct is False and verdict.timed_out
    assert elapsed < 2.0 + 10.0
    after = STATS.snapshot()
    assert after["timeouts"] - before["timeouts"] >= 2
    assert after["calls"] - before["calls"] == 2
    # the pool recovers: killed workers were replaced
    assert grade_answer(r"\sqrt{12}", r"2\sqrt{3}", timeout_s=30) is True


def test_concurrent_calls_from_eight_threads():
    cases = [(a, g, True) for a, g in EQUAL[:12]] + [(a, g, False) for a, g in DIFFERENT[:4]]
    jobs = (cases * 2)[:32]
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda c: grade_answer(c[0], c[1], timeout_s=30), jobs))
    assert results == [c[2] for c in jobs]


@pytest.mark.parametrize("template", [
    "__import__('os').system('touch PATH')",
    "1 + __import__('os').system('touch PATH')",
    "(lambda: __import__('os').system('touch PATH'))()",
    "exec(\"open('PATH', 'w')\")",
    r"\text{__import__('os').system('touch PATH')}",
    r"\frac{__import__('os').system('touch PATH')}{2}",
])
def test_model_text_is_never_executed(tmp_path, template):
    target = tmp_path / "pwned"
    payload = template.replace("PATH", str(target))
    assert grade_answer(payload, "5") is False
    assert grade_answer("5", payload) is False
    assert math_reward(r"\boxed{" + payload + "}", "5") == 0.0
    assert math_reward('\\boxed{__import__("os").system("touch ' + str(target) + '")}', "0") == 0.0
    assert not target.exists()


def test_megabyte_inputs_are_rejected():
    big = "1" * 1_000_000
    assert verify_answer(big, "1") == Verdict(False, "rejected")
    assert math_reward(r"\boxed{" + big + "}", "1") == 0.0
    assert math_reward("{" * 1_000_000, "1") == 0.0
    assert math_reward(r"\boxed{" + "{" * 1_000_000, "1") == 0.0
    assert math_reward("x" * 1_000_000 + r"\boxed{5}", "5") == 1.0


def test_stats_snapshot_and_reset():
    stats = grader.RewardStats()
    stats.record(Verdict(True, "fast"))
    stats.record(Verdict(False, "slow", timed_out=True))
    stats.record(Verdict(False, "slow", error="worker failed: EOFError"))
    snap = stats.snapshot()
    assert snap == {"calls": 3, "fast": 1, "slow": 2, "rejected": 0, "correct": 1,
                    "timeouts": 1, "errors": 1}
    stats.reset()
    assert set(stats.snapshot().values()) == {0}


def test_import_is_cheap():
    code = ("import sys, common.grader as r; "
            "bad = {'sympy', 'math_verify', 'torch', 'jax', 'flax', 'optax', 'orbax'} & "
            "set(m.split('.')[0] for m in sys.modules); "
            "assert not bad, bad; assert r._POOL is None")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=grader._ROOT, timeout=60)


@pytest.mark.parametrize("answer", ["25\\%", "25%", "25 \\%", "25 percent"])
def test_a_percentage_is_its_number_of_percent(answer):
    """math-verify takes `25\\%` for 25 AND for 0.25; here percent is a unit, so an environment
    step (the path training grades through) accepts it for the label 25 only."""
    from common.env import Geo3kEnv
    call = '<tool_call>{"name": "calc_score", "arguments": {"answer": "%s"}}</tool_call>'
    assert grade_answer(answer, "25") and not grade_answer(answer, "0.25")
    assert not grade_answer("0.25", answer) and grade_answer(answer, "25\\%")
    for label, ok in (("25", True), ("0.25", False)):
        info = Geo3kEnv(label).step(call % answer.replace("\\", "\\\\"))[2]
        assert info["correct"] is ok, label
