"""The entry points' command line (common.cli): a run that returns prints its summary line and
exits 0, its exit handlers run; a failing run exits with its error."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHILD = """
import atexit, os
from common import cli

def train(config, workdir):
    if os.environ.get("FAIL_RUN"):
        raise RuntimeError("the run failed")
    return {"train/reward_mean": 0.5}

atexit.register(lambda: print("exit handler ran", flush=True))
cli.main(train, rank=lambda: 0)
"""


@pytest.mark.parametrize("fail", [False, True])
def test_a_run_prints_its_summary_or_fails_with_its_error(tmp_path, fail):
    args = [sys.executable, "-c", CHILD, "--config=configs/cpu.py", f"--workdir={tmp_path}"]
    env = dict(os.environ, FAIL_RUN="1" if fail else "")
    out = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    if fail:
        assert out.returncode != 0 and "the run failed" in out.stderr
        assert "done:" not in out.stdout
    else:
        assert out.returncode == 0, out.stderr
        assert f"done: {tmp_path} reward 0.500" in out.stdout
    assert "exit handler ran" in out.stdout


BUCKET_CHILD = """
from pathlib import Path
from common import cli

def train(config, workdir):
    assert Path(workdir).is_dir() and "://" not in workdir  # a local folder
    (Path(workdir) / "metrics.jsonl").write_text('{"step": 1}\\n')
    (Path(workdir) / "checkpoint_dir.txt").write_text(config.checkpoint.dir)
    return {"train/reward_mean": 0.5, "eval/greedy_first_try_accuracy": 0.5,
            "eval/greedy_accuracy": 0.875, "eval/baseline_first_try": 0.25,
            "eval/baseline_with_feedback": 0.75}

cli.main(train, rank=lambda: 0)
"""


def test_a_bucket_as_workdir_gets_the_run_and_its_checkpoints(tmp_path):
    """--workdir=gs://...: the run writes a local folder that reaches the bucket (its report
    included), the checkpoints go to <workdir>/checkpoints, and nothing named "gs:" appears
    locally (pathlib would make one of the URL)."""
    from common import storage
    from tests.fake_gcs import fake_gcs

    with fake_gcs() as bucket:
        url = f"gs://{bucket}/cli-run"
        args = [sys.executable, "-c", BUCKET_CHILD, f"--config={ROOT}/configs/cpu.py",
                f"--workdir={url}"]
        out = subprocess.run(args, cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert f"done: {url} reward 0.500" in out.stdout
        assert storage.path(f"{url}/metrics.jsonl").read_text() == '{"step": 1}\n'
        assert storage.path(f"{url}/checkpoint_dir.txt").read_text() == f"{url}/checkpoints"
        assert "no skill" in storage.path(f"{url}/eval/eval.md").read_text()
        assert storage.path(f"{url}/eval/eval.png").exists()
    assert not list(tmp_path.iterdir())


EVAL_CHILD = """
from common import cli

def train(config, workdir):
    return {"train/reward_mean": 0.5, "eval/greedy_first_try_accuracy": 0.5,
            "eval/greedy_accuracy": 0.875, "eval/baseline_first_try": 0.25,
            "eval/baseline_with_feedback": 0.75}

cli.main(train, rank=lambda: 0)
"""


def test_the_last_evaluation_is_printed_beside_its_baselines(tmp_path):
    """Both entry points (torch and JAX) end with the last evaluation's table, a no-skill
    column beside every accuracy, also written to <workdir>/eval."""
    args = [sys.executable, "-c", EVAL_CHILD, "--config=configs/cpu.py", f"--workdir={tmp_path}"]
    out = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "| | greedy | no skill |" in out.stdout
    assert "| first try (turn 1) | 0.500 | 0.250 |" in out.stdout
    assert "| with feedback (≤3 turns) | 0.875 | 0.750 |" in out.stdout
    assert "eval 0.875 no-skill 0.750" in out.stdout
    assert (tmp_path / "eval" / "eval.md").read_text() in out.stdout


@pytest.mark.parametrize("entry", ["geo3k_torch.main", "geo3k_jax.train"])
@pytest.mark.parametrize("case", ["file_workdir", "negative_lr"])
def test_bad_input_stops_before_the_model_loads(entry, case, tmp_path):
    """Through the real entry points: a workdir that is a file, or a negative learning rate,
    stops with one clear line naming the setting, before any model is built or loaded (no
    tiny checkpoint is made: model.tiny_dir points into tmp_path), and the file is untouched."""
    workdir = tmp_path / "run"
    args = [sys.executable, "-m", entry, "--config=configs/cpu.py",
            f"--config.model.tiny_dir={tmp_path / 'tiny'}",
            f"--config.data.synthetic_dir={tmp_path / 'data'}"]
    if case == "file_workdir":
        workdir.write_text("not a folder")
        want = f"workdir {workdir} is a file"
    else:
        args.append("--config.train.lr=-0.001")
        want = "train.lr=-0.001 must be > 0.0"
    out = subprocess.run(args + [f"--workdir={workdir}"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode != 0 and want in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "tiny").exists() and not (tmp_path / "data").exists()
    if case == "file_workdir":
        assert workdir.read_text() == "not a folder"


def test_each_range_is_enforced():
    """Every range of common.prepare.RANGES refuses a value just outside it and takes its
    bound (where the bound is allowed)."""
    from common.prepare import RANGES, check_ranges
    from configs import base
    for key, (low, high, low_ok) in RANGES.items():
        section, name = key.split(".")
        below = low - 1 if isinstance(low, int) else low - 0.5
        cases = [(low, low_ok), (below, False)] + ([(high + 1, False)] if high is not None
                                                   else [])
        for value, ok in cases:
            cfg = base.get_config()
            cfg[section][name] = type(cfg[section][name])(value)
            if key in ("train.beta1", "train.beta2") and value >= 1:
                ok = False
            if ok:
                check_ranges(cfg)
            else:
                with pytest.raises(ValueError, match=key.replace(".", r"\.")):
                    check_ranges(cfg)
