"""GRPO learns: a tiny Qwen3-VL must read the diagram's colour and answer through the tool.

Vocabulary of the task (token -> text): tokens 0-3 are each a whole tool call answering 1-4,
token 4 ends the turn, 5-9 are filler words. The right answer is the colour of the image (red 1,
green 2, blue 3, yellow 4), so only the image tells it, and only a tool call scores (reward
source `tool`, one turn). A random policy scores about 0.2; the same pipeline as training
(`common.step.grpo_step`: local engine, common rollout, advantages, packing, learner)
must raise it above 0.7 within 30 steps, with the torch learner and with the JAX learner. With
the advantage sign flipped, it must not.
"""

import dataclasses
import json

import numpy as np
import pytest
import torch
from PIL import Image

from common.env import EnvConfig
from common.grpo import LossConfig
from common.rollout import RolloutConfig
from common.reward import RewardConfig
from common.step import StepConfig, grpo_step
from configs import base
from geo3k_torch import attention
from geo3k_torch.engine import LocalEngine
from geo3k_torch.learner import Learner
from tests.tiny_models import ImageOnlyProcessor, qwen3_vl, special_ids

VOCAB = 16
IDS = special_ids(VOCAB)
STOP, ASK = 4, 10
COLOURS = [(220, 30, 30), (30, 200, 30), (30, 30, 220), (230, 220, 20)]
STEPS, BEFORE_MAX, AFTER_MIN = 30, 0.4, 0.7
BUDGET = 1024  # micro-batch tokens (and the JAX learner's row length)


def text_of(token):
    if token < 4:
        call = {"name": "calc_score", "arguments": {"answer": str(token + 1)}}
        return f"<tool_call>{json.dumps(call)}</tool_call>"
    return {STOP: "", 5: " so", 6: " the", 7: " answer", 8: " is", 9: " hmm"}.get(token, "?")


class TaskRenderer:
    stop_token_ids = (STOP,)
    placeholder_ids = (IDS["image_token_id"], IDS["video_token_id"])

    def __init__(self, processor):
        self.processor = processor

    def prompt_ids(self, messages, images):
        grid = self.processor.image_processor(images=images, return_tensors="np")[
            "image_grid_thw"][0]
        n = int(np.prod(grid)) // 4
        return [ASK, IDS["vision_start_token_id"]] + [IDS["image_token_id"]] * n + [
            IDS["vision_end_token_id"], ASK]

    def observation_ids(self, message, last_token):
        return [ASK]

    def decode(self, ids):
        return "".join(text_of(int(t)) for t in ids)


@dataclasses.dataclass
class Prompt:
    uid: str
    answer: str
    images: list
    messages: list = dataclasses.field(default_factory=list)


def prompts(rng):
    out = []
    for k, colour in enumerate(COLOURS):
        noise = rng.integers(-20, 20, (64, 64, 3))
        pixels = np.clip(np.array(colour) + noise, 0, 255).astype(np.uint8)
        out.append(Prompt(f"c{k}", str(k + 1), [Image.fromarray(pixels)]))
    return out


def torch_learner(model, processor, cfg):
    """The torch learner trains the engine's own model: nothing to sync."""
    return Learner(model, processor, LossConfig(), cfg, 1.0), lambda: None


def jax_learner(model, processor, cfg):
    """The JAX learner on a copy of the weights; after each step they go back to the torch
    engine's model (what the reloading backend does through an HF export)."""
    import jax.numpy as jnp
    from flax import nnx

    from geo3k_jax.learner.learner import Learner as JaxLearner
    from geo3k_jax.models.model import QwenVL, split_params
    from geo3k_jax.core.stacking import from_hf, to_hf

    merge, params = split_params(nnx.eval_shape(lambda: QwenVL(model.config, rngs=nnx.Rngs(0))))
    torch_params = dict(model.named_parameters())
    hf = {k: v.detach().numpy() for k, v in torch_params.items()}
    params = {k: jnp.asarray(v) for k, v in from_hf(hf, params).items()}
    learner = JaxLearner(merge, params, LossConfig(), cfg, 1.0, processor=processor,
                         config=model.config, row_len=BUDGET)

    def sync():
        with torch.no_grad():
            for k, v in to_hf(learner.params).items():
                torch_params[k].copy_(torch.from_numpy(np.array(v)))
    return learner, sync


def train(sign: float, make_learner=torch_learner):
    model, patch = qwen3_vl(seed=0, vocab=VOCAB)
    model.set_attn_implementation(attention.NAME)
    model.train()
    processor = ImageOnlyProcessor(patch)
    cfg = base.get_config().train
    with cfg.unlocked():
        cfg.lr, cfg.weight_decay = 3e-3, 0.0
    learner, sync = make_learner(model, processor, cfg)
    engine = LocalEngine(model, processor, pad_id=STOP, seed=0)
    step_cfg = StepConfig(RolloutConfig(n_samples=8, max_response_tokens=3),
                          EnvConfig(max_turns=1), RewardConfig(source="tool"),
                          micro_batch_tokens=BUDGET, image_token_id=model.config.image_token_id)
    if sign < 0:  # the broken variant: every advantage negated
        import common.step as step_module
        original = step_module.episode_advantages
        step_module.episode_advantages = lambda *a, **k: (-original(*a, **k)[0],
                                                          original(*a, **k)[1])
    try:
        rng = np.random.default_rng(0)
        rewards = []
        for step in range(STEPS):
            trajs, _ = grpo_step(prompts(rng), engine, TaskRenderer(processor), learner,
                                 step_cfg, group_offset=4 * step)
            sync()
            engine.clear_cache()  # new weights
            rewards.append(np.mean([t.reward for t in trajs]))
    finally:
        if sign < 0:
            step_module.episode_advantages = original
    return float(np.mean(rewards[:3])), float(np.mean(rewards[-5:]))


@pytest.mark.slow
@pytest.mark.parametrize("make_learner", [torch_learner, jax_learner], ids=["torch", "jax"])
def test_grpo_raises_reward_and_flipped_sign_does_not(make_learner):
    torch.manual_seed(0)
    before, after = train(+1.0, make_learner)
    print(f"reward before {before:.3f} after {after:.3f}")
    assert before < BEFORE_MAX and after > AFTER_MIN
    flipped_before, flipped_after = train(-1.0, make_learner)
    print(f"flipped sign: before {flipped_before:.3f} after {flipped_after:.3f}")
    assert flipped_after < AFTER_MIN and flipped_after <= flipped_before + 0.1
