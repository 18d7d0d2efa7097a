"""The GRPO learner in torch: one optimizer step on a rollout's packed micro-batches.

    for each micro-batch:  log-probs of its masked tokens -> per-token loss (common.grpo, xp=torch)
                           -> sum(weight_t * loss_t) -> backward          (gradient accumulation)
    clip the global grad norm -> skip the step if it is not finite -> AdamW -> LR schedule

Weights come from `common.grpo.token_weights` with the GLOBAL token / sequence counts of the
whole batch (every rank, every micro-batch), so accumulated gradients equal the full-batch
gradient. Under FSDP the gradients are averaged over ranks, hence the loss is scaled by the world
size. The "old" log-probs of the ratio are a batch's `old_logprobs` (computed once by `logprobs`
before the first of several updates on one rollout) or, with one optimizer step per rollout (the
anchor recipe), the learner's own log-probs at the current weights, detached; their distance to
the engine's rollout log-probs is reported (mean and max over trained tokens).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from common.batching import PackedBatch, TrainSequence, pack
from common.grpo import LossConfig, per_token_terms, token_weights
from common.learner import Collectives, SingleProcess, is_vision
from common.schedule import horizon, lr_factor
from geo3k_torch import checkpoint
from geo3k_torch.model import packed_inputs, token_logprobs


class Learner:
    """`common.learner.Learner` in torch: owns the policy's optimizer and scheduler. `model`
    may be FSDP-sharded over `comm`'s ranks (and computes in bf16 under its mixed-precision
    policy); `model_dir` is the checkpoint it came from (its tokenizer and processor files go
    into every export)."""

    def __init__(self, model, processor, loss_cfg: LossConfig, train_cfg, temperature: float,
                 device: torch.device | str = "cpu", ref_model=None,
                 comm: Collectives = SingleProcess(), model_dir: str | None = None,
                 chunk: int = 0):
        self.model, self.processor, self.loss_cfg = model, processor, loss_cfg
        self.chunk = chunk  # trained tokens whose logits exist at once (0: all)
        self.cfg, self.temperature, self.model_dir = train_cfg, temperature, model_dir
        self.device, self.ref_model, self.comm = torch.device(device), ref_model, comm
        self.world_size = comm.world
        if loss_cfg.kl_coef and ref_model is None:
            raise ValueError("kl_coef > 0 needs a reference model")
        if train_cfg.freeze_vision:
            frozen = [p for name, p in model.named_parameters() if is_vision(name)]
            if not frozen:
                raise ValueError("train.freeze_vision: the model has no vision tower "
                                 "parameters (model.visual.*)")
            for p in frozen:
                p.requires_grad_(False)
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], lr=train_cfg.lr,
            betas=(train_cfg.beta1, train_cfg.beta2), eps=train_cfg.eps,
            weight_decay=train_cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, train_cfg.lr_schedule, *horizon(train_cfg),
                                                train_cfg.min_lr_ratio))

    def _forward(self, model, batch: PackedBatch, targets: torch.Tensor, entropy: bool):
        """The compute dtype is the model's: FSDP2's policy (bf16 over fp32 master weights, see
        `geo3k_torch.distributed`) or its parameters' own; never autocast, which leaves q and k
        fp32 beside a bf16 v in Qwen3-VL (its q/k RMSNorm) and fails in attention."""
        inputs = packed_inputs(batch, self.processor, model.config, self.device)
        return token_logprobs(model, inputs, targets, self.temperature, entropy, self.chunk)

    def micro_batch_loss(self, batch: PackedBatch, n_tokens: float, n_seqs: float) -> tuple:
        """Loss of one micro-batch (already scaled for accumulation) and its metric sums."""
        idx = np.nonzero(batch.loss_mask)[0]
        targets = torch.from_numpy(idx).to(self.device)
        const = lambda a: torch.from_numpy(np.asarray(a, np.float32)[idx]).to(self.device)  # noqa
        weights = token_weights(batch.loss_mask, self.loss_cfg.agg, seq_ids=batch.seq_ids,
                                n_tokens=n_tokens, n_seqs=n_seqs, mean_over=batch.mean_over)
        logp, entropy = self._forward(self.model, batch, targets, True)
        ref = None
        if self.loss_cfg.kl_coef:
            with torch.no_grad():
                ref = self._forward(self.ref_model, batch, targets, False)
        rollout = const(batch.rollout_logprobs)
        old = logp.detach() if batch.old_logprobs is None else const(batch.old_logprobs)
        terms = per_token_terms(logp, old, const(batch.advantages), self.loss_cfg,
                                ref_logp=ref, rollout_logp=rollout, xp=torch,
                                diag_logp=rollout if batch.old_logprobs is None else None)
        loss = (terms["loss"] * const(weights)).sum() * self.world_size
        with torch.no_grad():
            diff = (logp - rollout).abs()
            sums = {"tokens": float(len(idx)), "entropy": float(entropy.sum()),
                    "clip_frac": float(terms["clipped"].sum()),
                    "approx_kl": float(terms["approx_kl"].sum()),
                    "logp_diff_mean": float(diff.sum()),
                    "logp_diff_max": float(diff.max()) if len(idx) else 0.0}
            if "kl" in terms:
                sums["kl"] = float(terms["kl"].sum())
            if "tis" in terms:
                sums["tis_mean"] = float(terms["tis"].sum())
        return loss, sums

    def train_step(self, batches: Sequence[PackedBatch], n_tokens: float, n_seqs: float
                   ) -> dict[str, float]:
        """Accumulate over `batches` (this rank's share), then one optimizer step.

        n_tokens / n_seqs: masked tokens / sequences of the global batch. Returns the metrics of
        the whole step (every rank): loss, grad_norm, lr, skipped (1 if the gradients were not
        finite), and token means over all ranks of entropy, clip_frac, approx_kl, kl, tis_mean,
        logp_diff_mean, plus logp_diff_max.
        """
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {"loss": 0.0, "tokens": 0.0, "logp_diff_max": 0.0}
        for batch in batches:
            loss, s = self.micro_batch_loss(batch, n_tokens, n_seqs)
            loss.backward()
            sums["loss"] += float(loss.detach()) / self.world_size
            for k, v in s.items():
                sums[k] = max(sums[k], v) if k == "logp_diff_max" else sums.get(k, 0.0) + v
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor")
                          else grad_norm)
        skipped = not math.isfinite(grad_norm)
        lr = self.scheduler.get_last_lr()[0]
        if skipped:  # never applied; the schedule does not advance either
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.optimizer.step()
            self.scheduler.step()
        sums = self.comm.sum_scalars(sums, max_keys=("logp_diff_max",))
        n = max(sums.pop("tokens"), 1.0)
        out = {"grad_norm": grad_norm, "lr": lr, "skipped": float(skipped)}
        out.update({k: (v if k in ("loss", "logp_diff_max") else v / n)
                    for k, v in sums.items()})
        return out

    @torch.no_grad()
    def logprobs(self, batches: Sequence[PackedBatch]) -> list[np.ndarray]:
        """(T,) log-probs of each micro-batch's masked tokens at the current weights (0 off the
        mask): the behaviour policy when several updates share one rollout."""
        self.model.eval()
        out = []
        for batch in batches:
            idx = np.nonzero(batch.loss_mask)[0]
            logp = self._forward(self.model, batch, torch.from_numpy(idx).to(self.device), False)
            full = np.zeros(batch.num_tokens, np.float32)
            full[idx] = logp.float().cpu().numpy()
            out.append(full)
        return out

    def export_hf(self, out_dir: Path) -> None:
        checkpoint.write_hf(out_dir, self.model, self.model_dir)

    def save(self, directory: Path) -> None:
        checkpoint.save_state(directory, self.model, self.optimizer, self.scheduler)

    def wait_saved(self) -> None:
        """Nothing to wait for: `save` writes before it returns."""

    def restore(self, directory: Path) -> None:
        checkpoint.load_state(directory, self.model, self.optimizer, self.scheduler)


class SFTLearner(Learner):
    """The torch learner with the supervised loss: -sum(log p(masked tokens)) / global count.
    Optimizer, schedule, clipping, checkpoints and exports are the GRPO learner's."""

    def __init__(self, model, processor, train_cfg, device: torch.device | str = "cpu",
                 comm: Collectives = SingleProcess(), model_dir: str | None = None):
        super().__init__(model, processor, LossConfig(), train_cfg, 1.0, device, comm=comm,
                         model_dir=model_dir)

    def micro_batch_loss(self, batch, n_tokens: float, n_seqs: float) -> tuple:
        targets = torch.from_numpy(np.nonzero(batch.loss_mask)[0]).to(self.device)
        logp, entropy = self._forward(self.model, batch, targets, True)  # (K,), (K,)
        loss = -logp.sum() / n_tokens * self.world_size  # FSDP averages gradients over ranks
        return loss, {"tokens": float(len(targets)), "entropy": float(entropy.sum())}


def sft_step(learner: SFTLearner, seqs: Sequence[TrainSequence], micro_batch_tokens: int,
             comm: Collectives = SingleProcess()) -> dict[str, float]:
    """One optimizer step on this process's sequences. Returns loss (mean NLL per assistant
    token of the global batch), grad_norm, lr, skipped, entropy, tokens."""
    counts = comm.sum_scalars({"tokens": sum(float(s.loss_mask.sum()) for s in seqs),
                               "seqs": float(len(seqs))})
    m = learner.train_step(pack(seqs, micro_batch_tokens), counts["tokens"], counts["seqs"])
    m.pop("logp_diff_max", None)  # no rollout log-probs in SFT
    return {**m, "tokens": counts["tokens"]}
