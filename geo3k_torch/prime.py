"""Teach a tiny random checkpoint the tool-call format, so that the CPU default has a signal.

A random tiny model never writes a well-formed tool call by chance, so its GRPO reward is 0 at
every step and nothing is learned. Real Instruct checkpoints already speak the protocol; this
gives the tiny one the same starting point: a few supervised steps on

    <prompt> -> <tool_call>{"name": "calc_score", "arguments": {"answer": "<L>"}}</tool_call>

where L is a choice letter drawn UNIFORMLY at random, independently of the problem. The primed
policy thus knows the format and nothing about the answers (about 1 in 4 per turn); what GRPO
then learns (use the feedback, do not repeat a rejected letter, read the diagram) is its own.
Only a freshly built tiny checkpoint is primed (`model.tiny_prime_steps`), never `model.path`.
"""

from __future__ import annotations

import json

import numpy as np
import torch

from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                           TimeElapsedColumn)

from common.batching import TrainSequence, pack
from common.chat import ChatRenderer
from common.processor import load_processor
from geo3k_torch.model import load_model, packed_inputs, token_logprobs


def format_target(letter: str) -> str:
    call = {"name": "calc_score", "arguments": {"answer": letter}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def prime_format(model_dir: str, prompts, steps: int, seed: int = 0, lr: float = 3e-3,
                 batch: int = 8) -> list[float]:
    """`steps` AdamW steps of next-token loss on random-letter tool calls; saves the weights
    back into `model_dir`. prompts: `common.data.Prompt`s with choices. Returns the losses."""
    processor = load_processor(model_dir)
    renderer = ChatRenderer(processor)
    model = load_model(model_dir)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rng = np.random.default_rng(seed)
    usable = [p for p in prompts if p.choices]
    if not usable:
        raise ValueError("priming needs prompts with choices")
    prompt_ids = {}
    losses = []
    progress = Progress(TextColumn("[bold]prime tiny model"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), TextColumn("{task.fields[info]}"))
    task = progress.add_task("prime", total=steps, info="")
    with progress:
        for _ in range(steps):
            losses.append(_step(model, processor, renderer, opt, usable, prompt_ids, rng, batch))
            progress.update(task, advance=1, info=f"loss {losses[-1]:.3f}")
    model.save_pretrained(model_dir, safe_serialization=True)
    return losses


def _step(model, processor, renderer, opt, usable, prompt_ids, rng, batch) -> float:
    """One supervised step on `batch` random prompts; returns the mean token loss."""
    seqs = []
    for i in rng.choice(len(usable), min(batch, len(usable)), replace=False):
        p = usable[i]
        if i not in prompt_ids:
            prompt_ids[i] = renderer.prompt_ids(p.messages, p.images)
        letter = chr(ord("A") + int(rng.integers(len(p.choices))))
        target = renderer.tokenizer.encode(format_target(letter), add_special_tokens=False)
        target = target + [renderer.turn_end_id]
        ids = np.r_[prompt_ids[i], target]
        mask = np.r_[np.zeros(len(prompt_ids[i]), np.int8), np.ones(len(target), np.int8)]
        seqs.append(TrainSequence(ids, mask, np.zeros(len(ids), np.float32), 0.0, p.images,
                                  int(i)))
    n = float(sum(s.loss_mask.sum() for s in seqs))
    opt.zero_grad(set_to_none=True)
    total = 0.0
    for b in pack(seqs, max(len(s) for s in seqs) * len(seqs)):
        targets = torch.from_numpy(np.nonzero(b.loss_mask)[0])
        loss = -token_logprobs(model, packed_inputs(b, processor, model.config),
                               targets).sum() / n
        loss.backward()
        total += float(loss.detach())
    opt.step()
    return total
