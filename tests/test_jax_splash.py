"""Splash attention (geo3k_jax.kernels.splash, Pallas interpret mode on CPU) equals the windowed
path: the attention alone on packed and shared-prefix rows, and the whole model's log-probs and
gradients on rows with several images, multi-turn masks and shared prompts; and the splash path
compiles for a TPU topology (libtpu, no TPU needed)."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from common.batching import pack
from geo3k_jax.core.batch import attention_windows, device_batch
from geo3k_jax.models.model import token_logprobs
from geo3k_jax.core.sharding import AXES, BATCH_AXES
from geo3k_jax.kernels.splash import Attention, resolve_attention, text_attention, vision_attention
from geo3k_jax.kernels.windowed import WINDOW_AXES, window_mask, windowed_attention
from tests.test_jax_attention import rows_of, shared_rows
from tests.test_jax_model import sequences
from tests.tiny_models import IDS

jax.config.update("jax_default_matmul_precision", "highest")
SPLASH = Attention("splash", None, interpret=True)


def _qkvc(seg, h=4, kv=2, d=8, seed=0):
    b, t = seg.shape
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal((b, t, n, d)), jnp.float32) for n in (h, kv, kv))
    c = jnp.asarray(rng.standard_normal((b, t, h * d)) * (seg >= 0)[..., None], jnp.float32)
    return (q, k, v), c


@pytest.mark.slow  # interpret mode, or a TPU compile: seconds
@pytest.mark.parametrize("layout,length", [
    # (segment lengths, parents) per row; -1: no parent
    ([([100, 60, 90], [-1, -1, -1]), ([256], [-1])], 256),            # plain packed rows
    ([([130, 40, 90, 25], [-1, 0, 0, 0]), ([50, 100, 10, 10, 60], [-1, -1, 1, 1, -1])], 300),
])
def test_splash_equals_windowed(layout, length):
    """Outputs and q/k/v gradients of sum(c * out) agree to 1e-5 (fp32); rows not a multiple
    of the kernel block (300) are padded and cut back. A broken prefix merge (one pass only)
    would miss the prompt keys of every continuation; a wrong backward the prompt's dK, dV."""
    seg, prefix, _ = shared_rows(layout, length)
    windows = attention_windows(seg, prefix)
    pre = jnp.asarray(prefix)  # plain rows: all NO_PREFIX, the one-pass branch
    mask = jax.vmap(window_mask, in_axes=(0, WINDOW_AXES, 0))(jnp.asarray(seg), windows, pre)
    qkv, c = _qkvc(seg)

    def windowed(q, k, v):
        return jnp.sum(windowed_attention(q, k, v, windows, mask, 0.3) * c)

    def splash(q, k, v):
        return jnp.sum(text_attention(SPLASH, q, k, v, jnp.asarray(seg), pre, 0.3) * c)

    want = jax.jit(jax.value_and_grad(windowed, argnums=(0, 1, 2)))(*qkv)
    got = jax.jit(jax.value_and_grad(splash, argnums=(0, 1, 2)))(*qkv)
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5)
    for name, g, w in zip("qkv", got[1], want[1]):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5, err_msg=f"d{name}")
    out = text_attention(SPLASH, *qkv, jnp.asarray(seg), pre, 0.3)
    assert (np.asarray(out)[seg < 0] == 0).all()  # padding: zero, as windowed gives it


def test_splash_keeps_sequences_apart():
    """Without prefixes a query sees only its own segment: changing another sequence's keys
    changes nothing (segment ids reach the kernel)."""
    seg = rows_of([[70, 58]], 128)
    (q, k, v), _ = _qkvc(seg)
    out = text_attention(SPLASH, q, k, v, jnp.asarray(seg), None, 0.3)
    k2 = k.at[:, 70:].add(1.0)
    out2 = text_attention(SPLASH, q, k2, v, jnp.asarray(seg), None, 0.3)
    np.testing.assert_array_equal(np.asarray(out)[:, :70], np.asarray(out2)[:, :70])
    assert not np.allclose(np.asarray(out)[:, 70:], np.asarray(out2)[:, 70:])


def test_auto_is_splash_on_tpu_only():
    assert resolve_attention("auto", "tpu").splash
    assert not resolve_attention("auto", "tpu").interpret
    assert not resolve_attention("auto", "cpu").splash
    assert resolve_attention("splash", "cpu").interpret
    with pytest.raises(ValueError, match="jax.attention"):
        resolve_attention("flash", "cpu")


def _grouped(seqs, rng):
    """Each sequence and a sibling with the same prompt (tokens and images), another tail."""
    out = []
    for s in seqs:
        ids = np.array(s.token_ids)
        ids[-3:] = rng.integers(1, 200, 3)
        out += [s, dataclasses.replace(s, token_ids=ids)]
    return out


@pytest.mark.slow  # interpret mode, or a TPU compile: seconds
@pytest.mark.parametrize("arch", ["qwen3_vl", "qwen2_5_vl"])
def test_model_with_splash_equals_windowed(arch):
    """The tiny model's log-probs and parameter gradients with splash text and vision
    attention equal the windowed / dense ones (1e-5) on rows holding 0-3 images per sequence,
    multi-turn loss masks and prompts shared by two samples (`pack` with image_token_id)."""
    from tests.jax_learner_setup import model_and_batch

    setup = model_and_batch(arch)
    rng = np.random.default_rng(5)
    seqs = _grouped(sequences(setup.processor, rng, 3), rng)
    batches = pack(seqs, sum(map(len, seqs)) // 2 + 64, image_token_id=IDS["image_token_id"])
    batch = device_batch(batches, setup.processor, setup.config, agg="token-mean",
                         n_tokens=1.0, n_seqs=1.0, pad_to=32)
    assert (batch["prefix"] >= 0).any() and "pixel_values" in batch
    weights = jnp.asarray(np.random.default_rng(6).standard_normal(batch["input_ids"].shape),
                          jnp.float32)

    def run(attention):
        def loss(params):
            model = setup.merge(params)
            for module in (model.model.language_model, model.model.visual):
                module.attention = attention
            for block in model.model.visual.blocks:
                block.attn.attention = attention
            logp = token_logprobs(model, batch, remat=True)
            return jnp.sum(logp * weights), logp
        return jax.jit(jax.value_and_grad(loss, has_aux=True))(setup.params)

    (_, want), want_g = run(Attention())
    (_, got), got_g = run(SPLASH)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    worst = max(float(jnp.max(jnp.abs(got_g[k] - want_g[k]))) for k in want_g)
    assert worst <= 1e-5, worst


@pytest.fixture(scope="module")
def tpu_mesh():
    pytest.importorskip("libtpu", reason="the TPU compiler comes with libtpu (requirements-test)")
    from jax.experimental import topologies
    # compiling only: no TPU is opened, so other processes' compiles may hold libtpu too
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    devices = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1").devices
    return jax.sharding.Mesh(np.array(devices).reshape(1, 4, 1, 1), AXES)


@pytest.mark.slow  # interpret mode, or a TPU compile: seconds
def test_splash_compiles_for_tpu(tpu_mesh):
    """Forward and backward of the text attention with shared prefixes, rows split over the
    mesh (shard_map), compile for TPU v5p:2x2x1 with Mosaic (not interpret mode)."""
    attn = Attention("splash", tpu_mesh)
    b, t, h, kv, d = 4, 1024, 8, 2, 128
    rows = NamedSharding(tpu_mesh, P(BATCH_AXES))
    spec = lambda *shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt, sharding=rows)  # noqa

    def loss(q, k, v, seg, pre):
        return jnp.sum(text_attention(attn, q, k, v, seg, pre, d ** -0.5).astype(jnp.float32))
    with jax.default_matmul_precision("default"):  # this module's "highest": no bf16 on Mosaic
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(
            spec(b, t, h, d), spec(b, t, kv, d), spec(b, t, kv, d), spec(b, t, dt=jnp.int32),
            spec(b, t, dt=jnp.int32)).compile()
    text = compiled.as_text()
    assert "tpu_custom_call" in text  # the Mosaic kernel, not an XLA fallback
    assert compiled.memory_analysis().temp_size_in_bytes > 0


@pytest.mark.slow  # interpret mode, or a TPU compile: seconds
def test_vision_splash_compiles_for_tpu(tpu_mesh):
    """The vision tower's per-image attention, vmapped over rows as the model runs it (the
    rows mapped over the mesh's data axes), forward and backward, for TPU v5p:2x2x1."""
    attn = Attention("splash", tpu_mesh)
    b, n, h, d = 4, 1000, 16, 64  # 1,000 patches: padded to the kernel's block inside
    rows = NamedSharding(tpu_mesh, P(BATCH_AXES))
    spec = lambda *shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt, sharding=rows)  # noqa

    def loss(q, k, v, seg):
        out = jax.vmap(lambda *a: vision_attention(attn, *a, d ** -0.5),
                       spmd_axis_name=BATCH_AXES)(q, k, v, seg)
        return jnp.sum(out.astype(jnp.float32))
    with jax.default_matmul_precision("default"):
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(
            spec(b, n, h, d), spec(b, n, h, d), spec(b, n, h, d), spec(b, n, dt=jnp.int32)
        ).compile()
    assert "tpu_custom_call" in compiled.as_text()


def test_the_private_backward_is_the_pinned_one_or_a_clear_error(monkeypatch):
    """The shared-prefix backward calls splash's private `_splash_attention_bwd`: this JAX
    (the pinned 0.10.2) has it with the parameters it is called with; one that changed it or
    dropped it stops with the versions and the ways around it."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sak

    from geo3k_jax.kernels import splash

    assert jax.__version__ == "0.10.2"  # requirements-cpu.txt: the version this call is for
    assert splash._private_bwd() is sak._splash_attention_bwd
    monkeypatch.setattr(sak, "_splash_attention_bwd", lambda res, do, *, config: None)
    with pytest.raises(RuntimeError, match=r"jax 0\.10\.2 has \('res', 'do', 'config'\)\. "
                                           r"Install jax==0\.10\.2 .*share_prefix=False"):
        splash._private_bwd()
    monkeypatch.delattr(sak, "_splash_attention_bwd")
    with pytest.raises(RuntimeError, match="has none"):
        splash._private_bwd()
