"""SGLang servers as a `common.engine.Backend`: rollouts for any learner.

Servers are given by URL (`engine.sglang_urls`; their SGLang version is checked) or launched here
by process 0 (`common.sglang.server`: waits until they generate, checks the version). After every
optimizer step the learner's weights are exported as an HF directory
(`common.checkpoints.export_weights`, written atomically) and loaded by every server with
/update_weights_from_disk as weight version <step> (SGLang flushes its radix cache after a load);
the servers must then report that version, and so must every later answer. With
`engine.sglang_colocated` the servers release their accelerator memory around the update, only
once idle (running requests aborted, /flush_cache polled until it succeeds), and the learner
hands its cached memory back before they take theirs again.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from common.checkpoints import export_weights
from common.learner import Collectives


class SGLangBackend:
    def __init__(self, cfg, model_dir: str, processor, workdir: str | Path, comm: Collectives,
                 free_memory=lambda: None):
        """free_memory: the learner's hook that hands its cached accelerator memory back
        before the servers take theirs again (torch: `torch.cuda.empty_cache`)."""
        from common.sglang.engine import SGLangEngine
        from common.sglang.server import launch_servers

        e = cfg.engine
        self.comm, self.workdir, self.free_memory = comm, Path(workdir), free_memory
        self.colocated, self.group = e.sglang_colocated, None
        urls = [u.strip() for u in e.sglang_urls.split(",") if u.strip()]
        if not urls and comm.rank == 0:
            self.group = launch_servers(
                model_dir, n=e.sglang_servers, gpus_per_server=e.sglang_gpus_per_server,
                mem_fraction=e.sglang_mem_fraction,
                attention_backend=e.sglang_attention_backend or None,
                port_base=e.sglang_port_base, memory_saver=e.sglang_colocated,
                startup_timeout_s=e.sglang_startup_timeout_s,
                health_timeout_s=e.sglang_health_timeout_s,
                log_dir=str(self.workdir / "sglang_logs"))
        given = bool(urls)
        urls = comm.gather(self.group.urls if self.group else urls)[0]
        image_token_id = json.loads((Path(model_dir) / "config.json").read_text())["image_token_id"]
        self.engine = SGLangEngine(urls, image_token_id=image_token_id, processor=processor,
                                   timeout_s=e.sglang_timeout_s, max_retries=e.sglang_max_retries,
                                   max_concurrency=e.sglang_max_concurrency,
                                   check_prompt_ids=e.sglang_check_prompt_ids,
                                   idle_timeout_s=e.sglang_idle_timeout_s)
        if given and comm.rank == 0:
            self.engine.check_server_versions()

    def sync(self, learner, step: int) -> None:
        path = export_weights(self.workdir / "weights_for_sglang", learner, self.comm)
        if self.comm.rank == 0:  # raises StaleWeightsError if a server did not take it
            self.engine.update_weights_from_disk(str(path.resolve()), version=step)
        self.comm.barrier()

    @contextlib.contextmanager
    def train_context(self):
        if self.colocated and self.comm.rank == 0:
            self.engine.release_memory()
        self.comm.barrier()
        try:
            yield
        finally:
            self.free_memory()
            self.comm.barrier()
            if self.colocated and self.comm.rank == 0:
                self.engine.resume_memory()
            self.comm.barrier()

    def rng_state(self):
        return None  # SGLang's sampling RNG lives in the servers

    def set_rng_state(self, state) -> None:
        pass

    def close(self) -> None:
        self.engine.close()
        if self.group is not None:
            self.group.shutdown()
