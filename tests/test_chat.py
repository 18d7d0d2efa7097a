"""The chat renderer on real chat templates: observation tokens decode to the feedback, and a
whole multi-turn trajectory equals the template rendered on the whole conversation."""

import json

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


@pytest.fixture(scope="module", params=[("qwen2_5_vl", "qwen"), ("qwen3_vl", "small")])
def processor(request, tmp_path_factory):
    arch, vocab = request.param
    out = tmp_path_factory.mktemp(f"{arch}-{vocab}")
    build_tiny_checkpoint(out, arch=arch, vocab=vocab, hidden_size=64)
    return load_processor(out)


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


def test_observation_tokens_decode_to_the_feedback(processor):
    r = ChatRenderer(processor)
    env = build_env({"answer": "12"})
    obs, _, _ = env.step(call("7"))
    msg = env.format_observation(obs)
    ids = r.observation_ids(msg, r.turn_end_id)
    text = r.decode(ids)
    assert msg["content"] in text
    assert text.startswith("\n<|im_start|>user\n<tool_response>\n")
    assert text.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert r.tokenizer.convert_tokens_to_ids("<|im_end|>") == r.turn_end_id
    # after a different stop token the turn is closed with the template's own end
    other = r.decode(r.observation_ids(msg, r.stop_token_ids[-1] + 1))
    assert other.startswith("<|im_end|>\n<|im_start|>user")


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
    text = processor.apply_chat_template(conversation, tools=TOOLS, tokenize=False)
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
