"""Orbax checkpoints of the JAX learner: parameters, optimizer state and run metadata.

    ckpt = Checkpointer(workdir / "jax_checkpoints", keep=3)
    ckpt.save(step, learner.params, learner.opt_state, {"rng": ..., "sampler": ...})
    params, opt_state, meta = ckpt.restore(ckpt.latest(), learner.params, learner.opt_state)

A save is atomic (orbax writes to a temporary directory and renames it) and keeps the newest
`keep` steps. Restoring takes the live arrays as the target, so every array comes back with its
dtype and sharding on the current mesh (which may differ from the mesh that saved it): resuming
continues bit for bit, which `tests/test_jax_learner.py` checks against an uninterrupted run.
"""

from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp


class Checkpointer:
    """Numbered checkpoints under `directory`."""

    def __init__(self, directory: str | Path, keep: int = 3):
        self.manager = ocp.CheckpointManager(
            Path(directory).absolute(),
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))

    def save(self, step: int, params: dict, opt_state, meta: dict) -> None:
        """Write step `step` and wait until it is on disk."""
        self.manager.save(step, args=ocp.args.Composite(
            params=ocp.args.StandardSave(params), opt_state=ocp.args.StandardSave(opt_state),
            meta=ocp.args.JsonSave(meta)))
        self.manager.wait_until_finished()

    def latest(self) -> int | None:
        """The newest saved step, or None."""
        return self.manager.latest_step()

    def restore(self, step: int, params_like: dict, opt_state_like) -> tuple[dict, object, dict]:
        """(params, opt_state, meta) of `step`, shaped, typed and sharded like the targets."""
        if step not in self.manager.all_steps():
            raise FileNotFoundError(f"no checkpoint for step {step} in {self.manager.directory}; "
                                    f"saved steps: {sorted(self.manager.all_steps())}")
        abstract = lambda tree: jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)  # noqa
        out = self.manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(abstract(params_like)),
            opt_state=ocp.args.StandardRestore(abstract(opt_state_like)),
            meta=ocp.args.JsonRestore()))
        return out["params"], out["opt_state"], out["meta"]

    def close(self) -> None:
        self.manager.close()
