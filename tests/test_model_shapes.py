"""The published model configs in configs/models load in transformers and have the models' sizes."""

import pytest
import torch
import transformers

from configs.models import NAMES, model_shapes, write_config_dir

# Published sizes (billions of parameters) of the Instruct models.
PUBLISHED_B = {"qwen3_vl_2b": 2.13, "qwen3_vl_8b": 8.77, "qwen2_5_vl_3b": 3.75,
               "qwen2_5_vl_7b": 8.29}


@pytest.mark.parametrize("name", NAMES)
def test_config_loads_and_has_the_published_size(name, tmp_path):
    cfg = transformers.AutoConfig.from_pretrained(write_config_dir(name, tmp_path))
    with torch.device("meta"):
        model = transformers.AutoModelForImageTextToText.from_config(cfg)
    n = sum(p.numel() for p in model.parameters()) / 1e9
    assert n == pytest.approx(PUBLISHED_B[name], rel=0.01)
    text, vision = cfg.text_config, cfg.vision_config
    assert vision.out_hidden_size == text.hidden_size
    assert sum(text.rope_parameters["mrope_section"]) * 2 == text.hidden_size // text.num_attention_heads


def test_shapes_of_the_2b():
    c = model_shapes("qwen3_vl_2b")
    t, v = c["text_config"], c["vision_config"]
    assert (t["hidden_size"], t["num_hidden_layers"], t["num_attention_heads"],
            t["num_key_value_heads"], t["head_dim"]) == (2048, 28, 16, 8, 128)
    assert v["deepstack_visual_indexes"] == [5, 11, 17] and c["tie_word_embeddings"] is True


def test_unknown_name_is_a_clear_error():
    with pytest.raises(ValueError, match="qwen3_vl_2b"):
        model_shapes("qwen3_vl_4b")
