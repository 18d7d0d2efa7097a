r"""SFT warm start (slime's single-turn example's SFT run): the reply `Answer: \boxed{<answer>}`
for each training problem, loss on the assistant's tokens only.

    torchrun --nproc_per_node=8 -m geo3k_torch.sft --config=configs/sft.py \
        --config.model.path=Qwen/Qwen3-VL-2B-Instruct --config.data.path=hiyouga/geometry3k \
        --workdir=runs/sft
    torchrun --nproc_per_node=8 -m geo3k_torch.main --config=configs/h100_single_turn.py \
        --config.model.path=runs/sft/checkpoints/step_66 ...          # GRPO from the SFT weights
    python -m geo3k_torch.sft --config=configs/sft.py:cpu       # tiny, CPU, 3 steps

Anchor figure: none (the seed documents the data preparation and the run command, not a
result). Two epochs of the 2,101 training problems at 64 per step, lr 1e-5 with 10% warmup and
cosine decay; the single-turn prompt (no tool); greedy evaluation every 20 steps on the whole
test split (`eval/greedy_first_try_accuracy`; the local engine generates).
"""

from configs import cpu, h100


def get_config(arg=None):
    c = h100.get_config()
    c.data.prompt_style = "boxed"
    c.env.max_turns = 1
    c.reward.source = "boxed"
    c.engine.backend = "local"  # evaluation only; SFT itself generates nothing
    c.train.steps = 66
    c.train.prompts_per_step = 64
    c.train.lr = 1e-5
    c.train.lr_schedule = "cosine"
    c.train.warmup_steps = 7
    c.rollout.max_response_tokens = 1024  # the evaluation's answers
    c.eval.every = 20
    c.eval.max_prompts = 0
    c.eval.n_samples = 0  # greedy only
    c.checkpoint.every = 22
    if arg == "cpu":
        cpu.runlocal(c)
        c.eval.n_samples = 0
    elif arg:
        raise ValueError(f"configs/sft.py takes no argument or 'cpu', got {arg!r}")
    return c
