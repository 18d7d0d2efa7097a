"""`python -m geo3k_jax.main`: the cross-backend check passes on checkpoints of other shapes,
in fp32 and bf16, and its batch holds real multi-turn trajectories."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from common.processor import load_processor
from configs import cpu
from geo3k_jax.check.check_batch import batches_from_config, check_batches
from geo3k_jax.check.numerics import run_check
from geo3k_torch.tiny import build_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {  # nothing like the default tiny models: head counts, KV heads, depths, patches
    "qwen3_vl": dict(hidden_size=96, heads=6, kv_heads=3, layers=3, vision_depth=3,
                     vision_hidden=48, vision_heads=2, patch_size=8),
    "qwen2_5_vl": dict(hidden_size=64, heads=2, kv_heads=1, layers=2, vision_depth=4,
                       vision_hidden=64, vision_heads=4, patch_size=10, window_size=40),
    "qwen3_vl_moe": dict(hidden_size=96, heads=6, kv_heads=3, layers=3, vision_depth=2,
                         vision_hidden=48, vision_heads=2, patch_size=8, experts=6,
                         moe_intermediate_size=32),
}
CHECK = {"qwen3_vl": ("1,3", "30-120"), "qwen2_5_vl": ("2", "60-180"),
         "qwen3_vl_moe": ("1,2", "40-150")}


# the MoE model (Qwen3-VL's but for its decoder's MLP) runs the full check only
@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def ckpt(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param) / "ckpt"
    return request.param, build_tiny_checkpoint(out, arch=request.param, seed=5,
                                                **SHAPES[request.param])


def config(path, arch, dtype="float32"):
    cfg = cpu.get_config()
    cfg.model.path = str(path)
    cfg.jax.check.dtype = dtype
    cfg.jax.check.images, cfg.jax.check.image_sizes = CHECK[arch]
    return cfg


def test_check_batch_is_multi_turn_multi_image(ckpt):
    arch, path = ckpt
    processor = load_processor(path)
    batches, n_tokens, n_seqs = check_batches(processor, prompts=3, samples=2, images=[1, 3],
                                              image_sizes=(30, 120), micro_batch_tokens=0, seed=0)
    assert len(batches) >= 2 and n_seqs == 6
    assert max(len(b.seq_index) for b in batches) >= 2  # several sequences in a row
    assert sorted({int(c) for b in batches for c in b.image_counts if c}) == [1, 3]
    assert any((b.parent_of() >= 0).any() for b in batches)  # samples share their prompt
    sizes = {im.size for b in batches for im in b.images}
    assert len(sizes) >= 4
    # masked spans separated by unmasked observation tokens: a multi-turn episode
    runs = [np.flatnonzero(np.diff(b.loss_mask[b.seq_ids == s].astype(int)) == 1).size
            for b in batches for s in np.unique(b.seq_ids)]
    assert max(runs) >= 2 and n_tokens == sum(b.loss_mask.sum() for b in batches)


# A check takes a minute or two on 2 CPU cores: each architecture and each dtype runs once,
# Qwen2.5-VL in fp32 here (with the tight log-prob bound) and Qwen3-VL in bf16 through the
# command line, both in `make test-all`. `make test` keeps what they add up from:
# tests/test_jax_model.py (logits, log-probs and gradients against transformers, four variants)
# and the learner's loss against the numpy reference (tests/test_learners.py).
@pytest.mark.heavy
@pytest.mark.parametrize("ckpt,dtype", [("qwen2_5_vl", "float32"), ("qwen3_vl_moe", "float32")],
                         indirect=["ckpt"])
def test_check_passes_on_other_shapes(ckpt, dtype):
    arch, path = ckpt
    rows, info = run_check(config(path, arch, dtype), str(path), load_processor(path))
    assert info["images"] >= 4 and info["batches"] >= 2
    failed = [(r.quantity, r.abs_err, r.rel_err) for r in rows if not r.passed]
    assert not failed, failed
    if dtype == "float32":
        assert next(r for r in rows if r.quantity == "log-probs").abs_err <= 1e-5


@pytest.mark.heavy
@pytest.mark.parametrize("ckpt", ["qwen3_vl"], indirect=True)
def test_main_runs_and_prints_the_table(ckpt):
    """The command line, in bf16: every row passes within bf16's tolerances."""
    arch, path = ckpt
    images, sizes = CHECK[arch]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-m", "geo3k_jax.main", f"--config.model.path={path}",
                          f"--config.jax.check.images={images}",
                          f"--config.jax.check.image_sizes={sizes}",
                          "--config.jax.check.dtype=bfloat16"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for quantity in ("logits", "log-probs", "loss", "grad global norm", "params after AdamW"):
        assert quantity in out.stdout
    assert "all checks passed" in out.stdout and "FAIL" not in out.stdout


def test_unknown_dtype_is_an_error(ckpt):
    arch, path = ckpt
    with pytest.raises(ValueError, match="jax.check.dtype"):
        run_check(config(path, arch, "float16"), str(path), load_processor(path))


@pytest.mark.parametrize("field,value", [("images", "one"), ("images", "0"),
                                         ("image_sizes", "200-40"), ("image_sizes", "x"),
                                         ("prompts", 0)])
def test_bad_check_settings_are_errors(ckpt, field, value):
    arch, path = ckpt
    cfg = config(path, arch)
    cfg.jax.check[field] = value
    with pytest.raises(ValueError, match="jax.check"):
        batches_from_config(load_processor(path), cfg.jax.check)


def test_batch_positions_equal_transformers(ckpt):
    """The JAX batch's M-RoPE rows, sequence by sequence, are transformers' get_rope_index of
    that sequence alone (multi-turn trajectories with one or three images of different sizes;
    a sample that continues its group's shared prompt takes the positions after it)."""
    import torch
    from transformers import AutoModelForImageTextToText

    from geo3k_jax.core.batch import device_batch

    arch, path = ckpt
    processor = load_processor(path)
    hf = AutoModelForImageTextToText.from_pretrained(str(path))
    batches, n_tokens, n_seqs = check_batches(processor, prompts=3, samples=2, images=[1, 3],
                                              image_sizes=(30, 120), micro_batch_tokens=0, seed=1)
    batch = device_batch(batches, processor, hf.config, agg="token-mean", n_tokens=n_tokens,
                         n_seqs=n_seqs)
    grids = processor.image_processor(images=[im for b in batches for im in b.images],
                                      return_tensors="np")["image_grid_thw"]
    first, checked = 0, 0
    for r, b in enumerate(batches):
        cu, parents = b.cu_seqlens, b.parent_of()
        image_at = first + np.concatenate([[0], np.cumsum(b.image_counts)])
        first = image_at[-1]
        for s in np.flatnonzero(b.seq_index >= 0):  # each sequence, with its shared prompt
            spans = [s] if parents[s] < 0 else [parents[s], s]
            ids = torch.from_numpy(np.concatenate([b.input_ids[cu[j]:cu[j + 1]]
                                                   for j in spans]))[None]
            grid = np.concatenate([grids[image_at[j]:image_at[j + 1]] for j in spans])
            ref, _ = hf.model.get_rope_index(ids, (ids == hf.config.image_token_id).int(),
                                             image_grid_thw=torch.from_numpy(grid))
            lo, hi = int(cu[s]), int(cu[s + 1])
            np.testing.assert_array_equal(batch["positions"][r, :, lo:hi],
                                          ref[:, 0, ids.shape[1] - (hi - lo):].numpy())
            checked += 1
    assert checked == n_seqs and first == len(grids)
    assert any((b.parent_of() >= 0).any() for b in batches)


@pytest.mark.heavy
@pytest.mark.parametrize("ckpt", ["qwen3_vl"], indirect=True)
def test_the_tpu_configuration_passes_against_torch_in_float32(ckpt):
    """configs/tpu.py's computation on this CPU: float32 weights and optimizer state, bf16
    compute, rematerialised layers, the splash kernel (Pallas interpret mode), against torch in
    float32, within the bf16 tolerances (`geo3k_jax.check.numerics.tolerances`)."""
    from configs import tpu
    from geo3k_jax.check.numerics import TOLERANCES, tolerances

    arch, path = ckpt
    cfg = tpu.get_config("cpu")
    cfg.model.path = str(path)
    cfg.jax.attention = "splash"
    cfg.jax.check.images, cfg.jax.check.image_sizes = CHECK[arch]
    assert (cfg.jax.check.dtype, cfg.jax.compute_dtype, cfg.jax.remat) == (
        "float32", "bfloat16", True)
    assert tolerances(cfg) is TOLERANCES["bfloat16"]
    rows, info = run_check(cfg, str(path), load_processor(path))
    assert info["jax"] == "bfloat16 compute, splash attention (interpret), remat"
    print({r.quantity: (r.abs_err, r.rel_err) for r in rows})
    failed = [(r.quantity, r.abs_err, r.rel_err) for r in rows if not r.passed]
    assert not failed, failed
    # bf16 compute is not float32: the log-probs move by more than float32's bound
    assert next(r for r in rows if r.quantity == "log-probs").abs_err > 1e-4


@pytest.mark.parametrize("ckpt", ["qwen2_5_vl", "qwen3_vl_moe"], indirect=True)
def test_float64_reference_is_the_float32_function_in_float64(ckpt):
    """The reference's log-probs are torch's float32 ones to float32's rounding, at the same
    tokens, and not torch's float32 computation itself (some token differs)."""
    import torch

    from geo3k_jax.check.numerics import float64_logprobs
    from geo3k_torch.model import load_model, packed_inputs, token_logprobs

    arch, path = ckpt
    processor = load_processor(path)
    batches, _, _ = check_batches(processor, prompts=2, samples=2, images=[1, 2],
                                  image_sizes=(40, 120), micro_batch_tokens=0, seed=3)
    exact = float64_logprobs(str(path), processor, batches, temperature=0.7)
    model = load_model(str(path))
    with torch.no_grad():
        f32 = [token_logprobs(model, packed_inputs(b, processor, model.config),
                              torch.from_numpy(np.flatnonzero(b.loss_mask)), 0.7).numpy()
               for b in batches]
    assert [len(a) for a in exact] == [int(b.loss_mask.sum()) for b in batches]
    diff = np.abs(np.concatenate(exact) - np.concatenate(f32))
    assert diff.max() <= 1e-5 and diff.max() > 0
    assert np.concatenate(exact).dtype == np.float64


def test_a_norm_of_another_formula_has_no_float64_reference():
    """`norms_as_written` replaces transformers' Qwen RMSNorm by the same formula in float64,
    and refuses one it does not know (Gemma's 1 + weight) rather than change it."""
    import torch
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRMSNorm

    from geo3k_jax.check.numerics import norms_as_written

    class OffsetRMSNorm(Qwen3VLTextRMSNorm):
        def forward(self, x):
            return super().forward(x) * 2 / self.weight * (1 + self.weight) / 2

    norm = Qwen3VLTextRMSNorm(16).double()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(4, 16, dtype=torch.float64)
    before = norm(x)  # transformers computes in float32 whatever the input
    assert norms_as_written(torch.nn.Sequential(norm)) == 1
    exact = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon) * norm.weight
    torch.testing.assert_close(norm(x), exact, rtol=1e-15, atol=1e-15)
    assert 0 < (before - exact).abs().max() < 1e-6
    with pytest.raises(NotImplementedError, match="OffsetRMSNorm"):
        norms_as_written(torch.nn.Sequential(OffsetRMSNorm(16)))


def test_the_log_prob_row_passes_on_torch_rounding_only_when_jax_is_nearer_float64():
    from geo3k_jax.check.numerics import Row, blame_torch_rounding

    def pairwise(jax_to_f64, torch_to_f64):
        row = Row("log-probs", 1.1e-5, 0.0, "abs", 1e-5)
        blame_torch_rounding(row, Row("log-probs, JAX vs float64", jax_to_f64, 0.0, "abs", 1e-5),
                             Row("log-probs, torch vs float64", torch_to_f64, 0.0, "abs", np.inf))
        return row

    assert Row("log-probs", 9e-6, 0.0, "abs", 1e-5).result == "pass"
    assert pairwise(4.8e-6, 6.9e-6).result == "pass (torch's float32 rounding)"
    assert not pairwise(6.9e-6, 4.8e-6).passed  # JAX farther from float64 than torch
    assert not pairwise(1.2e-5, 2e-5).passed  # JAX itself outside the bound
    assert Row("x", np.nan, np.nan, "abs", np.inf).result == "FAIL"
    assert Row("x", 3.0, 1.0, "abs", np.inf).passed  # a shown-only row


@pytest.mark.parametrize("ckpt", ["qwen3_vl"], indirect=True)
def test_float64_reference_setting(ckpt):
    from geo3k_jax.check.numerics import wants_float64_reference

    arch, path = ckpt
    cfg = config(path, arch)
    assert wants_float64_reference(cfg, str(path))  # auto: a small float32 check
    cfg.jax.check.dtype = "bfloat16"
    assert not wants_float64_reference(cfg, str(path))
    cfg.jax.check.float64_reference = "on"
    assert wants_float64_reference(cfg, str(path))
    cfg.jax.check.float64_reference = "off"
    assert not wants_float64_reference(cfg, str(path))
    cfg.jax.check.float64_reference = "yes"
    with pytest.raises(ValueError, match="jax.check.float64_reference"):
        wants_float64_reference(cfg, str(path))


def test_weights_after_adamw_pass_on_gradient_noise_only():
    """`step_beyond_gradients`: two first AdamW steps (the JAX optimizer, its clip included)
    from the same weights, on gradients that differ by float32 noise where they are near zero,
    differ by a large share of lr there and by nothing beyond what the noise explains; a step
    with another learning rate is not explained."""
    from ml_collections import ConfigDict

    from configs import base
    from geo3k_jax.check.numerics import Row, adamw_on, blame_gradient_noise, step_beyond_gradients

    train = ConfigDict(base.get_config().train.to_dict())
    train.lr = lr = 1e-3
    rng = np.random.default_rng(0)
    before = {"w": rng.normal(scale=0.02, size=(64, 32)).astype(np.float32)}
    g = rng.normal(scale=1e-3, size=(64, 32))
    g[:8] = rng.normal(scale=1e-9, size=(8, 32))  # near zero: float32 noise decides the step
    g_th = {"w": g.astype(np.float32)}
    g_jx = {"w": (g + rng.normal(scale=2e-9, size=g.shape)
                  * (np.abs(g) < 1e-7)).astype(np.float32)}
    after_th, after_jx = adamw_on(g_th, before, train), adamw_on(g_jx, before, train)
    moved = np.abs(after_th["w"] - after_jx["w"]).max()
    assert moved > 0.1 * lr  # the row's own bound is exceeded
    beyond = step_beyond_gradients(after_jx, after_th, g_jx, g_th, lr, train.eps)
    row = Row("params after AdamW", float(moved), 0.0, "abs", 0.1 * lr)
    blame_gradient_noise(row, beyond, 1e-6)
    assert beyond <= 1e-6 and row.result == "pass (near-zero gradients' float32 noise)"
    train.lr = 1.5 * lr  # the same gradients, another learning rate: nothing explains it
    wrong = adamw_on(g_jx, before, train)
    beyond = step_beyond_gradients(wrong, after_th, g_jx, g_th, lr, train.eps)
    row = Row("params after AdamW", float(np.abs(wrong["w"] - after_th["w"]).max()), 0.0, "abs",
              0.1 * lr)
    blame_gradient_noise(row, beyond, 1e-6)
    assert beyond > 0.1 * lr and row.result == "FAIL"
