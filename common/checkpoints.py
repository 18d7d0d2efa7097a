"""Atomic, resumable checkpoints of any `common.learner.Learner`, and atomic weight exports.

    checkpoints/step_<N>/
        config.json, *.safetensors, tokenizer and processor files   (learner.export_hf: loads in
                                                                      transformers, serves as is)
        ...                       the learner's own state (learner.save: optimizer, schedule)
        loop_state.json           step, prompt sampler, every process's engine RNG (written last)

A checkpoint is written into `step_<N>.tmp` and renamed into place when complete, so a crash
mid-write never leaves a directory that looks complete; `latest` ignores `.tmp` leftovers and
directories without `loop_state.json`. `start` returns once the learner has taken its state (a
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

from common.learner import Collectives, Learner

_STEP = re.compile(r"^step_(\d+)$")
LOOP_STATE = "loop_state.json"


def latest(root: str | os.PathLike) -> Path | None:
    """The complete checkpoint with the highest step under `root`, or None."""
    root = Path(root)
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
    state as it is now, written into `step_<N>.tmp`. Returns `finish` (every process calls it,
    once): it waits for the learner's writes, then moves the checkpoint into place and returns
    its final path. Until then `latest` does not see it."""
    root = Path(root)
    final, tmp = root / f"step_{step}", root / f"step_{step}.tmp"
    if comm.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    comm.barrier()
    learner.export_hf(tmp)
    learner.save(tmp)

    def finish() -> Path:
        learner.wait_saved()
        comm.barrier()
        if comm.rank == 0:
            (tmp / LOOP_STATE).write_text(json.dumps({"step": step, **loop_state}))
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
        comm.barrier()
        return final

    return finish


def load_loop_state(path: str | os.PathLike) -> dict:
    """What `save` stored as `loop_state` (plus "step")."""
    return json.loads((Path(path) / LOOP_STATE).read_text())


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
    """Delete all but the newest `keep` complete checkpoints (and stale .tmp leftovers)."""
    root = Path(root)
    steps = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP.match(p.name)))
    for _, p in steps[:-keep] if keep > 0 else []:
        shutil.rmtree(p, ignore_errors=True)
    for p in root.glob("step_*.tmp"):
        shutil.rmtree(p, ignore_errors=True)
