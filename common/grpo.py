"""GRPO math in numpy: group advantages, the dynamic-sampling filter and the reference policy loss.

The numpy `policy_loss` is THE reference: the torch and JAX learners implement the same formulas
and are pinned to this function by tests. Notation, per token t of a sequence:

    rho_t   = exp(logp_t - old_logp_t)
    pg_t    = max(-A * rho_t, -A * clip(rho_t, 1 - clip_low, 1 + clip_high))
    dual    : for A < 0, pg_t = min(pg_t, -dual_clip * A)                      (dual_clip > 1)
    tis_t   = min(exp(old_logp_t - rollout_logp_t), tis_cap)                   (a constant weight)
    kl_t    = k1: d | k2: d^2 / 2 | k3: exp(-d) - 1 + d,  d = logp_t - ref_logp_t, clamp +-10
    loss_t  = tis_t * pg_t + kl_coef * kl_t

Aggregation over the tokens with mask 1, as constant per-token weights (`token_weights`), so the
loss is always sum_t weight_t * loss_t:
    token-mean               : sum_t loss_t / n_tokens
    seq-mean-token-mean      : mean over sequences of (sum of its loss_t / its n_tokens)

With gradient accumulation the weights use the global `n_tokens` / `n_seqs` of the whole batch,
so that the micro-batch losses add up to the full-batch loss.

Which KL estimators make sense as a LOSS term (samples from the current policy, d = logp - ref):
  * k1 = d: an unbiased estimate of KL's value, but its gradient, grad logp, has expectation zero
    under the policy: as a loss it only adds noise (and it is not >= 0). Use it to monitor.
  * k2 = d^2 / 2: its gradient is d * grad logp, the gradient of KL(pi || ref) (the usual
    choice for a KL loss, GRPO-style).
  * k3 = exp(-d) - 1 + d ("low_var_kl"): >= 0, low variance as a value; its gradient
    (1 - exp(-d)) grad logp is that of KL(ref || pi) to first order, and 0 at pi = ref.

`per_token_terms` is written once against an array namespace `xp`: the torch and JAX learners
call it with `torch` / `jax.numpy`, so the formulas exist in one place only.
"""

from __future__ import annotations

import dataclasses

import numpy as np

AGG_MODES = ("token-mean", "seq-mean-token-mean")
KL_ESTIMATORS = ("k1", "k2", "k3")
KL_CLAMP = 10.0


def group_advantages(rewards: np.ndarray, group_size: int, normalize_std: bool = True,
                     eps: float = 1e-6) -> np.ndarray:
    """A_i = (r_i - mean_g) / (std_g + eps), unbiased std over each group of `group_size`.

    rewards: (N,), N a multiple of group_size, groups contiguous. Returns (N,) float64.
    Groups whose rewards are all equal get exactly 0 (no float residue from e.g. 0.9 - mean).
    A group of one sample has no spread: its advantage is 0.
    """
    r = np.asarray(rewards, np.float64)
    if r.ndim != 1 or group_size < 1 or len(r) % group_size:
        raise ValueError(f"rewards of shape {r.shape} do not split into groups of {group_size}")
    g = r.reshape(-1, group_size)
    adv = g - g.mean(axis=1, keepdims=True)
    if normalize_std and group_size > 1:
        adv = adv / (g.std(axis=1, ddof=1, keepdims=True) + eps)
    adv[np.ptp(g, axis=1) == 0] = 0.0
    return adv.reshape(-1)


def turn_advantages(rewards: np.ndarray, group_ids: np.ndarray, valid: np.ndarray,
                    turns: np.ndarray, normalize_std: bool = True, eps: float = 1e-6
                    ) -> np.ndarray:
    """Advantages per turn: the tokens of an episode's turn t are scored against the valid
    episodes of its group that reached turn t, not the whole group. Against the whole group, a
    later turn that solved is ranked below the group's first-try solves when a turn discount
    pays it less (docs/results.md: a turn-2 solve's advantage was negative 38-45% of the time);
    against the episodes that reached turn t, it is ranked against the other answers given
    there, after the same failed turns.

    The estimator: A_i,t = (r_i - mean of the rewards at turn t) / (std of the whole group's
    rewards + eps), the unbiased std of all its valid episodes (normalize_std; else 1). One
    scale for every turn of a group, so a turn's advantage grows with its reward gap: the
    spread of the few episodes at a late turn would give two of them +-0.707 whatever their
    gap and undo the turn discount. The mean includes the episode itself: with n episodes at
    turn t the advantage is (n - 1) / n of the leave-one-out one, shrunk toward 0 for small n,
    never of the other sign.

    rewards, group_ids, valid, turns (the turns each episode played): (N,). Returns (N, K), K
    the most turns any episode played (invalid ones too, so every episode's turns index it; at
    least 1): column t - 1 for turn t, column 0 equal to `episode_advantages`'. Turns an episode
    did not play, invalid episodes, and a turn whose episodes all have one reward (or only one
    episode) get 0.
    """
    rewards, turns = np.asarray(rewards, np.float64), np.asarray(turns)
    k = max(int(max(turns, default=1)), 1)
    adv = np.zeros((len(rewards), k))
    for g in np.unique(group_ids):
        group = np.nonzero((group_ids == g) & valid)[0]
        if len(group) < 2 or np.ptp(rewards[group]) == 0:
            continue
        scale = rewards[group].std(ddof=1) + eps if normalize_std else 1.0
        for t in range(1, k + 1):
            members = group[turns[group] >= t]
            if len(members) > 1 and np.ptp(rewards[members]) > 0:
                adv[members, t - 1] = (rewards[members] - rewards[members].mean()) / scale
    return adv


def dynamic_sampling_keep(rewards: np.ndarray, group_size: int) -> np.ndarray:
    """Boolean (N,): False for every sample of a group whose rewards are all equal."""
    g = np.asarray(rewards, np.float64).reshape(-1, group_size)
    return np.repeat(np.ptp(g, axis=1) > 0, group_size)


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Policy-loss options. `dual_clip` None = off; `tis_cap` None = no importance weights."""

    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float | None = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    tis_cap: float | None = None
    agg: str = "token-mean"
    router_aux_coef: float = 0.0  # a MoE model's load-balancing loss (the torch learner)
    routing_replay: bool = False  # a MoE learner routes as the engine did (`Trajectory.routed_experts`)

    def __post_init__(self):
        if self.agg not in AGG_MODES:
            raise ValueError(f"agg must be one of {AGG_MODES}, got {self.agg!r}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, "
                             f"got {self.kl_estimator!r}")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ValueError(f"dual_clip must be > 1, got {self.dual_clip}")
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ValueError(f"tis_cap must be > 0, got {self.tis_cap}")
        if self.clip_low < 0 or self.clip_high < 0:
            raise ValueError("clip ranges must be >= 0")


def kl_penalty(logp, ref_logp, estimator: str, xp=np):
    """Per-token KL estimate to the reference policy, clamped to +-10. Shapes as the inputs.
    k2 or k3 as a loss term; k1's gradient has zero mean (see the module docstring)."""
    d = logp - ref_logp
    if estimator == "k1":
        kl = d
    elif estimator == "k2":
        kl = 0.5 * d * d
    elif estimator == "k3":
        kl = xp.exp(-d) - 1.0 + d
    else:
        raise ValueError(f"unknown KL estimator {estimator!r}")
    return xp.clip(kl, -KL_CLAMP, KL_CLAMP)


def per_token_terms(logp, old_logp, advantages, cfg: LossConfig, *, ref_logp=None,
                    rollout_logp=None, diag_logp=None, xp=np) -> dict:
    """The per-token loss and its diagnostics, written once for every array library.

    `xp` is the array namespace: numpy here, `torch` in the torch learner, `jax.numpy` in the
    JAX one (only exp, clip, maximum, minimum and where on arrays are used, which all three share).
    All inputs have one shape (T,) or (B, T); returns arrays of that shape: `loss` (the
    per-token loss_t of the module docstring), `clipped` (1 where the clipped term wins),
    `approx_kl` (k3 of KL(old || new)), and `kl` / `tis` when those options are on.
    `diag_logp` (default old_logp): what `clipped` and `approx_kl` compare the policy with. A
    learner passes the behaviour (rollout) log-probs when old_logp is the current policy
    itself (one update per rollout), where comparing with old_logp would give 0 by construction.
    """
    ratio = xp.exp(logp - old_logp)
    clipped = xp.clip(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    pg_unclipped, pg_clipped = -advantages * ratio, -advantages * clipped
    pg = xp.maximum(pg_unclipped, pg_clipped)
    if cfg.dual_clip is not None:
        pg = xp.where(advantages < 0, xp.minimum(pg, -cfg.dual_clip * advantages), pg)
    if diag_logp is None:
        out = {"clipped": (pg_clipped > pg_unclipped) * 1.0,
               "approx_kl": kl_penalty(old_logp, logp, "k3", xp)}
    else:
        d_ratio = xp.exp(logp - diag_logp)
        d_clip = xp.clip(d_ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
        out = {"clipped": (-advantages * d_clip > -advantages * d_ratio) * 1.0,
               "approx_kl": kl_penalty(diag_logp, logp, "k3", xp)}
    if cfg.tis_cap is not None:
        if rollout_logp is None:
            raise ValueError("tis_cap is set but no rollout_logp was given")
        # A constant weight: learners pass old_logp and rollout_logp without gradient.
        out["tis"] = xp.clip(xp.exp(old_logp - rollout_logp), 0.0, cfg.tis_cap)
        pg = pg * out["tis"]
    if cfg.kl_coef:
        if ref_logp is None:
            raise ValueError("kl_coef is set but no ref_logp was given")
        out["kl"] = kl_penalty(logp, ref_logp, cfg.kl_estimator, xp)
        pg = pg + cfg.kl_coef * out["kl"]
    out["loss"] = pg
    return out


def token_weights(loss_mask: np.ndarray, agg: str, *, seq_ids: np.ndarray | None = None,
                  n_tokens: float | None = None, n_seqs: float | None = None,
                  mean_over: np.ndarray | None = None) -> np.ndarray:
    """Aggregation as per-token weights: the loss is sum_t weight_t * loss_t.

    token-mean: mask_t / n_tokens; seq-mean-token-mean: mask_t / (len(seq of t) * n_seqs), with
    len counting masked tokens. loss_mask: (B, T) or packed (T,) with `seq_ids` (T,); rows of a
    2-D input are its sequences. n_tokens / n_seqs default to this batch's masked tokens /
    sequences with at least one masked token (pass the global batch's for micro-batches).
    mean_over: (S,) per sequence id (packed input), what its mean divides by instead of its own
    masked tokens (the turns of one episode exported apart divide by the episode's).
    Returns float64 weights of loss_mask's shape.
    """
    mask = np.asarray(loss_mask, np.float64)
    if agg == "token-mean":
        denom = mask.sum() if n_tokens is None else n_tokens
        return mask / max(denom, 1.0)
    if agg != "seq-mean-token-mean":
        raise ValueError(f"agg must be one of {AGG_MODES}, got {agg!r}")
    flat = mask.reshape(-1)
    seg = _segments(seq_ids, mask.shape)
    _, inv = np.unique(seg, return_inverse=True)
    seq_len = np.bincount(inv, flat)
    denom = (seq_len > 0).sum() if n_seqs is None else n_seqs
    per_token = seq_len[inv] if mean_over is None else np.asarray(mean_over, np.float64)[seg]
    w = flat / np.maximum(per_token, 1.0) / max(denom, 1.0)
    return w.reshape(mask.shape)


def _segments(seq_ids: np.ndarray | None, shape: tuple[int, ...]) -> np.ndarray:
    """Sequence id of every token: given, else the row of a (B, T) array, else one sequence."""
    if seq_ids is not None:
        return np.asarray(seq_ids).reshape(-1)
    if len(shape) == 2:
        return np.repeat(np.arange(shape[0]), shape[1])
    return np.zeros(int(np.prod(shape)), np.int64)


def policy_loss(logp: np.ndarray, old_logp: np.ndarray, advantages: np.ndarray,
                loss_mask: np.ndarray, cfg: LossConfig = LossConfig(), *,
                ref_logp: np.ndarray | None = None, rollout_logp: np.ndarray | None = None,
                seq_ids: np.ndarray | None = None, n_tokens: float | None = None,
                n_seqs: float | None = None, diag_logp: np.ndarray | None = None
                ) -> tuple[float, dict]:
    """The reference GRPO policy loss (float64) and its metrics.

    logp, old_logp, advantages, loss_mask, ref_logp, rollout_logp: (B, T) or packed (T,), the
    same shape; advantages already broadcast per token. seq_ids, n_tokens, n_seqs: see
    `token_weights`. Returns (loss, metrics): clip_frac (share of masked tokens where the
    clipped term wins), approx_kl (k3 estimate of KL(old || new)), both against `diag_logp`
    when given (`per_token_terms`), kl (when kl_coef), tis_mean (when tis_cap).
    """
    f64 = lambda a: None if a is None else np.asarray(a, np.float64)  # noqa: E731
    terms = per_token_terms(f64(logp), f64(old_logp), f64(advantages), cfg,
                            ref_logp=f64(ref_logp), rollout_logp=f64(rollout_logp),
                            diag_logp=f64(diag_logp))
    mask = f64(loss_mask)
    weights = token_weights(mask, cfg.agg, seq_ids=seq_ids, n_tokens=n_tokens, n_seqs=n_seqs)
    loss = float((terms["loss"] * weights).sum())
    names = {"clipped": "clip_frac", "approx_kl": "approx_kl", "kl": "kl", "tis": "tis_mean"}
    metrics = {names[k]: _masked_mean(v, mask) for k, v in terms.items() if k in names}
    return loss, metrics


def _masked_mean(x: np.ndarray, mask: np.ndarray) -> float:
    return float((x * mask).sum() / max(mask.sum(), 1.0))


def episode_advantages(rewards: np.ndarray, group_ids: np.ndarray, valid: np.ndarray,
                       normalize_std: bool = True, filter_equal: bool = True
                       ) -> tuple[np.ndarray, np.ndarray]:
    """Advantages of a rollout's episodes, group by group, over the valid (not aborted) ones.

    rewards, group_ids, valid: (N,). Returns (advantages (N,), keep (N,) bool): invalid
    episodes get 0 and keep False; with `filter_equal`, groups whose valid rewards are all
    equal (or that have fewer than two valid episodes) are not kept (dynamic sampling).
    """
    rewards = np.asarray(rewards, np.float64)
    adv = np.zeros(len(rewards))
    keep = np.zeros(len(rewards), bool)
    for g in np.unique(group_ids):
        members = np.nonzero((group_ids == g) & valid)[0]
        if len(members) == 0:
            continue
        adv[members] = group_advantages(rewards[members], len(members), normalize_std)
        spread = len(members) > 1 and bool(np.ptp(rewards[members]) > 0)
        keep[members] = spread or not filter_equal
    return adv, keep
