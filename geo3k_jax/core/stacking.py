"""Checkpoint keys <-> the stacked parameters of `geo3k_jax.models.layers.LayerStack`: the decoder's
layers and the vision tower's blocks.

A Hugging Face checkpoint names each decoder layer's (each vision block's) tensors apart,

    model.language_model.layers.3.mlp.up_proj.weight          (out, in)
    model.visual.blocks.3.attn.qkv.weight                      (out, in)

while the model keeps one array per tensor kind with the layers along a leading axis,

    model.language_model.layers.mlp.up_proj.weight            (L, out, in)
    model.visual.blocks.attn.qkv.weight                        (depth, out, in)

so that a forward scans over them. Loading stacks (`geo3k_jax.models.weights.load_model`), exporting
and the torch comparison unstack (`to_hf`); partition rules stay written against checkpoint keys
(`geo3k_jax.core.sharding.spec_for` matches a stacked key as layer 0's, the layer axis unsharded).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import numpy as np

STACKS = ("model.language_model.layers.", "model.visual.blocks.")  # the stacked prefixes
_LAYER_KEY = re.compile("^(" + "|".join(map(re.escape, STACKS)) + r")(\d+)\.(.+)$")


def _stack(key: str) -> str | None:
    """The stacked prefix `key` starts with, if any."""
    return next((p for p in STACKS if key.startswith(p)), None)


def is_stacked(key: str) -> bool:
    """Whether `key` is a stacked key (layers along its first axis)."""
    prefix = _stack(key)
    return prefix is not None and not key[len(prefix)].isdigit()


def layer_key(key: str, i: int) -> str:
    """The checkpoint key of layer i's slice of stacked key `key`."""
    prefix = _stack(key)
    return f"{prefix}{i}.{key[len(prefix):]}"


def stacked_key(hf_key: str) -> tuple[str, int] | None:
    """(stacked key, layer) of a per-layer checkpoint key; None for any other key."""
    m = _LAYER_KEY.match(hf_key)
    return None if m is None else (m.group(1) + m.group(3), int(m.group(2)))


def hf_shapes(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """{checkpoint key: shape} of a model's {key: shape}: stacked keys split per layer."""
    out = {}
    for key, shape in shapes.items():
        shape = tuple(shape)
        if is_stacked(key):
            out.update({layer_key(key, i): shape[1:] for i in range(shape[0])})
        else:
            out[key] = shape
    return out


def to_hf(params: Mapping[str, object]) -> dict[str, object]:
    """{checkpoint key: array} of a model's {key: array} (stacked arrays indexed per layer:
    numpy views, or slices of jax arrays)."""
    out = {}
    for key, value in params.items():
        if is_stacked(key):
            out.update({layer_key(key, i): value[i] for i in range(value.shape[0])})
        else:
            out[key] = value
    return out


def from_hf(hf: Mapping[str, object], like: Mapping[str, object]) -> dict[str, np.ndarray]:
    """The model's {key: numpy array} for the keys of `like` (a model's params or shapes),
    read from {checkpoint key: array} `hf` (numpy, or anything np.asarray takes); stacked keys
    gather their layers."""
    out = {}
    for key, value in like.items():
        out[key] = (np.stack([np.asarray(hf[layer_key(key, i)]) for i in range(value.shape[0])])
                    if is_stacked(key) else np.asarray(hf[key]))
    return out
