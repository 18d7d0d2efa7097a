"""Configs: every default in base.py, sections match the dataclasses, typos are errors."""

import dataclasses
import subprocess
import sys

import pytest

from common.env import EnvConfig
from common.grpo import LossConfig
from common.rollout import RolloutConfig
from common.reward import RewardConfig
from configs import (base, cpu, cpu_perception, h100, h100_areal, h100_single_turn, sft,
                     to_dataclass, tpu)

SECTIONS = {"env": EnvConfig, "reward": RewardConfig, "rollout": RolloutConfig,
            "loss": LossConfig}


@pytest.mark.parametrize("module", [base, cpu, cpu_perception, h100, tpu, h100_single_turn,
                                    h100_areal, sft])
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


@pytest.mark.slow
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
