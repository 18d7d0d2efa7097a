"""The torch engine's device side: decode slots over a preallocated KV cache, and one decode step
of our own over the Hugging Face model's modules, captured as a CUDA graph on GPUs.

`Slots` is everything a generate call decodes with, allocated once per call on the device:

    keys, values   per decoder layer (rows, H_kv, capacity, D), the model's dtype; a slot's
                   tokens sit at cache indices 0 .. pos - 1 in order (prompt, then generated)
    last, pos, mpos (rows,) the token a step feeds next, the cache index it is written at, and
                   its M-RoPE position (the three components of generated text are equal)
    temperature, top_p, max_new, stops   the slot's request's sampling settings
    tokens, logprobs (rows, max_new + 1) what it sampled (column max_new takes the writes of
                   finished rows), count (rows,) how many, done (rows,) bool

`Decoder.step(n)` feeds `last` of slots 0 .. n - 1 through the model's text decoder: the HF
model's own embedding, norms, q/k/v/o projections (Qwen3-VL: q_norm/k_norm on head_dim before
RoPE), rotary module (at position ids (3, n, 1), so Qwen2.5-VL's sectioned and Qwen3-VL's
interleaved M-RoPE both come out right), MLPs and head. Each slot's new key and value are
scattered into its own row at `pos`, and the one query token attends over cache indices <= pos
(a (n, 1, 1, L) boolean mask built from `pos` on the device) with F.scaled_dot_product_attention;
GQA reads the cache unrepeated (the query heads of one KV head are that head's queries). On CUDA
each n is captured once as a CUDA graph (one memory pool for all n) and replayed; the same code
runs eagerly elsewhere. `Slots.advance` then moves the fed rows on and `Slots.record` samples
(`sample`: one log_softmax) and writes tokens, log-probs and done flags on the device: a step
reads nothing back to the host.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F


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

    @classmethod
    def allocate(cls, text_config, rows: int, capacity: int, max_new: int, n_stops: int,
                 dtype: torch.dtype, device: torch.device) -> "Slots":
        """`rows` empty (done) slots of `capacity` tokens each, for requests of at most
        `max_new` new tokens and `n_stops` stop tokens. The cache starts at zero: a masked
        position must never hold a NaN (0 x NaN in the attention's weighted sum)."""
        t = text_config
        head_dim = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
        shape = (rows, t.num_key_value_heads, capacity, head_dim)
        cache = lambda: [torch.zeros(shape, dtype=dtype, device=device)  # noqa: E731
                         for _ in range(t.num_hidden_layers)]
        long = lambda *s: torch.zeros(s, dtype=torch.long, device=device)  # noqa: E731
        return cls(cache(), cache(), long(rows), long(rows), long(rows),
                   torch.ones(rows, device=device), torch.ones(rows, device=device),
                   long(rows), torch.full((rows, n_stops), -1, dtype=torch.long, device=device),
                   long(rows, max_new + 1), torch.zeros(rows, max_new + 1, device=device),
                   long(rows), torch.ones(rows, dtype=torch.bool, device=device))

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
                  self.done]:
            t[:k] = t[src]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as transformers' apply_rotary_pos_emb (rotate_half layout). x: (n, H, D); cos,
    sin: (n, 1, D)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Decoder:
    """One new token per slot through the text decoder of `model` (a transformers Qwen2.5-VL or
    Qwen3-VL, its own modules and weights, read at every call) over `slots`' cache; see the
    module docstring. cuda_graphs: capture each row count as a CUDA graph (CUDA only)."""

    def __init__(self, model, slots: Slots, cuda_graphs: bool):
        text = model.model.language_model
        self.embed, self.layers, self.norm = text.embed_tokens, text.layers, text.norm
        self.rotary, self.head = text.rotary_emb, model.lm_head
        for layer in self.layers:
            if getattr(layer.self_attn, "sliding_window", None) is not None:
                raise ValueError("sliding-window attention layers are not supported by the "
                                 "torch engine's decode step")
        self.slots = slots
        capacity = slots.keys[0].shape[2]
        self.index = torch.arange(capacity, device=slots.pos.device)  # (L,) cache indices
        self.graphs = cuda_graphs and slots.pos.device.type == "cuda"
        self._captured: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.graphs else None

    def step(self, n: int) -> torch.Tensor:
        """Feed `last` of slots 0 .. n - 1 (written into their cache at `pos`); their next-token
        logits (n, V) fp32 (on CUDA a graph's output buffer, valid until the next step)."""
        if not self.graphs:
            return self.forward(n)
        if n not in self._captured:
            self._captured[n] = self._capture(n)
        graph, logits = self._captured[n]
        graph.replay()
        return logits

    def _capture(self, n: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """A graph of `forward(n)`, warmed up on a side stream first (the warm-up writes the
        keys and values the step itself will write: same tokens at the same places). Only this
        thread is held to the capture's rules: with `train.max_staleness` > 0 the learner keeps
        training on the same GPU from another thread meanwhile."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.forward(n)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            logits = self.forward(n)
        return graph, logits

    def forward(self, n: int) -> torch.Tensor:
        """The step's math, eagerly (what a graph captures). Returns (n, V) fp32 logits."""
        s = self.slots
        pos = s.pos[:n]
        x = self.embed(s.last[:n, None])  # (n, 1, hidden)
        cos, sin = self.rotary(x, s.mpos[:n].view(1, n, 1).expand(3, n, 1))  # (n, 1, D) each
        mask = (self.index[None] <= pos[:, None])[:, None, None]  # (n, 1, 1, L)
        for layer, keys, values in zip(self.layers, s.keys, s.values):
            attn = layer.self_attn
            kv_heads, head_dim = keys.shape[1], keys.shape[3]
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(n, -1, head_dim)  # (n, H, D)
            k = attn.k_proj(h).view(n, kv_heads, head_dim)  # (n, H_kv, D)
            v = attn.v_proj(h).view(n, kv_heads, head_dim)
            if hasattr(attn, "q_norm"):  # Qwen3-VL: RMSNorm over head_dim before RoPE
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            at = pos.view(n, 1, 1, 1).expand(n, kv_heads, 1, head_dim)
            keys[:n].scatter_(2, at, k[:, :, None])
            values[:n].scatter_(2, at, v[:, :, None])
            # query head j reads KV head j // groups (transformers' repeat_kv): (n, H_kv, G, D)
            out = F.scaled_dot_product_attention(
                q.view(n, kv_heads, -1, head_dim), keys[:n], values[:n], attn_mask=mask,
                scale=attn.scaling)
            x = x + attn.o_proj(out.reshape(n, 1, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.head(self.norm(x))[:, 0].float()
