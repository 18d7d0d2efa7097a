"""What the machine checks (scripts/gpu_check.py, scripts/tpu_check.py) share: a section run in
a process group of its own and killed with it, its rows written to its JSON as they come, the end
of a log, the versions of the packages that matter.

    result = run_section(cmd, path, log, timeout)    # in the check: cmd runs one section...
    record_rows(lambda: SECTIONS[name](settings), path, {"device": ...})   # ...which does this
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import resource
import signal
import subprocess
import time
import traceback
from pathlib import Path
from typing import Callable, Iterable, Sequence

STOP_S = 10.0  # a section past its time is killed (its process group); this long to be gone


def run_section(cmd: list[str], path: Path, log: Path, timeout: float,
                env: dict | None = None) -> dict:
    """`cmd`, a section that writes its JSON to `path` (`record_rows`), in a session of its own
    with its output in `log`, for at most `timeout` seconds; then its process group is killed
    (`stop`), also when this process is interrupted: what the section started (compile passes,
    engines) would hold the devices through the next one. Returns that JSON with the section's
    `seconds`, its processes' `cpu_s` (on a busy host wall time says little), and the status
    "timeout", or "failed" where it exited before writing its end."""
    path.unlink(missing_ok=True)
    start, cpu = time.perf_counter(), _children_cpu_s()
    with open(log, "w") as f:
        child = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                 start_new_session=True)
        try:
            rc = child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:  # (also on KeyboardInterrupt)
            stop(child)
    result = json.loads(path.read_text()) if path.exists() else {"rows": []}
    result["seconds"] = time.perf_counter() - start
    result["cpu_s"] = _children_cpu_s() - cpu
    if rc is None:
        result.update(status="timeout", error=f"stopped after {timeout:.0f} s\n" + tail(log))
    elif result.get("status") not in ("ok", "failed"):  # it died before writing its end
        result.update(status="failed",
                      error=f"the process exited with status {rc}\n" + tail(log))
    return result


def stop(child: subprocess.Popen) -> None:
    """Kill `child`'s process group and wait at most `STOP_S` for `child` (a process stuck in a
    driver call may take longer: it is left, and the check goes on)."""
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # the group is gone already
        pass
    try:
        child.wait(timeout=STOP_S)
    except subprocess.TimeoutExpired:
        pass


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def record_rows(rows: Callable[[], Iterable[dict]], path: Path, fields: dict | None = None
                ) -> None:
    """Run a section (`rows()` yields its rows), writing {status, rows, **fields} to `path`
    after every row (a crash keeps what came before); a row marked failed, or the section
    raising (its traceback kept), makes the status "failed"."""
    result = {"status": "running", **(fields or {}), "rows": []}

    def write():
        path.write_text(json.dumps(result, indent=1, default=str))

    write()
    try:
        for row in rows():
            result["rows"].append({"status": "ok", **row})
            write()
        failed = any(r["status"] == "failed" for r in result["rows"])
        result["status"] = "failed" if failed else "ok"
    except Exception:  # noqa: BLE001  (recorded, and the exit status says so)
        result.update(status="failed", error=traceback.format_exc())
    write()


def tail(log: Path, lines: int = 40) -> str:
    """The last `lines` lines of a log."""
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def versions(packages: Sequence[str]) -> dict[str, str]:
    """Each package's installed version, or "absent"."""
    out = {}
    for pkg in packages:
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = "absent"
    return out
