"""configs/tpu.py: rollouts from the JAX engine on the slice's own chips, and its structure
(`:cpu`) trained on 2 CPU processes, each sampling with its own engine, the export written a
shard per process in bf16."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from configs import h100, tpu

ROOT = Path(__file__).resolve().parent.parent


def recipe_config(shared: Path):
    """configs/tpu.py:cpu on the tests' small synthetic set and an unprimed tiny model."""
    cfg = tpu.get_config("cpu")
    cfg.model.tiny_dir = str(shared / "tiny")
    cfg.model.tiny_prime_steps = 0
    cfg.data.synthetic_dir = str(shared / "data")
    cfg.data.synthetic_train_size, cfg.data.synthetic_test_size = 16, 4
    cfg.jax.compilation_cache_dir = ""
    # a random tiny model scores 0 everywhere: keep every group so that every step updates
    cfg.advantage.filter_equal_groups = False
    return cfg


def test_recipe_rolls_out_on_the_slice_with_the_jax_engine():
    cfg = tpu.get_config()
    assert cfg.engine.backend == "local" and h100.get_config().engine.backend == "sglang"
    assert (cfg.jax.platform, cfg.jax.distributed, cfg.jax.compute_dtype, cfg.jax.remat) == (
        "tpu", True, "bfloat16", True)
    assert cfg.engine.slots == 128 and cfg.loss.tis_cap == 2.0


def test_cpu_argument_keeps_the_structure_on_the_tiny_model():
    cfg = tpu.get_config("cpu")
    assert cfg.engine.backend == "local" and cfg.model.path == "" and cfg.data.path == ""
    assert (cfg.jax.platform, cfg.jax.distributed, cfg.jax.compute_dtype, cfg.jax.remat) == (
        "", False, "bfloat16", True)
    assert cfg.jax.slice.targets == cfg.train.micro_batch_tokens  # one slice shape, resized
    assert cfg.jax.slice.window == cfg.rollout.max_context_tokens + 128
    assert cfg.jax.slice.prefix_window <= cfg.train.micro_batch_tokens
    with pytest.raises(ValueError, match="takes no argument or 'cpu'"):
        tpu.get_config("gpu")


@pytest.mark.heavy
def test_two_processes_run_the_recipe_structure(tmp_path):
    """configs/tpu.py:cpu on 2 CPU processes (gloo), one device each: both processes roll out
    with their own JAX engine and the learner trains on parameters split over both, in bf16
    compute; the checkpoint's export is two bf16 shards, one per process, with their index."""
    from safetensors.numpy import load_file

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen([sys.executable, "-m", "tests.jax_loop_worker", str(i), str(port),
                               str(tmp_path), "tpu"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    logs = [p.communicate(timeout=900)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), logs[0][-3000:] + logs[1][-3000:]
    run = tmp_path / "run"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for r in rows[1:]:
        assert r["train/trajectories"] == 6  # 2 prompts x 3 samples, one prompt a process
        assert r["train/engine_compiles"] > 0 and np.isfinite(r["train/loss"])
    assert rows[-1]["eval/greedy_trajectories"] == 3
    for k in (0, 1):  # each process sampled its own episodes with its own engine
        dump = (run / "rollouts" / f"step_3.process_{k}.jsonl").read_text().splitlines()
        assert len(dump) == 3
    export = run / "checkpoints" / "step_3"
    index = json.loads((export / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    shards = [load_file(str(export / f)) for f in files]
    assert all(str(v.dtype) == "bfloat16" for s in shards for v in s.values())
    assert json.loads((export / "config.json").read_text())["dtype"] == "bfloat16"
