"""A workdir in an object store (`common.storage.mirrored`), against a GCS server on localhost
(tests/fake_gcs.py): what a run writes locally reaches the bucket while it runs and at its end,
a resumed run continues the bucket's run log, scratch and half-written files stay behind, and a
run that fails still leaves its files in the bucket."""

import time

import pytest

from common import storage


@pytest.fixture(scope="module")
def gcs():
    from tests.fake_gcs import fake_gcs
    with fake_gcs() as bucket:
        yield bucket


def read(url: str) -> str:
    return storage.path(url).read_text()


def test_a_local_workdir_is_itself(tmp_path):
    with storage.mirrored(tmp_path / "run") as local:
        assert local == tmp_path / "run"


def test_a_bucket_workdir_is_copied_up_while_the_run_writes_and_at_its_end(gcs):
    url = f"gs://{gcs}/mirror-run"
    with storage.mirrored(url, every_s=0.05) as local:
        (local / "metrics.jsonl").write_text('{"step": 1}\n')
        deadline = time.monotonic() + 30
        while not storage.path(f"{url}/metrics.jsonl").exists():  # the background copy
            assert time.monotonic() < deadline, "nothing reached the bucket while running"
            time.sleep(0.05)
        with (local / "metrics.jsonl").open("a") as f:
            f.write('{"step": 2}\n')
        (local / "rollouts" / "images").mkdir(parents=True)
        (local / "rollouts" / "images" / "p0_0.png").write_bytes(b"\x89PNG")
        (local / "rollouts" / "step_2.tmp").write_text("half written")
        (local / "weights_for_engine").mkdir()
        (local / "weights_for_engine" / "model.safetensors").write_bytes(b"0" * 64)
    assert not local.exists()  # removed once everything is up
    assert read(f"{url}/metrics.jsonl") == '{"step": 1}\n{"step": 2}\n'
    assert storage.path(f"{url}/rollouts/images/p0_0.png").read_bytes() == b"\x89PNG"
    assert not storage.path(f"{url}/rollouts/step_2.tmp").exists()
    assert not storage.path(f"{url}/weights_for_engine").exists()

    # a resumed run starts from the bucket's run log and appends to it
    with storage.mirrored(url, every_s=3600) as local:
        assert (local / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
        with (local / "metrics.jsonl").open("a") as f:
            f.write('{"step": 3}\n')
    assert read(f"{url}/metrics.jsonl").splitlines()[-1] == '{"step": 3}'


def test_a_pulled_file_goes_up_again_only_once_changed(gcs):
    """Another process of the run pulls the log too: its unchanged copy must never overwrite
    what process 0 appended since."""
    url = f"gs://{gcs}/two-processes"
    storage.path(url).mkdir(parents=True, exist_ok=True)
    storage.path(f"{url}/metrics.jsonl").write_text("1\n")
    with storage.mirrored(url, every_s=3600) as other:
        storage.path(f"{url}/metrics.jsonl").write_text("1\n2\n")  # process 0, meanwhile
        (other / "rollouts").mkdir()
        (other / "rollouts" / "step_1.process_1.jsonl").write_text("{}\n")
    assert read(f"{url}/metrics.jsonl") == "1\n2\n"
    assert read(f"{url}/rollouts/step_1.process_1.jsonl") == "{}\n"


def test_a_failing_run_still_leaves_its_files_in_the_bucket(gcs):
    url = f"gs://{gcs}/failed-run"
    with pytest.raises(RuntimeError, match="step 2 failed"):
        with storage.mirrored(url, every_s=3600) as local:
            (local / "metrics.jsonl").write_text('{"step": 1}\n')
            raise RuntimeError("step 2 failed")
    assert read(f"{url}/metrics.jsonl") == '{"step": 1}\n'
