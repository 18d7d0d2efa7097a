"""The JAX Qwen-VL models (geo3k_jax.models.model/text) against transformers, fp32 on CPU.

Weights are copied by name from randomly initialised transformers models (norm weights and
biases re-drawn so every parameter matters); packed rows of several sequences with several
images of different sizes go through both, the JAX side under jit.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen3VLConfig, \
    Qwen3VLForConditionalGeneration, Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

from common.batching import TrainSequence, pack
from geo3k_jax.core.batch import device_batch
from geo3k_jax.models.model import QwenVL, split_params, token_logprobs
from geo3k_jax.core.stacking import from_hf, to_hf
from geo3k_jax.models.text import MRoPE, mrope_rows
from geo3k_torch.model import packed_inputs, token_logprobs as torch_logprobs
from tests.tiny_models import IDS, VOCAB, ImageOnlyProcessor, image, prompt_ids

jax.config.update("jax_default_matmul_precision", "highest")


def qwen3(tie=True, moe=False, **text):
    """moe: Qwen3-VL-MoE, every decoder layer 4 experts of which 2 per token (moe_intermediate
    16: neither 2 I nor I is the hidden size, so a transposed expert would not fit)."""
    t = dict(hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=6,
             num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, attention_bias=False,
             rope_scaling={"rope_type": "default", "mrope_section": [4, 2, 2],
                           "mrope_interleaved": True})
    t.update(text)
    if moe:
        t.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                 decoder_sparse_step=1, mlp_only_layers=[])
    config, model = ((Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration) if moe
                     else (Qwen3VLConfig, Qwen3VLForConditionalGeneration))
    c = config(text_config=t, vision_config=dict(
        depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=48,
        patch_size=14, spatial_merge_size=2, deepstack_visual_indexes=[0, 2],
        num_position_embeddings=36), tie_word_embeddings=tie, **IDS)
    return model(c), 14


def qwen25(tie=False):
    c = Qwen2_5_VLConfig(text_config=dict(
        hidden_size=60, intermediate_size=96, num_hidden_layers=2, num_attention_heads=3,
        num_key_value_heads=1, vocab_size=VOCAB, rope_scaling={
            "rope_type": "default", "mrope_section": [2, 4, 4]}),
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=4,
                           out_hidden_size=60, patch_size=16, spatial_merge_size=2,
                           window_size=64, fullatt_block_indexes=[2]),
        tie_word_embeddings=tie, **IDS)
    return Qwen2_5_VLForConditionalGeneration(c), 16


BUILDERS = {"qwen3_vl": qwen3, "qwen3_vl_bias_untied": lambda: qwen3(False, attention_bias=True),
            "qwen2_5_vl": qwen25, "qwen2_5_vl_tied": lambda: qwen25(True),
            "qwen3_vl_moe": lambda: qwen3(moe=True)}


def randomize(hf, seed):
    """Every parameter drawn at random (norms around 1), so none is a no-op."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            is_norm = "norm" in name.split(".")[-2] and name.endswith("weight")
            p.copy_(1.0 + 0.1 * noise if is_norm else 0.05 * noise)
    return hf.float().eval()


def jax_copy(hf):
    """The JAX model of `hf`'s config, holding `hf`'s weights."""
    model = QwenVL(hf.config, rngs=nnx.Rngs(0))
    merge, params = split_params(model)
    sd = {k: v.numpy() for k, v in hf.state_dict().items()}
    return merge, {k: jnp.asarray(v) for k, v in from_hf(sd, params).items()}


def sequences(processor, rng, n):
    """n sequences with 0-3 images of different sizes and alternating masked / unmasked spans
    (prompt, response, observation, response), as multi-turn trajectories have."""
    out = []
    for i in range(n):
        imgs = [image(int(rng.integers(30, 150)), int(rng.integers(30, 150)), 10 * i + k)
                for k in range(i % 4)]
        p = prompt_ids(processor, imgs, rng) if imgs else rng.integers(1, 200, 7)
        spans = [rng.integers(1, 200, int(rng.integers(3, 9))) for _ in range(3)]
        ids = np.concatenate([p, *spans])
        mask = np.concatenate([np.zeros(len(p)), np.ones(len(spans[0])), np.zeros(len(spans[1])),
                               np.ones(len(spans[2]))]).astype(np.int8)
        logp = rng.uniform(-3, 0, len(ids)).astype(np.float32) * mask
        out.append(TrainSequence(ids, mask, logp, float(rng.normal()), imgs, i))
    return out


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def case(request):
    torch.manual_seed(0)
    hf, patch = BUILDERS[request.param]()
    hf = randomize(hf, 1)
    processor = ImageOnlyProcessor(patch)
    seqs = sequences(processor, np.random.default_rng(2), 6)
    batches = pack(seqs, max(max(map(len, seqs)), sum(map(len, seqs)) // 2))
    assert len(batches) >= 2
    merge, params = jax_copy(hf)
    batch = device_batch(batches, processor, hf.config, agg="token-mean", n_tokens=1.0,
                         n_seqs=1.0, pad_to=64)
    return hf, processor, batches, merge, params, batch


@pytest.mark.slow
def test_logits_match_transformers(case):
    hf, processor, batches, merge, params, batch = case
    logits = jax.jit(lambda p, b: merge(p).logits(merge(p).hidden_states(b)))(params, batch)
    for r, b in enumerate(batches):
        with torch.no_grad():
            ref = hf(**packed_inputs(b, processor, hf.config), use_cache=False).logits[0].numpy()
        got = np.asarray(logits[r, :b.num_tokens])
        assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max(), np.abs(got - ref).max()


@pytest.mark.slow
def test_logprobs_match_transformers(case):
    hf, processor, batches, merge, params, batch = case
    logp = np.asarray(jax.jit(lambda p, b: token_logprobs(merge(p), b, 0.7))(params, batch))
    for r, b in enumerate(batches):
        targets = np.flatnonzero(b.loss_mask)
        with torch.no_grad():
            ref = torch_logprobs(hf, packed_inputs(b, processor, hf.config),
                                 torch.from_numpy(targets), 0.7).numpy()
        np.testing.assert_allclose(logp[r, targets], ref, rtol=0, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["qwen2_5_vl", "qwen3_vl"], indirect=True)
def test_padding_and_other_rows_do_not_change_a_row(case):
    """A row's log-probs are the same alone, padded longer, or next to other rows (masks and
    padding are the architecture's, not the tied head's or the attention bias': the two
    architectures as shipped)."""
    hf, processor, batches, merge, params, batch = case
    # the log-probs test's program (same function, temperature and batch): compiled once
    fn = jax.jit(lambda p, b: token_logprobs(merge(p), b, 0.7))
    together = np.asarray(fn(params, batch))
    alone = np.asarray(fn(params, device_batch(batches[1:2], processor, hf.config,
                                               agg="token-mean", n_tokens=1.0, n_seqs=1.0,
                                               pad_to=512)))
    t = np.flatnonzero(batches[1].loss_mask)
    np.testing.assert_allclose(alone[0, t], together[1, t], rtol=0, atol=2e-6)


@pytest.mark.slow
def test_gradients_match_transformers(case):
    hf, processor, batches, merge, params, batch = case
    hf.zero_grad()
    for b in batches:
        t = torch.from_numpy(np.flatnonzero(b.loss_mask))
        torch_logprobs(hf, packed_inputs(b, processor, hf.config), t).sum().backward()
    ref = {k: p.grad.numpy() for k, p in hf.named_parameters()}
    mask = jnp.asarray(batch["loss_mask"])
    grads = jax.jit(jax.grad(lambda p: jnp.sum(token_logprobs(merge(p), batch) * mask)))(params)
    grads = to_hf(grads)  # stacked decoder gradients, per layer
    assert set(grads) == set(ref)
    for k, g in ref.items():
        err = np.linalg.norm(np.asarray(grads[k]) - g) / max(np.linalg.norm(g), 1e-12)
        assert err <= 1e-4, (k, err)


@pytest.mark.parametrize("arch,section", [("qwen2_5_vl", [2, 3, 3]), ("qwen3_vl", [4, 2, 2]),
                                          ("qwen3_vl", [24, 20, 20])])
def test_mrope_tables_match_transformers(arch, section):
    """cos/sin of every frequency come from the position row transformers takes them from, with
    inverse frequencies rounded as torch rounds them (an ulp off would be position x ulp of
    angle: 1e-4 at these positions)."""
    half = sum(section)
    text = dict(hidden_size=4 * half, num_attention_heads=2, num_key_value_heads=1,
                head_dim=2 * half, rope_scaling={"rope_type": "default", "mrope_section": section,
                                                 "mrope_interleaved": True})
    if arch == "qwen3_vl":
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding as R
        cfg = Qwen3VLConfig(text_config=text).text_config
    else:
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VLRotaryEmbedding as R)
        text.pop("head_dim")
        text["hidden_size"] = 2 * 2 * half
        cfg = Qwen2_5_VLConfig(text_config=text).text_config
    pos = np.random.default_rng(0).integers(0, 4000, (3, 2, 50))
    ref_cos, ref_sin = R(cfg)(torch.zeros(1), torch.from_numpy(pos))
    cos, sin = MRoPE(arch, 2 * half, dict(cfg.rope_parameters))(jnp.asarray(pos.transpose(1, 0, 2)))
    np.testing.assert_allclose(np.asarray(cos), ref_cos.numpy(), rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(sin), ref_sin.numpy(), rtol=0, atol=1e-5)


def test_mrope_layouts():
    assert mrope_rows("qwen2_5_vl", [2, 1, 1], 4).tolist() == [0, 0, 1, 2]
    assert mrope_rows("qwen3_vl", [4, 2, 2], 8).tolist() == [0, 1, 2, 0, 1, 2, 0, 0]
    with pytest.raises(ValueError, match="sum to head_dim"):
        mrope_rows("qwen3_vl", [4, 2, 2], 9)


def test_unknown_architecture_is_an_error():
    hf, _ = qwen25()
    hf.config.model_type = "llava"
    with pytest.raises(ValueError, match="llava"):
        QwenVL(hf.config, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("text,sparse", [(dict(decoder_sparse_step=2), "[1]"),
                                         (dict(mlp_only_layers=[0]), "[1, 2]")])
def test_mixed_dense_and_sparse_layers_are_refused(text, sparse):
    """The stacked decoder holds one layer structure: a MoE config whose layers are partly
    dense MLPs (transformers' decoder_sparse_step, mlp_only_layers) is named, not mis-built."""
    config = qwen3(moe=True)[0].config
    for k, v in text.items():
        setattr(config.text_config, k, v)
    with pytest.raises(ValueError, match=re.escape(f"decoder layers {sparse} are sparse")):
        QwenVL(config, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("build", [qwen3, qwen25])
def test_with_attention_changes_every_setting_and_keeps_the_parameters(build):
    """The text model and every vision attention take the changed setting (the engine's own
    mesh on a multi-host slice, `geo3k_jax.engine.backend`); the parameters stay the same arrays."""
    from geo3k_jax.models.model import with_attention
    from geo3k_jax.kernels.splash import Attention

    config = build()[0].config
    merge, params = split_params(QwenVL(config, rngs=nnx.Rngs(0)))
    mesh = jax.make_mesh((1,), ("data",))
    changed = with_attention(merge, params, lambda a: Attention("splash", mesh, True))
    model = changed(params)
    settings = [n.attention for _, n in nnx.iter_graph(model)
                if isinstance(getattr(n, "attention", None), Attention)]
    assert len(settings) == 3  # the stacked blocks' vision attention, the tower, the text model
    assert all(s == Attention("splash", mesh, True) for s in settings)
    blocks = model.model.visual.blocks  # each block as the tower's scan runs it
    assert all(blocks[i].attn.attention == Attention("splash", mesh, True)
               for i in range(config.vision_config.depth))
    assert all(n.attention == Attention() for _, n in nnx.iter_graph(merge(params))
               if isinstance(getattr(n, "attention", None), Attention))  # the original's
    again = split_params(changed(params))[1]
    assert all(again[k] is params[k] for k in params)
