"""One slice shape for a whole run (`config.jax.slice`, `geo3k_jax.core.buckets.one_shape`): where a
compile takes minutes (TPU), every slice of every step is that shape, so each program compiles
once; a slice that needs more is an error naming the setting to raise."""

import jax
import ml_collections
import numpy as np
import pytest

from common.grpo import LossConfig
from geo3k_jax.core.buckets import fit, one_shape
from tests.jax_learner_setup import model_and_batch, train_config

jax.config.update("jax_default_matmul_precision", "highest")


def slice_cfg(**kw):
    return ml_collections.ConfigDict(dict(dict(targets=0, patches=0, window=0,
                                               prefix_window=0), **kw))


def test_one_shape_from_the_config():
    assert one_shape(slice_cfg(), 1024) is None  # targets 0: shapes follow the data
    assert one_shape(slice_cfg(targets=512, patches=64, prefix_window=96), 1024) == dict(
        length=1024, targets=512, patches=64, window=1024, prefix_window=96)  # window 0: T
    assert one_shape(slice_cfg(targets=8, window=384), 1024)["window"] == 384
    with pytest.raises(ValueError, match="jax.slice.window=200"):
        one_shape(slice_cfg(targets=8, window=200), 1024)  # not a multiple of the block
    with pytest.raises(ValueError, match="jax.slice.window=2048"):
        one_shape(slice_cfg(targets=8, window=2048), 1024)  # longer than the row


def test_fit_names_what_to_raise():
    shape = dict(length=1024, targets=512, patches=64, window=1024, prefix_window=96)
    need = dict(length=256, targets=100, patches=0, window=256, prefix_window=32)
    assert fit(need, shape) == shape
    with pytest.raises(ValueError, match=r"patches=128 > 64 \(raise jax.slice.patches\)"):
        fit(dict(need, patches=128), shape)
    with pytest.raises(ValueError, match=r"length=2048 > 1024 \(raise train.micro_batch_tok"):
        fit(dict(need, length=2048), shape)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # two learners' compiles: 13 minutes on 2 cores shared by 20 processes
def test_a_run_of_one_shape_compiles_each_program_once_and_trains_the_same():
    """Steps of 4 and of 1 micro-batches (shorter rows, fewer patches) run the one compiled
    gradient; the loss equals the data-shaped learner's (padding never changes a result)."""
    setup = model_and_batch("qwen3_vl")
    length = setup.batch["input_ids"].shape[1]
    # room for the setup's micro-batches on the learner's ladders: trained tokens come in units
    # of 128, patches of 64 (16 merge units of 4)
    shape = one_shape(slice_cfg(targets=128, patches=128, prefix_window=length), length)
    learner = setup.learner(LossConfig(), train_config(), shape=shape, rows_per_slice=1)
    ladder = setup.learner(LossConfig(), train_config(), rows_per_slice=1)
    for batches in (setup.batches, setup.batches[-1:]):
        one, other = (setup.step(x, batches) for x in (learner, ladder))
        np.testing.assert_allclose(one["loss"], other["loss"], rtol=1e-5, atol=1e-7)
    assert learner._shapes == [shape]
    assert learner.compiles == 2  # the gradient and the update, once each
    # the data needed smaller slices than the run's shape: the one-shape learner padded them
    assert ladder._shapes and shape not in ladder._shapes
