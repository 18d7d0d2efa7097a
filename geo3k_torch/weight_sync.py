"""The torch learner's weights as SGLang loads them: bf16, under the checkpoint's own names,
bucket by bucket, never a full fp32 copy (`common.sglang.backend.TensorWeights`).

    weights = TorchWeights(model, model_dir)            # handed to the SGLang backend
    for payload, last in weights.tensor_buckets(512 << 20):   # colocated: in memory
        ...                                              # one /update_weights_from_tensor each
    weights.write_safetensors(out_dir, 512 << 20)       # remote servers: bf16 shards on disk

Names are those `save_pretrained` writes (what SGLang's loaders expect): tied weights once (the
first name, as transformers keeps the input embedding), then transformers' reverse checkpoint
conversion (`revert_weight_conversion`), applied bucket by bucket, which is exact only for
conversions that map one weight to one weight: checked once at construction on meta tensors
(Qwen2.5-VL and Qwen3-VL dense have none or renames only). Qwen3-VL-MoE's fused experts go in
the published checkpoints' layout, (E, H, 2I) and (E, I, H) (`geo3k_torch.model.hub_layout`),
which SGLang's loader transposes: the model's own (E, 2I, H) would load wrong. Every process walks the same
buckets: an FSDP2-sharded weight is cast to bf16 on its shard, then gathered
(`DTensor.full_tensor`, a collective); a bucket's gathered weights live in one flat bf16 buffer
on the learner's device.

A payload is the base64 pickle (multiprocessing's ForkingPickler, which torch extends, as
SGLang's `MultiprocessingSerializer.serialize(..., output_str=True)` writes it) of
[(name, tensor)], each tensor a view of the bucket's buffer: on CUDA an IPC handle (the server
must open it on the same GPU, device numbered as the learner numbers it: the servers inherit
its CUDA_VISIBLE_DEVICES), on CPU a shared-memory file descriptor (the CPU tests). SGLang
unpickles it with an allow-list (srt/utils/common.py `SafeUnpickler`), which admits exactly
these torch rebuild functions. A payload is valid until the next is drawn: the buffer is
freed then (and CUDA's IPC bookkeeping collected).
"""

from __future__ import annotations

import base64
import io
import json
import shutil
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Iterator

import torch
import torch.multiprocessing  # noqa: F401 - registers torch's reductions with ForkingPickler
from torch.distributed.tensor import DTensor

DTYPE = torch.bfloat16
# Files of a source checkpoint that an export rewrites (weights); the rest is copied.
_WEIGHT_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".safetensors.index.json")


def serialize(named: list[tuple[str, torch.Tensor]]) -> str:
    """[(name, tensor)] pickled for another process on this machine, base64 text."""
    buf = io.BytesIO()
    ForkingPickler(buf).dump(named)
    return base64.b64encode(buf.getvalue()).decode()


class TorchWeights:
    """`TensorWeights` of a transformers model, sharded by FSDP2 or not (see the module
    docstring). model_dir: the source checkpoint (config and processor files of exports)."""

    def __init__(self, model, model_dir: str | Path, rank: int = 0):
        from transformers.core_model_loading import revert_weight_conversion

        from geo3k_torch.model import hub_layout

        self.model, self.model_dir, self.rank = model, Path(model_dir), rank
        self._revert = lambda sd: hub_layout(revert_weight_conversion(model, sd), model)
        keys = set(model.state_dict())
        seen: set[int] = set()
        self.entries: list[tuple[str, torch.Size]] = []  # (state-dict name, shape), in order
        for name, t in self._live().items():
            if name in keys and id(t) not in seen:  # a tied weight once, under its first name
                seen.add(id(t))
                self.entries.append((name, t.shape))
        meta = {n: torch.empty(shape, dtype=DTYPE, device="meta") for n, shape in self.entries}
        if len(self._revert(meta)) != len(meta):
            raise ValueError(f"{type(model).__name__}'s checkpoint conversion is not one weight "
                             "to one weight, so it cannot be applied bucket by bucket: set "
                             "engine.sglang_weight_sync='disk' and hand no TorchWeights")

    def _live(self) -> dict[str, torch.Tensor]:
        """The model's parameters and buffers by name, tied ones under every name, looked up
        anew each time (FSDP2 and meta-device materialization put new tensors in place)."""
        return {**dict(self.model.named_parameters(remove_duplicate=False)),
                **dict(self.model.named_buffers(remove_duplicate=False))}

    def _buckets(self, bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
        """The entries in order with their live tensors, cut into buckets of at most
        `bucket_bytes` of bf16 (a larger weight alone); the same cut on every process."""
        live = self._live()
        out: list[list] = [[]]
        size = 0
        for name, shape in self.entries:
            n = shape.numel() * DTYPE.itemsize
            if out[-1] and size + n > bucket_bytes:
                out.append([])
                size = 0
            out[-1].append((name, live[name]))
            size += n
        return out

    @staticmethod
    def _full(t: torch.Tensor) -> torch.Tensor:
        """The whole weight in bf16 on this process's device (a collective for a DTensor)."""
        t = t.detach().to(DTYPE)
        return t.full_tensor() if isinstance(t, DTensor) else t

    def tensor_buckets(self, bucket_bytes: int) -> Iterator[tuple[str, bool]]:
        buckets = self._buckets(bucket_bytes)
        for i, bucket in enumerate(buckets):
            full = [(name, self._full(t)) for name, t in bucket]
            flat = torch.empty(sum(t.numel() for _, t in full), dtype=DTYPE,
                               device=full[0][1].device)
            named, offset = {}, 0
            for name, t in full:
                view = flat[offset:offset + t.numel()]
                view.copy_(t.reshape(-1))
                named[name] = view.view(t.shape)
                offset += t.numel()
            del full
            yield serialize(list(self._revert(named).items())), i == len(buckets) - 1
            del named, flat, view
            if torch.cuda.is_available():
                torch.cuda.ipc_collect()  # the servers closed their handles by now

    def write_safetensors(self, out_dir: Path, shard_bytes: int) -> None:
        from safetensors.torch import save_file

        out_dir = Path(out_dir)
        buckets = self._buckets(shard_bytes)
        weight_map, total = {}, 0
        for i, bucket in enumerate(buckets):
            shard = {name: self._full(t) for name, t in bucket}
            if self.rank != 0:
                continue
            shard = {k: v.to("cpu", copy=True).contiguous() for k, v in self._revert(shard).items()}
            file = f"model-{i + 1:05d}-of-{len(buckets):05d}.safetensors"
            save_file(shard, str(out_dir / file), metadata={"format": "pt"})
            weight_map |= dict.fromkeys(shard, file)
            total += sum(v.numel() * v.element_size() for v in shard.values())
        if self.rank != 0:
            return
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
        for f in self.model_dir.iterdir():  # config, tokenizer, processor, chat template
            if f.is_file() and not f.name.endswith(_WEIGHT_FILE_SUFFIXES):
                shutil.copy2(f, out_dir / f.name)
