"""Chat messages to token ids with a Hugging Face processor's own chat template.

`ChatRenderer` implements the rollout's `Renderer`:
  * `prompt_ids`: the prompt rendered with the scoring tool's schema and the generation prompt,
    then tokenized by the processor, which expands each image placeholder to one `<|image_pad|>`
    per merged patch of that image (the ids the learner trains on);
  * `observation_ids`: the tokens of a feedback message alone, taken as the text the template adds
    when that message follows an assistant turn (rendered twice, with and without it), so the
    generated tokens are never re-tokenized. The text between the end of the assistant's content
    and its turn-end token is template-specific and handled generally: if the model's last token
    was the turn-end token, what the template writes after it is prepended; otherwise (it stopped
    on another stop token) the turn is closed with the template's own turn-end text.

Feedback is text. The feedback repeats what the model wrote (its answer, its tool name); the
message's `plain_spans` mark those characters of its content (`common.env.fill_feedback`; a
message without the key is model text throughout). Added tokens (`<|image_pad|>`,
`<|im_start|>`, `<tool_call>`, ...) are matched in the template's and the environment's own text
as the tokenizer would, but never in or across a marked span, which stays ordinary tokens. So no
special token can come from model text, and where the model's text spells none the ids equal the
tokenizer's encoding of the whole observation text (the environment's own `<tool_call>` example
in a reminder stays the `<tool_call>` token the model writes).

Templates without tool support. Qwen2.5-VL's published template ignores `tools=` and writes a
`tool` message under a role the model never saw. The renderer detects whether the template
renders the tool schema and a tool message (`tool_format="auto"`: the schema must show in a
prompt rendered with `tools=`, and a `tool` message must be rendered otherwise than an unknown
role would be); where it does not, it writes the schema into the system prompt with Qwen's own
Hermes text (the block Qwen2.5's and Qwen3's templates write, `common.chat_template`) and sends
feedback as a user message wrapped in `<tool_response>` tags, as Qwen2.5 renders tool results.
`tool_format="template"` or `"system_prompt"` forces either way.

Works with any processor offering `apply_chat_template`, a `tokenizer` and `__call__(text=,
images=)`; nothing here imports torch.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Sequence

from common.chat_template import TOOLS_POSTAMBLE, TOOLS_PREAMBLE
from common.prompts import TOOLS

# Ids only the processor places (the image block); a model that samples one broke its sequence.
PLACEHOLDER_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
_PROBE_USER = {"role": "user", "content": "Q"}
_PROBE_REPLY = "A1b2C3"  # an assistant content the template cannot confuse with its own text
_PROBE_FEEDBACK = "F9e8D7"  # stands for the feedback text while the template is rendered
_PROBE_ROLE = "zq_role"  # a role no template knows
TOOL_FORMATS = ("auto", "template", "system_prompt")

log = logging.getLogger(__name__)


def hermes_tool_block(tools: list[dict]) -> str:
    """The tool schema as Qwen's Hermes system-prompt section, word for word what Qwen2.5's and
    Qwen3's templates write: the schemas as JSON lines inside <tools></tools>, then how to write
    a call inside <tool_call></tool_call>."""
    schemas = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
    return TOOLS_PREAMBLE + schemas + TOOLS_POSTAMBLE


class ChatRenderer:
    """Renders chat messages with `processor`'s template. See the module docstring."""

    def __init__(self, processor: Any, tools: list[dict] | None = TOOLS,
                 tool_format: str = "auto"):
        if tool_format not in TOOL_FORMATS:
            raise ValueError(f"tool_format must be one of {TOOL_FORMATS}, got {tool_format!r}")
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.tools = tools
        added = self.tokenizer.get_added_vocab()  # text -> id, specials included
        self._added_by_length = sorted(added.items(), key=lambda kv: -len(kv[0]))
        self.tool_format = "template"
        if tools and tool_format == "auto" and not self._template_renders_tools():
            log.warning("the chat template does not render tools or tool messages: the tool "
                        "schema goes into the system prompt and feedback into <tool_response> "
                        "user turns (model.tool_format forces either way)")
            tool_format = "system_prompt"
        if tools and tool_format == "system_prompt":
            self.tool_format = tool_format
        turn = self._render([_PROBE_USER, {"role": "assistant", "content": _PROBE_REPLY}], False)
        if _PROBE_REPLY not in turn:
            raise ValueError("the chat template does not render assistant content verbatim")
        self._prefix = turn
        self._after_content = turn[turn.rindex(_PROBE_REPLY) + len(_PROBE_REPLY):]
        tail_ids = self._encode(self._after_content)
        if not tail_ids:
            raise ValueError("the chat template writes nothing after an assistant turn")
        self.turn_end_id = tail_ids[0]
        self._turn_end_text = self.tokenizer.decode([self.turn_end_id])
        if not self._after_content.startswith(self._turn_end_text):
            raise ValueError(f"cannot find the turn-end token in {self._after_content!r}")
        stops = [self.turn_end_id]
        eos = getattr(self.tokenizer, "eos_token_id", None)
        # Qwen models also end generation on <|endoftext|> (their generation_config's eos list).
        eot = self.tokenizer.convert_tokens_to_ids("<|endoftext|>")
        for t in (eos, eot):
            if isinstance(t, int) and t != getattr(self.tokenizer, "unk_token_id", None) \
                    and t not in stops:
                stops.append(t)
        self.stop_token_ids = tuple(stops)
        vocab = self.tokenizer.get_vocab()
        self.placeholder_ids = tuple(vocab[t] for t in PLACEHOLDER_TOKENS if t in vocab)

    def _template_renders_tools(self) -> bool:
        """Whether the template shows the schema given as `tools=` AND has a tool role of its
        own (Qwen2.5-VL's writes any role verbatim, `tool` included: that is no tool support)."""
        def render(messages, tools=None):
            return self.processor.apply_chat_template(
                messages, tools=tools, add_generation_prompt=False, tokenize=False)

        name = self.tools[0]["function"]["name"]
        if f'"{name}"' not in render([_PROBE_USER], self.tools):
            return False
        turn = [_PROBE_USER, {"role": "assistant", "content": _PROBE_REPLY}]
        as_tool = render(turn + [{"role": "tool", "content": _PROBE_FEEDBACK}])
        try:
            as_unknown = render(turn + [{"role": _PROBE_ROLE, "content": _PROBE_FEEDBACK}])
        except Exception:  # noqa: BLE001 - a template may refuse unknown roles: tool is its own
            return _PROBE_FEEDBACK in as_tool
        return _PROBE_FEEDBACK in as_tool and as_tool != as_unknown.replace(_PROBE_ROLE, "tool")

    def render(self, messages: list[dict], generation_prompt: bool) -> str:
        """The template's text of `messages` as this renderer presents them (the tool schema
        where the template takes it, feedback in a role it knows)."""
        return self._render([self.template_message(m) for m in messages], generation_prompt)

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        if self.tool_format == "system_prompt":
            return self.processor.apply_chat_template(
                self._with_tool_block(messages), add_generation_prompt=generation_prompt,
                tokenize=False)
        return self.processor.apply_chat_template(
            messages, tools=self.tools, add_generation_prompt=generation_prompt, tokenize=False)

    def _with_tool_block(self, messages: list[dict]) -> list[dict]:
        """The conversation with the tool schema at the end of its system prompt."""
        block = hermes_tool_block(self.tools)
        messages = list(messages)
        if messages and messages[0]["role"] == "system":
            content = messages[0]["content"]
            if not isinstance(content, str):
                content = "".join(p.get("text", "") for p in content)
            messages[0] = dict(messages[0], content=f"{content}\n\n{block}")
        else:
            messages.insert(0, {"role": "system", "content": block})
        return messages

    def template_message(self, message: dict) -> dict:
        """A feedback message in a role the template knows: a tool result becomes a user turn
        wrapped in <tool_response> tags when the template has no tool role."""
        if self.tool_format == "system_prompt" and message["role"] == "tool":
            return {"role": "user",
                    "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
        return message

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _encode_plain(self, text: str) -> list[int]:
        """Tokens of `text` with no special or added token recognised in it."""
        return list(self.tokenizer(text, add_special_tokens=False,
                                   split_special_tokens=True)["input_ids"])

    def _encode_guarded(self, text: str, plain: Sequence[tuple[int, int]]) -> list[int]:
        """`text` as the tokenizer encodes it (added tokens split out first, longest match; the
        text between them as ordinary tokens), except that no added token is matched in or
        across a `plain` span ((start, end) character offsets)."""
        blocked = [False] * len(text)
        for a, b in plain:
            blocked[a:b] = [True] * (b - a)
        ids, start, pos = [], 0, 0
        while pos < len(text):
            hit = None if blocked[pos] else next(
                ((t, i) for t, i in self._added_by_length if text.startswith(t, pos)
                 and not any(blocked[pos:pos + len(t)])), None)
            if hit is None:
                pos += 1
                continue
            ids += self._encode_plain(text[start:pos]) + [hit[1]]
            pos = start = pos + len(hit[0])
        return ids + self._encode_plain(text[start:])

    def prompt_ids(self, messages: list[dict], images: Sequence[Any]) -> list[int]:
        """Token ids of the prompt with images expanded, ending with the generation prompt."""
        text = self._render(list(messages), True)
        if images:
            enc = self.processor(text=[text], images=list(images), return_tensors="np")
        else:
            enc = self.processor(text=[text], return_tensors="np")
        return [int(t) for t in enc["input_ids"][0]]

    def observation_ids(self, message: dict, last_token: int) -> list[int]:
        """Tokens that follow an assistant turn ending in `last_token`: `message`, then the
        generation prompt of the next assistant turn. Loss mask 0 in the trajectory. The
        message's `plain_spans` stay plain text (see the module docstring)."""
        feedback = message["content"]
        spans = message.get("plain_spans", [(0, len(feedback))])
        probe = [_PROBE_USER, {"role": "assistant", "content": _PROBE_REPLY}]
        full = self._render(probe + [self.template_message(
            dict(message, content=_PROBE_FEEDBACK))], True)
        if not full.startswith(self._prefix):
            raise ValueError("the chat template rewrites earlier turns when a message is added; "
                             "observation tokens cannot be taken as a suffix")
        added = full[len(self._prefix):]
        if added.count(_PROBE_FEEDBACK) != 1:
            raise ValueError("the chat template does not write a feedback message's content "
                             "verbatim, once")
        before, after = added.split(_PROBE_FEEDBACK)
        if last_token == self.turn_end_id:
            head = self._after_content[len(self._turn_end_text):]
        else:
            head = self._after_content
        start = len(head + before)
        return self._encode_guarded(head + before + feedback + after,
                                    [(start + a, start + b) for a, b in spans])

    def decode(self, ids: Sequence[int]) -> str:
        """Text of generated ids, special tokens included (the environment parses tool tags)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)
