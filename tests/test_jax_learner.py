"""The JAX GRPO learner: the loss against the numpy reference for every option, the schedule,
the non-finite skip, orbax resume against an uninterrupted run, and 8 sharded fake devices
against one."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from common.grpo import LossConfig, policy_loss
from common.learner import Deferred
from common.schedule import lr_table
from geo3k_jax.core.batch import host_row
from geo3k_jax.core.buckets import (SHAPE_KEYS, Ladder, agree, bucket, reuse, slice_sizes,
                               step_slices)
from geo3k_jax.learner.learner import grpo_loss, loss_from_logprobs
from geo3k_jax.models.model import token_logprobs
from tests.jax_learner_setup import model_and_batch, train_config

jax.config.update("jax_default_matmul_precision", "highest")
ROOT = Path(__file__).resolve().parents[1]

OPTIONS = [LossConfig(), LossConfig(agg="seq-mean-token-mean"), LossConfig(clip_low=0.1,
           clip_high=0.15), LossConfig(dual_clip=3.0), LossConfig(tis_cap=1.5),
           LossConfig(kl_coef=0.1, kl_estimator="k1"), LossConfig(kl_coef=0.2, kl_estimator="k2"),
           LossConfig(kl_coef=0.05, kl_estimator="k3", tis_cap=2.0, dual_clip=2.0,
                      agg="seq-mean-token-mean")]


@pytest.fixture(scope="module")
def setups():
    """{agg: Setup}, the loss weights for that agg."""
    return {agg: model_and_batch("qwen3_vl", agg=agg)
            for agg in ("token-mean", "seq-mean-token-mean")}


@pytest.fixture(scope="module")
def setup(setups):
    return setups["token-mean"]


def numpy_reference(batch, batches, cfg, logp, old, ref):
    """common.grpo.policy_loss over the packed rows, global counts as the learner's weights."""
    seq = batch["segments"] + 1000 * np.arange(len(batch["segments"]))[:, None]
    mask = batch["loss_mask"]
    n_tokens = float(mask.sum())
    n_seqs = float(sum(len(b.seq_index) for b in batches))
    return policy_loss(logp, old, batch["advantages"], mask, cfg, ref_logp=ref,
                       rollout_logp=batch["rollout_logprobs"], seq_ids=seq.reshape(-1),
                       n_tokens=n_tokens, n_seqs=n_seqs)


@pytest.mark.parametrize("cfg", OPTIONS, ids=lambda c: f"{c.agg}-dc{c.dual_clip}-kl{c.kl_coef}"
                         f"{c.kl_estimator}-tis{c.tis_cap}-clip{c.clip_low}")
def test_loss_equals_numpy_reference(setups, cfg):
    """Random old / ref log-probs so clipping, dual clip, TIS and KL all act."""
    s = setups[cfg.agg]
    batch = s.batch
    rng = np.random.default_rng(1)
    mask = batch["loss_mask"]
    logp = (rng.uniform(-4, 0, mask.shape) * mask).astype(np.float32)
    old = (logp + rng.normal(0, 0.3, mask.shape) * mask).astype(np.float32)
    ref = (logp + rng.normal(0, 0.5, mask.shape) * mask).astype(np.float32)
    want, metrics = numpy_reference(batch, s.batches, cfg, logp, old, ref)
    got, sums = jax.jit(lambda a, b, r: loss_from_logprobs(a, b, batch, cfg, r))(logp, old, ref)
    assert float(got) == pytest.approx(want, rel=1e-5, abs=1e-7)
    n = float(sums["tokens"])
    assert float(sums["clip_frac"]) / n == pytest.approx(metrics["clip_frac"], abs=1e-6)
    assert metrics["clip_frac"] > 0
    for key in ("kl", "tis_mean"):
        if key in metrics:
            assert float(sums[key]) / n == pytest.approx(metrics[key], rel=1e-5)


@pytest.mark.slow
def test_model_loss_equals_reference(setup):
    """The learner's loss on real log-probs (old = current, as one step per rollout does)."""
    merge, params, batch = setup.merge, setup.params, setup.batch
    cfg = LossConfig(kl_coef=0.1, tis_cap=2.0, agg="token-mean")
    ref_params = {k: v * 1.01 for k, v in params.items()}
    loss, _ = jax.jit(lambda p, r: grpo_loss(merge, p, batch, cfg, 0.8, ref_params=r))(
        params, ref_params)
    fn = jax.jit(lambda p: token_logprobs(merge(p), batch, 0.8))
    logp, ref = np.asarray(fn(params)), np.asarray(fn(ref_params))
    want, _ = numpy_reference(batch, setup.batches, cfg, logp, logp, ref)
    assert float(loss) == pytest.approx(want, rel=1e-5, abs=1e-7)


def capture_gradients():
    """An optimizer that applies nothing and keeps the step's gradient as its state."""
    import optax
    return optax.GradientTransformation(
        lambda params: jax.tree.map(jnp.zeros_like, params),
        lambda grads, state, params=None: (jax.tree.map(jnp.zeros_like, grads), grads))


@pytest.mark.slow
def test_accumulated_gradients_equal_one_shot(setup, monkeypatch):
    """One micro-batch per slice (a loop of 3+ gradients inside the compiled step, each slice
    padded to its own length) against every micro-batch in one slice: the same gradient."""
    import geo3k_jax.core.buckets as jb
    import geo3k_jax.learner.learner as jl
    monkeypatch.setattr(jl, "make_optimizer", lambda c, names=(): capture_gradients())
    monkeypatch.setattr(jl, "current_lr", lambda s, c: jnp.float32(0.0))
    monkeypatch.setattr(jb, "ROW_UNIT", 32)  # the setup's short micro-batches, several lengths
    cfg = LossConfig(tis_cap=2.0)
    grads = {}
    for name, rows in (("one", len(setup.batches)), ("acc", 1)):
        learner = setup.learner(cfg, train_config(), rows_per_slice=rows)
        setup.step(learner)
        grads[name] = {k: np.asarray(v, np.float64) for k, v in learner.opt_state.items()}
        lengths = sorted(s["length"] for s in learner._shapes)
        # 128 | 128 and 32 (the rows that need 96 reuse 128: within the ladder's reuse_slack)
        assert lengths == ([128] if name == "one" else [32, 128]), lengths
    assert len(setup.batches) >= 3
    one, acc = grads["one"], grads["acc"]
    worst = max(np.linalg.norm(acc[k] - g) / np.linalg.norm(g)
                for k, g in one.items() if np.linalg.norm(g) > 0)
    assert worst <= 2e-6, worst  # fp32 sums in another order: 0.99e-6 and 1.02e-6 measured
    assert max(np.abs(g).max() for g in one.values()) > 1e-4  # a real gradient


@pytest.mark.slow
def test_chunked_logprobs_and_remat_change_nothing(setup):
    batch = setup.batch
    fn = lambda **kw: jax.jit(lambda p: token_logprobs(setup.merge(p), batch, **kw))  # noqa
    full = np.asarray(fn()(setup.params))
    chunked = np.asarray(fn(chunk=32)(setup.params))
    assert batch["targets"].shape[1] > 32  # several chunks
    np.testing.assert_allclose(chunked, full, rtol=0, atol=1e-6)
    # a row's targets within one chunk are one piece: no loop, nothing recomputed
    jaxpr = lambda c: str(jax.make_jaxpr(  # noqa: E731
        lambda p: token_logprobs(setup.merge(p), batch, chunk=c))(setup.params))
    assert "remat" in jaxpr(32) and "remat" not in jaxpr(batch["targets"].shape[1] + 1)
    assert jaxpr(batch["targets"].shape[1] + 1) == jaxpr(0)
    mask = jnp.asarray(batch["loss_mask"])
    grad = lambda **kw: jax.jit(jax.grad(lambda p: jnp.sum(  # noqa: E731
        token_logprobs(setup.merge(p), batch, **kw) * mask)))(setup.params)
    plain = grad()
    # both at once: each one's recomputation checked; the policy that keeps the projections
    for kw in (dict(chunk=32, remat=True), dict(remat="projections")):
        other = grad(**kw)
        worst = max(np.linalg.norm(np.asarray(other[k]) - g) / np.linalg.norm(g)
                    for k, g in plain.items() if np.linalg.norm(g) > 0)
        # float32 summation order, nothing more: 0.9e-6 with normalized probabilities times V,
        # 1.1e-6 with V times the exponentials, then normalized (geo3k_jax.kernels.windowed)
        assert worst <= 2e-6, (kw, worst)


def test_the_remat_policy_says_what_a_layer_keeps():
    """jax.remat_policy: "full" keeps nothing of a layer, "projections" its matmul outputs
    (JAX's policy in the checkpoint), prevent_cse only outside a scan; an unknown name is
    refused with the choices."""
    import ml_collections

    from geo3k_jax.models.layers import remat_of, rematerialised

    def jaxpr(remat, scanned):
        return str(jax.make_jaxpr(rematerialised(lambda x: jnp.tanh(x @ x), remat, scanned))(
            jnp.ones((4, 4))))
    assert "checkpoint" not in jaxpr(False, True)
    assert "prevent_cse=False" in jaxpr("full", True) and "prevent_cse=True" in jaxpr(True, False)
    assert "DotsSaveable(only_if_no_batch_dims=True)" in jaxpr("projections", True)
    assert "DotsSaveable" not in jaxpr("full", True)
    jcfg = ml_collections.ConfigDict({"remat": False, "remat_policy": "projections"})
    assert remat_of(jcfg) is False
    jcfg.remat = True
    assert remat_of(jcfg) == "projections"
    jcfg.remat_policy = "some"
    with pytest.raises(ValueError, match="remat_policy must be one of"):
        remat_of(jcfg)


@pytest.mark.slow
def test_a_run_compiles_once_per_bucket(setup):
    """Steps whose slices fall in the same buckets reuse the compiled gradient (4 micro-batches
    in any order, or 3: how many slices a step has is no shape), the update compiles once; a
    new slice shape (longer rows) compiles the gradient again, not the update."""
    learner = setup.learner(LossConfig(), train_config())
    assert len(setup.batches) == 4
    setup.step(learner)
    setup.step(learner, setup.batches[::-1])
    assert learner.compiles == 2  # the slice gradient and the update
    setup.step(learner, setup.batches[:3])
    setup.step(learner, setup.batches[1:])
    assert learner.compiles == 2
    learner.row_len *= 2
    setup.step(learner)
    assert learner.compiles == 3
    learner.row_len //= 2  # shorter rows again: the longer shape holds them (buckets.reuse)
    setup.step(learner)
    assert learner.compiles == 3


def test_each_slice_is_as_long_as_its_own_rows_need(setup, monkeypatch):
    """A slice's rows are its longest micro-batch rounded up to a bucket of ROW_UNIT tokens, at
    most the row length: a short micro-batch never pays for the whole budget, nor for a longer
    neighbour in its step."""
    import geo3k_jax.core.buckets as jb
    monkeypatch.setattr(jb, "ROW_UNIT", 32)  # the setup's micro-batches: 101, 88, 93, 22 tokens
    rows = [host_row(b, setup.processor, setup.config, agg="token-mean", n_tokens=1.0,
                     n_seqs=1.0) for b in setup.batches]
    lengths = [b.num_tokens for b in setup.batches]
    sizes = slice_sizes(rows, setup.config, rows_per_slice=1, row_len=8 * 32)
    assert [s["length"] for s in sizes] == [bucket(n, 32, Ladder().row_rungs) for n in lengths]
    assert len({s["length"] for s in sizes}) >= 3 and max(lengths) < 8 * 32
    slices = step_slices(rows, setup.config, rows_per_slice=1, sizes=sizes)
    assert [sl["input_ids"].shape for sl in slices] == [(1, s["length"]) for s in sizes]
    pairs = slice_sizes(rows, setup.config, rows_per_slice=2, row_len=8 * 32)
    assert [s["length"] for s in pairs] == [max(a["length"], b["length"])
                                            for a, b in zip(sizes[::2], sizes[1::2])]
    capped = slice_sizes(rows, setup.config, rows_per_slice=1, row_len=max(lengths))
    assert max(s["length"] for s in capped) == max(lengths)
    coarse = slice_sizes(rows, setup.config, rows_per_slice=1, row_len=8 * 32, row_rungs=1)
    assert [s["length"] for s in coarse] == [128, 128, 128, 32]  # powers of two


@pytest.mark.slow
def test_a_coarse_ladder_compiles_less(setup, monkeypatch):
    """`Ladder(row_rungs, reuse_slack)`: lengths on a coarser ladder and a looser reuse meet
    fewer shapes; a ladder that cannot be built says why."""
    import geo3k_jax.core.buckets as jb
    monkeypatch.setattr(jb, "ROW_UNIT", 32)
    lengths = {}
    for ladder in (Ladder(), Ladder(row_rungs=1, reuse_slack=4.0)):
        learner = setup.learner(LossConfig(), train_config(), ladder=ladder)
        setup.step(learner)
        lengths[ladder] = sorted(s["length"] for s in learner._shapes)
    assert lengths == {Ladder(): [32, 128], Ladder(1, 4.0): [128]}
    with pytest.raises(ValueError, match="power of two"):
        Ladder(row_rungs=3)
    with pytest.raises(ValueError, match="reuse_slack"):
        Ladder(reuse_slack=0.5)


class MaxOver:
    """`Collectives.sum_scalars` of several processes whose values are given, for `agree`."""

    def __init__(self, others):
        self.others = others  # the other processes' values, one dict each, in call order
        self.calls = 0

    def sum_scalars(self, values, max_keys=()):
        other = self.others[self.calls]
        self.calls += 1
        keys = set(values) | set(other)
        assert set(max_keys) == keys
        return {k: max(values.get(k, 0), other.get(k, 0)) for k in keys}


def test_processes_agree_on_each_slices_shape():
    a = dict(length=512, targets=128, patches=64, window=128, prefix_window=0)
    b = dict(length=1024, targets=256, patches=0, window=256, prefix_window=512)
    comm = MaxOver([{"slices": 3}, {f"{i}/{k}": v for i, s in enumerate([a, a, b])
                                    for k, v in s.items()}])
    mine = [b, a]
    agreed = agree(mine, comm)
    assert agreed == [{k: max(a[k], b[k]) for k in SHAPE_KEYS}, a, b]  # the third: theirs


def test_reuse_takes_the_smallest_compiled_shape_that_holds_the_step():
    need = dict(slices=3, length=1024, targets=256, patches=64, window=256, prefix_window=512)
    big = dict(length=2048, targets=768, patches=128, window=256, prefix_window=512)
    mid = dict(length=1536, targets=384, patches=64, window=256, prefix_window=512)
    assert reuse(need, [big, mid]) == dict(need, **mid)  # the slice count is no shape
    assert reuse(need, [dict(mid, window=128)]) == need  # a narrower window does not hold it
    assert reuse(need, [dict(mid, targets=128)]) == need
    assert reuse(dict(need, length=512), [big]) == dict(need, length=512)  # 4x the rows: no
    assert reuse(dict(need, patches=0), [mid]) == dict(need, **mid)  # padding patches only
    assert reuse(need, []) == need


def test_bucket_ladder():
    assert [bucket(n, 1) for n in (0, 1, 2, 3, 4, 5, 7, 9, 13, 17, 25)] == \
        [1, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32]
    assert bucket(300, 128) == 384 and bucket(129, 16) == 192
    assert [bucket(n, 1, 4) for n in (1, 3, 5, 8, 9, 11, 15, 17, 33, 57)] == \
        [1, 3, 5, 8, 10, 12, 16, 20, 40, 64]
    assert [bucket(n, 1, 1) for n in (1, 2, 3, 5, 9)] == [1, 2, 4, 8, 16]
    assert bucket(1100, 256, 4) == 1280 and bucket(2047, 256, 4) == 2048
    for per_octave in (1, 2, 4, 8):  # the smallest rung: no rung lies between n and it
        rungs = sorted({bucket(n, 1, per_octave) for n in range(1, 600)})
        assert all(bucket(n, 1, per_octave) == min(r for r in rungs if r >= n)
                   for n in range(1, 600))
        assert all(b <= a * (1 + 1 / per_octave) for a, b in zip(rungs[per_octave:],
                                                                rungs[per_octave + 1:]))
    with pytest.raises(ValueError, match="power of two"):
        bucket(10, 1, 3)


@pytest.mark.slow
def test_schedule_and_skip(setup):
    tc = train_config(warmup_steps=2, steps=5, lr_schedule="linear", min_lr_ratio=0.2)
    learner = setup.learner(LossConfig(), tc)
    table = lr_table(tc.lr, "linear", 2, 5, 0.2)
    lrs = [setup.step(learner)["lr"] for _ in range(3)]
    np.testing.assert_allclose(lrs, table[:3], rtol=1e-7)
    before = {k: np.asarray(v) for k, v in learner.params.items()}
    bad = [dataclasses.replace(b, advantages=np.full_like(b.advantages, np.nan))
           for b in setup.batches]
    m = setup.step(learner, bad)
    assert m["skipped"] == 1.0 and not np.isfinite(m["grad_norm"])
    for k, v in learner.params.items():
        np.testing.assert_array_equal(np.asarray(v), before[k])
    assert setup.step(learner)["lr"] == pytest.approx(table[3], rel=1e-7)  # not advanced
    assert all(np.isfinite(np.asarray(v)).all() for v in setup.params.values())  # not donated


@pytest.mark.slow
def test_bf16_compute_keeps_fp32_state(setup):
    """Mixed precision: the step runs in bf16, parameters and moments stay fp32, and the loss
    and gradient norm are those of fp32 to bf16 accuracy."""
    full = setup.step(setup.learner(LossConfig(), train_config()))
    mixed = setup.learner(LossConfig(), train_config(), compute_dtype=jnp.bfloat16)
    m = setup.step(mixed)
    assert all(v.dtype == jnp.float32 for v in mixed.params.values())
    assert all(v.dtype == jnp.float32 for v in jax.tree.leaves(mixed.opt_state)
               if v.ndim > 0)
    assert m["grad_norm"] == pytest.approx(full["grad_norm"], rel=5e-2)
    assert m["entropy"] == pytest.approx(full["entropy"], rel=5e-2)
    assert m["skipped"] == 0.0


def test_kl_needs_reference(setup):
    with pytest.raises(ValueError, match="reference"):
        setup.learner(LossConfig(kl_coef=0.1), train_config())


@pytest.mark.slow
def test_router_aux_loss_is_refused(setup):
    """The torch learner's load-balancing loss has no JAX twin: a run asking for it stops
    rather than train without it."""
    with pytest.raises(ValueError, match="router_aux_coef"):
        setup.learner(LossConfig(router_aux_coef=1e-3), train_config())


def test_resume_keeps_the_shapes_a_run_has_used(setup, tmp_path):
    """A step after a restore pads as the uninterrupted run does: the shapes compiled before
    the checkpoint (`buckets.reuse`) come back with it, and its weights are the uninterrupted
    run's exactly (the step after `save` donated the buffers orbax was still writing).
    tests/test_learners.py resumes through the loop's checkpoints.start as well."""
    tc, cfg = train_config(), LossConfig(tis_cap=2.0)
    straight = setup.learner(cfg, tc)
    row_len = straight.row_len
    straight.row_len = row_len * 3 // 2
    setup.step(straight)
    straight.save(tmp_path)
    straight.row_len = row_len
    setup.step(straight)  # shorter rows, within the reuse slack: reuses the longer shape
    straight.wait_saved()  # orbax writes in the background: a checkpoint is read once written
    resumed = setup.learner(cfg, tc)
    resumed.restore(tmp_path)
    setup.step(resumed)
    assert resumed._shapes == straight._shapes and len(straight._shapes) == 1
    for k, v in straight.params.items():
        np.testing.assert_array_equal(np.asarray(resumed.params[k]), np.asarray(v), err_msg=k)
    with pytest.raises(FileNotFoundError, match="not a JAX learner checkpoint"):
        resumed.restore(tmp_path / "elsewhere")
    old = next(iter(resumed.params))  # a checkpoint of another parameter layout: named
    resumed.params = {("renamed." + k if k == old else k): v for k, v in resumed.params.items()}
    with pytest.raises(ValueError, match=f"1 parameters saved that it lacks .*{old}"):
        resumed.restore(tmp_path)


def sharded_run(arch: str) -> dict:
    """tests/jax_sharded_worker.py's differences for `arch` on 8 fake CPU devices."""
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") +
               " --xla_force_host_platform_device_count=8",
               PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-m", "tests.jax_sharded_worker", arch], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.heavy
def test_sharded_step_equals_single_device(arch="qwen2_5_vl"):
    """8 fake devices against one, on Qwen2.5-VL (the two-process test below runs Qwen3-VL):
    the mesh, the shardings and the per-device rows are the same code for both."""
    r = sharded_run(arch)
    assert r["rows"] == 4
    # the decoder's stacked q_proj (layers, out, in): layers unsharded, out over tensor, in over fsdp
    assert r["q_proj_spec"] == ["None", "tensor", "fsdp"]
    layers, out, inp = r["q_proj_shape"]
    assert r["q_proj_shard_shape"] == [layers, out // 2, inp // 2]
    assert r["logp_abs"] <= 1e-5
    assert r["loss_rel"] <= 1e-5 and r["grad_norm_rel"] <= 1e-5
    # Two AdamW steps at lr 1e-3: weights whose gradient is float32 noise around zero may move
    # by a fraction of lr differently when the reduction order changes.
    assert r["params_abs"] <= 1e-4
    # per-device work shrinks with the data axes (2 x 2): one of the 4 rows' logits and patch
    # activations (the vision tower's too, not only its input)
    assert r["logit_rows"] == ["1"] and r["patch_rows"] == ["1"], r


@pytest.mark.heavy
def test_sharded_moe_step_equals_single_device():
    """Qwen3-VL-MoE on fsdp 2 x expert 2 x tensor 2: each device holds half the experts (a
    quarter of each one's matrix), and two GRPO steps equal one device's."""
    r = sharded_run("qwen3_vl_moe")
    assert r["rows"] == 4  # expert is a data axis for the rest of the model
    prefix = "model.language_model.layers.mlp.experts."
    (gate_spec, gate_shape, gate_shard), (down_spec, down_shape, down_shard) = (
        r["experts"][prefix + name] for name in ("gate_up_proj", "down_proj"))
    assert gate_spec == ["None", "expert", "tensor", "fsdp"]
    assert down_spec == ["None", "expert", "fsdp", "tensor"]
    for shape, shard in ((gate_shape, gate_shard), (down_shape, down_shard)):
        assert shard == [shape[0], shape[1] // 2, shape[2] // 2, shape[3] // 2]
    assert r["logp_abs"] <= 1e-5
    assert r["loss_rel"] <= 1e-5 and r["grad_norm_rel"] <= 1e-5
    assert r["params_abs"] <= 1e-4
    # per-device work shrinks with the data axes (fsdp 2 x expert 2): one of the 4 rows
    assert r["logit_rows"] == ["1"] and r["patch_rows"] == ["1"], r


def _multihost(out, *mode) -> None:
    """tests/jax_multihost_worker.py on 2 CPU processes (gloo)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-m", "tests.jax_multihost_worker", str(i),
                               str(port), str(out), *mode], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), logs[0][-3000:] + logs[1][-3000:]


def _same_sessions_as_one_engine(setup, out, atol: float = 1e-5) -> None:
    """Each process's engine ran its share of the sessions on its own device: the same tokens
    and log-probs (within `atol`) as one engine (windowed attention, one process) running them
    all."""
    from geo3k_jax.engine.backend import JaxBackend
    from tests.test_jax_engine import episodes

    engine_runs = [json.loads((out / f"engine_{i}.json").read_text()) for i in range(2)]
    assert [r["cache_devices"] for r in engine_runs] == [1, 1]
    assert sorted(engine_runs[0]["sessions"]) == ["s0", "s2", "s4"]
    assert sorted(engine_runs[1]["sessions"]) == ["s1", "s3"]
    one = JaxBackend(setup.learner(LossConfig(tis_cap=2.0), train_config()), setup.processor,
                     setup.config, seed=11, slots=2, context=512)
    turns = episodes(one.engine, setup.processor, 3, turns=2, max_new=8, n=5)
    for k, (reqs, outs) in enumerate(turns):
        for r, o in zip(reqs, outs):
            got = next(run["sessions"][r.session] for run in engine_runs
                       if r.session in run["sessions"])
            assert got["tokens"][k] == [int(t) for t in o.token_ids], (r.session, k)
            assert np.abs(np.asarray(got["logprobs"][k]) - o.logprobs).max() <= atol


@pytest.mark.heavy
def test_two_processes_equal_one(setup, tmp_path):
    """The multi-host path on 2 CPU processes (gloo): per-process rows assembled into global
    arrays, uneven shares (2 and 1 micro-batches), an export that gathers across processes."""
    from safetensors.numpy import load_file

    from geo3k_jax.core.stacking import to_hf
    _multihost(tmp_path)
    multi = json.loads((tmp_path / "metrics.json").read_text())
    assert multi["shares"] == [2, 1]
    batches = setup.batches[0::2] + setup.batches[1::2][:1]
    single = setup.learner(LossConfig(tis_cap=2.0), train_config())
    ref = setup.step(single, batches)  # the same global batch in one process
    for key in ("loss", "grad_norm", "entropy", "tis_mean"):
        assert multi[key] == pytest.approx(ref[key], rel=1e-5), key
    _same_sessions_as_one_engine(setup, tmp_path)
    # each process wrote its own shard: the two files and the index that names them
    export = tmp_path / "export"
    index = json.loads((export / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert not (export / "model.safetensors").exists()
    shards = [load_file(str(export / f)) for f in files]
    assert shards[0] and shards[1] and not set(shards[0]) & set(shards[1])
    weights = {**shards[0], **shards[1]}
    assert {k: f for f, sh in zip(files, shards) for k in sh} == index["weight_map"]
    mine = {k: np.asarray(v) for k, v in to_hf(single.params).items()}  # checkpoint keys
    assert weights.keys() == mine.keys()
    assert max(float(np.abs(weights[k] - mine[k]).max()) for k in mine) <= 1e-4


@pytest.mark.heavy
def test_two_processes_engines_map_splash_over_their_own_devices(setup, tmp_path):
    """With the splash kernel (interpret mode) mapped over the learner's 2-process mesh, each
    process's engine maps its vision attention over its own device, where its arrays live
    (`geo3k_jax.models.model.with_attention`), and samples what one windowed engine samples: the
    same tokens, log-probs within 2e-3 (its decode goes through the Pallas paged attention kernel,
    whose matmuls round fp32 operands to bf16 as a TPU's do; 7.6e-4 measured)."""
    _multihost(tmp_path, "splash")
    _same_sessions_as_one_engine(setup, tmp_path, atol=2e-3)
