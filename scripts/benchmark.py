"""Throughput of the torch path on a config: rollout tokens/s, learner tokens/s, packing efficiency.

    python scripts/benchmark.py --config=configs/cpu.py [--rounds=3] [--config.train.device=cuda]

Each round: one rollout of `train.prompts_per_step` prompts x `rollout.n_samples` episodes with
the local engine, then one learner step on every trajectory (random advantages, so nothing is
filtered). Prints a table of the mean over rounds after a warm-up round ("sequences" tokens/s
counts every sequence's tokens, "packed" the tokens computed: a shared prompt once per group).
Timing never decides a test; this script is where speed is measured (docs/benchmarks.md).
"""

from __future__ import annotations

import time

import numpy as np
import torch
from absl import app, flags
from ml_collections import config_flags

from common.batching import pack, packing_efficiency, training_sequences
from common.env import EnvConfig
from common.learner import SingleProcess
from common.grpo import LossConfig
from common.processor import load_processor
from common.rollout import RolloutConfig, rollout
from common.sampler import PromptSampler
from common.reward import RewardConfig
from common.prepare import make_renderer, prepare_data
from configs import to_dataclass
from geo3k_torch.engine import LocalEngine
from geo3k_torch.learner import Learner
from geo3k_torch.memory import resolve as resolve_micro_batch
from geo3k_torch.model import load_model
from geo3k_torch.prepare import prepare_model_dir, resolve_device

_CONFIG = config_flags.DEFINE_config_file("config", "configs/cpu.py", "Config.", lock_config=True)
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Measured rounds (after one warm-up round).")
_ATTN = flags.DEFINE_string("attn", "packed_sdpa", "The learner's attention: packed_sdpa "
                            "(per sequence of a packed row) or sdpa (block-diagonal mask).")


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def main(argv):
    del argv
    cfg = _CONFIG.value
    if cfg.train.share_prefix and _ATTN.value != "packed_sdpa":
        raise app.UsageError(f"--attn={_ATTN.value} cannot train shared prefixes: add "
                             "--config.train.share_prefix=False")
    device = resolve_device(cfg)
    torch.manual_seed(cfg.seed)
    model_dir = prepare_model_dir(cfg)
    train_set, _ = prepare_data(cfg)
    processor = load_processor(model_dir)
    dtype = torch.bfloat16 if device.type == "cuda" and cfg.train.bf16 else torch.float32
    model = load_model(model_dir, attn=_ATTN.value, device=device)
    pad = processor.tokenizer.pad_token_id
    engine = LocalEngine(model, processor, pad if pad is not None else 0, cfg.seed, device)
    learner = Learner(model, processor, to_dataclass(LossConfig, cfg.loss), cfg.train,
                      cfg.rollout.temperature, device)
    resolve_micro_batch(cfg, learner, SingleProcess())  # "auto": measured on this learner
    roll_cfg = to_dataclass(RolloutConfig, cfg.rollout)
    renderer = make_renderer(cfg, processor)
    sampler = PromptSampler(len(train_set), cfg.seed)
    rng = np.random.default_rng(0)
    rows = []
    for r in range(_ROUNDS.value + 1):
        prompts = [train_set[i] for i in sampler.next_batch(cfg.train.prompts_per_step)]
        _sync(device)
        t0 = time.perf_counter()
        trajs = rollout(prompts, engine, renderer, roll_cfg, to_dataclass(EnvConfig, cfg.env),
                        to_dataclass(RewardConfig, cfg.reward))
        _sync(device)
        t1 = time.perf_counter()
        seqs = training_sequences(trajs, rng.normal(size=len(trajs)), roll_cfg.export_style)
        batches = pack(seqs, cfg.train.micro_batch_tokens,
                       processor.image_token_id if cfg.train.share_prefix else None)
        n_tok = float(sum(s.loss_mask.sum() for s in seqs))
        t2 = time.perf_counter()
        learner.train_step(batches, n_tok, float(len(seqs)))
        engine.clear_cache()
        _sync(device)
        t3 = time.perf_counter()
        if r == 0:
            continue  # warm-up
        rows.append({
            "rollout generated tokens/s": sum(t.num_generated for t in trajs) / (t1 - t0),
            "learner tokens/s (sequences)": sum(map(len, seqs)) / (t3 - t2),
            "learner tokens/s (packed)": sum(b.num_tokens for b in batches) / (t3 - t2),
            "packing efficiency": packing_efficiency(batches, cfg.train.micro_batch_tokens),
            "micro-batches": float(len(batches)),
            "rollout s / step": t1 - t0, "train s / step": t3 - t2})
    print(f"\nconfig: {cfg.model.path or cfg.model.tiny_dir}, device {device}, dtype {dtype}, "
          f"attention {_ATTN.value}, shared prefixes {cfg.train.share_prefix}, "
          f"{cfg.train.prompts_per_step} prompts x {cfg.rollout.n_samples} samples, "
          f"micro-batch budget {cfg.train.micro_batch_tokens} tokens, {_ROUNDS.value} rounds")
    print(f"| {'quantity':<28} | {'mean':>10} |")
    print(f"|{'-' * 30}|{'-' * 12}|")
    for key in rows[0]:
        print(f"| {key:<28} | {np.mean([row[key] for row in rows]):>10.2f} |")


if __name__ == "__main__":
    app.run(main)
