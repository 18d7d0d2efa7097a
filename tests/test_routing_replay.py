"""Routing replay (`loss.routing_replay`) in the torch learner: on micro-batches whose engine routed
some tokens to other experts than the learner's routers would, the replaying learner's log-probs
are the engine's, and without replay they are not; replaying the learner's own routing changes
nothing; the router still learns; checkpointing, the fused head, shared prompts and compiled
layers replay the same experts.

The "engine" here is the tiny MoE model itself with its routers' top-k flipped at near ties (a
token whose k-th and (k+1)-th expert probabilities lie within `TIE` of each other goes to the
(k+1)-th, scores from the same softmax): what bf16 numerics or another batch composition do to an
engine's routing, with everything else equal, so that a replaying learner must match it to fp32
rounding while a free one cannot.
"""

import dataclasses

import numpy as np
import pytest
import torch

from common.batching import pack
from common.grpo import LossConfig
from geo3k_torch.model import load_model, packed_inputs, token_logprobs
from geo3k_torch.router import Routing, replayed_choice
from tests.test_learners import LOSS, step, tiny_setup, torch_learner, train_config
from tests.tiny_models import qwen3_vl, qwen3_vl_moe

TIE = 0.005  # near ties a flipping engine breaks the other way (probabilities)
REPLAY = dataclasses.replace(LOSS, routing_replay=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_setup(qwen3_vl_moe, tmp_path_factory.mktemp("tiny_moe_replay"))


def flip_near_ties(model):
    """`model`'s routers send a token whose k-th and (k+1)-th probabilities differ by less than
    TIE to the (k+1)-th expert in place of the k-th (the engine of the module docstring)."""
    def hook(module, args, output):
        logits, _, free = output
        probs = torch.softmax(logits, -1, dtype=torch.float)
        order = probs.argsort(-1, descending=True)
        k = free.shape[1]
        gap = probs.gather(-1, order[:, k - 1:k + 1])
        near = (gap[:, 0] - gap[:, 1] < TIE)[:, None]
        chosen = torch.cat([order[:, :k - 1], torch.where(near, order[:, k:k + 1],
                                                          order[:, k - 1:k])], -1)
        scores, experts = replayed_choice(logits, free, chosen)
        return logits, scores, experts

    for layer in model.model.language_model.layers:
        layer.mlp.gate.register_forward_hook(hook)
    return model


def engine_rollouts(tiny, batches=None, flip=True):
    """`batches` (the tiny ones) as an engine would hand them over: the rollout log-probs and
    routed experts (T, L, K) of the flipping engine's packed forward, and the number of
    (token, layer) routings where it flipped (its choice against the free top-k)."""
    model = load_model(tiny["path"])
    if flip:
        flip_near_ties(model)
    routing = Routing.of(model)  # after the flip: it records the engine's choice
    out, flips = [], 0
    for b in batches or tiny["batches"]:
        targets = torch.from_numpy(np.flatnonzero(b.loss_mask))
        with torch.no_grad(), routing.recording(experts=True) as chosen:
            logp = token_logprobs(model, packed_inputs(b, tiny["processor"], model.config),
                                  targets)
        with torch.no_grad(), routing.recording() as logits:
            token_logprobs(model, packed_inputs(b, tiny["processor"], model.config), targets)
        rows = torch.stack(chosen, 1)  # (T, L, K)
        free = torch.stack([x.topk(2).indices for x in logits], 1)
        flips += int((rows.sort(-1).values != free.sort(-1).values).any(-1).sum())
        rollout = np.zeros(b.num_tokens, np.float32)
        rollout[targets.numpy()] = logp.numpy()
        out.append(dataclasses.replace(b, rollout_logprobs=rollout,
                                       routed_experts=rows.numpy().astype(np.int16)))
    return out, flips


@pytest.fixture(scope="module")
def rollouts(tiny):
    return engine_rollouts(tiny)


def learner_logprobs(learner, batches) -> np.ndarray:
    return np.concatenate([lp[b.loss_mask > 0] for lp, b in zip(learner.logprobs(batches),
                                                                  batches)])


def rollout_logprobs(batches) -> np.ndarray:
    return np.concatenate([b.rollout_logprobs[b.loss_mask > 0] for b in batches])


def test_replaying_learner_matches_the_engine_where_free_routing_does_not(tiny, rollouts):
    """The issue's done-when: the flipping engine routes some trained and prompt tokens
    elsewhere (measured: 68 of its 396 (token, layer) routings); the replaying learner's
    log-probs equal its rollout log-probs to fp32 rounding (measured: 0, the same arithmetic),
    the free one's differ by far more (measured: at most 0.013), and the step's metrics say both
    (replayed and free mismatch, the share of trained routings replayed against the router's
    own choice)."""
    batches, flips = rollouts
    assert flips > 0
    engine = rollout_logprobs(batches)
    replayed = learner_logprobs(torch_learner(tiny, loss=REPLAY), batches)
    free = learner_logprobs(torch_learner(tiny), batches)
    gap, free_gap = np.abs(replayed - engine).max(), np.abs(free - engine).max()
    print(f"flips {flips}; max |logp - engine| replayed {gap:.3g}, free {free_gap:.3g}")
    assert gap <= 1e-6 and free_gap > 1e-3

    m = torch_learner(tiny, loss=REPLAY).train_step(batches, tiny["n_tokens"], tiny["n_seqs"])
    assert m["logp_diff_max"] <= 1e-6 and m["logp_diff_mean"] <= 1e-7
    first = batches[0].loss_mask > 0
    d = np.abs(free[:first.sum()] - engine[:first.sum()])  # the free forward: the first batch
    assert m["logp_diff_max_free"] == pytest.approx(d.max(), abs=1e-6)
    assert m["logp_diff_mean_free"] == pytest.approx(d.mean(), abs=1e-6)
    rows = np.concatenate([b.routed_experts[b.loss_mask > 0] for b in batches])  # (K, L, 2)
    free_rows = free_choice(tiny, batches)
    differ = (np.sort(rows, -1) != np.sort(free_rows, -1)).any(-1)
    assert 0 < m["routing_replay_mismatch"] == pytest.approx(differ.mean(), abs=1e-7)


def test_the_kl_reference_replays_the_same_experts(tiny, rollouts):
    """A reference with the policy's weights: routed as the policy is (the engine's experts),
    its log-probs are the policy's and the KL term is 0; routing freely it would differ where
    the engine flipped."""
    from geo3k_torch.learner import Learner

    batches, _ = rollouts
    loss = dataclasses.replace(REPLAY, kl_coef=0.1)
    learner = Learner(load_model(tiny["path"]), tiny["processor"], loss, train_config(), 1.0,
                      ref_model=load_model(tiny["path"]), model_dir=tiny["path"])
    m = learner.train_step(batches, tiny["n_tokens"], tiny["n_seqs"])
    assert m["kl"] == 0.0


def free_choice(tiny, batches) -> np.ndarray:
    """(K, L, top_k) the learner's own top-k at the trained tokens of `batches`, computed under
    the replayed routing (the router's choice given the replayed hidden states)."""
    model = load_model(tiny["path"])
    routing = Routing.of(model)
    out = []
    for b in batches:
        targets = torch.from_numpy(np.flatnonzero(b.loss_mask))
        with torch.no_grad(), routing.replaying(torch.from_numpy(b.routed_experts)), \
                routing.recording() as logits:
            token_logprobs(model, packed_inputs(b, tiny["processor"], model.config), targets)
        out.append(torch.stack([x[targets].topk(2).indices for x in logits], 1).numpy())
    return np.concatenate(out)


def test_replaying_the_learners_own_routing_changes_nothing(tiny):
    """Rows equal to the free routing (in the router's order): the same step bit for bit,
    loss, metrics and weights; all-(-1) rows route freely, the same again."""
    own, _ = engine_rollouts(tiny, flip=False)
    unknown = [dataclasses.replace(b, routed_experts=np.full_like(b.routed_experts, -1))
               for b in own]
    plain = torch_learner(tiny)
    m0 = plain.train_step(own, tiny["n_tokens"], tiny["n_seqs"])
    for batches in (own, unknown):
        learner = torch_learner(tiny, loss=REPLAY)
        m = learner.train_step(batches, tiny["n_tokens"], tiny["n_seqs"])
        for k, v in m0.items():
            assert m[k] == v, k
        assert all(torch.equal(p, q) for p, q in zip(learner.model.parameters(),
                                                     plain.model.parameters()))
    assert m["routing_replay_mismatch"] == 0 and m["logp_diff_max_free"] <= 1e-6


def test_the_router_learns_through_the_replayed_scores(tiny, rollouts):
    """Under replay the routers' weights get the gradient of the engine's own function (the
    flipping model's, whose choice the rows are): equal to 1e-6 relative, and not zero."""
    batches, _ = rollouts
    learner = torch_learner(tiny, loss=REPLAY)
    learner.model.train()
    learner.optimizer.zero_grad()
    learner.accumulate(batches, tiny["n_tokens"], tiny["n_seqs"])
    engine = flip_near_ties(load_model(tiny["path"]))
    reference = torch_learner(tiny)
    reference.model = engine
    reference.routing = Routing.of(engine)
    reference.accumulate(batches, tiny["n_tokens"], tiny["n_seqs"])
    grads = {n: p.grad for n, p in engine.named_parameters()}
    routers = [n for n, _ in learner.model.named_parameters() if n.endswith("mlp.gate.weight")]
    assert len(routers) == 2
    for n, p in learner.model.named_parameters():
        g = grads[n]
        assert (p.grad - g).norm() <= 1e-6 * g.norm() + 1e-9, n
    assert all(grads[n].norm() > 0 for n in routers)


@pytest.mark.parametrize("variant", ["checkpointing", "fused_head"])
def test_checkpointing_and_the_fused_head_replay_the_same_experts(tiny, rollouts, variant):
    """Full activation checkpointing recomputes each layer in the backward pass with the same
    replayed experts (else other gradients), and the fused head's forward replays as the plain
    one: the same step to 1e-6."""
    from geo3k_torch.model import checkpoint_layers

    batches, _ = rollouts
    m0 = torch_learner(tiny, loss=REPLAY).train_step(batches, tiny["n_tokens"], tiny["n_seqs"])
    learner = torch_learner(tiny, loss=REPLAY)
    if variant == "checkpointing":
        checkpoint_layers(learner.model, "full")
    else:
        learner.fused_head = True
    m = learner.train_step(batches, tiny["n_tokens"], tiny["n_seqs"])
    for k, v in m0.items():
        assert m[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k


def test_a_shared_prompt_replays_its_first_samples_routing(tiny):
    """Samples of one group packed behind one copy of their prompt (`pack` with the image
    token): the engine routed each sample on its own, and the replaying learner's log-probs
    on the shared layout are the engine's."""
    from tests.test_jax_model import sequences
    from tests.tiny_models import IMG

    seqs = sequences(tiny["processor"], np.random.default_rng(5), 3)
    group = [dataclasses.replace(seqs[2], token_ids=np.concatenate([seqs[2].token_ids[:-3],
                                                                     [7 + i, 8, 9]]),
                                 traj_index=i) for i in range(3)]
    alone = pack(group, 10_000)  # one sequence after another: the engine's view
    singles = []
    for s in group:
        (b,) = engine_rollouts(tiny, pack([s], 10_000))[0]
        singles.append(dataclasses.replace(s, rollout_logprobs=b.rollout_logprobs,
                                           routed_experts=b.routed_experts))
    (shared,) = pack(singles, 10_000, image_token_id=IMG)
    assert shared.num_tokens < sum(b.num_tokens for b in alone)  # the prompt once
    got = learner_logprobs(torch_learner(tiny, loss=REPLAY), [shared])
    assert np.abs(got - rollout_logprobs([shared])).max() <= 1e-6


def test_routing_replay_needs_a_moe_model():
    from geo3k_torch.learner import Learner
    from tests.jax_learner_setup import train_config

    with pytest.raises(ValueError, match="routing_replay needs a MoE model"):
        Learner(qwen3_vl()[0], None, LossConfig(routing_replay=True), train_config(), 1.0)


def test_a_replaying_learner_refuses_rollouts_without_routing(tiny):
    with pytest.raises(ValueError, match="carry no routed experts"):
        torch_learner(tiny, loss=REPLAY).train_step(tiny["batches"], tiny["n_tokens"],
                                                    tiny["n_seqs"])


@pytest.mark.slow  # compiles
def test_compiled_layers_replay_without_a_graph_per_micro_batch(tiny, rollouts):
    """train.compile with selective checkpointing: the replaying step equals the eager one
    (metrics included) without graph breaks, and its micro-batches of three lengths compile no
    graph per length: once the free forward has met both kinds of first micro-batch (another
    step in reverse order: a no-grad graph with and without images), a step compiles nothing
    new (the replayed rows are an input of each layer's graph, their length dynamic)."""
    from torch._dynamo.utils import counters

    from geo3k_torch.model import compile_layers

    batches, _ = rollouts
    eager = torch_learner(tiny, loss=REPLAY).train_step(batches, tiny["n_tokens"],
                                                         tiny["n_seqs"])
    torch._dynamo.reset()
    counters.clear()
    learner = torch_learner(tiny, loss=REPLAY)
    compile_layers(learner.model, "selective", backend="aot_eager")
    compiled = learner.train_step(batches, tiny["n_tokens"], tiny["n_seqs"])
    assert not counters["graph_break"]
    assert compiled.keys() == eager.keys()
    for k, v in eager.items():
        assert compiled[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    learner.train_step(batches[::-1], tiny["n_tokens"], tiny["n_seqs"])
    graphs = counters["stats"]["unique_graphs"]
    learner.train_step(batches, tiny["n_tokens"], tiny["n_seqs"])
    assert counters["stats"]["unique_graphs"] == graphs and not counters["graph_break"]


def test_the_local_engines_routing_replayed_gives_its_logprobs(tiny):
    """End to end through the local engine (greedy, its own decode step and KV cache) on the
    flipping model: the completions' recorded routing, replayed, brings the learner's log-probs
    to the engine's within the decode step's fp32 rounding (measured: at most 4.8e-7), where
    free routing leaves them far off (measured: at most 0.0088)."""
    from common.batching import TrainSequence
    from geo3k_torch.engine import LocalEngine
    from tests.test_torch_engine_fast import make_requests

    engine = LocalEngine(flip_near_ties(load_model(tiny["path"])), tiny["processor"], 0,
                         record_routing=True)
    reqs = make_requests(tiny["processor"], 2, n=4)
    seqs = []
    for i, (r, c) in enumerate(zip(reqs, engine.generate(reqs))):
        n, new = len(r.input_ids), len(c.token_ids)
        unfed = np.full((1,) + c.routed_experts.shape[1:], -1, np.int16)  # the last token
        seqs.append(TrainSequence(
            np.array(list(r.input_ids) + list(c.token_ids)), np.r_[np.zeros(n), np.ones(new)],
            np.r_[np.zeros(n), c.logprobs].astype(np.float32), 1.0, list(r.images), i,
            routed_experts=np.concatenate([c.routed_experts, unfed])))
    batches = pack(seqs, 10_000)
    engine_logp = rollout_logprobs(batches)
    replayed = np.abs(learner_logprobs(torch_learner(tiny, loss=REPLAY), batches) - engine_logp)
    free = np.abs(learner_logprobs(torch_learner(tiny), batches) - engine_logp)
    print(f"local engine: max |logp - engine| replayed {replayed.max():.3g}, free "
          f"{free.max():.3g}")
    assert replayed.max() <= 1e-5 and free.max() > 1e-3


@pytest.mark.slow  # two GRPO steps of the loop
def test_grpo_steps_through_the_loop_replay_the_local_engines_routing(tmp_path):
    """configs/cpu.py's loop on a tiny MoE checkpoint with routing replay: the local engine
    records, the rollouts carry its rows through packing, and the learner replays them: the
    replayed mismatch is fp32 rounding's (the engine's decode step against the packed forward)
    and the metrics of the free forward are reported."""
    import json

    from geo3k_torch import main as train_main
    from tests.test_train_loop import small_config

    cfg = small_config(tmp_path, 2)
    cfg.model.tiny_arch, cfg.model.tiny_dir = "qwen3_vl_moe", str(tmp_path / "tiny_moe")
    cfg.loss.routing_replay = True
    train_main.train(cfg, str(tmp_path / "run"))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in trained] == [1, 2]
    for r in trained:
        print({k: v for k, v in r.items() if "diff" in k or "replay" in k})
        assert np.isfinite(r["train/loss"]) and r["train/logp_diff_max"] <= 1e-4
        assert r["train/logp_diff_max_free"] >= 0 and 0 <= r["train/routing_replay_mismatch"] <= 1


def _switch(probs: np.ndarray, chosen: np.ndarray) -> float:
    """One layer's load-balancing loss: probs (K, E), chosen (K, k) experts."""
    f = np.bincount(chosen.ravel(), minlength=probs.shape[1]) / len(probs)
    return float(probs.shape[1] * (f * probs.mean(0)).sum())


def test_the_balance_loss_and_load_metrics_count_the_replayed_experts(tiny, rollouts):
    """Under replay the load-balancing loss's assignment fractions and the load metrics count the
    experts the tokens went to (the engine's rows), not the learner's own top-k, which differ
    here; the router probabilities are those of the replayed forward."""
    batches, flips = rollouts
    assert flips > 0
    loss = dataclasses.replace(REPLAY, router_aux_coef=0.5)
    m = torch_learner(tiny, loss=loss).train_step(batches, tiny["n_tokens"], tiny["n_seqs"])
    model = load_model(tiny["path"])
    aux = {"replayed": 0.0, "free": 0.0}
    counts = {"replayed": np.zeros((2, 4)), "free": np.zeros((2, 4))}
    for b in batches:  # the router logits of the replayed forward (layer 2's follow layer 1's)
        with torch.no_grad(), Routing.of(model).replaying(torch.from_numpy(b.routed_experts)):
            out = model.model(**packed_inputs(b, tiny["processor"], model.config),
                              output_router_logits=True)
        t = np.flatnonzero(b.loss_mask)
        per_layer = {"replayed": [], "free": []}
        for layer, x in enumerate(out.router_logits):
            x = x.double().numpy()[t]
            p = np.exp(x - x.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            for name, chosen in (("replayed", b.routed_experts[t, layer].astype(np.int64)),
                                 ("free", np.argsort(-p, -1)[:, :2])):
                per_layer[name].append(_switch(p, chosen))
                counts[name][layer] += np.bincount(chosen.ravel(), minlength=4)
        for name in aux:
            aux[name] += np.mean(per_layer[name]) * len(t) / tiny["n_tokens"]
    assert abs(aux["replayed"] - aux["free"]) > 1e-3
    assert m["router_aux_loss"] == pytest.approx(aux["replayed"], rel=1e-5)
    share = 4 * counts["replayed"] / counts["replayed"].sum(-1, keepdims=True)
    assert not np.array_equal(counts["replayed"], counts["free"])
    assert (m["router_load_max"], m["router_load_min"]) == pytest.approx(
        (share.max(), share.min()))
