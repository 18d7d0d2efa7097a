"""The GRPO learner in JAX: `common.learner.Learner` as one compiled, sharded step.

    for each slice of micro-batches (a loop inside the compiled step):
        log-probs of the trained tokens (fp32, from logits / temperature, in chunks)
        -> per-token loss (common.grpo, xp=jax.numpy) -> sum(weight_t * loss_t) -> grad, summed
    clip the global norm -> AdamW (optax) with the schedule of common.schedule, unless the
    gradient norm is not finite (then nothing changes: a `lax.cond`, no second copy of state)

It mirrors `geo3k_torch.learner`: the same loss function, weights, schedule, clipping and skip
rule, one optimizer step per rollout, "old" log-probs = the current ones without gradient.
Inputs have fixed, bucketed shapes (`geo3k_jax.buckets`), so a run compiles a handful of times
(counted in `compiles`). Parameters are a flat {checkpoint key: array} dict
(`geo3k_jax.model.split_params`), the optimizer state mirrors it, both placed by the mesh's
partition rules; a slice's rows are split over the data-parallel axes.

Mixed precision (`compute_dtype=bfloat16`): fp32 parameters and optimizer state, the forward
and backward in bf16 (parameters cast inside the loss), the LM head accumulated in fp32,
log-probs and the loss in fp32 — the JAX counterpart of torch autocast.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging as absl_logging
from jax.sharding import NamedSharding, PartitionSpec as P

from common.batching import PackedBatch
from common.grpo import LossConfig, per_token_terms
from common.learner import Collectives, SingleProcess
from common.schedule import lr_table
from geo3k_jax.batch import host_row
from geo3k_jax.buckets import step_arrays, step_sizes
from geo3k_jax.model import token_logprobs
from geo3k_jax.sharding import BATCH_AXES, batch_shardings, param_shardings

STATE_DIR = "jax_state"  # the orbax learner state inside a checkpoint directory


def make_optimizer(train_cfg) -> optax.GradientTransformation:
    """Clip by global norm, then AdamW whose learning rate at step s is
    `lr * common.schedule.lr_factor(s)` (tabulated; the count advances only on applied steps)."""
    table = jnp.asarray(lr_table(train_cfg.lr, train_cfg.lr_schedule, train_cfg.warmup_steps,
                                 train_cfg.steps, train_cfg.min_lr_ratio))
    schedule = lambda count: table[jnp.minimum(count, table.shape[0] - 1)]  # noqa: E731
    return optax.chain(
        optax.clip_by_global_norm(train_cfg.grad_clip),
        optax.adamw(schedule, b1=train_cfg.beta1, b2=train_cfg.beta2, eps=train_cfg.eps,
                    weight_decay=train_cfg.weight_decay))


def current_lr(tx_state, train_cfg) -> jax.Array:
    """The learning rate the next applied step uses."""
    is_schedule = lambda s: isinstance(s, optax.ScaleByScheduleState)  # noqa: E731
    count, = [s.count for s in jax.tree.leaves(tx_state, is_leaf=is_schedule) if is_schedule(s)]
    table = jnp.asarray(lr_table(train_cfg.lr, train_cfg.lr_schedule, train_cfg.warmup_steps,
                                 train_cfg.steps, train_cfg.min_lr_ratio))
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
    old = batch["old_logprobs"] if "old_logprobs" in batch else jax.lax.stop_gradient(logp)
    loss, sums = loss_from_logprobs(logp, old, batch, loss_cfg, ref)
    sums["entropy"] = jnp.sum(entropy * batch["loss_mask"])
    return loss, sums


def loss_from_logprobs(logp, old_logp, batch: dict, loss_cfg: LossConfig, ref_logp=None):
    """sum(weights * per-token loss) and metric sums over the masked tokens: tokens, clip_frac,
    approx_kl, kl, tis_mean, logp_diff_mean; plus logp_diff_max. logp, old_logp, ref_logp and
    the batch's row arrays: (B, T)."""
    mask, rollout = batch["loss_mask"], batch["rollout_logprobs"]
    terms = per_token_terms(logp, old_logp, batch["advantages"], loss_cfg, ref_logp=ref_logp,
                            rollout_logp=rollout, xp=jnp)
    loss = jnp.sum(terms["loss"] * batch["weights"])
    diff = jnp.abs(jax.lax.stop_gradient(logp) - rollout) * mask
    sums = {"tokens": jnp.sum(mask), "clip_frac": jnp.sum(terms["clipped"] * mask),
            "approx_kl": jnp.sum(terms["approx_kl"] * mask),
            "logp_diff_mean": jnp.sum(diff), "logp_diff_max": jnp.max(diff)}
    for name, key in (("kl", "kl"), ("tis", "tis_mean")):
        if name in terms:
            sums[key] = jnp.sum(terms[name] * mask)
    return loss, sums


class Learner:
    """`common.learner.Learner` in JAX. `merge` and `params` come from
    `geo3k_jax.model.split_params`; `processor` and `config` (the transformers config) turn
    micro-batches into arrays; rows of `row_len` tokens (default: the micro-batch budget).

    With a `mesh`, parameters are placed by `rules`, a slice is as many rows as the mesh's
    data-parallel size, and the step donates the parameter and optimizer buffers it replaces
    (its own copies: the caller's `params` stay valid). `chunk`: log-probs computed that many
    trained tokens of a row at a time (0: all at once); `remat`: decoder layers recomputed in
    the backward pass; `rows_per_slice` overrides the slice size (a multiple of the data axes).
    """

    def __init__(self, merge: Callable, params: dict, loss_cfg: LossConfig, train_cfg,
                 temperature: float, *, processor=None, config=None, mesh=None, rules=(),
                 compute_dtype=None, ref_params: dict | None = None, chunk: int = 0,
                 remat: bool = False, rows_per_slice: int | None = None,
                 row_len: int | None = None, comm: Collectives = SingleProcess(),
                 model_dir: str | None = None):
        if loss_cfg.kl_coef and ref_params is None:
            raise ValueError("kl_coef > 0 needs reference parameters")
        self.merge, self.loss_cfg, self.cfg = merge, loss_cfg, train_cfg
        self.temperature, self.compute_dtype, self.mesh = temperature, compute_dtype, mesh
        self.processor, self.config, self.comm, self.model_dir = processor, config, comm, model_dir
        self.chunk, self.remat = chunk, remat
        data = 1 if mesh is None else int(np.prod([mesh.shape[a] for a in BATCH_AXES]))
        self.rows_per_slice = rows_per_slice or data
        if self.rows_per_slice % data:
            raise ValueError(f"rows_per_slice={self.rows_per_slice} must be a multiple of the "
                             f"mesh's data-parallel size {data}")
        self.row_len = row_len
        self.compiles = 0  # traces of the step: each is one compilation (or a cache load)
        self.tx = make_optimizer(train_cfg)
        self.param_sh = None if mesh is None else param_shardings(params, mesh, rules)
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
        """A copy of `params` in the learner's shardings (the caller's arrays are never donated)."""
        if self.mesh is None:
            return jax.tree.map(jnp.copy, params)
        return jax.device_put(params, self.param_sh, may_alias=False)

    def reset(self, params: dict) -> None:
        """Start from `params` (copied into place) with a fresh optimizer state."""
        self.params = self._place(params)
        self.opt_state = jax.jit(self.tx.init, out_shardings=self.opt_sh)(self.params)

    def export_hf(self, out_dir: Path) -> None:
        from geo3k_jax.weights import save_hf

        if self.config is None or self.model_dir is None:
            raise ValueError("exporting a Hugging Face directory needs the learner's config "
                             "and model_dir (the source of its tokenizer and processor files)")
        save_hf(self.merge(self.params), self.config, out_dir, source_dir=self.model_dir)

    def save(self, directory: Path) -> None:
        import orbax.checkpoint as ocp

        with _quiet(), ocp.StandardCheckpointer() as ckpt:
            ckpt.save(Path(directory).absolute() / STATE_DIR,
                      {"params": self.params, "opt_state": self.opt_state})

    def restore(self, directory: Path) -> None:
        """Parameters and optimizer state from `directory`, each array typed and sharded like
        the live one (the saving mesh may differ): resuming continues bit for bit."""
        import orbax.checkpoint as ocp

        path = Path(directory).absolute() / STATE_DIR
        if not path.exists():
            raise FileNotFoundError(f"{directory} has no {STATE_DIR}: not a JAX learner "
                                    "checkpoint")
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct,
                              {"params": self.params, "opt_state": self.opt_state})
        with _quiet(), ocp.StandardCheckpointer() as ckpt:
            out = ckpt.restore(path, target)
        self.params, self.opt_state = out["params"], out["opt_state"]

    # ---- the step ----------------------------------------------------------------------
    def train_step(self, batches: Sequence[PackedBatch], n_tokens: float, n_seqs: float
                   ) -> dict[str, float]:
        """Accumulate over `batches` (this process's share), then one optimizer step.
        n_tokens / n_seqs: masked tokens / sequences of the global batch. Returns loss,
        grad_norm, lr, skipped, and token means of entropy, clip_frac, approx_kl, kl,
        tis_mean, logp_diff_mean, plus logp_diff_max and compiles (of the step, this run)."""
        return self.train_arrays(self._step_arrays(batches, n_tokens, n_seqs)[0])

    def logprobs(self, batches: Sequence[PackedBatch]) -> list[np.ndarray]:
        """(T,) log-probs of each micro-batch's masked tokens at the current weights (0 off the
        mask): the behaviour policy when several updates share one rollout."""
        step, local = self._step_arrays(batches, 1.0, 1.0)
        key = ("logprobs",) + tuple(sorted(step))
        if key not in self._steps:
            self._steps[key] = jax.jit(self._logprobs)
        step_sh = None if self.mesh is None else batch_shardings(
            self.mesh, step, row_axis=1, processes=self.comm.world)
        if step_sh is not None:
            step = jax.tree.map(_global_array, step, step_sh)
        out = self._steps[key](self.params, step)  # (S, R, T)
        if not out.is_fully_addressable:  # this process's rows only
            from jax.experimental import multihost_utils
            out = multihost_utils.global_array_to_host_local_array(
                out, self.mesh, P(None, BATCH_AXES))
        out = np.asarray(out)
        return [out[i // local, i % local, :b.num_tokens] for i, b in enumerate(batches)]

    def _step_arrays(self, batches, n_tokens: float, n_seqs: float) -> tuple[dict, int]:
        """(this process's step arrays, its rows per slice), shapes agreed over processes."""
        if self.processor is None or self.config is None:
            raise ValueError("the JAX learner needs its processor and config for micro-batches")
        rows = [host_row(b, self.processor, self.config, agg=self.loss_cfg.agg,
                         n_tokens=n_tokens, n_seqs=n_seqs) for b in batches]
        row_len = self.row_len or self.cfg.micro_batch_tokens
        local = self.rows_per_slice // max(self.comm.world, 1) or 1
        sizes = step_sizes(rows, self.config, rows_per_slice=local, row_len=row_len)
        sizes = {k: int(v) for k, v in self.comm.sum_scalars(
            sizes, max_keys=tuple(sizes)).items()}  # every process pads to the same shapes
        return step_arrays(rows, self.config, rows_per_slice=local, row_len=row_len,
                           sizes=sizes), local

    def _logprobs(self, params, step):
        cast = params if self.compute_dtype is None else jax.tree.map(
            lambda a: a.astype(self.compute_dtype), params)
        model = self.merge(cast)
        arrays = {k: v for k, v in step.items() if k not in ("n_slices", "key_offsets")}
        return jax.lax.map(lambda sl: token_logprobs(
            model, dict(sl, key_offsets=step["key_offsets"]), self.temperature,
            chunk=self.chunk), arrays)

    def train_arrays(self, step: dict) -> dict[str, float]:
        """One optimizer step on a step's arrays (`geo3k_jax.buckets.step_arrays`, this
        process's rows); returns float metrics (see `train_step`)."""
        fn, shardings = self._compiled(step)
        if shardings is not None:  # this process's rows become slices of global arrays
            step = jax.tree.map(_global_array, step, shardings)
        self.params, self.opt_state, metrics = fn(self.params, self.opt_state, step,
                                                  self.ref_params)
        return {k: float(v) for k, v in metrics.items()} | {"compiles": float(self.compiles)}

    def _compiled(self, step: dict):
        """The jitted step for this step's key set (shardings are fixed per key set)."""
        key = tuple(sorted(step))
        if key not in self._steps:
            kw, step_sh = {}, None
            if self.mesh is not None:
                step_sh = batch_shardings(self.mesh, step, row_axis=1,
                                          processes=self.comm.world)
                ref_sh = None if self.ref_params is None else self.param_sh
                kw = dict(in_shardings=(self.param_sh, self.opt_sh, step_sh, ref_sh),
                          out_shardings=(self.param_sh, self.opt_sh, None))
            self._steps[key] = (jax.jit(self._step, donate_argnums=(0, 1), **kw), step_sh)
        return self._steps[key]

    def _slice_loss(self, params, batch, ref_params):
        return grpo_loss(self.merge, params, batch, self.loss_cfg, self.temperature,
                         self.compute_dtype, ref_params, self.chunk, self.remat)

    def _step(self, params, opt_state, step, ref_params):
        self.compiles += 1  # runs while tracing only
        n_slices = step["n_slices"]
        arrays = {k: v for k, v in step.items() if k not in ("n_slices", "key_offsets")}
        take = lambda i: dict(jax.tree.map(lambda a: a[i], arrays),  # noqa: E731
                              key_offsets=step["key_offsets"])
        grad_fn = jax.value_and_grad(self._slice_loss, has_aux=True)

        def body(i, carry):  # one slice: add its gradient and metric sums
            grads, sums = carry
            (loss, s), g = grad_fn(params, take(i), ref_params)
            s = dict(s, loss=loss)
            sums = {k: jnp.maximum(sums[k], v) if k == "logp_diff_max" else sums[k] + v
                    for k, v in s.items()}
            return jax.tree.map(jnp.add, grads, g), sums

        shapes = jax.eval_shape(lambda: grad_fn(params, take(0), ref_params)[0][1])
        sums0 = {k: jnp.zeros((), jnp.float32) for k in (*shapes, "loss")}
        grads0 = jax.tree.map(jnp.zeros_like, params)
        if self.param_sh is not None:
            grads0 = jax.lax.with_sharding_constraint(grads0, self.param_sh)
        grads, sums = jax.lax.fori_loop(0, n_slices, body, (grads0, sums0))

        grad_norm = optax.tree.norm(grads)
        lr = current_lr(opt_state, self.cfg)

        def apply(state):
            p, o = state
            updates, o = self.tx.update(grads, o, p)
            return optax.apply_updates(p, updates), o

        params, opt_state = jax.lax.cond(jnp.isfinite(grad_norm), apply, lambda s: s,
                                         (params, opt_state))
        n = jnp.maximum(sums.pop("tokens"), 1.0)
        metrics = {k: (v if k in ("loss", "logp_diff_max") else v / n) for k, v in sums.items()}
        metrics.update(grad_norm=grad_norm, skipped=1.0 - jnp.isfinite(grad_norm), lr=lr)
        return params, opt_state, metrics


@contextlib.contextmanager
def _quiet():
    """Orbax logs every file it writes at INFO: keep the run's log readable."""
    level = absl_logging.get_verbosity()
    absl_logging.set_verbosity(absl_logging.WARNING)
    try:
        yield
    finally:
        absl_logging.set_verbosity(level)


def _global_array(local: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array from this process's part of it (rows of every process, in process
    order, along the sharded axis; replicated arrays are the same everywhere)."""
    local = np.asarray(local)
    spec = tuple(sharding.spec) + (None,) * (local.ndim - len(sharding.spec))
    shape = tuple(d * jax.process_count() if s is not None else d
                  for d, s in zip(local.shape, spec))
    return jax.make_array_from_process_local_data(sharding, local, shape)
