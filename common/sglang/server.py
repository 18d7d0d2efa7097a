"""Launch SGLang servers as subprocesses, wait until they generate, shut them down on any exit.

    from common.sglang.server import launch_servers
    with launch_servers("checkpoints/step_0", n=2, gpus_per_server=1, mem_fraction=0.6) as group:
        group.urls      # ["http://127.0.0.1:30000", "http://127.0.0.1:30001"]

Server i runs, in its own process group,

    python -m sglang.launch_server --model-path M --host 127.0.0.1 --port <port_base + i>
        --tp-size G --base-gpu-id <base_gpu + i * G> --mem-fraction-static F
        [--ep-size EP] [--attention-backend B] [--enable-memory-saver] *extra_args

(0.5.23 derives its flags from the config fields of srt/arg_groups/fields/: `--base-gpu-id`
picks the first of the server's G consecutive GPUs, counted in this process's
CUDA_VISIBLE_DEVICES, which the server inherits; `common.sglang.placement` says which GPUs),
with its output in
`log_dir/server_<i>.log`, and a clean environment (`server_env`): this process's, less the
torchrun variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*, TORCHELASTIC_*, ...: SGLang would
take them for its own process group) and less torchrun's OMP_NUM_THREADS=1 (it would starve
SGLang's CPU-side work), plus SGLANG_MM_AVOID_RETOKENIZE=1 (keep our token ids verbatim around
images; see common/sglang/engine.py) and `env`.

Readiness, as SGLang 0.5.23 answers (entrypoints/http_server.py `health_generate`): a refused
connection means not listening yet and 503 means still loading; a ready server sleeps 1 s and
generates one token before its 200 (and gives up on its own after 20 s), so each probe of
`GET /health_generate` may take `health_timeout_s` (60 s). Probes run in threads while this
thread watches the processes: a server that exits fails the launch at once, with the tail of
its log; one not ready `startup_timeout_s` after launch fails it too, saying what it last
answered. A ready server must then report SGLang >= 0.5.15 on /server_info
(`common.sglang.engine.check_version`). Every failure shuts the whole group down first and
raises `ServerLaunchError`. Ports must be free before launch.

Shutdown sends SIGTERM to each server's process group (SGLang's scheduler and detokenizer are
its children), then SIGKILL to the groups whose leader is still alive after `grace_s`. It runs
on leaving the `with` block, at interpreter exit (atexit) and on a failed launch; a trainer
killed with SIGKILL leaves its servers running (nothing can catch that). `command` replaces
`python -m sglang.launch_server`; the tests run `tests/fake_sglang.py` with it. Nothing here imports sglang.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import dataclasses
import json
import http.client
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Mapping, Sequence

from common.sglang.engine import http_call
from common.sglang.wire import SGLangError, check_version

SGLANG_COMMAND = (sys.executable, "-m", "sglang.launch_server")
LOG_TAIL_CHARS = 4000
# What torchrun / torch.distributed.elastic put in a trainer's environment.
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR",
                 "MASTER_PORT")


class ServerLaunchError(RuntimeError):
    """A server exited or never became healthy; the message holds the tail of its log."""


@dataclasses.dataclass
class Server:
    """One launched server: its URL, command line, process (a process-group leader), log."""

    url: str
    argv: list[str]
    process: subprocess.Popen
    log_path: Path
    log_file: IO[bytes]

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        """The last `chars` characters of the server's output."""
        self.log_file.flush()
        data = self.log_path.read_bytes()
        return data[-chars:].decode(errors="replace")


class ServerGroup:
    """Servers launched together; `shutdown` (idempotent) stops them all. A context manager."""

    def __init__(self, servers: list[Server], grace_s: float):
        self.servers = servers
        self.grace_s = grace_s
        self._closed = False
        atexit.register(self.shutdown)

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def shutdown(self) -> None:
        """SIGTERM every server's process group, SIGKILL after `grace_s`, reap, close logs."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        for s in self.servers:
            if s.process.poll() is None:
                _signal_group(s.process, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for s in self.servers:
            try:
                s.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for s in self.servers:
            if s.process.poll() is None:  # only while unreaped is its pid surely still ours
                _signal_group(s.process, signal.SIGKILL)
            s.process.wait()
            s.log_file.close()

    def __enter__(self) -> "ServerGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    """Signal the process group led by `process` (started with start_new_session=True)."""
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass


def _check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            raise ServerLaunchError(f"port {port} on {host} is not free: {e}") from e


def server_argv(model_path: str, host: str, port: int, tp: int, base_gpu: int,
                mem_fraction: float, attention_backend: str | None, memory_saver: bool,
                extra_args: Sequence[str], command: Sequence[str] = SGLANG_COMMAND,
                ep: int = 1, routed_experts: bool = False) -> list[str]:
    """The command line of one server; `--ep-size` only where experts are split (ep > 1);
    routed_experts: `--enable-return-routed-experts` (routing replay)."""
    argv = [*command, "--model-path", str(model_path), "--host", host, "--port", str(port),
            "--tp-size", str(tp), "--base-gpu-id", str(base_gpu),
            "--mem-fraction-static", str(mem_fraction)]
    if ep > 1:
        argv += ["--ep-size", str(ep)]
    if attention_backend:
        argv += ["--attention-backend", attention_backend]
    if memory_saver:
        argv.append("--enable-memory-saver")
    if routed_experts:
        argv.append("--enable-return-routed-experts")
    return argv + [str(a) for a in extra_args]


def server_env(base: Mapping[str, str], extra: Mapping[str, str] | None = None
               ) -> dict[str, str]:
    """A server's environment: `base` less torchrun's variables (TORCHRUN_VARS, TORCHELASTIC_*,
    OMP_NUM_THREADS=1), with SGLANG_MM_AVOID_RETOKENIZE=1 and then `extra` on top."""
    env = {k: v for k, v in base.items()
           if k not in TORCHRUN_VARS and not k.startswith("TORCHELASTIC_")}
    if env.get("OMP_NUM_THREADS") == "1":
        del env["OMP_NUM_THREADS"]
    return {**env, "SGLANG_MM_AVOID_RETOKENIZE": "1", **(extra or {})}


def probe(url: str, timeout: float) -> str:
    """One readiness probe: "ready" (200), else what the server said ("HTTP 503", an error)."""
    try:
        status, _ = http_call(url, "GET", "/health_generate", timeout=timeout)
    except (OSError, http.client.HTTPException) as e:
        return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return "ready" if status == 200 else f"HTTP {status}"


def launch_servers(model_path: str, n: int = 1, gpus_per_server: int = 1,
                   mem_fraction: float = 0.8, attention_backend: str | None = None,
                   port_base: int = 30000, extra_args: Sequence[str] = (), *,
                   base_gpu: int = 0, ep_size: int = 1, host: str = "127.0.0.1",
                   memory_saver: bool = False, routed_experts: bool = False,
                   startup_timeout_s: float = 900.0, poll_s: float = 1.0, grace_s: float = 30.0,
                   health_timeout_s: float = 60.0, check_versions: bool = True,
                   log_dir: str | Path | None = None, env: Mapping[str, str] | None = None,
                   command: Sequence[str] = SGLANG_COMMAND) -> ServerGroup:
    """Start `n` servers on ports port_base..port_base+n-1 and wait until each generates.

    base_gpu: server i runs on GPUs base_gpu + i * gpus_per_server onwards (`--base-gpu-id`).
    ep_size: SGLang's `--ep-size`, the expert groups of a MoE model over a server's GPUs.
    memory_saver: pass `--enable-memory-saver` (needed by release/resume memory, colocated).
    routed_experts: pass `--enable-return-routed-experts` (routing replay).
    startup_timeout_s: for all servers together; poll_s: seconds between health checks.
    health_timeout_s: read timeout of one health check (SGLang's own gives up after 20 s).
    check_versions: refuse servers older than SGLang 0.5.15 (their /server_info "version").
    grace_s: SIGTERM-to-SIGKILL delay at shutdown. env: added to the clean `server_env`.
    Returns the running `ServerGroup`; raises `ServerLaunchError` (all servers stopped) if one
    exits or is not healthy in time.
    """
    if n < 1 or gpus_per_server < 1:
        raise ValueError(f"need n >= 1 and gpus_per_server >= 1, got {n}, {gpus_per_server}")
    if ep_size < 1 or gpus_per_server % ep_size:
        raise ValueError(f"ep_size={ep_size} must divide gpus_per_server={gpus_per_server}")
    ports = [port_base + i for i in range(n)]
    for port in ports:
        _check_port_free(host, port)
    log_dir = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="sglang-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    child_env = server_env(os.environ, env)
    servers: list[Server] = []
    group = ServerGroup(servers, grace_s)
    try:
        for i, port in enumerate(ports):
            argv = server_argv(model_path, host, port, gpus_per_server,
                               base_gpu + i * gpus_per_server,
                               mem_fraction, attention_backend, memory_saver, extra_args,
                               command, ep_size, routed_experts)
            log_path = log_dir / f"server_{i}.log"
            log_file = open(log_path, "wb")
            process = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, env=child_env,
                                       start_new_session=True)
            servers.append(Server(f"http://{host}:{port}", argv, process, log_path, log_file))
        wait_ready(servers, time.monotonic() + startup_timeout_s, poll_s, health_timeout_s)
        if check_versions:
            for s in servers:
                _check_server_version(s, health_timeout_s)
    except BaseException:
        group.shutdown()
        raise
    return group


def _exit_error(s: Server, code: int) -> ServerLaunchError:
    return ServerLaunchError(f"SGLang server {s.url} exited with code {code} before it was "
                             f"ready; {s.log_path} ends with:\n{s.log_tail()}")


def wait_ready(servers: list[Server], deadline: float, poll_s: float,
               health_timeout_s: float) -> None:
    """Return when every server answers /health_generate with 200. Raise `ServerLaunchError` as
    soon as one exits, or at `deadline` (time.monotonic()) naming the servers still not ready and
    what they last answered. One probe per server in flight at a time, each in a thread."""
    last = {s.url: "no answer yet" for s in servers}
    probes: dict[str, concurrent.futures.Future] = {}
    pool = concurrent.futures.ThreadPoolExecutor(len(servers), "sglang-probe")
    try:
        while True:
            for s in servers:
                code = s.process.poll()
                if code is not None:
                    raise _exit_error(s, code)
            for s in servers:
                f = probes.get(s.url)
                if f is not None and f.done():
                    last[s.url] = f.result()
                if last[s.url] != "ready" and (f is None or f.done()):
                    timeout = max(1.0, min(health_timeout_s, deadline - time.monotonic()))
                    probes[s.url] = pool.submit(probe, s.url, timeout)
            pending = [s for s in servers if last[s.url] != "ready"]
            if not pending:
                return
            if time.monotonic() > deadline:
                said = "; ".join(f"{s.url}: {last[s.url]}" for s in pending)
                raise ServerLaunchError(f"SGLang server(s) not ready in time (last answers: "
                                        f"{said}); {pending[0].log_path} ends with:\n"
                                        f"{pending[0].log_tail()}")
            time.sleep(poll_s)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)  # the caller kills hanging servers


def _check_server_version(s: Server, timeout: float) -> None:
    """Raise `ServerLaunchError` unless the server reports a supported SGLang on /server_info."""
    try:
        status, raw = http_call(s.url, "GET", "/server_info", timeout=timeout)
        version = json.loads(raw).get("version") if status == 200 else None
        if version is None:
            raise SGLangError(f"{s.url}/server_info answered HTTP {status} without a version")
        check_version(s.url, version)
    except (SGLangError, OSError, http.client.HTTPException, ValueError, AttributeError) as e:
        raise ServerLaunchError(str(e)) from e
