"""The evaluation's reading lines (issue 48, item 1), pinned with literal numbers: recovery after
a first-try miss and its blind lines, elimination after the run's own first try, the blind
baselines fitted on the evaluated problems (constant answer, best and worst fixed order of answer
positions), accuracy by answer position, and the greedy run on blank images."""

import collections
import types

import numpy as np
import pytest
from PIL import Image

from common.env import EnvConfig
from common.evaluation.baselines import (Problem, after_miss, answer_position, baselines,
                                         order_hits)
from common.evaluation.evaluate import evaluate
from common.evaluation.report import markdown, write_report
from common.rollout import RolloutConfig
from tests.conftest import ScriptedEngine, make_prompt
from tests.test_evaluate import A, R, W, call  # noqa: F401 (R answers 12, W answers 7)

SIDES = "<image>How many sides does the polygon have?"  # the perception family polygon_sides
FIND_X = "<image>Find x."  # geometry


def prompt(uid, problem, choices, images=("img0",)):
    return types.SimpleNamespace(uid=uid, answer="12", messages=make_prompt(uid=uid).messages,
                                 images=list(images), choices=choices, problem=problem)


def four_prompts():
    """Every label is 12. p0: perception, 12 at A of 4; p1: geometry, 12 at B of 4; p2:
    geometry, 12 at C of 3; p3: geometry, free-form."""
    return [prompt("p0", SIDES, ["12", "7", "3", "5"]),
            prompt("p1", FIND_X, ["7", "12", "3", "5"]),
            prompt("p2", FIND_X, ["7", "3", "12"]),
            prompt("p3", FIND_X, None)]


# Session "g-0" serves the greedy episode first, then the first sampled one.
#   greedy:  p0 solved on turn 1, p1 on turn 2, p2 never (3 wrong), p3 (free-form) on turn 2
#   sampled: p0 aborted | turn 2;  p1 turn 1 | turn 1;  p2 turn 1 | turn 3;  p3 never | turn 1
SCRIPT = {"0-0": [R, A, A, A], "0-1": [W, R],
          "1-0": [W, R, R], "1-1": [R],
          "2-0": [W, W, W, R], "2-1": [W, W, R],
          "3-0": [W, R, W, W, W], "3-1": [R]}


@pytest.fixture
def metrics(renderer):
    engine = ScriptedEngine(SCRIPT)
    m = evaluate(four_prompts(), engine, renderer, RolloutConfig(n_samples=8),
                 EnvConfig(max_turns=3), n_samples=2)
    assert all(not v for v in engine.script.values())  # every scripted reply was used
    return m


def test_recovery_after_a_miss_and_its_blind_lines(metrics):
    """Greedy missed turn 1 on p1, p2, p3 and solved p1 and p3 later: recovery 2/3. A blind
    eliminator would recover min(2, 3)/3 of p1, min(2, 2)/2 of p2, nothing of free-form p3;
    a uniform re-guesser 1 - (3/4)^2 and 1 - (2/3)^2."""
    m = metrics
    assert m["greedy_first_try_accuracy"] == pytest.approx(1 / 4)
    assert m["greedy_accuracy"] == pytest.approx(3 / 4)
    assert m["greedy_recovery_after_miss"] == pytest.approx(2 / 3)
    assert m["greedy_recovery_elimination_line"] == pytest.approx((2 / 3 + 1 + 0) / 3)
    assert m["greedy_recovery_uniform_line"] == pytest.approx((7 / 16 + 5 / 9 + 0) / 3)
    # sampled: missed p0 (aborted: a failure), p0, p2, p3; recovered p0 and p2
    assert m["sampled_first_try_accuracy"] == pytest.approx(4 / 8)
    assert m["sampled_recovery_after_miss"] == pytest.approx(2 / 4)
    assert m["sampled_recovery_elimination_line"] == pytest.approx((2 / 3 + 2 / 3 + 1 + 0) / 4)
    assert m["sampled_recovery_uniform_line"] == pytest.approx(
        (7 / 16 + 7 / 16 + 5 / 9 + 0) / 4)
    # per kind: the perception problem's greedy episode never missed, so no recovery there
    assert "perception/greedy_recovery_after_miss" not in m
    assert "polygon_sides/greedy_recovery_elimination_line" not in m
    assert m["geometry/greedy_recovery_after_miss"] == pytest.approx(2 / 3)
    assert m["geometry/greedy_recovery_elimination_line"] == pytest.approx(5 / 9)
    assert m["perception/sampled_recovery_after_miss"] == pytest.approx(1 / 2)
    assert m["perception/sampled_recovery_elimination_line"] == pytest.approx(2 / 3)
    assert m["perception/sampled_recovery_uniform_line"] == pytest.approx(0.4375)


def test_conditional_line_is_elimination_after_the_runs_own_first_try(metrics):
    """Mean over episodes of [solved on turn 1] + [not] * min(T-1, c-1)/(c-1), free-form 0."""
    m = metrics
    assert m["greedy_conditional_line"] == pytest.approx((1 + 2 / 3 + 1 + 0) / 4)
    assert m["sampled_conditional_line"] == pytest.approx((2 / 3 + 2 / 3 + 1 + 1 + 1 + 1 + 0 + 1)
                                                          / 8)
    assert m["perception/greedy_conditional_line"] == 1.0
    assert m["geometry/greedy_conditional_line"] == pytest.approx((2 / 3 + 1 + 0) / 3)
    # the identity of the docstring: first try + misses x the elimination line
    for mode in ("greedy", "sampled"):
        first = m[f"{mode}_first_try_accuracy"]
        assert m[f"{mode}_conditional_line"] == pytest.approx(
            first + (1 - first) * m[f"{mode}_recovery_elimination_line"])


def test_accuracy_by_answer_position(metrics):
    """p0's answer is choice A, p1's B, p2's C; no problem's is D (free-form p3 has none)."""
    m = metrics
    assert [m[f"count_at_{p}"] for p in "ABCD"] == [1, 1, 1, 0]
    assert [m[f"greedy_first_try_accuracy_at_{p}"] for p in "ABC"] == [1, 0, 0]
    assert [m[f"greedy_accuracy_at_{p}"] for p in "ABC"] == [1, 1, 0]
    assert [m[f"sampled_first_try_accuracy_at_{p}"] for p in "ABC"] == [0, 1, 0.5]
    assert [m[f"sampled_accuracy_at_{p}"] for p in "ABC"] == [0.5, 1, 1]
    assert "greedy_accuracy_at_D" not in m and "sampled_first_try_accuracy_at_D" not in m
    assert [m[f"geometry/count_at_{p}"] for p in "ABC"] == [0, 1, 1]
    assert "geometry/greedy_accuracy_at_A" not in m
    assert m["geometry/sampled_first_try_accuracy_at_C"] == 0.5
    assert m["perception/count_at_A"] == 1 and m["perception/sampled_accuracy_at_A"] == 0.5


def test_report_shows_the_lines_and_tables(metrics, tmp_path):
    table = markdown(metrics, 3, "lines")
    assert "| with feedback (≤3 turns) | 0.750 ± 0.217 | 0.750 ± 0.153 | 0.875 |" in table
    assert "| elimination after own first try | 0.667 | 0.792 |  |" in table  # 2/3, 19/24
    # recovery 2 of 3 missed, ± sqrt(2/9 / 3); sampled 2 of 4, ± sqrt(1/4 / 4)
    assert "| recovery after a first-try miss | 0.667 ± 0.272 | 0.500 ± 0.250 |  |" in table
    assert "| elimination after a miss | 0.556 | 0.583 |  |" in table
    assert "| uniform re-guess after a miss | 0.331 | 0.358 |  |" in table
    # the row sits under the with-feedback accuracy it is read against
    lines = table.splitlines()
    at = lines.index("| with feedback (≤3 turns) | 0.750 ± 0.217 | 0.750 ± 0.153 | 0.875 |")
    assert lines[at + 1].startswith("| elimination after own first try |")
    assert "blind baselines on these problems:" in table
    assert "| constant answer, most common first | 1.000 | 1.000 |" in table
    assert "| best fixed order of answer positions | 0.667 | 1.000 |" in table
    assert "| worst fixed order of answer positions | 0.000 | 0.333 |" in table
    assert ("| answer at | problems | greedy first try | greedy with feedback | sampled first try "
            "| sampled with feedback |") in table
    assert "| A | 1 | 1.000 ± 0.000 | 1.000 ± 0.000 | 0.000 ± 0.000 | 0.500 ± 0.354 |" in table
    assert "| B | 1 | 0.000 ± 0.000 | 1.000 ± 0.000 | 1.000 ± 0.000 | 1.000 ± 0.000 |" in table
    assert "| C | 1 | 0.000 ± 0.000 | 0.000 ± 0.000 | 0.500 ± 0.354 | 1.000 ± 0.000 |" in table
    assert "| D | 0 |  |  |  |  |" in table
    assert "*geometry problems*" in table and "| A | 0 |  |  |  |  |" in table
    out = write_report(metrics, tmp_path, "lines", 3)
    assert (out / "eval.md").read_text() == table


def geometry(uid, answer, choices=None):
    return Problem(uid, FIND_X, answer, tuple(choices) if choices else None)


def test_blind_baselines_fitted_on_the_problems():
    """Answers at A, A, B, C (4 choices) and C (3 choices), one free-form; the value 5√2
    answers four of the six problems once written alike, T = 2 turns."""
    problems = [geometry("q0", "5\\sqrt{2}", ["5\\sqrt{2}", "1", "2", "3"]),
                geometry("q1", "5 \\sqrt{2}", ["5 \\sqrt{2}", "2", "8", "9"]),
                geometry("q2", "7", ["1", "7", "2", "3"]),
                geometry("q3", "5\\sqrt{2}", ["1", "2", "5\\sqrt{2}", "3"]),
                geometry("q4", "9", ["1", "2", "9"]),
                geometry("q5", "5\\sqrt{2}")]
    m = baselines(problems, 2)
    # constant: 5√2 first (4 of 6, "5 \sqrt{2}" counted with it), then 7 (or 9: one each)
    assert m["baseline_constant_first_try"] == pytest.approx(4 / 6)
    assert m["baseline_constant_with_feedback"] == pytest.approx(5 / 6)
    # orders of A-D over the five choice problems: A (or C) first hits 2; A, C first hits 4;
    # D first hits none on the first try (q4 lacks D and goes on to the next position);
    # D, B, A, C hits only q2 within two tries (q4 tries B, A); nothing hits none
    assert m["baseline_best_order_first_try"] == pytest.approx(2 / 5)
    assert m["baseline_best_order_with_feedback"] == pytest.approx(4 / 5)
    assert m["baseline_worst_order_first_try"] == 0.0
    assert m["baseline_worst_order_with_feedback"] == pytest.approx(1 / 5)
    assert [m[f"count_at_{p}"] for p in "ABCD"] == [2, 1, 2, 0]
    # the skipped position is what the worst order turns on: D counted as a wasted try would
    # let D, C, ... miss q4 on both tries
    first, within = order_hits(np.array([2]), np.array([3]), np.array([[3, 2, 0, 1]]), 2)
    assert first.tolist() == [[True]] and within.tolist() == [[True]]
    # no choice problems: no order baselines, no counts
    free = baselines([geometry("f0", "3"), geometry("f1", "3"), geometry("f2", "4")], 3)
    assert free["baseline_constant_first_try"] == pytest.approx(2 / 3)
    assert free["baseline_constant_with_feedback"] == 1.0
    assert not [k for k in free if "order" in k or "count_at" in k]


def test_blind_baselines_are_fitted_per_kind():
    """Polygon problems answered 3 at D, geometry ones answered 7 at A: each kind's constant
    and order are its own, so both kinds are hit every time."""
    sides = [Problem(f"s{i}", SIDES, "3", ("6", "5", "4", "3")) for i in range(3)]
    geo = [geometry(f"g{i}", "7", ["7", "1", "2", "3"]) for i in range(2)]
    m = baselines(sides + geo, 3)
    assert m["baseline_constant_first_try"] == 1.0 and m["baseline_best_order_first_try"] == 1.0
    assert m["geometry/baseline_worst_order_with_feedback"] == 0.0  # D, C, B: never A
    assert m["perception/count_at_D"] == 3 and m["geometry/count_at_A"] == 2


def test_more_than_six_positions_use_the_orders_by_count():
    problems = [geometry(f"q{i}", "x", ["x" if j == q else str(j) for j in range(7)])
                for i, q in enumerate([0, 0, 1])]
    m = baselines(problems, 2)
    assert m["baseline_best_order_first_try"] == pytest.approx(2 / 3)
    assert m["baseline_best_order_with_feedback"] == 1.0
    assert m["baseline_worst_order_first_try"] == 0.0
    assert m["baseline_worst_order_with_feedback"] == 0.0
    assert m["count_at_G"] == 0 and m["count_at_A"] == 2


def test_answer_position_and_after_miss():
    assert answer_position(Problem("u", "", "B", ("3", "4", "5", "6"))) == 1  # by letter
    assert answer_position(Problem("u", "", "b", ("d", "c", "b", "a"))) == 2  # by value first
    assert answer_position(Problem("u", "", "12", ("3", "4"))) is None
    assert answer_position(Problem("u", "", "12", None)) is None
    problems = [Problem("a", "", "1", ("1", "2", "3", "4")), Problem("b", "", "1", ("1", "2")),
                Problem("c", "", "1", None), Problem("d", "", "1", ("1",))]
    elim, uniform = after_miss(problems, 3)
    assert elim.tolist() == pytest.approx([2 / 3, 1, 0, 1])
    assert uniform.tolist() == pytest.approx([0.4375, 0.75, 0, 1])
    assert [a.tolist() for a in after_miss(problems, 1)] == [[0, 0, 0, 0], [0, 0, 0, 0]]


def test_blank_images_reach_the_engine_and_the_originals_stay(renderer, tmp_path):
    """The greedy run again with every image white, same size and mode; the engine sees the
    real images first, then only blank ones; the prompts' images are the same objects with
    the same pixels after. Here the policy solves p0 on turn 1 with the figure, and with a
    blank one only on turn 3."""
    rgb = Image.new("RGB", (40, 30), (200, 10, 10))
    gray = Image.new("L", (17, 23), 90)
    prompts = [prompt("p0", SIDES, ["12", "7", "3", "5"], [rgb, gray]),
               prompt("p1", FIND_X, ["7", "12", "3", "5"], [gray])]
    before = [[(im.mode, im.size, im.tobytes()) for im in p.images] for p in prompts]
    held = [list(p.images) for p in prompts]
    engine = ScriptedEngine({"0-0": [R, W, W, R], "1-0": [W, R, W, W, W]})
    m = evaluate(prompts, engine, renderer, RolloutConfig(n_samples=8), EnvConfig(max_turns=3),
                 n_samples=0, blank_images=True)
    assert all(not v for v in engine.script.values())
    assert m["greedy_first_try_accuracy"] == 0.5 and m["greedy_accuracy"] == 1.0
    assert m["blank/greedy_first_try_accuracy"] == 0.0
    assert m["blank/greedy_accuracy"] == 0.5
    assert m["perception/blank/greedy_accuracy"] == 1.0
    assert m["geometry/blank/greedy_accuracy"] == 0.0
    assert m["geometry/blank/greedy_first_try_accuracy"] == 0.0
    assert sorted(k for k in m if "blank/" in k and "_turn_" not in k) == sorted(
        f"{kind}blank/greedy_{key}{se}" for kind in ("", "perception/", "polygon_sides/",
                                                     "geometry/")
        for key in ("first_try_accuracy", "accuracy") for se in ("", "_se"))
    real, blank = engine.requests[:3], engine.requests[3:]  # greedy: 1 + 2 calls
    assert [im is rgb or im is gray for r in real for im in r.images] == [True] * 4
    assert len(blank) == 6  # 3 turns each
    for r in blank:
        assert all(im is not rgb and im is not gray for im in r.images)
        expected = [("RGB", (40, 30)), ("L", (17, 23))] if len(r.images) == 2 else [
            ("L", (17, 23))]
        assert [(im.mode, im.size) for im in r.images] == expected
        for im in r.images:
            assert set(np.asarray(im.convert("RGB")).reshape(-1).tolist()) == {255}  # white
    assert [[(im.mode, im.size, im.tobytes()) for im in p.images] for p in prompts] == before
    assert all(a is b for p, h in zip(prompts, held) for a, b in zip(p.images, h))
    table = markdown(m, 3, "blank")
    assert "| | greedy | blank images | no skill |" in table
    assert "| first try (turn 1) | 0.500 ± 0.354 | 0.000 ± 0.000 | 0.250 |" in table
    assert "| with feedback (≤3 turns) | 1.000 ± 0.000 | 0.500 ± 0.354 | 0.750 |" in table
    assert "| solved by turn 2 | 1.000 ± 0.000 |  | 0.500 |" in table
    # per turn with blank figures: p0 answers 7, 7 (repeated), 12; p1 7 three times
    assert m["blank/greedy_turn_2_repeat_rate"] == 1.0
    assert m["blank/greedy_turn_3_repeat_rate"] == 0.5
    assert m["blank/greedy_turn_3_valid_answer_rate"] == 1.0
    assert "| 3 |  |  |  | 1.000 | 1.000 | 0.500 |" in table
    write_report(m, tmp_path, "blank", 3)
    # off by default: no blank keys, no blank column, no extra engine calls
    engine = ScriptedEngine({"0-0": [R], "1-0": [W, R]})
    m = evaluate(prompts, engine, renderer, RolloutConfig(), EnvConfig(max_turns=3),
                 n_samples=0)
    assert not [k for k in m if "blank" in k] and "blank images" not in markdown(m, 3)


def test_the_training_loops_evaluation_runs_blank_images_when_configured(renderer):
    """`common.train.evaluate_split` (the loop's eval/* and the CLI) runs the blank-image
    greedy run exactly when eval.blank_images is on, under the same key names."""
    from common.data import Geo3kSplit
    from common.train import evaluate_split
    from configs import base

    cfg = base.get_config()
    cfg.eval.n_samples, cfg.eval.max_prompts = 0, 0
    assert cfg.eval.blank_images is False
    prompts = [prompt("p0", FIND_X, ["12", "7", "3", "5"], [Image.new("RGB", (8, 8), "black")])]
    split = Geo3kSplit(prompts, collections.Counter(), rows=[0])
    m = evaluate_split(cfg, split, ScriptedEngine({"0-0": [R]}), renderer)
    assert m["greedy_accuracy"] == 1.0 and not [k for k in m if k.startswith("blank/")]
    cfg.eval.blank_images = True
    m = evaluate_split(cfg, split, ScriptedEngine({"0-0": [R, W, R]}), renderer)
    assert m["blank/greedy_first_try_accuracy"] == 0.0 and m["blank/greedy_accuracy"] == 1.0


def test_the_share_of_later_answers_that_repeat_an_earlier_one(metrics, tmp_path):
    """Greedy gave 4 answers after a wrong one: p1's and p3's right ones, and p2's 7 twice more
    after its first 7 (the environment's "repeated"): 2 of 4 repeat. The report shows the row."""
    m = metrics
    assert m["greedy_repeat_after_miss"] == pytest.approx(2 / 4)
    # sampled: p0's second episode 1 later answer (new), p2's second 2 (a repeated 7, then 12),
    # p3's first 2 (7 twice more): 3 of 5
    assert m["sampled_repeat_after_miss"] == pytest.approx(3 / 5)
    assert m["geometry/greedy_repeat_after_miss"] == pytest.approx(2 / 4)
    assert "perception/greedy_repeat_after_miss" not in m  # p0 solved on turn 1
    assert "| later answers repeating an earlier one | 0.500 |" in markdown(m, 3)
