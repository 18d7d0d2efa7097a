"""A fake SGLang server for CPU tests: SGLang 0.5.23's native HTTP API on 127.0.0.1, scripted.

It speaks the wire format documented in common/sglang/engine.py and is no kinder than the
released server (read from the 0.5.23 wheel's source) where the client depends on it:
  * start-up: /health, /health_generate and /generate answer 503 for `loading_s` seconds; after
    that a health call sleeps `health_delay_s` (1 s, as SGLang's handler does) and generates.
  * /generate: each image placeholder is expanded to `tokens_per_image` pads, and a prompt whose
    placeholder count differs from its image count is refused (SGLang's `_expand_input_ids`);
    the stop token is reported in `output_token_logprobs`; a stop token sampled as the last
    allowed token finishes as "stop" (0.5.23; `stop_beats_length=False` gives 0.5.15's
    "length"); `meta_info.weight_version` is the version of the last weight update ("default"
    before any); `return_prompt_token_ids` returns the expanded prompt ids.
  * routed experts (`routed_experts=(L, K, E)`: launched with --enable-return-routed-experts,
    serving a model of L layers routing to the top K of E experts): a request with
    `return_routed_experts` gets `meta_info.routed_experts`, base64 of int32 (rows, L, K) bytes,
    one row per fed position (prompt_tokens + completion_tokens - 1; `routed_row(t, l)` the
    experts of position t in layer l), an aborted one none; launched without the flag (None),
    the key is missing and nothing says why, as SGLang does.
  * /flush_cache answers 400 (plain text) while a request is running; /abort_request
    {"abort_all": true} ends every running request as "abort" (each leaves `abort_linger_s`
    after the abort, and only once a /flush_cache has been refused: aborting is not idling);
  * /release_memory_occupation with a request running fails SGLang's idle assertion: the server
    dies (no answer; every later call is refused), as the released server does. SGLang's
    `is_fully_idle` also counts queued requests; the fake has no queue (every request it holds
    counts as running), so "queued requests blocking a release" is modelled as running ones.
  * release and resume by tag ("weights", "kv_cache"; none: all). Released weights come back
    as garbage: SGLang's memory saver keeps no copy (no `--enable-weights-cpu-backup`), so
    after a resume of "weights" the model must be loaded again. SGLang answers on such weights
    without a word; the fake answers too, and appends why to `garbage` ("weights released",
    "weights wiped by a release", "kv_cache released"), which the tests require to stay empty.
    Resuming a tag that is not released fails (HTTP 500): SGLang's scheduler raises a KeyError
    there (`offload_tags.remove`), so a release of some tags must be resumed by the same tags.
  * /update_weights_from_disk -> {success, message, num_paused_requests}, storing
    `weight_version`; /model_info reports it; /server_info reports `version`.
  * the weight-update session (io_struct.py `BeginWeightUpdateReqInput`, `EndWeightUpdateReqInput`,
    `UpdateWeightsFromTensorReqInput`): /begin_weight_update opens it (refused when open),
    /update_weights_from_tensor is refused outside it (success false, HTTP 400) and otherwise
    loads `serialized_named_tensors[tp_rank]` through `tensor_loader(bytes) -> [(name, tensor)]`
    into `tensors` (the payload's base64 is decoded as SGLang does; without a loader only its
    size is recorded); with `flush_cache` and a request running it answers SGLang's
    "cache was not flushed" failure; `weight_version` sets the version. /end_weight_update closes
    the session (refused when none is open). Weights are whole again once a session that loaded
    tensors ends, or after a disk load.

    with FakeSGLang(image_token_id=2000, tokens_per_image=3) as fake:   # ephemeral port
        fake.script.append(Action(ids=[104, 105]))      # the next /generate answer
        fake.url, fake.requests, fake.max_inflight

`/generate` answers from `script` (consumed in order) or, when it is empty, from
`responder(body) -> Action`. An Action can fail instead: "500", "400", "drop" (close the
connection without an answer) or "hang" (answer nothing until aborted or the fake closes).
While `gate` is clear, /generate requests wait (in flight) until it is set or they are aborted.
`fail_control` makes the control endpoints fail; `stale` makes a weight update answer success
but keep serving the old version (a server that did not load what it said it loaded);
`rewrite_prompt(ids) -> ids` changes the prompt the fake "tokenizes" (a re-tokenizing server).

As a program, for the launcher tests (it always binds 127.0.0.1; other flags, such as sglang's
`--host` and `--model-path`, are ignored):
    python tests/fake_sglang.py --port N [--loading-s S] [--health-delay-s S] [--exit-after-s S]
        [--unhealthy] [--ignore-sigterm] [--version V]
It prints its environment's torchrun variables at start (the launcher tests read the log).
"""

from __future__ import annotations

import argparse
import base64
import collections
import dataclasses
import io
import json
import os
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Sequence

import numpy as np

LOGPROB_STEP = -0.01
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")  # srt/constants.py GPU_MEMORY_ALL_TYPES  # the i-th new token's log-prob is LOGPROB_STEP * (i + 1)


@dataclasses.dataclass
class Action:
    """One scripted /generate answer: new tokens (the stop token is added for "stop"), how the
    generation ends ("stop", "length", "abort"), or a failure ("500", "400", "drop", "hang")."""

    ids: Sequence[int] = ()
    finish: str = "stop"
    fail: str | None = None


def logprob(i: int) -> float:
    return LOGPROB_STEP * (i + 1)


def routed_row(t: int, layer: int, k: int, experts: int) -> list[int]:
    """The K experts the fake routes position t to in `layer`: distinct, in no sorted order."""
    return [(3 * t + layer + j) % experts for j in range(k)][::-1]


def decode_image(item: str):
    """(mode, (width, height), first pixel) of an image data URL, else the item itself."""
    if not item.startswith("data:"):
        return item
    from PIL import Image
    try:
        image = Image.open(io.BytesIO(base64.b64decode(item.split(",", 1)[1])))
    except Exception:  # noqa: BLE001 - not an image SGLang could read; the tests look at it
        return item
    return image.mode, image.size, image.getpixel((0, 0))


class FakeSGLang:
    """The fake server (see the module docstring). Thread-safe counters and records."""

    def __init__(self, image_token_id: int = 2000, tokens_per_image: int = 3, port: int = 0,
                 healthy: bool = True, responder: Callable[[dict], Action] | None = None, *,
                 loading_s: float = 0.0, health_delay_s: float = 1.0, abort_linger_s: float = 0.2,
                 version: str = "0.5.23", stop_beats_length: bool = True,
                 on_death: Callable[[], None] | None = None, tp_rank: int = 0,
                 tensor_loader: Callable[[bytes], list] | None = None,
                 routed_experts: tuple[int, int, int] | None = None):
        self.image_token_id = image_token_id
        self.tokens_per_image = tokens_per_image
        self.healthy = healthy
        self.responder = responder or (lambda body: Action())
        self.loading_until = time.monotonic() + loading_s
        self.health_delay_s = health_delay_s
        self.abort_linger_s = abort_linger_s
        self.version = version
        self.stop_beats_length = stop_beats_length
        self.on_death = on_death or self.close
        self.script: collections.deque[Action] = collections.deque()
        self.requests: list[tuple[str, str, object]] = []  # (method, path, JSON body or None)
        self.images: list = []  # decode_image of every image received
        self.fail_control = False
        self.stale = False
        self.rewrite_prompt: Callable[[list[int]], list[int]] | None = None
        self.weight_version = "default"  # SGLang's --weight-version default
        self.model_path = ""
        self.dead = False
        self.released: set[str] = set()  # memory tags released and not resumed
        self.wiped = False  # weights released since the last load
        self.session: dict | None = None  # the open weight-update session
        self.tensors: dict[str, object] = {}  # what /update_weights_from_tensor loaded
        self.tensor_loader = tensor_loader
        self.tp_rank = tp_rank
        self.routed_experts = routed_experts
        self.garbage: list[str] = []  # why answers came from weights or memory not in place
        self.inflight = self.max_inflight = 0
        self.abort_epoch = 0  # bumped by every /abort_request with abort_all
        self.flushes_refused = self.refused_at_abort = 0
        self.cond = threading.Condition()
        self.gate = threading.Event()
        self.gate.set()
        self.closing = threading.Event()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), _handler(self))
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        if self.closing.is_set():
            return
        self.closing.set()
        self.gate.set()
        with self.cond:
            self.cond.notify_all()
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> "FakeSGLang":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def bodies(self, path: str = "/generate") -> list:
        """JSON bodies received on `path`, in order."""
        return [b for _, p, b in self.requests if p == path]

    def paths(self) -> list[str]:
        """The path of every request received, in order."""
        return [p for _, p, _ in self.requests]

    def wait_inflight(self, n: int, timeout: float = 10.0) -> bool:
        """Block until `n` /generate requests are in flight (False on timeout)."""
        with self.cond:
            return self.cond.wait_for(lambda: self.inflight >= n, timeout)

    def loading(self) -> bool:
        return time.monotonic() < self.loading_until

    # -- /generate

    def wait_released(self, event: threading.Event, epoch: int) -> bool:
        """Wait until `event` is set; True if an abort_all came first (the request is aborted)."""
        def done() -> bool:
            return event.is_set() or self.abort_epoch != epoch or self.closing.is_set()

        with self.cond:
            while not self.cond.wait_for(done, 0.02):  # setting `event` notifies no one
                pass
            return self.abort_epoch != epoch

    def generate(self, body: dict, epoch: int) -> tuple[int | None, dict | None]:
        """(status, JSON answer) of a request that arrived in abort epoch `epoch`; status None
        means drop the connection."""
        if self.wait_released(self.gate, epoch):
            return self.aborted()
        with self.cond:
            action = self.script.popleft() if self.script else None
        action = action or self.responder(body)
        if action.fail == "hang":
            if self.wait_released(self.closing, epoch):
                return self.aborted()
            return None, None  # the client has long given up
        if action.fail == "drop":
            return None, None
        if action.fail in ("500", "400"):
            return int(action.fail), {"error": {"message": f"scripted {action.fail}"}}
        images = body.get("image_data") or []
        ids = body["input_ids"]
        n_pads = sum(t == self.image_token_id for t in ids)
        if n_pads != len(images):  # SGLang's _expand_input_ids refuses this prompt
            return 400, {"error": {"message": f"prompt has {n_pads} image placeholder token(s) "
                                              f"but {len(images)} image(s) were provided"}}
        with self.cond:
            self.images += [decode_image(im) for im in images]
            self.garbage += [why for why, bad in (
                ("weights released", "weights" in self.released),
                ("kv_cache released", "kv_cache" in self.released),
                ("weights wiped by a release", self.wiped and "weights" not in self.released))
                if bad]
        prompt = self.expand(ids)
        sp = body["sampling_params"]
        out, reason = self.finish(action, sp["max_new_tokens"], sp["stop_token_ids"])
        meta = {"id": f"fake-{len(self.requests)}", "finish_reason": reason,
                "prompt_tokens": len(prompt), "weight_version": self.weight_version,
                "completion_tokens": len(out), "cached_tokens": 0,
                "output_token_logprobs": [[logprob(i), t, None] for i, t in enumerate(out)]}
        if self.routed_experts and body.get("return_routed_experts"):
            layers, k, e = self.routed_experts
            rows = np.array([[routed_row(t, i, k, e) for i in range(layers)]
                             for t in range(len(prompt) + len(out) - 1)], np.int32)
            meta["routed_experts"] = base64.b64encode(rows.tobytes()).decode("ascii")
        answer = {"text": "", "output_ids": out, "meta_info": meta}
        if body.get("return_prompt_token_ids"):
            answer["prompt_token_ids"] = prompt
        return 200, answer

    def expand(self, ids: list[int]) -> list[int]:
        """The prompt as SGLang sees it: each placeholder expanded to `tokens_per_image` pads."""
        out = []
        for t in ids:
            out += [t] * (self.tokens_per_image if t == self.image_token_id else 1)
        return self.rewrite_prompt(out) if self.rewrite_prompt else out

    def finish(self, action: Action, budget: int, stop_ids: Sequence[int]
               ) -> tuple[list[int], dict]:
        """(new tokens, finish_reason) of a scripted answer under SGLang's finish rules."""
        out = list(action.ids)[:budget]
        if action.finish == "abort":
            return [], {"type": "abort", "message": "scripted abort"}
        if action.finish == "stop" and len(out) < budget:
            out.append(stop_ids[0])
            if len(out) < budget or self.stop_beats_length:  # 0.5.23; 0.5.15 tested length first
                return out, {"type": "stop", "matched": out[-1]}
        return out, {"type": "length", "length": budget}

    def aborted(self) -> tuple[int, dict]:
        """The answer of a request ended by /abort_request. It leaves `abort_linger_s` after the
        abort and not before a /flush_cache was refused for it (so a client that does not poll
        the flush fails here every time, not by chance)."""
        end = time.monotonic() + self.abort_linger_s
        with self.cond:
            while not self.cond.wait_for(lambda: self.flushes_refused > self.refused_at_abort
                                         or self.closing.is_set(), 0.02):
                pass
        time.sleep(max(0.0, end - time.monotonic()))
        meta = {"id": f"fake-{len(self.requests)}", "weight_version": self.weight_version,
                "finish_reason": {"type": "abort", "message": "Abort all requests."},
                "prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0,
                "output_token_logprobs": []}
        return 200, {"text": "", "output_ids": [], "meta_info": meta}

    # -- control endpoints

    def control(self, path: str, body) -> tuple[int | None, object]:
        """(status, answer) of a control call; str answers are plain text; None drops it."""
        base = path.split("?", 1)[0]
        if base in ("/health", "/health_generate"):
            if self.loading() or not self.healthy:
                return 503, None
            time.sleep(self.health_delay_s)  # SGLang: asyncio.sleep(1), then one token
            return 200, None
        if base in ("/server_info", "/get_server_info"):
            return 200, {"version": self.version, "weight_version": "default",
                         "model_path": self.model_path}
        if base in ("/model_info", "/get_model_info"):
            return 200, {"model_path": self.model_path, "weight_version": self.weight_version,
                         "is_generation": True}
        if self.fail_control:
            if base == "/update_weights_from_disk":
                return 400, {"success": False, "num_paused_requests": 0,
                             "message": "scripted weight-load failure"}
            return 400, {"error": {"message": f"scripted {base} failure"}}
        handler = {"/update_weights_from_disk": self.update_weights,
                   "/begin_weight_update": self.begin_update, "/end_weight_update": self.end_update,
                   "/update_weights_from_tensor": self.update_from_tensor,
                   "/flush_cache": self.flush_cache, "/abort_request": self.abort,
                   "/release_memory_occupation": self.release,
                   "/resume_memory_occupation": self.resume}.get(base)
        return handler(body or {}) if handler else (404, {"detail": "Not Found"})

    def busy(self) -> bool:
        with self.cond:
            return self.inflight > 0

    def update_weights(self, body: dict) -> tuple[int, dict]:
        message = "Succeeded to update model weights."
        self.model_path = body["model_path"]
        self.wiped = False
        if body.get("weight_version") is not None and not self.stale:
            self.weight_version = body["weight_version"]
            message += f" Weight version updated to {self.weight_version}."
        return 200, {"success": True, "message": message, "num_paused_requests": 0}

    def begin_update(self, body: dict) -> tuple[int, dict]:
        if self.session is not None:
            return 400, {"success": False, "message": "a weight-update session is already "
                                                      "open; call end_weight_update() first"}
        self.session = {"selector": body.get("selector", "all"), "loaded": False}
        return 200, {"success": True, "message": "Success"}

    def end_update(self, body: dict) -> tuple[int, dict]:
        if self.session is None:
            return 400, {"success": False, "message": "no weight-update session is open; call "
                                                      "begin_weight_update() first"}
        if self.session["loaded"]:
            self.wiped = False
        self.session = None
        return 200, {"success": True, "message": "Success"}

    def update_from_tensor(self, body: dict) -> tuple[int, dict]:
        if self.session is None:
            return 400, {"success": False, "message": "update_weights_from_tensor must run "
                         "between begin_weight_update() and end_weight_update()"}
        raw = base64.b64decode(body["serialized_named_tensors"][self.tp_rank], validate=True)
        if self.tensor_loader is None:
            self.tensors[f"payload_{len(self.tensors)}"] = len(raw)
        else:
            self.tensors.update(self.tensor_loader(raw))
        self.session["loaded"] = True
        if body.get("weight_version") is not None and not self.stale:
            self.weight_version = body["weight_version"]
        if body.get("flush_cache", True) and self.busy():
            return 400, {"success": False, "message": "Weights were updated, but the cache was "
                         "not flushed because requests are still running or queued. Retract "
                         "or finish them, then call /flush_cache."}
        return 200, {"success": True, "message": "Success"}

    def flush_cache(self, body: dict) -> tuple[int, str]:
        if self.busy():  # SGLang: not performed while requests run
            with self.cond:
                self.flushes_refused += 1
                self.cond.notify_all()
            return 400, "Flush cache failed.\n"
        return 200, "Cache flushed.\nPlease check backend logs for more details.\n"

    def abort(self, body: dict) -> tuple[int, None]:
        if body.get("abort_all"):
            with self.cond:
                self.abort_epoch += 1
                self.refused_at_abort = self.flushes_refused
                self.cond.notify_all()
        return 200, None

    def release(self, body: dict) -> tuple[int | None, None]:
        if self.busy():  # the scheduler's idle assertion fails and takes the server down
            print("AssertionError: release_memory_occupation should be called only when "
                  "server is idle.", flush=True)
            self.dead = True
            threading.Thread(target=self.on_death, daemon=True).start()
            return None, None
        tags = set(body.get("tags") or MEMORY_TAGS)
        self.released |= tags
        self.wiped = self.wiped or "weights" in tags
        return 200, None

    def resume(self, body: dict) -> tuple[int | None, object]:
        tags = set(body.get("tags") or MEMORY_TAGS)
        if tags - self.released:  # SGLang: offload_tags.remove(tag) raises KeyError
            return 500, "Internal Server Error"
        self.released -= tags
        return 200, None


def _handler(fake: FakeSGLang) -> type:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # keep test output quiet
            pass

        def _answer(self, status: int | None, body) -> None:
            if status is None:
                self.close_connection = True  # no answer at all: the client sees a dropped line
                return
            text = isinstance(body, str)
            data = body.encode() if text else b"" if body is None else json.dumps(body).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "text/plain" if text else "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client timed out and left

        def _serve(self, method: str) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            body = json.loads(raw) if raw else None
            with fake.cond:
                fake.requests.append((method, self.path, body))
            if fake.dead:
                self._answer(None, None)
            elif self.path != "/generate":
                self._answer(*fake.control(self.path, body))
            elif fake.loading():
                self._answer(503, {"error": {"message": "server is starting"}})
            else:
                self._generate(body)

        def _generate(self, body: dict) -> None:
            with fake.cond:
                fake.inflight += 1
                fake.max_inflight = max(fake.max_inflight, fake.inflight)
                epoch = fake.abort_epoch
                fake.cond.notify_all()
            try:
                status, answer = fake.generate(body, epoch)
            finally:
                with fake.cond:  # out of flight before the client can see the answer
                    fake.inflight -= 1
                    fake.cond.notify_all()
            self._answer(None if fake.dead else status, answer)  # a dead server answers nothing

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

    return Handler


TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                 "OMP_NUM_THREADS")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--loading-s", type=float, default=0.0, help="503 for this long")
    parser.add_argument("--health-delay-s", type=float, default=1.0, help="per health call")
    parser.add_argument("--exit-after-s", type=float, default=None, help="then exit with 3")
    parser.add_argument("--unhealthy", action="store_true", help="health checks answer 503")
    parser.add_argument("--ignore-sigterm", action="store_true", help="only SIGKILL stops it")
    parser.add_argument("--version", default="0.5.23", help="reported by /server_info")
    parser.add_argument("--enable-return-routed-experts", action="store_true",
                        help="answer routed experts of the tiny MoE's shape (2 layers, top 2 of 4)")
    args, _ = parser.parse_known_args(argv)
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("env:", {k: os.environ.get(k) for k in TORCHRUN_VARS}, flush=True)
    fake = FakeSGLang(port=args.port, healthy=not args.unhealthy, loading_s=args.loading_s,
                      health_delay_s=args.health_delay_s, version=args.version,
                      on_death=lambda: os._exit(1),
                      routed_experts=(2, 2, 4) if args.enable_return_routed_experts else None)
    print(f"fake sglang serving at {fake.url}", flush=True)
    if args.exit_after_s is not None:
        time.sleep(args.exit_after_s)
        print("RuntimeError: scripted crash while loading the model", flush=True)
        os._exit(3)
    fake.thread.join()


if __name__ == "__main__":
    main()
