"""The torch learner's weights as SGLang loads them (geo3k_torch.weight_sync) against
`save_pretrained`'s own export: the same names (Qwen2.5-VL's are renamed back to its checkpoint
layout, "visual.*", "model.layers.*"), the same values in bf16, in buckets of the asked size,
and bf16 shards that transformers loads back. The FSDP2 path (DTensors gathered per bucket) is
pinned in tests/test_fsdp.py, SGLang's unpickler in tests/test_sglang_real.py."""

import base64
import json
import pickle

import pytest
import torch
from safetensors.torch import load_file

from geo3k_torch import checkpoint
from geo3k_torch.model import load_model
from geo3k_torch.tiny import build_tiny_checkpoint
from geo3k_torch.weight_sync import TorchWeights


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen2_5_vl", "qwen3_vl_moe"])
def tiny(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    build_tiny_checkpoint(d / "src", arch=request.param)
    model = load_model(str(d / "src"))
    checkpoint.write_hf(d / "hf", model, str(d / "src"))  # transformers' own export
    exported = {}
    for f in (d / "hf").glob("*.safetensors"):
        exported.update(load_file(f))
    return d, model, exported


def test_buckets_hold_what_save_pretrained_writes_in_bf16(tiny):
    d, model, exported = tiny
    got, sizes, lasts = {}, [], []
    bucket = 1 << 16
    for payload, last in TorchWeights(model, d / "src").tensor_buckets(bucket):
        named = pickle.loads(base64.b64decode(payload))
        sizes.append(sum(t.numel() * 2 for _, t in named))
        assert all(n not in got for n, _ in named)  # every weight once
        got.update(named)
        lasts.append(last)
    assert sorted(got) == sorted(exported)  # names: the checkpoint's (tied embedding once)
    assert all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], v.to(torch.bfloat16))
               for k, v in exported.items())
    assert lasts == [False] * (len(lasts) - 1) + [True] and len(lasts) > 2
    biggest = max(t.numel() * 2 for t in exported.values())
    assert max(sizes) <= max(bucket, biggest)


def test_bf16_shards_load_back_in_transformers(tiny, tmp_path):
    d, model, exported = tiny
    TorchWeights(model, d / "src").write_safetensors(tmp_path, 1 << 16)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(index["weight_map"]) == sorted(exported)
    assert index["metadata"]["total_size"] == sum(v.numel() * 2 for v in exported.values())
    reloaded = load_model(str(tmp_path))  # config and processor files came along
    mine = {k: v for k, v in model.state_dict().items()}
    assert all(torch.equal(v, mine[k].to(torch.bfloat16).float())
               for k, v in reloaded.state_dict().items())


CONSUMER = """
import base64, json, pickle, sys
import torch
for line in sys.stdin:  # one payload a line; each answered before the learner moves on
    named = pickle.loads(base64.b64decode(line))
    print(json.dumps({n: [str(t.device), t.float().sum().item()] for n, t in named}), flush=True)
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_payloads_open_in_another_process(tiny):
    """On CUDA a payload carries IPC handles: another process on the same GPU (as a colocated
    SGLang server is) opens them and reads the learner's bf16 weights, on the learner's device.
    One consumer process reads every bucket while the learner holds it, as SGLang does."""
    import subprocess
    import sys

    d, model, exported = tiny
    model = model.to("cuda")
    device = f"cuda:{torch.cuda.current_device()}"
    seen = {}
    consumer = subprocess.Popen([sys.executable, "-c", CONSUMER], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for payload, _ in TorchWeights(model, d / "src").tensor_buckets(1 << 16):
            consumer.stdin.write(payload.strip() + "\n")
            consumer.stdin.flush()
            line = consumer.stdout.readline()
            assert line, consumer.stderr.read()[-2000:]
            seen.update(json.loads(line))
    finally:
        consumer.stdin.close()
        assert consumer.wait(timeout=60) == 0, consumer.stderr.read()[-2000:]
    assert sorted(seen) == sorted(exported)
    for n, (dev, total) in seen.items():
        want = exported[n].to(torch.bfloat16).float().sum().item()
        assert dev == device and total == pytest.approx(want, rel=1e-3, abs=1e-3), n
