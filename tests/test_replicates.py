"""scripts/replicates.py: the replicates' command lines and the table read from their workdirs."""

import json
import sys

import pytest

from tests.script_module import load_script

rep = load_script("replicates")


def _row(step, first, feedback, cond, recovery, blank=(0.2, 0.3)):
    return {"step": step, "eval/greedy_first_try_accuracy": first, "eval/greedy_accuracy": feedback,
            "eval/greedy_conditional_line": cond, "eval/greedy_recovery_after_miss": recovery,
            "eval/blank/greedy_first_try_accuracy": blank[0], "eval/blank/greedy_accuracy": blank[1]}


def _workdir(root, name, rows, steps=None):
    d = root / name
    d.mkdir(parents=True)
    if steps is not None:  # what the run's own config.json says
        (d / "config.json").write_text(json.dumps({"config": {"train": {"steps": steps}}}))
    lines = [json.dumps(r) for r in rows]
    # training steps without an evaluation are skipped
    lines.insert(1, json.dumps({"step": 1, "train/reward_mean": 0.3}))
    (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_command_varies_every_seed_and_keeps_replicate_zero_in_the_default_folders(tmp_path):
    zero = rep.command("torch", 0, tmp_path)
    assert zero[1:4] == ["-m", "geo3k_torch.main", "--config=configs/cpu_perception.py"]
    assert "--config.seed=0" in zero and not any("tiny_dir" in a or "synthetic_dir" in a for a in zero)
    three = rep.command("jax", 3, tmp_path)
    assert three[2] == "geo3k_jax.train"
    for flag in ("--config.seed=3", "--config.model.tiny_seed=3", "--config.data.synthetic_seed=3",
                 "--config.model.tiny_dir=data/rep3/tiny", "--config.data.synthetic_dir=data/rep3/synthetic",
                 f"--workdir={tmp_path / 'jax-3'}"):
        assert flag in three


def test_target_needs_all_three_lines():
    assert rep.meets_target(_row(200, 0.5, 0.90, 0.833, 0.70))
    assert not rep.meets_target(_row(200, 0.49, 0.95, 0.83, 0.90))   # first try below 0.5
    assert not rep.meets_target(_row(200, 0.6, 0.86, 0.867, 0.70))   # with feedback under cond.
    assert not rep.meets_target(_row(200, 0.6, 0.90, 0.867, 0.66))   # recovery under 2/3


def test_table_has_step_zero_and_the_last_evaluation_and_counts_per_learner(tmp_path):
    _workdir(tmp_path, "torch-0", [_row(0, 0.332, 0.41, 0.777, 0.117), _row(100, 0.5, 0.7, 0.8, 0.4),
                                   _row(200, 0.613, 0.938, 0.871, 0.838)])
    _workdir(tmp_path, "torch-10", [_row(0, 0.25, 0.3, 0.75, 0.1), _row(200, 0.7, 0.85, 0.9, 0.5)])
    _workdir(tmp_path, "torch-2", [_row(0, 0.25, 0.3, 0.75, 0.1)])  # still at step 0: no verdict
    _workdir(tmp_path, "jax-1", [_row(0, 0.3, 0.4, 0.767, 0.14), _row(180, 0.55, 0.9, 0.85, 0.78)],
             steps=180)
    _workdir(tmp_path, "jax-3", [_row(0, 0.3, 0.4, 0.767, 0.14), _row(80, 0.2, 0.3, 0.8, 0.1)],
             steps=200)  # still running: no verdict yet
    (tmp_path / "notes-x").mkdir()  # not a learner's folder
    text = rep.table(tmp_path)
    lines = text.splitlines()
    assert lines[2] == "| jax | 1 | 0 | 0.300 | 0.400 | 0.767 | 0.140 | 0.200 | 0.300 |  |"
    assert lines[3] == "| jax | 1 | 180 | 0.550 | 0.900 | 0.850 | 0.780 | 0.200 | 0.300 | yes |"
    # replicates in numeric order (2 before 10), step 100 left out
    assert lines[5] == "| jax | 3 | 80 | 0.200 | 0.300 | 0.800 | 0.100 | 0.200 | 0.300 | (running: 200 steps) |"
    assert [l.split(" | ")[1:3] for l in lines[6:11]] == [["0", "0"], ["0", "200"], ["2", "0"],
                                                          ["10", "0"], ["10", "200"]]
    assert lines[10].endswith("| **no** |")
    assert "torch: 1 of 2 replicates meet the target" in text
    assert "jax: 1 of 1 replicates meet the target" in text


def test_table_refuses_a_folder_without_evaluations(tmp_path):
    with pytest.raises(FileNotFoundError, match="no <learner>-<k> workdir"):
        rep.table(tmp_path)
    with pytest.raises(SystemExit, match="no <learner>-<k> workdir"):
        rep.main(["table", str(tmp_path)])


def test_run_refuses_negative_indices(capsys):
    with pytest.raises(SystemExit):
        rep.main(["run", "--learner=torch", "--replicates", "-1"])
    assert ">= 0" in capsys.readouterr().err


def test_run_stops_at_the_first_failure(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(rep.subprocess, "call", lambda cmd: calls.append(cmd) or 3)
    with pytest.raises(SystemExit) as e:
        rep.run("torch", [1, 2], tmp_path, None)
    assert e.value.code == 3 and len(calls) == 1 and calls[0][0] == sys.executable


def test_figures_draws_the_curve_and_the_last_evaluation_from_the_rows_alone(tmp_path):
    """The README's pictures from a committed workdir: the curve of every row, the chart and the
    table of the last evaluation (not step 0's), with the run's own turn budget."""
    from PIL import Image
    _workdir(tmp_path, "torch-0", [_row(0, 0.332, 0.41, 0.777, 0.117),
                                   _row(200, 0.613, 0.938, 0.871, 0.838, blank=(0.203, 0.285))])
    (tmp_path / "torch-0" / "config.json").write_text(json.dumps(
        {"config": {"env": {"max_turns": 4}, "train": {"steps": 200}}}))
    curve, chart = tmp_path / "docs" / "curve.png", tmp_path / "docs" / "eval.png"
    text = rep.figures(tmp_path / "torch-0", curve, chart)
    assert Image.open(curve).size[0] > 100 and Image.open(chart).size[0] > 100
    assert "| first try (turn 1) | 0.613 | 0.203 |" in text and "0.332" not in text
    assert "| with feedback (≤4 turns) | 0.938 | 0.285 |" in text
    assert "| recovery after a first-try miss | 0.838 |" in text
    assert not (tmp_path / "torch-0" / "curve.png").exists()  # the committed rows stay as they are
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    with pytest.raises(FileNotFoundError, match="no evaluation"):
        rep.figures(tmp_path / "empty", curve, chart)
