"""Load the processor (tokenizer + image processor + chat template) of a local Qwen-VL checkpoint.

transformers 5.x builds Qwen2.5-VL / Qwen3-VL processors with a video processor, and its video
processors need torchvision, which has no CPU build here. Where torchvision is missing we use
image-only subclasses of `Qwen2_5_VLProcessor` / `Qwen3VLProcessor` (their `__init__` takes no
video processor) with the PIL image processor `Qwen2VLImageProcessorPil`, and register them with
`AutoProcessor` for the two config classes. Where torchvision exists, `AutoProcessor` as is.

Works for our tiny checkpoints and for downloaded Qwen checkpoints (which name their own processor
class in `preprocessor_config.json`; the registration alone would not reach them, so
`load_processor` instantiates the subclass directly). Videos are not supported on the image-only
path. Only `load_processor` imports transformers; importing this module does not.

    from common.processor import load_processor
    proc = load_processor("data/tiny-qwen3_vl-small")
    enc = proc(text=[proc.apply_chat_template(messages, add_generation_prompt=True)],
               images=[pil_image], return_tensors="np")
    enc["input_ids"]       # (1, T) int64, one <|image_pad|> per merged patch
    enc["pixel_values"]    # (sum of patches, 3 * 2 * patch * patch) float32
    enc["image_grid_thw"]  # (n_images, 3) int64
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
from pathlib import Path
from typing import Any

import numpy as np

PROCESSOR_CONFIG_FILES = ("processor_config.json", "preprocessor_config.json")
# model_type in config.json -> the arch whose vision tower, processor and chat template it has
# (Qwen3-VL-MoE is Qwen3-VL with sparse MoE blocks in place of its decoder layers' MLPs)
FAMILY = {"qwen3_vl": "qwen3_vl", "qwen2_5_vl": "qwen2_5_vl", "qwen3_vl_moe": "qwen3_vl"}
MODEL_TYPES = tuple(FAMILY)
# ... and the processor class a processor config names -> the same key
_ARCH_OF = FAMILY | {"Qwen2_5_VLProcessor": "qwen2_5_vl", "Qwen3VLProcessor": "qwen3_vl"}


def family(model_type: str) -> str:
    """'qwen3_vl' or 'qwen2_5_vl': the arch whose vision tower and processor a config's
    `model_type` (one of MODEL_TYPES) has."""
    if model_type not in FAMILY:
        raise ValueError(f"model_type {model_type!r} is not one of {MODEL_TYPES}")
    return FAMILY[model_type]


def image_key(image) -> object:
    """An image's identity by content (hashable): two copies of one picture are equal. PIL
    images and arrays by type, mode / dtype, size / shape and a hash of their bytes; anything
    else as itself."""
    if hasattr(image, "tobytes"):
        shape = getattr(image, "size", None) or getattr(image, "shape", None)
        mode = getattr(image, "mode", None) or str(getattr(image, "dtype", ""))
        return (type(image).__name__, mode, tuple(shape or ()),
                hashlib.blake2b(image.tobytes(), digest_size=16).hexdigest())
    return image


def torchvision_available() -> bool:
    """Whether torchvision can be imported (checked without importing it or torch)."""
    try:
        return importlib.util.find_spec("torchvision") is not None
    except (ImportError, ValueError):  # a broken install, or an import hook that refuses it
        return False


@functools.lru_cache(maxsize=1)
def image_only_processor_classes() -> dict[str, type]:
    """{'qwen2_5_vl': class, 'qwen3_vl': class}: processors without a video processor,
    registered with `AutoProcessor` for their config classes (once per process)."""
    from transformers import (AutoProcessor, Qwen2_5_VLConfig, Qwen2_5_VLProcessor,
                              Qwen3VLConfig, Qwen3VLProcessor)
    from transformers.models.qwen3_vl_moe import Qwen3VLMoeConfig

    class Qwen2_5_VLImageOnlyProcessor(Qwen2_5_VLProcessor):
        """`Qwen2_5_VLProcessor` for images and text only (no torchvision needed)."""

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            # The parent passes (image_processor, tokenizer, None); ProcessorMixin pairs the
            # positional args with this signature's two sub-processors, dropping the None.
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template)

    class Qwen3VLImageOnlyProcessor(Qwen3VLProcessor):
        """`Qwen3VLProcessor` for images and text only (no torchvision needed)."""

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template)

    for config, cls in ((Qwen2_5_VLConfig, Qwen2_5_VLImageOnlyProcessor),
                        (Qwen3VLConfig, Qwen3VLImageOnlyProcessor),
                        (Qwen3VLMoeConfig, Qwen3VLImageOnlyProcessor)):
        AutoProcessor.register(config, cls, exist_ok=True)
    return {"qwen2_5_vl": Qwen2_5_VLImageOnlyProcessor, "qwen3_vl": Qwen3VLImageOnlyProcessor}


def checkpoint_arch(path: str | Path) -> str:
    """'qwen2_5_vl' or 'qwen3_vl' for a checkpoint dir, from config.json's model_type or else
    the processor class its processor config names."""
    path = Path(path)
    keys = []
    if (path / "config.json").is_file():
        keys.append(json.loads((path / "config.json").read_text()).get("model_type"))
    for name in PROCESSOR_CONFIG_FILES:
        if (path / name).is_file():
            keys.append(json.loads((path / name).read_text()).get("processor_class"))
    for key in keys:
        if key in _ARCH_OF:
            return _ARCH_OF[key]
    raise ValueError(f"{path}: not a Qwen2.5-VL or Qwen3-VL checkpoint (found {keys})")


def load_processor(path: str | Path) -> Any:
    """The processor of the checkpoint in local dir `path`: `.tokenizer`, `.image_processor`,
    `.apply_chat_template(...)`, `__call__(text=, images=, return_tensors="np")`.

    Raises FileNotFoundError when `path` has no processor config (processor_config.json or
    preprocessor_config.json): without one transformers would quietly return a bare tokenizer."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a directory")
    if not any((path / name).is_file() for name in PROCESSOR_CONFIG_FILES):
        raise FileNotFoundError(
            f"{path} has no {' or '.join(PROCESSOR_CONFIG_FILES)}: it is not a complete "
            "processor checkpoint (a tokenizer alone cannot expand images)")
    if torchvision_available():
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(str(path))
    else:
        cls = image_only_processor_classes()[checkpoint_arch(path)]
        processor = cls.from_pretrained(str(path))
    if getattr(processor, "image_processor", None) is None:
        raise TypeError(f"{path} loaded as {type(processor).__name__}, which has no image processor")
    return processor


def image_inputs(processor, images: list) -> dict:
    """pixel_values (P, C*t*p*p) and image_grid_thw (N, 3) as numpy, or {} without images."""
    if not images:
        return {}
    out = processor.image_processor(images=list(images), return_tensors="np")
    return {"pixel_values": np.asarray(out["pixel_values"]),
            "image_grid_thw": np.asarray(out["image_grid_thw"], np.int64)}
