"""TPU slices by name, their chips as compile-only devices (libtpu, no TPU needed), and one
host's chips as a topology of their own: what `geo3k_jax.aot` and `geo3k_jax.tpu.engine_aot`
compile for.

    devices = topology_devices("v6e-16")   # 16 chips, 4 hosts of 2 x 2
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # jax loads when a topology is built, not when `TOPOLOGIES` is read (--help)
    from jax.sharding import Mesh

# Cloud TPU slice names -> libtpu topologies. v5p names count TensorCores (2 a chip), v6e and
# v5e chips. Any libtpu name ("v5p:2x2x1") is accepted as well.
TOPOLOGIES = {
    "v5p-8": "v5p:2x2x1", "v5p-16": "v5p:2x2x2", "v5p-32": "v5p:2x2x4", "v5p-64": "v5p:2x4x4",
    "v5p-128": "v5p:4x4x4",
    "v6e-4": "v6e:2x2", "v6e-8": "v6e:2x4", "v6e-16": "v6e:4x4", "v6e-32": "v6e:4x8",
    "v6e-64": "v6e:8x8", "v6e-256": "v6e:16x16",
    "v5e-4": "v5e:2x2", "v5e-8": "v5e:2x4", "v5e-16": "v5e:4x4", "v5e-32": "v5e:4x8",
    "v5e-64": "v5e:8x8", "v5e-256": "v5e:16x16",
}


def topology_devices(topology: str) -> list:
    """The devices of a TPU slice (`TOPOLOGIES` name or a libtpu topology), compile-only."""
    from jax.experimental import topologies
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # libtpu locks /tmp otherwise
    name = TOPOLOGIES.get(topology, topology)
    if ":" not in name:
        raise SystemExit(f"--topology={topology!r}: use one of {', '.join(TOPOLOGIES)} or a "
                         "libtpu topology such as v5p:2x2x1")
    try:
        return list(topologies.get_topology_desc(platform="tpu", topology_name=name).devices)
    except (ImportError, RuntimeError) as e:
        raise SystemExit(f"no TPU compiler for --topology={topology!r} ({e}); install it with "
                         "`pip install libtpu==0.0.42` (requirements-test.txt)") from None


def one_host(mesh: Mesh, topology: str) -> Mesh:
    """`mesh`, one host's chips of a slice of several hosts (`geo3k_jax.engine.backend.host_mesh`),
    laid chip for chip (by their coordinates within the host) on a topology of that host alone: the
    v6e-16 host (4 x 4 chips) of devices 0, 1, 4 and 5 becomes v6e:2x2's 0-3, the same shape of
    the same chips. On a slice each host's engine runs on its own chips; libtpu's compile-only
    client refuses a program whose collectives run over devices that are not its topology's
    first ("Unexpected device_id 5 in replica group (0,1,2,3)")."""
    from jax.sharding import Mesh
    family, dims = TOPOLOGIES.get(topology, topology).split(":")
    key = lambda d, low: (*(np.asarray(d.coords) - low), d.core_on_chip)  # noqa: E731
    coords = np.array([d.coords for d in mesh.devices.flat])
    low = coords.min(0)
    shape = (coords.max(0) - low + 1)[:len(dims.split("x"))]
    chips = {key(d, 0): d for d in topology_devices(f"{family}:{'x'.join(map(str, shape))}")}
    devices = [chips[key(d, low)] for d in mesh.devices.flat]
    return Mesh(np.array(devices, dtype=object).reshape(mesh.devices.shape), mesh.axis_names)
