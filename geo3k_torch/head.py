"""The LM head fused with the loss: log-probs, entropies and the loss's gradient in one pass.

`token_logprobs` (geo3k_torch.model) computes the head's (chunk, vocab) logits, returns
log-probs, and lets autograd keep what the backward pass needs: with chunks, it checkpoints each
one and computes the head again in the backward pass. Here the loss is known before the backward
pass (its per-token constants are all in the micro-batch), so each chunk's gradient is formed at
once, in the forward pass, and nothing but two gradients is kept:

    for each chunk of c trained tokens:   z = h W^T (c, V) -> log softmax(z / T) -> loss(chunk)
        dz = d loss / d z                 (autograd over the chunk's fp32 logits alone)
        dh[chunk] = dz W ;  dW += dz^T h  (the head's two matmuls, as autograd would form them)
    backward: grad_output x (dh, dW)      (no logits, no recomputation)

`fused_loss(model, inputs, targets, ...)` runs the model with its head swapped for `FusedHead`
(inside the root forward, so FSDP2's hooks gather and reduce the head's weight as for a plain
head) and returns the micro-batch's loss and the per-token values the metrics need. Memory: the
fp32 (c, V) logits of one chunk at a time, dh (K, hidden) and an fp32 copy of the head's
gradient (V, hidden).
"""

from __future__ import annotations

from typing import Callable

import torch

# chunk_loss(logp, start, stop) -> (loss, values): the loss summed over trained tokens
# [start, stop) of the micro-batch given their (stop - start,) fp32 log-probs (with gradient),
# and per-token values (detached) to report.
ChunkLoss = Callable[[torch.Tensor, int, int], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def fused_loss(model, inputs: dict, targets: torch.Tensor, temperature: float, chunk: int,
               chunk_loss: ChunkLoss) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of a packed micro-batch whose trained tokens sit at row positions `targets`
    (K,), `chunk` tokens at a time (0: all at once), and its (K,) per-token values: `logp`,
    `entropy` and what `chunk_loss` reports, all detached. The loss's gradient reaches the
    model through `backward()` as usual."""
    ids = inputs["input_ids"][0, targets]
    head = model.lm_head
    fused = FusedHead(head, ids, temperature, chunk or len(targets), chunk_loss)
    model.lm_head = fused
    try:
        loss = model(**inputs, use_cache=False, logits_to_keep=targets - 1).logits
    finally:
        model.lm_head = head
    return loss, {k: torch.cat(v) if v else torch.zeros(0, device=targets.device)
                  for k, v in fused.values.items()}


class FusedHead(torch.nn.Module):
    """Stands in for the LM head during one forward: (1, K, hidden) -> the 0-d loss. Collects
    the chunks' per-token values in `values` (name -> list of (c,) tensors)."""

    def __init__(self, head: torch.nn.Linear, ids: torch.Tensor, temperature: float,
                 chunk: int, chunk_loss: ChunkLoss):
        super().__init__()
        if getattr(head, "bias", None) is not None:
            raise ValueError("the fused LM head takes a head without a bias (every Qwen-VL's)")
        self.head, self.ids, self.temperature, self.chunk = head, ids, temperature, chunk
        self.chunk_loss = chunk_loss
        self.values: dict[str, list[torch.Tensor]] = {}

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return _FusedLoss.apply(hidden, self.head.weight, self)


class _FusedLoss(torch.autograd.Function):
    """hidden (1, K, H), weight (V, H) -> the 0-d loss; the gradients formed in the forward."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, fused: FusedHead):
        h = hidden[0]  # (K, H)
        d_hidden = torch.empty_like(hidden)
        d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for a in range(0, h.shape[0], fused.chunk):
            b = min(a + fused.chunk, h.shape[0])
            with torch.enable_grad():
                # the head's output as a plain head gives it (its dtype), then fp32
                z = (h[a:b] @ weight.t()).float().requires_grad_()  # (c, V)
                logp_all = torch.log_softmax(z / fused.temperature, dim=-1)
                logp = logp_all.gather(-1, fused.ids[a:b, None])[:, 0]
                part, values = fused.chunk_loss(logp, a, b)
                dz, = torch.autograd.grad(part, z)
            loss += part.detach()
            g = dz.to(weight.dtype)
            d_hidden[0, a:b] = g @ weight
            d_weight += (g.t() @ h[a:b]).float()
            entropy = -(logp_all.detach().exp() * logp_all.detach()).sum(-1)
            for k, v in {"logp": logp.detach(), "entropy": entropy, **values}.items():
                fused.values.setdefault(k, []).append(v.detach())
        ctx.save_for_backward(d_hidden, d_weight)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        d_hidden, d_weight = ctx.saved_tensors
        return d_hidden * grad.to(d_hidden.dtype), (d_weight * grad).to(ctx.weight_dtype), None
