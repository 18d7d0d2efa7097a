"""Score a checkpoint on a split: first-try accuracy vs accuracy with feedback, and the rest.

    python -m geo3k_torch.evaluate --run=runs/<run>                  # its newest checkpoint
    python -m geo3k_torch.evaluate --run=runs/<run>/checkpoints/step_40 --split=train
    python -m geo3k_torch.evaluate --config=configs/cpu_perception.py \\
        --config.model.path=Qwen/Qwen3-VL-2B-Instruct --out=eval/base     # any checkpoint
    python -m geo3k_torch.evaluate --config=configs/h100.py --config.model.path=/ckpt \\
        --config.engine.sglang_urls=http://host:30000 --out=/ckpt/eval    # SGLang serves it

With `--run` (a run folder of `geo3k_torch.main` or `geo3k_jax.train`, or one of its
checkpoints) the checkpoint is evaluated with the config the run trained with, <run>/config.json
(`common.run_folder`): its data, prompt style, tool format, turns and reward. `--config.<key>`
overrides still apply on top, and each that changes what the run trained on is printed as a
warning; `--config=<file>` takes that file's settings instead of the run's (warned alike). The
report goes to <run>/eval_<step> unless `--out` says otherwise. Without `--run`, the config
file (default configs/cpu_perception.py) and `model.path` (empty: its tiny checkpoint).

Rollouts come from `engine.backend`: the in-process torch engine (`local` or `torch`), or
SGLang (`sglang`: the servers in `engine.sglang_urls`, which must serve `model.path`, or servers
launched here on it). `eval.max_prompts` (0 = all) prompts of the split, greedy plus
`eval.n_samples` sampled episodes each; with `--blank_images` (default: `eval.blank_images`)
greedy once more with every image blanked. Writes eval.json, eval.md and eval.png into the
output folder (`common.evaluation.report`) and prints the tables. The metrics are
`common.evaluation.evaluate`'s.
"""

from __future__ import annotations

DEFAULT_CONFIG = "configs/cpu_perception.py"


def define_flags(flag_values=None) -> None:
    """This command's flags on `flag_values` (absl's global flags by default); imports no
    torch (--help lists them before it loads)."""
    from absl import flags
    from ml_collections import config_flags
    fv = flags.FLAGS if flag_values is None else flag_values
    config_flags.DEFINE_config_file("config", DEFAULT_CONFIG, "Config file (with --run: replaces "
                                    "the run's config).", lock_config=True, flag_values=fv)
    flags.DEFINE_string("run", None, "A run folder (its newest complete checkpoint) or one of its "
                        "checkpoints, evaluated with the run's own config.json.", flag_values=fv)
    flags.DEFINE_enum("split", "test", ["train", "test"], "Which split to score.",
                      flag_values=fv)
    flags.DEFINE_string("out", None, "Folder for eval.json, eval.md and eval.png (default: "
                        "<run>/eval_<step> with --run, else eval).", flag_values=fv)
    flags.DEFINE_bool("blank_images", None, "Also run greedy with every image replaced by a white "
                      "one of its size (the 'blank images' column, blank/* keys); default: the "
                      "config's eval.blank_images.", flag_values=fv)


if __name__ == "__main__":  # --help, a bad --config.<key> or value: answered before torch loads
    from common import cli
    cli.preflight(DEFAULT_CONFIG, define=define_flags)

import sys
from pathlib import Path

import torch
from absl import app, flags, logging

from common import run_folder
from common.backends import make_backend
from common.config_help import USAGE_ERROR
from common.evaluation.report import markdown, write_report
from common.learner import SingleProcess
from common.processor import load_processor
from common.prepare import make_renderer, prepare_data
from common.train import evaluate_split
from geo3k_torch.prepare import prepare_model_dir, resolve_device


def eval_backend(cfg, model_dir: str, processor, device, workdir: str):
    """The configured rollout backend serving `model_dir` (its `.engine` generates)."""
    def own():
        from geo3k_torch.backend import LocalBackend, engine_settings
        from geo3k_torch.model import load_model
        model = load_model(model_dir, device=device).eval().requires_grad_(False)
        return LocalBackend(processor, model_dir, seed=cfg.seed, device=device,
                            comm=SingleProcess(), model=model,
                            **engine_settings(cfg) | {"record_routing": False})
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


def of_run(run: str, parsed, argv: list[str]):
    """(config, default output folder) for `--run=run` (`common.run_folder.evaluation_config`),
    its notes logged and its warnings printed; exit status 2 where `--run` cannot be used."""
    try:
        plan = run_folder.evaluation_config(run, parsed, argv)
    except run_folder.RunError as e:
        sys.stderr.write(f"error: {e}\n")
        sys.exit(USAGE_ERROR)
    for note in plan.notes:
        logging.info("%s", note)
    for line in plan.warnings:
        print(f"warning: {line}", file=sys.stderr, flush=True)
    print(f"evaluating {plan.checkpoint} with {plan.folder / run_folder.RECORD}", flush=True)
    return plan.cfg, str(plan.out)


def main(argv):
    del argv
    cfg, out = flags.FLAGS.config, flags.FLAGS.out
    if flags.FLAGS.run:
        cfg, run_out = of_run(flags.FLAGS.run, cfg, sys.argv)
        out = out or run_out
    out = out or "eval"
    if flags.FLAGS.blank_images is not None:
        cfg.eval.blank_images = flags.FLAGS.blank_images
    split = flags.FLAGS.split
    metrics = run(cfg, split, out)
    model = cfg.model.path or cfg.model.tiny_dir
    title = (f"{'/'.join(Path(model).parts[-3:])} on {split} "
             f"({int(metrics['greedy_trajectories'])} problems, "
             f"{cfg.eval.n_samples} samples each, ≤{cfg.env.max_turns} turns)")
    out = write_report(metrics, out, title, cfg.env.max_turns)
    print(markdown(metrics, cfg.env.max_turns, title))
    print(f"wrote {out}/eval.json, eval.md, eval.png")


if __name__ == "__main__":
    define_flags()
    app.run(main)
