"""Run by tests/test_jax_engine.py with 8 fake CPU devices: the same multi-turn episodes on the
JAX engine on one device and sharded over a (data=2, fsdp=2, tensor=2) mesh (cache slots over
data x fsdp, KV heads over tensor; weights in the engine's layout). Prints one JSON line.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.jax_engine_sharded_worker
"""

import json

import jax
import numpy as np

from configs.base import JAX_RULES
from geo3k_jax.engine.backend import engine_shardings
from geo3k_jax.engine.engine import JaxEngine
from geo3k_jax.core.sharding import make_mesh, param_shardings
from tests.test_jax_engine import episodes
from tests.test_jax_model import jax_copy
from tests.tiny_models import ImageOnlyProcessor, qwen3_vl


def main() -> None:
    jax.config.update("jax_default_matmul_precision", "highest")
    assert len(jax.devices()) == 8, jax.devices()
    hf, patch = qwen3_vl()
    merge, params = jax_copy(hf)
    processor = ImageOnlyProcessor(patch)
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    placed = jax.device_put(params, engine_shardings(param_shardings(params, mesh, JAX_RULES)))
    runs = {}
    for name, p, m in (("single", params, None), ("sharded", placed, mesh)):
        engine = JaxEngine(merge, lambda p=p: p, processor, hf.config, seed=11, slots=4,
                           mesh=m)
        turns = episodes(engine, processor, 3, turns=2, max_new=8, n=5)
        runs[name] = ([[o.token_ids for o in outs] for _, outs in turns],
                      [np.concatenate([o.logprobs for o in outs]) for _, outs in turns],
                      engine)
    (t1, l1, _), (t2, l2, sharded) = runs["single"], runs["sharded"]
    keys = sharded._cache[0]
    print(json.dumps({
        "same_tokens": t1 == t2,
        "tokens": sum(len(x) for turn in t1 for x in turn),
        "logprob_gap": max(float(np.abs(a - b).max()) for a, b in zip(l1, l2)),
        "cache_shape": list(keys.shape),
        "shard_shape": list(keys.addressable_shards[0].data.shape),
        "cache_devices": len(keys.sharding.device_set),
        "q_proj_shard": list(placed["model.language_model.layers.self_attn.q_proj.weight"]
                             .addressable_shards[0].data.shape),
        "evictions": sharded.evictions}))


if __name__ == "__main__":
    main()
