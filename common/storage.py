"""Paths that may live in an object store: a local path stays a `pathlib.Path`; a URL
(`gs://bucket/dir`, `s3://...`) becomes an `etils.epath.Path` (gcsfs / s3fs through fsspec;
etils comes with orbax, the JAX learner's checkpointer). Both offer the pathlib calls the
checkpoints use (`/`, exists, is_dir, iterdir, glob, mkdir, read_text, write_text); `rmtree`
below removes a tree in either.

An object store has no atomic rename: `common.checkpoints` writes there in place and publishes
a checkpoint by writing its `loop_state.json` last.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

_URL = re.compile(r"^[a-z][a-z0-9+.-]*://")


def is_remote(path: str | os.PathLike) -> bool:
    """True for a URL (an object store), False for a local path."""
    return bool(_URL.match(os.fspath(path)))


def path(p: str | os.PathLike):
    """`p` as a path object: `pathlib.Path` if local, `etils.epath.Path` if a URL."""
    if not is_remote(p):
        return Path(p)
    try:
        from etils import epath
    except ImportError as e:
        raise ImportError(f"{p}: paths in an object store need etils[epath] (installed with "
                          "orbax-checkpoint: pip install -e '.[jax]') and the store's fsspec "
                          "filesystem (gcsfs for gs://)") from e
    return epath.Path(os.fspath(p))


def rmtree(p) -> None:
    """Remove the tree at `p` (a `path`), if there is one."""
    if isinstance(p, Path):
        shutil.rmtree(p, ignore_errors=True)
    elif p.exists():
        p.rmtree()


def copy_into(local_dir: Path, dest) -> None:
    """Copy the files of the local directory `local_dir` into `dest` (a `path`, made if
    missing): how a file written with local-only APIs (safetensors, transformers) reaches an
    object store."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in sorted(Path(local_dir).iterdir()):
        if isinstance(dest, Path):
            shutil.copy2(f, dest / f.name)
        else:
            type(dest)(os.fspath(f)).copy(dest / f.name, overwrite=True)
