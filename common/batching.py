"""Trajectories become learner micro-batches: packed without padding, or padded.

`training_sequences` turns scored trajectories (and their group advantages) into the sequences
the learner trains on, in the chosen export style. `pack` concatenates them into micro-batches of
at most `token_budget` tokens (first-fit decreasing), keeping per-sequence boundaries
(`cu_seqlens`) and the images of those sequences in order. `pad` makes the (B, L) layout.

Shared prefixes: the n samples of a GRPO group repeat the same prompt (same tokens, same
images). Given the image token id, `pack` puts such a prompt into the micro-batch once, as a
segment of its own that trains nothing, followed by each sample's remainder as a segment whose
`parents` entry points at it: the learner attends each remainder to the prefix and to itself,
with the positions it would have had alone, so log-probs and gradients equal those of the
separate sequences while the prompt (and its images) is computed once per group.

    prompt ........ | sample 0's rest | sample 1's rest | ...      segments of one micro-batch
    parents:   -1           0                 0

Token arrays are aligned with the tokens: `loss_mask[t]` and `rollout_logprobs[t]` belong to token
t, whose log-prob the learner reads from the logits at position t - 1 of the same sequence (the
first token of a sequence is always prompt, mask 0). So are `routed_experts[t]`, the experts the
engine routed token t to (`loss.routing_replay`): a shared prompt takes its first sample's.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from common.processor import image_key
from common.rollout import ABORTED, Trajectory, split_turns


@dataclasses.dataclass
class TrainSequence:
    """One training sequence. Arrays are (T,); `traj_index` points back at its trajectory.
    `advantage`: its episode's, or (T,) one per token (`turn_token_advantages`).
    `episode_tokens`: the trained tokens of its whole episode when it is one turn of it (the
    `individual` export), so that a per-sequence mean weighs each episode once; 0: its own.
    `routed_experts`: (T, L, K) int16, the engine's experts per token and sparse layer (-1: not
    recorded), or None (`common.rollout.Trajectory.routed_experts`)."""

    token_ids: np.ndarray
    loss_mask: np.ndarray
    rollout_logprobs: np.ndarray
    advantage: float | np.ndarray
    images: list
    traj_index: int
    episode_tokens: int = 0
    routed_experts: np.ndarray | None = None

    @property
    def mean_over(self) -> float:
        """The trained tokens its per-sequence mean divides by (`common.grpo.token_weights`)."""
        return float(self.episode_tokens or self.loss_mask.sum())

    @property
    def share(self) -> float:
        """The part of one episode this sequence is (1 for a whole one): sequence counts of
        the seq-mean aggregation add these up, so an episode counts once however it is cut."""
        return float(self.loss_mask.sum()) / max(self.mean_over, 1.0)

    def __len__(self) -> int:
        return len(self.token_ids)

    def token_advantages(self) -> np.ndarray:
        """(T,) float32: the advantage of each token."""
        return np.broadcast_to(np.asarray(self.advantage, np.float32), (len(self),))


def turn_token_advantages(traj: Trajectory, per_turn: np.ndarray) -> np.ndarray:
    """(T,) float32: `per_turn[k]` on the tokens of the trajectory's turn k + 1, 0 elsewhere
    (prompt and feedback tokens, which are not trained). per_turn: (K,), K >= its turns."""
    out = np.zeros(len(traj.token_ids), np.float32)
    for k, turn in enumerate(traj.turns):
        out[turn.start:turn.end] = per_turn[k]
    return out


def training_sequences(trajectories: Sequence[Trajectory], advantages: Sequence,
                       export_style: str = "concat",
                       keep: np.ndarray | None = None) -> list[TrainSequence]:
    """Sequences to train on: aborted trajectories, `keep == False` ones and those with no
    generated token are left out. advantages: one per trajectory, a float or (T_i,) per token;
    keep: (N,)."""
    if len(advantages) != len(trajectories):
        raise ValueError(f"{len(advantages)} advantages for {len(trajectories)} trajectories")
    if export_style not in ("concat", "individual"):
        raise ValueError(f"unknown export style {export_style!r}")
    out = []
    for i, traj in enumerate(trajectories):
        if traj.status == ABORTED or (keep is not None and not keep[i]):
            continue
        pieces = [traj] if export_style == "concat" else split_turns(traj)
        total = int(traj.loss_mask.sum()) if len(pieces) > 1 else 0
        a = advantages[i]
        for p in pieces:  # a piece is a prefix of its trajectory
            if p.loss_mask.any():
                out.append(TrainSequence(p.token_ids, p.loss_mask, p.rollout_logprobs,
                                         float(a) if np.ndim(a) == 0 else a[:len(p.token_ids)],
                                         p.images, i, total, p.routed_experts))
    return out


@dataclasses.dataclass
class PackedBatch:
    """S sequences concatenated into T tokens.

    input_ids, loss_mask, advantages, rollout_logprobs, seq_ids: (T,); cu_seqlens: (S+1,) with
    sequence s at [cu_seqlens[s], cu_seqlens[s+1]); image_counts, seq_index: (S,); images: the
    sequences' images in order (sum(image_counts) of them); old_logprobs: (T,) the behaviour
    policy's log-probs when several updates share one rollout (None: the current weights');
    mean_over: (S,) the trained tokens each segment's per-sequence mean divides by (its own, or
    its episode's: `TrainSequence.episode_tokens`); routed_experts: (T, L, K) int16 (-1 where
    not recorded), None when no sequence has it.
    Segments are sequences or shared prefixes; parents: (S,) the segment whose tokens come
    before segment s's (a shared prefix: no trained token, seq_index -1), -1 for none.
    """

    input_ids: np.ndarray
    loss_mask: np.ndarray
    advantages: np.ndarray
    rollout_logprobs: np.ndarray
    seq_ids: np.ndarray
    cu_seqlens: np.ndarray
    image_counts: np.ndarray
    seq_index: np.ndarray
    images: list
    old_logprobs: np.ndarray | None = None
    parents: np.ndarray | None = None  # None: no segment continues another
    mean_over: np.ndarray | None = None  # None: each segment's own trained tokens
    routed_experts: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def parent_of(self) -> np.ndarray:
        """(S,) `parents`, -1 everywhere when the batch shares no prefix."""
        n = len(self.cu_seqlens) - 1
        return np.full(n, -1, np.int64) if self.parents is None else self.parents


def _concat(seqs: Sequence[TrainSequence], index: Sequence[int],
            parents: Sequence[int] | None = None) -> PackedBatch:
    lens = np.array([len(s) for s in seqs], np.int64)
    mask = np.concatenate([s.loss_mask for s in seqs]).astype(np.float32)
    adv = np.concatenate([s.token_advantages() for s in seqs]) * mask
    return PackedBatch(
        input_ids=np.concatenate([s.token_ids for s in seqs]).astype(np.int64),
        loss_mask=mask,
        advantages=adv,
        rollout_logprobs=np.concatenate([s.rollout_logprobs for s in seqs]).astype(np.float32),
        seq_ids=np.repeat(np.arange(len(seqs), dtype=np.int32), lens),
        cu_seqlens=np.concatenate([[0], np.cumsum(lens)]),
        image_counts=np.array([len(s.images) for s in seqs], np.int64),
        seq_index=np.asarray(index, np.int64),
        images=[im for s in seqs for im in s.images],
        parents=None if parents is None else np.asarray(parents, np.int64),
        mean_over=np.array([s.mean_over for s in seqs], np.float64),
        routed_experts=_concat_routing(seqs),
    )


def _concat_routing(seqs: Sequence[TrainSequence]) -> np.ndarray | None:
    """(T, L, K) int16: the sequences' routed experts one after the other, -1 rows for those
    without; None when none has them."""
    known = {s.routed_experts.shape[1:] for s in seqs if s.routed_experts is not None}
    if not known:
        return None
    if len(known) > 1:
        raise ValueError(f"sequences routed over different (layers, top_k): {sorted(known)}")
    (lk,) = known
    return np.concatenate([np.full((len(s),) + lk, -1, np.int16) if s.routed_experts is None
                           else s.routed_experts.astype(np.int16, copy=False) for s in seqs])


def replayed_routing(batch: PackedBatch) -> np.ndarray | None:
    """The micro-batch's (T, L, K) routed experts for a learner that replays them
    (`loss.routing_replay`), None for a batch that trains nothing (a filler routes freely).
    A batch with trained tokens but no routing is an error: the engine did not record it."""
    if batch.routed_experts is None:
        if batch.loss_mask.any():
            raise ValueError("loss.routing_replay: the rollouts carry no routed experts; the "
                             "engine must record them (a MoE model; SGLang is launched with "
                             "--enable-return-routed-experts when routing_replay is on)")
        return None
    return batch.routed_experts


@dataclasses.dataclass
class _Unit:
    """What packing places: sequences `members` (input indices) sharing their first `prefix`
    tokens (0: one sequence on its own). cost: the tokens it takes in a micro-batch."""

    members: list[int]
    prefix: int
    cost: int


def pack(seqs: Sequence[TrainSequence], token_budget: int, image_token_id: int | None = None
         ) -> list[PackedBatch]:
    """First-fit-decreasing packing into micro-batches of at most `token_budget` tokens.

    Deterministic; inside a micro-batch sequences keep their input order. A sequence longer than
    the budget is an error (raise the budget to at least the context limit). With
    `image_token_id`, sequences that share a prompt (`shared_prefix_len`: same tokens, same
    images) share one copy of it (see the module docstring); a group too large for the budget is
    split into parts that each carry the prompt.
    """
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    too_long = [i for i, s in enumerate(seqs) if len(s) > token_budget]
    if too_long:
        raise ValueError(f"sequence {too_long[0]} has {len(seqs[too_long[0]])} tokens, more than "
                         f"the micro-batch token budget {token_budget}")
    units = (_shared_units(seqs, image_token_id, token_budget) if image_token_id is not None
             else [_Unit([i], 0, len(s)) for i, s in enumerate(seqs)])
    order = sorted(range(len(units)), key=lambda u: (-units[u].cost, units[u].members[0]))
    bins: list[list[int]] = []
    room: list[int] = []
    for u in order:
        n = units[u].cost
        for b in range(len(bins)):
            if room[b] >= n:
                bins[b].append(u)
                room[b] -= n
                break
        else:
            bins.append([u])
            room.append(token_budget - n)
    out = []
    for b in bins:
        placed = sorted((units[u] for u in b), key=lambda unit: unit.members[0])
        if all(unit.prefix == 0 for unit in placed):
            out.append(_concat([seqs[unit.members[0]] for unit in placed],
                               [unit.members[0] for unit in placed]))
        else:
            out.append(_concat_shared(seqs, placed))
    return out


def _concat_shared(seqs: Sequence[TrainSequence], units: Sequence[_Unit]) -> PackedBatch:
    parts, index, parents = [], [], []
    for unit in units:
        if unit.prefix == 0:
            parts.append(seqs[unit.members[0]])
            index.append(unit.members[0])
            parents.append(-1)
            continue
        first, n = seqs[unit.members[0]], unit.prefix
        root = len(parts)
        parts.append(TrainSequence(first.token_ids[:n], np.zeros(n, first.loss_mask.dtype),
                                   np.zeros(n, np.float32), 0.0, list(first.images), -1,
                                   routed_experts=_rows(first.routed_experts, slice(0, n))))
        index.append(-1)
        parents.append(-1)
        for i in unit.members:
            s = seqs[i]
            parts.append(TrainSequence(s.token_ids[n:], s.loss_mask[n:], s.rollout_logprobs[n:],
                                       s.token_advantages()[n:], [], s.traj_index,
                                       int(s.mean_over), _rows(s.routed_experts, slice(n, None))))
            index.append(i)
            parents.append(root)
    return _concat(parts, index, parents)


def _rows(routed: np.ndarray | None, rows: slice) -> np.ndarray | None:
    return None if routed is None else routed[rows]


def shared_prefix_len(s: TrainSequence, image_token_id: int) -> int:
    """How many leading tokens of `s` a sibling with the same prompt may share: every token
    before the one that predicts its first trained token (so each sample's trained log-probs
    come from logits of its own segment), or 0 when an image token comes later (the shared
    prefix must hold all of the sequence's images)."""
    trained = np.flatnonzero(s.loss_mask)
    n = int(trained[0]) - 1 if len(trained) else 0
    if n < 1 or (np.asarray(s.token_ids[n:]) == image_token_id).any():
        return 0
    return n


def _shared_units(seqs: Sequence[TrainSequence], image_token_id: int, budget: int
                  ) -> list[_Unit]:
    """Sequences grouped by identical prompt tokens and images, in input order; groups that do
    not fit the budget are split greedily (a part of one is a plain sequence)."""
    groups: dict[tuple, list[int]] = {}
    lens = [shared_prefix_len(s, image_token_id) for s in seqs]
    known: dict[int, object] = {}  # id(image) -> image_key: a group's samples hold one image
    for i, s in enumerate(seqs):
        key = ("alone", i)
        if lens[i]:
            images = tuple(known[id(im)] if id(im) in known else
                           known.setdefault(id(im), image_key(im)) for im in s.images)
            key = (lens[i], np.asarray(s.token_ids[:lens[i]], np.int64).tobytes(), images)
        groups.setdefault(key, []).append(i)
    units = []
    for members in groups.values():
        n = lens[members[0]]
        part, cost = [], n
        for i in members:
            if part and cost + len(seqs[i]) - n > budget:
                units.append(_unit(seqs, part, n))
                part, cost = [], n
            part.append(i)
            cost += len(seqs[i]) - n
        units.append(_unit(seqs, part, n))
    return units


def _unit(seqs: Sequence[TrainSequence], members: list[int], prefix: int) -> _Unit:
    if len(members) == 1 or prefix == 0:
        return _Unit(members, 0, len(seqs[members[0]]))
    return _Unit(members, prefix, prefix + sum(len(seqs[i]) - prefix for i in members))


def packing_efficiency(batches: Sequence[PackedBatch], token_budget: int) -> float:
    """Real tokens / tokens a fixed-size micro-batch of `token_budget` would compute."""
    if not batches:
        return 0.0
    return sum(b.num_tokens for b in batches) / (len(batches) * token_budget)


@dataclasses.dataclass
class PaddedBatch:
    """B sequences right-padded to L. Arrays (B, L); `attention_mask` 1 on real tokens."""

    input_ids: np.ndarray
    attention_mask: np.ndarray
    loss_mask: np.ndarray
    advantages: np.ndarray
    rollout_logprobs: np.ndarray
    image_counts: np.ndarray
    images: list


def pad(seqs: Sequence[TrainSequence], pad_id: int, length: int | None = None) -> PaddedBatch:
    """Right-pad to `length` (default: the longest sequence)."""
    if not seqs:
        raise ValueError("pad() needs at least one sequence")
    L = max(len(s) for s in seqs) if length is None else length
    if any(len(s) > L for s in seqs):
        raise ValueError(f"a sequence is longer than the padded length {L}")
    B = len(seqs)
    ids = np.full((B, L), pad_id, np.int64)
    attn, mask, adv, lps = (np.zeros((B, L), np.float32) for _ in range(4))
    for b, s in enumerate(seqs):
        n = len(s)
        ids[b, :n] = s.token_ids
        attn[b, :n] = 1
        mask[b, :n] = s.loss_mask
        adv[b, :n] = s.token_advantages() * s.loss_mask
        lps[b, :n] = s.rollout_logprobs
    return PaddedBatch(ids, attn.astype(np.int64), mask, adv, lps,
                       np.array([len(s.images) for s in seqs], np.int64),
                       [im for s in seqs for im in s.images])
