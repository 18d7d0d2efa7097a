"""scripts/retry_probe.py: the scripted contexts hold the environment's own feedback ("repeated"
after the same wrong call twice), and a real checkpoint's third turns are graded, one each."""

import numpy as np
import pytest

from common.data import row_to_prompt
from common.env import REASONS, EnvConfig
from common.prompts import prompt_style
from common.synthetic import PERCEPTION, generate
from configs import cpu_perception
from geo3k_torch.prime import wrong_choices
from tests.script_module import load_script



@pytest.fixture(scope="module")
def retry_probe():
    return load_script("retry_probe")


def _problems(n):
    system, _ = prompt_style("brief")
    rows = generate(n, seed=11, image_size="112", families=PERCEPTION)
    return [row_to_prompt(row, uid=f"p{i}", system=system) for i, row in enumerate(rows)]


def test_the_scripted_contexts_carry_the_environments_feedback(retry_probe):
    env_cfg = EnvConfig(max_turns=3)
    p = _problems(1)[0]
    w1, w2 = wrong_choices(p, env_cfg)[:2]
    messages, env = retry_probe.scripted(p, [w1, w1], env_cfg)
    assert [m["role"] for m in messages[len(p.messages):]][::2] == ["assistant"] * 2
    assert "already tried" in str(messages[-1]["content"])
    assert not env.done and env.turn == 2
    messages, _ = retry_probe.scripted(p, [w1, w2], env_cfg)
    assert "already tried" not in str(messages[-1]["content"])


def test_a_checkpoints_third_turns_are_graded(retry_probe, tmp_path):
    from geo3k_torch.tiny import build_tiny_checkpoint

    model_dir = str(build_tiny_checkpoint(tmp_path / "ckpt", arch="qwen2_5_vl"))
    cfg = cpu_perception.get_config()
    cfg.rollout.max_response_tokens = 8  # a random model writes until the budget
    problems = _problems(3)
    counts = retry_probe.probe(cfg, model_dir, problems, np.random.default_rng(0))
    assert set(counts) == set(retry_probe.CONTEXTS)
    for c in counts.values():
        assert sum(c.values()) == len(problems) and set(c) <= set(REASONS)
