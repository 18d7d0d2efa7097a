"""Rollout scheduling on a simulated inference server: lock-step turns vs per-episode scheduling,
and the training loop with staleness 0, 1, 2 (generation overlapping training).

    python scripts/benchmark_rollout.py [--prompts=16 --samples=8 --concurrency=64 --scale=1.0]

The real multi-turn rollout (`common.rollout`: environment, feedback, budgets) runs against
`SimulatedServer`, an engine with a latency model instead of a model:

  * a request takes  PREFILL_MS x (prompt tokens not yet cached for its session)
                   + DECODE_MS  x (new tokens)   milliseconds (x --scale), really slept
  * at most `--concurrency` requests run at once (the rest queue), like a server's batch slots;
  * response lengths are long-tailed: log-normal with median 400 tokens and sigma 0.9, capped
    at the turn's budget (4,096 tokens per episode), so most turns are a few hundred tokens and
    a few run into the thousands, as in slime's multi-turn Geometry3K runs (700-4,096);
  * a turn answers right with probability 0.45 (else wrong, and the episode takes another turn,
    up to 3): episodes have 1 to 3 turns.

Lock-step sends all active episodes' turn in one batch and waits for the slowest; per-episode
scheduling (`rollout.schedule=episode`, an engine with `submit`) sends each episode's next turn
as soon as its own answer is back. The ideal is the slowest episode alone (its turns back to
back, no queueing).

Staleness: the real loop (`common.train.train`, `train.max_staleness` = 0, 1, 2) runs
`--steps` steps on the simulated server (per-episode scheduling) with `SleepingLearner`, a
learner that takes a fixed time per update: the mean rollout time measured above, so training
takes about as long as generation. The ideal step is max(rollout, train). Timing never decides a
test; this prints tables.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import tempfile
import threading
import time
import zlib

import numpy as np
from absl import app, flags

from common.engine import LENGTH, STOP, Completion, Request
from common.env import EnvConfig
from common.rollout import RolloutConfig, rollout
from simulated_mix import (BUDGET, DECODE_MS, FEEDBACK_TOKENS, PREFILL_MS,
                                   PROMPT_TOKENS, TURNS, draw_turn)

_PROMPTS = flags.DEFINE_integer("prompts", 16, "Prompts per step.")
_SAMPLES = flags.DEFINE_integer("samples", 8, "Episodes per prompt.")
_CONCURRENCY = flags.DEFINE_integer("concurrency", 64, "Requests the server runs at once.")
_SCALE = flags.DEFINE_float("scale", 1.0, "Multiplies every simulated time.")
_ROUNDS = flags.DEFINE_integer("rounds", 2, "Measured rollouts per schedule.")
_STEPS = flags.DEFINE_integer("steps", 6, "Loop steps per staleness setting.")

END = 1


class TokenRenderer:
    """Token ids without a tokenizer: prompts of PROMPT_TOKENS ids, one id per feedback."""

    stop_token_ids = (END,)
    placeholder_ids = ()

    def prompt_ids(self, messages, images):
        return [5] * PROMPT_TOKENS

    def observation_ids(self, message, last_token):
        return [7] * FEEDBACK_TOKENS

    def decode(self, ids):
        return self.script.get(tuple(ids), "")


@dataclasses.dataclass
class Prompt:
    uid: str
    answer: str = "12"
    images: tuple = ()
    messages: tuple = ()


class SimulatedServer:
    """An `AsyncEngine` whose answers are a function of the request (so both schedules see the
    same episodes) and whose latency follows the module docstring's model."""

    def __init__(self, renderer: TokenRenderer, concurrency: int, scale: float, seed: int):
        self.renderer, self.scale, self.seed = renderer, scale, seed
        self.slots = threading.Semaphore(concurrency)
        self.pool = concurrent.futures.ThreadPoolExecutor(4 * concurrency)
        self.cached: dict[str, int] = {}
        self.lock = threading.Lock()
        self.busy_s: dict[str, float] = {}  # session -> seconds of its own requests

    def answer(self, req: Request) -> tuple[list[int], float]:
        """(new token ids, seconds) of a request, fixed by its session and length."""
        rng = np.random.default_rng([self.seed, zlib.crc32(req.session.encode()),
                                     len(req.input_ids)])
        n, right = draw_turn(rng, req.sampling.max_new_tokens - 1)
        ids = [100 + int(right)] + [9] * (n - 1) + [END]
        self.renderer.script[tuple(ids[:-1])] = ('<tool_call>{"name": "calc_score", '
                                                 '"arguments": {"answer": "%s"}}</tool_call>'
                                                 % ("12" if right else "7"))
        with self.lock:
            new_prefix = len(req.input_ids) - self.cached.get(req.session, 0)
            self.cached[req.session] = len(req.input_ids) + len(ids)
        seconds = (PREFILL_MS * new_prefix + DECODE_MS * len(ids)) / 1000 * self.scale
        return ids, seconds

    def _run(self, req: Request) -> Completion:
        ids, seconds = self.answer(req)
        with self.slots:
            time.sleep(seconds)
        with self.lock:
            self.busy_s[req.session] = self.busy_s.get(req.session, 0.0) + seconds
        finish = STOP if len(ids) <= req.sampling.max_new_tokens else LENGTH
        ids = ids[:req.sampling.max_new_tokens]
        return Completion(ids, [-0.5] * len(ids), finish)

    def submit(self, request: Request) -> concurrent.futures.Future:
        return self.pool.submit(self._run, request)

    def generate(self, requests):
        return [f.result() for f in [self.submit(r) for r in requests]]


def measure(schedule: str, seed: int) -> dict[str, float]:
    renderer = TokenRenderer()
    renderer.script = {}
    server = SimulatedServer(renderer, _CONCURRENCY.value, _SCALE.value, seed)
    cfg = RolloutConfig(n_samples=_SAMPLES.value, max_response_tokens=BUDGET,
                        max_context_tokens=8192, schedule=schedule)
    prompts = [Prompt(f"p{i}") for i in range(_PROMPTS.value)]
    start = time.perf_counter()
    trajs = rollout(prompts, server, renderer, cfg, EnvConfig(max_turns=TURNS))
    wall = time.perf_counter() - start
    server.pool.shutdown()
    return {"wall_s": wall, "ideal_s": max(server.busy_s.values()),
            "turns": float(np.mean([len(t.turns) for t in trajs])),
            "tokens": float(sum(t.num_generated for t in trajs))}


class SleepingLearner:
    """A `common.learner.Learner` stand-in: each update takes `seconds`, nothing is learnt."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def train_step(self, batches, n_tokens, n_seqs):
        time.sleep(self.seconds)
        return {"loss": 0.0, "grad_norm": 0.0, "lr": 0.0, "skipped": 0.0}

    def logprobs(self, batches):
        return [np.zeros(b.num_tokens, np.float32) for b in batches]

    def export_hf(self, out_dir):
        pass

    def save(self, directory):
        pass

    def wait_saved(self):
        pass

    def restore(self, directory):
        pass


class SimulatedBackend:
    """The simulated server as a `common.engine.Backend` (weights are not simulated)."""

    def __init__(self, engine):
        self.engine = engine

    def sync(self, learner, step):
        pass

    def train_context(self):
        return contextlib.nullcontext()

    def rng_state(self):
        return None

    def set_rng_state(self, state):
        pass

    def close(self):
        self.engine.pool.shutdown()


def loop_seconds(max_staleness: int, train_s: float, workdir: str) -> float:
    """Seconds per step of the real loop at `max_staleness` (first step excluded)."""
    from common.learner import SingleProcess
    from common.train import Run, train
    from configs import base

    cfg = base.get_config()
    cfg.train.steps, cfg.train.prompts_per_step = _STEPS.value, _PROMPTS.value
    cfg.train.max_staleness, cfg.train.micro_batch_tokens = max_staleness, 8192
    cfg.rollout.n_samples, cfg.rollout.max_response_tokens = _SAMPLES.value, BUDGET
    cfg.rollout.max_context_tokens = 8192
    cfg.advantage.filter_equal_groups = False
    cfg.eval.every, cfg.checkpoint.every = 0, 10 ** 6
    cfg.log.tensorboard, cfg.log.dump_rollouts, cfg.log.plot_every = False, False, 0
    renderer = TokenRenderer()
    renderer.script = {}
    server = SimulatedServer(renderer, _CONCURRENCY.value, _SCALE.value, 0)
    prompts = [Prompt(f"p{i}") for i in range(_PROMPTS.value * _STEPS.value)]
    stamps = []

    class Timed(SleepingLearner):
        def train_step(self, *a):
            out = super().train_step(*a)
            stamps.append(time.perf_counter())
            return out

    run = Run(Timed(train_s), SimulatedBackend(server), SingleProcess(), None, prompts, [],
              renderer=renderer)
    train(cfg, workdir, run)
    return float(np.mean(np.diff(stamps)))


def main(argv):
    del argv
    rows = {}
    for schedule in ("lockstep", "episode"):
        runs = [measure(schedule, seed) for seed in range(_ROUNDS.value)]
        rows[schedule] = {k: float(np.mean([r[k] for r in runs])) for k in runs[0]}
    lock, ep = rows["lockstep"], rows["episode"]
    print(f"\n{_PROMPTS.value} prompts x {_SAMPLES.value} episodes, up to 3 turns, concurrency "
          f"{_CONCURRENCY.value}, scale {_SCALE.value}; mean of {_ROUNDS.value} rollouts "
          f"({lock['turns']:.2f} turns, {lock['tokens']:,.0f} generated tokens per rollout)")
    print("| schedule | seconds per rollout | / ideal |")
    print("|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['wall_s']:.2f} | {r['wall_s'] / r['ideal_s']:.2f} |")
    print(f"| ideal (slowest episode alone) | {ep['ideal_s']:.2f} | 1.00 |")
    print(f"per-episode speed-up over lock-step: {lock['wall_s'] / ep['wall_s']:.2f}x")

    train_s = ep["wall_s"]  # training takes about as long as generating
    steps = {}
    for k in (0, 1, 2):
        with tempfile.TemporaryDirectory() as workdir:
            steps[k] = loop_seconds(k, train_s, workdir)
    print(f"\nthe loop, {_STEPS.value} steps, update {train_s:.2f} s, rollout about "
          f"{ep['wall_s']:.2f} s (ideal step: max of the two)")
    print("| train.max_staleness | seconds per step | speed-up over 0 |")
    print("|---|---|---|")
    for k, s in steps.items():
        print(f"| {k} | {s:.2f} | {steps[0] / s:.2f}x |")
    print(json.dumps({"schedules": rows, "staleness_step_s": steps}))


if __name__ == "__main__":
    app.run(main)
