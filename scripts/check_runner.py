"""What the machine checks (scripts/gpu_check.py, scripts/tpu_check.py) share: a section's rows
written to its JSON as they come, the end of a log, the versions of the packages that matter.

    record_rows(lambda: SECTIONS[name](settings), path, {"device": ...})
"""

from __future__ import annotations

import importlib.metadata
import json
import traceback
from pathlib import Path
from typing import Callable, Iterable, Sequence


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
