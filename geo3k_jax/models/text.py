"""The Qwen2.5-VL and Qwen3-VL language models in Flax NNX, with M-RoPE.

Both are pre-norm decoders with grouped-query attention and a gated SiLU MLP. They differ in:

    Qwen2.5-VL: q/k/v projections with bias, o_proj without; head_dim = hidden / heads;
                M-RoPE frequencies in contiguous sections  [t t t ... h h h ... w w w ...]
    Qwen3-VL:   optional attention bias (`attention_bias`), RMSNorm on every q and k head, its own
                `head_dim`; M-RoPE frequencies interleaved  [t h w t h w ... t t t]; DeepStack:
                vision features added to the image tokens' hidden states after the first layers.
    Qwen3-VL-MoE: Qwen3-VL whose sparse layers' MLP is a top-k mixture of experts
                (`geo3k_jax.models.moe`); every layer sparse (Qwen3-VL-30B-A3B) or every layer
                dense, since the stacked layers share one structure.

Inputs are rows of packed sequences: a (B, T) batch whose row b holds several sequences told apart
by segment ids; attention is causal within a segment, which is what transformers does when it is
given packed text positions. The attention is chosen by `geo3k_jax.kernels.splash.Attention`:
windowed (`geo3k_jax.kernels.windowed`: each block of queries reads two windows of keys, its shared
prefix and its own segments, so a row costs T x (Wp + W) scores, Wp about the longest shared prompt
and W the longest continuation, rather than T x T) or the Pallas splash kernel with segment ids
(`geo3k_jax.kernels.splash`, TPU). Positions are the three M-RoPE rows (temporal, height, width) of
`common.mrope`.

The decoder layers are one `DecoderStack`: each parameter holds all layers along a leading axis,
and a forward is a `jax.lax.scan` over it, so a program compiles one layer whatever the depth.
Checkpoint keys name layers one by one (`layers.3.mlp.up_proj.weight`); `geo3k_jax.core.stacking`
maps them to the stacked keys (`layers.mlp.up_proj.weight`, row 3) when loading and back when
exporting.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from common.processor import family
from geo3k_jax.models.layers import (Embedding, GatedMLP, LayerStack, Linear, RMSNorm, apply_rotary,
                              rope_inv_freq, scatter_rows)
from geo3k_jax.kernels.splash import Attention, text_attention
from geo3k_jax.kernels.windowed import WINDOW_AXES, window_mask, windowed_attention
from geo3k_jax.models.moe import SparseMoeBlock, sparse_layers

ARCHS = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")


def mrope_rows(arch: str, section: list[int], half: int) -> np.ndarray:
    """Which position row (0 = t, 1 = h, 2 = w) drives each of the head_dim / 2 frequencies."""
    if sum(section) != half:
        raise ValueError(f"mrope_section {section} must sum to head_dim / 2 = {half}")
    if arch == "qwen2_5_vl":
        return np.repeat(np.arange(3), section)
    rows = np.zeros(half, np.int64)
    rows[1:3 * section[1]:3] = 1
    rows[2:3 * section[2]:3] = 2
    return rows


class MRoPE:
    """Multimodal rotary tables: positions (B, 3, T) -> cos, sin (B, T, head_dim), fp32."""

    def __init__(self, arch: str, head_dim: int, rope_parameters: dict):
        if rope_parameters.get("rope_type", "default") != "default":
            raise ValueError(f"rope_type {rope_parameters['rope_type']!r} is not supported "
                             "(Qwen-VL checkpoints use 'default')")
        theta = float(rope_parameters["rope_theta"])
        self.inv_freq = rope_inv_freq(theta, head_dim)
        self.rows = mrope_rows(arch, list(rope_parameters["mrope_section"]), head_dim // 2)

    def __call__(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        pos = positions[:, self.rows, :].astype(jnp.float32)  # (B, D/2, T): frequency j's row
        freqs = jnp.swapaxes(pos, 1, 2) * jnp.asarray(self.inv_freq)  # (B, T, D/2)
        emb = jnp.concatenate([freqs, freqs], axis=-1)
        return jnp.cos(emb), jnp.sin(emb)


class TextAttention(nnx.Module):
    """Grouped-query self-attention over packed rows. x: (B, T, hidden) -> (B, T, hidden)."""

    def __init__(self, cfg, arch: str, *, dtype, rngs: nnx.Rngs):
        h, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, head_dim_of(cfg, arch)
        qkv_bias = True if arch == "qwen2_5_vl" else cfg.attention_bias
        o_bias = False if arch == "qwen2_5_vl" else cfg.attention_bias
        self.q_proj = Linear(cfg.hidden_size, h * d, bias=qkv_bias, dtype=dtype, rngs=rngs)
        self.k_proj = Linear(cfg.hidden_size, kv * d, bias=qkv_bias, dtype=dtype, rngs=rngs)
        self.v_proj = Linear(cfg.hidden_size, kv * d, bias=qkv_bias, dtype=dtype, rngs=rngs)
        self.o_proj = Linear(h * d, cfg.hidden_size, bias=o_bias, dtype=dtype, rngs=rngs)
        if arch == "qwen3_vl":
            self.q_norm = RMSNorm(d, eps=cfg.rms_norm_eps, dtype=dtype)
            self.k_norm = RMSNorm(d, eps=cfg.rms_norm_eps, dtype=dtype)
        self.heads, self.kv_heads, self.head_dim = h, kv, d
        self.qk_norm = arch == "qwen3_vl"

    def __call__(self, x, cos, sin, attend):
        """x: (B, T, hidden); cos, sin: (B, T, head_dim); attend(q, k, v, scale): the packed
        rows' attention of q (B, T, H, D) to k, v (B, T, Hkv, D) -> (B, T, H * D)."""
        rows = x.shape[:-1]
        q = self.q_proj(x).reshape(rows + (self.heads, self.head_dim))
        k = self.k_proj(x).reshape(rows + (self.kv_heads, self.head_dim))
        v = self.v_proj(x).reshape(rows + (self.kv_heads, self.head_dim))
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return self.o_proj(attend(q, k, v, self.head_dim ** -0.5))


class DecoderLayer(nnx.Module):
    """Pre-norm attention + MLP block. x: (B, T, hidden) -> (B, T, hidden)."""

    def __init__(self, cfg, arch: str, *, sparse: bool, dtype, rngs: nnx.Rngs,
                 attention: Attention):
        """arch: the family (`common.processor.family`); sparse: the MLP is a mixture of
        experts (`geo3k_jax.models.moe`, its rows mapped over `attention.mesh`)."""
        self.self_attn = TextAttention(cfg, arch, dtype=dtype, rngs=rngs)
        self.mlp = (SparseMoeBlock(cfg, dtype=dtype, rngs=rngs, attention=attention) if sparse
                    else GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act,
                                  bias=False, dtype=dtype, rngs=rngs))
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps,
                                                dtype=dtype)

    def __call__(self, x, cos, sin, attend, replay=None):
        """Returns (x, the router's own top k (B, T, K), None for a dense MLP); replay
        (B, T, K): a sparse block's experts per token (`geo3k_jax.models.moe`)."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attend)
        return self.residual_mlp(x, replay)

    def residual_mlp(self, x, replay=None):
        """x + its MLP, and the router's own top k (None: dense); see `__call__`."""
        if not isinstance(self.mlp, SparseMoeBlock):
            if replay is not None:
                raise ValueError("routing replay on a dense MLP")
            return x + self.mlp(self.post_attention_layernorm(x)), None
        y, top = self.mlp(self.post_attention_layernorm(x), replay)
        return x + y, top


class DecoderStack(LayerStack):
    """`n` decoder layers stacked (`geo3k_jax.models.layers.LayerStack`); `run` scans them over
    hidden states."""

    PARTS = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")

    def __init__(self, n: int, make):
        super().__init__(n, make, self.PARTS)

    def run(self, x: jax.Array, cos, sin, attend, *, remat: bool | str, after=None,
            routing: jax.Array | None = None, record: bool = False):
        """x (B, T, hidden) through every layer in order (`DecoderLayer`'s inputs); `remat` and
        `after(i, x)` as `scan`'s. routing (B, T, L, K): the experts sparse layer i routes each
        token to are routing[:, :, i] (-1: its own top k). record: returns (x, the routers' own
        top k (L, B, T, K) int32), else x."""
        def step(layer, i, h):
            h, top = layer(h, cos, sin, attend, None if routing is None else routing[:, :, i])
            return (h, top) if record else h
        return self.scan(step, x, remat=remat, after=after, outputs=record)


def deepstack_after(deepstack, index: jax.Array, dtype):
    """`LayerStack.scan`'s `after` for DeepStack: feature k (B, N, hidden) added to layer k's
    output (B, T, hidden) at the row positions index (B, N) (positions >= T dropped); None
    without features."""
    if not len(deepstack):
        return None
    features = jnp.stack([f.astype(dtype) for f in deepstack])  # (K, B, N, hidden)
    return len(deepstack), lambda i, h: scatter_rows(h, index, features[i], "add")


def head_dim_of(cfg, arch: str) -> int:
    """Qwen2.5-VL derives head_dim from the hidden size; Qwen3-VL configs carry it."""
    if family(arch) == "qwen3_vl" and getattr(cfg, "head_dim", None):
        return int(cfg.head_dim)
    return cfg.hidden_size // cfg.num_attention_heads


class TextModel(nnx.Module):
    """Embedding, decoder layers and final norm (transformers' `model.language_model`)."""

    def __init__(self, cfg, arch: str, *, dtype, rngs: nnx.Rngs,
                 attention: Attention = Attention()):
        if arch not in ARCHS:
            raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
        if "sliding_attention" in (getattr(cfg, "layer_types", None) or []):
            raise ValueError("sliding-window text attention is not supported (Qwen-VL "
                             "checkpoints set use_sliding_window=false)")
        sparse = sparse_layers(cfg) if arch == "qwen3_vl_moe" else [False]
        if len(set(sparse)) > 1:
            raise ValueError(
                f"decoder layers {[i for i, s in enumerate(sparse) if s]} are sparse MoE blocks "
                "and the others dense MLPs; the stacked decoder needs every layer alike "
                "(decoder_sparse_step=1 and mlp_only_layers=[], as Qwen3-VL-30B-A3B)")
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = DecoderStack(cfg.num_hidden_layers, lambda: DecoderLayer(
            cfg, family(arch), sparse=sparse[0], dtype=dtype, rngs=rngs, attention=attention))
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.rope = MRoPE(family(arch), head_dim_of(cfg, arch), dict(cfg.rope_parameters))
        self.attention = attention

    def __call__(self, embeds: jax.Array, positions: jax.Array, segments: jax.Array,
                 windows: dict, visual_index: jax.Array | None = None,
                 deepstack: list[jax.Array] = (), remat: bool = False,
                 prefix: jax.Array | None = None, routing: jax.Array | None = None,
                 record: bool = False):
        """embeds: (B, T, hidden); positions: (B, 3, T); segments: (B, T); attention windows:
        attn_starts, prefix_starts (B, T / block), key_offsets (W,), prefix_offsets (Wp,)
        (`geo3k_jax.core.batch.attention_windows`). DeepStack:
        feature k (B, N, hidden) is added after layer k at the row positions visual_index
        (B, N) (positions >= T are dropped). remat: each layer's activations are recomputed in
        the backward pass (memory of one layer instead of all). prefix: (B, T) the shared prefix
        segment each token's segment continues (`geo3k_jax.core.batch`; None: none). routing,
        record: the experts replayed and the routing returned (`DecoderStack.run`). Returns
        normed hidden states (B, T, hidden), with `record` and the routers' top k."""
        cos, sin = self.rope(positions)
        if self.attention.splash:
            def attend(q, k, v, scale):
                return text_attention(self.attention, q, k, v, segments, prefix, scale)
        else:
            windows = jax.tree.map(jnp.asarray, windows)  # numpy arrays: not vmapped constants
            mask = jax.vmap(window_mask, in_axes=(0, WINDOW_AXES, None if prefix is None else 0))(
                segments, windows, prefix)

            def attend(q, k, v, scale):
                return windowed_attention(q, k, v, windows, mask, scale)
        deep = deepstack_after(deepstack, visual_index, embeds.dtype)
        out = self.layers.run(embeds, cos, sin, attend, remat=remat, after=deep,
                              routing=routing, record=record)
        return (self.norm(out[0]), out[1]) if record else self.norm(out)
