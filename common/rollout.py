"""Multi-turn rollout: generations and environment feedback become token-level trajectories.

For every prompt, `n_samples` episodes run turn by turn against an `Engine`:

    prompt ids ──> engine ──> generated ids (loss mask 1, the engine's log-probs)
                              │ decoded text -> env.step -> feedback message
                              └> observation ids (loss mask 0, log-prob 0) ──> engine ──> ...

The generated ids are never re-tokenized: the tokens the engine sampled are exactly the tokens the
learner trains on. Observation ids come from rendering the chat template for the feedback message
alone (`Renderer.observation_ids`). Scheduling: with an engine that takes requests one at a time
(`AsyncEngine`: SGLang) every episode advances on its own, so a short episode's next turn never
waits for another's long one; otherwise all active episodes of a turn go to the engine in one call.

Limits: a response budget shared by all turns (generated and observation tokens both count) and
a context limit (prompt + response). Each episode ends `completed` (the environment said done),
`truncated` (budget or context reached) or `aborted`, with an `abort_reason`: `engine` (the
engine failed a request more than `max_retries` times) or `placeholder` (it sampled an image or
video placeholder id, `Renderer.placeholder_ids`: such a token would make the learner look for
an image that is not there). Aborted episodes are excluded from training, the others go on.

A forced first turn (`first_turns`, the evaluation's forced miss): the given ids stand in for the
engine's first generation of the prompt's episodes; the environment scores them and gives its
feedback as for any turn, the model goes on from turn 2. The turn is marked `forced`, its tokens
have loss mask 0 and log-prob 0: they are not the model's.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
from typing import Any, Protocol, Sequence

import numpy as np

from common.engine import (ABORT, LENGTH, STOP, AsyncEngine, Completion, Engine, FatalEngineError,
                           Request, SamplingParams)
from common.env import EnvConfig, Geo3kEnv
from common.reward import RewardConfig, episode_reward

COMPLETED, TRUNCATED, ABORTED = "completed", "truncated", "aborted"
ABORT_REASONS = ("engine", "placeholder")
EXPORT_STYLES = ("concat", "individual")
SCHEDULES = ("episode", "lockstep")

log = logging.getLogger(__name__)


class Renderer(Protocol):
    """Turns chat messages into the model's token ids (see `common.chat.ChatRenderer`)."""

    stop_token_ids: tuple[int, ...]
    placeholder_ids: tuple[int, ...]  # image / video placeholders: never valid model output

    def prompt_ids(self, messages: list[dict], images: Sequence[Any]) -> list[int]: ...

    def observation_ids(self, message: dict, last_token: int) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Sampling and limits. Budgets are in tokens."""

    n_samples: int = 8
    max_response_tokens: int = 1024
    max_context_tokens: int = 4096
    temperature: float = 1.0
    top_p: float = 1.0
    max_retries: int = 2
    export_style: str = "concat"
    schedule: str = "episode"  # episode | lockstep (see `rollout`)

    def __post_init__(self):
        if self.n_samples < 1 or self.max_response_tokens < 1 or self.max_context_tokens < 1:
            raise ValueError(f"n_samples and token limits must be >= 1: {self}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.export_style not in EXPORT_STYLES:
            raise ValueError(f"export_style must be one of {EXPORT_STYLES}, "
                             f"got {self.export_style!r}")


@dataclasses.dataclass
class Turn:
    """One assistant turn: its generated span `[start, end)` in the trajectory's token ids."""

    start: int
    end: int
    text: str
    finish_reason: str
    info: dict
    observation: str | None = None  # the feedback that followed, if any
    forced: bool = False  # given to the episode (`rollout`'s first_turns), not generated


@dataclasses.dataclass
class Trajectory:
    """One episode. Token arrays have shape (T,); `prompt_len` tokens come first.

    `loss_mask[t]` is 1 for tokens the model generated, 0 for prompt and observation tokens;
    `rollout_logprobs[t]` is the engine's log-prob of token t (0 where the mask is 0).
    """

    uid: str
    group_id: int
    sample_idx: int
    answer: str
    token_ids: np.ndarray  # (T,) int64
    loss_mask: np.ndarray  # (T,) int8
    rollout_logprobs: np.ndarray  # (T,) float32
    prompt_len: int
    images: list
    turns: list[Turn]
    status: str
    reward: float = 0.0
    correct: bool = False
    correct_turn: int | None = None
    abort_reason: str | None = None  # one of ABORT_REASONS when aborted
    policy_version: int | None = None  # updates the sampling weights had (`common.pipeline`)
    # (T, L, K) int16: the experts the engine routed each token to in each sparse layer, -1
    # where it did not say (`common.engine.Completion.routed_experts`); None: not recorded
    routed_experts: np.ndarray | None = None

    @property
    def response_len(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def num_generated(self) -> int:
        return int(self.loss_mask.sum())


@dataclasses.dataclass
class _Episode:
    """Mutable state of one episode while it runs."""

    prompt: Any
    group: int
    sample: int
    prompt_len: int
    ids: list[int]
    mask: list[int]
    logps: list[float]
    env: Geo3kEnv
    turns: list[Turn] = dataclasses.field(default_factory=list)
    status: str | None = None
    abort_reason: str | None = None
    routing: np.ndarray | None = None  # the latest completion's `routed_experts`


def generate_with_retries(engine: Engine, requests: list[Request],
                          max_retries: int) -> list[Completion | None]:
    """One completion per request, None for a request that failed `max_retries` + 1 times.

    The first attempt sends all requests in one call; retries go one request at a time, so one
    bad request cannot sink the others. A raised exception and an `abort` both count as failure.
    """
    results: list[Completion | None] = [None] * len(requests)
    pending = list(range(len(requests)))
    for attempt in range(max_retries + 1):
        batches = [pending] if attempt == 0 else [[i] for i in pending]
        failed = []
        for batch in batches:
            try:
                outs = engine.generate([requests[i] for i in batch])
                if len(outs) != len(batch):
                    raise RuntimeError(f"engine returned {len(outs)} completions "
                                       f"for {len(batch)} requests")
            except FatalEngineError:
                raise
            except Exception as e:  # noqa: BLE001 - any other failure is retried, then aborted
                log.warning("engine call failed (attempt %d): %s", attempt + 1, e)
                failed.extend(batch)
                continue
            for i, out in zip(batch, outs):
                if out.finish_reason == ABORT:
                    failed.append(i)
                else:
                    results[i] = out
        pending = failed
        if not pending:
            break
    return results


def _close(ep: _Episode, status: str, abort_reason: str | None = None) -> None:
    ep.status, ep.abort_reason = status, abort_reason


def _advance(ep: _Episode, out: Completion, renderer: Renderer, cfg: RolloutConfig,
             prompt_len: int) -> None:
    """Append one completion, step the environment and, if the episode goes on, the feedback."""
    start = len(ep.ids)
    if out.routed_experts is not None:
        rows, fed = len(out.routed_experts), start + len(out.token_ids) - 1
        if rows != fed:
            raise ValueError(f"the engine's routed_experts has {rows} rows for the {fed} "
                             "positions it was fed")
        ep.routing = np.asarray(out.routed_experts)
    ep.ids.extend(int(t) for t in out.token_ids)
    ep.mask.extend([1] * len(out.token_ids))
    ep.logps.extend(float(x) for x in out.logprobs)
    gen = list(out.token_ids)
    if gen and gen[-1] in renderer.stop_token_ids:
        gen = gen[:-1]
    text = renderer.decode(gen)
    obs, done, info = ep.env.step(text)
    turn = Turn(start, len(ep.ids), text, out.finish_reason, info)
    ep.turns.append(turn)
    if out.finish_reason == LENGTH or not out.token_ids:
        _close(ep, TRUNCATED)  # cut off mid-turn: no feedback can follow a half-written turn
        return
    if done:
        _close(ep, COMPLETED)
        return
    message = ep.env.format_observation(obs)
    obs_ids = renderer.observation_ids(message, int(out.token_ids[-1]))
    used = len(ep.ids) - prompt_len + len(obs_ids)
    if used >= cfg.max_response_tokens or len(ep.ids) + len(obs_ids) >= cfg.max_context_tokens:
        _close(ep, TRUNCATED)  # no room left to answer the feedback
        return
    turn.observation = message["content"]
    ep.ids.extend(obs_ids)
    ep.mask.extend([0] * len(obs_ids))
    ep.logps.extend([0.0] * len(obs_ids))


def rollout(prompts: Sequence[Any], engine: Engine, renderer: Renderer, cfg: RolloutConfig,
            env_config: EnvConfig = EnvConfig(), reward_config: RewardConfig = RewardConfig(),
            group_offset: int = 0, prompt_ids: Sequence[Sequence[int]] | None = None,
            first_turns: Sequence[Sequence[int] | None] | None = None) -> list[Trajectory]:
    """Run `cfg.n_samples` episodes for each prompt; returns them grouped, prompt by prompt.

    `prompts` are `common.data.Prompt`-like objects (`uid`, `messages`, `images`, `answer`).
    `prompt_ids`: each prompt's `renderer.prompt_ids(messages, images)` when the caller rendered
    them ahead (`common.pipeline`), else None. `first_turns`: per prompt, None or the ids of
    a first assistant turn (ending with a stop token) that its episodes take instead of
    generating one (the module docstring).
    Group ids are `group_offset + prompt index`. Rewards are scored here (`common.reward`).
    With an `AsyncEngine` and `cfg.schedule == "episode"` each episode moves to its next turn
    as soon as its own generation is back; otherwise all active episodes take a turn together
    (lock-step). For an engine whose answers depend only on the request, both give the same
    trajectories.
    """
    if prompt_ids is None:
        prompt_ids = render_prompts(prompts, renderer)
    elif len(prompt_ids) != len(prompts):
        raise ValueError(f"{len(prompt_ids)} rendered prompts for {len(prompts)} prompts")
    episodes = []
    for g, (prompt, ids) in enumerate(zip(prompts, prompt_ids)):
        for k in range(cfg.n_samples):
            env = Geo3kEnv(prompt.answer, env_config, choices=getattr(prompt, "choices", None),
                           source=reward_config.source)
            episodes.append(_Episode(prompt, group_offset + g, k, len(ids), list(ids),
                                     [0] * len(ids), [0.0] * len(ids), env))
    step = _Stepper(renderer, cfg)
    if first_turns is not None:
        if len(first_turns) != len(prompts):
            raise ValueError(f"{len(first_turns)} first turns for {len(prompts)} prompts")
        for ep in episodes:
            if (ids := first_turns[ep.group - group_offset]) is not None:
                _force(ep, ids, step)
    if cfg.schedule == "episode" and isinstance(engine, AsyncEngine):
        _per_episode(episodes, engine, step, cfg.max_retries)
    else:
        _lock_step(episodes, engine, step, cfg.max_retries)
    return [_trajectory(ep, reward_config, env_config) for ep in episodes]


def render_prompts(prompts: Sequence[Any], renderer: Renderer) -> list[list[int]]:
    """Each prompt's token ids, as `rollout` starts its episodes from."""
    return [list(renderer.prompt_ids(p.messages, p.images)) for p in prompts]


def _force(ep: _Episode, ids: Sequence[int], step: _Stepper) -> None:
    """Take `ids` as the episode's first turn: stepped like a generation, then marked forced
    with loss mask 0 (log-probs are 0 already)."""
    req = step.request(ep)
    if req is None:
        return
    stops = req.sampling.stop_token_ids
    if not ids or ids[-1] not in stops or len(ids) > req.sampling.max_new_tokens:
        raise ValueError(f"a forced first turn of {len(ids)} ids must end with a stop token and "
                         f"fit the {req.sampling.max_new_tokens} tokens left")
    step.receive(ep, req, Completion(list(ids), [0.0] * len(ids), STOP))
    turn = ep.turns[0]
    turn.forced = True
    ep.mask[turn.start:turn.end] = [0] * (turn.end - turn.start)


class _Stepper:
    """What happens around one generation of an episode, in either schedule."""

    def __init__(self, renderer: Renderer, cfg: RolloutConfig):
        self.renderer, self.cfg = renderer, cfg
        self.placeholders = set(renderer.placeholder_ids)

    def request(self, ep: _Episode) -> Request | None:
        """The episode's next generation request; None (and the episode truncated) when its
        budget or the context is used up."""
        cfg = self.cfg
        room = min(cfg.max_response_tokens - (len(ep.ids) - ep.prompt_len),
                   cfg.max_context_tokens - len(ep.ids))
        if room <= 0:
            _close(ep, TRUNCATED)
            return None
        sampling = SamplingParams(cfg.temperature, cfg.top_p, room,
                                  self.renderer.stop_token_ids)
        return Request(tuple(ep.ids), ep.prompt.images, sampling, f"{ep.group}-{ep.sample}",
                       str(ep.group))

    def receive(self, ep: _Episode, req: Request, out: Completion | None) -> None:
        """Take the engine's answer (None: it failed every attempt) into the episode."""
        if out is None:
            _close(ep, ABORTED, "engine")
        elif self.placeholders.intersection(out.token_ids):
            _close(ep, ABORTED, "placeholder")
        elif len(out.token_ids) > req.sampling.max_new_tokens:
            raise ValueError(f"engine returned {len(out.token_ids)} tokens for "
                             f"max_new_tokens={req.sampling.max_new_tokens}")
        else:
            _advance(ep, out, self.renderer, self.cfg, ep.prompt_len)


def _lock_step(episodes: list[_Episode], engine: Engine, step: _Stepper,
               max_retries: int) -> None:
    """Every turn, all active episodes' requests go to the engine in one call."""
    while True:
        active = [(ep, req) for ep in episodes if ep.status is None
                  and (req := step.request(ep)) is not None]
        if not active:
            return
        outs = generate_with_retries(engine, [req for _, req in active], max_retries)
        for (ep, req), out in zip(active, outs):
            step.receive(ep, req, out)


def _per_episode(episodes: list[_Episode], engine: AsyncEngine, step: _Stepper,
                 max_retries: int) -> None:
    """Each episode's request goes out on its own; when it comes back the episode steps its
    environment and sends its next turn at once. A failed request (an exception or an `abort`)
    is sent again up to `max_retries` times, then the episode is aborted."""
    pending: dict[concurrent.futures.Future, tuple[_Episode, Request, int]] = {}

    def send(ep: _Episode, req: Request | None, attempt: int = 0) -> None:
        if req is not None:
            pending[engine.submit(req)] = (ep, req, attempt)

    for ep in episodes:
        send(ep, step.request(ep))
    while pending:
        done, _ = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
        for future in done:
            ep, req, attempt = pending.pop(future)
            try:
                out = future.result()
            except FatalEngineError:
                raise
            except Exception as e:  # noqa: BLE001 - retried, then aborted
                log.warning("engine request %s failed (attempt %d): %s", req.session,
                            attempt + 1, e)
                out = None
            if out is None or out.finish_reason == ABORT:
                if attempt < max_retries:
                    send(ep, req, attempt + 1)
                    continue
                out = None
            step.receive(ep, req, out)
            if ep.status is None:
                send(ep, step.request(ep))


def _trajectory(ep: _Episode, reward_config: RewardConfig, env_config: EnvConfig) -> Trajectory:
    """The finished episode, scored."""
    prompt = ep.prompt
    score = episode_reward(reward_config)([t.text for t in ep.turns], [t.info for t in ep.turns],
                                          prompt.answer, reward_config, ep.env.choices,
                                          env_config)
    aborted = ep.status == ABORTED
    return Trajectory(
        uid=prompt.uid, group_id=ep.group, sample_idx=ep.sample, answer=prompt.answer,
        token_ids=np.asarray(ep.ids, np.int64), loss_mask=np.asarray(ep.mask, np.int8),
        rollout_logprobs=np.asarray(ep.logps, np.float32), prompt_len=ep.prompt_len,
        images=list(prompt.images), turns=ep.turns, status=ep.status,
        reward=0.0 if aborted else score.reward, correct=score.correct and not aborted,
        correct_turn=None if aborted else score.correct_turn, abort_reason=ep.abort_reason,
        routed_experts=_routing(ep.routing, len(ep.ids)))


def _routing(routed: np.ndarray | None, length: int) -> np.ndarray | None:
    """(length, L, K) int16: an episode's last `routed_experts` (R, L, K), R <= length, then
    rows of -1 (not recorded); None for None."""
    if routed is None:
        return None
    if len(routed) and (routed.min() < 0 or routed.max() > np.iinfo(np.int16).max):
        raise ValueError(f"routed expert ids must lie in [0, 32767], got {routed.min()}.."
                         f"{routed.max()}")
    out = np.full((length,) + routed.shape[1:], -1, np.int16)
    out[:len(routed)] = routed
    return out


def split_turns(traj: Trajectory) -> list[Trajectory]:
    """The `individual` export: one trajectory per assistant turn, sharing the episode's reward.

    Piece k holds everything up to the end of turn k; only turn k's tokens keep loss mask 1
    (earlier turns and observations are its prompt).
    """
    pieces = []
    for turn in traj.turns:
        mask = np.zeros(turn.end, np.int8)
        mask[turn.start:turn.end] = traj.loss_mask[turn.start:turn.end]
        logps = np.where(mask == 1, traj.rollout_logprobs[:turn.end], 0.0).astype(np.float32)
        pieces.append(dataclasses.replace(
            traj, token_ids=traj.token_ids[:turn.end].copy(), loss_mask=mask,
            rollout_logprobs=logps, prompt_len=turn.start, turns=[turn],
            routed_experts=None if traj.routed_experts is None
            else traj.routed_experts[:turn.end]))
    return pieces
