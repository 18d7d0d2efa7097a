"""What a run leaves for people: metrics.jsonl, TensorBoard scalars, a reward curve, rollout dumps.

Backend-agnostic (no torch, no jax): TensorBoard events are written with the `tensorboard`
package's own event writer, the curve with matplotlib (Agg).

Workdir layout written here:
    metrics.jsonl              one JSON object per step: {"step": N, "train/...": ..., ...}
    config.json                the resolved config, the command line, the package versions, the
                               machine and the git commit, and every launch after the first
                               (`write_config`; a resumed run names what it changed)
    events.out.tfevents.*      the same scalars for TensorBoard (and wandb, when a project is set)
    curve.png                  reward and accuracy per step (train), accuracy per eval, with
                               the no-skill baselines (chance, elimination) drawn across
    rollouts/step_<N>.jsonl    every trajectory of step N (see `dump_rollouts`)
    rollouts/images/<uid>_<k>.png   the images those trajectories refer to
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from common.rollout import Trajectory


VERSIONED = ("numpy", "torch", "transformers", "jax", "flax", "optax", "sglang")


def write_config(workdir: str | os.PathLike, config: dict, resume: bool) -> list[str]:
    """Record this launch in <workdir>/config.json. The file holds `config`, the run's config
    now (ConfigDict.to_dict(), as JSON has it: tuples are lists); the first launch's command
    line, versions, machine and git commit at the top, as a fresh run writes them; and
    `launches`, every launch in order (time, command line, git commit, versions, machine; the
    first with its whole config, each later one with the keys it changed, {key: [before,
    after]}). A launch never rewrites what an earlier one recorded. Returns, for a resumed
    run, what differs from the config before it ("train.lr: 0.001 -> 0.0005", sorted; values
    compared as JSON holds them, `train.resume` left out); empty otherwise."""
    path = Path(workdir) / "config.json"
    now = json.loads(json.dumps(config, default=str))
    launch = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "argv": sys.argv,
              "git": git_commit(), "python": sys.version.split()[0], "versions": versions(),
              "machine": machine()}
    record = json.loads(path.read_text()) if path.exists() else None
    if not isinstance(record, dict) or not isinstance(record.get("config"), dict):
        record = None  # none yet (or not one of ours): this launch is the first
    if record is None:
        record = {"config": now, **{k: launch[k] for k in ("argv", "python", "versions",
                                                           "machine", "git")},
                  "launches": [dict(launch, resume=resume, config=now)]}
        changed = {}
    else:
        if "launches" not in record:  # written before launches were kept: its one launch
            record["launches"] = [{k: record[k] for k in ("argv", "python", "versions",
                                                          "machine", "config") if k in record}]
        before, after = flatten(record["config"]), flatten(now)
        changed = {k: [before.get(k, ABSENT), after.get(k, ABSENT)]
                   for k in sorted(before.keys() | after.keys())
                   if before.get(k, ABSENT) != after.get(k, ABSENT) and k != "train.resume"}
        record["config"] = now
        record["launches"].append(dict(launch, resume=resume, changed=changed))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(".config.json.tmp")
    tmp.write_text(json.dumps(record, indent=1, default=str))
    os.replace(tmp, path)
    if not resume:
        return []
    return [f"{k}: {_short(a)} -> {_short(b)}" for k, (a, b) in changed.items()]


ABSENT = "(absent)"  # a key one config has and the other lacks


def _short(value, width: int = 60) -> str:
    """repr of `value`, at most `width` characters (a long value must not bury the others)."""
    text = repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."


def versions() -> dict[str, str]:
    """The installed versions of the packages that decide the numbers (`VERSIONED`)."""
    out = {}
    for name in VERSIONED:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def git_commit() -> dict | None:
    """{"commit": the checkout's HEAD, "dirty": whether tracked files differ from it} for the
    code this process runs, None where that is not a git checkout (an installed wheel)."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if head.returncode:
            return None
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain",
                                 "--untracked-files=no"], capture_output=True, text=True,
                                timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": head.stdout.strip(),
            "dirty": bool(status.stdout.strip()) if status.returncode == 0 else None}


def machine() -> dict[str, object]:
    """The CPU's model name (/proc/cpuinfo where there is one, else `platform.processor()`),
    the platform, the cores there are and the cores this process may use."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": cpu, "platform": platform.platform(), "cores": os.cpu_count(),
            "usable_cores": usable}


def flatten(d: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out |= flatten(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


class RunLog:
    """Appends one line of metrics per step and keeps the TensorBoard file and curve current."""

    def __init__(self, workdir: str | os.PathLike, tensorboard: bool = True,
                 wandb_project: str = "", config: dict | None = None):
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        self._tb = None
        if tensorboard:
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
            self._tb = EventFileWriter(str(self.dir))
        self._wandb = None
        if wandb_project:
            try:
                import wandb
            except ImportError:
                raise SystemExit("log.wandb_project is set but wandb is not installed: "
                                 "pip install wandb, or leave log.wandb_project empty") from None
            self._wandb = wandb.init(project=wandb_project, dir=str(self.dir), config=config,
                                     name=self.dir.name, resume="allow")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self._tb is not None:
            self._write_tb(step, metrics)
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)

    def _write_tb(self, step: int, metrics: dict[str, float]) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=k, simple_value=float(v)) for k, v in metrics.items()
                  if isinstance(v, (int, float)) and math.isfinite(float(v))]
        self._tb.add_event(Event(wall_time=time.time(), step=step, summary=Summary(value=values)))
        self._tb.flush()

    def rows(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def truncate_after(self, step: int) -> None:
        """Drop rows past `step` (a resumed run rewrites the steps after its checkpoint)."""
        kept = [r for r in self.rows() if r["step"] <= step]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def plot(self, name: str = "curve.png") -> Path:
        """Train reward (raw and 10-step mean), accuracy when it differs from the reward, tool-call
        rate, and eval accuracy as points, against step; an SFT run's loss instead of the
        reward. Returns the PNG path."""
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rows = self.rows()
        fig, ax = plt.subplots(figsize=(8, 5.5), dpi=100)
        pts = [(r["step"], r["train/reward_mean"]) for r in rows if "train/reward_mean" in r]
        sft = not pts  # an SFT run (geo3k_torch.sft) has a loss and no reward
        loss = [(r["step"], r["train/loss"]) for r in rows if "train/loss" in r]
        if sft and loss:
            steps, vals = map(np.asarray, zip(*loss))
            ax.plot(steps, vals, color="tab:red", lw=1.5, label="SFT loss per assistant token")
        if pts:
            steps, reward = map(np.asarray, zip(*pts))
            ax.plot(steps, reward, color="tab:blue", alpha=0.3, lw=1)
            ax.plot(steps, _running_mean(reward, 10), color="tab:blue", lw=2.2,
                    label="train reward (10-step mean)")
        for key, label, color in (("train/accuracy", "train accuracy (10-step mean)", "tab:cyan"),
                                  ("train/tool_call_rate", "tool-call rate (10-step mean)",
                                   "tab:purple")):
            pts = [(r["step"], r[key]) for r in rows if key in r]
            if pts and not (key == "train/accuracy" and _same(rows, key, "train/reward_mean")):
                steps, vals = map(np.asarray, zip(*pts))
                ax.plot(steps, _running_mean(vals, 10), ":", color=color, lw=1.5, label=label)
        for key, label, style in (
                ("eval/greedy_accuracy", "eval with feedback (greedy)", "o--"),
                ("eval/sampled_accuracy", "eval with feedback (sampled)", "o--"),
                ("eval/greedy_first_try_accuracy", "eval first try (greedy)", "s--"),
                ("eval/perception/greedy_accuracy", "perception: with feedback (greedy)", "^-"),
                ("eval/perception/greedy_first_try_accuracy", "perception: first try (greedy)",
                 "v-")):
            pts = [(r["step"], r[key]) for r in rows if key in r]
            if pts:
                ax.plot(*zip(*pts), style, label=label)
        for key, label, style in (
                ("eval/baseline_first_try", "no skill: first try (chance)", (0, (2, 2))),
                ("eval/baseline_with_feedback", "no skill: with feedback (elimination)", "-")):
            last = [r[key] for r in rows if key in r]
            if last:  # the test split's baseline (the train split is drawn alike)
                ax.axhline(last[-1], color="black", ls=style, lw=1, label=label)
        ax.set_xlabel("step")
        if sft:
            ax.set_ylim(bottom=0)
        else:
            ax.set_ylim(-0.02, 1.12)
        ax.grid(alpha=0.3)
        if sft:
            ax.legend(loc="upper right", fontsize=8)
        else:  # below the axes: the curves and baselines stay visible
            ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), fontsize=8, ncol=2)
        ax.set_title("geo3k-rl: SFT loss" if sft else "geo3k-rl: reward and accuracy")
        fig.tight_layout()
        out = self.dir / name
        tmp = out.with_suffix(".tmp.png")
        fig.savefig(tmp)
        plt.close(fig)
        os.replace(tmp, out)  # a viewer never sees a half-written picture
        return out

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _running_mean(x: np.ndarray, window: int) -> np.ndarray:
    """Mean of the last `window` values at each point (fewer at the start)."""
    c = np.cumsum(np.insert(np.asarray(x, np.float64), 0, 0.0))
    n = np.minimum(np.arange(1, len(x) + 1), window)
    return (c[1:] - c[np.arange(1, len(x) + 1) - n]) / n


def _same(rows: list[dict], a: str, b: str) -> bool:
    return all(r.get(a) == r.get(b) for r in rows)


def _jsonable(v):
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def dump_rollouts(path: str | os.PathLike, trajs: Sequence[Trajectory],
                  decode: Callable[[Sequence[int]], str]) -> None:
    """One JSON line per trajectory: ids, loss mask, rollout log-probs, reward, status, turns
    (text, env info, feedback), the full decoded text and the PNG files of its images (saved
    once per prompt next to the dump, in `images/`)."""
    path = Path(path)
    img_dir = path.parent / "images"
    img_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with tmp.open("w") as f:
        for t in trajs:
            images = []
            for k, im in enumerate(t.images):
                name = f"{_safe(t.uid)}_{k}.png"
                if not (img_dir / name).exists() and hasattr(im, "save"):
                    im.save(img_dir / name)
                images.append(f"images/{name}")
            row = {"uid": t.uid, "group_id": t.group_id, "sample_idx": t.sample_idx,
                   "answer": t.answer, "status": t.status, "reward": t.reward,
                   "correct": t.correct, "correct_turn": t.correct_turn,
                   "prompt_len": t.prompt_len, "token_ids": t.token_ids.tolist(),
                   "loss_mask": t.loss_mask.tolist(),
                   "rollout_logprobs": [round(float(x), 6) for x in t.rollout_logprobs],
                   "turns": [{"text": u.text, "finish_reason": u.finish_reason,
                              "info": u.info, "feedback": u.observation} for u in t.turns],
                   "text": decode(t.token_ids.tolist()), "images": images}
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, path)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in str(name))[:80]
