"""Score a checkpoint on a split with the local engine.

    python -m geo3k_torch.evaluate --config=configs/cpu.py \
        --config.model.path=runs/demo/checkpoints/step_30 [--split=test] [--out=eval.json]

Prints (and writes with --out) greedy and sampled accuracy, accuracy by turn (solved_turn_k),
mean turns, tool-call rate, response length, truncated / aborted counts.
"""

from __future__ import annotations

import json

import torch
from absl import app, flags
from ml_collections import config_flags

from common.chat import ChatRenderer
from common.env import EnvConfig
from common.evaluate import evaluate
from common.processor import load_processor
from common.rollout import RolloutConfig
from common.scoring import RewardConfig
from common.setup import prepare_data
from configs import to_dataclass
from geo3k_torch.engine import LocalEngine
from geo3k_torch.model import load_model
from geo3k_torch.setup import prepare_model_dir, resolve_device

_CONFIG = config_flags.DEFINE_config_file("config", "configs/cpu.py", "Config.", lock_config=True)
_SPLIT = flags.DEFINE_enum("split", "test", ["train", "test"], "Which split to score.")
_OUT = flags.DEFINE_string("out", None, "Write the metrics as JSON here too.")


def run(cfg, split: str = "test") -> dict:
    """Evaluation metrics of `cfg.model.path` (or the tiny checkpoint) on a split."""
    device = resolve_device(cfg)
    model_dir = prepare_model_dir(cfg)
    train_set, test_set = prepare_data(cfg)
    data = test_set if split == "test" else train_set
    n = len(data) if not cfg.eval.max_prompts else min(cfg.eval.max_prompts, len(data))
    processor = load_processor(model_dir)
    model = load_model(model_dir).to(device).eval()
    pad = processor.tokenizer.pad_token_id
    engine = LocalEngine(model, processor, pad if pad is not None else 0, cfg.seed, device)
    torch.manual_seed(cfg.seed)
    renderer = ChatRenderer(processor, tool_format=cfg.model.tool_format)
    return evaluate([data[i] for i in range(n)], engine, renderer,
                    to_dataclass(RolloutConfig, cfg.rollout), to_dataclass(EnvConfig, cfg.env),
                    to_dataclass(RewardConfig, cfg.reward), n_samples=cfg.eval.n_samples)


def main(argv):
    del argv
    metrics = run(_CONFIG.value, _SPLIT.value)
    text = json.dumps(metrics, indent=2, sort_keys=True)
    print(text)
    if _OUT.value:
        with open(_OUT.value, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    app.run(main)
