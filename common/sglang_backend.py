"""SGLang servers as a `common.engine.Backend`: rollouts for any learner.

Servers are given by URL (`engine.sglang_urls`) or launched here by process 0
(`common.sglang_server`). After every optimizer step the learner's weights are exported as an
HF directory (`common.checkpoints.export_weights`, written atomically) and loaded by every
server with /update_weights_from_disk, then the radix cache is flushed. With
`engine.sglang_colocated` the servers release their accelerator memory around the update.
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
        from common.sglang_engine import SGLangEngine
        from common.sglang_server import launch_servers

        e = cfg.engine
        self.comm, self.workdir, self.free_memory = comm, Path(workdir), free_memory
        self.colocated, self.group, self.version = e.sglang_colocated, None, 0
        urls = [u.strip() for u in e.sglang_urls.split(",") if u.strip()]
        if not urls and comm.rank == 0:
            self.group = launch_servers(
                model_dir, n=e.sglang_servers, gpus_per_server=e.sglang_gpus_per_server,
                mem_fraction=e.sglang_mem_fraction,
                attention_backend=e.sglang_attention_backend or None,
                port_base=e.sglang_port_base, memory_saver=e.sglang_colocated,
                log_dir=str(self.workdir / "sglang_logs"))
            urls = self.group.urls
        urls = comm.gather(urls)[0]
        image_token_id = json.loads((Path(model_dir) / "config.json").read_text())["image_token_id"]
        self.engine = SGLangEngine(urls, image_token_id=image_token_id, processor=processor,
                                   timeout_s=e.sglang_timeout_s, max_retries=e.sglang_max_retries,
                                   max_concurrency=e.sglang_max_concurrency)

    def sync(self, learner) -> None:
        path = export_weights(self.workdir / "weights_for_sglang", learner, self.comm)
        self.version += 1
        if self.comm.rank == 0:
            self.engine.update_weights_from_disk(str(path.resolve()))
            self.engine.flush_cache()
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
