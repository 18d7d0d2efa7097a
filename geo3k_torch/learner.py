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
the engine's rollout log-probs is reported (mean and max over trained tokens). A MoE model's
routing (`geo3k_torch.router`) adds its load-balancing loss (`loss.router_aux_coef` > 0) and
reports its router entropy and per-expert load. With `loss.routing_replay` every forward of the
policy (the trained one, its recomputation, the old log-probs) and of the KL reference routes
each token to the experts the engine routed it to (`common.batching.replayed_routing`), so
logp_diff_* measure the replayed mismatch; a no-grad forward of each step's first micro-batch routes freely for
logp_diff_*_free, and routing_replay_mismatch is the share of the trained tokens' (token, layer)
routings whose free top-k would differ from the replayed one.

The device never waits for the host inside a step. A micro-batch's host work (the image
processor, M-RoPE positions, the loss weights: `MicroBatch.prepare`) runs in a background thread
while the device computes the previous one, and reaches the device through pinned memory; the
metrics stay device tensors, summed over micro-batches and read once per step together with the
grad norm (the one host sync of a step, which decides whether the step is skipped). On CUDA the
optimizer is torch's fused AdamW. A model that is not FSDP-wrapped computes in bf16 over its fp32
weights on CUDA (`geo3k_torch.precision.MasterWeights`, the arithmetic of FSDP2's bf16 policy).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from common.batching import PackedBatch, TrainSequence, pack, replayed_routing
from common.grpo import LossConfig, per_token_terms, token_weights
from common.learner import Collectives, SingleProcess, is_vision
from common.schedule import horizon, lr_factor
from geo3k_torch import checkpoint
from geo3k_torch.attention import to_device
from geo3k_torch.expert_parallel import clip_grad_norm
from geo3k_torch.head import fused_loss
from geo3k_torch.model import host_inputs, token_logprobs, upload
from geo3k_torch.precision import MasterWeights
from geo3k_torch.router import (Routing, balance_loss, load_metrics, replay_mismatch,
                                routing_sums)

# metrics that are not token means over the step's trained tokens: maxima, and ratios of their
# own counts (the free-routing forward sees only each process's first micro-batch)
MAX_KEYS = ("logp_diff_max", "logp_diff_max_free")
RATIOS = {"logp_diff_mean_free": "free_tokens", "routing_replay_mismatch": "replayed_routings"}


@dataclasses.dataclass
class MicroBatch:
    """One packed micro-batch of T tokens, K of them trained: the forward's inputs
    (`geo3k_torch.model.host_inputs`) and (K,) tensors of the trained tokens' row positions
    (`targets`, int64) and float32 constants (`advantages`, `rollout`, `old` or None,
    `weights`: the loss weights of `common.grpo.token_weights`); n_tokens: the global batch's
    trained tokens; routed: (T, L, K) int16, the experts to replay (`loss.routing_replay`), or
    None (free routing)."""

    inputs: dict
    targets: torch.Tensor
    advantages: torch.Tensor
    rollout: torch.Tensor
    old: torch.Tensor | None
    weights: torch.Tensor
    n_tokens: float
    routed: torch.Tensor | None = None

    @classmethod
    def prepare(cls, batch: PackedBatch, processor, config, agg: str, n_tokens: float,
                n_seqs: float, replay: bool = False) -> MicroBatch:
        """Everything the host computes for `batch` (no device work: safe in a thread); with
        `replay`, the engine's routing (`common.batching.replayed_routing`)."""
        routed = replayed_routing(batch) if replay else None
        idx = np.nonzero(batch.loss_mask)[0]
        const = lambda a: torch.from_numpy(np.asarray(a, np.float32)[idx])  # noqa: E731
        weights = token_weights(batch.loss_mask, agg, seq_ids=batch.seq_ids, n_tokens=n_tokens,
                                n_seqs=n_seqs, mean_over=batch.mean_over)
        return cls(host_inputs(batch, processor, config), torch.from_numpy(idx),
                   const(batch.advantages), const(batch.rollout_logprobs),
                   None if batch.old_logprobs is None else const(batch.old_logprobs),
                   const(weights), n_tokens, None if routed is None else torch.from_numpy(routed))

    def to(self, device: torch.device) -> MicroBatch:
        """On `device`, copied without blocking (pinned memory on CUDA)."""
        move = lambda t: None if t is None else to_device(t, device)  # noqa: E731
        return MicroBatch(upload(self.inputs, device), move(self.targets),
                          move(self.advantages), move(self.rollout), move(self.old),
                          move(self.weights), self.n_tokens, move(self.routed))


def prefetched(fn: Callable, items: Sequence) -> Iterator:
    """fn(item) for each of `items` in order, the next one computed in a background thread
    while the caller works on the current one."""
    if not items:
        return
    with ThreadPoolExecutor(1, thread_name_prefix="micro-batch") as pool:
        pending = pool.submit(fn, items[0])
        for i in range(len(items)):
            current = pending.result()
            if i + 1 < len(items):
                pending = pool.submit(fn, items[i + 1])
            yield current


class Learner:
    """`common.learner.Learner` in torch: owns the policy's optimizer and scheduler. `model`
    may be FSDP-sharded over `comm`'s ranks (and computes in bf16 under its mixed-precision
    policy); `model_dir` is the checkpoint it came from (its tokenizer and processor files go
    into every export). master_weights: a plain fp32 model computes in bf16 over its fp32
    weights (`geo3k_torch.precision.MasterWeights`); None: on CUDA under `train.bf16` when the
    model is not FSDP-wrapped."""

    def __init__(self, model, processor, loss_cfg: LossConfig, train_cfg, temperature: float,
                 device: torch.device | str = "cpu", ref_model=None,
                 comm: Collectives = SingleProcess(), model_dir: str | None = None,
                 chunk: int = 0, fused_head: bool = False,
                 master_weights: bool | None = None):
        self.model, self.processor, self.loss_cfg = model, processor, loss_cfg
        self.chunk = chunk  # trained tokens whose logits exist at once (0: all)
        self.fused_head = fused_head  # the loss's gradient formed by the LM head (`train.fused_head`)
        self.cfg, self.temperature, self.model_dir = train_cfg, temperature, model_dir
        self.device, self.ref_model, self.comm = torch.device(device), ref_model, comm
        self.world_size = comm.world
        if loss_cfg.kl_coef and ref_model is None:
            raise ValueError("kl_coef > 0 needs a reference model")
        self.routing = Routing.of(model)  # None: a dense model
        if loss_cfg.router_aux_coef and self.routing is None:
            raise ValueError("loss.router_aux_coef > 0 needs a MoE model (qwen3_vl_moe), got "
                             f"{model.config.model_type}")
        if loss_cfg.routing_replay and self.routing is None:
            raise ValueError("loss.routing_replay needs a MoE model (qwen3_vl_moe), got "
                             f"{model.config.model_type}")
        if train_cfg.freeze_vision:
            frozen = [p for name, p in model.named_parameters() if is_vision(name)]
            if not frozen:
                raise ValueError("train.freeze_vision: the model has no vision tower "
                                 "parameters (model.visual.*)")
            for p in frozen:
                p.requires_grad_(False)
        if master_weights is None:
            master_weights = (self.device.type == "cuda" and not is_sharded(model)
                              and train_cfg.bf16)
        self.master = MasterWeights(model) if master_weights else None  # after freezing
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], lr=train_cfg.lr,
            betas=(train_cfg.beta1, train_cfg.beta2), eps=train_cfg.eps,
            weight_decay=train_cfg.weight_decay, fused=self.device.type == "cuda")
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, train_cfg.lr_schedule, *horizon(train_cfg),
                                                train_cfg.min_lr_ratio))

    def _compute(self):
        """Around the policy's forwards: its bf16 copies in place under master weights."""
        return self.master.compute() if self.master else contextlib.nullcontext()

    def _replaying(self, mb: MicroBatch):
        """Around a micro-batch's forward and backward: the policy's routers replay `mb.routed`
        (`geo3k_torch.router.Routing.replaying`); nothing without routing replay."""
        if not self.loss_cfg.routing_replay:
            return contextlib.nullcontext()
        return self.routing.replaying(mb.routed)

    def _forward(self, model, mb: MicroBatch, entropy: bool):
        """The compute dtype is the model's: FSDP2's policy (bf16 over fp32 master weights, see
        `geo3k_torch.distributed`) or its parameters' own; never autocast, which leaves q and k
        fp32 beside a bf16 v in Qwen3-VL (its q/k RMSNorm) and fails in attention."""
        return token_logprobs(model, mb.inputs, mb.targets, self.temperature, entropy,
                              self.chunk)

    def _micro_batches(self, batches: Sequence[PackedBatch], n_tokens: float = 1.0,
                       n_seqs: float = 1.0) -> Iterator[MicroBatch]:
        """`batches` prepared one ahead in a background thread, each moved to the device."""
        prepare = lambda b: MicroBatch.prepare(  # noqa: E731
            b, self.processor, self.model.config, self.loss_cfg.agg, n_tokens, n_seqs,
            self.loss_cfg.routing_replay)
        for mb in prefetched(prepare, batches):
            yield mb.to(self.device)

    def micro_batch_loss(self, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss of one micro-batch (already scaled for accumulation) and its metric sums, all
        device tensors (nothing read back). With `fused_head` the LM head forms the loss's
        gradient in the forward pass (`geo3k_torch.head`), else autograd through the log-probs."""
        ref = None
        if self.loss_cfg.kl_coef:
            replaying = (Routing.of(self.ref_model).replaying(mb.routed)
                         if self.loss_cfg.routing_replay else contextlib.nullcontext())
            with torch.no_grad(), replaying:  # the reference routes as the policy does
                ref = self._forward(self.ref_model, mb, False)
        recording = self.routing.recording() if self.routing else contextlib.nullcontext()
        with recording as routed:  # a MoE model's router logits, [] until the block exits
            if self.fused_head:
                loss, terms = fused_loss(self.model, mb.inputs, mb.targets, self.temperature,
                                         self.chunk,
                                         lambda logp, a, b: self._terms(mb, logp, ref, a, b))
                logp, entropy = terms["logp"], terms["entropy"]
            else:
                logp, entropy = self._forward(self.model, mb, True)
                loss, terms = self._terms(mb, logp, ref)
        with torch.no_grad():
            diff = (logp - mb.rollout).abs()
            sums = {"entropy": entropy.sum(), "clip_frac": terms["clipped"].sum(),
                    "approx_kl": terms["approx_kl"].sum(), "logp_diff_mean": diff.sum(),
                    "logp_diff_max": diff.max() if len(diff) else diff.new_zeros(())}
            sums |= {k: terms[k].sum() for k in ("kl", "tis") if k in terms}
            if "tis" in sums:
                sums["tis_mean"] = sums.pop("tis")
        if routed is not None:
            loss = loss + self._router_loss(mb, routed, sums)
            if self.loss_cfg.routing_replay:
                sums |= self._mismatch(mb, routed)
        return loss, sums

    def _mismatch(self, mb: MicroBatch, logits: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """`geo3k_torch.router.replay_mismatch` of a replayed micro-batch (0 for a filler)."""
        if mb.routed is None:
            zero = torch.zeros((), device=mb.targets.device)
            return {"routing_replay_mismatch": zero, "replayed_routings": zero}
        return replay_mismatch(logits, mb.routed, mb.targets, self.routing.top_k)

    @torch.no_grad()
    def _free_routing_sums(self, mb: MicroBatch) -> dict[str, torch.Tensor]:
        """Under routing replay: the distance of `mb`'s log-probs to the engine's when the
        routers route freely (one forward without gradients): sum and max over its trained
        tokens, and their count."""
        logp = self._forward(self.model, mb, False) if len(mb.targets) else mb.rollout
        diff = (logp - mb.rollout).abs()
        return {"logp_diff_mean_free": diff.sum(),
                "logp_diff_max_free": diff.max() if len(diff) else diff.new_zeros(()),
                "free_tokens": diff.new_tensor(float(len(diff)))}

    def _router_loss(self, mb: MicroBatch, logits: list[torch.Tensor],
                     sums: dict[str, torch.Tensor]) -> torch.Tensor:
        """The micro-batch's share of the step's load-balancing loss (`geo3k_torch.router`:
        its trained tokens' loss, weighted by their share of the global batch's, scaled for
        accumulation as the policy loss; 0 when `loss.router_aux_coef` is 0), its routing
        metrics added to `sums`."""
        k = len(mb.targets)
        rows = mb.routed if self.loss_cfg.routing_replay else None  # where the tokens went
        sums |= routing_sums(logits, mb.targets, self.routing.top_k, rows)
        if not k:  # a filler that trains nothing
            sums["router_aux_loss"] = torch.zeros((), device=mb.targets.device)
            return sums["router_aux_loss"]
        aux = balance_loss(logits, mb.targets, self.routing.top_k, rows)
        sums["router_aux_loss"] = aux.detach() * k  # a token sum, as the other metrics
        if not self.loss_cfg.router_aux_coef:
            return torch.zeros((), device=aux.device)
        return self.loss_cfg.router_aux_coef * aux * (k / mb.n_tokens) * self.world_size

    def _terms(self, mb: MicroBatch, logp: torch.Tensor, ref: torch.Tensor | None,
               a: int = 0, b: int | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss (scaled for accumulation) of trained tokens [a, b) of `mb` given their
        (b - a,) log-probs, and their per-token terms (`common.grpo.per_token_terms`)."""
        cut = lambda t: None if t is None else t[a:b]  # noqa: E731
        old = logp.detach() if mb.old is None else mb.old[a:b]
        terms = per_token_terms(logp, old, mb.advantages[a:b], self.loss_cfg, ref_logp=cut(ref),
                                rollout_logp=mb.rollout[a:b], xp=torch,
                                diag_logp=mb.rollout[a:b] if mb.old is None else None)
        loss = (terms.pop("loss") * mb.weights[a:b]).sum() * self.world_size
        return loss, terms

    def train_step(self, batches: Sequence[PackedBatch], n_tokens: float, n_seqs: float
                   ) -> dict[str, float]:
        """Accumulate over `batches` (this rank's share), then one optimizer step.

        n_tokens / n_seqs: masked tokens / sequences of the global batch. Returns the metrics of
        the whole step (every rank): loss, grad_norm, lr, skipped (1 if the gradients were not
        finite), and token means over all ranks of entropy, clip_frac, approx_kl, kl, tis_mean,
        logp_diff_mean, plus logp_diff_max; a MoE model's router_aux_loss, router_entropy (token
        means) and router_load_max / _min / _cv (`geo3k_torch.router.load_metrics`); under
        routing replay logp_diff_mean_free, logp_diff_max_free (each process's first
        micro-batch, routed freely) and routing_replay_mismatch (a share of routings).
        """
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        sums = self.accumulate(batches, n_tokens, n_seqs)
        grad_norm = clip_grad_norm(self.model.parameters(), self.cfg.grad_clip)
        if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP
            grad_norm = grad_norm.full_tensor()
        counts = sums.pop("router_counts", None)  # (L, E) of a MoE model
        names = sorted(sums)  # the step's one host sync: every metric and the grad norm
        values = torch.stack([sums[k].float() for k in names] + [grad_norm.float()])
        if counts is not None:
            values = torch.cat([values, counts.flatten()])
        values = values.tolist()
        host = dict(zip(names, values))
        grad_norm = values[len(names)]
        host |= {f"router_counts/{i}": v for i, v in enumerate(values[len(names) + 1:])}
        skipped = not math.isfinite(grad_norm)
        lr = self.scheduler.get_last_lr()[0]
        if skipped:  # never applied; the schedule does not advance either
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.optimizer.step()
            self.scheduler.step()
            if self.master:
                self.master.refresh()  # the step's one copy of the new weights into bf16
        host["tokens"] = float(sum(int(b.loss_mask.astype(bool).sum()) for b in batches))
        host = self.comm.sum_scalars(host, max_keys=MAX_KEYS)
        n = max(host.pop("tokens"), 1.0)
        ratios = {k: host.pop(k) / max(host.pop(count), 1.0)
                  for k, count in RATIOS.items() if k in host}
        out = {"grad_norm": grad_norm, "lr": lr, "skipped": float(skipped)}
        if counts is not None:
            out |= load_metrics(np.array([host.pop(f"router_counts/{i}")
                                          for i in range(counts.numel())]).reshape(counts.shape))
        out.update({k: (v if k == "loss" or k in MAX_KEYS else v / n)
                    for k, v in host.items()})
        return out | ratios

    def accumulate(self, batches: Sequence[PackedBatch], n_tokens: float, n_seqs: float
                   ) -> dict[str, torch.Tensor]:
        """Forward and backward over `batches`, gradients accumulated into the Parameters'
        .grad (fp32 under master weights): the metric sums of the step as 0-d device tensors
        ("loss" the step's loss; `MAX_KEYS` maxima; a MoE model's "router_counts" (L, E)).
        Under routing replay each micro-batch's forward and backward replay its routing, and the
        first one is run again without it (`_free_routing_sums`). Reads nothing back from the
        device."""
        sums: dict[str, torch.Tensor] = {}
        with self._compute():
            for i, mb in enumerate(self._micro_batches(batches, n_tokens, n_seqs)):
                with self._replaying(mb):  # a checkpointed layer's recomputation replays too
                    loss, s = self.micro_batch_loss(mb)
                    loss.backward()
                if self.loss_cfg.routing_replay and i == 0:
                    s |= self._free_routing_sums(mb)
                self._add(sums, s, loss)
        if self.master:
            self.master.grads_to_params()
        if not sums:
            zero = torch.zeros((), device=self.device)
            sums = {"loss": zero, "logp_diff_max": zero}
        return sums

    def _add(self, sums: dict[str, torch.Tensor], s: dict[str, torch.Tensor],
             loss: torch.Tensor) -> None:
        """One micro-batch's metric sums `s` and `loss` added into the step's `sums`."""
        s["loss"] = loss.detach() / self.world_size
        for k, v in s.items():
            if k not in sums:
                sums[k] = v
            elif k in MAX_KEYS:
                sums[k] = torch.maximum(sums[k], v)
            else:
                sums[k] = sums[k] + v

    @torch.no_grad()
    def logprobs(self, batches: Sequence[PackedBatch]) -> list[np.ndarray]:
        """(T,) log-probs of each micro-batch's masked tokens at the current weights (0 off the
        mask): the behaviour policy when several updates share one rollout."""
        self.model.eval()
        with self._compute():
            got = []
            for mb in self._micro_batches(batches):
                with self._replaying(mb):
                    got.append(self._forward(self.model, mb, False))
        out = []
        for batch, logp in zip(batches, got):  # read back once the device has them all
            full = np.zeros(batch.num_tokens, np.float32)
            full[np.nonzero(batch.loss_mask)[0]] = logp.float().cpu().numpy()
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
        if self.master:
            self.master.refresh()


def is_sharded(model) -> bool:
    """Whether `model` is FSDP2-wrapped (its parameters DTensors)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


class SFTLearner(Learner):
    """The torch learner with the supervised loss: -sum(log p(masked tokens)) / global count.
    Optimizer, schedule, clipping, checkpoints and exports are the GRPO learner's."""

    def __init__(self, model, processor, train_cfg, device: torch.device | str = "cpu",
                 comm: Collectives = SingleProcess(), model_dir: str | None = None):
        super().__init__(model, processor, LossConfig(), train_cfg, 1.0, device, comm=comm,
                         model_dir=model_dir)

    def micro_batch_loss(self, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logp, entropy = self._forward(self.model, mb, True)  # (K,), (K,)
        loss = -logp.sum() / mb.n_tokens * self.world_size  # FSDP averages over ranks
        return loss, {"entropy": entropy.sum()}


def sft_step(learner: SFTLearner, seqs: Sequence[TrainSequence], micro_batch_tokens: int,
             comm: Collectives = SingleProcess()) -> dict[str, float]:
    """One optimizer step on this process's sequences. Returns loss (mean NLL per assistant
    token of the global batch), grad_norm, lr, skipped, entropy, tokens."""
    counts = comm.sum_scalars({"tokens": sum(float(s.loss_mask.sum()) for s in seqs),
                               "seqs": float(len(seqs))})
    m = learner.train_step(pack(seqs, micro_batch_tokens), counts["tokens"], counts["seqs"])
    m.pop("logp_diff_max", None)  # no rollout log-probs in SFT
    return {**m, "tokens": counts["tokens"]}
