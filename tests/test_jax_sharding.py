"""Mesh construction and partition rules (geo3k_jax.core.sharding) as config data."""

import types

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from configs.base import JAX_RULES
from geo3k_jax.core.sharding import AXES, batch_shardings, make_mesh, param_shardings, spec_for

FAKE = types.SimpleNamespace(shape={"data": 2, "fsdp": 4, "expert": 4, "tensor": 2})


def test_mesh_takes_the_remaining_devices():
    mesh = make_mesh({"data": 1, "fsdp": -1, "tensor": 1})
    assert mesh.axis_names == AXES and mesh.shape["fsdp"] == len(jax.devices())


@pytest.mark.parametrize("shape,match", [
    ({"model": 2}, "unknown mesh axes"), ({"data": -1, "fsdp": -1}, "at most one -1"),
    ({"data": 0}, "positive"), ({"data": 3}, "needs 3 devices")])
def test_bad_meshes_are_errors(shape, match):
    with pytest.raises(ValueError, match=match):
        make_mesh(shape)


def test_rules_first_match_and_indivisible_dims_replicated():
    name = "model.language_model.layers.3.self_attn.q_proj.weight"
    assert spec_for(name, (1024, 512), FAKE, JAX_RULES) == P("tensor", "fsdp")
    assert spec_for(name, (1024, 510), FAKE, JAX_RULES) == P("tensor", None)  # 510 % 4
    assert spec_for(name.replace("q_proj", "o_proj"), (512, 1024), FAKE, JAX_RULES) == \
        P("fsdp", "tensor")
    assert spec_for("model.visual.blocks.0.attn.qkv.bias", (96,), FAKE, JAX_RULES) == P("tensor")
    assert spec_for("model.visual.blocks.0.attn.proj.bias", (32,), FAKE, JAX_RULES) == P()
    assert spec_for("model.language_model.norm.weight", (64,), FAKE, JAX_RULES) == P()
    assert spec_for("lm_head.weight", (151936, 2048), FAKE, JAX_RULES) == P("tensor", "fsdp")


def test_stacked_experts_split_over_the_expert_axis_first():
    """A MoE layer's (E, out, in) experts: E over `expert`, out and in as the dense projections;
    the router is replicated (its E x hidden is small, and `gate.weight` is no `gate_proj`)."""
    key = "model.language_model.layers.mlp.experts.{}"  # stacked: (L, E, out, in)
    assert spec_for(key.format("gate_up_proj"), (48, 128, 1536, 2048), FAKE, JAX_RULES) == \
        P(None, "expert", "tensor", "fsdp")
    assert spec_for(key.format("down_proj"), (48, 128, 2048, 768), FAKE, JAX_RULES) == \
        P(None, "expert", "fsdp", "tensor")
    assert spec_for(key.format("down_proj"), (48, 6, 2048, 768), FAKE, JAX_RULES) == \
        P(None, None, "fsdp", "tensor")  # 6 experts on 4 devices: replicated over them
    assert spec_for("model.language_model.layers.mlp.gate.weight", (48, 128, 2048), FAKE,
                    JAX_RULES) == P(None)  # the layer axis, unsharded as ever


def test_rule_with_too_many_axes_is_an_error():
    with pytest.raises(ValueError, match="gives 2 axes"):
        spec_for("a.bias", (8,), FAKE, [(r"bias$", ("tensor", "fsdp"))])


def test_single_device_shardings():
    mesh = make_mesh({"fsdp": -1})
    sh = param_shardings({"x.q_proj.weight": np.zeros((4, 4))}, mesh, JAX_RULES)
    assert sh["x.q_proj.weight"].mesh == mesh
    batch = {"input_ids": np.zeros((3, 8)), "key_offsets": np.zeros(8),
             "vision": {"rope_pos": np.zeros((3, 5, 2))}}
    out = batch_shardings(mesh, batch)
    assert set(out) == {"input_ids", "key_offsets", "vision"}
    assert set(out["vision"]) == {"rope_pos"}
    assert out["key_offsets"].spec == P()
