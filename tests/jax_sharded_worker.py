"""Run by tests/test_jax_learner.py with 8 fake CPU devices: the same two GRPO steps on one
device and on a (data=2, fsdp=2, tensor=2) mesh (a MoE model: fsdp=2, expert=2, tensor=2), the
sharded model's attention over that mesh as geo3k_jax.train builds it (`resolve_attention`).
Prints one JSON line of differences.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.jax_sharded_worker ARCH
"""

import dataclasses
import json
import re
import sys

import jax
import numpy as np

from common.grpo import LossConfig
from configs.base import JAX_RULES
from geo3k_jax.kernels.splash import resolve_attention
from geo3k_jax.models.model import token_logprobs, with_attention
from geo3k_jax.core.sharding import batch_shardings, make_mesh
from tests.jax_learner_setup import model_and_batch, train_config
from tests.tiny_models import VOCAB


def main(arch: str) -> None:
    jax.config.update("jax_default_matmul_precision", "highest")
    assert len(jax.devices()) == 8, jax.devices()
    mesh = make_mesh({"data": 1 if arch == "qwen3_vl_moe" else 2, "fsdp": 2,
                      "expert": 2 if arch == "qwen3_vl_moe" else 1, "tensor": 2})
    setup = model_and_batch(arch, rows_multiple=4)
    batch = setup.batch
    on_mesh = dataclasses.replace(setup, merge=with_attention(
        setup.merge, setup.params,
        lambda a: resolve_attention(a.kind, jax.devices()[0].platform, mesh)))
    loss_cfg, train_cfg = LossConfig(tis_cap=2.0), train_config()
    runs = {}
    for name, s, kw in (("single", setup, {}),
                        ("sharded", on_mesh, dict(mesh=mesh, rules=JAX_RULES))):
        learner = s.learner(loss_cfg, train_cfg, **kw)
        logp = jax.jit(lambda p, b: token_logprobs(learner.merge(p), b))(learner.params, batch)
        metrics = [s.step(learner) for _ in range(2)]
        runs[name] = (np.asarray(logp), metrics, {k: np.asarray(v) for k, v in
                                                   learner.params.items()}, learner)
    (lp1, m1, p1, _), (lp2, m2, p2, sharded) = runs["single"], runs["sharded"]
    q = sharded.params["model.language_model.layers.self_attn.q_proj.weight"]  # (L, out, in)
    experts = {k: v for k, v in sharded.params.items() if ".experts." in k}  # (L, E, out, in)
    # what each device computes: the compiled, partitioned log-prob function's shapes
    fn = jax.jit(lambda p, b: token_logprobs(sharded.merge(p), b),
                 in_shardings=(sharded.param_sh, batch_shardings(mesh, batch)))
    hlo = fn.lower(sharded.params, batch).compile().as_text()
    rows, k = batch["targets"].shape
    patches = batch["pixel_values"].shape[1]
    found = lambda pattern: sorted(set(re.findall(pattern, hlo)))  # noqa: E731
    mask = batch["loss_mask"] > 0
    print(json.dumps({
        "rows": int(batch["input_ids"].shape[0]),
        "logp_abs": float(np.abs(lp1 - lp2)[mask].max()),
        "loss_rel": max(abs(a["loss"] - b["loss"]) / abs(a["loss"]) for a, b in zip(m1, m2)),
        "grad_norm_rel": max(abs(a["grad_norm"] - b["grad_norm"]) / a["grad_norm"]
                             for a, b in zip(m1, m2)),
        "lr": [m["lr"] for m in m2],
        "params_abs": max(float(np.abs(p1[k] - p2[k]).max()) for k in p1),
        "q_proj_spec": [str(a) for a in q.sharding.spec],
        "q_proj_shard_shape": list(q.addressable_shards[0].data.shape),
        "q_proj_shape": list(q.shape),
        "experts": {k: [[str(a) for a in v.sharding.spec], list(v.shape),
                        list(v.addressable_shards[0].data.shape)] for k, v in experts.items()},
        # per device: (rows, K, vocab shard) logits and every (rows, P, features) activation
        # of the patches (the tower's blocks: hidden, qkv, MLP, whole or in shards)
        "logit_rows": found(rf"f32\[(\d+),{k},{VOCAB // 2}\]"),
        "patch_rows": found(rf"f32\[(\d+),{patches},\d+\]")}))


if __name__ == "__main__":
    main(sys.argv[1])
