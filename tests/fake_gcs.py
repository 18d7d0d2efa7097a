"""A Google Cloud Storage server on localhost for tests: gcp-storage-emulator (the GCS JSON API,
objects kept in memory), with the two clients a run uses pointed at it: gcsfs (etils.epath's
gs:// paths: JSON files, the HF export) through STORAGE_EMULATOR_HOST, and TensorStore (orbax's
arrays) through TENSORSTORE_GCS_HTTP_URL.

Two things GCS does that the emulator does not, and TensorStore relies on, are added here: a
download carries the object's generation (`x-goog-generation`), and an upload with
`ifGenerationMatch` fails with 412 unless the object's generation is that one ("0": it must not
exist). Nothing is kinder than GCS on the points the checkpoints rely on: no rename, objects
under a prefix rather than directories."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from http import HTTPStatus
from typing import Iterator


def _with_generation(download):
    def handler(request, response, storage, *args, **kwargs):
        download(request, response, storage, *args, **kwargs)
        if response.status in (HTTPStatus.OK, HTTPStatus.PARTIAL_CONTENT):
            obj = storage.get_file_obj(request.params["bucket_name"],
                                       request.params["object_id"])
            response["x-goog-generation"] = obj["generation"]
            response["x-goog-metageneration"] = obj["metageneration"]
    return handler


def _with_preconditions(insert):
    def handler(request, response, storage, *args, **kwargs):
        from gcp_storage_emulator.exceptions import NotFound

        want = request.query.get("ifGenerationMatch")
        if want:
            name = request.query.get("name", [None])[0]
            if name is None and isinstance(request.data, dict):
                name = request.data.get("meta", {}).get("name")
            try:
                have = storage.get_file_obj(request.params["bucket_name"], name)["generation"]
            except NotFound:
                have = "0"
            if want[0] != have:
                response.status = HTTPStatus.PRECONDITION_FAILED
                return
        return insert(request, response, storage, *args, **kwargs)
    return handler


def _patch_emulator() -> None:
    """Once: the emulator's download and upload handlers, wherever the server looks them up."""
    from gcp_storage_emulator import server
    from gcp_storage_emulator.handlers import objects

    if getattr(objects, "_geo3k_patched", False):
        return
    new = {objects.download: _with_generation(objects.download),
           objects.insert: _with_preconditions(objects.insert)}
    objects.download = new[objects.download]  # objects.get (alt=media) calls it by name
    for _, methods in server.HANDLERS:
        for method, fn in methods.items():
            methods[method] = new.get(fn, fn)
    objects._geo3k_patched = True


@contextlib.contextmanager
def fake_gcs(bucket: str = "geo3k") -> Iterator[str]:
    """Serve GCS on a free local port while the context lasts; yields the bucket's name."""
    from gcp_storage_emulator.server import create_server
    from gcsfs import GCSFileSystem

    _patch_emulator()
    logging.getLogger("gcp_storage_emulator").setLevel(logging.ERROR)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    saved = {k: os.environ.get(k) for k in ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL")}
    os.environ.update(STORAGE_EMULATOR_HOST=url, TENSORSTORE_GCS_HTTP_URL=url)
    server = create_server("127.0.0.1", port, in_memory=True, default_bucket=bucket)
    server.start()
    GCSFileSystem.clear_instance_cache()  # fsspec keeps clients, each with its endpoint
    try:
        yield bucket
    finally:
        server.stop()
        GCSFileSystem.clear_instance_cache()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
