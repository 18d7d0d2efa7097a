"""Qwen3-VL-MoE's sparse block in JAX (geo3k_jax.models.moe) against transformers' own, and its
grouped matmuls compiled for a TPU (the model-level numerics are tests/test_jax_model.py's)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import Qwen3VLMoeConfig
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextSparseMoeBlock

from geo3k_jax.models.moe import SparseMoeBlock, route, routed, sparse_layers

jax.config.update("jax_default_matmul_precision", "highest")


def text_config(**kw):
    return Qwen3VLMoeConfig(text_config=dict(
        dict(hidden_size=48, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16,
             num_hidden_layers=4), **kw)).text_config


def blocks(cfg, seed=0):
    """transformers' block with random weights and the JAX block holding the same."""
    torch.manual_seed(seed)
    hf = Qwen3VLMoeTextSparseMoeBlock(cfg).float()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
    block = SparseMoeBlock(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    block.gate.weight[...] = jnp.asarray(hf.gate.weight.detach().numpy())
    block.experts.gate_up_proj[...] = jnp.asarray(hf.experts.gate_up_proj.detach().numpy())
    block.experts.down_proj[...] = jnp.asarray(hf.experts.down_proj.detach().numpy())
    return hf, block


def test_block_equals_transformers_with_its_gradient():
    """Rows of tokens routed over 6 experts, 2 a token: the output and the gradients of the
    input and of every weight (the router's through the renormalised top-k weights) are
    transformers'."""
    cfg = text_config()
    hf, block = blocks(cfg)
    x = np.random.default_rng(1).standard_normal((3, 7, 48)).astype(np.float32)
    xt = torch.from_numpy(x).requires_grad_()
    ref = hf(xt)
    (ref * ref).sum().backward()
    graphdef, state = nnx.split(block)

    def loss(state, x):
        y, _ = nnx.merge(graphdef, state)(x)
        return (y * y).sum(), y
    (_, y), (grads, gx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        state, jnp.asarray(x))
    for got, want in ((y, ref.detach().numpy()), (gx, xt.grad.numpy())):
        assert np.abs(np.asarray(got) - want).max() <= 1e-6 * np.abs(want).max()
    for name, g in (("gate.weight", grads["gate"]["weight"]),
                    ("experts.gate_up_proj", grads["experts"]["gate_up_proj"]),
                    ("experts.down_proj", grads["experts"]["down_proj"])):
        want = hf.get_parameter(name).grad.numpy()
        assert np.linalg.norm(np.asarray(g[...]) - want) <= 1e-5 * np.linalg.norm(want), name
    chosen = hf.gate(xt.reshape(-1, 48))[2].flatten().numpy()
    assert len(set(chosen.tolist())) >= 4  # most experts take tokens: their grouping matters


def _grads(block, x, replay=None):
    """The block's output, router top k, and the gradients of sum(y^2) over its state and x."""
    graphdef, state = nnx.split(block)

    def loss(state, x):
        y, top = nnx.merge(graphdef, state)(x, replay)
        return (y * y).sum(), (y, top)
    (_, (y, top)), (gs, gx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        state, x)
    return y, top, gs, gx


def test_replaying_the_free_routing_is_the_free_path_bit_for_bit():
    """Routing replay given the router's own choice: output, top k and every gradient equal
    the free path's exactly (the learner with replay on trains what it trained without)."""
    _, block = blocks(text_config())
    x = jnp.asarray(np.random.default_rng(1).standard_normal((3, 7, 48)), jnp.float32)
    free = _grads(block, x)
    again = _grads(block, x, free[1])
    for a, b in zip(jax.tree.leaves(free), jax.tree.leaves(again)):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def _dense_reference(x, router, gate_up, down, index):
    """Every expert on every token, then each token's `index` (N, k) experts combined with their
    softmax probabilities renormalised: (N, hidden)."""
    probs = jax.nn.softmax(x @ router.T, axis=-1)
    w = jnp.take_along_axis(probs, index, axis=-1)
    w = w / w.sum(-1, keepdims=True)
    gate, up = jnp.split(jnp.einsum("nh,eoh->neo", x, gate_up), 2, axis=-1)
    every = jnp.einsum("nei,ehi->neh", jax.nn.silu(gate) * up, down)  # (N, E, hidden)
    return jnp.einsum("nk,nkh->nh", w, jnp.take_along_axis(every, index[..., None], axis=1))


def test_replayed_experts_weigh_by_their_probabilities_and_minus_one_routes_freely():
    """Half the tokens replay experts drawn at random (mostly not the router's choice), half
    hold -1 rows: output and gradients are an every-expert dense reference's with the replayed
    experts, and the router's own top k where -1. The router learns through the replayed
    experts' probabilities (its gradient is the reference's, not zero)."""
    cfg = text_config()
    _, block = blocks(cfg)
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((2, 9, 48)), jnp.float32)
    y_free, top, _, _ = _grads(block, x)
    drawn = np.stack([rng.choice(6, 2, replace=False) for _ in range(18)]).reshape(2, 9, 2)
    replay = np.where((np.arange(9) % 2 == 0)[None, :, None], drawn, -1)
    replay[0, 1, 1] = 3 if replay[0, 1, 0] != 3 else 4  # one -1 in a row: the whole row free
    replay[0, 1, 0] = -1
    y, top_r, gs, gx = _grads(block, x, jnp.asarray(replay, jnp.int32))
    used = np.where(replay[..., :1] >= 0, replay, np.asarray(top)).reshape(-1, 2)
    assert np.array_equal(np.asarray(top_r), np.asarray(top))  # the router's own, as before
    flips = (np.sort(used, -1) != np.sort(np.asarray(top).reshape(-1, 2), -1)).any(-1).sum()
    assert flips >= 6  # most replayed rows are not the router's choice
    router, gate_up, down = (block.gate.weight[...], block.experts.gate_up_proj[...],
                             block.experts.down_proj[...])

    def ref_loss(x, router, gate_up, down):
        r = _dense_reference(x.reshape(-1, 48), router, gate_up, down, jnp.asarray(used))
        return (r * r).sum(), r
    (_, want), grads = jax.value_and_grad(ref_loss, argnums=(0, 1, 2, 3), has_aux=True)(
        x, router, gate_up, down)
    assert np.abs(np.asarray(y).reshape(-1, 48) - want).max() <= 1e-5 * np.abs(want).max()
    free_rows = (replay[..., 0] < 0).reshape(-1)
    assert np.array_equal(np.asarray(y).reshape(-1, 48)[free_rows],
                          np.asarray(y_free).reshape(-1, 48)[free_rows])
    for got, want in ((gx, grads[0]), (gs["gate"]["weight"], grads[1]),
                      (gs["experts"]["gate_up_proj"], grads[2]),
                      (gs["experts"]["down_proj"], grads[3])):
        got, want = np.asarray(got[...]), np.asarray(want)
        assert np.linalg.norm(got - want) <= 1e-5 * np.linalg.norm(want)
    assert np.abs(np.asarray(grads[1])).max() > 1e-3


def test_a_tokens_experts_are_added_in_its_top_k_order():
    """k = 3: the float32 sum of a token's three weighted expert outputs depends on the order,
    and transformers adds them in top-k order (heaviest first: its grouped experts sum a
    (tokens, k, hidden) view over k). Experts whose every output is +-2^(12 e) (gate = up = 1,
    an identity activation) make each weighted output exact, so the additions are the only
    roundings: the block equals the top-k-order sum bit for bit. Adding in expert order, as the
    scatter-add this block had did, gives other bits on 32 of these 512 outputs."""
    rng = np.random.default_rng(0)
    n, hidden, experts, k = 64, 8, 4, 3
    x = rng.standard_normal((n, hidden)).astype(np.float32)
    x[:, -1] = 1.0
    router = rng.standard_normal((experts, hidden)).astype(np.float32)
    gate_up = np.zeros((experts, 2, hidden), np.float32)
    gate_up[:, :, -1] = 1.0  # the gate and the up projection read the constant 1
    signs = rng.choice([-1.0, 1.0], (experts, hidden, 1))
    down = (signs * 2.0 ** (12 * np.arange(experts))[:, None, None]).astype(np.float32)
    got = np.asarray(jax.jit(routed, static_argnums=(4, 5))(x, router, gate_up, down, k,
                                                            lambda g: g)[0])
    weights, index = (np.asarray(a) for a in jax.jit(
        lambda x, r: route(jnp.einsum("nh,eh->ne", x, r), k)[:2])(x, router))
    want = np.zeros((n, hidden), np.float32)
    for j in range(k):  # rank j of every token: its j-th heaviest expert
        want = want + down[index[:, j], :, 0] * weights[:, j:j + 1]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("kw,want", [
    (dict(), [True] * 4), (dict(decoder_sparse_step=2), [False, True, False, True]),
    (dict(mlp_only_layers=[0, 3]), [False, True, True, False]),
    (dict(num_experts=0), [False] * 4)])
def test_sparse_layers_are_the_ones_transformers_builds(kw, want):
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextDecoderLayer
    cfg = text_config(**kw)
    built = [isinstance(Qwen3VLMoeTextDecoderLayer(cfg, i).mlp, Qwen3VLMoeTextSparseMoeBlock)
             for i in range(4)]
    assert sparse_layers(cfg) == built == want


@pytest.mark.parametrize("replay", [False, True], ids=["free", "replayed"])
def test_experts_compile_for_tpu_as_a_ragged_dot_with_experts_sharded(replay):
    """libtpu compiles the block's gradient for a v5p with the experts over an `expert` axis of
    4 chips, routing freely or replaying given experts: the grouped matmuls become its
    ragged-dot kernel, not a dense product over every expert."""
    pytest.importorskip("libtpu", reason="the TPU compiler: pip install libtpu==0.0.42")
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from geo3k_jax.tpu.topology import topology_devices

    cfg = text_config(num_experts=8)
    block = nnx.eval_shape(lambda: SparseMoeBlock(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(block)
    mesh = Mesh(np.array(topology_devices("v5p-8")).reshape(4), ("expert",))
    spec = jax.tree.map(lambda a: NamedSharding(mesh, P("expert") if a.ndim == 3 else P()),
                        state)
    x = jax.ShapeDtypeStruct((2, 256, 48), jnp.float32)
    again = jax.ShapeDtypeStruct((2, 256, 2), jnp.int16) if replay else None
    fn = jax.jit(jax.grad(lambda s, x, r: (nnx.merge(graphdef, s)(x, r)[0] ** 2).sum()),
                 in_shardings=(spec, NamedSharding(mesh, P()),
                               NamedSharding(mesh, P()) if replay else None))
    with jax.default_matmul_precision(None):  # the TPU kernels take the default
        hlo = fn.lower(state, x, again).compile().as_text()
    assert "ragged-dot" in hlo
    assert not any(f"f32[512,8,{n}]" in hlo for n in (32, 48))  # no every-expert product


@pytest.mark.slow
def test_rows_mapped_over_the_mesh_route_their_own_tokens():
    """On 4 fake devices (data 2 x fsdp 2, the splash kernel's mesh) the block's rows are
    mapped over the batch axes: output and gradients are one device's, and each device sorts
    its own row's 64 tokens x 2 experts (128 assignments) where XLA's propagation alone gathers
    all 4 rows' 512 on every device."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root), XLA_FLAGS=os.environ.get("XLA_FLAGS", "")
               + " --xla_force_host_platform_device_count=4")
    out = subprocess.run([sys.executable, "-m", "tests.jax_moe_worker"], cwd=root, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["leaves"] == 5 and r["rel"] <= 1e-6  # the value, x's and 3 weights' gradients
    assert 512 in r["plain_rows"] and 128 in r["rows"] and max(r["rows"]) < 256, r
