"""One GRPO iteration on this process's prompts: rollout -> advantages -> packing -> update.

Shared by the training loop (`common.train`) and the learning test, for every learner, so all
run exactly the same math. Cross-process work goes through a `common.learner.Collectives`.
The engine's weights are NOT synced here: the loop asks the backend to after the step.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Mapping, Sequence

import numpy as np

from common.batching import (PackedBatch, TrainSequence, pack, training_sequences,
                             turn_token_advantages)
from common.env import EnvConfig
from common.grpo import episode_advantages, turn_advantages
from common.learner import Collectives, Deferred, Learner, SingleProcess
from common.evaluation.retry import forced_first_turns
from common.grader import STATS as reward_stats
from common.rollout import ABORTED, RolloutConfig, Trajectory, rollout
from common.reward import RewardConfig
from common.timing import timed


@dataclasses.dataclass(frozen=True)
class StepConfig:
    rollout: RolloutConfig
    env: EnvConfig
    reward: RewardConfig
    normalize_std: bool = True
    filter_equal_groups: bool = True
    turn_baseline: bool = False  # each turn's tokens against the group's episodes that reached it
    micro_batch_tokens: int = 8192
    updates_per_rollout: int = 1
    image_token_id: int | None = None  # given: a group's samples share its prompt (`pack`)
    # The share of prompts whose groups start from a forced wrong first call (loss-masked;
    # `common.evaluation.retry.forced_first_turns`), drawn from `seed` and the step.
    forced_miss_fraction: float = 0.0
    seed: int = 0
    # The rollouts were sampled with the learner's current weights (a synchronous loop on the
    # learner's own engine): with one update per rollout, clip_frac and approx_kl then compare
    # the policy with itself and are not reported.
    on_policy: bool = False

    def __post_init__(self):
        if self.updates_per_rollout < 1:
            raise ValueError(f"updates_per_rollout must be >= 1, got {self.updates_per_rollout}")


def grpo_step(prompts: Sequence, engine, renderer, learner: Learner, cfg: StepConfig,
              group_offset: int, comm: Collectives = SingleProcess(),
              train_context=contextlib.nullcontext
              ) -> tuple[list[Trajectory], dict[str, float]]:
    """Roll out `prompts`, train once on the result (`collect`, then `learn`). Returns this
    process's trajectories and the step's metrics (the learner's, batch counts over processes,
    phase times). `train_context()` wraps the update (a colocated server frees its memory)."""
    trajs, metrics = collect(prompts, engine, renderer, cfg, group_offset)
    return trajs, metrics | learn(trajs, learner, cfg, comm, train_context,
                                  metrics["time_rollout"])


def collect(prompts: Sequence, engine, renderer, cfg: StepConfig, group_offset: int,
            prompt_ids: Sequence[Sequence[int]] | None = None
            ) -> tuple[list[Trajectory], dict[str, float]]:
    """This process's rollouts of `prompts`, with time_rollout and the grader's counts;
    `prompt_ids`: the prompts rendered ahead (`common.rollout.rollout`), or None."""
    times: dict[str, float] = {}
    graded = reward_stats.snapshot()
    first = forced_first_turns(prompts, renderer, cfg.forced_miss_fraction, cfg.seed,
                               group_offset)
    with timed(times, "rollout"):
        trajs = rollout(prompts, engine, renderer, cfg.rollout, cfg.env, cfg.reward,
                        group_offset, prompt_ids, first_turns=first)
    if cfg.forced_miss_fraction:
        times["forced_groups"] = float(sum(t is not None for t in first or ()))
    times.update({f"grader_{k}": float(v - graded[k])
                  for k, v in reward_stats.snapshot().items() if k in ("calls", "timeouts")})
    return trajs, times


def learn(trajs: list[Trajectory], learner: Learner, cfg: StepConfig,
          comm: Collectives = SingleProcess(), train_context=contextlib.nullcontext,
          rollout_s: float = 0.0) -> Deferred:
    """Advantages, the dynamic-sampling filter, mini-batches (`mini_batches`), packing and the
    update on this process's trajectories. Returns the learner's metrics and batch counts over
    processes, as a `Deferred`: the update may still be running (reading a value waits for it).
    """
    times: dict[str, float] = {}
    with timed(times, "batching"):
        rewards = np.array([t.reward for t in trajs])
        groups = np.array([t.group_id for t in trajs])
        valid = np.array([t.status != ABORTED for t in trajs], dtype=bool)
        adv, keep = episode_advantages(rewards, groups, valid, cfg.normalize_std,
                                       cfg.filter_equal_groups)
        if cfg.turn_baseline:
            per_turn = turn_advantages(rewards, groups, valid,
                                       np.array([len(t.turns) for t in trajs]), cfg.normalize_std)
            adv = [turn_token_advantages(t, a) for t, a in zip(trajs, per_turn)]
        seqs = training_sequences(trajs, adv, cfg.rollout.export_style, keep)
        seed = int(groups.min()) if len(groups) else 0  # the step's first group: reproducible
        minis = [pack(part, cfg.micro_batch_tokens, cfg.image_token_id)
                 for part in mini_batches(seqs, trajs, cfg.updates_per_rollout, seed)]
        most = comm.sum_scalars({f"micro_{k}": float(len(m)) for k, m in enumerate(minis)},
                                max_keys=tuple(f"micro_{k}" for k in range(len(minis))))
        batches = [b for m in minis for b in m]
        counts = comm.sum_scalars(
            {"tokens": float(sum(s.loss_mask.sum() for s in seqs)),
             "seqs": float(sum(s.share for s in seqs)),
             "packed": float(sum(b.num_tokens for b in batches)),
             "filtered": float(len(set(groups[~keep & valid]))),
             "generated": float(sum(t.num_generated for t in trajs))})
        counts["micro"] = float(sum(most.values()))
        if comm.world > 1:  # every process runs as many forward/backward passes
            spare = spare_sequence(trajs)
            minis = [even_out(m, int(most[f"micro_{k}"]), spare) for k, m in enumerate(minis)]
    learned: Mapping[str, float] = {}
    times["time_train"] = 0.0  # (stays 0.0 when nothing trained)
    trained = counts["seqs"] > 0  # no group with a reward spread on any process: nothing to learn
    if trained:
        with timed(times, "train"), train_context():
            learned = update(learner, minis, comm)
        if cfg.on_policy and cfg.updates_per_rollout == 1:  # (values not waited for)
            values = learned.pending() if isinstance(learned, Deferred) else dict(learned)
            learned = {k: v for k, v in values.items() if k not in SELF_COMPARED}
    world, budget = comm.world, cfg.micro_batch_tokens

    def finish(metrics: dict[str, float], waited: float) -> None:
        if trained:  # waiting for a learner's background step is training time too
            metrics["time_train"] += waited
        metrics["train_tokens_per_s"] = (counts["packed"] / max(metrics["time_train"], 1e-9)
                                         / world)

    return Deferred(learned, times, {
        "filtered_groups": counts["filtered"], "sequences": counts["seqs"],
        "micro_batches": counts["micro"],
        "packing_efficiency": counts["packed"] / max(counts["micro"] * world * budget, 1.0),
        "rollout_tokens_per_s": counts["generated"] / max(rollout_s, 1e-9) / world},
        then=finish)


# With one update on rollouts of the current weights these compare the policy with itself.
SELF_COMPARED = ("clip_frac", "approx_kl")


def mini_batches(seqs: Sequence[TrainSequence], trajs: Sequence[Trajectory], updates: int,
                 seed: int) -> list[list[TrainSequence]]:
    """`seqs` split into `updates` mini-batches of whole groups, the groups in a seeded random
    order: every mini-batch holds both sides of each of its groups' advantages (group
    advantages sum to zero), whatever the packing's length order. One mini-batch (all of
    `seqs`, in order) for updates = 1. A process may get empty mini-batches (fewer groups)."""
    if updates == 1:
        return [list(seqs)]
    group_of = [trajs[s.traj_index].group_id for s in seqs]
    order = np.random.default_rng(seed).permutation(sorted(set(group_of)))
    share = {g: k for k, part in enumerate(np.array_split(order, updates)) for g in part}
    return [[s for s, g in zip(seqs, group_of) if share[g] == k] for k in range(updates)]


def update(learner: Learner, minis: list[list[PackedBatch]],
           comm: Collectives = SingleProcess()) -> Mapping[str, float]:
    """Train on one rollout's micro-batches: one optimizer step per mini-batch (`mini_batches`;
    one: the anchor recipe), the token and sequence counts summed over processes. With several,
    every step is against the behaviour policy's log-probs, computed once before the first, so
    that the ratio, clipping, dual clip and KL act. Metrics are averaged over the steps
    (skipped: summed); an empty mini-batch on every process is no step."""
    if len(minis) > 1:
        flat = [b for m in minis for b in m]
        old = iter(learner.logprobs(flat))
        minis = [[dataclasses.replace(b, old_logprobs=next(old)) for b in m] for m in minis]
    steps = []
    for mini in minis:
        counts = comm.sum_scalars({"tokens": float(sum(b.loss_mask.sum() for b in mini)),
                                   "seqs": float(sum(_trained_sequences(b) for b in mini))})
        if counts["seqs"] > 0:
            steps.append(learner.train_step(mini, counts["tokens"], counts["seqs"]))
    if len(steps) == 1:
        return steps[0]
    out = {k: float(np.mean([m[k] for m in steps])) for k in steps[0]}
    out["skipped"] = float(sum(m["skipped"] for m in steps))
    return out


def _trained_sequences(b: PackedBatch) -> float:
    """Episodes' worth of trained sequences in a micro-batch (`TrainSequence.share`; fillers
    and shared prefixes have none)."""
    trained = np.add.reduceat(b.loss_mask, b.cu_seqlens[:-1]).astype(np.float64)
    over = trained if b.mean_over is None else np.asarray(b.mean_over, np.float64)
    return float((trained / np.maximum(over, 1.0)).sum())


def spare_sequence(trajs: Sequence[Trajectory]) -> TrainSequence | None:
    """A sequence that trains nothing (loss mask 0) from this process's first trajectory, with
    its images: what a process with no micro-batch of its own runs (see `even_out`)."""
    if not trajs:
        return None
    t = trajs[0]
    return TrainSequence(np.asarray(t.token_ids), np.zeros_like(t.loss_mask),
                         np.zeros(len(t.token_ids), np.float32), 0.0, list(t.images), 0)


def even_out(batches: list[PackedBatch], n: int, spare: TrainSequence | None
             ) -> list[PackedBatch]:
    """Pad this process's micro-batches to `n` (the most any process has) with fillers that
    train nothing (loss mask 0: zero loss and gradient) but run the same layers, so sharded
    learners issue the same collectives everywhere. A process with no micro-batch at all (its
    groups were all filtered or aborted) runs `spare` (with its images, so the vision tower runs
    on every process too)."""
    if len(batches) >= n:
        return batches
    if batches:
        filler = dataclasses.replace(batches[-1], loss_mask=np.zeros_like(batches[-1].loss_mask))
    elif spare is not None and not spare.loss_mask.any():
        filler, = pack([spare], len(spare))
    else:
        raise ValueError("a process with no micro-batch needs a spare sequence with an empty "
                         "loss mask to take part in the update")
    return batches + [filler] * (n - len(batches))
