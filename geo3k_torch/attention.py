"""Packed attention for the torch learner: a packed row costs the sum of its sequences' squares.

transformers' sdpa attends over a packed row with a dense block-diagonal mask: T x T scores for
a row of T tokens, ten times what ten ~T/10-token sequences cost alone. "packed_sdpa", registered
with transformers' attention interfaces, attends each segment of the row on its own instead,
when the forward is given the row's segments (`geo3k_torch.model.packed_inputs` passes them as
`packed_segments`): a segment attends causally to itself and, when it continues a shared prefix
(`common.batching`), to all of that prefix. Everything else (the engine's batched, cached
generation, the vision tower's per-image calls) is transformers' own sdpa.

    load_model(path)   # attn_implementation="packed_sdpa" by default
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "packed_sdpa"


def packed_sdpa(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, dropout: float = 0.0,
                scaling: float | None = None,
                packed_segments: tuple[Sequence[int], Sequence[int]] | None = None,
                **kwargs) -> tuple[torch.Tensor, None]:
    """query (1, H, T, D), key / value (1, H_kv, T, D), packed_segments: (lengths, parents) of
    the row's segments in order (lengths summing to T; parents[s] the earlier segment whose keys
    segment s also sees, -1 for none) -> (1, T, H, D). Calls without segments (or not causal,
    or with a KV cache) go to transformers' sdpa unchanged."""
    length = query.shape[2]
    if (packed_segments is None or not getattr(module, "is_causal", True)
            or query.shape[0] != 1 or key.shape[2] != length):
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    lengths, parents = packed_segments
    gqa = query.shape[1] != key.shape[1]
    # split, not sliced: the backward pass concatenates the pieces' gradients once
    qs, ks, vs = (x.split(list(lengths), dim=2) for x in (query, key, value))
    parts = []
    for s, p in enumerate(parents):
        k, v, mask = ks[s], vs[s], None
        if p >= 0:  # causal, aligned at the end: the prefix's keys are all before the queries
            k, v = torch.cat([ks[p], k], dim=2), torch.cat([vs[p], v], dim=2)
            mask = causal_lower_right(lengths[s], lengths[p] + lengths[s])
        parts.append(F.scaled_dot_product_attention(
            qs[s], k, v, attn_mask=mask, is_causal=mask is None, scale=scaling,
            dropout_p=dropout, enable_gqa=gqa))
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, packed_sdpa)
AttentionMaskInterface.register(NAME, sdpa_mask)  # generation still gets its padding masks
