"""The GRPO learner in JAX: `common.learner.Learner` as two compiled, sharded functions.

    for each slice of micro-batches (one compiled gradient per slice shape):
        log-probs of the trained tokens (fp32, from logits / temperature, in chunks)
        -> per-token loss (common.grpo, xp=jax.numpy) -> sum(weight_t * loss_t) -> grad
    each slice's gradient added, inside its compiled program, into one fp32 accumulator that
    the program takes and donates (one gradient tree alive, never two), then (one compiled
    update) clip the global norm ->
    AdamW (optax) with the schedule of common.schedule, unless the gradient norm is not finite
    (then nothing changes: a `lax.cond`, no second copy of state)

It mirrors `geo3k_torch.learner`: the same loss function, weights, schedule, clipping and skip
rule, one optimizer step per rollout, "old" log-probs = the current ones without gradient.
A slice has bucketed shapes (`geo3k_jax.core.buckets`) and a step any number of slices, so a run
compiles a handful of times (counted in `compiles`). Parameters are a flat {checkpoint key:
array} dict
(`geo3k_jax.models.model.split_params`), the optimizer state mirrors it, both placed by the mesh's
partition rules; a slice's rows are split over the data-parallel axes.

Routing replay (`loss.routing_replay`, a mixture-of-experts model): each slice carries the
engine's experts per token and sparse layer (`geo3k_jax.core.batch`'s `routing`) and the
forward (the KL reference's too) routes every token to them, so its log-probs are the engine's
routing's; `logp_diff_*` are then the replayed mismatch against the rollout's log-probs. A
no-gradient forward of the step's first slice routing freely reports what replay removed:
`logp_diff_mean_free`, `logp_diff_max_free`, and `routing_replay_mismatch`, the share of
(token, sparse layer) routings whose free top-k set differs from the replayed one.

Mixed precision (`compute_dtype=bfloat16`): fp32 parameters and optimizer state, the forward
and backward in bf16 (parameters cast inside the loss), the LM head accumulated in fp32,
log-probs and the loss in fp32 — the JAX counterpart of torch autocast.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

from common import storage
from common.batching import PackedBatch
from common.grpo import LossConfig, per_token_terms
from common.learner import Collectives, Deferred, SingleProcess, is_vision
from common.schedule import horizon, lr_table
from geo3k_jax.core.batch import host_row
from geo3k_jax.core.buckets import Ladder, agree, fit, reuse, slice_sizes, step_slices
from geo3k_jax.models.model import head_logprobs, token_logprobs
from geo3k_jax.models.moe import routing_shape
from geo3k_jax.core.sharding import BATCH_AXES, batch_shardings, param_shardings

DTYPES = {"float32": None, "bfloat16": jnp.bfloat16}  # jax.compute_dtype -> the compute dtype
STATE_DIR = "jax_state"  # the orbax learner state inside a checkpoint directory
SHAPES_FILE = "jax_shapes.json"  # and the slice shapes the run has used (`buckets.reuse`)


def make_optimizer(train_cfg, names: Iterable[str] = ()) -> optax.GradientTransformation:
    """Clip by global norm, then AdamW whose learning rate at step s is
    `lr * common.schedule.lr_factor(s)` (tabulated; the count advances only on applied steps).
    With `train_cfg.freeze_vision` the vision tower's parameters (`model.visual.*`, its merger
    included) among `names` (the parameter dict's keys) get no update, and the norm clipped is
    the rest's."""
    table = jnp.asarray(lr_table(train_cfg.lr, train_cfg.lr_schedule, *horizon(train_cfg),
                                 train_cfg.min_lr_ratio))
    schedule = lambda count: table[jnp.minimum(count, table.shape[0] - 1)]  # noqa: E731
    frozen = {k for k in names if is_vision(k)} if train_cfg.freeze_vision else set()
    if train_cfg.freeze_vision and not frozen:
        raise ValueError("train.freeze_vision: the model has no vision tower parameters "
                         "(model.visual.*)")
    # Stateless masks before and after (the moments keep every parameter's shape, so the
    # state shards as the parameters do): a frozen gradient is 0 before the clip and AdamW,
    # and a frozen update (AdamW's weight decay) 0 after.
    zero = optax.stateless(lambda updates, _: {
        k: jnp.zeros_like(u) if k in frozen else u for k, u in updates.items()})
    return optax.chain(
        *([zero] if frozen else []),
        optax.clip_by_global_norm(train_cfg.grad_clip),
        optax.adamw(schedule, b1=train_cfg.beta1, b2=train_cfg.beta2, eps=train_cfg.eps,
                    weight_decay=train_cfg.weight_decay),
        *([zero] if frozen else []))


def current_lr(tx_state, train_cfg) -> jax.Array:
    """The learning rate the next applied step uses."""
    is_schedule = lambda s: isinstance(s, optax.ScaleByScheduleState)  # noqa: E731
    count, = [s.count for s in jax.tree.leaves(tx_state, is_leaf=is_schedule) if is_schedule(s)]
    table = jnp.asarray(lr_table(train_cfg.lr, train_cfg.lr_schedule, *horizon(train_cfg),
                                 train_cfg.min_lr_ratio))
    return table[jnp.minimum(count, table.shape[0] - 1)]


def grpo_loss(merge: Callable, params: dict, batch: dict, loss_cfg: LossConfig,
              temperature: float, compute_dtype=None, ref_params: dict | None = None,
              chunk: int = 0, remat: bool = False):
    """(loss, metric sums) of a batch under `params` (see `loss_from_logprobs`)."""
    cast = (lambda p: p) if compute_dtype is None else (  # noqa: E731
        lambda p: jax.tree.map(lambda a: a.astype(compute_dtype), p))
    logp, entropy = token_logprobs(merge(cast(params)), batch, temperature, with_entropy=True,
                                   chunk=chunk, remat=remat)
    ref = None
    if loss_cfg.kl_coef:
        if ref_params is None:
            raise ValueError("kl_coef > 0 needs reference parameters")
        ref = jax.lax.stop_gradient(token_logprobs(merge(cast(ref_params)), batch, temperature,
                                                   chunk=chunk))
    behaviour = "old_logprobs" in batch  # else: one update, against the rollout's log-probs
    old = batch["old_logprobs"] if behaviour else jax.lax.stop_gradient(logp)
    loss, sums = loss_from_logprobs(logp, old, batch, loss_cfg, ref,
                                    diag_logp=None if behaviour else batch["rollout_logprobs"])
    sums["entropy"] = jnp.sum(entropy * batch["loss_mask"])
    return loss, sums


def loss_from_logprobs(logp, old_logp, batch: dict, loss_cfg: LossConfig, ref_logp=None,
                       diag_logp=None):
    """sum(weights * per-token loss) and metric sums over the masked tokens: tokens, clip_frac,
    approx_kl (against `diag_logp` when given, see `per_token_terms`), kl, tis_mean,
    logp_diff_mean; plus logp_diff_max. logp, old_logp, ref_logp and the batch's row arrays:
    (B, T)."""
    mask, rollout = batch["loss_mask"], batch["rollout_logprobs"]
    terms = per_token_terms(logp, old_logp, batch["advantages"], loss_cfg, ref_logp=ref_logp,
                            rollout_logp=rollout, diag_logp=diag_logp, xp=jnp)
    loss = jnp.sum(terms["loss"] * batch["weights"])
    diff = jnp.abs(jax.lax.stop_gradient(logp) - rollout) * mask
    sums = {"tokens": jnp.sum(mask), "clip_frac": jnp.sum(terms["clipped"] * mask),
            "approx_kl": jnp.sum(terms["approx_kl"] * mask),
            "logp_diff_mean": jnp.sum(diff), "logp_diff_max": jnp.max(diff)}
    for name, key in (("kl", "kl"), ("tis", "tis_mean")):
        if name in terms:
            sums[key] = jnp.sum(terms[name] * mask)
    return loss, sums


def free_routing_metrics(logp, tops, batch: dict) -> dict:
    """What routing replay removed, from a forward routing freely: logp_diff_mean_free and
    logp_diff_max_free (|logp - rollout log-prob| over the trained tokens: mean, max) and
    routing_replay_mismatch, the share of the trained tokens' recorded (token, sparse layer)
    routings whose free top-k set differs from the replayed one (as the torch learner counts). logp (B, T); tops
    (L, B, T, K) the free top k; batch["routing"] (B, T, L, K) the replayed experts (-1: not
    recorded)."""
    mask = batch["loss_mask"]
    diff = jnp.abs(logp - batch["rollout_logprobs"]) * mask
    replay = jnp.moveaxis(batch["routing"], 2, 0).astype(jnp.int32)  # (L, B, T, K)
    recorded = jnp.all(replay >= 0, axis=-1) & (mask > 0)[None]
    differs = jnp.any(jnp.sort(tops, axis=-1) != jnp.sort(replay, axis=-1), axis=-1) & recorded
    return {"logp_diff_mean_free": jnp.sum(diff) / jnp.maximum(jnp.sum(mask), 1.0),
            "logp_diff_max_free": jnp.max(diff),
            "routing_replay_mismatch": jnp.sum(differs) / jnp.maximum(jnp.sum(recorded), 1)}


class Learner:
    """`common.learner.Learner` in JAX. `merge` and `params` come from
    `geo3k_jax.models.model.split_params`; `processor` and `config` (the transformers config) turn
    micro-batches into arrays; rows of `row_len` tokens (default: the micro-batch budget).

    With a `mesh`, parameters are placed by `rules`, a slice is as many rows as the mesh's
    data-parallel size, and the step donates the parameter and optimizer buffers it replaces
    (its own copies: the caller's `params` stay valid). `chunk`: log-probs computed that many
    trained tokens of a row at a time (0: all at once); `remat`: decoder layers recomputed in
    the backward pass; `rows_per_slice` overrides the slice size (a multiple of the data axes);
    `ladder`: how finely slice lengths follow the data (`geo3k_jax.core.buckets.Ladder`), or
    `shape`: every slice of the run that one shape (`geo3k_jax.core.buckets.one_shape`: one compile
    of each program, where a compile takes minutes).
    """

    remote_checkpoints = True  # orbax and the HF export write to gs:// too (common.storage)

    def __init__(self, merge: Callable, params: dict, loss_cfg: LossConfig, train_cfg,
                 temperature: float, *, processor=None, config=None, mesh=None, rules=(),
                 compute_dtype=None, ref_params: dict | None = None, chunk: int = 0,
                 remat: bool = False, rows_per_slice: int | None = None,
                 row_len: int | None = None, ladder: Ladder = Ladder(),
                 shape: dict | None = None,
                 comm: Collectives = SingleProcess(), model_dir: str | None = None):
        if loss_cfg.kl_coef and ref_params is None:
            raise ValueError("kl_coef > 0 needs reference parameters")
        if loss_cfg.router_aux_coef:
            raise ValueError("loss.router_aux_coef > 0: the JAX learner has no router "
                             "load-balancing loss (the torch learner has, geo3k_torch.router); "
                             "set it to 0 or train with geo3k_torch")
        # (L, K) of the routing replayed, None: routing freely
        self.routing = None
        if loss_cfg.routing_replay:
            self.routing = None if config is None else routing_shape(config)
            if self.routing is None:
                raise ValueError(
                    "loss.routing_replay replays a mixture-of-experts model's routing; this "
                    f"model ({getattr(config, 'model_type', 'no config')}) has no sparse "
                    "layer: set loss.routing_replay=False")
        self.merge, self.loss_cfg, self.cfg = merge, loss_cfg, train_cfg
        self.temperature, self.compute_dtype, self.mesh = temperature, compute_dtype, mesh
        self.processor, self.config, self.comm, self.model_dir = processor, config, comm, model_dir
        self.chunk, self.remat = chunk, remat
        data = 1 if mesh is None else int(np.prod([mesh.shape[a] for a in BATCH_AXES]))
        self.rows_per_slice = rows_per_slice or data
        if self.rows_per_slice % data:
            raise ValueError(f"rows_per_slice={self.rows_per_slice} must be a multiple of the "
                             f"mesh's data-parallel size {data}")
        self.row_len, self.ladder, self.shape = row_len, ladder, shape
        self.compiles = 0  # traces of the compiled functions: each one compilation
        self._shapes = []  # the slice shapes used so far (`buckets.reuse`)
        self._saver = None  # the orbax checkpointer of `save`, kept for its background writes
        self._offloaded = "none"  # the state in host memory (`offload`)
        self.tx = make_optimizer(train_cfg, params)
        self.param_sh = None if mesh is None else param_shardings(params, mesh, rules)
        # Without a mesh, the state lives committed to this process's device, as a restored
        # state does: the programs' argument placements, hence the compiled programs, stay the
        # same from step to step and across a restore (uncommitted arrays compile apart).
        self.home = None if mesh is not None else SingleDeviceSharding(jax.local_devices()[0])
        self.opt_sh = None
        if mesh is not None:  # moments sharded like their parameters, counts replicated
            replicated = NamedSharding(mesh, P())
            self.opt_sh = optax.tree_map_params(
                self.tx, lambda _, sh: sh, jax.eval_shape(self.tx.init, params), self.param_sh,
                transform_non_params=lambda _: replicated)
        self.ref_params = None if ref_params is None else self._place(ref_params)
        self.reset(params)
        self._steps = {}

    # ---- state -------------------------------------------------------------------------
    def _place(self, params: dict) -> dict:
        """A copy of `params` in the learner's shardings (the caller's arrays are never donated);
        ShapeDtypeStructs stay shapes, given the learner's shardings."""
        if _abstract(params):
            return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=(
                None if self.param_sh is None else self.param_sh[k])) for k, v in params.items()}
        return jax.device_put(params, self.home or self.param_sh, may_alias=False)

    def reset(self, params: dict) -> None:
        """Start from `params` (copied into place) with a fresh optimizer state. Parameters given
        as ShapeDtypeStructs make a learner of shapes alone, which only `lower`s its programs."""
        self.params, self._offloaded = self._place(params), "none"
        init = jax.jit(self.tx.init, out_shardings=self.home or self.opt_sh)
        self.opt_state = (jax.eval_shape(init, self.params) if _abstract(params)
                          else init(self.params))

    def offload(self, what: str) -> None:
        """Move the optimizer state ("moments") or the whole state ("all": parameters and KL
        reference too) into host memory (`geo3k_jax.learner.phases`) until `onload`, which every
        program of this learner calls first."""
        from geo3k_jax.learner.phases import HOST, offloaded_parts, to_memory
        if what == self._offloaded:
            return
        self.onload()
        parts = offloaded_parts(what)
        if "moments" in parts:
            self.opt_state = to_memory(self.opt_state, HOST)
        if "params" in parts:
            self.params = to_memory(self.params, HOST)
            if self.ref_params is not None:
                self.ref_params = to_memory(self.ref_params, HOST)
        self._offloaded = what

    def onload(self) -> None:
        """Back from host memory (`offload`) into the learner's own shardings in device memory
        (as placed at the start: the compiled programs take them as they are)."""
        if self._offloaded == "none":
            return
        self.opt_state = jax.device_put(self.opt_state, self.home or self.opt_sh)
        if self._offloaded == "all":
            self.params = jax.device_put(self.params, self.home or self.param_sh)
            if self.ref_params is not None:
                self.ref_params = jax.device_put(self.ref_params, self.home or self.param_sh)
        self._offloaded = "none"

    @contextlib.contextmanager
    def _on_device(self):
        """The state in device memory inside, offloaded again after as it was."""
        was = self._offloaded
        self.onload()
        try:
            yield
        finally:
            self.offload(was)

    def export_hf(self, out_dir: Path) -> None:
        """The parameters as a transformers checkpoint in the compute dtype (bf16 on
        accelerators: what the engines sample in; float32 without one), each process writing
        its own shard (`geo3k_jax.models.weights.save_hf`)."""
        from geo3k_jax.models.weights import save_hf

        if self.config is None or self.model_dir is None:
            raise ValueError("exporting a Hugging Face directory needs the learner's config "
                             "and model_dir (the source of its tokenizer and processor files)")
        with self._on_device():
            save_hf(self.merge(self.params), self.config, out_dir,
                    dtype=self.compute_dtype or np.float32, source_dir=self.model_dir)

    def save(self, directory: Path) -> None:
        """Orbax copies the parameters and optimizer state, then writes them in the background
        (`wait_saved`), while the next steps run (after the copy, the step may donate the
        buffers); one save at a time."""
        import orbax.checkpoint as ocp

        self.wait_saved()
        _quiet_orbax()
        self._saver = self._saver or ocp.StandardCheckpointer()
        with self._on_device():  # saved as placed in device memory: restored the same way
            self._saver.save(_state_dir(directory),
                             {"params": self.params, "opt_state": self.opt_state})
        if jax.process_index() == 0:  # the shapes used so far: a resumed run pads the same
            (storage.path(directory) / SHAPES_FILE).write_text(json.dumps(self._shapes))

    def wait_saved(self) -> None:
        if self._saver is not None:
            self._saver.wait_until_finished()

    def restore(self, directory: Path) -> None:
        """Parameters, optimizer state and the slice shapes used so far from `directory`, each
        array typed and sharded like the live one (the saving mesh may differ): resuming
        continues bit for bit, padding each step as the uninterrupted run would."""
        import orbax.checkpoint as ocp

        self.onload()
        path = _state_dir(directory)
        if not path.exists():
            raise FileNotFoundError(f"{directory} has no {STATE_DIR}: not a JAX learner "
                                    "checkpoint")
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct,
                              {"params": self.params, "opt_state": self.opt_state})
        _quiet_orbax()
        with ocp.StandardCheckpointer() as ckpt:
            saved, here = set(ckpt.metadata(path).item_metadata["params"]), set(self.params)
            if saved != here:
                raise ValueError(
                    f"{directory}'s learner state does not fit this model: "
                    f"{len(saved - here)} parameters saved that it lacks (such as "
                    f"{sorted(saved - here)[:2]}), {len(here - saved)} of its own not saved "
                    f"(such as {sorted(here - saved)[:2]}); saved for another model, or "
                    "another layout of its parameters (the vision blocks are stacked along "
                    "their first axis since 556a206, as the decoder layers were before)")
            out = ckpt.restore(path, target)
        self.params, self.opt_state = out["params"], out["opt_state"]
        shapes = storage.path(directory) / SHAPES_FILE
        self._shapes = json.loads(shapes.read_text()) if shapes.exists() else []

    # ---- the step ----------------------------------------------------------------------
    def train_step(self, batches: Sequence[PackedBatch], n_tokens: float, n_seqs: float
                   ) -> Deferred:
        """Accumulate over `batches` (this process's share), then one optimizer step.
        n_tokens / n_seqs: masked tokens / sequences of the global batch. Returns loss,
        grad_norm, lr, skipped, and token means of entropy, clip_frac, approx_kl, kl,
        tis_mean, logp_diff_mean, plus logp_diff_max and compiles (of this learner, so far);
        with routing replay, the free routing's (`free_routing_metrics`)."""
        return self.train_slices(self._slices(batches, n_tokens, n_seqs))

    def train_slices(self, slices: Sequence[dict]) -> Deferred:
        """One optimizer step on a step's slices (`geo3k_jax.core.buckets.step_slices`, this
        process's rows): each slice's gradient (compiled once per shape), their sum, then the
        update (compiled once). Returns at once, the step dispatched: the metrics (see
        `train_step`) are device scalars that reading waits for."""
        if not slices:
            raise ValueError("a step needs at least one slice (a process with no micro-batch "
                             "runs a filler: common.step.even_out)")
        self.onload()
        free = {}
        if self.routing is not None:  # before the step: the weights the rollout sampled from
            fn, shardings = self._compiled("free", slices[0])
            free = fn(self.params, self._global(slices[0], shardings))
        acc, sums = self._program("zeros")(), None  # the gradient accumulator (fp32, sharded)
        for sl in slices:
            grad_fn, shardings = self._compiled("grad", sl)
            acc, new = grad_fn(self.params, acc, self._global(sl, shardings), self.ref_params)
            sums = new if sums is None else _add_sums(sums, new)
        self.params, self.opt_state, metrics = self._program("apply")(
            self.params, self.opt_state, acc, sums)
        return Deferred(metrics, free, {"compiles": float(self.compiles)})

    def logprobs(self, batches: Sequence[PackedBatch]) -> list[np.ndarray]:
        """(T,) log-probs of each micro-batch's masked tokens at the current weights (0 off the
        mask): the behaviour policy when several updates share one rollout."""
        self.onload()
        slices = self._slices(batches, 1.0, 1.0)
        local = len(slices[0]["input_ids"])  # this process's rows per slice
        out = []
        for sl in slices:
            fn, shardings = self._compiled("logprobs", sl)
            rows = fn(self.params, self._global(sl, shardings))  # (R, T)
            if not rows.is_fully_addressable:  # this process's rows only
                from jax.experimental import multihost_utils
                rows = multihost_utils.global_array_to_host_local_array(
                    rows, self.mesh, P(BATCH_AXES))
            out.append(np.asarray(rows))
        return [out[i // local][i % local, :b.num_tokens] for i, b in enumerate(batches)]

    def _slices(self, batches, n_tokens: float, n_seqs: float) -> list[dict]:
        """This process's slices, their shapes and count agreed over processes."""
        if self.processor is None or self.config is None:
            raise ValueError("the JAX learner needs its processor and config for micro-batches")
        rows = [host_row(b, self.processor, self.config, agg=self.loss_cfg.agg,
                         n_tokens=n_tokens, n_seqs=n_seqs, routing=self.routing)
                for b in batches]
        row_len = self.row_len or self.cfg.micro_batch_tokens
        local = self.rows_per_slice // max(self.comm.world, 1) or 1
        sizes = agree(slice_sizes(rows, self.config, rows_per_slice=local, row_len=row_len,
                                  row_rungs=self.ladder.row_rungs),
                      self.comm)  # every process pads its slice i to the same shape
        shapes = []
        for need in sizes:  # the same on every process: the same history
            shape = fit(need, self.shape) if self.shape else reuse(need, self._shapes,
                                                                    self.ladder.reuse_slack)
            if shape not in self._shapes:
                self._shapes.append(shape)
            shapes.append(shape)
        return step_slices(rows, self.config, rows_per_slice=local, sizes=shapes,
                           routing=self.routing)

    def _global(self, sl: dict, shardings) -> dict:
        """A slice as the compiled functions take it: with a mesh, this process's rows become
        its part of global arrays."""
        return sl if shardings is None else jax.tree.map(_global_array, sl, shardings)

    def lower(self, sl: dict) -> dict[str, jax.stages.Lowered]:
        """The step's programs for slices shaped like `sl` (the global slice: arrays or
        ShapeDtypeStructs), lowered for the mesh's devices and not run: "grad" (one slice's
        gradient added into the donated accumulator) and "apply" (the update, which donates the
        parameters and optimizer state). All a learner of shapes alone can do:
        `geo3k_jax.aot` compiles them for a TPU slice on a host without one. An offloaded
        state (`offload`) is lowered as the programs take it, in device memory."""
        like = lambda x, sh=None: jax.ShapeDtypeStruct(  # noqa: E731
            x.shape, x.dtype, sharding=sh if sh is not None else getattr(x, "sharding", None))
        with self._on_device():  # the shapes and shardings of the state as the programs run
            params, opt_state = (jax.tree.map(like, t) for t in (self.params, self.opt_state))
            ref = None if self.ref_params is None else jax.tree.map(like, self.ref_params)
        grad_fn, shardings = self._compiled("grad", sl)
        sl = jax.tree.map(like, sl) if shardings is None else jax.tree.map(like, sl, shardings)
        acc = jax.eval_shape(self._program("zeros"))
        grad = grad_fn.lower(params, acc, sl, ref)
        sums = jax.eval_shape(grad_fn, params, acc, sl, ref)[1]
        return {"grad": grad, "apply": self._program("apply").lower(params, opt_state, acc, sums)}

    def _program(self, kind: str):
        """The jitted step-wide function `kind`: "zeros" (a fresh accumulator, fp32 zeros in
        the parameters' shardings) or "apply" (the update)."""
        if kind not in self._steps:
            sh = dict(out_shardings=self.home or self.param_sh)
            if kind == "zeros":
                fn = lambda: {k: jnp.zeros(v.shape, jnp.float32)  # noqa: E731
                              for k, v in self.params.items()}
                self._steps[kind] = jax.jit(fn, **sh)
            else:
                kw = {} if self.mesh is None else dict(
                    in_shardings=(self.param_sh, self.opt_sh, self.param_sh, None),
                    out_shardings=(self.param_sh, self.opt_sh, None))
                self._steps[kind] = jax.jit(self._apply, donate_argnums=(0, 1), **kw)
        return self._steps[kind]

    def _compiled(self, kind: str, sl: dict):
        """The jitted `kind` function ("grad", "logprobs" or "free": `_free`) for slices with
        these keys, and their shardings (fixed per key set; jit compiles once per shape)."""
        key = (kind,) + tuple(sorted(sl))
        if key not in self._steps:
            kw, sl_sh = {}, None
            if self.mesh is not None:
                sl_sh = batch_shardings(self.mesh, sl, processes=self.comm.world)
                ref_sh = None if self.ref_params is None else self.param_sh
                kw = dict(in_shardings=(self.param_sh, self.param_sh, sl_sh, ref_sh),
                          out_shardings=(self.param_sh, None)) if kind == "grad" else dict(
                    in_shardings=(self.param_sh, sl_sh))
            if kind == "grad":  # the accumulator's buffers become the output's
                kw["donate_argnums"] = (1,)
            fn = {"grad": self._slice_grad, "logprobs": self._logprobs, "free": self._free}[kind]
            self._steps[key] = (jax.jit(fn, **kw), sl_sh)
        return self._steps[key]

    def _logprobs(self, params, sl):
        self.compiles += 1  # runs while tracing only
        cast = params if self.compute_dtype is None else jax.tree.map(
            lambda a: a.astype(self.compute_dtype), params)
        return token_logprobs(self.merge(cast), sl, self.temperature, chunk=self.chunk)

    def _free(self, params, sl):
        """`free_routing_metrics` of a slice, its replayed routing left out of the forward."""
        self.compiles += 1
        cast = params if self.compute_dtype is None else jax.tree.map(
            lambda a: a.astype(self.compute_dtype), params)
        model = self.merge(cast)
        free = {k: v for k, v in sl.items() if k != "routing"}
        hidden, tops = model.hidden_states(free, record=True)
        logp = head_logprobs(model, hidden, free, self.temperature, chunk=self.chunk)
        return free_routing_metrics(logp, tops, sl)

    def _slice_grad(self, params, acc, sl, ref_params):
        """(acc + the slice's gradient, the slice's metric sums and loss): acc is donated, so
        its buffers hold the sum and the step keeps one fp32 gradient tree."""
        self.compiles += 1
        (loss, sums), grads = jax.value_and_grad(
            lambda p: grpo_loss(self.merge, p, sl, self.loss_cfg, self.temperature,
                                self.compute_dtype, ref_params, self.chunk, self.remat),
            has_aux=True)(params)
        acc = {k: acc[k] + grads[k].astype(jnp.float32) for k in acc}
        return acc, dict(sums, loss=loss)

    def _apply(self, params, opt_state, grads, sums):
        """Clip and AdamW unless the gradient norm is not finite; the step's metrics."""
        self.compiles += 1
        grad_norm = optax.tree.norm(grads)
        lr = current_lr(opt_state, self.cfg)

        def apply(state):
            p, o = state
            # the fp32 sum in the parameters' dtype: the optimizer state keeps theirs (bf16
            # parameters have bf16 moments, as without an accumulator)
            g = {k: v.astype(p[k].dtype) for k, v in grads.items()}
            updates, o = self.tx.update(g, o, p)
            return optax.apply_updates(p, updates), o

        params, opt_state = jax.lax.cond(jnp.isfinite(grad_norm), apply, lambda s: s,
                                         (params, opt_state))
        n = jnp.maximum(sums.pop("tokens"), 1.0)
        metrics = {k: (v if k in ("loss", "logp_diff_max") else v / n) for k, v in sums.items()}
        metrics.update(grad_norm=grad_norm, skipped=1.0 - jnp.isfinite(grad_norm), lr=lr)
        return params, opt_state, metrics


@jax.jit
def _add_sums(total: dict, new: dict) -> dict:
    """The metric sums of two slices added (the largest logp_diff_max kept)."""
    return {k: jnp.maximum(v, new[k]) if k == "logp_diff_max" else v + new[k]
            for k, v in total.items()}


def _abstract(params: dict) -> bool:
    """Whether `params` are shapes (ShapeDtypeStructs) rather than arrays."""
    return any(isinstance(v, jax.ShapeDtypeStruct) for v in jax.tree.leaves(params))


class _OrbaxInfo(logging.Filter):
    """Drops orbax's INFO records: it logs every file it writes, from its background threads
    too, so that a run's log would be mostly orbax."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno > logging.INFO or "orbax" not in record.pathname


def _state_dir(directory):
    """Where orbax keeps the learner state in a checkpoint directory (local, made absolute as
    orbax wants it, or an object-store URL: `common.storage`)."""
    if storage.is_remote(directory):
        return storage.path(directory) / STATE_DIR
    return Path(directory).absolute() / STATE_DIR


def _quiet_orbax() -> None:
    """Install `_OrbaxInfo` on absl's logger (which orbax logs through), once."""
    absl = logging.getLogger("absl")
    if not any(isinstance(f, _OrbaxInfo) for f in absl.filters):
        absl.addFilter(_OrbaxInfo())


def _global_array(local: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array from this process's part of it (rows of every process, in process
    order, along the sharded axis; replicated arrays are the same everywhere)."""
    local = np.asarray(local)
    spec = tuple(sharding.spec) + (None,) * (local.ndim - len(sharding.spec))
    shape = tuple(d * jax.process_count() if s is not None else d
                  for d, s in zip(local.shape, spec))
    return jax.make_array_from_process_local_data(sharding, local, shape)
