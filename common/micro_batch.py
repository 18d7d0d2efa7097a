"""`train.micro_batch_tokens = "auto"`: the largest micro-batch, and the checkpointing mode, that
the device's free memory holds.

    costs = [Cost("none", fixed, per_token), Cost("selective", ...), Cost("full", ...)]  # measured
    choice = choose(costs, free_bytes, margin=0.1, target=32768, min_tokens=8192)
    print(choice.reason)   # the size, the mode, the measured costs, the free memory, the candidates

The costs are measured by the learner (`geo3k_torch.memory`: the bytes a forward leaves alive
for its backward, and on CUDA the peak of a forward and backward, at two probe sizes: a fixed
part and a part per token). `choose` is plain arithmetic: for each mode, fastest first, the
largest multiple of `step` tokens whose activations fit the free memory less the margin; the
fastest mode that reaches `target` tokens wins, else the mode with the largest size. The JAX
learner compiles its row length and takes a number only (`require_fixed`).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

AUTO = "auto"
MODES = ("none", "selective", "full")  # fastest first: less recomputation
STEP = 1024  # sizes are multiples of this
MAX_TOKENS = 1 << 20  # the linear extrapolation of a few-thousand-token probe ends here
GIB = float(1 << 30)


def setting(value) -> int | str:
    """`train.micro_batch_tokens` checked: a positive int or "auto" (anything else: ValueError)."""
    if value == AUTO:
        return AUTO
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"train.micro_batch_tokens={value!r} must be a positive number of "
                         f"tokens or {AUTO!r} (the largest size the device's memory holds)")
    return value


def require_fixed(value, who: str) -> int:
    """`value` as a number of tokens; "auto" is refused, naming `who` cannot resolve it."""
    if setting(value) == AUTO:
        raise ValueError(f"train.micro_batch_tokens='auto' is resolved by the torch learner "
                         f"(geo3k_torch.memory); {who} takes a number of tokens: set "
                         "--config.train.micro_batch_tokens=<tokens>")
    return value


@dataclasses.dataclass(frozen=True)
class Cost:
    """A checkpointing mode's activation memory for n tokens: fixed + per_token * n bytes."""

    mode: str
    fixed: float
    per_token: float


@dataclasses.dataclass(frozen=True)
class Choice:
    mode: str
    tokens: int
    reason: str  # one line: the choice and why


def largest(cost: Cost, budget: float, step: int = STEP, cap: int = MAX_TOKENS) -> int:
    """The most tokens (a multiple of `step`, at most `cap`) whose activations fit `budget`
    bytes; 0 where none do."""
    if cost.per_token <= 0:
        return cap
    n = int(max(budget - cost.fixed, 0.0) // cost.per_token) // step * step
    return min(n, cap)


def choose(costs: Sequence[Cost], free_bytes: float, margin: float, target: int,
           min_tokens: int, step: int = STEP, cap: int = MAX_TOKENS) -> Choice:
    """The micro-batch for `costs` (fastest mode first) in `free_bytes` of memory less the
    `margin` share: the fastest mode whose largest size reaches `target` tokens, else the one
    with the largest size. Every size is a multiple of `step`, at least `min_tokens` (one whole
    episode, `rollout.max_context_tokens`); ValueError where no mode holds that many."""
    if not costs:
        raise ValueError("no checkpointing mode to choose from")
    budget = free_bytes * (1.0 - margin)
    least = -(-min_tokens // step) * step
    sizes = {c.mode: largest(c, budget, step, cap) for c in costs}
    fits = [c for c in costs if sizes[c.mode] >= least]
    described = ", ".join(f"{c.mode} {c.per_token / 1024:.1f} KiB/token + "
                          f"{c.fixed / GIB:.2f} GiB -> {sizes[c.mode]}" for c in costs)
    memory = f"{free_bytes / GIB:.1f} GiB free x (1 - {margin:g} margin)"
    if not fits:
        raise ValueError(f"train.micro_batch_tokens=auto: no checkpointing mode holds one "
                         f"episode ({least} tokens, rollout.max_context_tokens={min_tokens}) in "
                         f"{memory}: {described}. Free memory (fewer engine KV blocks, a "
                         "smaller model) or lower rollout.max_context_tokens")
    best = next((c for c in fits if sizes[c.mode] >= target), None)
    why = f"the fastest mode reaching the {target}-token target"
    if best is None:
        best = max(fits, key=lambda c: sizes[c.mode])  # the first of equals: the fastest
        why = f"no mode reaches the {target}-token target: the largest size"
    return Choice(best.mode, sizes[best.mode],
                  f"train.micro_batch_tokens=auto: {sizes[best.mode]} tokens, "
                  f"activation_checkpointing={best.mode} ({why}); {memory}; activations "
                  f"measured per mode: {described}")
