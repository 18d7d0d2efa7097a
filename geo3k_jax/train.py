"""Multi-turn GRPO on Geometry3K with the JAX learner, through the shared loop.

    python -m geo3k_jax.train --config=configs/cpu_perception.py --workdir=runs/jax
    python -m geo3k_jax.train --config=configs/tpu.py --config.model.path=Qwen/Qwen3-VL-2B-Instruct

Builds the JAX pieces (mesh, Flax model from the HF checkpoint, learner) and a rollout backend,
then runs `common.train.train`, the loop the torch learner runs too. Rollouts: with
`engine.backend=local` (the default) the in-process JAX engine
(`geo3k_jax.engine.backend.JaxBackend`), sampling from the learner's own parameters (no torch
model is built); with `engine.backend=torch` the in-process torch engine
(`geo3k_torch.backend.LocalBackend`), loaded after every step with the weights this learner
exports; with `engine.backend=sglang`, SGLang servers synced from the same export. Same workdir
as `python -m geo3k_torch.main`; checkpoints hold the HF export, the orbax learner state
(`jax_state/`) and the slice shapes the run has used (`jax_shapes.json`: a resumed run pads its
steps as the uninterrupted one).
"""

from __future__ import annotations

if __name__ == "__main__":  # --help, a bad --config.<key> or value: answered before jax loads
    from common import cli
    cli.preflight(grpo=True)

import sys

import jax

from common import cli, micro_batch, train as loop
from common.backends import make_backend
from common.grpo import LossConfig
from common.processor import load_processor
from common.hub import checkpoint_dir
from common.prepare import check_config, load_data, model_dir_everywhere
from configs import to_dataclass
from geo3k_jax.core.distributed import JaxCollectives
from geo3k_jax.engine.backend import JaxBackend
from geo3k_jax.core.buckets import Ladder, one_shape
from geo3k_jax.core.compiler import use_compilation_cache
from geo3k_jax.models.layers import remat_of
from geo3k_jax.learner.learner import DTYPES, Learner
from geo3k_jax.models.model import split_params
from geo3k_jax.learner.phases import check_phases, frees_engine
from geo3k_jax.core.sharding import make_mesh
from geo3k_jax.kernels.splash import resolve_attention
from geo3k_jax.models.weights import load_model



def model_dir_of(cfg) -> str:
    """`model.path` (a local folder or a Hub model name, `common.hub`), or the tiny checkpoint
    (built with torch the first time)."""
    if cfg.model.path:
        return checkpoint_dir(cfg.model.path)
    from geo3k_torch.prepare import prepare_model_dir
    return prepare_model_dir(cfg)


def check_budget(cfg, learner, config) -> None:
    """Refuse to start when the learner's step and the JAX engine's largest programs do not fit
    a device together (`geo3k_jax.aot.check_run`; `jax.hbm_check`)."""
    from geo3k_jax.aot import check_run
    from geo3k_jax.engine.kv_budget import device_memory
    if learner.shape is None:
        raise SystemExit("jax.hbm_check compiles the run's one slice shape: set jax.slice "
                         "(targets, patches, window, prefix_window) as configs/tpu.py does")
    memory = (int(cfg.jax.hbm_gib * 2 ** 30) if cfg.jax.hbm_gib
              else device_memory(jax.local_devices()[0]))
    r = check_run(cfg, learner, config, memory)
    if jax.process_index() == 0:
        b = r["budget"]
        print(f"memory budget: {b['worst']} peak {b['peak'] / 2 ** 30:.2f} of "
              f"{memory / 2 ** 30:.2f} GiB a device (jax.hbm_check)", flush=True)


def build(cfg, workdir: str) -> loop.Run:
    """Processes, mesh, data, model, learner and rollout backend for `cfg`."""
    if cfg.jax.distributed:  # multi-host: before any other JAX call
        try:
            jax.distributed.initialize()
        except (ValueError, RuntimeError) as e:
            raise SystemExit(f"jax.distributed=True but JAX found no multi-host cluster to "
                             f"join ({e}). This config is for a TPU slice: on one TPU host "
                             "add --config.jax.distributed=False; on a CPU machine use "
                             "--config=configs/cpu.py") from None
    platform = jax.devices()[0].platform
    if cfg.jax.platform and platform != cfg.jax.platform:
        raise SystemExit(f"this config needs {cfg.jax.platform.upper()} devices "
                         f"(jax.platform={cfg.jax.platform!r}) and JAX sees {platform}; use "
                         "--config=configs/cpu.py on a CPU machine")
    if cfg.jax.compilation_cache_dir:
        use_compilation_cache(cfg.jax.compilation_cache_dir)
    if cfg.jax.compute_dtype not in DTYPES:
        raise ValueError(f"jax.compute_dtype must be one of {sorted(DTYPES)}, got "
                         f"{cfg.jax.compute_dtype!r}")
    if cfg.train.expert_parallel != 1:
        raise ValueError(f"train.expert_parallel={cfg.train.expert_parallel} is the torch "
                         "learner's; the JAX learner splits experts over jax.mesh.expert")
    comm = JaxCollectives()
    check_config(cfg, comm.world)
    notes = check_phases(cfg)  # jax.offload and jax.free_engine against the schedule
    if jax.process_index() == 0:
        for note in notes:
            print(note, flush=True)
    micro_batch.require_fixed(cfg.train.micro_batch_tokens, "the JAX learner (it compiles its "
                              "row length)")
    loss_cfg = to_dataclass(LossConfig, cfg.loss)
    train_set, test_set = load_data(cfg, comm)  # first: a bad data.path fails before any model work
    model_dir = model_dir_everywhere(cfg, comm, lambda: model_dir_of(cfg))
    processor = load_processor(model_dir)
    mesh = make_mesh(dict(cfg.jax.mesh))
    model, config = load_model(model_dir, mesh=mesh, rules=cfg.jax.rules,
                               attention=resolve_attention(cfg.jax.attention, platform, mesh))
    merge, params = split_params(model)
    learner = Learner(merge, params, loss_cfg, cfg.train, cfg.rollout.temperature,
                      processor=processor, config=config, mesh=mesh, rules=cfg.jax.rules,
                      compute_dtype=DTYPES[cfg.jax.compute_dtype],
                      ref_params=params if loss_cfg.kl_coef else None,
                      chunk=cfg.train.logprob_chunk, remat=remat_of(cfg.jax), comm=comm,
                      ladder=Ladder(cfg.jax.row_rungs, cfg.jax.reuse_slack), model_dir=model_dir,
                      shape=one_shape(cfg.jax.slice, cfg.train.micro_batch_tokens))
    if cfg.jax.hbm_check:
        check_budget(cfg, learner, config)
    backend = make_backend(
        cfg, own_kind="jax", model_dir=model_dir, processor=processor, workdir=workdir,
        comm=comm, own=lambda: JaxBackend(
            learner, processor, config, seed=cfg.seed, slots=cfg.engine.slots,
            context=cfg.rollout.max_context_tokens,
            memory_fraction=cfg.engine.kv_memory_fraction, prefill_rows=cfg.engine.prefill_rows,
            prefill_tokens=cfg.engine.prefill_tokens, warm_up=cfg.engine.warm_up,
            free=frees_engine(cfg), offload=cfg.jax.offload))
    counters = backend.metrics if isinstance(backend, JaxBackend) else dict
    return loop.Run(learner, backend, comm, processor, train_set, test_set, counters=counters)


def same_workdir(cfg, name: str) -> str:
    """The default run folder (`common.cli.main`): `name` on one host; several hosts
    (`jax.distributed`) join only when the run is built, too late to agree on a name from each
    one's clock, so they need `--workdir` (exit status 2 without it)."""
    if cfg.jax.distributed:
        sys.stderr.write("error: jax.distributed=True runs a process per host, and they need one "
                         "--workdir to share: pass --workdir=<a folder every host sees, or a "
                         "gs:// URL>\n")
        sys.exit(2)
    return name


def train(cfg, workdir: str) -> dict:
    """Build the JAX run and train it; returns the last step's metrics."""
    loop.check_workdir(cfg, workdir)
    return loop.train(cfg, workdir, build(cfg, workdir))


if __name__ == "__main__":
    cli.main(train, rank=jax.process_index, suffix="-jax", grpo=True,
             same_workdir=same_workdir)
