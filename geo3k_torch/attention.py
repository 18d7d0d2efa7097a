"""Packed attention for the torch learner: a packed row costs the sum of its sequences' squares.

transformers' sdpa attends over a packed row with a dense block-diagonal mask: T x T scores for
a row of T tokens, ten times what ten ~T/10-token sequences cost alone. "packed_sdpa", registered
with transformers' attention interfaces, attends each segment of the row on its own instead,
when the forward is given the row's segments (`geo3k_torch.model.packed_inputs` passes them as
`packed_segments`, a `Segments`): a segment attends causally to itself and, when it continues a
shared prefix (`common.batching`), to all of that prefix. Two kernels compute it:

    segments_varlen : CUDA, bf16/fp16 - one flash kernel per layer over the whole row
                      (`torch.nn.attention.varlen.varlen_attn` with cu_seqlens, torch >= 2.10;
                      before 2.12 it has no `enable_gqa` and K/V are repeated to the query
                      heads); a continuing segment's keys are its prefix's gathered before its
                      own (`varlen_layout`), causal aligned at the end (flash's bottom-right rule)
    segments_sdpa   : everywhere else, and the reference - one sdpa call per segment

The varlen layout is computed once per micro-batch on the host and copied to the device once
(`Segments.device_layout`), not per layer: no host sync inside the forward. For the same reason
the forward is given a placeholder (`packed_mask`) in place of an attention mask:
transformers would otherwise look for packed sequences in the position ids (a host sync) and
build a dense (1, 1, T, T) mask that packed_sdpa never reads (268 MB at 16k tokens).

Everything else (the engine's batched, cached generation, the vision tower's per-image calls) is
transformers' own sdpa.

    load_model(path)   # attn_implementation="packed_sdpa" by default
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import NamedTuple, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "packed_sdpa"


def _varlen():
    """torch's varlen_attn if it takes `scale` and `window_size` (torch >= 2.10), with whether it
    takes `enable_gqa` (2.12+); else (None, False), and every device runs segments_sdpa."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, False
    params = set(inspect.signature(varlen_attn).parameters)
    if not {"scale", "window_size"} <= params:
        return None, False
    return varlen_attn, "enable_gqa" in params


varlen_attn, varlen_has_gqa = _varlen()


def packed_mask() -> torch.Tensor:
    """What a packed forward passes as `attention_mask`: an empty (1, 1, 0, 0) mask, which
    transformers hands to the attention as it is (a 4-D mask is "already prepared"), so it
    neither scans the position ids nor builds a dense mask. packed_sdpa never reads it when it
    has the row's segments; any other attention would fail on its shape instead of attending
    without a mask."""
    return torch.ones((1, 1, 0, 0), dtype=torch.bool)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`; to CUDA through pinned memory without blocking, so the copy
    waits for nothing the device is still doing (a pageable copy is a host sync)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class Layout(NamedTuple):
    """A packed row's attention layout as the layers take it: device tensors and ints, no Python
    list a compiled layer would guard on by value (`train.compile`). cu_q (S+1,) int32 query
    bounds (the segments themselves); kv_index (T_k,) int64 the row positions of each sequence's
    keys (its parent's tokens, then its own), empty when the keys are the row; cu_k (S+1,) int32
    bounds in the keys; max_q / max_k the longest query and key sequences."""

    cu_q: torch.Tensor
    kv_index: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int


@dataclasses.dataclass(eq=False)
class Segments:
    """A packed row's segments in order: lengths (S,) summing to T, parents (S,) the earlier
    segment whose keys segment s also sees (-1 for none). Built on the host with the rest of a
    micro-batch's inputs; `layout` copies its varlen layout to the device once."""

    lengths: list[int]
    parents: list[int]
    _layout: Layout | None = None

    @classmethod
    def of(cls, segments) -> Segments:
        """A `Segments`, or one from a (lengths, parents) pair."""
        return segments if isinstance(segments, Segments) else cls(*map(list, segments))

    def layout(self, device: torch.device | str) -> Layout:
        """`varlen_layout` on `device`, copied once from pinned memory without waiting for it."""
        device = torch.device(device)
        if self._layout is None or self._layout.cu_q.device != device:
            cu_q, kv_index, cu_k, max_q, max_k = varlen_layout(self.lengths, self.parents)
            up = lambda a: to_device(torch.from_numpy(a), device)  # noqa: E731
            self._layout = Layout(up(cu_q), up(np.zeros(0, np.int64) if kv_index is None
                                                else kv_index), up(cu_k), max_q, max_k)
        return self._layout


def image_layout(cu_seqlens: np.ndarray) -> Layout:
    """The vision tower's layout on the host: images (or Qwen2.5-VL's windows) with bounds
    `cu_seqlens` (N+1,), each attending to all of itself (the attention is not causal)."""
    cu = torch.from_numpy(np.asarray(cu_seqlens, np.int32))
    longest = int(np.diff(cu_seqlens).max()) if len(cu_seqlens) > 1 else 0
    return Layout(cu, torch.zeros(0, dtype=torch.int64), cu, longest, longest)


def as_layout(segments, device: torch.device) -> Layout:
    """A `Layout` on `device` from a `Layout`, a `Segments` or a (lengths, parents) pair."""
    if isinstance(segments, Layout):
        return segments
    return Segments.of(segments).layout(device)


def packed_sdpa(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, dropout: float = 0.0,
                scaling: float | None = None, packed_segments=None, **kwargs
                ) -> tuple[torch.Tensor, None]:
    """query (1, H, T, D), key / value (1, H_kv, T, D), packed_segments: the row's `Layout`
    (or a `Segments`, or a (lengths, parents) pair) -> (1, T, H, D). Calls without segments (or
    not causal, or with a KV cache) go to transformers' sdpa unchanged."""
    length = query.shape[2]
    if (packed_segments is None or not getattr(module, "is_causal", True)
            or query.shape[0] != 1 or key.shape[2] != length):
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    if not query.dtype == key.dtype == value.dtype:
        raise ValueError(f"packed attention needs query, key and value of the same dtype, got "
                         f"{query.dtype}, {key.dtype}, {value.dtype}: under autocast Qwen3-VL's "
                         "q/k RMSNorm keeps fp32 weights' q and k beside a bf16 v; compute in "
                         "the model's own dtype (FSDP2's bf16 policy) instead")
    if dropout:
        segments = Segments.of(packed_segments)  # the reference; no Qwen-VL trains with dropout
        return segments_sdpa(query, key, value, segments.lengths, segments.parents, scaling,
                             dropout), None
    return packed_attention(query, key, value, as_layout(packed_segments, query.device),
                            scaling), None


def packed_attention(query, key, value, layout: Layout, scaling: float | None = None,
                     causal: bool = True) -> torch.Tensor:
    """query (1, H, T, D), key / value (1, H_kv, T, D) attended sequence by sequence as `layout`
    says -> (1, T, H, D); causal aligned at the end (a sequence's prefix keys are all before its
    queries), or each sequence attending to all of itself. CUDA bf16: torch's varlen kernel;
    elsewhere `segments_attention`. Both are single ops to torch.compile (no graph break) and
    to selective checkpointing (their outputs are kept, `geo3k_torch.model._KEPT_OPS`)."""
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    if uses_varlen(query):
        return segments_varlen(query, key, value, layout, scale, causal)
    return segments_attention(query, key, value, layout.cu_q, layout.kv_index, layout.cu_k,
                              scale, causal)


def uses_varlen(query: torch.Tensor) -> bool:
    """Whether packed rows of this query go through the one-kernel varlen path."""
    return (varlen_attn is not None and query.is_cuda
            and query.dtype in (torch.bfloat16, torch.float16))


def segments_sdpa(query, key, value, lengths: Sequence[int], parents: Sequence[int],
                  scaling: float | None = None, dropout: float = 0.0) -> torch.Tensor:
    """The reference: one sdpa call per segment. Shapes as `packed_sdpa`'s; returns (1, T, H, D)."""
    gqa = query.shape[1] != key.shape[1]
    # split, not sliced: the backward pass concatenates the pieces' gradients once
    qs, ks, vs = (x.split(list(lengths), dim=2) for x in (query, key, value))
    parts = []
    for s, p in enumerate(parents):
        k, v, mask = ks[s], vs[s], None
        if p >= 0:  # causal, aligned at the end: the prefix's keys are all before the queries
            k, v = torch.cat([ks[p], k], dim=2), torch.cat([vs[p], v], dim=2)
            # a plain boolean mask: torch's causal_lower_right is a tensor subclass, which
            # selective checkpointing's dispatch mode cannot create
            mask = torch.ones(lengths[s], lengths[p] + lengths[s], dtype=torch.bool,
                              device=query.device).tril(lengths[p])
        parts.append(F.scaled_dot_product_attention(
            qs[s], k, v, attn_mask=mask, is_causal=mask is None, scale=scaling,
            dropout_p=dropout, enable_gqa=gqa))
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous()


def varlen_layout(lengths: Sequence[int], parents: Sequence[int]):
    """The row's segments as varlen sequences. Returns cu_q (S+1,) int32 (query bounds: the
    segments themselves), kv_index (T_k,) int64 (the row positions of each sequence's keys: its
    parent's tokens, then its own) or None when no segment has a parent (the keys are the row),
    cu_k (S+1,) int32 bounds in kv_index, and the longest query and key sequences."""
    lengths = np.asarray(lengths, np.int64)
    parents = np.asarray(parents, np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    cu_q = starts.astype(np.int32)
    if (parents < 0).all():
        return cu_q, None, cu_q, int(lengths.max()), int(lengths.max())
    pieces, k_len = [], lengths.copy()
    for s, p in enumerate(parents):
        if p >= 0:
            pieces.append(np.arange(starts[p], starts[p + 1]))
            k_len[s] += lengths[p]
        pieces.append(np.arange(starts[s], starts[s + 1]))
    cu_k = np.concatenate([[0], np.cumsum(k_len)]).astype(np.int32)
    return cu_q, np.concatenate(pieces), cu_k, int(lengths.max()), int(k_len.max())


def segments_varlen(query, key, value, layout: Layout, scaling: float | None = None,
                    causal: bool = True) -> torch.Tensor:
    """One varlen flash call over the row (CUDA). Shapes as `packed_sdpa`'s; returns
    (1, T, H, D)."""
    q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))  # (T, H, D)
    if layout.kv_index.numel():
        k, v = k.index_select(0, layout.kv_index), v.index_select(0, layout.kv_index)
    gqa = {}
    if q.shape[1] != k.shape[1]:
        if varlen_has_gqa:
            gqa = {"enable_gqa": True}
        else:  # torch 2.10-2.11: each query head reads its group's key / value head
            k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    out = varlen_attn(q, k, v, layout.cu_q, layout.cu_k, layout.max_q, layout.max_k,
                      scale=scaling, window_size=(-1, 0) if causal else (-1, -1), **gqa)
    return out[None]  # causal: bottom-right


# The per-sequence path as one operator: torch.compile sees a single call (its layout is read on
# the host inside, which on CPU costs nothing; on CUDA only fp32 runs here, a host sync per call),
# and selective checkpointing can keep its output. Its backward is written out (the softmax
# recomputed per sequence from q and k, as a flash kernel's backward does).
@torch.library.custom_op("geo3k::segments_attention", mutates_args=())
def segments_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       cu_q: torch.Tensor, kv_index: torch.Tensor, cu_k: torch.Tensor,
                       scale: float, causal: bool) -> torch.Tensor:
    """query (1, H, T, D), key / value (1, H_kv, T, D), the layout of `Layout` -> (1, T, H, D):
    one sdpa call per sequence."""
    parts = []
    for q, k, v in _sequences(query, key, value, cu_q, kv_index, cu_k):
        mask = _mask(q.shape[2], k.shape[2], causal, q.device)
        parts.append(F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal and mask is None, scale=scale,
            enable_gqa=q.shape[1] != k.shape[1]))
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous()


@segments_attention.register_fake
def _(query, key, value, cu_q, kv_index, cu_k, scale, causal):
    return query.new_empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3])


@torch.library.custom_op("geo3k::segments_attention_backward", mutates_args=())
def segments_attention_backward(grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                                value: torch.Tensor, cu_q: torch.Tensor, kv_index: torch.Tensor,
                                cu_k: torch.Tensor, scale: float, causal: bool
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of `segments_attention`'s query, key and value given grad (1, T, H, D) of
    its output, in fp32 (or the inputs' dtype if wider) per sequence: P = softmax(q k^T scale), dv = P^T do,
    ds = P (do v^T - rowsum(do o)), dq = ds k scale, dk = ds^T q scale."""
    group, wide = query.shape[1] // key.shape[1], torch.promote_types(query.dtype, torch.float32)
    grads = grad.transpose(1, 2).split(cu_q.diff().tolist(), dim=2)
    dq, dks, dvs = [], [], []
    for (q, k, v), g in zip(_sequences(query, key, value, cu_q, kv_index, cu_k), grads):
        q, g = q.to(wide), g.to(wide)
        k, v = (x.to(wide).repeat_interleave(group, dim=1) for x in (k, v))  # (1, H, L_k, D)
        scores = q @ k.transpose(-1, -2) * scale  # (1, H, L_q, L_k)
        mask = _mask(q.shape[2], k.shape[2], causal, q.device)
        if causal and mask is None:
            mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        p = scores.softmax(-1)
        out = p @ v
        ds = p * (g @ v.transpose(-1, -2) - (g * out).sum(-1, keepdim=True))
        dq.append(ds @ k * scale)
        dks.append((ds.transpose(-1, -2) @ q * scale).unflatten(1, (-1, group)).sum(2))
        dvs.append((p.transpose(-1, -2) @ g).unflatten(1, (-1, group)).sum(2))
    dk, dv = torch.cat(dks, dim=2), torch.cat(dvs, dim=2)  # (1, H_kv, T_k, D)
    if kv_index.numel():  # a prefix's keys serve several sequences: their gradients add up
        dk = dk.new_zeros(key.shape).index_add_(2, kv_index, dk)
        dv = dv.new_zeros(value.shape).index_add_(2, kv_index, dv)
    # contiguous, as the fake says (the inputs may be transposed views)
    return tuple(x.to(like.dtype).contiguous() for x, like in (
        (torch.cat(dq, dim=2), query), (dk, key), (dv, value)))


@segments_attention_backward.register_fake
def _(grad, query, key, value, cu_q, kv_index, cu_k, scale, causal):
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:6])
    ctx.scale, ctx.causal = inputs[6:]


def _backward(ctx, grad):
    dq, dk, dv = segments_attention_backward(grad, *ctx.saved_tensors, ctx.scale, ctx.causal)
    return dq, dk, dv, None, None, None, None, None


segments_attention.register_autograd(_backward, setup_context=_setup_context)


def _sequences(query, key, value, cu_q, kv_index, cu_k):
    """(q, k, v) per sequence, (1, H, L_q, D) and (1, H_kv, L_k, D), the keys gathered by
    kv_index (when not empty)."""
    if kv_index.numel():
        key, value = key.index_select(2, kv_index), value.index_select(2, kv_index)
    qs = query.split(cu_q.diff().tolist(), dim=2)
    ks, vs = (x.split(cu_k.diff().tolist(), dim=2) for x in (key, value))
    return zip(qs, ks, vs)


def _mask(q_len: int, k_len: int, causal: bool, device) -> torch.Tensor | None:
    """A causal sequence whose keys start with its prefix's: its queries see every prefix key
    (bottom-right alignment), as a plain boolean mask (torch's causal_lower_right is a tensor
    subclass, which selective checkpointing's dispatch mode cannot create); None otherwise."""
    if not causal or q_len == k_len:
        return None
    return torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(k_len - q_len)


AttentionInterface.register(NAME, packed_sdpa)
AttentionMaskInterface.register(NAME, sdpa_mask)  # generation still gets its padding masks
