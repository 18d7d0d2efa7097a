"""JAX vision towers (geo3k_jax.models.vision) against transformers' torch towers, fp32 on CPU.

Torch weights are re-drawn at unit scale (norm weights and biases included) so that every
parameter matters, copied into the JAX tower by name, and several images of different,
non-square sizes (grids that are not multiples of the attention window, a two-frame grid) go
through both towers; the JAX side runs under jax.jit.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import Qwen2_5_VLVisionConfig, Qwen3VLVisionConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
    Qwen2_5_VisionTransformerPretrainedModel)
from transformers.models.qwen2_vl import Qwen2VLVisionConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel
from transformers.vision_utils import (get_vision_cu_seqlens,
                                       get_vision_interpolation_indices_and_weights,
                                       get_vision_position_ids, get_vision_window_index)

from geo3k_jax.core import stacking
from geo3k_jax.models.vision import Qwen3VisionTower, Qwen25VisionTower, build_vision_tower
from geo3k_jax.core.vision_grid import vision_aux
from tests.tiny_models import ImageOnlyProcessor, image, qwen2_5_vl, qwen3_vl

jax.config.update("jax_default_matmul_precision", "highest")

RTOL = ATOL = 1e-5  # fp32 on both sides; outputs are O(1)
SMALL = dict(depth=4, hidden_size=48, num_heads=3, intermediate_size=80, out_hidden_size=40,
             patch_size=8, spatial_merge_size=2)
# Patch grids (frames, rows, columns): merge units 5x7, 3x2 over two frames, 1x1, 6x3, 4x9.
GRIDS = np.array([[1, 10, 14], [2, 6, 4], [1, 2, 2], [1, 12, 6], [1, 8, 18]])


def small_qwen25():
    """4 blocks, 3 heads, windows of 3x3 merge units, full attention in the first and last."""
    torch.manual_seed(1)
    cfg = Qwen2_5_VLVisionConfig(**SMALL, window_size=48, fullatt_block_indexes=[0, 3])
    return Qwen2_5_VisionTransformerPretrainedModel(cfg).float().eval()


def small_qwen3():
    """4 blocks, 3 heads, a 6x6 position table, DeepStack mergers after blocks 0, 2 and 3."""
    torch.manual_seed(2)
    cfg = Qwen3VLVisionConfig(**SMALL, num_position_embeddings=36,
                              deepstack_visual_indexes=[0, 2, 3])
    return Qwen3VLVisionModel(cfg).float().eval()


def tiny_visual(build):
    """The visual tower of a tests.tiny_models model, its patch size."""
    model, patch = build()
    return model.model.visual, patch


def randomize(visual, seed):
    """Re-draw torch weights at unit scale: matrices ~ 1/sqrt(fan_in), norms ~ 1, biases ~ 0.1."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in visual.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, p[0].numel() ** -0.5)
            elif name.endswith("weight"):
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0.0, 0.1)
    return visual


VISUAL = "model.visual."  # the towers' keys within a model (`geo3k_jax.core.stacking`'s)


def hf_shapes(visual):
    """Torch parameter name -> shape."""
    return {k: tuple(v.shape) for k, v in visual.state_dict().items()}


def jax_shapes(tower):
    """Checkpoint name (the blocks' stacked parameters split per block, `geo3k_jax.core.stacking`)
    -> shape, of the JAX tower's parameters."""
    shapes = {VISUAL + ".".join(map(str, path)): tuple(v.shape)
              for path, v in nnx.to_flat_state(nnx.state(tower, nnx.Param))}
    return {k[len(VISUAL):]: v for k, v in stacking.hf_shapes(shapes).items()}


def load_from_torch(visual):
    """A JAX tower for `visual`'s config holding a copy of its weights, looked up by name (each
    block's stacked in the tower's blocks)."""
    tower = nnx.eval_shape(lambda: build_vision_tower(visual.config, dtype=jnp.float32,
                                                      rngs=nnx.Rngs(0)))
    weights = {VISUAL + k: v.detach().numpy() for k, v in visual.state_dict().items()}
    flat = nnx.to_flat_state(nnx.state(tower, nnx.Param))
    names = [VISUAL + ".".join(map(str, path)) for path, _ in flat]
    stacked = stacking.from_hf(weights, {n: var.get_value() for n, (_, var) in zip(names, flat)})
    for name, (_, var) in zip(names, flat):
        var.set_value(jnp.asarray(stacked[name]))
    nnx.update(tower, nnx.from_flat_state(flat))
    return tower


def run_jax(tower, cfg, pixel_values, grid):
    """The tower under jax.jit, aux passed as a dict of arrays: (embeds, deepstack) in numpy."""
    graphdef, state = nnx.split(tower)
    step = jax.jit(lambda s, px, aux: nnx.merge(graphdef, s)(px, aux))
    aux = {k: jnp.asarray(v) for k, v in vision_aux(cfg, grid).items()}
    embeds, deepstack = step(state, jnp.asarray(pixel_values), aux)
    return np.asarray(embeds), [np.asarray(d) for d in deepstack]


def run_torch(visual, pixel_values, grid):
    """The torch tower: (merged embeds, DeepStack features) in numpy."""
    with torch.no_grad():
        out = visual(torch.from_numpy(pixel_values), grid_thw=torch.from_numpy(grid))
    return out.pooler_output.numpy(), [d.numpy() for d in getattr(out, "deepstack_features",
                                                                  None) or []]


def compare(name, got, want):
    """Print the errors (relative ones to the largest reference value), assert closeness."""
    abs_err = np.abs(got - want)
    rel = float(abs_err.max() / np.abs(want).max())
    print(f"{name}: shape {got.shape} max|want| {np.abs(want).max():.3g} "
          f"max abs err {abs_err.max():.3g} max rel (to max|want|) {rel:.3g}")
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=name)


def check_tower(visual, pixel_values, grid, n_deepstack):
    embeds, deepstack = run_jax(load_from_torch(visual), visual.config, pixel_values, grid)
    want_embeds, want_deepstack = run_torch(visual, pixel_values, grid)
    assert embeds.shape == (grid.prod(1).sum() // 4, visual.config.out_hidden_size)
    compare("embeds", embeds, want_embeds)
    assert len(deepstack) == len(want_deepstack) == n_deepstack
    for i, (got, want) in enumerate(zip(deepstack, want_deepstack)):
        compare(f"deepstack {i}", got, want)


def processor_inputs(patch):
    """Three images of different sizes (two non-square) through the Qwen-VL image processor."""
    out = ImageOnlyProcessor(patch).image_processor(
        images=[image(130, 45, 0), image(40, 100, 1), image(90, 90, 2)], return_tensors="np")
    return out["pixel_values"].astype(np.float32), out["image_grid_thw"].astype(np.int64)


def random_pixels(visual, grid, seed):
    """Standard-normal flattened patches for `grid`: (P, C*T*p*p) float32."""
    c = visual.config
    width = c.in_channels * c.temporal_patch_size * c.patch_size ** 2
    return np.random.default_rng(seed).standard_normal((grid.prod(1).sum(), width), np.float32)


@pytest.mark.parametrize("build,n_deepstack", [(qwen2_5_vl, 0), (qwen3_vl, 1)],
                         ids=["qwen2_5_vl", "qwen3_vl"])
def test_tiny_models_match_torch_on_processed_images(build, n_deepstack):
    visual, patch = tiny_visual(build)
    pixel_values, grid = processor_inputs(patch)
    assert len({tuple(g) for g in grid}) == len(grid)
    check_tower(randomize(visual, 3), pixel_values, grid, n_deepstack)


@pytest.mark.parametrize("build,n_deepstack", [(small_qwen25, 0), (small_qwen3, 3)],
                         ids=["qwen2_5_vl", "qwen3_vl"])
def test_deeper_towers_match_torch_on_ragged_grids(build, n_deepstack):
    visual = randomize(build(), 4)
    check_tower(visual, random_pixels(visual, GRIDS, 5), GRIDS, n_deepstack)


def test_aux_matches_transformers_grid_helpers():
    grid = torch.from_numpy(GRIDS)
    c25 = small_qwen25().config
    aux = vision_aux(c25, GRIDS)
    window_index, cu_windows = get_vision_window_index(grid, 2, c25.window_size, c25.patch_size)
    np.testing.assert_array_equal(np.argsort(aux["merge_unperm"]), window_index.numpy())
    units = aux["window_perm"].reshape(-1, 4)
    np.testing.assert_array_equal(units[:, 0] // 4, window_index.numpy())
    np.testing.assert_array_equal(units - units[:, :1], np.tile(np.arange(4), (len(units), 1)))
    positions = get_vision_position_ids(grid, 2).numpy()
    np.testing.assert_array_equal(aux["rope_pos"], positions[aux["window_perm"]])
    np.testing.assert_array_equal(boundaries(aux["window_segments"]), cu_windows.numpy())
    np.testing.assert_array_equal(boundaries(aux["segments"]), get_vision_cu_seqlens(grid).numpy())

    c3 = small_qwen3().config
    aux = vision_aux(c3, GRIDS)
    indices, weights = get_vision_interpolation_indices_and_weights(
        grid, 6, mode="bilinear", align_corners=True, spatial_merge_size=2)
    np.testing.assert_array_equal(aux["pos_indices"], indices.numpy())
    np.testing.assert_array_equal(aux["pos_weights"], weights.numpy())
    np.testing.assert_array_equal(aux["rope_pos"], positions)
    np.testing.assert_array_equal(boundaries(aux["segments"]), get_vision_cu_seqlens(grid).numpy())
    assert {k: v.dtype for k, v in aux.items()} == dict(
        rope_pos=np.int32, segments=np.int32, pos_indices=np.int32, pos_weights=np.float32)


def boundaries(segments):
    """cu_seqlens of a segment-id array: 0, every change of id, the length."""
    changes = np.flatnonzero(np.diff(segments)) + 1
    return np.concatenate([[0], changes, [len(segments)]])


@pytest.mark.parametrize("build", [lambda: tiny_visual(qwen2_5_vl)[0],
                                   lambda: tiny_visual(qwen3_vl)[0], small_qwen25, small_qwen3],
                         ids=["tiny_qwen2_5_vl", "tiny_qwen3_vl", "small_qwen2_5_vl",
                              "small_qwen3_vl"])
def test_parameter_names_and_shapes_are_huggingface(build):
    visual = build()
    tower = nnx.eval_shape(lambda: build_vision_tower(visual.config, dtype=jnp.float32,
                                                      rngs=nnx.Rngs(0)))
    assert isinstance(tower, (Qwen25VisionTower, Qwen3VisionTower))
    assert jax_shapes(tower) == hf_shapes(visual)


def test_unknown_config_is_rejected():
    with pytest.raises(ValueError, match="unsupported vision config model_type 'qwen2_vl_vision'"):
        build_vision_tower(Qwen2VLVisionConfig(), dtype=jnp.float32, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="qwen2_vl_vision"):
        vision_aux(Qwen2VLVisionConfig(), GRIDS)
