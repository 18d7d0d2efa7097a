"""Windowed attention (geo3k_jax.kernels.windowed + batch.attention_windows) equals dense causal
same-segment attention on packed rows of every layout."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from geo3k_jax.core.batch import NO_PREFIX, PREFIX_UNIT, attention_windows
from geo3k_jax.models.layers import attention
from geo3k_jax.kernels.windowed import (WINDOW_AXES, block_classes, window_classes, window_mask,
                                windowed_attention)

jax.config.update("jax_default_matmul_precision", "highest")


def rows_of(lengths_per_row, length):
    """(B, T) segments: row r holds sequences of the given lengths, then padding (-1)."""
    out = np.full((len(lengths_per_row), length), -1, np.int32)
    for r, lengths in enumerate(lengths_per_row):
        out[r, :sum(lengths)] = np.repeat(np.arange(len(lengths)), lengths)
    return out


def windowed(q, k, v, seg, windows, prefix=None):
    """The windowed attention of rows (B, T, ...) as the text model runs it (scale 0.3)."""
    mask = jax.vmap(window_mask, in_axes=(0, WINDOW_AXES, None if prefix is None else 0))(
        jnp.asarray(seg), windows, None if prefix is None else jnp.asarray(prefix))
    return jax.jit(lambda *a: windowed_attention(*a, 0.3))(q, k, v, windows, mask)


def dense(q, k, v, seg):
    t = seg.shape[0]
    mask = (seg[:, None] == seg[None, :]) & (np.arange(t)[:, None] >= np.arange(t)[None, :])
    return attention(q, k, v, jnp.asarray(mask), 0.3)


@pytest.mark.slow
@pytest.mark.parametrize("lengths,length", [
    ([[100, 300, 50], [512], [7, 1, 200]], 512),      # a sequence filling the row: W = T
    ([[130, 60, 70], [20] * 12, []], 384),            # many short ones, an empty row
    ([[33, 250], [64, 64, 64]], 320),                 # block = gcd(320, 128) = 64
    ([[5, 9, 3], [17]], 21),                          # T not a multiple of anything
])
def test_windowed_equals_dense(lengths, length):
    seg = rows_of(lengths, length)
    windows = attention_windows(seg)
    assert len(windows["prefix_offsets"]) == 0  # nothing continues a prefix
    rng = np.random.default_rng(0)
    b, t, h, kv, d = len(lengths), length, 4, 2, 8
    q, k, v = (jnp.asarray(rng.standard_normal((b, t, n, d)), jnp.float32) for n in (h, kv, kv))
    got = windowed(q, k, v, seg, windows)
    for r in range(b):
        real = seg[r] >= 0
        want = dense(q[r], k[r], v[r], seg[r])
        np.testing.assert_allclose(np.asarray(got[r])[real], np.asarray(want)[real], atol=1e-6)
        assert np.isfinite(np.asarray(got[r])).all()


def test_window_is_the_longest_sequence_plus_a_block():
    seg = rows_of([[100, 300, 50], [20] * 20], 1024)
    w = attention_windows(seg)
    starts, offsets = w["attn_starts"], w["key_offsets"]
    assert len(offsets) % 128 == 0 and 300 <= len(offsets) <= 300 + 2 * 128
    assert starts.shape == (2, 8) and (starts >= 0).all() and (starts + len(offsets) <= 1024).all()


def shared_rows(layout, length):
    """(segments, prefix, allowed (B, T, T) dense mask) of rows of (segment lengths, parents)."""
    b = len(layout)
    seg = np.full((b, length), -1, np.int32)
    prefix = np.full((b, length), NO_PREFIX, np.int32)
    allowed = np.zeros((b, length, length), bool)
    for r, (lengths, parents) in enumerate(layout):
        bounds = np.cumsum([0] + lengths)
        for s, p in enumerate(parents):
            lo, hi = bounds[s], bounds[s + 1]
            seg[r, lo:hi] = s
            allowed[r, lo:hi, lo:hi] = np.tril(np.ones((hi - lo, hi - lo), bool))
            if p >= 0:
                prefix[r, lo:hi] = p
                allowed[r, lo:hi, bounds[p]:bounds[p + 1]] = True
    return seg, prefix, allowed


LONG_GROUP = ([400] + [60] * 10 + [30, 100], [-1] + [0] * 10 + [-1, 11])  # 1,130 tokens


@pytest.mark.slow
@pytest.mark.parametrize("layout,length", [
    # (segment lengths, parents) per row: prompts with several continuations, plain sequences
    ([([300, 40, 90, 25], [-1, 0, 0, 0]), ([50, 200, 10, 10, 60], [-1, -1, 1, 1, -1])], 512),
    ([([7, 3, 3], [-1, 0, 0]), ([5, 9, 2, 1], [-1, -1, 1, 1])], 21),
    # a group over many blocks, then another group; two groups meeting inside a block
    ([LONG_GROUP, ([100, 20, 20, 150, 50, 50, 30], [-1, 0, 0, -1, 3, 3, -1])], 1152),
    # the last block's own window is pulled left over its prefix (kept once, not twice)
    ([([130, 10, 500], [-1, 0, 0]), ([64, 64, 64, 64, 100], [-1, 0, -1, 2, 2])], 640),
])
@pytest.mark.parametrize("min_prefix_window", [0, 448])  # 448: a bucket, no block multiple
def test_windows_reach_shared_prefixes(layout, length, min_prefix_window):
    """Segments that continue a shared prefix see all of it (and themselves causally): the
    windowed attention with prefix-aware masks and windows equals the dense reference, also
    with a prefix window grown to a bucket (`geo3k_jax.core.buckets.row_sizes`)."""
    b = len(layout)
    seg, prefix, allowed = shared_rows(layout, length)
    windows = attention_windows(seg, prefix, min_prefix_window=min_prefix_window)
    assert len(windows["prefix_offsets"]) % PREFIX_UNIT == 0 or length % PREFIX_UNIT
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.standard_normal((b, length, n, 8)), jnp.float32) for n in (4, 2, 2))
    got = windowed(q, k, v, seg, windows, prefix)
    for r in range(b):
        real = seg[r] >= 0
        want = attention(q[r], k[r], v[r], jnp.asarray(allowed[r]), 0.3)
        np.testing.assert_allclose(np.asarray(got[r])[real], np.asarray(want)[real], atol=1e-6)


def test_a_long_group_costs_its_prompt_plus_a_continuation():
    """A group's queries read the prompt (prefix window) and their own continuation, not the
    whole group: Wp is the prompt and W a continuation plus a block or two, also for the
    blocks that start inside the prompt."""
    seg, prefix, _ = shared_rows([LONG_GROUP], 1152)
    w = attention_windows(seg, prefix)
    assert len(w["prefix_offsets"]) == 416  # the 400-token prompt, in units of 32 (not 512)
    assert len(w["key_offsets"]) <= 100 + 2 * 128
    assert list(w["window_prefix"][0, :4]) == [0, 0, 0, 0]  # the prompt's blocks, then ...
    assert (w["window_prefix"][0, 4:8] == 0).all()  # ... its continuations' blocks


def test_a_prefix_outside_the_row_is_an_error():
    seg, prefix, _ = shared_rows([([10, 5], [-1, 0])], 16)
    prefix[0, 10:15] = 7
    with pytest.raises(ValueError, match="prefix segment that is not in the row"):
        attention_windows(seg, prefix)


GRAD_LAYOUTS = [
    ([([300, 40, 90, 25], [-1, 0, 0, 0]), ([50, 200, 10, 10, 60], [-1, -1, 1, 1, -1])], 512),
    ([LONG_GROUP, ([100, 20, 20, 150, 50, 50, 30], [-1, 0, 0, -1, 3, 3, -1])], 1152),
    ([([130, 10, 500], [-1, 0, 0]), ([64, 64, 64, 64, 100], [-1, 0, -1, 2, 2])], 640),
    ([([5, 9, 3], [-1, -1, -1]), ([17], [-1])], 21),
]


def _losses(layout, length, dtype=jnp.float32):
    """(windowed loss, dense loss, q, k, v): sum(c * out) over the real queries, c random."""
    b = len(layout)
    seg, prefix, allowed = shared_rows(layout, length)
    windows = attention_windows(seg, prefix)
    rng = np.random.default_rng(2)
    q, k, v = (jnp.asarray(rng.standard_normal((b, length, n, 8)), dtype) for n in (4, 2, 2))
    c = jnp.asarray(rng.standard_normal((b, length, 32)) * (seg >= 0)[..., None], jnp.float32)
    mask = jax.vmap(window_mask, in_axes=(0, WINDOW_AXES, 0))(jnp.asarray(seg), windows,
                                                              jnp.asarray(prefix))

    def windowed_loss(q, k, v):
        out = windowed_attention(q, k, v, windows, mask, 0.3)
        return jnp.sum(out.astype(jnp.float32) * c)

    def dense_loss(q, k, v):
        out = jax.vmap(lambda q_, k_, v_, a: attention(q_, k_, v_, a, 0.3))(
            q, k, v, jnp.asarray(allowed))
        return jnp.sum(out.astype(jnp.float32) * c)

    return windowed_loss, dense_loss, (q, k, v), seg


@pytest.mark.slow
@pytest.mark.parametrize("layout,length", GRAD_LAYOUTS)
def test_windowed_gradients_equal_dense(layout, length):
    """The hand-written backward pass (per block, key and value gradients added into place
    where windows overlap) gives autodiff's gradients of dense attention."""
    windowed_loss, dense_loss, qkv, _ = _losses(layout, length)
    got = jax.jit(jax.grad(windowed_loss, argnums=(0, 1, 2)))(*qkv)
    want = jax.grad(dense_loss, argnums=(0, 1, 2))(*qkv)
    for name, g, w in zip("qkv", got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, rtol=1e-4,
                                   err_msg=f"d{name}")


@pytest.mark.slow
def test_blocks_run_with_the_windows_they_need():
    """On one row (a CPU-default slice), a prompt's blocks run without the own window and a
    block of padding with no keys at all; with two rows a block takes the larger of their
    needs. Outputs and gradients stay dense attention's."""
    seg, prefix, _ = shared_rows([LONG_GROUP], 1280)  # 10 blocks: 1,130 tokens, then padding
    windows = attention_windows(seg, prefix)
    wp, w = len(windows["prefix_offsets"]), len(windows["key_offsets"])
    mask = jax.vmap(window_mask, in_axes=(0, WINDOW_AXES, 0))(jnp.asarray(seg), windows,
                                                              jnp.asarray(prefix))
    classes = window_classes(wp, w)
    assert classes == ((0, 0), (wp, 0), (wp, w))
    assert [classes[c] for c in block_classes(mask, wp, classes)] == (
        [(wp, 0)] * 3 + [(wp, w)] * 6 + [(0, 0)])  # 400 prompt tokens: blocks 0-2
    both = jnp.concatenate([mask, jnp.roll(mask, 1, axis=1)])  # the other row one block later
    assert [classes[c] for c in block_classes(both, wp, classes)] == (
        [(wp, 0)] * 3 + [(wp, w)] * 7)
    windowed_loss, dense_loss, qkv, _ = _losses([LONG_GROUP], 1280)
    np.testing.assert_allclose(float(jax.jit(windowed_loss)(*qkv)), float(dense_loss(*qkv)),
                               rtol=1e-5)
    got = jax.jit(jax.grad(windowed_loss, argnums=(0, 1, 2)))(*qkv)
    want = jax.grad(dense_loss, argnums=(0, 1, 2))(*qkv)
    for name, g, w in zip("qkv", got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, rtol=1e-4,
                                   err_msg=f"d{name}")


@pytest.mark.slow
def test_windowed_bfloat16_follows_float32():
    """bf16 inputs: scores and softmax in fp32, gradients in the inputs' dtype, close to the
    fp32 ones (within bf16 rounding)."""
    layout, length = GRAD_LAYOUTS[0]
    windowed_loss, _, qkv, _ = _losses(layout, length)
    half = tuple(a.astype(jnp.bfloat16) for a in qkv)
    got = jax.jit(jax.grad(windowed_loss, argnums=(0, 1, 2)))(*half)
    want = jax.grad(windowed_loss, argnums=(0, 1, 2))(*qkv)
    for g, w in zip(got, want):
        assert g.dtype == jnp.bfloat16
        err = np.abs(np.asarray(g, np.float32) - np.asarray(w))
        assert err.max() <= 0.05 * np.abs(np.asarray(w)).max()


@pytest.mark.slow
def test_a_query_that_sees_nothing_gives_zero_and_no_gradient():
    """A query whose mask row is all False (padding's, or made so) outputs 0 and its output's
    gradient reaches nothing: not NaN, not a uniform average of its window."""
    seg = rows_of([[5, 9]], 32)
    windows = attention_windows(seg)
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 32, n, 8)), jnp.float32) for n in (2, 1, 1))
    mask = jax.vmap(window_mask, in_axes=(0, WINDOW_AXES))(jnp.asarray(seg), windows)
    blind = np.zeros(32, bool)
    blind[[3, 10]] = True
    mask = mask & ~jnp.asarray(blind.reshape(mask.shape[:3]))[..., None]
    run = lambda q, k, v: windowed_attention(q, k, v, windows, mask, 0.3)  # noqa: E731
    out = np.asarray(run(q, k, v))
    assert (out[0, blind] == 0).all() and (out[0, seg[0] < 0] == 0).all()
    assert (out[0, ~blind & (seg[0] >= 0)] != 0).all() and np.isfinite(out).all()
    blind |= seg[0] < 0
    blind_only = lambda q, k, v: jnp.sum(run(q, k, v)[:, blind] ** 2 + 1.0)  # noqa: E731
    for g in jax.grad(blind_only, argnums=(0, 1, 2))(q, k, v):
        assert (np.asarray(g) == 0).all()
