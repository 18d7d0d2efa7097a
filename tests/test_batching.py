"""Packing and padding: no token lost or duplicated, budget respected, images follow sequences."""

import numpy as np
import pytest

from common.batching import TrainSequence, pack, packing_efficiency, pad, training_sequences
from common.rollout import Trajectory, Turn


def seq(n, i, n_images=1, adv=1.0, prompt=2):
    ids = np.arange(n, dtype=np.int64) + 1000 * i
    mask = np.zeros(n, np.int8)
    mask[prompt:] = 1
    lps = np.where(mask == 1, -0.1 * (i + 1), 0.0).astype(np.float32)
    return TrainSequence(ids, mask, lps, adv, [f"img{i}-{k}" for k in range(n_images)], i)


def test_pack_keeps_every_token_once_within_budget():
    rng = np.random.default_rng(0)
    seqs = [seq(int(n), i, n_images=i % 3, adv=float(i)) for i, n in
            enumerate(rng.integers(3, 60, 40))]
    batches = pack(seqs, 100)
    assert all(b.num_tokens <= 100 for b in batches)
    seen = sorted(int(j) for b in batches for j in b.seq_index)
    assert seen == list(range(40))
    all_ids = np.concatenate([b.input_ids for b in batches])
    assert sorted(all_ids.tolist()) == sorted(np.concatenate([s.token_ids for s in seqs]).tolist())
    for b in batches:
        assert b.cu_seqlens[0] == 0 and b.cu_seqlens[-1] == b.num_tokens
        assert list(b.seq_index) == sorted(b.seq_index)  # input order inside a micro-batch
        k = 0
        for s, i in enumerate(b.seq_index):
            lo, hi = b.cu_seqlens[s], b.cu_seqlens[s + 1]
            src = seqs[i]
            assert b.input_ids[lo:hi].tolist() == src.token_ids.tolist()
            assert b.loss_mask[lo:hi].tolist() == src.loss_mask.tolist()
            assert np.all(b.seq_ids[lo:hi] == s)
            np.testing.assert_array_equal(b.advantages[lo:hi], src.advantage * src.loss_mask)
            np.testing.assert_array_equal(b.rollout_logprobs[lo:hi], src.rollout_logprobs)
            assert b.images[k:k + b.image_counts[s]] == src.images  # images follow their sequence
            k += b.image_counts[s]
        assert k == len(b.images)
    assert 0.5 < packing_efficiency(batches, 100) <= 1.0


def test_pack_is_first_fit_decreasing():
    seqs = [seq(n, i) for i, n in enumerate([30, 70, 50, 50, 20])]
    batches = pack(seqs, 100)
    assert [b.seq_index.tolist() for b in batches] == [[0, 1], [2, 3], [4]]


def test_pack_rejects_oversized_sequence():
    with pytest.raises(ValueError, match="budget"):
        pack([seq(10, 0), seq(101, 1)], 100)
    assert pack([], 100) == []


def test_pad_layout():
    seqs = [seq(3, 0, adv=2.0, prompt=1), seq(5, 1, n_images=2, adv=-1.0)]
    b = pad(seqs, pad_id=-7)
    assert b.input_ids.shape == (2, 5)
    assert b.input_ids[0].tolist() == [0, 1, 2, -7, -7]
    assert b.attention_mask.tolist() == [[1, 1, 1, 0, 0], [1] * 5]
    assert b.loss_mask.tolist() == [[0, 1, 1, 0, 0], [0, 0, 1, 1, 1]]
    assert b.advantages.tolist() == [[0, 2, 2, 0, 0], [0, 0, -1, -1, -1]]
    assert b.images == ["img0-0", "img1-0", "img1-1"] and b.image_counts.tolist() == [1, 2]
    assert pad(seqs, 0, length=8).input_ids.shape == (2, 8)
    with pytest.raises(ValueError):
        pad(seqs, 0, length=4)


def traj(i, status="completed", turns=2):
    n = 4 + 6 * turns
    ids = np.arange(n)
    mask = np.zeros(n, np.int8)
    spans = [(4 + 6 * k, 4 + 6 * k + 4) for k in range(turns)]  # 4 generated + 2 obs per turn
    for a, b in spans:
        mask[a:b] = 1
    return Trajectory("u", 0, i, "1", ids, mask, mask * -0.5, 4, ["im"],
                      [Turn(a, b, "", "stop", {}) for a, b in spans], status)


def test_training_sequences_styles_and_filters():
    trajs = [traj(0), traj(1, status="aborted"), traj(2), traj(3)]
    adv = np.array([1.0, 2.0, -1.0, 0.5])
    keep = np.array([True, True, True, False])
    concat = training_sequences(trajs, adv, "concat", keep)
    assert [s.traj_index for s in concat] == [0, 2]
    assert [s.advantage for s in concat] == [1.0, -1.0]
    indiv = training_sequences(trajs, adv, "individual", keep)
    assert [(s.traj_index, len(s), int(s.loss_mask.sum())) for s in indiv] == [
        (0, 8, 4), (0, 14, 4), (2, 8, 4), (2, 14, 4)]
    with pytest.raises(ValueError):
        training_sequences(trajs, adv[:2])
