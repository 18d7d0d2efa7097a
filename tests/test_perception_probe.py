"""scripts/perception_probe.py: the figure's reach is 0 where only the text varies between a
family's problems and positive where the figures do, at every layer after the embeddings."""

import importlib
import sys
from pathlib import Path

import numpy as np
import pytest

from common.chat import ChatRenderer
from common.data import row_to_prompt
from common.processor import load_processor
from common.prompts import prompt_style
from common.synthetic import generate, problem_kind

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.fixture(scope="module")
def probe():
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    return importlib.import_module("perception_probe")


def test_importing_the_probe_defines_no_flags():
    """Other scripts define `--steps` too (benchmark_trl, benchmark_jax): a test worker that
    imported one of them first failed on a duplicate flag."""
    from absl import flags
    sys.modules.pop("perception_probe", None)
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    importlib.import_module("perception_probe")
    assert "perception_probe" not in flags.FLAGS.flags_by_module_dict()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from geo3k_torch.tiny import build_tiny_checkpoint
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


def _prompts(same_figure: bool):
    system, _ = prompt_style("brief")
    rows = generate(6, seed=5, image_size="112", families=("polygon_sides", "longest_segment"))
    if same_figure:  # every problem of a family shows its family's first figure
        first = {}
        for row in rows:
            row["images"] = first.setdefault(row["problem"], row["images"])
    return [row_to_prompt(row, uid=f"p{i}", system=system) for i, row in enumerate(rows)]


def test_the_reach_is_what_the_figure_moves(probe, tiny):
    from geo3k_torch.model import load_model
    processor, model = load_processor(str(tiny)), load_model(str(tiny))
    renderer = ChatRenderer(processor, tools=None)
    shares = {}
    for same in (True, False):
        prompts = _prompts(same)
        held_out = probe.examples(renderer, prompts, "letter")
        shares[same] = probe.figure_reach(model, processor, held_out,
                                          [problem_kind(p.problem) for p in prompts])
    layers = model.config.text_config.num_hidden_layers
    assert shares[True].shape == shares[False].shape == (layers + 1,)
    # the answer's own token embedding never sees the figure
    assert shares[False][0] == pytest.approx(0.0, abs=1e-7)
    assert np.all(shares[True] < 1e-5)  # one figure a family: nothing varies
    assert np.all(shares[False][1:] > 1e-4)
