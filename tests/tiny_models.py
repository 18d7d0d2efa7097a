"""Tiny randomly initialised Qwen-VL models built from configs, for numerics tests.

They need no tokenizer: token ids are drawn at random, images go through the PIL image
processor. The image-token ids sit at the top of the small vocabulary.
"""

import numpy as np
import torch
from PIL import Image
from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen3VLConfig,
                          Qwen3VLForConditionalGeneration, Qwen3VLMoeConfig,
                          Qwen3VLMoeForConditionalGeneration)
from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

VOCAB = 300
IMG, START, END = 250, 252, 253
TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB)
IDS = dict(image_token_id=IMG, video_token_id=251, vision_start_token_id=START,
           vision_end_token_id=END)


def special_ids(vocab):
    """Image, video, vision-start and vision-end ids: the top four of the vocabulary."""
    return dict(image_token_id=vocab - 4, video_token_id=vocab - 3,
                vision_start_token_id=vocab - 2, vision_end_token_id=vocab - 1)


def qwen3_vl(seed=0, vocab=VOCAB, moe=None):
    """moe: text-config settings of a Qwen3-VL-MoE model (`qwen3_vl_moe`) instead."""
    torch.manual_seed(seed)
    ids = IDS if vocab == VOCAB else special_ids(vocab)
    config, model = ((Qwen3VLConfig, Qwen3VLForConditionalGeneration) if moe is None
                     else (Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration))
    c = config(text_config=dict(TEXT, vocab_size=vocab, head_dim=16, rope_scaling={
        "rope_type": "default", "mrope_section": [4, 2, 2], "mrope_interleaved": True},
        **(moe or {})),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                           out_hidden_size=64, patch_size=16, spatial_merge_size=2,
                           deepstack_visual_indexes=[0], num_position_embeddings=64), **ids)
    return model(c).float().eval(), 16


def qwen3_vl_moe(seed=0, vocab=VOCAB):
    """Qwen3-VL-MoE: every decoder layer a sparse block of 4 experts, top 2 (30B-A3B's layout),
    each expert 3/8 of the hidden size as 30B-A3B's (768 of 2048): the published and the model's
    layouts of the experts differ in shape, as they do there."""
    return qwen3_vl(seed, vocab, moe=dict(num_experts=4, num_experts_per_tok=2,
                                          moe_intermediate_size=24, decoder_sparse_step=1,
                                          mlp_only_layers=[]))


def qwen2_5_vl(seed=0):
    torch.manual_seed(seed)
    c = Qwen2_5_VLConfig(text_config=dict(TEXT, rope_scaling={
        "rope_type": "default", "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                           out_hidden_size=64, patch_size=14, spatial_merge_size=2,
                           window_size=56, fullatt_block_indexes=[1]), **IDS)
    return Qwen2_5_VLForConditionalGeneration(c).float().eval(), 14


class ImageOnlyProcessor:
    """What the learner and engine need of a processor: an image processor."""

    def __init__(self, patch_size):
        p = patch_size * 2
        self.image_processor = Qwen2VLImageProcessorPil(
            patch_size=patch_size, merge_size=2, temporal_patch_size=2,
            min_pixels=p * p, max_pixels=8 * p * p)


def image(w, h, seed):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))


def prompt_ids(processor, images, rng, n_text=(5, 3)):
    """Random text with one <start> image <end> block per image, placeholders expanded."""
    grids = processor.image_processor(images=images, return_tensors="np")["image_grid_thw"]
    ids = list(rng.integers(1, 200, n_text[0]))
    for g in grids:
        ids += [START] + [IMG] * (int(np.prod(g)) // 4) + [END] + list(rng.integers(1, 200,
                                                                                    n_text[1]))
    return np.array(ids, np.int64)
