"""Text and vision attention through the Pallas splash kernel (TPU; interpret mode elsewhere).

`jax.attention` in the config picks the text attention: `windowed` (`geo3k_jax.kernels.windowed`,
XLA, any platform) or `splash` (this module); `auto` is splash on TPU and windowed elsewhere
(`resolve_attention`). The vision tower's per-image attention follows the same choice.

Packed rows tell their sequences apart by segment ids, which splash takes as they are
(`SegmentIds(q, kv)`: a query sees a key of the same id) under a static causal mask. A
shared-prefix group (`common.batching`: a prompt once, then each sample's continuation,
`geo3k_jax.core.batch`'s `prefix`) needs a query to see two segments, its own and its prompt's,
which one id per token cannot say. The text attention then runs the kernel twice over the same
keys, once with the queries' own ids (causal inside the segment) and once with their prompt's
id (the prompt precedes its continuations in a row, so the causal mask holds it whole), and
merges the two by their log-sum-exps; its backward runs splash's own backward kernels once per
pass with the merged output and log-sum-exp, which is the exact gradient of the merged
attention (flash attention's backward needs only those two per query). Neither the dense
(T, T) mask a dynamic splash mask materialises (T^2 bytes per row and head: 268 MB at 16k
tokens) nor a copy of every prompt per sample (G - 1 more prompts through every layer, not
only the attention) is needed; the cost is a second causal pass over the row's score blocks
(`scripts/aot_text_stack.py --mode=prefix` compiles the three for a TPU topology).

A Mosaic kernel is not partitioned by XLA: the kernel runs under `jax.shard_map`, rows split
over the mesh's data-parallel axes and key heads over `tensor` when it divides them.

Grouped-query heads: each key head runs splash's multi-query kernel over its group of query
heads (vmapped over key heads), so keys are never repeated per query head. Scores are taken of
q * scale (splash does not scale). Rows and patch lists are padded to the kernel's block with
an id no real token has; padding queries get a zero output, as the windowed path gives them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sak
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sam
from jax.sharding import PartitionSpec as P

from geo3k_jax.core.sharding import BATCH_AXES

ATTENTIONS = ("auto", "splash", "windowed")
MAX_BLOCK = 512  # the kernel's query and key block on long rows (MaxText's default)
MIN_BLOCK = 128  # on shorter ones: a row is padded to a multiple of this
PAD_ID = -7  # segment id of the padding added here (never a segment, padding's -1 or NO_PREFIX)


@dataclasses.dataclass(frozen=True)
class Attention:
    """How the model attends: kind "windowed" or "splash"; the mesh the model's rows are split
    over (None: one device), whichever the kind: the splash kernels, the sparse blocks
    (`geo3k_jax.models.moe`) and the vision tower's rows (`geo3k_jax.models.model`) are mapped
    over it; and whether splash runs in Pallas' interpret mode (not TPU)."""

    kind: str = "windowed"
    mesh: jax.sharding.Mesh | None = None
    interpret: bool = False

    @property
    def splash(self) -> bool:
        return self.kind == "splash"


def resolve_attention(name: str, platform: str, mesh=None) -> Attention:
    """The `jax.attention` setting on `platform` ("tpu", "cpu", ...) over `mesh`: auto is
    splash on TPU, windowed elsewhere; splash off TPU runs in interpret mode (tests, not
    speed). Either kind keeps the mesh the rows are split over."""
    if name not in ATTENTIONS:
        raise ValueError(f"jax.attention must be one of {ATTENTIONS}, got {name!r}")
    kind = ("splash" if platform == "tpu" else "windowed") if name == "auto" else name
    return Attention(kind, mesh, interpret=kind == "splash" and platform != "tpu")


def block_for(length: int) -> int:
    """The kernel's block for a sequence of `length`: MAX_BLOCK once the sequence is that
    long, MIN_BLOCK otherwise."""
    return MAX_BLOCK if length >= MAX_BLOCK else MIN_BLOCK


def _block_sizes(block: int) -> sak.BlockSizes:
    return sak.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                          block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                          use_fused_bwd_kernel=True)


def _kernel(heads: int, length: int, causal: bool, mqa: bool, interpret: bool,
            residuals: bool = False) -> sak.SplashAttentionKernel:
    """A splash kernel over `heads` query heads of `length` tokens (a multiple of its block).
    Built afresh in every trace: its mask tables become arrays of the trace that builds it
    (a kernel cached across traces would carry another trace's arrays)."""
    shape = (length, length)
    one = sam.CausalMask(shape) if causal else sam.FullMask(shape)
    make = sak.make_splash_mqa_single_device if mqa else sak.make_splash_mha_single_device
    return make(sam.MultiHeadMask([one] * heads), block_sizes=_block_sizes(block_for(length)),
                save_residuals=residuals, interpret=interpret)


def _pad(x: jax.Array, axis: int, length: int, value=0) -> jax.Array:
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, length - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def _shard(attn: Attention, fn, args, specs, out_spec):
    """fn under shard_map on attn.mesh (directly without one)."""
    if attn.mesh is None:
        return fn(*args)
    return jax.shard_map(fn, mesh=attn.mesh, in_specs=specs, out_specs=out_spec,
                         check_vma=False)(*args)


def row_axes(mesh, rows: int):
    """The mesh axes a batch of `rows` is split over (None when they do not divide it)."""
    size = int(np.prod([mesh.shape[a] for a in BATCH_AXES]))
    return BATCH_AXES if size > 1 and rows % size == 0 else None


def _head_axis(mesh, heads: int):
    return "tensor" if mesh.shape.get("tensor", 1) > 1 and heads % mesh.shape["tensor"] == 0 \
        else None


# --- text: packed rows, causal, optional shared prefixes ------------------------------------

def text_attention(attn: Attention, q: jax.Array, k: jax.Array, v: jax.Array,
                   segments: jax.Array, prefix: jax.Array | None, scale: float) -> jax.Array:
    """Causal attention within segments, plus every key of the shared prefix segment each
    query's segment continues. q: (B, T, H, D); k, v: (B, T, Hkv, D); segments: (B, T), -1 on
    padding; prefix: (B, T) that prefix segment, NO_PREFIX for none (None: no sharing).
    Returns (B, T, H * D), zero on padding."""
    b, t, h, d = q.shape
    hkv = k.shape[2]
    block = block_for(t)
    length = -(-t // block) * block
    qg = (q.astype(jnp.float32) * scale).astype(q.dtype)
    qg = _pad(qg.reshape(b, t, hkv, h // hkv, d).transpose(0, 2, 3, 1, 4), 3, length)
    kg = _pad(k.transpose(0, 2, 1, 3), 2, length)  # (B, Hkv, L, D)
    vg = _pad(v.transpose(0, 2, 1, 3), 2, length)
    seg = _pad(segments.astype(jnp.int32), 1, length, PAD_ID)
    inputs = [qg, kg, vg, seg]
    if prefix is not None:
        inputs.append(_pad(prefix.astype(jnp.int32), 1, length, PAD_ID - 1))
    fn = functools.partial(_text_rows, attn.interpret)
    if attn.mesh is None:
        out = fn(*inputs)
    else:
        rows, heads = row_axes(attn.mesh, b), _head_axis(attn.mesh, hkv)
        qkv = P(rows, heads)
        specs = (qkv, qkv, qkv, P(rows), P(rows))[:len(inputs)]
        out = _shard(attn, fn, inputs, specs, qkv)
    out = out[..., :t, :].transpose(0, 3, 1, 2, 4).reshape(b, t, h * d)  # (B, T, H * D)
    return jnp.where(segments[..., None] >= 0, out, 0).astype(v.dtype)


def _text_rows(interpret, q, k, v, seg, pre=None):
    """(B, G, R, L, D) queries, (B, G, L, D) keys and values, (B, L) ids -> (B, G, R, L, D).
    The prefix pass runs only when one of these rows continues a prefix (`lax.cond` over all
    of them: a batch that shares nothing, or a device's share of one, pays one pass)."""
    _, _, r, length, _ = q.shape

    def plain(q, k, v, seg, _=None):
        kernel = _kernel(r, length, True, True, interpret)
        one = lambda q1, k1, v1, s: kernel(q1, k1, v1, sak.SegmentIds(s, s))  # noqa: E731
        return jax.vmap(jax.vmap(one, (0, 0, 0, None)))(q, k, v, seg)
    if pre is None:
        return plain(q, k, v, seg)

    def shared(q, k, v, seg, pre):
        one = functools.partial(_prefixed, (r, length, interpret))
        return jax.vmap(jax.vmap(one, (0, 0, 0, None, None)))(q, k, v, seg, pre)
    return jax.lax.cond(jnp.any(pre >= 0), shared, plain, q, k, v, seg, pre)


def _passes(key, q, k, v, seg, pre):
    """The two passes' kernel (with residuals) and segment ids: own segments, then prefixes."""
    kernel = _kernel(key[0], key[1], True, True, key[2], residuals=True)
    return kernel, (sak.SegmentIds(seg, seg), sak.SegmentIds(pre, seg))


def _merged(key, q, k, v, seg, pre):
    """(out (R, L, D), lse (R, L)) of the two passes merged."""
    kernel, ids = _passes(key, q, k, v, seg, pre)
    (o1, (l1,)), (o2, (l2,)) = (kernel(q, k, v, i) for i in ids)
    lse = jnp.logaddexp(l1, l2)
    out = (o1.astype(jnp.float32) * jnp.exp(l1 - lse)[..., None]
           + o2.astype(jnp.float32) * jnp.exp(l2 - lse)[..., None])
    return out.astype(v.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _prefixed(key, q, k, v, seg, pre):
    """One key head's attention of its R query heads q (R, L, D) to k, v (L, D): its own
    segment causally (seg) and all of its prefix segment (pre, (L,))."""
    return _merged(key, q, k, v, seg, pre)[0]


def _prefixed_fwd(key, q, k, v, seg, pre):
    out, lse = _merged(key, q, k, v, seg, pre)
    return out, (q, k, v, seg, pre, out, lse)


# The parameters of splash's private backward as jax 0.10.2 (requirements-cpu.txt) defines
# them, in order; `_private_bwd` refuses any other, so a JAX that changed it stops at the trace
# with what to do, not deep inside Pallas.
PRIVATE_BWD = ("save_residuals", "mask_value", "is_mqa", "block_sizes",
               "residual_checkpoint_name", "mask_function", "attn_logits_soft_cap",
               "interpret", "res", "do")


def _private_bwd():
    """splash's `_splash_attention_bwd`, checked to take `PRIVATE_BWD`."""
    import inspect

    fn = getattr(sak, "_splash_attention_bwd", None)
    got = tuple(inspect.signature(fn).parameters) if callable(fn) else None
    if got != PRIVATE_BWD:
        raise RuntimeError(
            f"the shared-prefix splash backward calls splash's private _splash_attention_bwd"
            f"{PRIVATE_BWD} as jax 0.10.2 defines it; jax {jax.__version__} has "
            f"{'none' if got is None else got}. Install jax==0.10.2 (requirements-cpu.txt), or "
            "train without shared prefixes (train.share_prefix=False) or with "
            "jax.attention=windowed")
    return fn


def _prefixed_bwd(key, res, d_out):
    """Each pass's keys get splash's backward with the merged output and log-sum-exp: its
    probabilities exp(s - lse) are the merged softmax's on those keys, and dS = P (dP - rowsum(
    dO * O)) needs nothing else. The kernel's private backward (jax 0.10.2) is called as its
    custom_vjp calls it, with the residuals it would have saved."""
    q, k, v, seg, pre, out, lse = res
    kernel, ids = _passes(key, q, k, v, seg, pre)
    kw = kernel.kwargs
    grads = []
    for i in ids:
        saved = (q, k, v, i, None, out, lse, kernel.dq_mask_info, kernel.dkv_mask_info)
        grads.append(_private_bwd()(
            False, kw["mask_value"], kw["is_mqa"], kw["block_sizes"],
            kw["residual_checkpoint_name"], kw["mask_function"], kw["attn_logits_soft_cap"],
            kw["interpret"], saved, d_out)[3:6])
    (dq1, dk1, dv1), (dq2, dk2, dv2) = grads
    return dq1 + dq2, dk1 + dk2, dv1 + dv2, None, None


_prefixed.defvjp(_prefixed_fwd, _prefixed_bwd)


# --- vision: one row's patches, bidirectional within an image (or window) -------------------

def vision_attention(attn: Attention, q: jax.Array, k: jax.Array, v: jax.Array,
                     segments: jax.Array, scale: float) -> jax.Array:
    """Bidirectional attention within segments (a frame of an image, or a window of one).
    q, k, v: (P, H, D); segments: (P,). Returns (P, H * D). Called per row under the model's
    `jax.vmap` over rows, which maps it over rows of the mesh (`spmd_axis_name`)."""
    n, h, d = q.shape
    block = block_for(n)
    length = -(-n // block) * block
    qh = _pad((q.astype(jnp.float32) * scale).astype(q.dtype).transpose(1, 0, 2), 1, length)
    kh = _pad(k.transpose(1, 0, 2), 1, length)
    vh = _pad(v.transpose(1, 0, 2), 1, length)
    seg = _pad(segments.astype(jnp.int32), 0, length, PAD_ID)
    kernel = _kernel(h, length, False, False, attn.interpret)

    def fn(q1, k1, v1, s):
        return kernel(q1, k1, v1, sak.SegmentIds(s, s))
    heads = None if attn.mesh is None else _head_axis(attn.mesh, h)
    out = _shard(attn, fn, (qh, kh, vh, seg), (P(heads), P(heads), P(heads), P()), P(heads))
    return out[:, :n].transpose(1, 0, 2).reshape(n, h * d)
