"""Which values each numeric config field may take, as data, which field must divide another,
and what GRPO needs beyond them.

    problems(cfg)              -> ["train.lr=-0.001 must be in (0, inf)", ...]   every field
    problems(cfg, grpo=True)   -> the same, and "rollout.n_samples=1: ..." where GRPO cannot train

The command line's preflight (`common.config_help`) refuses a config with problems in one line
each, before torch or jax loads and before a run folder exists; `common.prepare.check_config`
asks again where a run is built from a config that came another way (a test, a script). Plain
Python: no numpy, no ml_collections (a config is read as nested mappings).

A rule is an interval, "[" or "]" taking its bound and "(" or ")" leaving it out ("inf" for an
open end, never taken), or several joined by " or " ("-1 or [1, inf)": a single value is its own
interval). NaN is in no interval; a placeholder field (`loss.dual_clip`) may also be None (off).
A test holds every numeric field of configs/base.py to having a rule here.
"""

from __future__ import annotations

import math
import re

RANGES = {
    "seed": "[0, inf)",
    "data.synthetic_seed": "[0, inf)",
    "data.synthetic_train_size": "[1, inf)",
    "data.synthetic_test_size": "[1, inf)",
    "model.tiny_seed": "[0, inf)",
    "model.tiny_see_steps": "[0, inf)",
    "model.tiny_caption_steps": "[0, inf)",
    "model.tiny_prime_steps": "[0, inf)",
    "model.tiny_prime_later_steps": "[0, inf)",
    "env.max_turns": "[1, inf)",
    "env.rel_tol": "[0, inf)",
    "env.grade_timeout_s": "(0, inf)",
    "reward.turn_discount": "(0, 1]",
    "reward.format_bonus": "(-inf, inf)",
    "reward.repeat_penalty": "[0, inf)",
    "reward.progress_bonus": "[0, inf)",
    "rollout.n_samples": "[1, inf)",
    "rollout.max_response_tokens": "[1, inf)",
    "rollout.max_context_tokens": "[1, inf)",
    "rollout.temperature": "[0, inf)",
    "rollout.top_p": "(0, 1]",
    "rollout.max_retries": "[0, inf)",
    "engine.local_max_batch": "[1, inf)",
    "engine.local_kv_budget_gb": "(0, inf)",
    "engine.local_attention_bucket": "[0, inf)",
    "engine.sglang_servers": "[1, inf)",
    "engine.sglang_gpus_per_server": "[1, inf)",
    "engine.sglang_ep_size": "[1, inf)",
    "engine.sglang_base_gpu": "[-1, inf)",
    "engine.sglang_mem_fraction": "(0, 1]",
    "engine.sglang_bucket_mb": "(0, inf)",
    "engine.sglang_port_base": "[1, 65535]",
    "engine.sglang_timeout_s": "(0, inf)",
    "engine.sglang_max_retries": "[0, inf)",
    "engine.sglang_max_concurrency": "[1, inf)",
    "engine.sglang_startup_timeout_s": "(0, inf)",
    "engine.sglang_health_timeout_s": "(0, inf)",
    "engine.sglang_idle_timeout_s": "(0, inf)",
    "engine.slots": "[1, inf)",
    "engine.kv_memory_fraction": "(0, 1]",
    "engine.prefill_rows": "[0, inf)",
    "engine.prefill_tokens": "[0, inf)",
    "loss.clip_low": "[0, 1]",
    "loss.clip_high": "[0, inf)",
    "loss.dual_clip": "(1, inf)",
    "loss.kl_coef": "[0, inf)",
    "loss.router_aux_coef": "[0, inf)",
    "loss.tis_cap": "(0, inf)",
    "train.steps": "[1, inf)",
    "train.prompts_per_step": "[1, inf)",
    "train.micro_batch_tokens": "[1, inf)",
    "train.micro_batch_target_tokens": "[1, inf)",
    "train.micro_batch_margin": "[0, 1)",
    "train.forced_miss_fraction": "[0, 1]",
    "train.updates_per_rollout": "[1, inf)",
    "train.max_staleness": "[0, inf)",
    "train.logprob_chunk": "[0, inf)",
    "train.lr": "(0, inf)",
    "train.warmup_steps": "[0, inf)",
    "train.min_lr_ratio": "[0, 1]",
    "train.beta1": "[0, 1)",  # 1: Adam's averages would never forget
    "train.beta2": "[0, 1)",
    "train.eps": "(0, inf)",
    "train.weight_decay": "[0, inf)",
    "train.grad_clip": "(0, inf)",
    "train.collective_timeout_s": "(0, inf)",
    "train.expert_parallel": "[1, inf)",
    "eval.every": "[0, inf)",
    "eval.max_prompts": "[0, inf)",
    "eval.n_samples": "[0, inf)",
    "log.plot_every": "[0, inf)",
    "checkpoint.every": "[1, inf)",
    "checkpoint.keep": "[1, inf)",
    "jax.mesh.data": "-1 or [1, inf)",
    "jax.mesh.fsdp": "-1 or [1, inf)",
    "jax.mesh.expert": "-1 or [1, inf)",
    "jax.mesh.tensor": "-1 or [1, inf)",
    "jax.pad_to": "[1, inf)",
    "jax.row_rungs": "[1, inf)",
    "jax.reuse_slack": "[1, inf)",
    "jax.slice.targets": "[0, inf)",
    "jax.slice.patches": "[0, inf)",
    "jax.slice.window": "[0, inf)",
    "jax.slice.prefix_window": "[0, inf)",
    "jax.hbm_gib": "[0, inf)",
    "jax.check.prompts": "[1, inf)",
    "jax.check.samples": "[1, inf)",
    "jax.check.micro_batch_tokens": "[0, inf)",
    "jax.check.seed": "[0, inf)",
}

# What the GRPO loop needs beyond RANGES (`geo3k_torch.main`, `geo3k_jax.train`): field -> (rule,
# why). Every advantage here is an episode's reward against its group's (`common.grpo`): no
# recipe of this project trains on groups of one.
GRPO = {
    "rollout.n_samples": ("[2, inf)", "GRPO scores each episode against the other episodes of "
                          "its prompt; a group of one has no spread and trains nothing"),
    "rollout.temperature": ("(0, inf)", "the learner divides the logits by it, and greedy "
                            "episodes of one prompt are all alike"),
}

# A field that must divide another (both within RANGES): field -> (the other, why).
DIVIDES = {
    "engine.sglang_ep_size": ("engine.sglang_gpus_per_server", "SGLang splits a server's "
                              "experts into ep groups over its tp GPUs (--ep-size, --tp-size)"),
}

OPTIONAL = ("loss.dual_clip", "loss.tis_cap")  # may be None: off
WORDS = {"train.micro_batch_tokens": ("auto",)}  # a word it may be instead of a number

_INTERVAL = re.compile(r"^([\[(])\s*(\S+)\s*,\s*(\S+)\s*([\])])$")


def contains(rule: str, value) -> bool:
    """Whether the number `value` is in `rule` ("[0, 1)", "-1 or [1, inf)"); False for NaN, a
    bool, a string or anything else that is not an int or a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        return False
    for part in rule.split(" or "):
        m = _INTERVAL.match(part.strip())
        if m is None:
            if value == float(part):
                return True
            continue
        opening, low, high, closing = m.group(1), float(m.group(2)), float(m.group(3)), m.group(4)
        above = value >= low if opening == "[" else value > low
        below = value <= high if closing == "]" else value < high
        if above and below and math.isfinite(value):
            return True
    return False


def _get(cfg, key: str):
    for part in key.split("."):
        cfg = cfg[part]
    return cfg


def problems(cfg, grpo: bool = False) -> list[str]:
    """One line per field of `cfg` (a ConfigDict or nested dicts) outside its rule, in RANGES'
    order, then per field that does not divide its DIVIDES partner, then (with `grpo`) per GRPO
    rule it breaks. A field the config lacks is skipped (a config of another shape); None passes
    only where the config's field is a placeholder (`loss.dual_clip`, `loss.tis_cap`: off)."""
    out = []
    for key, rule in RANGES.items():
        try:
            value = _get(cfg, key)
        except (KeyError, AttributeError, TypeError):
            continue
        if value is None and key in OPTIONAL or value in WORDS.get(key, ()):
            continue
        if not contains(rule, value):
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            kind = "" if number else f" ({type(value).__name__}, not a number)"
            off = (" (or None: off)" if key in OPTIONAL else
                   "".join(f" (or {w!r})" for w in WORDS.get(key, ())))
            out.append(f"{key}={value!r}{kind} must be {describe(rule)}{off}")
    for key, (other, why) in DIVIDES.items():
        try:
            value, whole = _get(cfg, key), _get(cfg, other)
        except (KeyError, AttributeError, TypeError):
            continue
        if contains(RANGES[key], value) and contains(RANGES[other], whole) and whole % value:
            out.append(f"{key}={value!r} must divide {other}={whole!r}: {why}")
    if grpo:
        for key, (rule, why) in GRPO.items():
            try:
                value = _get(cfg, key)
            except (KeyError, AttributeError, TypeError):
                continue
            if contains(RANGES.get(key, "(-inf, inf)"), value) and not contains(rule, value):
                out.append(f"{key}={value!r} must be {describe(rule)} to train with GRPO: {why}")
    return out


def describe(rule: str) -> str:
    """A rule in words: "[1, inf)" -> ">= 1", "(0, 1]" -> "> 0 and <= 1", "-1 or [1, inf)" ->
    "-1 or >= 1", "(-inf, inf)" -> "finite"."""
    words = []
    for part in rule.split(" or "):
        m = _INTERVAL.match(part.strip())
        if m is None:
            words.append(part.strip())
            continue
        opening, low, high, closing = m.groups()
        bounds = ([f"{'>=' if opening == '[' else '>'} {low}"] if low != "-inf" else []) + \
            ([f"{'<=' if closing == ']' else '<'} {high}"] if high != "inf" else [])
        words.append(" and ".join(bounds) or "finite")
    return " or ".join(words)
