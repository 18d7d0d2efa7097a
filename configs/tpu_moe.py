"""configs/tpu.py's recipe with Qwen3-VL-30B-A3B-Instruct (MoE: 128 experts, top 8) on a v5p-16
slice (8 chips, 2 hosts of 4).

    python -m geo3k_jax.train --config=configs/tpu_moe.py --workdir=gs://$BUCKET/geo3k-moe
    python -m geo3k_jax.aot --config=configs/tpu_moe.py --topology=v5p-16 \
        --shapes=qwen3_vl_30b_a3b          # its budget, compiled on any host (docs/tpu.md)
    python -m geo3k_jax.train --config=configs/tpu_moe.py:cpu   # its structure, tiny MoE, CPU

Everything but the model, the mesh and the engine's slots is configs/tpu.py (h100.py's task, loss
and advantage; the router's load-balancing loss off, as configs/h100_moe.py).

Mesh (data 1, fsdp the rest, expert 2, tensor 4): a tensor group is one host's 4 chips, so each
host's JAX engine holds a quarter of the bf16 weights a chip (14.5 GiB of 57.9) and of the KV
cache; the learner's stacked experts are split over expert x fsdp x tensor (every chip), its
other parameters over fsdp x tensor (the expert axis is a data axis for them). Per chip the
learner's state is 16 bytes a parameter over the chips (fp32 parameters, two Adam moments, the
fp32 gradient accumulator during the gradient): 31.07 B parameters need at least 8 v5p chips
(v5p-8's 4 would hold 115.7 GiB each, more than 95.74) and 32 v6e chips. Compiled for v5p-16
(docs/tpu.md): 94.2 of 95.74 GiB a chip at the gradient program (32.2 of it temporaries at one
16,384-token row a tensor group), 82.1 during rollouts at these 64 slots (about 136 would fit).
On v6e it needs rows of 8,448 tokens and `jax.offload=moments` (16 slots a host: v6e-64 28.4
of 31.25 GiB a chip, v6e-32 30.4; the engine's decode alone takes 26.4).
"""

from configs import tpu


def get_config(arg=None):
    if arg not in (None, "", "cpu"):
        raise ValueError(f"configs/tpu_moe.py takes no argument or 'cpu', got {arg!r}")
    c = tpu.get_config(arg)
    c.model.path = "Qwen/Qwen3-VL-30B-A3B-Instruct"
    c.loss.router_aux_coef = 0.0
    c.jax.mesh.fsdp, c.jax.mesh.expert, c.jax.mesh.tensor = -1, 2, 4
    c.engine.slots = 64  # per host (docs/tpu.md: the rollout phase is the peak)
    if arg == "cpu":
        c.model.path = ""
        c.model.tiny_arch = "qwen3_vl_moe"
        c.model.tiny_dir = "data/tiny-qwen3_vl_moe-small"
        c.jax.mesh.expert, c.jax.mesh.tensor = 1, 1  # whatever devices the host has
        c.engine.slots = 8
    return c
