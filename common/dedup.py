"""Problems told apart by content: the same text over pixel-identical figures is one problem,
whatever the file encoding or the uid.

    key = content_key(prompt.problem, prompt.images)       # 64 hex characters
    pairs = overlap(train_keys, test_keys)                  # [(test uid, train uid), ...]

The synthetic set draws its splits (and the tiny model's pretraining draws its figures) so that
no key repeats within a split or across them (`common.synthetic.write_split`'s `exclude`);
`common.prepare` checks any data's test split against its train split (`data.overlap`).
"""

from __future__ import annotations

import hashlib
from typing import Iterable, Sequence

from PIL import Image


def content_key(problem: str, images: Sequence[Image.Image]) -> str:
    """sha256 of the problem text and of each image's mode, size and pixels, in order."""
    h = hashlib.sha256(problem.encode())
    for im in images:
        h.update(f"|{im.mode}|{im.width}x{im.height}|".encode())
        h.update(im.tobytes())
    return h.hexdigest()


def overlap(train: Iterable[tuple[str, str]], test: Iterable[tuple[str, str]]
            ) -> list[tuple[str, str]]:
    """(test uid, train uid) for every test problem whose key a train problem has, given
    (uid, key) pairs of each split; in test order, one train uid each (the first)."""
    seen: dict[str, str] = {}
    for uid, key in train:
        seen.setdefault(key, uid)
    return [(uid, seen[key]) for uid, key in test if key in seen]
