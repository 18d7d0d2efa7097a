"""The quick CPU run (`make train-quick`): every piece of the loop in about 2 minutes on 2 cores,
a tiny Qwen3-VL on the synthetic set. It learns the tool-call protocol, not the figures: its
accuracy stays at chance (docs/results.md). The learning run is `configs/cpu_perception.py`,
which starts from this config.

    python -m geo3k_torch.main --config=configs/cpu.py
"""

from common.synthetic import GEOMETRY, PERCEPTION
from configs import base


def get_config():
    c = base.get_config()
    c.data.synthetic_train_size = 256
    c.data.synthetic_test_size = 32
    # Half the problems are perception ones (answerable from the pixels: the tiny model can
    # learn those in a minute, not geometry), half today's geometry families.
    c.data.synthetic_families = ",".join(GEOMETRY + PERCEPTION * 2)
    # Solving on turn 1 earns twice what turn 2 does: the first try's letter gets its own signal
    # (with a discount of 1 an episode solved on turn 3 rewards its wrong first letters as much).
    c.reward.turn_discount = 0.5
    # A random tiny model never writes a tool call: give it the format first (geo3k_torch/prime.py;
    # the letter it answers is uniform, so what it learns about the answers comes from GRPO).
    c.model.tiny_prime_steps = 150
    c.rollout.n_samples = 8
    # Room for all 3 turns: 3 calls and 2 feedback messages are ~180 tokens after a ~420-token
    # prompt (96 and 512 cut every episode after turn 2: tests/test_prime.py).
    c.rollout.max_response_tokens = 256
    c.rollout.max_context_tokens = 768
    c.train.steps = 60
    c.train.prompts_per_step = 4
    c.train.micro_batch_tokens = 2048
    # 3e-4 let one run in ten collapse (tool calls given up, the reward falling); at 1.5e-4 torch
    # and JAX seeds 0-4 all rise (docs/benchmarks.md, twelfth round).
    c.train.lr = 1.5e-4
    c.eval.every = 20
    return c


def runlocal(c, max_response_tokens: int = 32):
    """Shrink a GPU recipe `c` in place for a few-step CPU run (big_vision's `runlocal`): the
    quick run's tiny checkpoint and synthetic set, the local engine, 3 steps of 2 prompts x 3
    samples. The recipe's task settings (prompt style, turns, reward, loss) stay."""
    local = get_config()
    prompt_style = c.data.prompt_style
    for section in ("model", "data"):
        c[section] = local[section]
    c.data.prompt_style = prompt_style
    c.train.device = "auto"
    c.engine.backend = "local"
    c.loss.tis_cap = None  # the local engine is the learner's own model: nothing to correct
    c.rollout.n_samples, c.rollout.max_response_tokens = 3, max_response_tokens
    c.rollout.max_context_tokens = local.rollout.max_context_tokens
    c.train.steps, c.train.prompts_per_step = 3, 2
    c.train.micro_batch_tokens, c.train.lr = local.train.micro_batch_tokens, local.train.lr
    c.eval.every, c.eval.max_prompts, c.eval.n_samples = 3, 2, 2
    c.checkpoint.every = 3
    return c
