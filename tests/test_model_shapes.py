"""The published model configs in configs/models load in transformers and have the models' sizes."""

import pytest
import torch
import transformers

from configs.models import NAMES, model_shapes, write_config_dir

# Published sizes (billions of parameters) of the Instruct models; of the MoE models (all
# experts) the text models' published 30.5 B and 235 B plus their vision towers, 0.54 and 0.58 B.
PUBLISHED_B = {"qwen3_vl_2b": 2.13, "qwen3_vl_8b": 8.77, "qwen2_5_vl_3b": 3.75,
               "qwen2_5_vl_7b": 8.29, "qwen3_vl_30b_a3b": 30.5 + 0.54,
               "qwen3_vl_235b_a22b": 235 + 0.58}
# Parameters one token meets (billions): all but the E - k experts a layer's router leaves out
# (the experts are 29.0 B of the 30B's 31.1 B: top-k 4 instead of 8 would give 2.99 B).
ACTIVE_B = {"qwen3_vl_30b_a3b": 3.89, "qwen3_vl_235b_a22b": 22.77}


def _meta_model(name, tmp_path):
    cfg = transformers.AutoConfig.from_pretrained(write_config_dir(name, tmp_path))
    with torch.device("meta"):
        return cfg, transformers.AutoModelForImageTextToText.from_config(cfg)


@pytest.mark.parametrize("name", NAMES)
def test_config_loads_and_has_the_published_size(name, tmp_path):
    cfg, model = _meta_model(name, tmp_path)
    n = sum(p.numel() for p in model.parameters()) / 1e9
    assert n == pytest.approx(PUBLISHED_B[name], rel=0.01)
    text, vision = cfg.text_config, cfg.vision_config
    assert vision.out_hidden_size == text.hidden_size
    head_dim = model.model.language_model.layers[0].self_attn.head_dim
    assert sum(text.rope_parameters["mrope_section"]) * 2 == head_dim


@pytest.mark.parametrize("name", sorted(ACTIVE_B))
def test_active_parameters_of_the_moe_models(name, tmp_path):
    cfg, model = _meta_model(name, tmp_path)
    text = cfg.text_config
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    total = sum(p.numel() for p in model.parameters())
    active = total - experts + experts * text.num_experts_per_tok // text.num_experts
    assert active / 1e9 == pytest.approx(ACTIVE_B[name], rel=0.005)
    assert (text.num_experts, text.num_experts_per_tok, text.decoder_sparse_step,
            text.mlp_only_layers) == (128, 8, 1, [])


def test_shapes_of_the_2b():
    c = model_shapes("qwen3_vl_2b")
    t, v = c["text_config"], c["vision_config"]
    assert (t["hidden_size"], t["num_hidden_layers"], t["num_attention_heads"],
            t["num_key_value_heads"], t["head_dim"]) == (2048, 28, 16, 8, 128)
    assert v["deepstack_visual_indexes"] == [5, 11, 17] and c["tie_word_embeddings"] is True


def test_unknown_name_is_a_clear_error():
    with pytest.raises(ValueError, match="qwen3_vl_2b"):
        model_shapes("qwen3_vl_4b")
