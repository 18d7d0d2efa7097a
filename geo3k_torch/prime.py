"""Teach a tiny random checkpoint the tool-call format, so that the CPU default has a signal.

A random tiny model never writes a well-formed tool call by chance, so its GRPO reward is 0 at
every step and nothing is learned. Real Instruct checkpoints already speak the protocol; this
gives the tiny one the same starting point: a few SFT steps (`geo3k_torch.sft`) on

    <prompt> -> <tool_call>{"name": "calc_score", "arguments": {"answer": "<L>"}}</tool_call>

where L is a choice letter drawn UNIFORMLY at random, independently of the problem. The primed
policy thus knows the format and nothing about the answers (about 1 in 4 per turn); what GRPO
then learns (use the feedback, do not repeat a rejected letter, read the diagram) is its own.
Only a freshly built tiny checkpoint is primed (`model.tiny_prime_steps`), never `model.path`.
"""

from __future__ import annotations

import json
import types

import numpy as np
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                           TimeElapsedColumn)

from common.chat import ChatRenderer
from common.processor import load_processor
from common.sft import sft_example, sft_messages
from geo3k_torch.model import load_model
from geo3k_torch.learner import SFTLearner, sft_step


def format_target(letter: str) -> str:
    call = {"name": "calc_score", "arguments": {"answer": letter}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def prime_config(lr: float, steps: int):
    """AdamW at a constant `lr`, no weight decay, no clipping: the fields `SFTLearner` reads."""
    return types.SimpleNamespace(lr=lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                                 grad_clip=float("inf"), lr_schedule="constant", warmup_steps=0,
                                 steps=steps, updates_per_rollout=1, min_lr_ratio=0.0, bf16=False)


def prime_format(model_dir: str, prompts, steps: int, seed: int = 0, lr: float = 3e-3,
                 batch: int = 8, train_vision: bool = True) -> list[float]:
    """`steps` SFT steps on random-letter tool calls; saves the weights back into `model_dir`.
    prompts: `common.data.Prompt`s with choices (rendered with the tool's schema);
    train_vision=False leaves the vision tower as it is (the random letters carry no signal
    about the figure, yet at this lr they move every vision weight by about its own norm:
    docs/results.md).
    Returns the losses (mean per target token)."""
    processor = load_processor(model_dir)
    renderer = ChatRenderer(processor)
    model = load_model(model_dir)
    model.model.visual.requires_grad_(train_vision)
    learner = SFTLearner(model, processor, prime_config(lr, steps), model_dir=model_dir)
    rng = np.random.default_rng(seed)
    usable = [p for p in prompts if p.choices]
    if not usable:
        raise ValueError("priming needs prompts with choices")
    losses = []
    progress = Progress(TextColumn("[bold]prime tiny model"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), TextColumn("{task.fields[info]}"))
    task = progress.add_task("prime", total=steps, info="")
    with progress:
        for _ in range(steps):
            seqs = []
            for i in rng.choice(len(usable), min(batch, len(usable)), replace=False):
                p = usable[i]
                letter = chr(ord("A") + int(rng.integers(len(p.choices))))
                seqs.append(sft_example(renderer, sft_messages(p, format_target(letter)),
                                        p.images, int(i)))
            budget = max(len(s) for s in seqs) * len(seqs)  # one micro-batch
            losses.append(sft_step(learner, seqs, budget)["loss"])
            progress.update(task, advance=1, info=f"loss {losses[-1]:.3f}")
    model.save_pretrained(model_dir, safe_serialization=True)
    return losses
