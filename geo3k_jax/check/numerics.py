"""The cross-backend numerics check: torch (transformers) and JAX on the same weights and batch.

    rows = run_check(cfg, model_dir)     # list of Row; print_table(rows); all(r.passed ...)

Both backends load the same checkpoint directory, get the same packed micro-batches of real
multi-turn trajectories (`geo3k_jax.check.check_batch`), and compute: logits of every token,
per-token log-probs of the trained tokens, the GRPO loss, its gradient (global norm; the worst
parameter's relative error), and the parameters after one AdamW step. Torch runs its learner
(`geo3k_torch.learner.Learner`, gradient accumulation over the micro-batches); JAX runs its own
(`geo3k_jax.learner.learner.Learner`, all rows in one sharded step).

Errors: `abs` is max |jax - torch|; `rel` is max |jax - torch| / max |torch| (for gradients: the
largest, over parameters, of ||g_jax - g_torch||_2 / ||g_torch||_2). Each quantity passes on
the measure its tolerance names. The float32 tolerances are the goal we hold the JAX models to
(log-probs 1e-5 absolute); the bfloat16 ones cover bf16 rounding of two different kernel orders
(8 mantissa bits: ~4e-3 relative per rounding, compounded over the layers) — see
docs/benchmarks.md for measured values.

Two float32 evaluations of one function each round their own way: where the checkpoint is small
enough (`jax.check.float64_reference`), both sides' log-probs are also measured against the
same transformers model run in float64 (`float64_logprobs`), the function both approximate. JAX
must be within the log-prob tolerance of it; torch's distance is shown beside it. When torch and
JAX then differ by more than the tolerance while JAX is nearer the float64 values than torch is,
the difference is torch's float32 rounding and the log-prob row passes, saying so. Likewise the
weights after one AdamW step pass above their bound when no weight differs by more than float32
rounding beyond what the two sides' gradient difference explains (`step_beyond_gradients`).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from common.grpo import LossConfig
from common.schedule import horizon, lr_table
from configs import to_dataclass
from geo3k_jax.core.batch import device_batch
from geo3k_jax.check.check_batch import batches_from_config
from geo3k_jax.models.layers import remat_of
from geo3k_jax.learner.learner import Learner as JaxLearner, grpo_loss, make_optimizer
from geo3k_jax.models.model import split_params, token_logprobs
from geo3k_jax.core.sharding import BATCH_AXES, make_mesh
from geo3k_jax.core.stacking import to_hf
from geo3k_jax.models.weights import load_model as load_jax_model

# quantity -> (measure, tolerance) per dtype
TOLERANCES = {
    "float32": {"logits": ("rel", 1e-5), "log-probs": ("abs", 1e-5), "loss": ("abs", 1e-6),
                "grad global norm": ("rel", 1e-5), "grad worst param": ("rel", 1e-4),
                "params after AdamW": ("abs", "0.1 lr"), "AdamW on torch's grads": ("abs", 1e-6)},
    "bfloat16": {"logits": ("rel", 5e-2), "log-probs": ("abs", 0.25), "loss": ("abs", 2e-2),
                 "grad global norm": ("rel", 2e-2), "grad worst param": ("rel", 0.15),
                 "params after AdamW": ("abs", "bf16 ulp"),
                 "AdamW on torch's grads": ("abs", "bf16 ulp")},
}


@dataclasses.dataclass
class Row:
    """One quantity's errors and its tolerance (tol = inf: shown, never failing). explained:
    why an error above tol still passes, measured (`blame_torch_rounding`,
    `blame_gradient_noise`); "" where nothing explains it."""
    quantity: str
    abs_err: float
    rel_err: float
    measure: str
    tol: float
    explained: str = ""

    @property
    def within(self) -> bool:
        err = self.abs_err if self.measure == "abs" else self.rel_err
        return bool(np.isfinite(err) and err <= self.tol)

    @property
    def passed(self) -> bool:
        return self.within or bool(self.explained)

    @property
    def result(self) -> str:
        return "pass" if self.within else f"pass ({self.explained})" if self.explained else "FAIL"


def _errors(jx, th) -> tuple[float, float]:
    a, b = np.asarray(jx, np.float64), np.asarray(th, np.float64)
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch: jax {a.shape} vs torch {b.shape}")
    err = float(np.max(np.abs(a - b))) if a.size else 0.0
    return err, err / max(float(np.max(np.abs(b))) if b.size else 0.0, 1e-30)


def _grad_errors(jx: dict, th: dict) -> tuple[float, float, float, float, str]:
    """(max abs, global-norm abs and rel error, worst per-parameter rel error, its name)."""
    worst, name, max_abs = 0.0, "", 0.0
    for k, g in th.items():
        d = np.asarray(jx[k], np.float64) - g
        max_abs = max(max_abs, float(np.abs(d).max()))
        rel = float(np.linalg.norm(d) / max(np.linalg.norm(g), 1e-30))
        if rel > worst:
            worst, name = rel, k
    norm = lambda t: np.sqrt(sum(float(np.sum(np.square(np.asarray(v, np.float64))))  # noqa
                                 for v in t.values()))
    diff = abs(norm(jx) - norm(th))
    return max_abs, diff, diff / max(norm(th), 1e-30), worst, name


def torch_side(model_dir, processor, batches, n_tokens, n_seqs, loss_cfg, train_cfg,
               temperature, dtype: str) -> dict:
    """Torch's logits per row, log-probs per row (masked positions), loss, grads, params after."""
    import torch

    from geo3k_torch.learner import Learner
    from geo3k_torch.model import load_model, packed_inputs, token_logprobs as t_logprobs

    model = load_model(model_dir, dtype=getattr(torch, dtype))
    learner = Learner(model, processor, loss_cfg, train_cfg, temperature, "cpu")
    out = {"logits": [], "logp": []}
    with torch.no_grad():
        for b in batches:
            inputs = packed_inputs(b, processor, model.config)
            out["logits"].append(model(**inputs, use_cache=False).logits[0].float().numpy())
            targets = torch.from_numpy(np.flatnonzero(b.loss_mask))
            out["logp"].append(t_logprobs(model, inputs, targets, temperature).float().numpy())
    out["loss"] = float(learner.accumulate(batches, n_tokens, n_seqs)["loss"])
    out["grads"] = {k: p.grad.float().numpy().copy() for k, p in model.named_parameters()}
    out["params_before"] = {k: p.detach().float().numpy().copy()
                            for k, p in model.named_parameters()}
    start = time.perf_counter()
    learner.train_step(batches, n_tokens, n_seqs)
    out["step_s"] = time.perf_counter() - start
    out["params"] = {k: p.detach().float().numpy() for k, p in model.named_parameters()}
    return out


def _rmsnorm_as_written(module, hidden_states):
    """transformers' Qwen RMSNorm in its input's dtype (transformers' casts to float32 first)."""
    import torch

    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return module.weight * (hidden_states * torch.rsqrt(variance + module.variance_epsilon))


def norms_as_written(model) -> int:
    """Every RMSNorm of `model` computes in its input's dtype, by transformers' own formula
    (checked on a float32 probe first: another formula is an error, not a silent change).
    Returns how many were replaced."""
    import copy
    import types

    import torch

    gen, n = torch.Generator().manual_seed(0), 0
    for m in model.modules():
        if not type(m).__name__.endswith("RMSNorm"):
            continue
        with torch.no_grad():
            m32 = copy.deepcopy(m).float()
            probe = torch.randn(3, m32.weight.shape[-1], generator=gen)
            same = (hasattr(m32, "variance_epsilon") and
                    torch.allclose(m32(probe), _rmsnorm_as_written(m32, probe), atol=1e-6))
        if not same:
            raise NotImplementedError(f"{type(m).__name__} is not weight * x * rsqrt(mean(x^2) + "
                                      "eps): no float64 reference for it")
        m.forward = types.MethodType(_rmsnorm_as_written, m)
        n += 1
    return n


def float64_logprobs(model_dir, processor, batches, temperature) -> list[np.ndarray]:
    """Per packed row, the (K,) log-probs of its trained tokens from the transformers model in
    float64. Every RMSNorm computes in float64 (transformers' casts its input to float32; the
    formula is checked against transformers' own in float32 first), a MoE's experts by
    transformers' eager loop; the rotary angles and the router's softmax stay float32, as
    transformers defines them."""
    import torch

    from geo3k_torch.model import load_model, packed_inputs

    model = load_model(model_dir, dtype=torch.float64).eval()
    if getattr(model.config.get_text_config(), "num_experts", 0):
        model.set_experts_implementation("eager")  # torch's grouped matmul has no float64
    norms_as_written(model)
    out = []
    with torch.no_grad():
        for b in batches:
            inputs = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                      for k, v in packed_inputs(b, processor, model.config).items()}
            logits = model(**inputs, use_cache=False).logits[0]
            logp = torch.log_softmax(logits / temperature, dim=-1)
            targets = torch.from_numpy(np.flatnonzero(b.loss_mask))
            ids = inputs["input_ids"][0, targets]
            out.append(logp[targets - 1].gather(-1, ids[:, None])[:, 0].numpy())
    return out


def wants_float64_reference(cfg, model_dir) -> bool:
    """`jax.check.float64_reference`: on, off, or auto (float32 checks of checkpoints whose
    safetensors hold at most 1 GiB: a float64 copy on the host is twice that)."""
    mode = cfg.jax.check.float64_reference
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"jax.check.float64_reference must be auto, on or off, got {mode!r}")
    if mode != "auto":
        return mode == "on"
    size = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))
    return cfg.jax.check.dtype == "float32" and 0 < size <= 2 ** 30


def jax_side(model_dir, processor, batches, n_tokens, n_seqs, loss_cfg, train_cfg, temperature,
             dtype: str, jcfg) -> dict:
    """The same quantities from the JAX model and learner, on `jcfg.mesh`, computed as the
    config trains: `jcfg.compute_dtype` (bf16 compute over `dtype` parameters), `jcfg.remat`
    and `jcfg.attention` (splash off a TPU runs in Pallas' interpret mode)."""
    from geo3k_jax.kernels.splash import resolve_attention
    from geo3k_jax.learner.learner import DTYPES

    mesh = make_mesh(dict(jcfg.mesh))
    attention = resolve_attention(jcfg.attention, jax.devices()[0].platform, mesh)
    compute, remat = DTYPES[jcfg.compute_dtype], remat_of(jcfg)
    model, config = load_jax_model(model_dir, dtype=getattr(jnp, dtype), mesh=mesh,
                                   rules=jcfg.rules, attention=attention)
    merge, params = split_params(model)
    rows = int(np.prod([mesh.shape[a] for a in BATCH_AXES]))
    batch = device_batch(batches, processor, config, agg=loss_cfg.agg, n_tokens=n_tokens,
                         n_seqs=n_seqs, pad_to=jcfg.pad_to, rows_multiple=rows)
    cast = (lambda p: p) if compute is None else (  # noqa: E731
        lambda p: jax.tree.map(lambda a: a.astype(compute), p))
    with jax.set_mesh(mesh):
        logits = jax.jit(lambda p, b: merge(cast(p)).logits(merge(cast(p)).hidden_states(b)))(
            params, batch)
        logp = jax.jit(lambda p, b: token_logprobs(merge(cast(p)), b, temperature))(
            params, batch)
        grad_fn = jax.jit(jax.value_and_grad(
            lambda p, b: grpo_loss(merge, p, b, loss_cfg, temperature, compute_dtype=compute,
                                   remat=remat), has_aux=True))
        (loss, _), grads = grad_fn(params, batch)
        learner = JaxLearner(merge, params, loss_cfg, train_cfg, temperature, mesh=mesh,
                             rules=jcfg.rules, processor=processor, config=config,
                             row_len=batch["input_ids"].shape[1], chunk=train_cfg.logprob_chunk,
                             compute_dtype=compute, remat=remat)
        start = time.perf_counter()
        learner.train_step(batches, n_tokens, n_seqs)
        compile_and_step = time.perf_counter() - start
        learner.reset(params)  # time a second, already compiled step from the same start
        start = time.perf_counter()
        learner.train_step(batches, n_tokens, n_seqs)
        step_s = time.perf_counter() - start
    f32 = lambda t: {k: np.asarray(v, np.float32) for k, v in t.items()}  # noqa: E731
    logits, logp = np.asarray(logits, np.float32), np.asarray(logp)
    out = {"logits": [logits[r, :b.num_tokens] for r, b in enumerate(batches)],
           "logp": [logp[r, np.flatnonzero(b.loss_mask)] for r, b in enumerate(batches)],
           "loss": float(loss), "grads": f32(to_hf(grads)), "params": f32(to_hf(learner.params)),
           "step_s": step_s, "compile_s": compile_and_step - step_s,
           "computation": f"{jcfg.compute_dtype} compute, {attention.kind} attention"
                          f"{' (interpret)' if attention.interpret else ''}"
                          f"{', remat' if remat else ''}"}
    return out


def blame_torch_rounding(pairwise: Row, of_jax: Row, of_torch: Row) -> None:
    """The torch-vs-JAX log-prob row passes above its bound when JAX is within the bound of the
    float64 reference and nearer it than torch is: the difference is torch's rounding."""
    if of_jax.within and of_jax.abs_err <= of_torch.abs_err:
        pairwise.explained = "torch's float32 rounding"


def step_beyond_gradients(jx_after: dict, th_after: dict, jx_grads: dict, th_grads: dict,
                          lr: float, eps: float) -> float:
    """The largest difference between the two sides' weights after a first AdamW step from the
    same weights, beyond what their gradients' difference explains. Step 1 moves a weight by
    lr * (u(g) + weight decay), u(g) = g / (|g| + eps) (bias-corrected moments: m = g, v = g^2;
    a global-norm clip scales g by c <= 1, which only raises eps to eps / c), and
    |u(g) - u(g')| <= |g - g'| / (min(|g|, |g'|) + eps): near-zero gradients' float32 noise
    moves weights by a large share of lr, a gradient above the noise by almost nothing."""
    worst = -np.inf
    for k, p in th_after.items():
        g, h = np.asarray(th_grads[k], np.float64), np.asarray(jx_grads[k], np.float64)
        explained = lr * np.abs(g - h) / (np.minimum(np.abs(g), np.abs(h)) + eps)
        moved = np.abs(np.asarray(jx_after[k], np.float64) - np.asarray(p, np.float64))
        worst = max(worst, float(np.max(moved - explained)))
    return worst


def blame_gradient_noise(row: Row, beyond: float, rounding: float) -> None:
    """The parameters-after-AdamW row passes above its bound when no weight differs by more
    than `rounding` beyond what the gradients' difference explains (`step_beyond_gradients`)."""
    if np.isfinite(beyond) and beyond <= rounding:
        row.explained = "near-zero gradients' float32 noise"


def tolerances(cfg) -> dict:
    """The check's tolerances: those of its weights' dtype, or bf16's where the JAX side
    computes in bf16 over float32 weights (the TPU configuration against torch in float32)."""
    chk = cfg.jax.check
    if chk.dtype not in TOLERANCES:
        raise ValueError(f"jax.check.dtype must be one of {sorted(TOLERANCES)}, got {chk.dtype!r}")
    mixed = cfg.jax.compute_dtype == "bfloat16" and chk.dtype == "float32"
    return TOLERANCES["bfloat16" if mixed else chk.dtype]


def adamw_on(grads: dict, params: dict, train_cfg) -> dict:
    """The JAX optimizer's first step from `params` with the given gradients (numpy dicts)."""
    tx = make_optimizer(train_cfg, params)
    p = {k: jnp.asarray(v) for k, v in params.items()}
    updates, _ = tx.update({k: jnp.asarray(grads[k]) for k in p}, tx.init(p), p)
    return {k: np.asarray(v) for k, v in optax.apply_updates(p, updates).items()}


def run_check(cfg, model_dir: str, processor) -> tuple[list[Row], dict]:
    """(table rows, info) comparing the backends on `model_dir` under config `cfg`."""
    chk = cfg.jax.check
    tol = tolerances(cfg)
    batches, n_tokens, n_seqs = batches_from_config(processor, chk, cfg.train.share_prefix)
    loss_cfg = to_dataclass(LossConfig, cfg.loss)
    args = (model_dir, processor, batches, n_tokens, n_seqs, loss_cfg, cfg.train,
            cfg.rollout.temperature, chk.dtype)
    th = torch_side(*args)
    jx = jax_side(*args, cfg.jax)
    logp_jx, logp_th = np.concatenate(jx["logp"]), np.concatenate(th["logp"])
    logp = Row("log-probs", *_errors(logp_jx, logp_th), *tol["log-probs"])
    rows = [Row("logits", *_errors(np.concatenate([a.ravel() for a in jx["logits"]]),
                                   np.concatenate([a.ravel() for a in th["logits"]])),
                *tol["logits"]), logp]
    if wants_float64_reference(cfg, model_dir):
        exact = np.concatenate(float64_logprobs(model_dir, processor, batches,
                                                cfg.rollout.temperature))
        of_jax = Row("log-probs, JAX vs float64", *_errors(logp_jx, exact), *tol["log-probs"])
        of_torch = Row("log-probs, torch vs float64", *_errors(logp_th, exact), "abs", np.inf)
        rows += [of_jax, of_torch]
        blame_torch_rounding(logp, of_jax, of_torch)
    rows.append(Row("loss", *_errors(jx["loss"], th["loss"]), *tol["loss"]))
    missing = set(th["grads"]) ^ set(jx["grads"])
    if missing:
        raise ValueError(f"parameter names differ between the backends: {sorted(missing)[:10]}")
    max_abs, norm_abs, norm_rel, worst, worst_name = _grad_errors(jx["grads"], th["grads"])
    rows += [Row("grad global norm", norm_abs, norm_rel, *tol["grad global norm"]),
             Row("grad worst param", max_abs, worst, *tol["grad worst param"])]
    ref = th["params"]
    big = float(max(np.abs(v).max() for v in ref.values()))
    # One AdamW step moves a weight by about lr * g / (|g| + eps): weights whose gradient is
    # float32 noise around zero (|g| ~ 1e-9) may move differently by a fraction of lr. In bf16
    # both sides round the new weights to bf16: one ulp of the largest weight.
    lr = float(lr_table(cfg.train.lr, cfg.train.lr_schedule, *horizon(cfg.train),
                        cfg.train.min_lr_ratio)[0])
    limits = {"0.1 lr": 0.1 * lr, "bf16 ulp": big * 2.0 ** -7}
    stepped = adamw_on(th["grads"], th["params_before"], cfg.train)
    for name, got in (("params after AdamW", jx["params"]), ("AdamW on torch's grads", stepped)):
        err = max(_errors(got[k], v)[0] for k, v in ref.items())
        measure, limit = tol[name]
        rows.append(Row(name, err, err / max(big, 1e-30), measure, limits.get(limit, limit)))
    info = {"batches": len(batches), "tokens": int(sum(b.num_tokens for b in batches)),
            "trained_tokens": int(n_tokens), "sequences": int(n_seqs),
            "images": int(sum(len(b.images) for b in batches)),
            "worst_grad_param": worst_name, "torch_step_s": th["step_s"],
            "jax_step_s": jx["step_s"], "jax_compile_s": jx["compile_s"],
            "jax": jx["computation"]}
    if tol is TOLERANCES["float32"]:
        beyond = step_beyond_gradients(jx["params"], ref, jx["grads"], th["grads"], lr,
                                       cfg.train.eps)
        info["step_beyond_gradients"] = beyond
        blame_gradient_noise(next(r for r in rows if r.quantity == "params after AdamW"), beyond,
                             tol["AdamW on torch's grads"][1])
    return rows, info


def print_table(rows: list[Row], info: dict, title: str) -> None:
    """The check's table (rich), then the batch it ran on."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("quantity", "max abs error", "max rel error", "tolerance", "result"):
        table.add_column(col, justify="left" if col == "quantity" else "right")
    for r in rows:
        bound = f"{r.measure} <= {r.tol:.1e}" if np.isfinite(r.tol) else "(shown)"
        table.add_row(r.quantity, f"{r.abs_err:.3e}", f"{r.rel_err:.3e}", bound, r.result)
    console = Console(width=max(Console().width, 110))  # a log file gets whole rows too
    console.print(table)
    console.print(", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                            for k, v in info.items()))
