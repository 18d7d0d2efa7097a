"""The AOT compile of the learner's step for a TPU slice (geo3k_jax.aot), on this CPU host.

libtpu compiles for the chips of a topology without any TPU; the tiny model's step must
compile for v5p-8, fit, and report the bytes the compiler gives it.
"""

import contextlib
import functools
import importlib.util

import pytest

from tests.jax_learner_setup import config

pytest.importorskip("libtpu", reason="the TPU compiler: pip install libtpu==0.0.42 "
                    "(requirements-test.txt)")


@contextlib.contextmanager
def as_a_run_compiles():
    """Inside, JAX compiles as a run does: optimised (tests/conftest.py turns most
    optimisations off, so the figures would be the unoptimised program's), at the default
    matmul precision (other test modules ask for "highest", which the TPU kernels refuse for
    bf16 operands)."""
    import jax

    optimise = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        with jax.default_matmul_precision(None):
            yield
    finally:
        jax.config.update("jax_disable_most_optimizations", optimise)


def tiny_step(arch: str, routing_replay: bool = False, **mesh) -> dict:
    """`aot.compile_step`'s report of the tiny `arch`'s step on a v5p-8 (configs/tpu.py, 256-token
    rows, `mesh` over the defaults, `loss.routing_replay`)."""
    from configs import tpu
    from geo3k_jax import aot

    cfg = tpu.get_config()
    cfg.train.micro_batch_tokens = 256
    cfg.jax.slice.update(targets=128, patches=64, window=256, prefix_window=64)
    cfg.jax.mesh.update(mesh)
    cfg.loss.routing_replay = routing_replay
    with as_a_run_compiles():
        return aot.compile_step(cfg, "v5p-8", config(arch)[0])


@pytest.fixture(scope="module")
def tiny_v5p():
    return tiny_step("qwen3_vl")


@pytest.mark.slow
@pytest.mark.parametrize("replay", [False, True], ids=["free", "routing_replay"])
def test_the_tiny_moe_step_compiles_for_v5p_8_with_experts_sharded(replay):
    """Qwen3-VL-MoE's step (splash attention, bf16 compute, remat, experts as ragged dots) on
    fsdp 2 x expert 2, routing freely or replaying the engine's routing (its (rows, T, L, K)
    experts split over the rows as every batch array): both programs compile and fit, a row
    per chip (expert is a data axis)."""
    r = tiny_step("qwen3_vl_moe", replay, fsdp=2, expert=2)
    assert (r["devices"], r["fits"], r["attention"]) == (4, True, "splash")
    assert r["slice"]["rows"] == 4
    assert [p["program"] for p in r["programs"]] == ["grad", "apply"]


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the TPU compile took 286 s on 2 cores shared by 20 processes
def test_the_tiny_step_compiles_for_v5p_8_and_fits(tiny_v5p):
    from geo3k_jax import aot

    r = tiny_v5p
    assert (r["chip"], r["devices"], r["fits"]) == ("v5p", 4, True)
    assert r["attention"] == "splash"  # jax.attention=auto on a TPU
    # one 256-token row per chip (fsdp over the 4 chips of a v5p:2x2x1)
    assert r["slice"] == dict(length=256, targets=128, patches=64, window=256,
                              prefix_window=64, rows=4)
    grad, apply = r["programs"]
    assert (grad["program"], apply["program"]) == ("grad", "apply")
    for p in (grad, apply):
        assert min(p["argument"], p["output"], p["temp"], p["code"], p["flops"],
                   p["bytes_accessed"], p["roofline_s"]) > 0, p
        assert p["peak"] == (p["argument"] + p["output"] - p["alias"] + p["temp"] + p["code"]
                             + p["resident"])
        assert p["fits"] and p["peak"] < p["hbm"] == aot.CHIPS["TPU v5"].hbm
    # the parameters (fp32, sharded over 4 chips) are an argument of both programs; the
    # accumulator (fp32, the parameters' shape) is donated to the gradient program, the
    # parameters and optimizer state to the update: without the donations the aliased bytes
    # would be 0 and a second gradient tree would live beside the first
    per_chip = r["params"] * 4 / 4  # fp32 bytes over 4 chips (a few small ones replicated)
    assert grad["alias"] >= 0.9 * per_chip
    assert apply["alias"] >= 0.9 * 3 * per_chip  # params and the two Adam moments
    assert grad["resident"] >= 0.9 * 2 * per_chip  # the Adam moments wait in HBM meanwhile
    assert grad["flops"] > 10 * apply["flops"]  # forward and backward of 256 tokens a chip
    # the roofline counts at least the model's FLOPs, which the compiler's count of a scanned
    # layer and of the splash kernel misses
    assert grad["model_flops"] > 0 and apply["model_flops"] == 0
    peak_flops = aot.CHIPS["TPU v5"].peak_flops
    assert grad["roofline_s"] >= grad["model_flops"] / peak_flops


def test_a_moes_roofline_counts_its_active_weights():
    """The TPU compiler counts a ragged dot's weight gradient as every expert over every row
    (16x the work of a 16-group one), so a MoE's gradient takes the model's FLOPs (its active
    experts, `common.flops`) even where the compiler's count is larger; a dense model's takes
    the larger (the compiler's misses scanned layers and Pallas kernels)."""
    from types import SimpleNamespace

    from geo3k_jax.tpu.compiled import CHIPS, report

    memory = SimpleNamespace(argument_size_in_bytes=1, output_size_in_bytes=1,
                             alias_size_in_bytes=0, temp_size_in_bytes=1,
                             generated_code_size_in_bytes=1)
    compiled = SimpleNamespace(memory_analysis=lambda: memory,
                               cost_analysis=lambda: {"flops": 918e12, "bytes accessed": 1e9})
    chip = CHIPS["TPU v6 lite"]  # 918 TFLOP/s
    dense = report("grad", compiled, chip, 0, 1.0, model_flops=459e12)
    moe = report("grad", compiled, chip, 0, 1.0, model_flops=459e12, model_flops_only=True)
    assert (dense["roofline_s"], moe["roofline_s"]) == (1.0, 0.5)
    assert moe["flops"] == 918e12 and moe["bound"] == "flops"  # the compiler's count is kept


def test_a_step_that_does_not_fit_exits_1(monkeypatch, capsys):
    from geo3k_jax import aot
    from geo3k_jax.tpu import engine_aot

    program = dict(program="grad", argument=1, output=1, alias=0, temp=2 * aot.GiB, code=1,
                   resident=0, peak=2 * aot.GiB, hbm=aot.GiB, fits=False, flops=1.0,
                   model_flops=2.0,
                   bytes_accessed=1.0, roofline_s=1e-3, compile_s=1.0)
    learner = dict(topology="v5e-8", chip="v5e", devices=8, params=10, attention="splash",
                   slice={}, fits=False, resident=0,
                   programs=[program, dict(program="apply", refused="RESOURCE_EXHAUSTED: too big",
                                           fits=False, compile_s=2.0)])
    monkeypatch.setattr(aot, "compile_learner", lambda *a, **k: learner)
    monkeypatch.setattr(aot, "abstract_learner", lambda *a: None)
    monkeypatch.setattr(aot, "model_config", lambda shapes: None)
    engine = dict(slots=128, context=8192, devices=4, data_shards=4, weights=aot.GiB,
                  cache=aot.GiB, prefill_shapes=[(8, 2048), (1, 8192)], compile_set=49,
                  programs=[dict(program, program="decode", peak=aot.GiB // 2, fits=True)])
    monkeypatch.setattr(engine_aot, "compile_engine", lambda *a: engine)
    with pytest.raises(SystemExit) as e:
        aot.main(["aot", "--config=configs/tpu.py", "--topology=v5e-8"])
    assert e.value.code == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "refused by the compiler" in out and "NO" in out
    assert "engine on 4 devices a host: 128 slots of 8192 tokens" in out
    assert "decode" in out and "refused apply" in out
    # the engine alone: its own table, no learner compiled, exit 1 when a program does not fit
    monkeypatch.setattr(aot, "compile_learner", None)
    engine["compile_set"] = 49
    with pytest.raises(SystemExit) as e:
        aot.main(["aot", "--config=configs/tpu.py", "--topology=v5e-8", "--engine_only"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "the JAX engine's programs alone, 128 slots of 8192 tokens" in out
    assert "49 programs in all" in out and "decode" in out
    engine["programs"][0]["fits"] = False
    with pytest.raises(SystemExit) as e:
        aot.main(["aot", "--config=configs/tpu.py", "--topology=v5e-8", "--engine_only"])
    assert e.value.code == 1


@functools.cache
def aot_table():
    """scripts/aot_table.py as a module, loaded once (it defines absl flags)."""
    spec = importlib.util.spec_from_file_location("aot_table", "scripts/aot_table.py")
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    return table


def _program(name, peak, resident=0):
    return dict(program=name, peak=peak, resident=resident, fits=True)


def test_the_budget_adds_what_each_phase_holds():
    """Per device, in GiB: the learner keeps 10 (parameters, Adam, reference), its gradient
    peaks at 30 (its Adam moments counted), the update at 25; the engine keeps 4 of weights and
    20 of cache, its decode peaks at 26 and its prefill at 27 with 3 of them its own resident
    share (which the budget does not count twice)."""
    from geo3k_jax.aot import GiB, budget, format_budget

    learner = {"resident": 10 * GiB,
               "programs": [_program("grad", 30 * GiB, 8 * GiB), _program("apply", 25 * GiB)]}
    engine = {"weights": 4 * GiB, "cache": 20 * GiB, "slots": 128, "data_shards": 4,
              "programs": [_program("prefill", 27 * GiB, 3 * GiB), _program("decode", 26 * GiB)]}
    b = budget(learner, engine, 95 * GiB, overlap=False)
    assert b["phases"] == {"rollout": (10 + 26) * GiB, "weight copy": (10 + 20 + 8) * GiB,
                           "train": (30 + 24) * GiB}
    assert (b["worst"], b["peak"], b["fits"]) == ("train", 54 * GiB, True)
    # 41 GiB left at 20/128 GiB a slot: 262 more slots, 390 in all, a multiple of 4: 388
    assert b["slots_fit"] == 388
    b = budget(learner, engine, 50 * GiB, overlap=True)
    assert b["phases"]["overlapped"] == (30 + 26) * GiB
    assert (b["worst"], b["fits"]) == ("overlapped", False)
    assert b["slots_fit"] == 88  # 6 GiB short: 39 slots fewer, rounded down to a multiple of 4
    text = format_budget(b, 128)
    assert "overlapped" in text and "DOES NOT FIT" in text and "about 88 fit" in text
    # rollouts elsewhere (SGLang): the learner alone
    b = budget(learner, None, 31.25 * GiB, overlap=True)
    assert b["phases"] == {"train": 30 * GiB} and b["fits"] and "slots_fit" not in b
    refused = dict(program="prefill", refused="RESOURCE_EXHAUSTED", fits=False, compile_s=1.0)
    b = budget(learner, dict(engine, programs=[refused]), 95 * GiB, overlap=False)
    assert b["refused"] == ["prefill"] and not b["fits"]
    assert "refused prefill" in format_budget(b)


def _tiny_tpu_config():
    """configs/tpu.py with the tiny model's shapes: one 256-token slice, 8 engine slots of 512
    tokens, prefills of at most 2 rows of 64 new tokens."""
    from configs import tpu

    cfg = tpu.get_config()
    cfg.train.micro_batch_tokens = 256
    cfg.jax.slice.update(targets=128, patches=64, window=256, prefix_window=64)
    cfg.engine.update(slots=8, prefill_rows=2, prefill_tokens=64)
    cfg.rollout.max_context_tokens = 512
    return cfg


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_run_that_does_not_fit_its_devices_refuses_to_start(capsys):
    """`jax.hbm_check` on this host's CPU device, the tiny model: the learner's two programs and
    the engine's four (the bounded prefill, the one-row long prefill, insert, decode) compile,
    and the run refuses with the budget's numbers when they do not fit `jax.hbm_gib`."""
    import jax

    from geo3k_jax import aot
    from geo3k_jax.train import check_budget

    cfg = _tiny_tpu_config()
    cfg.jax.platform = ""
    hf = config("qwen2_5_vl")[0]
    learner = aot.abstract_learner(cfg, hf, jax.devices()[:1])
    cfg.jax.hbm_gib = 1024.0
    check_budget(cfg, learner, hf)
    assert "of 1024.00 GiB a device (jax.hbm_check)" in capsys.readouterr().out
    r = aot.check_run(cfg, learner, hf, 2 ** 40)
    e = r["engine"]
    assert [p["program"] for p in e["programs"]] == ["prefill", "prefill_long", "insert",
                                                     "decode"]
    assert e["prefill_shapes"] == [(2, 64), (1, 512)]
    # layers, keys and values, slots, tokens, KV heads, head_dim, bf16 bytes
    assert e["cache"] == 2 * 2 * 8 * 512 * 2 * 16 * 2
    b = r["budget"]
    assert b["fits"] and set(b["phases"]) == {"rollout", "weight copy", "train"}
    # jax.free_engine (on by default): the learner's step alone, one copy of the weights
    assert b["free"] and b["phases"]["train"] == max(p["peak"] for p in r["programs"])
    assert b["phases"]["weight copy"] == r["resident"] + e["weights"]
    assert e["programs"][-1]["model_flops"] > 0 and e["programs"][-1]["model_bytes"] > 0
    cfg.jax.hbm_gib = b["peak"] / 2 ** 30 * 0.99
    with pytest.raises(SystemExit, match="do not fit its devices together") as exc:
        check_budget(cfg, learner, hf)
    assert "DOES NOT FIT" in str(exc.value) and "<- peak" in str(exc.value)
    assert "lower engine.slots" in str(exc.value)
    cfg.jax.slice.targets = 0
    with pytest.raises(SystemExit, match="one slice shape"):
        check_budget(cfg, aot.abstract_learner(cfg, hf, jax.devices()[:1]), hf)


@pytest.mark.heavy
@pytest.mark.timeout(3600)
def test_the_tiny_run_compiles_for_v5p_8_with_its_engine():
    """geo3k_jax.aot's whole budget for a TPU slice: the tiny model's learner and engine compile
    for v5p-8 (4 chips, one host) with the runtime (splash) attention and fit together."""
    from geo3k_jax import aot

    cfg = _tiny_tpu_config()
    devices = aot.topology_devices("v5p-8")
    hf = config("qwen3_vl")[0]
    with as_a_run_compiles():
        r = aot.compile_run(cfg, aot.abstract_learner(cfg, hf, devices), hf,
                            aot.tpu_chip(devices), "v5p-8")
    e = r["engine"]
    assert r["attention"] == "splash" and e["devices"] == 4 and e["data_shards"] == 4
    assert all("refused" not in p for p in r["programs"] + e["programs"]), r
    assert r["fits"] and r["budget"]["slots_fit"] > 8
    assert "peak" in aot.format_report(dict(r, shapes="tiny"))


def test_the_table_row_reads_a_report():
    """scripts/aot_table.py's row: the costliest program of each side, the phases, the peak
    against HBM, the slots asked and fitting; a refused program says so."""
    from geo3k_jax.aot import GiB, budget

    table = aot_table()
    learner = [dict(_program("grad", 30 * GiB, 8 * GiB), compile_s=400.0),
               dict(_program("apply", 25 * GiB), compile_s=20.0)]
    engine = {"weights": 4 * GiB, "cache": 20 * GiB, "slots": 128, "data_shards": 4,
              "programs": [dict(_program("prefill", 27 * GiB), compile_s=900.0),
                           dict(_program("decode", 26 * GiB), compile_s=100.0)]}
    r = {"shapes": "qwen3_vl_2b", "topology": "v5p-8", "programs": learner, "engine": engine,
         "resident": 10 * GiB}
    r["budget"] = budget(r, engine, 95.74 * GiB, overlap=False)
    r["fits"] = r["budget"]["fits"]
    assert table.row(r) == (
        "| qwen3_vl_2b | v5p-8 | grad 30.0 | prefill 27.0 (weights 4.0, cache 20.0) | rollout "
        "37.0, weight copy 38.0, train 54.0 | 54.0 / 95.74 | yes | 128 / 392 | 1420 |")
    # --rebudget: the same programs with the engine freed for the learner's step: the train
    # phase is the gradient program alone and only the rollout holds the cache
    assert table.row(table.rebudget(r)) == (
        "| qwen3_vl_2b | v5p-8 | grad 30.0 | prefill 27.0 (weights 4.0, cache 20.0) | rollout "
        "37.0, weight copy 14.0, train 30.0 | 37.0 / 95.74 | yes | 128 / 500 | 1420 |")
    # --offload=moments: the learner's 4 GiB of moments in host memory during rollouts
    moved = table.rebudget(dict(r, parts={"params": 6 * GiB, "moments": 4 * GiB,
                                          "reference": 0}), "moments")
    assert table.row(moved).startswith(
        "| qwen3_vl_2b | v5p-8, jax.offload=moments (rebudget) | grad 30.0 | prefill 27.0 "
        "(weights 4.0, cache 20.0) | rollout 33.0, weight copy 14.0, train 30.0 |")
    r["programs"] = [dict(program="grad", refused="RESOURCE_EXHAUSTED: 40G", fits=False,
                          compile_s=300.0)] + learner[1:]
    assert "refused: grad (RESOURCE_EXHAUSTED: 40G)" in table.row(r) and "**no**" in table.row(r)
    r["programs"] = learner
    r["engine"] = dict(engine, programs=[dict(
        program="decode", refused="RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory "
        "required for HLO temporaries (32.06G) exceeds available HBM (31.25G).", fits=False,
        compile_s=80.0)])
    assert table.row(r) == ("| qwen3_vl_2b | v5p-8 | grad 30.0 | refused: decode (32.06 GB of "
                            "temporaries) | | | **no** | 128 / ? | 500 |")
    r["settings"] = ["jax.mesh.tensor=4"]  # a cell's own settings, beside its slice
    assert table.row(r).startswith("| qwen3_vl_2b | v5p-8, jax.mesh.tensor=4 | grad 30.0 |")
    r["config"] = "configs/tpu_moe.py"  # compiled with another --config: named first
    assert table.row(r).startswith("| qwen3_vl_2b | v5p-8, configs/tpu_moe.py, jax.mesh.tensor=4 "
                                   "| grad 30.0 |")


def test_a_table_cell_may_set_the_engine_slots():
    table = aot_table()
    assert table.cell("qwen3_vl_2b@v6e-8") == ("qwen3_vl_2b", "v6e-8", 0, ())
    assert table.cell("qwen3_vl_2b@v6e-8@40") == ("qwen3_vl_2b", "v6e-8", 40, ())
    assert table.report_name("qwen3_vl_2b", "v6e-8", 40) == "qwen3_vl_2b_v6e-8_slots40.json"
    assert table.report_name("qwen3_vl_2b", "v6e-8", 0) == "qwen3_vl_2b_v6e-8.json"
    # and any other setting of the config, with or without the slots
    cell = table.cell("qwen3_vl_8b@v6e-16@32@jax.mesh.tensor=4@train.micro_batch_tokens=8192")
    assert cell == ("qwen3_vl_8b", "v6e-16", 32, ("jax.mesh.tensor=4",
                                                 "train.micro_batch_tokens=8192"))
    assert table.report_name(*cell) == ("qwen3_vl_8b_v6e-16_slots32_jax.mesh.tensor=4"
                                        "_train.micro_batch_tokens=8192.json")
    assert table.cell("qwen3_vl_8b@v6e-16@jax.mesh.tensor=4") == (
        "qwen3_vl_8b", "v6e-16", 0, ("jax.mesh.tensor=4",))
    for bad in ("qwen3_vl_2b@v6e-8@many", "qwen3_vl_2b", "qwen3_vl_2b@v6e-8@40@tensor",
                "qwen3_vl_2b@v6e-8@=4", "@v6e-8"):
        with pytest.raises(SystemExit, match="model@slice"):
            table.cell(bad)


def test_a_hosts_engine_is_laid_on_a_topology_of_that_host():
    """libtpu's compile-only client refuses collectives over devices that are not its
    topology's first, and a v6e-16 host holds devices 0, 1, 4 and 5: the AOT tool lays a host's
    engine on a topology of one host, chip for chip by their coordinates in the host."""
    import numpy as np
    from jax.sharding import Mesh

    from geo3k_jax import aot
    from geo3k_jax.engine.backend import host_mesh
    from geo3k_jax.tpu.topology import one_host

    devices = aot.topology_devices("v6e-16")
    for tensor in (1, 2, 4):
        mesh = Mesh(np.array(devices).reshape(1, 16 // tensor, tensor), ("data", "fsdp", "tensor"))
        host = host_mesh(mesh)
        assert [d.id for d in host.devices.flat] == [0, 1, 4, 5]
        alone = one_host(host, "v6e-16")
        assert (alone.devices.shape, alone.axis_names) == (host.devices.shape, host.axis_names)
        assert [d.id for d in alone.devices.flat] == [0, 1, 2, 3]
        assert {d.process_index for d in alone.devices.flat} == {0}
        assert alone.devices.flat[0].device_kind == host.devices.flat[0].device_kind
    # the second host (chips x 2-3, y 0-1) in its own order: coordinates relative to its corner
    second = [d for d in devices if d.process_index == 1][::-1]
    assert [tuple(d.coords) for d in second] == [(3, 1, 0), (2, 1, 0), (3, 0, 0), (2, 0, 0)]
    alone = one_host(Mesh(np.array(second).reshape(1, 2, 2), ("data", "fsdp", "tensor")),
                     "v6e-16")
    assert [tuple(d.coords) for d in alone.devices.flat] == [(1, 1, 0), (0, 1, 0), (1, 0, 0),
                                                             (0, 0, 0)]
    assert [d.id for d in alone.devices.flat] == [3, 2, 1, 0]


def test_a_tensor_group_of_a_multi_host_mesh_lies_within_one_host():
    """jax.make_mesh lays a v6e-16's axes along its 4 x 4 links, and a 4-chip tensor axis then
    spans two hosts, whose JAX engines each sample on their own chips (host_mesh refused it)."""
    from geo3k_jax import aot
    from geo3k_jax.engine.backend import host_mesh
    from geo3k_jax.core.sharding import make_mesh

    devices = aot.topology_devices("v6e-16")
    for tensor in (2, 4):
        mesh = make_mesh({"data": 1, "fsdp": -1, "tensor": tensor}, devices)
        assert mesh.shape == {"data": 1, "fsdp": 16 // tensor, "expert": 1, "tensor": tensor}
        groups = mesh.devices.reshape(-1, tensor)
        assert all(len({d.process_index for d in g}) == 1 for g in groups)
        assert sorted(d.id for d in mesh.devices.flat) == list(range(16))
        assert sorted(d.id for d in host_mesh(mesh).devices.flat) == [0, 1, 4, 5]
    with pytest.raises(ValueError, match="keep a tensor group within a host"):
        make_mesh({"data": 1, "fsdp": 2, "tensor": 8}, devices)
    # without a tensor axis the mesh is jax.make_mesh's, along the links
    assert make_mesh({"data": 1, "fsdp": -1, "tensor": 1}, devices).shape["fsdp"] == 16


@pytest.mark.parametrize("topology,fsdp", [("v5p-16", 1), ("v6e-32", 4), ("v6e-64", 8)])
def test_the_moe_recipes_mesh_lays_a_tensor_group_on_each_host(topology, fsdp):
    """configs/tpu_moe.py's mesh (expert 2, tensor 4, fsdp the rest) on the slices docs/tpu.md
    compiles it for: every tensor group is one host's 4 chips (each host's engine holds a
    quarter of the bf16 weights a chip) and host 0's engine gets one whole group."""
    from configs import tpu_moe
    from geo3k_jax import aot
    from geo3k_jax.engine.backend import host_mesh
    from geo3k_jax.core.sharding import make_mesh

    devices = aot.topology_devices(topology)
    mesh = make_mesh(dict(tpu_moe.get_config().jax.mesh), devices)
    assert mesh.shape == {"data": 1, "fsdp": fsdp, "expert": 2, "tensor": 4}
    groups = mesh.devices.reshape(-1, 4)
    assert all(len({d.process_index for d in g}) == 1 for g in groups)
    assert host_mesh(mesh).devices.shape == (1, 1, 1, 4)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("topology", ["v5p-8", "v6e-8", "v6e-16"])
def test_the_decode_compiles_the_pallas_kernel_for_tpu(topology):
    """On a TPU slice the engine's decode (one host's chips, the splash attention of a run)
    attends through the Pallas paged attention kernel, compiled by libtpu for v5p and v6e
    (v6e-16's hosts on a topology of one host, `one_host`),
    reading the cache in place: no copy of it, temporaries far below its size (a cache of 256
    MiB a chip: one small enough would be staged whole in on-chip memory). The insert writes
    each chip's slots in place (it had gathered the whole cache on every chip: 309 MiB), and the
    prefill's 8 work rows are split over the 4 chips (replicated, their (T, L) scores took 4.4
    GiB a chip, split 1.0). The tiny model with Qwen-VL's head dim of 128, the kernel's tile."""
    import re

    from transformers import Qwen3VLConfig

    from geo3k_jax import aot
    from geo3k_jax.tpu.engine_aot import abstract_engine, engine_programs
    from tests.jax_learner_setup import IDS, TEXT, VISION

    hf = Qwen3VLConfig(text_config=dict(TEXT, head_dim=128, rope_scaling={
        "rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": True}),
        vision_config=dict(VISION, patch_size=16, deepstack_visual_indexes=[0],
                           num_position_embeddings=64), **IDS)
    cfg = _tiny_tpu_config()
    cfg.engine.slots, cfg.rollout.max_context_tokens = 64, 8192
    cfg.engine.prefill_rows, cfg.engine.prefill_tokens = 8, 2048
    devices = aot.topology_devices(topology)
    with as_a_run_compiles():
        engine, params = abstract_engine(cfg, aot.abstract_learner(cfg, hf, devices), hf,
                                         memory=2 ** 40, topology=topology)
        programs = engine_programs(engine, params)
        compiled = programs["decode"]().compile()
        temps = {name: programs[name]().compile().memory_analysis().temp_size_in_bytes
                 for name in ("insert", "prefill")}
    assert engine.kernel and engine.attention.splash and not engine.attention.interpret
    text = compiled.as_text()
    assert "tpu_custom_call" in text and "paged_attention" in text
    shard = "bf16[2,2,16,8192,128]"  # (Hkv, layers, slots, L, D) a chip: 64 slots over 4 chips
    assert shard in text and not re.search(re.escape(shard) + r"\{[^}]*\} copy\(", text)
    assert engine.cache_bytes == 2 ** 28  # keys and values of a chip
    assert compiled.memory_analysis().temp_size_in_bytes < engine.cache_bytes / 16
    assert temps["insert"] < engine.cache_bytes / 16
    assert temps["prefill"] < 1.5 * 2 ** 30


@pytest.mark.slow
@pytest.mark.parametrize("offload", ["moments", "all"])
def test_the_offloaded_state_leaves_the_tpus_memory(offload):
    """`jax.offload`'s move of the tiny learner's state, compiled for v5p-8: the TPU compiler
    puts every moved byte in host memory and keeps none in HBM but the optimizer's step
    counters (a few hundred bytes); with "all" the parameters and KL reference go too (2B on
    v5p-8, measured: 4.28 GB a chip to host memory, 448 bytes left in HBM). A move
    the compiler kept on the device would show its bytes as device outputs."""
    from configs import tpu
    from geo3k_jax import aot

    cfg = tpu.get_config()
    cfg.train.micro_batch_tokens = 256
    cfg.loss.kl_coef = 0.1
    cfg.jax.slice.update(targets=128, patches=64, window=256, prefix_window=64)
    learner = aot.abstract_learner(cfg, config("qwen3_vl")[0], aot.topology_devices("v5p-8"))
    o = aot.compile_offload(learner, offload)
    parts = aot.learner_parts(learner)
    want = parts["moments"] + (parts["params"] + parts["reference"]) * (offload == "all")
    # the TPU pads the tiny arrays to its tiles: the compiler moves more than their bytes
    assert o["host_out"] >= want and o["device_out"] < 1024


@pytest.mark.slow
def test_the_tiny_moe_engine_recording_its_routing_compiles_for_v5p_8():
    """With `loss.routing_replay` the engine beside the learner records its routing (each fed
    token's experts out of the prefill and the decode loop): its prefill and decode compile for
    v5p-8 with the experts over fsdp 2 x expert 2, and fit."""
    from geo3k_jax import aot
    from geo3k_jax.tpu.engine_aot import abstract_engine, compile_engine

    cfg = _tiny_tpu_config()
    cfg.loss.routing_replay = True
    cfg.jax.mesh.update(fsdp=2, expert=2)
    devices = aot.topology_devices("v5p-8")
    hf = config("qwen3_vl_moe")[0]
    with as_a_run_compiles():
        learner = aot.abstract_learner(cfg, hf, devices)
        assert abstract_engine(cfg, learner, hf, memory=2 ** 62)[0].record
        r = compile_engine(cfg, learner, hf, aot.tpu_chip(devices), ["prefill", "decode"],
                           "v5p-8")
    assert [(p["program"], p["fits"]) for p in r["programs"]] == [("prefill", True),
                                                                   ("decode", True)], r
