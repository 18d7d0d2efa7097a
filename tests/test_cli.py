"""The entry points' command line (common.cli): a run that returns prints its summary line and
exits 0, its exit handlers run; a failing run exits with its error."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHILD = """
import atexit, os
from common import cli

def train(config, workdir):
    if os.environ.get("FAIL_RUN"):
        raise RuntimeError("the run failed")
    return {"train/reward_mean": 0.5}

atexit.register(lambda: print("exit handler ran", flush=True))
cli.main(train, rank=lambda: 0)
"""


@pytest.mark.parametrize("fail", [False, True])
def test_a_run_prints_its_summary_or_fails_with_its_error(tmp_path, fail):
    args = [sys.executable, "-c", CHILD, "--config=configs/cpu.py", f"--workdir={tmp_path}"]
    env = dict(os.environ, FAIL_RUN="1" if fail else "")
    out = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    if fail:
        assert out.returncode != 0 and "the run failed" in out.stderr
        assert "done:" not in out.stdout
    else:
        assert out.returncode == 0, out.stderr
        assert f"done: {tmp_path} reward 0.500" in out.stdout
    assert "exit handler ran" in out.stdout


BUCKET_CHILD = """
from pathlib import Path
from common import cli

def train(config, workdir):
    assert Path(workdir).is_dir() and "://" not in workdir  # a local folder
    (Path(workdir) / "metrics.jsonl").write_text('{"step": 1}\\n')
    (Path(workdir) / "checkpoint_dir.txt").write_text(config.checkpoint.dir)
    return {"train/reward_mean": 0.5, "eval/greedy_first_try_accuracy": 0.5,
            "eval/greedy_accuracy": 0.875, "eval/baseline_first_try": 0.25,
            "eval/baseline_with_feedback": 0.75}

cli.main(train, rank=lambda: 0)
"""


def test_a_bucket_as_workdir_gets_the_run_and_its_checkpoints(tmp_path):
    """--workdir=gs://...: the run writes a local folder that reaches the bucket (its report
    included), the checkpoints go to <workdir>/checkpoints, and nothing named "gs:" appears
    locally (pathlib would make one of the URL)."""
    from common import storage
    from tests.fake_gcs import fake_gcs

    with fake_gcs() as bucket:
        url = f"gs://{bucket}/cli-run"
        args = [sys.executable, "-c", BUCKET_CHILD, f"--config={ROOT}/configs/cpu.py",
                f"--workdir={url}"]
        out = subprocess.run(args, cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert f"done: {url} reward 0.500" in out.stdout
        assert storage.path(f"{url}/metrics.jsonl").read_text() == '{"step": 1}\n'
        assert storage.path(f"{url}/checkpoint_dir.txt").read_text() == f"{url}/checkpoints"
        assert "no skill" in storage.path(f"{url}/eval/eval.md").read_text()
        assert storage.path(f"{url}/eval/eval.png").exists()
    assert not list(tmp_path.iterdir())


EVAL_CHILD = """
from common import cli

def train(config, workdir):
    return {"train/reward_mean": 0.5, "eval/greedy_first_try_accuracy": 0.5,
            "eval/greedy_accuracy": 0.875, "eval/baseline_first_try": 0.25,
            "eval/baseline_with_feedback": 0.75}

cli.main(train, rank=lambda: 0)
"""


def test_the_last_evaluation_is_printed_beside_its_baselines(tmp_path):
    """Both entry points (torch and JAX) end with the last evaluation's table, a no-skill
    column beside every accuracy, also written to <workdir>/eval."""
    args = [sys.executable, "-c", EVAL_CHILD, "--config=configs/cpu.py", f"--workdir={tmp_path}"]
    out = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "| | greedy | no skill |" in out.stdout
    assert "| first try (turn 1) | 0.500 | 0.250 |" in out.stdout
    assert "| with feedback (≤3 turns) | 0.875 | 0.750 |" in out.stdout
    assert "eval 0.875 no-skill 0.750" in out.stdout
    assert (tmp_path / "eval" / "eval.md").read_text() in out.stdout


@pytest.mark.parametrize("entry", ["geo3k_torch.main", "geo3k_jax.train"])
@pytest.mark.parametrize("case", ["file_workdir", "negative_lr"])
def test_bad_input_stops_before_the_model_loads(entry, case, tmp_path):
    """Through the real entry points: a workdir that is a file, or a negative learning rate,
    stops with one clear line naming the setting, before any model is built or loaded (no
    tiny checkpoint is made: model.tiny_dir points into tmp_path), and the file is untouched."""
    workdir = tmp_path / "run"
    args = [sys.executable, "-m", entry, "--config=configs/cpu.py",
            f"--config.model.tiny_dir={tmp_path / 'tiny'}",
            f"--config.data.synthetic_dir={tmp_path / 'data'}"]
    if case == "file_workdir":
        workdir.write_text("not a folder")
        want = f"workdir {workdir} is a file"
    else:
        args.append("--config.train.lr=-0.001")
        want = "train.lr=-0.001 must be > 0"
    out = subprocess.run(args + [f"--workdir={workdir}"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode != 0 and want in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "tiny").exists() and not (tmp_path / "data").exists()
    if case == "file_workdir":
        assert workdir.read_text() == "not a folder"
    else:  # refused by the preflight: exit status 2, one line, no run folder
        assert out.returncode == 2 and out.stderr.strip() == f"error: {want}"
        assert not workdir.exists()


def test_each_range_is_enforced():
    """Every rule of common.config_rules.RANGES takes its closed bounds and refuses a value
    just outside each bound, NaN, the infinities, a string and a bool, each in one line that
    names the key; check_ranges (the build's own check) raises on the same."""
    import math

    from common.config_rules import RANGES, contains, problems
    from common.prepare import check_ranges
    from configs import base
    interval = re.compile(r"^([\[(])(\S+), (\S+)([\])])$")
    for key, rule in RANGES.items():
        for part in rule.split(" or "):
            m = interval.match(part)
            if m is None:  # a single value
                assert contains(rule, float(part)), (key, part)
                continue
            opening, low, high, closing = m.group(1), float(m.group(2)), float(m.group(3)), \
                m.group(4)
            if math.isfinite(low):
                assert contains(rule, low) == (opening == "["), (key, low)
                assert not contains(rule, low - 0.5) or " or " in rule, (key, low - 0.5)
            if math.isfinite(high):
                assert contains(rule, high) == (closing == "]"), (key, high)
                assert not contains(rule, high + 0.5), (key, high)
        for value in (math.nan, math.inf, -math.inf, "1", True, None):
            assert not contains(rule, value), (key, value)
    cfg = base.get_config()
    assert problems(cfg) == []
    cfg.train.lr, cfg.train.beta2, cfg.loss.dual_clip = -1e-3, 1.0, 1.0
    assert problems(cfg) == ["loss.dual_clip=1.0 must be > 1 (or None: off)",
                             "train.lr=-0.001 must be > 0", "train.beta2=1.0 must be >= 0 and < 1"]
    with pytest.raises(ValueError, match=r"train\.lr=-0\.001 must be > 0"):
        check_ranges(cfg)


def test_every_numeric_field_has_a_rule_and_every_config_keeps_them():
    """A numeric field added to configs/base.py without a rule in common.config_rules.RANGES
    fails here; every config file (each with its arguments) is within the rules, the GRPO
    recipes within GRPO's too."""
    from common.config_help import flatten, load
    from common.config_rules import RANGES, problems
    import ml_collections
    cfg = load(str(ROOT / "configs" / "base.py"))
    numeric = [k for k, v in flatten(cfg).items() if not isinstance(v, ml_collections.ConfigDict)
               and isinstance(v, (int, float)) and not isinstance(v, bool)]
    numeric += ["loss.dual_clip", "loss.tis_cap"]  # placeholders: None by default
    assert sorted(set(numeric) - set(RANGES)) == []
    assert sorted(set(RANGES) - set(numeric)) == []
    for spec in ("cpu.py", "cpu_perception.py", "h100.py", "h100_areal.py", "h100_areal.py:cpu",
                 "h100_single_turn.py", "h100_single_turn.py:cpu", "h100_moe.py",
                 "h100_moe.py:cpu", "tpu.py", "tpu.py:cpu"):
        assert problems(load(str(ROOT / "configs" / spec)), grpo=True) == [], spec
    for spec in ("sft.py", "sft.py:cpu"):
        assert problems(load(str(ROOT / "configs" / spec))) == [], spec


# The command line's mistakes and help (common.config_help), answered before torch or jax loads.
# Each entry point runs as `python -m` would run it (runpy, as __main__); the wrapper then prints
# which heavy modules were imported, on stdout, so stderr holds only the entry point's words.
RUN_AS_MAIN = """
import runpy, sys
entry, sys.argv = sys.argv[1], [sys.argv[1]] + sys.argv[2:]
try:
    runpy.run_module(entry, run_name="__main__", alter_sys=True)
finally:
    heavy = sorted(m for m in ("torch", "jax", "transformers") if m in sys.modules)
    print("heavy modules:", heavy, flush=True)
"""
HEAVY_NONE = "heavy modules: []"


def run_entry(entry, *args, columns=200, cwd=ROOT):
    """`python -m entry args` (as RUN_AS_MAIN runs it) on a terminal `columns` wide."""
    env = dict(os.environ, COLUMNS=str(columns), PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", RUN_AS_MAIN, entry, *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("entry", ["geo3k_torch.main", "geo3k_jax.train", "geo3k_torch.sft",
                                   "geo3k_torch.evaluate", "geo3k_jax.main"])
@pytest.mark.parametrize("arg, key, nearest", [
    ("--config.train.lr_typo=1", "train.lr_typo", "train.lr"),  # a misspelled field
    ("--config.trian.lr=1", "trian.lr", "train.lr"),             # a misspelled section
    ("--config.rolout.n_samples=4", "rolout.n_samples", "rollout.n_samples"),
])
def test_an_unknown_config_key_is_one_line_naming_the_nearest(entry, arg, key, nearest):
    """Exit status 2 (absl's usage error), one line on stderr naming the key and the nearest
    existing one, and neither torch, jax nor transformers imported."""
    out = run_entry(entry, "--config=configs/cpu.py", arg)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert f"--config.{key}" in lines[0] and f"did you mean {nearest}" in lines[0], lines[0]
    assert HEAVY_NONE in out.stdout


def test_expert_groups_must_divide_the_servers_gpus():
    """engine.sglang_ep_size: a divisor of sglang_gpus_per_server passes, another is one line
    naming both; at the command line the preflight refuses it (exit 2) before torch loads."""
    from common.config_rules import problems
    from configs import h100
    cfg = h100.get_config()
    cfg.engine.sglang_gpus_per_server = 8
    for ep in (1, 2, 4, 8):
        cfg.engine.sglang_ep_size = ep
        assert problems(cfg) == [], ep
    cfg.engine.sglang_ep_size = 3
    want = ("engine.sglang_ep_size=3 must divide engine.sglang_gpus_per_server=8: SGLang splits "
            "a server's experts into ep groups over its tp GPUs (--ep-size, --tp-size)")
    assert problems(cfg) == [want]
    out = run_entry("geo3k_torch.main", "--config=configs/h100.py",
                    "--config.engine.sglang_gpus_per_server=8", "--config.engine.sglang_ep_size=3")
    assert out.returncode == 2 and out.stderr.strip() == f"error: {want}", out.stderr[-2000:]
    assert HEAVY_NONE in out.stdout


CLI_MAIN_CHILD = """
from common import cli
cli.main(lambda config, workdir: {}, rank=lambda: 0)
"""


@pytest.mark.parametrize("arg, words", [
    ("--config.train.lr=abc", ["--config.train.lr=abc", "takes a float"]),
    ("--config.train.steps=1.5", ["--config.train.steps=1.5", "takes an int"]),
    ("--config.train.bf16=maybe", ["--config.train.bf16=maybe", "takes a bool"]),
    ("--config.train.lr_typo=1", ["train.lr_typo", "did you mean train.lr"]),
])
def test_a_value_of_the_wrong_type_is_one_line(arg, words):
    """Through `cli.main` itself (no entry point's early check before it): a value its field
    cannot take names the key, the value and the type; an unknown key is refused the same."""
    out = subprocess.run([sys.executable, "-c", CLI_MAIN_CHILD, "--config=configs/cpu.py", arg],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and all(w in lines[0] for w in words), out.stderr


def test_an_override_before_the_config_and_a_missing_config_file_are_one_line():
    for args, words in [(["--config.train.lr=1", "--config=configs/cpu.py"],
                         ["--config.train.lr=1 comes before --config=configs/cpu.py"]),
                        (["--config=configs/no_such.py"], ["configs/no_such.py",
                                                           "no such config file"])]:
        out = run_entry("geo3k_torch.main", *args)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1, out.stderr[-2000:]
        assert all(w in lines[0] for w in words), lines[0]
        assert HEAVY_NONE in out.stdout


@pytest.mark.parametrize("entry", ["geo3k_torch.main", "geo3k_jax.train", "geo3k_torch.sft"])
@pytest.mark.parametrize("flag", ["--help", "--helpfull"])
def test_help_lists_the_config_fields_without_importing_the_framework(entry, flag):
    """--help and --helpfull exit 0 and list the entry point's flags and every config field
    with its value in the --config file (configs/base.py's beside it where the file changes
    it) and its meaning, the comment of configs/base.py; torch and jax are not imported."""
    out = run_entry(entry, "--config=configs/cpu.py", flag)
    assert out.returncode == 0, out.stderr[-2000:]
    assert HEAVY_NONE in out.stdout and not out.stderr.strip(), out.stderr
    lines = out.stdout.splitlines()
    assert any(line.strip().startswith("--workdir:") for line in lines)
    assert "config fields (configs/cpu.py;" in out.stdout
    fields = {line.split(" = ", 1)[0].strip(): line for line in lines if " = " in line}
    from configs import base, cpu
    lr, base_lr = cpu.get_config().train.lr, base.get_config().train.lr
    assert f"train.lr = {lr!r}" in fields["train.lr"]
    assert (f"[base: {base_lr!r}]" in fields["train.lr"]) == (lr != base_lr)
    assert "constant | linear | cosine" in fields["train.lr_schedule"]
    assert "'constant'" in fields["train.lr_schedule"]
    assert "jax.check.seed" in fields and "seed" in fields
    if flag == "--helpfull":
        assert "--[no]pdb" in out.stdout  # absl's own flags too


def test_help_without_config_shows_the_default_config():
    out = run_entry("geo3k_torch.main", "--help")
    assert out.returncode == 0 and HEAVY_NONE in out.stdout, out.stderr[-2000:]
    assert "config fields (configs/cpu_perception.py;" in out.stdout
    assert "Multi-turn GRPO on Geometry3K with the torch learner" in out.stdout  # its docstring


def test_field_notes_read_the_comment_beside_or_above(tmp_path):
    from common import config_help
    src = tmp_path / "base.py"
    src.write_text(
        "import ml_collections\n"
        "def get_config():\n"
        "    c = ml_collections.ConfigDict()\n"
        "    # The section.\n"
        "    c.a = ml_collections.ConfigDict()\n"
        "    c.a.x = 1  # beside x\n"
        "    # above y,\n"
        "    #   two lines\n"
        "    c.a.y = '#not a comment'\n"
        "\n"
        "    c.a.z = ml_collections.ConfigDict(\n"
        "        {'p': 1})  # the dict\n"
        "    c.a.w = 2\n"
        "    return c\n")
    assert config_help.field_notes(src) == {
        "a": "The section.", "a.x": "beside x", "a.y": "above y, two lines",
        "a.z": "the dict", "a.w": ""}
    assert config_help.field_notes(tmp_path / "missing.py") == {}
    notes = config_help.field_notes()  # the real configs/base.py
    assert notes["rollout.schedule"].startswith("episode (each episode at its own pace)")
    order = list(notes)  # the file's order
    assert order.index("data") < order.index("data.path") < order.index("train.lr")


def test_nearest_keys():
    from common.config_help import nearest
    keys = ["seed", "train.lr", "train.steps", "train.min_lr_ratio", "rollout.n_samples",
            "eval.n_samples", "jax.mesh.data"]
    assert nearest("trian.lr", keys) == ["train.lr"]
    assert nearest("lr", keys) == ["train.lr"]
    assert nearest("train.lr_typo", keys)[0] == "train.lr"
    assert nearest("rolout.n_samples", keys)[0] == "rollout.n_samples"
    assert nearest("seeed", keys) == ["seed"]
    assert nearest("jax.mesh.dta", keys) == ["jax.mesh.data"]
    assert nearest("completely.different", keys) == []


@pytest.mark.slow
@pytest.mark.parametrize("entry", ["geo3k_torch.main", "geo3k_jax.train"])
def test_a_batch_run_prints_a_line_per_step_and_keeps_its_config(entry, tmp_path):
    """Through the real entry point with stdout a file (nohup, SLURM): one plain line per step
    on stdout, no progress bar or warning repeated per checkpoint on stderr, and the run folder
    holds config.json (the resolved config, the command line, the versions); a resumed run
    with another setting names that change alone and is appended to config.json's launches,
    the first kept; launched again at its last step, the run says it is finished."""
    run = tmp_path / "run"
    args = [sys.executable, "-m", entry, "--config=configs/cpu.py", f"--workdir={run}",
            f"--config.model.tiny_dir={tmp_path / 'tiny'}", "--config.model.tiny_prime_steps=2",
            f"--config.data.synthetic_dir={tmp_path / 'data'}",
            "--config.data.synthetic_train_size=8", "--config.data.synthetic_test_size=4",
            "--config.train.steps=2", "--config.train.prompts_per_step=2",
            "--config.rollout.n_samples=2", "--config.rollout.max_response_tokens=8",
            "--config.eval.every=0", "--config.checkpoint.every=1",
            "--config.advantage.filter_equal_groups=False"]
    out = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [x for x in out.stdout.splitlines() if x.startswith("step ")]
    assert [x.split()[1] for x in lines] == ["1/2", "2/2"], out.stdout[-2000:]
    assert all(" s eta " in x and "reward" in x for x in lines)
    assert "Writing model shards" not in out.stderr and "UserWarning" not in out.stderr
    record = json.loads((run / "config.json").read_text())
    assert record["config"]["train"]["steps"] == 2 and "--config.train.steps=2" in record["argv"]
    assert "torch" in record["versions"] or "jax" in record["versions"]
    again = subprocess.run(args[:-1] + ["--config.train.steps=3", "--config.train.resume=True",
                                        "--config.advantage.filter_equal_groups=False"],
                           cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    # the one real change, named alone (jax.rules' tuples are JSON lists: no change)
    said = [x for x in again.stderr.splitlines() if "differs from the run's" in x]
    assert len(said) == 1 and said[0].endswith("differs from the run's: train.steps: 2 -> 3")
    record = json.loads((run / "config.json").read_text())
    assert record["config"]["train"]["steps"] == 3 and "--config.train.steps=2" in record["argv"]
    first, second = record["launches"]
    assert first["config"]["train"]["steps"] == 2 and "--config.train.steps=3" in second["argv"]
    assert second["changed"] == {"train.steps": [2, 3]} and second["resume"] is True
    assert first["git"] is None or len(first["git"]["commit"]) == 40
    # a finished run says so and exits 0: no bare `done:`, nothing built, nothing appended
    done = subprocess.run(args[:-1] + ["--config.train.steps=3", "--config.train.resume=True",
                                       "--config.advantage.filter_equal_groups=False"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{run} is finished: its newest checkpoint" in done.stdout
    assert "at step 3 of train.steps=3" in done.stdout and "done:" not in done.stdout
    assert len(json.loads((run / "config.json").read_text())["launches"]) == 2


ENTRY_POINTS = ["geo3k_torch.main", "geo3k_jax.train", "geo3k_torch.sft", "geo3k_torch.evaluate",
                "geo3k_jax.main", "geo3k_jax.aot"]
GRPO_ENTRY_POINTS = ("geo3k_torch.main", "geo3k_jax.train")


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_values_out_of_range_are_refused_one_line_each_before_anything(entry, tmp_path):
    """Hostile values (negative, zero steps, NaN, inf) through the real entry point: one line
    each naming the key, its value and its range, exit status 2, in the same preflight as an
    unknown key (no torch, jax or transformers imported), and no run folder made. A group of
    one episode is refused where the entry point trains with GRPO, and only there."""
    args = [f"--config={ROOT}/configs/cpu.py", f"--workdir={tmp_path / 'run'}",
            "--config.train.lr=-0.001", "--config.train.steps=0",
            "--config.rollout.temperature=nan", "--config.loss.clip_high=inf",
            "--config.rollout.n_samples=1"]
    began = time.monotonic()
    out = run_entry(entry, *args, cwd=tmp_path)
    seconds = time.monotonic() - began
    want = ["error: rollout.temperature=nan must be >= 0",
            "error: loss.clip_high=inf must be >= 0",
            "error: train.steps=0 must be >= 1",
            "error: train.lr=-0.001 must be > 0"]
    if entry in GRPO_ENTRY_POINTS:
        want.append("error: rollout.n_samples=1 must be >= 2 to train with GRPO: GRPO scores "
                    "each episode against the other episodes of its prompt; a group of one has "
                    "no spread and trains nothing")
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == want
    assert HEAVY_NONE in out.stdout
    assert not (tmp_path / "run").exists() and not (tmp_path / "runs").exists()
    assert seconds < 30  # about a second alone; a loaded machine's worst case


def test_a_group_of_one_alone_and_a_float_for_an_int_are_refused():
    """`--config.rollout.n_samples=1`, the one setting of a run that trained nothing in 60
    steps, is refused by itself; a string where a number goes is the type's one line."""
    out = run_entry("geo3k_torch.main", "--config=configs/cpu.py", "--config.rollout.n_samples=1")
    assert out.returncode == 2 and HEAVY_NONE in out.stdout
    assert out.stderr.startswith("error: rollout.n_samples=1 must be >= 2 to train with GRPO")
    out = run_entry("geo3k_torch.sft", "--config=configs/cpu.py", "--config.train.lr=fast")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert "--config.train.lr=fast: train.lr takes a float" in out.stderr


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("columns", [60, 160])
def test_help_is_alike_for_every_entry_point_and_fits_the_terminal(entry, columns):
    """--help through every entry point: exit 0 without torch, jax or transformers, the entry
    point's docstring, its flags, and every config field with its whole meaning (no "..." cut),
    wrapped to the terminal's width (COLUMNS) except where one word is longer than a line."""
    out = run_entry(entry, "--help", columns=columns)
    assert out.returncode == 0, out.stderr[-2000:]
    assert HEAVY_NONE in out.stdout and not out.stderr.strip(), out.stderr
    text = out.stdout.replace(HEAVY_NONE, "")
    lines = text.splitlines()
    assert lines[0].strip() and "flags:" in lines and "  --config: " in text
    over = [x for x in lines if len(x) > columns and " " in x.strip()
            and not x.startswith("    python") and not x.startswith(" " * 4 + "torchrun")
            and len(max(x.split(), key=len)) < columns - 8 and not x.startswith("    XLA_")]
    listing = text[text.index("config fields ("):]
    over = [x for x in over if x in listing or x.startswith("  --")]
    assert not over, over[:3]
    fields = " ".join(listing.split())  # the meanings, their wrapping undone
    assert "train.lr = " in listing and "jax.check.seed = " in listing
    assert ("episode (each episode at its own pace) | lockstep" in fields)  # a whole meaning
    assert " ..." not in fields.replace("...]", "").replace("...'", "")
    if entry == "geo3k_torch.evaluate":
        assert "  --run: " in text and "  --out: " in text
    if entry == "geo3k_jax.aot":
        assert "  --topology: " in text and "config fields (configs/tpu.py;" in text


def test_several_processes_need_a_workdir_unless_the_entry_point_shares_one(tmp_path):
    """WORLD_SIZE=2 and no --workdir, through `cli.main` with no way to share rank 0's folder
    name: one line, exit status 2, and no runs/ folder (each process would name its own)."""
    env = dict(os.environ, WORLD_SIZE="2", RANK="1", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", CLI_MAIN_CHILD, f"--config={ROOT}/configs/cpu.py"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip() == ("error: 2 processes (WORLD_SIZE=2) need one --workdir to share: "
                                  "pass --workdir=<folder every process sees>")
    assert not (tmp_path / "runs").exists()


TORCHRUN_CHILD = """
import atexit, os, sys, time
from pathlib import Path
sys.path.insert(0, {root!r})
import torch.distributed as dist

def left_the_group():  # registered first, so it runs after every handler the run registers
    Path(f"left_{{os.environ['RANK']}}").write_text(str(not dist.is_initialized()))

atexit.register(left_the_group)
if os.environ["RANK"] == "1":
    time.sleep(1.5)  # the ranks read their clocks in different seconds
from common import cli
from geo3k_torch.prepare import same_workdir

def train(config, workdir):
    Path(workdir).mkdir(parents=True, exist_ok=True)
    (Path(workdir) / f"rank_{{os.environ['RANK']}}").write_text(os.environ["WORLD_SIZE"])
    return {{"train/reward_mean": 0.5}}

cli.main(train, rank=lambda: int(os.environ["RANK"]), grpo=True, same_workdir=same_workdir)
"""


@pytest.mark.slow
def test_under_torchrun_every_rank_uses_rank_0s_run_folder(tmp_path):
    """Two CPU processes (gloo) under torchrun, no --workdir, rank 1 reading its clock 1.5 s
    after rank 0: both write into the one folder rank 0 named (`geo3k_torch.prepare.
    same_workdir`, the torch entry points' broadcast), and rank 0 alone prints `done:`. The
    `train` here never leaves the group: each process has left it before exiting all the same
    (`distributed.init`'s exit handler; a gloo group left to finalization aborted a rank)."""
    from tests.test_fsdp import free_port
    child = tmp_path / "child.py"
    child.write_text(TORCHRUN_CHILD.format(root=str(ROOT)))
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(child),
           f"--config={ROOT}/configs/cpu.py", "--config.train.device=cpu"]
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    folders = list((tmp_path / "runs").iterdir())
    assert len(folders) == 1, folders
    assert sorted(p.name for p in folders[0].iterdir()) == ["rank_0", "rank_1"]
    assert out.stdout.count("done: runs/") == 1
    assert [(tmp_path / f"left_{r}").read_text() for r in (0, 1)] == ["True", "True"]


@pytest.mark.slow
def test_a_run_whose_steps_train_nothing_says_so(tmp_path):
    """Through the real entry point: an untrained tiny model never calls the tool, every
    episode scores 0, no group has a reward spread and no step trains a sequence; after 5
    such steps in a row the log says so, naming the steps."""
    args = [sys.executable, "-m", "geo3k_torch.main", "--config=configs/cpu.py",
            f"--workdir={tmp_path / 'run'}", f"--config.model.tiny_dir={tmp_path / 'tiny'}",
            "--config.model.tiny_prime_steps=0", f"--config.data.synthetic_dir={tmp_path / 'data'}",
            "--config.data.synthetic_train_size=8", "--config.data.synthetic_test_size=4",
            "--config.train.steps=5", "--config.train.prompts_per_step=2",
            "--config.rollout.n_samples=2", "--config.rollout.max_response_tokens=8",
            "--config.eval.every=0", "--config.checkpoint.every=5",
            "--config.log.dump_rollouts=False", "--config.log.plot_every=0"]
    out = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/sequences"] for r in rows] == [0.0] * 5
    said = [x for x in out.stderr.splitlines() if "trained nothing" in x]
    assert len(said) == 1 and "steps 1-5 trained nothing (0 sequences)" in said[0], out.stderr
