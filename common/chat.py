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

Works with any processor offering `apply_chat_template`, a `tokenizer` and `__call__(text=,
images=)`; nothing here imports torch.
"""

from __future__ import annotations

from typing import Any, Sequence

from common.prompts import TOOLS

_PROBE_USER = {"role": "user", "content": "Q"}
_PROBE_REPLY = "A1b2C3"  # an assistant content the template cannot confuse with its own text


class ChatRenderer:
    """Renders chat messages with `processor`'s template. See the module docstring."""

    def __init__(self, processor: Any, tools: list[dict] | None = TOOLS):
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.tools = tools
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

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.processor.apply_chat_template(
            messages, tools=self.tools, add_generation_prompt=generation_prompt, tokenize=False)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

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
        generation prompt of the next assistant turn. Loss mask 0 in the trajectory."""
        probe = [_PROBE_USER, {"role": "assistant", "content": _PROBE_REPLY}]
        full = self._render(probe + [message], True)
        if not full.startswith(self._prefix):
            raise ValueError("the chat template rewrites earlier turns when a message is added; "
                             "observation tokens cannot be taken as a suffix")
        added = full[len(self._prefix):]
        if last_token == self.turn_end_id:
            head = self._after_content[len(self._turn_end_text):]
        else:
            head = self._after_content
        return self._encode(head + added)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of generated ids, special tokens included (the environment parses tool tags)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)
