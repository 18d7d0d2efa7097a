"""The JAX rollout engine (geo3k_jax.engine) on the tiny checkpoints, fp32 on CPU: its log-probs
are the JAX learner's over multi-turn episodes, its greedy tokens are the torch engine's, and it
stops, bans and seeds as the rollout requires of any engine."""

import dataclasses

import jax
import numpy as np
import pytest
import torch

from common.batching import TrainSequence, pack
from common.engine import Request, SamplingParams
from common.grpo import LossConfig
from geo3k_jax.engine import JaxEngine
from geo3k_jax.learner import Learner
from geo3k_torch.engine import LocalEngine
from tests.jax_learner_setup import train_config
from tests.test_jax_model import jax_copy
from tests.tiny_models import IMG, ImageOnlyProcessor, image, prompt_ids, qwen2_5_vl, qwen3_vl

jax.config.update("jax_default_matmul_precision", "highest")
# Every test compiles the engine or its sampling (seconds each on CPU): all of them are slow.
pytestmark = pytest.mark.slow
ARCHS = {"qwen3_vl": qwen3_vl, "qwen2_5_vl": qwen2_5_vl}
# Scheduling, caches, stops and seeds are the engine's own, the same for both architectures:
# such a test runs on one of them (the two alternate); numerics against the learner and the
# torch engine, and what reads the checkpoint's keys, run on both.


def one_arch(arch):
    """Runs the test on the module's `tiny` of `arch` only."""
    return pytest.mark.parametrize("tiny", [arch], indirect=True)


@dataclasses.dataclass
class Tiny:
    hf: torch.nn.Module
    processor: object
    merge: object
    params: dict
    shared: JaxEngine

    def engine(self, seed=0) -> JaxEngine:
        """The module's engine (compiled once per shape) reseeded and emptied as a fresh one
        would be."""
        self.shared.set_rng_state(np.asarray(jax.random.PRNGKey(seed)).tolist())
        self.shared.params = lambda: self.params
        self.shared.clear_cache()
        return self.shared


@pytest.fixture(scope="module", params=sorted(ARCHS))
def tiny(request):
    hf, patch = ARCHS[request.param]()
    merge, params = jax_copy(hf)
    processor = ImageOnlyProcessor(patch)
    return Tiny(hf, processor, merge, params,
                JaxEngine(merge, lambda: params, processor, hf.config))


def episodes(engine, processor, seed, turns=3, max_new=12, temperature=1.0, n=3, stop=(7,)):
    """n sessions of `turns` turns, 1-3 images of different sizes each; turn k + 1 continues
    turn k's request and output with random feedback tokens. Returns every turn's
    (requests, completions)."""
    rng = np.random.default_rng(seed)
    reqs = []
    for i in range(n):
        imgs = [image(int(rng.integers(40, 130)), int(rng.integers(40, 130)), 100 + 10 * i + k)
                for k in range(1 + i % 3)]
        reqs.append(Request(tuple(prompt_ids(processor, imgs, rng, (3 + 4 * i, 2))), imgs,
                            SamplingParams(temperature, 1.0, max_new, stop), f"s{i}"))
    out = []
    for _ in range(turns):
        done = engine.generate(reqs)
        out.append((reqs, done))
        feedback = [tuple(int(x) for x in rng.integers(1, 200, 4 + i)) for i in range(n)]
        reqs = [dataclasses.replace(r, input_ids=tuple(r.input_ids) + tuple(o.token_ids) + f)
                for r, o, f in zip(reqs, done, feedback)]
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


def test_engine_logprobs_equal_learner(tiny, temperature=0.7):
    """Three turns with feedback, 1-3 images each: every sampled token's engine log-prob is the
    JAX learner's at the same temperature. A decode position off by one after an image (text
    resumes at start + max(h, w)) or a DeepStack feature missing from the prefill moves them by
    1e-3 or more."""
    engine = tiny.engine(seed=3)
    turns = episodes(engine, tiny.processor, 2, temperature=temperature)
    seqs = trajectories(turns)
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


def test_greedy_tokens_equal_torch_engine(tiny):
    """Greedy, 32 new tokens per turn (no stop token), 3 turns fed back with feedback tokens:
    the JAX engine and the torch LocalEngine pick the same tokens with the same log-probs."""
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
    """Same seed, same samples; the RNG state round-trips through JSON and replays the same
    samples; greedy ignores the seed; a tiny top_p keeps only the likeliest token (= greedy)."""
    import json
    req = one_request(tiny.processor, 2, SamplingParams(1.0, 0.9, 10))
    engine = tiny.engine(seed=5)
    state = json.loads(json.dumps(engine.rng_state()))
    first = engine.generate([req])[0]
    assert tiny.engine(seed=5).generate([req])[0] == first
    assert engine.generate([req])[0].token_ids != first.token_ids  # the key moved on
    engine.set_rng_state(state)
    assert engine.generate([req])[0] == first
    assert JaxEngine(tiny.merge, lambda: tiny.params, tiny.processor, tiny.hf.config,
                     seed=5).rng_state() == state
    greedy = dataclasses.replace(req, sampling=SamplingParams(0.0, 1.0, 10))
    g = tiny.engine(seed=1).generate([greedy])[0]
    assert tiny.engine(seed=2).generate([greedy])[0].token_ids == g.token_ids
    nucleus = dataclasses.replace(req, sampling=SamplingParams(1.0, 1e-6, 10))
    assert tiny.engine(seed=3).generate([nucleus])[0].token_ids == g.token_ids


@one_arch("qwen2_5_vl")
def test_a_small_call_reuses_compiled_rows_and_samples_the_same(tiny):
    """After a call of 8 requests, a call of 1 pads its rows to 8 (within ROW_SLACK) instead
    of compiling new shapes, and samples, with the same key, what a fresh engine sampling it
    alone in one row does; past the slack a call gets rows of its own."""
    reqs = [one_request(tiny.processor, seed=s, session=f"r{s}") for s in range(8)]
    make = lambda: JaxEngine(tiny.merge, lambda: tiny.params, tiny.processor,  # noqa: E731
                             tiny.hf.config)
    engine, alone = make(), make()
    engine.generate(reqs)
    compiles = engine.compiles
    key = np.asarray(jax.random.PRNGKey(11)).tolist()
    for e in (engine, alone):
        e.clear_cache()
        e.set_rng_state(key)
    padded, single = engine.generate(reqs[3:4])[0], alone.generate(reqs[3:4])[0]
    assert engine.compiles == compiles and engine._row_counts["requests"] == {8}
    assert alone._row_counts["requests"] == {1} and alone.compiles == 2
    assert padded.token_ids == single.token_ids and padded.finish_reason == single.finish_reason
    np.testing.assert_allclose(padded.logprobs, single.logprobs, rtol=0, atol=1e-5)
    assert engine._rows(1, "work") == 8 and make()._rows(1, "work") == 1
    engine._row_counts["requests"] = {64}
    assert engine._rows(4, "requests") == 4 and engine._rows(8, "requests") == 64
    # new tokens per row likewise: a length used before, within LENGTH_SLACK of the bucket
    fresh = make()
    assert fresh._length(1) == 32 and fresh._length(40) == 64 and fresh._length(1) == 32
    fresh._lengths = {64}
    assert fresh._length(1) == 64 and fresh._length(100) == 128 and fresh._length(70) == 128
    assert fresh._length(500) == 512 and fresh._length(120) == 128


@one_arch("qwen3_vl")
def test_the_same_call_again_is_not_traced_again(tiny):
    """With the parameters on a mesh, as the learner holds them, a second call of the same
    shapes reuses the compiled prefill and decode: the key that came back from the first is
    placed as a fresh one (a device key would be traced again as another input)."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    from geo3k_jax.sharding import make_mesh
    placed = jax.device_put(tiny.params, NamedSharding(
        make_mesh({"data": 1, "fsdp": -1, "tensor": 1}), P()))
    engine = JaxEngine(tiny.merge, lambda: placed, tiny.processor, tiny.hf.config)
    reqs = [one_request(tiny.processor, seed=s, session=f"k{s}") for s in range(2)]
    engine.generate(reqs)
    assert engine.compiles == 2
    engine.clear_cache()
    engine.generate(reqs)
    assert engine.compiles == 2


def test_backend_reads_the_learners_params(tiny):
    """Sync is free: the engine samples from the learner's own arrays; with `own_copy` (rollouts
    while the learner's step donates its buffers) from equal arrays of its own."""
    from geo3k_jax.backend import JaxBackend
    learner = Learner(tiny.merge, tiny.params, LossConfig(), train_config(), 1.0,
                      processor=tiny.processor, config=tiny.hf.config)
    shared = JaxBackend(learner, tiny.processor, tiny.hf.config, seed=0)
    own = JaxBackend(learner, tiny.processor, tiny.hf.config, seed=0, own_copy=True)
    learner.params = {k: v + 1.0 for k, v in learner.params.items()}  # as after a step
    shared.sync(learner, 1)
    own.sync(learner, 1)
    for k, v in learner.params.items():
        assert shared.engine.params()[k] is v
        assert own.engine.params()[k] is not v
        np.testing.assert_array_equal(np.asarray(own.engine.params()[k]), np.asarray(v))
    assert shared.rng_state() == np.asarray(jax.random.PRNGKey(0)).tolist()


@one_arch("qwen3_vl")
def test_shared_group_prefill_equals_separate_prefills(tiny):
    """A group's identical requests (own image copies) are prefilled in one row and give the
    tokens and log-probs of separate prefills, sampled from the same key."""
    rng = np.random.default_rng(8)
    imgs = [image(90, 50, 1), image(40, 70, 2)]
    ids = tuple(prompt_ids(tiny.processor, imgs, rng))
    other = [image(64, 64, 3)]
    group = [Request(ids, [im.copy() for im in imgs], SamplingParams(t, 1.0, 10), f"g{i}")
             for i, t in enumerate([1.0, 1.0, 0.0, 1.0])]
    reqs = group[:2] + [Request(tuple(prompt_ids(tiny.processor, other, rng)), other,
                                SamplingParams(1.0, 0.9, 10), "o")] + group[2:]
    shared_engine = tiny.engine(seed=4)
    work, expand = shared_engine._plan(reqs, {})
    assert [r for _, r, _ in work] == [reqs[0], reqs[2]] and expand == [0, 0, 1, 0, 0]
    shared = shared_engine.generate(reqs)
    separate = JaxEngine(tiny.merge, lambda: tiny.params, tiny.processor, tiny.hf.config,
                         seed=4, share_prefill=False).generate(reqs)
    for a, b in zip(shared, separate):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
    assert len({tuple(o.token_ids) for o in shared[:2] + shared[3:]}) > 1  # samples differ


@one_arch("qwen3_vl")
def test_kept_cache_equals_whole_prefills(tiny):
    """Turns 2 and 3 continue each session's kept KV cache (only the last generated token and
    the feedback are prefilled) and sample what prefilling the whole conversation samples:
    the same tokens, log-probs within 1e-5, sampled (same key) and greedy; after
    `clear_cache`, or with an image token in the new part, a request is prefilled whole."""
    for temperature in (1.0, 0.0):
        kept = episodes(tiny.engine(seed=6), tiny.processor, 9, temperature=temperature)
        engine = tiny.engine()
        whole = episodes(JaxEngine(tiny.merge, lambda: tiny.params, tiny.processor,
                                   tiny.hf.config, seed=6, keep_cache=False),
                         tiny.processor, 9, temperature=temperature)
        for (_, a), (_, b) in zip(kept, whole):
            for x, y in zip(a, b):
                assert x.token_ids == y.token_ids and x.finish_reason == y.finish_reason
                np.testing.assert_allclose(x.logprobs, y.logprobs, rtol=0, atol=1e-5)
    reqs, outs = kept[-1]
    nxt = [dataclasses.replace(r, input_ids=tuple(r.input_ids) + tuple(o.token_ids) + (5, 6))
           for r, o in zip(reqs, outs)]
    engine = tiny.engine()
    engine.generate(reqs)
    work, _ = engine._plan(nxt, engine._kept)
    assert all(entry is not None for entry, _, _ in work)  # every session continues
    assert len(work[0][1].input_ids) - len(work[0][0].ids) == 1 + 2  # last token + feedback
    with_image = dataclasses.replace(nxt[0], input_ids=nxt[0].input_ids + (IMG,))
    assert engine._plan([with_image], engine._kept)[0][0][0] is None
    engine.clear_cache()
    assert all(entry is None for entry, _, _ in engine._plan(nxt, engine._kept)[0])


@one_arch("qwen2_5_vl")
def test_a_request_prefilled_before_continues_its_row(tiny):
    """Requests equal to ones an earlier call prefilled whole (new sessions: an evaluation's
    sampled episodes after its greedy ones) continue those rows, prefilling their last token
    only, and sample what whole prefills sample: the same tokens, log-probs within 1e-5.
    Sessions that continue take precedence; `clear_cache` forgets the rows."""
    rng = np.random.default_rng(12)
    imgs = [[image(70, 50, 20 + i)] + [image(40, 90, 30)] * (i % 2) for i in range(3)]
    first = [Request(tuple(prompt_ids(tiny.processor, im, rng)), im,
                     SamplingParams(0.0, 1.0, 8), f"greedy{i}") for i, im in enumerate(imgs)]
    again = [dataclasses.replace(r, images=[x.copy() for x in r.images],
                                 sampling=SamplingParams(1.0, 0.9, 8), session=f"sampled{i}")
             for i, r in enumerate(first)]
    engine = tiny.engine(seed=5)
    engine.generate(first)
    work, _ = engine._plan(again, engine._kept, engine._prompts)
    assert all(entry is not None and entry.ids == r.input_ids for entry, r, _ in work)
    batch, source, lengths, _ = engine._work_arrays(work)
    assert batch["count"][:3].tolist() == [1, 1, 1] and "pixel_values" not in batch
    assert (lengths[:3] == [len(r.input_ids) - 1 for r in first]).all()
    reused = engine.generate(again)
    engine.clear_cache()
    assert engine._plan(again, engine._kept, engine._prompts)[0][0][0] is None
    whole = JaxEngine(tiny.merge, lambda: tiny.params, tiny.processor, tiny.hf.config,
                      seed=5, keep_cache=False)
    whole.generate(first)
    for a, b in zip(reused, whole.generate(again)):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
    # a later turn of the first sessions continues its session, not the whole prefill
    engine = tiny.engine(seed=5)
    done = engine.generate(first)
    turn2 = [dataclasses.replace(r, input_ids=r.input_ids + tuple(o.token_ids) + (5,))
             for r, o in zip(first, done)]
    work, _ = engine._plan(turn2 + again[:1], engine._kept, engine._prompts)
    assert [len(entry.ids) for entry, _, _ in work[:3]] == [
        len(r.input_ids) + len(o.token_ids) - 1 for r, o in zip(first, done)]
    assert work[3][0] is not None  # the same cache: both continue


@pytest.mark.parametrize("vocab,block", [(12, 128), (12, 5), (300, 128)])
def test_draws_follow_the_softmax_and_never_a_zero_probability_token(vocab, block):
    """`draw` (a block of ids, then an id in it, each by inverting a cumulative sum at one
    uniform) samples softmax(scaled): one block, blocks with a padded last one, and a whole
    block excluded. The frequencies of 40,000 draws per row are within 5 standard errors of
    the probabilities, for flat to sharp rows; -inf ids (banned, outside the nucleus) are never
    drawn, wherever they sit, nor is an out-of-range id returned."""
    from geo3k_jax.engine import draw
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
    from geo3k_jax.engine import power_of_two, sample
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
