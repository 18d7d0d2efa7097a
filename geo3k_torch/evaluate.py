"""Score a checkpoint on a split: first-try accuracy vs accuracy with feedback, and the rest.

    python -m geo3k_torch.evaluate --config=configs/cpu_perception.py \
        --config.model.path=runs/demo/checkpoints/step_200 --out=runs/demo/eval [--split=test]
    python -m geo3k_torch.evaluate --config=configs/h100.py --config.model.path=/ckpt \
        --config.engine.sglang_urls=http://host:30000 --out=/ckpt/eval    # SGLang serves it

Rollouts come from `engine.backend`: the in-process torch engine (`local` or `torch`), or
SGLang (`sglang`: the servers in `engine.sglang_urls`, which must serve `model.path`, or servers
launched here on it). `eval.max_prompts` (0 = all) prompts of the split, greedy plus `eval.n_samples` sampled
episodes each; with `--blank_images` (default: `eval.blank_images`) greedy once more with every
image blanked. Writes eval.json, eval.md and eval.png into --out (`common.evaluation.report`) and
prints the tables. The metrics are `common.evaluation.evaluate`'s.
"""

from __future__ import annotations

if __name__ == "__main__":  # a bad --config.<key> answered before torch loads
    from common import cli
    cli.preflight("configs/cpu_perception.py", with_help=False)

from pathlib import Path

import torch
from absl import app, flags
from ml_collections import config_flags

from common.backends import make_backend
from common.evaluation.report import markdown, write_report
from common.learner import SingleProcess
from common.processor import load_processor
from common.prepare import make_renderer, prepare_data
from common.train import evaluate_split
from geo3k_torch.prepare import prepare_model_dir, resolve_device

_CONFIG = config_flags.DEFINE_config_file("config", "configs/cpu_perception.py", "Config.",
                                          lock_config=True)
_SPLIT = flags.DEFINE_enum("split", "test", ["train", "test"], "Which split to score.")
_OUT = flags.DEFINE_string("out", "eval", "Folder for eval.json, eval.md and eval.png.")
_BLANK = flags.DEFINE_bool(
    "blank_images", None, "Also run greedy with every image replaced by a white one of its size "
    "(the 'blank images' column, blank/* keys); default: the config's eval.blank_images.")


def eval_backend(cfg, model_dir: str, processor, device, workdir: str):
    """The configured rollout backend serving `model_dir` (its `.engine` generates)."""
    def own():
        from geo3k_torch.backend import LocalBackend, engine_settings
        from geo3k_torch.model import load_model
        model = load_model(model_dir).to(device).eval().requires_grad_(False)
        return LocalBackend(processor, model_dir, seed=cfg.seed, device=device,
                            comm=SingleProcess(), model=model, **engine_settings(cfg))
    return make_backend(cfg, own=own, own_kind="torch", model_dir=model_dir, processor=processor,
                        workdir=workdir, comm=SingleProcess())


def run(cfg, split: str = "test", workdir: str = "eval") -> dict:
    """Evaluation metrics of `cfg.model.path` (or the tiny checkpoint) on a split."""
    device = resolve_device(cfg)
    train_set, test_set = prepare_data(cfg)  # first: a bad data.path fails before the model
    model_dir = prepare_model_dir(cfg)
    processor = load_processor(model_dir)
    torch.manual_seed(cfg.seed)
    backend = eval_backend(cfg, model_dir, processor, device, workdir)
    try:
        return evaluate_split(cfg, test_set if split == "test" else train_set, backend.engine,
                              make_renderer(cfg, processor),
                              episodes=Path(workdir) / "episodes.jsonl")
    finally:
        backend.close()


def main(argv):
    del argv
    cfg = _CONFIG.value
    if _BLANK.value is not None:
        cfg.eval.blank_images = _BLANK.value
    metrics = run(cfg, _SPLIT.value, _OUT.value)
    model = cfg.model.path or cfg.model.tiny_dir
    title = (f"{'/'.join(Path(model).parts[-3:])} on {_SPLIT.value} "
             f"({int(metrics['greedy_trajectories'])} problems, "
             f"{cfg.eval.n_samples} samples each, ≤{cfg.env.max_turns} turns)")
    out = write_report(metrics, _OUT.value, title, cfg.env.max_turns)
    print(markdown(metrics, cfg.env.max_turns, title))
    print(f"wrote {out}/eval.json, eval.md, eval.png")


if __name__ == "__main__":
    app.run(main)
