"""The multi-turn recipe of configs/h100.py with Qwen3-VL-30B-A3B-Instruct (MoE: 128 experts,
top 8) on one node of 8 H100s.

    torchrun --nproc_per_node=8 -m geo3k_torch.main --config=configs/h100_moe.py \
        --workdir=runs/h100-moe
    python -m geo3k_torch.main --config=configs/h100_moe.py:cpu   # tiny MoE, CPU, 3 steps

Everything but the model and its servers is configs/h100.py: 64 prompts x 8 samples, 3 turns,
lr 1e-6, clip 0.2 / 0.28, no KL, truncated importance sampling (cap 2), micro-batch "auto". The
router's load-balancing loss stays off (`loss.router_aux_coef` 0), as GRPO recipes train MoE
models.

Layout: the torch learner shards the model over the 8 GPUs with FSDP2; one colocated SGLang
server spans the same 8 GPUs with tp 8 and ep 8 (each GPU holds a tp slice of the attention and
16 whole experts of every layer), releases its memory while the learner trains and takes the
new weights in memory, in bf16, after every step. One server per GPU (or per pair) would need
the whole bf16 model (or half of it) on each GPU beside the learner's state.

Memory per GPU (H100: 79.2 GiB; 31.07 B parameters, configs/models/README.md; estimated, not
yet measured on the GPUs):
  * the learner: fp32 weights 14.5 GiB and AdamW's two moments 28.9 GiB, held all run (43.4);
    during a step also the fp32 gradients (14.5) and the activations ("auto" sizes the
    micro-batch on what is left with the moments and gradients counted, SGLang released);
  * SGLang: the bf16 weights, 57.9 GiB (62.1 GB) over 8 GPUs = 7.2 GiB, and its KV cache.
    SGLang 0.5.23 keeps `--mem-fraction-static` of the memory free at its start for its
    weights, 1 GiB of image features (cuda_ipc transport, its Hopper default for Qwen3-VL) and
    the KV cache (mem_cache/kv_cache_configurator.py). It starts after the learner is built
    but before the first step allocates the moments: about 79.2 - 14.5 - 2 (CUDA contexts) =
    62.7 GiB free, of which 0.4 is 25 GiB, 16.8 of it KV cache (24 KiB per token per GPU:
    48 layers x K and V x one of the 4 KV heads x 128 x bf16; about 730k tokens). h100.py's
    0.6 would keep 37.6 GiB, more than the moments leave.
  * during rollouts: 43.4 (learner) + 25 (SGLang) + its CUDA graphs and activations (a few GiB)
    + 2 (contexts) = about 75 of 79.2 GiB.
`:cpu` shrinks it to the tiny MoE checkpoint (configs/cpu.py's `runlocal`, the local engine).
"""

from configs import cpu, h100


def get_config(arg=None):
    c = h100.get_config()
    c.model.path = "Qwen/Qwen3-VL-30B-A3B-Instruct"
    c.loss.router_aux_coef = 0.0
    c.engine.sglang_gpus_per_server = 8  # one server over the node: tp 8
    c.engine.sglang_ep_size = 8  # 128 experts, 16 per GPU
    c.engine.sglang_mem_fraction = 0.4  # of the memory free at start: see the docstring
    if arg == "cpu":
        cpu.runlocal(c)
        c.model.tiny_arch = "qwen3_vl_moe"
        c.model.tiny_dir = "data/tiny-qwen3_vl_moe-small"
    elif arg:
        raise ValueError(f"configs/h100_moe.py takes no argument or 'cpu', got {arg!r}")
    return c
