"""The scoring tool's schema and the system prompts a Geometry3K prompt starts with.

Three prompt styles (`data.prompt_style`): `tool` (the multi-turn task: the tool's schema goes to
the chat template, the system prompt asks for a tool call), `brief` (the same task in one short
system sentence and no schema, for a tiny checkpoint that learns the call from its priming: a
synthetic perception prompt is ~95 tokens in its vocabulary instead of ~500, and its 16 image
tokens 5x the prompt's share) and `boxed` (the single-turn task of slime's single-turn example
and of SFT: no tool, the final answer in `\\boxed{}`).

The schema is in the form chat templates take as `tools=` (OpenAI / Qwen function format), so
`processor.apply_chat_template(messages, tools=TOOLS)` renders it in the model's own way.
"""

# Both names are accepted by the environment; the prompt advertises the first.
TOOL_NAMES = ("calc_score", "calc_geo3k_reward")

SCORE_TOOL = {
    "type": "function",
    "function": {
        "name": TOOL_NAMES[0],
        "description": (
            "Check a candidate final answer to the geometry problem. Returns 1.0 if the answer "
            "is correct and 0.0 otherwise, with feedback."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "answer": {
                    "type": "string",
                    "description": "The final answer only: a number or a LaTeX expression, "
                    "for example 12, 6.5, \\frac{5}{2} or 8\\sqrt{3}.",
                }
            },
            "required": ["answer"],
        },
    },
}

TOOLS = [SCORE_TOOL]

SYSTEM_PROMPT = (
    "You are solving a geometry problem about the diagram shown. Read the numbers you need from "
    "the diagram, reason step by step, then check your answer by calling the calc_score tool "
    "with your final answer. If the tool says the answer is wrong, think again and call it with "
    "a different answer. Finish with the final answer in \\boxed{}."
)

BOXED_SYSTEM_PROMPT = (
    "You are solving a geometry problem about the diagram shown. Read the numbers you need from "
    "the diagram, reason step by step, and put the final answer in \\boxed{}."
)

BRIEF_SYSTEM_PROMPT = "Answer with a calc_score call; if it is wrong, answer again."

# style -> (system prompt, tools for the chat template)
PROMPT_STYLES = {"tool": (SYSTEM_PROMPT, TOOLS), "brief": (BRIEF_SYSTEM_PROMPT, None),
                 "boxed": (BOXED_SYSTEM_PROMPT, None)}


def prompt_style(name: str) -> tuple[str, list[dict] | None]:
    """(system prompt, tool schemas or None) of a prompt style."""
    if name not in PROMPT_STYLES:
        raise ValueError(f"data.prompt_style must be one of {sorted(PROMPT_STYLES)}, got {name!r}")
    return PROMPT_STYLES[name]
