"""scripts/gpu_check.py: its FLOPs count matches the models' real matmuls, a failing section is
reported with its traceback (and the rows before it), and `--tiny` runs every section on the CPU
with finite, positive numbers."""

import importlib
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from common.flops import image_flops, matmul_params, row_flops
from configs.models import write_config_dir

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"


def _module(name):
    if str(SCRIPTS) not in sys.path:  # gpu_check imports gpu_sections as a sibling
        sys.path.insert(0, str(SCRIPTS))
    return importlib.import_module(name)


@pytest.fixture(scope="module")
def sections():
    return _module("gpu_sections")


@pytest.fixture(scope="module")
def check():
    return _module("gpu_check")


def _linear_weights(module) -> int:
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, torch.nn.Linear))


@pytest.mark.parametrize("name", ["qwen3_vl_2b", "qwen2_5_vl_7b"])
def test_matmul_params_are_the_models(sections, name, tmp_path):
    """The FLOPs count's weights per unit equal the transformers model's: a wrong head count,
    a missing KV projection or the wrong MLP arity (Qwen3 vision: 2, Qwen2.5: 3) shows here."""
    cfg = transformers.AutoConfig.from_pretrained(write_config_dir(name, tmp_path))
    with torch.device("meta"):
        model = transformers.AutoModelForImageTextToText.from_config(cfg)
    visual = model.model.visual
    got = matmul_params(cfg)
    assert got["layer"] == _linear_weights(model.model.language_model.layers[0])
    assert got["vision_block"] == _linear_weights(visual.blocks[0])
    assert got["merger"] == _linear_weights(visual.merger)
    assert got["patch_embed"] == visual.patch_embed.proj.weight.numel()


def test_train_flops_of_a_text_row(sections):
    """One row of two 4-token sequences, no image, 3 trained tokens: 3 x (2 x layer weights x 8
    tokens x layers + 2 x hidden x vocab x 3 + 4 x heads x head_dim x 10 causal pairs x layers)."""
    from common.batching import PackedBatch

    cfg = transformers.AutoConfig.from_pretrained(write_config_dir("qwen3_vl_2b",
                                                                   tempfile.mkdtemp()))
    mask = np.array([0, 1, 1, 0, 0, 0, 1, 0], np.float32)
    batch = PackedBatch(np.arange(8), mask, mask, mask, np.repeat([0, 1], 4), np.array([0, 4, 8]),
                        np.zeros(2, np.int64), np.arange(2), [])
    t = cfg.text_config
    layer = matmul_params(cfg)["layer"]
    want = 3 * (2 * layer * 8 * 28 + 2 * 2048 * t.vocab_size * 3 + 4 * 16 * 128 * 20 * 28)
    assert sections.train_flops(cfg, [batch], None) == pytest.approx(want, rel=1e-12)


def test_row_flops_is_a_row_of_window_long_sequences(sections):
    """The AOT roofline's count of a row (geo3k_jax.aot) equals the step count of a packed row
    of sequences `window` long, every token trained, and adds one image's vision FLOPs."""
    from common.batching import PackedBatch

    cfg = transformers.AutoConfig.from_pretrained(write_config_dir("qwen3_vl_2b",
                                                                   tempfile.mkdtemp()))
    ones = np.ones(8, np.float32)
    batch = PackedBatch(np.arange(8), ones, ones, ones, np.repeat([0, 1], 4), np.array([0, 4, 8]),
                        np.zeros(2, np.int64), np.arange(2), [])
    text = row_flops(cfg, 8, 8, 0, window=4)
    assert text == pytest.approx(sections.train_flops(cfg, [batch], None), rel=1e-12)
    assert row_flops(cfg, 8, 8, 64, window=4) == pytest.approx(
        text + 3 * image_flops(cfg, 64), rel=1e-12)


def test_a_failing_section_is_reported_with_what_came_before(check, monkeypatch, tmp_path):
    def broken(settings):
        yield {"framework": "torch", "tokens_per_s": 1.0}
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setitem(check.gpu_sections.SECTIONS, "broken", broken)
    path = tmp_path / "broken.json"
    check.run_here("broken", check.settings(str(tmp_path), True, None), path)
    result = json.loads(path.read_text())
    assert result["status"] == "failed" and result["rows"][0]["tokens_per_s"] == 1.0
    assert "illegal memory access" in result["error"] and "Traceback" in result["error"]
    report = {"device": "CPU", "tiny": True, "peak_tflops": None, "shapes": "qwen3_vl_2b",
              "date": "now", "versions": {}, "seconds": 1.0, "failed": ["broken"],
              "sections": {"broken": {**result, "seconds": 1.0, "cpu_s": 1.0}}}
    md = check.markdown(report)
    assert "## broken: failed" in md and "illegal memory access" in md


def test_peak_from_the_device_name(check):
    assert check.peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert check.peak_tflops("NVIDIA H200") == 989.0
    assert check.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert check.peak_tflops("CPU") is None


MEASURED = ("tokens_per_s", "seconds", "tflops_per_s", "mfu", "peak_memory_gb", "wall_s",
            "time_rollout", "time_train", "first_step_s", "first_call_s", "tokens")


@pytest.mark.slow
@pytest.mark.heavy  # two minutes; the runs, steps and engines it times have their own tests
@pytest.mark.timeout(1800)
def test_tiny_check_runs_every_section(tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPTS / "gpu_check.py"), "--tiny",
                          f"--out={tmp_path}", "--peak_tflops=1"],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["failed"] == []
    assert list(report["sections"]) == ["e2e_torch", "learner_torch", "engine_torch",
                                        "e2e_jax", "learner_jax", "engine_jax"]
    rows = {n: [r for r in s["rows"] if r["status"] == "ok"]
            for n, s in report["sections"].items()}
    for name in ("e2e_torch", "e2e_jax"):
        (row,) = rows[name]
        assert row["steps"] == 2 and 0 <= row["reward_mean"] <= 1
        assert 0 <= row["tool_call_rate"] <= 1
    for name in ("learner_torch", "learner_jax"):
        assert [r["micro_batch_tokens"] for r in rows[name]] == [256]
        for r in rows[name]:
            assert r["tflops_per_s"] == pytest.approx(r["mfu"])  # --peak_tflops=1
            assert math.isfinite(r["loss"]) and r["micro_batches"] == 2
    for name in ("engine_torch", "engine_jax"):
        (row,) = rows[name]
        assert row["tokens"] == row["episodes"] * row["new_tokens"] == 64
    for name, rs in rows.items():
        numbers = [(k, v) for r in rs for k, v in r.items() if k in MEASURED]
        assert numbers, name
        assert all(math.isfinite(v) and v > 0 for _, v in numbers), (name, numbers)
    md = (tmp_path / "gpu_check.md").read_text()
    assert "## learner_jax: ok" in md and "| tokens_per_s" not in md.split("\n")[0]
