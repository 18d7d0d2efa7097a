"""slime's multi-turn recipe on a TPU slice with the JAX learner: Qwen3-VL-2B-Instruct, multi-turn
Geometry3K, the same settings as configs/h100.py.

    python -m geo3k_jax.train --config=configs/tpu.py \
        --config.model.path=Qwen/Qwen3-VL-2B-Instruct --config.data.path=hiyouga/geometry3k
    python -m geo3k_jax.train --config=configs/tpu.py:cpu   # its structure, tiny, on a CPU

Learner: parameters and optimizer state sharded FSDP-style over every chip (`jax.mesh`),
bf16 compute with fp32 state, decoder layers rematerialised, the LM head 1,024 trained tokens
of a row at a time, 16,384-token rows; on a multi-host slice every host runs this command
(`jax.distributed`). Rollouts: the in-process JAX engine on the slice's own chips
(`geo3k_jax.engine.backend.JaxBackend`): every host samples its own share of the episodes on its own
chips, from a bf16 copy of the learner's parameters made in device memory after every step (no
export, no host copy). `--config.engine.backend=sglang --config.engine.sglang_urls=...` sends
them to SGLang servers instead (GPU machines the slice can reach), synced from a bf16 export in
which every host writes its own shard. What has run on a TPU so far: nothing (see the README).
Refuses to start where JAX sees no TPU, except with the `cpu` argument: the tiny checkpoint and
synthetic set of `configs/cpu.py` (`cpu.runlocal`), one slice shape, bf16 compute and remat as
here, on whatever devices and processes JAX has (tests/test_tpu_recipe.py runs it on 2 CPU
processes).
"""

from configs import cpu, h100


def get_config(arg=None):
    if arg not in (None, "", "cpu"):
        raise ValueError(f"configs/tpu.py takes no argument or 'cpu', got {arg!r}")
    c = h100.get_config()
    c.train.device = "cpu"  # the torch side (a torch engine, if chosen) stays on the host
    c.engine.backend = "local"  # the JAX engine, on the learner's chips
    c.engine.sglang_colocated = False  # SGLang servers, if chosen, are not on the TPU hosts
    c.jax.platform = "tpu"
    c.jax.distributed = True
    c.jax.mesh.data, c.jax.mesh.fsdp, c.jax.mesh.tensor = 1, -1, 1
    c.jax.compute_dtype = "bfloat16"
    c.train.micro_batch_tokens = 16384  # a number: the JAX learner compiles its row length
    c.engine.slots = 128  # per host: 28 GiB of KV cache a v5p chip (docs/tpu_engine.md)
    c.jax.remat = True
    # The learner and the engine on the same chips: checked together before the first step
    # (geo3k_jax.aot.check_run), at most 8 prefill rows of 2,048 new tokens (docs/tpu.md)
    c.jax.hbm_check = True
    c.engine.prefill_rows = 8
    c.engine.prefill_tokens = 2048
    c.engine.warm_up = True  # every engine program compiled at start (docs/tpu_engine.md)
    if arg == "cpu":
        cpu.runlocal(c)
        c.jax.platform = ""
        c.jax.distributed = False  # a test starts its processes' cluster itself
        c.engine.slots = 8
        c.jax.hbm_check = False  # minutes of compiling on a CPU; tests/test_jax_aot.py turns it on
        c.engine.warm_up = False  # the same: tests/test_jax_engine.py warms an engine up
    # A compile takes minutes here: one slice shape for the run (geo3k_jax.core.buckets.one_shape).
    # Rows of the micro-batch budget (16,384 tokens), any of them trained; 2,048 image patches
    # (a row holds a few groups, each prompt's image encoded once); a sequence is at most
    # rollout.max_context_tokens (8,192) long, so a query block sees at most that + 128 of its
    # own keys; prompts up to 2,048 tokens.
    c.jax.slice.targets = c.train.micro_batch_tokens
    c.jax.slice.patches = 2048
    c.jax.slice.window = c.rollout.max_context_tokens + 128
    c.jax.slice.prefix_window = min(2048, c.train.micro_batch_tokens)
    return c
