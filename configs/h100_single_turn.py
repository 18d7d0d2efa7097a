r"""slime's single-turn Geometry3K recipe on NVIDIA GPUs: one turn, no tool, the math reward on
the last `\boxed{}` of the answer.

    torchrun --nproc_per_node=8 -m geo3k_torch.main --config=configs/h100_single_turn.py \
        --config.model.path=Qwen/Qwen3-VL-2B-Instruct --config.data.path=hiyouga/geometry3k
    python -m geo3k_torch.main --config=configs/h100_single_turn.py:cpu    # tiny, CPU, 3 steps

Published figure (slime single-turn): train reward 0.3 -> 0.45-0.6 (a user reproduced
about 0.55). Everything else is the multi-turn recipe (`configs/h100.py`): 64 prompts x 8
samples, lr 1e-6, clip 0.2 / 0.28, no KL; here temperature 0.8 and evaluation every 20 steps on
the whole 601-problem test split. `:cpu` shrinks it to the tiny checkpoint and synthetic set.
"""

from configs import cpu, h100


def get_config(arg=None):
    c = h100.get_config()
    c.data.prompt_style = "boxed"  # no tool schema; the system prompt asks for \boxed{}
    c.env.max_turns = 1
    c.reward.source = "boxed"  # the default math reward on the last \boxed{}
    c.rollout.temperature = 0.8
    c.eval.every = 20
    c.eval.max_prompts = 0
    if arg == "cpu":
        cpu.runlocal(c)
    elif arg:
        raise ValueError(f"configs/h100_single_turn.py takes no argument or 'cpu', got {arg!r}")
    return c
