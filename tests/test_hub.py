"""Hub names for `model.path` and `data.path` (common.hub), offline, against a Hugging Face cache
written in huggingface_hub's own layout (<type>s--owner--name/{refs/main, snapshots/<commit>/
links into blobs/}): the real entry points read a model and a Geometry3K-shaped dataset (the
Hub copy's columns: images as [{bytes, path}], problem with <image>, answer) by name, and a name
that is nowhere stops the run first, naming itself and the cache."""

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from common.hub import HubError, checkpoint_dir, is_repo_id, local_path

ROOT = Path(__file__).resolve().parent.parent


def cache_repo(cache: Path, repo_type: str, repo_id: str, files: dict[str, bytes]) -> Path:
    """Write `files` (relative path -> bytes) as the main revision of `repo_id` in the cache
    `cache` the way huggingface_hub stores a download: blobs named by their hash, the snapshot's
    files relative links to them, refs/main the commit. Returns the snapshot folder."""
    owner, name = repo_id.split("/")
    root = cache / f"{repo_type}s--{owner}--{name}"
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    snapshot = root / "snapshots" / commit
    for rel, data in files.items():
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    return snapshot


def geometry3k_parquet(split: str, n: int, seed: int) -> bytes:
    """`n` synthetic problems in the Hub Geometry3K copy's columns and nothing else."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    from common.synthetic import generate

    rows = generate(n, seed, image_size=64, families=("polygon_sides",))
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    table = pa.table({
        "images": pa.array([r["images"] for r in rows], pa.list_(image)),
        "problem": [r["problem"] if "<image>" in r["problem"] else "<image>" + r["problem"]
                    for r in rows],
        "answer": [r["answer"] for r in rows]})
    out = io.BytesIO()
    pq.write_table(table, out)
    return out.getvalue()


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """A cache holding the model acme/tiny-vl (a tiny Qwen3-VL checkpoint) and the dataset
    acme/geometry3k-mini (data/{train,test}-00000-of-00001.parquet, as on the Hub)."""
    from geo3k_torch.tiny import build_tiny_checkpoint

    tmp = tmp_path_factory.mktemp("hub")
    built = Path(build_tiny_checkpoint(tmp / "built", arch="qwen3_vl", vocab="small",
                                       hidden_size=64))
    cache = tmp / "cache"
    cache_repo(cache, "model", "acme/tiny-vl",
               {p.name: p.read_bytes() for p in built.iterdir() if p.is_file()})
    cache_repo(cache, "dataset", "acme/geometry3k-mini", {
        f"data/{split}-00000-of-00001.parquet": geometry3k_parquet(split, 6, seed)
        for split, seed in (("train", 0), ("test", 1))} | {"README.md": b"# mini\n"})
    shutil.rmtree(tmp / "built")
    return cache


def offline(cache: Path) -> dict:
    return dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache), PYTHONPATH=str(ROOT))


def test_repo_ids_and_local_paths(tmp_path):
    """A path that exists is used as it is (even one shaped like owner/name); one that does not
    and cannot be a Hub name says so; a model folder without config.json is refused."""
    assert is_repo_id("Qwen/Qwen3-VL-2B-Instruct") and is_repo_id("hiyouga/geometry3k")
    assert not any(map(is_repo_id, ["/data/geo3k", "./x/y", "a/b/c", "geo3k", "a/../b", "~/x"]))
    (tmp_path / "acme" / "model").mkdir(parents=True)
    os.chdir(tmp_path)
    try:
        assert local_path("acme/model", "model.path", "model") == "acme/model"
        with pytest.raises(HubError, match="has no config.json"):
            checkpoint_dir("acme/model")
    finally:
        os.chdir(ROOT)
    with pytest.raises(HubError, match=r"data.path='/no/such/dir': no such file or directory"):
        local_path("/no/such/dir", "data.path", "dataset")


def test_evaluate_reads_a_hub_model_and_dataset_offline(hub_cache, tmp_path):
    """geo3k_torch.evaluate with both names: the snapshot's checkpoint and the dataset's Hub
    columns are read, offline, and the report covers the test split's 6 problems."""
    out = tmp_path / "eval"
    args = [sys.executable, "-m", "geo3k_torch.evaluate", "--config=configs/cpu.py",
            "--config.model.path=acme/tiny-vl", "--config.data.path=acme/geometry3k-mini",
            "--config.rollout.max_response_tokens=8", "--config.eval.n_samples=1",
            f"--out={out}"]
    run = subprocess.run(args, cwd=ROOT, env=offline(hub_cache), capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "(6 problems" in run.stdout and (out / "eval.json").exists()


@pytest.mark.parametrize("field", ["data.path", "model.path"])
def test_a_name_in_no_cache_stops_the_run_naming_it_and_the_cache(hub_cache, tmp_path, field):
    """Through geo3k_torch.main, offline: a Hub name the cache lacks fails with one error that
    names the setting, the name and the cache, before any model is built (a missing data set
    stops the run before the model is looked at: no tiny checkpoint appears)."""
    args = [sys.executable, "-m", "geo3k_torch.main", "--config=configs/cpu.py",
            f"--config.{field}=acme/not-there", f"--config.model.tiny_dir={tmp_path / 'tiny'}",
            f"--config.data.synthetic_dir={tmp_path / 'data'}", f"--workdir={tmp_path / 'run'}"]
    if field == "model.path":
        args.append("--config.data.path=acme/geometry3k-mini")
    run = subprocess.run(args, cwd=ROOT, env=offline(hub_cache), capture_output=True, text=True,
                         timeout=300)
    assert run.returncode != 0
    assert f"{field}='acme/not-there'" in run.stderr and str(hub_cache) in run.stderr, \
        run.stderr[-3000:]
    assert "HF_HUB_OFFLINE=1" in run.stderr
    assert not (tmp_path / "tiny").exists()
