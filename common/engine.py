"""The `Engine` protocol: how the rollout asks for tokens, whatever generates them.

The rollout does not need to know how or where generation runs: an in-process torch engine on
CPU, SGLang servers on GPUs, or a scripted fake in the tests all take a list of `Request`s and
return one `Completion` per request, in order.

Token ids are the model's own ids with image placeholders already expanded (one `<|image_pad|>`
per merged patch), exactly the ids the learner trains on. An engine that expands images itself
must say so and take care not to expand them twice.

A `Backend` owns an engine for the training loop and keeps it on the current policy.

Routing replay (`loss.routing_replay`, a mixture-of-experts model): an engine built to record
its routing returns, with each completion, the experts every fed position was routed to
(`Completion.routed_experts`, SGLang's `return_routed_experts` layout), and the learner's
forward routes each token to the same experts (Rollout Routing Replay, Ma et al. 2025).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from contextlib import AbstractContextManager
from typing import Any, Protocol, Sequence, runtime_checkable

STOP = "stop"  # a stop token was sampled (it is the last token of `token_ids`)
LENGTH = "length"  # max_new_tokens reached
ABORT = "abort"  # the engine gave up on the request; the rollout retries it
FINISH_REASONS = (STOP, LENGTH, ABORT)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings. `top_p` = 1.0 disables nucleus sampling."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclasses.dataclass(frozen=True)
class Request:
    """One generation call: continue `input_ids` (all tokens so far, prompt included).

    `images` are the episode's images (PIL), in the order of their placeholders in `input_ids`.
    `session` names the episode, so an engine may keep its KV cache between turns; `group` names
    its GRPO group (samples of one prompt), so an engine may serve the group where the prompt's
    cache already is.
    """

    input_ids: Sequence[int]
    images: Sequence[Any]
    sampling: SamplingParams
    session: str = ""
    group: str = ""


@dataclasses.dataclass(frozen=True)
class Completion:
    """New tokens, each with its log-prob under the distribution it was sampled from.

    `logprobs[i]` is log p(token_ids[i]) at the sampling temperature, from raw logits (not the
    processed scores of top-p/top-k); shapes: both length n_new.
    `routed_experts`: None, or (n_in + n_new - 1, L, K) integers: row t holds the K experts each
    of the L sparse layers chose for position t of the request's `input_ids` followed by the new
    tokens (every position the model was fed: the last new token never was), from an engine
    that records its routing (module docstring).
    """

    token_ids: Sequence[int]
    logprobs: Sequence[float]
    finish_reason: str
    routed_experts: Any = None

    def __post_init__(self):
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"{len(self.token_ids)} tokens but {len(self.logprobs)} log-probs")
        if self.routed_experts is not None and getattr(self.routed_experts, "ndim", 0) != 3:
            raise ValueError("routed_experts must be a (positions, layers, top_k) array, got "
                             f"shape {getattr(self.routed_experts, 'shape', None)}")
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"unknown finish_reason {self.finish_reason!r}")


class FatalEngineError(RuntimeError):
    """A failure no retry can fix (the engine and the learner disagree on the inputs, say): the
    rollout re-raises it instead of retrying and aborting samples one by one."""


class Engine(Protocol):
    """Anything that turns requests into completions (one per request, same order)."""

    def generate(self, requests: Sequence[Request]) -> list[Completion]: ...


@runtime_checkable
class AsyncEngine(Engine, Protocol):
    """An engine that also takes one request at a time and answers when it is done (SGLang:
    many requests in flight, batched continuously), so each episode can move on to its next
    turn without waiting for the others (`common.rollout`'s per-episode scheduling)."""

    def submit(self, request: Request) -> concurrent.futures.Future:
        """A future of the request's `Completion` (or of the exception that failed it)."""


class Backend(Protocol):
    """Where rollouts come from, and what happens around an update. Every process calls every
    method; a backend that launched servers stops them in `close`."""

    engine: Engine

    def sync(self, learner, step: int) -> None:
        """After optimizer step `step`: the engine samples from `learner`'s new weights next
        (servers tag them as weight version `step`)."""

    def train_context(self) -> AbstractContextManager:
        """Wraps the update (a colocated server frees its accelerator memory there)."""

    def rng_state(self) -> Any:
        """This process's sampling RNG state, JSON-serialisable (None where the engine keeps
        its own, as SGLang servers do)."""

    def set_rng_state(self, state: Any) -> None:
        """Restore what `rng_state` returned."""

    def close(self) -> None:
        """Release what the backend started."""
