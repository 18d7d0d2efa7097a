"""Teach a tiny random checkpoint the tool-call format, so that the CPU runs have a signal.

A random tiny model never writes a well-formed tool call by chance, so its GRPO reward is 0 at
every step and nothing is learned. Real Instruct checkpoints already speak the protocol; this
gives the tiny one the same starting point: a few SFT steps (`geo3k_torch.sft`) on

    <prompt> -> <tool_call>{"name": "calc_score", "arguments": {"answer": "<L>"}}</tool_call>

where L is a choice letter drawn UNIFORMLY at random, independently of the problem, in turn 1
or in a later turn (the earlier turns random calls too, the environment's own feedback between
them: a model primed on first turns alone wrote its second call malformed). The primed policy
thus knows the format and nothing about the answers (about 1 in 4 per turn, a rejected letter as
likely as any, unless `model.tiny_prime_retry` is "new" or "new_after_repeats"); what GRPO then
learns (use the feedback, do not repeat a rejected letter, read the diagram) is its own.
Only a freshly built tiny checkpoint is primed (`model.tiny_prime_steps`), never `model.path`.
"""

from __future__ import annotations

import json
import types
from typing import Sequence

import numpy as np
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                           TimeElapsedColumn)

from common.chat import ChatRenderer
from common.env import EnvConfig, Geo3kEnv
from common.processor import load_processor
from common.prompts import TOOLS
from common.sft import sft_example
from geo3k_torch.checkpoint import save_published
from geo3k_torch.model import load_model
from geo3k_torch.learner import SFTLearner, sft_step


PRIME_ANSWERS = ("letter", "value")
PRIME_RETRIES = ("any", "new", "new_after_repeats", "cyclic")


def format_target(answer: str) -> str:
    call = {"name": "calc_score", "arguments": {"answer": answer}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def prime_config(lr: float, steps: int, freeze_vision: bool = False):
    """AdamW at a constant `lr`, no weight decay, no clipping: the fields `SFTLearner` reads."""
    return types.SimpleNamespace(lr=lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                                 grad_clip=float("inf"), lr_schedule="constant", warmup_steps=0,
                                 steps=steps, updates_per_rollout=1, min_lr_ratio=0.0, bf16=False,
                                 freeze_vision=freeze_vision)


def check_settings(answer: str, retry: str) -> None:
    """Refuse an `answer` (model.tiny_prime_answer) or `retry` (model.tiny_prime_retry) the
    priming does not know."""
    if answer not in PRIME_ANSWERS:
        raise ValueError(f"model.tiny_prime_answer={answer!r}: the priming answers by one of "
                         f"{PRIME_ANSWERS}")
    if retry not in PRIME_RETRIES:
        raise ValueError(f"model.tiny_prime_retry={retry!r}: the priming's later calls choose "
                         f"from one of {PRIME_RETRIES} (every choice, or those not yet given)")


def primer_messages(prompt, rng: np.random.Generator, env_config: EnvConfig,
                    answer: str = "letter", wrong: Sequence[int] | None = None,
                    retry: str = "any", later: bool = False) -> list[dict]:
    """`prompt`'s messages, then 1 to `env_config.max_turns` assistant turns (uniformly many;
    exactly 2 when `later`, if a wrong choice and a second turn exist), each
    a call answering a choice by its letter or its value (`answer`), with the environment's
    feedback between them. The last turn, the one trained, answers a uniformly random choice;
    the earlier ones, context only, a random wrong one (`wrong`: their indices in
    `prompt.choices`, found with the environment's grader when None), as a later turn in a
    rollout always follows wrong ones. Were a solving call allowed to end it early, the trained
    call would be the right answer more often than 1 in 4.

    retry="new": the earlier calls are distinct, and the trained call is uniform over the
    choices no earlier call gave (an Instruct model's manners after "try a different answer":
    it carries nothing about which of those is right; with 4 choices a turn-2 call is right 1 in
    3, a turn-3 call 1 in 2, as for the elimination baseline). "new_after_repeats": the trained
    call as for "new", the earlier calls wrong ones drawn independently, so that the context may
    repeat one and carry the environment's "repeated" feedback, as a policy's rollouts do (primed
    with "new", the tiny model never saw that feedback and broke the format of the turn after it).
    "cyclic": the earlier calls as for "new_after_repeats"; a trained later call is the choice
    after the last earlier call's in the listed order, cyclically, skipping those given (a blind
    elimination in a fixed order; a trained first call stays uniform). Each such call follows
    from the earlier ones: a signal the tiny model learns to read them by, where the uniform
    draw of "new_after_repeats" leaves it deaf to them (docs/results.md).
    "any": the earlier calls as for "new_after_repeats", the trained call over every choice."""
    check_settings(answer, retry)
    env = Geo3kEnv(prompt.answer, env_config, choices=prompt.choices)
    if wrong is None:
        wrong = wrong_choices(prompt, env_config)
    messages = list(prompt.messages)
    most = env_config.max_turns if retry != "new" else min(env_config.max_turns, len(wrong) + 1)
    turns = (2 if later and most > 1 else int(rng.integers(1, most + 1))) if wrong else 1
    earlier = ([int(k) for k in rng.choice(wrong, turns - 1, replace=False)]
               if retry == "new" else [])
    for turn in range(1, turns + 1):
        if retry == "new":
            left = [k for k in range(len(prompt.choices)) if k not in earlier]
            k = earlier[turn - 1] if turn < turns else int(rng.choice(left))
        elif turn < turns:
            k = int(rng.choice(wrong))
            earlier.append(k)
        elif retry == "new_after_repeats":
            k = int(rng.choice([k for k in range(len(prompt.choices)) if k not in earlier]))
        elif retry == "cyclic" and earlier:
            n = len(prompt.choices)
            k = next(j % n for j in range(earlier[-1] + 1, earlier[-1] + n) if j % n not in earlier)
        else:
            k = int(rng.integers(len(prompt.choices)))
        reply = format_target(chr(ord("A") + k) if answer == "letter" else prompt.choices[k])
        messages.append({"role": "assistant", "content": reply})
        if turn < turns:
            observation, _, _ = env.step(reply)
            messages.append(Geo3kEnv.format_observation(observation))
    return messages


def wrong_choices(prompt, env_config: EnvConfig) -> list[int]:
    """Indices of `prompt.choices` that the environment scores wrong."""
    out = []
    for k, choice in enumerate(prompt.choices):
        env = Geo3kEnv(prompt.answer, env_config, choices=prompt.choices)
        if not env.step(format_target(choice))[2]["correct"]:
            out.append(k)
    return out


def prime_format(model_dir: str, prompts, steps: int, seed: int = 0, lr: float = 3e-3,
                 batch: int = 8, train_vision: bool = True, tools=TOOLS,
                 env_config: EnvConfig = EnvConfig(), answer: str = "letter",
                 retry: str = "any", later_steps: int = 0) -> list[float]:
    """`later_steps` then `steps` SFT steps on random tool calls; saves the weights back into
    `model_dir`. The first `later_steps` train second turns only (`primer_messages`' `later`):
    with retry="cyclic", they form the reading of the earlier call before the format's tokens,
    most of the loss, sharpen the attention past the point where that signal reaches it
    (docs/results.md).
    prompts: `common.data.Prompt`s with choices, rendered with `tools` (the run's prompt style's
    schemas, or None), played under the run's `env_config`, answering by `answer`, later calls
    choosing by `retry` (`primer_messages`);
    train_vision=False leaves the vision tower as it is (the random letters carry no signal
    about the figure, yet at this lr they move every vision weight by about its own norm:
    docs/results.md).
    Returns the losses (mean per target token)."""
    if steps < 0 or later_steps < 0:
        raise ValueError(f"model.tiny_prime_steps={steps} and model.tiny_prime_later_steps="
                         f"{later_steps}: step counts cannot be negative")
    processor = load_processor(model_dir)
    renderer = ChatRenderer(processor, tools=tools)
    model = load_model(model_dir)
    total = later_steps + steps
    learner = SFTLearner(model, processor, prime_config(lr, total, not train_vision),
                         model_dir=model_dir)
    rng = np.random.default_rng(seed)
    usable = [p for p in prompts if p.choices]
    if not usable:
        raise ValueError("priming needs prompts with choices")
    wrong = [wrong_choices(p, env_config) for p in usable]
    losses = []
    progress = Progress(TextColumn("[bold]prime tiny model"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), TextColumn("{task.fields[info]}"))
    task = progress.add_task("prime", total=total, info="")
    with progress:
        for step in range(total):
            seqs = []
            for i in rng.choice(len(usable), min(batch, len(usable)), replace=False):
                p = usable[i]
                messages = primer_messages(p, rng, env_config, answer, wrong[i], retry,
                                           later=step < later_steps)
                seqs.append(sft_example(renderer, messages, p.images, int(i)))
            budget = max(len(s) for s in seqs) * len(seqs)  # one micro-batch
            losses.append(sft_step(learner, seqs, budget)["loss"])
            progress.update(task, advance=1, info=f"loss {losses[-1]:.3f}")
    save_published(model, model_dir)
    return losses
