"""Where SGLang servers run and whom each training process talks to (common.sglang.placement),
and the SGLang backend's launch, in-memory weight sync and release order across processes.

The multi-process cases run every "process" as a thread with its own `Collectives` over shared
memory and its own `SGLangBackend`; `launch_servers` is replaced by one that starts in-process
fake servers on the ports it is asked for and records what each launch was given, so the test
reads which GPUs (--base-gpu-id), port and memory settings each launch got, which servers each
process generates through and what each server was sent.
"""

import base64
import json
import pickle
import socket
import threading

import pytest
import torch

from common.sglang import backend as sglang_backend
from common.sglang.placement import colocated, dedicated
from common.sglang.server import launch_servers, server_argv
from common.sglang.wire import SGLangError
from configs import base
from geo3k_torch.weight_sync import serialize
from tests.fake_sglang import FakeSGLang


# ------------------------------------------------------------------------- placement, pure


@pytest.mark.parametrize("gpus", [1, 4, 8])
def test_colocated_one_server_per_gpu(gpus):
    """tp 1: server r on GPU r and port base + r, launched and used by local rank r alone."""
    for r in range(gpus):
        p = colocated(r, gpus, 1, 30000)
        assert [(s.gpus, s.port) for s in p.servers] == [((i,), 30000 + i) for i in range(gpus)]
        assert p.launch == (r,) and p.use == (r,)


def test_colocated_tp2_on_8_gpus():
    """tp 2: four servers on GPUs 0-1, 2-3, 4-5, 6-7; even ranks launch, both ranks of a
    block use its server (a wrong block or a launch by both ranks changes these tuples)."""
    plans = [colocated(r, 8, 2, 30000) for r in range(8)]
    assert [s.gpus for s in plans[0].servers] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert [p.launch for p in plans] == [(0,), (), (1,), (), (2,), (), (3,), ()]
    assert [p.use for p in plans] == [(0,), (0,), (1,), (1,), (2,), (2,), (3,), (3,)]
    with pytest.raises(ValueError, match="sglang_gpus_per_server=3 must divide the 8"):
        colocated(0, 8, 3, 30000)


@pytest.mark.parametrize("learners", [1, 4])
def test_dedicated_servers_start_after_the_learners_gpus(learners):
    p = dedicated(0, learners, 2, 2, -1, 31000)
    assert [(s.gpus, s.base_gpu, s.port) for s in p.servers] == [
        ((learners, learners + 1), learners, 31000), ((learners + 2, learners + 3),
                                                      learners + 2, 31001)]
    assert p.launch == (0, 1) and p.use == (0, 1)
    other = dedicated(1, learners, 2, 2, -1, 31000)
    assert other.launch == () and other.use == (0, 1)  # only process 0 launches; all use


def test_dedicated_servers_never_land_on_a_learner_gpu_by_accident():
    assert [s.gpus for s in dedicated(0, 4, 4, 1, 4, 30000).servers] == [(4,), (5,), (6,), (7,)]
    with pytest.raises(ValueError, match=r"sglang_base_gpu=2 puts SGLang servers on GPUs "
                                         r"\[2, 3\], where the 4 learner processes"):
        dedicated(0, 4, 2, 1, 2, 30000)
    with pytest.raises(ValueError, match=r"sglang_base_gpu=0 .* GPUs \[0\]"):  # the old default
        dedicated(0, 1, 1, 1, 0, 30000)


def test_server_argv_names_its_first_gpu():
    argv = server_argv("/m", "127.0.0.1", 30002, 2, 4, 0.6, None, True, [], command=("sg",))
    assert argv == ["sg", "--model-path", "/m", "--host", "127.0.0.1", "--port", "30002",
                    "--tp-size", "2", "--base-gpu-id", "4", "--mem-fraction-static", "0.6",
                    "--enable-memory-saver"]


def test_server_argv_splits_experts_only_when_asked():
    """ep 8 of tp 8: `--ep-size 8` after the memory share; ep 1 leaves the line as it was."""
    argv = server_argv("/m", "127.0.0.1", 30000, 8, 0, 0.4, None, True, [], command=("sg",),
                       ep=8)
    assert argv[argv.index("--mem-fraction-static"):] == [
        "--mem-fraction-static", "0.4", "--ep-size", "8", "--enable-memory-saver"]
    assert "--ep-size" not in server_argv("/m", "h", 1, 8, 0, 0.4, None, True, [], ep=1)
    with pytest.raises(ValueError, match="ep_size=3 must divide gpus_per_server=8"):
        launch_servers("/m", gpus_per_server=8, ep_size=3)  # before any port or process


# ------------------------------------------------------------- the backend, process by process


class Shared:
    """What the thread "processes" share: a barrier and one slot per process."""

    def __init__(self, world):
        self.world, self.slots = world, [None] * world
        self.wall = threading.Barrier(world, timeout=60)


class ThreadComm:
    """`Collectives` of one thread among `shared.world`."""

    def __init__(self, shared, rank):
        self.shared, self.rank, self.world = shared, rank, shared.world

    def gather(self, obj):
        self.shared.slots[self.rank] = obj
        self.shared.wall.wait()
        out = list(self.shared.slots)
        self.shared.wall.wait()
        return out

    def barrier(self):
        self.shared.wall.wait()

    def sum_scalars(self, values, max_keys=()):
        raise AssertionError("the SGLang backend never sums scalars across processes")


class RankWeights:
    """`TensorWeights` whose bucket i of process r holds one tensor [r, i]: a server that got
    another process's payload, or a bucket twice, shows it."""

    def __init__(self, rank, n=3):
        self.rank, self.n, self.alive = rank, n, []

    def tensor_buckets(self, bucket_bytes):
        for i in range(self.n):
            t = torch.tensor([self.rank, i], dtype=torch.bfloat16)
            self.alive.append(i)
            yield serialize([(f"w{i}", t)]), i == self.n - 1
            self.alive.remove(i)

    def write_safetensors(self, out_dir, shard_bytes):
        (out_dir / "model-00001-of-00001.safetensors").write_text("bf16")


def free_port_base(n):
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            for i in range(n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + i))
            return port
        except OSError:
            continue
    raise RuntimeError("no free ports")


@pytest.fixture
def launches(monkeypatch):
    """Replace `launch_servers` by in-process fakes; returns the record of every launch."""
    record, fakes = [], []

    class Group:
        def __init__(self, servers):
            self.servers, self.urls = servers, [f.url for f in servers]

        def shutdown(self):
            for f in self.servers:
                f.close()

    def fake_launch(model_path, n=1, gpus_per_server=1, **kw):
        if kw.get("base_gpu") == 99:
            raise RuntimeError("scripted launch failure")
        # no tensor loader: a payload's shared memory can be taken once, by the test
        servers = [FakeSGLang(port=kw["port_base"] + i, health_delay_s=0) for i in range(n)]
        fakes.extend(servers)
        record.append(dict(n=n, tp=gpus_per_server, **kw))
        return Group(servers)

    import common.sglang.server as server
    monkeypatch.setattr(server, "launch_servers", fake_launch)
    yield record, fakes
    for f in fakes:
        f.close()


def engine_cfg(colocated_, tp=1, servers=1, base_gpu=-1, sync="auto"):
    cfg = base.get_config()
    e = cfg.engine
    e.backend, e.sglang_colocated, e.sglang_gpus_per_server = "sglang", colocated_, tp
    e.sglang_servers, e.sglang_base_gpu, e.sglang_weight_sync = servers, base_gpu, sync
    e.sglang_port_base, e.sglang_idle_timeout_s = free_port_base(8), 5.0
    return cfg


class StubLearner:
    def export_hf(self, out_dir):
        (out_dir / "model.safetensors").write_text("fp32")


def run_processes(world, body):
    """body(rank) in `world` threads; returns their results (re-raises the first error)."""
    results, errors = [None] * world, []

    def one(r):
        try:
            results[r] = body(r)
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            errors.append((r, e))

    threads = [threading.Thread(target=one, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0][1]
    return results


def make_backends(cfg, world, tmp_path, weights=True, frees=None, config=None):
    """One `SGLangBackend` per thread "process"; the model's config.json is `config` (default:
    a dense model's image token alone)."""
    model_dir = tmp_path / "model"
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(config or {"image_token_id": 2000}))
    shared = Shared(world)

    def build(r):
        free = (lambda: frees.append(r)) if frees is not None else (lambda: None)
        return sglang_backend.SGLangBackend(
            cfg, str(model_dir), None, tmp_path / "work", ThreadComm(shared, r),
            free_memory=free, weights=RankWeights(r) if weights else None, local=(r, world))

    return run_processes(world, build)


@pytest.mark.parametrize("world,tp", [(1, 1), (4, 1), (8, 1), (4, 2), (8, 2), (8, 8)])
def test_colocated_launch_and_in_memory_sync(launches, tmp_path, world, tp):
    """Each block's first process launches one server on its block's GPUs (memory saver on,
    memory handed back first); every process generates through its own GPU's server; a sync
    sends each server its block's payloads in tp-rank order, inside one session, version on the
    last bucket only; the KV cache comes back after the weights."""
    record, fakes = launches
    cfg = engine_cfg(True, tp)
    frees = []
    backends = make_backends(cfg, world, tmp_path, frees=frees)
    port = cfg.engine.sglang_port_base
    assert [(r["base_gpu"], r["port_base"], r["n"], r["tp"], r["memory_saver"],
             r["mem_fraction"]) for r in sorted(record, key=lambda r: r["base_gpu"])] == [
        (g, port + g // tp, 1, tp, True, 0.6) for g in range(0, world, tp)]
    assert sorted(frees) == list(range(0, world, tp))  # each launcher first hands memory back
    by_url = {f.url: f for f in fakes}
    assert [b.engine.urls for b in backends] == [[fakes_url] for fakes_url in
                                                  [f"http://127.0.0.1:{port + r // tp}"
                                                   for r in range(world)]]
    assert all(b.in_memory for b in backends)

    def step(r):
        with backends[r].train_context():
            pass
        backends[r].sync(None, 1)

    run_processes(world, step)
    for s in range(world // tp):
        fake = by_url[f"http://127.0.0.1:{port + s}"]
        calls = [(p, b) for _, p, b in fake.requests if p != "/health_generate"]
        paths = [p for p, _ in calls]
        assert paths == ["/abort_request", "/flush_cache", "/release_memory_occupation",
                         "/resume_memory_occupation", "/begin_weight_update",
                         "/update_weights_from_tensor", "/update_weights_from_tensor",
                         "/update_weights_from_tensor", "/end_weight_update", "/model_info",
                         "/resume_memory_occupation"], paths
        assert [b for p, b in calls if p == "/resume_memory_occupation"] == [
            {"tags": ["weights"]}, {"tags": ["kv_cache", "cuda_graph"]}]
        updates = [b for p, b in calls if p == "/update_weights_from_tensor"]
        for i, body in enumerate(updates):
            got = [pickle.loads(base64.b64decode(x)) for x in body["serialized_named_tensors"]]
            # payload j is tp rank j's: process s * tp + j, bucket i
            assert [(n, t.tolist()) for (n, t), in got] == [
                (f"w{i}", [float(s * tp + j), float(i)]) for j in range(tp)]
            assert body["flush_cache"] == (i == 2)
            assert body.get("weight_version") == ("1" if i == 2 else None)
        assert fake.weight_version == "1" and not fake.released and not fake.wiped
    for b in backends:
        assert b.engine.weight_version == "1"  # every process checks later answers
        b.close()


def test_dedicated_servers_shared_and_synced_from_bf16_files(launches, tmp_path):
    """Not colocated: process 0 launches both servers on GPUs 4-7 (after the 4 learners'),
    every process uses both, the weights go as the learner's bf16 files, no memory release."""
    record, fakes = launches
    cfg = engine_cfg(False, tp=2, servers=2)
    backends = make_backends(cfg, 4, tmp_path)
    assert [(r["base_gpu"], r["n"], r["tp"], r["memory_saver"]) for r in record] == [
        (4, 2, 2, False)]
    assert all(b.engine.urls == [f.url for f in fakes] for b in backends)
    assert not any(b.in_memory for b in backends)

    def step(r):
        with backends[r].train_context():
            pass
        backends[r].sync(StubLearner(), 3)

    run_processes(4, step)
    out = tmp_path / "work" / "weights_for_sglang"
    assert (out / "model-00001-of-00001.safetensors").read_text() == "bf16"  # not export_hf
    for f in fakes:
        assert [p for _, p, _ in f.requests if p != "/health_generate"] == [
            "/update_weights_from_disk", "/model_info"]
        assert f.bodies("/update_weights_from_disk")[0]["model_path"] == str(out.resolve())
    for b in backends:
        b.close()


def test_a_failed_launch_stops_every_process(launches, tmp_path, monkeypatch):
    """Process 2's launch fails: every process raises (none waits for it forever), naming it."""
    cfg = engine_cfg(True, 1)
    real = sglang_backend.place

    def place(e, rank, local_rank, local_world):
        p = real(e, rank, local_rank, local_world)
        if local_rank == 2:  # GPU 99 makes the stub launcher fail
            s = p.servers[2]
            servers = p.servers[:2] + (type(s)(2, (99,), s.port),) + p.servers[3:]
            return type(p)(servers, p.launch, p.use)
        return p

    monkeypatch.setattr(sglang_backend, "place", place)
    errors = []

    def build(r, shared=Shared(4)):
        try:
            sglang_backend.SGLangBackend(cfg, str(tmp_path / "model"), None, tmp_path,
                                         ThreadComm(shared, r), local=(r, 4))
        except Exception as e:  # noqa: BLE001
            errors.append((r, str(e)))

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"image_token_id": 2000}))
    run_processes(4, build)
    said = dict(errors)
    assert sorted(said) == [0, 1, 2, 3] and said[2] == "scripted launch failure"  # its own
    assert all(said[r] == "SGLang launch failed on another process: process 2: scripted "
               "launch failure" for r in (0, 1, 3)), said


def moe_config(experts):
    return {"image_token_id": 2000, "text_config": {"num_experts": experts}}


def test_one_server_over_8_gpus_splits_128_experts_8_ways(launches, tmp_path):
    """One MoE server over a node: process 0 launches it on GPUs 0-7 with tp 8
    and ep 8; all 8 processes generate through it."""
    record, fakes = launches
    cfg = engine_cfg(True, tp=8)
    cfg.engine.sglang_ep_size = 8
    backends = make_backends(cfg, 8, tmp_path, config=moe_config(128))
    assert [(r["base_gpu"], r["n"], r["tp"], r["ep_size"]) for r in record] == [(0, 1, 8, 8)]
    assert {tuple(b.engine.urls) for b in backends} == {(fakes[0].url,)}
    for b in backends:
        b.close()


@pytest.mark.parametrize("config, said", [
    (moe_config(6), r"sglang_ep_size=4 must divide the 6 experts of .*config\.json"),
    ({"image_token_id": 2000}, r"sglang_ep_size=4 splits a MoE model's experts, and .* has "
                               r"none \(no text_config\.num_experts\): set it to 1"),
])
def test_expert_groups_that_do_not_split_the_experts_are_refused(launches, tmp_path, config,
                                                                 said):
    """Before any launch: SGLang would assert deep in its MoE layer (E % ep) or, for a dense
    model, have nothing to split."""
    record, _ = launches
    cfg = engine_cfg(True, tp=4)
    cfg.engine.sglang_ep_size = 4
    with pytest.raises(ValueError, match=said):
        make_backends(cfg, 4, tmp_path, config=config)
    assert record == []


def test_weight_sync_setting_is_checked(launches, tmp_path):
    cfg = engine_cfg(False, sync="tensor")
    with pytest.raises(ValueError, match="sglang_weight_sync='tensor' needs colocated"):
        make_backends(cfg, 1, tmp_path)
    cfg.engine.sglang_weight_sync = "memory"
    with pytest.raises(ValueError, match="must be one of"):
        make_backends(cfg, 1, tmp_path)
    cfg = engine_cfg(True, sync="disk")
    (b,) = make_backends(cfg, 1, tmp_path)
    assert not b.in_memory  # colocated, but told to go through files
    b.close()


def test_a_server_refusing_a_bucket_fails_every_process(launches, tmp_path):
    """A server that answers a bucket with success false: its process raises that error, the
    others name it, and every process still went through every bucket (no one hangs)."""
    record, fakes = launches
    cfg = engine_cfg(True, 1)
    backends = make_backends(cfg, 2, tmp_path)
    by_port = {int(f.url.rsplit(":", 1)[1]): f for f in fakes}
    first, second = by_port[cfg.engine.sglang_port_base], by_port[cfg.engine.sglang_port_base + 1]
    first.session = {"selector": "all", "loaded": False}  # already open: begin is refused
    got = [None, None]

    def step(r):
        try:
            backends[r].sync(None, 1)
        except SGLangError as e:
            got[r] = str(e)

    run_processes(2, step)
    assert "a weight-update session is already open" in got[0]
    assert got[1].startswith("in-memory weight sync failed on another process: process 0:")
    assert [p for _, p, _ in second.requests].count("/update_weights_from_tensor") == 3
    assert all(not b.weights.alive for b in backends)  # every bucket was let go
    for b in backends:
        b.close()


def test_a_bad_layout_is_refused_before_anything_is_built(monkeypatch):
    """check_config runs the placement: a server layout that cannot run stops the run before
    a model loads (minutes on a GPU machine), naming the setting."""
    from common.prepare import check_config
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    cfg = engine_cfg(False, base_gpu=6)
    with pytest.raises(ValueError, match="sglang_base_gpu=6 puts SGLang servers on GPUs"):
        check_config(cfg, 8)
    cfg = engine_cfg(True, tp=3)
    with pytest.raises(ValueError, match="sglang_gpus_per_server=3 must divide the 8"):
        check_config(cfg, 8)
    cfg.engine.sglang_urls = "http://h:1"  # given servers: no layout to check
    check_config(cfg, 8)
