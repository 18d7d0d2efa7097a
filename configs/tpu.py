"""slime's multi-turn recipe on a TPU slice with the JAX learner: Qwen3-VL-2B-Instruct, multi-turn
Geometry3K, the same settings as configs/h100.py.

    python -m geo3k_jax.train --config=configs/tpu.py \
        --config.model.path=Qwen/Qwen3-VL-2B-Instruct --config.data.path=hiyouga/geometry3k \
        --config.engine.sglang_urls=http://gpu-host:30000

Learner: parameters and optimizer state sharded FSDP-style over every chip (`jax.mesh`),
bf16 compute with fp32 state, decoder layers rematerialised, the LM head 1,024 trained tokens
of a row at a time, 16,384-token rows; on a multi-host slice every host runs this command
(`jax.distributed`). Rollouts: SGLang servers given by URL (GPU machines the slice can reach),
synced from the HF export after every step; on one host `--config.engine.backend=local`
generates with the in-process JAX engine on the learner's own parameters, and
`--config.engine.backend=torch` with torch on the host CPU (slow, for a smoke test). What has run on a TPU so far: nothing (see the README). Refuses to start where
JAX sees no TPU.
"""

from configs import h100


def get_config():
    c = h100.get_config()
    c.train.device = "cpu"  # the torch side (a torch engine, if chosen) stays on the host
    c.engine.sglang_colocated = False  # the servers are not on the TPU hosts
    c.jax.platform = "tpu"
    c.jax.distributed = True
    c.jax.mesh.data, c.jax.mesh.fsdp, c.jax.mesh.tensor = 1, -1, 1
    c.jax.compute_dtype = "bfloat16"
    c.engine.slots = 128  # local JAX engine: 28 GiB of KV cache a v5p chip (docs/tpu_engine.md)
    c.jax.remat = True
    # A compile takes minutes here: one slice shape for the run (geo3k_jax.buckets.one_shape).
    # Rows of 16,384 tokens, any of them trained; 2,048 image patches (a row holds a few groups,
    # each prompt's image encoded once); a sequence is at most rollout.max_context_tokens
    # (8,192) long, so a query block sees at most 8,192 + 128 of its own keys; prompts up to
    # 2,048 tokens.
    c.jax.slice.targets = c.train.micro_batch_tokens
    c.jax.slice.patches = 2048
    c.jax.slice.window = c.rollout.max_context_tokens + 128
    c.jax.slice.prefix_window = 2048
    return c
