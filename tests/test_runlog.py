"""Run outputs: metrics lines, TensorBoard scalars, the curve, rollout dumps."""

import json
import os

import numpy as np
import pytest
from PIL import Image

from common.runlog import RunLog, dump_rollouts
from common.rollout import Trajectory, Turn


def test_metrics_tensorboard_and_curve(tmp_path):
    log = RunLog(tmp_path)
    for step in range(1, 6):
        log.log(step, {"train/reward_mean": step / 10, "train/accuracy": step / 10,
                       "train/tool_call_rate": 0.5, "eval/greedy_accuracy": 0.2,
                       "train/grad_norm": float("nan")})
    log.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[2]["train/reward_mean"] == 0.3 and rows[0]["train/grad_norm"] == "nan"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    scalars = events.Scalars("train/reward_mean")
    assert [(s.step, round(s.value, 6)) for s in scalars] == [(i, i / 10) for i in range(1, 6)]
    assert "train/grad_norm" not in events.Tags()["scalars"]  # non-finite values are not plotted
    png = log.plot()
    assert Image.open(png).size == (800, 550)
    log.truncate_after(3)
    assert [r["step"] for r in log.rows()] == [1, 2, 3]


def test_wandb_requested_but_missing_is_a_clear_error(tmp_path, monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_wandb(name, *a, **k):
        if name == "wandb":
            raise ImportError("no wandb")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(SystemExit, match="wandb"):
        RunLog(tmp_path, tensorboard=False, wandb_project="geo3k")


def test_dump_rollouts(tmp_path):
    img = Image.new("RGB", (20, 10), "red")
    t = Trajectory("train-3", 7, 1, "12", np.array([5, 6, 7, 8]), np.array([0, 0, 1, 1], np.int8),
                   np.array([0, 0, -0.5, -0.25], np.float32), 2, [img],
                   [Turn(2, 4, "hi", "stop", {"reason": "wrong", "tool_score": 0.0}, "Wrong")],
                   "completed", 0.0)
    dump_rollouts(tmp_path / "rollouts" / "step_1.jsonl", [t], lambda ids: "".join(map(str, ids)))
    row = json.loads((tmp_path / "rollouts" / "step_1.jsonl").read_text())
    assert row["token_ids"] == [5, 6, 7, 8] and row["loss_mask"] == [0, 0, 1, 1]
    assert row["rollout_logprobs"] == [0, 0, -0.5, -0.25] and row["text"] == "5678"
    assert row["turns"][0]["feedback"] == "Wrong" and row["group_id"] == 7
    assert Image.open(tmp_path / "rollouts" / row["images"][0]).size == (20, 10)


def test_the_config_is_recorded_and_a_resume_names_what_changed(tmp_path):
    """config.json holds the resolved config, the command line, the versions and the machine
    (this one's CPU model and usable cores, which a build's rounding depends on); a resumed run
    with another learning rate and a new key is told exactly those (train.resume itself is not
    a change), and the file then holds the resumed run's config."""
    from common.runlog import write_config
    cfg = {"train": {"lr": 1e-3, "resume": False, "steps": 10}, "seed": 0}
    assert write_config(tmp_path, cfg, resume=False) == []
    record = json.loads((tmp_path / "config.json").read_text())
    assert record["config"] == cfg and isinstance(record["argv"], list)
    assert "numpy" in record["versions"] and record["python"]
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert record["machine"]["usable_cores"] == usable and record["machine"]["cores"] >= usable
    if os.path.exists("/proc/cpuinfo"):
        names = [line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                 if line.startswith("model name")]
        assert names and record["machine"]["cpu"] == names[0]
    again = {"train": {"lr": 5e-4, "resume": True, "steps": 10}, "seed": 0, "extra": 1}
    assert write_config(tmp_path, again, resume=True) == [
        "extra: '(absent)' -> 1", "train.lr: 0.001 -> 0.0005"]
    assert json.loads((tmp_path / "config.json").read_text())["config"] == again
    assert write_config(tmp_path, again, resume=True) == []


def test_launches_are_appended_and_only_real_changes_named(tmp_path, monkeypatch):
    """A config with tuples (jax.rules) resumed from its own config.json is no change (JSON
    holds lists); a real change is named first even beside a long value, shortened; every
    launch is appended (its command line, git commit, versions) and the first config, command
    line and commit stay."""
    import subprocess
    import sys

    from common.runlog import write_config
    rules = tuple((f"layer_{i}\\.weight$", ("tensor", "fsdp")) for i in range(40))
    first = {"jax": {"rules": rules}, "train": {"lr": 1e-3, "resume": False}}
    monkeypatch.setattr(sys, "argv", ["geo3k_torch.main", "--config=configs/cpu.py"])
    assert write_config(tmp_path, first, resume=False) == []
    monkeypatch.setattr(sys, "argv", ["geo3k_torch.main", "--config.train.resume=True"])
    same = {"jax": {"rules": rules}, "train": {"lr": 1e-3, "resume": True}}
    assert write_config(tmp_path, same, resume=True) == []  # tuples against lists: no change
    longer = {"jax": {"rules": rules + (("x", ()),)}, "train": {"lr": 5e-4, "resume": True}}
    changed = write_config(tmp_path, longer, resume=True)
    assert [c.split(":")[0] for c in changed] == ["jax.rules", "train.lr"]
    assert changed[1] == "train.lr: 0.001 -> 0.0005"
    assert len(changed[0]) < 140 and "..." in changed[0]  # 40 rules would be 2,000 characters

    record = json.loads((tmp_path / "config.json").read_text())
    assert record["config"]["train"]["lr"] == 5e-4  # the run's config now
    assert record["argv"] == ["geo3k_torch.main", "--config=configs/cpu.py"]  # the first's
    launches = record["launches"]
    assert [x["argv"][-1] for x in launches] == ["--config=configs/cpu.py",
                                                 "--config.train.resume=True",
                                                 "--config.train.resume=True"]
    assert launches[0]["config"]["train"] == {"lr": 1e-3, "resume": False}  # kept
    assert launches[1]["changed"] == {}
    assert launches[2]["changed"]["train.lr"] == [1e-3, 5e-4]
    head = subprocess.run(["git", "-C", os.path.dirname(os.path.dirname(__file__)), "rev-parse",
                           "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:  # a git checkout: its commit, and whether it is dirty
        assert all(x["git"]["commit"] == head.stdout.strip() for x in launches)
        assert record["git"]["commit"] == head.stdout.strip()
        assert all(isinstance(x["git"]["dirty"], bool) for x in launches)
    assert all("numpy" in x["versions"] and x["time"] for x in launches)


def test_a_config_json_of_before_launches_gets_its_launch_kept(tmp_path):
    from common.runlog import write_config
    old = {"config": {"train": {"lr": 1e-3}}, "argv": ["first", "launch"], "python": "3.11",
           "versions": {}, "machine": {}}
    (tmp_path / "config.json").write_text(json.dumps(old))
    assert write_config(tmp_path, {"train": {"lr": 2e-3}}, resume=True) == [
        "train.lr: 0.001 -> 0.002"]
    record = json.loads((tmp_path / "config.json").read_text())
    assert record["argv"] == ["first", "launch"]
    assert record["launches"][0]["config"] == {"train": {"lr": 1e-3}}
    assert record["launches"][1]["changed"] == {"train.lr": [1e-3, 2e-3]}
