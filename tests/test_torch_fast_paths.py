"""The torch learner's fast paths against their plain twins, on CPU: no host sync inside the
micro-batch loop, no dense mask for packed rows, varlen with K/V repeated where torch has no
`enable_gqa`, activation checkpointing modes with the same gradients, and the one-ahead
micro-batch preparation."""

import collections
import sys
import threading
import traceback

import numpy as np
import pytest
import torch
from torch.nn.attention.bias import causal_lower_right
import transformers.masking_utils as masking_utils
from torch._dynamo.utils import counters as dynamo_counters
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.masking_utils import AttentionMaskInterface

import geo3k_torch.attention as attention
from common.batching import pack
from common.grpo import LossConfig
from geo3k_torch.learner import Learner, prefetched
from geo3k_torch.model import (CHECKPOINTING, checkpoint_layers, compile_layers, deepstack_add,
                               packed_inputs, token_logprobs, use_deepstack_add)
from tests.jax_learner_setup import train_config
from tests.test_jax_model import sequences
from tests.test_shared_prefix import groups
from tests.tiny_models import IMG, ImageOnlyProcessor, qwen2_5_vl, qwen3_vl, qwen3_vl_moe

BUILDERS = [qwen3_vl, qwen2_5_vl, qwen3_vl_moe]
# Tensor methods that make the host wait for the device when the tensor lives there.
SYNCS = ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__",
         "__format__", "nonzero")
# The one host read left in a forward: transformers checks that the image placeholders match the
# image features (`torch_compilable_check`). The vision tower's layouts come precomputed
# (`geo3k_torch.model.vision_inputs`) and the deepstack step gathers (`deepstack_add`). The packed
# attention's CPU operator reads its layout's bounds (`_sequences`), host tensors there; on CUDA
# in bf16 the varlen kernel takes them as device tensors and reads nothing.
ALLOWED_FRAMES = {"get_placeholder_mask", "_sequences", "segments_attention_backward"}

class HostSyncs(TorchDispatchMode):
    """Within the block, from the main thread, a method of `SYNCS` called on a tensor raises, and
    so does any aten op whose output size or value the host must wait for (nonzero, boolean-mask
    indexing, `.item()`, repeat_interleave by a tensor: `DATA_DEPENDENT`), the backward's too,
    unless transformers' placeholder check made it (`ALLOWED_FRAMES`). The micro-batch thread
    does host work on host tensors and is not watched."""

    def __enter__(self):
        self.saved = {name: torch.Tensor.__dict__.get(name) for name in SYNCS}  # None: inherited
        for name in SYNCS:
            setattr(torch.Tensor, name, self._guard(name, getattr(torch.Tensor, name)))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, method in self.saved.items():
            if method is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, method)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, op, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        aten = torch.ops.aten
        data_dependent = op in (aten.nonzero.default, aten.masked_select.default,
                                aten._local_scalar_dense.default) or (
            op is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None) or (
            op in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
                   aten._index_put_impl_.default)
            and any(i is not None and i.dtype == torch.bool for i in args[1]))
        if data_dependent and threading.current_thread() is threading.main_thread():
            self._check(str(op))
        return op(*args, **kwargs)

    @staticmethod
    def _check(what):
        callers = {f.name for f in traceback.extract_stack()[:-1]}
        if not callers & ALLOWED_FRAMES:
            raise AssertionError(f"host sync: {what} in the micro-batch loop")

    @classmethod
    def _guard(cls, name, method):
        def guarded(self, *args, **kwargs):
            if threading.current_thread() is threading.main_thread():
                cls._check(f"Tensor.{name}")
            return method(self, *args, **kwargs)
        return guarded


def _learner(build, seed=0):
    model, patch = build(seed=seed)
    model.set_attn_implementation(attention.NAME)
    use_deepstack_add(model)  # as `load_model` and `load_sharded` do
    model.train()
    processor = ImageOnlyProcessor(patch)
    return Learner(model, processor, LossConfig(kl_coef=0.0, tis_cap=2.0), train_config(), 0.8,
                   chunk=7), processor


@pytest.mark.parametrize("build", BUILDERS, ids=lambda b: b.__name__)
def test_no_host_sync_in_the_micro_batch_loop(build, monkeypatch):
    """Forward, loss, backward and metric sums of every micro-batch (images, shared prompts,
    several micro-batches) never read a device value back; the step's metrics are the ones
    computed without the guard. A `float(loss)` planted in the loop is caught."""
    learner, processor = _learner(build)
    seqs = groups(processor, np.random.default_rng(1))
    batches = pack(seqs, max(map(len, seqs)) + 40, image_token_id=IMG)
    assert len(batches) >= 2 and any((b.parent_of() >= 0).any() for b in batches)
    n_tokens, n_seqs = float(sum(s.loss_mask.sum() for s in seqs)), float(len(seqs))
    with HostSyncs():
        sums = learner.accumulate(batches, n_tokens, n_seqs)
    assert {"loss", "entropy", "clip_frac", "approx_kl", "logp_diff_mean", "logp_diff_max",
            "tis_mean"} <= set(sums)
    assert all(isinstance(v, torch.Tensor) and v.ndim == (k == "router_counts") * 2
               for k, v in sums.items())  # a MoE model's counts: (layers, experts)
    learner.model.zero_grad()
    plain = learner.accumulate(batches, n_tokens, n_seqs)
    for k, v in sums.items():
        assert torch.allclose(v, plain[k], rtol=1e-6, atol=1e-7), k

    loss_of = learner.micro_batch_loss
    monkeypatch.setattr(learner, "micro_batch_loss",
                        lambda mb: (lambda out: (float(out[0]), out)[1])(loss_of(mb)))
    with pytest.raises(AssertionError, match="host sync: Tensor.__float__"), HostSyncs():
        learner.accumulate(batches, n_tokens, n_seqs)


def test_deepstack_add_equals_transformers_boolean_mask_step():
    """`deepstack_add` against Qwen3-VL's own `_deepstack_process`: the same hidden states and
    the same gradients for hidden and embeds (2 rows, images at scattered positions, one row
    without any); no images leaves hidden as it is. Then a model's logits with and without it
    are equal, and transformers' step does index by the boolean mask (what the fast path's
    guard refuses)."""
    g = torch.Generator().manual_seed(0)
    mask = torch.zeros(2, 9, dtype=torch.bool)
    mask[0, [1, 2, 6]] = True
    mask[1, [0, 8]] = True
    model, _ = qwen3_vl(seed=0)
    own = model.model.language_model._deepstack_process
    results = []
    for step in (own, deepstack_add):
        hidden = torch.randn(2, 9, 4, generator=g.manual_seed(1)).requires_grad_()
        embeds = torch.randn(5, 4, generator=g.manual_seed(2)).requires_grad_()
        out = step(hidden, mask, embeds)
        (out * torch.arange(72.0).view(2, 9, 4)).sum().backward()
        results.append((out.detach(), hidden.grad, embeds.grad))
    for want, got in zip(*results):
        assert torch.equal(want, got)
    hidden = torch.randn(1, 3, 4)
    assert deepstack_add(hidden, torch.zeros(1, 3, dtype=torch.bool), torch.zeros(0, 4)) is hidden

    processor = ImageOnlyProcessor(16)
    model.set_attn_implementation(attention.NAME)
    row, = pack(sequences(processor, np.random.default_rng(0), 3), 10_000)
    inputs = packed_inputs(row, processor, model.config)
    with torch.no_grad():
        plain = model(**inputs, use_cache=False).logits
        with pytest.raises(AssertionError, match="host sync: aten.index"), HostSyncs():
            model(**inputs, use_cache=False)
        use_deepstack_add(model)
        with HostSyncs():
            fast = model(**inputs, use_cache=False).logits
    assert torch.equal(plain, fast)


@pytest.mark.parametrize("build", BUILDERS, ids=lambda b: b.__name__)
def test_a_packed_forward_builds_no_mask(build, monkeypatch):
    """Under packed_sdpa transformers neither scans the position ids for packed sequences (a
    host sync) nor builds a mask (T x T); the logits are those of the dense block-diagonal
    reference. The placeholder mask fails loudly under any other attention."""
    model, patch = build(seed=0)
    processor = ImageOnlyProcessor(patch)
    seqs = sequences(processor, np.random.default_rng(0), 5)
    row, = pack(seqs, sum(map(len, seqs)))
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        dense = model(**packed_inputs(row, processor, model.config), use_cache=False).logits

    def refuse(*args, **kwargs):
        raise AssertionError("a mask was built for a packed row")

    model.set_attn_implementation(attention.NAME)
    inputs = packed_inputs(row, processor, model.config)
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", refuse)
    AttentionMaskInterface.register(attention.NAME, refuse)
    try:
        with torch.no_grad():
            packed = model(**inputs, use_cache=False).logits
    finally:
        AttentionMaskInterface.register(attention.NAME, masking_utils.sdpa_mask)
    assert (packed - dense).abs().max() <= 1e-5 * dense.abs().max()
    model.set_attn_implementation("sdpa")
    with pytest.raises(RuntimeError), torch.no_grad():
        model(**inputs, use_cache=False)


@pytest.mark.parametrize("has_gqa", [False, True])
def test_varlen_repeats_kv_where_torch_has_no_enable_gqa(has_gqa, monkeypatch):
    """torch 2.10-2.11's varlen_attn has no `enable_gqa`: each query head must get its group's
    key / value head (repeat_interleave, not tile). Emulated on CPU by per-sequence sdpa with the
    flash kernel's bottom-right causal rule, the call equals segments_sdpa; a tiled repeat
    would pair query head 1 with key head 1 instead of 0 and differ."""
    seen = []

    def emulated(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size, **kw):
        assert window_size == (-1, 0) and ("enable_gqa" in kw) == has_gqa
        seen.append((q.shape[1], k.shape[1]))
        parts = []
        for s in range(len(cu_q) - 1):
            qs, ks, vs = (x[a:b].transpose(0, 1) for x, a, b in (
                (q, cu_q[s], cu_q[s + 1]), (k, cu_k[s], cu_k[s + 1]), (v, cu_k[s], cu_k[s + 1])))
            parts.append(torch.nn.functional.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=causal_lower_right(qs.shape[1], ks.shape[1]),
                scale=scale, enable_gqa=kw.get("enable_gqa", False)).transpose(0, 1))
        return torch.cat(parts)

    monkeypatch.setattr(attention, "varlen_attn", emulated)
    monkeypatch.setattr(attention, "varlen_has_gqa", has_gqa)
    g = torch.Generator().manual_seed(0)
    lengths, parents = [7, 4, 3, 4, 2, 3], [-1, 0, 0, -1, -1, 4]
    T, H, D = sum(lengths), 4, 8
    q = torch.randn(1, H, T, D, generator=g)
    k, v = (torch.randn(1, H // 2, T, D, generator=g) for _ in range(2))
    out = attention.segments_varlen(q, k, v, attention.Segments(lengths, parents).layout("cpu"),
                                    0.3)
    ref = attention.segments_sdpa(q, k, v, lengths, parents, scaling=0.3)
    assert torch.allclose(out, ref, rtol=0, atol=1e-6)
    assert seen == [(H, H // 2 if has_gqa else H)]


class _Ops(TorchDispatchMode):
    """Counts the aten ops that run inside the block, by name."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))


def _backward_ops_and_grads(build, mode, vision=True):
    """The ops of one packed forward's backward pass, and its gradients."""
    model, patch = build(seed=0)
    model.set_attn_implementation(attention.NAME)
    checkpoint_layers(model, mode, vision)
    model.train()
    processor = ImageOnlyProcessor(patch)
    seqs = groups(processor, np.random.default_rng(1))  # samples sharing their prompt
    row, = pack(seqs, sum(map(len, seqs)), image_token_id=IMG)
    assert (row.parent_of() >= 0).any()
    targets = torch.from_numpy(np.flatnonzero(row.loss_mask))
    logp = token_logprobs(model, packed_inputs(row, processor, model.config), targets)
    with _Ops() as ops:
        (logp * torch.linspace(-1, 1, len(logp))).sum().backward()
    return ops.counts, {k: p.grad.clone() for k, p in model.named_parameters()}, model.config


@pytest.mark.parametrize("build", BUILDERS, ids=lambda b: b.__name__)
def test_activation_checkpointing_modes_give_the_same_gradients(build):
    """The modes differ in what the backward pass recomputes: full recomputes the blocks'
    matmuls and activations, selective only the activations (SwiGLU's silu, the vision MLP's
    gelu), none nothing; full without the vision blocks (train.checkpoint_vision=False)
    recomputes the decoder layers alone. The gradients are the same."""
    results = {mode: _backward_ops_and_grads(build, mode) for mode in CHECKPOINTING}
    results["full, text only"] = _backward_ops_and_grads(build, "full", vision=False)
    ops = {mode: r[0] for mode, r in results.items()}
    act = {mode: c["silu"] + c["gelu"] for mode, c in ops.items()}
    assert act["none"] == 0 and act["selective"] == act["full"] > act["full, text only"] > 0, act
    mm = {mode: c["mm"] + c["addmm"] + c["_grouped_mm"] for mode, c in ops.items()}
    assert mm["none"] == mm["selective"] < mm["full, text only"] < mm["full"], mm
    # attention is never recomputed under selective: the text layers' packed attention (one op
    # a layer) and the vision blocks' sdpa are kept; full recomputes them, each once
    layers = results["none"][2].text_config.num_hidden_layers
    text = {mode: c["segments_attention"] for mode, c in ops.items()}
    assert text == {"none": 0, "selective": 0, "full": layers, "full, text only": layers}, text
    vision = {mode: c["_scaled_dot_product_flash_attention_for_cpu"] for mode, c in ops.items()}
    assert vision["none"] == vision["selective"] == vision["full, text only"] == 0 \
        < vision["full"], vision
    assert all(c["segments_attention_backward"] == layers for c in ops.values()), ops
    ref = results["none"][1]
    for mode in ("full", "selective", "full, text only"):
        for k, g in results[mode][1].items():
            assert torch.linalg.norm(g - ref[k]) <= 1e-6 * max(torch.linalg.norm(ref[k]), 1e-8), \
                (mode, k)


def _compiled_against_eager(build, mode, backend):
    """Log-probs and gradients of two packed rows of different lengths (images, shared prompts:
    M-RoPE, deepstack for Qwen3-VL, windows for Qwen2.5-VL), eager then compiled; the compiled
    graphs counted after each row."""
    torch._dynamo.reset()
    dynamo_counters.clear()
    results = []
    for compiled in (False, True):
        model, patch = build(seed=0)
        model.set_attn_implementation(attention.NAME)
        use_deepstack_add(model)
        names = list(model.state_dict())
        if compiled:
            compile_layers(model, mode, backend=backend)
        else:
            checkpoint_layers(model, mode)
        assert list(model.state_dict()) == names
        model.train()
        processor = ImageOnlyProcessor(patch)
        seqs = groups(processor, np.random.default_rng(1))
        logps, graphs = [], []
        for budget in (2 * max(map(len, seqs)), sum(map(len, seqs))):
            row = pack(seqs, budget, image_token_id=IMG)[0]
            assert (row.parent_of() >= 0).any()  # the same layout kind in both rows
            targets = torch.from_numpy(np.flatnonzero(row.loss_mask))
            logp = token_logprobs(model, packed_inputs(row, processor, model.config), targets)
            (logp * torch.linspace(-1, 1, len(logp))).sum().backward()
            logps.append(logp.detach())
            graphs.append(dynamo_counters["stats"]["unique_graphs"])
        results.append((logps, {k: p.grad.clone() for k, p in model.named_parameters()},
                        graphs))
    return results


@pytest.mark.slow  # compiles (about 20 s on two cores)
@pytest.mark.parametrize("build", BUILDERS, ids=lambda b: b.__name__)
def test_compiled_layers_equal_eager(build):
    """train.compile: every text decoder layer and vision block compiled as one region each
    (Dynamo and AOTAutograd; the aot_eager backend generates no code), selective checkpointing
    inside, gives the eager log-probs and gradients; the blocks of a kind share one graph, and a
    row of another length compiles nothing new: three graphs, the text layers', and Qwen2.5-VL's
    windowed and full vision blocks, or Qwen3-VL's first vision block (its input is a view, the
    patch embedding reshaped) and the others. A per-block function or a Python list in the
    attention's layout would compile once per block or per row."""
    (a, ga, _), (b, gb, graphs) = _compiled_against_eager(build, "selective", "aot_eager")
    model = build(seed=0)[0]
    blocks = len(model.model.visual.blocks) + model.config.text_config.num_hidden_layers
    assert graphs == [3, 3] and blocks > 3, (graphs, blocks)
    assert [len(x) for x in a] == [len(x) for x in b] and len(set(map(len, a))) == 2
    for x, y in zip(a, b):
        assert torch.allclose(x, y, rtol=0, atol=1e-6)
    for k, g in ga.items():
        assert torch.linalg.norm(gb[k] - g) <= 1e-6 * max(torch.linalg.norm(g), 1e-8), k


@pytest.mark.slow  # generates and compiles C++ kernels (about 60 s on two cores)
def test_compiled_layers_with_inductor_equal_eager():
    """The default backend (inductor: fused kernels), full checkpointing: the eager log-probs
    and gradients within fp32 reassociation (measured 5e-7 / 1e-6)."""
    (a, ga, _), (b, gb, graphs) = _compiled_against_eager(qwen3_vl, "full", "inductor")
    assert graphs[0] == graphs[1] > 0, graphs
    for x, y in zip(a, b):
        assert torch.allclose(x, y, rtol=0, atol=1e-5)
    for k, g in ga.items():
        assert torch.linalg.norm(gb[k] - g) <= 1e-5 * max(torch.linalg.norm(g), 1e-8), k


def test_compiled_blocks_run_eager_without_a_packed_layout():
    """Generation (no packed layout) calls the blocks' eager forward: nothing compiles, and the
    logits equal an uncompiled model's."""
    torch._dynamo.reset()
    dynamo_counters.clear()
    plain, compiled = (qwen3_vl(seed=0)[0].eval() for _ in range(2))
    compile_layers(compiled, "none", backend="aot_eager")
    ids = torch.tensor([[1, 5, 9, 30, 2]])
    with torch.no_grad():
        assert torch.equal(plain(input_ids=ids).logits, compiled(input_ids=ids).logits)
    assert dynamo_counters["stats"]["unique_graphs"] == 0


def test_an_unknown_checkpointing_mode_is_refused():
    model, _ = qwen3_vl(seed=0)
    with pytest.raises(ValueError, match="full, selective, none|'full', 'selective', 'none'"):
        checkpoint_layers(model, "some")


def test_prefetched_keeps_order_and_works_one_ahead():
    """Items come back in order, each computed in another thread, at most one ahead of the
    consumer; an error in the preparation reaches the consumer."""
    started, consumer = [], threading.current_thread()

    def fn(i):
        assert threading.current_thread() is not consumer
        started.append(i)
        return i * 10

    got = []
    for value in prefetched(fn, [0, 1, 2, 3]):
        got.append(value)
        assert len(started) <= len(got) + 1
    assert got == [0, 10, 20, 30] and list(prefetched(fn, [])) == []

    def broken(i):
        raise KeyError(i)

    with pytest.raises(KeyError):
        list(prefetched(broken, [5]))


@pytest.mark.slow  # compiles (about 30 s on two cores)
def test_the_gpu_recipes_learner_on_cpu_equals_the_plain_one():
    """Every fast path of the GPU learner together, on CPU: FSDP2's bf16 policy, blocks compiled
    (aot_eager) with selective checkpointing inside, the fused head in chunks; one optimizer
    step on several micro-batches (images, shared prompts) against the same step with eager
    blocks, no checkpointing and the plain head: the loss within 1e-4, the gradient norm and
    every gradient within 1e-2 (bf16 compute in both; the fast paths reorder its rounding)."""
    from geo3k_torch.distributed import parallelize
    from tests.torch_group import one_process_group

    torch._dynamo.reset()
    out = []
    with one_process_group():
        for fast in (False, True):
            model, patch = qwen3_vl(seed=0)
            model.set_attn_implementation(attention.NAME)
            use_deepstack_add(model)
            if fast:
                compile_layers(model, "selective", backend="aot_eager")
            model = parallelize(model.train(), bf16=True)
            processor = ImageOnlyProcessor(patch)
            learner = Learner(model, processor, LossConfig(tis_cap=2.0), train_config(), 0.8,
                              chunk=7, fused_head=fast)
            seqs = groups(processor, np.random.default_rng(1))
            batches = pack(seqs, max(map(len, seqs)) + 40, image_token_id=IMG)
            assert len(batches) >= 2
            metrics = learner.train_step(batches, float(sum(s.loss_mask.sum() for s in seqs)),
                                         float(len(seqs)))
            out.append((metrics, {k: p.grad.full_tensor().clone()
                                  for k, p in model.named_parameters()}))
    (plain, g_plain), (fast, g_fast) = out
    assert fast["loss"] == pytest.approx(plain["loss"], rel=1e-4, abs=1e-6)
    assert fast["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-2)
    for k, g in g_plain.items():
        assert torch.linalg.norm(g_fast[k] - g) <= 1e-2 * max(torch.linalg.norm(g), 1e-8), k
