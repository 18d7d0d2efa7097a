"""One JAX process of a 2-process CPU run (gloo), for tests/test_jax_learner.py: the multi-host
data path. Each process packs its own micro-batches; the learner agrees the step's shapes over
processes, assembles global arrays from the per-process rows and steps once on a data=2 mesh
(one device per process); the HF export all-gathers the parameters and process 0 writes it.

    python -m tests.jax_multihost_worker PROCESS_ID PORT OUT_DIR
"""

import json
import sys
from pathlib import Path

import jax


def main(pid: int, port: int, out: str) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                               process_id=pid)
    jax.config.update("jax_default_matmul_precision", "highest")
    from common.grpo import LossConfig
    from configs.base import JAX_RULES
    from geo3k_jax.distributed import JaxCollectives
    from geo3k_jax.sharding import make_mesh
    from tests.jax_learner_setup import model_and_batch, train_config

    comm = JaxCollectives()
    setup = model_and_batch("qwen3_vl")
    mine = setup.batches[pid::2] if pid == 0 else setup.batches[pid::2][:1]  # uneven shares
    learner = setup.learner(LossConfig(tis_cap=2.0), train_config(),
                            mesh=make_mesh({"data": 2, "fsdp": 1, "tensor": 1}),
                            rules=JAX_RULES, comm=comm, model_dir=out)
    metrics = setup.step(learner, mine)
    seen = comm.gather(len(mine))
    learner.export_hf(Path(out) / "export")
    if pid == 0:
        (Path(out) / "metrics.json").write_text(json.dumps({**metrics, "shares": seen}))
    comm.barrier()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
