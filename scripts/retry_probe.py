"""What a checkpoint's greedy last turn does after two rejected calls, scripted.

    python scripts/retry_probe.py --config=configs/cpu_perception.py \
        --models=data/tiny-qwen2_5_vl-captioned-new,runs/n0/checkpoints/step_200

For every problem of the config's test split, two contexts: turn 1 a wrong choice w and turn 2
the same w again ("repeat": the environment's "repeated" feedback follows it) or another wrong
choice ("distinct"), each call followed by the environment's own feedback. The checkpoint then
writes turn 3 greedily (the torch engine), and the environment grades it: the table counts its
reasons (correct, wrong, repeated, malformed_json, no_tool_call, ...). A policy that read the
feedback and kept the format would write a valid call in both contexts and never repeat; one
that knows nothing of the figure is right 1 in 3 after "repeat" and 1 in 2 after "distinct"
(with 4 choices). The checkpoints are only read (docs/results.md, the eighth attempt).
"""

from __future__ import annotations

import collections

import numpy as np
import torch
from absl import app, flags
from ml_collections import config_flags

from common.engine import Request, SamplingParams
from common.env import Geo3kEnv
from common.learner import SingleProcess
from common.prepare import make_renderer, prepare_data
from common.processor import load_processor
from common.train import step_config
from geo3k_torch.backend import LocalBackend
from geo3k_torch.model import load_model
from geo3k_torch.prime import format_target, wrong_choices

CONTEXTS = ("repeat", "distinct")


def scripted(prompt, calls: list[int], env_cfg) -> tuple[list[dict], Geo3kEnv]:
    """`prompt`'s messages with one assistant call per index of `calls` (a choice's value, as
    the primed checkpoints answer), each followed by the environment's feedback; the
    environment, ready to grade the next turn."""
    env = Geo3kEnv(prompt.answer, env_cfg, choices=prompt.choices)
    messages = list(prompt.messages)
    for k in calls:
        reply = format_target(prompt.choices[k])
        messages.append({"role": "assistant", "content": reply})
        messages.append(Geo3kEnv.format_observation(env.step(reply)[0]))
    return messages, env


def probe(cfg, model_dir: str, problems, rng: np.random.Generator) -> dict[str, collections.Counter]:
    """Per context, the environment's reasons for the greedy third turns of `problems`."""
    env_cfg = step_config(cfg).env
    if env_cfg.max_turns < 3:
        raise ValueError(f"env.max_turns={env_cfg.max_turns}: the probe scripts two turns and "
                         "grades a third")
    processor = load_processor(model_dir)
    renderer = make_renderer(cfg, processor)
    model = load_model(model_dir).eval().requires_grad_(False)
    backend = LocalBackend(processor, model_dir, seed=cfg.seed, device=torch.device("cpu"),
                           comm=SingleProcess(), model=model)
    out = {}
    try:
        for context in CONTEXTS:
            requests, envs = [], []
            for i, p in enumerate(problems):
                wrong = wrong_choices(p, env_cfg)
                if len(wrong) < 2:
                    continue
                w1, w2 = (int(k) for k in rng.choice(wrong, 2, replace=False))
                messages, env = scripted(p, [w1, w1] if context == "repeat" else [w1, w2],
                                         env_cfg)
                sampling = SamplingParams(0.0, 1.0, cfg.rollout.max_response_tokens,
                                          renderer.stop_token_ids)
                requests.append(Request(renderer.prompt_ids(messages, p.images), p.images,
                                        sampling, session=f"{context}-{i}"))
                envs.append(env)
            completions = backend.engine.generate(requests)
            out[context] = collections.Counter(
                env.step(renderer.decode(c.token_ids))[2]["reason"]
                for env, c in zip(envs, completions))
    finally:
        backend.close()
    return out


def main(argv):
    del argv
    cfg = flags.FLAGS.config
    torch.manual_seed(cfg.seed)
    _, test = prepare_data(cfg)
    problems = [p for p in test if p.choices]
    if not problems:
        raise SystemExit("the test split has no problems with choices to probe")
    print(f"{len(problems)} problems; greedy turn 3 after two rejected calls")
    for model_dir in flags.FLAGS.models:
        cfg.model.path = model_dir
        counts = probe(cfg, model_dir, problems, np.random.default_rng(flags.FLAGS.seed))
        for context, c in counts.items():
            n = sum(c.values())
            shares = ", ".join(f"{k} {v}" for k, v in c.most_common())
            print(f"{model_dir}  {context:8s} n={n}: {shares}")


if __name__ == "__main__":  # the flags only here: tests import `probe` beside other scripts
    config_flags.DEFINE_config_file("config", "configs/cpu_perception.py", "Config.")
    flags.DEFINE_list("models", None, "Checkpoint directories to probe.", required=True)
    flags.DEFINE_integer("seed", 0, "Draws the wrong choices of the scripted turns.")
    app.run(main)
