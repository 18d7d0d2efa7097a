"""The torch learner's activation memory measured on the tiny Qwen3-VL on CPU
(`geo3k_torch.memory`), and `train.micro_batch_tokens="auto"` resolved from it."""

import numpy as np
import pytest
import torch

from common.learner import SingleProcess
from common.micro_batch import choose
from configs import base
from tests.test_precision import LOSS, data, model  # noqa: F401 - data: a fixture
from tests.tiny_models import ImageOnlyProcessor

SIZES = (256, 512)  # probe micro-batches small enough for a quick CPU test
SEQ = 128


def learner(**kw):
    from geo3k_torch.learner import Learner

    return Learner(model(False), ImageOnlyProcessor(16), LOSS, base.get_config().train, 0.8, **kw)


def test_checkpointing_keeps_less_and_the_cost_is_linear_in_tokens(data):  # noqa: F811
    from geo3k_torch.memory import measure

    _, batches, n_tokens, n_seqs = data
    x = learner()
    before = {n: p.detach().clone() for n, p in x.model.named_parameters()}
    costs = {c.mode: c for c in measure(x, ("none", "selective", "full"), SEQ, sizes=SIZES)}
    # measured: none 14.4 KB a token, selective 7.9 KB, full 3.6 KB. The saved-tensor hooks
    # would measure selective as full (its kept matmul outputs live in a cache they never see)
    assert costs["full"].per_token < 0.6 * costs["selective"].per_token
    assert costs["selective"].per_token < 0.7 * costs["none"].per_token
    # twice the tokens: the same line (a cost per token that depended on the probe's size, or
    # a fixed part that grew with it, would move it)
    again = {c.mode: c for c in measure(x, ("none", "full"), SEQ, sizes=(512, 1024))}
    for mode in again:
        assert again[mode].per_token == pytest.approx(costs[mode].per_token, rel=0.01)
        assert abs(costs[mode].fixed) < 0.05 * SIZES[0] * costs[mode].per_token
    # the probes leave no trace: no gradients, no optimizer state, the same weights, and the
    # next step is a fresh learner's
    assert all(p.grad is None for p in x.model.parameters()) and not x.optimizer.state
    assert all(torch.equal(p, before[n]) for n, p in x.model.named_parameters())
    from geo3k_torch.model import checkpoint_layers
    checkpoint_layers(x.model, "none")
    a, b = (y.train_step(batches, n_tokens, n_seqs) for y in (x, learner()))
    assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]


def test_master_weights_measure_bf16_activations():
    from geo3k_torch.memory import measure

    fp32, = measure(learner(), ("full",), SEQ, sizes=SIZES)
    bf16, = measure(learner(master_weights=True), ("full",), SEQ, sizes=SIZES)
    assert 0.4 < bf16.per_token / fp32.per_token < 0.75  # bf16 hidden states, fp32 log-probs


def test_auto_resolves_to_the_choice_on_the_measured_costs(monkeypatch, capsys):
    from geo3k_torch import memory

    x = learner()
    monkeypatch.setattr(memory, "PROBE_TOKENS", SIZES)
    cfg = base.get_config()
    cfg.train.micro_batch_tokens = "auto"
    cfg.rollout.max_context_tokens = SEQ
    pending = memory.pending_bytes(x)
    # the fp32 gradients and AdamW's two moments of every parameter, none allocated yet
    assert pending == 3 * 4 * sum(p.numel() for p in x.model.parameters())
    free = pending + (64 << 20)  # 64 MiB beyond the first step's state
    monkeypatch.setattr(memory, "free_bytes", lambda device: free)
    tokens = memory.resolve(cfg, x, SingleProcess(), reserved=8 << 20)
    costs = memory.measure(x, ("none",), SEQ, sizes=SIZES)  # a CPU run never checkpoints
    want = choose(costs, (56 << 20), 0.1, 32768, SEQ)
    assert tokens == want.tokens == cfg.train.micro_batch_tokens and tokens % 1024 == 0
    assert 2048 <= tokens < 8192  # 56 MiB x 0.9 / ~14 KB a token
    assert cfg.train.activation_checkpointing == "full"  # the CUDA setting, untouched on CPU
    out = capsys.readouterr().out
    assert f"train.micro_batch_tokens=auto: {tokens} tokens" in out and "reserved" in out
    # a number is kept as it is, nothing measured
    assert memory.resolve(cfg, x, SingleProcess()) == tokens
    # too little memory for one episode: refused, saying so
    cfg.train.micro_batch_tokens = "auto"
    monkeypatch.setattr(memory, "free_bytes", lambda device: pending + (1 << 20))
    with pytest.raises(ValueError, match="no checkpointing mode holds one episode"):
        memory.resolve(cfg, x, SingleProcess())


def test_the_entry_point_resolves_auto_before_the_loop(tmp_path, monkeypatch, capsys):
    """geo3k_torch.main.build measures and writes a number into the config; the loop trains
    on it (its step settings refuse "auto")."""
    from common import train as loop
    from geo3k_torch import main, memory
    from tests.test_train_loop import small_config

    cfg = small_config(tmp_path / "shared", 1)
    cfg.eval.every, cfg.checkpoint.every = 0, 1
    cfg.train.micro_batch_tokens = "auto"
    with pytest.raises(ValueError, match="the loop .* takes a number"):
        loop.step_config(cfg)
    monkeypatch.setattr(memory, "free_bytes", lambda device: 1 << 30)
    run = main.build(cfg, str(tmp_path / "run"))
    assert isinstance(cfg.train.micro_batch_tokens, int) and cfg.train.micro_batch_tokens >= 1024
    assert "train.micro_batch_tokens=auto:" in capsys.readouterr().out
    metrics = loop.train(cfg, str(tmp_path / "run"), run)
    assert np.isfinite(metrics["train/loss"]) and metrics["train/skipped"] == 0.0


def test_host_memory_is_read_on_cpu():
    from geo3k_torch.memory import free_bytes

    assert free_bytes(torch.device("cpu")) > 1 << 26
    assert np.isfinite(free_bytes(torch.device("cpu")))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_measures_the_peak_and_auto_picks_a_mode(capsys):
    """On CUDA the forward-and-backward peak is read too (never below what the forward leaves
    alive), every mode is measured, and "auto" applies the mode it chose."""
    from geo3k_torch import memory
    from geo3k_torch.learner import Learner

    device = torch.device("cuda", 0)
    cfg = base.get_config()
    x = Learner(model(False).to(device), ImageOnlyProcessor(16), LOSS, cfg.train, 0.8, device)
    assert x.master is not None  # one GPU: bf16 over fp32 masters
    costs = {c.mode: c for c in memory.measure(x, ("none", "selective", "full"), SEQ,
                                               sizes=SIZES)}
    assert costs["full"].per_token < costs["none"].per_token
    cfg.train.micro_batch_tokens, cfg.rollout.max_context_tokens = "auto", SEQ
    tokens = memory.resolve(cfg, x, SingleProcess())
    assert tokens >= 32768 and cfg.train.activation_checkpointing == "none"  # the tiny model
    assert "auto:" in capsys.readouterr().out
