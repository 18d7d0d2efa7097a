"""The loop's torch collectives hand the process group tensors on the learner's device only.

NCCL, the CUDA backend, refuses CPU tensors ("No backend type associated with device type
cpu"); gloo takes them, so the CPU suite would never see a CPU tensor sent where the learner
lives on CUDA. Here every tensor collective is wrapped to check the device type of what it is
handed, and the learner's device is pretended to be "meta" (a device CPU code never uses by
accident): a collective handed a meta tensor stops the call (`Handed`, its values do not exist),
one handed a CPU tensor fails the test.
"""

import numpy as np
import pytest
import torch
import torch.distributed as dist

from common.batching import pack
from common.grpo import LossConfig
from tests.jax_learner_setup import train_config
from tests.test_jax_model import sequences
from tests.tiny_models import ImageOnlyProcessor, qwen3_vl
from tests.torch_group import one_process_group

TENSOR_COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "all_gather", "broadcast",
                      "reduce_scatter_tensor", "reduce", "gather", "scatter")


class Handed(Exception):
    """A collective was handed its tensors on the learner's (meta) device."""


@pytest.fixture
def meta_checked(monkeypatch):
    """A one-process group whose tensor collectives accept meta tensors only."""
    seen = []

    def checked(name):
        def run(*args, **kwargs):
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            tensors += [t for a in args if isinstance(a, list) for t in a
                        if isinstance(t, torch.Tensor)]
            kinds = sorted({t.device.type for t in tensors})
            seen.append((name, kinds))
            assert kinds == ["meta"], (f"dist.{name} was handed {kinds} tensors; the learner's "
                                       "device is meta (NCCL would refuse them)")
            raise Handed(name)
        return run

    for name in TENSOR_COLLECTIVES:
        monkeypatch.setattr(dist, name, checked(name))
    with one_process_group():
        yield seen


def test_sum_scalars_hands_the_group_device_tensors(meta_checked):
    from geo3k_torch.distributed import TorchCollectives

    comm = TorchCollectives(torch.device("meta"))
    with pytest.raises(Handed):
        comm.sum_scalars({"tokens": 3.0, "logp_diff_max": 0.5}, max_keys=("logp_diff_max",))
    assert meta_checked == [("all_gather_into_tensor", ["meta"])]
    assert comm.gather("x") == ["x"]  # object collectives: the group picks its CPU backend
    comm.barrier()


def test_learner_step_hands_the_group_device_tensors(meta_checked):
    """The learner's step as the loop runs it (forward and backward on CPU, then its metrics
    merged over ranks through the run's collectives) and the SFT step's global counts."""
    from geo3k_torch.distributed import TorchCollectives
    from geo3k_torch.learner import Learner, SFTLearner, sft_step

    model, patch = qwen3_vl(seed=0)
    processor = ImageOnlyProcessor(patch)
    seqs = sequences(processor, np.random.default_rng(0), 2)
    batches = pack(seqs, sum(map(len, seqs)))
    comm = TorchCollectives(torch.device("meta"))
    learner = Learner(model, processor, LossConfig(), train_config(), 1.0, comm=comm)
    with pytest.raises(Handed):
        learner.train_step(batches, float(sum(s.loss_mask.sum() for s in seqs)), 2.0)
    with pytest.raises(Handed):
        sft_step(SFTLearner(model, processor, train_config(), comm=comm), seqs, 10_000, comm)
    assert [name for name, _ in meta_checked] == ["all_gather_into_tensor"] * 2


def test_sum_scalars_values_over_the_group():
    """Sums and maxima of the merged scalars (one process: its own values)."""
    from geo3k_torch.distributed import TorchCollectives

    with one_process_group():
        got = TorchCollectives("cpu").sum_scalars({"a": 1.5, "m": -2.0}, max_keys=("m",))
    assert got == {"a": 1.5, "m": -2.0}
