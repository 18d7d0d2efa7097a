"""A MoE model's routing in the learner's forward (the load-balancing loss, the load metrics,
routing replay) and the engine's record of it.

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
averaged over the layers (under replay, f_e and the load metrics count the replayed experts,
where the tokens went); the learner weights each micro-batch's by its trained tokens. (transformers' own call pools the layers' fractions first,
which lets one layer's imbalance cancel another's.) `load_metrics` turns the step's counts into
scalars: E x the largest and smallest fraction of a layer's assignments an expert took (1 and 1
when balanced; 0 for an expert no trained token reached) and their coefficient of variation over
experts, averaged over the layers.

Routing replay (`loss.routing_replay`, Rollout Routing Replay: Ma et al. 2025): inside
`replaying(rows)` the same hook makes each router return the experts the engine chose, rows
(T, L, K), in place of its own top-k (`replayed_choice`; a row of -1 routes freely), and their
softmax probabilities renormalised as transformers renormalises its top-k, so the router's
weights still learn through them. The rows stay on the routers until the block exits, so wrap
the backward pass too: an activation-checkpointed layer's recomputation must replay the same
experts (a compiled layer keeps them as an input of its graph). `replay_mismatch` counts the
(token, layer) routings where the router's own top-k differs from the replayed one. The local
engine records what each router chose in a prefill with `recording(experts=True)` ((T, K) per
sparse layer); one `Routing` per model (`of`), so an engine sharing the learner's model adds no
second hook.

    with routing.replaying(rows):                 # rows: (T, L, K) on the device, -1: free
        loss = ...forward...; loss.backward()     # the recomputation replays too
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch


class Routing:
    """Records (and replays) the routing of `model`'s sparse MoE blocks (see the module
    docstring). One per model (`of`): a learner and an engine on the same model share it."""

    def __init__(self, model):
        text = model.model.language_model
        self.routers = [layer.mlp.gate for layer in text.layers if hasattr(layer.mlp, "experts")]
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no sparse MoE blocks")
        config = model.config.get_text_config()
        self.top_k = config.num_experts_per_tok
        self.active, self.part = False, 0  # recording; what: 0 logits, 2 chosen experts
        for router in self.routers:
            router.replayed = None  # (T, K) experts to route to (`replaying`)
            router.register_forward_hook(self._hook)

    @classmethod
    def of(cls, model) -> Routing | None:
        """The `Routing` of a MoE model (made at the first call, kept on the model), None for a
        dense one."""
        if not getattr(model.config.get_text_config(), "num_experts", 0):
            return None
        if "_routing" not in model.__dict__:
            model._routing = cls(model)
        return model._routing

    def _hook(self, module, args, output):
        replayed = module.replayed
        if replayed is not None:
            scores, experts = replayed_choice(output[0], output[2], replayed)
            output = (output[0], scores, experts)
        if self.active:
            module.recorded = output[self.part]
        return None if replayed is None else output

    @contextlib.contextmanager
    def recording(self, experts: bool = False):
        """Yields a list that holds, once the block exits, the (T, E) router logits of each
        sparse layer of the forward inside (in layer order), or with `experts` the (T, K)
        experts each routed its tokens to (int64)."""
        out: list[torch.Tensor] = []
        self.active, self.part = True, 2 if experts else 0
        try:
            yield out
        finally:
            self.active = False
            out.extend(r.__dict__.pop("recorded") for r in self.routers
                       if "recorded" in r.__dict__)

    @contextlib.contextmanager
    def replaying(self, rows: torch.Tensor | None):
        """Inside, the router of sparse layer l routes token t to the experts rows[t, l] (rows:
        (T, L, K) integers on the model's device, T the forward's tokens; a row of -1 routes
        freely); None: every router routes freely. Nests: the previous rows come back at
        exit."""
        if rows is not None and tuple(rows.shape[1:]) != (len(self.routers), self.top_k):
            raise ValueError(f"replayed routing of shape {tuple(rows.shape)} for a model of "
                             f"{len(self.routers)} sparse layers, top {self.top_k}")
        before = [r.replayed for r in self.routers]
        for i, r in enumerate(self.routers):
            r.replayed = None if rows is None else rows[:, i]
        try:
            yield
        finally:
            for r, b in zip(self.routers, before):
                r.replayed = b


def replayed_choice(logits: torch.Tensor, free: torch.Tensor, rows: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """A router's choice with `rows` replayed: logits (T, E), its own top-k `free` (T, K) int64,
    rows (T, K) integers (-1 rows: keep `free`). Returns (scores (T, K) in the logits' dtype, the
    softmax probabilities at the chosen experts over their sum, as transformers'
    `Qwen3VLMoeTextTopKRouter` computes its top-k's; experts (T, K) int64). Where the rows equal
    `free` (same order), both are bitwise the router's own."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    experts = torch.where(rows[:, :1] >= 0, rows.long(), free)
    top = probs.gather(-1, experts)
    return (top / top.sum(-1, keepdim=True)).to(logits.dtype), experts


@torch.no_grad()
def replay_mismatch(logits: list[torch.Tensor], rows: torch.Tensor, targets: torch.Tensor,
                    top_k: int) -> dict[str, torch.Tensor]:
    """At the trained tokens `targets` (K,) of a replayed forward, given each sparse layer's
    (T, E) logits and the replayed rows (T, L, top_k): `routing_replay_mismatch`, how many
    (token, layer) routings the router's own top-k would have sent to another set of experts
    than the replayed one, and `replayed_routings`, how many were replayed (rows not -1); 0-d
    fp32 each."""
    x = torch.stack([layer[targets].float() for layer in logits])  # (L, K, E)
    free = x.topk(top_k, dim=-1).indices.sort(-1).values
    replayed = rows[targets].transpose(0, 1).long().sort(-1).values  # (L, K, top_k)
    known = replayed[..., -1] >= 0
    differ = (free != replayed).any(-1) & known
    return {"routing_replay_mismatch": differ.sum().float(),
            "replayed_routings": known.sum().float()}


def chosen_experts(logits: list[torch.Tensor], targets: torch.Tensor, top_k: int,
                   rows: torch.Tensor | None = None) -> torch.Tensor:
    """The experts each sparse layer sent the tokens at `targets` (K,) to: (L, K, top_k) int64,
    the router's own top-k of its (T, E) logits, or under replay the replayed rows (T, L, top_k;
    a row of -1 routed freely)."""
    free = torch.stack([layer[targets].topk(top_k, dim=-1).indices for layer in logits])
    if rows is None:
        return free
    replayed = rows[targets].transpose(0, 1).long()
    return torch.where(replayed[..., :1] >= 0, replayed, free)


def balance_loss(logits: list[torch.Tensor], targets: torch.Tensor, top_k: int,
                 rows: torch.Tensor | None = None) -> torch.Tensor:
    """The load-balancing loss over the tokens at row positions `targets` (K,), as transformers'
    `load_balancing_loss_func` computes it for one layer (E x sum_e f_e P_e), of each layer's
    (K, E) logits, averaged over the L layers; f_e counts the experts the tokens went to
    (`chosen_experts`: the replayed ones under replay, where transformers' would count the
    router's own top-k). 0-d fp32, its gradient through P to the routers."""
    probs = torch.softmax(torch.stack([x[targets].float() for x in logits]), dim=-1)  # (L, K, E)
    chosen = chosen_experts(logits, targets, top_k, rows)
    f = torch.zeros_like(probs).scatter_(-1, chosen, 1.0).mean(1)  # (L, E)
    return (probs.shape[-1] * (f * probs.mean(1)).sum(-1)).mean()


@torch.no_grad()
def routing_sums(logits: list[torch.Tensor], targets: torch.Tensor, top_k: int,
                 rows: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """At the trained tokens `targets` (K,): `router_entropy`, the sum over tokens of the router
    distribution's entropy (nats) averaged over the L layers (0-d), and `router_counts`, how
    many of the tokens each layer sent to each expert (L, E) fp32 (`chosen_experts`: the
    replayed experts under replay)."""
    x = torch.stack([layer[targets].float() for layer in logits])  # (L, K, E)
    logp = torch.log_softmax(x, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1).mean(0).sum()
    chosen = torch.zeros_like(x).scatter_(-1, chosen_experts(logits, targets, top_k, rows), 1.0)
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
