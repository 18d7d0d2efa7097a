"""SFT: the seed's data preparation on a real chat template (only the reply is trained), the loss
falling on the synthetic set, and a GRPO run starting from the SFT checkpoint."""

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from common.data import row_to_prompt
from common.processor import load_processor
from common.prompts import BOXED_SYSTEM_PROMPT
from common.prepare import make_renderer
from common.sft import format_answer, sft_example, sft_messages
from common.synthetic import generate
from configs import h100_single_turn, sft
from geo3k_torch import main as train_main, sft as sft_main
from geo3k_torch.tiny import build_tiny_checkpoint
from tests.test_recipes import local


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    return tmp_path_factory.mktemp("sft")


@pytest.mark.slow
@pytest.mark.parametrize("arch, vocab", [("qwen3_vl", "small"), ("qwen2_5_vl", "qwen")])
def test_only_the_reply_is_in_the_mask(arch, vocab, tmp_path):
    build_tiny_checkpoint(tmp_path, arch=arch, vocab=vocab, hidden_size=64)
    processor = load_processor(tmp_path)
    cfg = sft.get_config("cpu")
    renderer = make_renderer(cfg, processor)
    row = generate(1, seed=5, image_size="112")[0]
    prompt = row_to_prompt(row, uid="p0", system=BOXED_SYSTEM_PROMPT)
    messages = sft_messages(prompt)
    assert messages[-1] == {"role": "assistant",
                            "content": "Answer: \\boxed{" + row["answer"] + "}"}
    seq = sft_example(renderer, messages, prompt.images)
    tok = processor.tokenizer
    # the masked tokens are the reply and the turn end, nothing of the prompt or the image
    assert tok.decode(seq.token_ids[seq.loss_mask == 1]) == \
        format_answer(row["answer"]) + "<|im_end|>"
    assert seq.loss_mask[:-1].sum() == seq.loss_mask.sum() - 1  # the reply ends the sequence
    assert np.flatnonzero(seq.loss_mask).tolist() == list(range(len(seq) - seq.loss_mask.sum(),
                                                                len(seq)))
    # the ids are the template's own rendering of the whole conversation, images expanded
    text = processor.apply_chat_template(messages, tools=None, tokenize=False)
    full = processor(text=[text], images=prompt.images, return_tensors="np")["input_ids"][0]
    assert seq.token_ids.tolist() == full.tolist()[:len(seq)]
    assert tok.decode(full[len(seq):]) == "\n"  # only the newline after <|im_end|> is left
    image_pad = tok.convert_tokens_to_ids("<|image_pad|>")
    assert (seq.token_ids == image_pad).sum() > 1 and not seq.loss_mask[seq.token_ids == image_pad
                                                                         ].any()
    assert "<tools>" not in text and BOXED_SYSTEM_PROMPT in text  # data.prompt_style="boxed"


@pytest.mark.slow
def test_sft_lowers_the_loss_and_grpo_starts_from_its_checkpoint(shared, tmp_path):
    cfg = local(sft, "cpu", shared)
    cfg.data.synthetic_train_size = 4  # the same 4 problems every step
    cfg.train.prompts_per_step, cfg.train.steps, cfg.train.lr = 4, 8, 1e-2
    cfg.eval.every, cfg.eval.max_prompts = 8, 2
    last = sft_main.train(cfg, str(tmp_path / "sft"))
    rows = [json.loads(x) for x in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in rows]
    assert len(losses) == 8 and all(np.isfinite(losses))
    # a random tiny model starts near log(vocab); eight steps on four replies must fit them
    assert losses[-1] < 0.5 * losses[0] and losses[1] < losses[0], losses
    assert "eval/greedy_first_try_accuracy" in last
    assert (tmp_path / "sft" / "curve.png").stat().st_size > 1000
    assert list((tmp_path / "sft").glob("events.out.tfevents.*"))
    ckpt = tmp_path / "sft" / "checkpoints" / "step_8"
    assert (ckpt / "config.json").exists() and (ckpt / "loop_state.json").exists()

    grpo = local(h100_single_turn, "cpu", shared)
    grpo.data.synthetic_train_size = 4  # the SFT's problems (a set of other settings is refused)
    grpo.model.path = str(ckpt)
    grpo.train.steps, grpo.eval.every = 1, 0
    grpo.advantage.filter_equal_groups = False  # train on the step whatever the rewards
    train_main.train(grpo, str(tmp_path / "grpo"))
    w_sft = load_file(str(ckpt / "model.safetensors"))
    w_base = load_file(str(Path(grpo.model.tiny_dir) / "model.safetensors"))
    w_grpo = load_file(str(tmp_path / "grpo" / "checkpoints" / "step_1" / "model.safetensors"))
    # GRPO started from the SFT weights (not the tiny base): one step at the quick CPU run's lr stays close
    dist = lambda a, b: max(float(np.abs(a[k] - b[k]).max()) for k in a)  # noqa: E731
    assert dist(w_sft, w_base) > 1e-2
    assert dist(w_grpo, w_sft) < 0.1 * dist(w_sft, w_base)
