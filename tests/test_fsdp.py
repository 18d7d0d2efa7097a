"""FSDP2 on CPU (gloo): a 2-process learner step equals the 1-process step on the same batch."""

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(tmp_path, nproc, arch, agg, layout="strided"):
    out = tmp_path / f"{arch}-{agg}-{nproc}-{layout}.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1",
               PYTHONFAULTHANDLER="1")  # an abort prints every thread's Python stack
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}",
           str(ROOT / "tests" / "fsdp_worker.py"), str(out), arch, agg, layout]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return json.loads(out.read_text())


# FSDP2's collectives are the same for both dense architectures: Qwen2.5-VL and
# seq-mean-token-mean here, Qwen3-VL and token-mean on two processes in the empty-rank test
# below. Qwen3-VL-MoE shards its experts' 3-D tensors and adds the load-balancing loss, its
# routing metrics summed over ranks.
@pytest.mark.slow
@pytest.mark.parametrize("arch,agg", [("qwen2_5_vl", "seq-mean-token-mean"),
                                      ("qwen3_vl_moe", "token-mean")])
def test_two_processes_equal_one(tmp_path, arch, agg):
    one = run(tmp_path, 1, arch, agg)
    two = run(tmp_path, 2, arch, agg)
    assert one["micro_batches"] >= 2  # accumulation inside a rank is exercised as well
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-7)
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    assert two["checksum"] == pytest.approx(one["checksum"], rel=1e-6)
    assert one["grad_norm"] > 0
    assert one["sync_exact"] and two["sync_exact"]  # bf16 buckets of the sharded weights
    routing = [k for k in ("router_aux_loss", "router_entropy", "router_load_max",
                           "router_load_cv") if k in one]
    assert len(routing) == (4 if arch == "qwen3_vl_moe" else 0)
    for key in routing:
        assert two[key] == pytest.approx(one[key], rel=1e-5), key


@pytest.mark.slow
def test_two_processes_replay_the_routing_as_one(tmp_path):
    """Routing replay under FSDP2 (random routing, some rows free): the two-process step is the
    one-process step, and so is the share of replayed routings the routers would have chosen
    otherwise (summed over ranks); the free forward's distance is each rank's first
    micro-batch's, so it is only reported."""
    one = run(tmp_path, 1, "qwen3_vl_moe", "token-mean", "replay")
    two = run(tmp_path, 2, "qwen3_vl_moe", "token-mean", "replay")
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-7)
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    assert two["checksum"] == pytest.approx(one["checksum"], rel=1e-6)
    assert 0.5 < one["routing_replay_mismatch"] < 1  # random rows: most differ
    assert two["routing_replay_mismatch"] == pytest.approx(one["routing_replay_mismatch"])
    assert one["logp_diff_max_free"] > 0 and two["logp_diff_max_free"] > 0


@pytest.mark.heavy
def test_a_rank_with_nothing_to_train_takes_part(tmp_path):
    """All groups of rank 1 filtered: it runs a spare sequence with an empty loss mask in every
    collective, and the step (loss, weights, token-mean metrics) is the one-process step."""
    one = run(tmp_path, 1, "qwen3_vl", "token-mean")
    two = run(tmp_path, 2, "qwen3_vl", "token-mean", layout="empty_rank")
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-7)
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    assert two["checksum"] == pytest.approx(one["checksum"], rel=1e-6)
    assert one["sync_exact"] and two["sync_exact"]  # Qwen3-VL's bf16 sync buckets, sharded
    # global token means: the empty rank adds no tokens (a mean of rank means would halve them)
    for key in ("entropy", "logp_diff_mean", "tis_mean"):
        assert two[key] == pytest.approx(one[key], rel=1e-5), key


@pytest.mark.heavy
def test_sharded_load_and_sharded_resume(tmp_path):
    """Two processes: the meta-built model loaded from rank 0's read equals the plainly loaded
    one exactly (tied LM head included), each rank holding about half of it; a learner restored
    from a sharded checkpoint (one file of shards per rank, no full copy) trains the next step
    exactly as the learner that saved it; the engine's unsharded copy receives the trained
    weights exactly."""
    out = tmp_path / "resume.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}",
           str(ROOT / "tests" / "fsdp_resume_worker.py"), str(out), str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    r = json.loads(out.read_text())
    assert r["load_keys_equal"] and r["load_max_diff"] == 0.0 and r["tied"]
    assert all(h <= 0.6 * r["total"] for h in r["held"]) and sum(r["held"]) >= r["total"]
    assert [f for f in r["files"] if f.endswith(".distcp")] == ["__0_0.distcp", "__1_0.distcp"]
    a, b = r["uninterrupted"], r["resumed"]
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-6, abs=1e-8)
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-6)
    assert r["checksum_b"] == pytest.approx(r["checksum_a"], rel=1e-7)
    assert a["grad_norm"] > 0
    # the engine's own copy receives the trained weights exactly (tied head included)
    assert r["copy_max_diff"] == 0.0 and r["copy_changed"] > 0
