"""Real Redis deployments for the tests, started once per session on free loopback ports
(no persistence) and killed at the end (`servers.py`). Set `KVFLOW_REDIS_URL` to test
against a standalone server you run yourself instead."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import servers


def _needs_server() -> None:
    if servers.binary() is None:
        pytest.skip("redis-server is not installed (Debian: apt-get install -y redis-server)")


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a running, empty redis-server (`redis://127.0.0.1:PORT/0`)."""
    if url := os.environ.get("KVFLOW_REDIS_URL"):
        yield url
        return
    _needs_server()
    with servers.standalone(tmp_path_factory.mktemp("redis")) as d:
        yield d.url


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[servers.Deployment]:
    """A Redis Cluster of 3 masters with one replica each (`url` names two of them)."""
    _needs_server()
    with servers.cluster(tmp_path_factory.mktemp("cluster")) as d:
        yield d


@pytest.fixture(scope="session")
def redis_sentinel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[servers.Deployment]:
    """A primary (`servers[0]`), its replica and three sentinels (`url` names them);
    the primary's name is `kvflow`."""
    _needs_server()
    with servers.sentinel(tmp_path_factory.mktemp("sentinel")) as d:
        yield d


@pytest.fixture(scope="session")
def redis_tls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """URL (`rediss://`) of a TLS-only server, and its CA certificate."""
    _needs_server()
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed (it makes the test certificates)")
    work = tmp_path_factory.mktemp("tls")
    with servers.tls(work) as d:
        yield d.url, work / "certs" / "ca.crt"
