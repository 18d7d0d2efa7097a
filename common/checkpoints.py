"""Atomic, resumable checkpoints of any `common.learner.Learner`, and atomic weight exports.

    checkpoints/step_<N>/
        config.json, *.safetensors, tokenizer and processor files   (learner.export_hf: loads in
                                                                      transformers, serves as is)
        ...                       the learner's own state (learner.save: optimizer, schedule)
        loop_state.json           step, prompt sampler, every process's engine RNG (written last)

A checkpoint is written into `step_<N>.tmp` and renamed into place when complete, then
`loop_state.json` is written last: a directory without it (a crash mid-write) is never `latest`.
In an object store (`gs://...`: `common.storage`), which has no atomic rename, the checkpoint is
written in place and published by the same last write. `start` returns once the learner has
taken its state (a
learner may write it in the background, as orbax does) and hands back the `finish` that waits
for the writes and publishes the checkpoint: the training loop calls it after the next step's
rollouts, so that the writing overlaps them; `save` is the two at once.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Callable

from common import storage
from common.learner import Collectives, Learner

_STEP = re.compile(r"^step_(\d+)$")
LOOP_STATE = "loop_state.json"


def location(cfg, workdir: str | os.PathLike):
    """Where a run's checkpoints go: `checkpoint.dir`, else <workdir>/checkpoints."""
    return cfg.checkpoint.dir or storage.path(workdir) / "checkpoints"


def root(cfg, workdir: str | os.PathLike, learner: Learner):
    """`location`, checked: an object store (a URL) only for a learner that writes there
    (`Learner.remote_checkpoints`)."""
    where = location(cfg, workdir)
    if storage.is_remote(where) and not getattr(learner, "remote_checkpoints", False):
        raise ValueError(f"checkpoint.dir={where}: {type(learner).__module__} writes its "
                         "checkpoints to a local or shared POSIX path (every process reads "
                         "and writes it): set checkpoint.dir to one (a --workdir in a bucket "
                         "puts them under it otherwise); object stores need the JAX learner "
                         "(orbax)")
    return where


def latest(root: str | os.PathLike) -> Path | None:
    """The complete checkpoint with the highest step under `root` (local or a URL), or None."""
    root = storage.path(root)
    if not root.is_dir():
        return None
    steps = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _STEP.match(p.name)) and (p / LOOP_STATE).exists()]
    return max(steps)[1] if steps else None


def save(root: str | os.PathLike, step: int, learner: Learner, loop_state: dict,
         comm: Collectives) -> Path:
    """Write checkpoint `step` (every process calls this). Returns its final path."""
    return start(root, step, learner, loop_state, comm)()


def start(root: str | os.PathLike, step: int, learner: Learner, loop_state: dict,
          comm: Collectives) -> Callable[[], Path]:
    """Begin checkpoint `step` (every process calls this): the HF export, and the learner's
    state as it is now, written into `step_<N>.tmp` (in an object store: `step_<N>`). Returns
    `finish` (every process calls it, once): it waits for the learner's writes, moves the
    checkpoint into place, writes its loop state and returns its final path. Until then
    `latest` does not see it."""
    root = storage.path(root)
    final = root / f"step_{step}"
    work = final if storage.is_remote(root) else root / f"step_{step}.tmp"
    if comm.rank == 0:
        storage.rmtree(work)
        work.mkdir(parents=True, exist_ok=True)
    comm.barrier()
    learner.export_hf(work)
    learner.save(work)

    def finish() -> Path:
        learner.wait_saved()
        comm.barrier()
        if comm.rank == 0:
            if work != final:
                storage.rmtree(final)
                os.replace(work, final)
            (final / LOOP_STATE).write_text(json.dumps({"step": step, **loop_state}))
        comm.barrier()
        return final

    return finish


def load_loop_state(path: str | os.PathLike) -> dict:
    """What `save` stored as `loop_state` (plus "step")."""
    return json.loads((storage.path(path) / LOOP_STATE).read_text())


def export_weights(out: str | os.PathLike, write: Callable[[Path], None],
                   comm: Collectives) -> Path:
    """Weights written by `write(dir)` (every process calls it; e.g. `learner.export_hf`) as
    the directory `out`, replaced atomically (written into `out.tmp`, then renamed): an engine
    reading `out` never sees a half-written model."""
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    if comm.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    comm.barrier()
    write(tmp)
    comm.barrier()
    if comm.rank == 0:
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    comm.barrier()
    return out


def prune(root: str | os.PathLike, keep: int) -> None:
    """Delete all but the newest `keep` complete checkpoints, the incomplete ones older than
    the newest complete one, and stale .tmp leftovers."""
    root = storage.path(root)
    done = sorted((int(m.group(1)), p) for p in root.iterdir()
                  if (m := _STEP.match(p.name)) and (p / LOOP_STATE).exists())
    newest = done[-1][0] if done else 0
    for _, p in done[:-keep] if keep > 0 else []:
        storage.rmtree(p)
    for p in root.iterdir():
        m = _STEP.match(p.name)
        unfinished = m and int(m.group(1)) < newest and not (p / LOOP_STATE).exists()
        if unfinished or (p.name.startswith("step_") and p.name.endswith(".tmp")):
            storage.rmtree(p)
