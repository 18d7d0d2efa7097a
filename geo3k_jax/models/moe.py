"""Qwen3-VL-MoE's sparse MLP block in Flax NNX: a top-k router and experts as grouped matmuls.

transformers' `Qwen3VLMoeTextSparseMoeBlock`, under its parameter names and layouts:

    mlp.gate.weight                (E, hidden)        router logits = x @ weight.T
    mlp.experts.gate_up_proj       (E, 2 I, hidden)   rows [0, I) the gate, [I, 2 I) the up
    mlp.experts.down_proj          (E, hidden, I)

Each token's router logits are softmaxed over the E experts in fp32, the top k kept and
renormalised to sum to 1 (transformers' `Qwen3VLMoeTextTopKRouter` always renormalises; its
config has no `norm_topk_prob`), cast back to the logits' dtype; the block's output is the
weighted sum of the k experts' gated SiLU MLPs, added in the token's top-k order (highest
weight first), as transformers' grouped experts add them.

The experts run as two grouped matmuls (`jax.lax.ragged_dot_general`) over the N x k
(token, expert) assignments sorted by expert: each expert multiplies only the tokens routed
to it, so the block costs k / E of running every expert on every token (Qwen3-VL-30B-A3B:
8 of 128), and the weights keep transformers' layout (the contraction is over their last
axis). A dense dispatch (every expert on every token, then a one-hot combine) equals it to
float32 rounding on a CPU but costs E / k times the FLOPs; XLA's CPU runs the ragged dot
(forward and gradient), and for TPU it compiles to libtpu's ragged-dot kernel (a Mosaic
custom call), checked with `jax.jit(...).lower(...).compile()` on `geo3k_jax.tpu.topology`'s
compile-only devices.

The tokens of a call are sorted together, so left to XLA's sharding propagation every
data-parallel device would gather the step's tokens and compute every assignment. With a mesh
(`attention.mesh`: the one the model's rows are split over, `geo3k_jax.kernels.splash`)
the block runs under `shard_map` over the batch axes instead: each device routes and sorts its
own rows' tokens and multiplies them by the experts gathered whole (sharding the experts over
`expert` divides their memory at rest, not the compute; routing tokens to the devices holding
their experts, an all-to-all, is not done).

Routing replay (`loss.routing_replay`, Rollout Routing Replay): the block may be given each
token's experts (N, k) to use instead of its own top k, as the engine routed it; a token whose
row holds a -1 (not recorded) routes freely. The weights are the softmax probabilities at the
given experts renormalised, as the free path's, so the router still learns through them; given
the router's own choice, replay computes the same numbers as the free path, bit for bit. The
block also returns the router's own top k, what the engine records and what the learner
compares with the replayed experts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jax.sharding import PartitionSpec as P

from geo3k_jax.kernels.splash import Attention, row_axes
from geo3k_jax.models.layers import Linear, activation, init_normal

# lhs (M, in) ragged along M by expert, rhs (E, out, in): contract in with rhs' last axis
_GROUPED = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0])


def sparse_layers(cfg) -> list[bool]:
    """Which decoder layers of text config `cfg` have a sparse MoE block, as transformers'
    `Qwen3VLMoeTextDecoderLayer` decides: not in `mlp_only_layers`, and every
    `decoder_sparse_step`-th layer when there are experts."""
    return [i not in cfg.mlp_only_layers and cfg.num_experts > 0
            and (i + 1) % cfg.decoder_sparse_step == 0 for i in range(cfg.num_hidden_layers)]


def routing_shape(config) -> tuple[int, int] | None:
    """(sparse layers L, experts a token K) of a transformers Qwen-VL config: the last axes of
    the routing an engine records and a learner replays; None for a dense model."""
    if config.model_type != "qwen3_vl_moe":
        return None
    layers = sum(sparse_layers(config.text_config))
    return (layers, int(config.text_config.num_experts_per_tok)) if layers else None


def route(logits: jax.Array, k: int, replay: jax.Array | None = None
          ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Top-k routing of router logits (N, E), the softmax in fp32: (weights (N, k) in the
    logits' dtype, summing to 1 per token; the experts used (N, k) int32; the router's own top
    k (N, k) int32). replay: (N, k) experts to use instead of the top k (a row with a -1: the
    top k); the weights are the probabilities at the experts used, renormalised."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    chosen, top = jax.lax.top_k(probs, k)
    index = top
    if replay is not None:  # gathered: for the top k, top_k's values and gradient exactly
        index = jnp.where(jnp.all(replay >= 0, axis=-1, keepdims=True),
                          replay.astype(jnp.int32), top)
        chosen = jnp.take_along_axis(probs, index, axis=-1)
    return (chosen / chosen.sum(-1, keepdims=True)).astype(logits.dtype), index, top


class Experts(nnx.Module):
    """E gated MLPs stacked: gate_up_proj (E, 2 I, hidden), down_proj (E, hidden, I) (`routed`
    runs them)."""

    def __init__(self, experts: int, hidden: int, inner: int, act: str, *, dtype,
                 rngs: nnx.Rngs):
        self.gate_up_proj = nnx.Param(init_normal(rngs, (experts, 2 * inner, hidden), dtype))
        self.down_proj = nnx.Param(init_normal(rngs, (experts, hidden, inner), dtype))
        self.act = activation(act)


def routed(x: jax.Array, router: jax.Array, gate_up: jax.Array, down: jax.Array, k: int,
           act, replay: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The block on tokens x (N, hidden) with router (E, hidden), gate_up (E, 2I, hidden) and
    down (E, hidden, I): each token's top-k experts' outputs (or replay's, `route`), weighted,
    summed, (N, hidden); and the router's own top k (N, k) int32."""
    weights, index, top = route(jnp.einsum("nh,eh->ne", x, router), k, replay)  # (N, k) each
    flat = index.reshape(-1)  # (N k,) assignment j is token j // k's
    order = jnp.argsort(flat, stable=True)  # assignments grouped by expert
    token = order // k
    sizes = jnp.bincount(flat, length=router.shape[0]).astype(jnp.int32)  # (E,)
    h = jax.lax.ragged_dot_general(x[token], gate_up, sizes, _GROUPED)
    gate, up = jnp.split(h, 2, axis=-1)  # (N k, I) each
    y = jax.lax.ragged_dot_general(act(gate) * up, down, sizes, _GROUPED)  # (N k, hidden)
    y = y * weights.reshape(-1)[order][:, None]
    # back to (token, rank) order and summed over the k ranks in that order, as transformers
    # adds them (a scatter-add would add a token's outputs in expert order: the same sum for
    # k = 2, another float32 rounding for k > 2)
    back = jnp.zeros_like(order).at[order].set(jnp.arange(order.size, dtype=order.dtype))
    return y[back].reshape(x.shape[0], k, x.shape[1]).sum(axis=1), top


class SparseMoeBlock(nnx.Module):
    """Router and experts (transformers' `mlp` of a sparse layer). x (B, T, hidden) -> (the
    output (B, T, hidden), the router's own top k (B, T, k) int32)."""

    def __init__(self, cfg, *, dtype, rngs: nnx.Rngs, attention: Attention = Attention()):
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                               cfg.hidden_act, dtype=dtype, rngs=rngs)
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=False, dtype=dtype, rngs=rngs)
        self.top_k = cfg.num_experts_per_tok
        self.attention = attention  # its mesh: the one the rows are split over (None: none)

    def __call__(self, x: jax.Array, replay: jax.Array | None = None
                 ) -> tuple[jax.Array, jax.Array]:
        """x (B, T, hidden): B rows, split over the mesh's batch axes when they divide B;
        replay (B, T, k): the experts each token goes to (a row with a -1: its own top k)."""
        def block(x, router, gate_up, down, *replay):
            flat = x.reshape(-1, x.shape[-1])  # (N, hidden): this device's rows' tokens
            again = replay[0].reshape(-1, self.top_k) if replay else None
            y, top = routed(flat, router, gate_up, down, self.top_k, self.experts.act, again)
            return y.reshape(x.shape), top.reshape(x.shape[:-1] + (self.top_k,))
        args = (x, self.gate.weight[...], self.experts.gate_up_proj[...],
                self.experts.down_proj[...]) + (() if replay is None else (replay,))
        mesh = self.attention.mesh
        rows = None if mesh is None else row_axes(mesh, x.shape[0])
        if rows is None:
            return block(*args)
        return jax.shard_map(block, mesh=mesh, in_specs=(P(rows), P(), P(), P())
                             + (P(rows),) * (replay is not None),
                             out_specs=(P(rows), P(rows)), check_vma=False)(*args)
