"""The AOT compile of the learner's step for a TPU slice (geo3k_jax.aot), on this CPU host.

libtpu compiles for the chips of a topology without any TPU; the tiny model's step must
compile for v5p-8, fit, and report the bytes the compiler gives it.
"""

import math

import pytest

from tests.jax_learner_setup import config

pytest.importorskip("libtpu", reason="the TPU compiler: pip install libtpu==0.0.42 "
                    "(requirements-test.txt)")


@pytest.fixture(scope="module")
def tiny_v5p():
    import jax

    from configs import tpu
    from geo3k_jax import aot

    cfg = tpu.get_config()
    cfg.train.micro_batch_tokens = 256
    cfg.jax.slice.update(targets=128, patches=64, window=256, prefix_window=64)
    # as a run compiles it: the figures are the optimised program's (tests/conftest.py turns
    # most optimisations off), and the matmul precision the default (other test modules ask for
    # "highest", which the TPU kernels refuse for bf16 operands)
    optimise = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        with jax.default_matmul_precision(None):
            return aot.compile_step(cfg, "v5p-8", config("qwen3_vl")[0])
    finally:
        jax.config.update("jax_disable_most_optimizations", optimise)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the TPU compile took 286 s on 2 cores shared by 20 processes
def test_the_tiny_step_compiles_for_v5p_8_and_fits(tiny_v5p):
    from geo3k_jax import aot

    r = tiny_v5p
    assert (r["chip"], r["devices"], r["fits"]) == ("v5p", 4, True)
    assert r["attention"] == "splash"  # jax.attention=auto on a TPU
    # one 256-token row per chip (fsdp over the 4 chips of a v5p:2x2x1)
    assert r["slice"] == dict(length=256, targets=128, patches=64, window=256,
                              prefix_window=64, rows=4)
    grad, apply = r["programs"]
    assert (grad["program"], apply["program"]) == ("grad", "apply")
    for p in (grad, apply):
        assert min(p["argument"], p["output"], p["temp"], p["code"], p["flops"],
                   p["bytes_accessed"], p["roofline_s"]) > 0, p
        assert p["peak"] == (p["argument"] + p["output"] - p["alias"] + p["temp"] + p["code"]
                             + p["resident"])
        assert p["fits"] and p["peak"] < p["hbm"] == aot.CHIPS["TPU v5"].hbm
    # the parameters (fp32, sharded over 4 chips) are an argument of both programs; the
    # accumulator (fp32, the parameters' shape) is donated to the gradient program, the
    # parameters and optimizer state to the update: without the donations the aliased bytes
    # would be 0 and a second gradient tree would live beside the first
    per_chip = r["params"] * 4 / 4  # fp32 bytes over 4 chips (a few small ones replicated)
    assert grad["alias"] >= 0.9 * per_chip
    assert apply["alias"] >= 0.9 * 3 * per_chip  # params and the two Adam moments
    assert grad["resident"] >= 0.9 * 2 * per_chip  # the Adam moments wait in HBM meanwhile
    assert grad["flops"] > 10 * apply["flops"]  # forward and backward of 256 tokens a chip
    # the roofline counts at least the model's FLOPs, which the compiler's count of a scanned
    # layer and of the splash kernel misses
    assert grad["model_flops"] > 0 and apply["model_flops"] == 0
    peak_flops = aot.CHIPS["TPU v5"].peak_flops
    assert grad["roofline_s"] >= grad["model_flops"] / peak_flops


def test_a_step_that_does_not_fit_exits_1(monkeypatch, capsys):
    from geo3k_jax import aot

    program = dict(program="grad", argument=1, output=1, alias=0, temp=2 * aot.GiB, code=1,
                   resident=0, peak=2 * aot.GiB, hbm=aot.GiB, fits=False, flops=1.0,
                   model_flops=2.0,
                   bytes_accessed=1.0, roofline_s=1e-3, compile_s=1.0)
    monkeypatch.setattr(aot, "compile_step", lambda cfg, topology, config: dict(
        topology=topology, chip="v5e", devices=8, params=10, attention="splash", slice={},
        fits=False,
        programs=[program, dict(program="apply", refused="RESOURCE_EXHAUSTED: too big",
                                fits=False, compile_s=2.0)]))
    monkeypatch.setattr(aot, "model_config", lambda shapes: None)
    with pytest.raises(SystemExit) as e:
        aot.main(["aot", "--config=configs/tpu.py", "--topology=v5e-8"])
    assert e.value.code == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "refused by the compiler" in out and "NO" in out
