r"""Supervised fine-tuning examples: a conversation becomes token ids and an assistant mask.

The data preparation of slime's single-turn example: each problem's reply is its answer as
`Answer: \boxed{<answer>}`, appended to the problem's chat messages as the assistant turn; the
images stay where the problem's placeholders put them.

    seq = sft_example(renderer, sft_messages(prompt), prompt.images)   # a TrainSequence
    seq.token_ids   (T,)  the prompt rendered with the chat template (images expanded, generation
                          prompt included), then the reply's tokens and the turn-end token
    seq.loss_mask   (T,)  1 on the reply and its turn-end token, 0 elsewhere

The reply is tokenized after the generation prompt, on its own, exactly as the model's sampled
tokens follow the prompt in a rollout (`common.chat.ChatRenderer`): the SFT and GRPO sequences of
one problem share their prompt ids. The sequences pack with `common.batching.pack`, so SFT runs
the same M-RoPE and image path as GRPO. Framework-neutral (no torch).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from common.batching import TrainSequence


def format_answer(answer: str) -> str:
    r"""The seed's SFT target: `Answer: \boxed{<answer>}`."""
    return f"Answer: \\boxed{{{answer}}}"


def sft_messages(prompt: Any, reply: str | None = None) -> list[dict]:
    """The prompt's chat messages with the assistant's reply appended (default: the seed's
    formatted answer)."""
    text = format_answer(prompt.answer) if reply is None else reply
    return list(prompt.messages) + [{"role": "assistant", "content": text}]


def sft_example(renderer, messages: list[dict], images: Sequence[Any],
                index: int = 0) -> TrainSequence:
    """Token ids and assistant mask of `messages`, whose last message is the assistant reply
    trained on (everything before it is context). `index` is kept as the sequence's
    `traj_index`. Advantages and rollout log-probs are 0 (unused by the SFT loss)."""
    *context, reply = messages
    if reply["role"] != "assistant" or not isinstance(reply["content"], str):
        raise ValueError("the last SFT message must be an assistant turn with text content")
    prompt = list(renderer.prompt_ids(context, images))
    target = list(renderer.tokenizer.encode(reply["content"], add_special_tokens=False))
    target.append(renderer.turn_end_id)  # the model learns to end its turn
    ids = np.asarray(prompt + target, np.int64)
    mask = np.r_[np.zeros(len(prompt), np.int8), np.ones(len(target), np.int8)]
    return TrainSequence(ids, mask, np.zeros(len(ids), np.float32), 0.0, list(images), index)
