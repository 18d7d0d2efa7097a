"""The embedded CPU default: a tiny Qwen-VL, the synthetic set, 2 cores.

    python -m geo3k_torch.main --config=configs/cpu.py
"""

from configs import base


def get_config():
    c = base.get_config()
    c.data.synthetic_train_size = 256
    c.data.synthetic_test_size = 32
    # A random tiny model never writes a tool call: give it the format first (geo3k_torch/prime.py;
    # the letter it answers is uniform, so what it learns about the answers comes from GRPO).
    c.model.tiny_prime_steps = 150
    c.rollout.n_samples = 8
    c.rollout.max_response_tokens = 96
    c.rollout.max_context_tokens = 512
    c.train.steps = 60
    c.train.prompts_per_step = 4
    c.train.micro_batch_tokens = 2048
    c.train.lr = 3e-4
    c.eval.every = 20
    return c
