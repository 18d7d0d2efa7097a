"""Paths that may live in an object store: a local path stays a `pathlib.Path`; a URL
(`gs://bucket/dir`, `s3://...`) becomes an `etils.epath.Path` (gcsfs / s3fs through fsspec;
etils comes with orbax, the JAX learner's checkpointer). Both offer the pathlib calls the
checkpoints use (`/`, exists, is_dir, iterdir, glob, mkdir, read_text, write_text); `rmtree`
below removes a tree in either.

An object store has no atomic rename: `common.checkpoints` writes there in place and publishes
a checkpoint by writing its `loop_state.json` last.

A workdir in an object store (`--workdir=gs://...`) is written through a local folder that
`mirrored` copies up as it grows: the run log, TensorBoard, the curve and the rollout dumps use
local-file APIs (append, matplotlib, the event writer, PIL).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Iterator

from absl import logging

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


# What a resumed run reads back from its workdir (`common.runlog.RunLog`): copied down first.
PULLED = ("metrics.jsonl",)
# The engines' scratch copies of the weights, rewritten at every sync: never copied up.
SCRATCH = ("weights_for_engine", "weights_for_sglang")


class Mirror:
    """Copies the files of the local folder `local` that changed since the last `push` (size
    or modification time) into `dest` (a `path`), keeping relative paths. Files whose name has
    ".tmp" (being written, replaced when done) are left for a later push; `SCRATCH` folders
    are never copied."""

    def __init__(self, local: Path, dest):
        self.local, self.dest = Path(local), dest
        self._seen: dict[Path, tuple[int, int]] = {}
        self._lock = threading.Lock()

    def push(self) -> int:
        """Upload what changed; returns how many files went up."""
        with self._lock:
            sent = 0
            for f in sorted(self.local.rglob("*")):
                rel = f.relative_to(self.local)
                if not f.is_file() or ".tmp" in f.name or rel.parts[0] in SCRATCH:
                    continue
                try:
                    st = f.stat()
                    if self._seen.get(rel) == (st.st_size, st.st_mtime_ns):
                        continue
                    data = f.read_bytes()
                except FileNotFoundError:  # replaced while we looked
                    continue
                target = self.dest.joinpath(*rel.parts)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
                self._seen[rel] = (st.st_size, st.st_mtime_ns)
                sent += 1
            return sent

    def pull(self, name: str) -> None:
        """Copy `dest`/name down into the local folder, if it is there, as already pushed: it
        goes up again only once changed here (another process's copy never overwrites it)."""
        if (self.dest / name).exists():
            f = self.local / name
            f.write_bytes((self.dest / name).read_bytes())
            st = f.stat()
            self._seen[Path(name)] = (st.st_size, st.st_mtime_ns)


@contextlib.contextmanager
def mirrored(workdir: str | os.PathLike, every_s: float = 60.0) -> Iterator[Path]:
    """A local folder for `workdir`: `workdir` itself when local; for a URL, a fresh temporary
    folder (holding the URL's `PULLED` files, for a resumed run) whose files a background
    thread copies up every `every_s` seconds, and once more on exit (errors included). The
    folder is removed once that last copy succeeded; if it failed, it stays (its path logged)."""
    if not is_remote(workdir):
        yield Path(workdir)
        return
    dest = path(workdir)
    local = Path(tempfile.mkdtemp(prefix="geo3k-workdir-"))
    mirror, stop = Mirror(local, dest), threading.Event()
    for name in PULLED:
        mirror.pull(name)

    def loop():
        while not stop.wait(every_s):
            try:
                mirror.push()
            except Exception as e:  # a store's hiccup: the next push (or the last) retries
                logging.warning("copying %s up to %s failed: %s", local, workdir, e)

    thread = threading.Thread(target=loop, name="workdir-mirror", daemon=True)
    thread.start()
    try:
        yield local
    finally:
        stop.set()
        thread.join()
        try:
            mirror.push()
        except Exception:
            logging.error("the run's files are in %s: copying them up to %s failed", local,
                          workdir)
            raise
        shutil.rmtree(local, ignore_errors=True)
