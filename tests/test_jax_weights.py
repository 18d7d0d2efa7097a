"""HF checkpoint directories <-> JAX parameters (geo3k_jax.models.weights): exact loading, key
errors that name the key, legacy and sharded layouts, and exports that transformers loads."""

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from transformers import AutoModelForImageTextToText

from geo3k_jax.core.batch import attention_windows
from geo3k_jax.models.model import split_params
from geo3k_jax.core.stacking import to_hf
from geo3k_jax.models import weights
from geo3k_jax.models.weights import CheckpointError, canonical_key, load_model, save_hf
from geo3k_torch.tiny import build_tiny_checkpoint

jax.config.update("jax_default_matmul_precision", "highest")

SHAPES = {
    "qwen3_vl": dict(hidden_size=96, heads=6, kv_heads=3, layers=3, vision_depth=3,
                     vision_hidden=48, vision_heads=2, patch_size=8),
    "qwen2_5_vl": dict(hidden_size=64, heads=2, kv_heads=1, layers=2, vision_depth=4,
                       vision_hidden=64, vision_heads=4, patch_size=10, window_size=40),
    # the tiny checkpoint's experts: 2I = hidden, so only down_proj's shape tells the layouts apart
    # 2I = hidden: gate_up_proj's two layouts share a shape (written in transformers' own)
    "qwen3_vl_moe": dict(hidden_size=96, heads=6, kv_heads=3, layers=2, vision_depth=2,
                         vision_hidden=48, vision_heads=2, patch_size=8, moe_intermediate_size=48),
}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def ckpt(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    return build_tiny_checkpoint(out / "ckpt", arch=request.param, seed=3, **SHAPES[request.param])


def hf_params(path) -> dict:
    model = AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32)
    return {k: p.detach().numpy() for k, p in model.named_parameters()}, model


def test_load_is_exact(ckpt):
    """Every checkpoint tensor arrives unchanged; decoder layers stacked along a first axis
    (`geo3k_jax.core.stacking`), one key per tensor kind."""
    model, config = load_model(ckpt)
    _, stacked = split_params(model)
    layers = config.text_config.num_hidden_layers
    norm = stacked["model.language_model.layers.input_layernorm.weight"]
    assert norm.shape == (layers, config.text_config.hidden_size)
    assert not any(k.startswith("model.language_model.layers.0.") for k in stacked)
    params = to_hf(stacked)
    ref, _ = hf_params(ckpt)
    assert set(params) == set(ref)
    for k, v in ref.items():
        np.testing.assert_array_equal(np.asarray(params[k]), v, err_msg=k)
    assert config.model_type in SHAPES


def rewrite(ckpt, tmp_path, edit):
    """A copy of `ckpt` whose tensors went through edit(dict) -> dict."""
    out = tmp_path / "edited"
    out.mkdir()
    for f in ckpt.iterdir():
        if f.name != "model.safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    save_file(edit(load_file(str(ckpt / "model.safetensors"))), str(out / "model.safetensors"))
    return out


def test_missing_key_is_named(ckpt, tmp_path):
    key = "model.language_model.layers.1.input_layernorm.weight"
    bad = rewrite(ckpt, tmp_path, lambda t: {k: v for k, v in t.items() if canonical_key(k) != key})
    with pytest.raises(CheckpointError, match=f"missing keys.*{key}"):
        load_model(bad)


def test_unexpected_key_is_named(ckpt, tmp_path):
    bad = rewrite(ckpt, tmp_path, lambda t: {**t, "model.visual.extra.weight": np.ones(3)})
    with pytest.raises(CheckpointError, match="unexpected keys.*model.visual.extra.weight"):
        load_model(bad)


def test_misshaped_key_is_named(ckpt, tmp_path):
    key = "model.language_model.norm.weight"
    bad = rewrite(ckpt, tmp_path, lambda t: {k: np.ones(7, np.float32) if canonical_key(k) == key
                                             else v for k, v in t.items()})
    with pytest.raises(CheckpointError, match=r"norm\.weight'.*shape \(7,\)"):
        load_model(bad)


EXPERT = "model.language_model.layers.{}.mlp.experts.{}"


@pytest.mark.parametrize("ckpt", ["qwen3_vl_moe"], indirect=True)
def test_published_expert_layout_loads_the_same(ckpt, tmp_path):
    """The Hub checkpoints' experts, (E, hidden, 2I) and (E, I, hidden), load as transformers 5's
    (E, 2I, hidden) and (E, hidden, I): here 2I = hidden, so gate_up_proj's shape alone cannot
    tell (a loader deciding by it would keep the transposed matrix), its layer's down_proj does."""
    experts = {EXPERT.format(i, n) for i in range(2) for n in ("gate_up_proj", "down_proj")}
    published = rewrite(ckpt, tmp_path, lambda t: {
        k: np.ascontiguousarray(v.swapaxes(1, 2)) if k in experts else v for k, v in t.items()})
    want = to_hf(split_params(load_model(ckpt)[0])[1])
    got = to_hf(split_params(load_model(published)[0])[1])
    gate_up = EXPERT.format(0, "gate_up_proj")
    assert want[gate_up].shape[1] == want[gate_up].shape[2]
    assert not np.array_equal(want[gate_up], np.swapaxes(want[gate_up], 1, 2))
    for k, v in want.items():
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(v), err_msg=k)


@pytest.mark.parametrize("ckpt", ["qwen3_vl_moe"], indirect=True)
def test_experts_in_neither_layout_are_named(ckpt, tmp_path):
    down = EXPERT.format(1, "down_proj")
    bad = rewrite(ckpt, tmp_path, lambda t: {
        k: np.ones((4, 50, 96), np.float32) if k == down else v for k, v in t.items()})
    with pytest.raises(CheckpointError, match=r"layers\.1\.mlp\.experts\.down_proj.*neither"):
        load_model(bad)


def test_legacy_layout_and_sharded_index(ckpt, tmp_path):
    """Older Qwen2.5-VL files (`visual.*`, `model.layers.*`), split over two shards."""
    tensors = {canonical_key(k): v for k, v in load_file(str(ckpt / "model.safetensors")).items()}
    legacy = {k.replace("model.visual.", "visual.").replace("model.language_model.", "model."): v
              for k, v in tensors.items()}
    assert all(canonical_key(k) in tensors for k in legacy)
    out = tmp_path / "legacy"
    out.mkdir()
    for f in ckpt.iterdir():
        if f.name != "model.safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    keys = sorted(legacy)
    shards = {"model-00001-of-00002.safetensors": keys[::2],
              "model-00002-of-00002.safetensors": keys[1::2]}
    for name, ks in shards.items():
        save_file({k: legacy[k] for k in ks}, str(out / name))
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: n for n, ks in shards.items() for k in ks}}))
    model, _ = load_model(out)
    params = to_hf(split_params(model)[1])
    for k, v in tensors.items():
        np.testing.assert_array_equal(np.asarray(params[k]), v)


def test_no_weights_is_an_error(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(Exception):
        load_model(tmp_path)


@pytest.mark.slow
def test_export_loads_in_transformers_with_the_same_logits(ckpt, tmp_path):
    """Change the JAX weights, export, load with transformers: its logits are the JAX ones."""
    model, config = load_model(ckpt)
    merge, params = split_params(model)
    rng = np.random.default_rng(0)
    params = {k: v + 0.01 * rng.standard_normal(v.shape).astype(np.float32)
              for k, v in params.items()}
    out = save_hf(merge(params), config, tmp_path / "export", source_dir=ckpt)
    ref, hf = hf_params(out)
    for k, v in to_hf(params).items():
        np.testing.assert_array_equal(np.asarray(v), ref[k], err_msg=k)
    assert set(to_hf(params)) == set(ref)
    assert (out / "tokenizer.json").exists() and (out / "chat_template.jinja").exists()
    ids = rng.integers(0, config.text_config.vocab_size - 4, (1, 40))
    segments = np.zeros((1, 40), np.int32)
    batch = {"input_ids": ids.astype(np.int32),
             "positions": np.broadcast_to(np.arange(40), (1, 3, 40)).astype(np.int32),
             "segments": segments, **attention_windows(segments)}
    jax_logits = np.asarray(merge(params).logits(merge(params).hidden_states(batch)))
    with torch.no_grad():
        torch_logits = hf(input_ids=torch.from_numpy(ids)).logits.numpy()
    np.testing.assert_allclose(jax_logits, torch_logits, rtol=0,
                               atol=1e-5 * np.abs(torch_logits).max())


def test_bf16_export_round_trip(ckpt, tmp_path):
    model, config = load_model(ckpt)
    out = save_hf(model, config, tmp_path / "bf16", dtype=jnp.bfloat16)
    hf = AutoModelForImageTextToText.from_pretrained(str(out))
    assert next(hf.parameters()).dtype == torch.bfloat16
    back, _ = load_model(out, dtype=jnp.bfloat16)
    _, a = split_params(model)
    _, b = split_params(back)
    for k in a:
        assert b[k].dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(b[k]), np.asarray(a[k]).astype(ml_dtypes.bfloat16))


def test_owners_balance_bytes_and_agree_everywhere():
    sizes = {"a": 10, "b": 7, "c": 6, "d": 3, "e": 3, "f": 1}
    # largest first, each to the lightest writer (ties: the lower index)
    assert weights.owners(sizes, 2) == {"a": 0, "b": 1, "c": 1, "d": 0, "e": 0, "f": 1}
    assert weights.owners(sizes, 1) == dict.fromkeys(sizes, 0)
    assert set(weights.owners({"x": 5}, 3).values()) == {0}  # more writers than tensors
    assert [weights.shard_name(i, 2) for i in range(2)] == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert weights.shard_name(0, 1) == "model.safetensors"


def test_each_host_writes_its_own_bf16_shard(ckpt, tmp_path, monkeypatch):
    """Two hosts' exports (the process index and count set by hand; on one process every array
    is addressable): each writes only its shard, host 0 the index and config; together they are
    the model in bf16 that transformers and `load_model` read."""
    model, config = load_model(ckpt)
    out = tmp_path / "export"
    monkeypatch.setattr(weights.jax, "process_count", lambda: 2)
    monkeypatch.setattr(weights.multihost_utils, "sync_global_devices", lambda name: None)
    for me in (1, 0):
        monkeypatch.setattr(weights.jax, "process_index", lambda me=me: me)
        save_hf(model, config, out, dtype=jnp.bfloat16, source_dir=ckpt)
        if me == 1:  # host 1: its shard alone
            assert [f.name for f in out.iterdir()] == ["model-00002-of-00002.safetensors"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    two = [load_file(str(out / f"model-0000{i}-of-00002.safetensors")) for i in (1, 2)]
    assert two[0] and two[1] and not set(two[0]) & set(two[1])
    assert index["weight_map"] == {k: f"model-0000{i + 1}-of-00002.safetensors"
                                   for i, shard in enumerate(two) for k in shard}
    assert index["metadata"]["total_size"] == 2 * sum(v.size for s in two for v in s.values())
    assert (out / "tokenizer.json").exists() and not (out / "model.safetensors").exists()
    hf = AutoModelForImageTextToText.from_pretrained(str(out))
    assert next(hf.parameters()).dtype == torch.bfloat16
    back, _ = load_model(out, dtype=jnp.bfloat16)
    a, b = split_params(model)[1], split_params(back)[1]
    for k in a:
        np.testing.assert_array_equal(np.asarray(b[k]), np.asarray(a[k]).astype(ml_dtypes.bfloat16))


@pytest.mark.heavy
def test_each_parameter_is_gathered_to_its_writer_alone(tmp_path):
    """`weights.gather_to` on 2 CPU processes of 2 devices each (gloo; mesh fsdp 2 x tensor 2,
    a tensor group a process): each layout comes whole to the owner and to no one else, by
    point-to-point sends (a collective permute, no all-gather), the owner receiving only the
    blocks its own devices lack: 2 of an array split over fsdp and tensor (4 blocks, 2 of them
    its own), 1 of one split over fsdp alone (its copy on the other process's second device
    does not travel too); none of one split over tensor alone or replicated (its devices hold
    every block). An
    all-gather would give the other process the array too, and its program an all-gather."""
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(root),
               XLA_FLAGS=os.environ.get("XLA_FLAGS", "")
               + " --xla_force_host_platform_device_count=2")
    procs = [subprocess.Popen([sys.executable, "-m", "tests.jax_export_worker", str(i),
                               str(port), str(tmp_path)], cwd=root, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), logs[0][-3000:] + logs[1][-3000:]
    runs = [json.loads((tmp_path / f"gather_{i}.json").read_text()) for i in range(2)]
    for pid, r in enumerate(runs):
        for name in ("fsdp_tensor", "tensor", "fsdp", "replicated"):
            for owner in (0, 1):
                assert r["got"][f"{name}_{owner}"] is (True if owner == pid else None)
        p = r["programs"]
        for owner in (0, 1):
            mine = owner == pid
            assert p[f"fsdp_tensor_{owner}"] == {"rounds": 1, "blocks_received": 2 * mine,
                                                 "permute": True, "all_gather": False}
            assert p[f"fsdp_{owner}"] == {"rounds": 1, "blocks_received": 1 * mine,
                                          "permute": True, "all_gather": False}
            for name in ("tensor", "replicated"):
                assert p[f"{name}_{owner}"]["rounds"] == 0


def test_the_export_writes_the_published_expert_layout(tmp_path):
    """Where the two layouts differ in shape (hidden 96, I 32) the export holds the experts as
    the published checkpoints do, (E, hidden, 2I) and (E, I, hidden), as the torch learner's;
    it loads back to the same parameters."""
    src = build_tiny_checkpoint(tmp_path / "src", arch="qwen3_vl_moe", seed=3,
                                **SHAPES["qwen3_vl_moe"] | {"moe_intermediate_size": 32})
    model, config = load_model(src)
    out = save_hf(model, config, tmp_path / "export")
    saved = load_file(str(out / "model.safetensors"))
    assert saved[EXPERT.format(0, "gate_up_proj")].shape == (4, 96, 64)
    assert saved[EXPERT.format(1, "down_proj")].shape == (4, 32, 96)
    torch_saved = load_file(str(src / "model.safetensors"))  # the torch learner's build
    for k, v in saved.items():
        np.testing.assert_array_equal(v, torch_saved[k], err_msg=k)
    _, a = split_params(model)
    _, b = split_params(load_model(out)[0])
    for k in a:
        np.testing.assert_array_equal(np.asarray(b[k]), np.asarray(a[k]), err_msg=k)
