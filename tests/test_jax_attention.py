"""Windowed attention (geo3k_jax.layers + batch.attention_windows) equals dense causal
same-segment attention on packed rows of every layout."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from geo3k_jax.batch import attention_windows
from geo3k_jax.layers import attention, window_mask, windowed_attention

jax.config.update("jax_default_matmul_precision", "highest")


def rows_of(lengths_per_row, length):
    """(B, T) segments: row r holds sequences of the given lengths, then padding (-1)."""
    out = np.full((len(lengths_per_row), length), -1, np.int32)
    for r, lengths in enumerate(lengths_per_row):
        out[r, :sum(lengths)] = np.repeat(np.arange(len(lengths)), lengths)
    return out


def dense(q, k, v, seg):
    t = seg.shape[0]
    mask = (seg[:, None] == seg[None, :]) & (np.arange(t)[:, None] >= np.arange(t)[None, :])
    return attention(q, k, v, jnp.asarray(mask), 0.3)


@pytest.mark.parametrize("lengths,length", [
    ([[100, 300, 50], [512], [7, 1, 200]], 512),      # a sequence filling the row: W = T
    ([[130, 60, 70], [20] * 12, []], 384),            # many short ones, an empty row
    ([[33, 250], [64, 64, 64]], 320),                 # block = gcd(320, 128) = 64
    ([[5, 9, 3], [17]], 21),                          # T not a multiple of anything
])
def test_windowed_equals_dense(lengths, length):
    seg = rows_of(lengths, length)
    starts, offsets = attention_windows(seg)
    rng = np.random.default_rng(0)
    b, t, h, kv, d = len(lengths), length, 4, 2, 8
    q, k, v = (jnp.asarray(rng.standard_normal((b, t, n, d)), jnp.float32) for n in (h, kv, kv))
    mask = jax.vmap(window_mask, in_axes=(0, 0, None))(jnp.asarray(seg), starts, offsets)
    got = jax.jit(jax.vmap(windowed_attention, in_axes=(0, 0, 0, 0, 0, None)),
                  static_argnums=5)(q, k, v, starts, mask, 0.3)
    for r in range(b):
        real = seg[r] >= 0
        want = dense(q[r], k[r], v[r], seg[r])
        np.testing.assert_allclose(np.asarray(got[r])[real], np.asarray(want)[real], atol=1e-6)
        assert np.isfinite(np.asarray(got[r])).all()


def test_window_is_the_longest_sequence_plus_a_block():
    seg = rows_of([[100, 300, 50], [20] * 20], 1024)
    starts, offsets = attention_windows(seg)
    assert len(offsets) % 128 == 0 and 300 <= len(offsets) <= 300 + 2 * 128
    assert starts.shape == (2, 8) and (starts >= 0).all() and (starts + len(offsets) <= 1024).all()
