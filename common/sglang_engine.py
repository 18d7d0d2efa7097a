"""The SGLang rollout engine: `common.engine.Engine` over SGLang's native HTTP API.

    from common.sglang_server import launch_servers
    from common.sglang_engine import SGLangEngine
    with launch_servers("checkpoints/step_0", n=2) as group, \\
            SGLangEngine(group.urls, image_token_id=151655) as engine:
        completions = engine.generate(requests)        # one per request, same order
        engine.update_weights_from_disk("checkpoints/step_1")

Only the standard library talks to the servers (http.client, json, threads); sglang is never
imported. Each `Request` is one `POST /generate`; the requests of a `generate` call run
concurrently (at most `max_concurrency` in flight), each on one server: the server its session
used before (so a multi-turn episode keeps hitting its own radix cache), else the server with
the fewest requests in flight (ties in turn). Connection errors, timeouts, 429 and 5xx answers
are retried `max_retries` times with exponential backoff, each retry on another server when
there is one; a request that still fails (or gets another 4xx) comes back as an `abort`
Completion, which the rollout retries or aborts by its own policy.

Wire format, from SGLang's source (python/sglang/srt/...):
  * request (managers/io_struct.py `GenerateReqInput`; entrypoints/http_server.py
    `generate_request`): `input_ids` (list of int), `image_data` (one item per image, in
    placeholder order: SGLang's `load_image` takes a "data:image/png;base64,..." URL, a bare base64
    string, a file path or an http(s) URL; raw bytes cannot travel in JSON, so PIL images and
    bytes are sent as PNG / base64 data URLs (PIL images in RGB, transparency on white, as the
    learner's processor sees them) and strings as they are), `sampling_params`,
    `return_logprob: true`, `logprob_start_len: -1` (output tokens only), `stream: false`.
  * `sampling_params` (sampling/sampling_params.py `SamplingParams`): temperature, top_p,
    max_new_tokens, stop_token_ids; and, sent explicitly because a server launched with the
    default `--sampling-defaults model` fills every missing one from the checkpoint's
    generation_config.json (Qwen-VL ships top_k=1, repetition_penalty=1.05): top_k=-1, min_p=0,
    repetition/frequency/presence penalties neutral. skip_special_tokens=false and
    no_stop_trim=true only shape the returned text, which we ignore.
  * response: `{"text", "output_ids", "meta_info": {"finish_reason", "prompt_tokens",
    "completion_tokens", "output_token_logprobs", ...}}`. `output_token_logprobs` is a list of
    `[logprob, token_id, text-or-null]`, one per new token, the stop token included (the
    scheduler records a log-prob for every sampled token; `no_stop_trim` and the detokenizer's
    `trim_matched_stop` only cut the text). The tokens are read from it, as slime does;
    `output_ids` is only cross-checked. `finish_reason` (managers/schedule_batch.py
    `FINISH_*.to_json`) is {"type": "stop", "matched": id}, {"type": "length", "length": n} or
    {"type": "abort", "message": ...}. The scheduler tests length before stop tokens, so a stop
    token sampled as the last allowed token reads "length": we report that as "stop", like
    `LocalEngine`. Errors come back as HTTP 400 `{"error": {"message": ...}}`.

Log-probs (layers/sampler.py `Sampler.forward`): SGLang returns log softmax(logits / T) of the
sampled token, before top-k / top-p / min-p filtering (it samples from the filtered
distribution but reports the unfiltered, temperature-scaled one), and log_softmax(logits) for
greedy (T = 0) requests: exactly `Completion.logprobs`. Two server settings change that:
`SGLANG_RETURN_ORIGINAL_LOGPROB=1` returns pre-temperature log-probs (leave it unset), and
`--rl-on-policy-target` computes them in bf16 with log_softmax to match a trainer.

Image tokens (REFERENCE §5, the double expansion): our ids hold one `<|image_pad|>` per merged
patch; SGLang expects ONE pad per image and expands it itself. Its Qwen-VL processor
(multimodal/processors/qwen_vl.py `QwenVLImageProcessor.process_mm_data_async`) resizes each
image (`resize_image`: smart_resize with SGLang's own factor and pixel bounds) and runs the HF
processor on the prompt, whose `__call__` replaces each `<|image_pad|>` by one pad per merged
patch of the next image; with `SGLANG_MM_AVOID_RETOKENIZE` (on by default in current releases;
multimodal/processors/base_processor.py `process_and_combine_mm_data`, `_expand_input_ids`) it
then keeps the caller's ids verbatim and expands the i-th pad to the i-th image's count, which
it only does when pads and images are equally many (else it falls back to decode and
re-tokenize). Given expanded ids, releases differ: the legacy `load_mm_data` collapses each
`<|vision_start|><|image_pad|>+<|vision_end|>` run by regex (after a decode / re-tokenize round
trip), transformers 5 processors refuse the prompt ("The total number of <|image_pad|> tokens
... should be the same as the number of images"), transformers 4 ones fail indexing the image
grid, and the anchor's setup expanded them twice (a blind model). One pad per image is handled
alike by all. So the engine collapses each run of pads to one (`collapse_image_pads`) and checks
the answer: `meta_info.prompt_tokens` is the prompt length after SGLang's own expansion and must
equal len(Request.input_ids); a mismatch (SGLang resized an image to another grid than the
learner's processor, or re-tokenized text differently) raises `ImageTokenMismatch`. Pass the
learner's `processor` to send each image already resized as the learner's image processor
resizes it (`learner_image`): the pixels SGLang encodes are then the learner's, and its own
resize is a no-op wherever its factor and bounds agree with the learner's.

Weight sync and memory (http_server.py): `update_weights_from_disk` (POST
/update_weights_from_disk {"model_path", ...}; SGLang flushes its cache after loading),
`flush_cache` (POST /flush_cache), `release_memory` / `resume_memory` for colocated training
(POST /release_memory_occupation and /resume_memory_occupation {"tags": [...]}; the server
needs `--enable-memory-saver`), `health` (GET /health_generate: generates one token). Each goes
to every server; failures raise `SGLangError` naming the servers. Not here:
`/update_weights_from_tensor` carries `MultiprocessingSerializer`-pickled CUDA-IPC tensor
handles (SGLang's own Python objects, same node only) and `/update_weights_from_distributed`
needs an NCCL group built with SGLang's `init_weights_update_group` on the trainer side; neither
can be done with plain HTTP, so in-memory weight sync is left out.
"""

from __future__ import annotations

import base64
import collections
import concurrent.futures
import dataclasses
import http.client
import io
import json
import logging
import math
import threading
import time
import urllib.parse
from typing import Any, Sequence

from common.engine import (ABORT, LENGTH, STOP, Completion, FatalEngineError, Request,
                           SamplingParams)

log = logging.getLogger(__name__)

_RETRYABLE_STATUS = {429, 500, 502, 503, 504}
_MAX_SESSIONS = 1 << 16  # session -> server entries kept for cache affinity


class SGLangError(RuntimeError):
    """A server failed or refused a call; the message names the server(s)."""


class ImageTokenMismatch(SGLangError, FatalEngineError):
    """SGLang's expanded prompt length differs from the learner's: the model would attend to
    other tokens than the learner trains on (see the module docstring)."""


@dataclasses.dataclass
class _Failure:
    """One failed HTTP attempt. `retry`: worth another attempt (transient)."""

    message: str
    retry: bool


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


def generate_payload(req: Request, image_token_id: int, image_data: Sequence[str]) -> dict:
    """The JSON body of `POST /generate` for one request (image pads collapsed, see above)."""
    ids, runs = collapse_image_pads(req.input_ids, image_token_id)
    if len(runs) != len(image_data):
        raise ValueError(f"request {req.session!r}: {len(runs)} runs of image token "
                         f"{image_token_id} but {len(image_data)} images; each image needs its "
                         "own run (Qwen-VL wraps each in <|vision_start|>...<|vision_end|>)")
    body = {"input_ids": ids, "sampling_params": sampling_payload(req.sampling),
            "return_logprob": True, "logprob_start_len": -1, "stream": False}
    if image_data:
        body["image_data"] = list(image_data)
    return body


# ---------------------------------------------------------------------------- response parsing

def parse_generate_response(body: dict, sampling: SamplingParams,
                            prompt_tokens: int | None = None) -> Completion:
    """A `Completion` from SGLang's `/generate` answer. `prompt_tokens`: the expected expanded
    prompt length (len of the learner's ids), checked against `meta_info.prompt_tokens`."""
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
    return Completion(ids, logps, STOP if stopped else LENGTH)


# ------------------------------------------------------------------------------------- transport

def http_call(url: str, method: str, path: str, payload: Any = None, timeout: float = 60.0
              ) -> tuple[int, bytes]:
    """One HTTP request; returns (status, body). Raises OSError / http.client.HTTPException on
    connection failures and timeouts (`timeout` seconds for the connect and for each read)."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        data = None if payload is None else json.dumps(payload).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        conn.request(method, parts.path.rstrip("/") + path, body=data, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _error_text(status: int, raw: bytes) -> str:
    """SGLang's error message out of an error body ({"error": {"message"}}, or plain text)."""
    try:
        body = json.loads(raw)
        msg = body.get("error", {}).get("message") if isinstance(body, dict) else None
        if msg is None and isinstance(body, dict):
            msg = body.get("message")
    except (ValueError, AttributeError):
        msg = None
    return f"HTTP {status}: {msg if msg is not None else raw[:300].decode(errors='replace')}"


class _Balancer:
    """Picks a server per request: the session's previous server, else the least loaded (ties
    in turn). `outstanding[i]` counts requests in flight on server i."""

    def __init__(self, n: int):
        self.outstanding = [0] * n
        self.sessions: collections.OrderedDict[str, int] = collections.OrderedDict()
        self.last = -1
        self.lock = threading.Lock()

    def acquire(self, session: str, avoid: int | None = None) -> int:
        with self.lock:
            n = len(self.outstanding)
            i = self.sessions.get(session) if session else None
            if i is None or (i == avoid and n > 1):
                order = [(self.last + 1 + k) % n for k in range(n)]
                order = [j for j in order if j != avoid] or order
                i = min(order, key=lambda j: self.outstanding[j])  # first of the ties in turn
                self.last = i
            if session:
                self.sessions[session] = i
                self.sessions.move_to_end(session)
                if len(self.sessions) > _MAX_SESSIONS:
                    self.sessions.popitem(last=False)
            self.outstanding[i] += 1
            return i

    def release(self, i: int) -> None:
        with self.lock:
            self.outstanding[i] -= 1

    def forget_sessions(self) -> None:
        with self.lock:
            self.sessions.clear()


# ---------------------------------------------------------------------------------------- engine

class SGLangEngine:
    """`Engine` over SGLang servers at `urls` (e.g. "http://127.0.0.1:30000"). See the module
    docstring for the wire format, balancing, retries and the image-token handling.

    image_token_id: the model's `<|image_pad|>` id (config.image_token_id).
    processor: the learner's processor; if given, images are sent resized as it resizes them.
    timeout_s: per attempt, seconds to connect and to wait for the answer.
    max_retries: further attempts after a transient failure; backoff_s * 2**k before retry k.
    max_concurrency: requests in flight at once, over all servers.
    control_timeout_s: seconds for weight updates and the other control calls.
    check_prompt_tokens: check SGLang's expanded prompt length (raise `ImageTokenMismatch`).
    """

    def __init__(self, urls: Sequence[str], *, image_token_id: int, processor=None,
                 timeout_s: float = 600.0, max_retries: int = 3, backoff_s: float = 1.0,
                 max_concurrency: int = 256, control_timeout_s: float = 1800.0,
                 check_prompt_tokens: bool = True):
        if not urls:
            raise ValueError("SGLangEngine needs at least one server url")
        if max_retries < 0 or max_concurrency < 1 or timeout_s <= 0 or backoff_s < 0:
            raise ValueError(f"bad limits: max_retries={max_retries}, max_concurrency="
                             f"{max_concurrency}, timeout_s={timeout_s}, backoff_s={backoff_s}")
        self.urls = [u.rstrip("/") for u in urls]
        self.image_token_id = int(image_token_id)
        self.processor = processor
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.control_timeout_s = control_timeout_s
        self.check_prompt_tokens = check_prompt_tokens
        self.balancer = _Balancer(len(self.urls))
        self.pool = concurrent.futures.ThreadPoolExecutor(max_concurrency, "sglang-request")

    def close(self) -> None:
        """Stop the request threads (the servers are not touched)."""
        self.pool.shutdown(wait=True)

    def __enter__(self) -> "SGLangEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- generation

    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        """One Completion per request, same order; `abort` for requests that kept failing."""
        if not requests:
            return []
        encoded: dict[int, tuple[Any, str]] = {}  # id(image) -> (image, data URL), this call
        bodies = [generate_payload(r, self.image_token_id,
                                   [self._encode(im, encoded) for im in r.images])
                  for r in requests]
        futures = [self.pool.submit(self._run, r, b) for r, b in zip(requests, bodies)]
        return [f.result() for f in futures]

    def _encode(self, image, cache: dict) -> str:
        """Data URL of an image, encoded once per `generate` call however many requests hold it."""
        hit = cache.get(id(image))
        if hit is None:
            prepared = image
            if hasattr(image, "getbands"):  # a PIL image
                prepared = to_rgb(image)
                if self.processor is not None:
                    prepared = learner_image(prepared, self.processor)
            hit = cache[id(image)] = (image, encode_image(prepared))
        return hit[1]

    def _run(self, req: Request, body: dict) -> Completion:
        """Send one request with retries; abort Completion when every attempt failed."""
        avoid = None
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            i = self.balancer.acquire(req.session, avoid)
            try:
                status, raw = http_call(self.urls[i], "POST", "/generate", body, self.timeout_s)
            except (OSError, http.client.HTTPException) as e:
                failure = _Failure(f"{type(e).__name__}: {e}", retry=True)
            else:
                if status == 200:
                    out = json.loads(raw)
                    expected = len(req.input_ids) if self.check_prompt_tokens else None
                    return parse_generate_response(out, req.sampling, expected)
                failure = _Failure(_error_text(status, raw), retry=status in _RETRYABLE_STATUS)
            finally:
                self.balancer.release(i)
            log.warning("SGLang %s /generate failed (attempt %d/%d): %s", self.urls[i],
                        attempt + 1, self.max_retries + 1, failure.message)
            if not failure.retry:
                break
            avoid = i
        return Completion([], [], ABORT)

    # -- control calls: every server, errors name the servers

    def _control(self, method: str, path: str, payload: Any = None,
                 timeout: float | None = None) -> list[Any]:
        """Call every server concurrently; returns their parsed JSON bodies (None for non-JSON)."""
        timeout = self.control_timeout_s if timeout is None else timeout

        def one(url: str):
            try:
                status, raw = http_call(url, method, path, payload, timeout)
            except (OSError, http.client.HTTPException) as e:
                return f"{url}{path}: {type(e).__name__}: {e}"
            try:
                body = json.loads(raw) if raw.strip() else None
            except ValueError:
                body = None
            if status != 200 or (isinstance(body, dict) and body.get("success") is False):
                return f"{url}{path}: " + _error_text(status, raw)
            return body

        with concurrent.futures.ThreadPoolExecutor(len(self.urls)) as pool:
            results = list(pool.map(one, self.urls))
        errors = [r for r in results if isinstance(r, str)]
        if errors:
            raise SGLangError(f"{len(errors)} of {len(self.urls)} servers failed: "
                              + "; ".join(errors))
        return results

    def update_weights_from_disk(self, model_path: str, *, weight_version: str | None = None,
                                 load_format: str | None = None,
                                 abort_all_requests: bool = False) -> None:
        """Every server loads the HF checkpoint directory `model_path` (and flushes its cache)."""
        payload: dict[str, Any] = {"model_path": str(model_path)}
        if weight_version is not None:
            payload["weight_version"] = weight_version
        if load_format is not None:
            payload["load_format"] = load_format
        if abort_all_requests:
            payload["abort_all_requests"] = True
        self._control("POST", "/update_weights_from_disk", payload)
        self.balancer.forget_sessions()

    def flush_cache(self) -> None:
        """Every server drops its radix (prefix) cache; refused while requests are running."""
        self._control("POST", "/flush_cache")
        self.balancer.forget_sessions()

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Colocated mode: every server frees its GPU memory (`tags`: "weights", "kv_cache";
        None = all). Needs servers launched with `--enable-memory-saver`."""
        self._control("POST", "/release_memory_occupation",
                      {} if tags is None else {"tags": list(tags)})

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """Colocated mode: every server takes its GPU memory back (None = all released)."""
        self._control("POST", "/resume_memory_occupation",
                      {} if tags is None else {"tags": list(tags)})

    def health(self, timeout_s: float = 60.0) -> None:
        """Raise `SGLangError` naming every server that cannot generate a token right now."""
        self._control("GET", "/health_generate", timeout=timeout_s)
