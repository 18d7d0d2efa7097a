"""AReaL's multi-turn VLM recipe (its pull request's settings) on NVIDIA GPUs.

    torchrun --nproc_per_node=8 -m geo3k_torch.main --config=configs/h100_areal.py \
        --config.model.path=Qwen/Qwen3-VL-4B-Instruct --config.data.path=hiyouga/geometry3k
    ... --config=configs/h100_areal.py:individual      # one training sequence per turn
    python -m geo3k_torch.main --config=configs/h100_areal.py:cpu   # tiny, CPU, 3 steps

Settings (AReaL's multi-turn VLM pull request): Qwen3-VL-4B, up to 4 turns, turn discount 0.95 (reward
0.95^(k-1) for a first correct answer on turn k: the max over turns of r_t * 0.95^t with t
counted from 0), feedback as a user message, lr 1e-6, n = 4 samples, temperature 0.8, 1,024 new
tokens, `concat` export (`individual` with the argument). Anchor figure: none (the pull request
reports no accuracy); compare with `python -m geo3k_torch.evaluate`'s first-try and with-feedback
accuracy. The rest (optimizer, SGLang colocated, TIS) is `configs/h100.py`. Arguments, comma
separated: `cpu` (the runlocal shrink), `individual`.
"""

from configs import cpu, h100

ARGS = ("cpu", "individual")


def get_config(arg=None):
    args = [a for a in (arg or "").split(",") if a]
    if set(args) - set(ARGS):
        raise ValueError(f"configs/h100_areal.py takes arguments from {ARGS}, got {arg!r}")
    c = h100.get_config()
    c.model.path = "Qwen/Qwen3-VL-4B-Instruct"
    c.env.max_turns = 4
    c.env.feedback_role = "user"
    c.reward.turn_discount = 0.95
    c.rollout.n_samples = 4
    c.rollout.temperature = 0.8
    c.rollout.max_response_tokens = 1024
    c.rollout.max_context_tokens = 4096
    c.rollout.export_style = "individual" if "individual" in args else "concat"
    c.train.lr = 1e-6
    if "cpu" in args:
        cpu.runlocal(c, max_response_tokens=64)  # room for a few short turns
    return c
