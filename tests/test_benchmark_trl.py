"""scripts/benchmark_trl.py gives TRL the same work: the same prompt ids (our messages and tool
schema through TRL's path), the same reward, TRL keeping the checkpoint's chat template."""

import json

import pytest

from common.data import build_messages
from common.processor import load_processor
from common.prompts import SCORE_TOOL
from common.prepare import make_renderer
from configs import cpu
from geo3k_torch.tiny import build_tiny_checkpoint
from tests.script_module import load_script
from tests.tiny_models import image

trl = pytest.importorskip("trl")


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmark_trl")


@pytest.fixture(scope="module", params=["own", "qwen3_vl"])
def processor(request, tmp_path_factory):
    """A tiny Qwen3-VL checkpoint's processor, with its own template or Qwen's published one."""
    import importlib.resources
    out = tmp_path_factory.mktemp("tiny")
    build_tiny_checkpoint(out, arch="qwen3_vl", vocab="small", hidden_size=64)
    processor = load_processor(out)
    if request.param != "own":
        processor.chat_template = (importlib.resources.files("trl") / "chat_templates" /
                                   "qwen3_vl.jinja").read_text()
    return processor


class Prompt:
    def __init__(self, problem, images, answer, choices):
        self.messages = build_messages(problem, len(images), choices)
        self.images, self.answer, self.choices = images, answer, choices


PROMPTS = [Prompt("Find x. <image> The segment is 3x + 1.", [image(90, 60, 1)], "4",
                  ["2", "4", "6", "8"]),
           Prompt("Find the area of the triangle.", [image(64, 100, 2)], "12", None)]


def test_trl_renders_our_prompt_ids(bench, processor):
    from trl.chat_template_utils import is_chat_template_prefix_preserving
    from trl.data_utils import prepare_multimodal_messages

    renderer = make_renderer(cpu.get_config(), processor)
    tool = bench.schema_tool(SCORE_TOOL)
    assert is_chat_template_prefix_preserving(processor)  # TRL keeps the template as is
    for prompt, row in zip(PROMPTS, bench.trl_dataset(PROMPTS)):
        messages = prepare_multimodal_messages(row["prompt"], images=row["images"])
        ids = processor.apply_chat_template(conversation=[messages], tools=[tool],
                                            add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"][0]
        assert list(ids) == renderer.prompt_ids(prompt.messages, prompt.images)


def test_trl_reward_is_our_single_turn_reward(bench, processor):
    cfg = bench.same_work(cpu.get_config())
    renderer = make_renderer(cfg, processor)
    reward = bench.make_reward(cfg, renderer)

    def call(answer):
        text = ('<tool_call>\n{"name": "calc_score", "arguments": {"answer": '
                + json.dumps(answer) + '}}\n</tool_call><|im_end|>')
        return processor.tokenizer.encode(text, add_special_tokens=False)

    boxed = processor.tokenizer.encode("so \\boxed{12}", add_special_tokens=False)
    rows = bench.trl_dataset(PROMPTS)
    got = reward(completion_ids=[call("4"), call("B"), call("6"), boxed, call("13")],
                 answer=["4", "4", "4", "12", "12"],
                 choices=[rows[0]["choices"]] * 3 + [rows[1]["choices"]] * 2)
    assert got == [1.0, 1.0, 0.0, 1.0, 0.0]


def test_fixed_settings_cannot_be_overridden_silently(bench):
    cfg = bench.same_work(cpu.get_config(), ["--config.train.lr=0.1"])
    assert cfg.env.max_turns == 1 and not cfg.advantage.filter_equal_groups
    with pytest.raises(Exception, match="env.max_turns"):
        bench.same_work(cpu.get_config(), ["--config.env.max_turns=3"])


def test_schema_tool_refuses_what_trl_cannot_render(bench):
    bad = json.loads(json.dumps(SCORE_TOOL))
    bad["function"]["parameters"]["properties"]["answer"]["type"] = "number"
    with pytest.raises(ValueError, match="not a string"):
        bench.schema_tool(bad)
