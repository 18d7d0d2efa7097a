"""Flax NNX building blocks shared by the Qwen-VL vision towers and language models.

Parameters are stored in Hugging Face's layout and under Hugging Face's names (a linear layer's
`weight` is (out, in), norms have `weight` and `bias`), so a module path such as
`model.language_model.layers.0.self_attn.q_proj.weight` IS the checkpoint key: loading and
exporting are a rename-free walk over the state (`geo3k_jax.models.weights`), and partition rules
are written against the names users see in checkpoints.

Compute runs in the parameters' dtype; softmax, rotary and norm statistics in at least fp32
(`geo3k_jax.core.dtypes.wide_dtype`), as transformers does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from geo3k_jax.core.dtypes import wide_dtype

INIT_STD = 0.02


def init_normal(rngs: nnx.Rngs, shape: tuple[int, ...], dtype) -> jax.Array:
    """A new weight of `shape`: normal with std INIT_STD (the checkpoint overwrites it)."""
    return (INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class Linear(nnx.Module):
    """y = x @ weight.T + bias. weight: (out, in); x: (..., in) -> (..., out)."""

    def __init__(self, d_in: int, d_out: int, *, bias: bool, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(init_normal(rngs, (d_out, d_in), dtype))
        self.bias = nnx.Param(jnp.zeros((d_out,), dtype)) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = jnp.einsum("...i,oi->...o", x, self.weight[...])
        return y if self.bias is None else y + self.bias[...]


class Embedding(nnx.Module):
    """Token embedding table. weight: (vocab, dim); ids: (...) int -> (..., dim)."""

    def __init__(self, vocab: int, dim: int, *, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(init_normal(rngs, (vocab, dim), dtype))

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.weight[...], ids, axis=0)


class RMSNorm(nnx.Module):
    """x / rms(x) * weight, statistics in fp32, cast back before the scale (as transformers)."""

    def __init__(self, dim: int, *, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(wide_dtype(x.dtype))
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * xf.astype(x.dtype)


class LayerNorm(nnx.Module):
    """Standard LayerNorm with weight and bias, statistics in fp32."""

    def __init__(self, dim: int, *, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.bias = nnx.Param(jnp.zeros((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(wide_dtype(x.dtype))
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * self.weight[...].astype(xf.dtype)
                + self.bias[...].astype(xf.dtype)).astype(x.dtype)


class GatedMLP(nnx.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)). x: (..., dim) -> (..., dim)."""

    def __init__(self, dim: int, hidden: int, act: str, *, bias: bool, dtype, rngs: nnx.Rngs):
        self.gate_proj = Linear(dim, hidden, bias=bias, dtype=dtype, rngs=rngs)
        self.up_proj = Linear(dim, hidden, bias=bias, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(hidden, dim, bias=bias, dtype=dtype, rngs=rngs)
        self.act = activation(act)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def activation(name: str):
    """The transformers activation called `name` (ACT2FN), as a jax function."""
    table = {"silu": jax.nn.silu, "swish": jax.nn.silu,
             "gelu": lambda x: jax.nn.gelu(x, approximate=False),
             "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
             "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
             "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x)}
    if name not in table:
        raise ValueError(f"activation {name!r} is not supported; known: {sorted(table)}")
    return table[name]


def rope_inv_freq(theta: float, dim: int) -> np.ndarray:
    """(dim / 2,) float32 rotary inverse frequencies 1 / theta^(2i / dim), rounded as torch
    computes them: the exponent in float32, the power rounded from float64 (torch's float32 pow
    is correctly rounded except in rare near-ties), the reciprocal in float32. A one-ulp
    difference here becomes position x ulp of angle, 1e-4 rad at a few thousand tokens."""
    exponent = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    power = (np.float64(theta) ** exponent.astype(np.float64)).astype(np.float32)
    return np.float32(1.0) / power


def rotate_half(x: jax.Array) -> jax.Array:
    """(x1, x2) -> (-x2, x1) over the last axis split in halves."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotary embedding in (at least) fp32. x: (..., T, H, D); cos/sin: (..., T, D). Returns
    x's dtype."""
    xf = x.astype(wide_dtype(x.dtype))
    cos, sin = cos[..., None, :].astype(xf.dtype), sin[..., None, :].astype(xf.dtype)
    return (xf * cos + rotate_half(xf) * sin).astype(x.dtype)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
              scale: float) -> jax.Array:
    """Masked softmax attention with grouped KV heads.

    q: (T, H, D); k, v: (S, Hkv, D) with H a multiple of Hkv; mask: (T, S) bool, True = attend.
    Scores and softmax in (at least) fp32, probabilities cast to v's dtype. Returns (T, H * D).
    """
    t, h, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(t, hkv, h // hkv, d)  # head i uses kv head i // (H / Hkv), as repeat_kv
    wide = wide_dtype(q.dtype)
    scores = jnp.einsum("tgrd,sgd->grts", qg, k, preferred_element_type=wide) * scale
    scores = jnp.where(mask[None, None], scores, jnp.finfo(wide).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("grts,sgd->tgrd", probs, v)
    return out.reshape(t, h * d)


def segment_mask(segments: jax.Array) -> jax.Array:
    """(T,) segment ids -> (T, T) bool: query and key in the same segment."""
    return segments[:, None] == segments[None, :]


def scatter_rows(x: jax.Array, index: jax.Array, values: jax.Array, op: str) -> jax.Array:
    """x (B, T, D) with values (B, N, D) set or added at positions index (B, N) of each row;
    positions >= T are dropped (padding)."""
    def one(row, idx, val):
        at = row.at[idx]
        return at.set(val, mode="drop") if op == "set" else at.add(val, mode="drop")
    return jax.vmap(one)(x, index, values)


REMAT_POLICIES = {
    # save nothing: every intermediate of the layer is recomputed in the backward pass
    "full": None,
    # save the outputs of the dense projections (q, k, v, o, the MLP's: matmuls without batch
    # dimensions), recompute the rest (norms, rotary, activations, attention)
    "projections": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def remat_of(jcfg):
    """A config's `jax` section as the models' `remat` argument: False, or the policy name
    (`jax.remat_policy`, one of `REMAT_POLICIES`) when `jax.remat`."""
    if not jcfg.remat:
        return False
    if jcfg.remat_policy not in REMAT_POLICIES:
        raise ValueError(f"jax.remat_policy must be one of {sorted(REMAT_POLICIES)}, got "
                         f"{jcfg.remat_policy!r}")
    return jcfg.remat_policy


class LayerStack(nnx.Module):
    """`n` layers of one kind (the decoder's, the vision tower's blocks) whose parameters are
    stacked along a leading layer axis: the parts `parts` of one layer, each array (n, ...).
    `stack[i]` is layer i (its parameters sliced), `len(stack)` the depth; `scan` runs them in
    order as one `jax.lax.scan`, so a program compiles one layer whatever the depth."""

    def __init__(self, n: int, make, parts: tuple[str, ...]):
        layers = [make() for _ in range(n)]  # initialised in order: the unrolled model's draws
        defs, states = zip(*(nnx.split(layer) for layer in layers))
        self.layer_def = defs[0]
        stacked = nnx.merge(defs[0], jax.tree.map(lambda *a: jnp.stack(a), *states))
        self.parts = parts
        for name in parts:
            setattr(self, name, getattr(stacked, name))

    def __len__(self) -> int:
        return int(jax.tree.leaves(nnx.state(self))[0].shape[0])

    def _current_def(self):
        """One layer's graph as the parts now are: a setting changed on them since (a vision
        attention's, `geo3k_jax.models.model.with_attention`) is in it, not the one at
        construction."""
        layer = nnx.merge(self.layer_def, nnx.state(self))
        for name in self.parts:
            setattr(layer, name, getattr(self, name))
        return nnx.split(layer)[0]

    def __getitem__(self, i):
        return nnx.merge(self._current_def(), jax.tree.map(lambda a: a[i], nnx.state(self)))

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def scan(self, step, carry, *, remat: bool | str = False, after=None,
             outputs: bool = False):
        """carry = step(layer, i, carry) for every layer i in order (layer: the scanned slice of
        the parameters, never a copy of them); with `outputs` step returns (carry, y) and this
        (carry, ys): each y stacked over the layers. after(i, carry) follows layer i for the
        first `after[0]` layers (DeepStack): `after` is (count, fn) or None. remat: each
        layer's activations are recomputed in the backward pass (memory of one layer's inputs
        per layer instead of all its intermediates; a `REMAT_POLICIES` name says what else is
        kept)."""
        count, fn = after if after is not None else (0, None)
        count = min(count, len(self))
        layer_def = self._current_def()

        def body(c, xs):
            i = xs[1]
            out = step(nnx.merge(layer_def, xs[0]), i, c)
            c, y = out if outputs else (out, None)
            if count:  # one scan over the whole stack: its weights are never sliced (copied)
                c = jax.lax.cond(i < count, lambda c: fn(jnp.minimum(i, count - 1), c),
                                 lambda c: c, c)
            return c, y
        body = rematerialised(body, remat, scanned=True)
        carry, ys = jax.lax.scan(body, carry, (nnx.state(self), jnp.arange(len(self))))
        return (carry, ys) if outputs else carry


def rematerialised(fn, remat, scanned: bool):
    """`fn` under `jax.checkpoint` as `remat` says: False as it is, True or "full" saving
    nothing, "projections" saving the projections' outputs (`REMAT_POLICIES`). scanned: `fn`
    is a `lax.scan` body, where CSE across iterations cannot undo the recomputation, so JAX's
    guard against it (`prevent_cse`, extra ops in every layer) is left out."""
    if not remat:
        return fn
    policy = REMAT_POLICIES["full" if remat is True else remat]
    return jax.checkpoint(fn, policy=policy, prevent_cse=not scanned)

