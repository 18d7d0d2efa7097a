"""Model FLOPs of the Qwen-VL models from their transformers config (no weights): what a step's
matrix products cost, for MFU (`scripts/gpu_check.py`) and the TPU compile's roofline
(`geo3k_jax.aot`, where the compiler's own count sees one pass of a scanned layer and nothing
inside a Pallas kernel)."""

from __future__ import annotations

from common.processor import family


def matmul_params(config) -> dict[str, int]:
    """Weights of the matrix products, per unit: a decoder layer (`layer`; of a MoE model the
    weights one token meets, its router and top-k experts, averaged over the layers), the patch
    embedding (`patch_embed`), a vision block (`vision_block`), one patch merger (`merger`, the
    main one or a DeepStack one)."""
    t, v = config.text_config, config.vision_config
    h, heads, kv = t.hidden_size, t.num_attention_heads, t.num_key_value_heads
    hd = getattr(t, "head_dim", None) or h // heads
    hv, m2 = v.hidden_size, v.spatial_merge_size ** 2
    mlp = 2 if family(config.model_type) == "qwen3_vl" else 3  # fc1/fc2 or gate/up/down
    return {"layer": 2 * h * heads * hd + 2 * h * kv * hd + _text_mlp(t),
            "patch_embed": v.in_channels * v.temporal_patch_size * v.patch_size ** 2 * hv,
            "vision_block": 4 * hv * hv + mlp * hv * v.intermediate_size,
            "merger": (m2 * hv) ** 2 + m2 * hv * v.out_hidden_size}


def _text_mlp(t) -> float:
    """Weights of a decoder layer's MLP one token meets, averaged over the layers: a dense one's
    gate/up/down; a sparse MoE block's router and its top-k experts (Qwen3-VL-MoE: every
    `decoder_sparse_step`-th layer not in `mlp_only_layers`)."""
    dense = 3 * t.hidden_size * t.intermediate_size
    if not getattr(t, "num_experts", 0):
        return dense
    n = t.num_hidden_layers
    sparse = sum(i not in (t.mlp_only_layers or ()) and (i + 1) % t.decoder_sparse_step == 0
                 for i in range(n))
    moe = t.hidden_size * t.num_experts + t.num_experts_per_tok * 3 * t.hidden_size \
        * t.moe_intermediate_size
    return (sparse * moe + (n - sparse) * dense) / n


def row_flops(config, length: int, targets: int, patches: int, window: int) -> float:
    """Model FLOPs of one training row (forward + backward = 3 forwards): `length` tokens
    through the decoder, the LM head over `targets` trained tokens, causal attention of a row
    filled with sequences of `window` tokens, and `patches` patches as one image through the
    vision tower (full attention per image; Qwen2.5-VL's windowed blocks over their windows).
    Recomputation under remat is not counted."""
    seq = min(window, length) or length
    fwd = text_flops(config, length, targets, pairs=length * (seq + 1) / 2)
    if patches:
        fwd += image_flops(config, patches)
    return 3 * fwd


def text_flops(config, tokens: float, targets: float, pairs: float) -> float:
    """Forward FLOPs of the decoder over `tokens` tokens, the LM head over `targets` trained
    tokens, and attention over `pairs` (query, key) pairs in every layer."""
    t, w = config.text_config, matmul_params(config)
    heads = t.num_attention_heads
    hd = getattr(t, "head_dim", None) or t.hidden_size // heads
    return (2 * w["layer"] * t.num_hidden_layers * tokens
            + 2 * t.hidden_size * t.vocab_size * targets
            + 4 * heads * hd * pairs * t.num_hidden_layers)


def image_flops(config, patches: int) -> float:
    """Forward FLOPs of one image of `patches` patches through the vision tower: the patch
    embedding, the blocks (full attention over the image; Qwen2.5-VL's windowed blocks over
    their windows) and the main and DeepStack mergers."""
    v, w = config.vision_config, matmul_params(config)
    m2 = v.spatial_merge_size ** 2
    mergers = 1 + len(getattr(v, "deepstack_visual_indexes", None) or [])
    full = set(range(v.depth)) if family(config.model_type) == "qwen3_vl" else set(
        v.fullatt_block_indexes)
    side = (getattr(v, "window_size", 0) or 0) // v.patch_size  # patches per window side
    p = float(patches)
    return (2 * (w["patch_embed"] + w["vision_block"] * v.depth) * p
            + 2 * w["merger"] * mergers * p / m2
            + sum(4 * v.hidden_size * p * (p if i in full else min(p, side ** 2))
                  for i in range(v.depth)))
