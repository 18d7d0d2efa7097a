"""An evaluation's episodes as JSON lines, so every number of its report can be recomputed.

    write_episodes(path, [("greedy", trajs), ("forced", trajs), ...], problems)

One line per episode: `uid`, `kind`, `choices`, `answer`, `mode` (greedy, sampled, blank,
forced), `sample` (its index among the prompt's episodes), `status`, `reward`, `correct`,
`correct_turn`, and `turns`: per turn its `answer` (as given, None for none), `score` (the
tool's 1.0 / 0.0, None without a well-formed call), `reason` (`common.env`), `tool_call`
(well-formed), `valid` (an answer that is a listed choice; any answer without choices) and
`forced` (the forced miss's first call: the environment's, not the model's). The training loop
writes `<workdir>/eval/episodes_step_<N>.jsonl`, `geo3k_torch.evaluate` `<out>/episodes.jsonl`
(one file per process, `.process_<rank>` before the suffix, when there are several).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Mapping, Sequence

from common.evaluation.retry import NONE, Keyed, answer_key
from common.rollout import Trajectory


def episode_record(t: Trajectory, mode: str, problem: Keyed, answer: str) -> dict:
    """The JSON-ready line of one episode (the module docstring)."""
    turns = []
    for u in t.turns:
        given = u.info.get("answer")
        turns.append({"answer": given, "score": u.info.get("tool_score"),
                      "reason": u.info.get("reason"),
                      "tool_call": u.info.get("tool_score") is not None,
                      "valid": given is not None and (
                          not problem.choices or answer_key(given, problem.choices) != NONE),
                      "forced": u.forced})
    return {"uid": t.uid, "kind": problem.kind,
            "choices": list(problem.choices) if problem.choices else None, "answer": answer,
            "mode": mode, "sample": t.sample_idx, "status": t.status, "reward": t.reward,
            "correct": bool(t.correct), "correct_turn": t.correct_turn, "turns": turns}


def write_episodes(path: str | os.PathLike, runs: Sequence[tuple[str, Sequence[Trajectory]]],
                   keyed: Mapping[str, Keyed]) -> Path:
    """Every episode of `runs` ((mode, trajectories) in order) as one JSON line, written whole
    (a temporary file moved into place)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        for mode, trajs in runs:
            for t in trajs:
                f.write(json.dumps(episode_record(t, mode, keyed[t.uid], str(t.answer))) + "\n")
    tmp.replace(path)
    return path
