"""The entry points' command line (common.cli): a run that returns skips the interpreter's final
collection; its summary line and exit handlers are unchanged; a failing run is left as it is."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHILD = """
import atexit, gc, os
from common import cli

def train(config, workdir):
    if os.environ.get("FAIL_RUN"):
        raise RuntimeError("the run failed")
    return {"train/reward_mean": 0.5}

atexit.register(lambda: print("frozen", gc.get_freeze_count() > 0, flush=True))
cli.main(train, rank=lambda: 0)
"""


@pytest.mark.parametrize("fail", [False, True])
def test_a_finished_run_exits_without_a_last_collection(tmp_path, fail):
    args = [sys.executable, "-c", CHILD, "--config=configs/cpu.py", f"--workdir={tmp_path}"]
    env = dict(os.environ, FAIL_RUN="1" if fail else "")
    out = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    if fail:
        assert out.returncode != 0 and "the run failed" in out.stderr
        assert "frozen False" in out.stdout  # a failure keeps Python's usual exit
    else:
        assert out.returncode == 0, out.stderr
        assert f"done: {tmp_path} reward 0.500" in out.stdout and "frozen True" in out.stdout
