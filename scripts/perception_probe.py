"""How many labelled examples a checkpoint needs before its answer reads the figure.

    python scripts/perception_probe.py --model=data/tiny-qwen3_vl-small --lr=1e-3 --steps=150

Supervised steps (`geo3k_torch.learner.SFTLearner`, AdamW at a constant lr) on perception
problems (`common.synthetic.PERCEPTION`, drawn afresh: seed 777 to train, 778 held out) with the
right tool call as the target, answering by the choice's letter or its value (`--answer`), in a
prompt style (`--prompt_style`). Every `--every` steps it prints the held-out accuracy: the share
of held-out problems whose answer token gets the highest logit among the four choices' tokens,
teacher-forced (chance 0.25). An upper bound on what GRPO's reward can teach in as many episodes
(docs/results.md, the fourth attempt). `--freeze_vision` trains the language model alone. The
checkpoint directory is only read.

`--reach` also prints, before and after the steps, how much of the hidden state at the position
that predicts the answer the figure moves, after the embeddings, each decoder layer and the final
norm: within a family the prompt's text is the same for every problem (the choices are in their
natural order), so the state varies with the figure alone; the share is the RMS of that variation
over the norm of the family's mean state, averaged over the families (docs/results.md, the fifth
attempt: the priming shrinks it from about 0.1 to 0.002).
"""

from __future__ import annotations

import tempfile
import time

import numpy as np
import torch
from absl import app, flags

from common.batching import pack
from common.chat import ChatRenderer
from common.data import load_split
from common.processor import load_processor
from common.prompts import PROMPT_STYLES, prompt_style
from common.sft import sft_example, sft_messages
from common.synthetic import PERCEPTION, problem_kind, write_split
from geo3k_torch.learner import SFTLearner, sft_step
from geo3k_torch.model import load_model, packed_inputs
from geo3k_torch.prime import PRIME_ANSWERS, format_target, prime_config

_TRAIN, _HELD_OUT = 1024, 96


def define_flags() -> None:
    """The command line's flags, defined when the probe runs as a script only: imported (its
    test), it leaves absl's global flags to the modules that own them."""
    flags.DEFINE_string("model", None, "a (tiny) Qwen-VL checkpoint directory", required=True)
    flags.DEFINE_float("lr", 1e-3, "AdamW's constant learning rate")
    flags.DEFINE_integer("batch", 8, "labelled problems a step")
    flags.DEFINE_integer("steps", 150, "supervised steps")
    flags.DEFINE_integer("every", 25, "steps between held-out evaluations")
    flags.DEFINE_enum("answer", "letter", PRIME_ANSWERS, "the call answers by")
    flags.DEFINE_enum("prompt_style", "brief", sorted(PROMPT_STYLES), "data.prompt_style")
    flags.DEFINE_bool("freeze_vision", False, "leave the vision tower untrained")
    flags.DEFINE_bool("reach", False, "print the figure's share of the answer's state")


def examples(renderer, prompts, answer: str) -> list[tuple]:
    """(sequence, the four candidate answer token ids) of each prompt, its right call the
    target."""
    out = []
    for i, p in enumerate(prompts):
        k = p.choices.index(p.answer)
        texts = [chr(ord("A") + j) for j in range(len(p.choices))] if answer == "letter" \
            else list(p.choices)
        seq = sft_example(renderer, sft_messages(p, format_target(texts[k])), p.images, i)
        out.append((seq, [renderer.tokenizer.encode(t, add_special_tokens=False)[-1]
                          for t in texts]))
    return out


@torch.no_grad()
def accuracy(model, processor, held_out) -> float:
    """Share of `held_out` whose answer token has the highest logit among its candidates."""
    model.eval()
    hits = 0
    for seq, candidates in held_out:
        ids = seq.token_ids
        at = answer_position(seq, candidates)
        inputs = packed_inputs(pack([seq], len(seq))[0], processor, model.config)
        logits = model(**inputs, use_cache=False,
                       logits_to_keep=torch.tensor([at - 1])).logits[0, 0]
        hits += int(candidates[int(torch.argmax(logits[candidates]))] == ids[at])
    model.train()
    return hits / len(held_out)


def answer_position(seq, candidates) -> int:
    """Index of the (last) trained token of `seq` that is one of the `candidates` token ids."""
    return max(k for k in np.flatnonzero(seq.loss_mask) if seq.token_ids[k] in candidates)


@torch.no_grad()
def figure_reach(model, processor, held_out, families) -> np.ndarray:
    """(layers + 1,) the figure's share of the state that predicts the answer, per hidden state
    transformers returns (embeddings, each layer's output, the last one after the final norm):
    RMS over a family's problems of the state about the family's mean, over that mean's norm,
    averaged over the `families` ((N,) names, one per held-out example)."""
    model.eval()
    states = []
    for seq, candidates in held_out:
        at = answer_position(seq, candidates)
        inputs = packed_inputs(pack([seq], len(seq))[0], processor, model.config)
        hidden = model(**inputs, use_cache=False, output_hidden_states=True).hidden_states
        states.append(torch.stack([h[0, at - 1] for h in hidden]).float().numpy())
    model.train()
    states, families = np.stack(states), np.asarray(families)  # (N, layers + 1, hidden)
    shares = []
    for family in np.unique(families):
        x = states[families == family]
        mean = x.mean(0)  # (layers + 1, hidden)
        spread = np.sqrt(((x - mean) ** 2).sum(-1).mean(0))
        shares.append(spread / np.linalg.norm(mean, axis=-1))
    return np.mean(shares, axis=0)


def print_reach(model, processor, held_out, families) -> None:
    shares = figure_reach(model, processor, held_out, families)
    names = ["embeddings"] + [f"layer {k}" for k in range(1, len(shares) - 1)] + ["final norm"]
    print("figure's share of the answer's state: "
          + ", ".join(f"{n} {v:.4f}" for n, v in zip(names, shares)), flush=True)


def main(argv) -> None:
    del argv
    FLAGS = flags.FLAGS
    torch.manual_seed(0)
    system, tools = prompt_style(FLAGS.prompt_style)
    with tempfile.TemporaryDirectory() as data:
        write_split(data, "train", _TRAIN, seed=777, image_size="112", families=PERCEPTION)
        write_split(data, "test", _HELD_OUT, seed=778, image_size="112", families=PERCEPTION)
        train = load_split(data, split="train", system=system).prompts
        test = load_split(data, split="test", system=system).prompts
    processor = load_processor(FLAGS.model)
    renderer = ChatRenderer(processor, tools=tools)
    model = load_model(FLAGS.model)
    learner = SFTLearner(model, processor,
                         prime_config(FLAGS.lr, FLAGS.steps, FLAGS.freeze_vision))
    train_examples = examples(renderer, train, FLAGS.answer)
    held_out = examples(renderer, test, FLAGS.answer)
    families = [problem_kind(p.problem) for p in test]
    if FLAGS.reach:
        print_reach(model, processor, held_out, families)
    rng, start = np.random.default_rng(0), time.perf_counter()
    print(f"step 0: held-out accuracy {accuracy(model, processor, held_out):.2f}")
    for step in range(1, FLAGS.steps + 1):
        seqs = [train_examples[i][0] for i in rng.choice(len(train), FLAGS.batch,
                                                          replace=False)]
        loss = sft_step(learner, seqs, max(map(len, seqs)) * len(seqs))["loss"]
        if step % FLAGS.every == 0:
            print(f"step {step} ({step * FLAGS.batch} examples): loss {loss:.3f} a token, "
                  f"held-out accuracy {accuracy(model, processor, held_out):.2f}, "
                  f"{time.perf_counter() - start:.0f} s", flush=True)
    if FLAGS.reach:
        print_reach(model, processor, held_out, families)


if __name__ == "__main__":
    define_flags()
    app.run(main)
