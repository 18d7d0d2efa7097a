"""The torch engine's own decode step and slot loop (`geo3k_torch.decode`, `LocalEngine`) against
transformers' model run over whole sequences, on the tiny Qwen3-VL (interleaved M-RoPE, q/k
norms) and Qwen2.5-VL (sectioned M-RoPE, q/k/v biases), fp32 on CPU.

The decode step's logits equal a full forward's at every step: a wrong rotary position, a missed
q/k norm or bias, a key written at the wrong cache index or a bad mask moves them by far more
than 1e-4. Greedy calls (refilled slots, stop tokens, second turns on kept caches) pick the full
forward's argmax, and every log-prob is its log_softmax(logits / T). Sampling is seeded, and
`sample` draws what torch.multinomial draws, with the right frequencies.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch

from common.engine import LENGTH, STOP, Request, SamplingParams
from common.mrope import mrope_position_ids
from common.processor import image_inputs
from geo3k_torch.decode import Decoder, Slots, sample
from geo3k_torch.engine import LocalEngine, row_counts
from tests.tiny_models import (IMG, ImageOnlyProcessor, image, prompt_ids, qwen2_5_vl, qwen3_vl,
                               qwen3_vl_moe)

ARCHS = {"qwen3_vl": qwen3_vl, "qwen2_5_vl": qwen2_5_vl, "qwen3_vl_moe": qwen3_vl_moe}
BANNED = [IMG, 251]  # image and video placeholders
STOPS = tuple(range(3, 250, 7))  # one text id in seven ends a turn


@pytest.fixture(scope="module", params=sorted(ARCHS))
def tiny(request):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models gain nothing from a second thread
    model, patch = ARCHS[request.param]()
    yield model, ImageOnlyProcessor(patch)
    torch.set_num_threads(threads)


def full_logits(model, processor, ids, images) -> torch.Tensor:
    """(T, V) fp32 logits of transformers' forward over the whole sequence, no cache."""
    imgs = image_inputs(processor, list(images))
    grid = imgs["image_grid_thw"]
    pos = mrope_position_ids(ids, IMG, grid, model.config.vision_config.spatial_merge_size)
    pos = np.concatenate([np.arange(len(ids))[None], pos])[:, None]  # (4, 1, T)
    with torch.no_grad():
        out = model(input_ids=torch.tensor(np.asarray(ids, np.int64))[None],
                    position_ids=torch.from_numpy(pos),
                    pixel_values=torch.from_numpy(imgs["pixel_values"]),
                    image_grid_thw=torch.from_numpy(grid), use_cache=False)
    return out.logits[0].float()


def make_requests(processor, seed, n=5, temperature=0.0, top_p=1.0):
    """n requests of different prompt lengths, 1-2 images and max_new_tokens, STOPS."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        imgs = [image(int(rng.integers(40, 120)), int(rng.integers(40, 90)), 50 * seed + 10 * i + k)
                for k in range(1 + i % 2)]
        ids = prompt_ids(processor, imgs, rng, (2 + 5 * i, 2 + i))
        out.append(Request(tuple(int(t) for t in ids), imgs,
                           SamplingParams(temperature, top_p, 4 + 3 * (i % 3), STOPS),
                           f"s{seed}-{i}"))
    return out


def check_against_forward(model, processor, requests, completions, temperature=0.0):
    """Every completion is what transformers' full forward gives: greedy tokens are its argmax
    over the allowed tokens, log-probs its log_softmax(logits / T) (1e-4, and 1e-5 of the value:
    a banned placeholder's log-prob is near -180, where fp32's spacing alone is 1.5e-5 and
    another CPU's summation order moved it by 2.2e-4), and the finish reason is the stop token
    or the length."""
    for r, o in zip(requests, completions):
        n = len(r.input_ids)
        logits = full_logits(model, processor, list(r.input_ids) + list(o.token_ids), r.images)
        logits = logits[n - 1:n - 1 + len(o.token_ids)]  # row t predicts new token t
        logp = torch.log_softmax(logits / (temperature or 1.0), -1)
        tok = torch.tensor(o.token_ids)
        got = torch.tensor(o.logprobs)
        torch.testing.assert_close(got, logp.gather(-1, tok[:, None])[:, 0], rtol=1e-5, atol=1e-4)
        if temperature == 0:
            allowed = logits.index_fill(-1, torch.tensor(BANNED), float("-inf"))
            assert o.token_ids == allowed.argmax(-1).tolist()
        assert not set(STOPS) & set(o.token_ids[:-1])
        if o.finish_reason == STOP:
            assert o.token_ids[-1] in STOPS
        else:
            assert o.finish_reason == LENGTH and len(o.token_ids) == r.sampling.max_new_tokens


def test_decode_step_logits_equal_the_full_forward(tiny):
    """Three rows of different prompts (images, lengths) in 4 slots of one cache: each of five
    decode steps gives every row the logits of transformers' forward over its whole sequence,
    attending over the whole capacity or only up to the longest position (the span: the empty
    end of the cache adds nothing); one M-RoPE position off (the text position, as a plain
    decoder would use) does not."""
    model, processor = tiny
    engine = LocalEngine(model, processor, 0)
    reqs = make_requests(processor, 1, n=3)
    slots = Slots.allocate(model.config.get_text_config(), 4, 200, 8, len(STOPS), torch.float32,
                           torch.device("cpu"))
    with torch.no_grad():
        engine._admit(slots, reqs, [2, 0, 3], nucleus=False)
        decoder = Decoder(model, slots, engine.generator, engine.banned)  # eager on the CPU
        seqs = [list(r.input_ids) for r in reqs]
        for step in range(5):
            for s, seq in zip([2, 0, 3], seqs):
                seq.append(int(slots.last[s]))
            logits = decoder.logits(4, 200)
            span = int(slots.pos.max()) + 1  # the shortest span that holds every row
            torch.testing.assert_close(decoder.logits(4, span), logits, rtol=0, atol=1e-6)
            for s, seq, r in zip([2, 0, 3], seqs, reqs):
                want = full_logits(model, processor, seq, r.images)[-1]
                assert (logits[s] - want).abs().max() <= 1e-4, (step, s)
            slots.done[:] = False  # keep every row decoding, whatever it sampled
            slots.advance(4)
            slots.record(torch.arange(4), logits, engine.generator, engine.banned, False)
        slots.mpos[:] = slots.pos  # one-off: the text position instead of M-RoPE's
        seqs[0].append(int(slots.last[2]))
        wrong = decoder.logits(4, 200)[2]
    right = full_logits(model, processor, seqs[0], reqs[0].images)[-1]
    assert (wrong - right).abs().max() > 1e-3


@pytest.mark.parametrize("max_batch", [2, 256], ids=["refilled", "one-wave"])
def test_greedy_calls_and_second_turns_equal_the_full_forward(tiny, max_batch, monkeypatch):
    """Five requests (prompt lengths, images, max_new_tokens and stops differ) in 2 refilled
    slots or 5 at once; then every session's second turn continues its kept cache (its
    prefills take the new tokens only)."""
    model, processor = tiny
    engine = LocalEngine(model, processor, 0, max_batch=max_batch)
    reqs = make_requests(processor, 2)
    capacity = max(len(r.input_ids) + r.sampling.max_new_tokens for r in reqs)
    assert engine.plan(reqs) == (min(max_batch, 5), capacity)
    first = engine.generate(reqs)
    check_against_forward(model, processor, reqs, first)
    assert {o.finish_reason for o in first} == {STOP, LENGTH}  # both ends are exercised
    rng = np.random.default_rng(0)
    follow = [dataclasses.replace(r, input_ids=tuple(r.input_ids) + tuple(o.token_ids) + tuple(
        int(t) for t in rng.integers(1, 200, 3 + i))) for i, (r, o) in enumerate(zip(reqs, first))]
    for r, o in zip(reqs, first):  # the kept cache: prompt and every fed token (not the last)
        kept = engine._cache[r.session]
        assert kept.ids == list(r.input_ids) + list(o.token_ids[:-1])
        assert kept.keys[0].shape[1] == len(kept.ids)
    widths, forward = [], model.forward
    monkeypatch.setattr(model, "forward",
                        lambda **kw: widths.append(kw["input_ids"].shape[1]) or forward(**kw))
    second = engine.generate(follow)
    assert widths and max(widths) == 3 + 4 + 1  # the observation and the unfed last token
    check_against_forward(model, processor, follow, second)


def test_sampled_calls_with_top_p_follow_the_full_forward(tiny):
    """T = 0.7, top-p 0.8 (rows 0, 2, 4) or 1: each sampled token is in the nucleus of the full
    forward's distribution over the allowed tokens, its log-prob is log_softmax(logits / T)."""
    model, processor = tiny
    reqs = make_requests(processor, 3, temperature=0.7)
    reqs = [dataclasses.replace(r, sampling=dataclasses.replace(
        r.sampling, top_p=0.8 if i % 2 == 0 else 1.0)) for i, r in enumerate(reqs)]
    outs = LocalEngine(model, processor, 0, seed=4, max_batch=3).generate(reqs)
    check_against_forward(model, processor, reqs, outs, temperature=0.7)
    for r, o in zip(reqs, outs):
        n = len(r.input_ids)
        logits = full_logits(model, processor, list(r.input_ids) + list(o.token_ids), r.images)
        probs = torch.softmax(logits[n - 1:n - 1 + len(o.token_ids)].index_fill(
            -1, torch.tensor(BANNED), float("-inf")) / 0.7, -1)
        for p, t in zip(probs, o.token_ids):
            above = p[p > p[t]].sum()  # mass strictly above the token (ties aside)
            assert above < r.sampling.top_p + 1e-5


def test_same_seed_same_samples_and_refill_draws(tiny):
    """A seeded engine samples the same tokens twice (refilled slots, compactions), another seed
    others. Every request is answered in full whatever slot it ran in."""
    model, processor = tiny
    reqs = make_requests(processor, 4, n=7, temperature=1.0)
    run = lambda seed: LocalEngine(model, processor, 0, seed=seed,  # noqa: E731
                                   max_batch=3).generate(reqs)
    a, b, c = run(5), run(5), run(6)
    assert a == b
    assert [o.token_ids for o in a] != [o.token_ids for o in c]
    check_against_forward(model, processor, reqs, a, temperature=1.0)


def test_greedy_never_picks_a_placeholder():
    """The image placeholder made by far the likeliest token: greedy takes the best other one."""
    model, patch = qwen3_vl(seed=1)
    processor = ImageOnlyProcessor(patch)
    boosted = copy.deepcopy(model)
    with torch.no_grad():
        boosted.lm_head.weight[IMG] = boosted.lm_head.weight[IMG].sign() * 50.0
    reqs = make_requests(processor, 5, n=2)
    outs = LocalEngine(boosted, processor, 0).generate(reqs)
    assert all(IMG not in o.token_ids for o in outs)
    check_against_forward(boosted, processor, reqs, outs)


def test_sample_is_multinomial_with_the_right_frequencies():
    """`sample` draws torch.multinomial's tokens from the same generator state, never a banned
    one, keeps top-p's nucleus, and its frequencies follow softmax(logits / T)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 3.0]]).expand(40_000, 6)
    t = torch.full((40_000,), 0.8)
    top_p = torch.where(torch.arange(40_000) < 20_000, 1.0, 0.7)
    banned = torch.tensor([5])
    tok, lp = sample(logits, t, top_p, torch.Generator().manual_seed(0), banned, nucleus=True)
    logp = torch.log_softmax(logits[0] / 0.8, -1)
    assert torch.allclose(lp, logp[tok])
    probs = torch.softmax(logits[0, :5] / 0.8, -1)
    free = torch.bincount(tok[:20_000], minlength=6) / 20_000
    assert free[5] == 0 and (free[:5] - probs).abs().max() < 0.015
    nucleus = probs[:2] / probs[:2].sum()  # 0.51 + 0.25 >= 0.7: tokens 0 and 1 only
    held = torch.bincount(tok[20_000:], minlength=6) / 20_000
    assert held[2:].sum() == 0 and (held[:2] - nucleus).abs().max() < 0.015
    # the draw is torch.multinomial's: same generator state, same tokens
    p = torch.rand(64, 300, generator=torch.Generator().manual_seed(1))
    mine, _ = sample(p.log(), torch.ones(64), torch.ones(64), torch.Generator().manual_seed(2),
                     torch.tensor([299]), nucleus=False)
    p[:, 299] = 0
    theirs = torch.multinomial(p, 1, generator=torch.Generator().manual_seed(2))[:, 0]
    assert torch.equal(mine, theirs)
    greedy, glp = sample(logits[:2], torch.zeros(2), torch.ones(2), torch.Generator(), banned,
                         nucleus=False)
    assert greedy.tolist() == [0, 0] and torch.allclose(glp, torch.log_softmax(logits[0], -1)[0])


def test_row_counts_and_slot_plan(tiny):
    """Steps run at 1, 2, 4, ... rows below the slot count and at the slot count; slots of the
    longest request's capacity fit the budget."""
    assert row_counts(1) == [1] and row_counts(2) == [1, 2] and row_counts(5) == [1, 2, 4, 5]
    assert row_counts(64) == [1, 2, 4, 8, 16, 32, 64]
    model, processor = tiny
    engine = LocalEngine(model, processor, 0)
    reqs = make_requests(processor, 6, n=4)
    capacity = max(len(r.input_ids) + r.sampling.max_new_tokens for r in reqs)
    per_slot = capacity * engine.kv_bytes_per_token()
    budget = LocalEngine(model, processor, 0, kv_budget_gb=3.5 * per_slot / 2**30)
    assert budget.plan(reqs) == (3, capacity)
    assert [len(b) for b in budget.batches(reqs)] == [3, 1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_equal_eager_steps():
    """On CUDA (fp32 tiny model): the captured decode steps give the eager steps' tokens and
    log-probs, refills and compactions included, whether the graph samples (its draws advance
    the seeded generator as the eager ones do) or the sampling follows it, and with every fast
    path on (kept slots, attention buckets, inductor); the kept engine's second call captures
    nothing new. Greedy steps give the CPU's tokens."""
    model, patch = qwen3_vl(seed=0)
    processor = ImageOnlyProcessor(patch)
    reqs = make_requests(processor, 7, n=6, temperature=1.0)
    greedy = [dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, temperature=0.0))
              for r in reqs]
    cpu = LocalEngine(model, processor, 0, max_batch=4).generate(greedy)
    model = model.cuda()
    ways = {"eager": dict(cuda_graphs=False), "sampling after the graph": {},
            "graphs": dict(graph_sampling=True, keep_slots=True),
            "fast": dict(graph_sampling=True, keep_slots=True, attention_bucket=16,
                         compile=True)}
    engines = {k: LocalEngine(model, processor, 0, seed=1, device="cuda", max_batch=4, **kw)
               for k, kw in ways.items()}
    runs = {k: e.generate(reqs) for k, e in engines.items()}
    for way in ways:
        for a, b in zip(runs[way], runs["eager"]):
            assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason, way
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
    assert engines["graphs"]._kept.graph_sampling  # this torch registers generators
    fast = LocalEngine(model, processor, 0, device="cuda", max_batch=4, **ways["fast"])
    assert [o.token_ids for o in fast.generate(greedy)] == [o.token_ids for o in cpu]
    kept = fast._kept
    builds = kept.builds
    fast.clear_cache()
    again = fast.generate([dataclasses.replace(r, session=r.session + "-again") for r in greedy])
    assert fast._kept is kept and kept.builds == builds  # the same shapes: nothing captured
    assert [o.token_ids for o in again] == [o.token_ids for o in cpu]
    greedy_gpu = LocalEngine(model, processor, 0, device="cuda", max_batch=4).generate(greedy)
    assert [o.token_ids for o in greedy_gpu] == [o.token_ids for o in cpu]
