"""The torch learner's activation memory, measured, and `train.micro_batch_tokens = "auto"`
resolved from it (`common.micro_batch` chooses).

    tokens = resolve(cfg, learner, comm)   # in the entry point, once the learner exists

For each checkpointing mode the learner's own micro-batch loss runs on two probe micro-batches
(sequences of random text around one image, `probe_batch`), and two things are read:

    live bytes  what the forward leaves alive for its backward: every tensor an op creates in
                the forward (`LiveBytes`, a dispatch mode; weights excluded), counted once per
                storage if still alive when the forward ends. It sees what checkpointing keeps
                ("selective" saves its matmul outputs in a cache that
                `torch.autograd.graph.saved_tensors_hooks` never sees: the hooks measure
                selective as full), on any device.
    peak        on CUDA, the most memory allocated during forward and backward above what was
                allocated before (`torch.cuda.max_memory_allocated`): recomputation, gradients
                of activations, the backward's workspaces.

The two sizes give a fixed part and a part per token (a straight line through both; the
larger of the two lines' slopes on CUDA). The free memory is what the device has (CUDA:
`mem_get_info` plus this process's cached blocks; CPU: the host's MemAvailable) less what the
first optimizer step will allocate (gradients and AdamW's moments) and what the caller reserves
(the local engine's own weights). A CPU run never checkpoints, so only "none" is measured there.
"""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from common import micro_batch
from common.batching import TrainSequence, pack
from geo3k_torch.model import checkpoint_layers, compile_layers

PROBE_TOKENS = (2048, 4096)  # the two probe micro-batches
PROBE_IMAGE_PX = 448  # one square image per probe sequence (a Geometry3K diagram's size)


class LiveBytes(TorchDispatchMode):
    """Records the storage of every tensor an op returns; `live()` is the bytes of those still
    alive, each storage once, less `exclude` (data pointers: the weights)."""

    def __init__(self, exclude: set[int]):
        super().__init__()
        self.exclude, self.seen = exclude, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                known = self.seen.get(id(s))
                if known is None or known() is not s:  # an id is reused once its owner dies
                    self.seen[id(s)] = weakref.ref(s)
        return out

    def live(self) -> int:
        gc.collect()
        ptrs = {}
        for ref in self.seen.values():
            s = ref()
            if s is not None and s.data_ptr() not in self.exclude:
                ptrs[s.data_ptr()] = s.nbytes()  # now: a freed FSDP buffer is resized to 0
        return sum(ptrs.values())


def probe_batch(tokens: int, seq_len: int, processor, config, seed: int = 0):
    """A packed micro-batch of `tokens` tokens: sequences of `seq_len` tokens, each random text
    around one random PROBE_IMAGE_PX image, every token but each sequence's first trained."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    low = min(config.image_token_id, config.vision_start_token_id, config.vision_end_token_id)
    merge = config.vision_config.spatial_merge_size
    seqs = []
    for i in range(tokens // seq_len):
        img = Image.fromarray(rng.integers(0, 255, (PROBE_IMAGE_PX, PROBE_IMAGE_PX, 3),
                                           np.uint8))
        grid = processor.image_processor(images=[img], return_tensors="np")["image_grid_thw"][0]
        image = ([config.vision_start_token_id] + [config.image_token_id]
                 * (int(np.prod(grid)) // merge ** 2) + [config.vision_end_token_id])
        if len(image) + 2 > seq_len:
            image, img = [], None  # too long a sequence for an image: text alone
        ids = np.concatenate([rng.integers(1, low, 1), image,
                              rng.integers(1, low, seq_len - 1 - len(image))]).astype(np.int64)
        mask = np.ones(seq_len, np.float32)
        mask[0] = 0
        seqs.append(TrainSequence(ids, mask, np.full(seq_len, -1.0, np.float32), 1.0,
                                  [img] if img is not None else [], i))
    return pack(seqs, tokens)[0], float(sum(s.loss_mask.sum() for s in seqs)), float(len(seqs))


def _weights(learner) -> set[int]:
    """Data pointers of the learner's parameters (as they are inside its compute context) and of
    its reference model's: never activations."""
    models = [learner.model] + ([learner.ref_model] if learner.ref_model is not None else [])
    out = set()
    for m in models:
        for t in list(m.parameters()) + list(m.buffers()):
            t = t.to_local() if hasattr(t, "to_local") else t
            out.add(t.untyped_storage().data_ptr())
    return out


def measure_one(learner, batch, n_tokens: float, n_seqs: float) -> tuple[int, int]:
    """(live bytes after the forward, peak bytes above the start during forward and backward;
    0 off CUDA) of the learner's loss on one probe micro-batch. Leaves no gradient behind."""
    cuda = learner.device.type == "cuda"
    learner.model.train()
    with learner._compute():
        (mb,) = list(learner._micro_batches([batch], n_tokens, n_seqs))
        if cuda:
            torch.cuda.synchronize(learner.device)
            start = torch.cuda.memory_allocated(learner.device)
            torch.cuda.reset_peak_memory_stats(learner.device)
        tracker = LiveBytes(_weights(learner))
        with tracker:
            loss, _ = learner.micro_batch_loss(mb)
        live = tracker.live()
        loss.backward()
        del loss, mb
        peak = torch.cuda.max_memory_allocated(learner.device) - start if cuda else 0
    learner.optimizer.zero_grad(set_to_none=True)
    if learner.master:
        learner.master.discard()
    return live, peak


def measure(learner, modes, seq_len: int, vision: bool = True,
            sizes: tuple[int, int] | None = None) -> list[micro_batch.Cost]:
    """The activation cost of each checkpointing mode (`common.micro_batch.Cost`), each a line
    through the two probe sizes; a mode whose probe runs out of CUDA memory costs infinity.
    The model is left in the last mode measured."""
    sizes = sizes or PROBE_TOKENS
    seq_len = min(seq_len, sizes[0])  # the same sequences in both: only their number changes
    batches = [probe_batch(n, seq_len, learner.processor, learner.model.config) for n in sizes]
    (n1, n2) = [b.num_tokens for b, _, _ in batches]
    out = []
    for mode in modes:
        checkpoint_layers(learner.model, mode, vision)
        try:
            (l1, p1), (l2, p2) = [measure_one(learner, *b) for b in batches]
        except torch.OutOfMemoryError:
            learner.optimizer.zero_grad(set_to_none=True)
            if learner.master:
                learner.master.discard()
            gc.collect()
            torch.cuda.empty_cache()
            out.append(micro_batch.Cost(mode, 0.0, float("inf")))
            continue
        lines = [((l2 - l1) / (n2 - n1), l1)] + ([((p2 - p1) / (n2 - n1), p1)] if p2 else [])
        slope, at = max(lines)
        out.append(micro_batch.Cost(mode, max(at - slope * n1, 0.0), slope))
    return out


def free_bytes(device: torch.device) -> int:
    """Memory the device has for this process: CUDA's free memory plus the cached blocks this
    process holds but does not use; on CPU the host's MemAvailable (/proc/meminfo)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("train.micro_batch_tokens=auto on CPU reads MemAvailable from "
                       "/proc/meminfo, which this system lacks: set a number of tokens")


def pending_bytes(learner) -> int:
    """What the first optimizer step allocates that does not exist yet: each trained
    parameter's fp32 gradient and AdamW's two moments (this process's shard under FSDP)."""
    total = 0
    for p in learner.model.parameters():
        if p.requires_grad:
            local = p.to_local() if hasattr(p, "to_local") else p
            n = local.numel() * local.element_size()
            total += n + (0 if learner.optimizer.state.get(p) else 2 * n)
    return total


def resolve(cfg, learner, comm, reserved: int = 0) -> int:
    """`train.micro_batch_tokens` as a number: itself, or for "auto" the choice of
    `common.micro_batch.choose` on this learner's measured costs (the same on every process:
    the least free memory of all; measured eager), whose checkpointing mode is applied to the
    model (compiling its blocks with it inside under `train.compile`) and
    written to `train.activation_checkpointing`. Writes the resolved size into the config
    (everything after reads a number) and prints the choice and why. reserved: bytes the
    caller will allocate on the device before training (the local engine's weights)."""
    value = micro_batch.setting(cfg.train.micro_batch_tokens)
    if value != micro_batch.AUTO:
        return value
    modes = micro_batch.MODES if learner.device.type == "cuda" else ("none",)
    costs = measure(learner, modes, cfg.rollout.max_context_tokens, cfg.train.checkpoint_vision)
    gc.collect()
    if learner.device.type == "cuda":
        torch.cuda.empty_cache()
    free = free_bytes(learner.device) - pending_bytes(learner) - reserved
    every = comm.gather((free, [(c.fixed, c.per_token) for c in costs]))
    free = min(f for f, _ in every)
    costs = [micro_batch.Cost(c.mode, max(r[1][i][0] for r in every),
                              max(r[1][i][1] for r in every)) for i, c in enumerate(costs)]
    choice = micro_batch.choose(costs, free, cfg.train.micro_batch_margin,
                                cfg.train.micro_batch_target_tokens,
                                cfg.rollout.max_context_tokens)
    if cfg.train.compile:  # compiled now, with the chosen mode inside (`load_policy` waited)
        compile_layers(learner.model, choice.mode, cfg.train.checkpoint_vision,
                       cfg.train.compile_backend)
    else:
        checkpoint_layers(learner.model, choice.mode, cfg.train.checkpoint_vision)
    if learner.device.type == "cuda":
        cfg.train.activation_checkpointing = choice.mode
    cfg.train.micro_batch_tokens = choice.tokens
    if comm.rank == 0:
        print(choice.reason + (f"; reserved {reserved / micro_batch.GIB:.1f} GiB" if reserved
                               else ""), flush=True)
    return choice.tokens
