"""Fixtures shared by the test packages."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.gotools import go_built

MINIO_USER, MINIO_PASSWORD = "phalanx-test", "phalanx-test-secret"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def minio(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A MinIO server on loopback; yields its endpoint URL. boto3 finds it through the standard variables,
    as a Pod would (set for the session's tests, and inherited by the processes they start)."""
    binary = go_built("minio-binary", cached="minio-*/minio", unchecked="S3 checkpoint storage unchecked")
    data = tmp_path_factory.mktemp("minio")
    port = _free_port()
    env = {
        **os.environ,
        "MINIO_ROOT_USER": MINIO_USER,
        "MINIO_ROOT_PASSWORD": MINIO_PASSWORD,
        "MINIO_BROWSER": "off",
    }
    with (data.parent / "minio.log").open("wb") as log:
        proc = subprocess.Popen(
            [binary, "server", str(data), "--address", f"127.0.0.1:{port}", "--quiet"],
            env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    endpoint = f"http://127.0.0.1:{port}"
    saved = {k: os.environ.get(k) for k in _AWS}
    os.environ.update(
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID=MINIO_USER,
        AWS_SECRET_ACCESS_KEY=MINIO_PASSWORD,
        AWS_REGION="us-east-1",
    )
    try:
        deadline = time.monotonic() + 60
        while not _live(endpoint):
            assert proc.poll() is None, (data.parent / "minio.log").read_text()
            assert time.monotonic() < deadline, "MinIO did not start"
            time.sleep(0.2)
        yield endpoint
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        proc.terminate()
        proc.wait(20)


_AWS = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION")


def _live(endpoint: str) -> bool:
    try:
        return httpx.get(f"{endpoint}/minio/health/live", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
