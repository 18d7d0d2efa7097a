"""scripts/replicates.py: the replicates' command lines and the table read from their workdirs."""

import json
import sys

import pytest

from tests.script_module import load_script

rep = load_script("replicates")


def _row(step, first, recovery, forced=None, line=0.7, blank=(0.2, 0.9, 0.1)):
    """An evaluation row as the loop writes it; `forced` (recovery, its SE) or None for a run
    evaluated without `eval.forced_miss`."""
    row = {"step": step, "eval/greedy_first_try_accuracy": first,
           "eval/greedy_first_try_accuracy_se": 0.03, "eval/greedy_accuracy": 0.9,
           "eval/greedy_conditional_line": 0.85, "eval/greedy_recovery_after_miss": recovery,
           "eval/greedy_recovery_after_miss_se": 0.05, "eval/greedy_retry_lookup_share": 0.95,
           "eval/blank/greedy_first_try_accuracy": blank[0],
           "eval/blank/greedy_first_try_accuracy_se": 0.025,
           "eval/blank/greedy_turn_2_valid_answer_rate": blank[1],
           "eval/blank/greedy_turn_2_repeat_rate": blank[2]}
    if forced is not None:
        row.update({"eval/forced/greedy_recovery": forced[0], "eval/forced/greedy_recovery_se": forced[1],
                    "eval/forced/greedy_blind_retry_line": line,
                    "eval/forced/greedy_retry_lookup_share": 0.6})
    return row


def _workdir(root, name, rows, steps=None, seeds=None):
    d = root / name
    d.mkdir(parents=True)
    if steps is not None:  # what the run's own config.json says
        cfg = {"train": {"steps": steps}}
        if seeds is not None:
            cfg.update(seed=seeds[0], model={"tiny_seed": seeds[1]}, data={"synthetic_seed": seeds[2]})
        (d / "config.json").write_text(json.dumps({"config": cfg}))
    lines = [json.dumps(r) for r in rows]
    # training steps without an evaluation are skipped
    lines.insert(1, json.dumps({"step": 1, "train/reward_mean": 0.3}))
    (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_the_learners_replicates_share_no_seed_and_seed_zero_keeps_the_default_folders(tmp_path):
    zero = rep.command("torch", 0, tmp_path)
    assert zero[1:4] == ["-m", "geo3k_torch.main", "--config=configs/cpu_perception.py"]
    assert "--config.seed=0" in zero and not any("tiny_dir" in a or "synthetic_dir" in a for a in zero)
    three = rep.command("jax", 3, tmp_path)
    assert three[2] == "geo3k_jax.train"
    for flag in ("--config.seed=103", "--config.model.tiny_seed=103", "--config.data.synthetic_seed=103",
                 "--config.model.tiny_dir=data/rep103/tiny",
                 "--config.data.synthetic_dir=data/rep103/synthetic", f"--workdir={tmp_path / 'jax-3'}"):
        assert flag in three
    torch_seeds = {rep.seed("torch", k) for k in range(5)}
    assert len(torch_seeds) == 5 and not torch_seeds & {rep.seed("jax", k) for k in range(5)}


def test_a_recipe_change_reaches_every_replicate_but_not_its_seeds_or_folders(tmp_path, capsys):
    cmd = rep.command("torch", 2, tmp_path, ["reward.progress_bonus=0.25", "train.steps=10"])
    assert cmd[-3:] == ["--config.reward.progress_bonus=0.25", "--config.train.steps=10",
                        f"--workdir={tmp_path / 'torch-2'}"]
    for bad in ("reward.progress_bonus", "=1", "--config.seed=3", "seed=3", "model.tiny_dir=x"):
        with pytest.raises(ValueError, match="key=value"):
            rep.command("jax", 1, tmp_path, [bad])
        with pytest.raises(SystemExit):  # refused before any replicate runs
            rep.main(["run", "--learner=torch", "--replicates", "1", f"--set={bad}"])
        assert "--set takes" in capsys.readouterr().err


def test_target_needs_first_try_and_forced_recovery_two_errors_above_its_line():
    assert rep.meets_target(_row(200, 0.5, 0.1, forced=(0.80, 0.03), line=0.74))
    assert not rep.meets_target(_row(200, 0.49, 0.9, forced=(0.95, 0.01), line=0.7))  # first try
    assert not rep.meets_target(_row(200, 0.9, 0.9, forced=(0.79, 0.03), line=0.74))  # 1.7 SE only
    assert rep.meets_target(_row(200, 0.9, 0.9)) is None  # no forced-miss evaluation: not judged


def test_table_has_step_zero_and_the_last_evaluation_with_errors_seeds_and_counts(tmp_path):
    _workdir(tmp_path, "torch-0", [_row(0, 0.332, 0.117, (0.5, 0.03)), _row(100, 0.5, 0.4, (0.6, 0.03)),
                                   _row(200, 0.613, 0.838, (0.85, 0.02))], steps=200, seeds=(0, 0, 0))
    _workdir(tmp_path, "torch-10", [_row(0, 0.25, 0.1), _row(200, 0.7, 0.5, (0.7, 0.03))],
             steps=200, seeds=(10, 10, 10))
    _workdir(tmp_path, "torch-2", [_row(0, 0.25, 0.1)], steps=200)  # still at step 0: no verdict
    _workdir(tmp_path, "jax-1", [_row(0, 0.3, 0.14), _row(180, 0.55, 0.78, (0.9, 0.02))],
             steps=180, seeds=(10, 10, 10))  # built from torch-10's seeds: shared
    _workdir(tmp_path, "jax-3", [_row(0, 0.3, 0.14), _row(80, 0.2, 0.1)], steps=200)  # running
    _workdir(tmp_path, "jax-4", [_row(0, 0.3, 0.14), _row(200, 0.8, 0.9)], steps=200)  # no forced row
    (tmp_path / "notes-x").mkdir()  # not a learner's folder
    text = rep.table(tmp_path)
    lines = text.splitlines()
    assert lines[0].startswith("| learner | k | seeds (run, tiny, data) | step | first try |")
    assert lines[2] == ("| jax | 1 | 10, 10, 10 | 0 | 0.300 ± 0.030 | 0.900 | 0.850 | 0.140 ± 0.050 "
                        "| 0.950 | - | - | - | 0.200 ± 0.025 | - | 0.900 | 0.100 |  |")
    assert lines[3] == ("| jax | 1 | 10, 10, 10 | 180 | 0.550 ± 0.030 | 0.900 | 0.850 | 0.780 ± 0.050 "
                        "| 0.950 | 0.900 ± 0.020 | 0.700 | 0.600 | 0.200 ± 0.025 | - | 0.900 | 0.100 "
                        "| yes |")
    assert lines[5].endswith("| (running: 200 steps) |") and lines[7].endswith("| no forced-miss row |")
    # replicates in numeric order (2 before 10), step 100 left out
    assert [l.split(" | ")[1:4:2] for l in lines[8:13]] == [["0", "0"], ["0", "200"], ["2", "0"],
                                                            ["10", "0"], ["10", "200"]]
    assert lines[9].endswith("| yes |") and lines[12].endswith("| **no** |")
    assert "torch: 1 of 2 replicates meet the target (first try >= 0.5, forced-miss" in text
    assert "jax: 1 of 1 replicates meet the target" in text
    assert "jax-1 and torch-10 share their build seeds (tiny 10, data 10)" in text
    assert "torch-0 and" not in text


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
    final = dict(_row(200, 0.613, 0.838, blank=(0.203, 0.9, 0.1)),
                 **{"eval/greedy_accuracy": 0.938, "eval/blank/greedy_accuracy": 0.285})
    _workdir(tmp_path, "torch-0", [_row(0, 0.332, 0.117), final])
    (tmp_path / "torch-0" / "config.json").write_text(json.dumps(
        {"config": {"env": {"max_turns": 4}, "train": {"steps": 200}}}))
    curve, chart = tmp_path / "docs" / "curve.png", tmp_path / "docs" / "eval.png"
    text = rep.figures(tmp_path / "torch-0", curve, chart)
    assert Image.open(curve).size[0] > 100 and Image.open(chart).size[0] > 100
    assert "| first try (turn 1) | 0.613 ± 0.030 | 0.203 ± 0.025 |" in text and "0.332" not in text
    assert "| with feedback (≤4 turns) | 0.938 | 0.285 |" in text
    assert "| recovery after a first-try miss | 0.838 ± 0.050 |" in text
    assert not (tmp_path / "torch-0" / "curve.png").exists()  # the committed rows stay as they are
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    with pytest.raises(FileNotFoundError, match="no evaluation"):
        rep.figures(tmp_path / "empty", curve, chart)
