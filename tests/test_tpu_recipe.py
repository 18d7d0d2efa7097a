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
    # a random tiny model never solves a problem: a reward that tells its episodes apart gives
    # every step advantages, a loss and a gradient to compare
    cfg.reward.fn = "tests.test_tpu_recipe:length_reward"
    cfg.advantage.filter_equal_groups = False
    return cfg


def length_reward(texts, infos, answer, cfg, choices, env_cfg):
    """The episode's text length modulo 5, over 4: varies between the samples of a group."""
    return (sum(len(t) for t in texts) % 5) / 4


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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _workers(out: Path, world: int, devices: int, dtype: str = "bfloat16") -> None:
    """tests/jax_loop_worker.py's `tpu` run in `world` processes of `devices` CPU devices, in
    `dtype` compute."""
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    procs = [subprocess.Popen([sys.executable, "-m", "tests.jax_loop_worker", str(i), str(port),
                               str(out), "tpu", str(world), dtype], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(world)]
    logs = [p.communicate(timeout=900)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)


def _rollouts(run: Path, step: int) -> list[dict]:
    """Step `step`'s episodes, every process's dump, by group and sample."""
    rows = [json.loads(x) for f in sorted((run / "rollouts").glob(f"step_{step}*.jsonl"))
            for x in f.read_text().splitlines()]
    return sorted(rows, key=lambda r: (r["group_id"], r["sample_idx"]))


@pytest.mark.heavy
def test_two_processes_run_the_recipe_structure(tmp_path):
    """configs/tpu.py:cpu on 2 CPU processes (gloo), one device each: both processes roll out
    with their own JAX engine and the learner trains on parameters split over both, in bf16
    compute; the checkpoint's export is two bf16 shards, one per process, with their index."""
    from safetensors.numpy import load_file

    _workers(tmp_path, world=2, devices=1)
    run = tmp_path / "run"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for r in rows[1:]:
        assert r["train/trajectories"] == 6  # 2 prompts x 3 samples, one prompt a process
        assert r["train/engine_compiles"] > 0 and r["train/grad_norm"] > 0
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


@pytest.mark.heavy
def test_two_processes_run_the_recipe_as_one_does(tmp_path):
    """The recipe's structure on 2 processes of one device and on 1 process of 2 devices draws
    the same prompts, samples the same episodes and takes the same steps: the run does not
    depend on how many processes run it. In fp32 compute: in bf16 the two layouts' different
    reduction orders move log-probs by ~1e-2, enough to flip a near tie between two sampled
    tokens, and from there the episodes, and the steps, differ (seen in about 1 run of 3)."""
    _workers(tmp_path, world=2, devices=1, dtype="float32")
    _workers(tmp_path, world=1, devices=2, dtype="float32")  # the shared model and data are built
    run, one = tmp_path / "run-float32", tmp_path / "run1-float32"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    ones = [json.loads(x) for x in (one / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [r["step"] for r in ones] == [0, 1, 2, 3]
    for step in (1, 2, 3):
        a, b = _rollouts(run, step), _rollouts(one, step)
        assert len(a) == 6
        assert [(r["uid"], r["group_id"], r["sample_idx"]) for r in a] == [
            (r["uid"], r["group_id"], r["sample_idx"]) for r in b], step
        for x, y in zip(a, b):
            assert x["token_ids"] == y["token_ids"], (step, x["group_id"], x["sample_idx"])
            np.testing.assert_allclose(x["rollout_logprobs"], y["rollout_logprobs"], atol=1e-4)
    for two_row, one_row in zip(rows, ones):
        for key in ("train/reward_mean", "eval/greedy_accuracy", "train/response_len_mean"):
            if key in one_row:
                assert two_row[key] == one_row[key], (one_row["step"], key)
        for key in ("train/loss", "train/grad_norm", "train/entropy"):
            if key in one_row:
                assert two_row[key] == pytest.approx(one_row[key], rel=1e-4, abs=1e-6), (
                    one_row["step"], key)
