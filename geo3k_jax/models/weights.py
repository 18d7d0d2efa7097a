"""Hugging Face checkpoint directories <-> sharded JAX parameters of
`geo3k_jax.models.model.QwenVL`.

    model, config = load_model("path/to/Qwen3-VL-2B-Instruct", mesh=mesh, rules=rules)
    save_hf(model, config, "out/", source_dir="path/to/Qwen3-VL-2B-Instruct")

Loading builds the model abstractly (`nnx.eval_shape`, no memory), then reads every tensor from
the safetensors files on the host (numpy, bf16 through ml_dtypes; torch is not needed) and places
it straight into its target sharding, one parameter at a time, so the host never holds a second
copy of the model (a stacked decoder parameter, `geo3k_jax.core.stacking`, is read layer by layer
and placed whole: the host holds one tensor kind of every layer at a time). Keys are checked both ways: a missing, unexpected or mis-shaped key is an
error naming it. Older Qwen2.5-VL files (`visual.*`, `model.layers.*`) are renamed to the
layout transformers 5 writes (`model.visual.*`, `model.language_model.*`), as transformers does
when it loads them.

Qwen3-VL-MoE's experts (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`) come in two
layouts: transformers 5's, which its `save_pretrained` writes, (E, 2I, hidden) and (E, hidden, I);
and the published checkpoints' (and older transformers'), the same transposed: (E, hidden, 2I)
and (E, I, hidden), which SGLang's loader reads and this export writes. Each layer's pair of tensors is read in the layout
its two shapes name (`expert_transposed`). The pair always tells them apart: gate_up_proj's
shape does unless hidden = 2I, down_proj's unless hidden = I, and both cannot hold; a pair that
matches neither layout, or one each, is an error naming it.

Export writes the transformers-5 names, the experts in the published layout (`published`: in
transformers 5's where the two share a shape, hidden = 2I or I, which `from_pretrained` tells
apart by shape alone), layers unstacked, float32 or bfloat16, with the config (and the tokenizer /
processor files of `source_dir`), so `AutoModelForImageTextToText.from_pretrained(out)` loads it
as the torch learner's export (`geo3k_torch.checkpoint.save_published`); on several hosts each
writes a shard of its own (transformers' sharded layout, with its index).
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P
from jax.experimental import multihost_utils
from safetensors import safe_open
from safetensors.numpy import save_file

from common import storage
from geo3k_jax.models.model import QwenVL, split_params
from geo3k_jax.core.sharding import param_shardings
from geo3k_jax.kernels.splash import Attention
from geo3k_jax.core.stacking import hf_shapes, is_stacked, layer_key, stacked_key, to_hf

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Tokenizer, chat template and processor files a served model needs next to its weights.
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "chat_template.jinja", "chat_template.json", "processor_config.json",
              "preprocessor_config.json", "video_preprocessor_config.json",
              "generation_config.json", "vocab.json", "merges.txt")


class CheckpointError(ValueError):
    """A checkpoint directory that does not match the model its config describes."""


def canonical_key(key: str) -> str:
    """The transformers-5 name of a checkpoint key (legacy Qwen2.5-VL layout renamed)."""
    if key.startswith("visual."):
        return "model." + key
    if re.match(r"^model\.(?!language_model\.|visual\.)", key):
        return "model.language_model." + key[len("model."):]
    return key


def checkpoint_files(path: str | Path) -> dict[str, Path]:
    """{canonical key: safetensors file} of a checkpoint directory (sharded or single file)."""
    root = Path(path)
    if (root / INDEX_FILE).is_file():
        index = json.loads((root / INDEX_FILE).read_text())["weight_map"]
        files = {k: root / f for k, f in index.items()}
    elif (root / SINGLE_FILE).is_file():
        with safe_open(root / SINGLE_FILE, "np") as f:
            files = {k: root / SINGLE_FILE for k in f.keys()}
    else:
        raise CheckpointError(f"{root}: no {SINGLE_FILE} or {INDEX_FILE}")
    out = {}
    for key, file in files.items():
        name = canonical_key(key)
        if name in out:
            raise CheckpointError(f"{root}: {key!r} and another key both map to {name!r}")
        out[name] = (file, key)
    return out


def read_tensor(file: Path, key: str) -> np.ndarray:
    """One tensor as numpy on the host. safetensors' numpy reader has no bfloat16, so tensors
    are read through its flax reader onto the CPU device and viewed as numpy (ml_dtypes)."""
    with jax.default_device(jax.local_devices(backend="cpu")[0]):  # this process's own
        with safe_open(file, "flax") as f:
            return np.asarray(f.get_tensor(key))


EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")  # (E, out, in) in transformers 5


def tensor_shape(file: Path, key: str) -> tuple[int, ...]:
    """A stored tensor's shape, from the safetensors header (nothing read)."""
    with safe_open(file, "np") as f:
        return tuple(f.get_slice(key).get_shape())


def expert_transposed(stored: dict[str, tuple], want: dict[str, tuple]) -> dict[str, bool]:
    """{checkpoint key: stored transposed} for the expert tensors of {key: stored shape}, by
    layer: a layer's gate_up_proj and down_proj are both in transformers 5's layout (`want`'s
    shapes: False) or both with their last two axes swapped (True); anything else is a
    CheckpointError."""
    out = {}
    for key in stored:
        if not key.endswith(EXPERTS[0]):
            continue
        pair = (key, key[:-len(EXPERTS[0])] + EXPERTS[1])
        shapes = tuple(stored[k] for k in pair)
        native = tuple(want[k] for k in pair)
        swapped = tuple(s[:-2] + s[:-3:-1] for s in native)
        if shapes not in (native, swapped):
            raise CheckpointError(f"{pair} have shapes {shapes}: neither transformers' {native} "
                                  f"nor the published checkpoints' {swapped}")
        out.update(dict.fromkeys(pair, shapes == swapped))
    return out


def load_model(path: str | Path, *, dtype=jnp.float32, mesh=None, rules=(),
               attention: Attention = Attention()) -> tuple[QwenVL, object]:
    """(model, transformers config) with parameters in `dtype`, sharded on `mesh` by `rules`
    (see `geo3k_jax.core.sharding`; no mesh = the default device); `attention`: windowed or splash
    (`geo3k_jax.kernels.splash.resolve_attention`)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(path))
    abstract = nnx.eval_shape(lambda: QwenVL(config, dtype=dtype, rngs=nnx.Rngs(0),
                                             attention=attention))
    merge, shapes = split_params(abstract)
    want = hf_shapes({k: v.shape for k, v in shapes.items()})
    files = checkpoint_files(path)
    if abstract.tied:
        files.pop("lm_head.weight", None)  # some tied checkpoints store the copy too
    missing = sorted(set(want) - set(files))
    unexpected = sorted(set(files) - set(want))
    if missing or unexpected:
        raise CheckpointError(f"{path}: missing keys {_few(missing)}; unexpected keys "
                              f"{_few(unexpected)}")

    transposed = expert_transposed(
        {k: tensor_shape(*files[k]) for k in want if k.endswith(EXPERTS)}, want)

    def read(name):
        file, key = files[name]
        array = read_tensor(file, key)
        if transposed.get(name):
            array = np.swapaxes(array, -1, -2)
        if array.shape != want[name]:
            raise CheckpointError(f"{path}: {key!r} has shape {array.shape}, the config "
                                  f"needs {want[name]}")
        return array.astype(dtype)

    shardings = param_shardings(shapes, mesh, rules) if mesh is not None else {}
    params = {}
    for name, abstract_value in shapes.items():
        array = (np.stack([read(layer_key(name, i)) for i in range(abstract_value.shape[0])])
                 if is_stacked(name) else read(name))
        params[name] = jax.device_put(array, shardings.get(name, jax.local_devices()[0]))
    return merge(params), config


def _few(keys: list[str]) -> str:
    return str(keys[:10]) + (f" and {len(keys) - 10} more" if len(keys) > 10 else "")


def owners(sizes: dict[str, int], world: int) -> dict[str, int]:
    """{key: the process that writes it} for tensors of `sizes` bytes: largest first, each to
    the process with the fewest bytes so far (ties: the lower index; keys in order), so every
    process computes the same assignment and no share exceeds another by more than the
    largest tensor."""
    load = [0] * world
    out = {}
    for key in sorted(sizes, key=lambda k: (-sizes[k], k)):
        p = min(range(world), key=lambda i: (load[i], i))
        out[key] = p
        load[p] += sizes[key]
    return out


def shard_name(index: int, count: int) -> str:
    """The safetensors file of writer `index` of `count` (transformers' sharded naming)."""
    return SINGLE_FILE if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def _block(index: tuple) -> tuple:
    """A device's block of an array (`Sharding.devices_indices_map`'s slices) as a key."""
    return tuple((i.start, i.stop, i.step) for i in index)


def gather_plan(devices: list, index: dict, owner: int) -> list[list[tuple[int, int]]]:
    """The rounds of point-to-point sends that bring process `owner` every block of an array
    it does not hold: [[(source, receiver) positions in `devices`, ...], ...]. devices: the
    array's mesh's devices in the mesh's order; index: {device: its block's slices}. Each
    block missing from the owner's devices leaves one device that holds it (a replicated block
    travels once), the owner's devices take turns receiving (one block each a round)."""
    mine = [i for i, d in enumerate(devices) if d.process_index == owner]
    have = {_block(index[devices[i]]) for i in mine}
    sources = {}
    for i, d in enumerate(devices):
        block = _block(index[d])
        if block not in have and block not in sources:
            sources[block] = i
    todo = list(sources.values())
    return [list(zip(todo[r:r + len(mine)], mine)) for r in range(0, len(todo), len(mine))]


@functools.lru_cache(maxsize=None)
def _sender(mesh, spec, rounds: tuple):
    """A compiled shard_map over `mesh`: every device's block of an array laid out by `spec`,
    sent along each round's (source, receiver) pairs (`gather_plan`); out: (rounds, *block)
    on every device, what it received (zeros where nothing came)."""
    axes = tuple(mesh.axis_names)

    def body(x):
        return jnp.stack([jax.lax.ppermute(x, axes, perm=list(pairs)) for pairs in rounds])
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=P(axes)))


def gather_to(v: jax.Array, owner: int) -> np.ndarray | None:
    """`v` whole as numpy on process `owner` (None on the others; every process calls this):
    the owner copies its own devices' blocks and receives each other block once, point to
    point (`gather_plan`: a collective permute), so no process but the owner receives any of
    it; on one process, or where the owner's devices hold every block, nothing crosses."""
    me = jax.process_index()
    if v.is_fully_addressable:
        return np.asarray(jax.device_get(v)) if me == owner else None
    devices = list(v.sharding.mesh.devices.flat)
    index = v.sharding.devices_indices_map(v.shape)
    rounds = gather_plan(devices, index, owner)
    got = (_sender(v.sharding.mesh, v.sharding.spec, tuple(map(tuple, rounds)))(v)
           if rounds else None)
    if me != owner:
        return None
    out = np.empty(v.shape, v.dtype)
    for shard in v.addressable_shards:
        out[shard.index] = np.asarray(shard.data)
    if got is not None:
        received = {s.device: np.asarray(s.data) for s in got.addressable_shards}
        for r, pairs in enumerate(rounds):
            for src, dst in pairs:
                out[index[devices[src]]] = received[devices[dst]][r]
    return out


def owned_params(params: dict, owner: dict[str, int], dtype=None) -> dict[str, np.ndarray]:
    """{checkpoint key: numpy array} of the parameters `owner` gives this process, decoder
    layers unstacked, cast to `dtype` on the devices; each parameter gathered to its owner
    alone (`gather_to`), one at a time. Every process calls this with the same arguments."""
    me, out = jax.process_index(), {}
    for k, v in params.items():
        value = gather_to(v if dtype is None else v.astype(dtype), owner[k])
        if owner[k] == me:
            out[k] = value
    return to_hf(out)


def save_hf(model, config, out_dir: str | Path, *, dtype=np.float32,
            source_dir: str | Path | None = None) -> Path:
    """Write `model` as a transformers checkpoint directory; returns it. Every process calls
    this (parameters may span hosts). One process writes `model.safetensors`; with several,
    each writes the parameters `owners` gives it into a shard of its own
    (model-0000k-of-0000n.safetensors: each host holds and writes ~1/n of the model; each
    parameter is gathered to its writer alone, `gather_to`, so a host receives only what it
    writes) and process 0 the index, the config and the side files; all of them are in place
    when any returns.

    dtype: float32 or ml_dtypes bfloat16 (`jnp.bfloat16`); parameters are cast on the devices,
    so a bf16 export moves half the bytes between hosts. Tokenizer / processor files are
    copied from `source_dir` when given."""
    world, me = jax.process_count(), jax.process_index()
    params = split_params(model)[1]
    itemsize = np.dtype(dtype).itemsize
    owner = owners({k: v.size * itemsize for k, v in params.items()}, world)
    tensors = published(owned_params(params, owner, dtype), config)
    writers = sorted(set(owner.values()))  # every process, unless there are more than tensors
    files = {p: shard_name(i, len(writers)) for i, p in enumerate(writers)}
    index = None
    if len(writers) > 1 and me == 0:
        shapes = hf_shapes({k: v.shape for k, v in params.items()})
        weight_map = {hf: files[owner[_param_key(hf, params)]] for hf in shapes}
        total = sum(int(np.prod(s)) * itemsize for s in shapes.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    mine = files.get(me)
    if storage.is_remote(out_dir):  # written here, then copied up (common.storage)
        with tempfile.TemporaryDirectory() as tmp:
            _write_hf(tensors if mine else None, mine, index, config if me == 0 else None,
                      Path(tmp), dtype, source_dir)
            storage.copy_into(Path(tmp), storage.path(out_dir))
        out = storage.path(out_dir)
    else:
        out = _write_hf(tensors if mine else None, mine, index, config if me == 0 else None,
                        Path(out_dir), dtype, source_dir)
    if world > 1:
        multihost_utils.sync_global_devices(f"save_hf {out_dir}")
    return out


def published(tensors: dict[str, np.ndarray], config) -> dict[str, np.ndarray]:
    """{checkpoint key: array} in transformers 5's layout -> the experts (`EXPERTS`, (E, out,
    in)) in the published checkpoints' (E, in, out) where the two differ in shape (see the
    module docstring); contiguous arrays."""
    text = config.get_text_config()
    i, h = getattr(text, "moe_intermediate_size", 0), text.hidden_size
    swap = bool(i) and h not in (i, 2 * i)
    return {k: np.ascontiguousarray(v.swapaxes(1, 2) if swap and k.endswith(EXPERTS) else v)
            for k, v in tensors.items()}


def _param_key(hf_key: str, params: dict) -> str:
    """The model's key holding checkpoint key `hf_key` (a stacked key for a layer's)."""
    stacked = stacked_key(hf_key)
    return stacked[0] if stacked is not None and stacked[0] in params else hf_key


def _write_hf(tensors: dict | None, name: str | None, index: dict | None, config, out: Path,
              dtype, source_dir) -> Path:
    """Into `out`: `tensors` as the file `name` (None: none), the sharded checkpoint's `index`
    (None: none), `config` with the side files of `source_dir` (config None: neither)."""
    out.mkdir(parents=True, exist_ok=True)
    if tensors is not None:
        save_file(tensors, str(out / name), metadata={"format": "pt"})
    if index is not None:
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2))
    if config is None:
        return out
    config.dtype = "bfloat16" if np.dtype(dtype) == jnp.bfloat16 else "float32"
    config.save_pretrained(str(out))
    if source_dir is not None:
        for name in SIDE_FILES:
            if (Path(source_dir) / name).is_file() and Path(source_dir) != out:
                shutil.copy2(Path(source_dir) / name, out / name)
    return out
