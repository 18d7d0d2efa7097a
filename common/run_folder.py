"""A run folder's saved config and its checkpoints, for a command that takes `--run`.

    run, checkpoint = locate("runs/20260101-120000")            # its newest complete checkpoint
    run, checkpoint = locate("runs/<run>/checkpoints/step_40")  # that one; the run folder above
    cfg, notes = saved_config(run)          # the ConfigDict the run trained with (config.json)
    plan = evaluation_config("runs/<run>", parsed, sys.argv)  # .cfg, .checkpoint, .out, ...

`python -m geo3k_torch.evaluate --run=...` evaluates a checkpoint with the settings it was
trained with: the data, prompt style, tool format, turns and reward of <run>/config.json
(`common.runlog.write_config`), not those of whatever config file the command line names.
Plain Python: ml_collections, no torch or jax.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from common import checkpoints
from common.runlog import flatten

RECORD = "config.json"  # in the run folder (a checkpoint's own config.json is the model's)

# What decides what the policy saw and how its answers were scored: an evaluation that changes
# one of these measures another task than the run trained on (a prefix covers a section).
TRAINED_ON = ("data.", "env.", "reward.", "model.tool_format", "rollout.max_response_tokens",
              "rollout.max_context_tokens")


class RunError(ValueError):
    """`--run` names no run folder or checkpoint this can use (the message says why)."""


def read_record(run: Path) -> dict | None:
    """<run>/config.json as a run wrote it ({"config": {...}, ...}), None where there is no
    such file or it is another kind of config.json (a checkpoint's model config)."""
    try:
        record = json.loads((Path(run) / RECORD).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("config"), dict) \
        else None


def locate(path: str | Path) -> tuple[Path, Path]:
    """(run folder, checkpoint) for `--run=path`: a run folder and its newest complete
    checkpoint (under its `checkpoint.dir`, else <run>/checkpoints), or a checkpoint folder
    and the run folder that holds it (the nearest folder above with a run's config.json).
    Raises `RunError` with what is missing."""
    path = Path(path)
    if not path.is_dir():
        raise RunError(f"--run={path}: no such folder")
    record = read_record(path)
    if record is not None:
        saved = record["config"].get("checkpoint", {}).get("dir") or ""
        root = Path(saved) if saved else path / "checkpoints"
        last = checkpoints.latest(root)
        if last is None:
            raise RunError(f"--run={path}: no complete checkpoint under {root} (one with "
                           f"{checkpoints.LOOP_STATE}); the run has not saved one yet")
        return path, last
    if not (path / checkpoints.LOOP_STATE).exists() and not (path / RECORD).exists():
        raise RunError(f"--run={path}: neither a run folder (no {RECORD} of a run) nor a "
                       "checkpoint folder (no config.json, no loop_state.json)")
    for parent in list(path.resolve().parents)[:3]:
        if read_record(parent) is not None:
            return parent, path
    raise RunError(f"--run={path}: no run folder above this checkpoint holds the run's "
                   f"{RECORD}; evaluate it with --config=<the config it was trained with> "
                   f"--config.model.path={path} instead")


def step_of(checkpoint: Path) -> str:
    """"200" for .../step_200 (its loop state's step where the name says none)."""
    name = Path(checkpoint).name
    if name.startswith("step_") and name[5:].isdigit():
        return name[5:]
    try:
        return str(checkpoints.load_loop_state(checkpoint)["step"])
    except (OSError, KeyError, ValueError):
        return name


def saved_config(run: Path):
    """(the run's config as a ConfigDict, notes): configs/base.py's fields with the values of
    <run>/config.json, each as base.py types it (JSON lists back to tuples); a saved key that
    base.py no longer has, or a value its field cannot take, is left out with a note, and a
    field the run's config lacks keeps base.py's default, also noted."""
    from configs import base
    record = read_record(run)
    if record is None:
        raise RunError(f"{run}: no run {RECORD}")
    cfg = base.get_config()
    saved, notes = flatten(record["config"]), []
    fields = flatten(json.loads(json.dumps(cfg.to_dict(), default=str)))
    for key, value in saved.items():
        if key not in fields:
            notes.append(f"{key}={value!r} is no field of configs/base.py now: left out")
            continue
        try:
            _set(cfg, key, _tuples(value) if isinstance(_get(cfg, key), tuple) else value)
        except (TypeError, ValueError, AttributeError, KeyError) as e:
            notes.append(f"{key}={value!r} cannot be set ({e}): configs/base.py's "
                         f"{_get(cfg, key)!r} kept")
    for key in sorted(fields.keys() - saved.keys()):
        notes.append(f"{key} is not in {run / RECORD}: configs/base.py's {fields[key]!r}")
    return cfg, notes


@dataclasses.dataclass
class Evaluation:
    """What `evaluation_config` settles for `--run`."""

    cfg: object  # the ConfigDict to evaluate with; model.path is the checkpoint
    folder: Path  # the run folder
    checkpoint: Path
    notes: list[str]  # how the saved config was read (keys left out, defaults kept)
    warnings: list[str]  # settings that differ from what the run trained with

    @property
    def out(self) -> Path:
        """The report's default folder: <run>/eval_<step>."""
        return self.folder / f"eval_{step_of(self.checkpoint)}"


def evaluation_config(run: str | Path, parsed, argv: list[str]) -> Evaluation:
    """How to evaluate `--run=run`: the run's saved config (`saved_config`; its notes) with the
    command line's `--config.<key>` overrides on top, their values as absl parsed them into
    `parsed` (the `--config` flag's config); or, where `argv` names a config file, `parsed`
    itself. `model.path` is the checkpoint. The warnings name each `TRAINED_ON` setting that
    differs from the run's. Raises `RunError` where `run` is no run or checkpoint, or
    `--config.model.path` names another model."""
    from common.config_help import config_file_given, override_keys
    folder, checkpoint = locate(run)
    keys = override_keys(argv, parsed)
    if "model.path" in keys:
        raise RunError(f"--run={run} and --config.model.path both name the model: give one")
    if config_file_given(argv):
        cfg, notes = parsed, []
    else:
        cfg, notes = saved_config(folder)
        with cfg.unlocked():
            for key in keys:
                _set(cfg, key, _get(parsed, key))
    warnings = [f"{line} ({folder / RECORD}): this evaluates another task than the run's"
                for line in trained_on_changes(read_record(folder)["config"], cfg)]
    with cfg.unlocked():
        cfg.model.path = str(checkpoint)
    return Evaluation(cfg, folder, checkpoint, notes, warnings)


def trained_on_changes(saved: dict, cfg) -> list[str]:
    """One line per `TRAINED_ON` setting whose value in `cfg` (a ConfigDict) differs from the
    run's config `saved` (config.json's "config"), values compared as JSON holds them."""
    before = flatten(saved)
    after = flatten(json.loads(json.dumps(cfg.to_dict(), default=str)))
    return [f"{key}={after.get(key)!r} differs from {before.get(key)!r}, what the run trained "
            "with" for key in sorted(before.keys() | after.keys())
            if key.startswith(TRAINED_ON) and before.get(key) != after.get(key)]


def _tuples(value):
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _get(cfg, key: str):
    for part in key.split("."):
        cfg = cfg[part]
    return cfg


def _set(cfg, key: str, value) -> None:
    *sections, name = key.split(".")
    for part in sections:
        cfg = cfg[part]
    cfg[name] = value
