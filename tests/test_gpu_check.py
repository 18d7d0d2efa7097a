"""scripts/gpu_check.py: its FLOPs count matches the models' real matmuls, a failing section is
reported with its traceback (and the rows before it), the profile's pure parts (idle share, top
ops, the step-cost fit, the host-sync counter) give the literal numbers, and `--tiny` runs every
section on the CPU with finite, positive numbers."""

import json
import math
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from common.flops import image_flops, matmul_params, row_flops
from configs.models import write_config_dir
from tests.script_module import SCRIPTS, script_fixture

ROOT = SCRIPTS.parent
sections = script_fixture("gpu_sections")
check = script_fixture("gpu_check")
profile = script_fixture("gpu_profile")


def _linear_weights(module) -> int:
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, torch.nn.Linear))


def _token_weights(layer, text) -> int:
    """A decoder layer's matmul weights one token meets: its linears, and of a MoE block the
    router and top-k of the experts' 3-D tensors (not modules, so not among the linears)."""
    mlp = layer.mlp
    if not hasattr(mlp, "experts"):
        return _linear_weights(layer)
    expert = mlp.experts.gate_up_proj[0].numel() + mlp.experts.down_proj[0].numel()
    return _linear_weights(layer) + mlp.gate.weight.numel() + text.num_experts_per_tok * expert


@pytest.mark.parametrize("name", ["qwen3_vl_2b", "qwen2_5_vl_7b", "qwen3_vl_30b_a3b"])
def test_matmul_params_are_the_models(sections, name, tmp_path):
    """The FLOPs count's weights per unit equal the transformers model's: a wrong head count,
    a missing KV projection, the wrong MLP arity (Qwen3 vision: 2, Qwen2.5: 3) or all E experts
    counted per token instead of the top k shows here."""
    cfg = transformers.AutoConfig.from_pretrained(write_config_dir(name, tmp_path))
    with torch.device("meta"):
        model = transformers.AutoModelForImageTextToText.from_config(cfg)
    visual = model.model.visual
    got = matmul_params(cfg)
    assert got["layer"] == _token_weights(model.model.language_model.layers[0], cfg.text_config)
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
    check.run_here("broken", check.settings(str(tmp_path), True, None), path, "CPU")
    result = json.loads(path.read_text())
    assert result["status"] == "failed" and result["rows"][0]["tokens_per_s"] == 1.0
    assert result["device"] == "CPU" and result["versions"]["torch"] == torch.__version__
    assert "illegal memory access" in result["error"] and "Traceback" in result["error"]
    report = {"device": "CPU", "tiny": True, "peak_tflops": None, "shapes": "qwen3_vl_2b",
              "date": "now", "versions": {}, "seconds": 1.0, "failed": ["broken"],
              "sections": {"broken": {**result, "seconds": 1.0, "cpu_s": 1.0}}}
    md = check.markdown(report)
    assert "## broken: failed" in md and "illegal memory access" in md


def test_the_default_sections_fit_the_budget(check):
    """The default check is one call of a short-lived machine: its caps sum to the 520 s budget,
    with the time to stop a section on top of each, and the end-to-end runs (minutes of a tiny
    model, minutes of compiles) are left to be named."""
    assert check.BUDGET_S == 520
    assert check.DEFAULT_SECTIONS == ("learner_torch", "engine_torch", "profile_torch",
                                      "whole_step", "learner_moe")
    assert sum(check.CAPS_S[n] for n in check.DEFAULT_SECTIONS) == check.BUDGET_S
    assert set(check.CAPS_S) == set(check.gpu_sections.SECTIONS)
    assert check.parse_args(["--out=x"]).sections == ""  # no sections named: the defaults


def test_the_moe_row_fits_one_h100(sections, tmp_path):
    """learner_moe's model, Qwen3-VL-30B-A3B's shapes with 3 of its 48 decoder layers, built on
    the meta device from the config the section writes: 3 x 623,120,640 + 1,160,963,312
    parameters, at the one-GPU learner's 20 bytes each (fp32 master, its bf16 copy, fp32
    gradient, AdamW's two moments, the engine's bf16 copy) 56.5 GiB, leaving 21.5 of an H100's
    78 for activations (a fourth layer: 9.9). Its FLOPs count a token's router and top 8
    experts per layer (56,885,248 weights), not all 128 (623 M). A layer count not passed on
    to the config gives 48 layers and 579 GiB."""
    import dataclasses

    shapes, layers = sections.MOE_SHAPES
    s = dataclasses.replace(sections.Settings(str(tmp_path)), shapes=shapes, text_layers=layers)
    cfg = sections.shapes_config(s, tmp_path)
    with torch.device("meta"):
        model = transformers.AutoModelForImageTextToText.from_config(cfg)
    decoder = model.model.language_model.layers
    per_layer = sum(p.numel() for p in decoder[0].parameters())
    total = sum(p.numel() for p in model.parameters())
    assert (shapes, len(decoder), per_layer) == ("qwen3_vl_30b_a3b", 3, 623_120_640)
    assert total == 3 * per_layer + 1_160_963_312
    assert total * 20 / 2 ** 30 == pytest.approx(56.45, abs=0.01)
    assert 78 - (total + per_layer) * 20 / 2 ** 30 == pytest.approx(9.94, abs=0.01)
    assert matmul_params(cfg)["layer"] == 56_885_248


def test_a_hung_section_is_stopped_in_time_with_what_it_started(check, monkeypatch, tmp_path):
    """A section that wrote a row, started a process of its own and then hangs: stopped at its
    timeout (plus at most `STOP_S`), recorded as a timeout with the row it had written, and the
    process it started is gone too (it would hold the GPU through the next sections)."""
    script = tmp_path / "hangs.py"
    script.write_text(
        "import json, subprocess, sys, time\n"
        "out = [a.split('=', 1)[1] for a in sys.argv if a.startswith('--out=')][0]\n"
        "child = subprocess.Popen(['sleep', '120'])\n"
        f"open({str(tmp_path / 'pid')!r}, 'w').write(str(child.pid))\n"
        "open(out + '/sections/hangs.json', 'w').write(json.dumps("
        "{'status': 'running', 'rows': [{'status': 'ok', 'tokens_per_s': 1.0}]}))\n"
        "print('hanging', flush=True)\n"
        "time.sleep(120)\n")
    monkeypatch.setattr(check, "__file__", str(script))
    (tmp_path / "sections").mkdir()
    result = check.run_child("hangs", tmp_path, True, None, 3.0, "CPU")
    assert result["status"] == "timeout" and "hanging" in result["error"]
    assert result["rows"] == [{"status": "ok", "tokens_per_s": 1.0}]
    assert 3.0 <= result["seconds"] < 3.0 + check.STOP_S
    pid = int((tmp_path / "pid").read_text())
    for _ in range(50):  # killed: reaped by init within moments
        if not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text(
                ).split()[2]:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the section's own process {pid} outlived it")


def test_busy_time_merges_overlapping_kernels(profile):
    """Kernels at 0-2, 3-5, 4-6 (overlapping: counted once) and 8-10 cover 7 of the 10 units
    from the first start to the last end; summing their durations would give 8."""
    assert profile.busy_time([(8, 10), (0, 2), (4, 6), (3, 5)]) == pytest.approx(7.0)
    assert profile.busy_time([(0.0, 1.0), (1.0, 4.0), (2.0, 3.0)]) == 4.0
    assert profile.busy_time([]) == 0.0


def test_idle_share_is_of_the_unprofiled_step(profile):
    """The H200 numbers of issue 64: 1,736 ms of kernels in a step that takes 2,170 ms
    unprofiled leave the GPU idle 20%; over the 2,600 ms of a step profiled with shapes it
    would read 33%, the inflated figure."""
    assert profile.idle_share(1736.0, 2170.0) == pytest.approx(0.2)
    assert profile.idle_share(1736.0, 2600.0) == pytest.approx(0.3323, abs=1e-4)


def test_phase_ms_gives_each_interval_to_its_phase(profile):
    """A step of two micro-batches (ms): zero_grad 0-1; forward from 1, the vision tower 2-5,
    the text model 6-16, the head and loss 16-18, backward 18-40; the second micro-batch
    without an image, forward 41-50, head 50-51, backward 51-70; clip and AdamW 70-78; then 2
    ms to the end. Each phase sums its intervals; together they are the step's 80 ms."""
    marks = [("step", 0), ("forward", 1), ("vision", 2), ("vision_end", 5), ("text", 6),
             ("head", 16), ("loss", 18), ("backward", 18), ("backward_end", 40),
             ("forward", 41), ("text", 41), ("head", 50), ("loss", 51), ("backward", 51),
             ("backward_end", 70), ("clip", 70), ("optimizer_end", 78), ("end", 80)]
    got = profile.phase_ms(marks)
    assert got == {"vision": 3, "text": 1 + 1 + 10 + 9, "head": 2 + 1, "backward": 22 + 19,
                   "optimizer": 8, "other": 1 + 1 + 2}
    assert sum(got.values()) == 80
    with pytest.raises(ValueError, match="from 'step' to 'end'"):
        profile.phase_ms(marks[:-1])


def test_step_tokens_counts_a_shared_prompt_once_for_the_learner(sections):
    """A group of two episodes with one 10-token prompt and responses of 3 and 5 tokens. EasyR1
    counts each episode's prompt and response: 13 + 15 = 28. Packed with shared prefixes the
    learner computes the prompt's first 9 tokens once (its last token predicts each response's
    first, so it stays in each sample's own segment) and each sample's 4 and 6 others:
    9 + 4 + 6 = 19. Without sharing the learner computes what EasyR1 counts."""
    from common.batching import TrainSequence, pack

    prompt = np.arange(1, 11)
    seqs = [TrainSequence(np.r_[prompt, 100 + np.arange(n)], np.r_[np.zeros(10), np.ones(n)],
                          np.zeros(10 + n), 1.0, [], k) for k, n in enumerate((3, 5))]
    shared = pack(seqs, 64, image_token_id=999)
    assert sections.step_tokens(seqs, shared) == {"computed_tokens": 19.0,
                                                  "easyr1_tokens": 28.0}
    assert sections.step_tokens(seqs, pack(seqs, 64)) == {"computed_tokens": 28.0,
                                                          "easyr1_tokens": 28.0}


def test_the_learner_plan_runs_the_recipe_first_and_compiles_last(sections, tmp_path):
    """The GPU plan: the recipe, the fused head, then compiled (with the fused head), each at
    the largest micro-batch. The rehearsal also runs the other checkpointing modes and the
    other kernel, before the compiled row: compiling cannot be undone."""
    gpu = sections.Settings(str(tmp_path))
    assert sections.learner_plan(gpu) == [
        ("recipe", {"micro_batch_tokens": 32768}),
        ("fused_head", {"micro_batch_tokens": 32768, "fused_head": True}),
        ("compiled", {"micro_batch_tokens": 32768, "fused_head": True, "compile": True}),
        ("fsdp", {"micro_batch_tokens": 32768, "fsdp": "always"})]
    tiny = sections.learner_plan(sections.Settings.tiny_settings(str(tmp_path), None))
    assert [label for label, _ in tiny] == ["recipe", "fused_head", "full", "selective",
                                            "varlen", "compiled", "fsdp"]
    assert all(o["activation_checkpointing"] == "none" for label, o in tiny
               if label not in ("full", "selective"))
    assert tiny[-2][1]["compile"] and not any(o.get("compile") for _, o in tiny[:-2])


def test_the_report_names_the_planned_rows_left_out(check):
    """A learner section cut after its fused-head row: the compiled row is named as left out."""
    rows = [{"status": "ok", "framework": "torch", "config": c, "kernel": "varlen",
             "micro_batches": 2, "tokens": 1.0, "seconds": 1.0} for c in ("recipe", "fused_head")]
    report = {"device": "GPU", "tiny": False, "peak_tflops": None, "shapes": "qwen3_vl_2b",
              "date": "now", "versions": {}, "seconds": 1.0, "failed": ["learner_torch"],
              "sections": {"learner_torch": {"status": "timeout", "rows": rows, "seconds": 180.0,
                                             "planned": ["recipe", "fused_head", "compiled"]}}}
    assert "Left out (no time, or failed before its first row): compiled." in \
        check.markdown(report)


def test_top_ops_adds_up_each_name(profile):
    """mm called twice (3 + 5 ms) over 2 steps of 20 ms in all: 8 ms total, 4 a step, 40%."""
    rows = profile.top_ops([("mm", 3.0), ("add", 1.0), ("mm", 5.0), ("copy", 0.0)], 20.0, 2, n=2)
    assert rows == [{"op": "mm", "calls": 2, "total_ms": 8.0, "ms_per_step": 4.0, "share": 0.4},
                    {"op": "add", "calls": 1, "total_ms": 1.0, "ms_per_step": 0.5,
                     "share": 0.05}]


def test_profile_events_reads_kernels_on_a_gpu_and_ops_on_a_cpu(profile):
    """A GPU profile's time is its kernels' (20 and 5 µs, at 10-30 and 40-45: idle 10 of the 35
    from first to last), not the 50 µs of the CPU op that launched them; a CPU profile's is the
    ops' own time. The host's waits are its CPU-side synchronize calls (15 µs), not its launches
    nor anything on the device. (The GPU path runs only on a lent machine: here its events are
    built.)"""
    from types import SimpleNamespace

    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    events = [FunctionEvent(0, "aten::mm", 1, 0.0, 50.0)] + [
        FunctionEvent(k, "gemm", 7, start, end, device_type=DeviceType.CUDA, use_device="cuda")
        for k, (start, end) in enumerate([(10.0, 30.0), (40.0, 45.0)], 1)]
    prof = SimpleNamespace(events=lambda: events)
    timed, intervals = profile.profile_events(prof, cuda=True)
    assert timed == [("gemm", pytest.approx(0.02)), ("gemm", pytest.approx(0.005))]
    assert intervals == [(10.0, 30.0), (40.0, 45.0)]
    assert profile.busy_time(intervals) == pytest.approx(25.0)
    assert profile.profile_events(prof, cuda=False) == ([("aten::mm", pytest.approx(0.05))], [])
    waits = events + [FunctionEvent(9, "cudaStreamSynchronize", 1, 60.0, 75.0),
                      FunctionEvent(10, "cudaLaunchKernel", 1, 5.0, 9.0),
                      FunctionEvent(11, "cudaStreamSynchronize", 7, 0.0, 40.0,
                                    device_type=DeviceType.CUDA, use_device="cuda")]
    assert profile.host_wait_ms(SimpleNamespace(events=lambda: waits)) == pytest.approx(0.015)


def test_fit_step_cost_recovers_the_costs(profile):
    """Steps of 0.5 s + 0.25 s a micro-batch + 1 ms a token, at 2 and 4 micro-batches of 500 and
    1,000 tokens: the fit gives back a, b and c exactly."""
    mb, tokens = [2, 4, 2, 4], [1000, 2000, 2000, 4000]
    seconds = [0.5 + 0.25 * m + 0.001 * t for m, t in zip(mb, tokens)]
    assert profile.fit_step_cost(mb, tokens, seconds) == pytest.approx(
        {"a": 0.5, "b": 0.25, "c": 0.001})
    # the same tokens per micro-batch in every row: b and c cannot be told apart, so the
    # simpler fit, seconds = 0.5 + 2 ms x tokens
    assert profile.fit_step_cost([1, 2, 3], [100, 200, 300], [0.7, 0.9, 1.1]) == pytest.approx(
        {"a": 0.5, "c": 0.002})
    assert profile.fit_step_cost([2, 4, 2], [1000, 2000, 1000], [1.0, 2.0, 1.1]) is None


def test_host_syncs_counts_what_a_gpu_would_wait_for(profile):
    """Inside the block: .item() and float() (reads), a boolean-mask index and torch.nonzero
    (sizes known only from the data) count, each at its own line; a read outside the block,
    a read from another thread and plain tensor ops do not. After the block Tensor has its own
    methods back and no dispatch mode is left on."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    x = torch.arange(3.0)
    x[0].item()
    with profile.host_syncs(cuda=False) as syncs:
        x.sum().item()
        y = x * 2 + x[1:2]
        float(y[1])
        x[x > 0].sum()
        torch.nonzero(y)
        other = threading.Thread(target=lambda: x[0].item())
        other.start()
        other.join()
    x[0].item()
    assert syncs.n == 4
    here = Path(__file__).name
    lines = sorted(int(site.split(":")[1].split()[0]) for site in syncs.sites)
    assert all(here in site for site in syncs.sites) and len(lines) == 4
    assert lines[1] - lines[0] == 2 and lines[3] - lines[2] == 1
    assert not set(profile.READS) & set(torch.Tensor.__dict__)
    assert _get_current_dispatch_mode() is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's sync debug mode is CUDA's")
def test_host_syncs_on_cuda_counts_torchs_own_and_names_each_op(profile):
    """On a GPU the count is torch's own. .item(), a boolean-mask index, torch.tensor(list,
    device=cuda) and a pageable .to(cuda) each wait and each is sited at its line with its aten
    op; a pinned non-blocking copy and plain arithmetic wait for nothing. A backward's
    boolean-mask index_put is sited too (its warning is replayed at backward())."""
    x = torch.arange(4.0, device="cuda")
    here = Path(__file__).name
    waits = {"_local_scalar_dense.default": lambda: x.sum().item(),
             "index.Tensor": lambda: x[x > 0],
             "lift_fresh.default": lambda: torch.tensor([1, 2, 3], device="cuda"),
             "_to_copy.default": lambda: torch.ones(3).to("cuda")}
    for op, work in waits.items():
        with profile.host_syncs(cuda=True) as syncs:
            work()
        assert syncs.n >= 1, op
        assert {site.rsplit("[", 1)[1].rstrip("]") for site in syncs.sites} == {op}
        assert all(here in site for site in syncs.sites)
    with profile.host_syncs(cuda=True) as syncs:
        torch.ones(3).pin_memory().to("cuda", non_blocking=True)
        (x * 2 + 1).exp()
    assert syncs.n == 0 and not syncs.sites
    w = torch.ones(4, device="cuda", requires_grad=True)
    with profile.host_syncs(cuda=True) as syncs:
        (w[x > 0] * 3).sum().backward()
    assert syncs.n >= 2 and any("index_put" in site for site in syncs.sites), syncs


def test_the_report_fits_the_learner_rows(check):
    """Four ok rows of one kernel get a fit line under their table (the rows of
    test_fit_step_cost_recovers_the_costs: 0.25 s a micro-batch, 1 s per thousand tokens); a
    kernel with two rows gets none."""
    rows = [{"status": "ok", "framework": "torch", "kernel": "varlen", "micro_batches": m,
             "tokens": float(t), "seconds": 0.5 + 0.25 * m + 0.001 * t}
            for m, t in zip([2, 4, 2, 4], [1000, 2000, 2000, 4000])]
    rows += [{"status": "ok", "framework": "torch", "kernel": "packed_sdpa", "micro_batches": m,
              "tokens": 1.0, "seconds": 1.0} for m in (2, 4)]
    report = {"device": "CPU", "tiny": True, "peak_tflops": None, "shapes": "qwen3_vl_2b",
              "date": "now", "versions": {}, "seconds": 1.0, "failed": [],
              "sections": {"learner_torch": {"status": "ok", "rows": rows, "seconds": 1.0}}}
    md = check.markdown(report)
    assert ("Fit, varlen (4 rows, least squares): step seconds = 0.5 + 0.25 x micro-batches "
            "+ 1 x thousand tokens.") in md
    assert "Fit, packed_sdpa" not in md


def test_peak_from_the_device_name(check):
    assert check.peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert check.peak_tflops("NVIDIA H200") == 989.0
    assert check.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert check.peak_tflops("CPU") is None


MEASURED = ("tokens_per_s", "seconds", "tflops_per_s", "mfu", "peak_memory_gb", "wall_s",
            "time_rollout", "time_train", "first_step_s", "first_call_s", "tokens",
            "step_ms", "profiled_step_ms", "kernel_ms_per_step", "total_ms", "ms_per_step",
            "share", "step_s", "rollout_s", "train_s", "sync_s", "computed_tokens",
            "easyr1_tokens", "computed_tokens_per_gpu_s", "easyr1_tokens_per_gpu_s",
            "rollout_tokens_per_s")


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
                                        "profile_torch", "whole_step", "learner_moe",
                                        "learner_jax", "e2e_jax", "engine_jax"]
    rows = {n: [r for r in s["rows"] if r["status"] == "ok"]
            for n, s in report["sections"].items()}
    for name in ("e2e_torch", "e2e_jax"):
        (row,) = rows[name]
        assert row["steps"] == 2 and 0 <= row["reward_mean"] <= 1
        assert 0 <= row["tool_call_rate"] <= 1
    # torch: the recipe on the CPU (no checkpointing), the fused head, the other two modes,
    # then compiled with the fused head (the other kernel, varlen, is skipped on a CPU), then
    # built anew with train.fsdp=always (on one CPU process still plain: the rebuild is run)
    assert [(r["config"], r["activation_checkpointing"], r["fused_head"], r["compile"],
             r["micro_batches"]) for r in rows["learner_torch"]] == [
        (c, m, f, k, n) for c, m, f, k in [("recipe", "none", False, False),
                                           ("fused_head", "none", True, False),
                                           ("full", "full", False, False),
                                           ("selective", "selective", False, False),
                                           ("compiled", "none", True, True),
                                           ("fsdp", "none", False, False)] for n in (2, 4)]
    (skipped,) = [r for r in report["sections"]["learner_torch"]["rows"] if r["status"] != "ok"]
    assert skipped["status"] == "skipped" and skipped["config"] == "varlen"
    assert report["sections"]["learner_torch"]["planned"] == [
        "recipe", "fused_head", "full", "selective", "varlen", "compiled", "fsdp"]
    # the MoE row: the tiny MoE (geo3k_torch.tiny: 2 layers of 4 experts, top 2) as the recipe
    # trains it on a CPU, its experts through torch's grouped matmul, MFU on active weights
    assert [(r["config"], r["shapes"], r["layers"], r["experts"], r["top_k"],
             r["experts_kernel"], r["activation_checkpointing"], r["micro_batches"])
            for r in rows["learner_moe"]] == [
        ("moe, MFU on active weights", "qwen3_vl_30b_a3b (tiny)", 2, 4, 2, "grouped_mm", "none",
         n) for n in (2, 4)]
    for name in ("learner_torch", "learner_moe", "learner_jax"):
        assert {(r["micro_batch_tokens"], r["micro_batches"]) for r in rows[name]} == {
            (256, 2), (256, 4)}
        for r in rows[name]:
            assert r["tflops_per_s"] == pytest.approx(r["mfu"])  # --peak_tflops=1
            assert math.isfinite(r["loss"])
        assert rows[name][1]["tokens"] > rows[name][0]["tokens"]
    assert {r["kernel"] for n in ("e2e_torch", "learner_torch", "profile_torch", "whole_step",
                                  "learner_moe")
            for r in rows[n] if r.get("phase") != "engine"} == {"packed_sdpa"}  # a CPU
    assert rows["engine_torch"][0]["kernel"] == rows["whole_step"][0]["engine_kernel"] == "sdpa"
    summaries = {r["phase"]: r for r in rows["profile_torch"] if "op" not in r}
    learner = summaries["learner"]
    assert learner["host_syncs_per_step"] > 0  # the step reads its metrics once
    assert learner["gpu_idle"] == summaries["engine"]["gpu_idle"] == "n/a"
    assert learner["host_wait_ms_per_step"] == "n/a"
    assert learner["kernels_per_step"] > 0 and summaries["engine"]["kernels_per_step"] > 0
    # the unprofiled step by phase: every phase, none negative, the named ones within the step
    split = {k: learner[f"{k}_ms"] for k in ("vision", "text", "head", "backward", "optimizer",
                                             "other")}
    assert all(v >= 0 for v in split.values()) and split["vision"] > 0, split
    assert sum(split.values()) - split["other"] <= learner["step_ms"]
    assert sum(split.values()) == pytest.approx(learner["step_ms"])
    for phase, table in (("learner", "ops"), ("learner", "ops by shape"), ("engine", "ops")):
        ops = [r for r in rows["profile_torch"] if r["phase"] == phase and r.get("table") == table]
        assert 0 < len(ops) <= 10 and sum(r["share"] for r in ops) <= 1, (phase, table)
    assert all("[" in r["op"] for r in rows["profile_torch"] if r.get("table") == "ops by shape")
    profiled = json.loads((tmp_path / "profile_torch.json").read_text())
    assert [len(profiled["phases"][p]["top"]) for p in ("learner", "engine")] == [25, 25]
    assert len(profiled["phases"]["learner"]["top_shapes"]) == 25
    sites = profiled["phases"]["learner"]["sync_sites"]
    assert 0 < sum(x["count"] for x in sites) <= summaries["learner"]["host_syncs_per_step"]
    assert any("train_step" in x["site"] for x in sites)  # the step's one read of its metrics
    assert not any("vision" in x["site"] or "get_image_features" in x["site"] for x in sites)
    md = (tmp_path / "profile_torch.md").read_text()
    assert "## learner:" in md and "Where the learner's host syncs" in md
    assert "Milliseconds a step by phase" in md and "ops by input shapes" in md
    (step,) = rows["whole_step"]
    assert step["episodes"] == 8 and step["steps"] == 1 and step["turns_mean"] >= 1
    # EasyR1 counts each group's prompt once per episode, the learner once per group
    assert step["easyr1_tokens"] > step["computed_tokens"] > step["generated_tokens"] > 0
    assert step["step_s"] >= step["rollout_s"] + step["train_s"] + step["sync_s"]
    # the torch engine at its episodes, then at more: the slots it holds
    assert [r["tokens"] for r in rows["engine_torch"] + rows["engine_jax"]] == [64, 128, 64]
    for row in rows["engine_torch"] + rows["engine_jax"]:
        assert row["tokens"] == row["episodes"] * row["new_tokens"]
    for name, rs in rows.items():
        numbers = [(k, v) for r in rs for k, v in r.items() if k in MEASURED]
        assert numbers, name
        assert all(math.isfinite(v) and v > 0 for _, v in numbers), (name, numbers)
    md = (tmp_path / "gpu_check.md").read_text()
    assert "## learner_jax: ok" in md and "| tokens_per_s" not in md.split("\n")[0]


@pytest.mark.parametrize("fused, chunk", [(False, 0), (False, 7), (True, 7)],
                         ids=["plain head", "chunked head", "fused head"])
def test_step_phases_time_a_tiny_learner_step(profile, fused, chunk):
    """Two steps of a tiny Qwen3-VL learner (two micro-batches, images) timed from outside by
    `step_phases`: every mark is made (the vision tower's and the text model's forward twice a
    micro-batch with an image, a backward per micro-batch, one clip and one optimizer step a
    step), every phase is there and non-negative, the vision tower and backward take time, the
    phases sum to at most the step's wall time, whatever head the learner swaps in. Afterwards
    no hook, wrapper or patch is left."""
    from common.batching import pack
    from common.grpo import LossConfig
    from geo3k_torch import attention
    from geo3k_torch.learner import Learner
    from geo3k_torch.model import use_deepstack_add
    from tests.jax_learner_setup import train_config
    from tests.test_shared_prefix import groups
    from tests.tiny_models import IMG, ImageOnlyProcessor, qwen3_vl

    model, patch = qwen3_vl()
    model.set_attn_implementation(attention.NAME)
    use_deepstack_add(model)
    processor = ImageOnlyProcessor(patch)
    learner = Learner(model.train(), processor, LossConfig(), train_config(), 1.0, chunk=chunk,
                      fused_head=fused)
    rng = np.random.default_rng(0)
    seqs = groups(processor, rng)
    for s in seqs:
        s.advantages = rng.normal(size=len(s)).astype(np.float32) * s.loss_mask
    batches = pack(seqs, max(map(len, seqs)) + 40, image_token_id=IMG)
    assert len(batches) >= 2
    counts = float(sum(s.loss_mask.sum() for s in seqs)), float(len(seqs))
    backward, clip = torch.Tensor.backward, torch.nn.utils.clip_grad_norm_
    walls = []
    with profile.step_phases(learner, cuda=False) as clock:
        for _ in range(2):
            start = time.perf_counter()
            clock.mark("step")
            learner.train_step(batches, *counts)
            clock.mark("end")
            walls.append((time.perf_counter() - start) * 1e3)
    steps = clock.read()
    assert len(steps) == 2
    with_images = sum(1 for b in batches if b.images)
    for marks, wall in zip(steps, walls):
        names = [n for n, _ in marks]
        assert names.count("forward") == names.count("head") == len(batches)
        assert names.count("vision") == names.count("vision_end") == with_images
        assert names.count("backward") == names.count("backward_end") == len(batches)
        assert names.count("clip") == names.count("optimizer_end") == 1
        assert [ms for _, ms in marks] == sorted(ms for _, ms in marks)
        phases = profile.phase_ms(marks)
        assert list(phases) == list(profile.PHASES)
        assert all(v >= 0 for v in phases.values()), phases
        assert phases["vision"] > 0 and phases["backward"] > 0 and phases["head"] > 0
        assert sum(phases.values()) <= wall
    assert torch.Tensor.backward is backward and torch.nn.utils.clip_grad_norm_ is clip
    assert "micro_batch_loss" not in vars(learner)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert not learner.optimizer._optimizer_step_post_hooks
