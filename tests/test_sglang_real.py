"""The SGLang client's requests against the real code of the released SGLang 0.5.23 wheel.

SGLang cannot be installed here (its dependencies need CUDA), but the wheel holds its whole
Python source. These tests read the parts that stand without CUDA from a git-ignored folder,
`.cache/sglang-0.5.23/` at the repository root, which `make sglang-src` fills
(scripts/fetch_sglang.py: `pip download --no-deps` of the wheel, unpacked into src/, and msgspec,
SamplingParams' one dependency, in deps/). `make test`, `test-fast` and `test-all` fetch it first,
once; running pytest directly without it fails every test here with a message naming
`make sglang-src` (it never skips). `GEO3K_SGLANG_DIR` names another folder of the same layout
(src/sglang/..., deps/) instead. What runs:
  * `SamplingParams` (srt/sampling/sampling_params.py) is imported for real (it needs msgspec
    and torch, both CPU-only), bypassing `sglang/__init__.py`, which pulls in triton, zmq and
    the server stack;
  * the request structs of srt/managers/io_struct.py are read with `ast` (that module imports
    zmq, triton and the scheduler) to check that every key we send is a field SGLang knows;
  * `_expand_input_ids` (srt/multimodal/processors/base_processor.py, a pure static method
    whose module imports the CUDA stack) is compiled alone from the wheel's source, to check the
    fake's image expansion against it;
  * `SafeUnpickler` (srt/utils/common.py, the allow-list SGLang unpickles weight payloads with)
    is compiled alone, to load the learner's in-memory weight payloads as a server would;
  * the launch flags are checked against the config fields SGLang derives its flags from
    (srt/arg_groups/fields/), and the fake's weight-update session answers against the
    scheduler's (srt/managers/scheduler_components/weight_updater.py).
"""

import ast
import base64
import io
import os
import pickle
import sys
import types
import typing
from pathlib import Path

import pytest

from common.engine import Request, SamplingParams
from common.sglang.engine import SGLangEngine
from common.sglang.server import server_argv
from common.sglang.wire import generate_payload, sampling_payload
from tests.conftest import EOS, IMAGE, TURN_END
from tests.fake_sglang import FakeSGLang

ROOT = Path(os.environ.get("GEO3K_SGLANG_DIR")
            or Path(__file__).resolve().parent.parent / ".cache" / "sglang-0.5.23")
SRT = ROOT / "src" / "sglang" / "srt"
FETCH = "run `make sglang-src` (make test does), or set GEO3K_SGLANG_DIR"
SAMPLING = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=50,
                          stop_token_ids=(TURN_END, EOS))


@pytest.fixture(scope="module", autouse=True)
def sglang_source():
    """Fails (never skips) every test here when the unpacked wheel is missing."""
    if not (SRT / "managers" / "io_struct.py").exists():
        pytest.fail(f"no unpacked SGLang 0.5.23 wheel under {ROOT}: {FETCH}", pytrace=False)


@pytest.fixture(scope="module")
def real_sampling_params():
    """SGLang's own `SamplingParams` class, imported from the wheel's source."""
    deps = str(ROOT / "deps")
    sys.path.insert(0, deps)
    saved = {k: v for k, v in sys.modules.items() if k == "sglang" or k.startswith("sglang.")}
    package = types.ModuleType("sglang")  # skip sglang/__init__.py (triton, zmq, servers)
    package.__path__ = [str(ROOT / "src" / "sglang")]
    sys.modules["sglang"] = package
    try:
        from sglang.srt.sampling.sampling_params import SamplingParams as Real
    except ImportError as e:
        pytest.fail(f"SGLang's SamplingParams does not import from {ROOT} (msgspec in deps/?): "
                    f"{e}; {FETCH}", pytrace=False)
    finally:
        sys.path.remove(deps)
    yield Real
    for k in [k for k in sys.modules if k == "sglang" or k.startswith("sglang.")]:
        del sys.modules[k]
    sys.modules.update(saved)


def struct_fields(path: Path, name: str) -> set[str]:
    """The annotated fields of class `name` in `path`, with those of its bases in that file."""
    classes = {n.name: n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef)}
    fields, todo = set(), [name]
    while todo:
        node = classes[todo.pop()]
        fields |= {s.target.id for s in node.body
                   if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
        todo += [b.id for b in node.bases if isinstance(b, ast.Name) and b.id in classes]
    return fields


def real_function(path: Path, cls: str, name: str):
    """Method `name` of class `cls` in `path`, compiled alone (typing names only)."""
    tree = ast.parse(path.read_text())
    (klass,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls]
    (fn,) = [n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name == name]
    fn.decorator_list = []
    namespace = {}
    exec(compile(ast.Module([fn], []), str(path), "exec"),
         {"List": typing.List, "Optional": typing.Optional, "__name__": "sglang_real"},
         namespace)
    return namespace[name]


def test_sampling_payload_is_accepted_by_sglang(real_sampling_params):
    params = real_sampling_params(**sampling_payload(SAMPLING))
    params.normalize(None)
    params.verify(vocab_size=151_936)
    assert (params.temperature, params.top_p, params.min_p) == (0.7, 0.9, 0.0)
    assert params.top_k == 1 << 30  # -1: the whole vocabulary, SGLang's "no top-k"
    assert params.max_new_tokens == 50 and set(params.stop_token_ids) == {TURN_END, EOS}
    assert (params.repetition_penalty, params.frequency_penalty, params.presence_penalty) == \
        (1.0, 0.0, 0.0)
    with pytest.raises(TypeError, match="bogus"):  # unknown keys are refused, not ignored
        real_sampling_params(**sampling_payload(SAMPLING), bogus=1)


def test_request_keys_are_fields_sglang_knows():
    io_struct = SRT / "managers" / "io_struct.py"
    ids = (1, IMAGE, IMAGE, 2)
    body = generate_payload(Request(ids, ["data:x"], SAMPLING, ""), IMAGE, ["data:x"])
    body["return_prompt_token_ids"] = True
    assert set(body) <= struct_fields(io_struct, "GenerateReqInput")
    assert {"model_path", "weight_version", "load_format", "abort_all_requests",
            "flush_cache"} <= struct_fields(io_struct, "UpdateWeightFromDiskReqInput")
    assert "abort_all" in struct_fields(io_struct, "AbortReq")
    assert "tags" in struct_fields(io_struct, "ReleaseMemoryOccupationReqInput")
    assert "tags" in struct_fields(io_struct, "ResumeMemoryOccupationReqInput")


def test_fake_expands_images_as_sglang_does():
    expand = real_function(SRT / "multimodal" / "processors" / "base_processor.py",
                           "BaseMultimodalProcessor", "_expand_input_ids")
    body = generate_payload(Request((7, IMAGE, IMAGE, IMAGE, 8, IMAGE, 9), ["a", "b"],
                                    SAMPLING, ""), IMAGE, ["a", "b"])
    with FakeSGLang(image_token_id=IMAGE, tokens_per_image=4) as fake:
        assert fake.expand(body["input_ids"]) == expand(body["input_ids"], [4, 4], IMAGE) == \
            [7] + [IMAGE] * 4 + [8] + [IMAGE] * 4 + [9]
    with pytest.raises(ValueError, match=r"prompt has 2 image placeholder token\(s\) but 1 "):
        expand(body["input_ids"], [4], IMAGE)  # the refusal the fake copies word for word


def real_class(path: Path, name: str, namespace: dict):
    """Class `name` of `path`, compiled alone in `namespace`."""
    tree = ast.parse(path.read_text())
    (klass,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
    exec(compile(ast.Module([klass], []), str(path), "exec"), namespace)
    return namespace[name]


def test_weight_update_session_keys_and_answers_are_sglangs():
    """Every body the engine sends in an in-memory update is made of fields of SGLang's request
    structs, and the fake refuses what the scheduler refuses, in its words."""
    io_struct = SRT / "managers" / "io_struct.py"
    updater = {n.value for n in ast.walk(ast.parse(
        (SRT / "managers" / "scheduler_components" / "weight_updater.py").read_text()))
        if isinstance(n, ast.Constant) and isinstance(n.value, str)}  # its messages
    with FakeSGLang(tensor_loader=lambda raw: [("w", raw)]) as fake, \
            SGLangEngine([fake.url], image_token_id=2000) as engine:
        payload = base64.b64encode(b"tensors").decode()
        engine.update_weights_from_tensors([([payload], False), ([payload], True)], version=4)
        engine.release_memory()
        engine.resume_memory(["weights"])
        engine.resume_memory(["kv_cache", "cuda_graph"])
        assert fake.tensors == {"w": b"tensors"} and fake.weight_version == "4"
        assert set(fake.bodies("/begin_weight_update")[0]) <= struct_fields(
            io_struct, "BeginWeightUpdateReqInput")
        assert set(fake.bodies("/end_weight_update")[0]) <= struct_fields(
            io_struct, "EndWeightUpdateReqInput")
        for body in fake.bodies("/update_weights_from_tensor"):
            assert set(body) <= struct_fields(io_struct, "UpdateWeightsFromTensorReqInput")
        for body in fake.bodies("/resume_memory_occupation"):
            assert set(body) <= struct_fields(io_struct, "ResumeMemoryOccupationReqInput")
        constants = (SRT / "constants.py").read_text()
        assert all(f'"{tag}"' in constants for tag in ("weights", "kv_cache", "cuda_graph"))
        refusals = [fake.update_from_tensor({"serialized_named_tensors": [payload]}),
                    fake.end_update({}), (fake.begin_update({}), fake.begin_update({}))[1]]
    for status, body in refusals:  # outside a session, twice closed, twice opened
        assert status == 400 and body["success"] is False
        assert body["message"] in updater, body["message"]


def test_launch_flags_are_sglang_config_fields():
    fields = set()
    for f in (SRT / "arg_groups" / "fields").glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                fields.add(node.target.id)
    argv = server_argv("/m", "127.0.0.1", 30000, 2, 4, 0.6, "fa3", True, [], command=(), ep=2)
    flags = [a[2:].replace("-", "_") for a in argv if a.startswith("--")]
    assert flags and set(flags) <= fields, set(flags) - fields


def test_weight_payloads_pass_sglangs_unpickler(tmp_path):
    """The torch learner's in-memory weight payloads load through SGLang's own allow-list
    unpickler: every weight of the tiny model, in bf16, under its checkpoint name."""
    import torch
    from geo3k_torch.model import load_model
    from geo3k_torch.tiny import build_tiny_checkpoint
    from geo3k_torch.weight_sync import TorchWeights

    common = SRT / "utils" / "common.py"
    safe = real_class(common, "SafeUnpickler", {"pickle": pickle, "io": io, "torch": torch,
                                                "_safe_load_torch_storage": None})
    build_tiny_checkpoint(tmp_path / "tiny")
    model = load_model(str(tmp_path / "tiny"))
    got = {}
    for payload, _ in TorchWeights(model, tmp_path / "tiny").tensor_buckets(1 << 16):
        got.update(safe(io.BytesIO(base64.b64decode(payload, validate=True))).load())
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
    assert sorted(got) == sorted(state)
    assert all(torch.equal(got[k], state[k].to(torch.bfloat16)) for k in state)
    with pytest.raises(RuntimeError, match="Blocked unsafe global"):  # it does refuse
        safe(io.BytesIO(pickle.dumps(os.system))).load()


def test_routing_replay_speaks_sglangs_names_and_encoding():
    """The request field and the launch flag are SGLang's (io_struct.py, arg_groups/fields/),
    and SGLang's own decoder of `meta_info.routed_experts` (state_capturer/routed_experts.py
    `extract_routed_experts_from_meta_info`, compiled alone) reads the fake's answer as the
    client does: the same int32 rows."""
    import numpy as np

    from common.sglang.wire import parse_generate_response

    body = generate_payload(Request((1, IMAGE, IMAGE, 2), ["data:x"], SAMPLING, ""), IMAGE,
                            ["data:x"], routed_experts=True)
    assert body["return_routed_experts"] is True
    assert set(body) <= struct_fields(SRT / "managers" / "io_struct.py", "GenerateReqInput")
    argv = server_argv("/m", "127.0.0.1", 30000, 1, 0, 0.6, None, False, [], command=(),
                       routed_experts=True)
    fields = {node.target.id for f in (SRT / "arg_groups" / "fields").glob("*.py")
              for node in ast.walk(ast.parse(f.read_text()))
              if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}
    assert "enable_return_routed_experts" in fields and "--enable-return-routed-experts" in argv
    source = SRT / "state_capturer" / "routed_experts.py"
    tree = ast.parse(source.read_text())
    (fn,) = [n for n in tree.body if isinstance(n, ast.FunctionDef)
             and n.name == "extract_routed_experts_from_meta_info"]
    namespace = {}
    exec(compile(ast.Module([fn], []), str(source), "exec"),
         {"np": np, "pybase64": base64}, namespace)
    with FakeSGLang(image_token_id=IMAGE, tokens_per_image=2, routed_experts=(3, 2, 8)) as fake:
        status, answer = fake.generate(body, fake.abort_epoch)  # no HTTP: the answer itself
    assert status == 200
    flat = namespace["extract_routed_experts_from_meta_info"](answer)
    ours = parse_generate_response(answer, SAMPLING, 4, (3, 2)).routed_experts
    assert flat.dtype == np.int32 and np.array_equal(flat.reshape(-1, 3, 2), ours)
    assert len(ours) == 4 + len(answer["output_ids"]) - 1
