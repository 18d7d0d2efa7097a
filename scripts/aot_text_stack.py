"""Compile the text decoder's forward + backward for a TPU topology on a CPU host (libtpu, no
TPU): the splash shared-prefix choice and the scanned layer stack, measured by the compiler.

    python scripts/aot_text_stack.py --config=path/to/config.json --mode=layers
    python scripts/aot_text_stack.py --config=path/to/config.json --mode=prefix

`config.json`: a Qwen-VL Hugging Face config (shapes only; the published ones are in
configs/models/). Parameters are abstract (bf16, sharded over `fsdp` by configs/base.py's
rules), one row of `--tokens` per chip of `--topology`, splash attention, remat.

layers: compile seconds of the whole text stack, scanned
        (`geo3k_jax.models.text.DecoderStack.run`) and unrolled (the same layers called one by
        one in Python).
prefix: one decoder layer with a shared-prefix row, three ways: splash's two passes merged
        (`geo3k_jax.kernels.splash`), the prompt kept per sample (a row `--unshared` tokens
        long, one pass), and splash's dynamic (T, T) mask; per-chip flops, bytes accessed,
        temporaries.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import types

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.experimental.pallas.ops.tpu.splash_attention import (  # noqa: E402
    splash_attention_kernel as sak)
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from configs.base import JAX_RULES  # noqa: E402
from geo3k_jax.models.model import split_params  # noqa: E402
from geo3k_jax.core.sharding import BATCH_AXES, param_shardings  # noqa: E402
from geo3k_jax.kernels.splash import (  # noqa: E402
    Attention, _block_sizes, block_for, text_attention)
from geo3k_jax.models.text import TextModel  # noqa: E402


def text_config(path: str):
    raw = json.load(open(path))
    cfg = json.loads(json.dumps(raw["text_config"]),
                     object_hook=lambda d: types.SimpleNamespace(**d))
    if not hasattr(cfg, "rope_parameters"):
        cfg.rope_parameters = dict(vars(cfg.rope_scaling), rope_theta=cfg.rope_theta)
    else:
        cfg.rope_parameters = vars(cfg.rope_parameters)
    cfg.attention_bias = getattr(cfg, "attention_bias", False)
    return cfg, raw["model_type"]


def abstract_model(cfg, arch, mesh, layers: int):
    cfg.num_hidden_layers = layers
    attn = Attention("splash", mesh)
    model = nnx.eval_shape(lambda: TextModel(cfg, arch, dtype=jnp.bfloat16, rngs=nnx.Rngs(0),
                                             attention=attn))
    merge, params = split_params(model)
    shard = param_shardings(params, mesh, JAX_RULES)
    return merge, {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shard[k])
                   for k, v in params.items()}


def row_inputs(cfg, mesh, tokens: int):
    rows = NamedSharding(mesh, P(BATCH_AXES))
    b = mesh.devices.size

    def spec(*shape, dtype=jnp.int32):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=rows)
    return (spec(b, tokens, cfg.hidden_size, dtype=jnp.bfloat16), spec(b, 3, tokens),
            spec(b, tokens), spec(b, tokens))


def report(name, lowered):
    start = time.perf_counter()
    compiled = lowered.compile()
    seconds = time.perf_counter() - start
    cost, mem = compiled.cost_analysis(), compiled.memory_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    print(f"{name}: compile {seconds:.1f} s, {cost.get('flops', 0) / 1e12:.2f} TFLOP, "
          f"{cost.get('bytes accessed', 0) / 1e9:.2f} GB accessed, temporaries "
          f"{mem.temp_size_in_bytes / 1e9:.2f} GB per chip", flush=True)


def layers_mode(cfg, arch, mesh, tokens):
    merge, params = abstract_model(cfg, arch, mesh, cfg.num_hidden_layers)
    inputs = row_inputs(cfg, mesh, tokens)

    def scanned(p, embeds, positions, segments, prefix):
        return jnp.sum(merge(p)(embeds, positions, segments, {}, remat=True,
                                prefix=prefix).astype(jnp.float32))

    def unrolled(p, embeds, positions, segments, prefix):
        lm = merge(p)
        cos, sin = lm.rope(positions)

        def attend(q, k, v, scale):
            return text_attention(lm.attention, q, k, v, segments, prefix, scale)
        x = embeds
        for layer in lm.layers:
            x = jax.checkpoint(lambda h, layer=layer: layer(h, cos, sin, attend))(x)
        return jnp.sum(lm.norm(x).astype(jnp.float32))

    for name, fn in (("scanned", scanned), ("unrolled", unrolled)):
        report(f"{cfg.num_hidden_layers} layers "
               f"{name}", jax.jit(jax.grad(fn)).lower(params, *inputs))


def prefix_mode(cfg, arch, mesh, tokens, unshared):
    merge, params = abstract_model(cfg, arch, mesh, 1)

    def layer_loss(p, embeds, positions, segments, prefix):
        return jnp.sum(merge(p)(embeds, positions, segments, {}, remat=True,
                                prefix=prefix).astype(jnp.float32))
    report(f"two passes merged, {tokens} tokens",
           jax.jit(jax.grad(layer_loss)).lower(params, *row_inputs(cfg, mesh, tokens)))
    report(f"prompt per sample, {unshared} tokens",
           jax.jit(jax.grad(lambda p, e, pos, s, _: layer_loss(p, e, pos, s, None))).lower(
               params, *row_inputs(cfg, mesh, unshared)))

    # splash's dynamic mask: the (T, T) mask of each row's shared-prefix layout, per head
    h, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    rows = NamedSharding(mesh, P(BATCH_AXES))
    b = mesh.devices.size

    def dynamic(q, k, v, segments, prefix):
        def one(q1, k1, v1, s, pre):
            t = s.shape[0]
            causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
            mask = ((s[:, None] == s[None, :]) & causal) | (pre[:, None] == s[None, :])
            kernel = sak.make_splash_mqa(jnp.broadcast_to(mask, (h // kv, t, t)),
                                         block_sizes=_block_sizes(block_for(t)),
                                         head_shards=1, q_seq_shards=1)
            return jax.vmap(kernel, (0, 0, 0))(q1, k1, v1)

        def local(q, k, v, s, pre):
            return jax.vmap(one)(q, k, v, s, pre)
        out = jax.shard_map(local, mesh=mesh, in_specs=P(BATCH_AXES), out_specs=P(BATCH_AXES),
                            check_vma=False)(q, k, v, segments, prefix)
        return jnp.sum(out.astype(jnp.float32))

    def spec(*shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=rows)
    t = tokens
    report(f"dynamic mask (attention alone), {t} tokens", jax.jit(jax.grad(
        dynamic, argnums=(0, 1, 2))).lower(
        spec(b, kv, h // kv, t, d), spec(b, kv, t, d), spec(b, kv, t, d),
        spec(b, t, dtype=jnp.int32), spec(b, t, dtype=jnp.int32)))
    report(f"two passes (attention alone), {t} tokens", jax.jit(jax.grad(
        lambda q, k, v, s, pre: jnp.sum(text_attention(
            Attention("splash", mesh), q, k, v, s, pre, d ** -0.5).astype(jnp.float32)),
        argnums=(0, 1, 2))).lower(
        spec(b, t, h, d), spec(b, t, kv, d), spec(b, t, kv, d),
        spec(b, t, dtype=jnp.int32), spec(b, t, dtype=jnp.int32)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--mode", choices=("layers", "prefix"), required=True)
    parser.add_argument("--topology", default="v5p:2x2x1")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--unshared", type=int, default=23552,
                        help="the same samples with every prompt kept (prefix mode)")
    args = parser.parse_args()
    devices = topologies.get_topology_desc(platform="tpu", topology_name=args.topology).devices
    mesh = jax.sharding.Mesh(np.array(devices).reshape(1, -1, 1), ("data", "fsdp", "tensor"))
    cfg, arch = text_config(args.config)
    if args.mode == "layers":
        layers_mode(cfg, arch, mesh, args.tokens)
    else:
        prefix_mode(cfg, arch, mesh, args.tokens, args.unshared)


if __name__ == "__main__":
    main()
