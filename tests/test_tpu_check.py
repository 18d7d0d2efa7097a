"""scripts/tpu_check.py: the roofline and the chip lookup give the literal numbers, the budget
gives each section its cap and what the earlier ones left, a section past its time is killed
with the processes it started, a config override is typed and a missing key is reported, a
failing section is recorded with the rows before it, and `--tiny` runs every section on the
CPU."""

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.script_module import SCRIPTS, script_fixture

ROOT = SCRIPTS.parent
sections = script_fixture("tpu_sections")
check = script_fixture("tpu_check")


def test_roofline_is_the_slower_of_compute_and_memory(sections):
    """4 v5p chips (459 TFLOP/s, 2,765 GB/s each): 3.672 PFLOP is 2 s of compute, 2.765 TB
    accessed a chip 1 s of HBM: compute-bound at 2 s. Dividing the FLOPs by one chip instead of
    four would give 8 s; the bytes (already per chip) by four, 0.25 s."""
    v5p = sections.chip_of("TPU v5p")
    line = sections.roofline(3.672e15, 2.765e12, 4, v5p)
    assert line.pop("bound") == "compute"
    assert line == pytest.approx({"compute_s": 2.0, "memory_s": 1.0, "roofline_s": 2.0})
    # a decode-like program: 1 TFLOP over 8 v6e chips (0.136 ms), 3.28 GB a chip (2 ms)
    line = sections.roofline(1e12, 3.28e9, 8, sections.chip_of("TPU v6 lite"))
    assert line["bound"] == "memory" and line["roofline_s"] == pytest.approx(2e-3)
    assert line["compute_s"] == pytest.approx(1e12 / (8 * 918e12))


@pytest.mark.parametrize("kind, name", [("TPU v5", "v5p"), ("TPU v5p", "v5p"),
                                        ("TPU v5 lite", "v5e"), ("TPU v5e", "v5e"),
                                        ("TPU v6 lite", "v6e"), ("TPU v4", "v4")])
def test_chip_of_the_device_kinds_jax_reports(sections, kind, name):
    """"TPU v5 lite" contains "v5": looked up in the wrong order it would read as a v5p."""
    assert sections.chip_of(kind).name == name


def test_chip_of_a_cpu_is_none(sections):
    assert sections.chip_of("cpu") is None


def test_phase_seconds_are_clipped_to_the_rollout(sections):
    """Spans 0-2, 3-5 and 9-12 in a rollout from 1 to 10: 1 + 2 + 1 = 4 s. Whole spans would
    give 7 (more than a share of 1 of the 9 s window allows once phases add up)."""
    assert sections.overlap([(0, 2), (3, 5), (9, 12)], 1, 10) == 4
    assert sections.overlap([(11, 12)], 1, 10) == 0


def test_a_phase_still_running_counts_up_to_the_window_end(sections):
    """The engine's last decode chunk sets the last future before it returns: the rollout ends
    inside it. A call wrapped by the clock records its span; one still running (started at 8)
    counts to the window's end (10): 2 s more."""
    class Engine:
        _cache = None

        def _decode_chunk(self):
            return "done"

    engine = Engine()
    clock = sections.PhaseClock(engine, ("_decode_chunk",))
    assert engine._decode_chunk() == "done"
    (span,) = clock.spans["_decode_chunk"]
    assert 0 <= span[1] - span[0] < 1
    clock.spans["_decode_chunk"] = [(2.0, 3.0)]
    clock.running["_decode_chunk"] = 8.0
    assert clock.seconds("_decode_chunk", 1.0, 10.0) == 3.0


def test_the_caps_fill_the_budget_under_an_hour(check, sections):
    assert set(check.CAPS_S) == set(sections.SECTIONS)
    assert sum(check.CAPS_S.values()) == check.BUDGET_S == 3300 < 3600


def test_a_section_gets_its_cap_and_what_the_earlier_ones_left(check):
    """At the start every section's cap is sure: compile gets its 1,200 s. Had compile used
    200 of them, memory would get 3,100 - 1,500 (decode's 420, rollout's 360, learner's 480,
    numerics' 240, kept) = 1,600 s. With 100 s left, decode gets those 100 s; with --tiny all
    that is left."""
    order = list(check.CAPS_S)
    assert check.section_timeout("compile", order, 3300.0, False) == 1200.0
    assert check.section_timeout("memory", order, 3100.0, False) == 1600.0
    assert check.section_timeout("decode", order, 100.0, False) == 100.0
    assert check.section_timeout("numerics", order, 250.0, False) == 250.0
    assert check.section_timeout("compile", order, 500.0, True) == 500.0
    # the sections asked for, not all of them, are the ones kept for
    assert check.section_timeout("decode", ["decode", "numerics"], 1000.0, False) == 760.0


def test_a_section_past_its_time_is_killed_with_what_it_started(check, tmp_path):
    """The section starts a process of its own (as the compile and memory sections start their
    passes) and waits; at the timeout both are gone, so the chips are free for the next
    section. Killing the section's process alone would leave the other one running."""
    pid_file = tmp_path / "pid"
    code = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', "
            "'import time; time.sleep(120)']); open(sys.argv[1], 'w').write(str(p.pid)); "
            "time.sleep(120)")
    start = time.perf_counter()
    result = check.run_child([sys.executable, "-c", code, str(pid_file)],
                             tmp_path / "s.json", tmp_path / "s.log", 5.0, True)
    assert time.perf_counter() - start < 60
    assert result["status"] == "timeout" and "stopped after 5 s" in result["error"]
    pid = int(pid_file.read_text())
    for _ in range(50):  # killed; reaped by init shortly after
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the section's own process {pid} outlived the timeout")


def test_an_override_takes_the_keys_type_and_a_missing_key_is_named(sections):
    from configs import tpu

    cfg = tpu.get_config("cpu")
    assert sections.set_override(cfg, "engine.slots=64") and cfg.engine.slots == 64
    assert sections.set_override(cfg, "jax.remat=False") and cfg.jax.remat is False
    assert sections.set_override(cfg, "jax.attention=windowed")
    assert cfg.jax.attention == "windowed"
    assert sections.set_override(cfg, "engine.kv_memory_fraction=0.5")
    assert cfg.engine.kv_memory_fraction == 0.5
    with pytest.raises(ValueError, match="True or False"):
        sections.set_override(cfg, "jax.remat=no")
    assert not sections.set_override(cfg, "jax.no_such_key=1")
    assert not sections.set_override(cfg, "nowhere.slots=1")
    assert sections.missing(cfg, ("engine.slots=8", "jax.no_such_key=1", "x.y=2")) == [
        "jax.no_such_key", "x.y"]
    assert cfg.engine.slots == 64  # `missing` tries them on a copy


def test_a_memory_variant_the_config_lacks_is_skipped_with_its_note(sections, monkeypatch,
                                                                     tmp_path):
    """No pass is started for it; the recipe's own row is the pass's."""
    monkeypatch.setattr(sections, "MEMORY_VARIANTS", (("recipe", ()),
                                                      ("new", ("jax.no_such_key=True",))))
    passes = []
    monkeypatch.setattr(sections, "in_child", lambda name, s, overrides=(): passes.append(
        overrides) or {"measured": {"rollout": {"in_use_gib": 1.0}}, "predicted": {
            "rollout": 2.0}, "fits": True, "predicted_hbm_gib": 95.74})
    rows = list(sections.memory(sections.Settings.tiny_settings(str(tmp_path))))
    assert passes == [()]
    assert rows[0] == {"variant": "recipe", "phase": "rollout", "in_use_gib": 1.0,
                       "predicted_gib": 2.0, "predicted_fits": True, "hbm_gib": 95.74}
    assert rows[1]["status"] == "skipped" and "jax.no_such_key" in rows[1]["note"]


def test_a_failing_section_is_reported_with_what_came_before(check, monkeypatch, tmp_path):
    def broken(settings):
        yield {"megacore_mode": "None", "tokens_per_s": 1.0}
        raise RuntimeError("RESOURCE_EXHAUSTED: Error allocating device buffer")

    monkeypatch.setitem(check.tpu_sections.SECTIONS, "broken", broken)
    path = tmp_path / "broken.json"
    check.run_here("broken", check.tpu_sections.Settings.tiny_settings(str(tmp_path)), path)
    result = json.loads(path.read_text())
    assert result["status"] == "failed" and result["rows"][0]["tokens_per_s"] == 1.0
    assert "RESOURCE_EXHAUSTED" in result["error"] and "Traceback" in result["error"]
    report = {"device": {"platform": "cpu", "device_kind": "cpu", "devices": 1},
              "tiny": True, "model": "", "overrides": [], "date": "now", "versions": {},
              "seconds": 1.0, "failed": ["broken"],
              "sections": {"broken": {**result, "seconds": 1.0}}}
    md = check.markdown(report)
    assert "## broken: failed" in md and "RESOURCE_EXHAUSTED" in md
    assert "| megacore_mode | tokens_per_s |" in md


MEASURED = ("build_s", "learner_grad_s", "learner_apply_s", "engine_s", "total_s",
            "first_call_s", "seconds", "tokens_per_s", "rollout_s", "prefill_s", "decode_s",
            "step_s", "first_step_s", "model_tflop", "compute_s", "memory_s", "roofline_s",
            "step_over_roofline", "mfu", "predicted_gib")


@pytest.mark.slow
@pytest.mark.heavy  # 6-20 minutes on 2 loaded cores: 7 builds, 2 x 45 engine programs
@pytest.mark.timeout(3600)
def test_tiny_check_runs_every_section(tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPTS / "tpu_check.py"), "--tiny",
                          f"--out={tmp_path}"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    report = json.loads((tmp_path / "tpu_check.json").read_text())
    assert report["failed"] == [] and report["device"]["platform"] == "cpu"
    assert list(report["sections"]) == ["compile", "memory", "decode", "rollout", "learner",
                                        "numerics"]
    rows = {n: [r for r in s["rows"] if r["status"] == "ok"]
            for n, s in report["sections"].items()}
    cold, warm = rows["compile"]
    assert (cold["cache"], warm["cache"]) == ("cold", "warm")
    assert cold["engine_programs"] > 0 and warm["cache_files"] >= cold["cache_files"] > 0
    phases = [r["phase"] for r in rows["memory"] if r["variant"] == "recipe"]
    assert phases == ["built", "rollout", "train", "weight copy"]
    assert all(r["in_use_gib"] == "n/a" or r["in_use_gib"] > 0 for r in rows["memory"])
    # every megacore mode through the interpreted kernel (a TPU skips them but on v5p and v4)
    assert [r["megacore_mode"] for r in rows["decode"]] == ["None", "kv_head", "batch"]
    for r in rows["decode"]:
        assert r["kernel"] == "pallas" and r["tokens"] == r["slots"] * r["new_tokens"]
        assert r["same_tokens"]  # the kernel split over two cores draws the same tokens
    second = rows["rollout"][1]
    assert second["call"] == "second" and second["episodes"] > 0
    assert 0 < second["prefill_share"] + second["decode_share"] <= 1
    (step,) = rows["learner"]
    assert step["rows"] == 2 and math.isfinite(step["loss"])
    assert step["chip"] == "nominal (tiny rehearsal)"  # a CPU has no published peak
    assert step["roofline_s"] == max(step["compute_s"], step["memory_s"]) > 0
    assert step["compute_s"] == pytest.approx(step["model_tflop"] * 1e12 / 1e12)  # 1 TFLOP/s
    assert {r["quantity"] for r in rows["numerics"]} >= {"logits", "loss"}
    for name, rs in rows.items():
        numbers = [(k, v) for r in rs for k, v in r.items() if k in MEASURED
                   and not isinstance(v, str)]
        assert all(math.isfinite(v) and v > 0 for _, v in numbers), (name, numbers)
    md = (tmp_path / "tpu_check.md").read_text()
    assert "## decode: ok" in md and "# TPU check: 1 x cpu (cpu)" in md
