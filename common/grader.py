r"""The binary math reward for Geometry3K: is a model's answer equal to the label?

Public API
  * `extract_last_boxed(text)`: content of the last `\boxed{...}` / `\fbox{...}` (brace-matched,
    nesting allowed; `\boxed 5` reads one token); None when there is none or it is unbalanced.
  * `grade_answer(answer, ground_truth)` -> bool: a bare answer (the scoring tool's argument).
  * `math_reward(response, ground_truth)` -> 1.0 / 0.0: the last box of a response.
  * `verify_answer(...)` -> `Verdict`: the same decision plus why (path, timed out, error);
    `STATS` counts calls, timeouts and errors for the trainer's metrics (`snapshot()`, `reset()`).
  * `warmup()` / `shutdown()`: start / kill the worker processes (shutdown also runs at exit).

How a decision is made
  1. Guards: ints/floats are str()-ed, other non-strings, empty answers and answers longer than
     MAX_ANSWER_CHARS are incorrect at once (path "rejected").
  2. Both sides are normalized (log below). Equal normalized text is correct. When both are plain
     rationals (`12`, `-0.5`, `.5`, `5/2`, `\frac{5}{2}`) they are compared exactly with
     fractions.Fraction, or within rel_tol, and that is final (path "fast": no process, no sympy).
  3. Otherwise math-verify (LaTeX -> sympy through its antlr grammar; only LatexExtractionConfig:
     its ExprExtractionConfig goes through sympy's parse_expr, which evals Python) decides in a
     worker process (path "slow"). With rel_tol > 0, two symbol-free expressions it calls
     different are evaluated numerically and compared within rel_tol.
  Nothing here evals, execs or sympifies a string.

Why a worker process
  math-verify's own timeouts use SIGALRM: main thread only, and no signal can stop a long C-level
  computation such as the integer power behind `9^{9^{9^{9}}}`. So sympy work runs in a small pool
  of persistent child processes (POOL_SIZE, started lazily on the first slow call, never at
  import). A call waits at most `timeout_s` in total (for a free worker, for a starting worker's
  import, for the answer); on expiry a busy worker is SIGKILLed and replaced at once, a starting
  one is kept. Timeouts score 0 and are counted. Workers are plain `python -c` subprocesses
  speaking JSON lines: unlike multiprocessing spawn/forkserver they do not re-import the trainer's
  __main__ (torch, jax) and no pickle crosses the pipe. Each worker caps its memory (RLIMIT_AS)
  and, per job, its CPU time (RLIMIT_CPU) so an orphan cannot run forever; it ignores SIGINT and
  exits on EOF. POSIX only (select on pipes).

Normalization decision log (applied to answer and label alike)
  * `$`, `\(`, `\)`, `\[`, `\]`, `\displaystyle`, `\left`, `\right` and TeX spacing removed;
    an answer that is a single `\boxed{...}` is unwrapped.
  * `\dfrac`, `\tfrac` -> `\frac`; `\sqrt 3` -> `\sqrt{3}`, `\frac 5 2` -> `\frac{5}{2}` (one
    token per argument, as in TeX: `\sqrt 34` is `\sqrt{3}4`).
  * `\text`, `\mathrm`, `\mbox`, ... replaced by their content; then trailing unit words from a
    fixed list (cm, m, units, square/sq., ^2 / ^3, degrees, ...) after a number-like token are
    dropped: `12 \text{ cm}` = `12 cm` = `12`, `5\text{ units}^2` = `5`; `5x` keeps its x.
    `\text{}` alone is empty and so never correct.
  * Degrees: `^\circ`, `^{\circ}`, `\circ`, `°`, `\degree` dropped: `60^\circ` = `60`.
  * `x = 5`, `m\angle ABC = 60`, `AB = 2 + 3 = 5`: the last `=` part is the answer, as in
    math-verify; the chain's truth is not checked (`10 = 5` counts as 5, `5 = 10` as 10).
    `\approx`: after a name (a letter outside a command, or \angle, \overline, ...) the value
    counts, `x \approx 13.9` -> `13.9`; after a value the exact claim does, `8\sqrt{3} \approx 13.9`
    -> `8\sqrt{3}`.
  * Thousands: only the whole answer in groups of exactly three (`1,000`, `-12,345.5`) loses its
    commas. `(1,2)`, `1,2`, `1,23` are left alone and are never 12.
  * A trailing sentence period is dropped.
  * Exactness: without rel_tol numbers must be equal (math-verify's decimals are compared to
    FLOAT_DIGITS = 10 places, not its default 6, so the fast path and math-verify agree:
    `\frac{1}{3}` != `0.333333`, `4\pi` != `12.566`). rel_tol is relative to the label,
    |answer - label| <= rel_tol * |label|; a label of 0 needs an exact 0.
  * Percent is a unit: `25\%` = `25%` = `25 percent` = 25, never 0.25 (math-verify would take
    both, so a label of 25 and one of 0.25 could not be told apart).
  * Not handled here: angles in radians vs degrees; choice letters are resolved to
    their choice by the environment (`common.env.resolve_choice`) before grading.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from fractions import Fraction

DEFAULT_TIMEOUT = 5.0  # seconds per call, wall clock, everything included
MAX_ANSWER_CHARS = 2048  # longer answers are rejected without parsing
POOL_SIZE = max(1, min(4, os.cpu_count() or 1))  # worker processes
FLOAT_DIGITS = 10  # decimal places math-verify compares floats to
WORKER_MEMORY = 2 << 30  # bytes of address space per worker
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Verdict:
    """One decision. path: "fast" (no process), "slow" (math-verify) or "rejected" (guards)."""

    correct: bool
    path: str = "fast"
    timed_out: bool = False
    error: str | None = None


class RewardStats:
    """Thread-safe counters: calls, fast, slow, rejected, correct, timeouts, errors."""

    KEYS = ("calls", "fast", "slow", "rejected", "correct", "timeouts", "errors")

    def __init__(self):
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(self.KEYS, 0)

    def record(self, v: Verdict) -> None:
        with self._lock:
            for key, hit in (("calls", True), (v.path, True), ("correct", v.correct),
                             ("timeouts", v.timed_out), ("errors", v.error is not None)):
                self._counts[key] += bool(hit)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def reset(self) -> None:
        with self._lock:
            self._counts = dict.fromkeys(self.KEYS, 0)


STATS = RewardStats()

# ---------------------------------------------------------------- box extraction

_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_BRACE = re.compile(r"\\.|[{}]", re.S)  # an escaped char (`\{`, `\\`) or a brace
_SPACES, _TOKEN = re.compile(r"\s*"), re.compile(r"[^\s${}]+")


def extract_last_boxed(text: str) -> str | None:
    r"""Content of the last `\boxed{...}` or `\fbox{...}` in `text`, stripped.

    Braces are matched (escaped `\{` `\}` ignored), so `\boxed{\frac{5}{2}}` gives `\frac{5}{2}`.
    `\boxed 5` gives the next whitespace-delimited token. None when there is no box or the last one
    is unbalanced (a truncated answer): an earlier box is never used instead.
    """
    last = None
    for last in _BOX.finditer(text):
        pass
    if last is None:
        return None
    j = _SPACES.match(text, last.end()).end()
    if text.startswith("{", j):
        depth = 0
        for m in _BRACE.finditer(text, j):
            depth += {"{": 1, "}": -1}.get(m.group(), 0)
            if depth == 0:
                return text[j + 1:m.start()].strip()
        return None
    token = _TOKEN.match(text, j)  # `\boxed 5`: one token
    return token.group() if token else None

# ---------------------------------------------------------------- normalization

_WRAPPER = re.compile(r"\\(?:text|textrm|textbf|textit|textnormal|mathrm|mathbf|mathit|mbox|"
                      r"operatorname)\s*\{([^{}]*)\}")
_DEGREE = re.compile(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\circ|°|\\degree(?![A-Za-z])")
_SPACING = re.compile(r"\\[,;:! ]|\\q?quad(?![A-Za-z])|~")
_DROP = re.compile(r"\$|\\[()\[\]]|\\displaystyle|\\(?:left|right)(?![A-Za-z])")
_UNITS = (r"units?|cm|mm|km|m|meters?|centimeters?|millimeters?|kilometers?|in|inch(?:es)?|ft|"
          r"feet|foot|yd|yards?|mi|miles?|degrees?|deg|radians?|rad|\\%|%|percent")
_UNIT_TAIL = re.compile(rf"(?<=[\d}}).\s])\s*(?:(?:sq\.?|square)\s*)?(?:{_UNITS})\.?"
                        r"\s*(?:\^\s*\{?\s*[23]\s*\}?|²|³)?\s*$")
_EQ = re.compile(r"(?<![<>!=\\])=(?!=)")
_NAMING_CMD = re.compile(r"\\(?:angle|measuredangle|overline|overarc|widehat|arc|triangle|odot)"
                         r"(?![A-Za-z])")
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_NUM = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)"
_RATIONAL = re.compile(rf"(?P<sign>[+-]?)(?:(?P<n>{_NUM})|\\frac\{{(?P<fn>{_NUM})\}}"
                       rf"\{{(?P<fd>{_NUM})\}}|(?P<sn>{_NUM})/(?P<sd>{_NUM}))")


def _names_something(lhs: str) -> bool:
    """True for `x`, `AB`, `m\\angle 1`, `y_1`: a left side that is a name, not a value."""
    return bool(_NAMING_CMD.search(lhs) or re.search(r"[A-Za-z]", re.sub(r"\\[A-Za-z]+", "", lhs)))


def normalize_answer(s: str) -> str:
    """Canonical text of an answer or label (see the decision log in the module docstring)."""
    s = s.strip().replace("\u2212", "-")  # Unicode minus
    if _BOX.match(s) and len(_BOX.findall(s)) == 1:
        s = extract_last_boxed(s) or ""
    s = _DROP.sub("", s)
    s = _SPACING.sub(" ", s)
    s = re.sub(r"\\[dt]frac(?![A-Za-z])", r"\\frac", s)
    s = re.sub(r"\\sqrt\s*(\d)", r"\\sqrt{\1}", s)
    s = re.sub(r"\\frac\s*(\d)\s*(\d)", r"\\frac{\1}{\2}", s)
    for _ in range(2):  # `\text{\textbf{cm}}`
        s = _WRAPPER.sub(r" \1 ", s)
    s = _DEGREE.sub("", s)
    s = " ".join(s.split())
    parts = _EQ.split(s)
    if len(parts) > 1 and parts[-1].strip():
        s = parts[-1].strip()
    if "\\approx" in s:
        lhs, *_, rhs = s.split("\\approx")
        s = (rhs if _names_something(lhs) else lhs).strip()
    for _ in range(3):  # `12 square cm.`, `5 units^2`
        s = _UNIT_TAIL.sub("", s).strip()
    if len(s) > 1 and s.endswith("."):
        s = s[:-1]
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    return s


def _key(s: str) -> str:
    """Whitespace-free text for string equality; keeps a space between two letters (`\\pi r`)."""
    return re.sub(r"(?<![A-Za-z])\s+|\s+(?![A-Za-z])", "", s)


def _as_rational(s: str) -> Fraction | None:
    m = _RATIONAL.fullmatch(s)
    if m is None:
        return None
    num, den = m["n"] or m["fn"] or m["sn"], m["fd"] or m["sd"] or "1"
    if Fraction(den) == 0:
        return None
    value = Fraction(num) / Fraction(den)
    return -value if m["sign"] == "-" else value


def _close(a, g, rel_tol: float) -> bool:
    return a == g or (rel_tol > 0 and abs(a - g) <= rel_tol * abs(g))

# ---------------------------------------------------------------- public entry points


def verify_answer(answer, ground_truth, *, rel_tol: float = 0.0,
                  timeout_s: float = DEFAULT_TIMEOUT) -> Verdict:
    """Decide whether `answer` equals `ground_truth` (both LaTeX/plain strings) and record it.

    rel_tol: relative tolerance against the label for numeric answers (0 = exact).
    timeout_s: hard wall-clock limit in seconds for this call; on expiry the answer is incorrect,
    `timed_out` is set and the busy worker process is killed. Safe to call from any thread.
    """
    if not (rel_tol >= 0 and 0 < timeout_s <= 86400):  # also rejects NaN and infinity
        raise ValueError(f"need rel_tol >= 0, 0 < timeout_s <= 86400; got {rel_tol}, {timeout_s}")
    verdict = _decide(answer, ground_truth, rel_tol, timeout_s)
    STATS.record(verdict)
    return verdict


def grade_answer(answer: str, ground_truth: str, *, rel_tol: float = 0.0,
                 timeout_s: float = DEFAULT_TIMEOUT) -> bool:
    """True if the bare `answer` equals `ground_truth`; see `verify_answer` for the arguments."""
    return verify_answer(answer, ground_truth, rel_tol=rel_tol, timeout_s=timeout_s).correct


def math_reward(response: str, ground_truth: str, *, rel_tol: float = 0.0,
                timeout_s: float = DEFAULT_TIMEOUT) -> float:
    """1.0 if the last `\\boxed{}` of `response` equals `ground_truth`, else 0.0 (also: no box)."""
    boxed = extract_last_boxed(response) if isinstance(response, str) else None
    if boxed is None:
        return 0.0
    return 1.0 if grade_answer(boxed, ground_truth, rel_tol=rel_tol, timeout_s=timeout_s) else 0.0


def _decide(answer, ground_truth, rel_tol: float, timeout_s: float) -> Verdict:
    sides = []
    for s in (answer, ground_truth):
        if isinstance(s, (int, float)) and not isinstance(s, bool):
            s = str(s)
        if not isinstance(s, str) or len(s) > MAX_ANSWER_CHARS:
            return Verdict(False, "rejected")
        s = normalize_answer(s)
        if not s:
            return Verdict(False, "rejected")
        sides.append(s)
    a, g = sides
    if _key(a) == _key(g):
        return Verdict(True)
    ra, rg = _as_rational(_key(a)), _as_rational(_key(g))
    if ra is not None and rg is not None:
        return Verdict(_close(ra, rg, rel_tol))
    return _get_pool().run({"a": a, "g": g, "tol": rel_tol, "cpu": int(timeout_s) + 5}, timeout_s)

# ---------------------------------------------------------------- worker processes


class _Worker:
    """One child process answering one JSON line per JSON line; first says it is ready."""

    def __init__(self):
        code = f"import sys; sys.path.insert(0, {_ROOT!r}); import common.grader as r; r._serve()"
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, bufsize=0)
        self.ready = False

    def read_line(self, deadline: float) -> bytes | None:
        """The next line, or None if the deadline passes first; raises if the worker died."""
        if not self.readable(deadline - time.monotonic()):
            return None
        line = self.proc.stdout.readline()  # written whole in one write, so never partial
        if not line.endswith(b"\n"):
            raise EOFError("reward worker exited")
        return line

    def readable(self, wait_s: float) -> bool:
        poller = select.poll()  # not select.select: that fails on fds >= 1024
        poller.register(self.proc.stdout, select.POLLIN)
        return bool(poller.poll(max(0.0, wait_s) * 1000))

    def send(self, job: dict) -> None:
        data = memoryview(json.dumps(job).encode() + b"\n")
        while data:
            data = data[os.write(self.proc.stdin.fileno(), data):]

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()


class _Pool:
    """Up to `size` workers, each owned by one calling thread at a time."""

    def __init__(self, size: int):
        self.size, self.pid = size, os.getpid()
        self._cond = threading.Condition()
        self._idle: list[_Worker] = []
        self._all: set[_Worker] = set()
        self._closed = False

    def _acquire(self, deadline: float) -> _Worker | None:
        with self._cond:
            while True:
                if self._closed:
                    raise RuntimeError("reward pool was shut down")
                if self._idle:  # prefer the latest-used worker that has finished importing
                    w = max(reversed(self._idle), key=lambda w: w.ready or w.readable(0))
                    self._idle.remove(w)
                    return w
                if len(self._all) < self.size:
                    w = _Worker()
                    self._all.add(w)
                    return w
                if not self._cond.wait(deadline - time.monotonic()):
                    return None

    def _release(self, w: _Worker) -> None:
        with self._cond:
            if self._closed:
                return w.kill()
            self._idle.append(w)
            self._cond.notify()

    def _replace(self, w: _Worker) -> None:
        w.kill()
        with self._cond:
            self._all.discard(w)
            if not self._closed:  # start the successor now: it imports while others work
                self._all.add(new := _Worker())
                self._idle.append(new)
                self._cond.notify()

    def run(self, job: dict, timeout_s: float) -> Verdict:
        deadline = time.monotonic() + timeout_s
        try:
            w = self._acquire(deadline)
        except Exception as e:
            return Verdict(False, "slow", error=f"no worker: {type(e).__name__}")
        if w is None:
            return Verdict(False, "slow", timed_out=True)
        try:
            if not w.ready:
                if w.read_line(deadline) is None:  # still importing: keep it, give up this call
                    self._release(w)
                    return Verdict(False, "slow", timed_out=True)
                w.ready = True
            w.send(job)
            line = w.read_line(deadline)
            if line is None:
                self._replace(w)
                return Verdict(False, "slow", timed_out=True)
            out = json.loads(line)
        except Exception as e:
            self._replace(w)
            return Verdict(False, "slow", error=f"worker failed: {type(e).__name__}")
        self._release(w)
        return Verdict(bool(out["ok"]), "slow", error=out["err"])

    def warm(self, deadline: float) -> None:
        taken = [w for w in (self._acquire(deadline) for _ in range(self.size)) if w is not None]
        for w in taken:
            try:
                w.ready = w.ready or w.read_line(deadline) is not None
            except EOFError:
                self._replace(w)
                continue
            self._release(w)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            workers, self._all, self._idle = list(self._all), set(), []
        for w in workers:
            w.kill()


_POOL: _Pool | None = None
_POOL_LOCK = threading.Lock()


def _get_pool() -> _Pool:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL.pid != os.getpid():
            _POOL = _Pool(POOL_SIZE)
        return _POOL


def warmup(timeout_s: float = 60.0) -> None:
    """Start every worker and wait until it has imported math-verify (optional, ~1 s; without it
    the first slow-path calls pay the import inside their own timeout)."""
    _get_pool().warm(time.monotonic() + timeout_s)


def shutdown() -> None:
    """Kill the worker processes (also done at interpreter exit); later calls start new ones."""
    global _POOL
    with _POOL_LOCK:
        pool, _POOL = _POOL, None
    if pool is not None and pool.pid == os.getpid():
        pool.close()


def _forget_pool_in_child() -> None:  # a forked child must not talk to its parent's workers
    global _POOL, _POOL_LOCK
    _POOL, _POOL_LOCK = None, threading.Lock()
    STATS._lock = threading.Lock()


atexit.register(shutdown)
os.register_at_fork(after_in_child=_forget_pool_in_child)

# ---------------------------------------------------------------- inside a worker


def _numeric(expr) -> complex | None:
    import sympy
    if isinstance(expr, sympy.Eq):
        expr = expr.rhs
    if not isinstance(expr, sympy.Expr) or expr.free_symbols:
        return None
    value = complex(expr.evalf(30))
    return value.real if abs(value.imag) <= 1e-12 * max(1.0, abs(value.real)) else None


def _slow_equal(a: str, g: str, rel_tol: float) -> bool:
    from math_verify import LatexExtractionConfig, parse, verify
    config = [LatexExtractionConfig()]
    gold = parse(f"${g}$", config, parsing_timeout=None)
    pred = parse(f"${a}$", config, parsing_timeout=None)
    if not gold or not pred:
        return False
    if verify(gold, pred, float_rounding=FLOAT_DIGITS, timeout_seconds=None):
        return True
    if rel_tol <= 0:
        return False
    x, y = _numeric(pred[0]), _numeric(gold[0])
    return x is not None and y is not None and _close(x, y, rel_tol)


def _serve() -> None:
    """Worker main loop: JSON jobs on stdin, JSON verdicts on the saved stdout."""
    import logging
    import resource
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # stray prints from libraries must not corrupt the protocol
    sys.stdout = sys.stderr
    logging.disable(logging.CRITICAL)
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    for limit, value in ((resource.RLIMIT_AS, WORKER_MEMORY), (resource.RLIMIT_CORE, 0)):
        try:
            resource.setrlimit(limit, (value, value))
        except (ValueError, OSError):
            pass
    _slow_equal("1", "1", 0.0)  # import sympy/math-verify and warm the grammar before "ready"
    out.write(b'{"ready": true}\n')
    for line in sys.stdin.buffer:
        job = json.loads(line)
        cap = int(time.process_time()) + job["cpu"]  # an orphaned runaway dies of SIGXCPU
        try:
            soft = cap if hard == resource.RLIM_INFINITY else min(cap, hard)
            resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))
        except (ValueError, OSError):
            pass
        try:
            result = {"ok": bool(_slow_equal(job["a"], job["g"], job["tol"])), "err": None}
        except Exception as e:  # str(e) could print a huge expression: the type is enough
            result = {"ok": False, "err": type(e).__name__}
        out.write(json.dumps(result).encode() + b"\n")
