"""SGLang servers as a `common.engine.Backend`: rollouts for any learner.

Servers are given by URL (`engine.sglang_urls`; their SGLang version is checked; every process
uses all of them) or launched here as `common.sglang.placement` places them: colocated, one
server per block of `engine.sglang_gpus_per_server` learner GPUs, started by the block's first
process, each process generating through the server on its own GPU; otherwise
`engine.sglang_servers` servers on GPUs of their own from `engine.sglang_base_gpu`, started by
process 0 and shared; a MoE model's experts split into `engine.sglang_ep_size` groups over each
server's GPUs (`check_expert_groups` first). Each launch waits until its servers generate
(`common.sglang.server`); the learner's cached accelerator memory is handed back first
(`free_memory`), so SGLang sizes its KV cache on what is really free. A failed launch stops
every process, each saying which server failed.

Weight sync after every optimizer step, as weight version <step>, checked on every server
(/model_info) and in every later answer (`common.sglang.engine`):
  * in memory (colocated, with a learner that hands over `weights`, a
    `TensorWeights`; `engine.sglang_weight_sync` "auto" or "tensor"): the weights in bf16,
    bucket by bucket (`engine.sglang_bucket_mb`), each process serializing its own GPU's copy;
    the first process of each server gathers its block's payloads (one per tp rank) and sends
    them inside one weight-update session; every process keeps a bucket alive until all
    servers loaded it (a barrier);
  * from files (otherwise): the weights as an HF directory, written atomically
    (`common.checkpoints.export_weights`): bf16 safetensors shards when the learner hands over
    `weights` (`TensorWeights.write_safetensors`), else the learner's own export; every server
    loads it with /update_weights_from_disk (it must see the same filesystem).

Colocated memory (`train_context`): every server releases all its memory around the update
(only once idle: running requests aborted, /flush_cache polled), the learner hands its cached
memory back, then the servers take back their weights' memory, load the new weights (released
weights come back as garbage: SGLang keeps no copy) and only then their KV cache and CUDA
graphs, so a bucket in flight never competes with the KV cache (slime's order).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Callable, Iterator, Protocol, Sequence

from common.checkpoints import export_weights
from common.learner import Collectives
from common.sglang.placement import place
from common.sglang.wire import SGLangError

WEIGHT_SYNCS = ("auto", "tensor", "disk")
WEIGHTS_TAG, REST_TAGS = ["weights"], ["kv_cache", "cuda_graph"]  # srt/constants.py


class TensorWeights(Protocol):
    """A learner's weights in the form SGLang loads them (geo3k_torch.weight_sync). Every
    process calls every method at the same point (collectives inside)."""

    def tensor_buckets(self, bucket_bytes: int) -> Iterator[tuple[str, bool]]:
        """(payload, last) per bucket: the bucket's bf16 weights under their checkpoint names
        as a base64 pickled [(name, tensor)] of tensors on this process's device; a payload
        stays valid until the next one is drawn."""

    def write_safetensors(self, out_dir: Path, shard_bytes: int) -> None:
        """The weights as a bf16 HF directory (sharded safetensors, index, the source's
        config and processor files); process 0 writes."""


def check_expert_groups(ep: int, config: dict, model_dir: str) -> None:
    """Refuse `engine.sglang_ep_size` > 1 unless it divides the expert count of the model's
    config.json (`text_config.num_experts`): SGLang gives each group E / ep experts."""
    experts = config.get("text_config", config).get("num_experts", 0)
    if ep > 1 and not experts:
        raise ValueError(f"engine.sglang_ep_size={ep} splits a MoE model's experts, and "
                         f"{model_dir}/config.json has none (no text_config.num_experts): "
                         "set it to 1")
    if ep > 1 and experts % ep:
        raise ValueError(f"engine.sglang_ep_size={ep} must divide the {experts} experts of "
                         f"{model_dir}/config.json (text_config.num_experts)")


def routing_shape(config: dict, model_dir: str) -> tuple[int, int]:
    """(L, K) of the routed experts SGLang returns for the model of `config` (its config.json):
    every decoder layer's (`text_config.num_hidden_layers`; a dense layer's rows would be 0, so
    a model with dense layers is refused) and its top k (`num_experts_per_tok`)."""
    text = config.get("text_config", config)
    if not text.get("num_experts"):
        raise ValueError(f"loss.routing_replay needs a MoE model; {model_dir}/config.json has "
                         "no text_config.num_experts")
    if text.get("mlp_only_layers") or text.get("decoder_sparse_step", 1) != 1:
        raise ValueError(f"loss.routing_replay: {model_dir}/config.json has dense decoder "
                         "layers (mlp_only_layers, decoder_sparse_step), whose rows SGLang "
                         "fills with expert 0")
    return int(text["num_hidden_layers"]), int(text["num_experts_per_tok"])


def local_layout(comm: Collectives) -> tuple[int, int]:
    """(local rank, processes on this node): torchrun's LOCAL_RANK / LOCAL_WORLD_SIZE, else
    one node."""
    return (int(os.environ.get("LOCAL_RANK", comm.rank)),
            int(os.environ.get("LOCAL_WORLD_SIZE", comm.world)))


class SGLangBackend:
    def __init__(self, cfg, model_dir: str, processor, workdir: str | Path, comm: Collectives,
                 free_memory: Callable[[], None] = lambda: None,
                 weights: TensorWeights | None = None, local: tuple[int, int] | None = None):
        """free_memory: the learner's hook that hands its cached accelerator memory back
        (torch: `torch.cuda.empty_cache`). weights: the learner's `TensorWeights` (None: the
        disk path through `learner.export_hf`). local: (local rank, processes on this node);
        None: `local_layout`."""
        from common.sglang.engine import SGLangEngine

        e = cfg.engine
        if e.sglang_weight_sync not in WEIGHT_SYNCS:
            raise ValueError(f"engine.sglang_weight_sync must be one of {WEIGHT_SYNCS}, got "
                             f"{e.sglang_weight_sync!r}")
        self.comm, self.workdir, self.free_memory = comm, Path(workdir), free_memory
        self.weights, self.bucket_bytes = weights, int(e.sglang_bucket_mb * 2 ** 20)
        self.colocated, self.group = e.sglang_colocated, None
        urls = [u.strip() for u in e.sglang_urls.split(",") if u.strip()]
        # in memory: each server must sit on its processes' GPUs, which a launch here
        # guarantees and given URLs can only for one process (the user says colocated)
        self.in_memory = (self.colocated and weights is not None and e.sglang_weight_sync != "disk"
                          and (not urls or comm.world == 1))
        if e.sglang_weight_sync == "tensor" and not self.in_memory:
            raise ValueError("engine.sglang_weight_sync='tensor' needs colocated servers "
                             "(engine.sglang_colocated=True; launched here, or one given URL "
                             "for a one-process run) and a learner that hands its weights over "
                             "(the torch learner); use 'auto' or 'disk'")
        config = json.loads((Path(model_dir) / "config.json").read_text())
        self.routing = routing_shape(config, model_dir) if cfg.loss.routing_replay else None
        if urls:  # process 0 controls every server; every process generates through all
            self.leads, self.tp_ranks, mine = comm.rank == 0, [comm.rank], urls
        else:
            check_expert_groups(e.sglang_ep_size, config, model_dir)
            mine = self._launch(cfg, model_dir, local or local_layout(comm))
        self.engine = SGLangEngine(mine, image_token_id=config["image_token_id"],
                                   processor=processor,
                                   timeout_s=e.sglang_timeout_s, max_retries=e.sglang_max_retries,
                                   max_concurrency=e.sglang_max_concurrency,
                                   check_prompt_ids=e.sglang_check_prompt_ids,
                                   idle_timeout_s=e.sglang_idle_timeout_s, routing=self.routing)
        if urls and comm.rank == 0:
            self.engine.check_server_versions()
        self._rest_released = False  # KV cache and CUDA graphs wait for the new weights

    def _launch(self, cfg, model_dir: str, local: tuple[int, int]) -> list[str]:
        """Start this process's servers (if any) and wait for every process's; returns the
        URLs this process generates through."""
        from common.sglang.server import launch_servers

        e, comm = cfg.engine, self.comm
        local_rank, local_world = local
        if not e.sglang_colocated and local_world != comm.world:
            raise ValueError("servers launched here (no engine.sglang_urls) answer on "
                             "127.0.0.1 of the first node only: with several nodes set "
                             "engine.sglang_colocated=True or give engine.sglang_urls")
        plan = place(e, comm.rank, local_rank, local_world)
        g = e.sglang_gpus_per_server
        # each server is led by the first process of its GPU block (its tp ranks) when
        # colocated, by process 0 otherwise
        self.leads = bool(plan.launch)
        first = comm.rank - local_rank % g
        self.tp_ranks = list(range(first, first + g))
        specs = [plan.servers[i] for i in plan.launch]
        urls: list[str] = []

        def launch() -> None:
            self.free_memory()  # SGLang sizes its KV cache on the memory free at start
            self.group = launch_servers(
                model_dir, n=len(specs), gpus_per_server=g, base_gpu=specs[0].base_gpu,
                port_base=specs[0].port, ep_size=e.sglang_ep_size,
                mem_fraction=e.sglang_mem_fraction,
                attention_backend=e.sglang_attention_backend or None,
                memory_saver=e.sglang_colocated, routed_experts=self.routing is not None,
                startup_timeout_s=e.sglang_startup_timeout_s,
                health_timeout_s=e.sglang_health_timeout_s,
                log_dir=str(self.workdir / "sglang_logs" / f"process{comm.rank}"))
            urls.extend(self.group.urls)

        self._on_leads(launch, "SGLang launch", errors=(Exception,))
        node = range(comm.rank - local_rank, comm.rank - local_rank + local_world)
        launched = comm.gather(urls)  # this node's servers, by port
        by_port = {int(u.rsplit(":", 1)[1]): u for r in node for u in launched[r]}
        return [by_port[plan.servers[i].port] for i in plan.use]

    def _on_leads(self, fn: Callable[[], None], what: str,
                  errors: tuple[type, ...] = (SGLangError,)) -> None:
        """fn() on the processes that lead servers; a failure anywhere is raised on every
        process (the failing one re-raises its own error, the others name it)."""
        failure = None
        if self.leads:
            try:
                fn()
            except errors as err:
                failure = err
        said = [m for m in self.comm.gather(f"process {self.comm.rank}: {failure}"
                                            if failure else "") if m]
        if failure is not None:
            if self.group is not None and what == "SGLang launch":
                self.group.shutdown()
            raise failure
        if said:
            if self.group is not None and what == "SGLang launch":
                self.group.shutdown()
            raise SGLangError(f"{what} failed on another process: " + "; ".join(said))

    # -- weight sync

    def sync(self, learner, step: int) -> None:
        if self.in_memory:
            buckets = self._gathered_buckets()

            def send() -> None:
                try:
                    self.engine.update_weights_from_tensors(buckets, version=step)
                finally:
                    for _ in buckets:  # the remaining collectives, even after a failure
                        pass

            if not self.leads:
                for _ in buckets:
                    pass
            self._on_leads(send, "in-memory weight sync")
        else:
            write = (learner.export_hf if self.weights is None else
                     lambda d: self.weights.write_safetensors(d, self.bucket_bytes))
            path = export_weights(self.workdir / "weights_for_sglang", write, self.comm)
            self._on_leads(lambda: self.engine.update_weights_from_disk(str(path.resolve()),
                                                                        version=step),
                           "weight sync from disk")
        if self._rest_released:
            self._on_leads(lambda: self.engine.resume_memory(REST_TAGS), "resuming memory")
            self._rest_released = False
        self.engine.expect_version(step)  # every process checks the answers it gets

    def _gathered_buckets(self) -> Iterator[tuple[Sequence[str], bool]]:
        """This process's buckets, each with the payloads of its server's tp ranks."""
        for payload, last in self.weights.tensor_buckets(self.bucket_bytes):
            every = self.comm.gather(payload)
            yield [every[r] for r in self.tp_ranks], last
            self.comm.barrier()  # every server has loaded this bucket: its tensors may go

    # -- colocated memory

    @contextlib.contextmanager
    def train_context(self):
        if self.colocated:
            self._on_leads(self.engine.release_memory, "releasing memory")
        try:
            yield
        finally:
            self.free_memory()
            self.comm.barrier()
            if self.colocated:  # with in-memory sync the KV cache waits for the new weights
                self._on_leads(lambda: self.engine.resume_memory(
                    WEIGHTS_TAG if self.in_memory else None), "resuming memory")
                self._rest_released = self.in_memory

    def rng_state(self):
        return None  # SGLang's sampling RNG lives in the servers

    def set_rng_state(self, state) -> None:
        pass

    def close(self) -> None:
        self.engine.close()
        if self.group is not None:
            self.group.shutdown()
