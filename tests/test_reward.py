"""Answer grading: Geometry3K answer shapes, tolerance, boxed extraction, hard time limits from
threads, concurrency, and model text that is never executed."""

import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from common.reward import STATS, extract_last_boxed, grade_answer, math_reward

EQUAL = [
    ("10", "10"), ("10.0", "10"), ("10", "10.00"), ("2.5", "\\frac{5}{2}"), ("5/2", "2.5"),
    ("\\frac{5}{2}", "\\dfrac{5}{2}"), ("\\tfrac{1}{2}", "0.5"), (".5", "0.5"),
    ("8\\sqrt{3}", "8\\sqrt{3}"), ("8 \\sqrt 3", "8\\sqrt{3}"), ("\\sqrt{192}", "8\\sqrt{3}"),
    ("60^\\circ", "60"), ("60^{\\circ}", "60"), ("60°", "60"), ("x = 5", "5"), ("x=5", "5"),
    ("$12$", "12"), ("12 \\text{ cm}", "12"), ("12 cm", "12"), ("12\\mathrm{ft}", "12"),
    ("5\\text{ units}^2", "5"), ("36 units^2", "36"), ("1,000", "1000"), ("-3", "-3.0"),
    ("12.", "12"), ("\\frac{\\sqrt{3}}{2}", "\\frac{\\sqrt{3}}{2}"), ("4\\pi", "4\\pi"),
    ("2\\sqrt{2}", "\\sqrt{8}"), ("x^2+1", "1+x^2"), ("\\frac{10}{4}", "2.5"),
    ("m \\angle 3 = 70", "70"),
]
DIFFERENT = [
    ("2\\sqrt{3}", "3\\sqrt{2}"), ("10", "100"), ("", "5"), ("   ", "5"), ("\\text{}", "5"),
    ("4\\pi", "12.566"), ("13.86", "8\\sqrt{3}"), ("(1,2)", "12"), ("5", "-5"),
    ("\\frac{5}{2}", "\\frac{2}{5}"), ("70", "110"), ("\\sqrt{3}", "3"), ("12 cm", "13"),
    ("None", "5"), ("x", "5"),
]


@pytest.mark.parametrize("answer,truth", EQUAL)
def test_equivalent_answers(answer, truth):
    assert grade_answer(answer, truth) is True


@pytest.mark.parametrize("answer,truth", DIFFERENT)
def test_different_answers(answer, truth):
    assert grade_answer(answer, truth) is False


def test_case_count():
    assert len(EQUAL) + len(DIFFERENT) >= 40


@pytest.mark.parametrize("answer,truth,tol,expected", [
    ("13.86", "8\\sqrt{3}", 0.01, True), ("12.566", "4\\pi", 0.001, True),
    ("12.6", "12.566", 0.05, True), ("14", "12", 0.05, False), ("13.9", "8\\sqrt{3}", 0.0, False),
    ("0.87", "\\frac{\\sqrt{3}}{2}", 0.01, True),
])
def test_relative_tolerance(answer, truth, tol, expected):
    assert grade_answer(answer, truth, rel_tol=tol) is expected


@pytest.mark.parametrize("text,boxed", [
    ("so \\boxed{12}", "12"), ("\\boxed{1} then \\boxed{\\frac{5}{2}}", "\\frac{5}{2}"),
    ("\\boxed{\\frac{\\sqrt{3}}{2}} ok", "\\frac{\\sqrt{3}}{2}"), ("\\fbox{7}", "7"),
    ("\\boxed 5.", "5."), ("no box", None), ("\\boxed{12", None), ("\\boxed", None),
])
def test_extract_last_boxed(text, boxed):
    assert extract_last_boxed(text) == boxed


def test_math_reward_is_binary_and_reads_the_last_box():
    assert math_reward("first \\boxed{3} then \\boxed{8\\sqrt{3}}", "\\sqrt{192}") == 1.0
    assert math_reward("\\boxed{8\\sqrt{3}} no wait \\boxed{3}", "\\sqrt{192}") == 0.0
    assert math_reward("12", "12") == 0.0  # no box, no reward
    assert isinstance(math_reward("\\boxed{12}", "12"), float)


def test_exponent_tower_times_out_from_a_worker_thread():
    before = STATS.snapshot()["timeouts"]
    start = time.monotonic()
    with ThreadPoolExecutor(2) as ex:
        results = list(ex.map(lambda _: math_reward("\\boxed{9^{9^{9^{9}}}}", "5",
                                                    timeout_s=2.0), range(2)))
        answer = ex.submit(grade_answer, "9^{9^{9^{9}}}", "5", timeout_s=2.0).result()
    elapsed = time.monotonic() - start
    assert results == [0.0, 0.0] and answer is False
    assert elapsed < 2.0 * 2 + 10
    assert STATS.snapshot()["timeouts"] >= before + 1
    assert grade_answer("x^2+1", "1+x^2")  # a fresh worker answers after the kill


def test_many_threads_at_once():
    with ThreadPoolExecutor(8) as ex:
        got = list(ex.map(lambda i: grade_answer(f"y + \\frac{{{i}}}{{7}}",
                                                 f"\\frac{{{i}}}{{7}} + y"), range(32)))
    assert got == [True] * 32


def test_model_text_is_never_executed(tmp_path):
    marker = tmp_path / "pwned"
    payloads = [f"__import__('os').system('touch {marker}')",
                f"\\boxed{{__import__(\"os\").system(\"touch {marker}\")}}",
                f"exec(\"open('{marker}', 'w')\")", f"eval('open(\"{marker}\", \"w\")')",
                f"(lambda: __import__('os').system('touch {marker}'))()"]
    for p in payloads:
        assert grade_answer(p, "5") is False
        assert math_reward(f"\\boxed{{{p}}}", "5") == 0.0
        assert grade_answer("5", p) is False
    assert not marker.exists() and not os.path.exists(marker)


def test_huge_and_hostile_inputs_are_wrong_fast():
    assert grade_answer("9" * 1_000_000, "9") is False
    assert math_reward("\\boxed{" * 100_000, "5") == 0.0
    assert math_reward("x" * 5_000_000 + "\\boxed{5}", "5") == 1.0
    assert grade_answer("1\x00\x1b[2J", "1") is False
    assert grade_answer(None, "1") is False and grade_answer("1", None) is False
