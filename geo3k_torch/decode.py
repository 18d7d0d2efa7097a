"""The torch engine's device side: decode slots over a preallocated KV cache, and one decode step
of our own over the Hugging Face model's modules, captured as a CUDA graph on GPUs.

`Slots` is everything a generate call decodes with, allocated on the device for one call, or
kept for the next ones (`engine.local_keep_slots`):

    keys, values   per decoder layer (rows, H_kv, capacity, D), the model's dtype; a slot's
                   tokens sit at cache indices 0 .. pos - 1 in order (prompt, then generated)
    last, pos, mpos (rows,) the token a step feeds next, the cache index it is written at, and
                   its M-RoPE position (the three components of generated text are equal)
    temperature, top_p, max_new, stops   the slot's request's sampling settings
    tokens, logprobs (rows, columns) what it sampled (the last column takes the writes of
                   finished rows), count (rows,) how many, done (rows,) bool
    routed         None, or (rows, capacity, L, K) int16: the experts each of the L sparse
                   layers routed the token at each cache index to (routing replay), written as
                   the keys and values are

`Decoder.step(n, span, nucleus)` feeds `last` of slots 0 .. n - 1 through the model's text
decoder: the HF model's own embedding, norms, q/k/v/o projections (Qwen3-VL: q_norm/k_norm on
head_dim before RoPE), rotary module (at position ids (3, n, 1), so Qwen2.5-VL's sectioned and
Qwen3-VL's interleaved M-RoPE both come out right), MLPs and head (a MoE block's router and
experts called in turn when the slots record the routing). Each slot's new key and value (and
routed experts) are written into its own row at `pos`, and the one query token attends over
cache indices <= pos of the first `span` (a (n, 1, 1, span) boolean mask built from `pos` on
the device) with
F.scaled_dot_product_attention; GQA reads the cache unrepeated (the query heads of one KV head
are that head's queries). The engine picks the span: the whole capacity, or the live rows'
longest position rounded up to a bucket (`engine.local_attention_bucket`), so early steps do not
read the empty end of the cache. `Slots.advance` then moves the fed rows on and `Slots.record`
samples (`sample`: one log_softmax) and writes tokens, log-probs and done flags on the device: a
step reads nothing back to the host.

On CUDA each (n, span, nucleus) is captured once as a CUDA graph (one memory pool for all) and
replayed: the model's step, and with `graph_sampling` the advance and the sampling too, whose
draws come from the engine's seeded generator registered with the graph (every replay moves its
Philox offset on, as the eager draws would). The same code runs eagerly elsewhere. With
`compile_backend` the model's step is `torch.compile`d first (static shapes per row count, the
span's length dynamic); the sampling stays eager code inside the graph, so it draws from the same generator
as the plain step (inductor's own random numbers would not).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Callable

import torch
import torch._dynamo
import torch.nn.functional as F

# Two compilations per row count (`engine.row_counts`: 18 at 256 slots): past dynamo's default
# limit of 8 recompilations per function it would run the rest eagerly.
_COMPILE_LIMITS = {k: 4096 for k in ("recompile_limit", "accumulated_recompile_limit")
                   if hasattr(torch._dynamo.config, k)}


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
           generator: torch.Generator, banned: torch.Tensor, nucleus: bool
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row. logits: (B, V) fp32 raw; temperature, top_p: (B,); banned: token ids
    never sampled (image placeholders: a generated one would break the sequence); nucleus:
    whether some row has top_p < 1 (else the sort is skipped; a host flag, so no sync).

    Returns (tokens (B,), log-probs (B,) under log_softmax(logits / T) of the raw logits, before
    banning and top-p; T = 0 rows are greedy, the argmax of the allowed tokens, and report
    log_softmax(logits)). The draw is torch.multinomial's own for one sample (the argmax of
    p / q, q ~ Exp(1) per token, from `generator`), without its host-side validity check.
    """
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    logp = torch.log_softmax(logits / t, dim=-1)
    allowed = logp.index_fill(-1, banned, float("-inf"))
    probs = allowed.exp()  # (B, V) the allowed tokens' probabilities, not renormalised
    if nucleus:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass strictly above each token
        mass = sorted_p.sum(-1, keepdim=True)
        keep = (before < top_p[:, None] * mass) | (top_p[:, None] >= 1)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p * keep)
    drawn = (probs / torch.empty_like(probs).exponential_(generator=generator)).argmax(-1)
    tokens = torch.where(greedy, allowed.argmax(-1), drawn)
    return tokens, logp.gather(-1, tokens[:, None])[:, 0]


@dataclasses.dataclass
class Slots:
    """Decode slots on the device (see the module docstring for every field's shape)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    last: torch.Tensor
    pos: torch.Tensor
    mpos: torch.Tensor
    temperature: torch.Tensor
    top_p: torch.Tensor
    max_new: torch.Tensor
    stops: torch.Tensor
    tokens: torch.Tensor
    logprobs: torch.Tensor
    count: torch.Tensor
    done: torch.Tensor
    routed: torch.Tensor | None = None

    @classmethod
    def allocate(cls, text_config, rows: int, capacity: int, max_new: int, n_stops: int,
                 dtype: torch.dtype, device: torch.device,
                 routing: tuple[int, int] | None = None) -> "Slots":
        """`rows` empty (done) slots of `capacity` tokens each, for requests of at most
        `max_new` new tokens and `n_stops` stop tokens; routing: (L sparse layers, top k) to
        record the routing of, None: not recorded. The cache starts at zero: a masked
        position must never hold a NaN (0 x NaN in the attention's weighted sum)."""
        t = text_config
        head_dim = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
        shape = (rows, t.num_key_value_heads, capacity, head_dim)
        cache = lambda: [torch.zeros(shape, dtype=dtype, device=device)  # noqa: E731
                         for _ in range(t.num_hidden_layers)]
        long = lambda *s: torch.zeros(s, dtype=torch.long, device=device)  # noqa: E731
        routed = None if routing is None else torch.zeros((rows, capacity, *routing),
                                                          dtype=torch.int16, device=device)
        return cls(cache(), cache(), long(rows), long(rows), long(rows),
                   torch.ones(rows, device=device), torch.ones(rows, device=device),
                   long(rows), torch.full((rows, n_stops), -1, dtype=torch.long, device=device),
                   long(rows, max_new + 1), torch.zeros(rows, max_new + 1, device=device),
                   long(rows), torch.ones(rows, dtype=torch.bool, device=device), routed)

    @property
    def rows(self) -> int:
        return self.keys[0].shape[0]

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def fits(self, rows: int, capacity: int, max_new: int, n_stops: int) -> bool:
        """Whether these slots can serve a call that `allocate` would give these numbers."""
        return (rows <= self.rows and capacity <= self.capacity
                and max_new < self.tokens.shape[1] and n_stops <= self.stops.shape[1])

    def advance(self, n: int) -> None:
        """After a step over slots 0 .. n - 1: the live ones' fed token is in their cache."""
        live = ~self.done[:n]
        self.pos[:n] += live
        self.mpos[:n] += live

    def record(self, rows: torch.Tensor, logits: torch.Tensor, generator: torch.Generator,
               banned: torch.Tensor, nucleus: bool) -> None:
        """Sample one token for each slot of `rows` (k,) from its logits (k, V) fp32; live slots
        record it and its log-prob, feed it next, and are done at a stop token or their
        max_new-th token. Finished slots record nothing."""
        tok, lp = sample(logits, self.temperature[rows], self.top_p[rows], generator, banned,
                         nucleus)
        live, count = ~self.done[rows], self.count[rows]
        column = torch.where(live, count, self.tokens.shape[1] - 1)
        self.tokens[rows, column] = tok
        self.logprobs[rows, column] = lp
        count = count + live
        stop = (tok[:, None] == self.stops[rows]).any(-1)
        self.count[rows] = count
        self.done[rows] = ~live | stop | (count >= self.max_new[rows])
        self.last[rows] = torch.where(live, tok, self.last[rows])

    def move(self, src: torch.Tensor) -> None:
        """Slots 0 .. k - 1 := slots `src` (k,), everything they hold (a permutation's prefix:
        the live slots gathered at the front)."""
        k = len(src)
        for t in [*self.keys, *self.values, self.last, self.pos, self.mpos, self.temperature,
                  self.top_p, self.max_new, self.stops, self.tokens, self.logprobs, self.count,
                  self.done, *([] if self.routed is None else [self.routed])]:
            t[:k] = t[src]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as transformers' apply_rotary_pos_emb (rotate_half layout). x: (n, H, D); cos,
    sin: (n, 1, D)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Decoder:
    """One new token per slot through the text decoder of `model` (a transformers Qwen2.5-VL or
    Qwen3-VL, its own modules and weights, read at every call) over `slots`' cache, sampled from
    `generator` with the token ids `banned` never drawn; see the module docstring.

    cuda_graphs: on CUDA, capture each (rows, span, nucleus) step as a CUDA graph.
    graph_sampling: the graph takes the sampling too (`register_generator_state`); off, or where
    this torch lacks that call, the graph ends at the logits and `Slots.record` runs after it.
    compile_backend: `torch.compile` the logits with this backend ("inductor"; "" runs them as
    written): static shapes per row count, the span's length dynamic (two compilations per row
    count: spans short of the capacity, and the whole capacity, a contiguous slice).
    """

    def __init__(self, model, slots: Slots, generator: torch.Generator, banned: torch.Tensor, *,
                 cuda_graphs: bool = True, graph_sampling: bool = False,
                 compile_backend: str = ""):
        text = model.model.language_model
        self.embed, self.layers, self.norm = text.embed_tokens, text.layers, text.norm
        self.rotary, self.head = text.rotary_emb, model.lm_head
        for layer in self.layers:
            if getattr(layer.self_attn, "sliding_window", None) is not None:
                raise ValueError("sliding-window attention layers are not supported by the "
                                 "torch engine's decode step")
        self.slots, self.generator, self.banned = slots, generator, banned
        # each layer's index among the sparse ones (-1: dense), where the slots record routing
        sparse = [hasattr(layer.mlp, "experts") for layer in self.layers]
        self.sparse = [sum(sparse[:i]) if is_sparse else -1 for i, is_sparse in enumerate(sparse)]
        device = slots.pos.device
        self.index = torch.arange(slots.capacity, device=device)  # (L,) cache indices
        self.every = torch.arange(slots.rows, device=device)  # (rows,) slot indices
        self.graphs = cuda_graphs and device.type == "cuda"
        rng_api = hasattr(torch.cuda.CUDAGraph, "register_generator_state")
        if self.graphs and graph_sampling and not rng_api:
            warnings.warn(f"torch {torch.__version__} has no CUDAGraph.register_generator_state: "
                          "the decode step's sampling runs outside its CUDA graph")
        self.graph_sampling = self.graphs and graph_sampling and rng_api
        # Nothing here may hold a bound method of self: a cycle would keep the slots' memory
        # until the garbage collector runs, past the next call's allocation.
        self._compiled = _compiled_forward(compile_backend) if compile_backend else None
        self._programs: dict[tuple[int, int, bool], Callable[[], None] | None] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.graphs else None
        self.builds = 0  # steps built (on CUDA with graphs: captured)

    def step(self, n: int, span: int, nucleus: bool) -> None:
        """One decode step over slots 0 .. n - 1 attending over cache indices < `span` (which
        must exceed every live slot's `pos`): feed `last`, then `Slots.advance` and
        `Slots.record` (a graph replay on CUDA, built at the first step of its shape)."""
        key = (n, span, nucleus)
        if key not in self._programs:
            self._programs[key] = self._build(n, span, nucleus)
            self.builds += 1
        program = self._programs[key]
        if program is None:
            self.run(n, span, nucleus)
        else:
            program()

    def run(self, n: int, span: int, nucleus: bool) -> None:
        """`step`'s work, eagerly (what a graph with sampling captures)."""
        logits = self.logits(n, span)
        self.slots.advance(n)
        self.slots.record(self.every[:n], logits, self.generator, self.banned, nucleus)

    def logits(self, n: int, span: int) -> torch.Tensor:
        """`forward` over slots 0 .. n - 1 and cache indices < span, compiled if asked."""
        index = self.index[:span]
        if self._compiled is None:
            return self.forward(self.every[:n], index)
        torch._dynamo.maybe_mark_dynamic(index, 0)  # not one compilation per span
        with torch._dynamo.config.patch(**_COMPILE_LIMITS):
            return self._compiled(self, self.every[:n], index)

    def warm_up(self, n: int, span: int, nucleus: bool) -> None:
        """Run `run` once (compiling, autotuning, initialising what a capture may not) without
        changing what the next step gives: slots 0 .. n - 1 run as finished ones (they write
        only their key and value at `pos`, which that step writes again, and the spare token
        column), and the generator's state is put back."""
        s = self.slots
        done, state = s.done[:n].clone(), self.generator.get_state()
        s.done[:n] = True
        self.run(n, span, nucleus)
        s.done[:n] = done
        self.generator.set_state(state)

    def _build(self, n: int, span: int, nucleus: bool) -> Callable[[], None] | None:
        """The step of one shape: None (`run` it), or on CUDA a graph of `run` (the sampling's
        draws advance `generator` at every replay) or of its logits, warmed up on a side stream
        first. Only this thread is held to the capture's rules: with `train.max_staleness` > 0
        the learner keeps training on the same GPU from another thread meanwhile."""
        if not self.graphs:
            return None
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.warm_up(n, span, nucleus)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self.graph_sampling:
            graph.register_generator_state(self.generator)
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            if self.graph_sampling:
                self.run(n, span, nucleus)
            else:
                logits = self.logits(n, span)
        if self.graph_sampling:
            return graph.replay
        return functools.partial(_replay_then_sample, graph, logits, self.slots, self.every[:n],
                                 self.generator, self.banned, nucleus)

    def forward(self, rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """The step's model math over slots `rows` (n,) = 0 .. n - 1 and cache indices `index`
        (L,) = 0 .. L - 1: writes each slot's key and value at `pos`, returns (n, V) fp32
        logits."""
        s, n, L = self.slots, rows.shape[0], index.shape[0]
        pos = s.pos[:n]
        x = self.embed(s.last[:n, None])  # (n, 1, hidden)
        cos, sin = self.rotary(x, s.mpos[:n].view(1, n, 1).expand(3, n, 1))  # (n, 1, D) each
        mask = (index[None] <= pos[:, None])[:, None, None]  # (n, 1, 1, L)
        for layer, keys, values, sparse in zip(self.layers, s.keys, s.values, self.sparse):
            attn = layer.self_attn
            kv_heads, head_dim = keys.shape[1], keys.shape[3]
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(n, -1, head_dim)  # (n, H, D)
            k = attn.k_proj(h).view(n, kv_heads, head_dim)  # (n, H_kv, D)
            v = attn.v_proj(h).view(n, kv_heads, head_dim)
            if hasattr(attn, "q_norm"):  # Qwen3-VL: RMSNorm over head_dim before RoPE
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            keys[rows, :, pos] = k  # (n, H_kv, D) at each slot's own cache index
            values[rows, :, pos] = v
            # query head j reads KV head j // groups (transformers' repeat_kv): (n, H_kv, G, D)
            out = F.scaled_dot_product_attention(
                q.view(n, kv_heads, -1, head_dim), keys[:n, :, :L], values[:n, :, :L],
                attn_mask=mask, scale=attn.scaling)
            x = x + attn.o_proj(out.reshape(n, 1, -1))
            h = layer.post_attention_layernorm(x)
            if s.routed is None or sparse < 0:
                x = x + layer.mlp(h)
            else:
                out, experts = sparse_block(layer.mlp, h)
                s.routed[rows, pos, sparse] = experts.to(s.routed.dtype)  # (n, K)
                x = x + out
        return self.head(self.norm(x))[:, 0].float()


def sparse_block(block, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' `Qwen3VLMoeTextSparseMoeBlock.forward` of hidden (..., H), and the experts
    its router chose for each token (N, K) int64, N the tokens."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    _, weights, experts = block.gate(flat)
    return block.experts(flat, experts, weights).view_as(hidden), experts


def _replay_then_sample(graph, logits: torch.Tensor, slots: Slots, rows: torch.Tensor,
                        generator: torch.Generator, banned: torch.Tensor, nucleus: bool) -> None:
    """A graph of the logits (n, V) of slots `rows` (n,), then their sampling, eagerly."""
    graph.replay()
    slots.advance(len(rows))
    slots.record(rows, logits, generator, banned, nucleus)


@functools.cache
def _compiled_forward(backend: str):
    """`Decoder.forward` compiled with `backend`, one function for every decoder (it holds none:
    a dropped decoder's slots go at once)."""
    return torch.compile(Decoder.forward, backend=backend, dynamic=False, fullgraph=True)
