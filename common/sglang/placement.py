"""Where SGLang servers run and which server each training process generates through.

Pure arithmetic over one node's GPUs, numbered as the trainer numbers them (CUDA device i of
its CUDA_VISIBLE_DEVICES, which the servers inherit unchanged; torchrun's local rank r trains
on device r). Two layouts, as slime places its engines:

  * colocated (`engine.sglang_colocated`): one server per `gpus_per_server` (G, SGLang's tp)
    consecutive learner GPUs, on every node. Local rank r generates through the server on its
    own GPU, server r // G, launched by the first rank of that block (r % G == 0); the server's
    tp rank j runs on device (r // G) * G + j, the GPU of local rank (r // G) * G + j. With
    8 GPUs and G = 1: 8 servers, rank r on server r; G = 2: 4 servers on devices 0-1, 2-3, ...
  * dedicated (not colocated): `n` servers of G GPUs each on devices base_gpu,
    base_gpu + 1, ... (server i from base_gpu + i * G), launched by process 0 of the run and
    shared by every process. base_gpu < 0 means "right after the learner's GPUs" (the
    node's local world size), so servers never start on a learner's GPU unless the GPUs are
    named explicitly (`engine.sglang_base_gpu`), and one that overlaps them is refused.

Server i of a node listens on port_base + i (127.0.0.1: only processes of its node reach it).
An episode group always stays on one server: a colocated process has one, and a process with
several routes a group to one (`common.sglang.engine`).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ServerSpec:
    """One server: its index on the node, its GPUs (the first is SGLang's --base-gpu-id) and
    its port."""

    index: int
    gpus: tuple[int, ...]
    port: int

    @property
    def base_gpu(self) -> int:
        return self.gpus[0]


@dataclasses.dataclass(frozen=True)
class Placement:
    """One process's view: every server of its node, those it launches, those it uses."""

    servers: tuple[ServerSpec, ...]
    launch: tuple[int, ...]  # indices into `servers` this process starts
    use: tuple[int, ...]  # indices into `servers` this process generates through


def colocated(local_rank: int, local_world: int, gpus_per_server: int,
              port_base: int) -> Placement:
    """One server per block of `gpus_per_server` learner GPUs; rank r uses the one on its GPU."""
    g = gpus_per_server
    if g < 1 or local_world % g:
        raise ValueError(f"engine.sglang_gpus_per_server={g} must divide the {local_world} "
                         "learner GPUs of a node when engine.sglang_colocated=True (one server "
                         "per block of GPUs, on the learners' own GPUs)")
    servers = tuple(ServerSpec(i, tuple(range(i * g, (i + 1) * g)), port_base + i)
                    for i in range(local_world // g))
    mine = local_rank // g
    return Placement(servers, (mine,) if local_rank % g == 0 else (), (mine,))


def dedicated(rank: int, local_world: int, n: int, gpus_per_server: int, base_gpu: int,
              port_base: int) -> Placement:
    """`n` servers on their own GPUs from `base_gpu` (< 0: after the learners' GPUs), launched
    by process 0 and used by every process."""
    g = gpus_per_server
    if n < 1 or g < 1:
        raise ValueError(f"engine.sglang_servers={n} and engine.sglang_gpus_per_server={g} "
                         "must be >= 1")
    base = local_world if base_gpu < 0 else base_gpu
    servers = tuple(ServerSpec(i, tuple(range(base + i * g, base + (i + 1) * g)),
                               port_base + i) for i in range(n))
    taken = sorted({d for s in servers for d in s.gpus} & set(range(local_world)))
    if taken:
        raise ValueError(f"engine.sglang_base_gpu={base_gpu} puts SGLang servers on GPUs "
                         f"{taken}, where the {local_world} learner processes of this node "
                         f"train (devices 0-{local_world - 1}): name free GPUs (at least "
                         f"{local_world}; -1 picks the first after the learners') or set "
                         "engine.sglang_colocated=True")
    every = tuple(range(n))
    return Placement(servers, every if rank == 0 else (), every)


def place(e, rank: int, local_rank: int, local_world: int) -> Placement:
    """The placement `cfg.engine` (`e`) asks for, seen from one process."""
    if e.sglang_colocated:
        return colocated(local_rank, local_world, e.sglang_gpus_per_server, e.sglang_port_base)
    return dedicated(rank, local_world, e.sglang_servers, e.sglang_gpus_per_server,
                     e.sglang_base_gpu, e.sglang_port_base)
