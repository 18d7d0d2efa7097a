"""The Geometry3K tool-calling environment: parses the model's tool call, scores it, gives feedback.

One episode is one problem. Each assistant turn is passed to `step(text)`; the environment finds the
last Qwen/Hermes tool call in it,

    <tool_call>{"name": "calc_score", "arguments": {"answer": "12"}}</tool_call>

scores the `answer` against the label and returns feedback as an observation that
`format_observation` turns into a chat message (a tool response in the model's chat template).
The feedback repeats the model's answer (or tool name); the message marks where
(`plain_spans`), so the renderer can keep that text out of special tokens.

API (the seed's): `build_env(sample, args, **kw) -> Geo3kEnv`, `reset() -> (obs, info)`,
`step(response_text) -> (obs, done, info)`, `format_observation(obs) -> dict`.

A turn's answer (`turn_answer`, the one function the reward reads too) is the argument of its
valid tool call; a turn without one answers with its last `\\boxed{}` (the answer source
`tool_or_boxed`; `tool` takes calls only, `boxed` boxes only, as `common.reward` is set). A
correct box ends the episode like a correct call, whatever else the turn wrote.

Episode rules (all configurable through `EnvConfig`):
  * at most `max_turns` assistant turns;
  * a correct answer ends the episode (`end_on_correct`; one anchor kept going and wasted tokens);
  * a turn with no tool call ends it (`end_on_no_tool_call`: the model chose to answer);
  * a malformed call (bad JSON, unknown tool, missing answer) gets feedback and the episode goes
    on while turns remain.

`step` never raises on model text: megabytes of text, deep JSON, control characters and code are
all just wrong or malformed answers.
"""

from __future__ import annotations

import dataclasses
import json
import re
import string
from typing import Any, Callable, Mapping, Sequence

from common.prompts import TOOL_NAMES
from common.grader import extract_last_boxed, grade_answer

# Reason codes carried in `info["reason"]`.
CORRECT = "correct"
WRONG = "wrong"
REPEATED = "repeated"  # wrong, and the same answer (as math) as an earlier turn
NO_TOOL_CALL = "no_tool_call"
MALFORMED = "malformed_json"
UNKNOWN_TOOL = "unknown_tool"
MISSING_ANSWER = "missing_answer"
REASONS = (CORRECT, WRONG, REPEATED, NO_TOOL_CALL, MALFORMED, UNKNOWN_TOOL, MISSING_ANSWER)

# Tool calls larger than this are malformed: no honest answer needs more.
MAX_CALL_CHARS = 4096
MAX_ANSWER_CHARS = 512

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"

FEEDBACK = {
    CORRECT: "Correct: the answer {answer} scores 1.0. Stop calling the tool and give the final "
    "answer in \\boxed{{}}.",
    WRONG: "Wrong: the answer {answer} scores 0.0. Reason about the diagram again with a "
    "different approach and call the tool with a different answer. Do not repeat it.",
    REPEATED: "Wrong again: you already tried {answer} and it scores 0.0. Do not repeat an "
    "answer; reason differently and call the tool with a new one.",
    NO_TOOL_CALL: "No tool call found. Check your answer by calling the calc_score tool as "
    '<tool_call>{{"name": "calc_score", "arguments": {{"answer": "..."}}}}</tool_call>.',
    MALFORMED: "The tool call is not valid JSON. Call the tool again as "
    '<tool_call>{{"name": "calc_score", "arguments": {{"answer": "..."}}}}</tool_call>.',
    UNKNOWN_TOOL: "Unknown tool {name}. The only tool is calc_score with one argument, answer.",
    MISSING_ANSWER: "The tool call has no usable \"answer\" argument. Pass your final answer as "
    'a string: {{"answer": "..."}}.',
}
LAST_CHANCE = " You have one attempt left."


@dataclasses.dataclass(frozen=True)
class EnvConfig:
    """Episode rules. `rel_tol` > 0 accepts numeric answers within that relative tolerance;
    `rel_tol` and `grade_timeout_s` grade the reward's boxed answers too (`common.reward`)."""

    max_turns: int = 3
    end_on_correct: bool = True
    end_on_no_tool_call: bool = True
    rel_tol: float = 0.0
    grade_timeout_s: float = 5.0
    accept_choice_letter: bool = True  # "B" means the second listed choice, when there are choices
    feedback_role: str = "tool"  # the role of feedback on a tool call: tool | user (AReaL's)

    def __post_init__(self):
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        if self.rel_tol < 0:
            raise ValueError(f"rel_tol must be >= 0, got {self.rel_tol}")
        if self.feedback_role not in ("tool", "user"):
            raise ValueError(f"feedback_role must be tool or user, got {self.feedback_role!r}")


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """The outcome of parsing one turn: `reason` is None when `answer` is usable."""

    name: str | None
    answer: str | None
    reason: str | None


def _safe_json(text: str) -> Any:
    """json.loads that turns every failure (deep nesting included) into ValueError."""
    try:
        return json.loads(text, strict=False)
    except (ValueError, RecursionError, MemoryError) as e:
        raise ValueError(str(e)[:200]) from None


def _answer_text(value: Any) -> str | None:
    """The `answer` argument as a string; numbers are formatted, anything else is unusable."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return repr(value) if isinstance(value, float) else str(value)
    if isinstance(value, str) and value.strip() and len(value) <= MAX_ANSWER_CHARS:
        return value.strip()
    return None


def parse_tool_call(text: str) -> ToolCall:
    """Parse the last `<tool_call>` block of a turn (an unterminated last block counts too)."""
    start = text.rfind(_OPEN)  # linear time, whatever the text: no regex backtracking
    if start < 0:
        return ToolCall(None, None, NO_TOOL_CALL)
    start += len(_OPEN)
    end = text.find(_CLOSE, start)
    body = text[start:end if end >= 0 else len(text)].strip()
    if len(body) > MAX_CALL_CHARS:
        return ToolCall(None, None, MALFORMED)
    try:
        call = _safe_json(body)
    except ValueError:
        return ToolCall(None, None, MALFORMED)
    if isinstance(call, dict) and isinstance(call.get("function"), dict):
        call = call["function"]  # OpenAI-style wrapping: {"function": {"name", "arguments"}}
    if not isinstance(call, dict):
        return ToolCall(None, None, MALFORMED)
    name = call.get("name")
    if not isinstance(name, str) or name not in TOOL_NAMES:
        shown = name[:64] if isinstance(name, str) else repr(name)[:64]
        return ToolCall(shown, None, UNKNOWN_TOOL)
    args = call.get("arguments", call.get("parameters"))
    if isinstance(args, str):  # arguments may arrive as a JSON string
        try:
            args = _safe_json(args)
        except ValueError:
            return ToolCall(name, None, MALFORMED)
    if not isinstance(args, dict):
        return ToolCall(name, None, MISSING_ANSWER)
    answer = _answer_text(args.get("answer"))
    if answer is None:
        return ToolCall(name, None, MISSING_ANSWER)
    return ToolCall(name, answer, None)


SOURCES = ("tool", "boxed", "tool_or_boxed")  # where a turn's answer may come from


def turn_answer(text: str, source: str = "tool_or_boxed"
                ) -> tuple[ToolCall, tuple[str, str] | None]:
    """The turn's parsed tool call, and its answer under `source` as ("tool" | "boxed",
    answer as written), or None when it gave none: a valid call's argument (unless source is
    `boxed`), else the last box (unless source is `tool`)."""
    if source not in SOURCES:
        raise ValueError(f"answer source must be one of {SOURCES}, got {source!r}")
    call = parse_tool_call(text)
    if source != "boxed" and call.reason is None:
        return call, ("tool", call.answer)
    if source != "tool":
        boxed = extract_last_boxed(text)
        if boxed is not None:
            return call, ("boxed", boxed)
    return call, None


def fill_feedback(template: str, **values: Any) -> tuple[str, list[tuple[int, int]]]:
    """`template.format(**values)` and the (start, end) character spans the values took: the
    values are model text (its answer, its tool name), which must stay plain text in tokens."""
    text, spans = "", []
    for literal, field, _, _ in string.Formatter().parse(template):
        text += literal
        if field is not None:
            value = str(values[field])
            spans.append((len(text), len(text) + len(value)))
            text += value
    return text, spans


def resolve_choice(answer: str, choices: Sequence[str] | None) -> str:
    """A choice letter ("B", "(b)", "B.") as the text of that choice; anything else unchanged."""
    m = re.fullmatch(r"\(?([A-Za-z])[).]?", answer.strip())
    if not choices or not m:
        return answer
    k = ord(m.group(1).upper()) - ord("A")
    return str(choices[k]) if k < len(choices) else answer


class Geo3kEnv:
    """One Geometry3K episode against a ground-truth answer (and the problem's choices, if any:
    then a choice letter is accepted as an answer, see `EnvConfig.accept_choice_letter`)."""

    def __init__(self, ground_truth: str, config: EnvConfig = EnvConfig(),
                 grader: Callable[..., bool] = grade_answer,
                 choices: Sequence[str] | None = None, source: str = "tool_or_boxed"):
        if not isinstance(ground_truth, str) or not ground_truth.strip():
            raise ValueError(f"ground truth must be a non-empty string, got {ground_truth!r}")
        if source not in SOURCES:
            raise ValueError(f"answer source must be one of {SOURCES}, got {source!r}")
        self.ground_truth, self.source = ground_truth, source
        self.config = config
        self.choices = list(choices) if choices and config.accept_choice_letter else None
        self._grader = grader
        self.reset()

    def reset(self) -> tuple[dict, dict]:
        """Start the episode over. Returns an empty observation and `{"turn": 0}`."""
        self.turn = 0
        self.done = False
        self.tried: list[str] = []
        self.first_correct_turn: int | None = None
        return {}, {"turn": 0}

    def _grade(self, answer: str) -> bool:
        return bool(self._grader(answer, self.ground_truth, rel_tol=self.config.rel_tol,
                                 timeout_s=self.config.grade_timeout_s))

    def _same(self, answer: str, earlier: str) -> bool:
        """Whether `answer` repeats an earlier wrong answer: equal as math (`12`, `12.0` and
        `x = 12` are one answer), judged by the grader itself, exactly."""
        return answer == earlier or bool(self._grader(
            answer, earlier, rel_tol=0.0, timeout_s=self.config.grade_timeout_s))

    def step(self, response_text: str) -> tuple[dict, bool, dict]:
        """Score one assistant turn.

        Returns (observation, done, info). `observation` is `{"role", "content", "reason"}` (empty
        when the episode is done); `info` has `turn` (1-based), `reason`, `tool_score` (1.0, 0.0, or
        None when no valid call was made), `parsed_answer` and `tool_name`, and the turn's answer
        (`turn_answer`): `answer_kind` ("tool", "boxed" or None), `answer`, `correct` (bool) and
        `source`. A box answers only when the turn made no valid call: a correct one is CORRECT
        (it ends the episode), a wrong one keeps the call's reason (no call, malformed, ...).
        """
        if self.done:
            raise RuntimeError("step() called on a finished episode; call reset() first")
        if not isinstance(response_text, str):
            response_text = "" if response_text is None else str(response_text)
        self.turn += 1
        call, given = turn_answer(response_text, self.source)
        score, correct = None, False
        reason = call.reason
        if given is not None:
            answer = resolve_choice(given[1], self.choices)
            correct = self._grade(answer)
            if given[0] == "tool":
                score = 1.0 if correct else 0.0
            if correct:
                reason = CORRECT
                if self.first_correct_turn is None:
                    self.first_correct_turn = self.turn
            elif given[0] == "tool":
                reason = REPEATED if any(self._same(answer, t) for t in self.tried) else WRONG
            self.tried.append(answer)
        cfg = self.config
        self.done = (
            self.turn >= cfg.max_turns
            or (reason == CORRECT and cfg.end_on_correct)
            or (reason == NO_TOOL_CALL and cfg.end_on_no_tool_call)
        )
        info = {"turn": self.turn, "reason": reason, "tool_score": score,
                "parsed_answer": call.answer, "tool_name": call.name,
                "answer_kind": given and given[0], "answer": given and given[1],
                "correct": correct, "source": self.source}
        if self.done:
            return {}, True, info
        shown = given[1] if given is not None else call.answer  # the answer the turn gave
        text, spans = fill_feedback(FEEDBACK[reason], answer=shown, name=call.name)
        if self.turn == cfg.max_turns - 1:
            text += LAST_CHANCE
        # A reply to an actual call is a tool response (or, with feedback_role=user, a user turn as
        # in AReaL's recipe); a reminder after no call is always a user turn.
        role = "user" if reason == NO_TOOL_CALL else cfg.feedback_role
        return ({"role": role, "content": text, "reason": reason, "plain_spans": spans}, False,
                info)

    @staticmethod
    def format_observation(observation: Mapping[str, Any]) -> dict:
        """The observation as a chat message: `{"role": "tool" | "user", "content": str,
        "plain_spans": [(start, end), ...]}`, the spans marking the model's own text in the
        content (the renderer encodes them as plain text; chat templates ignore the key)."""
        if not observation:
            raise ValueError("empty observation: the episode is over, nothing to send")
        content = observation["content"]  # without spans, all of it counts as model text
        message = {"role": observation["role"], "content": content,
                   "plain_spans": list(observation.get("plain_spans", [(0, len(content))]))}
        if message["role"] == "tool":
            message["name"] = TOOL_NAMES[0]
        return message


def _ground_truth(sample: Any) -> str:
    if isinstance(sample, Mapping):
        if "answer" not in sample:
            raise ValueError("sample mapping has no 'answer' key")
        return str(sample["answer"])
    if hasattr(sample, "label"):
        return str(sample.label)
    if hasattr(sample, "answer"):
        return str(sample.answer)
    raise ValueError(f"cannot find a ground truth in sample of type {type(sample).__name__}")


def build_env(sample: Any = None, args: Any = None, source: str = "tool_or_boxed",
              **kwargs) -> Geo3kEnv:
    """Build an environment for `sample` (a mapping with `answer` or an object with `label`),
    reading answers from `source` (`turn_answer`; the reward's `RewardConfig.source`).

    `args` may be an `EnvConfig`, a mapping or an object with EnvConfig's fields (e.g. a
    ConfigDict section); `kwargs` override single fields. Unknown keyword fields are an error.
    """
    if sample is None:
        raise ValueError("build_env needs a sample with a ground-truth answer")
    if isinstance(args, EnvConfig):
        config = args
    else:
        names = [f.name for f in dataclasses.fields(EnvConfig)]
        if isinstance(args, Mapping):
            values = {k: args[k] for k in names if k in args}
        else:
            values = {k: getattr(args, k) for k in names if args is not None and hasattr(args, k)}
        config = EnvConfig(**values)
    unknown = set(kwargs) - {f.name for f in dataclasses.fields(EnvConfig)}
    if unknown:
        raise TypeError(f"unknown environment options: {sorted(unknown)}")
    if kwargs:
        config = dataclasses.replace(config, **kwargs)
    choices = sample.get("choices") if isinstance(sample, Mapping) else getattr(sample, "choices",
                                                                                None)
    return Geo3kEnv(_ground_truth(sample), config, choices=choices, source=source)
