"""A MoE model's routing in the learner's forward: the load-balancing loss and the load metrics.

Qwen3-VL-MoE routes each token of a sparse decoder layer to its top-k experts by a softmax over
the router's logits (transformers' `Qwen3VLMoeTextTopKRouter`). `Routing` keeps every router's
(T, E) logits of one packed forward (a forward hook on each router, installed once, keeps its
router's output on the router; it records only inside `recording()`, so an activation-
checkpointed layer's recomputation in the backward pass adds nothing; one hook and no growing
list, so that every compiled decoder layer is one graph, `geo3k_torch.model.compile_layers`),
and reads them at the trained tokens (the loss mask's K positions):

    routing = Routing.of(model)                   # None for a dense model
    with routing.recording() as logits:           # logits: [(T, E)] per sparse layer, at exit
        logp = token_logprobs(model, inputs, targets)
    aux = balance_loss(logits, targets, top_k)    # 0-d, with gradient to the routers
    sums = routing_sums(logits, targets, top_k)   # entropy sum (0-d), counts (L, E)

`balance_loss` is Switch Transformer's auxiliary loss as transformers computes it
(`load_balancing_loss_func`: E x sum_e f_e P_e, f_e the top-k assignments to expert e per token
and P_e its mean router probability; k when balanced) for each layer over the trained tokens,
averaged over the layers; the learner weights each micro-batch's by its trained tokens. (transformers' own call pools the layers' fractions first,
which lets one layer's imbalance cancel another's.) `load_metrics` turns the step's counts into
scalars: E x the largest and smallest fraction of a layer's assignments an expert took (1 and 1
when balanced; 0 for an expert no trained token reached) and their coefficient of variation over
experts, averaged over the layers.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch


class Routing:
    """Records the router logits of `model`'s sparse MoE blocks (see the module docstring)."""

    def __init__(self, model):
        text = model.model.language_model
        self.routers = [layer.mlp.gate for layer in text.layers if hasattr(layer.mlp, "experts")]
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no sparse MoE blocks")
        config = model.config.get_text_config()
        self.top_k = config.num_experts_per_tok
        self.active = False
        for router in self.routers:
            router.register_forward_hook(self._record)

    @classmethod
    def of(cls, model) -> Routing | None:
        """`Routing(model)` for a MoE model, None for a dense one."""
        return cls(model) if getattr(model.config.get_text_config(), "num_experts", 0) else None

    def _record(self, module, args, output) -> None:
        if self.active:
            module.recorded_logits = output[0]  # (T, E): the router's logits

    @contextlib.contextmanager
    def recording(self):
        """Yields a list that holds, once the block exits, the (T, E) router logits of each
        sparse layer of the forward inside (in layer order)."""
        out: list[torch.Tensor] = []
        self.active = True
        try:
            yield out
        finally:
            self.active = False
            out.extend(r.__dict__.pop("recorded_logits") for r in self.routers
                       if "recorded_logits" in r.__dict__)


def balance_loss(logits: list[torch.Tensor], targets: torch.Tensor, top_k: int) -> torch.Tensor:
    """The load-balancing loss over the tokens at row positions `targets` (K,): transformers'
    `load_balancing_loss_func` of each layer's (K, E) logits, averaged over the L layers. 0-d
    fp32."""
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import load_balancing_loss_func

    per_layer = [load_balancing_loss_func((x[targets].float(),), x.shape[-1], top_k)
                 for x in logits]
    return torch.stack(per_layer).mean()


@torch.no_grad()
def routing_sums(logits: list[torch.Tensor], targets: torch.Tensor, top_k: int
                 ) -> dict[str, torch.Tensor]:
    """At the trained tokens `targets` (K,): `router_entropy`, the sum over tokens of the router
    distribution's entropy (nats) averaged over the L layers (0-d), and `router_counts`, how
    many of the tokens each layer routed to each expert (L, E) fp32."""
    x = torch.stack([layer[targets].float() for layer in logits])  # (L, K, E)
    logp = torch.log_softmax(x, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1).mean(0).sum()
    chosen = torch.zeros_like(x).scatter_(-1, x.topk(top_k, dim=-1).indices, 1.0)
    return {"router_entropy": entropy, "router_counts": chosen.sum(1)}


def load_metrics(counts: np.ndarray) -> dict[str, float]:
    """counts (L, E): a step's top-k assignments per layer and expert -> router_load_max,
    router_load_min (E x the largest / smallest fraction of a layer's assignments that one expert
    took, over all layers: 1 when balanced) and router_load_cv (the fractions' coefficient of
    variation over experts, averaged over layers: 0 when balanced)."""
    counts = np.asarray(counts, np.float64)
    frac = counts / np.maximum(counts.sum(-1, keepdims=True), 1.0)  # (L, E)
    share = frac * counts.shape[-1]
    return {"router_load_max": float(share.max()), "router_load_min": float(share.min()),
            "router_load_cv": float((frac.std(-1) / np.maximum(frac.mean(-1), 1e-12)).mean())}
