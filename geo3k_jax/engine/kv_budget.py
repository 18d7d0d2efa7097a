"""The JAX engine's KV cache: its shape, its layout over the mesh, and whether it fits.

    shape = CacheShape.of(config)                                # layers, KV heads, head_dim
    check_kv_budget(shape, slots, capacity, dtype, mesh, weight_bytes)  # raises if it won't fit
    cache = allocate(shape, slots, capacity, dtype, mesh)        # (keys, values)

The keys and the values are each one array (Hkv, layers, slots, L, D) (`geo3k_jax.engine.decode`): a
KV head's layers, slots and positions are consecutive, so (Hkv, layers x slots x L / PAGE, PAGE,
D) is the same memory cut into pages, the layout the Pallas paged attention kernel reads
(`geo3k_jax.kernels.ragged`), and the decode scans the layers over one array. They are split by slot
over the mesh's data-parallel axes (`geo3k_jax.core.sharding.BATCH_AXES`: each device decodes its
own slots) and by KV head over the tensor axis when it divides them (the attention of a KV head
group stays on one device; otherwise they are replicated over it).
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from geo3k_jax.core.sharding import BATCH_AXES
from geo3k_jax.models.text import head_dim_of


@dataclasses.dataclass(frozen=True)
class CacheShape:
    layers: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, config) -> "CacheShape":
        """From a transformers Qwen-VL config."""
        text = config.text_config
        return cls(int(text.num_hidden_layers), int(text.num_key_value_heads),
                   head_dim_of(text, config.model_type))

    def bytes(self, slots: int, capacity: int, dtype) -> int:
        """The whole cache's bytes: keys and values of every layer, slot and position."""
        return (2 * self.layers * slots * self.kv_heads * self.head_dim * capacity
                * np.dtype(dtype).itemsize)


def _size(mesh, axes) -> int:
    return math.prod(mesh.shape[a] for a in axes if a in mesh.shape)


def cache_specs(mesh, shape: CacheShape, slots: int) -> P:
    """The PartitionSpec of the keys and of the values (the same, (Hkv, layers, S, L, D): KV
    heads over tensor, slots over the data axes)."""
    data = _size(mesh, BATCH_AXES)
    if slots % data:
        raise ValueError(f"engine.slots={slots} must be a multiple of the mesh's data-parallel "
                         f"size {data} ({', '.join(BATCH_AXES)}): each device holds its slots")
    heads = "tensor" if shape.kv_heads % _size(mesh, ("tensor",)) == 0 else None
    return P(heads, None, tuple(a for a in BATCH_AXES if a in mesh.shape))


def cache_shardings(mesh, shape: CacheShape, slots: int) -> tuple | None:
    """The cache's shardings, as `allocate` builds it (None without a mesh: one device)."""
    if mesh is None:
        return None
    s = NamedSharding(mesh, cache_specs(mesh, shape, slots))
    return s, s


def allocator(shape: CacheShape, slots: int, capacity: int, dtype, mesh=None):
    """A compiled function of no arguments returning a zero cache (`allocate`): keep it to
    allocate the cache again (after `geo3k_jax.engine.engine.JaxEngine.free`) without a new
    compile."""
    dims = (shape.kv_heads, shape.layers, slots, capacity, shape.head_dim)

    def zeros():
        return jnp.zeros(dims, dtype), jnp.zeros(dims, dtype)
    return jax.jit(zeros, out_shardings=cache_shardings(mesh, shape, slots))


def allocate(shape: CacheShape, slots: int, capacity: int, dtype, mesh=None) -> tuple:
    """A zero cache: (keys, values), each (Hkv, layers, S, L, D), each device allocating only
    its own share."""
    return allocator(shape, slots, capacity, dtype, mesh)()


def device_memory(device) -> int:
    """Bytes a device may hold: its allocator's limit (GPU, TPU), or the host's physical memory
    shared by its local devices (CPU, which reports none)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total // max(1, jax.local_device_count())


def per_device_bytes(shape: CacheShape, slots: int, capacity: int, dtype, mesh=None) -> int:
    """One device's share of the cache under `cache_specs`."""
    total = shape.bytes(slots, capacity, dtype)
    if mesh is None:
        return total
    spec = cache_specs(mesh, shape, slots)
    split = _size(mesh, BATCH_AXES) * (_size(mesh, ("tensor",)) if spec[0] else 1)
    return total // split


def check_kv_budget(shape: CacheShape, slots: int, capacity: int, dtype, mesh=None,
                    weight_bytes: int = 0, memory: int | None = None,
                    fraction: float = 0.9) -> int:
    """Raise before allocating when one device's share of the cache plus `weight_bytes` (the
    engine's weights on a device) exceeds `fraction` of its `memory` (default: the first
    device's, `device_memory`). Returns the cache's bytes per device."""
    cache = per_device_bytes(shape, slots, capacity, dtype, mesh)
    device = (mesh.devices.flat[0] if mesh is not None else jax.local_devices()[0])
    memory = device_memory(device) if memory is None else memory
    allowed = int(fraction * memory)
    if cache + weight_bytes > allowed:
        per_slot = cache // max(1, slots)
        fit = max(0, (allowed - weight_bytes) // max(1, per_slot))
        raise ValueError(
            f"the JAX engine's KV cache does not fit: {slots} slots x {capacity} tokens x "
            f"{shape.layers} layers x {shape.kv_heads} KV heads x {shape.head_dim} x 2 (keys, "
            f"values) x {np.dtype(dtype).itemsize} bytes = {cache / 2**30:.2f} GiB per device, "
            f"plus {weight_bytes / 2**30:.2f} GiB of weights, over {fraction:g} of the device's "
            f"{memory / 2**30:.2f} GiB; lower engine.slots (at most {fit} fit) or "
            f"rollout.max_context_tokens, or shard over more devices")
    return cache
