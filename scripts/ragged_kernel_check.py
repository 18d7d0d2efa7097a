"""JAX's Pallas ragged paged attention kernel: does it compile for TPU at this project's shapes,
and why do Pallas' interpreters not run it on a CPU? (docs/tpu_engine.md quotes the output.)

    JAX_PLATFORMS=cpu python scripts/ragged_kernel_check.py   # a minute or two on a CPU

1. The unmodified kernel (`jax.experimental.pallas.ops.tpu.ragged_paged_attention`) compiled
   by libtpu for one chip of v5p:2x2x1 and of v6e:2x2 at Qwen3-VL-2B's attention (16 query
   heads, 8 KV heads, head dim 128, bf16) over a chip's share of the recipe's cache (32 slots
   of 8,192 tokens in pages of 32): a decode (a token a slot) and a prefill (8 x 2,048 tokens).
   Its block sizes are given: its tuned table looks them up from `jax.devices()[0]`, the CPU.
2. A small mixed call (an 8-token chunk, a decode, a 5-token chunk; fp32) in the TPU
   interpreter and the HLO interpreter: unmodified; with the kernel's one reshape of a buffer
   ref made a reshape of its loaded value; and with the TPU interpreter's bounds check of a
   masked store also fixed. Each against the kernel module's own reference.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import textwrap
import time
import traceback
import types

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, PAGE = 16, 8, 128, 32  # Qwen3-VL-2B; geo3k_jax.kernels.ragged.PAGE
SLOTS, CONTEXT = 32, 8192  # a v5p-8 chip's share of configs/tpu.py's 128 slots
KV_BLOCK, Q_BLOCK = 16, 32  # pages and queries a block (the tuned table needs a TPU)
REF_RESHAPE = "      kv_ref = cur_async_copy_kv.wait().reshape("
BOUNDS_BUG = "in_bounds_mask[in_bounds_shape[i] :] = False"


def compile_for(topology: str, name: str, tokens: int, seqs: int) -> str:
    """The kernel compiled for one chip of `topology`: seconds and temporaries."""
    device = topologies.get_topology_desc(platform="tpu", topology_name=topology).devices[0]
    mesh = Mesh(np.array([device]), ("x",))
    at = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype,  # noqa: E731
                                                   sharding=NamedSharding(mesh, P()))
    per_seq = CONTEXT // PAGE
    args = (at((tokens, HEADS, HEAD_DIM), jnp.bfloat16),
            at((SLOTS * per_seq, PAGE, 2 * KV_HEADS, HEAD_DIM), jnp.bfloat16),
            at((seqs,), jnp.int32), at((seqs, per_seq), jnp.int32), at((seqs + 1,), jnp.int32),
            at((1,), jnp.int32))
    f = jax.jit(functools.partial(kernel.ragged_paged_attention, sm_scale=HEAD_DIM ** -0.5,
                                  num_kv_pages_per_block=KV_BLOCK, num_queries_per_block=Q_BLOCK))
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):  # Mosaic reads the chip's generation from the mesh's device
        compiled = f.lower(*args).compile()
    return (f"{topology} ({device.device_kind}) {name}, {tokens} query tokens over {seqs} "
            f"sequences: compiled in {time.perf_counter() - t0:.1f} s, temporaries "
            f"{compiled.memory_analysis().temp_size_in_bytes} bytes")


def small_call() -> tuple:
    rng = np.random.default_rng(0)
    seqs, per_seq, page = 3, 4, 16
    kv_lens = np.array([40, 17, 33], np.int32)
    q_lens = np.array([8, 1, 5], np.int32)
    return (jnp.asarray(rng.normal(size=(16, 4, 128)), jnp.float32),  # 4 query, 2 KV heads
            jnp.asarray(rng.normal(size=(seqs * per_seq, page, 4, 128)), jnp.float32),
            jnp.asarray(kv_lens), jnp.arange(seqs * per_seq, dtype=jnp.int32).reshape(seqs, -1),
            jnp.asarray(np.r_[0, np.cumsum(q_lens)], jnp.int32), jnp.asarray([seqs], jnp.int32))


def patched_kernel() -> types.ModuleType:
    """The kernel module with its buffer ref loaded, then reshaped as a value."""
    source = inspect.getsource(kernel)
    assert source.count(REF_RESHAPE) == 1
    module = types.ModuleType("ragged_value_reshape")
    exec(compile(source.replace(REF_RESHAPE, REF_RESHAPE.replace(".wait()", ".wait()[...]")),
                 kernel.__file__, "exec"), vars(module))
    return module


def fix_bounds_check() -> None:
    """The TPU interpreter's masked swap clears the in-bounds mask along each dimension i, not
    along the first axis for every i."""
    from jax._src.pallas.mosaic.interpret import shared_memory

    cls = next(c for c in vars(shared_memory).values()
               if inspect.isclass(c) and "swap_buffer_content" in vars(c))
    source = textwrap.dedent(inspect.getsource(cls.swap_buffer_content))
    assert source.count(BOUNDS_BUG) == 1
    fixed = "in_bounds_mask[(slice(None),) * i + (slice(in_bounds_shape[i], None),)] = False"
    scope = {}
    exec(compile(source.replace(BOUNDS_BUG, fixed), shared_memory.__file__, "exec"),
         vars(shared_memory), scope)
    cls.swap_buffer_content = scope["swap_buffer_content"]


def interpreted(module, which: str) -> str:
    """The small call through `module`'s kernel in the "tpu" or "hlo" interpreter."""
    args = small_call()
    run = functools.partial(module.ragged_paged_attention, *args, sm_scale=0.1,
                            num_kv_pages_per_block=2, num_queries_per_block=8)
    try:
        if which == "tpu":
            with pltpu.force_tpu_interpret_mode():
                out = run()
        else:
            plain = module.pl.pallas_call
            module.pl.pallas_call = functools.partial(plain, interpret=True)
            try:
                out = run()
            finally:
                module.pl.pallas_call = plain
        n = int(args[4][-1])
        ref = kernel.ref_ragged_paged_attention(*args, sm_scale=0.1)
        gap = float(jnp.abs(out[:n] - ref[:n]).max())  # the reference has the n real rows
        return f"ran: max abs difference from the reference {gap:.1e}"
    except Exception as e:  # noqa: BLE001  (the failure is the finding)
        lines = [line for line in str(e).splitlines() if "Error" in line] or [str(e)]
        frame = traceback.extract_tb(e.__traceback__)[-1]
        return (f"fails: {type(e).__name__}: {lines[-1].strip()[:240]} (at "
                f"{frame.filename.split('site-packages/')[-1]}:{frame.lineno})")


def main() -> None:
    print(f"jax {jax.__version__}")
    for topology in ("v5p:2x2x1", "v6e:2x2"):
        for name, tokens, seqs in (("decode", SLOTS, SLOTS), ("prefill", 8 * 2048, 8)):
            print(compile_for(topology, name, tokens, seqs), flush=True)
    value = patched_kernel()
    for label, module in (("unmodified", kernel), ("ref reshape -> value reshape", value)):
        for which in ("tpu", "hlo"):
            print(f"{which} interpreter, {label}: {interpreted(module, which)}", flush=True)
    fix_bounds_check()
    print(f"tpu interpreter, value reshape and the bounds check fixed: "
          f"{interpreted(value, 'tpu')}")


if __name__ == "__main__":
    sys.exit(main())
