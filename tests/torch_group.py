"""A one-process gloo process group for tests of the torch learner's FSDP2 paths on CPU."""

import contextlib

import torch.distributed as dist


@contextlib.contextmanager
def one_process_group():
    """A gloo group of this process alone (an in-memory store: no ports), destroyed after."""
    assert not dist.is_initialized(), "a process group is already up"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
