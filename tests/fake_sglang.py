"""A fake SGLang server for CPU tests: SGLang's native HTTP API on 127.0.0.1, scripted answers.

It speaks the wire format documented in common/sglang_engine.py (from SGLang's source) and
behaves like SGLang where the engine depends on it: it expands each image placeholder itself
(`tokens_per_image` pads per image) and refuses a prompt whose placeholder count differs from
its image count, as SGLang's `_expand_input_ids` does; it reports the stop token in
`output_token_logprobs`, and "length" when a stop token is the last allowed one.

    with FakeSGLang(image_token_id=2000, tokens_per_image=3) as fake:   # ephemeral port
        fake.script.append(Action(ids=[104, 105]))      # the next /generate answer
        fake.url, fake.requests, fake.max_inflight

`/generate` answers from `script` (consumed in order) or, when it is empty, from
`responder(body) -> Action`. An Action can fail instead: "500", "400", "drop" (close the
connection without an answer) or "hang" (answer nothing until the fake closes). While `gate`
is clear, /generate requests wait (in flight) until it is set. Control endpoints answer like
SGLang; set `fail_control` to make them fail.

As a program, for the launcher tests (it always binds 127.0.0.1; other flags, such as sglang's
`--host` and `--model-path`, are ignored):
    python tests/fake_sglang.py --port N [--unhealthy] [--ignore-sigterm]
"""

from __future__ import annotations

import argparse
import base64
import collections
import dataclasses
import io
import json
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Sequence

LOGPROB_STEP = -0.01  # the i-th new token's log-prob is LOGPROB_STEP * (i + 1)


@dataclasses.dataclass
class Action:
    """One scripted /generate answer: new tokens (the stop token is added for "stop"), how the
    generation ends ("stop", "length", "abort"), or a failure ("500", "400", "drop", "hang")."""

    ids: Sequence[int] = ()
    finish: str = "stop"
    fail: str | None = None


def logprob(i: int) -> float:
    return LOGPROB_STEP * (i + 1)


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
                 healthy: bool = True, responder: Callable[[dict], Action] | None = None):
        self.image_token_id = image_token_id
        self.tokens_per_image = tokens_per_image
        self.healthy = healthy
        self.responder = responder or (lambda body: Action())
        self.script: collections.deque[Action] = collections.deque()
        self.requests: list[tuple[str, str, object]] = []  # (method, path, JSON body or None)
        self.images: list = []  # decode_image of every image received
        self.fail_control = False
        self.inflight = self.max_inflight = 0
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
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> "FakeSGLang":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def bodies(self, path: str = "/generate") -> list:
        """JSON bodies received on `path`, in order."""
        return [b for _, p, b in self.requests if p == path]

    def wait_inflight(self, n: int, timeout: float = 10.0) -> bool:
        """Block until `n` /generate requests are in flight (False on timeout)."""
        with self.cond:
            return self.cond.wait_for(lambda: self.inflight >= n, timeout)

    # -- /generate

    def generate(self, body: dict) -> tuple[int, dict | None]:
        """(status, JSON answer); status None means drop the connection."""
        with self.cond:
            action = self.script.popleft() if self.script else None
        action = action or self.responder(body)
        if action.fail == "hang":
            self.closing.wait()
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
        sp = body["sampling_params"]
        out, budget = list(action.ids)[:sp["max_new_tokens"]], sp["max_new_tokens"]
        if action.finish == "abort":
            out, reason = [], {"type": "abort", "message": "scripted abort"}
        elif action.finish == "stop" and len(out) < budget:
            out.append(sp["stop_token_ids"][0])
            reason = {"type": "stop", "matched": out[-1]}
            if len(out) == budget:  # SGLang checks the length limit before stop tokens
                reason = {"type": "length", "length": budget}
        else:
            reason = {"type": "length", "length": budget}
        meta = {"id": f"fake-{len(self.requests)}", "finish_reason": reason,
                "prompt_tokens": len(ids) + len(images) * (self.tokens_per_image - 1),
                "completion_tokens": len(out), "cached_tokens": 0,
                "output_token_logprobs": [[logprob(i), t, None] for i, t in enumerate(out)]}
        return 200, {"text": "", "output_ids": out, "meta_info": meta}

    def control(self, path: str) -> tuple[int, object]:
        if path in ("/health", "/health_generate"):
            return (200, None) if self.healthy else (503, None)
        if path == "/update_weights_from_disk":
            ok = not self.fail_control
            return (200 if ok else 400), {"success": ok, "num_paused_requests": 0,
                                          "message": "Succeeded to update model weights." if ok
                                          else "scripted weight-load failure"}
        if path in ("/flush_cache", "/release_memory_occupation", "/resume_memory_occupation"):
            if self.fail_control:
                return 400, {"error": {"message": f"scripted {path} failure"}}
            return 200, None
        return 404, {"detail": "Not Found"}


def _handler(fake: FakeSGLang) -> type:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # keep test output quiet
            pass

        def _answer(self, status: int, body) -> None:
            data = b"" if body is None else json.dumps(body).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
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
            if self.path != "/generate":
                self._answer(*fake.control(self.path))
                return
            with fake.cond:
                fake.inflight += 1
                fake.max_inflight = max(fake.max_inflight, fake.inflight)
                fake.cond.notify_all()
            try:
                fake.gate.wait()
                status, answer = fake.generate(body)
            finally:
                with fake.cond:  # out of flight before the client can see the answer
                    fake.inflight -= 1
                    fake.cond.notify_all()
            if status is None:
                self.close_connection = True  # no answer at all: the client sees a dropped line
                return
            self._answer(status, answer)

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

    return Handler


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--unhealthy", action="store_true", help="health checks answer 503")
    parser.add_argument("--ignore-sigterm", action="store_true", help="only SIGKILL stops it")
    args, _ = parser.parse_known_args(argv)
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    fake = FakeSGLang(port=args.port, healthy=not args.unhealthy)
    print(f"fake sglang serving at {fake.url}", flush=True)
    fake.thread.join()


if __name__ == "__main__":
    main()
