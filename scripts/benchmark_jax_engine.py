"""The JAX engine's slots against static batches, on the tiny test checkpoint (CPU).

    PYTHONPATH=. nice python scripts/benchmark_jax_engine.py [--requests=48 --slots=16 --mix=tail]

`--requests` requests (one image each, different prompts) with budgets and no stop token, so
each runs exactly its budget: `--mix=even` gives every request `--median` tokens, `--mix=tail`
draws them log-normal (median `--median`, sigma 0.9, capped at 8x the median), the shape of
`scripts/benchmark_rollout.py`'s simulated turns. The same engine serves them two ways:

  * static: batches of `--slots` requests, one `generate` each (a batch waits for its longest
    row before the next starts: what the engine did before slots);
  * slots: one `generate` of all requests (a finished row's slot takes the next request).

Both are timed after a warm-up pass of the same requests (compiles excluded). Prints one JSON
line: generated tokens, seconds and tokens/s of each, and the decode steps each ran.
"""

from __future__ import annotations

import json
import time

import jax
import numpy as np
from absl import app, flags

from common.engine import Request, SamplingParams
from geo3k_jax.engine import JaxEngine
from tests.test_jax_model import jax_copy
from tests.tiny_models import ImageOnlyProcessor, image, prompt_ids, qwen3_vl

_REQUESTS = flags.DEFINE_integer("requests", 48, "Requests per pass.")
_SLOTS = flags.DEFINE_integer("slots", 16, "Decode slots (= the static batch size).")
_MEDIAN = flags.DEFINE_integer("median", 24, "Median new tokens per request.")
_MIX = flags.DEFINE_enum("mix", "tail", ["even", "tail"], "Request lengths.")


def requests(n: int, median: int, mix: str, processor, seed: int = 0) -> list[Request]:
    rng = np.random.default_rng(seed)
    lengths = np.full(n, median) if mix == "even" else np.minimum(
        np.maximum(1, rng.lognormal(np.log(median), 0.9, n).astype(int)), 8 * median)
    out = []
    for i, budget in enumerate(lengths):
        imgs = [image(56, 56, i)]
        out.append(Request(tuple(prompt_ids(processor, imgs, rng)), imgs,
                           SamplingParams(1.0, 1.0, int(budget)), f"r{i}"))
    return out


def timed(engine: JaxEngine, batches: list[list[Request]]) -> dict:
    engine.clear_cache()
    steps, start = engine.decode_steps, time.perf_counter()
    tokens = sum(len(o.token_ids) for b in batches for o in engine.generate(b))
    wall = time.perf_counter() - start
    return {"tokens": tokens, "s": round(wall, 3), "tokens_per_s": round(tokens / wall, 1),
            "decode_steps": engine.decode_steps - steps}


def main(_):
    hf, patch = qwen3_vl()
    merge, params = jax_copy(hf)
    processor = ImageOnlyProcessor(patch)
    reqs = requests(_REQUESTS.value, _MEDIAN.value, _MIX.value, processor)
    context = max(1024, -(-(8 * _MEDIAN.value + 256) // 128) * 128)  # the longest request
    engine = JaxEngine(merge, lambda: params, processor, hf.config, slots=_SLOTS.value,
                       context=context)
    s = _SLOTS.value
    static = [reqs[i:i + s] for i in range(0, len(reqs), s)]
    result = {"mix": _MIX.value, "requests": len(reqs), "n_slots": s, "device":
              jax.devices()[0].platform}
    for name, batches in (("static", static), ("slots", [reqs])):
        timed(engine, batches)  # warm-up: every shape compiled
        result[name] = timed(engine, batches)
    result["speedup"] = round(result["slots"]["tokens_per_s"]
                              / result["static"]["tokens_per_s"], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    app.run(main)
