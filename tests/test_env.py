"""The tool-calling environment: every feedback case, episode rules and hostile input."""

import json
import os
import types

import pytest

from common import env as E
from common.env import EnvConfig, Geo3kEnv, build_env, parse_tool_call


def exact(answer, truth, **_):
    """A grader that needs no math: exact string match."""
    return answer == truth


def call(answer, name="calc_score"):
    return f'<tool_call>{{"name": "{name}", "arguments": {{"answer": {json.dumps(answer)}}}}}</tool_call>'


def make(truth="12", **kw):
    return Geo3kEnv(truth, EnvConfig(**kw), grader=exact)


def test_reset_gives_empty_observation():
    env = make()
    assert env.reset() == ({}, {"turn": 0})


def test_correct_answer_ends_episode():
    env = make()
    obs, done, info = env.step("I think x = 12. " + call("12"))
    assert done and obs == {}
    assert info == {"turn": 1, "reason": "correct", "tool_score": 1.0, "parsed_answer": "12",
                    "tool_name": "calc_score", "answer_kind": "tool", "answer": "12",
                    "correct": True, "source": "tool_or_boxed"}
    assert env.first_correct_turn == 1


def test_correct_answer_continues_when_configured():
    env = make(end_on_correct=False)
    obs, done, info = env.step(call("12"))
    assert not done and info["tool_score"] == 1.0
    assert obs["role"] == "tool" and obs["content"].startswith("Correct")
    assert "\\boxed{}" in obs["content"]


def test_wrong_then_repeated_then_last_turn():
    env = make(max_turns=3)
    obs, done, info = env.step(call("10"))
    assert not done and info["reason"] == "wrong" and info["tool_score"] == 0.0
    assert "10" in obs["content"] and "Do not repeat" in obs["content"]
    assert E.LAST_CHANCE not in obs["content"]
    obs, done, info = env.step(call("10"))
    assert not done and info["reason"] == "repeated" and info["turn"] == 2
    assert obs["content"].endswith(E.LAST_CHANCE)  # the next turn is the last one
    obs, done, info = env.step(call("11"))
    assert done and info["reason"] == "wrong" and info["turn"] == 3 and obs == {}
    with pytest.raises(RuntimeError):
        env.step(call("12"))


def test_correct_on_later_turn_is_recorded():
    env = make()
    env.step(call("10"))
    _, done, info = env.step(call("12"))
    assert done and info["reason"] == "correct" and env.first_correct_turn == 2


def test_no_tool_call_ends_episode_by_default():
    env = make()
    obs, done, info = env.step("The answer is \\boxed{7}.")
    assert done and info["reason"] == "no_tool_call" and info["tool_score"] is None
    assert info["parsed_answer"] is None and info["answer"] == "7" and not info["correct"]
    # a correct box answers the turn (the reward reads this very verdict)
    obs, done, info = make().step("The answer is \\boxed{12}.")
    assert done and info["reason"] == "correct" and info["tool_score"] is None
    assert info["answer_kind"] == "boxed" and info["correct"]


def test_no_tool_call_gets_a_reminder_when_configured():
    env = make(end_on_no_tool_call=False)
    obs, done, info = env.step("no call here")
    assert not done and obs["role"] == "user" and "calc_score" in obs["content"]
    assert Geo3kEnv.format_observation(obs) == {"role": "user", "content": obs["content"],
                                                "plain_spans": []}  # no model text in it


@pytest.mark.parametrize("text,reason", [
    ("<tool_call>{not json}</tool_call>", "malformed_json"),
    ('<tool_call>{"name": "calc_score", "arguments": "{bad"}</tool_call>', "malformed_json"),
    ('<tool_call>["calc_score", "12"]</tool_call>', "malformed_json"),
    ('<tool_call>{"name": "rm_rf", "arguments": {"answer": "12"}}</tool_call>', "unknown_tool"),
    ('<tool_call>{"arguments": {"answer": "12"}}</tool_call>', "unknown_tool"),
    ('<tool_call>{"name": "calc_score", "arguments": {}}</tool_call>', "missing_answer"),
    ('<tool_call>{"name": "calc_score", "arguments": {"answer": ""}}</tool_call>', "missing_answer"),
    ('<tool_call>{"name": "calc_score", "arguments": {"answer": [12]}}</tool_call>', "missing_answer"),
    ('<tool_call>{"name": "calc_score", "arguments": {"answer": true}}</tool_call>', "missing_answer"),
    ('<tool_call>{"name": "calc_score", "arguments": 12}</tool_call>', "missing_answer"),
])
def test_malformed_calls_get_feedback_and_continue(text, reason):
    env = make()
    obs, done, info = env.step(text)
    assert not done
    assert info["reason"] == reason and info["tool_score"] is None
    assert obs["role"] == "tool" and obs["content"] == E.FEEDBACK[reason].format(
        answer=None, name=info["tool_name"])


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "calc_score", "arguments": "{\\"answer\\": \\"12\\"}"}</tool_call>',
    '<tool_call>{"function": {"name": "calc_score", "arguments": {"answer": "12"}}}</tool_call>',
    '<tool_call>{"name": "calc_geo3k_reward", "arguments": {"answer": "12"}}</tool_call>',
    '<tool_call>{"name": "calc_score", "arguments": {"answer": 12}}</tool_call>',
    '<tool_call>\n{"name": "calc_score", "arguments": {"answer": " 12 "}}\n</tool_call>',
    '<tool_call>{"name": "calc_score", "parameters": {"answer": "12"}}</tool_call>',
    '<tool_call>{"name": "calc_score", "arguments": {"answer": "12"}}',  # cut before the close
    call("7") + " on second thought " + call("12"),  # the last call counts
])
def test_accepted_call_shapes(text):
    _, done, info = make().step(text)
    assert done and info["reason"] == "correct" and info["parsed_answer"] == "12"


def test_last_call_counts_even_if_wrong():
    _, _, info = make().step(call("12") + call("13"))
    assert info["reason"] == "wrong" and info["parsed_answer"] == "13"


def test_float_answer_is_formatted():
    assert parse_tool_call('<tool_call>{"name": "calc_score", "arguments": {"answer": 2.5}}'
                           '</tool_call>').answer == "2.5"


def test_format_observation_is_a_tool_message():
    env = make()
    obs, _, _ = env.step(call("3"))
    msg = Geo3kEnv.format_observation(obs)
    assert msg == {"role": "tool", "content": obs["content"], "name": "calc_score",
                   "plain_spans": [(18, 19)]}
    assert msg["content"][18:19] == "3"  # "Wrong: the answer 3 ...": the model's answer
    with pytest.raises(ValueError):
        Geo3kEnv.format_observation({})


@pytest.mark.parametrize("text", [
    "x" * 5_000_000,
    "<tool_call>" * 200_000,
    "<tool_call>" + "[" * 200_000 + "]" * 200_000 + "</tool_call>",
    '<tool_call>{"name": "calc_score", "arguments": {"answer": "' + "9" * 100_000 + '"}}</tool_call>',
    '<tool_call>{"name": "calc_score", "arguments": {"answer": "1\x00\x1b[2J\x07"}}</tool_call>',
    "<tool_call>\ud800\udfff{\"name\": \"calc_score\"}</tool_call>",
    '<tool_call>{"name": "calc_score", "arguments": "' + '{\\"a\\":' * 2000 + '"}</tool_call>',
    "</tool_call></tool_call><tool_call>",
])
def test_hostile_text_never_raises(text):
    env = make()
    obs, done, info = env.step(text)
    assert info["tool_score"] in (None, 0.0)
    assert info["reason"] in E.REASONS


def test_non_string_response_is_no_tool_call():
    _, done, info = make().step(None)
    assert done and info["reason"] == "no_tool_call"


def test_code_in_answer_is_never_executed(tmp_path):
    marker = tmp_path / "pwned"
    code = f"__import__('os').system('touch {marker}')"
    env = build_env({"answer": "12"}, max_turns=2)  # the real grader
    _, _, info = env.step(call(code))
    assert info["reason"] == "wrong" and info["tool_score"] == 0.0
    assert not marker.exists() and not os.path.exists(marker)


def test_real_grader_accepts_equivalent_forms():
    env = build_env({"answer": "\\frac{5}{2}"})
    _, done, info = env.step(call("2.5"))
    assert done and info["tool_score"] == 1.0


def test_build_env_sources_of_truth_and_options():
    assert build_env({"answer": 12}).ground_truth == "12"
    assert build_env(types.SimpleNamespace(label="8\\sqrt{3}")).ground_truth == "8\\sqrt{3}"
    env = build_env({"answer": "1"}, {"max_turns": 5, "rel_tol": 0.1, "other_key": 1})
    assert env.config.max_turns == 5 and env.config.rel_tol == 0.1
    env = build_env({"answer": "1"}, types.SimpleNamespace(max_turns=4), end_on_correct=False)
    assert env.config == EnvConfig(max_turns=4, end_on_correct=False)
    with pytest.raises(TypeError, match="max_turn"):
        build_env({"answer": "1"}, max_turn=2)
    with pytest.raises(ValueError):
        build_env(None)
    with pytest.raises(ValueError, match="answer"):
        build_env({"label": "1"})
    with pytest.raises(ValueError):
        build_env({"answer": "  "})
    with pytest.raises(ValueError):
        EnvConfig(max_turns=0)


@pytest.mark.parametrize("letter,expected", [("B", True), ("(b)", True), ("B.", True),
                                             ("A", False), ("E", False)])
def test_choice_letters(letter, expected):
    env = build_env({"answer": "12", "choices": ["7", "12", "15", "20"]})
    _, _, info = env.step(call(letter))
    assert info["tool_score"] == (1.0 if expected else 0.0)
    assert info["parsed_answer"] == letter


def test_choice_letter_can_be_turned_off_and_repeat_is_by_choice():
    env = build_env({"answer": "12", "choices": ["7", "12"]}, accept_choice_letter=False)
    assert env.step(call("B"))[2]["tool_score"] == 0.0
    env = build_env({"answer": "12", "choices": ["7", "12"]})
    env.step(call("A"))
    assert env.step(call("7"))[2]["reason"] == "repeated"  # "7" is choice A again


def test_feedback_as_a_user_message():
    """AReaL's recipe (env.feedback_role=user): feedback on a call is a user turn, not a tool
    response; the default stays a tool response."""
    obs, done, _ = make(feedback_role="user").step(call("7"))
    assert not done and Geo3kEnv.format_observation(obs) == {
        "role": "user", "content": obs["content"], "plain_spans": [(18, 19)]}
    assert obs["content"].startswith("Wrong")
    assert make().step(call("7"))[0]["role"] == "tool"
    with pytest.raises(ValueError, match="feedback_role"):
        EnvConfig(feedback_role="system")


def test_feedback_marks_the_model_text():
    text, spans = E.fill_feedback("{{x}} {answer} and {name}.", answer="<|im_end|>", name="t")
    assert text == "{x} <|im_end|> and t." and spans == [(4, 14), (19, 20)]
    env = make()
    obs, _, _ = env.step('<tool_call>{"name": "nope<|im_start|>"}</tool_call>')
    (a, b), = obs["plain_spans"]
    assert obs["content"][a:b] == "nope<|im_start|>"
