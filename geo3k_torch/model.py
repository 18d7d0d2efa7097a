"""Qwen-VL models in torch: loading, model inputs for packed micro-batches, per-token log-probs.

A packed micro-batch (`common.batching.PackedBatch`) is one row of T tokens holding S sequences.
Its position ids are computed per sequence by `common.mrope` (3-D M-RoPE for image tokens) and
passed in transformers' (4, 1, T) layout (row 0 the text position); its segments go to the
attention (`geo3k_torch.attention`) as `packed_segments`, so no attention crosses a sequence
boundary and a sample that continues its group's shared prompt attends to it. Log-probs are read
only where they are needed (the masked tokens), in fp32 from `logits / temperature`.
"""

from __future__ import annotations

import functools
import sys
import types
from pathlib import Path

import numpy as np
import torch

from common.batching import PackedBatch
from common.mrope import packed_position_ids
from common.processor import MODEL_TYPES, family, image_inputs
from geo3k_torch import attention
from geo3k_torch.experts import use_grouped_experts


def load_model(path: str, dtype: torch.dtype = torch.float32, attn: str = attention.NAME,
               device: torch.device | str = "cpu"):
    """A Qwen2.5-VL, Qwen3-VL or Qwen3-VL-MoE checkpoint directory as a transformers model on
    `device`, in train mode, Qwen3-VL's deepstack step without a host sync (`use_deepstack_add`),
    a MoE model's experts as grouped matmuls (`use_grouped_experts`). attn: "packed_sdpa"
    (`geo3k_torch.attention`: packed rows attend per sequence) or any transformers attention
    implementation."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype, attn_implementation=attn)
    _check_kind(model.config, path)
    use_deepstack_add(model)
    use_grouped_experts(model, device)
    return model.to(device)


def load_sharded(path: str, device: torch.device | str, bf16: bool,
                 dtype: torch.dtype = torch.float32, attn: str = attention.NAME,
                 activation_checkpointing: str = "none", checkpoint_vision: bool = True,
                 compile_backend: str | None = None, expert_parallel: int = 1):
    """The checkpoint at `path` as an FSDP2 model (`geo3k_torch.distributed.parallelize`; every
    rank of the process group calls this), without a full copy on any device: the model is
    built on the meta device, sharded, given storage on `device` for its own shards only, then
    rank 0 reads the safetensors (on CPU, in the checkpoint's dtype) and each tensor is
    broadcast and scattered to its shards. dtype: the stored parameters' (fp32 master weights
    for training, bf16 for the KL reference); bf16: compute under the bf16 policy;
    activation_checkpointing, checkpoint_vision: `checkpoint_layers`' mode and whether it
    covers the vision blocks (set before sharding); compile_backend: its blocks compiled by this
    torch.compile backend (`compile_layers`, the checkpointing inside), None: eager;
    expert_parallel: a MoE model's experts split over that many ranks
    (`geo3k_torch.expert_parallel`, `train.expert_parallel`)."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from transformers import AutoConfig, AutoModelForImageTextToText
    import torch.distributed as dist

    from geo3k_torch import distributed

    config = AutoConfig.from_pretrained(path)
    _check_kind(config, path)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config, dtype=dtype,
                                                        attn_implementation=attn)
    use_deepstack_add(model)
    use_grouped_experts(model, device)
    if compile_backend:
        compile_layers(model, activation_checkpointing, checkpoint_vision, compile_backend)
    else:
        checkpoint_layers(model, activation_checkpointing, checkpoint_vision)
    distributed.parallelize(model, bf16, expert_parallel)
    model.to_empty(device=device)
    for module in model.modules():  # the rotary tables: buffers outside the checkpoint
        if module._non_persistent_buffers_set:
            model._init_weights(module)
    full = {}
    if dist.get_rank() == 0:
        for f in sorted(Path(path).glob("*.safetensors")):
            full.update({k: v.to(dtype) for k, v in load_file(f).items()})
        full = _model_layout(full, model)
        missing = set(model.state_dict()) - set(full) - _tied(model)
        if missing:
            raise ValueError(f"{path}: the checkpoint lacks {sorted(missing)[:5]}")
    set_model_state_dict(model, full, options=StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=True, strict=False))
    model.train()
    return model


CHECKPOINTING = ("full", "selective", "none")
# What "selective" keeps from a layer's forward: the outputs of its matmuls (the projections,
# the MLP, a MoE block's router and experts' grouped matmuls, the LM head) and of the attention
# kernels (the packed attention's two, CUDA's and CPU's sdpa kernels). Norms, RoPE, SwiGLU's
# activation, the routing's sort and gathers and the residual adds are recomputed in the
# backward pass: cheap work in place of most of the layer's activation memory.
_KEPT_OPS = tuple(getattr(torch.ops.aten, name).default for name in (
    "mm", "addmm", "bmm", "_grouped_mm", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_flash_attention_forward",
    "_efficient_attention_forward")
    if hasattr(torch.ops.aten, name)) + (torch.ops.geo3k.segments_attention.default,) + (
    (torch.ops.torch_attn._varlen_attn.default,) if hasattr(torch.ops, "torch_attn")
    and hasattr(torch.ops.torch_attn, "_varlen_attn") else ())


def checkpoint_layers(model, mode: str, vision: bool = True) -> None:
    """Activation checkpointing of every decoder and vision block (transformers'
    GradientCheckpointingLayer): "full" keeps only each block's inputs and recomputes the whole
    block in the backward pass; "selective" also keeps its matmul and attention outputs
    (`_KEPT_OPS`) and recomputes the rest; "none" keeps everything. vision=False
    (`train.checkpoint_vision`): the vision tower's blocks keep everything whatever the mode.
    They see a micro-batch's patches (hundreds a diagram), not its tokens (thousands), so their
    activations are small and their recomputation is dispatch and launch time more than
    arithmetic. A model already sharded may switch (the flags are read at every call); a
    compiled model (`compile_layers`) switches by compiling again."""
    if mode not in CHECKPOINTING:
        raise ValueError(f"train.activation_checkpointing must be one of {CHECKPOINTING}, "
                         f"got {mode!r}")
    if mode == "none":
        if model.is_gradient_checkpointing:
            model.activation_checkpointing_disable()
        return
    model.activation_checkpointing_enable(activation_checkpointing_kwargs=_checkpoint_kwargs(mode))
    for block in model.model.visual.blocks:
        block.gradient_checkpointing = vision


def _checkpoint_kwargs(mode: str) -> dict:
    kwargs = {"use_reentrant": False}
    if mode == "selective":
        kwargs["context_fn"] = _selective_context
    return kwargs


def _selective_context():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        return (CheckpointPolicy.MUST_SAVE if op in _KEPT_OPS
                else CheckpointPolicy.PREFER_RECOMPUTE)

    return create_selective_checkpoint_contexts(policy)


def compile_layers(model, mode: str = "none", vision: bool = True,
                   backend: str = "inductor") -> None:
    """torch.compile each text decoder layer and each vision block as one region (`train.compile`,
    per block as torchtitan compiles): the norms, RoPE, SwiGLU, casts and residual adds of a
    block fused around its matmuls, one graph for all the blocks of a kind, token counts dynamic
    (no recompile per micro-batch length). Activation checkpointing (`checkpoint_layers`' `mode`,
    `vision` as there) runs inside each compiled region, and the packed attention is one op in
    it (`geo3k_torch.attention.packed_attention`; the vision blocks' attention goes through it
    too, over the images' layout that `host_inputs` passes as `packed_vision`). Only packed
    forwards (the learner's) take the compiled path; any other call (generation) runs the eager
    block. In place: parameter names and the state dict are unchanged; callable again to switch
    the mode, before or after FSDP2 wraps the blocks. backend: torch.compile's
    (`train.compile_backend`)."""
    checkpoint_layers(model, "none")  # the compiled regions checkpoint themselves
    if mode not in CHECKPOINTING:
        raise ValueError(f"train.activation_checkpointing must be one of {CHECKPOINTING}, "
                         f"got {mode!r}")
    visual = model.model.visual
    full = set(getattr(visual, "fullatt_block_indexes", None) or range(len(visual.blocks)))
    for i, block in enumerate(visual.blocks):
        attn = block.attn
        if not isinstance(attn, _PackedVisionAttention):
            attn.__class__ = _packed_class(type(attn))
        attn.layout_index = 0 if i in full else 1
        _compile_block(block, mode if vision else "none", backend, "packed_vision")
    for layer in model.model.language_model.layers:
        _compile_block(layer, mode, backend, "packed_segments")


def _compile_block(block, mode: str, backend: str, packed: str) -> None:
    """block.forward := its compiled, checkpointed self for calls given the packed layout
    `packed`; its class's forward for any other call."""
    eager = types.MethodType(type(block).forward, block)
    region = eager
    if mode != "none":
        from torch.utils.checkpoint import checkpoint
        region = functools.partial(checkpoint, eager, **_checkpoint_kwargs(mode))
    compiled = torch.compile(region, dynamic=True, backend=backend)

    def forward(*args, **kwargs):
        if kwargs.get(packed) is None:
            return eager(*args, **kwargs)
        # no "duck sizing": sizes that happen to be equal in one micro-batch (a layout's length
        # and a hidden size) must not become a guard that the next one fails; a MoE router's
        # recording hook (`geo3k_torch.router`) appends in the forward only, which a checkpointed
        # region's recomputation must not replay (Dynamo would break the graph otherwise)
        with torch.fx.experimental._config.patch(use_duck_shape=False), \
                torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
            return compiled(*args, **kwargs)

    block.forward = forward


@functools.cache
def _packed_class(cls: type) -> type:
    """`cls` (a vision attention class) with `_PackedVisionAttention`'s forward: one class for
    every block of a tower."""
    return type(f"Packed{cls.__name__}", (_PackedVisionAttention, cls), {})


class _PackedVisionAttention(torch.nn.Module):
    """Mixed into a Qwen-VL vision attention's class (`compile_layers`): its forward over the
    images' packed layout (`packed_vision[self.layout_index]`: 0 every image, 1 Qwen2.5-VL's
    windows), transformers' computation (qkv, the vision RoPE, attention per image, proj) with
    the attention one op. (P, C) -> (P, C). Without the layout, transformers' own forward. A
    class, not a per-block function, so that every block of a tower is one compiled graph."""

    layout_index: int = 0

    def forward(self, hidden_states: torch.Tensor, cu_seqlens=None, position_embeddings=None,
                packed_vision=None, **kwargs):
        if packed_vision is None:
            return super().forward(hidden_states, cu_seqlens,
                                   position_embeddings=position_embeddings, **kwargs)
        rope = sys.modules[type(self).__mro__[2].__module__].apply_rotary_pos_emb_vision
        n = hidden_states.shape[0]
        q, k, v = self.qkv(hidden_states).reshape(n, 3, self.num_heads, -1) \
            .permute(1, 0, 2, 3).unbind(0)  # (P, H, D) each
        q, k = rope(q, k, *position_embeddings)
        q, k, v = (x.transpose(0, 1)[None] for x in (q, k, v))  # (1, H, P, D)
        out = attention.packed_attention(q, k, v, packed_vision[self.layout_index],
                                         self.scaling, causal=False)
        return self.proj(out.reshape(n, -1))


def transposed_weights(model) -> list[tuple[str, list]]:
    """(name pattern, its Transpose ops) of each rule of transformers' conversion mapping for
    `model` that only transposes a weight in place (Qwen3-VL-MoE's experts); renames and merges
    are left out."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import Transpose, WeightConverter

    return [(rule.source_patterns[0], list(rule.operations))
            for rule in get_model_conversion_mapping(model)
            if isinstance(rule, WeightConverter) and len(rule.source_patterns) == 1
            and rule.source_patterns == rule.target_patterns
            and all(isinstance(op, Transpose) for op in rule.operations)]


def _model_layout(full: dict[str, torch.Tensor], model) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors `full` (by name) in `model`'s layout: the transposes of
    transformers' conversion mapping applied as `from_pretrained` applies them (where a shape
    differs from the model's, with `check_dims`). Qwen3-VL-MoE checkpoints on the Hub hold their
    experts as (E, H, 2I) and (E, I, H); transformers' modules (E, 2I, H) and (E, H, I).
    Renames and merges are not applied: the caller's missing-tensor check refuses them."""
    import re

    for pattern, ops in transposed_weights(model):
        for name in [k for k in full if re.search(pattern, k)]:
            for op in ops:
                full[name] = op.convert({name: full[name]}, [name], [name], model=model,
                                        full_layer_name=name)[name]
    return full


def hub_layout(named: dict[str, torch.Tensor], model) -> dict[str, torch.Tensor]:
    """Tensors by checkpoint name in `model`'s layout -> the layout of the published
    checkpoints, which SGLang's loaders read (0.5.23's qwen3_vl_moe.py transposes a fused
    expert weight unconditionally): each of `transposed_weights`' rules undone. transformers'
    `save_pretrained` does not undo them (its reverse transpose compares the shape with the
    model's own, always equal), so it writes the model's layout."""
    import re

    out = dict(named)
    for pattern, ops in transposed_weights(model):
        for name in [k for k in out if re.search(pattern, k)]:
            t = out[name]
            for op in reversed(ops):
                t = t.transpose(op.dim0, op.dim1)
            out[name] = t.contiguous()
    return out


def layouts_differ_in_shape(model) -> bool:
    """Whether every weight that `hub_layout` transposes has another shape transposed, so that
    `from_pretrained` (which tells the layouts apart by shape alone) reads a published file
    right. Not so for a model with H = 2I or H = I (a tiny one), nor for one with no such
    weight."""
    import re

    found = [p.shape[op.dim0] != p.shape[op.dim1]
             for pattern, ops in transposed_weights(model)
             for name, p in model.named_parameters() if re.search(pattern, name) for op in ops]
    return bool(found) and all(found)


def _tied(model) -> set[str]:
    """Parameter names that share a tensor with an earlier one (a tied LM head is saved once)."""
    first, tied = set(), set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            tied.add(name)
        first.add(id(p))
    return tied


def _check_kind(config, path: str) -> None:
    if config.model_type not in MODEL_TYPES:
        raise ValueError(f"{path}: model_type {config.model_type!r} is not one of {MODEL_TYPES}")


def packed_inputs(batch: PackedBatch, processor, config, device: torch.device | str = "cpu"
                  ) -> dict:
    """Keyword arguments for the model's forward on a packed micro-batch (batch dim 1),
    `packed_segments` (for `geo3k_torch.attention`) included: `host_inputs` moved to `device`."""
    return upload(host_inputs(batch, processor, config), torch.device(device))


def host_inputs(batch: PackedBatch, processor, config) -> dict:
    """The forward's inputs of a packed micro-batch, on the host: input_ids (1, T), position_ids
    (4, 1, T) (row 0 the text position, rows 1-3 M-RoPE), packed_segments (a
    `geo3k_torch.attention.Segments`), under packed_sdpa the placeholder attention mask
    (`attention.packed_mask`), and when the row has images pixel_values (P, C), image_grid_thw
    (N, 3), `vision_inputs` and packed_vision (the images' and the windows' `attention.Layout`,
    which the compiled vision blocks attend by, `compile_layers`). All the host work of a micro-batch (the image processor, the positions)
    happens here, so it can run while the device computes the previous one."""
    parents = batch.parent_of()
    if (parents >= 0).any() and config._attn_implementation != attention.NAME:
        raise ValueError(f"a micro-batch with shared prefixes needs the {attention.NAME!r} "
                         f"attention, the model runs {config._attn_implementation!r}")
    imgs = image_inputs(processor, batch.images)
    grid = imgs.get("image_grid_thw", np.zeros((0, 3), np.int64))
    pos = packed_position_ids(batch.input_ids, batch.cu_seqlens, batch.image_counts, grid,
                              config.image_token_id, config.vision_config.spatial_merge_size,
                              parents)
    out = {"input_ids": torch.from_numpy(batch.input_ids)[None],
           "position_ids": torch.from_numpy(pos)[:, None, :],
           "packed_segments": attention.Segments(np.diff(batch.cu_seqlens).tolist(),
                                                 parents.tolist())}
    if config._attn_implementation == attention.NAME:  # no mask built (other kernels need it)
        out["attention_mask"] = attention.packed_mask()
    if imgs:
        out["pixel_values"] = torch.from_numpy(imgs["pixel_values"])
        out |= vision_inputs(config, grid)
        out["packed_vision"] = (attention.image_layout(out["image_cu_seqlens"]),
                                attention.image_layout(out.get("image_cu_window_seqlens",
                                                               out["image_cu_seqlens"])))
    return out


def vision_inputs(config, grid: np.ndarray) -> dict:
    """What the vision tower would otherwise compute from the images' `grid` (N, 3) on the device,
    computed here on the host by transformers' own functions (`transformers.vision_utils`) and
    passed to the forward, which takes them in place of computing them: each of those reads the
    grid back from the device or indexes by data-dependent sizes, a host sync every time, and the
    attention split the patches by `cu_seqlens.tolist()` three times in every block. Returns
    image_grid_thw (N, 3) and image_cu_seqlens (N+1,) as numpy arrays, which stay on the host
    (the only reads are `.tolist()` of sizes, free there; FSDP2's root moves every tensor input
    to the device, numpy arrays it leaves), image_position_ids (patches, 2) and for Qwen3-VL
    image_interp_indices / image_interp_weights (patches, 4) of its learned position table, for
    Qwen2.5-VL's windowed blocks image_window_index (patches / merge^2,) and
    image_cu_window_seqlens (host, numpy)."""
    from transformers import vision_utils as vu

    v = config.vision_config
    thw = torch.from_numpy(np.asarray(grid, np.int64).reshape(-1, 3))
    out = {"image_grid_thw": thw.numpy(), "image_cu_seqlens": vu.get_vision_cu_seqlens(thw).numpy(),
           "image_position_ids": vu.get_vision_position_ids(thw, v.spatial_merge_size)}
    if family(config.model_type) == "qwen3_vl":  # bilinear, corners aligned: the tower's own
        out["image_interp_indices"], out["image_interp_weights"] = (
            vu.get_vision_interpolation_indices_and_weights(
                thw, num_grid_per_side=int(v.num_position_embeddings ** 0.5), mode="bilinear",
                align_corners=True, spatial_merge_size=v.spatial_merge_size))
    else:
        index, cu_window = vu.get_vision_window_index(thw, v.spatial_merge_size, v.window_size,
                                                       v.patch_size)
        out["image_window_index"], out["image_cu_window_seqlens"] = index, cu_window.numpy()
    return out


def upload(inputs: dict, device: torch.device) -> dict:
    """`host_inputs` on `device`: tensors and the attention layouts (`packed_segments` becomes an
    `attention.Layout`) copied without blocking from pinned memory on CUDA; numpy arrays
    (`vision_inputs`' host-side sizes) stay."""
    def up(v):
        if isinstance(v, torch.Tensor):
            return attention.to_device(v, device)
        if isinstance(v, attention.Segments):
            return v.layout(device)
        if isinstance(v, attention.Layout):
            return attention.Layout(*map(up, v))
        if isinstance(v, tuple):  # packed_vision: two layouts
            return tuple(map(up, v))
        return v
    return {k: up(v) for k, v in inputs.items()}


def deepstack_add(hidden: torch.Tensor, mask: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
    """Qwen3-VL's deepstack step without a host sync: hidden (B, T, H) with embeds (N, H) added
    at the N positions where mask (B, T) is true, in order. transformers indexes by the boolean
    mask (its size known only from the data: a sync in the forward, in the recomputation and in
    the backward); here each position gathers its row of embeds by the mask's running count and
    keeps it where the mask holds. The same values (x + 0 elsewhere)."""
    if embeds.shape[0] == 0:
        return hidden
    flat = mask.to(hidden.device).reshape(-1)
    row = (flat.cumsum(0) - 1).clamp_(min=0)
    add = embeds.to(hidden.device, hidden.dtype).index_select(0, row)
    return hidden + torch.where(flat[:, None], add, 0).view_as(hidden)


def use_deepstack_add(model) -> None:
    """A Qwen3-VL model's text model calls `deepstack_add` in place of its boolean-mask step
    (this instance only; other architectures have no deepstack)."""
    text = getattr(model.model, "language_model", None)
    if text is not None and hasattr(text, "_deepstack_process"):
        text._deepstack_process = deepstack_add  # an instance attribute: called unbound


def token_logprobs(model, inputs: dict[str, torch.Tensor], targets: torch.Tensor,
                   temperature: float = 1.0, with_entropy: bool = False, chunk: int = 0):
    """log p(token t | tokens < t) at the positions `targets` (K,) of the packed row.

    Every target must have a predecessor in its own sequence (its loss mask is 1, so it is never
    the first token of a sequence). Only the K needed logits rows are computed (the root forward
    with `logits_to_keep`, so FSDP's hooks run), `chunk` rows at a time when 0 < chunk < K (each
    chunk's (chunk, vocab) logits are recomputed in the backward pass: the K x vocab logits never
    exist at once). Returns (K,) fp32 log-probs and, with `with_entropy`, (K,) detached
    entropies of the same distributions.
    """
    ids = inputs["input_ids"][0, targets]
    if 0 < chunk < len(targets):
        head = model.lm_head
        model.lm_head = _ChunkedHead(head, ids, temperature, chunk)
        try:
            out = model(**inputs, use_cache=False, logits_to_keep=targets - 1).logits[0]
        finally:
            model.lm_head = head
        return (out[:, 0], out[:, 1]) if with_entropy else out[:, 0]
    out = model(**inputs, use_cache=False, logits_to_keep=targets - 1)
    return _logprobs(out.logits[0], ids, temperature, with_entropy)


def _logprobs(logits: torch.Tensor, ids: torch.Tensor, temperature: float, with_entropy: bool):
    """(K, V) logits, (K,) token ids -> (K,) fp32 log-probs [and (K,) detached entropies]."""
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    logp = logp_all.gather(-1, ids[:, None])[:, 0]
    if not with_entropy:
        return logp
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


class _ChunkedHead(torch.nn.Module):
    """Stands in for the LM head during one forward: (1, K, hidden) -> (1, K, 2) log-probs of
    `ids` and entropies, `chunk` rows at a time, each chunk checkpointed."""

    def __init__(self, head: torch.nn.Module, ids: torch.Tensor, temperature: float, chunk: int):
        super().__init__()
        self.head, self.ids, self.temperature, self.chunk = head, ids, temperature, chunk

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        parts = [checkpoint(self._part, hidden[0, a:a + self.chunk], self.ids[a:a + self.chunk],
                            use_reentrant=False) for a in range(0, hidden.shape[1], self.chunk)]
        return torch.cat(parts)[None]

    def _part(self, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        logp, entropy = _logprobs(self.head(hidden), ids, self.temperature, True)
        return torch.stack([logp, entropy], dim=-1)
