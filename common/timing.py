"""`timed`: how long each phase of a step took, into a metrics dict."""

from __future__ import annotations

import contextlib
import time


@contextlib.contextmanager
def timed(times: dict[str, float], name: str):
    """Adds the seconds spent inside the block to `times[f"time_{name}"]`."""
    start = time.perf_counter()
    try:
        yield
    finally:
        key = f"time_{name}"
        times[key] = times.get(key, 0.0) + time.perf_counter() - start
