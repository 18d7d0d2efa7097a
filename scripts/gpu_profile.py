"""Where a torch step's time goes: host syncs, the time of each phase of a learner step, the top
kernels (ops on a CPU) and ops by shape, the device's idle share, and a fit of step time to its
micro-batches and tokens. Used by `gpu_sections.profile_torch` and the report of `gpu_check.py`;
`host_syncs` and `step_phases` are also diagnostics of their own:

    with host_syncs(cuda=False) as syncs:
        learner.train_step(batches, n_tokens, n_seqs)
    print(syncs.n)   # what would make a GPU's host wait: .item(), float(t), boolean-mask
                     # indexing, nonzero, ... (`_syncs_on_cuda`)
    print(syncs.sites.most_common(10))   # "path:line function" -> count

    with step_phases(learner, cuda=True) as clock:
        clock.mark("step"); learner.train_step(batches, n_tokens, n_seqs); clock.mark("end")
    print(phase_ms(clock.read()[0]))   # {"vision": ms, "text": ms, "head": ms, ...}

The idle share comes from two runs: the kernels' busy time from a profile without recorded
shapes (`busy_time`) over the wall time of an unprofiled step (`idle_share`); recording shapes
slows the host's dispatch by about a fifth, which a profiled step's own gaps would count as idle.

`busy_time`, `idle_share`, `phase_ms`, `top_ops` and `fit_step_cost` are plain Python or numpy
(tested with literal numbers); `table` writes the reports' markdown tables.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import math
import os
import threading
import time
import traceback
import warnings
from typing import Iterable, Sequence

import numpy as np

# The torch.Tensor methods that bring a tensor's value to the host: each one is a host sync
# when the tensor is on a GPU.
READS = ("item", "__float__", "__bool__", "tolist", "cpu", "numpy")
NAME_CHARS = 100  # a kernel's name is cut to this many characters (templates run to hundreds)
# Above this condition number (columns scaled to a maximum of 1) the rows cannot tell the
# per-micro-batch cost from the per-token cost: every row has about the same tokens per
# micro-batch.
MAX_CONDITION = 100.0


@dataclasses.dataclass
class Syncs:
    n: int = 0  # host syncs counted (final once the `host_syncs` block has exited)
    # "file:line function" of the innermost frame outside torch that made each sync -> count
    sites: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def add(self, stack: list[traceback.FrameSummary]) -> None:
        self.n += 1
        self.sites[sync_site(stack)] += 1


def sync_site(stack: list[traceback.FrameSummary]) -> str:
    """Where a sync comes from: the innermost frame of `stack` (outermost first) outside torch
    and this module, as "path:line function" (a library's path from its package down)."""
    own = {__file__, warnings.__file__}
    frames = [f for f in stack if f.filename not in own and f"{os.sep}torch{os.sep}" not in
              f.filename] or stack
    f = frames[-1]
    path = f.filename.split(f"site-packages{os.sep}")[-1]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    return f"{path.removeprefix(root)}:{f.lineno} {f.name}"


def _syncs_on_cuda(op, args, kwargs) -> bool:
    """Whether aten `op` makes the host wait when its tensors are on a GPU: a value read
    (`.item()`), an output whose size depends on the data (nonzero, boolean-mask indexing,
    masked_select, unique, repeat_interleave with tensor repeats and no output_size), a
    comparison answered on the host (equal, is_nonzero)."""
    import torch

    aten = torch.ops.aten
    if op in (aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
              aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default,
              aten.equal.default, aten.is_nonzero.default):
        return True
    if op is aten.repeat_interleave.Tensor:
        return kwargs.get("output_size") is None
    if op in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
              aten._index_put_impl_.default):
        return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1])
    return False


def _blocking_copy(op, args, kwargs) -> bool:
    """Whether aten `op` copies between the host and a GPU and waits for it: `.to()` / `.cpu()`
    / `copy_` across devices unless non-blocking (a host-to-device copy also needs pinned
    memory), and `torch.tensor(data, device=gpu)` (seen as `lift_fresh` of the GPU tensor it
    made by a pageable copy)."""
    import torch

    aten = torch.ops.aten
    if op in (aten.lift_fresh.default, aten.lift_fresh_copy.default):
        return args[0].is_cuda
    if op is aten._to_copy.default:
        src, dst = args[0], kwargs.get("device")
        non_blocking = kwargs.get("non_blocking", False)
    elif op is aten.copy_.default:
        dst, src = args[0].device, args[1]
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
    else:
        return False
    if not isinstance(src, torch.Tensor) or dst is None:
        return False
    dst = torch.device(dst)
    if src.is_cuda == (dst.type == "cuda"):
        return False
    return not non_blocking or (src.device.type == "cpu" and not src.is_pinned())


def _op_site(stack: list[traceback.FrameSummary], op) -> str:
    return f"{sync_site(stack)} [{str(op).removeprefix('aten.')}]"


@contextlib.contextmanager
def host_syncs(cuda: bool, sites: bool = True):
    """Count the host syncs made inside the block, with where each was made (`Syncs.sites`).

    cuda: `n` is torch's own count (its sync debug mode "warn": a warning per synchronizing
    CUDA operation, any thread's). The sites are found by a dispatch mode that sees every
    aten op of the block, backward's and other threads' included, and names those that sync
    on a GPU (`_syncs_on_cuda` with a GPU tensor, `_blocking_copy`): "path:line function
    [op]". A sync no aten op makes (a stream or event wait) is counted but has no site, so the
    sites may sum to less than `n`. sites=False: the count alone, no dispatch mode.

    Not cuda (a CPU run, which has no device to wait for): every aten op that would sync on a
    GPU (`_syncs_on_cuda`, backward's too) and, in the thread that entered the block, every
    call of `READS` (outermost calls only: a read that makes another counts once); the methods
    are restored on exit. That finds what a GPU would wait for, except copies between host and
    device."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    syncs = Syncs()
    found = Syncs()  # the dispatch mode's sites (cuda); `syncs` itself on a CPU
    thread, depth = threading.get_ident(), 0

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, op, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if cuda:
                flat = [a for a in args if isinstance(a, torch.Tensor)] + [
                    i for a in args if isinstance(a, (list, tuple)) for i in a
                    if isinstance(i, torch.Tensor)]
                if ((_syncs_on_cuda(op, args, kwargs) and any(t.is_cuda for t in flat))
                        or _blocking_copy(op, args, kwargs)):
                    found.sites[_op_site(traceback.extract_stack()[:-1], op)] += 1
            elif depth == 0 and _syncs_on_cuda(op, args, kwargs):
                syncs.add(traceback.extract_stack()[:-1])
            return op(*args, **kwargs)

    if cuda:
        def seen(message, *args, **kwargs):
            if "synchroniz" in str(message):
                syncs.n += 1

        mode = torch.cuda.get_sync_debug_mode()
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = seen
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with Ops() if sites else contextlib.nullcontext():
                    yield syncs
            finally:
                torch.cuda.set_sync_debug_mode(mode)
                syncs.sites = found.sites
        return
    own = {name: torch.Tensor.__dict__.get(name) for name in READS}  # None: inherited

    def counted(method):
        @functools.wraps(method)
        def read(*args, **kwargs):
            nonlocal depth
            if threading.get_ident() != thread:
                return method(*args, **kwargs)
            if depth == 0:
                syncs.add(traceback.extract_stack()[:-1])
            depth += 1
            try:
                return method(*args, **kwargs)
            finally:
                depth -= 1
        return read

    for name in READS:
        setattr(torch.Tensor, name, counted(getattr(torch.Tensor, name)))
    try:
        with Ops():
            yield syncs
    finally:
        for name, method in own.items():
            if method is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, method)


def busy_time(intervals: Iterable[tuple[float, float]]) -> float:
    """The time that (start, end) intervals cover (any one unit): with a GPU's kernels, the time
    the device computed. Overlapping intervals (kernels of several streams) count once."""
    busy, reach = 0.0, -math.inf
    for start, end in sorted(intervals):
        busy += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return busy


def idle_share(busy_ms: float, wall_ms: float) -> float:
    """1 - busy / wall: the share of a step's wall time (unprofiled) that the device's kernels
    (`busy_time` of a profiled step) leave idle. Both are of one step each, two runs: step-to-step
    spread can make it slightly negative, which is left to show."""
    return 1.0 - busy_ms / wall_ms


# ---- a learner step's phases --------------------------------------------------------------------
# The phase each mark of `step_phases` opens; it lasts until the next mark. "other" is what no
# phase holds: zero_grad, moving micro-batches to the device, the host's turns between them.
OPENS = {"step": "other", "forward": "text", "vision": "vision", "vision_end": "text",
         "text": "text", "head": "head", "loss": "other", "backward": "backward",
         "backward_end": "other", "clip": "optimizer", "optimizer_end": "other"}
# vision: the vision tower's forward; text: the rest of the model's forward up to the text
# model's output (embeddings, the image merge, the decoder layers); head: the LM head, log-probs
# and the loss (plain, chunked or fused, whose head also forms its gradient); backward: every
# micro-batch's backward; optimizer: the gradient clip, the step's metrics read and AdamW.
PHASES = ("vision", "text", "head", "backward", "optimizer", "other")


def phase_ms(marks: Sequence[tuple[str, float]]) -> dict[str, float]:
    """One step's marks, (name, ms) in time order from "step" to "end" (`Clock.read`), as ms per
    phase (`PHASES`, each interval to the phase its first mark opens, `OPENS`); they sum to the
    step's time, end - step."""
    if not marks or marks[0][0] != "step" or marks[-1][0] != "end":
        raise ValueError(f"a step's marks run from 'step' to 'end', got {[m for m, _ in marks]}")
    out = dict.fromkeys(PHASES, 0.0)
    for (name, at), (_, until) in zip(marks, marks[1:]):
        out[OPENS[name]] += until - at
    return out


class Clock:
    """Named marks on the device's timeline: CUDA events recorded on the current stream (their
    times are the device's, reached when the work before them is done), or on a CPU, where work
    runs as it is issued, perf_counter."""

    def __init__(self, cuda: bool):
        self.cuda, self.marks = cuda, []

    def mark(self, name: str) -> None:
        if self.cuda:
            import torch
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append((name, event))
        else:
            self.marks.append((name, time.perf_counter()))

    def read(self) -> list[list[tuple[str, float]]]:
        """The marks so far as (name, ms from the first mark), one list per "step" mark (waits
        for the device)."""
        if not self.marks:
            return []
        first = self.marks[0][1]
        if self.cuda:
            import torch
            torch.cuda.synchronize()
            times = [(n, first.elapsed_time(e)) for n, e in self.marks]
        else:
            times = [(n, (t - first) * 1e3) for n, t in self.marks]
        steps: list[list[tuple[str, float]]] = []
        for name, ms in times:
            if name == "step" or not steps:
                steps.append([])
            steps[-1].append((name, ms))
        return steps


@contextlib.contextmanager
def step_phases(learner, cuda: bool):
    """A `Clock` marking the phase boundaries (`OPENS`) of a torch learner's
    (`geo3k_torch.learner.Learner`) steps from outside it: forward pre-hooks on the model (the
    root: "forward"), the vision tower and the text model ("vision", "text"), forward hooks on
    those two ("vision_end", "head"); `micro_batch_loss` returning ("loss"); every
    `Tensor.backward` before and after ("backward", "backward_end"); the gradient clip called
    ("clip"); `optimizer.step` returning ("optimizer_end"). The head is timed from the text
    model's output, so a head the learner swaps in for the forward (`geo3k_torch.head.FusedHead`,
    the chunked head) is in it. The caller marks "step" before each `train_step` and "end" after.
    Everything is undone on exit."""
    import torch

    clock = Clock(cuda)
    model, inner = learner.model, learner.model.model
    hooks = [model.register_forward_pre_hook(lambda *_: clock.mark("forward")),
             inner.visual.register_forward_pre_hook(lambda *_: clock.mark("vision")),
             inner.visual.register_forward_hook(lambda *_: clock.mark("vision_end")),
             inner.language_model.register_forward_pre_hook(lambda *_: clock.mark("text")),
             inner.language_model.register_forward_hook(lambda *_: clock.mark("head")),
             learner.optimizer.register_step_post_hook(lambda *_: clock.mark("optimizer_end"))]
    loss_fn, backward, clip = learner.micro_batch_loss, torch.Tensor.backward, \
        torch.nn.utils.clip_grad_norm_

    def micro_batch_loss(*args, **kwargs):
        out = loss_fn(*args, **kwargs)
        clock.mark("loss")
        return out

    def timed_backward(self, *args, **kwargs):
        clock.mark("backward")
        backward(self, *args, **kwargs)
        clock.mark("backward_end")

    def timed_clip(*args, **kwargs):
        clock.mark("clip")
        return clip(*args, **kwargs)

    own = "micro_batch_loss" in vars(learner)
    learner.micro_batch_loss = micro_batch_loss
    torch.Tensor.backward = timed_backward
    torch.nn.utils.clip_grad_norm_ = timed_clip
    try:
        yield clock
    finally:
        for h in hooks:
            h.remove()
        torch.Tensor.backward, torch.nn.utils.clip_grad_norm_ = backward, clip
        if own:
            learner.micro_batch_loss = loss_fn
        else:
            del learner.micro_batch_loss


def top_ops(timed: Iterable[tuple[str, float]], wall_ms: float, steps: int, n: int = 25
            ) -> list[dict]:
    """The `n` names with the most time among (name, ms) pairs (one per kernel or op call) of
    `steps` steps taking `wall_ms` in all: name, calls, total_ms (all steps), ms_per_step and
    share (of the steps' wall time), most first."""
    calls: dict[str, int] = {}
    total: dict[str, float] = {}
    for name, ms in timed:
        calls[name] = calls.get(name, 0) + 1
        total[name] = total.get(name, 0.0) + ms
    names = sorted(total, key=total.get, reverse=True)[:n]
    return [{"op": name[:NAME_CHARS], "calls": calls[name], "total_ms": total[name],
             "ms_per_step": total[name] / steps, "share": total[name] / wall_ms}
            for name in names if total[name] > 0]


def profile_events(prof, cuda: bool) -> tuple[list[tuple[str, float]], list[tuple[float, float]]]:
    """A finished `torch.profiler.profile`'s (name, ms) of every GPU kernel and copy (cuda: their
    own time) or else every CPU op (its self time), and the kernels' (start, end) in µs (a CPU:
    none)."""
    from torch.autograd import DeviceType

    if cuda:
        kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
        return ([(e.name, e.time_range.elapsed_us() / 1e3) for e in kernels],
                [(e.time_range.start, e.time_range.end) for e in kernels])
    ops = [e for e in prof.events() if e.device_type == DeviceType.CPU and not e.is_async]
    return [(e.name, e.self_cpu_time_total / 1e3) for e in ops], []


def shaped_ops(prof, cuda: bool) -> list[tuple[str, float]]:
    """A finished `torch.profiler.profile` (record_shapes=True)'s (name and input shapes, ms) of
    every op: on a GPU the time of the kernels it launched itself (not its children's), on a CPU
    its own time. For `top_ops`: which GEMM, cast or norm, at which shape, takes the time."""
    from torch.autograd import DeviceType

    ops = [e for e in prof.events() if e.device_type == DeviceType.CPU and not e.is_async]
    return [(f"{e.name} {str(e.input_shapes).replace(' ', '')}",
             (e.self_device_time_total if cuda else e.self_cpu_time_total) / 1e3) for e in ops]


# The CUDA runtime calls in which the host waits for the device (a profile's CPU-side events).
WAIT_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
              "cudaMemcpy")


def host_wait_ms(prof) -> float:
    """Milliseconds the host spent inside `WAIT_CALLS` over a finished GPU profile: the rest of
    the wall time it was busy issuing work. A step whose host waits little while the device
    idles is bound by the host (its Python, dispatch and kernel launches), not by syncs."""
    from torch.autograd import DeviceType

    return sum(e.time_range.elapsed_us() for e in prof.events()
               if e.device_type == DeviceType.CPU and e.name in WAIT_CALLS) / 1e3


def fit_step_cost(micro_batches: Sequence[float], tokens: Sequence[float],
                  seconds: Sequence[float]) -> dict[str, float] | None:
    """Least squares of a step's seconds = a + b x micro-batches + c x tokens over rows (one
    value each per row): a in s per step, b in s per micro-batch, c in s per token. None with
    fewer than 3 distinct (micro-batches, tokens) rows; where the rows cannot separate b from c
    (`MAX_CONDITION`), the simpler seconds = a + c x tokens (no "b")."""
    m, t, y = (np.asarray(v, np.float64) for v in (micro_batches, tokens, seconds))
    if len(set(zip(m.tolist(), t.tolist()))) < 3:
        return None
    x = np.stack([np.ones_like(m), m, t], axis=1)
    if np.linalg.cond(x / np.abs(x).max(axis=0)) > MAX_CONDITION:
        a, c = np.linalg.lstsq(x[:, [0, 2]], y, rcond=None)[0]
        return {"a": float(a), "c": float(c)}
    a, b, c = np.linalg.lstsq(x, y, rcond=None)[0]
    return {"a": float(a), "b": float(b), "c": float(c)}


def fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e4 else f"{v:,.0f}"
    return str(v)


def table(rows: Sequence[dict]) -> list[str]:
    """The markdown lines of a table of `rows`: a column per key (in the order first seen) but
    "error"; none for no rows."""
    cols = [c for c in dict.fromkeys(k for r in rows for k in r) if c != "error"]
    if not rows:
        return []
    return (["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
            + ["| " + " | ".join(fmt(r.get(c, "")).replace("|", "/") for c in cols) + " |"
               for r in rows])
