"""Trajectories become learner micro-batches: packed without padding, or padded.

`training_sequences` turns scored trajectories (and their group advantages) into the sequences
the learner trains on, in the chosen export style. `pack` concatenates them into micro-batches of
at most `token_budget` tokens (first-fit decreasing), keeping per-sequence boundaries
(`cu_seqlens`) and the images of those sequences in order. `pad` makes the (B, L) layout.

Token arrays are aligned with the tokens: `loss_mask[t]` and `rollout_logprobs[t]` belong to token
t, whose log-prob the learner reads from the logits at position t - 1 of the same sequence (the
first token of a sequence is always prompt, mask 0).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from common.rollout import ABORTED, Trajectory, split_turns


@dataclasses.dataclass
class TrainSequence:
    """One training sequence. Arrays are (T,); `traj_index` points back at its trajectory."""

    token_ids: np.ndarray
    loss_mask: np.ndarray
    rollout_logprobs: np.ndarray
    advantage: float
    images: list
    traj_index: int

    def __len__(self) -> int:
        return len(self.token_ids)


def training_sequences(trajectories: Sequence[Trajectory], advantages: np.ndarray,
                       export_style: str = "concat",
                       keep: np.ndarray | None = None) -> list[TrainSequence]:
    """Sequences to train on: aborted trajectories, `keep == False` ones and those with no
    generated token are left out. advantages, keep: (N,) per trajectory."""
    if len(advantages) != len(trajectories):
        raise ValueError(f"{len(advantages)} advantages for {len(trajectories)} trajectories")
    if export_style not in ("concat", "individual"):
        raise ValueError(f"unknown export style {export_style!r}")
    out = []
    for i, traj in enumerate(trajectories):
        if traj.status == ABORTED or (keep is not None and not keep[i]):
            continue
        pieces = [traj] if export_style == "concat" else split_turns(traj)
        for p in pieces:
            if p.loss_mask.any():
                out.append(TrainSequence(p.token_ids, p.loss_mask, p.rollout_logprobs,
                                         float(advantages[i]), p.images, i))
    return out


@dataclasses.dataclass
class PackedBatch:
    """S sequences concatenated into T tokens.

    input_ids, loss_mask, advantages, rollout_logprobs, seq_ids: (T,); cu_seqlens: (S+1,) with
    sequence s at [cu_seqlens[s], cu_seqlens[s+1]); image_counts, seq_index: (S,); images: the
    sequences' images in order (sum(image_counts) of them); old_logprobs: (T,) the behaviour
    policy's log-probs when several updates share one rollout (None: the current weights').
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

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


def _concat(seqs: Sequence[TrainSequence], index: Sequence[int]) -> PackedBatch:
    lens = np.array([len(s) for s in seqs], np.int64)
    mask = np.concatenate([s.loss_mask for s in seqs]).astype(np.float32)
    adv = np.concatenate([np.full(len(s), s.advantage, np.float32) for s in seqs]) * mask
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
    )


def pack(seqs: Sequence[TrainSequence], token_budget: int) -> list[PackedBatch]:
    """First-fit-decreasing packing into micro-batches of at most `token_budget` tokens.

    Deterministic; inside a micro-batch sequences keep their input order. A sequence longer than
    the budget is an error (raise the budget to at least the context limit).
    """
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    too_long = [i for i, s in enumerate(seqs) if len(s) > token_budget]
    if too_long:
        raise ValueError(f"sequence {too_long[0]} has {len(seqs[too_long[0]])} tokens, more than "
                         f"the micro-batch token budget {token_budget}")
    order = sorted(range(len(seqs)), key=lambda i: (-len(seqs[i]), i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = len(seqs[i])
        for b in range(len(bins)):
            if room[b] >= n:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(token_budget - n)
    return [_concat([seqs[i] for i in sorted(b)], sorted(b)) for b in bins]


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
        adv[b, :n] = s.advantage * s.loss_mask
        lps[b, :n] = s.rollout_logprobs
    return PaddedBatch(ids, attn.astype(np.int64), mask, adv, lps,
                       np.array([len(s.images) for s in seqs], np.int64),
                       [im for s in seqs for im in s.images])
