"""The JAX rollout engine (geo3k_jax.engine.engine) on the tiny checkpoints, fp32 on CPU: its
log-probs are the JAX learner's over multi-turn episodes, its greedy tokens are the torch engine's,
and it stops, bans and seeds as the rollout requires of any engine."""

import dataclasses

import jax
import numpy as np
import pytest
import torch

from common.batching import TrainSequence, pack
from common.engine import Request, SamplingParams
from common.processor import image_key
from common.grpo import LossConfig
from geo3k_jax.engine.engine import DECODE_CHUNK, JaxEngine
from geo3k_jax.learner.learner import Learner
from geo3k_torch.engine import LocalEngine
from tests.jax_learner_setup import train_config
from tests.test_jax_model import jax_copy
from tests.tiny_models import (IMG, ImageOnlyProcessor, image, prompt_ids, qwen2_5_vl, qwen3_vl,
                                qwen3_vl_moe)

jax.config.update("jax_default_matmul_precision", "highest")
# Every test compiles the engine or its sampling (seconds each on CPU): all of them are slow.
pytestmark = pytest.mark.slow
ARCHS = {"qwen3_vl": qwen3_vl, "qwen2_5_vl": qwen2_5_vl, "qwen3_vl_moe": qwen3_vl_moe}
DENSE = ("qwen2_5_vl", "qwen3_vl")
SLOTS = 2
# Scheduling, caches, stops and seeds are the engine's own, the same for both architectures:
# such a test runs on one of them (the two alternate); numerics against the learner and the
# torch engine, and what reads the checkpoint's keys, run on both. Qwen3-VL-MoE differs from
# Qwen3-VL only in its decoder's MLP: it runs the numerics tests (`every_arch`).


def one_arch(arch):
    """Runs the test on the module's `tiny` of `arch` only."""
    return pytest.mark.parametrize("tiny", [arch], indirect=True)


every_arch = pytest.mark.parametrize("tiny", sorted(ARCHS), indirect=True)


def reseed(engine: JaxEngine, seed: int) -> None:
    """The engine's RNG state as a fresh engine of `seed` has it."""
    engine.set_rng_state({"key": np.asarray(jax.random.PRNGKey(seed)).tolist(), "version": 0,
                          "seen": []})


@dataclasses.dataclass
class Tiny:
    hf: torch.nn.Module
    processor: object
    merge: object
    params: dict
    shared: JaxEngine

    def engine(self, seed=0, params: dict | None = None) -> JaxEngine:
        """The module's engine (compiled once per shape) reseeded and emptied as a fresh one
        would be, sampling from `params` (default: the module's)."""
        self.shared.clear_cache()
        reseed(self.shared, seed)
        weights = self.params if params is None else params
        self.shared.params = lambda: weights
        return self.shared


@pytest.fixture(scope="module", params=DENSE)
def tiny(request):
    hf, patch = ARCHS[request.param]()
    merge, params = jax_copy(hf)
    processor = ImageOnlyProcessor(patch)
    # 2 slots for 3 sessions: every multi-session test refills slots mid-batch, and a session's
    # next turn finds its cache kept or evicted (then prefilled whole again)
    return Tiny(hf, processor, merge, params,
                JaxEngine(merge, lambda: params, processor, hf.config, slots=SLOTS))


def episodes(engine, processor, seed, turns=3, max_new=12, temperature=1.0, n=3, stop=(7,),
             only=None):
    """n sessions of `turns` turns, 1-3 images of different sizes each; turn k + 1 continues
    turn k's request and output with random feedback tokens. `only`: the indices of the
    sessions this engine runs (default all; the others' requests are drawn all the same, so a
    session's requests never depend on which run). Returns every turn's (requests, completions)
    of the sessions run."""
    rng = np.random.default_rng(seed)
    reqs = []
    for i in range(n):
        imgs = [image(int(rng.integers(40, 130)), int(rng.integers(40, 130)), 100 + 10 * i + k)
                for k in range(1 + i % 3)]
        reqs.append(Request(tuple(prompt_ids(processor, imgs, rng, (3 + 4 * i, 2))), imgs,
                            SamplingParams(temperature, 1.0, max_new, stop), f"s{i}"))
    run = list(range(n)) if only is None else list(only)
    out = []
    for _ in range(turns):
        done = dict(zip(run, engine.generate([reqs[i] for i in run])))
        out.append(([reqs[i] for i in run], [done[i] for i in run]))
        feedback = [tuple(int(x) for x in rng.integers(1, 200, 4 + i)) for i in range(n)]
        reqs = [dataclasses.replace(r, input_ids=tuple(r.input_ids) + tuple(done[i].token_ids)
                                    + feedback[i]) if i in done else r
                for i, r in enumerate(reqs)]
    return out


def trajectories(turns) -> list[TrainSequence]:
    """Each session's whole episode as one training sequence: its generated tokens in the loss
    mask with the engine's log-probs, prompt and feedback out of it."""
    last_reqs, last_outs = turns[-1]
    seqs = []
    for i, (r, o) in enumerate(zip(last_reqs, last_outs)):
        ids = np.r_[np.asarray(r.input_ids), o.token_ids].astype(np.int64)
        mask, logp = np.zeros(len(ids), np.int8), np.zeros(len(ids), np.float32)
        for reqs, outs in turns:
            start = len(reqs[i].input_ids)
            mask[start:start + len(outs[i].token_ids)] = 1
            logp[start:start + len(outs[i].token_ids)] = outs[i].logprobs
        seqs.append(TrainSequence(ids, mask, logp, 1.0, list(r.images), i))
    return seqs


@every_arch
def test_engine_logprobs_equal_learner(tiny, temperature=0.7):
    """Three turns with feedback, 1-3 images each: every sampled token's engine log-prob is the
    JAX learner's at the same temperature. A decode position off by one after an image (text
    resumes at start + max(h, w)) or a DeepStack feature missing from the prefill moves them by
    1e-3 or more."""
    engine = tiny.engine(seed=4)  # at seed 3 the tiny MoE's sessions never kept a cache
    evicted, prefilled = engine.evictions, engine.prefilled
    turns = episodes(engine, tiny.processor, 2, temperature=temperature)
    seqs = trajectories(turns)
    # 3 sessions on 2 slots: some later turns continued their cache, some were rebuilt
    whole = sum(len(r.input_ids) for reqs, _ in turns for r in reqs)
    assert engine.evictions > evicted and engine.prefilled - prefilled < whole
    assert all(len(o.token_ids) >= 1 for _, outs in turns for o in outs)
    learner = Learner(tiny.merge, tiny.params, LossConfig(), train_config(), temperature,
                      processor=tiny.processor, config=tiny.hf.config, row_len=1024)
    batches = pack(seqs, 1024)
    learned = learner.logprobs(batches)
    gap = 0.0
    for b, lp in zip(batches, learned):
        m = b.loss_mask > 0
        gap = max(gap, float(np.abs(lp[m] - b.rollout_logprobs[m]).max()))
    assert sum(int(b.loss_mask.sum()) for b in batches) > 30
    assert gap <= 1e-5


@every_arch
def test_greedy_tokens_equal_torch_engine(tiny):
    """Greedy, 32 new tokens per turn (no stop token), 3 turns fed back with feedback tokens,
    2 sessions on the 2 slots: the JAX engine and the torch LocalEngine pick the same tokens
    with the same log-probs."""
    kw = dict(max_new=32, temperature=0.0, n=2, stop=())
    jax_turns = episodes(tiny.engine(), tiny.processor, 5, **kw)
    torch_turns = episodes(LocalEngine(tiny.hf, tiny.processor, 0), tiny.processor, 5, **kw)
    for (_, a), (_, b) in zip(jax_turns, torch_turns):
        for x, y in zip(a, b):
            assert len(x.token_ids) == 32 and x.finish_reason == "length"
            assert x.token_ids == y.token_ids and x.finish_reason == y.finish_reason
            np.testing.assert_allclose(x.logprobs, y.logprobs, rtol=0, atol=1e-4)


def one_request(processor, seed=0, sampling=SamplingParams(1.0, 1.0, 10), session="a"):
    rng = np.random.default_rng(seed)
    imgs = [image(64, 48, seed)]
    return Request(tuple(prompt_ids(processor, imgs, rng)), imgs, sampling, session)


@one_arch("qwen3_vl")
def test_stop_tokens_and_budgets(tiny):
    """In one batch: a request stops at the first of its stop tokens (kept as its last token,
    finish 'stop'), another runs to its own max_new_tokens ('length'), a third of a different
    prompt length and budget is unaffected by the others."""
    engine = tiny.engine(seed=1)
    probe = engine.generate([one_request(tiny.processor, sampling=SamplingParams(0.0, 1.0, 6))])[0]
    stop = probe.token_ids[2]  # greedy: the third token comes again with that stop id set
    reqs = [one_request(tiny.processor, sampling=SamplingParams(0.0, 1.0, 6, (stop, 299))),
            one_request(tiny.processor, sampling=SamplingParams(0.0, 1.0, 6)),
            one_request(tiny.processor, 1, SamplingParams(1.0, 1.0, 3))]
    a, b, c = engine.generate(reqs)
    first = probe.token_ids.index(stop)
    steps = engine.decode_steps
    alone, = engine.generate(reqs[:1])
    assert alone.token_ids == a.token_ids and alone.finish_reason == "stop"
    assert engine.decode_steps - steps == first < 5  # the device loop ends at the stop token
    assert a.token_ids == probe.token_ids[:first + 1] and a.finish_reason == "stop"
    assert b.token_ids == probe.token_ids and b.finish_reason == "length"
    np.testing.assert_allclose(b.logprobs, probe.logprobs, rtol=0, atol=1e-5)  # other shapes
    assert len(c.token_ids) == 3 or c.finish_reason == "stop"
    assert [len(o.token_ids) == len(o.logprobs) for o in (a, b, c)] == [True] * 3


def test_placeholders_never_sampled(tiny):
    """With the image placeholder made by far the likeliest token it is still never sampled
    (greedy or not); the video placeholder is banned too."""
    params = dict(tiny.params)
    key = "lm_head.weight" if "lm_head.weight" in params else \
        "model.language_model.embed_tokens.weight"
    w = np.array(params[key])
    for banned in (IMG, tiny.hf.config.video_token_id):
        w[banned] = np.sign(w[banned]) * 50.0
    params[key] = jax.numpy.asarray(w)
    engine = tiny.engine()
    engine.params = lambda: params
    outs = engine.generate([one_request(tiny.processor, sampling=SamplingParams(t, 1.0, 8))
                            for t in (1.0, 0.0)])
    for o in outs:
        assert len(o.token_ids) == 8
        assert not {IMG, tiny.hf.config.video_token_id} & set(o.token_ids)


@one_arch("qwen2_5_vl")
def test_seeded_rng_state_and_top_p(tiny):
    """Same seed, same samples; the same request again in one version of the weights samples
    anew, and again in another; the RNG state round-trips through JSON and replays the same
    samples, also when restored and synced to the version it was saved in (a resumed run);
    greedy ignores the seed; a tiny top_p keeps only the likeliest token (= greedy)."""
    import json
    req = one_request(tiny.processor, 2, SamplingParams(1.0, 0.9, 10))
    engine = tiny.engine(seed=5)
    state = json.loads(json.dumps(engine.rng_state()))
    first = engine.generate([req])[0]
    assert tiny.engine(seed=5).generate([req])[0] == first
    assert engine.generate([req])[0].token_ids != first.token_ids  # its second occurrence
    engine.clear_cache()
    engine.set_rng_state(state)
    assert engine.generate([req])[0] == first
    assert JaxEngine(tiny.merge, lambda: tiny.params, tiny.processor, tiny.hf.config,
                     seed=5).rng_state() == state
    engine.clear_cache(version=4)
    assert engine.generate([req])[0].token_ids != first.token_ids  # a new version
    saved = json.loads(json.dumps(engine.rng_state()))
    after = engine.generate([req])[0]
    engine.set_rng_state(saved)
    engine.clear_cache(version=4)  # as a resumed run syncs the weights it saved
    again = engine.generate([req])[0]  # prefilled whole, where `after` continued its slot:
    assert again.token_ids == after.token_ids  # the same numbers but for rounding
    np.testing.assert_allclose(again.logprobs, after.logprobs, rtol=0, atol=1e-5)
    greedy = dataclasses.replace(req, sampling=SamplingParams(0.0, 1.0, 10))
    g = tiny.engine(seed=1).generate([greedy])[0]
    assert tiny.engine(seed=2).generate([greedy])[0].token_ids == g.token_ids
    nucleus = dataclasses.replace(req, sampling=SamplingParams(1.0, 1e-6, 10))
    assert tiny.engine(seed=3).generate([nucleus])[0].token_ids == g.token_ids


@one_arch("qwen3_vl")
def test_a_request_samples_the_same_whatever_serves_it(tiny):
    """A request's tokens come from its own key: 6 sessions x 2 turns on 2 slots (refilled as
    rows finish, caches evicted) and on 8 slots (all at once, every cache kept), lock-step or
    submitted one by one, sample the same tokens with log-probs within 1e-5. A per-batch key
    (the engine before slots) would give each layout other samples."""
    wide = JaxEngine(tiny.merge, lambda: tiny.params, tiny.processor, tiny.hf.config, seed=7,
                     slots=8)
    narrow = tiny.engine(seed=7)
    evicted = narrow.evictions
    a = episodes(narrow, tiny.processor, 4, turns=2, n=6)
    b = episodes(wide, tiny.processor, 4, turns=2, n=6)
    assert narrow.evictions > evicted and wide.evictions == 0
    for (_, x), (_, y) in zip(a, b):
        for p, q in zip(x, y):
            assert p.token_ids == q.token_ids and p.finish_reason == q.finish_reason
            np.testing.assert_allclose(p.logprobs, q.logprobs, rtol=0, atol=1e-5)
    wide.clear_cache()
    reseed(wide, 7)
    narrow = tiny.engine(seed=7)
    reqs = a[0][0]
    one_by_one = [f.result() for f in [narrow.submit(r) for r in reqs]]
    assert [o.token_ids for o in one_by_one] == [o.token_ids for o in a[0][1]]


@one_arch("qwen2_5_vl")
def test_a_finished_slot_takes_the_next_request_at_once(tiny):
    """One long and three short requests on 2 slots: the short ones take the second slot in
    turn while the long one decodes, so the decode loop runs about as many steps as the long
    request's tokens (a static batch of 2 would run long + max(short) steps, here 24 + 8)."""
    engine = tiny.engine(seed=2)
    long_ = one_request(tiny.processor, 0, SamplingParams(0.0, 1.0, 24), "long")
    shorts = [one_request(tiny.processor, s, SamplingParams(0.0, 1.0, 4), f"short{s}")
              for s in (1, 2, 3)]
    steps = engine.decode_steps
    outs = engine.generate([long_] + shorts)
    assert [len(o.token_ids) for o in outs] == [24, 4, 4, 4]
    assert engine.decode_steps - steps == 23  # the first token of each comes from its prefill


@one_arch("qwen2_5_vl")
def test_a_submitted_sessions_next_turn_keeps_its_slot(tiny):
    """Per-episode scheduling on 2 slots: a long request decodes (longer than a decode call),
    a short one finishes and its session sends its next turn at once, while a new session
    already waits. The next turn goes on in the short one's parked slot (its new tokens
    prefilled only; the new session taking that slot first would make it prefill its whole
    prompt again); the tokens are those of the lock-step engine."""
    engine = tiny.engine(seed=4)
    long_ = one_request(tiny.processor, 0, SamplingParams(0.0, 1.0, DECODE_CHUNK + 16), "long")
    short = one_request(tiny.processor, 1, SamplingParams(0.0, 1.0, 4), "short")
    new = one_request(tiny.processor, 2, SamplingParams(0.0, 1.0, 4), "new")
    feedback = (7, 8, 9)
    follow: list = []

    def next_turn(f):  # runs in the engine's thread as the short request finishes
        ids = short.input_ids + tuple(f.result().token_ids) + feedback
        follow.append(engine.submit(Request(ids, short.images, short.sampling, "short")))
    prefilled = engine.prefilled
    first = [engine.submit(long_), engine.submit(short)]
    first[1].add_done_callback(next_turn)
    later = engine.submit(new)
    outs = [f.result() for f in first] + [follow[0].result(), later.result()]
    whole = len(short.input_ids) + 4 + len(feedback)
    turn_two = (engine.prefilled - prefilled
                - sum(len(r.input_ids) for r in (long_, short, new)))
    assert turn_two == len(feedback) + 1  # the last sampled token and the feedback
    assert turn_two < whole
    lockstep = tiny.engine(seed=4)
    again = lockstep.generate([long_, short, new])
    again.append(lockstep.generate([Request(short.input_ids + tuple(again[1].token_ids)
                                            + feedback, short.images, short.sampling,
                                            "short")])[0])
    for a, b in zip(outs, [again[0], again[1], again[3], again[2]]):
        assert a.token_ids == b.token_ids


@one_arch("qwen3_vl")
def test_the_same_call_again_is_not_traced_again(tiny):
    """With the parameters on a mesh, as the learner holds them, a second call of the same
    shapes reuses the compiled prefill, insert and decode: the key that came back from the
    first is placed as a fresh one (a device key would be traced again as another input)."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    from geo3k_jax.core.sharding import make_mesh
    placed = jax.device_put(tiny.params, NamedSharding(
        make_mesh({"data": 1, "fsdp": -1, "tensor": 1}), P()))
    engine = JaxEngine(tiny.merge, lambda: placed, tiny.processor, tiny.hf.config, slots=2)
    reqs = [one_request(tiny.processor, seed=s, session=f"k{s}") for s in range(2)]
    engine.generate(reqs)
    assert engine.compiles == 3
    engine.clear_cache()
    engine.generate(reqs)
    assert engine.compiles == 3


def test_backend_samples_from_a_copy_in_the_engines_layout(tiny, capsys):
    """Sync copies the learner's parameters in device memory (the learner's next step donates
    its own), cast to the compute dtype (bf16: half the bytes), with only the tensor axis of the
    learner's layout kept (replicated over the data axes, as decoding reads every weight). The
    backend prints the engine's compile set's size at start."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    from geo3k_jax.engine.backend import JaxBackend, engine_shardings
    from geo3k_jax.core.sharding import make_mesh
    learner = Learner(tiny.merge, tiny.params, LossConfig(), train_config(), 1.0,
                      processor=tiny.processor, config=tiny.hf.config)
    backend = JaxBackend(learner, tiny.processor, tiny.hf.config, seed=0, slots=2)
    programs = len(backend.engine.compile_set())
    assert f"JAX engine: {programs} programs at most" in capsys.readouterr().out
    learner.params = {k: v + 1.0 for k, v in learner.params.items()}  # as after a step
    backend.sync(learner, 1)
    for k, v in learner.params.items():
        assert backend.engine.params()[k] is not v
        np.testing.assert_array_equal(np.asarray(backend.engine.params()[k]), np.asarray(v))
    assert backend.rng_state()["version"] == 1  # the step: a part of every request's key
    mesh = make_mesh({"data": 1, "fsdp": -1, "tensor": 1})
    learned = {"w": NamedSharding(mesh, P("fsdp", "tensor")), "b": NamedSharding(mesh, P(
        ("data", "fsdp")))}
    assert {k: s.spec for k, s in engine_shardings(learned).items()} == {
        "w": P(None, "tensor"), "b": P(None)}
    learner.compute_dtype = jax.numpy.bfloat16
    half = JaxBackend(learner, tiny.processor, tiny.hf.config, seed=0, slots=2)
    assert {a.dtype for a in half.params.values()} == {jax.numpy.dtype("bfloat16")}
    assert half.engine.cache_bytes * 2 == backend.engine.cache_bytes


@one_arch("qwen3_vl")
def test_shared_group_prefill_equals_separate_prefills(tiny):
    """A group's identical requests (own image copies) are prefilled in one row and give the
    tokens and log-probs of separate prefills, sampled from the same keys."""
    rng = np.random.default_rng(8)
    imgs = [image(90, 50, 1), image(40, 70, 2)]
    ids = tuple(prompt_ids(tiny.processor, imgs, rng))
    other = [image(64, 64, 3)]
    group = [Request(ids, [im.copy() for im in imgs], SamplingParams(t, 1.0, 10), f"g{i}")
             for i, t in enumerate([1.0, 1.0, 0.0, 1.0])]
    reqs = group[:2] + [Request(tuple(prompt_ids(tiny.processor, other, rng)), other,
                                SamplingParams(1.0, 0.9, 10), "o")] + group[2:]
    shared_engine = tiny.engine(seed=4)
    before = shared_engine.prefilled
    shared = shared_engine.generate(reqs)
    separate_engine = JaxEngine(tiny.merge, lambda: tiny.params, tiny.processor,
                                tiny.hf.config, seed=4, share_prefill=False, keep_cache=False)
    separate = separate_engine.generate(reqs)
    for a, b in zip(shared, separate):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
    assert len({tuple(o.token_ids) for o in shared[:2] + shared[3:]}) > 1  # samples differ
    assert separate_engine.prefilled == sum(len(r.input_ids) for r in reqs)
    # g0 and g1 share a row; g2 and g3 continue a finished group member's parked prompt
    assert shared_engine.prefilled - before == len(ids) + len(reqs[2].input_ids) + 2


@one_arch("qwen3_vl")
def test_kept_cache_equals_whole_prefills(tiny):
    """Turns 2 and 3 continue each session's kept KV cache where its slot was not taken (only
    the last generated token and the feedback are prefilled) and sample what prefilling the
    whole conversation samples: the same tokens, log-probs within 1e-5, sampled and greedy;
    after `clear_cache`, or with an image token in the new part, a request is prefilled
    whole."""
    whole_engine = JaxEngine(tiny.merge, lambda: tiny.params, tiny.processor, tiny.hf.config,
                             slots=SLOTS, keep_cache=False)
    for temperature in (1.0, 0.0):
        kept = episodes(tiny.engine(seed=6), tiny.processor, 9, temperature=temperature)
        whole_engine.clear_cache()
        reseed(whole_engine, 6)
        whole = episodes(whole_engine, tiny.processor, 9, temperature=temperature)
        for (_, a), (_, b) in zip(kept, whole):
            for x, y in zip(a, b):
                assert x.token_ids == y.token_ids and x.finish_reason == y.finish_reason
                np.testing.assert_allclose(x.logprobs, y.logprobs, rtol=0, atol=1e-5)
    reqs, outs = kept[-1]
    nxt = [dataclasses.replace(r, input_ids=tuple(r.input_ids) + tuple(o.token_ids) + (5, 6))
           for r, o in zip(reqs, outs)]
    engine = tiny.engine()
    engine.generate(reqs[:SLOTS])
    before = engine.prefilled
    engine.generate(nxt[:SLOTS])
    assert engine.prefilled - before == SLOTS * 3  # every session continues: last token + 2
    with_image = dataclasses.replace(nxt[0], input_ids=nxt[0].input_ids + (IMG,))
    slot = next(s for s in engine._slots if s.session == nxt[0].session)
    images = tuple(image_key(im) for im in nxt[0].images)
    assert engine._continues(slot, nxt[0], images) == len(nxt[0].input_ids) - 1
    assert engine._continues(slot, with_image, images) == 0
    engine.clear_cache()
    before = engine.prefilled
    engine.generate(nxt[1:SLOTS])
    assert engine.prefilled - before == sum(len(r.input_ids) for r in nxt[1:SLOTS])


@one_arch("qwen2_5_vl")
def test_a_request_prefilled_before_continues_its_slot(tiny):
    """Requests equal to ones prefilled before (new sessions: an evaluation's sampled episodes
    after its greedy ones) continue those parked slots, prefilling their last token only, and
    sample what whole prefills sample: the same tokens, log-probs within 1e-5."""
    rng = np.random.default_rng(12)
    imgs = [[image(70, 50, 20 + i)] + [image(40, 90, 30)] * (i % 2) for i in range(2)]
    first = [Request(tuple(prompt_ids(tiny.processor, im, rng)), im,
                     SamplingParams(0.0, 1.0, 8), f"greedy{i}") for i, im in enumerate(imgs)]
    again = [dataclasses.replace(r, images=[x.copy() for x in r.images],
                                 sampling=SamplingParams(1.0, 0.9, 8), session=f"sampled{i}")
             for i, r in enumerate(first)]
    engine = tiny.engine(seed=5)
    engine.generate(first)
    before = engine.prefilled
    reused = engine.generate(again)
    assert engine.prefilled - before == len(again)
    whole = tiny.engine(seed=5)
    whole.keep_cache = False
    try:
        whole.generate(first)
        for a, b in zip(reused, whole.generate(again)):
            assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
            np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
    finally:
        whole.keep_cache = True


@one_arch("qwen2_5_vl")
def test_the_context_does_not_change_what_is_sampled(tiny):
    """The engine's capacity changes no token nor log-prob: its prefill reads the cached
    tokens block by block up to the longest row, its decode each slot's own pages, never the
    capacity."""
    big = JaxEngine(tiny.merge, lambda: tiny.params, tiny.processor, tiny.hf.config, seed=9,
                    slots=SLOTS, context=4096)
    a = episodes(big, tiny.processor, 4, turns=2)
    b = episodes(tiny.engine(seed=9), tiny.processor, 4, turns=2)
    for (_, x), (_, y) in zip(a, b):
        for p, q in zip(x, y):
            assert p.token_ids == q.token_ids
            np.testing.assert_allclose(p.logprobs, q.logprobs, rtol=0, atol=1e-6)


@one_arch("qwen2_5_vl")
def test_budget_check_refuses_a_cache_that_does_not_fit(tiny):
    """The budget is the cache's bytes per device, slots split over the data axes and KV heads
    over tensor: a config over it stops before allocating, naming the numbers and the setting;
    Qwen3-VL-2B's (28 layers, 8 KV heads of 128) at 256 slots x 4096 tokens in bf16 is
    112 GiB, 28 GiB on each of a v5p-8's 4 chips (95 GiB: fits), 112 GiB on one (does not)."""
    from geo3k_jax.engine.kv_budget import CacheShape, check_kv_budget
    qwen2b = CacheShape(layers=28, kv_heads=8, head_dim=128)
    assert qwen2b.bytes(256, 4096, jax.numpy.bfloat16) == 112 * 2**30
    with pytest.raises(ValueError, match=r"256 slots x 4096 tokens x 28 layers x 8 KV heads.*"
                                         r"112.00 GiB per device.*engine.slots \(at most 186"):
        check_kv_budget(qwen2b, 256, 4096, jax.numpy.bfloat16, memory=95 * 2**30,
                        weight_bytes=4 * 2**30)
    class FourChips:  # a (data=1, fsdp=4, tensor=1) mesh as the budget sees it
        shape = {"data": 1, "fsdp": 4, "tensor": 1}
        devices = np.asarray(jax.devices()[:1] * 4)
    assert check_kv_budget(qwen2b, 256, 4096, jax.numpy.bfloat16, FourChips,
                           weight_bytes=4 * 2**30, memory=95 * 2**30) == 28 * 2**30
    with pytest.raises(ValueError, match="engine.slots=6 must be a multiple of"):
        check_kv_budget(qwen2b, 6, 4096, jax.numpy.bfloat16, FourChips, memory=95 * 2**30)
    with pytest.raises(ValueError, match="does not fit.*lower engine.slots"):
        JaxEngine(tiny.merge, lambda: tiny.params, tiny.processor, tiny.hf.config,
                  slots=2**40, context=1024)


@pytest.mark.parametrize("vocab,block", [(12, 128), (12, 5), (300, 128)])
def test_draws_follow_the_softmax_and_never_a_zero_probability_token(vocab, block):
    """`draw` (a block of ids, then an id in it, each by inverting a cumulative sum at one
    uniform) samples softmax(scaled): one block, blocks with a padded last one, and a whole
    block excluded. The frequencies of 40,000 draws per row are within 5 standard errors of
    the probabilities, for flat to sharp rows; -inf ids (banned, outside the nucleus) are never
    drawn, wherever they sit, nor is an out-of-range id returned."""
    from geo3k_jax.engine.engine import draw
    n = 40_000
    scale = np.asarray([[0.5], [2.0], [6.0]])
    scaled = np.asarray(jax.random.normal(jax.random.PRNGKey(3), (3, vocab))) * scale
    excluded = [0, vocab // 2, vocab - 1] + (list(range(128, 256)) if vocab > 256 else [])
    scaled[:, excluded] = -np.inf
    probs = np.exp(scaled - scaled.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    keys = jax.random.split(jax.random.PRNGKey(4), 3)
    for row in range(3):
        tokens = np.asarray(draw(keys[row], jax.numpy.asarray(np.repeat(
            scaled[row:row + 1], n, axis=0)), block=block))
        assert tokens.dtype == np.int32 and tokens.min() >= 0 and tokens.max() < vocab
        freq = np.bincount(tokens, minlength=vocab) / n
        assert freq[excluded].sum() == 0
        np.testing.assert_array_less(np.abs(freq - probs[row]),
                                     5 * np.sqrt(probs[row] * (1 - probs[row]) / n) + 1e-9)
    one = np.full((4, vocab), -np.inf, np.float32)
    one[np.arange(4), [0, 3, 7, vocab - 1]] = 0.0  # a single allowed id per row
    np.testing.assert_array_equal(draw(jax.random.PRNGKey(5), jax.numpy.asarray(one),
                                       block=block), [0, 3, 7, vocab - 1])


def test_sampling_without_top_p_skips_the_sort_and_draws_the_same():
    """With every top_p = 1 the sort is skipped (`nucleus=False`): same tokens and log-probs
    from the same key as through the nucleus path; placeholders stay banned."""
    from geo3k_jax.engine.engine import power_of_two, sample
    logits = jax.random.normal(jax.random.PRNGKey(1), (6, 50)) * 3
    logits = logits.at[:, 7].set(100.0)  # a placeholder that would always win
    temperature = jax.numpy.asarray([1.0, 0.7, 0.0, 1.3, 1.0, 0.0])
    top_p, key, banned = jax.numpy.ones(6), jax.random.PRNGKey(2), jax.numpy.asarray([7])
    fast = sample(logits, temperature, top_p, key, banned, nucleus=False)
    full = sample(logits, temperature, top_p, key, banned, nucleus=True)
    np.testing.assert_array_equal(fast[0], full[0])
    np.testing.assert_array_equal(fast[1], full[1])
    assert 7 not in np.asarray(fast[0]).tolist()
    assert [power_of_two(n, 32) for n in (1, 32, 33, 100, 512, 513)] == \
        [32, 32, 64, 128, 512, 1024]


@pytest.mark.heavy
@pytest.mark.timeout(900)  # two engines compiled in a subprocess: about a minute alone
def test_engine_sharded_on_8_devices_samples_what_one_device_does():
    """5 sessions x 2 turns of up to 8 tokens on 4 slots over a (data=2, fsdp=2, tensor=2) mesh of 8 fake CPU
    devices (a subprocess: the device count is fixed at startup): the same tokens as on one
    device, log-probs within 1e-5; each device holds 1 of the 4 slots and 1 of the 2 KV heads
    of the cache, and the weights split over tensor only."""
    import json
    import os
    import subprocess
    import sys
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-m", "tests.jax_engine_sharded_worker"], env=env,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["same_tokens"] and res["tokens"] > 40 and res["logprob_gap"] <= 1e-5
    assert res["cache_devices"] == 8 and res["evictions"] > 0
    heads, layers, slots, length, d = res["cache_shape"]  # (Hkv, layers, S, L, D)
    assert (heads, layers, slots) == (2, 2, 4)
    assert res["shard_shape"] == [1, layers, 1, length, d]
    assert res["q_proj_shard"] == [2, 32, 64]  # 2 layers, (4 heads x 16) / tensor 2, hidden 64


@one_arch("qwen2_5_vl")
def test_a_bounded_prefill_samples_the_same(tiny):
    """engine.prefill_rows and prefill_tokens bound every prefill the engine runs: 6 sessions x
    2 turns on 8 slots with at most 2 rows of 32 new tokens a prefill (a whole prompt is longer:
    it goes alone) sample what the unbounded engine samples, every prefill within
    `prefill_shapes`; the unbounded one prefills more rows at once."""
    def calls(engine):
        shapes, prefill = [], engine._prefill

        def spy(*args, **kw):
            shapes.append(args[4]["input_ids"].shape)
            return prefill(*args, **kw)
        engine._prefill = spy
        return shapes

    wide = JaxEngine(tiny.merge, lambda: tiny.params, tiny.processor, tiny.hf.config, seed=7,
                     slots=8)
    bounded = JaxEngine(tiny.merge, lambda: tiny.params, tiny.processor, tiny.hf.config,
                        seed=7, slots=8, prefill_rows=2, prefill_tokens=32)
    assert bounded.prefill_ladder() == [(2, 32), (1, 32), (1, 64), (1, 128), (1, 256),
                                        (1, 512), (1, 1024)]
    assert bounded.prefill_shapes() == [(2, 32), (1, 1024)]
    seen, seen_wide = calls(bounded), calls(wide)
    a = episodes(wide, tiny.processor, 4, turns=2, n=6)
    b = episodes(bounded, tiny.processor, 4, turns=2, n=6)
    for (_, x), (_, y) in zip(a, b):
        for p, q in zip(x, y):
            assert p.token_ids == q.token_ids and p.finish_reason == q.finish_reason
            np.testing.assert_allclose(p.logprobs, q.logprobs, rtol=0, atol=1e-5)
    assert max(rows for rows, _ in seen_wide) == 8  # several rows: all 8 (padding)
    assert set(seen) <= set(bounded.prefill_ladder()), seen
    assert any(rows == 1 and tokens > 32 for rows, tokens in seen)  # the prompts, alone
    assert (2, 32) in seen  # the next turns, two a prefill
    with pytest.raises(ValueError, match="prefill_rows"):
        JaxEngine(tiny.merge, lambda: tiny.params, tiny.processor, tiny.hf.config,
                  prefill_rows=-1)


@one_arch("qwen3_vl")
def test_after_warm_up_a_multi_turn_run_compiles_nothing(tiny):
    """`warm_up` compiles the engine's whole compile set, its count known from the config
    alone (a prefill with and one without images and an insert for each prefill shape, a
    decode for each page-table size); then multi-turn sessions (images of several sizes,
    feedback over kept caches, evicted sessions prefilled whole, a prompt longer than
    `prefill_tokens` alone, greedy, sampled and nucleus requests) trace nothing and compile
    nothing, counted by JAX's own compile events too."""
    import jax.monitoring
    engine = JaxEngine(tiny.merge, lambda: tiny.params, tiny.processor, tiny.hf.config,
                       seed=3, slots=SLOTS, context=512, prefill_tokens=32)
    assert engine.prefill_ladder() == [(2, 32), (1, 32), (1, 64), (1, 128), (1, 256),
                                       (1, 512)]
    programs = engine.compile_set()
    pages = [p[1] for p in programs if p[0] == "decode"]
    assert pages == [8, 16, 24, 32]  # 2 slots x 512 / 32 pages at most
    assert len(programs) == 3 * 6 + 4
    n, _ = engine.warm_up()
    assert n == engine.compiles == len(programs)
    compiled = []
    listener = lambda event, *a, **k: compiled.append(event) if "backend_compile" in event \
        else None  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        for temperature, top_p in ((0.0, 1.0), (1.0, 1.0), (1.0, 0.8)):
            episodes(engine, tiny.processor, 6, turns=3, n=3, temperature=temperature)
            req = one_request(tiny.processor, 7, SamplingParams(temperature, top_p, 40))
            engine.generate([req, dataclasses.replace(req, session="other")])
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert engine.compiles == len(programs) and compiled == []
    assert engine.evictions > 0


@one_arch("qwen3_vl")
def test_the_pallas_decode_samples_what_the_xla_decode_samples(tiny):
    """With the splash attention (`jax.attention`, auto on TPU) the engine decodes through
    JAX's Pallas paged attention kernel, here in TPU interpret mode: 3 sessions x 2 turns,
    greedy and sampled, give the XLA decode's tokens, log-probs within 2e-3 (the kernel's
    matmuls round fp32 operands to bf16, as a TPU's default precision does; the vision tower
    runs splash too)."""
    from geo3k_jax.models.model import with_attention
    from geo3k_jax.kernels.splash import Attention
    merge = with_attention(tiny.merge, tiny.params,
                           lambda a: Attention("splash", None, interpret=True))
    kernel = JaxEngine(merge, lambda: tiny.params, tiny.processor, tiny.hf.config, seed=5,
                       slots=SLOTS)
    assert kernel.kernel and not tiny.shared.kernel
    for temperature in (0.0, 1.0):
        a = episodes(tiny.engine(seed=5), tiny.processor, 6, turns=2, temperature=temperature)
        reseed(kernel, 5)
        kernel.clear_cache()
        b = episodes(kernel, tiny.processor, 6, turns=2, temperature=temperature)
        for (_, x), (_, y) in zip(a, b):
            for p, q in zip(x, y):
                assert p.token_ids == q.token_ids and p.finish_reason == q.finish_reason
                np.testing.assert_allclose(p.logprobs, q.logprobs, rtol=0, atol=2e-3)
