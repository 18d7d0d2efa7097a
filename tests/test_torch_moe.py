"""Qwen3-VL-MoE (qwen3_vl_moe) in the torch learner: the tiny checkpoint, the experts as grouped
matmuls, the load-balancing loss and routing metrics, an exact resume, and GRPO steps through
the shared loop. The packed forward and the engine against transformers are
tests/test_torch_numerics.py's, parametrized over the MoE model too; FSDP2 on two processes is
tests/test_fsdp.py's; compiled layers tests/test_torch_fast_paths.py's."""

import json

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from common.grpo import LossConfig
from geo3k_torch.model import load_model, packed_inputs, token_logprobs
from tests.test_learners import LOSS, assert_resume_is_exact, step, tiny_setup, torch_learner
from tests.tiny_models import qwen3_vl, qwen3_vl_moe


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_setup(qwen3_vl_moe, tmp_path_factory.mktemp("tiny_moe"))


def test_tiny_checkpoint_is_a_qwen3_vl_moe_that_transformers_loads(tmp_path):
    """The tiny MoE checkpoint has 30B-A3B's layout (every decoder layer a sparse block, the
    top-k weights renormalised) at a few experts, loads into transformers' own class with every
    tensor, and `load_model` runs its experts as grouped matmuls."""
    from transformers import Qwen3VLMoeForConditionalGeneration
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import \
        Qwen3VLMoeTextSparseMoeBlock

    from common.processor import load_processor
    from geo3k_torch.tiny import build_tiny_checkpoint

    out = build_tiny_checkpoint(tmp_path / "moe", arch="qwen3_vl_moe", hidden_size=64)
    model, info = Qwen3VLMoeForConditionalGeneration.from_pretrained(out,
                                                                     output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}
    text = model.config.text_config
    assert (text.num_experts, text.num_experts_per_tok, text.moe_intermediate_size) == (4, 2, 24)
    assert (text.decoder_sparse_step, text.mlp_only_layers) == (1, [])
    assert all(isinstance(layer.mlp, Qwen3VLMoeTextSparseMoeBlock)
               for layer in model.model.language_model.layers)
    assert model.model.language_model.layers[0].mlp.experts.gate_up_proj.shape == (4, 48, 64)
    saved = load_file(str(out / "model.safetensors"))  # the published layout, (E, H, 2I)
    assert saved["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 48)
    assert saved["model.language_model.layers.0.mlp.experts.down_proj"].shape == (4, 24, 64)
    assert type(load_processor(out)).__name__ == "Qwen3VLImageOnlyProcessor"
    assert load_model(str(out)).config.text_config._experts_implementation == "grouped_mm"


def test_an_unknown_tiny_arch_is_refused_up_front():
    from common.prepare import check_config
    from configs import cpu

    cfg = cpu.get_config()
    cfg.model.tiny_arch = "qwen3_moe"
    with pytest.raises(ValueError, match=r"model.tiny_arch must be one of \('qwen3_vl', "
                                         r"'qwen2_5_vl', 'qwen3_vl_moe'\), got 'qwen3_moe'"):
        check_config(cfg, 1)


def _logp_and_grads(model, tiny):
    """Log-probs of the first micro-batch and the gradients of their weighted sum."""
    batch = tiny["batches"][0]
    targets = torch.from_numpy(np.flatnonzero(batch.loss_mask))
    model.zero_grad()
    logp = token_logprobs(model, packed_inputs(batch, tiny["processor"], model.config), targets)
    (logp * torch.linspace(-1, 1, len(logp))).sum().backward()
    return logp.detach(), {k: p.grad.clone() for k, p in model.named_parameters()
                           if p.grad is not None}


# bf16 measured: the same log-probs, gradients within 2e-6 (the loop sums in another order)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-4)])
def test_experts_run_as_grouped_matmuls_equal_to_the_eager_loop(tiny, monkeypatch, dtype, tol):
    """Every sparse layer's experts are two grouped matmuls (gate/up and down) per forward, not
    transformers' per-expert loop, and give its log-probs and gradients, in fp32 and bf16."""
    calls = []
    grouped_mm = torch.nn.functional.grouped_mm
    monkeypatch.setattr(torch.nn.functional, "grouped_mm",
                        lambda *a, **k: calls.append(1) or grouped_mm(*a, **k))
    model = load_model(tiny["path"], dtype)
    logp, grads = _logp_and_grads(model, tiny)
    assert len(calls) == 2 * model.config.text_config.num_hidden_layers
    model.set_experts_implementation("eager")
    calls.clear()
    eager_logp, eager_grads = _logp_and_grads(model, tiny)
    assert calls == []
    assert (logp.float() - eager_logp.float()).abs().max() <= tol
    assert grads.keys() == eager_grads.keys()
    assert any(".experts." in k for k in grads)
    for k, g in eager_grads.items():
        assert (grads[k] - g).float().norm() <= tol * max(g.float().norm(), 1e-8), k


def reference_balance_loss(logits: np.ndarray, top_k: int) -> float:
    """Switch's auxiliary loss as transformers writes it, of one layer's (K, E) router logits:
    E x sum_e (top-k assignments to e / K) x (mean probability of e)."""
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    chosen = np.argsort(-p, -1)[:, :top_k]
    f = np.bincount(chosen.ravel(), minlength=p.shape[1]) / len(p)
    return float(p.shape[1] * (f * p.mean(0)).sum())


def test_router_aux_loss_is_the_switch_loss_and_coef_0_changes_nothing(tiny, monkeypatch):
    """loss.router_aux_coef = 0 trains exactly as a learner that records no routing; 0.5 adds
    0.5 x the token-weighted mean over micro-batches of the per-layer mean Switch loss of their
    trained tokens (computed here from transformers' own router logits), and the routing
    metrics are those of the same logits."""
    from geo3k_torch import learner as learner_module

    def trained(learner):
        m = step(learner, tiny)
        return m, {k: p.detach().clone() for k, p in learner.model.named_parameters()}

    m0, w0 = trained(torch_learner(tiny))
    with monkeypatch.context() as patch:
        patch.setattr(learner_module.Routing, "of", classmethod(lambda cls, model: None))
        plain, w_plain = trained(torch_learner(tiny))
    assert "router_aux_loss" not in plain and m0["loss"] == plain["loss"]
    assert all(torch.equal(w0[k], w_plain[k]) for k in w0)

    m, w = trained(torch_learner(tiny, loss=LossConfig(**{**LOSS.__dict__,
                                                          "router_aux_coef": 0.5})))
    model = load_model(tiny["path"])  # packed attention: no sequence attends to another
    aux, counts, entropy = 0.0, np.zeros((2, 4)), 0.0
    for batch in tiny["batches"]:
        with torch.no_grad():
            out = model.model(**packed_inputs(batch, tiny["processor"], model.config),
                              output_router_logits=True)
        layers = [x.numpy()[np.flatnonzero(batch.loss_mask)] for x in out.router_logits]
        aux += np.mean([reference_balance_loss(x, 2) for x in layers]) * len(layers[0])
        for i, x in enumerate(layers):
            counts[i] += np.bincount(np.argsort(-x, -1)[:, :2].ravel(), minlength=4)
            logp = x - np.log(np.exp(x).sum(-1, keepdims=True))
            entropy -= (np.exp(logp) * logp).sum() / len(layers)
    aux, entropy = aux / tiny["n_tokens"], entropy / tiny["n_tokens"]
    assert 2 - 1e-3 < aux < 4  # k (= 2) when balanced, E (= 4) when every token picks the same
    assert m["loss"] - m0["loss"] == pytest.approx(0.5 * aux, rel=1e-5)
    assert m0["router_aux_loss"] == m["router_aux_loss"] == pytest.approx(aux, rel=1e-5)
    assert m["router_entropy"] == pytest.approx(entropy, rel=1e-5)
    share = 4 * counts / counts.sum(-1, keepdims=True)
    assert (m["router_load_max"], m["router_load_min"]) == pytest.approx(
        (share.max(), share.min()))
    assert m["router_load_cv"] == pytest.approx(np.mean(share.std(-1)))  # mean share is 1
    routers = [k for k in w if k.endswith("mlp.gate.weight")]
    assert len(routers) == 2 and all(not torch.equal(w[k], w0[k]) for k in routers)


def test_router_aux_loss_needs_a_moe_model(tmp_path):
    from geo3k_torch.learner import Learner
    from tests.jax_learner_setup import train_config

    with pytest.raises(ValueError, match="router_aux_coef > 0 needs a MoE model"):
        Learner(qwen3_vl()[0], None, LossConfig(router_aux_coef=0.1), train_config(), 1.0)


def test_resumed_moe_step_equals_uninterrupted(tiny, tmp_path):
    """DCP state (the experts' 3-D tensors, AdamW's moments of them) and HF export round-trip:
    a step after restore equals the uninterrupted learner's exactly."""
    assert_resume_is_exact(lambda t: torch_learner(t, loss=LossConfig(router_aux_coef=0.01)),
                           tiny, tmp_path)


@pytest.mark.slow
def test_grpo_steps_through_the_loop_train_the_moe_model(tmp_path):
    """configs/cpu.py's loop (local engine, torch learner, evaluation, checkpoints) on a tiny
    MoE checkpoint with the load-balancing loss on: finite losses, the routing metrics in
    metrics.jsonl, and a checkpoint transformers loads as Qwen3-VL-MoE with moved weights."""
    from transformers import Qwen3VLMoeForConditionalGeneration

    from common import checkpoints
    from geo3k_torch import main as train_main
    from tests.test_train_loop import small_config

    cfg = small_config(tmp_path, 2)
    cfg.model.tiny_arch, cfg.model.tiny_dir = "qwen3_vl_moe", str(tmp_path / "tiny_moe")
    cfg.loss.router_aux_coef = 0.01
    train_main.train(cfg, str(tmp_path / "run"))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in trained] == [1, 2]
    for r in trained:
        assert np.isfinite(r["train/loss"]) and r["train/grad_norm"] > 0
        assert r["train/router_aux_loss"] >= 2 - 1e-3  # top-2: at least 2
        assert 0 <= r["train/router_load_min"] <= 1 <= r["train/router_load_max"] <= 2
        assert 0 < r["train/router_entropy"] <= np.log(4)
    ckpt = checkpoints.latest(tmp_path / "run" / "checkpoints")
    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(ckpt)
    assert model.config.model_type == "qwen3_vl_moe"
    before = load_file(str(tmp_path / "tiny_moe" / "model.safetensors"))
    after = load_file(str(ckpt / "model.safetensors"))
    assert before.keys() == after.keys()
    moved = [k for k in before if not np.array_equal(before[k], after[k])]
    assert any(".experts." in k for k in moved) and any("mlp.gate." in k for k in moved)


@pytest.mark.slow  # compiles (about 30 s on two cores)
def test_compiled_moe_layers_record_the_routing_in_one_graph(tiny):
    """train.compile with selective checkpointing: the MoE learner's step (load-balancing loss
    on) equals the eager one, metrics included, and the routers' recording breaks no graph nor
    compiles a layer twice (4 graphs, as the dense model's in the same step; a hook appending
    to one list gave 6, and checkpointing's side-effect rule broke the layers' graph)."""
    from torch._dynamo.utils import counters

    from geo3k_torch.model import compile_layers

    loss = LossConfig(router_aux_coef=0.1)
    eager = step(torch_learner(tiny, loss=loss), tiny)
    torch._dynamo.reset()
    counters.clear()
    learner = torch_learner(tiny, loss=loss)
    compile_layers(learner.model, "selective", backend="aot_eager")
    compiled = step(learner, tiny)
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == 4
    assert compiled.keys() == eager.keys() and "router_load_cv" in compiled
    for k, v in eager.items():
        assert compiled[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k


def test_sharded_load_reads_the_hub_layout_of_the_experts(tmp_path):
    """Qwen3-VL-MoE checkpoints on the Hub hold the experts transposed, (E, H, 2I) and
    (E, I, H), and so do the ones this project writes (`checkpoint.save_published`); FSDP2's
    meta-device load (`load_sharded`, rank 0 reading the safetensors) turns them into
    transformers' layout as `from_pretrained` does: every tensor equals `load_model`'s (with the
    file's own layout the shapes would not even fit). A file in transformers' own layout (what
    `save_pretrained` writes) loads the same."""
    from safetensors.torch import load_file as load_torch, save_file

    from geo3k_torch import checkpoint
    from geo3k_torch.model import load_sharded
    from geo3k_torch.tiny import build_tiny_checkpoint
    from tests.torch_group import one_process_group

    out = build_tiny_checkpoint(tmp_path / "moe", arch="qwen3_vl_moe", hidden_size=64,
                                moe_intermediate_size=16)
    hub = load_torch(str(out / "model.safetensors"))
    assert hub["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 32)
    plain = load_model(str(out)).state_dict()
    assert torch.equal(plain["model.language_model.layers.0.mlp.experts.down_proj"],
                       hub["model.language_model.layers.0.mlp.experts.down_proj"].transpose(1, 2))
    for layout in ("hub", "transformers"):
        if layout == "transformers":
            save_file({k: v.transpose(1, 2).contiguous() if ".experts." in k else v
                       for k, v in hub.items()}, str(out / "model.safetensors"),
                      metadata={"format": "pt"})
        with one_process_group():
            sharded = checkpoint.full_state_dict(load_sharded(str(out), "cpu", bf16=False))
        assert sharded.keys() == plain.keys()
        assert all(torch.equal(sharded[k], plain[k]) for k in plain), layout


def test_flops_count_the_weights_a_token_meets():
    """A MoE decoder layer's matmul weights per token (MFU, `common.flops`): its attention, the
    router and top-k experts, not all E; a dense layer (`mlp_only_layers`) its own MLP."""
    from common.flops import matmul_params

    model = qwen3_vl_moe()[0]
    layer = model.model.language_model.layers[0]
    attn = sum(m.weight.numel() for m in layer.self_attn.modules()
               if isinstance(m, torch.nn.Linear))
    experts = layer.mlp.experts
    moe = layer.mlp.gate.weight.numel() + 2 * (experts.gate_up_proj[0].numel()
                                               + experts.down_proj[0].numel())
    assert matmul_params(model.config)["layer"] == attn + moe
    text = model.config.text_config
    text.mlp_only_layers = [1]  # one of the two layers dense: the mean of the two
    dense = 3 * text.hidden_size * text.intermediate_size
    assert matmul_params(model.config)["layer"] == attn + (moe + dense) / 2


def test_the_engine_copy_receives_the_trained_experts(tiny):
    """`copy_weights` (the engine's own copy, `LocalBackend`): after a step the engine's model
    holds the learner's weights, the experts' 3-D tensors and the routers included."""
    from geo3k_torch.backend import copy_weights

    learner, engine_model = torch_learner(tiny), load_model(tiny["path"]).eval()
    step(learner, tiny)
    copy_weights(learner.model, engine_model)
    trained, copied = learner.model.state_dict(), engine_model.state_dict()
    first = load_model(tiny["path"]).state_dict()
    assert all(torch.equal(trained[k], copied[k]) for k in trained)
    moved = [k for k in trained if not torch.equal(trained[k], first[k])]
    assert any(".experts.gate_up_proj" in k for k in moved) and any("mlp.gate" in k for k in moved)


def test_sglang_receives_the_experts_in_the_published_layout(tmp_path):
    """SGLang 0.5.23's Qwen3-VL-MoE loader transposes a fused expert weight whatever its shape
    (it expects the Hub's (E, H, 2I) and (E, I, H)): the in-memory sync sends that layout, the
    model's weights transposed, not transformers' (E, 2I, H)."""
    import base64
    import pickle

    from geo3k_torch.tiny import build_tiny_checkpoint
    from geo3k_torch.weight_sync import TorchWeights

    src = build_tiny_checkpoint(tmp_path / "moe", arch="qwen3_vl_moe", hidden_size=64)
    model = load_model(str(src))
    got = {}
    for payload, _ in TorchWeights(model, src).tensor_buckets(1 << 20):
        got.update(pickle.loads(base64.b64decode(payload)))
    for n, (e, h, i) in (("gate_up_proj", (4, 64, 48)), ("down_proj", (4, 24, 64))):
        name = f"model.language_model.layers.1.mlp.experts.{n}"
        assert got[name].shape == (e, h, i)
        assert torch.equal(got[name], model.get_parameter(name).detach().transpose(1, 2)
                           .to(torch.bfloat16))
