"""One JAX process of a 2-process CPU run (gloo, 2 devices each), for tests/test_jax_weights.py:
`geo3k_jax.models.weights.gather_to` brings arrays of several layouts whole to one process, the
other receiving nothing. Writes what it got and the gather programs' collectives as JSON.

    python -m tests.jax_export_worker PROCESS_ID PORT OUT_DIR
"""

import json
import sys
from pathlib import Path

import jax


def main(pid: int, port: int, out: str) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                               process_id=pid)
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from geo3k_jax.core.sharding import make_mesh
    from geo3k_jax.models.weights import _sender, gather_plan, gather_to

    mesh = make_mesh({"data": 1, "fsdp": -1, "tensor": 2})  # fsdp 2 (a device a process)
    layouts = {"fsdp_tensor": P("fsdp", "tensor"), "tensor": P(None, "tensor"),
               "fsdp": P("fsdp"), "replicated": P()}
    got, programs = {}, {}
    for name, spec in layouts.items():
        full = np.arange(8 * 6, dtype=np.float32).reshape(8, 6) + 100 * len(got)
        v = jax.make_array_from_callback(full.shape, NamedSharding(mesh, spec),
                                         lambda i: full[i])
        for owner in (0, 1):
            value = gather_to(v, owner)
            got[f"{name}_{owner}"] = None if value is None else bool(
                np.array_equal(value, full))
            devices = list(mesh.devices.flat)
            rounds = gather_plan(devices, v.sharding.devices_indices_map(v.shape), owner)
            received = sum(1 for pairs in rounds for _, dst in pairs
                           if devices[dst].process_index == pid)
            hlo = (_sender(mesh, spec, tuple(map(tuple, rounds))).lower(v).compile().as_text()
                   if rounds else "")
            programs[f"{name}_{owner}"] = {
                "rounds": len(rounds), "blocks_received": received,
                "permute": "collective-permute" in hlo, "all_gather": "all-gather" in hlo}
    (Path(out) / f"gather_{pid}.json").write_text(json.dumps({"got": got,
                                                                "programs": programs}))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
