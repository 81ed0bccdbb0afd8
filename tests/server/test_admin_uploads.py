"""Every kind of bad adapter upload through the admin API is refused with a 4xx naming the
problem, and leaves the registry exactly as it was (rows, blobs, temporary files, audit)."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loraplex.registry import RegistryConfig
from tests.registry.registry_support import registry_state, write_adapter
from tests.registry.test_adapter_uploads import BAD_ADAPTERS
from tests.server.server_support import Server, serve, upload_files

MAX_UPLOAD_BYTES = 256 << 10


@pytest.fixture(scope="module")
def upload_server(tmp_path_factory: pytest.TempPathFactory, engine) -> Iterator[Server]:
    """One server for the module (each case compares the registry before and after), with a
    small upload cap; acme already has an adapter `existing`."""
    root = tmp_path_factory.mktemp("uploads")
    with serve(RegistryConfig(data_dir=root / "data"), engine, max_upload_bytes=MAX_UPLOAD_BYTES) as server:
        server.registry.adapters.upload_dir("acme", "existing", write_adapter(root / "existing"))
        yield server


def _post(server: Server, **kwargs) -> httpx.Response:
    with server.http() as http:
        return http.post("/admin/api/adapters", **kwargs)


# The registry's own cases (tests/registry): the message the API returns names the problem.
API_MESSAGES = {"only a pickle .bin": "pickle file", "no config": "lacks adapter_config"}


@pytest.mark.parametrize("case", list(BAD_ADAPTERS))
def test_bad_adapters(upload_server: Server, tmp_path: Path, case: str) -> None:
    build, match = BAD_ADAPTERS[case]
    folder = build(tmp_path / "bad")
    before = registry_state(upload_server.registry)
    response = _post(upload_server, data={"tenant": "acme", "name": "candidate"}, files=upload_files(folder))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert API_MESSAGES.get(case, match) in error["message"], error
    assert error["type"] == "invalid_request_error"
    assert registry_state(upload_server.registry) == before
    _reveals_no_server_path(upload_server, error["message"])


def _reveals_no_server_path(server: Server, message: str) -> None:
    """Nothing of the server's file system: no path, no temporary file (named by host and
    process id)."""
    blobs = server.registry.blobs
    for secret in (str(blobs.root), str(blobs.root.resolve()), socket.gethostname(), f".{os.getpid()}.",
                   ".tmp", "/tmp/"):
        assert secret not in message, (secret, message)


def _good(tmp_path: Path) -> dict[str, tuple[str, bytes]]:
    return upload_files(write_adapter(tmp_path / "good"))


FORM_PROBLEMS = {
    "bad adapter name": (lambda f: {"data": {"tenant": "acme", "name": "../up"}, "files": f},
                         400, "invalid adapter name"),
    "tenant name with NUL": (lambda f: {"data": {"tenant": "ac\x00me", "name": "x"}, "files": f},
                             400, "invalid tenant name"),
    "unknown tenant": (lambda f: {"data": {"tenant": "nobody", "name": "x"}, "files": f},
                       404, "tenant 'nobody' does not exist"),
    "name taken": (lambda f: {"data": {"tenant": "acme", "name": "existing"}, "files": f},
                   409, "already has an adapter named 'existing'"),
    "no weights": (lambda f: {"data": {"tenant": "acme", "name": "x"},
                              "files": {"adapter_config": f["adapter_config"]}}, 400, "lacks adapter_model"),
    "no tenant": (lambda f: {"data": {"name": "x"}, "files": f}, 400, "lacks tenant"),
    "unknown field": (lambda f: {"data": {"tenant": "acme", "name": "x", "path": "/etc"}, "files": f},
                      400, "unexpected form field 'path'"),
    "field twice": (lambda f: {"data": {"tenant": "acme", "name": "x"},
                               "files": [("adapter_config", f["adapter_config"])] * 2 +
                               [("adapter_model", f["adapter_model"])]}, 400, "given twice"),
    "config too large": (lambda f: {"data": {"tenant": "acme", "name": "x"},
                                    "files": f | {"adapter_config": ("c.json", b" " * (65 << 10))}},
                         400, "larger than 65536 bytes"),
    "JSON instead of a form": (lambda f: {"json": {"tenant": "acme"}}, 400, "multipart/form-data"),
    "malformed multipart": (lambda f: {"content": b"--zzz\r\nnot a part", "headers": {
        "content-type": "multipart/form-data; boundary=zzz"}}, 400, "multipart body is malformed"),
    "body ends inside a part": (lambda f: {"content": b'--zzz\r\nContent-Disposition: form-data; '
                                           b'name="tenant"\r\n\r\nacme', "headers": {
        "content-type": "multipart/form-data; boundary=zzz"}}, 400, "ended inside a part"),
    "body over the cap": (lambda f: {"data": {"tenant": "acme", "name": "x"}, "files": f | {
        "adapter_model": ("adapter_model.safetensors", b"\0" * MAX_UPLOAD_BYTES)}}, 413, "larger than"),
    "chunked body over the cap": (lambda f: {"content": iter([
        b'--zzz\r\nContent-Disposition: form-data; name="adapter_model"\r\n\r\n', *[b"x" * 65536] * 8]),
        "headers": {"content-type": "multipart/form-data; boundary=zzz"}}, 413, "larger than"),
}


@pytest.mark.parametrize("case", list(FORM_PROBLEMS))
def test_bad_upload_forms(upload_server: Server, tmp_path: Path, case: str) -> None:
    make, status, message = FORM_PROBLEMS[case]
    before = registry_state(upload_server.registry)
    response = _post(upload_server, **make(_good(tmp_path)))
    assert response.status_code == status, response.text
    assert message in response.json()["error"]["message"], response.json()
    _reveals_no_server_path(upload_server, response.json()["error"]["message"])
    assert "x-request-id" in response.headers
    assert registry_state(upload_server.registry) == before


def test_tenant_keys_cannot_upload(upload_server: Server, tmp_path: Path) -> None:
    before = registry_state(upload_server.registry)
    with upload_server.http(upload_server.keys["acme"]) as http:
        response = http.post("/admin/api/adapters", data={"tenant": "acme", "name": "x"},
                             files=_good(tmp_path))
    assert response.status_code == 403
    assert httpx.post(f"{upload_server.url}/admin/api/adapters").status_code == 401
    assert registry_state(upload_server.registry) == before


def test_a_client_that_leaves_mid_upload_leaves_nothing(upload_server: Server, tmp_path: Path) -> None:
    """The weights stream into the registry's temporary file as they arrive; when the client
    goes, that file is removed and no row is written."""
    before = registry_state(upload_server.registry)
    boundary = "b0undary"
    files = _good(tmp_path)
    head = "".join(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'
                   for name, value in (("tenant", "acme"), ("name", "partial"))).encode()
    head += (f'--{boundary}\r\nContent-Disposition: form-data; name="adapter_config"; filename="c.json"'
             f'\r\n\r\n').encode() + files["adapter_config"][1] + b"\r\n"
    head += (f'--{boundary}\r\nContent-Disposition: form-data; name="adapter_model"; '
             f'filename="adapter_model.safetensors"\r\n\r\n').encode()
    weights = files["adapter_model"][1]
    request = (f"POST /admin/api/adapters HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
               f"{upload_server.admin_key}\r\nContent-Type: multipart/form-data; boundary={boundary}\r\n"
               f"Content-Length: {len(head) + len(weights) + 100}\r\n\r\n").encode() + head
    temp_dir = upload_server.registry.blobs.temp_dir
    host, port = upload_server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(request + weights[: len(weights) // 2])
        deadline = time.monotonic() + 10
        while not any(temp_dir.iterdir()):  # the upload is being staged
            assert time.monotonic() < deadline, "the upload never reached the registry"
            time.sleep(0.01)
    deadline = time.monotonic() + 10
    while registry_state(upload_server.registry) != before:
        assert time.monotonic() < deadline, registry_state(upload_server.registry)
        time.sleep(0.02)
