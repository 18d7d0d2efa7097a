"""The SGLang rollout engine: `common.engine.Engine` over SGLang's native HTTP API.

    from common.sglang.server import launch_servers
    from common.sglang.engine import SGLangEngine
    with launch_servers("checkpoints/step_0", n=2) as group, \\
            SGLangEngine(group.urls, image_token_id=151655) as engine:
        completions = engine.generate(requests)        # one per request, same order
        engine.release_memory()                        # colocated: abort, wait idle, release
        engine.resume_memory()
        engine.update_weights_from_disk("checkpoints/step_1", version=1)  # then checked
        engine.update_weights_from_tensors([(payloads, True)], version=2)  # colocated

Only the standard library talks to the servers (http.client, json, threads); sglang is never
imported. Each `Request` is one `POST /generate`; the requests of a `generate` call run
concurrently (at most `max_concurrency` in flight), each on one server: the server its session
used before (so a multi-turn episode keeps hitting its own radix cache), else the server its
group went to (a group's samples share the prompt's prefill in that server's radix cache), else
the server with the fewest requests in flight (ties in turn). Connection errors, timeouts, 429
and 5xx answers are retried `max_retries` times with exponential backoff, each retry on another
server when there is one; a request that still fails (or gets another 4xx) comes back as an `abort`
Completion, which the rollout retries or aborts by its own policy.

The wire format (request encoding, answer parsing, the image-token and version checks) is in
common/sglang/wire.py.

Weight sync (http_server.py `update_weights_from_disk`): POST /update_weights_from_disk
{"model_path", "weight_version"} -> {"success", "message", "num_paused_requests"}; SGLang
flushes its cache after loading. Its Qwen-VL loaders skip parameter names they do not know
without an error, so `success` alone proves little: every update carries a weight version, each
server's /model_info must report it right after, and every later answer's
`meta_info.weight_version` (and each span of `meta_info.weight_versions`) must equal it, else
`StaleWeightsError` names the server and both versions.

Colocated memory (`release_memory` / `resume_memory`; the server needs `--enable-memory-saver`):
SGLang's /release_memory_occupation asserts that its scheduler is idle and the failed assertion
takes the whole server down, so a release first aborts what is still running
(POST /abort_request {"abort_all": true}), then polls POST /flush_cache, which answers 400 while
any request runs, until it answers 200 (at most `idle_timeout_s`, else `SGLangError`), and only
then releases. `health` is GET /health_generate (it sleeps 1 s and generates one token). Each
control call goes to every server; failures raise `SGLangError` naming the servers.

In-memory weight sync (colocated servers; http_server.py `update_weights_from_tensor`,
`begin_weight_update`, `end_weight_update`; io_struct.py `UpdateWeightsFromTensorReqInput`,
`BeginWeightUpdateReqInput`, `EndWeightUpdateReqInput`): 0.5.23 loads tensors only inside a
weight-update session (scheduler_components/weight_updater.py refuses them otherwise), so
`update_weights_from_tensors` opens one with POST /begin_weight_update {"selector": "all"},
sends each bucket as POST /update_weights_from_tensor {"serialized_named_tensors": [one base64
payload per tp rank], "flush_cache", "weight_version"} and closes it with POST
/end_weight_update {}. A payload is a pickled [(name, tensor)] whose CUDA tensors travel as IPC
handles (torch.multiprocessing's reductions, as SGLang's `MultiprocessingSerializer` writes
them; geo3k_torch.weight_sync builds them), so the server must run on the tensor's GPU. Only
the last bucket carries the weight version and flushes the cache (a flush refused because
requests are queued fails that call): a server that failed half way never reports the new
version. `/update_weights_from_distributed` (an NCCL group shared with the servers) is not used.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import http.client
import json
import logging
import threading
import time
import urllib.parse
from typing import Any, Sequence

from common.engine import ABORT, Completion, Request
from common.sglang.wire import (ImageTokenMismatch, RoutingNotReturned, SGLangError,
                                SGLangVersionError, StaleWeightsError, check_answer_prompt_ids,
                                check_answer_version, check_version, encode_image,
                                generate_payload, learner_image, parse_generate_response, to_rgb)

__all__ = ["SGLangEngine", "SGLangError", "ImageTokenMismatch", "StaleWeightsError",
           "SGLangVersionError", "RoutingNotReturned", "http_call"]

log = logging.getLogger(__name__)

_RETRYABLE_STATUS = {429, 500, 502, 503, 504}
_MAX_SESSIONS = 1 << 16  # session -> server entries kept for cache affinity
_IMAGE_CACHE = 512  # encoded images kept (a step's diagrams, sent with every sample and turn)
PROMPT_CHECKS = ("off", "first", "every")


@dataclasses.dataclass
class _Failure:
    """One failed HTTP attempt. `retry`: worth another attempt (transient)."""

    message: str
    retry: bool


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
    """Picks a server per request: the session's previous server, else its group's, else the
    least loaded (ties in turn). `outstanding[i]` counts requests in flight on server i."""

    def __init__(self, n: int):
        self.outstanding = [0] * n
        # ("session", name) / ("group", name) -> server, least recently used first
        self.homes: collections.OrderedDict[tuple[str, str], int] = collections.OrderedDict()
        self.last = -1
        self.lock = threading.Lock()

    def acquire(self, session: str, avoid: int | None = None, group: str = "") -> int:
        with self.lock:
            n = len(self.outstanding)
            keys = [k for k in (("session", session), ("group", group)) if k[1]]
            i = next((self.homes[k] for k in keys if k in self.homes), None)
            if i is None or (i == avoid and n > 1):
                order = [(self.last + 1 + k) % n for k in range(n)]
                order = [j for j in order if j != avoid] or order
                i = min(order, key=lambda j: self.outstanding[j])  # first of the ties in turn
                self.last = i
            for k in keys:
                self.homes[k] = i
                self.homes.move_to_end(k)
            while len(self.homes) > _MAX_SESSIONS:
                self.homes.popitem(last=False)
            self.outstanding[i] += 1
            return i

    def release(self, i: int) -> None:
        with self.lock:
            self.outstanding[i] -= 1

    def forget_sessions(self) -> None:
        with self.lock:
            self.homes.clear()


# ---------------------------------------------------------------------------------------- engine

class SGLangEngine:
    """`Engine` over SGLang servers at `urls` (e.g. "http://127.0.0.1:30000"). See the module
    docstring for the wire format, balancing, retries, image tokens, weight versions and release.

    image_token_id: the model's `<|image_pad|>` id (config.image_token_id).
    processor: the learner's processor; if given, images are sent resized as it resizes them.
    timeout_s: per attempt, seconds to connect and to wait for the answer.
    max_retries: further attempts after a transient failure; backoff_s * 2**k before retry k.
    max_concurrency: requests in flight at once, over all servers.
    control_timeout_s: seconds for weight updates and the other control calls.
    check_prompt_tokens: check SGLang's expanded prompt length (raise `ImageTokenMismatch`).
    check_prompt_ids: exact expanded-prompt check: "off", "first" (the first request this engine
        sends, and after each `check_prompt_ids_next()`) or "every" request.
    idle_timeout_s, idle_poll_s: how long `release_memory` polls /flush_cache for an idle server.
    routing: (L layers, top k) of a MoE model whose routed experts every request asks for and
        every Completion carries (routing replay; the servers need
        --enable-return-routed-experts); None: not asked.
    """

    def __init__(self, urls: Sequence[str], *, image_token_id: int, processor=None,
                 timeout_s: float = 600.0, max_retries: int = 3, backoff_s: float = 1.0,
                 max_concurrency: int = 256, control_timeout_s: float = 1800.0,
                 check_prompt_tokens: bool = True, check_prompt_ids: str = "first",
                 idle_timeout_s: float = 120.0, idle_poll_s: float = 0.5,
                 routing: tuple[int, int] | None = None):
        if not urls:
            raise ValueError("SGLangEngine needs at least one server url")
        if max_retries < 0 or max_concurrency < 1 or timeout_s <= 0 or backoff_s < 0:
            raise ValueError(f"bad limits: max_retries={max_retries}, max_concurrency="
                             f"{max_concurrency}, timeout_s={timeout_s}, backoff_s={backoff_s}")
        if check_prompt_ids not in PROMPT_CHECKS:
            raise ValueError(f"check_prompt_ids must be one of {PROMPT_CHECKS}, "
                             f"got {check_prompt_ids!r}")
        self.urls = [u.rstrip("/") for u in urls]
        self.image_token_id = int(image_token_id)
        self.processor = processor
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.control_timeout_s = control_timeout_s
        self.check_prompt_tokens = check_prompt_tokens
        self.check_prompt_ids = check_prompt_ids
        self.idle_timeout_s = idle_timeout_s
        self.idle_poll_s = idle_poll_s
        self.routing = routing
        self.weight_version: str | None = None  # set by the last update; None: not checked
        self._prompt_check_armed = check_prompt_ids == "first"
        self.balancer = _Balancer(len(self.urls))
        self._images: collections.OrderedDict[int, tuple[Any, str]] = collections.OrderedDict()
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
        """One Completion per request, same order; `abort` for requests that kept failing.
        Raises `ImageTokenMismatch` / `StaleWeightsError` (fatal) when a check fails."""
        return [f.result() for f in self._send(requests)]

    def submit(self, request: Request) -> concurrent.futures.Future:
        """One request on its own (`common.engine.AsyncEngine`): a future of its Completion,
        answered as soon as its server is done, whatever else is in flight."""
        return self._send([request])[0]

    def _send(self, requests: Sequence[Request]) -> list[concurrent.futures.Future]:
        """Encode the requests (each image once) and put them in flight."""
        bodies = [generate_payload(r, self.image_token_id, [self._encode(im) for im in r.images],
                                   self.routing is not None) for r in requests]
        for body in self._prompt_checked(bodies):
            body["return_prompt_token_ids"] = True
        return [self.pool.submit(self._run, r, b) for r, b in zip(requests, bodies)]

    def check_prompt_ids_next(self) -> None:
        """Compare the expanded prompt ids of the next request exactly (on demand)."""
        self._prompt_check_armed = True

    def _prompt_checked(self, bodies: list[dict]) -> list[dict]:
        """The bodies whose prompt ids get the exact check: all ("every"), or the first one
        after the check was armed."""
        if self.check_prompt_ids == "every":
            return bodies
        if self._prompt_check_armed:
            self._prompt_check_armed = False
            return bodies[:1]
        return []

    def _encode(self, image) -> str:
        """Data URL of an image, encoded once however many requests and turns carry it (the
        last `_IMAGE_CACHE` images are kept, each with a reference so its id stays its own)."""
        hit = self._images.get(id(image))
        if hit is None:
            prepared = image
            if hasattr(image, "getbands"):  # a PIL image
                prepared = to_rgb(image)
                if self.processor is not None:
                    prepared = learner_image(prepared, self.processor)
            hit = self._images[id(image)] = (image, encode_image(prepared))
            if len(self._images) > _IMAGE_CACHE:
                self._images.popitem(last=False)
        self._images.move_to_end(id(image))
        return hit[1]

    def _run(self, req: Request, body: dict) -> Completion:
        """Send one request with retries; abort Completion when every attempt failed."""
        avoid = None
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            i = self.balancer.acquire(req.session, avoid, req.group)
            try:
                status, raw = http_call(self.urls[i], "POST", "/generate", body, self.timeout_s)
            except (OSError, http.client.HTTPException) as e:
                failure = _Failure(f"{type(e).__name__}: {e}", retry=True)
            else:
                if status == 200:
                    return self._completion(json.loads(raw), req, body, self.urls[i])
                failure = _Failure(_error_text(status, raw), retry=status in _RETRYABLE_STATUS)
            finally:
                self.balancer.release(i)
            log.warning("SGLang %s /generate failed (attempt %d/%d): %s", self.urls[i],
                        attempt + 1, self.max_retries + 1, failure.message)
            if not failure.retry:
                break
            avoid = i
        return Completion([], [], ABORT)

    def _completion(self, out: dict, req: Request, body: dict, url: str) -> Completion:
        """The checked Completion of a 200 answer from `url` (weight version, prompt ids)."""
        finish = (out.get("meta_info") or {}).get("finish_reason") or {}
        aborted = isinstance(finish, dict) and finish.get("type") == "abort"
        if self.weight_version is not None and not aborted:
            check_answer_version(out, url, self.weight_version)
        if body.get("return_prompt_token_ids") and not aborted:
            check_answer_prompt_ids(out, url, req.input_ids)
        expected = len(req.input_ids) if self.check_prompt_tokens else None
        return parse_generate_response(out, req.sampling, expected, self.routing)

    # -- control calls: every server, errors name the servers

    def _control(self, method: str, path: str, payload: Any = None,
                 timeout: float | None = None) -> list[Any]:
        """Call every server concurrently; returns their parsed JSON bodies (None for non-JSON)."""
        timeout = self.control_timeout_s if timeout is None else timeout
        return self._each(lambda url: self._call(url, method, path, payload, timeout))

    def _each(self, fn) -> list[Any]:
        """fn(url) on every server concurrently; fn returns a result or raises `SGLangError`.
        Raises one `SGLangError` naming every server that failed."""
        def one(url: str):
            try:
                return fn(url)
            except SGLangError as e:
                return e

        with concurrent.futures.ThreadPoolExecutor(len(self.urls)) as pool:
            results = list(pool.map(one, self.urls))
        errors = [r for r in results if isinstance(r, SGLangError)]
        if errors:
            kind = type(errors[0]) if all(type(e) is type(errors[0]) for e in errors) \
                else SGLangError
            raise kind(f"{len(errors)} of {len(self.urls)} servers failed: "
                       + "; ".join(str(e) for e in errors))
        return results

    @staticmethod
    def _call(url: str, method: str, path: str, payload: Any, timeout: float) -> Any:
        """One control call; its parsed JSON body (None for non-JSON), or `SGLangError`."""
        try:
            status, raw = http_call(url, method, path, payload, timeout)
        except (OSError, http.client.HTTPException) as e:
            raise SGLangError(f"{url}{path}: {type(e).__name__}: {e}") from None
        try:
            body = json.loads(raw) if raw.strip() else None
        except ValueError:
            body = None
        if status != 200 or (isinstance(body, dict) and body.get("success") is False):
            raise SGLangError(f"{url}{path}: " + _error_text(status, raw))
        return body

    def check_server_versions(self) -> dict[str, str]:
        """Each server's SGLang release (/server_info "version"), by url; raises
        `SGLangVersionError` naming the servers older than `MIN_SGLANG_VERSION`."""
        def one(url: str) -> str:
            info = self._call(url, "GET", "/server_info", None, self.control_timeout_s)
            version = info.get("version") if isinstance(info, dict) else None
            if version is None:
                raise SGLangError(f"{url}/server_info reports no version")
            check_version(url, version)
            return version

        return dict(zip(self.urls, self._each(one)))

    def update_weights_from_disk(self, model_path: str, version: int | str | None = None, *,
                                 load_format: str | None = None,
                                 abort_all_requests: bool = False) -> str:
        """Every server loads the HF checkpoint directory `model_path` (and flushes its cache)
        as weight version `version` (the training step; None: the previous version + 1). Checks
        each server's `success` and /model_info, then every later answer; returns the version."""
        version = str(version if version is not None else self._next_version())
        payload: dict[str, Any] = {"model_path": str(model_path), "weight_version": version}
        if load_format is not None:
            payload["load_format"] = load_format
        if abort_all_requests:
            payload["abort_all_requests"] = True
        self.weight_version = version  # from now on, an answer of another version is an error
        self._control("POST", "/update_weights_from_disk", payload)
        self.balancer.forget_sessions()
        self.check_version(version)
        return version

    def update_weights_from_tensors(self, buckets, version: int | str) -> str:
        """Every server loads the weights of `buckets`, an iterable of per-tp-rank payload
        lists (base64 strings, see the module docstring) drawn one at a time, inside one
        weight-update session, as weight version `version`; then checks /model_info and every
        later answer. Raises `SGLangError` (session closed first when it was opened)."""
        version = str(version)
        self.weight_version = version
        try:
            self._control("POST", "/begin_weight_update", {"selector": "all"})
            sent = 0
            for payloads, last in buckets:
                body: dict[str, Any] = {"serialized_named_tensors": list(payloads),
                                        "flush_cache": bool(last)}
                if last:
                    body["weight_version"] = version
                self._control("POST", "/update_weights_from_tensor", body)
                sent += 1
            if not sent:
                raise SGLangError("update_weights_from_tensors was given no weights")
        except SGLangError:
            with contextlib.suppress(SGLangError):  # close what opened; the first error counts
                self._control("POST", "/end_weight_update", {})
            raise
        self._control("POST", "/end_weight_update", {})
        self.balancer.forget_sessions()
        self.check_version(version)
        return version

    def expect_version(self, version: int | str) -> None:
        """Check every later answer against weight version `version` (set by an update that
        another process made; sessions start over, as after any update)."""
        self.weight_version = str(version)
        self.balancer.forget_sessions()

    def _next_version(self) -> int:
        try:
            return int(self.weight_version) + 1
        except (TypeError, ValueError):
            return 1

    def check_version(self, version: int | str) -> None:
        """Raise `StaleWeightsError` naming every server whose /model_info reports another
        weight version than `version`."""
        want = str(version)

        def one(url: str) -> None:
            info = self._call(url, "GET", "/model_info", None, self.control_timeout_s)
            got = info.get("weight_version") if isinstance(info, dict) else None
            if got != want:
                raise StaleWeightsError(f"SGLang server {url} serves weight version {got!r}, "
                                        f"expected {want!r}")

        self._each(one)

    def flush_cache(self) -> None:
        """Every server drops its radix (prefix) cache; refused while requests are running."""
        self._control("POST", "/flush_cache")
        self.balancer.forget_sessions()

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Colocated mode: every server frees its GPU memory (`tags`: "weights", "kv_cache";
        None = all), once idle: abort what runs, poll /flush_cache until 200, release. Needs
        servers launched with `--enable-memory-saver`."""
        self._control("POST", "/abort_request", {"abort_all": True})
        self._each(self._wait_idle)
        self.balancer.forget_sessions()
        self._control("POST", "/release_memory_occupation",
                      {} if tags is None else {"tags": list(tags)})

    def _wait_idle(self, url: str) -> None:
        """Poll `url`/flush_cache until it answers 200 (nothing running, cache dropped); raise
        `SGLangError` at once on another answer, and after `idle_timeout_s` of 400s."""
        deadline = time.monotonic() + self.idle_timeout_s
        while True:
            try:
                status, raw = http_call(url, "POST", "/flush_cache", None, self.control_timeout_s)
            except (OSError, http.client.HTTPException) as e:
                raise SGLangError(f"{url}/flush_cache: {type(e).__name__}: {e}") from None
            if status == 200:
                return
            if status != 400:  # 400: requests still running; anything else is a failure
                raise SGLangError(f"{url}/flush_cache: " + _error_text(status, raw))
            if time.monotonic() >= deadline:
                raise SGLangError(f"{url} still busy {self.idle_timeout_s:g} s after "
                                  f"/abort_request ({_error_text(status, raw)}); its memory was "
                                  "not released (SGLang asserts an idle scheduler and dies "
                                  "otherwise)")
            time.sleep(self.idle_poll_s)

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """Colocated mode: every server takes its GPU memory back (None = all released)."""
        self._control("POST", "/resume_memory_occupation",
                      {} if tags is None else {"tags": list(tags)})

    def health(self, timeout_s: float = 60.0) -> None:
        """Raise `SGLangError` naming every server that cannot generate a token right now
        (SGLang's own health check takes 1 s and gives up after 20 s)."""
        self._control("GET", "/health_generate", timeout=timeout_s)
