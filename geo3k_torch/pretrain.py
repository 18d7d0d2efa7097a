"""Teach a tiny random checkpoint to see, before the format priming: figures, then captions.

Real VLMs start RL from a vision tower pretrained on images and a language model that reads it.
A random tiny one has neither (docs/results.md): its tower's outputs barely differ between
figures and its language model ignores the image tokens, and supervised captions through the
whole model do not change that (the tower drifts to a constant; measured in docs/results.md).
So the tiny checkpoint is pretrained in two stages on perception figures generated afresh
(`common.synthetic.make_problem` with their own seeds, never the train or test split's):

1. **see** (`train_tower`): the vision tower alone, with a throwaway linear head on the mean of
   its merged image tokens, classifies each figure: its family and its answer (12 classes:
   "3".."6" sides, angle "1".."4", segment "a".."d"). Cheap: no language model in the step.
2. **caption** (`train_captions`): the tower frozen, supervised steps on SHORT sequences, the
   figure and a fixed request, no system prompt and no tools,

       <|im_start|>user <16 image tokens> Describe the figure.<|im_end|>
       <|im_start|>assistant sides: 5<|im_end|>

   with the loss on the caption (`common.synthetic.caption`), never a choice letter: the
   language model learns to read the image tokens.

Held-out accuracy (figures of another seed; chance 0.25): the tower's, the head's argmax over
the figure's own family's four classes; the captions', the argmax over the four candidate
captions' last tokens at the answer's position, teacher-forced.
"""

from __future__ import annotations

import io
import json
from typing import Sequence

import numpy as np
import torch
from PIL import Image
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                           TimeElapsedColumn)

from common.batching import TrainSequence, pack
from common.chat import ChatRenderer
from common.processor import load_processor
from common.sft import sft_example
from common.synthetic import PERCEPTION, caption, distinct_problem, make_problem
from geo3k_torch.checkpoint import save_published
from geo3k_torch.learner import SFTLearner, sft_step
from geo3k_torch.model import load_model, packed_inputs
from geo3k_torch.prime import prime_config

REQUEST = "Describe the figure."
HELD_OUT = 1  # held-out figures are drawn with seed + HELD_OUT


def _progress(title: str) -> Progress:
    return Progress(TextColumn(f"[bold]{title}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), TextColumn("{task.fields[info]}"))


def figures(seed: int, start: int, n: int, image_size: str = "112",
            exclude: frozenset[str] = frozenset()) -> tuple[list[Image.Image], list[dict]]:
    """Perception figures `start`..`start + n - 1` of `seed`: images and their rows (answer,
    choices in natural order, meta with the family); a figure whose content key is in
    `exclude` (the run's data) is drawn again (`common.synthetic.distinct_problem`)."""
    rows = [distinct_problem(seed, i, image_size, PERCEPTION, exclude, add=False) if exclude
            else make_problem(seed, i, image_size, PERCEPTION) for i in range(start, start + n)]
    images = [Image.open(io.BytesIO(r["images"][0]["bytes"])).convert("RGB") for r in rows]
    return images, rows


def labels(rows: Sequence[dict]) -> np.ndarray:
    """(n,) classes 4 * family + answer index (families in `PERCEPTION` order)."""
    return np.asarray([4 * PERCEPTION.index(json.loads(r["meta"])["family"]) +
                       r["choices"].index(r["answer"]) for r in rows], np.int64)


def tower_tokens(model, processor, images: Sequence[Image.Image]) -> torch.Tensor:
    """(n, tokens, hidden) merged image tokens of same-sized `images`: what the language model
    reads in their place."""
    enc = processor.image_processor(images=list(images), return_tensors="pt")
    merged = model.model.visual(enc["pixel_values"], grid_thw=enc["image_grid_thw"]).pooler_output
    return merged.view(len(images), -1, merged.shape[-1])


def tower_accuracy(model, processor, head, images, y: np.ndarray) -> float:
    """Share of `images` whose class `y` (n,) wins among its family's four under `head`."""
    with torch.no_grad():
        logits = head(tower_tokens(model, processor, images).mean(1)).view(len(y), 3, 4)
        own = logits[torch.arange(len(y)), torch.from_numpy(y // 4)]  # (n, 4)
    return float((own.argmax(-1).numpy() == y % 4).mean())


def train_tower(model, processor, steps: int, seed: int, lr: float, batch: int = 32,
                image_size: str = "112", held_out: int = 96,
                exclude: frozenset[str] = frozenset()) -> dict[str, float]:
    """Stage 1: `steps` AdamW steps on the vision tower's parameters (with a throwaway linear
    head on the mean merged token), `batch` fresh figures each. Returns the last step's loss and
    the held-out accuracy before and after."""
    visual = model.model.visual
    head = torch.nn.Linear(model.config.text_config.hidden_size, 4 * len(PERCEPTION))
    opt = torch.optim.AdamW([*visual.parameters(), *head.parameters()], lr=lr,
                            weight_decay=0.0)
    test_images, test_rows = figures(seed + HELD_OUT, 0, held_out, image_size, exclude)
    test_y = labels(test_rows)
    out = {"tower_accuracy_before": tower_accuracy(model, processor, head, test_images, test_y)}
    progress = _progress("pretrain tiny vision: see")
    task = progress.add_task("see", total=steps, info="")
    with progress:
        for step in range(steps):
            images, rows = figures(seed, step * batch, batch, image_size, exclude)
            logits = head(tower_tokens(model, processor, images).mean(1))  # (batch, 12)
            loss = torch.nn.functional.cross_entropy(logits, torch.from_numpy(labels(rows)))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            out["tower_loss"] = float(loss.detach())
            progress.update(task, advance=1, info=f"loss {out['tower_loss']:.3f}")
    out["tower_accuracy"] = tower_accuracy(model, processor, head, test_images, test_y)
    return out


def caption_examples(renderer: ChatRenderer, seed: int, start: int, n: int,
                     image_size: str = "112", exclude: frozenset[str] = frozenset()
                     ) -> tuple[list[TrainSequence], np.ndarray]:
    """Figures `start`..`start + n - 1` of `seed` as caption sequences, and (n, 4) token ids
    of their four candidate answers (the right one among them)."""
    images, rows = figures(seed, start, n, image_size, exclude)
    seqs, candidates = [], []
    for i, (image, row) in enumerate(zip(images, rows)):
        family = json.loads(row["meta"])["family"]
        messages = [{"role": "user", "content": [{"type": "image"},
                                                 {"type": "text", "text": REQUEST}]},
                    {"role": "assistant", "content": caption(family, row["answer"])}]
        seqs.append(sft_example(renderer, messages, [image], start + i))
        candidates.append([renderer.tokenizer.encode(caption(family, c),
                                                     add_special_tokens=False)[-1]
                           for c in row["choices"]])
    return seqs, np.asarray(candidates, np.int64)


@torch.no_grad()
def caption_accuracy(model, processor, seqs: Sequence[TrainSequence], candidates: np.ndarray
                     ) -> float:
    """Share of `seqs` whose answer token (the last before the turn end) gets the highest logit
    among its row of `candidates` (n, 4)."""
    hits = 0
    for seq, cand in zip(seqs, candidates):
        answer_at = int(np.nonzero(seq.loss_mask)[0][-2])  # the turn-end token follows it
        inputs = packed_inputs(pack([seq], len(seq))[0], processor, model.config)
        logits = model(**inputs, use_cache=False,
                       logits_to_keep=torch.tensor([answer_at - 1])).logits[0, 0]
        best = cand[int(torch.argmax(logits[torch.from_numpy(cand)]))]
        hits += int(best == seq.token_ids[answer_at])
    return hits / max(len(seqs), 1)


def train_captions(model, processor, steps: int, seed: int, lr: float, batch: int = 32,
                   image_size: str = "112", held_out: int = 96,
                   exclude: frozenset[str] = frozenset()) -> dict[str, float]:
    """Stage 2: `steps` supervised caption steps with the vision tower frozen, `batch` fresh
    figures each. Returns the last step's loss (mean per caption token) and the held-out caption
    accuracy before and after."""
    renderer = ChatRenderer(processor, tools=None)
    model.model.visual.requires_grad_(False)
    learner = SFTLearner(model, processor, prime_config(lr, steps))
    test = caption_examples(renderer, seed + HELD_OUT, 0, held_out, image_size, exclude)
    out = {"caption_accuracy_before": caption_accuracy(model, processor, *test)}
    progress = _progress("pretrain tiny vision: caption")
    task = progress.add_task("caption", total=steps, info="")
    with progress:
        for step in range(steps):
            seqs, _ = caption_examples(renderer, seed, step * batch, batch, image_size,
                                       exclude)
            out["caption_loss"] = sft_step(learner, seqs, max(map(len, seqs)) * len(seqs))["loss"]
            progress.update(task, advance=1, info=f"loss {out['caption_loss']:.3f}")
    model.model.visual.requires_grad_(True)
    model.eval()
    out["caption_accuracy"] = caption_accuracy(model, processor, *test)
    return out


def pretrain_vision(model_dir: str, see_steps: int, caption_steps: int, seed: int = 0,
                    see_lr: float = 2e-3, caption_lr: float = 1e-3, batch: int = 32,
                    image_size: str = "112", held_out: int = 96,
                    exclude: frozenset[str] = frozenset()) -> dict[str, float]:
    """Both stages on the checkpoint in `model_dir` (the figures of `seed`, the caption stage's
    from seed + 2 so that it sees other figures than the tower did; `held_out` figures to
    measure each; none with a content key in `exclude`, the run's train and test problems);
    saves the weights back. Returns the stages' losses and held-out accuracies."""
    processor = load_processor(model_dir)
    model = load_model(model_dir)
    out = train_tower(model, processor, see_steps, seed, see_lr, batch, image_size, held_out,
                      exclude)
    out |= train_captions(model, processor, caption_steps, seed + 2, caption_lr, batch,
                          image_size, held_out, exclude)
    save_published(model, model_dir)
    return out
