"""The episode reward: one answer per turn (a valid tool call's argument, else the turn's last
box), reward = max over turns of correct * discount ** (turn - 1). Hedging (a box and a tool call
with different answers) earns exactly what the per-turn rule gives; the environment's verdict
and the reward agree for every tolerance."""

import json

import pytest

from common.env import (CORRECT, MALFORMED, UNKNOWN_TOOL, EnvConfig, Geo3kEnv, REPEATED, WRONG,
                        turn_answer)
from common.reward import RewardConfig, score_episode

CHOICES = ["3", "5", "7", "9"]  # the label is 7 = choice C


def call(answer):
    return ('<tool_call>{"name": "calc_score", "arguments": {"answer": ' + json.dumps(answer)
            + '}}</tool_call>')


def episode(texts, cfg=RewardConfig(), choices=CHOICES, label="7", **env):
    """Run `texts` through the real environment (exact grader), then score them."""
    env_cfg = EnvConfig(max_turns=len(texts), end_on_no_tool_call=False, **env)
    e = Geo3kEnv(label, env_cfg, choices=choices, source=cfg.source)
    infos = []
    for t in texts:  # as the rollout does: no turn after the environment says done
        infos.append(e.step(t)[2])
        if e.done:
            break
    return score_episode(texts[:len(infos)], infos, label, cfg, e.choices, env_cfg)


@pytest.mark.parametrize("discount", [1.0, 0.5])
@pytest.mark.parametrize("choices,right,wrongs", [
    (CHOICES, "C", ["A", "B", "D"]),  # letters on a 4-choice problem
    (None, "7", ["3", "5", "9"]),  # no choices: the values themselves
])
@pytest.mark.parametrize("turns", [1, 2, 3])
def test_hedging_earns_what_the_per_turn_rule_gives(discount, choices, right, wrongs, turns):
    cfg = RewardConfig(turn_discount=discount)
    # every turn boxes the right answer and calls the tool with a wrong one: each turn's answer
    # is its tool call, so nothing is correct (the old rule scored 1.0 here)
    hedged = [f"\\boxed{{{right}}} " + call(wrongs[t]) for t in range(turns)]
    s = episode(hedged, cfg, choices)
    assert (s.reward, s.correct, s.correct_turn) == (0.0, False, None)
    # the reverse hedge: the call is right, the box wrong: correct on turn 1
    s = episode([f"\\boxed{{{wrongs[0]}}} " + call(right)], cfg, choices)
    assert (s.reward, s.correct_turn) == (1.0, 1)
    # wrong calls, then on the last turn a box alone: that box is the turn's answer
    texts = [call(wrongs[t]) for t in range(turns - 1)] + [f"so \\boxed{{{right}}}"]
    s = episode(texts, cfg, choices)
    assert (s.reward, s.correct_turn) == (discount ** (turns - 1), turns)


def test_honest_answers_still_score():
    # single turn, boxed, no tool (the single-turn recipe)
    assert episode(["x = 7, so \\boxed{7}"], RewardConfig(source="boxed")).reward == 1.0
    assert episode(["\\boxed{C}"], RewardConfig(source="boxed")).reward == 1.0  # choice letter
    # multi-turn tool answers with a discount
    s = episode([call("9"), call("5"), call("7")], RewardConfig(turn_discount=0.9))
    assert s.reward == pytest.approx(0.81) and s.correct_turn == 3
    # the last box of a turn counts, an earlier box of that turn does not
    assert episode(["\\boxed{7} no wait \\boxed{9}"]).reward == 0.0
    assert episode(["\\boxed{9} no wait \\boxed{7}"]).reward == 1.0


def test_sources_narrow_what_counts():
    texts = ["\\boxed{7} " + call("9"), call("7")]
    assert episode(texts, RewardConfig(source="tool")).correct_turn == 2
    assert episode(texts, RewardConfig(source="boxed")).correct_turn == 1  # calls ignored
    assert episode(texts, RewardConfig(source="tool_or_boxed")).correct_turn == 2
    assert episode([call("7")], RewardConfig(source="boxed")).reward == 0.0
    assert episode(["\\boxed{7}"], RewardConfig(source="tool")).reward == 0.0


def test_format_bonus_and_malformed_calls():
    cfg = RewardConfig(format_bonus=0.1)
    assert episode([call("9")], cfg).reward == pytest.approx(0.1)  # wrong but well-formed
    # a malformed call is no call: the turn's box answers
    s = episode(['<tool_call>{"name": "calc_score", "arguments": {}}</tool_call> \\boxed{7}'])
    assert (s.reward, s.correct_turn) == (1.0, 1)


@pytest.mark.parametrize("rel_tol", [0.0, 0.001, 0.01, 0.05, 0.1])
@pytest.mark.parametrize("value", ["12", "12.01", "12.3", "12.9", "13.5", "11", "x = 12.05"])
def test_environment_and_reward_agree_for_every_tolerance(rel_tol, value):
    """The same answer, once as a tool call and once as a box, graded for label 12: the
    environment's verdict on the call and the reward of the box are the same."""
    env_cfg = dict(rel_tol=rel_tol)
    by_tool = episode([call(value)], choices=None, label="12", **env_cfg)
    by_box = episode([f"\\boxed{{{value}}}"], choices=None, label="12", **env_cfg)
    assert by_tool.correct == by_box.correct
    numeric = float(value.split("=")[-1])
    assert by_tool.correct == (abs(numeric - 12) <= rel_tol * 12)


def test_turn_answer():
    wrong_call = "\\boxed{7} " + call("9")
    assert turn_answer(wrong_call, "tool_or_boxed")[1] == ("tool", "9")
    assert turn_answer(wrong_call, "boxed")[1] == ("boxed", "7")
    assert turn_answer("\\boxed{7}", "tool_or_boxed")[1] == ("boxed", "7")
    assert turn_answer("\\boxed{7}", "tool")[1] is None
    assert turn_answer("no answer", "tool_or_boxed")[1] is None


BROKEN = ['<tool_call>{"name": "calc_score", "arguments": {"answer": "7"</tool_call>',  # JSON
          '<tool_call>{"name": "grade", "arguments": {"answer": "7"}}</tool_call>']  # unknown


@pytest.mark.parametrize("broken,reason", list(zip(BROKEN, [MALFORMED, UNKNOWN_TOOL])))
def test_a_box_beside_a_broken_call_is_one_verdict_for_environment_and_reward(broken, reason):
    """A malformed or unknown tool call plus a correct box: the reward calls turn 1 correct, so
    the environment must end the episode there (before, it answered "malformed", asked again,
    and the later turns were trained with the positive advantage). With source=tool the box is
    no answer for either: the episode goes on and the reward is 0."""
    env = Geo3kEnv("7", EnvConfig(max_turns=3), choices=CHOICES)
    obs, done, info = env.step(broken + " so \\boxed{C}")
    assert done and info["reason"] == CORRECT and info["answer_kind"] == "boxed"
    s = score_episode([broken], [info], "7", RewardConfig(), env.choices)
    assert (s.reward, s.correct_turn) == (1.0, 1)
    env = Geo3kEnv("7", EnvConfig(max_turns=3), choices=CHOICES, source="tool")
    obs, done, info = env.step(broken + " so \\boxed{C}")
    assert not done and info["reason"] == reason and not info["correct"]
    s = score_episode([broken], [info], "7", RewardConfig(source="tool"), env.choices)
    assert s.reward == 0.0
    with pytest.raises(ValueError, match="reward.source"):  # built with another source
        score_episode([broken], [info], "7", RewardConfig(), env.choices)


def test_repeats_are_found_by_equivalence():
    env = Geo3kEnv("5", EnvConfig(max_turns=4))
    reasons = [env.step(call(a))[2]["reason"] for a in ("12", "12.0", "x = 12", "13")]
    assert reasons == [WRONG, REPEATED, REPEATED, WRONG]


def test_mismatched_turns_are_an_error():
    with pytest.raises(ValueError, match="turn infos"):
        score_episode(["a", "b"], [{}], "7")


def test_each_repeat_of_a_rejected_answer_costs_the_penalty():
    cfg = RewardConfig(turn_discount=0.5, repeat_penalty=0.3)
    # A, then A again (rejected, repeated), then C: solved on turn 3, one repeat
    s = episode([call("A"), call("3"), call("C")], cfg)
    assert (s.correct_turn, s.reward) == (3, pytest.approx(0.25 - 0.3))
    s = episode([call("A"), call("A"), call("A")], cfg)  # two repeats, never solved
    assert (s.correct, s.reward) == (False, pytest.approx(-0.6))
    s = episode([call("A"), call("B"), call("C")], cfg)  # no repeat: the discounted reward
    assert s.reward == pytest.approx(0.25)
    assert episode([call("A"), call("A"), call("C")]).reward == 1.0  # off by default
    for bad in (-0.1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="repeat_penalty"):
            RewardConfig(repeat_penalty=bad)


def test_a_solve_after_a_miss_earns_the_progress_bonus():
    cfg = RewardConfig(turn_discount=0.5, progress_bonus=0.4)
    assert episode([call("C")], cfg).reward == 1.0  # solved first: no progress to reward
    assert episode([call("A"), call("C")], cfg).reward == pytest.approx(0.5 + 0.4)
    assert episode([call("A"), call("B"), call("C")], cfg).reward == pytest.approx(0.25 + 0.4)
    assert episode([call("A"), call("B"), call("D")], cfg).reward == 0.0  # never solved
    assert episode([call("A"), call("C")]).reward == 1.0  # off by default
    for bad in (-0.1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="progress_bonus"):
            RewardConfig(progress_bonus=bad)
