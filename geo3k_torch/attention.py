"""Packed attention for the torch learner: a packed row costs the sum of its sequences' squares.

transformers' sdpa attends over a packed row with a dense block-diagonal mask: T x T scores for
a row of T tokens, ten times what ten ~T/10-token sequences cost alone. "packed_sdpa", registered
with transformers' attention interfaces, runs causal sdpa on each sequence of the row instead
whenever the row is packed: one row, no KV cache, text position ids that restart at 0 where a
sequence starts (`geo3k_torch.model.packed_inputs` makes them so). Everything else (the engine's
batched, cached generation, the vision tower's per-image calls) is transformers' own sdpa.

    load_model(path)   # attn_implementation="packed_sdpa" by default
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "packed_sdpa"


def packed_sdpa(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, dropout: float = 0.0,
                scaling: float | None = None, position_ids: torch.Tensor | None = None,
                **kwargs) -> tuple[torch.Tensor, None]:
    """query (1, H, T, D), key / value (1, H_kv, T, D), position_ids (1, T) text positions ->
    (1, T, H, D): causal attention inside each sequence of the row (sequences start where the
    position is 0). Other calls go to transformers' sdpa unchanged."""
    length = query.shape[2]
    packed = (position_ids is not None and query.shape[0] == 1 and key.shape[2] == length
              and getattr(module, "is_causal", True) and position_ids.shape[-1] == length)
    starts = torch.nonzero(position_ids.reshape(-1) == 0).flatten().tolist() if packed else []
    if len(starts) < 2 or starts[0] != 0:  # one sequence (or not a packed row)
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    gqa = query.shape[1] != key.shape[1]
    parts = [F.scaled_dot_product_attention(
        query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], is_causal=True, scale=scaling,
        dropout_p=dropout, enable_gqa=gqa) for a, b in zip(starts, starts[1:] + [length])]
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, packed_sdpa)
AttentionMaskInterface.register(NAME, sdpa_mask)  # generation still gets its padding masks
