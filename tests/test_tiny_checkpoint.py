"""Tiny checkpoints (geo3k_torch.tiny), their tokenizers (common.tokenizer), chat template
(common.chat_template) and processor loading (common.processor).

The Qwen vocabulary is checked against a direct implementation of tiktoken's algorithm on the
ranks in `qwen.tiktoken` (the `tiktoken` package is not installed here).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import unicodedata
from pathlib import Path

import numpy as np
import pytest
import regex
import torch
from PIL import Image

from common import tokenizer as toks
from common.chat_template import CHAT_TEMPLATE
from common.processor import family, load_processor, torchvision_available
from geo3k_torch.tiny import (build_tiny_checkpoint, deepstack_indexes, fullatt_indexes, main,
                              mrope_section)

ROOT = Path(__file__).resolve().parents[1]
ARCHS = ("qwen3_vl", "qwen2_5_vl", "qwen3_vl_moe")
TEXTS = [
    "Hello world! Hello, world",
    "In triangle ABC, m \\angle B = 35^\\circ and AB = 8\\sqrt{3}. Find x.\n\nx = \\frac{5}{2}",
    '<tool_call>\n{"name": "calc_score", "arguments": {"answer": "6.5"}}\n</tool_call>',
    "   leading spaces, trailing spaces   \n\n\n\ttabs\t\tand\r\nCRLF  ",
    "Numbers 1234567890 and 3.14159, 1e-6, -42, 100%",
    "Unicode: café naïve résumé Ünïcödé — “quotes” … ∠ABC ≅ ∠DEF, π r², √2, ≤ ≥ ≠ ∞",
    "cafe\u0301 (decomposed e + combining accent, NFC-normalised to café)",
    "中文：求三角形的面积。日本語のテキスト。한국어 텍스트. Ελληνικά. Русский текст. العربية",
    "emoji 🙂🚀 and ZWJ 👩‍👩‍👧 and flags 🇫🇷",
    "def f(x):\n    return {'a': [1, 2, 3]}  # code\n",
    "don't WON'T it's I'M we'LL they'd you've",
    "",
]


def image(w: int, h: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    """arch -> a small-vocab tiny checkpoint, built once per test session."""
    root = tmp_path_factory.mktemp("tiny")
    return {arch: build_tiny_checkpoint(root / arch, arch=arch, vocab="small") for arch in ARCHS}


@pytest.fixture(scope="session")
def qwen_tok():
    return toks.build_qwen_tokenizer("qwen3_vl")


@pytest.fixture(scope="session")
def qwen_ranks():
    return toks.load_tiktoken_ranks(toks.qwen_tiktoken_path())


def tiktoken_encode(text: str, ranks: dict[bytes, int]) -> list[int]:
    """tiktoken's encoding with Qwen's special tokens allowed: NFC; special tokens become their
    ids; other text is split by the regex, and in each piece the adjacent pair whose concatenation
    has the lowest rank is joined until none is in the vocab (a piece in the vocab is one id)."""
    specials = {t: 151643 + i for i, t in enumerate(toks.SPECIAL_TOKENS)}
    ids = []
    text = unicodedata.normalize("NFC", text)
    for chunk in regex.split("(" + "|".join(map(regex.escape, specials)) + ")", text):
        if chunk in specials:
            ids.append(specials[chunk])
            continue
        for piece in regex.findall(toks.SPLIT_PATTERN, chunk):
            ids.extend(_tiktoken_piece(piece.encode("utf-8"), ranks))
    return ids


def _tiktoken_piece(data: bytes, ranks: dict[bytes, int]) -> list[int]:
    if data in ranks:
        return [ranks[data]]
    parts = [bytes([b]) for b in data]
    while len(parts) > 1:
        pairs = [(ranks[a + b], i) for i, (a, b) in enumerate(zip(parts, parts[1:]))
                 if a + b in ranks]
        if not pairs:
            break
        _, i = min(pairs)
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return [ranks[p] for p in parts]


# ---------------------------------------------------------------------------- tokenizers


def test_small_vocab_layout():
    tok = toks.build_small_tokenizer()
    assert tok.get_vocab_size() == toks.SMALL_VOCAB_SIZE == 2048
    ids = toks.special_token_ids(tok)
    assert list(ids) == list(toks.SPECIAL_TOKENS)
    assert list(ids.values()) == list(range(2022, 2048))
    assert (ids["<|im_start|>"], ids["<|im_end|>"], ids["<|image_pad|>"]) == (2023, 2024, 2034)
    assert (ids["<|vision_start|>"], ids["<tool_call>"], ids["</think>"]) == (2031, 2036, 2047)


def test_small_vocab_round_trip_and_specials():
    tok = toks.build_small_tokenizer()
    for text in TEXTS + toks.small_corpus(50, seed=1):
        expect = unicodedata.normalize("NFC", text)
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == expect
    enc = tok.encode("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>hi<|im_end|>")
    i = enc.ids.index(2031)
    assert enc.ids[0] == 2023 and enc.ids[i:i + 3] == [2031, 2034, 2032] and enc.ids[-1] == 2024
    assert len(tok.encode(toks.small_corpus(1)[0]).ids) < 200  # the corpus compresses


def test_small_vocab_is_identical_in_a_new_process():
    code = ("import hashlib; from common.tokenizer import build_small_tokenizer as b; "
            "print(hashlib.sha256(b().to_str().encode()).hexdigest())")
    runs = [subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.strip() for _ in range(2)]
    here = __import__("hashlib").sha256(toks.build_small_tokenizer().to_str().encode())
    assert runs[0] == runs[1] == here.hexdigest()


def test_byte_alphabet():
    table = toks.byte_to_unicode()
    assert len(set(table.values())) == 256
    assert table[ord("A")] == "A" and table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ"


def test_merges_reproduce_tiktoken_on_toy_ranks():
    ranks = {b"a": 0, b"b": 1, b"c": 2, b"ab": 3, b"bc": 4, b"abc": 5}
    merges = toks.merges_from_ranks(ranks)
    assert merges == [(b"a", b"b"), (b"b", b"c"), (b"a", b"bc"), (b"ab", b"c")]


def test_qwen_vocab_matches_tiktoken(qwen_tok, qwen_ranks):
    assert len(qwen_ranks) == 151643
    corpus = TEXTS + toks.small_corpus(400, seed=3)
    for text in corpus:
        assert qwen_tok.encode(text).ids == tiktoken_encode(text, qwen_ranks), text
    assert qwen_tok.encode("Hello world").ids == [9707, 1879]  # ids of the real Qwen tokenizer
    for text in TEXTS:
        decoded = qwen_tok.decode(qwen_tok.encode(text).ids, skip_special_tokens=False)
        assert decoded == unicodedata.normalize("NFC", text)


def test_qwen_special_tokens_at_qwen_ids(qwen_tok):
    ids = toks.special_token_ids(qwen_tok)
    assert ids == {t: 151643 + i for i, t in enumerate(toks.SPECIAL_TOKENS)}
    assert (ids["<|im_start|>"], ids["<|image_pad|>"], ids["</tool_call>"]) == (151644, 151655,
                                                                               151658)
    assert (ids["<tool_response>"], ids["</think>"]) == (151665, 151668)
    assert qwen_tok.get_vocab_size() == 151669
    enc = qwen_tok.encode("<|im_start|>assistant\n<tool_call>x</tool_call><|im_end|>")
    assert enc.ids[0] == 151644 and 151657 in enc.ids and enc.ids[-1] == 151645


def test_qwen2_5_vl_vocab_has_22_special_tokens():
    tok = toks.build_qwen_tokenizer("qwen2_5_vl")
    assert tok.get_vocab_size() == 151665
    assert tok.token_to_id("<|file_sep|>") == 151664
    assert tok.token_to_id("<tool_response>") is None  # plain text for Qwen2.5-VL


def test_common_modules_import_neither_torch_nor_transformers():
    code = ("import sys, common.tokenizer, common.processor, common.chat_template; "
            "print(sorted(m for m in ('torch', 'transformers', 'jax') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"


# ---------------------------------------------------------------------------- model sizes


def test_rope_and_block_layouts_reproduce_the_real_models():
    assert mrope_section(128, "qwen2_5_vl") == [16, 24, 24]
    assert mrope_section(128, "qwen3_vl") == [24, 20, 20]
    for head_dim in (8, 16, 32, 64):
        for arch in ARCHS:
            assert sum(mrope_section(head_dim, arch)) == head_dim // 2
        t, h, w = mrope_section(head_dim, "qwen3_vl")
        assert 3 * h <= head_dim // 2 and t >= h == w  # interleaved t,h,w stays in range
    assert deepstack_indexes(24, 28) == [5, 11, 17] and deepstack_indexes(2, 2) == [0]
    assert fullatt_indexes(32) == [7, 15, 23, 31] and fullatt_indexes(2) == [1]


# ---------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("arch", ARCHS)
def test_processor_has_image_processor_and_matching_ids(tiny_dirs, arch):
    proc = load_processor(tiny_dirs[arch])
    assert proc.image_processor is not None and proc.tokenizer is not None
    if not torchvision_available():
        assert type(proc.image_processor).__name__ == "Qwen2VLImageProcessorPil"
    cfg = json.loads((tiny_dirs[arch] / "config.json").read_text())
    tok = proc.tokenizer
    assert cfg["image_token_id"] == tok.convert_tokens_to_ids("<|image_pad|>") == 2034
    assert cfg["video_token_id"] == tok.convert_tokens_to_ids("<|video_pad|>") == 2035
    assert cfg["vision_start_token_id"] == tok.convert_tokens_to_ids("<|vision_start|>") == 2031
    assert cfg["vision_end_token_id"] == tok.convert_tokens_to_ids("<|vision_end|>") == 2032
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token, tok.pad_token_id) == (
        "<|im_end|>", 2024, "<|endoftext|>", 2022)
    assert cfg["text_config"]["vocab_size"] == len(tok) == 2048
    gen = json.loads((tiny_dirs[arch] / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [2024, 2022] and gen["pad_token_id"] == 2022
    assert proc.chat_template == CHAT_TEMPLATE == tok.chat_template
    # the saved tokenizer (rebuilt by transformers from vocab + merges) encodes like ours
    ours = toks.build_small_tokenizer()
    for text in TEXTS:
        assert tok.encode(text, add_special_tokens=False) == ours.encode(text).ids


@pytest.mark.parametrize("arch", ARCHS)
def test_model_loads_and_runs_two_images(tiny_dirs, arch):
    from transformers import AutoModelForImageTextToText

    proc = load_processor(tiny_dirs[arch])
    model, info = AutoModelForImageTextToText.from_pretrained(tiny_dirs[arch],
                                                              output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}
    messages = [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "Find x in the first and"},
        {"type": "image"}, {"type": "text", "text": " the second diagram."}]}]
    text = proc.apply_chat_template(messages, add_generation_prompt=True)
    enc = proc(text=[text], images=[image(112, 112, 0), image(200, 90, 1)], return_tensors="np")
    grid = enc["image_grid_thw"]
    merge = proc.image_processor.merge_size
    assert grid.shape == (2, 3) and (grid[0] != grid[1]).any()
    n_pad = int((enc["input_ids"] == proc.image_token_id).sum())
    assert n_pad == int(grid.prod(-1).sum()) // merge**2
    assert enc["pixel_values"].shape == (int(grid.prod(-1).sum()),
                                         3 * 2 * proc.image_processor.patch_size**2)
    with torch.no_grad():
        out = model(**{k: torch.from_numpy(v) for k, v in enc.items()})
    assert out.logits.shape == (1, enc["input_ids"].shape[1], model.config.text_config.vocab_size)
    assert torch.isfinite(out.logits).all()
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()


def test_same_seed_same_bytes(tiny_dirs, tmp_path):
    again = build_tiny_checkpoint(tmp_path / "again", arch="qwen3_vl", vocab="small", seed=0)
    for path in sorted(tiny_dirs["qwen3_vl"].iterdir()):
        assert (again / path.name).read_bytes() == path.read_bytes(), path.name
    other = build_tiny_checkpoint(tmp_path / "other", arch="qwen3_vl", vocab="small", seed=1)
    assert (other / "model.safetensors").read_bytes() != (again / "model.safetensors").read_bytes()


def test_cli_sizes_reach_the_config(tmp_path):
    out = tmp_path / "cli"
    main(["--arch", "qwen2_5_vl", "--vocab", "small", "--out", str(out), "--hidden-size", "64",
          "--heads", "2", "--kv-heads", "1", "--vision-depth", "4", "--window-size", "112",
          "--max-pixels", str(16 * 28 * 28)])
    cfg = json.loads((out / "config.json").read_text())
    text, vision = cfg["text_config"], cfg["vision_config"]
    assert (text["hidden_size"], text["num_attention_heads"], text["num_key_value_heads"]) == (
        64, 2, 1)
    assert text["rope_parameters"]["mrope_section"] == [4, 6, 6]  # head_dim 32
    assert (vision["depth"], vision["window_size"], vision["fullatt_block_indexes"]) == (
        4, 112, [1, 3])
    assert vision["out_hidden_size"] == 64 and vision["patch_size"] == 14
    pre = json.loads((out / "preprocessor_config.json").read_text())
    assert pre["size"] == {"shortest_edge": 56 * 56, "longest_edge": 16 * 28 * 28}
    with pytest.raises(ValueError, match="window_size"):
        build_tiny_checkpoint(tmp_path / "bad", arch="qwen2_5_vl", window_size=100)


@pytest.mark.slow
def test_qwen_vocab_checkpoint_loads(tmp_path, qwen_ranks):
    from transformers import AutoModelForImageTextToText

    out = build_tiny_checkpoint(tmp_path / "q", arch="qwen3_vl", vocab="qwen", hidden_size=64,
                                vision_hidden=32)
    proc = load_processor(out)
    tok = proc.tokenizer
    assert [tok.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>", "<|image_pad|>",
                                                   "<tool_call>", "</think>")] == [
        151644, 151645, 151655, 151657, 151668]
    for text in TEXTS:
        assert tok.encode(text, add_special_tokens=False) == tiktoken_encode(text, qwen_ranks)
    model, info = AutoModelForImageTextToText.from_pretrained(out, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}
    assert model.config.text_config.vocab_size == 151936 and model.config.image_token_id == 151655
    text = proc.apply_chat_template([{"role": "user", "content": [{"type": "image"}]}],
                                    add_generation_prompt=True)
    enc = proc(text=[text], images=[image(64, 64, 2)], return_tensors="np")
    with torch.no_grad():
        logits = model(**{k: torch.from_numpy(v) for k, v in enc.items()}).logits
    assert logits.shape[-1] == 151936 and torch.isfinite(logits).all()


# ---------------------------------------------------------------------------- processor files


def test_missing_processor_config_is_an_error(tiny_dirs, tmp_path):
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_dirs["qwen3_vl"] / name, tmp_path / name)
    with pytest.raises(FileNotFoundError, match="preprocessor_config.json"):
        load_processor(tmp_path)


@pytest.mark.parametrize("arch", ARCHS)
def test_downloaded_checkpoint_layout_loads(tiny_dirs, tmp_path, arch):
    """Real downloads keep the image settings in preprocessor_config.json (no processor_config),
    the template in chat_template.json, and Qwen3-VL adds video_preprocessor_config.json."""
    src = tiny_dirs[arch]
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, tmp_path / name)
    pre = json.loads((src / "preprocessor_config.json").read_text())
    qwen3 = family(arch) == "qwen3_vl"
    pre["image_processor_type"] = "Qwen2VLImageProcessorFast" if qwen3 else "Qwen2VLImageProcessor"
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(pre))
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    if qwen3:
        video = {"video_processor_type": "Qwen3VLVideoProcessor", "patch_size": 16,
                 "temporal_patch_size": 2, "merge_size": 2, "processor_class": "Qwen3VLProcessor"}
        (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(video))
    legacy, ours = load_processor(tmp_path), load_processor(src)
    assert legacy.chat_template == CHAT_TEMPLATE
    text = "<|vision_start|><|image_pad|><|vision_end|>x"
    a = legacy(text=[text], images=[image(150, 100, 3)], return_tensors="np")
    b = ours(text=[text], images=[image(150, 100, 3)], return_tensors="np")
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])


NO_TORCH_PROBE = """
import importlib.util, sys
from PIL import Image
from common.processor import load_processor
p = load_processor(sys.argv[1])
text = p.apply_chat_template([{"role": "user", "content": [{"type": "image"}]}])
enc = p(text=[text], images=[Image.new("RGB", (100, 60))], return_tensors="np")
print(importlib.util.find_spec("torch") is None, "torch" in sys.modules,
      int((enc["input_ids"] == p.image_token_id).sum()), enc["image_grid_thw"].tolist())
"""


def test_processor_needs_no_torch(tiny_dirs, tmp_path):
    """With torch not installed, the processor still renders, tokenizes and patchifies into numpy
    (simulated by a copy of site-packages without torch; where torch is installed, transformers
    imports it anyway)."""
    site = Path(sysconfig.get_paths()["purelib"])
    for entry in site.iterdir():
        if not entry.name.startswith(("torch", "functorch")):
            (tmp_path / entry.name).symlink_to(entry)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}
    run = subprocess.run([sys.executable, "-S", "-c", NO_TORCH_PROBE, str(tiny_dirs["qwen3_vl"])],
                         env=env, cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split("\n")[-2] == "True False 6 [[1, 4, 6]]"


# ---------------------------------------------------------------------------- chat template

TOOL = {"type": "function", "function": {
    "name": "calc_score", "description": "Check an answer.",
    "parameters": {"type": "object", "properties": {"answer": {"type": "string"}},
                   "required": ["answer"]}}}
SYSTEM = {"role": "system", "content": "Solve the problem."}
USER = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Find x."}]}
CALL = {"role": "assistant", "content": "x = 12.", "tool_calls": [
    {"type": "function", "function": {"name": "calc_score", "arguments": {"answer": "12"}}}]}
FEEDBACK = {"role": "tool", "name": "calc_score", "content": "Correct. Score: 1.0"}

RENDERED_SYSTEM_TOOLS = (
    "<|im_start|>system\nSolve the problem.\n\n# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "calc_score", "description": "Check an answer.", '
    '"parameters": {"type": "object", "properties": {"answer": {"type": "string"}}, '
    '"required": ["answer"]}}}\n</tools>\n\n'
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n')
RENDERED_USER = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Find x.<|im_end|>\n"
RENDERED_CALL = ('<|im_start|>assistant\nx = 12.\n<tool_call>\n{"name": "calc_score", '
                 '"arguments": {"answer": "12"}}\n</tool_call><|im_end|>\n')
RENDERED_FEEDBACK = ("<|im_start|>user\n<tool_response>\nCorrect. Score: 1.0\n"
                     "</tool_response><|im_end|>\n")
GENERATION_PROMPT = "<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def render(tiny_dirs):
    proc = load_processor(tiny_dirs["qwen3_vl"])

    def _render(messages, tools=None, gen=False):
        return proc.apply_chat_template(messages, tools=tools, add_generation_prompt=gen,
                                        tokenize=False)
    return _render


def test_template_exact_conversation(render):
    full = render([SYSTEM, USER, CALL, FEEDBACK], tools=[TOOL], gen=True)
    assert full == (RENDERED_SYSTEM_TOOLS + RENDERED_USER + RENDERED_CALL + RENDERED_FEEDBACK
                    + GENERATION_PROMPT)


def test_template_turns_concatenate(render):
    prompt = render([SYSTEM, USER], tools=[TOOL], gen=True)
    assert prompt == RENDERED_SYSTEM_TOOLS + RENDERED_USER + GENERATION_PROMPT
    with_call = render([SYSTEM, USER, CALL], tools=[TOOL])
    assert with_call == prompt + RENDERED_CALL[len(GENERATION_PROMPT):]
    assert render([FEEDBACK], gen=True) == RENDERED_FEEDBACK + GENERATION_PROMPT
    assert render([SYSTEM, USER, CALL, FEEDBACK], tools=[TOOL], gen=True) == (
        with_call + render([FEEDBACK], gen=True))
    raw = "<think>\n reasoning kept </think>\n\n  spaces kept  \n"
    assert render([{"role": "assistant", "content": raw}]) == (
        GENERATION_PROMPT + raw + "<|im_end|>\n")


def test_template_variants(render):
    assert render([SYSTEM]) == "<|im_start|>system\nSolve the problem.<|im_end|>\n"
    assert render([USER], tools=[TOOL]).startswith("<|im_start|>system\n# Tools\n\n")
    as_list = {"role": "user", "content": [{"type": "text", "text": "Find x."}]}
    assert render([as_list]) == render([{"role": "user", "content": "Find x."}])
    url = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "a.png"}},
                                       {"image": "b.png"}, {"type": "video"}]}
    assert render([url]) == ("<|im_start|>user\n" + "<|vision_start|><|image_pad|><|vision_end|>"
                             * 2 + "<|vision_start|><|video_pad|><|vision_end|><|im_end|>\n")
    two = render([USER, FEEDBACK, {"role": "tool", "content": "Second."}, USER])
    assert two == (RENDERED_USER + "<|im_start|>user\n<tool_response>\nCorrect. Score: 1.0\n"
                   "</tool_response>\n<tool_response>\nSecond.\n</tool_response><|im_end|>\n"
                   + RENDERED_USER)
    string_args = {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "calc_score", "arguments": '{"answer": "1"}'}},
        {"name": "calc_score", "arguments": {"answer": "\\frac{1}{2}"}}]}
    assert render([string_args]) == (
        '<|im_start|>assistant\n<tool_call>\n{"name": "calc_score", "arguments": {"answer": "1"}}'
        '\n</tool_call>\n<tool_call>\n{"name": "calc_score", "arguments": {"answer": '
        '"\\\\frac{1}{2}"}}\n</tool_call><|im_end|>\n')


def test_template_tokens_are_special(tiny_dirs):
    proc = load_processor(tiny_dirs["qwen2_5_vl"])
    ids = proc.tokenizer.encode(RENDERED_CALL + RENDERED_FEEDBACK, add_special_tokens=False)
    assert ids[0] == 2023 and 2036 in ids and 2037 in ids and 2044 in ids and 2045 in ids
    assert ids.count(2024) == 2


def test_tiny_dir_of_another_arch_is_an_error(tmp_path):
    """Asking for a tiny Qwen2.5-VL where a tiny Qwen3-VL was built must not train the wrong one."""
    from configs import cpu
    from geo3k_torch.prepare import prepare_model_dir

    (tmp_path / "config.json").write_text('{"model_type": "qwen3_vl"}')
    cfg = cpu.get_config()
    cfg.model.tiny_dir, cfg.model.tiny_arch = str(tmp_path), "qwen2_5_vl"
    with pytest.raises(ValueError, match="holds a qwen3_vl checkpoint"):
        prepare_model_dir(cfg)


def test_the_tiny_checkpoint_is_the_same_for_every_run_seed_and_other_builds_are_refused(
        tmp_path):
    """Runs of any seed start from the checkpoint of `model.tiny_seed`; a folder built from
    other settings, or with none recorded, stops the run and is left as it was."""
    from configs import cpu
    from geo3k_torch.prepare import BUILD_RECORD, prepare_model_dir

    def config(seed=0, **model):
        cfg = cpu.get_config()
        cfg.seed = seed
        cfg.model.tiny_dir, cfg.model.tiny_prime_steps = str(tmp_path / "tiny"), 0
        cfg.model.update(model)
        return cfg

    out = Path(prepare_model_dir(config(seed=3)))
    plain = build_tiny_checkpoint(tmp_path / "plain", arch="qwen3_vl", vocab="small", seed=0)
    assert (out / "model.safetensors").read_bytes() == (plain / "model.safetensors").read_bytes()
    same = config(seed=4)
    same.env.max_turns = 5  # the environment is read by the priming only, which is off
    assert prepare_model_dir(same) == str(out)
    files = {f.name: f.read_bytes() for f in out.iterdir()}
    for key, value, said in (("tiny_seed", 1, "seed=0 where this config asks for 1"),
                             ("tiny_vocab", "qwen", "vocab='small' where this config asks for "
                                                    "'qwen'"),
                             ("tiny_prime_steps", 2, "prime_steps=None where this config asks "
                                                     "for 2"),
                             ("tiny_prime_later_steps", 2, "prime_later_steps=None where this "
                                                           "config asks for 2")):
        with pytest.raises(ValueError, match=said) as e:
            prepare_model_dir(config(**{key: value}))
        assert f"model.path={str(out)!r}" in str(e.value)
    (out / BUILD_RECORD).write_text("[1, 2]")
    with pytest.raises(ValueError, match="tiny_build.json: not a JSON object"):
        prepare_model_dir(config())
    (out / BUILD_RECORD).unlink()
    with pytest.raises(ValueError, match="no record of its settings"):
        prepare_model_dir(config())
    assert {f.name: f.read_bytes() for f in out.iterdir()} == {
        k: v for k, v in files.items() if k != BUILD_RECORD}
    assert prepare_model_dir(config(path=str(out))) == str(out)  # as it is, on purpose
