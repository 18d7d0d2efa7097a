"""`python -m geo3k_torch.evaluate --run=...`: a run folder or one of its checkpoints, evaluated
with the config the run trained with (`common.run_folder`), overrides warned of; end to end, the
evaluation of a run's last checkpoint repeats the run's own last evaluation."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from common import run_folder
from common.config_help import load
from common.run_folder import RunError, evaluation_config, locate, saved_config

ROOT = Path(__file__).resolve().parents[1]


def fake_run(tmp_path, config="cpu.py", steps=(2, 4), unfinished=(6,)):
    """A run folder as a training run leaves it: config.json (JSON: tuples become lists) and
    complete checkpoints (loop_state.json) at `steps`, incomplete ones at `unfinished`."""
    run = tmp_path / "run"
    cfg = load(str(ROOT / "configs" / config))
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"config": cfg.to_dict(), "argv": []},
                                                default=str))
    for step in steps:
        (run / "checkpoints" / f"step_{step}").mkdir(parents=True)
        (run / "checkpoints" / f"step_{step}" / "loop_state.json").write_text(
            json.dumps({"step": step}))
        (run / "checkpoints" / f"step_{step}" / "config.json").write_text('{"model_type": "x"}')
    for step in unfinished:
        (run / "checkpoints" / f"step_{step}").mkdir(parents=True)
    return run, cfg


def test_locate_a_run_or_a_checkpoint(tmp_path):
    run, _ = fake_run(tmp_path)
    assert locate(run) == (run, run / "checkpoints" / "step_4")  # step_6 is incomplete
    ckpt = run / "checkpoints" / "step_2"
    assert locate(ckpt) == (run.resolve(), ckpt)
    with pytest.raises(RunError, match="no such folder"):
        locate(tmp_path / "missing")
    with pytest.raises(RunError, match="neither a run folder"):
        locate(tmp_path)
    lone = tmp_path / "lone" / "step_3"
    lone.mkdir(parents=True)
    (lone / "loop_state.json").write_text('{"step": 3}')
    with pytest.raises(RunError, match="--config.model.path="):
        locate(lone)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps({"config": {"train": {}}}))
    with pytest.raises(RunError, match="no complete checkpoint"):
        locate(empty)


def test_the_saved_config_comes_back_as_it_was(tmp_path):
    """configs/cpu_perception.py saved as JSON and read back: every field equal, tuples
    tuples again (jax.rules), placeholders None; a field config.json lacks keeps base.py's
    default and a key base.py lacks is left out, each with a note."""
    run, cfg = fake_run(tmp_path, "cpu_perception.py")
    back, notes = saved_config(run)
    assert back.to_dict() == cfg.to_dict() and notes == []
    assert isinstance(back.jax.rules, tuple) and isinstance(back.jax.rules[0][1], tuple)
    record = json.loads((run / "config.json").read_text())
    del record["config"]["train"]["lr"]
    record["config"]["train"]["gone"] = 1
    (run / "config.json").write_text(json.dumps(record))
    back, notes = saved_config(run)
    assert back.train.lr == 1e-6  # base.py's
    assert sorted(n.split(" ")[0] for n in notes) == ["train.gone=1", "train.lr"]


def test_overrides_apply_on_the_runs_config_and_what_it_trained_on_is_warned(tmp_path):
    """The run trained on configs/cpu.py; the command line's default config file is
    cpu_perception.py (another data set, another prompt style). Without --config the run's
    settings hold and only the overrides change; one that changes what the run trained on is a
    warning, one that does not (eval.max_prompts) is none. An explicit --config file replaces
    the run's config and is warned of key by key."""
    run, trained = fake_run(tmp_path, "cpu.py")
    parsed = load(str(ROOT / "configs" / "cpu_perception.py"))  # as absl parsed the flags
    parsed.eval.max_prompts, parsed.env.max_turns = 3, 2
    argv = ["evaluate", f"--run={run}", "--config.eval.max_prompts=3", "--config.env.max_turns",
            "2"]
    plan = evaluation_config(run, parsed, argv)
    assert plan.cfg.data.prompt_style == trained.data.prompt_style == "tool"
    assert plan.cfg.data.synthetic_dir == "data/synthetic"  # the run's, not cpu_perception's
    assert plan.cfg.eval.max_prompts == 3 and plan.cfg.env.max_turns == 2
    assert plan.cfg.model.path == str(run / "checkpoints" / "step_4")
    assert plan.out == run / "eval_4"
    assert [w.split(" (")[0] for w in plan.warnings] == [
        "env.max_turns=2 differs from 3, what the run trained with"]
    explicit = evaluation_config(run / "checkpoints" / "step_2", parsed,
                                 ["evaluate", "--config=configs/cpu_perception.py"])
    assert explicit.cfg is parsed and explicit.out == run.resolve() / "eval_2"
    named = {w.split("=")[0] for w in explicit.warnings}
    assert {"data.prompt_style", "data.synthetic_dir", "env.max_turns"} <= named
    assert not {k for k in named if not k.startswith(run_folder.TRAINED_ON)}
    with pytest.raises(RunError, match="both name the model"):
        evaluation_config(run, parsed, ["evaluate", "--config.model.path=/elsewhere"])


@pytest.mark.slow
def test_a_run_that_cannot_be_evaluated_is_one_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "geo3k_torch.evaluate", f"--run={tmp_path}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == (
        f"error: --run={tmp_path}: neither a run folder (no config.json of a run) nor a "
        "checkpoint folder (no config.json, no loop_state.json)")


@pytest.mark.slow
def test_evaluating_a_run_repeats_its_last_evaluation(tmp_path):
    """A short quick run (configs/cpu.py, its tiny model primed a few steps), then `evaluate
    --run=<run>` as the README shows it: the greedy numbers of the run's own last evaluation
    (the same checkpoint, data and prompt), written to <run>/eval_<step>. Evaluated with
    another prompt style it still runs, and says that this is not what the run trained on."""
    run = tmp_path / "run"
    shrink = [f"--config.model.tiny_dir={tmp_path / 'tiny'}", "--config.model.tiny_prime_steps=20",
              f"--config.data.synthetic_dir={tmp_path / 'data'}",
              "--config.data.synthetic_train_size=8", "--config.data.synthetic_test_size=6",
              "--config.rollout.max_response_tokens=48"]
    train = subprocess.run(
        [sys.executable, "-m", "geo3k_torch.main", "--config=configs/cpu.py", f"--workdir={run}",
         *shrink, "--config.train.steps=2", "--config.train.prompts_per_step=2",
         "--config.rollout.n_samples=2", "--config.eval.every=2", "--config.checkpoint.every=2",
         "--config.advantage.filter_equal_groups=False", "--config.log.dump_rollouts=False"],
        cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert train.returncode == 0, train.stderr[-3000:]
    last = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["step"] == 2 and "eval/greedy_first_try_accuracy" in last

    evaluate = [sys.executable, "-m", "geo3k_torch.evaluate", f"--run={run}"]
    out = subprocess.run(evaluate, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "warning:" not in out.stderr
    got = json.loads((run / "eval_2" / "eval.json").read_text())
    for key in ("greedy_first_try_accuracy", "greedy_accuracy", "greedy_tool_call_rate",
                "greedy_turns_mean", "greedy_trajectories"):
        assert got[key] == pytest.approx(last[f"eval/{key}"], abs=1e-9), key
    # the printed table's greedy cell (its standard error after it)
    assert f"| first try (turn 1) | {last['eval/greedy_first_try_accuracy']:.3f} " in out.stdout

    other = subprocess.run(evaluate[:-1] + [f"--run={run}/checkpoints/step_2",
                                            "--config.data.prompt_style=brief",
                                            f"--out={tmp_path / 'brief'}"],
                           cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert other.returncode == 0, other.stderr[-3000:]
    warned = [x for x in other.stderr.splitlines() if x.startswith("warning:")]
    assert len(warned) == 1 and warned[0].startswith(
        "warning: data.prompt_style='brief' differs from 'tool', what the run trained with")
    assert (tmp_path / "brief" / "eval.json").exists()
