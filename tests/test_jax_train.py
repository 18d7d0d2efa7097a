"""The JAX learner through the shared loop (`python -m geo3k_jax.train`): the workdir, an HF
export that transformers reads as the JAX model, exact resume, the JAX engine without a torch
model, and a bounded number of compiles (one run checks them all: a run compiles for a minute)."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from common import checkpoints
from common import train as loop
from tests.test_train_loop import assert_same_metrics, crash_after_checkpoint, small_config

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    return tmp_path_factory.mktemp("shared")


def jax_config(shared, steps):
    cfg = small_config(shared, steps)
    cfg.jax.compilation_cache_dir = ""
    cfg.train.micro_batch_tokens = 512  # rows of 512 tokens
    return cfg


def run(cfg, workdir):
    """(last metrics, the run's pieces) of a JAX training run."""
    from geo3k_jax.train import build
    pieces = build(cfg, str(workdir))
    return loop.train(cfg, str(workdir), pieces), pieces


@pytest.mark.slow
def test_jax_run_layout_export_and_exact_resume(shared, tmp_path, monkeypatch):
    """Also: with the default `engine.backend=local` the JAX trainer samples with the JAX
    engine: no torch module is constructed once the tiny checkpoint exists (a reloading torch
    engine would build one at once), and the engine's compilations, logged every step, stop
    growing once the run's shape buckets are met (a shape that followed the data would compile
    at every step: prompt lengths, image sizes and response lengths all vary)."""
    from transformers import AutoModelForImageTextToText

    from common.processor import load_processor
    from geo3k_jax.engine.backend import JaxBackend
    from geo3k_jax.core.batch import device_batch
    from geo3k_jax.check.check_batch import check_batches
    from geo3k_torch.model import packed_inputs
    from geo3k_torch.prepare import prepare_model_dir

    full = tmp_path / "full"
    cfg = jax_config(shared, 3)
    prepare_model_dir(cfg)  # setup, not training: the tiny checkpoint is built with torch once

    def no_torch_model(self, *args, **kwargs):
        raise AssertionError(f"a torch {type(self).__name__} was built during JAX training")

    with monkeypatch.context() as m:
        m.setattr(torch.nn.Module, "__init__", no_torch_model)
        last, pieces = run(cfg, full)
    assert isinstance(pieces.backend, JaxBackend)
    rows = [json.loads(x) for x in (full / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # step 0: the evaluation before training
    compiles = [r["train/engine_compiles"] for r in rows[1:]]
    assert compiles == sorted(compiles) and 2 <= compiles[-1] <= 12, compiles
    assert "eval/greedy_accuracy" in rows[0] and "eval/greedy_accuracy" in rows[2]
    assert (full / "curve.png").stat().st_size > 1000 and list(full.glob("events.out.*"))
    assert len((full / "rollouts" / "step_1.jsonl").read_text().splitlines()) == 6
    # every 2 steps, and the last
    assert sorted(p.name for p in (full / "checkpoints").iterdir()) == ["step_2", "step_3"]
    assert (full / "checkpoints" / "step_3" / "jax_state").is_dir()
    # one shape bucket covers the run: compiled once, then reused
    assert [r["train/compiles"] for r in rows if "train/compiles" in r][-1] <= 2
    w0 = load_file(str(shared / "tiny" / "model.safetensors"))
    w3 = load_file(str(full / "checkpoints" / "step_3" / "model.safetensors"))
    assert max(float(np.abs(w3[k] - w0[k]).max()) for k in w3) > 1e-4  # it trained

    # the final export, read by transformers, is the learner's model
    ckpt = full / "checkpoints" / "step_3"
    processor = load_processor(ckpt)
    hf = AutoModelForImageTextToText.from_pretrained(ckpt).eval()
    batches, n_tokens, n_seqs = check_batches(processor, prompts=2, samples=1, images=[1, 2],
                                              image_sizes=(40, 120), micro_batch_tokens=0,
                                              seed=3)
    batch = device_batch(batches, processor, hf.config, agg="token-mean", n_tokens=n_tokens,
                         n_seqs=n_seqs)
    learner = pieces.learner
    model = learner.merge(learner.params)
    logits = np.asarray(jax.jit(lambda b: model.logits(model.hidden_states(b)))(batch))
    for r, b in enumerate(batches):
        with torch.no_grad():
            ref = hf(**packed_inputs(b, processor, hf.config), use_cache=False).logits[0]
        ref = ref.numpy()
        assert np.abs(logits[r, :b.num_tokens] - ref).max() <= 1e-5 * np.abs(ref).max()

    # the run interrupted right after its step-2 checkpoint, then resumed, in a bucket
    # (`--workdir=gs://...`, against a GCS server on localhost): the same metrics and weights
    from common import storage
    from common.cli import run_in
    from tests.fake_gcs import fake_gcs

    def train(cfg, local):
        return run(cfg, local)[0]

    with fake_gcs() as bucket:
        url = f"gs://{bucket}/part"
        with crash_after_checkpoint(2, monkeypatch), pytest.raises(KeyboardInterrupt):
            run_in(url, jax_config(shared, 3), train, report=False)
        cfg = jax_config(shared, 3)
        cfg.train.resume = True
        run_in(url, cfg, train, report=True)
        part = tmp_path / "part"
        for name in ("metrics.jsonl", "curve.png", "eval/eval.md", "rollouts/step_3.jsonl",
                     "checkpoints/step_3/model.safetensors"):
            (part / name).parent.mkdir(parents=True, exist_ok=True)
            (part / name).write_bytes(storage.path(f"{url}/{name}").read_bytes())
        assert_same_metrics(rows, part)
        assert checkpoints.latest(f"{url}/checkpoints").name == "step_3"
    w_part = load_file(str(part / "checkpoints" / "step_3" / "model.safetensors"))
    assert max(float(np.abs(w3[k] - w_part[k]).max()) for k in w3) == 0.0
    assert not (tmp_path / "gs:").exists()


@pytest.mark.heavy
def test_two_processes_train_through_the_loop(tmp_path):
    """The multi-host path end to end on 2 CPU processes (tests/jax_loop_worker.py): each takes
    its part of every step's prompts from one shared order, rolls out with its own JAX engine, and the learner
    trains on parameters split over both; the run log counts both processes' episodes, each
    process dumps its own, and a checkpoint holds each process's data order."""
    import os
    import socket
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(root), JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen([sys.executable, "-m", "tests.jax_loop_worker", str(i), str(port),
                               str(tmp_path)], cwd=root, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    logs = [p.communicate(timeout=900)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), logs[0][-3000:] + logs[1][-3000:]
    run = tmp_path / "run"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # step 0: the evaluation before training
    rows = rows[1:]
    assert all(r["train/trajectories"] == 6 for r in rows)  # 2 prompts x 3 samples, 1 each
    assert rows[-1]["eval/greedy_trajectories"] == 3  # 2 + 1 evaluation prompts
    assert "train/loss" in rows[-1] and np.isfinite(rows[-1]["train/loss"])
    for k in (0, 1):
        assert len((run / "rollouts" / f"step_3.process_{k}.jsonl").read_text().splitlines()) == 3
    state = json.loads((run / "checkpoints" / "step_3" / "loop_state.json").read_text())
    assert [s["rank"] for s in state["sampler"]] == [0, 1]
    assert [s["n"] for s in state["sampler"]] == [16, 16]  # one order over the 16 training rows
    assert len({(s["epoch"], s["position"]) for s in state["sampler"]}) == 1


@pytest.mark.slow
def test_grpo_steps_through_the_loop_train_the_moe_model(tmp_path):
    """The JAX learner and engine on a tiny Qwen3-VL-MoE (4 experts, 2 a token, every decoder
    layer sparse): two GRPO steps of the shared loop with finite losses, and a checkpoint
    transformers loads as Qwen3-VL-MoE whose experts and routers moved."""
    from transformers import Qwen3VLMoeForConditionalGeneration

    cfg = jax_config(tmp_path, 2)
    cfg.model.tiny_arch, cfg.model.tiny_dir = "qwen3_vl_moe", str(tmp_path / "tiny_moe")
    run(cfg, tmp_path / "run")
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in trained] == [1, 2]
    assert all(np.isfinite(r["train/loss"]) and np.isfinite(r["train/grad_norm"])
               for r in trained)
    # every reward is 0 (small_config): step 1's policy is its reference, its gradient exactly
    # 0; step 2's KL term to the reference has one once weight decay has moved the policy
    assert trained[-1]["train/grad_norm"] > 0
    ckpt = checkpoints.latest(tmp_path / "run" / "checkpoints")
    assert Qwen3VLMoeForConditionalGeneration.from_pretrained(ckpt).config.model_type == \
        "qwen3_vl_moe"
    before = load_file(str(tmp_path / "tiny_moe" / "model.safetensors"))
    after = load_file(str(ckpt / "model.safetensors"))
    assert before.keys() == after.keys()
    assert all(after[k].shape == v.shape for k, v in before.items())  # transformers' layout
    moved = [k for k in before if not np.array_equal(before[k], after[k])]
    assert any(".experts." in k for k in moved) and any("mlp.gate." in k for k in moved)


@pytest.mark.slow
def test_routing_replay_through_the_loop_on_the_moe_model(tmp_path):
    """`loss.routing_replay` on the tiny Qwen3-VL-MoE: the JAX engine records its routing, the
    rollout carries it into the packed batches and the learner replays it for two GRPO steps
    (the second after a weight sync), reporting the replayed and free-routing mismatches. The
    engine and the learner hold the same fp32 weights: replayed, their log-probs agree to
    float32 rounding (a row of routing off by one token would move them by 1e-3 or more)."""
    cfg = jax_config(tmp_path, 2)
    cfg.model.tiny_arch, cfg.model.tiny_dir = "qwen3_vl_moe", str(tmp_path / "tiny_moe")
    cfg.loss.routing_replay = True
    run(cfg, tmp_path / "run")
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in trained] == [1, 2]
    # step 1: zero advantages (a random model scores 0) and the policy still the KL reference
    assert trained[1]["train/grad_norm"] > 0, trained
    for r in trained:
        assert np.isfinite(r["train/loss"]) and 0.0 <= r["train/routing_replay_mismatch"] <= 1.0
        assert r["train/logp_diff_max"] <= 1e-4 and np.isfinite(r["train/logp_diff_max_free"])
        assert r["train/logp_diff_mean_free"] >= 0.0, r
    print({k: [r[k] for r in trained] for k in ("train/logp_diff_max",
          "train/logp_diff_max_free", "train/routing_replay_mismatch", "train/grad_norm")})
