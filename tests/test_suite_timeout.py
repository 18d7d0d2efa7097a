"""The suite's own time limit (pyproject's pytest-timeout settings) ends a test that outlives it
with a named failure and every thread's stack, and lets the run end: a test interrupted in
the middle of JAX work can leave threads that never finish (a JAX engine's thread blocked on a
computation whose host callback waits behind it), and a run that waits for them never reports."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

HANGS = '''
import threading, time

def test_outlives_the_limit():
    threading.Thread(target=threading.Event().wait, name="never-ends").start()
    time.sleep(60)
'''


def test_a_test_past_the_limit_fails_by_name_and_the_run_ends(tmp_path):
    """A test that sleeps past a 2 s limit after starting a thread that never ends: pytest
    returns (within 60 s), the test fails, and the report names it and shows the stuck
    thread's stack. (With pytest-timeout's signal method the test fails but the process then
    waits for the thread forever.)"""
    (tmp_path / "test_hangs.py").write_text(HANGS)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
         "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path), "-o", "timeout=2",
         str(tmp_path / "test_hangs.py")],
        capture_output=True, text=True, timeout=60, cwd=tmp_path)
    out = run.stdout + run.stderr
    assert run.returncode != 0, out
    assert "Timeout" in out and "test_outlives_the_limit" in out, out
    assert "never-ends" in out, out  # the stuck thread's stack is printed
