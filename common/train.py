"""The training loop, for any learner: sample prompts -> GRPO step -> weight sync -> the next
step's prompts drawn and rendered -> metrics, curve, rollout dump -> checkpoint -> periodic
evaluation. A fresh run is also evaluated at step 0, before any update (logged as step 0; the
engine's random state is put back after it, so training samples as it would without). A
learner whose update runs in the background (JAX's) overlaps it with everything after the
weight sync.

    metrics = train(cfg, workdir, Run(learner, backend, comm, processor, train_set, test_set))

The entry points (`python -m geo3k_torch.main`, `python -m geo3k_jax.train`) build the pieces
for their framework and call `train`. The workdir layout is in the README; what a checkpoint
holds is in `common.checkpoints`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

from absl import logging

from common import checkpoints, micro_batch
from common.engine import Backend
from common.env import EnvConfig
from common.evaluation.baselines import Problem
from common.evaluation.evaluate import evaluate
from common.grpo import LossConfig
from common.learner import Collectives, Learner, SingleProcess
from common.metrics import metrics_of_sums, rollout_sums
from common.runlog import RunLog, dump_rollouts, write_config
from common.rollout import RolloutConfig, render_prompts
from common.sampler import PromptSampler
from common.reward import RewardConfig
from common.prepare import make_renderer
from common.pipeline import rollout_source
from common.step import StepConfig, collect, learn
from common.timing import timed
from configs import to_dataclass


@dataclasses.dataclass
class Run:
    """The pieces an entry point builds for `train`; `shutdown` runs after the backend closes
    (torch: leave the process group)."""

    learner: Learner
    backend: Backend
    comm: Collectives
    processor: object
    train_set: Sequence
    test_set: Sequence
    shutdown: Callable[[], None] = lambda: None
    renderer: object = None  # a `common.rollout.Renderer`; None: the processor's chat template
    counters: Callable[[], dict[str, float]] = dict  # logged every step (engine compiles)


def step_config(cfg, processor=None) -> StepConfig:
    """The GRPO step's settings from the config; with `train.share_prefix`, the processor's
    image token id (the learner trains each group's prompt once)."""
    image_token_id = None
    if cfg.train.share_prefix and processor is not None:
        image_token_id = getattr(processor, "image_token_id", None)
        if image_token_id is None:
            raise ValueError("train.share_prefix=True needs a processor with an image_token_id "
                             "(a Qwen-VL processor)")
    return StepConfig(to_dataclass(RolloutConfig, cfg.rollout), to_dataclass(EnvConfig, cfg.env),
                      to_dataclass(RewardConfig, cfg.reward), cfg.advantage.normalize_std,
                      cfg.advantage.filter_equal_groups, cfg.advantage.turn_baseline,
                      micro_batch.require_fixed(cfg.train.micro_batch_tokens,
                                                "the loop (the entry point resolves it first)"),
                      cfg.train.updates_per_rollout,
                      image_token_id,
                      on_policy=cfg.train.max_staleness == 0 and cfg.engine.backend == "local",
                      forced_miss_fraction=cfg.train.forced_miss_fraction, seed=cfg.seed)


class Finished(Exception):
    """The run in the workdir has reached `train.steps`: nothing is left to train (the
    message says so; the entry point exits 0)."""


def check_workdir(cfg, workdir: str | Path) -> None:
    """Stop before a run is built (and before the model loads) where it cannot write, or would
    overwrite an earlier run's checkpoints and append to its metrics: a workdir that is a file
    or cannot be written; a checkpoint there and `train.resume` unset. Raises `Finished` where
    `train.resume` finds a checkpoint at `train.steps` or past it. (Settings out of their
    ranges stop in the command line's preflight, `common.config_help`, and again in the
    build's first step, `common.prepare.check_config`.)"""
    path = Path(workdir)
    if path.exists() and not path.is_dir():
        raise ValueError(f"workdir {workdir} is a file, not a folder: pass another --workdir")
    try:
        path.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as e:
        raise ValueError(f"workdir {workdir} cannot be written ({e.strerror}): pass another "
                         "--workdir") from None
    last = checkpoints.latest(checkpoints.location(cfg, workdir))
    if last and not cfg.train.resume:
        raise ValueError(f"{last} holds an earlier run's checkpoint: pass "
                         "--config.train.resume=True to go on from it, or another --workdir")
    if last and (step := checkpoints.load_loop_state(last)["step"]) >= cfg.train.steps:
        raise Finished(f"{workdir} is finished: its newest checkpoint ({last}) is at step {step} "
                       f"of train.steps={cfg.train.steps}, nothing left to train (pass a larger "
                       "--config.train.steps to train on)")


def train(cfg, workdir: str | Path, run: Run) -> dict:
    """Run the configured training, then close the run's backend (on errors too); returns the
    last step's metrics."""
    try:
        return _loop(cfg, workdir, run)
    finally:
        run.backend.close()
        run.shutdown()


def _loop(cfg, workdir: str | Path, run: Run) -> dict:
    # ---- setup -------------------------------------------------------------------------
    workdir, comm, backend, learner = Path(workdir), run.comm, run.backend, run.learner
    step_cfg = step_config(cfg, run.processor)
    to_dataclass(LossConfig, cfg.loss)  # a bad loss setting stops here, before any rollout
    renderer = run.renderer or make_renderer(cfg, run.processor)
    # every process the same order, each its own part of every batch (`common.sampler`)
    sampler = PromptSampler(len(run.train_set), cfg.seed, rank=comm.rank, world=comm.world)
    log = RunLog(workdir, cfg.log.tensorboard, cfg.log.wandb_project,
                 cfg.to_dict()) if comm.rank == 0 else None
    if log:
        changed = write_config(workdir, cfg.to_dict(), cfg.train.resume)
        if changed:
            logging.warning("resuming with a config that differs from the run's: %s",
                            "; ".join(changed))
    start = 0
    ckpt_root = checkpoints.root(cfg, workdir, learner)  # may be a URL (common.storage)
    if cfg.train.resume and (last := checkpoints.latest(ckpt_root)):
        state = checkpoints.load_loop_state(last)
        if len(state["engine_rng"]) != comm.world:
            raise ValueError(f"{last} was written by {len(state['engine_rng'])} processes, "
                             f"this run has {comm.world}")
        learner.restore(last)
        start = state["step"]
        sampler = PromptSampler.of_process(state["sampler"], comm.rank, comm.world,
                                           len(run.train_set))
        backend.set_rng_state(state["engine_rng"][comm.rank])
        backend.sync(learner, start)
        if log:
            log.truncate_after(start)
        logging.info("resumed from %s at step %d", last, start)

    if start == 0 and cfg.eval.every:  # step 0: what the checkpoint does before any update
        rng = backend.rng_state()
        step0 = {f"eval/{k}": v for k, v in evaluate_split(
            cfg, run.test_set, backend.engine, renderer, comm,
            eval_episodes(workdir, 0)).items()}
        backend.set_rng_state(rng)  # training samples as it would without this evaluation
        if log:
            log.log(0, step0)

    # ---- the loop ----------------------------------------------------------------------
    def draw(step: int):  # every process its part of the step's batch: group ids as one's
        ids = sampler.next_batch(cfg.train.prompts_per_step // comm.world)
        offset = (step - 1) * cfg.train.prompts_per_step + comm.rank * len(ids)
        return [run.train_set[i] for i in ids], offset, sampler.state()

    def collect_rollouts(prompts, offset, prompt_ids):
        return collect(prompts, backend.engine, renderer, step_cfg, offset, prompt_ids)

    rollouts = rollout_source(cfg.train.max_staleness, draw, collect_rollouts, start + 1,
                              cfg.train.steps, lambda prompts: render_prompts(prompts, renderer))
    pending = None  # `finish` of the checkpoint still being written (`common.checkpoints`)

    def publish(finish) -> None:  # into place, and the older checkpoints pruned
        finish()
        if comm.rank == 0:
            checkpoints.prune(ckpt_root, cfg.checkpoint.keep)

    progress = _progress(comm.rank == 0)
    task = progress.add_task("train", total=cfg.train.steps, completed=start, info="")
    # without a terminal (nohup, SLURM, a pipe) the live bar shows nothing: a plain line a step
    plain = comm.rank == 0 and not sys.stdout.isatty()
    began, step_began = time.monotonic(), time.monotonic()
    metrics: dict = {}
    idle = 0  # steps in a row that trained no sequence
    with progress, contextlib.closing(rollouts):
        for step in range(start + 1, cfg.train.steps + 1):
            # rollout (in line, or generated ahead while earlier steps trained) and update
            trajs, train_m, sampler_state = rollouts.next(step)
            if pending:  # the last checkpoint was written while these rollouts ran
                publish(pending)
                pending = None
            train_m |= comm.sum_scalars({k: train_m[k] for k in GRADER_KEYS})
            fresh, stale_m = staleness(trajs, step, cfg.train.max_staleness, comm)
            train_m |= stale_m
            learned = learn(fresh, learner, step_cfg, comm, backend.train_context,
                            train_m["time_rollout"])  # the update may still be running
            with timed(train_m, "weight_sync"), rollouts.engine_lock:
                backend.sync(learner, step)  # the next rollouts sample from the new weights
            rollouts.landed(step)
            if step < cfg.train.steps:  # the next prompts, rendered while the update runs
                rollouts.prepare(step + 1)

            # dump and curve while a background update runs (each process dumps its own
            # trajectories; only their sums cross processes; the curve shows the steps logged
            # so far), then the step's metrics
            turns = step_cfg.env.max_turns
            metrics = {f"train/{k}": v for k, v in metrics_of_sums(
                comm.sum_scalars(rollout_sums(trajs, turns)), turns).items()}
            if cfg.log.dump_rollouts:
                name = f"step_{step}" + (f".process_{comm.rank}" if comm.world > 1 else "")
                dump_rollouts(workdir / "rollouts" / f"{name}.jsonl", trajs, renderer.decode)
            if log and cfg.log.plot_every and step % cfg.log.plot_every == 0 and step > 1:
                log.plot()
            train_m |= learned.settle() | run.counters()  # waits for the update
            metrics.update({f"train/{k}": v for k, v in train_m.items()})
            idle = 0 if train_m["sequences"] else idle + 1
            if log and idle and idle % IDLE_STEPS == 0:
                logging.warning(idle_message(idle, step, metrics, step_cfg))
            if cfg.eval.every and (step % cfg.eval.every == 0 or step == cfg.train.steps):
                with rollouts.engine_lock:
                    rng = backend.rng_state()
                    metrics.update({f"eval/{k}": v for k, v in evaluate_split(
                        cfg, run.test_set, backend.engine, renderer, comm,
                        eval_episodes(workdir, step)).items()})
                    backend.set_rng_state(rng)  # what is evaluated never changes training
            if log:
                log.log(step, metrics)

            # checkpoint
            if step % cfg.checkpoint.every == 0 or step == cfg.train.steps:
                with rollouts.engine_lock:
                    rng = backend.rng_state()
                loop_state = {"sampler": comm.gather(sampler_state),
                              "engine_rng": comm.gather(rng)}
                pending = checkpoints.start(ckpt_root, step, learner, loop_state,
                                            comm)
            progress.update(task, advance=1, info=summary(metrics))
            if plain:
                now = time.monotonic()
                print(step_line(step, cfg.train.steps, metrics, now - step_began,
                                (now - began) / (step - start) * (cfg.train.steps - step)),
                      flush=True)
                step_began = now
        if pending:
            publish(pending)
    if log:
        log.plot()
        log.close()
    return metrics


GRADER_KEYS = ("grader_calls", "grader_timeouts")
IDLE_STEPS = 5  # steps in a row that train nothing before the log says so (and every 5 after)


def idle_message(idle: int, step: int, metrics: dict, step_cfg: StepConfig) -> str:
    """The log's line for `idle` steps in a row, the last `step`, that trained no sequence."""
    reward = metrics.get("train/reward_mean", float("nan"))
    return (f"steps {step - idle + 1}-{step} trained nothing (0 sequences): no group of "
            f"{step_cfg.rollout.n_samples} episodes of a prompt had a reward spread (reward "
            f"mean {reward:.3f}), so every advantage was 0. More episodes per prompt "
            "(rollout.n_samples), a higher rollout.temperature or a reward that tells the "
            "episodes apart gives GRPO something to learn")


def staleness(trajs: list, step: int, bound: int, comm: Collectives
              ) -> tuple[list, dict[str, float]]:
    """(the trajectories within the staleness bound, metrics). The learner of step `step` is at
    version step - 1; a trajectory sampled with weights `policy_version` is step - 1 - version
    updates stale. Metrics over processes: staleness_mean, staleness_max, the histogram
    staleness_0..staleness_<bound>, and stale_dropped (over the bound: not trained on)."""
    ages = [step - 1 - t.policy_version for t in trajs]
    counts = {f"staleness_{a}": float(ages.count(a)) for a in range(bound + 1)}
    counts |= {"stale_dropped": float(sum(a > bound for a in ages)),
               "staleness_sum": float(sum(ages)), "n": float(len(ages)),
               "staleness_max": float(max(ages, default=0))}
    out = comm.sum_scalars(counts, max_keys=("staleness_max",))
    out["staleness_mean"] = out.pop("staleness_sum") / max(out.pop("n"), 1.0)
    return [t for t, a in zip(trajs, ages) if a <= bound], out


def evaluate_split(cfg, split: Sequence, engine, renderer,
                   comm: Collectives = SingleProcess(),
                   episodes: str | Path | None = None) -> dict:
    """`common.evaluation.evaluate.evaluate` on the first `eval.max_prompts` rows (0 = all) of a
    split with the config's rollout, environment and reward settings, with
    `eval.blank_images` the greedy run again on blank images (`blank/*` keys) and with
    `eval.forced_miss` after a forced wrong first call (`forced/*`, drawn from `seed`).
    `split` is this process's share (a `common.data.Geo3kSplit`, `load_split(..., shard=(rank,
    world))`): each process runs its own prompts; what crosses processes is the problems' text
    (for the baselines) and sums of scalars. With `episodes` (a .jsonl path), each process
    writes its episodes there (`.process_<rank>` before the suffix when there are several)."""
    n = cfg.eval.max_prompts or float("inf")
    mine = [p for p, row in zip(split, split.rows) if row < n]
    problems = [q for part in comm.gather([Problem.of(p) for p in mine]) for q in part]
    step_cfg = step_config(cfg)
    if episodes is not None and comm.world > 1:
        episodes = Path(episodes).with_suffix(f".process_{comm.rank}.jsonl")
    return evaluate(mine, engine, renderer, step_cfg.rollout, step_cfg.env, step_cfg.reward,
                    n_samples=cfg.eval.n_samples, split=problems, sum_scalars=comm.sum_scalars,
                    blank_images=cfg.eval.blank_images, forced_miss=cfg.eval.forced_miss,
                    seed=cfg.seed, episodes=episodes)


def eval_episodes(workdir: Path, step: int) -> Path:
    """Where the loop's evaluation at `step` writes its episodes (`common.evaluation.episodes`)."""
    return workdir / "eval" / f"episodes_step_{step}.jsonl"


def _progress(enabled: bool):
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn, TimeRemainingColumn)
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[info]}"),
                    disable=not enabled)


def step_line(step: int, steps: int, m: dict, seconds: float, eta_s: float) -> str:
    """One plain line for a step: 'step 12/200 reward 0.412 acc 0.381 tools 0.980 9.1 s eta
    28m05s', then the evaluation's accuracy on steps that have one."""
    keys = (("train/reward_mean", "reward"), ("train/accuracy", "acc"),
            ("train/tool_call_rate", "tools"), ("eval/greedy_accuracy", "eval"))
    parts = [f"step {step}/{steps}"] + [f"{name} {m[k]:.3f}" for k, name in keys if k in m]
    eta = int(round(eta_s))
    return " ".join(parts + [f"{seconds:.1f} s", f"eta {eta // 60}m{eta % 60:02d}s"])


def summary(m: dict) -> str:
    """One line of the headline metrics, for the progress bar and the final print."""
    keys = (("train/reward_mean", "reward"), ("train/accuracy", "acc"),
            ("train/turns_mean", "turns"), ("train/grad_norm", "gnorm"),
            ("eval/greedy_accuracy", "eval"), ("eval/baseline_with_feedback", "no-skill"))
    return " ".join(f"{name} {m[k]:.3f}" for k, name in keys if k in m)
