"""The SGLang client's requests against the real code of the released SGLang 0.5.23 wheel.

SGLang cannot be installed here (its dependencies need CUDA), but the wheel holds its whole
Python source. These tests use the parts that stand without CUDA, from a test-only folder that is
never committed (skipped when it is absent):

    pip download sglang==0.5.23 --no-deps -d /tmp/sgl
    unzip -q /tmp/sgl/sglang-0.5.23-*.whl -d /tmp/sgl/src
    pip install --no-deps --target /tmp/sgl/deps msgspec     # SamplingParams' one dependency

(`GEO3K_SGLANG_DIR` names another folder.) What runs:
  * `SamplingParams` (srt/sampling/sampling_params.py) is imported for real (it needs msgspec
    and torch, both CPU-only), bypassing `sglang/__init__.py`, which pulls in triton, zmq and
    the server stack;
  * the request structs of srt/managers/io_struct.py are read with `ast` (that module imports
    zmq, triton and the scheduler) to check that every key we send is a field SGLang knows;
  * `_expand_input_ids` (srt/multimodal/processors/base_processor.py, a pure static method
    whose module imports the CUDA stack) is compiled alone from the wheel's source, to check the
    fake's image expansion against it.
"""

import ast
import os
import sys
import types
import typing
from pathlib import Path

import pytest

from common.engine import Request, SamplingParams
from common.sglang.wire import generate_payload, sampling_payload
from tests.conftest import EOS, IMAGE, TURN_END
from tests.fake_sglang import FakeSGLang

ROOT = Path(os.environ.get("GEO3K_SGLANG_DIR", "/tmp/sgl"))
SRT = ROOT / "src" / "sglang" / "srt"
pytestmark = pytest.mark.skipif(not (SRT / "managers" / "io_struct.py").exists(),
                                reason=f"no unpacked SGLang wheel under {ROOT}")
SAMPLING = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=50,
                          stop_token_ids=(TURN_END, EOS))


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
        pytest.skip(f"SGLang's SamplingParams does not import here: {e}")
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
