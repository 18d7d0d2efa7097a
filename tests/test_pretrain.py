"""geo3k_torch.pretrain: the tiny checkpoint's vision pretraining (tower, then captions with the
tower frozen), and the priming that can leave the tower alone."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.torch import load_file

from common.chat import ChatRenderer
from common.processor import load_processor
from common.synthetic import PERCEPTION, caption


def test_captions_end_with_the_answer_not_a_letter():
    assert caption("polygon_sides", "5") == "sides: 5"
    assert caption("right_angle", "3") == "right angle: 3"
    assert caption("longest_segment", "b") == "longest: b"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from geo3k_torch.tiny import build_tiny_checkpoint
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


def test_labels_are_family_and_answer_index():
    from geo3k_torch.pretrain import figures, labels
    images, rows = figures(seed=5, start=0, n=12)
    y = labels(rows)
    assert len(images) == 12 and images[0].size == (112, 112)
    for row, k in zip(rows, y):  # choices in natural order: the index is the answer's rank
        assert PERCEPTION[k // 4] in row["meta"] and row["choices"][k % 4] == row["answer"]
    # the same seed and index give the same figure: the held-out figures are reproducible
    assert figures(seed=5, start=3, n=1)[1][0]["images"] == rows[3]["images"]


def test_caption_examples_train_on_the_caption_only(tiny):
    from geo3k_torch.pretrain import REQUEST, caption_examples
    renderer = ChatRenderer(load_processor(str(tiny)), tools=None)
    seqs, cands = caption_examples(renderer, seed=5, start=0, n=6)
    tok = renderer.tokenizer
    for seq, cand in zip(seqs, cands):
        text = tok.decode(seq.token_ids)
        assert REQUEST in text and "calc_score" not in text  # short: no system prompt, no tools
        trained = tok.decode(seq.token_ids[seq.loss_mask == 1])
        assert trained.removesuffix("<|im_end|>") in ("sides: 3", "sides: 4", "sides: 5", "sides: 6",
                                                "right angle: 1", "right angle: 2",
                                                "right angle: 3", "right angle: 4",
                                                "longest: a", "longest: b", "longest: c",
                                                "longest: d")
        answer = seq.token_ids[np.nonzero(seq.loss_mask)[0][-2]]
        assert len(set(cand.tolist())) == 4 and answer in cand


def test_pretraining_trains_the_tower_then_the_language_model_only(tiny, tmp_path):
    import shutil
    from geo3k_torch.pretrain import pretrain_vision
    out = shutil.copytree(tiny, tmp_path / "ckpt")
    w0 = load_file(str(out / "model.safetensors"))
    # stage 1 alone moves the tower and nothing else
    pretrain_vision(str(out), see_steps=2, caption_steps=0, batch=4, held_out=4)
    w1 = load_file(str(out / "model.safetensors"))
    moved = {k for k in w0 if not np.array_equal(w0[k].numpy(), w1[k].numpy())}
    assert moved and all(k.startswith("model.visual.") for k in moved)
    # stage 2 alone moves the language model and leaves the tower as it was
    r = pretrain_vision(str(out), see_steps=0, caption_steps=2, batch=4, held_out=4)
    w2 = load_file(str(out / "model.safetensors"))
    moved = {k for k in w1 if not np.array_equal(w1[k].numpy(), w2[k].numpy())}
    assert moved and not any(k.startswith("model.visual.") for k in moved)
    assert set(r) >= {"tower_accuracy", "caption_accuracy", "caption_loss"}
    assert all(0.0 <= r[k] <= 1.0 for k in r if k.endswith("accuracy"))


def test_priming_can_leave_the_tower_alone(tiny, tmp_path):
    import shutil
    from common.data import load_split
    from common.synthetic import write_split
    from geo3k_torch.prime import prime_format
    write_split(tmp_path / "data", "train", 4, seed=1, image_size="112")
    prompts = load_split(tmp_path / "data", split="train").prompts
    out = shutil.copytree(tiny, tmp_path / "ckpt")
    w0 = load_file(str(out / "model.safetensors"))
    prime_format(str(out), prompts, steps=1, batch=2, train_vision=False)
    w1 = load_file(str(out / "model.safetensors"))
    moved = {k for k in w0 if not np.array_equal(w0[k].numpy(), w1[k].numpy())}
    assert moved and not any(k.startswith("model.visual.") for k in moved)


def test_the_tiny_checkpoint_is_pretrained_when_the_config_asks(tmp_path, capsys):
    from configs import cpu
    from geo3k_torch.prepare import prepare_model_dir
    from geo3k_torch.tiny import build_tiny_checkpoint
    cfg = cpu.get_config()
    cfg.data.synthetic_dir = str(tmp_path / "data")
    cfg.data.synthetic_train_size, cfg.data.synthetic_test_size = 8, 4
    cfg.model.tiny_dir = str(tmp_path / "tiny")
    cfg.model.tiny_see_steps, cfg.model.tiny_caption_steps = 1, 1
    cfg.model.tiny_prime_steps, cfg.model.tiny_prime_vision = 1, False
    out = prepare_model_dir(cfg)
    assert "vision pretraining, held-out accuracy" in capsys.readouterr().out
    plain = load_file(str(build_tiny_checkpoint(tmp_path / "plain", seed=cfg.model.tiny_seed)
                          / "model.safetensors"))
    built = load_file(f"{out}/model.safetensors")
    key = "model.visual.patch_embed.proj.weight"
    assert not np.array_equal(plain[key].numpy(), built[key].numpy())  # the tower was trained
    record = json.loads((tmp_path / "tiny" / "tiny_build.json").read_text())
    assert set(record["distinct_from"]) == {"train", "test"}  # its figures avoid the data's


def test_pretraining_figures_avoid_the_data():
    """A figure whose content key is in `exclude` is drawn again; the others are as drawn."""
    from common.synthetic import row_key
    from geo3k_torch.pretrain import figures

    _, rows = figures(5, 0, 12, "56")
    keys = [row_key(r) for r in rows]
    _, again = figures(5, 0, 12, "56", exclude=frozenset(keys[::3]))
    assert [r == a for r, a in zip(rows, again)] == [i % 3 != 0 for i in range(12)]
    assert not {row_key(r) for r in again} & set(keys[::3])


def test_an_unknown_priming_setting_stops_before_anything_is_built(tmp_path):
    from configs import cpu
    from geo3k_torch.prepare import prepare_model_dir
    for key in ("tiny_prime_answer", "tiny_prime_retry"):
        cfg = cpu.get_config()
        cfg.model.tiny_dir = str(tmp_path / "tiny")
        cfg.model.tiny_see_steps = 600  # minutes, were it reached
        cfg.model[key] = "sometimes"
        with pytest.raises(ValueError, match=f"model.{key}='sometimes'"):
            prepare_model_dir(cfg)
        assert not (tmp_path / "tiny").exists() and not (tmp_path / "tiny.tmp").exists()
