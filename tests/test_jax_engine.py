"""The JAX rollout engine (geo3k_jax.engine) on the tiny checkpoints, fp32 on CPU: its log-probs
are the JAX learner's over multi-turn episodes, its greedy tokens are the torch engine's, and it
stops, bans and seeds as the rollout requires of any engine."""

import dataclasses

import jax
import numpy as np
import pytest
import torch

from common.batching import TrainSequence, pack
from common.engine import Request, SamplingParams
from common.grpo import LossConfig
from geo3k_jax.engine import JaxEngine
from geo3k_jax.learner import Learner
from geo3k_torch.engine import LocalEngine
from tests.jax_learner_setup import train_config
from tests.test_jax_model import jax_copy
from tests.tiny_models import IMG, ImageOnlyProcessor, image, prompt_ids, qwen2_5_vl, qwen3_vl

jax.config.update("jax_default_matmul_precision", "highest")
ARCHS = {"qwen3_vl": qwen3_vl, "qwen2_5_vl": qwen2_5_vl}


@dataclasses.dataclass
class Tiny:
    hf: torch.nn.Module
    processor: object
    merge: object
    params: dict

    def engine(self, seed=0, **kw) -> JaxEngine:
        return JaxEngine(self.merge, lambda: self.params, self.processor, self.hf.config,
                         seed=seed, **kw)


@pytest.fixture(scope="module", params=sorted(ARCHS))
def tiny(request):
    hf, patch = ARCHS[request.param]()
    merge, params = jax_copy(hf)
    return Tiny(hf, ImageOnlyProcessor(patch), merge, params)


def episodes(engine, processor, seed, turns=3, max_new=12, temperature=1.0, n=3):
    """n sessions of `turns` turns, 1-3 images of different sizes each; turn k + 1 continues
    turn k's request and output with random feedback tokens. Returns every turn's
    (requests, completions)."""
    rng = np.random.default_rng(seed)
    reqs = []
    for i in range(n):
        imgs = [image(int(rng.integers(40, 130)), int(rng.integers(40, 130)), 100 + 10 * i + k)
                for k in range(1 + i % 3)]
        reqs.append(Request(tuple(prompt_ids(processor, imgs, rng, (3 + 4 * i, 2))), imgs,
                            SamplingParams(temperature, 1.0, max_new, (7,)), f"s{i}"))
    out = []
    for _ in range(turns):
        done = engine.generate(reqs)
        out.append((reqs, done))
        reqs = [dataclasses.replace(r, input_ids=tuple(r.input_ids) + tuple(o.token_ids) + tuple(
            int(x) for x in rng.integers(1, 200, 4 + i))) for i, (r, o) in enumerate(zip(reqs, done))]
    return out


def trajectories(turns) -> list[TrainSequence]:
    """Each session's whole episode as one training sequence: its generated tokens in the loss
    mask with the engine's log-probs, prompt and feedback out of it."""
    last_reqs, last_outs = turns[-1]
    seqs = []
    for i, (r, o) in enumerate(zip(last_reqs, last_outs)):
        ids = np.r_[np.asarray(r.input_ids), o.token_ids].astype(np.int64)
        mask, logp = np.zeros(len(ids), np.int8), np.zeros(len(ids), np.float32)
        for reqs, outs in turns:
            start = len(reqs[i].input_ids)
            mask[start:start + len(outs[i].token_ids)] = 1
            logp[start:start + len(outs[i].token_ids)] = outs[i].logprobs
        seqs.append(TrainSequence(ids, mask, logp, 1.0, list(r.images), i))
    return seqs


def test_engine_logprobs_equal_learner(tiny, temperature=0.7):
    """Three turns with feedback, 1-3 images each: every sampled token's engine log-prob is the
    JAX learner's at the same temperature. A decode position off by one after an image (text
    resumes at start + max(h, w)) or a DeepStack feature missing from the prefill moves them by
    1e-3 or more."""
    engine = tiny.engine(seed=3)
    turns = episodes(engine, tiny.processor, 2, temperature=temperature)
    seqs = trajectories(turns)
    assert all(len(o.token_ids) >= 1 for _, outs in turns for o in outs)
    learner = Learner(tiny.merge, tiny.params, LossConfig(), train_config(), temperature,
                      processor=tiny.processor, config=tiny.hf.config, row_len=1024)
    batches = pack(seqs, 1024)
    learned = learner.logprobs(batches)
    gap = 0.0
    for b, lp in zip(batches, learned):
        m = b.loss_mask > 0
        gap = max(gap, float(np.abs(lp[m] - b.rollout_logprobs[m]).max()))
    assert sum(int(b.loss_mask.sum()) for b in batches) > 30
    assert gap <= 1e-5


def test_greedy_tokens_equal_torch_engine(tiny):
    """Greedy, up to 32 new tokens per turn, 3 turns fed back with feedback tokens:
    the JAX engine and the torch LocalEngine pick the same tokens with the same log-probs."""
    jax_turns = episodes(tiny.engine(), tiny.processor, 5, max_new=32, temperature=0.0, n=2)
    torch_turns = episodes(LocalEngine(tiny.hf, tiny.processor, 0, keep_cache=False),
                           tiny.processor, 5, max_new=32, temperature=0.0, n=2)
    for (_, a), (_, b) in zip(jax_turns, torch_turns):
        for x, y in zip(a, b):
            assert len(x.token_ids) == 32 or x.token_ids[-1] == 7
            assert x.token_ids == y.token_ids and x.finish_reason == y.finish_reason
            np.testing.assert_allclose(x.logprobs, y.logprobs, rtol=0, atol=1e-4)
