"""M-RoPE position ids in numpy equal transformers' own for both Qwen-VL families."""

import numpy as np
import pytest
import torch
from transformers import Qwen2_5_VLConfig, Qwen3VLConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

from common.mrope import image_token_counts, mrope_position_ids, packed_position_ids

IMG, START, END = 250, 252, 253
TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, vocab_size=300)
IDS = dict(image_token_id=IMG, video_token_id=251, vision_start_token_id=START,
           vision_end_token_id=END)


def qwen3():
    c = Qwen3VLConfig(text_config=dict(TEXT, head_dim=16, rope_scaling={
        "rope_type": "default", "mrope_section": [4, 2, 2], "mrope_interleaved": True}),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                           out_hidden_size=32, patch_size=16, spatial_merge_size=2,
                           deepstack_visual_indexes=[0], num_position_embeddings=64), **IDS)
    return Qwen3VLModel(c)


def qwen25():
    c = Qwen2_5_VLConfig(text_config=dict(TEXT, rope_scaling={
        "rope_type": "default", "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                           out_hidden_size=32, patch_size=14, spatial_merge_size=2,
                           window_size=56, fullatt_block_indexes=[0]), **IDS)
    return Qwen2_5_VLModel(c)


def sequence(grids, text_runs):
    """text, <vision_start> image <vision_end>, text, ... (a multi-turn-like layout)."""
    ids = list(range(1, text_runs[0] + 1))
    for g, n_text in zip(grids, text_runs[1:]):
        ids += [START] + [IMG] * (int(np.prod(g)) // 4) + [END] + list(range(1, n_text + 1))
    return np.array(ids)


@pytest.mark.parametrize("build", [qwen3, qwen25])
@pytest.mark.parametrize("grids,text", [
    ([[1, 4, 4]], [3, 5]),
    ([[1, 4, 4], [1, 4, 6], [1, 8, 2]], [2, 3, 1, 40]),  # several images of different sizes
    ([[1, 6, 10], [1, 2, 2]], [0, 7, 25]),
])
def test_matches_transformers(build, grids, text):
    model = build()
    ids = sequence(grids, text)
    t_ids = torch.from_numpy(ids)[None]
    ref, _ = model.get_rope_index(t_ids, (t_ids == IMG).int(),
                                  image_grid_thw=torch.tensor(grids))
    ours = mrope_position_ids(ids, IMG, np.array(grids), 2)
    np.testing.assert_array_equal(ours, ref[:, 0].numpy())


def test_adjacent_images_are_told_apart_by_count():
    grid = np.array([[1, 2, 2], [1, 2, 4]])
    ids = np.array([7] + [IMG] * 1 + [IMG] * 2 + [8])
    pos = mrope_position_ids(ids, IMG, grid, 2)
    assert pos.T.tolist() == [[0, 0, 0], [1, 1, 1], [2, 2, 2], [2, 2, 3], [4, 4, 4]]


def test_count_mismatch_is_an_error():
    with pytest.raises(ValueError, match="image tokens"):
        mrope_position_ids(np.array([1, IMG, IMG]), IMG, np.array([[1, 4, 4]]), 2)
    assert image_token_counts(np.array([[1, 4, 6], [1, 2, 2]]), 2).tolist() == [6, 1]


def test_packed_positions_restart_per_sequence():
    a, b = sequence([[1, 4, 4]], [2, 3]), sequence([[1, 2, 4], [1, 4, 2]], [1, 1, 2])
    ids = np.concatenate([a, b])
    cu = np.array([0, len(a), len(a) + len(b)])
    grids = np.array([[1, 4, 4], [1, 2, 4], [1, 4, 2]])
    pos = packed_position_ids(ids, cu, np.array([1, 2]), grids, IMG, 2)
    assert pos.shape == (4, len(ids))
    np.testing.assert_array_equal(pos[0], np.concatenate([np.arange(len(a)), np.arange(len(b))]))
    np.testing.assert_array_equal(pos[1:, :len(a)], mrope_position_ids(a, IMG, grids[:1], 2))
    np.testing.assert_array_equal(pos[1:, len(a):], mrope_position_ids(b, IMG, grids[1:], 2))
    with pytest.raises(ValueError):
        packed_position_ids(ids, cu, np.array([1, 1]), grids, IMG, 2)
