"""One JAX process of a 2-process CPU run (gloo), for tests/test_jax_learner.py: the multi-host
data path. Each process packs its own micro-batches; the learner agrees the step's shapes over
processes, assembles global arrays from the per-process rows and steps once on an fsdp=2 mesh
(one device per process, the parameters split over the processes); the HF export all-gathers
the parameters one at a time and each process writes its own shard.
Before the step, each process's JAX engine (`geo3k_jax.engine.backend.JaxBackend`, on its own
device) runs its share of a few multi-turn sessions from the initial weights. MODE `splash`: the
model's attention is the splash kernel (interpret mode) mapped over the learner's 2-process mesh,
and only the engines run (each must map its vision attention over its own devices).

    python -m tests.jax_multihost_worker PROCESS_ID PORT OUT_DIR [MODE]
"""

import json
import sys
from pathlib import Path

import jax


def main(pid: int, port: int, out: str, mode: str = "") -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                               process_id=pid)
    jax.config.update("jax_default_matmul_precision", "highest")
    from common.grpo import LossConfig
    from configs.base import JAX_RULES
    from geo3k_jax.core.distributed import JaxCollectives
    from geo3k_jax.core.sharding import make_mesh
    from tests.jax_learner_setup import model_and_batch, train_config

    comm = JaxCollectives()
    setup = model_and_batch("qwen3_vl")
    mine = setup.batches[pid::2] if pid == 0 else setup.batches[pid::2][:1]  # uneven shares
    mesh = make_mesh({"data": 1, "fsdp": 2, "tensor": 1})
    if mode == "splash":
        import dataclasses

        from geo3k_jax.models.model import with_attention
        from geo3k_jax.kernels.splash import Attention
        setup = dataclasses.replace(setup, merge=with_attention(
            setup.merge, setup.params, lambda a: Attention("splash", mesh, interpret=True)))
    learner = setup.learner(LossConfig(tis_cap=2.0), train_config(), mesh=mesh,
                            rules=JAX_RULES, comm=comm, model_dir=out)
    from geo3k_jax.engine.backend import JaxBackend
    from tests.test_jax_engine import episodes
    backend = JaxBackend(learner, setup.processor, setup.config, seed=11, slots=2, context=512)
    turns = episodes(backend.engine, setup.processor, 3, turns=2, max_new=8, n=5,
                     only=range(pid, 5, 2))
    sessions = {r.session: {"tokens": [], "logprobs": []} for r in turns[0][0]}
    for reqs, outs in turns:
        for r, o in zip(reqs, outs):
            sessions[r.session]["tokens"].append([int(t) for t in o.token_ids])
            sessions[r.session]["logprobs"].append([float(x) for x in o.logprobs])
    devices = len(backend.engine._cache[0].sharding.device_set)
    (Path(out) / f"engine_{pid}.json").write_text(json.dumps(
        {"sessions": sessions, "cache_devices": devices}))
    if mode == "splash":
        comm.barrier()
        return
    metrics = setup.step(learner, mine)
    seen = comm.gather(len(mine))
    learner.export_hf(Path(out) / "export")
    if pid == 0:
        (Path(out) / "metrics.json").write_text(json.dumps({**metrics, "shares": seen}))
    comm.barrier()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], *sys.argv[4:])
