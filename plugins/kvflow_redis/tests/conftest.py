"""A real `redis-server` for the tests: started once per session on a free loopback port
(no persistence), killed at the end. Set `KVFLOW_REDIS_URL` to test against a server you
run yourself instead."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

START_TIMEOUT_S = 20.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a running, empty redis-server (`redis://127.0.0.1:PORT/0`)."""
    if url := os.environ.get("KVFLOW_REDIS_URL"):
        yield url
        return
    binary = shutil.which("redis-server") or shutil.which("valkey-server")
    if binary is None:
        pytest.skip("redis-server is not installed (Debian: apt-get install -y redis-server)")
    work: Path = tmp_path_factory.mktemp("redis")
    port = _free_port()
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(work)]
    args += ["--save", "", "--appendonly", "no"]  # no persistence
    args += ["--maxmemory", "1gb", "--maxmemory-policy", "allkeys-lru"]
    log = open(work / "redis.log", "wb")  # noqa: SIM115 - closed at teardown
    proc = subprocess.Popen(
        args,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _ping(port):
            if proc.poll() is not None:
                raise RuntimeError(
                    f"redis-server exited with {proc.returncode}: "
                    + (work / "redis.log").read_text(errors="replace")[-2000:]
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not answer PING within {START_TIMEOUT_S} s")
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait(timeout=10)
        log.close()
