"""SGLang's native HTTP wire format: request encoding, answer parsing and the checks on answers.

Pure functions (no network) used by `common.sglang.engine.SGLangEngine` and the launcher.

Supported releases: SGLang >= 0.5.15 (`MIN_SGLANG_VERSION`; `check_server_versions` asks each
server's /server_info and refuses older ones); tested against the source of 0.5.23 and 0.5.15.

Wire format, from SGLang's source (0.5.23, python/sglang/srt/...):
  * request (managers/io_struct.py `GenerateReqInput`; entrypoints/http_server.py
    `generate_request`): `input_ids` (list of int), `image_data` (one item per image, in
    placeholder order: SGLang's `load_image` takes a "data:image/png;base64,..." URL, a bare base64
    string, a file path or an http(s) URL; raw bytes cannot travel in JSON, so PIL images and
    bytes are sent as PNG / base64 data URLs (PIL images in RGB, transparency on white, as the
    learner's processor sees them) and strings as they are), `sampling_params`,
    `return_logprob: true`, `logprob_start_len: -1` (output tokens only), `stream: false`.
  * `sampling_params` (sampling/sampling_params.py `SamplingParams`): temperature, top_p,
    max_new_tokens, stop_token_ids; and every other knob explicitly neutral (top_k=-1, min_p=0,
    repetition/frequency/presence penalties): native /generate fills a missing key from
    `--preferred-sampling-params` when the server was launched with it (`--sampling-defaults`
    and generation_config.json only reach the OpenAI endpoints), so nothing is left to a server
    flag. Unknown keys are refused. skip_special_tokens=false and no_stop_trim=true only shape
    the returned text, which we ignore.
  * response: `{"text", "output_ids", "meta_info": {"finish_reason", "prompt_tokens",
    "completion_tokens", "output_token_logprobs", "weight_version", ...}}` and, when asked
    with `return_prompt_token_ids`, a top-level `prompt_token_ids` (the prompt after SGLang's
    image expansion). `output_token_logprobs` is a list of
    `[logprob, token_id, text-or-null]`, one per new token, the stop token included (the
    scheduler records a log-prob for every sampled token; `no_stop_trim` and the detokenizer's
    `trim_matched_stop` only cut the text). The tokens are read from it, as slime does;
    `output_ids` is only cross-checked. `finish_reason` (managers/schedule_batch.py
    `FINISH_*.to_json`) is {"type": "stop", "matched": id}, {"type": "length", "length": n} or
    {"type": "abort", "message": ...}. 0.5.23 tests stop tokens before the length cap; 0.5.15
    tested length first, so there a stop token sampled as the last allowed token reads
    "length": we report that as "stop" either way, like `LocalEngine`. Errors come back as
    HTTP 400 `{"error": {"message": ...}}`.
  * routing replay (`loss.routing_replay`): a request with `return_routed_experts: true` to a
    server launched with `--enable-return-routed-experts` gets `meta_info.routed_experts`,
    base64 of int32 bytes (detokenizer_manager.py; tokenizer_manager.py stores it), C-order
    (rows, L, K) with L = num_hidden_layers and K = num_experts_per_tok: the logical experts
    every layer chose for each position of [0, prompt_tokens + completion_tokens - 1) (prompt
    included, the last new token never fed; radix-cached positions keep the routing of when they
    were computed). A server without the flag answers without the key and without a word, so a
    missing key is an error here (`RoutingNotReturned`), and so is another row count.

Log-probs (layers/sampler.py `Sampler.forward`): SGLang returns log softmax(logits / T) of the
sampled token, before top-k / top-p / min-p filtering (it samples from the filtered
distribution but reports the unfiltered, temperature-scaled one), and log_softmax(logits) for
greedy (T = 0) requests: exactly `Completion.logprobs`. Two server settings change that:
`SGLANG_RETURN_ORIGINAL_LOGPROB=1` returns pre-temperature log-probs (leave it unset), and
`--rl-on-policy-target` computes them in bf16 with log_softmax to match a trainer.

Image tokens (the double expansion other frameworks shipped): our ids hold one `<|image_pad|>` per merged
patch; SGLang expects ONE pad per image and expands it itself. Its Qwen-VL processor
(multimodal/processors/qwen_vl.py `QwenVLImageProcessor.process_mm_data_async`) runs the HF
processor of the model directory on the image and the prompt (0.5.23 resizes only videos
itself; releases before SGLang PR #12458 also resized Qwen3-VL images, with factor 28); with
`SGLANG_MM_AVOID_RETOKENIZE` (on by default by 0.5.15; base_processor.py `_expand_input_ids`) it
keeps the caller's ids verbatim and expands the i-th pad to the i-th image's merged-patch count,
refusing a prompt whose pads and images differ in number. Expanded ids would fail or be expanded
twice (a blind model), so the engine collapses each run of pads to one (`collapse_image_pads`)
and checks the answer: `meta_info.prompt_tokens` (the prompt after SGLang's expansion) must
equal len(Request.input_ids), else `ImageTokenMismatch` (SGLang's processor gave an image
another grid than the learner's, or text was re-tokenized). The exact check compares the ids
themselves: `check_prompt_ids="first"` asks the first request of a run for
`return_prompt_token_ids`, "every" asks every request, and `check_prompt_ids_next()` arms one
more check on demand. Pass the learner's `processor` to send each image already resized as the
learner's image processor resizes it (`learner_image`), so both sides see the same pixels.
"""

from __future__ import annotations

import base64
import io
import logging
import math
from typing import Sequence

import numpy as np

from common.engine import (ABORT, LENGTH, STOP, Completion, FatalEngineError, Request,
                           SamplingParams)

log = logging.getLogger(__name__)

MIN_SGLANG_VERSION = (0, 5, 15)  # first release with SGLANG_MM_AVOID_RETOKENIZE on by default
TESTED_BELOW = (0, 6)  # newer servers run with a warning (the `gpu` extra pins 0.5.23)


class SGLangError(RuntimeError):
    """A server failed or refused a call; the message names the server(s)."""


class ImageTokenMismatch(SGLangError, FatalEngineError):
    """SGLang's expanded prompt differs from the learner's: the model would attend to other
    tokens than the learner trains on (see the module docstring)."""


class StaleWeightsError(SGLangError, FatalEngineError):
    """A server reports another weight version than the last update set: the rollout would
    sample from a policy the learner does not think it is."""


class SGLangVersionError(SGLangError):
    """A server runs an SGLang release older than `MIN_SGLANG_VERSION`."""


class RoutingNotReturned(SGLangError, FatalEngineError):
    """Routing replay asked for the routed experts and the answer has none (the server was
    launched without --enable-return-routed-experts) or not one row per fed position."""


# ----------------------------------------------------------------------------- request encoding

def collapse_image_pads(input_ids: Sequence[int], image_token_id: int
                        ) -> tuple[list[int], list[int]]:
    """Each run of `image_token_id` collapsed to one; returns (ids, run lengths in order)."""
    ids, runs = [], []
    prev_pad = False
    for t in input_ids:
        t = int(t)
        if t == image_token_id:
            if prev_pad:
                runs[-1] += 1
                continue
            runs.append(1)
        ids.append(t)
        prev_pad = t == image_token_id
    return ids, runs


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int
                 ) -> tuple[int, int]:
    """(height, width) a Qwen-VL image processor resizes an image to: both multiples of `factor`
    (patch size x merge size), aspect ratio kept, area within [min_pixels, max_pixels]."""
    if max(height, width) > 200 * min(height, width):
        raise ValueError(f"aspect ratio of {width}x{height} is over 200")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        scale = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / scale / factor) * factor)
        w = max(factor, math.floor(width / scale / factor) * factor)
    elif h * w < min_pixels:
        scale = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * scale / factor) * factor
        w = math.ceil(width * scale / factor) * factor
    return h, w


def to_rgb(image):
    """A PIL image in RGB, transparency composited onto white as the HF image processors do
    (SGLang's loader would just drop the alpha channel)."""
    from PIL import Image
    if image.mode == "RGB":
        return image
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def learner_image(image, processor):
    """`image` (PIL, RGB) at the size the learner's image processor resizes it to (bicubic, as
    the processor does), so the server's processor sees the learner's pixels."""
    ip = processor.image_processor
    size = ip.size
    bound = (lambda k: size.get(k)) if isinstance(size, dict) else (lambda k: getattr(size, k))
    lo = getattr(ip, "min_pixels", None) or bound("shortest_edge")
    hi = getattr(ip, "max_pixels", None) or bound("longest_edge")
    h, w = smart_resize(image.height, image.width, ip.patch_size * ip.merge_size, lo, hi)
    if (w, h) == image.size:
        return image
    from PIL import Image
    return image.resize((w, h), resample=Image.Resampling.BICUBIC)


def encode_image(image) -> str:
    """An `image_data` item: PIL image -> PNG data URL, bytes -> base64 data URL, str (path,
    URL or data URL) as is."""
    if isinstance(image, str):
        return image
    if isinstance(image, (bytes, bytearray)):
        return "data:image/png;base64," + base64.b64encode(bytes(image)).decode("ascii")
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def sampling_payload(s: SamplingParams) -> dict:
    """SGLang `sampling_params` for our `SamplingParams`; every other knob set to neutral."""
    return {"temperature": s.temperature, "top_p": s.top_p, "top_k": -1, "min_p": 0.0,
            "max_new_tokens": s.max_new_tokens,
            "stop_token_ids": [int(t) for t in s.stop_token_ids],
            "repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
            "skip_special_tokens": False, "spaces_between_special_tokens": False,
            "no_stop_trim": True}


def generate_payload(req: Request, image_token_id: int, image_data: Sequence[str],
                     routed_experts: bool = False) -> dict:
    """The JSON body of `POST /generate` for one request (image pads collapsed, see above);
    routed_experts: ask for the routing of every position (routing replay)."""
    ids, runs = collapse_image_pads(req.input_ids, image_token_id)
    if len(runs) != len(image_data):
        raise ValueError(f"request {req.session!r}: {len(runs)} runs of image token "
                         f"{image_token_id} but {len(image_data)} images; each image needs its "
                         "own run (Qwen-VL wraps each in <|vision_start|>...<|vision_end|>)")
    body = {"input_ids": ids, "sampling_params": sampling_payload(req.sampling),
            "return_logprob": True, "logprob_start_len": -1, "stream": False}
    if image_data:
        body["image_data"] = list(image_data)
    if routed_experts:
        body["return_routed_experts"] = True
    return body


# ---------------------------------------------------------------------------- response parsing

def parse_generate_response(body: dict, sampling: SamplingParams,
                            prompt_tokens: int | None = None,
                            routing: tuple[int, int] | None = None) -> Completion:
    """A `Completion` from SGLang's `/generate` answer. `prompt_tokens`: the expected expanded
    prompt length (len of the learner's ids), checked against `meta_info.prompt_tokens`.
    routing: (L layers, top k) of the routed experts the request asked for (`routed_experts`),
    None: not asked."""
    meta = body["meta_info"]
    finish = meta.get("finish_reason") or {}
    kind = finish.get("type") if isinstance(finish, dict) else None
    if kind == "abort":
        log.warning("SGLang aborted a request: %s", finish.get("message"))
        return Completion([], [], ABORT)
    if kind not in ("stop", "length"):
        raise SGLangError(f"unexpected finish_reason {finish!r}")
    got = meta.get("prompt_tokens")
    if prompt_tokens is not None and got is not None and int(got) != prompt_tokens:
        raise ImageTokenMismatch(
            f"SGLang's prompt has {got} tokens after its image expansion, the learner's "
            f"{prompt_tokens}: the server resizes images to another grid (or re-tokenizes text) "
            "than the learner's processor; pass `processor=` and check SGLang's image pixel "
            "bounds, or launch with SGLANG_MM_AVOID_RETOKENIZE=1")
    pairs = meta.get("output_token_logprobs")
    if pairs is None:
        raise SGLangError("answer has no meta_info.output_token_logprobs")
    ids = [int(p[1]) for p in pairs]
    if any(p[0] is None for p in pairs):
        raise SGLangError("answer has a null output log-prob")
    logps = [float(p[0]) for p in pairs]
    out_ids = body.get("output_ids")
    if out_ids is not None and len(out_ids) == len(ids) and [int(t) for t in out_ids] != ids:
        raise SGLangError(f"output_ids {out_ids} disagree with output_token_logprobs ids {ids}")
    if len(ids) > sampling.max_new_tokens:
        raise SGLangError(f"{len(ids)} tokens for max_new_tokens={sampling.max_new_tokens}")
    stopped = kind == "stop" or (ids and ids[-1] in sampling.stop_token_ids)
    routed = None if routing is None else routed_experts(meta, routing, len(ids))
    return Completion(ids, logps, STOP if stopped else LENGTH, routed)


def routed_experts(meta: dict, routing: tuple[int, int], new_tokens: int) -> np.ndarray:
    """(prompt_tokens + new_tokens - 1, L, K) int32: `meta_info.routed_experts` decoded (see the
    module docstring), routing = (L, K); `RoutingNotReturned` when missing or of another
    size."""
    raw = meta.get("routed_experts")
    if raw is None:
        raise RoutingNotReturned(
            "loss.routing_replay: SGLang's answer has no meta_info.routed_experts; launch the "
            "server with --enable-return-routed-experts (servers launched here get it)")
    experts = np.frombuffer(base64.b64decode(raw), np.int32)
    rows = int(meta["prompt_tokens"]) + new_tokens - 1
    if experts.size != rows * math.prod(routing):
        raise RoutingNotReturned(
            f"SGLang returned {experts.size} routed expert ids, {rows} fed positions x "
            f"{routing[0]} layers x top {routing[1]} expected")
    return experts.reshape(rows, *routing)


def check_answer_version(body: dict, url: str, expected: str) -> None:
    """Raise `StaleWeightsError` unless the answer was generated by weight version `expected`
    (`meta_info.weight_version`, and every span of `meta_info.weight_versions` when present)."""
    meta = body.get("meta_info") or {}
    got = meta.get("weight_version")
    spans = [s.get("version") for s in meta.get("weight_versions") or [] if isinstance(s, dict)]
    bad = [v for v in [got, *spans] if v != expected]
    if bad:
        raise StaleWeightsError(f"SGLang server {url} answered with weight version {bad[0]!r}, "
                                f"expected {expected!r} (the last update's): the server did not "
                                "load the new weights, or was restarted, or is another server")


def check_answer_prompt_ids(body: dict, url: str, expected: Sequence[int]) -> None:
    """Raise `ImageTokenMismatch` unless SGLang's expanded prompt ids (`prompt_token_ids`,
    returned for `return_prompt_token_ids`) are exactly the learner's ids `expected`."""
    got = body.get("prompt_token_ids")
    if got is None:
        raise SGLangError(f"SGLang server {url} returned no prompt_token_ids for "
                          "return_prompt_token_ids (needs SGLang >= 0.5.15)")
    got, want = [int(t) for t in got], [int(t) for t in expected]
    if got == want:
        return
    i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    raise ImageTokenMismatch(
        f"SGLang server {url} expanded the prompt to {len(got)} ids, the learner has "
        f"{len(want)}; first difference at position {i}: server {got[max(0, i - 3):i + 4]}, "
        f"learner {want[max(0, i - 3):i + 4]} (another image grid or a re-tokenized text)")


def parse_version(text: str) -> tuple[int, ...]:
    """The leading release numbers of a version string: "0.5.15.post1" -> (0, 5, 15)."""
    numbers = []
    for part in str(text).split("."):
        digits = ""
        for ch in part:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        numbers.append(int(digits))
        if len(digits) != len(part):
            break
    if not numbers:
        raise ValueError(f"not a version: {text!r}")
    return tuple(numbers)


def check_version(url: str, version: str) -> None:
    """Refuse (`SGLangVersionError`) a server older than `MIN_SGLANG_VERSION`; warn above the
    tested range."""
    got = parse_version(version)
    want = ".".join(map(str, MIN_SGLANG_VERSION))
    if got < MIN_SGLANG_VERSION:
        raise SGLangVersionError(
            f"SGLang server {url} runs sglang {version}; geo3k-rl needs >= {want}: older releases "
            "decode and re-tokenize the multi-turn prompt around images (no "
            "SGLANG_MM_AVOID_RETOKENIZE) and resized Qwen3-VL images with factor 28 (another "
            "grid than the learner's). Install the `gpu` extra (pip install -e .[gpu])")
    if got >= TESTED_BELOW:
        log.warning("SGLang server %s runs sglang %s, newer than the tested range (< %s)", url,
                    version, ".".join(map(str, TESTED_BELOW)))
