"""Expert parallelism (`train.expert_parallel`, geo3k_torch/expert_parallel.py) on CPU: two gloo
processes that split the tiny Qwen3-VL-MoE's 4 experts between them (FSDP2 over both for the
rest), and four that split them two ways and shard each half over two, take the one-process
learner step on the same global batch (tests/ep_worker.py); their sharded checkpoints resume
there and in one process.

Tolerances: fp32, the two runs reduce in another order (other micro-batch packing, gradients
summed over ranks, the experts' grouped matmuls over other row groups). Measured on this CPU:
the block's output 2.4e-7 and gradients at most 1.5e-7 of their largest magnitude; the learner's
loss 2.4e-7 and grad norm 1.0e-7 relative, every gathered gradient within 4.4e-7 of its largest
magnitude (FSDP over the same two processes without EP: 2.1e-7); the same on four processes.
"""

import os
import subprocess
import sys

import pytest
import torch

from tests.test_fsdp import ROOT, free_port

TOL = 1e-6


def run(tmp_path, nproc: int, ep: int, checkpointing: str = "none") -> dict:
    out, work = tmp_path / f"ep-{nproc}-{ep}.pt", tmp_path / f"work-{nproc}-{ep}"
    work.mkdir()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}",
           str(ROOT / "tests" / "ep_worker.py"), str(out), str(work), str(ep), checkpointing]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return torch.load(out, weights_only=False) | {"workdir": work}


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    return run(tmp_path_factory.mktemp("ep"), 1, 1)


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return run(tmp_path_factory.mktemp("ep"), 2, 2)


def largest_gap(a: dict, b: dict) -> tuple[float, str]:
    """The largest max|a - b| / max|b| over the tensors of b, and its name."""
    return max((float((a[k].double() - b[k].double()).abs().max() / b[k].abs().max()), k)
               for k in b)


def checksum(r: dict) -> float:
    return float(sum(v.double().abs().sum() for v in r["weights"].values()))


def assert_block_is_unsharded(many: dict) -> None:
    """Layer 0's experts split over the processes, each on its own tokens: output and gradients
    (hidden states, router weights, gathered experts) are the unsharded block's; also when every
    token picks the first rank's experts and the others receive no rows. A gradient averaged
    over the expert_fsdp group alone (not the world) would be 2x or more, a gap of 1.0."""
    for case in ("random", "one_sided"):
        for key, gap in many["block"][case].items():
            assert gap <= TOL, (case, key, gap)


def assert_same_step(one: dict, many: dict) -> None:
    """The step of `many` processes is the one-process step: metrics, every gathered gradient,
    the updated weights; its HF export read back is its gathered weights (full experts, the
    published layout undone by transformers), every process's bf16 weight-sync buckets and its
    engine copy hold them exactly, and a learner restored from its sharded checkpoint trains the second step as
    the one that saved it."""
    assert one["micro_batches"] >= 2 and many["micro_batches"] >= 2  # accumulation as well
    a, b = one["step1"], many["step1"]
    assert a["grad_norm"] > 1.0  # clipped at 1: the clip's scale is compared too
    # the norm counts each expert shard once (1.16268): twice gives 1.16392, none 1.16143
    for key in ("loss", "grad_norm", "router_aux_loss", "router_entropy", "router_load_max",
                "router_load_cv", "entropy", "clip_frac"):
        assert b[key] == pytest.approx(a[key], rel=TOL, abs=1e-9), key
    gap, name = largest_gap(many["grads"], one["grads"])
    assert gap <= TOL, (name, gap)
    # Adam's first step is about lr x sign(g): weights move alike wherever the gradients do
    assert max(float((many["weights"][k] - one["weights"][k]).abs().max())
               for k in one["weights"]) < 2e-5
    assert checksum(many) == pytest.approx(checksum(one), rel=1e-8)
    assert sorted(many["exported"]) == sorted(one["exported"])
    assert all(torch.equal(many["exported"][k], many["weights"][k]) for k in many["exported"])
    assert many["sync_exact"] and one["sync_exact"]  # SGLang's buckets
    assert many["copy_exact"] and one["copy_exact"]  # the local engine's copy
    for r in (one, many):
        assert r["resumed"]["loss"] == pytest.approx(r["step2"]["loss"], rel=1e-7)
        assert r["resumed"]["grad_norm"] == pytest.approx(r["step2"]["grad_norm"], rel=1e-7)
        assert largest_gap(r["after_resumed"], r["after"])[0] == 0.0
    assert many["step2"]["loss"] == pytest.approx(one["step2"]["loss"], rel=1e-5)


@pytest.mark.slow
def test_two_processes_with_split_experts_take_the_one_process_step(one, two):
    """ep = 2 on 2 processes: each holds 2 of the 4 experts (nothing left for FSDP to split)."""
    assert one["slabs"] == [(4, 48, 64)] and two["slabs"] == [(2, 48, 64)] * 2  # (E, 2I, H)
    assert_block_is_unsharded(two)
    assert_same_step(one, two)


@pytest.mark.slow
def test_a_checkpoint_of_split_experts_resumes_in_one_process(two):
    """DCP reshards on load: one process restores what two with ep = 2 saved (the weights
    exactly, and AdamW's state: the second step is theirs)."""
    from geo3k_torch.model import load_model
    from tests.ep_worker import make_learner, this_share

    source = two["workdir"] / "model"
    learner = make_learner(load_model(str(source)).train(), source)
    learner.restore(two["workdir"] / "ckpt")
    assert largest_gap(learner.model.state_dict(), two["weights"])[0] == 0.0
    m = learner.train_step(*this_share())
    assert m["loss"] == pytest.approx(two["step2"]["loss"], rel=TOL)
    assert m["grad_norm"] == pytest.approx(two["step2"]["grad_norm"], rel=TOL)
    after = learner.model.state_dict()
    assert max(float((after[k] - v).abs().max()) for k, v in two["after"].items()) < 1e-7


@pytest.mark.heavy
def test_four_processes_split_experts_two_ways_and_shard_them_two_ways(one, tmp_path):
    """ep = 2 on 4 processes: the (expert_fsdp, expert) mesh is 2 x 2, each expert group of 2
    slabs FSDP-sharded over 2 processes, 1 slab each; every layer recomputed in the backward pass
    (its all-to-alls again, its gradient division once). About 50 s here."""
    four = run(tmp_path, 4, 2, "full")
    assert four["slabs"] == [(1, 48, 64)] * 4
    assert_block_is_unsharded(four)
    assert_same_step(one, four)


def test_a_degree_that_does_not_fit_is_refused():
    from common.prepare import check_config
    from configs import cpu
    from geo3k_torch.expert_parallel import check
    from tests.tiny_models import qwen3_vl, qwen3_vl_moe

    cfg = cpu.get_config()
    cfg.train.prompts_per_step = 6
    cfg.train.expert_parallel = 2
    check_config(cfg, 2)
    with pytest.raises(ValueError, match="expert_parallel=2 must divide the 3 processes"):
        check_config(cfg, 3)
    cfg.train.compile = True
    with pytest.raises(ValueError, match="train.compile"):
        check_config(cfg, 2)
    moe, dense = qwen3_vl_moe()[0], qwen3_vl()[0]
    check(moe, 4, 4)
    with pytest.raises(ValueError, match="must divide the model's 4 experts"):
        check(moe, 3, 3)
    with pytest.raises(ValueError, match="needs a MoE model"):
        check(dense, 2, 2)
