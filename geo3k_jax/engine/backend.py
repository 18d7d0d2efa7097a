"""The in-process JAX rollout engine as a `common.engine.Backend` for the JAX learner.

The engine samples from its own copy of the learner's parameters, made in device memory at
every `sync` (no export, no host copy): cast to the learner's compute dtype (bf16 on
accelerators) and laid out for decoding, each weight split over the mesh's tensor axis as the
learner splits it and replicated over the data axes (`engine_shardings`: a decode step reads
every weight, so none is gathered per step as the learner's FSDP layout would need). The
engine's KV cache is its own too (`geo3k_jax.engine.kv_budget`). Every sync drops the parked caches
and gives the engine the step as its weights' version (a part of every request's key).

With `free` (`jax.free_engine`, rollouts and training taking turns: `geo3k_jax.learner.phases`) the
engine's cache and weights are deleted for the learner's step (`train_context`) and before each
weight copy (one bf16 copy alive at a time); the copy makes new weights and the first request a
new cache of the same shapes. With `offload` (`jax.offload`) the learner's moments (or its whole
state) wait in host memory from each weight copy to the next step (`Learner.offload`).
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from geo3k_jax.engine.engine import JaxEngine
from geo3k_jax.models.model import with_attention
from geo3k_jax.core.sharding import AXES


def engine_shardings(param_sh: dict | None) -> dict | None:
    """The learner's {key: NamedSharding} with only the tensor axis kept (None: one device)."""
    if param_sh is None:
        return None
    keep = lambda a: a if a == "tensor" or a == ("tensor",) else None  # noqa: E731
    return {k: NamedSharding(s.mesh, P(*(keep(a) for a in s.spec)))
            for k, s in param_sh.items()}


def host_mesh(mesh: Mesh) -> Mesh:
    """This process's devices of `mesh` as a mesh of its own, axes `AXES`: each of its tensor
    groups (devices differing only in their tensor coordinate) a row, in tensor order, the rows
    over the data axes. Raises if a tensor group spans processes."""
    me = jax.process_index()
    order = [mesh.axis_names.index(a) for a in AXES if a in mesh.axis_names]
    t = mesh.shape.get("tensor", 1)
    groups = np.transpose(mesh.devices, order).reshape(-1, t)
    mine = [g for g in groups if any(d.process_index == me for d in g)]
    if any(d.process_index != me for g in mine for d in g):
        raise ValueError(f"the mesh's tensor axis ({t} devices) spans processes: each process's "
                         "JAX engine samples on its own devices and needs whole tensor groups; "
                         "keep jax.mesh.tensor within a host")
    return Mesh(np.array(mine)[None, :, None], AXES)  # data 1, fsdp the groups, expert 1


def on_host(tree: dict, mesh: Mesh) -> dict:
    """Arrays placed by `engine_shardings` on a mesh of several processes (replicated over the
    data axes) as arrays of this process's `host_mesh`: the same device buffers, no copy."""
    def local(a):
        sharding = NamedSharding(mesh, a.sharding.spec)
        return jax.make_array_from_single_device_arrays(
            a.shape, sharding, [s.data for s in a.addressable_shards])
    return jax.tree.map(local, tree)


def engine_mesh(merge, params: dict, mesh: Mesh | None, several: bool,
                host: Mesh | None = None):
    """(merge, mesh) of the JAX engine beside a learner of `merge`, `params` on `mesh`: with
    `several` processes this process's own devices (`host_mesh`, or `host` in its place: the AOT
    tool's stand-in, `geo3k_jax.tpu.topology.one_host`), the splash kernel's shard_map over them
    rather than over the learner's mesh of every process; else the learner's."""
    if not several:
        return merge, mesh
    if mesh is None:
        raise ValueError("a JAX engine on several processes needs the learner's mesh")
    host = host_mesh(mesh) if host is None else host
    return with_attention(merge, params, lambda a: dataclasses.replace(
        a, mesh=host) if a.mesh is not None else a), host


class JaxBackend:
    """The engine of the JAX learner's process. With several processes (a multi-host slice)
    each runs an engine of its own on its own devices (`host_mesh`) for its own share of the
    requests: no program of the engine spans hosts, so each host schedules its requests
    independently; only the weight copy at `sync` (every process at once) gathers the
    learner's parameters over the data axes."""

    def __init__(self, learner, processor, config, *, seed: int, slots: int = 8,
                 context: int = 1024, memory_fraction: float = 0.9, prefill_rows: int = 0,
                 prefill_tokens: int = 0, warm_up: bool = False, free: bool = False,
                 offload: str = "none"):
        """learner: a `geo3k_jax.learner.learner.Learner`; config: the transformers config of its
        model; slots, context, memory_fraction, prefill_rows, prefill_tokens: `JaxEngine`'s
        (per process); warm_up: compile the engine's whole compile set now
        (`JaxEngine.warm_up`), else each program at its first use; free: release the engine's
        cache and weights during the learner's step; offload: "none", "moments" or "all" of
        the learner's state in host memory during rollouts (the last two: only where
        rollouts and training take turns, `geo3k_jax.learner.phases.check_phases`)."""
        self.free, self.offload, self._learner = free, offload, learner
        dtype = learner.compute_dtype
        several = learner.comm.world > 1
        merge, mesh = engine_mesh(learner.merge, learner.params, learner.mesh, several)
        self._host = mesh if several else None  # this process's own mesh, if several
        shardings = engine_shardings(getattr(learner, "param_sh", None))
        self._copy = jax.jit(lambda p: jax.tree.map(
            lambda a: a if dtype is None else a.astype(dtype), p), out_shardings=shardings)
        self.params = self._placed(learner)
        self.engine = JaxEngine(merge, self._weights, processor, config,
                                seed=seed, compute_dtype=dtype, slots=slots, context=context,
                                mesh=mesh, memory_fraction=memory_fraction,
                                prefill_rows=prefill_rows, prefill_tokens=prefill_tokens,
                                record_routing=learner.routing is not None)
        programs = len(self.engine.compile_set())
        if warm_up:
            n, seconds = self.engine.warm_up()
            print(f"JAX engine: compiled its {n} programs in {seconds:.1f} s (prefill "
                  f"shapes {self.engine.prefill_ladder()})", flush=True)
        else:
            print(f"JAX engine: {programs} programs at most, each compiled at its first use "
                  "(engine.warm_up compiles them at start)", flush=True)

    def _placed(self, learner) -> dict:
        copy = self._copy(learner.params)
        return copy if self._host is None else on_host(copy, self._host)

    def _weights(self) -> dict:
        if self.params is None:
            raise RuntimeError("the JAX engine's weights were freed for the learner's step "
                               "(jax.free_engine); the weight copy (sync) makes new ones")
        return self.params

    def _release(self) -> None:
        """Delete the engine's cache and weights now (`free`)."""
        self.engine.free()
        if self.params is not None:
            for a in jax.tree.leaves(self.params):
                a.delete()
            self.params = None

    def sync(self, learner, step: int) -> None:
        # a copy in device memory: the learner's next step donates its own buffers, and
        # rollouts may run while it trains (train.max_staleness >= 1)
        if self.free:  # the old weights go before the new ones come (already, after a step)
            self._release()
        self.params = self._placed(learner)
        self.engine.clear_cache(step)  # the KV caches were computed with the old weights
        if self.offload != "none":  # made from the parameters: now they may wait on the host
            learner.offload(self.offload)

    @contextlib.contextmanager
    def train_context(self):
        if self.free:
            self._release()
        if self.offload != "none":
            self._learner.onload()  # into the room the engine left
        yield

    def rng_state(self) -> list[int]:
        return self.engine.rng_state()

    def set_rng_state(self, state: list[int]) -> None:
        self.engine.set_rng_state(state)

    def metrics(self) -> dict[str, float]:
        """Counters for the run log: the engine's compilations and evicted sessions so far."""
        return {"engine_compiles": float(self.engine.compiles),
                "engine_evictions": float(self.engine.evictions)}

    def close(self) -> None:
        self.engine.close()
