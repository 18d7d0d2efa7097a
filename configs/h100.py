"""slime's multi-turn recipe on NVIDIA GPUs: Qwen3-VL-2B-Instruct, multi-turn Geometry3K.

    torchrun --nproc_per_node=8 -m geo3k_torch.main --config=configs/h100.py \
        --config.model.path=Qwen/Qwen3-VL-2B-Instruct --config.data.path=hiyouga/geometry3k

64 prompts x 8 samples per step, one optimizer step per rollout, response budget 4096 tokens,
temperature 1.0, clip 0.2 / 0.28, no KL, max_turns 3. Rollouts come from one SGLang server
per GPU, colocated as slime's Geometry3K multi-turn example runs them (each process generates
through the server on its own GPU; its memory is released during training; --mem-fraction-static
0.6), weights synced in memory in bf16 after every step (/update_weights_from_tensor),
truncated importance sampling (cap 2). Needs the pinned GPU stack (requirements-gpu.txt) and
CUDA.
"""

from configs import base


def get_config():
    c = base.get_config()
    c.train.device = "cuda"
    c.model.path = "Qwen/Qwen3-VL-2B-Instruct"  # a Hub name (common.hub) or a local folder
    c.data.path = "hiyouga/geometry3k"
    c.rollout.n_samples = 8
    c.rollout.max_response_tokens = 4096
    c.rollout.max_context_tokens = 8192
    c.rollout.temperature = 1.0
    c.env.max_turns = 3
    c.loss.clip_low = 0.2
    c.loss.clip_high = 0.28
    c.loss.kl_coef = 0.0
    c.loss.agg = "seq-mean-token-mean"
    # SGLang generates; its bf16 kernels drift from the learner: truncated importance sampling.
    c.engine.backend = "sglang"
    c.engine.sglang_colocated = True  # one server per GPU (engine.sglang_gpus_per_server: 1)
    c.engine.sglang_mem_fraction = 0.6
    c.loss.tis_cap = 2.0
    c.train.steps = 1000
    c.train.prompts_per_step = 64
    c.train.micro_batch_tokens = "auto"  # the largest the free GPU memory holds, measured
    c.train.lr = 1e-6
    c.train.lr_schedule = "constant"
    c.train.weight_decay = 0.1
    c.train.beta1, c.train.beta2 = 0.9, 0.98
    c.train.grad_clip = 1.0
    c.train.bf16 = True
    # The LM head forms the loss's gradient in its forward pass (geo3k_torch.head): the head is
    # not computed again in the backward pass. train.compile stays off until a GPU has timed it.
    c.train.fused_head = True
    c.eval.every = 20
    c.eval.max_prompts = 0  # the whole 601-problem test split
    c.checkpoint.every = 50
    return c
