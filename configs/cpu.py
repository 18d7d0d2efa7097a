"""The embedded CPU default: a tiny Qwen-VL, the synthetic set, 2 cores.

    python -m geo3k_torch.main --config=configs/cpu.py
"""

from configs import base


def get_config():
    c = base.get_config()
    c.data.synthetic_train_size = 256
    c.data.synthetic_test_size = 32
    c.rollout.n_samples = 4
    c.rollout.max_response_tokens = 96
    c.rollout.max_context_tokens = 512
    c.train.steps = 30
    c.train.prompts_per_step = 4
    c.train.micro_batch_tokens = 2048
    return c
