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
