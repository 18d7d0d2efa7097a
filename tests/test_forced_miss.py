"""An evaluation that can tell whether retries read the figure (issue 65, item 1): the forced
miss through the environment's own step, its exact figure-blind line, the own-miss lookup lines,
the episode file and the report's rows, with literal numbers."""

import collections
import json

import numpy as np
import pytest

from common.env import FEEDBACK, WRONG, EnvConfig, fill_feedback
from common.evaluation.baselines import Problem
from common.evaluation.evaluate import evaluate
from common.evaluation.report import markdown, write_report
from common.evaluation.retry import (NONE, best_retry_solved, call_text, forced_position,
                                     reply_ids, stderr)
from common.rollout import RolloutConfig, rollout
from tests.conftest import TURN_END, CharRenderer, Reply, ScriptedEngine
from tests.test_evaluate import call
from tests.test_evaluation_lines import SIDES, prompt


class Tokenizer:
    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


class ChatLike(CharRenderer):
    """The character renderer with what `reply_ids` reads of a `ChatRenderer`."""

    tokenizer = Tokenizer()
    turn_end_id = TURN_END


def sides(uid, answer):
    """A polygon-sides problem (choices 3, 4, 5, 6) answered `answer`."""
    p = prompt(uid, SIDES, ["3", "4", "5", "6"])
    p.answer = answer
    return p


def test_the_best_figure_blind_retry_is_counted_exactly():
    """4 choices, 3 turns. Forced A: answers at B three times, C twice, D once: the best retry
    tries B then C (5 of 6); a policy allowed to try A again, or given 3 retries, would get 6.
    Answers uniform over B, C, D: 2 of 3, the elimination line. With no first answer (NONE)
    the retry has 2 tries over all 4 positions: the two most common."""
    skewed = {(0, 1, 4): 3.0, (0, 2, 4): 2.0, (0, 3, 4): 1.0}
    assert best_retry_solved(skewed, 4, 3) == 5.0
    assert best_retry_solved(skewed, 4, 2) == 3.0  # one retry: B
    assert best_retry_solved({(0, q, 4): 1.0 for q in (1, 2, 3)}, 4, 3) == 2.0
    none = {(NONE, 0, 4): 2.0, (NONE, 1, 4): 1.0, (NONE, 3, 4): 1.0}
    assert best_retry_solved(none, 4, 3) == 3.0
    # two groups fitted apart (forced A: B; forced B: D), a free-form answer never solved
    assert best_retry_solved({(0, 1, 4): 2.0, (1, 3, 4): 1.0, (1, NONE, 0): 4.0}, 4, 2) == 3.0
    # a problem of 3 choices lacks D: the order A, D, B, C tries B there on turn 2 and D on
    # the other (answers B of 3, D of 4): both, where counting D as a try would solve one
    assert best_retry_solved({(0, 1, 3): 1.0, (0, 3, 4): 1.0}, 4, 2) == 2.0
    assert stderr(0.75, 4) == pytest.approx(np.sqrt(0.75 * 0.25 / 4)) and stderr(0.5, 0) == 0


def test_forced_answers_are_uniform_wrong_choices_drawn_from_the_uid():
    problems = [Problem(f"u{i}", SIDES, str(3 + i % 4), ("3", "4", "5", "6"))
                for i in range(3000)]
    drawn = [forced_position(p, 0) for p in problems]
    assert all(f != i % 4 for i, f in enumerate(drawn))  # never the answer
    counts = collections.Counter(drawn)  # 750 each, +- 24 (one standard deviation)
    assert sorted(counts) == [0, 1, 2, 3] and all(650 < c < 850 for c in counts.values())
    assert [forced_position(p, 0) for p in problems[:50]] == drawn[:50]  # no hidden state
    assert [forced_position(p, 1) for p in problems[:50]] != drawn[:50]  # the seed matters
    assert forced_position(Problem("f", SIDES, "3", None), 0) is None


def test_the_forced_turn_is_the_environments_feedback_and_the_model_goes_on():
    """The forced call answers 5 (wrong; the answer is 4): the environment scores it and its
    own "Wrong" feedback follows in the ids the engine sees on turn 2; the model's turn 2
    answers 4. The forced turn is marked, with loss mask 0; only turn 2 is generated."""
    renderer = ChatLike()
    p = sides("s0", "4")
    ids = reply_ids(renderer, call_text("5"))
    engine = ScriptedEngine({"0-0": [Reply(call("4"))]})
    (t,) = rollout([p], engine, renderer, RolloutConfig(n_samples=1, temperature=0.0),
                   EnvConfig(max_turns=3), first_turns=[ids])
    (req,) = engine.requests  # one generation: turn 2
    shown = renderer.decode(req.input_ids)
    feedback, _ = fill_feedback(FEEDBACK[WRONG], answer="5")
    assert shown.endswith(call_text("5") + "|T:" + feedback + "|A:")
    first, second = t.turns
    assert first.forced and not second.forced
    assert first.info["reason"] == WRONG and first.info["answer"] == "5"
    assert t.loss_mask[first.start:first.end].sum() == 0
    assert t.loss_mask[second.start:second.end].all()
    assert t.correct and t.correct_turn == 2


# Four polygon problems (choices 3, 4, 5, 6). Seed 0 forces 5 on s0 and s1, 6 on s2 and s3.
#   greedy:  s0 4 (right) | s1 3, 6 | s2 3 (right) | s3 3, 4, 5
#   forced:  s0 5*, 4     | s1 5*, 5 (repeated), 3 | s2 6*, 3 | s3 6*, 4, 5
SCRIPT = {"0-0": [Reply(call("4")), Reply(call("4"))],
          "1-0": [Reply(call("3")), Reply(call("6")), Reply(call("5")), Reply(call("3"))],
          "2-0": [Reply(call("3")), Reply(call("3"))],
          "3-0": [Reply(call("3")), Reply(call("4")), Reply(call("5")), Reply(call("4")),
                  Reply(call("5"))]}


def four_sides():
    return [sides("s0", "4"), sides("s1", "6"), sides("s2", "3"), sides("s3", "5")]


@pytest.fixture
def forced_run(tmp_path):
    assert [forced_position(Problem.of(p), 0) for p in four_sides()] == [2, 2, 3, 3]
    engine = ScriptedEngine(SCRIPT)
    path = tmp_path / "eval" / "episodes.jsonl"
    m = evaluate(four_sides(), engine, ChatLike(), RolloutConfig(), EnvConfig(max_turns=3),
                 n_samples=0, forced_miss=True, seed=0, episodes=path)
    assert all(not v for v in engine.script.values())
    return m, path


def test_forced_miss_recovery_beside_its_blind_line(forced_run):
    """Recovered after the forced miss: s0, s2 (turn 2) and s3 (turn 3): 3 of 4, ± sqrt(3/64).
    The blind line: forced 5 -> answers 4 and 6, forced 6 -> answers 3 and 5: one order each
    solves both within two retries: 1. Blind elimination: 2/3. Turn-2 answers per forced
    answer: 4, 5 and 3, 4: half equal their group's most common."""
    m, _ = forced_run
    assert m["forced/greedy_recovery"] == 0.75
    assert m["forced/greedy_recovery_se"] == pytest.approx(np.sqrt(3 / 64))
    assert m["forced/greedy_problems"] == 4.0
    assert m["forced/greedy_blind_retry_line"] == 1.0
    assert m["forced/greedy_elimination_line"] == pytest.approx(2 / 3)
    assert m["forced/greedy_repeat_after_miss"] == pytest.approx(1 / 6)  # s1's 5 of 6 answers
    assert m["forced/greedy_retry_lookup_share"] == 0.5
    # the model's turns only: no turn 1 (forced), turn 2 all four, turn 3 s1 and s3
    assert "forced/greedy_turn_1_turns" not in m
    assert m["forced/greedy_turn_2_turns"] == 4 and m["forced/greedy_turn_2_repeat_rate"] == 0.25
    assert m["forced/greedy_turn_3_turns"] == 2 and m["forced/greedy_turn_3_repeat_rate"] == 0
    # beside own-miss recovery: s1 and s3 missed with 3 (A), then answered 6 and 4; one order
    # (A, then D, C) solves both; half the turn-2 answers equal the group's most common one
    assert m["greedy_recovery_after_miss"] == 1.0
    assert m["greedy_recovery_after_miss_se"] == 0.0
    assert m["greedy_recovery_blind_retry_line"] == 1.0
    assert m["greedy_retry_lookup_share"] == 0.5
    assert m["greedy_first_try_accuracy_se"] == pytest.approx(np.sqrt(0.25 / 4))


def test_every_episode_is_written_with_its_turns(forced_run):
    _, path = forced_run
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert [(r["mode"], r["uid"]) for r in rows] == [
        (mode, f"s{i}") for mode in ("greedy", "forced") for i in range(4)]
    s1 = rows[5]
    assert {k: s1[k] for k in ("uid", "kind", "choices", "answer", "mode", "correct",
                               "correct_turn")} == {
        "uid": "s1", "kind": "polygon_sides", "choices": ["3", "4", "5", "6"], "answer": "6",
        "mode": "forced", "correct": False, "correct_turn": None}
    assert s1["turns"] == [
        {"answer": "5", "score": 0.0, "reason": "wrong", "tool_call": True, "valid": True,
         "forced": True},
        {"answer": "5", "score": 0.0, "reason": "repeated", "tool_call": True, "valid": True,
         "forced": False},
        {"answer": "3", "score": 0.0, "reason": "wrong", "tool_call": True, "valid": True,
         "forced": False}]
    assert [t["answer"] for t in rows[3]["turns"]] == ["3", "4", "5"]
    assert rows[3]["correct_turn"] == 3 and rows[3]["turns"][0]["forced"] is False
    # the forced recovery is recomputed from the file alone
    forced = [r for r in rows if r["mode"] == "forced"]
    assert sum(r["correct"] for r in forced) / len(forced) == 0.75


def test_the_report_shows_the_forced_miss_and_the_lookup(forced_run, tmp_path):
    m, _ = forced_run
    table = markdown(m, 3, "forced")
    assert ("| all problems | 4 | 0.750 ± 0.217 | 1.000 | 0.667 | 0.167 | 0.500 |") in table
    assert "| recovery after a first-try miss | 1.000 ± 0.000 |" in table
    assert "| best figure-blind retry after a miss | 1.000 |" in table
    assert "| turn-2 answers equal to their group's most common | 0.500 |" in table
    assert "| turn | greedy tool calls | greedy valid answers | greedy repeats | forced miss " \
           "tool calls | forced miss valid answers | forced miss repeats |" in table
    assert "| 2 | 1.000 | 1.000 | 0.000 | 1.000 | 1.000 | 0.250 |" in table
    out = write_report(m, tmp_path / "report", "forced", 3)
    saved = json.loads((out / "eval.json").read_text())
    assert saved["forced/greedy_recovery"] == 0.75
    assert saved["forced/greedy_recovery_se"] == pytest.approx(0.2165, abs=1e-4)
    assert (out / "eval.md").read_text() == table


def test_the_loops_evaluation_runs_the_forced_miss_and_writes_its_episodes(tmp_path):
    """`common.train.evaluate_split` (the loop's eval/* and the CLI) with eval.forced_miss and
    an episode path: forced/* keys and the file; off by default (no forced keys)."""
    from common.data import Geo3kSplit
    from common.train import eval_episodes, evaluate_split
    from configs import base, cpu_perception

    cfg = base.get_config()
    assert cfg.eval.forced_miss is False and cpu_perception.get_config().eval.forced_miss
    cfg.eval.n_samples, cfg.eval.max_prompts, cfg.seed = 0, 0, 0
    split = Geo3kSplit(four_sides(), collections.Counter(), rows=[0, 1, 2, 3])
    path = eval_episodes(tmp_path, 20)
    assert path == tmp_path / "eval" / "episodes_step_20.jsonl"
    greedy = {"0-0": 1, "1-0": 2, "2-0": 1, "3-0": 3}  # each episode's greedy replies
    m = evaluate_split(cfg, split, ScriptedEngine({k: SCRIPT[k][:n] for k, n in greedy.items()}),
                       ChatLike(), episodes=path)
    assert not [k for k in m if k.startswith("forced/")]
    assert len(path.read_text().splitlines()) == 4
    cfg.eval.forced_miss = True
    m = evaluate_split(cfg, split, ScriptedEngine(SCRIPT), ChatLike(), episodes=path)
    assert m["forced/greedy_recovery"] == 0.75
    assert len(path.read_text().splitlines()) == 8


def test_training_groups_start_from_a_forced_miss_at_the_configured_share():
    """train.forced_miss_fraction: about that share of a step's prompts get a forced wrong first
    call, the same for every episode of the group (never the answer; loss-masked, so only the
    retries train), drawn anew each step from seed and step; 0 forces nothing; a problem
    without choices never gets one."""
    from common.evaluation.retry import forced_first_turns
    from common.reward import RewardConfig
    from common.step import StepConfig, collect

    renderer = ChatLike()
    prompts = [sides(f"t{i}", str(3 + i % 4)) for i in range(400)]
    turns = forced_first_turns(prompts, renderer, 0.5, seed=0, step=0)
    chosen = [i for i, t in enumerate(turns) if t is not None]
    assert 160 < len(chosen) < 240  # 200 +- 10 (one standard deviation)
    for i in chosen:
        assert renderer.decode(turns[i]) != renderer.decode(reply_ids(renderer, call_text(
            prompts[i].answer)))
    again = forced_first_turns(prompts, renderer, 0.5, seed=0, step=0)
    assert again == turns and forced_first_turns(prompts, renderer, 0.5, seed=0, step=1) != turns
    assert forced_first_turns(prompts, renderer, 0.0, seed=0, step=0) is None
    free = prompt("f", SIDES, None)  # no choices: nothing to force
    assert forced_first_turns([free], renderer, 1.0, seed=0, step=0) is None

    cfg = StepConfig(RolloutConfig(n_samples=2, temperature=0.0), EnvConfig(max_turns=3),
                     RewardConfig(), forced_miss_fraction=1.0, seed=0)
    two = four_sides()[:2]
    engine = ScriptedEngine({f"{g}-{k}": [Reply(call("3")), Reply(call("4"))]
                             for g in range(2) for k in range(2)})
    trajs, metrics = collect(two, engine, renderer, cfg, group_offset=0)
    assert metrics["forced_groups"] == 2.0
    for t in trajs:
        first = t.turns[0]
        assert first.forced and t.loss_mask[first.start:first.end].sum() == 0
        assert first.info["answer"] != t.answer  # a wrong choice, the group's one
    assert len({t.turns[0].info["answer"] for t in trajs if t.group_id == 0}) == 1
