"""Answer grading for Geometry3K: `grade_answer` for a bare answer, `math_reward` for a response.

    grade_answer("2.5", "\\frac{5}{2}")               -> True
    math_reward("... so \\boxed{8\\sqrt{3}}", "\\sqrt{192}") -> 1.0

Two stages:
  1. A fast path in plain Python: both sides are normalized (see `normalize`) and, when both are
     simple numbers (decimals, a/b, \\frac{a}{b}, k\\sqrt{n}, k\\pi), compared numerically.
     Most Geometry3K answers end here, with no process hop.
  2. Everything else goes to math-verify (LaTeX extraction only: its Python-expression parser
     is never used on model text) in worker PROCESSES (`python -m common.reward`, JSON lines over
     pipes; started on first use, at most MAX_WORKERS, reused). math-verify's own timeouts use signals,
     which only work on the main thread; a reward computed in a rollout thread would hang on an
     exponent tower. The worker is killed when a call outlives its hard wall-clock limit, the
     call counts as wrong, the timeout is counted in `STATS`, and a fresh worker replaces it.

Normalizations added on top of math-verify (decision log):
  * `$...$`, `\\text{..}`/`\\mathrm{..}` units, degree signs (`^\\circ`, `^{\\circ}`, `°`),
    trailing unit words (cm, units^2, ...), `\\dfrac`/`\\tfrac`, `\\left`/`\\right`, spacing
    commands and a leading `x =` are removed.
  * A comma between digits is a thousands separator only in the 1,234 pattern; `(1,2)` stays.
  * `rel_tol` > 0 accepts numbers within that relative tolerance (rounded labels).
  * An empty answer, or one longer than `MAX_ANSWER_CHARS`, is wrong without any parsing.
Rewards are binary: exactly 1.0 or 0.0. Model text is never executed.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import queue
import re
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

DEFAULT_TIMEOUT = 5.0
MAX_ANSWER_CHARS = 1000
MAX_WORKERS = 4

_UNIT_WORDS = r"(?:square\s+)?(?:units?|cm|mm|km|m|in|inches|inch|ft|feet|foot|yd|yards?|meters?|" \
              r"centimeters?|degrees?|deg|sq)\.?"


def extract_last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` / `\\fbox{...}` (brace-matched), or of a bare
    `\\boxed 5`; None if there is none or its braces never close."""
    if not isinstance(text, str):
        return None
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = start + (6 if text.startswith("\\boxed", start) else 5)
    rest = text[i:]
    if rest.startswith(" ") and not rest.lstrip().startswith("{"):
        m = re.match(r"\s+([^\s$]+)", rest)  # "\boxed 5"
        return m.group(1) if m else None
    if not rest.startswith("{"):
        return None
    depth = 0
    for j, ch in enumerate(rest):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return rest[1:j]
    return None


def normalize(s: str) -> str:
    """A canonical string form of an answer (see the module docstring)."""
    s = s.strip().strip("$").strip()
    s = re.sub(r"\\(?:text|mathrm|textbf|mbox|operatorname)\s*\{([^{}]*)\}", r" \1 ", s)
    s = re.sub(r"\^\s*\{?\s*\\circ\s*\}?|°|\\degree", "", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"\\left|\\right|\\[,;!: ]|\\q?quad", "", s)
    s = re.sub(r"^[a-zA-Z](?:_\{?\w+\}?)?\s*=\s*", "", s)  # "x = 5", "m_{1} = 5"
    s = re.sub(rf"(?<=[\d}}\s])\s*{_UNIT_WORDS}(?:\s*\^\s*\{{?[23]\}}?)?\s*$", "", s)
    s = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", s) if re.fullmatch(r"[\d,.]+", s) else s
    s = s.rstrip(".").strip()
    return re.sub(r"\s+", "", s)


_NUM = r"(?:\d+(?:\.\d*)?|\.\d+)"


def to_number(s: str) -> float | None:
    """The value of a normalized simple number: decimal, a/b, \\frac{a}{b}, k\\sqrt{n},
    \\frac{k\\sqrt{n}}{d}, k\\pi, optionally negative. None for anything else."""
    sign = -1.0 if s.startswith("-") else 1.0
    s = s[1:] if s[:1] in "+-" else s
    if re.fullmatch(_NUM, s):
        return sign * float(s)
    m = re.fullmatch(rf"({_NUM})/({_NUM})", s) or re.fullmatch(rf"\\frac\{{({_NUM})\}}\{{({_NUM})\}}", s)
    if m:
        den = float(m.group(2))
        return sign * float(m.group(1)) / den if den else None
    m = re.fullmatch(rf"({_NUM})?\\sqrt\{{?({_NUM})\}}?", s)
    if m:
        return sign * float(m.group(1) or 1) * math.sqrt(float(m.group(2)))
    m = re.fullmatch(rf"\\frac\{{({_NUM})?\\sqrt\{{?({_NUM})\}}?\}}\{{({_NUM})\}}", s)
    if m and float(m.group(3)):
        return sign * float(m.group(1) or 1) * math.sqrt(float(m.group(2))) / float(m.group(3))
    m = re.fullmatch(rf"({_NUM})?\\pi", s)
    if m:
        return sign * float(m.group(1) or 1) * math.pi
    return None


def _close(a: float, b: float, rel_tol: float) -> bool:
    return math.isclose(a, b, rel_tol=max(rel_tol, 1e-9), abs_tol=1e-9)


# ---- the math-verify worker process ---------------------------------------------------------

def _mv_compare(answer: str, truth: str, rel_tol: float) -> bool:
    """Runs in the worker: math-verify on LaTeX only, then the numeric tolerance."""
    from math_verify import LatexExtractionConfig, parse, verify

    cfg = [LatexExtractionConfig(boxed_match_priority=0)]
    gold = parse(f"${truth}$", extraction_config=cfg)
    pred = parse(f"${answer}$", extraction_config=cfg)
    if not gold or not pred:
        return False
    if verify(gold, pred):
        return True
    if rel_tol > 0:
        try:
            a, b = float(pred[0].evalf()), float(gold[0].evalf())
        except (TypeError, ValueError, AttributeError):
            return False
        return _close(a, b, rel_tol)
    return False


def _serve() -> None:
    """The worker's loop (`python -m common.reward`): one JSON request per stdin line, one JSON
    verdict per stdout line."""
    import json
    import sys

    for line in sys.stdin:
        try:
            answer, truth, rel_tol = json.loads(line)
            ok = bool(_mv_compare(answer, truth, rel_tol))
        except Exception:  # noqa: BLE001 - any parser failure is a wrong answer
            ok = False
        sys.stdout.write("1\n" if ok else "0\n")
        sys.stdout.flush()


class _Worker:
    """A `python -m common.reward` child process speaking JSON lines over its pipes."""

    def __init__(self):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(Path(__file__).resolve().parents[1])] + sys.path))
        self.proc = subprocess.Popen([sys.executable, "-m", "common.reward"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, env=env)

    def ask(self, answer: str, truth: str, rel_tol: float, deadline: float) -> bool | None:
        """The verdict, or None if none came before `deadline` (or the worker died)."""
        self.proc.stdin.write(json.dumps([answer, truth, rel_tol]) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [],
                                    max(deadline - time.monotonic(), 0.0))
        if not ready:
            return None
        line = self.proc.stdout.readline()
        return line.strip() == "1" if line else None

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=5)


class _Pool:
    """Up to MAX_WORKERS worker processes, each used by one call at a time, started lazily."""

    def __init__(self):
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._lock = threading.Lock()
        self._all: list[_Worker] = []

    def _take(self, deadline: float) -> _Worker | None:
        with self._lock:
            if self._idle.empty() and len(self._all) < MAX_WORKERS:
                w = _Worker()
                self._all.append(w)
                return w
        try:
            return self._idle.get(timeout=max(deadline - time.monotonic(), 0.0))
        except queue.Empty:
            return None

    def _drop(self, w: _Worker) -> None:
        w.kill()
        with self._lock:
            self._all.remove(w)

    def compare(self, answer: str, truth: str, rel_tol: float, timeout_s: float) -> bool | None:
        """math-verify's verdict, or None when the hard time limit ran out."""
        deadline = time.monotonic() + timeout_s
        w = self._take(deadline)
        if w is None:
            return None
        try:
            verdict = w.ask(answer, truth, rel_tol, deadline)
        except (OSError, ValueError):
            verdict = None
        if verdict is None:
            self._drop(w)  # hung or dead: a fresh one is started when needed
        else:
            self._idle.put(w)
        return verdict

    def shutdown(self) -> None:
        with self._lock:
            for w in self._all:
                w.kill()
            self._all = []
            self._idle = queue.Queue()


_POOL = _Pool()
atexit.register(_POOL.shutdown)


class RewardStats:
    """Thread-safe counters of grading calls, timeouts and slow-path (math-verify) calls."""

    def __init__(self):
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self._c = {"calls": 0, "timeouts": 0, "slow_path": 0}

    def add(self, key: str) -> None:
        with self._lock:
            self._c[key] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._c)


STATS = RewardStats()


def grade_answer(answer: str, ground_truth: str, *, rel_tol: float = 0.0,
                 timeout_s: float = DEFAULT_TIMEOUT) -> bool:
    """Is `answer` (a bare answer, e.g. the tool's argument) equivalent to `ground_truth`?

    Never raises on model text, never runs it, and returns within about `timeout_s` seconds
    from any thread (a timeout is False and is counted in `STATS`).
    """
    STATS.add("calls")
    if not isinstance(answer, str) or not isinstance(ground_truth, str):
        return False
    if not answer.strip() or len(answer) > MAX_ANSWER_CHARS:
        return False
    a, g = normalize(answer), normalize(ground_truth)
    if not a or not g:
        return False
    if a == g:
        return True
    na, ng = to_number(a), to_number(g)
    if na is not None and ng is not None:
        return _close(na, ng, rel_tol)
    STATS.add("slow_path")
    verdict = _POOL.compare(a, g, rel_tol, timeout_s)
    if verdict is None:
        STATS.add("timeouts")
        return False
    return verdict


def math_reward(response: str, ground_truth: str, *, rel_tol: float = 0.0,
                timeout_s: float = DEFAULT_TIMEOUT) -> float:
    """1.0 if the last `\\boxed{}` of `response` is equivalent to `ground_truth`, else 0.0."""
    boxed = extract_last_boxed(response)
    if boxed is None:
        return 0.0
    return 1.0 if grade_answer(boxed, ground_truth, rel_tol=rel_tol, timeout_s=timeout_s) else 0.0


if __name__ == "__main__":
    _serve()
