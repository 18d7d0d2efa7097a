"""A small random JAX Qwen-VL, its processor and packed batches, for the JAX learner tests and
the 8-device sharding worker (no checkpoint directory, no torch weights)."""

import dataclasses

import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx
from transformers import Qwen2_5_VLConfig, Qwen3VLConfig, Qwen3VLMoeConfig

from common.batching import pack
from geo3k_jax.core.batch import device_batch
from geo3k_jax.learner.learner import Learner
from geo3k_jax.models.model import QwenVL, split_params
from tests.test_jax_model import sequences
from tests.tiny_models import IDS, VOCAB, ImageOnlyProcessor

TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB)
VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
              spatial_merge_size=2)


MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
           mlp_only_layers=[])  # every layer sparse, 4 experts, 2 a token


def config(arch: str):
    if arch in ("qwen3_vl", "qwen3_vl_moe"):
        moe = arch == "qwen3_vl_moe"
        return (Qwen3VLMoeConfig if moe else Qwen3VLConfig)(text_config=dict(
            TEXT, head_dim=16, rope_scaling={"rope_type": "default", "mrope_section": [4, 2, 2],
                                             "mrope_interleaved": True}, **(MOE if moe else {})),
            vision_config=dict(VISION, patch_size=16, deepstack_visual_indexes=[0],
                               num_position_embeddings=64), **IDS), 16
    return Qwen2_5_VLConfig(text_config=dict(TEXT, rope_scaling={
        "rope_type": "default", "mrope_section": [2, 3, 3]}),
        vision_config=dict(VISION, patch_size=14, window_size=56, fullatt_block_indexes=[1]),
        **IDS), 14


@dataclasses.dataclass
class Setup:
    """A random model, its processor and config, packed micro-batches and their device batch."""

    merge: object
    params: dict
    processor: object
    config: object
    batches: list
    batch: dict
    n_tokens: float
    n_seqs: float

    def learner(self, loss_cfg, train_cfg, **kw) -> Learner:
        """A learner on this setup whose rows are the device batch's length."""
        return Learner(self.merge, self.params, loss_cfg, train_cfg, 1.0,
                       processor=self.processor, config=self.config,
                       row_len=self.batch["input_ids"].shape[1], **kw)

    def step(self, learner: Learner, batches=None) -> dict:
        """One train_step of `learner` on this setup's micro-batches (or `batches`)."""
        return learner.train_step(self.batches if batches is None else batches, self.n_tokens,
                                  self.n_seqs)


def model_and_batch(arch: str = "qwen3_vl", rows_multiple: int = 1, agg: str = "token-mean",
                    seed: int = 0) -> Setup:
    """A `Setup` with every weight perturbed and 8 sequences in about 3 micro-batches."""
    cfg, patch = config(arch)
    merge, params = split_params(QwenVL(cfg, rngs=nnx.Rngs(seed)))
    rng = np.random.default_rng(seed)
    params = {k: v + jnp.asarray(0.02 * rng.standard_normal(v.shape), v.dtype)
              for k, v in params.items()}
    processor = ImageOnlyProcessor(patch)
    seqs = sequences(processor, rng, 8)
    batches = pack(seqs, max(max(map(len, seqs)), sum(map(len, seqs)) // 3))
    n_tokens, n_seqs = float(sum(s.loss_mask.sum() for s in seqs)), float(len(seqs))
    batch = device_batch(batches, processor, cfg, agg=agg, n_tokens=n_tokens, n_seqs=n_seqs,
                         pad_to=32, rows_multiple=rows_multiple)
    return Setup(merge, params, processor, cfg, batches, batch, n_tokens, n_seqs)


def train_config(**kw):
    c = ml_collections.ConfigDict(dict(lr=1e-3, lr_schedule="cosine", warmup_steps=1, steps=6,
                                       min_lr_ratio=0.1, updates_per_rollout=1, beta1=0.9, beta2=0.98, eps=1e-8,
                                       weight_decay=0.1, grad_clip=1.0, freeze_vision=False))
    c.update(kw)
    return c
