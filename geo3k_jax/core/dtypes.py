"""The dtype that softmax, rotary and norm statistics are computed in (`wide_dtype`): shared by
the model layers (`geo3k_jax.models.layers`) and the attention kernels (`geo3k_jax.kernels`)."""

from __future__ import annotations

import jax.numpy as jnp


def wide_dtype(dtype):
    """fp32 for half-precision inputs, the input's own dtype when it is wider (float64)."""
    return jnp.promote_types(dtype, jnp.float32)
