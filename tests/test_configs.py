"""Configs: every default in base.py, sections match the dataclasses, typos are errors."""

import dataclasses
import subprocess
import sys

import pytest

from common.env import EnvConfig
from common.grpo import LossConfig
from common.rollout import RolloutConfig
from common.reward import RewardConfig
from configs import (base, cpu, cpu_perception, h100, h100_areal, h100_moe, h100_single_turn,
                     sft, to_dataclass, tpu, tpu_moe)

SECTIONS = {"env": EnvConfig, "reward": RewardConfig, "rollout": RolloutConfig,
            "loss": LossConfig}


@pytest.mark.parametrize("module", [base, cpu, cpu_perception, h100, tpu, h100_single_turn,
                                    h100_areal, h100_moe, sft, tpu_moe])
def test_sections_build_their_dataclasses(module):
    cfg = module.get_config()
    for name, cls in SECTIONS.items():
        obj = to_dataclass(cls, cfg[name])
        assert dataclasses.asdict(obj) == cfg[name].to_dict()


def test_base_defaults_equal_dataclass_defaults():
    cfg = base.get_config()
    for name, cls in SECTIONS.items():
        assert dataclasses.asdict(cls()) == cfg[name].to_dict(), name


def test_misspelled_key_is_an_error():
    cfg = cpu.get_config()
    with pytest.raises(AttributeError):
        cfg.rollout.n_sample = 3
    with pytest.raises(ValueError, match="unknown"):
        to_dataclass(EnvConfig, {**cfg.env.to_dict(), "max_turn": 2})


def test_tpu_recipe_is_the_anchor_on_the_jax_learner():
    cfg, gpu = tpu.get_config(), h100.get_config()
    for section in ("rollout", "env", "loss", "reward", "advantage"):
        assert cfg[section].to_dict() == gpu[section].to_dict(), section


def test_moe_recipe_is_the_anchor_with_one_server_over_the_node(monkeypatch):
    """configs/h100_moe.py: h100.py's task, loss and advantage; one colocated server over the
    8 GPUs (tp 8, ep 8) that every process uses; the build's own checks pass, and ep 8 splits
    the published 30B-A3B's 128 experts."""
    from common.prepare import check_config
    from common.sglang.backend import check_expert_groups
    from common.sglang.placement import place
    from configs.models import model_shapes

    cfg, anchor = h100_moe.get_config(), h100.get_config()
    for section in ("rollout", "env", "loss", "reward", "advantage", "train"):
        assert cfg[section].to_dict() == anchor[section].to_dict(), section
    assert cfg.loss.router_aux_coef == 0.0 and cfg.train.micro_batch_tokens == "auto"
    plans = [place(cfg.engine, r, r, 8) for r in range(8)]
    assert [s.gpus for s in plans[0].servers] == [tuple(range(8))]
    assert [p.launch for p in plans] == [(0,)] + [()] * 7 and {p.use for p in plans} == {(0,)}
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    check_config(cfg, 8)
    check_expert_groups(cfg.engine.sglang_ep_size, model_shapes("qwen3_vl_30b_a3b"), "30b")
    assert h100_moe.get_config("cpu").model.tiny_arch == "qwen3_vl_moe"


def test_moe_recipe_memory_figures_are_the_models(tmp_path):
    """The per-GPU figures of configs/h100_moe.py's docstring, from the 30B-A3B's shapes (meta
    device): fp32 weights and AdamW's moments sharded 8 ways, the bf16 weights over tp 8, and
    the KV cache per token of a GPU (tp 8 over 4 KV heads: one head each)."""
    import torch
    import transformers

    from configs.models import write_config_dir

    config = transformers.AutoConfig.from_pretrained(
        write_config_dir("qwen3_vl_30b_a3b", tmp_path))
    with torch.device("meta"):
        model = transformers.AutoModelForImageTextToText.from_config(config)
    n, gib, text = sum(p.numel() for p in model.parameters()), 2 ** 30, config.text_config
    assert round(4 * n / 8 / gib, 1) == 14.5 and round(8 * n / 8 / gib, 1) == 28.9
    assert round(2 * n / gib, 1) == 57.9 and round(2 * n / 1e9, 1) == 62.1
    assert round(2 * n / 8 / gib, 1) == 7.2
    heads = max(1, text.num_key_value_heads // h100_moe.get_config().engine.sglang_gpus_per_server)
    assert text.num_hidden_layers * 2 * heads * text.head_dim * 2 == 24 * 2 ** 10


@pytest.mark.slow
def test_tpu_moe_recipe_is_the_tpu_recipe_with_the_30b_on_its_mesh():
    """configs/tpu_moe.py: tpu.py's task, loss, advantage and training with the 30B-A3B; its
    mesh splits the published model evenly (128 experts over `expert`, the 4 KV heads of the
    engine's cache over a host's 4-chip tensor group: one a chip); its `cpu` form is the tiny
    MoE on whatever devices the host has."""
    from configs.models import model_shapes

    cfg, anchor = tpu_moe.get_config(), tpu.get_config()
    for section in ("rollout", "env", "loss", "reward", "advantage", "train"):
        assert cfg[section].to_dict() == anchor[section].to_dict(), section
    assert cfg.model.path == "Qwen/Qwen3-VL-30B-A3B-Instruct" and cfg.loss.router_aux_coef == 0
    mesh = cfg.jax.mesh
    assert (mesh.data, mesh.fsdp, mesh.expert, mesh.tensor) == (1, -1, 2, 4)
    text = model_shapes("qwen3_vl_30b_a3b")["text_config"]
    assert text["num_experts"] % mesh.expert == 0
    assert text["num_key_value_heads"] == mesh.tensor
    small = tpu_moe.get_config("cpu")
    assert small.model.path == "" and small.model.tiny_arch == "qwen3_vl_moe"
    assert (small.jax.mesh.expert, small.jax.mesh.tensor) == (1, 1)
    with pytest.raises(ValueError, match="no argument or 'cpu'"):
        tpu_moe.get_config("v6e")


def test_tpu_recipe_without_a_tpu_stops_with_a_clear_message(tmp_path):
    for extra in ([], ["--config.jax.distributed=False"]):  # as shipped, and on one host
        proc = subprocess.run([sys.executable, "-m", "geo3k_jax.train", "--config=configs/tpu.py",
                               f"--workdir={tmp_path}", *extra],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0, extra
        assert "TPU" in proc.stderr + proc.stdout and "Traceback" not in proc.stderr, \
            proc.stderr[-2000:]


def test_command_line_typo_is_rejected(tmp_path):
    code = ("from absl import app\nfrom ml_collections import config_flags\n"
            "C = config_flags.DEFINE_config_file('config')\n"
            "app.run(lambda _: print(C.value.rollout.n_samples))\n")
    ok = subprocess.run([sys.executable, "-c", code, "--config=configs/cpu.py",
                         "--config.rollout.n_samples=3"], capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.strip() == "3", ok.stderr
    bad = subprocess.run([sys.executable, "-c", code, "--config=configs/cpu.py",
                          "--config.rollout.n_sample=3"], capture_output=True, text=True)
    assert bad.returncode != 0 and "n_sample" in bad.stderr


def test_engine_backend_names():
    """local (the learner's own framework), torch and sglang run; anything else stops before a
    model is built."""
    from common.prepare import check_config
    for name in ("local", "torch", "sglang"):
        cfg = cpu.get_config()
        cfg.engine.backend = name
        check_config(cfg, 1)
    cfg.engine.backend = "jax"
    with pytest.raises(ValueError, match="engine.backend"):
        check_config(cfg, 1)
