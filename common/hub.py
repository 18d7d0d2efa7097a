"""Local folders for `model.path` and `data.path`: a local path as it is, or a Hugging Face Hub
name (`Qwen/Qwen3-VL-2B-Instruct`, `hiyouga/geometry3k`) resolved through huggingface_hub into
its cache (`HF_HUB_CACHE`, default ~/.cache/huggingface/hub): downloaded the first time, read
from the cache after that, offline too (`HF_HUB_OFFLINE=1`, or no network). A value that is
neither an existing path nor in the cache or on the Hub gets one error that names it, the cache
and what was tried.

A Hub dataset's snapshot is its repository's files: Geometry3K's copies on the Hub are parquet
files (`data/train-00000-of-00001.parquet`, ...), which `common.data.load_split` reads as it
reads any folder of them.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# owner/name, as the Hub spells repository ids
REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
# weights in formats no learner here reads: never downloaded
SKIP = ["*.h5", "*.msgpack", "*.onnx", "*.gguf", "*.ot", "original/*", "onnx/*"]


class HubError(FileNotFoundError):
    """A `model.path` / `data.path` that is no local path and no Hub repository we can read."""


def is_repo_id(value: str) -> bool:
    """Whether `value` could name a Hub repository (owner/name), not whether one exists."""
    return bool(REPO_ID.match(value)) and ".." not in value


def local_path(value: str, field: str, repo_type: str) -> str:
    """The local folder (or file) for `value`, the setting `field` ("model.path", "data.path"):
    an existing path as it is; else a Hub repository id's snapshot in the cache (repo_type
    "model" or "dataset"), downloaded if missing and the network allows. Raises `HubError`."""
    if os.path.exists(value):
        return value
    if not is_repo_id(value):
        raise HubError(f"{field}={value!r}: no such file or directory (and not a Hugging Face "
                       "Hub name, which reads owner/name)")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    try:
        return snapshot_download(value, repo_type=repo_type, ignore_patterns=SKIP)
    except (LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError,
            GatedRepoError) as e:
        why = str(e).strip().splitlines()[0] if str(e).strip() else ""
        how = ("offline: HF_HUB_OFFLINE=1" if constants.HF_HUB_OFFLINE
               else f"{type(e).__name__}: {why}" if why else type(e).__name__)
        raise HubError(
            f"{field}={value!r}: no such local path, and no {repo_type} {value!r} in the Hugging "
            f"Face cache {constants.HF_HUB_CACHE} ({how}). Download it where the Hub is "
            f"reachable (`hf download {value}{' --repo-type dataset' * (repo_type == 'dataset')}"
            "`, with HF_HUB_CACHE pointing at this cache), or give a local path") from None


def checkpoint_dir(value: str) -> str:
    """The checkpoint folder of `model.path` = `value` (a local path or a Hub model name): it
    must hold a Hugging Face checkpoint (config.json)."""
    path = local_path(value, "model.path", "model")
    if not (Path(path) / "config.json").exists():
        raise HubError(f"model.path={value!r} has no config.json ({path}): point it at a Hugging "
                       "Face checkpoint folder or a Hub model name")
    return path


def data_path(value: str) -> str:
    """The local file or folder of `data.path` = `value` (a local path or a Hub dataset name)."""
    return local_path(value, "data.path", "dataset")
