"""The chat renderer on real chat templates: the tiny checkpoints' own and Qwen's published
Qwen2.5-VL and Qwen3-VL templates (loaded from the installed `trl` package at test time). The
prompt shows the tool, observation tokens decode to the feedback in a role the template knows,
model text never becomes a special token, and a whole multi-turn trajectory equals the template
rendered on the whole conversation."""

import json
import re

import numpy as np
import pytest

from common.chat import ChatRenderer
from common.env import build_env
from common.processor import load_processor
from common.rollout import RolloutConfig, rollout
from common.synthetic import generate
from common.data import row_to_prompt
from common.engine import STOP, Completion
from common.prompts import TOOLS
from geo3k_torch.tiny import build_tiny_checkpoint


def published_template(name: str) -> str:
    """Qwen's chat template `name` as shipped in the trl package (never copied here)."""
    import importlib.resources
    return (importlib.resources.files("trl") / "chat_templates" / f"{name}.jinja").read_text()


@pytest.fixture(scope="module", params=[("qwen2_5_vl", "qwen"), ("qwen3_vl", "small")],
                ids=["qwen2_5_vl-qwen", "qwen3_vl-small"])
def checkpoint(request, tmp_path_factory):
    arch, vocab = request.param
    out = tmp_path_factory.mktemp(f"{arch}-{vocab}")
    build_tiny_checkpoint(out, arch=arch, vocab=vocab, hidden_size=64)
    return out


@pytest.fixture(params=["own", "qwen2_5_vl", "qwen3_vl"])
def processor(request, checkpoint):
    """The checkpoint's processor with its own template or one of Qwen's published ones."""
    processor = load_processor(checkpoint)
    if request.param != "own":
        processor.chat_template = published_template(request.param)
    return processor


def call(answer):
    return ('<tool_call>\n{"name": "calc_score", "arguments": {"answer": ' + json.dumps(answer)
            + '}}\n</tool_call>')


class TextEngine:
    """Answers each session from a script of texts, tokenized by the real tokenizer."""

    def __init__(self, tokenizer, stop, script):
        self.tok, self.stop, self.script = tokenizer, stop, {k: list(v) for k, v in
                                                             script.items()}

    def generate(self, requests):
        out = []
        for r in requests:
            ids = self.tok.encode(self.script[r.session].pop(0), add_special_tokens=False)
            ids = ids + [self.stop]
            out.append(Completion(ids, [-0.5] * len(ids), STOP))
        return out


def test_prompt_shows_the_tool_and_its_call_format(processor):
    r = ChatRenderer(processor)
    prompt = row_to_prompt(generate(1, seed=3, image_size="112")[0], uid="p0")
    text = r.decode(r.prompt_ids(prompt.messages, prompt.images))
    system = text[:text.index("<|im_end|>")]
    assert '"name": "calc_score"' in system and '"answer"' in system  # the schema
    assert "<tools>" in system and "<tool_call>" in system  # and how to call it
    assert text.endswith("<|im_start|>assistant\n")


def test_observation_tokens_decode_to_the_feedback(processor):
    r = ChatRenderer(processor)
    env = build_env({"answer": "12"})
    obs, _, _ = env.step(call("7"))
    msg = env.format_observation(obs)
    ids = r.observation_ids(msg, r.turn_end_id)
    text = r.decode(ids)
    # a tool result, in a role every one of these templates knows: a user turn
    assert text.startswith("\n<|im_start|>user\n<tool_response>\n" + msg["content"])
    assert text.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert "<|im_start|>tool" not in text
    assert r.tokenizer.convert_tokens_to_ids("<|im_end|>") == r.turn_end_id
    # after a different stop token the turn is closed with the template's own end
    other = r.decode(r.observation_ids(msg, r.stop_token_ids[-1] + 1))
    assert other.startswith("<|im_end|>\n<|im_start|>user")


def test_model_text_never_becomes_a_special_token(processor):
    """An answer spelled with the text of every added token (<|image_pad|>, <|im_start|>,
    <tool_response>, ...): the observation holds exactly the added tokens the template itself
    writes, and decodes to the model's text."""
    r = ChatRenderer(processor)
    added = set(r.tokenizer.get_added_vocab().values())
    # (the call's own tags would end the call early: every other added token is in the answer)
    hostile = "".join(t for t in r.tokenizer.get_added_vocab() if "tool_call" not in t)
    env = build_env({"answer": "12"}, max_turns=3)

    def observation(answer):
        obs, _, _ = env.step(call(answer))
        msg = env.format_observation(obs)
        return msg, r.observation_ids(msg, r.turn_end_id)

    _, plain = observation("7")
    msg, ids = observation(hostile)
    assert hostile in msg["content"]
    assert sorted(t for t in ids if t in added) == sorted(t for t in plain if t in added)
    assert msg["content"] in r.decode(ids)


def test_tool_format_detected_and_forced(checkpoint):
    processor = load_processor(checkpoint)
    assert ChatRenderer(processor).tool_format == "template"  # the tiny template takes tools
    processor.chat_template = published_template("qwen2_5_vl")
    assert ChatRenderer(processor).tool_format == "system_prompt"  # it ignores tools=
    forced = ChatRenderer(processor, tool_format="template")
    prompt = row_to_prompt(generate(1, seed=3, image_size="112")[0], uid="p0")
    assert "\"name\": \"calc_score\"" not in forced.decode(forced.prompt_ids(prompt.messages,
                                                                      prompt.images))
    processor.chat_template = published_template("qwen3_vl")
    assert ChatRenderer(processor).tool_format == "template"
    assert ChatRenderer(processor, tool_format="system_prompt").tool_format == "system_prompt"
    with pytest.raises(ValueError, match="tool_format"):
        ChatRenderer(processor, tool_format="xml")


def test_trajectory_equals_template_on_whole_conversation(processor):
    r = ChatRenderer(processor)
    row = generate(1, seed=3, image_size="112,160")[0]
    prompt = row_to_prompt(row, uid="p0")
    turns = ["Let me look. " + call("1"), "Again: x is " + row["answer"] + ". " +
             call(row["answer"])]
    engine = TextEngine(r.tokenizer, r.turn_end_id, {"0-0": list(turns)})
    traj, = rollout([prompt], engine, r, RolloutConfig(n_samples=1, max_response_tokens=4000,
                                                       max_context_tokens=8000))
    assert traj.status == "completed" and traj.reward == 1.0 and len(traj.turns) == 2
    conversation = list(prompt.messages)
    for turn in traj.turns:
        conversation.append({"role": "assistant", "content": turn.text})
        if turn.observation is not None:
            conversation.append({"role": "tool", "name": "calc_score",
                                 "content": turn.observation})
    text = r.render(conversation, generation_prompt=False)
    if r.tool_format == "template":
        assert text == processor.apply_chat_template(conversation, tools=TOOLS, tokenize=False)
    one_pad = lambda t: re.sub(r"(<\|image_pad\|>)+", "<|image_pad|>", t)  # noqa: E731
    assert text.endswith("<|im_end|>\n")  # the model stopped at <|im_end|>
    assert one_pad(r.decode(traj.token_ids)) == text[:-1]  # the whole conversation, as text
    full = processor(text=[text], images=prompt.images, return_tensors="np")["input_ids"][0]
    # the template ends the last assistant turn with "<|im_end|>\n"; the model stopped at <|im_end|>
    assert traj.token_ids.tolist() == full.tolist()[:len(traj.token_ids)]
    assert len(full) - len(traj.token_ids) == len(r.tokenizer.encode("\n",
                                                                     add_special_tokens=False))
    # what the learner trains on is exactly the model's tokens
    gen = traj.token_ids[traj.loss_mask == 1]
    expected = sum((r.tokenizer.encode(t, add_special_tokens=False) + [r.turn_end_id]
                    for t in turns), [])
    assert gen.tolist() == expected
    assert np.all(traj.rollout_logprobs[traj.loss_mask == 0] == 0)
