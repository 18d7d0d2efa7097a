"""common.step.learn on real rollouts (scripted engine): what each optimizer step is given.

A recording learner stands in for the model: these tests pin what `learn` hands a learner (the
mini-batches, their counts, the aggregation weights the learners compute from them), not a
learner's numerics (tests/test_learners.py pins those against the numpy reference)."""

import json

import numpy as np
import pytest

from common.env import EnvConfig
from common.grpo import token_weights
from common.reward import RewardConfig
from common.rollout import RolloutConfig, rollout
from common.step import StepConfig, learn
from tests.conftest import Reply, ScriptedEngine, make_prompt


def call(answer):
    return ('<tool_call>{"name": "calc_score", "arguments": {"answer": ' + json.dumps(answer)
            + '}}</tool_call>')


class Recorder:
    """A learner that records each optimizer step's micro-batches and counts."""

    def __init__(self):
        self.steps = []

    def logprobs(self, batches):
        return [np.zeros(b.num_tokens, np.float32) for b in batches]

    def train_step(self, batches, n_tokens, n_seqs):
        self.steps.append((list(batches), n_tokens, n_seqs))
        return {"loss": 0.0, "grad_norm": 0.0, "lr": 0.0, "skipped": 0.0, "clip_frac": 0.0,
                "approx_kl": 0.0}


def trajectories(groups: int, renderer):
    """`groups` prompts x 4 episodes: two solve it at once (one short turn), two never do
    (three long turns): wrong answers are long, right ones short, as in a real run."""
    right, wrong = Reply(call("12")), Reply("let me think it over " + call("7"))
    script = {f"{g}-{k}": ([right] if k < 2 else [wrong] * 3)
              for g in range(groups) for k in range(4)}
    prompts = [make_prompt(uid=f"p{g}") for g in range(groups)]
    return rollout(prompts, ScriptedEngine(script), renderer,
                   RolloutConfig(n_samples=4, max_response_tokens=2000,
                                 max_context_tokens=4000), EnvConfig(max_turns=3))


def step_config(updates=1, export="concat", budget=1000):
    return StepConfig(RolloutConfig(n_samples=4, export_style=export), EnvConfig(max_turns=3),
                      RewardConfig(), micro_batch_tokens=budget, updates_per_rollout=updates)


def test_each_update_of_a_rollout_sees_whole_groups(renderer):
    """Two updates on one rollout of 4 groups: each mini-batch holds 2 whole groups, so both
    signs of the advantage and a zero advantage sum. Before, the mini-batches were consecutive
    slices of length-sorted micro-batches: here one update got all 8 right episodes and 4 wrong
    ones, the other only 4 wrong ones (every advantage negative)."""
    trajs = trajectories(4, renderer)
    learner = Recorder()
    learn(trajs, learner, step_config(updates=2)).settle()
    assert len(learner.steps) == 2
    for batches, n_tokens, n_seqs in learner.steps:
        adv = np.array([b.advantages[b.cu_seqlens[s]:b.cu_seqlens[s + 1]].max()
                        + b.advantages[b.cu_seqlens[s]:b.cu_seqlens[s + 1]].min()
                        for b in batches for s in range(len(b.seq_index))])
        assert (adv > 0).sum() == 4 and (adv < 0).sum() == 4  # 2 groups: 2 right, 2 wrong each
        assert n_seqs == 8 and n_tokens == sum(b.loss_mask.sum() for b in batches)
        assert abs(adv.sum()) < 1e-5
    # every trajectory trained exactly once over the two updates
    seen = sorted(int(i) for batches, _, _ in learner.steps for b in batches for i in b.seq_index)
    assert len(seen) == 16


def test_turns_exported_apart_weigh_each_episode_once(renderer):
    """The individual export cuts a 3-turn episode into 3 sequences: with seq-mean-token-mean
    each episode must still weigh 1 / episodes (before: a 3-turn episode weighed 3x a 1-turn
    one, 3/8 against 1/8 of the loss here, and the counts said 8 sequences)."""
    trajs = trajectories(1, renderer)
    learner = Recorder()
    learn(trajs, learner, step_config(export="individual", budget=2000)).settle()
    (batches, n_tokens, n_seqs), = learner.steps
    assert n_seqs == pytest.approx(4.0)  # episodes, however they are cut
    traj_of = np.repeat(np.arange(4), [len(t.turns) for t in trajs])  # sequences in order
    assert list(traj_of) == [0, 1, 2, 2, 2, 3, 3, 3]  # 2 one-turn, 2 three-turn episodes
    weight = np.zeros(4)
    # the weights both learners compute (geo3k_torch.learner, geo3k_jax.core.batch)
    for b in batches:
        w = token_weights(b.loss_mask, "seq-mean-token-mean", seq_ids=b.seq_ids,
                          n_tokens=n_tokens, n_seqs=n_seqs, mean_over=b.mean_over)
        for s, i in enumerate(b.seq_index):
            weight[traj_of[i]] += w[b.cu_seqlens[s]:b.cu_seqlens[s + 1]].sum()
    assert weight == pytest.approx([0.25] * 4)


def turn_advantage_rollout(renderer):
    """One group: two episodes solve on turn 1, one on turn 2 (reward 0.5 with the discount),
    one never (three turns, reward 0)."""
    right, wrong = Reply(call("12")), Reply(call("7"))
    script = {"0-0": [right], "0-1": [right], "0-2": [wrong, right], "0-3": [wrong] * 3}
    return rollout([make_prompt(uid="p0")], ScriptedEngine(script), renderer,
                   RolloutConfig(n_samples=4, max_response_tokens=2000, max_context_tokens=4000),
                   EnvConfig(max_turns=3), RewardConfig(turn_discount=0.5))


@pytest.mark.parametrize("export", ["concat", "individual"])
def test_the_turn_baseline_scores_each_turn_against_the_episodes_that_reached_it(renderer,
                                                                                 export):
    """With `turn_baseline`, the turn-2 solve's tokens are ranked against the other episode that
    reached turn 2 (+0.52), not against the two first-try solves (its turn 1 stays negative, as
    in the whole-group baseline); the turn only one episode reached trains nothing. Before,
    every token of an episode had the whole group's advantage: the turn-2 solve's -0.26."""
    trajs = turn_advantage_rollout(renderer)
    assert [t.reward for t in trajs] == [1.0, 1.0, 0.5, 0.0]
    assert [len(t.turns) for t in trajs] == [1, 1, 2, 3]
    cfg = StepConfig(RolloutConfig(n_samples=4, export_style=export), EnvConfig(max_turns=3),
                     RewardConfig(turn_discount=0.5), micro_batch_tokens=4000,
                     turn_baseline=True)
    learner = Recorder()
    learn(trajs, learner, cfg).settle()
    (batches, _, _), = learner.steps
    pieces = [(i, k) for i, t in enumerate(trajs)
              for k in ([None] if export == "concat" else range(len(t.turns)))]
    got = {}  # (episode, turn) -> the advantages on that turn's trained tokens
    for b in batches:
        for s, q in enumerate(b.seq_index):
            i, only = pieces[q]
            seg = slice(b.cu_seqlens[s], b.cu_seqlens[s + 1])
            adv, mask = b.advantages[seg], b.loss_mask[seg]
            for k, turn in enumerate(trajs[i].turns):
                if only in (None, k):
                    span = mask[turn.start:turn.end] > 0
                    got[i, k + 1] = {round(float(x), 3) for x in adv[turn.start:turn.end][span]}
    whole = (np.array([1, 1, 0.5, 0]) - 0.625) / np.std([1, 1, 0.5, 0], ddof=1)
    first = [round(float(x), 3) for x in whole]
    # turn 2: rewards 0.5 and 0 around 0.25, on the group's scale (std 0.479): +-0.522
    assert got == {(0, 1): {first[0]}, (1, 1): {first[1]}, (2, 1): {first[2]}, (3, 1): {first[3]},
                   (2, 2): {0.522}, (3, 2): {-0.522}, (3, 3): {0.0}}
    assert first == [0.783, 0.783, -0.261, -1.306]
