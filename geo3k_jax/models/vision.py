"""Flax NNX vision towers of Qwen2.5-VL and Qwen3-VL, numerically matching transformers' torch
`Qwen2_5_VisionTransformerPretrainedModel` and `Qwen3VLVisionModel`.

Both towers embed flattened patches (the Conv3d patch embedding as one matmul), run pre-norm
transformer blocks with 2-D (row, column) rotary embeddings and attention restricted to one frame
of one image, and merge each spatial_merge_size**2 group of neighbouring patches into one output
token with an MLP:

* Qwen2.5-VL: RMSNorm blocks with a gated MLP; all blocks but `fullatt_block_indexes` attend
  within windows of `window_size` pixels only, so the patches are regrouped window by window
  before the blocks and the merged tokens are put back in image order at the end.
* Qwen3-VL: LayerNorm blocks with a plain MLP; a learned square position-embedding table is
  bilinearly resampled (align_corners) to each image's grid and added to the patch embeddings;
  the DeepStack mergers turn the outputs of the `deepstack_visual_indexes` blocks into extra
  features for the language model.

Parameters carry Hugging Face's names and layouts (a path in the state, joined with dots, is the
key of `model.visual.state_dict()`), except that the blocks are one
`geo3k_jax.models.layers.LayerStack` (`blocks.attn.qkv.weight` holds every block's along a leading
axis; `geo3k_jax.core.stacking` maps the checkpoint's `blocks.3.attn.qkv.weight`) run as one
`lax.scan`: a program compiles one block whatever the depth. Everything that depends on the image
grids is computed on the host by `geo3k_jax.core.vision_grid.vision_aux` in numpy, so the towers
take arrays only and run under `jax.jit` (one compilation per patch count).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from geo3k_jax.models.layers import (INIT_STD, Embedding, GatedMLP, LayerNorm, LayerStack, Linear,
                              RMSNorm, activation, apply_rotary, attention, rope_inv_freq,
                              segment_mask)
from geo3k_jax.kernels.splash import Attention, vision_attention
from geo3k_jax.core.vision_grid import QWEN3, QWEN25, tower

NORM_EPS = 1e-6
BLOCK_PARTS = ("norm1", "norm2", "attn", "mlp")  # a VisionBlock's parts, stacked over blocks

def rotary_cos_sin(rope_pos: jax.Array, head_dim: int, theta: float
                   ) -> tuple[jax.Array, jax.Array]:
    """Axial 2-D rotary tables in fp32: (P, 2) int positions -> cos, sin (P, head_dim).

    A quarter of head_dim frequencies rotate by the row, the next quarter by the column; the
    half is repeated over the full head_dim (rotate_half pairs i with i + head_dim / 2)."""
    spatial = head_dim // 2
    inv_freq = rope_inv_freq(theta, spatial)
    freqs = rope_pos.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    freqs = freqs.reshape(rope_pos.shape[0], -1)  # (P, 2, head_dim/4) -> rows then columns
    angles = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def whole_on_row_devices(x: jax.Array, row_mesh: Mesh | None) -> jax.Array:
    """One row's patch activations x (P, D), in a tower vmapped over rows that `row_mesh`'s data
    axes split (`spmd_axis_name`), kept whole on that row's devices, as the decoder's rows are.
    Left to XLA, the scanned blocks' carry took the weights' layout (features over fsdp, so
    rows not over fsdp) and each device computed every row of its fsdp group. row_mesh None:
    x unchanged."""
    if row_mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(row_mesh, P()))


def _rotary_dim(cfg) -> int:
    """Head dimension the rotary tables are built for (transformers' axial rope rule)."""
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_heads


class PatchProjection(nnx.Module):
    """Conv3d whose kernel equals its stride and its input: a matmul over flattened patches.

    weight: (D, C, T, p, p) as torch's Conv3d; x: (P, C*T*p*p) -> (P, D) in the weight's dtype."""

    def __init__(self, channels: int, temporal: int, patch: int, dim: int, *, bias: bool,
                 dtype, rngs: nnx.Rngs):
        shape = (dim, channels, temporal, patch, patch)
        self.weight = nnx.Param(
            (INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype))
        self.bias = nnx.Param(jnp.zeros((dim,), dtype)) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        weight = self.weight[...]
        y = x.astype(weight.dtype) @ weight.reshape(weight.shape[0], -1).T
        return y if self.bias is None else y + self.bias[...]


class PatchEmbed(nnx.Module):
    """HF's `patch_embed`: holds `proj`. x: (P, C*T*p*p) -> (P, hidden_size)."""

    def __init__(self, cfg, *, bias: bool, dtype, rngs: nnx.Rngs):
        self.proj = PatchProjection(cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size,
                                    cfg.hidden_size, bias=bias, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.proj(x)


class VisionAttention(nnx.Module):
    """Bidirectional multi-head attention with fused qkv and 2-D rotary, masked by segments."""

    def __init__(self, cfg, *, dtype, rngs: nnx.Rngs, attention: Attention):
        dim = cfg.hidden_size
        self.attention = attention
        self.num_heads = cfg.num_heads
        self.scale = (dim // cfg.num_heads) ** -0.5
        self.qkv = Linear(dim, 3 * dim, bias=True, dtype=dtype, rngs=rngs)
        self.proj = Linear(dim, dim, bias=True, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, segments: jax.Array
                 ) -> jax.Array:
        """x: (P, D); cos, sin: (P, head_dim); segments: (P,) a patch attends to the patches
        of its own id -> (P, D)."""
        qkv = self.qkv(x).reshape(x.shape[0], 3, self.num_heads, -1)
        q = apply_rotary(qkv[:, 0], cos, sin)
        k = apply_rotary(qkv[:, 1], cos, sin)
        if self.attention.splash:
            return self.proj(vision_attention(self.attention, q, k, qkv[:, 2], segments,
                                              self.scale))
        return self.proj(attention(q, k, qkv[:, 2], segment_mask(segments), self.scale))


class MLP(nnx.Module):
    """Qwen3-VL block MLP: linear_fc2(act(linear_fc1(x)))."""

    def __init__(self, cfg, *, dtype, rngs: nnx.Rngs):
        dim, hidden = cfg.hidden_size, cfg.intermediate_size
        self.linear_fc1 = Linear(dim, hidden, bias=True, dtype=dtype, rngs=rngs)
        self.linear_fc2 = Linear(hidden, dim, bias=True, dtype=dtype, rngs=rngs)
        self.act = activation(cfg.hidden_act)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nnx.Module):
    """Pre-norm block: x + attn(norm1(x)), then + mlp(norm2(x)).

    Qwen2.5-VL (`qwen25=True`): RMSNorm and the gated MLP; Qwen3-VL: LayerNorm and the plain MLP."""

    def __init__(self, cfg, *, qwen25: bool, dtype, rngs: nnx.Rngs, attention: Attention):
        norm = RMSNorm if qwen25 else LayerNorm
        self.norm1 = norm(cfg.hidden_size, eps=NORM_EPS, dtype=dtype)
        self.norm2 = norm(cfg.hidden_size, eps=NORM_EPS, dtype=dtype)
        self.attn = VisionAttention(cfg, dtype=dtype, rngs=rngs, attention=attention)
        self.mlp = (GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, bias=True,
                             dtype=dtype, rngs=rngs) if qwen25
                    else MLP(cfg, dtype=dtype, rngs=rngs))

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, segments: jax.Array
                 ) -> jax.Array:
        """x: (P, D); cos, sin: (P, head_dim); segments: (P,) -> (P, D)."""
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class Qwen25Merger(nnx.Module):
    """Qwen2.5-VL patch merger: RMSNorm `ln_q` per patch, concatenate each group of merge**2
    patches, then `mlp` = [Linear, GELU, Linear] (torch's nn.Sequential, hence `mlp.0`, `mlp.2`).

    x: (P, D) -> (P / merge**2, out_hidden_size)."""

    def __init__(self, cfg, *, dtype, rngs: nnx.Rngs):
        grouped = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.ln_q = RMSNorm(cfg.hidden_size, eps=NORM_EPS, dtype=dtype)
        self.mlp = nnx.List([Linear(grouped, grouped, bias=True, dtype=dtype, rngs=rngs),
                             activation("gelu"),
                             Linear(grouped, cfg.out_hidden_size, bias=True, dtype=dtype,
                                    rngs=rngs)])
        self.grouped = grouped

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.ln_q(x).reshape(-1, self.grouped)
        for layer in self.mlp:
            x = layer(x)
        return x


class Qwen3Merger(nnx.Module):
    """Qwen3-VL patch merger: LayerNorm `norm` per patch (or, with `postshuffle`, per group as
    in the DeepStack mergers), groups of merge**2 patches concatenated, linear_fc1, GELU,
    linear_fc2. x: (P, D) -> (P / merge**2, out_hidden_size)."""

    def __init__(self, cfg, *, postshuffle: bool, dtype, rngs: nnx.Rngs):
        grouped = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.norm = LayerNorm(grouped if postshuffle else cfg.hidden_size, eps=NORM_EPS,
                              dtype=dtype)
        self.linear_fc1 = Linear(grouped, grouped, bias=True, dtype=dtype, rngs=rngs)
        self.linear_fc2 = Linear(grouped, cfg.out_hidden_size, bias=True, dtype=dtype, rngs=rngs)
        self.act = activation("gelu")
        self.grouped = grouped
        self.postshuffle = postshuffle

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.postshuffle:
            x = x.reshape(-1, self.grouped)
        x = self.norm(x).reshape(-1, self.grouped)
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Qwen25VisionTower(nnx.Module):
    """Qwen2.5-VL vision tower (transformers' Qwen2_5_VisionTransformerPretrainedModel).

    __call__(pixel_values (P, C*T*p*p), aux from `vision_aux`) ->
    (embeds (P / merge**2, out_hidden_size), [] : no DeepStack features)."""

    def __init__(self, cfg, *, dtype, rngs: nnx.Rngs, attention: Attention = Attention()):
        self.patch_embed = PatchEmbed(cfg, bias=False, dtype=dtype, rngs=rngs)
        self.blocks = LayerStack(cfg.depth, lambda: VisionBlock(
            cfg, qwen25=True, dtype=dtype, rngs=rngs, attention=attention), BLOCK_PARTS)
        self.attention = attention
        self.merger = Qwen25Merger(cfg, dtype=dtype, rngs=rngs)
        self.fullatt_block_indexes = tuple(cfg.fullatt_block_indexes)
        self.rotary_dim = _rotary_dim(cfg)
        self.rope_theta = float(cfg.rope_parameters["rope_theta"])

    def __call__(self, pixel_values: jax.Array, aux: dict[str, jax.Array], remat: bool = False,
                 row_mesh: Mesh | None = None) -> tuple[jax.Array, list[jax.Array]]:
        """(P, C*T*p*p) patches, `vision_aux` arrays -> (P / merge**2, out_hidden_size), [].
        remat: each block's activations are recomputed in the backward pass. row_mesh: the
        mesh whose data axes split the rows this call is vmapped over (`whole_on_row_devices`)."""
        x = self.patch_embed(pixel_values)[aux["window_perm"]]
        cos, sin = rotary_cos_sin(aux["rope_pos"], self.rotary_dim, self.rope_theta)
        full = jnp.asarray([i in self.fullatt_block_indexes for i in range(len(self.blocks))])

        def step(block, i, h):  # the full-attention blocks' segments are frames, else windows
            segments = jnp.where(full[i], aux["segments"], aux["window_segments"])
            return whole_on_row_devices(block(h, cos, sin, segments), row_mesh)
        x = self.blocks.scan(step, x, remat=remat)
        return self.merger(x)[aux["merge_unperm"]], []


class Qwen3VisionTower(nnx.Module):
    """Qwen3-VL vision tower (transformers' Qwen3VLVisionModel).

    __call__(pixel_values (P, C*T*p*p), aux from `vision_aux`) ->
    (embeds (P / merge**2, out_hidden_size),
     one (P / merge**2, out_hidden_size) DeepStack feature per `deepstack_visual_indexes` entry)."""

    def __init__(self, cfg, *, dtype, rngs: nnx.Rngs, attention: Attention = Attention()):
        self.patch_embed = PatchEmbed(cfg, bias=True, dtype=dtype, rngs=rngs)
        self.pos_embed = Embedding(cfg.num_position_embeddings, cfg.hidden_size, dtype=dtype,
                                   rngs=rngs)
        self.blocks = LayerStack(cfg.depth, lambda: VisionBlock(
            cfg, qwen25=False, dtype=dtype, rngs=rngs, attention=attention), BLOCK_PARTS)
        self.attention = attention
        self.merger = Qwen3Merger(cfg, postshuffle=False, dtype=dtype, rngs=rngs)
        self.deepstack_merger_list = nnx.List([
            Qwen3Merger(cfg, postshuffle=True, dtype=dtype, rngs=rngs)
            for _ in cfg.deepstack_visual_indexes])
        self.deepstack_visual_indexes = tuple(cfg.deepstack_visual_indexes)
        self.rotary_dim = _rotary_dim(cfg)
        self.rope_theta = float(cfg.rope_parameters["rope_theta"])

    def interpolated_pos_embed(self, indices: jax.Array, weights: jax.Array) -> jax.Array:
        """Weighted sum of position-table rows in fp32: (P, 4) indices, weights -> (P, D)."""
        rows = self.pos_embed(indices).astype(jnp.float32)
        return (rows * weights[:, :, None].astype(jnp.float32)).sum(axis=1)

    def __call__(self, pixel_values: jax.Array, aux: dict[str, jax.Array], remat: bool = False,
                 row_mesh: Mesh | None = None) -> tuple[jax.Array, list[jax.Array]]:
        """(P, C*T*p*p) patches, `vision_aux` arrays -> (P / merge**2, out_hidden_size) embeds
        and the DeepStack features, each (P / merge**2, out_hidden_size). remat: each block's
        activations are recomputed in the backward pass. row_mesh: the mesh whose data axes
        split the rows this call is vmapped over (`whole_on_row_devices`)."""
        x = self.patch_embed(pixel_values)
        x = x + self.interpolated_pos_embed(aux["pos_indices"], aux["pos_weights"]).astype(x.dtype)
        cos, sin = rotary_cos_sin(aux["rope_pos"], self.rotary_dim, self.rope_theta)

        def block_out(block, h):  # (P, D) -> (P, D)
            return whole_on_row_devices(block(h, cos, sin, aux["segments"]), row_mesh)
        if not self.deepstack_visual_indexes:
            return self.merger(self.blocks.scan(
                lambda block, i, h: block_out(block, h), x, remat=remat)), []

        def step(block, i, h):  # every block's output: the DeepStack mergers read some
            h = block_out(block, h)
            return h, h
        x, outs = self.blocks.scan(step, x, remat=remat, outputs=True)  # outs (depth, P, D)
        return self.merger(x), [merger(outs[i]) for i, merger in
                                zip(self.deepstack_visual_indexes, self.deepstack_merger_list)]


def build_vision_tower(cfg, *, dtype, rngs: nnx.Rngs, attention: Attention = Attention()
                       ) -> Qwen25VisionTower | Qwen3VisionTower:
    """The tower for transformers vision config `cfg` (`model.config.vision_config`);
    `attention`: its per-image attention, dense or splash (`geo3k_jax.kernels.splash`)."""
    towers = {QWEN25: Qwen25VisionTower, QWEN3: Qwen3VisionTower}
    return towers[tower(cfg)](cfg, dtype=dtype, rngs=rngs, attention=attention)
