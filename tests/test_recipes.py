"""Every recipe config: its CPU form (`:cpu`) running a few steps here, the SFT recipe's GPU form
refusing a machine without CUDA with a clear message."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from configs import h100_areal, h100_moe, h100_single_turn
from geo3k_torch import main as train_main

ROOT = Path(__file__).resolve().parents[1]


def local(module, arg, shared):
    """The recipe's CPU form, on a private tiny checkpoint and synthetic set."""
    cfg = module.get_config(arg)
    cfg.model.tiny_dir = str(shared / f"tiny-{cfg.model.tiny_arch}")
    cfg.model.tiny_prime_steps = 0
    cfg.data.synthetic_dir = str(shared / "data")
    cfg.data.synthetic_train_size, cfg.data.synthetic_test_size = 8, 2
    return cfg


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    return tmp_path_factory.mktemp("recipes")


def test_a_recipe_argument_it_does_not_know_is_an_error():
    with pytest.raises(ValueError, match="argument"):
        h100_single_turn.get_config("gpu")


@pytest.mark.slow
@pytest.mark.parametrize("module, arg", [(h100_single_turn, "cpu"),
                                         (h100_areal, "cpu,individual"), (h100_moe, "cpu")],
                         ids=["single_turn", "areal", "moe"])
def test_grpo_recipe_runs_on_cpu(module, arg, shared, tmp_path):
    last = train_main.train(local(module, arg, shared), str(tmp_path))
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # step 0: the evaluation before training
    rows = rows[1:]
    assert last["train/trajectories"] == 6.0  # 2 prompts x 3 samples
    assert "eval/greedy_first_try_accuracy" in last and "eval/sampled_pass_at_2" in last
    assert (tmp_path / "checkpoints" / "step_3" / "model.safetensors").exists()
    dump = [json.loads(x) for x in (tmp_path / "rollouts" / "step_1.jsonl").read_text()
            .splitlines()]
    system = dump[0]["text"].split("<|im_end|>")[0]
    if module is h100_single_turn:  # one turn, no tool advertised
        assert all(len(d["turns"]) == 1 for d in dump)
        assert "\\boxed{}" in system and "<tools>" not in system
    else:
        assert "<tools>" in system and max(len(d["turns"]) for d in dump) <= 4


@pytest.mark.slow
def test_sft_recipe_without_cuda_stops_with_a_clear_message(tmp_path):
    """geo3k_torch.sft's own check (the GRPO recipes share geo3k_torch.main's, tested with
    configs/h100.py in test_train_loop.py)."""
    proc = subprocess.run([sys.executable, "-m", "geo3k_torch.sft", "--config=configs/sft.py",
                           f"--workdir={tmp_path}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "needs a CUDA GPU" in proc.stderr + proc.stdout
