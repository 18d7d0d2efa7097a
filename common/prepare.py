"""What a run needs before it starts, for any learner: the data splits and a sane config.

With `data.path` empty the synthetic set is generated into `data.synthetic_dir` once, from
`data.synthetic_seed` (never the run's `seed`: runs of every seed, in any order, read the same
problems). The folder records what each split was made from (`synthetic.json`); a split of other
settings is never reused, and never overwritten. The model directory is the learner's business (a
tiny checkpoint is built with torch: `geo3k_torch.prepare.prepare_model_dir`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from pathlib import Path
from typing import Callable, Iterator

from common.backends import ENGINE_BACKENDS
from common.chat import ChatRenderer
from common.config_rules import problems
from common.data import DataError, load_split
from common.dedup import content_key, overlap
from common.hub import HubError, checkpoint_dir, data_path
from common import micro_batch
from common.processor import MODEL_TYPES
from common.prompts import prompt_style
from common.synthetic import FAMILIES, parse_image_size, split_keys, write_split


def prepare_data(cfg, shard: tuple[int, int] = (0, 1), separate: bool = True):
    """(train split, test split) as loaded by `common.data.load_split` from `data.path` (a local
    path or a Hub dataset name, `common.hub`), or from the synthetic set, written first if
    `data.path` is empty and it is missing: the whole train split (every process samples from
    one shared order, `common.sampler`) and the test split's rows k modulo n with
    `shard=(k, n)` (each process evaluates its share); kept apart (`separate_splits`) unless
    `separate` is False (`load_data` checks all shares)."""
    path = data_path(cfg.data.path) if cfg.data.path else write_synthetic(cfg)
    system, _ = prompt_style(cfg.data.prompt_style)
    train, test = (load_split(path, split=s, skip_bad=cfg.data.skip_bad_rows, system=system,
                              shard=part)
                   for s, part in ((cfg.data.train_split, (0, 1)), (cfg.data.test_split, shard)))
    return separate_splits(cfg, train, test, lambda x: [x]) if separate else (train, test)


OVERLAP_MODES = ("refuse", "drop")
SHOWN = 8  # overlapping pairs an error names


def separate_splits(cfg, train, test, gather: Callable[[object], list]):
    """`train` and `test` with no test problem that repeats a train problem (the same text over
    the same pixels: `common.dedup`): with `data.overlap="refuse"` a repeat raises `DataError`
    naming the uids, with "drop" the test split leaves it out (`skipped["overlap"]`). `gather`
    (`Collectives.gather`) brings every process's test keys (each holds the whole train split),
    so every process sees every pair. Not
    checked where both splits are one split or one file on purpose (a test split named as the
    train split, a single parquet file)."""
    if cfg.data.overlap not in OVERLAP_MODES:
        raise ValueError(f"data.overlap must be one of {OVERLAP_MODES}, got {cfg.data.overlap!r}")
    if cfg.data.train_split == cfg.data.test_split or Path(train.path).is_file():
        return train, test
    train_keys, test_keys = ([(p.uid, content_key(p.problem, p.images)) for p in split.prompts]
                             for split in (train, test))
    pairs = overlap(train_keys, [pair for part in gather(test_keys) for pair in part])
    if not pairs:
        return train, test
    if cfg.data.overlap == "refuse":
        named = ", ".join(f"{a} = {b}" for a, b in pairs[:SHOWN])
        raise DataError(
            f"{len(pairs)} {cfg.data.test_split!r} problem(s) repeat {cfg.data.train_split!r} "
            f"ones (the same text over the same pixels; test uid = train uid): {named}"
            f"{' ...' if len(pairs) > SHOWN else ''}. Remove them from the data, or leave them "
            "out of the evaluation with data.overlap=drop")
    drop = {a for a, _ in pairs}
    keep = [i for i, p in enumerate(test.prompts) if p.uid not in drop]
    test.skipped["overlap"] += len(test.prompts) - len(keep)
    test.prompts = [test.prompts[i] for i in keep]
    test.rows = [test.rows[i] for i in keep] if test.rows else test.rows
    return train, test


SYNTHETIC_RECORD = "synthetic.json"  # {split: synthetic_spec's entry} in data.synthetic_dir
TEST_SEED_OFFSET = 10_000  # the test split is drawn from data.synthetic_seed + this


def synthetic_spec(cfg) -> dict:
    """{split name: {"n", "seed", "image_size": [lo, hi], "families": [...], "distinct_from":
    [split, ...]}}: what each split of the synthetic set is generated from; no problem of a
    split repeats one of its own or of the splits it is distinct from (`write_split`)."""
    spec = cfg.data.synthetic_families.replace(" ", "")
    families = list(spec.split(",") if spec else FAMILIES)
    size = list(parse_image_size(cfg.data.synthetic_image_size))
    seed, train = cfg.data.synthetic_seed, cfg.data.train_split
    return {split: {"n": n, "seed": s, "image_size": size, "families": families,
                    "distinct_from": after}
            for split, n, s, after in (
                (train, cfg.data.synthetic_train_size, seed, []),
                (cfg.data.test_split, cfg.data.synthetic_test_size, seed + TEST_SEED_OFFSET,
                 [train]))}


def data_spec(cfg, split: str | None = None) -> dict:
    """What the run's data is, for a build record: `data.path` and the split (both splits when
    `split` is None), or what the synthetic set's split (or splits) is generated from."""
    splits = [split] if split else [cfg.data.train_split, cfg.data.test_split]
    if cfg.data.path:
        return {"path": cfg.data.path, "split": split} if split else {"path": cfg.data.path,
                                                                       "splits": splits}
    spec = synthetic_spec(cfg)
    return spec[split] if split else {s: spec[s] for s in splits}


def data_keys(cfg) -> frozenset[str]:
    """The content keys (`common.dedup.content_key`) of every train and test problem."""
    train, test = prepare_data(cfg, separate=False)
    return frozenset(content_key(p.problem, p.images) for p in train.prompts + test.prompts)


def read_record(path: Path, error: type[Exception]) -> dict | None:
    """The JSON object in `path` (a folder's record of what it was built from), None if there is
    no such file; raises `error` if it holds anything else."""
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{path}: unreadable ({type(e).__name__}: {e}); remove its folder to have it "
                    "built again") from None
    if not isinstance(record, dict):
        raise error(f"{path}: not a JSON object; remove its folder to have it built again")
    return record


@contextlib.contextmanager
def build_lock(target: str | os.PathLike) -> Iterator[None]:
    """Hold an exclusive lock on `target`'s sibling `.<name>.lock` file: two runs started at once
    on a fresh folder build it one after the other (the second then finds it built)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def write_synthetic(cfg) -> str:
    """Generate the synthetic splits into `data.synthetic_dir` unless they are there; returns
    that folder. Raises `DataError` if a split there was made from other settings than
    `synthetic_spec(cfg)`'s, or without a record of them."""
    path = Path(cfg.data.synthetic_dir)
    with build_lock(path):
        record_file = path / SYNTHETIC_RECORD
        record = read_record(record_file, DataError) or {}
        for split, want in synthetic_spec(cfg).items():
            if list(path.glob(f"{split}-*.parquet")):
                if record.get(split) != want:
                    made = (f"from {record[split]}" if split in record else
                            f"with no record of its settings ({SYNTHETIC_RECORD})")
                    raise DataError(
                        f"data.synthetic_dir={str(path)!r} holds a {split!r} split made {made}, "
                        f"but this config asks for {want}: point data.synthetic_dir at another "
                        f"folder (it is generated there), remove this one, or read it as it is "
                        f"with data.path={str(path)!r}")
                continue
            # recorded first: a split cut short leaves no parquet, and is generated again
            record[split] = want
            path.mkdir(parents=True, exist_ok=True)
            tmp = record_file.with_name(f".{SYNTHETIC_RECORD}.tmp")
            tmp.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
            tmp.replace(record_file)
            exclude = set().union(*(split_keys(f) for other in want["distinct_from"]
                                    for f in path.glob(f"{other}-*.parquet")))
            write_split(path, split, want["n"], want["seed"], image_size=want["image_size"],
                        families=tuple(want["families"]), exclude=exclude)
    return str(path)


def load_data(cfg, comm):
    """The whole train split and each process's share of the test split (`prepare_data` with
    `shard=(rank, world)`): process 0 writes a missing synthetic set (or downloads a Hub
    dataset) first; then every process reads and checks its rows from `data.path` (or the
    synthetic set's folder), the same path on every host (a Hub name: each host's cache). No
    dataset crosses processes (only content keys do, for `separate_splits`); a process that
    cannot read its rows makes every process stop (`DataError`, `HubError`), not wait for
    it."""
    error = None
    if comm.rank == 0:
        try:
            data_path(cfg.data.path) if cfg.data.path else write_synthetic(cfg)
        except (DataError, HubError) as e:
            error = e
    comm.barrier()
    if error is None:
        try:
            splits = prepare_data(cfg, (comm.rank, comm.world), separate=False)
        except (DataError, HubError) as e:
            error = e
    failed = comm.sum_scalars({"failed": float(error is not None)})["failed"]
    if error is not None:
        raise error
    if failed:
        raise DataError(f"{int(failed)} of the {comm.world} processes could not read their share "
                        "of the data (their logs say why)")
    return separate_splits(cfg, *splits, comm.gather)  # every process, all shares' keys


def model_dir_everywhere(cfg, comm, prepare: Callable[[], str]) -> str:
    """The model folder on every process: process 0 runs `prepare` (which builds the tiny
    checkpoint, or downloads a Hub model), the others take its path once it is done, except
    that with `model.path` set each resolves it itself (`common.hub.checkpoint_dir`: a Hub name is
    in each host's own cache, downloaded there if missing)."""
    first = comm.gather(prepare() if comm.rank == 0 else None)[0]
    return checkpoint_dir(cfg.model.path) if cfg.model.path and comm.rank else first


def make_renderer(cfg, processor) -> ChatRenderer:
    """The chat renderer of `data.prompt_style` (with the scoring tool's schema, or none), the
    tool presented as `model.tool_format` says."""
    return ChatRenderer(processor, tools=prompt_style(cfg.data.prompt_style)[1],
                        tool_format=cfg.model.tool_format)


def check_ranges(cfg) -> None:
    """Refuse numeric settings outside their ranges (`common.config_rules.RANGES`), each named
    with its value and range on a line: a negative learning rate stops here, not in the
    optimizer after the model loaded. (The entry points' preflight refuses them sooner.)"""
    found = problems(cfg)
    if found:
        raise ValueError("\n".join(found))


def check_config(cfg, world: int) -> None:
    """Refuse settings that cannot run, before anything is built."""
    check_ranges(cfg)
    if cfg.model.tiny_arch not in MODEL_TYPES:
        raise ValueError(f"model.tiny_arch must be one of {MODEL_TYPES}, got "
                         f"{cfg.model.tiny_arch!r}")
    if cfg.engine.backend not in ENGINE_BACKENDS:
        raise ValueError(f"engine.backend must be one of {ENGINE_BACKENDS}, got "
                         f"{cfg.engine.backend!r}")
    if cfg.train.activation_checkpointing not in ("full", "selective", "none"):
        raise ValueError(f"train.activation_checkpointing must be full, selective or none, got "
                         f"{cfg.train.activation_checkpointing!r}")
    if cfg.train.fsdp not in ("auto", "always"):
        raise ValueError(f"train.fsdp must be auto or always, got {cfg.train.fsdp!r}")
    tokens = micro_batch.setting(cfg.train.micro_batch_tokens)  # a number or "auto"
    if tokens != micro_batch.AUTO and tokens < cfg.rollout.max_context_tokens:
        raise ValueError(f"train.micro_batch_tokens={cfg.train.micro_batch_tokens} must hold one "
                         f"whole episode: at least rollout.max_context_tokens="
                         f"{cfg.rollout.max_context_tokens}")
    if cfg.train.max_staleness and cfg.engine.backend == "sglang" and cfg.engine.sglang_colocated:
        raise ValueError("train.max_staleness > 0 generates while the learner trains, but "
                         "engine.sglang_colocated=True releases the servers' memory during "
                         "training: run the servers on their own GPUs (sglang_colocated=False)")
    if cfg.engine.backend == "sglang" and not cfg.engine.sglang_urls.strip():
        from common.sglang.placement import place  # a bad server layout stops here, not later
        place(cfg.engine, 0, 0, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    if cfg.train.max_staleness and cfg.loss.tis_cap is None:
        raise ValueError(f"train.max_staleness={cfg.train.max_staleness} trains on rollouts of "
                         "older weights, and loss.tis_cap is None leaves them uncorrected: set "
                         "loss.tis_cap (2.0 is slime's value) to weight each token by the "
                         "capped ratio of the current to the behaviour policy, or max_staleness=0")
    ep = cfg.train.expert_parallel
    if world % ep:
        raise ValueError(f"train.expert_parallel={ep} must divide the {world} processes: each "
                         "group of that many splits a MoE model's experts among its ranks")
    if ep > 1 and cfg.train.compile:
        raise ValueError(f"train.expert_parallel={ep} with train.compile=True: the experts' "
                         "all-to-all sizes are read on the host, a break in every compiled "
                         "layer's graph; set one of them off")
    if cfg.train.prompts_per_step % world:
        raise ValueError(f"train.prompts_per_step={cfg.train.prompts_per_step} must be a "
                         f"multiple of the {world} processes")
