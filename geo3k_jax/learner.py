"""The GRPO learner in JAX: one jitted, sharded optimizer step on a `geo3k_jax.batch` batch.

    log-probs of every row (fp32, from logits / temperature)  -> per-token loss (common.grpo,
    xp=jax.numpy) -> sum(weight_t * loss_t) -> grad -> clip global norm -> AdamW (optax) with the
    schedule of common.schedule -> keep the old state if the gradient norm is not finite

It mirrors `geo3k_torch.learner`: the same loss function, weights, schedule, clipping and skip
rule, one optimizer step per rollout, "old" log-probs = the current ones without gradient. The
rows of one step are the torch learner's micro-batches; GSPMD computes their global gradient
(no accumulation loop, no world-size factor). Parameters are a flat {checkpoint key: array}
dict (`geo3k_jax.model.split_params`), the optimizer state mirrors it.

Mixed precision (`compute_dtype=bfloat16`): fp32 parameters and optimizer state, the forward
and backward in bf16 (parameters cast inside the loss), log-probs and the loss in fp32 — the JAX
counterpart of torch autocast.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from common.grpo import LossConfig, per_token_terms
from common.schedule import lr_table
from geo3k_jax.batch import ROW_KEYS
from geo3k_jax.model import token_logprobs
from geo3k_jax.sharding import batch_shardings, param_shardings


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
              temperature: float, compute_dtype=None, ref_params: dict | None = None):
    """(loss, metric sums) of a batch under `params` (see `loss_from_logprobs`)."""
    cast = (lambda p: p) if compute_dtype is None else (  # noqa: E731
        lambda p: jax.tree.map(lambda a: a.astype(compute_dtype), p))
    logp, entropy = token_logprobs(merge(cast(params)), batch, temperature, with_entropy=True)
    ref = None
    if loss_cfg.kl_coef:
        if ref_params is None:
            raise ValueError("kl_coef > 0 needs reference parameters")
        ref = jax.lax.stop_gradient(token_logprobs(merge(cast(ref_params)), batch, temperature))
    loss, sums = loss_from_logprobs(logp, jax.lax.stop_gradient(logp), batch, loss_cfg, ref)
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
    """Owns the optimizer and the jitted step. `merge` and `params` come from
    `geo3k_jax.model.split_params`; with a `mesh`, parameters are placed by `rules` and the
    step is compiled with explicit in/out shardings and donates the parameter and optimizer
    buffers it replaces (its own copies: the caller's `params` stay valid)."""

    def __init__(self, merge: Callable, params: dict, loss_cfg: LossConfig, train_cfg,
                 temperature: float, *, mesh=None, rules=(), compute_dtype=None,
                 ref_params: dict | None = None):
        if loss_cfg.kl_coef and ref_params is None:
            raise ValueError("kl_coef > 0 needs reference parameters")
        self.merge, self.loss_cfg, self.cfg = merge, loss_cfg, train_cfg
        self.temperature, self.compute_dtype, self.mesh = temperature, compute_dtype, mesh
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

    def _place(self, params: dict) -> dict:
        """A copy of `params` in the learner's shardings (the caller's arrays are never donated)."""
        if self.mesh is None:
            return jax.tree.map(jnp.copy, params)
        return jax.device_put(params, self.param_sh, may_alias=False)

    def reset(self, params: dict) -> None:
        """Start from `params` (copied into place) with a fresh optimizer state."""
        self.params = self._place(params)
        self.opt_state = jax.jit(self.tx.init, out_shardings=self.opt_sh)(self.params)

    def _compiled(self, batch: dict):
        """The jitted step for this batch's key set (shardings are fixed per key set)."""
        key = tuple(sorted(batch))
        if key not in self._steps:
            kw = {}
            if self.mesh is not None:
                ref_sh = None if self.ref_params is None else self.param_sh
                kw = dict(in_shardings=(self.param_sh, self.opt_sh, batch_shardings(
                    self.mesh, batch, ROW_KEYS), ref_sh),
                          out_shardings=(self.param_sh, self.opt_sh, None))
            self._steps[key] = jax.jit(self._step, donate_argnums=(0, 1), **kw)
        return self._steps[key]

    def _step(self, params, opt_state, batch, ref_params):
        grad_fn = jax.value_and_grad(grpo_loss, argnums=1, has_aux=True)
        (loss, sums), grads = grad_fn(self.merge, params, batch, self.loss_cfg,
                                      self.temperature, self.compute_dtype, ref_params)
        grad_norm = optax.tree.norm(grads)
        ok = jnp.isfinite(grad_norm)
        updates, new_opt = self.tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)  # noqa
        n = jnp.maximum(sums.pop("tokens"), 1.0)
        metrics = {k: (v if k == "logp_diff_max" else v / n) for k, v in sums.items()}
        metrics.update(loss=loss, grad_norm=grad_norm, skipped=1.0 - ok,
                       lr=current_lr(opt_state, self.cfg))
        return keep(new_params, params), keep(new_opt, opt_state), metrics

    def train_step(self, batch: dict) -> dict:
        """One optimizer step on `batch` (numpy arrays from `geo3k_jax.batch.device_batch`).
        Returns float metrics: loss, grad_norm, lr, skipped, entropy, clip_frac, approx_kl,
        logp_diff_mean, logp_diff_max, and kl / tis_mean when those options are on."""
        step = self._compiled(batch)
        self.params, self.opt_state, metrics = step(self.params, self.opt_state, batch,
                                                    self.ref_params)
        return {k: float(v) for k, v in metrics.items()}
